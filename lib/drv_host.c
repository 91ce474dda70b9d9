/*
 * Host backend: the CUDA VMM semantics on host memory, so the library can be tested without a GPU.
 *
 * "Device pointers" are ordinary host addresses. A reservation is a PROT_NONE anonymous mapping; a physical
 * chunk is a memfd whose pages are committed at creation, so the memory the library holds is real memory the
 * kernel accounts to the process (Shmem/RssShmem) and tests can watch it come and go. Mapping a chunk puts the
 * memfd over part of a reservation; unmapping puts a new reservation back.
 *
 * The backend tracks its reservations and mappings and refuses what the driver refuses (mapping over a mapping,
 * unmapping part of one, granting access to unmapped space, freeing a reservation that is still mapped). Without
 * that, MAP_FIXED and mprotect would quietly do something, and a library bug that fails on a GPU would pass here
 * -- or overwrite unrelated process memory.
 *
 * Work is synchronous, so events complete when recorded, except while the test gate is closed (drv_test.h).
 *
 * Several devices (cfg->host_devices, CUVMM_HOST_DEVICES): each has its own chunks, gate (its events and
 * synchronisations) and captures; they share the process's address space, as CUDA devices share one
 * unified address space. Each mapping records which devices were granted access to it, and every device can
 * access every other's memory unless a test says otherwise (cvm_host_access, cvm_host_peer_deny: drv_test.h).
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <search.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "drv.h"
#include "drv_test.h"
#include "log.h"

#define HOST_DEFAULT_GRANULARITY ((size_t)2 << 20)
#define HOST_MAX_DEVICES 64
/* Set in a live chunk, cleared at release: turns some double releases into an error instead of a crash. */
#define HOST_CHUNK_MAGIC 0x63766d63686e6bULL

struct host_chunk {
	uint64_t magic;
	int fd;
	int dev;
	size_t size;
};

struct host_event {
	int dev;          /* recorded for this device: its gate completes it */
	uint64_t seq;     /* 0: complete; otherwise complete once the device gate's completed_seq reaches it */
	uint64_t capture; /* recorded into this capture (a graph node, not work): never queryable, as in CUDA */
};

/* An address range, as the key and element of the tsearch trees below. */
struct host_span {
	uintptr_t va;
	size_t size;
	uint64_t access; /* mappings: the devices granted access (bit i: device i) */
};

struct host_state {
	struct host_state *next; /* in `states`, for cvm_host_access */
	size_t page;
	size_t granularity;
	size_t total_bytes; /* of each device */
	int ndev;
	/* Serialises the trees with the mmap calls that change what they describe, so a check and its effect
	 * cannot be separated by another thread's map or unmap. */
	pthread_mutex_t lock;
	void *reservations; /* struct host_span *, disjoint */
	void *mappings;     /* struct host_span *, disjoint, each inside a reservation */
	size_t live_chunks;
	size_t dev_chunks[HOST_MAX_DEVICES];
};

/* The open host contexts, for cvm_host_access (a test asks without a handle on the backend state). */
static pthread_mutex_t states_lock = PTHREAD_MUTEX_INITIALIZER;
static struct host_state *states;

/* Pairs of devices without peer access (cvm_host_peer_deny): bit `peer` of no_peer[dev]. */
static _Atomic uint64_t no_peer[HOST_MAX_DEVICES];

/* A function run at the start of every call of one kind (cvm_host_call_hook), for tests of what holds which
 * lock, and what others can do, while memory is unmapped or released. */
static void (*_Atomic call_hook)(void *);
static void *_Atomic call_hook_arg;
static _Atomic int call_hook_call = -1;

void cvm_host_call_hook(enum cuvmm_call call, void (*fn)(void *arg), void *arg)
{
	atomic_store(&call_hook, NULL);
	atomic_store(&call_hook_arg, arg);
	atomic_store(&call_hook_call, (int)call);
	atomic_store(&call_hook, fn);
}

static void run_hook(enum cuvmm_call call)
{
	void (*hook)(void *) = atomic_load(&call_hook);

	if (hook && atomic_load(&call_hook_call) == (int)call)
		hook(atomic_load(&call_hook_arg));
}

static bool bad_dev(const void *state, int dev)
{
	return dev < 0 || dev >= ((const struct host_state *)state)->ndev;
}

static bool peer_denied(int dev, int peer)
{
	return dev != peer && (atomic_load(&no_peer[dev]) >> peer & 1);
}

void cvm_host_peer_deny(int dev, int peer, bool deny)
{
	if (dev < 0 || dev >= HOST_MAX_DEVICES || peer < 0 || peer >= HOST_MAX_DEVICES)
		return;
	if (deny)
		atomic_fetch_or(&no_peer[dev], (uint64_t)1 << peer);
	else
		atomic_fetch_and(&no_peer[dev], ~((uint64_t)1 << peer));
}

/*
 * The gate is process-wide on purpose: a test closes it without a handle on the context's backend state, and
 * GPU work that is still running is not a property of one context either.
 */
static struct {
	pthread_mutex_t lock;
	pthread_cond_t done;
	struct {
		bool closed;
		uint64_t pending_seq;   /* last sequence number handed to an event recorded while closed */
		uint64_t completed_seq; /* every event with seq <= this is complete */
		unsigned waiters;       /* threads waiting for this gate */
	} d[HOST_MAX_DEVICES];
} gate = {
	.lock = PTHREAD_MUTEX_INITIALIZER,
	.done = PTHREAD_COND_INITIALIZER,
};

static void gate_set(int dev, bool closed)
{
	if (dev < 0 || dev >= HOST_MAX_DEVICES)
		return;
	gate.d[dev].closed = closed;
	if (!closed)
		gate.d[dev].completed_seq = gate.d[dev].pending_seq;
}

void cvm_host_gate_close(void)
{
	pthread_mutex_lock(&gate.lock);
	for (int i = 0; i < HOST_MAX_DEVICES; i++)
		gate_set(i, true);
	pthread_mutex_unlock(&gate.lock);
}

void cvm_host_gate_open(void)
{
	pthread_mutex_lock(&gate.lock);
	for (int i = 0; i < HOST_MAX_DEVICES; i++)
		gate_set(i, false);
	pthread_cond_broadcast(&gate.done);
	pthread_mutex_unlock(&gate.lock);
}

void cvm_host_gate_close_dev(int dev)
{
	pthread_mutex_lock(&gate.lock);
	gate_set(dev, true);
	pthread_mutex_unlock(&gate.lock);
}

void cvm_host_gate_open_dev(int dev)
{
	pthread_mutex_lock(&gate.lock);
	gate_set(dev, false);
	pthread_cond_broadcast(&gate.done);
	pthread_mutex_unlock(&gate.lock);
}

unsigned cvm_host_gate_waiters(int dev)
{
	unsigned n;

	if (dev < 0 || dev >= HOST_MAX_DEVICES)
		return 0;
	pthread_mutex_lock(&gate.lock);
	n = gate.d[dev].waiters;
	pthread_mutex_unlock(&gate.lock);
	return n;
}

/*
 * Stream capture, process-wide like the gate (streams are). CUDA's rules that the library must never break
 * are modelled so that a test sees it break them: synchronising the device or a capturing stream, copying
 * on a capturing stream, or querying or waiting for an event recorded in a capture invalidates the capture
 * and fails with the error CUDA gives.
 */
#define HOST_MAX_CAPTURES 16
static struct {
	pthread_mutex_t lock;
	uint64_t next_id;
	struct {
		CUstream stream; /* NULL: slot free */
		uint64_t id;
		int dev;         /* the stream's device; -1: any (cvm_host_capture_begin) */
		bool invalidated;
	} c[HOST_MAX_CAPTURES];
	unsigned active;
} cap = {
	.lock = PTHREAD_MUTEX_INITIALIZER,
};

uint64_t cvm_host_capture_begin(CUstream stream)
{
	return cvm_host_capture_begin_dev(stream, -1);
}

uint64_t cvm_host_capture_begin_dev(CUstream stream, int dev)
{
	uint64_t id = 0;

	pthread_mutex_lock(&cap.lock);
	for (int i = 0; i < HOST_MAX_CAPTURES && stream; i++) {
		if (cap.c[i].stream == stream)
			break; /* capturing already */
		if (!cap.c[i].stream) {
			cap.c[i].stream = stream;
			cap.c[i].id = id = ++cap.next_id;
			cap.c[i].dev = dev;
			cap.c[i].invalidated = false;
			cap.active++;
			break;
		}
	}
	pthread_mutex_unlock(&cap.lock);
	return id;
}

bool cvm_host_capture_end(CUstream stream)
{
	bool ok = false;

	pthread_mutex_lock(&cap.lock);
	for (int i = 0; i < HOST_MAX_CAPTURES; i++) {
		if (stream && cap.c[i].stream == stream) {
			ok = !cap.c[i].invalidated;
			cap.c[i].stream = NULL;
			cap.active--;
			break;
		}
	}
	pthread_mutex_unlock(&cap.lock);
	return ok;
}

/* The id of the capture under way on `stream`, 0 if none. */
static uint64_t capture_of(CUstream stream)
{
	uint64_t id = 0;

	pthread_mutex_lock(&cap.lock);
	for (int i = 0; cap.active && i < HOST_MAX_CAPTURES; i++)
		if (stream && cap.c[i].stream == stream)
			id = cap.c[i].id;
	pthread_mutex_unlock(&cap.lock);
	return id;
}

static bool capture_on(int i, int dev)
{
	return cap.c[i].stream && (dev < 0 || cap.c[i].dev < 0 || cap.c[i].dev == dev);
}

/* Break the capture `id` (0: every capture under way on device `dev`, -1: on any) and return the error CUDA
 * would have given. */
static int capture_break_dev(uint64_t id, int dev, int cu)
{
	pthread_mutex_lock(&cap.lock);
	for (int i = 0; i < HOST_MAX_CAPTURES; i++)
		if (capture_on(i, dev) && (!id || cap.c[i].id == id))
			cap.c[i].invalidated = true;
	pthread_mutex_unlock(&cap.lock);
	cvm_warn("host backend: a stream capture was invalidated (CUresult %d)", cu);
	return cu;
}

static int capture_break(uint64_t id, int cu)
{
	return capture_break_dev(id, -1, cu);
}

/* Is a capture under way on a stream of device `dev`? */
static bool capture_any(int dev)
{
	bool any = false;

	pthread_mutex_lock(&cap.lock);
	for (int i = 0; cap.active && i < HOST_MAX_CAPTURES; i++)
		any |= capture_on(i, dev);
	pthread_mutex_unlock(&cap.lock);
	return any;
}

/* Errors of the resource kind map to out-of-memory so the library reacts as on a full GPU: it gives cached
 * chunks back (which also closes their fds and drops their VMAs) and retries or reports ENOMEM. */
static int cu_from_errno(int e)
{
	switch (e) {
	case ENOMEM:
	case ENOSPC:
	case EMFILE:
	case ENFILE:
		return CUDA_ERROR_OUT_OF_MEMORY;
	case EINVAL:
	case EFBIG:
	case EOVERFLOW:
		return CUDA_ERROR_INVALID_VALUE;
	default:
		return CUDA_ERROR_UNKNOWN;
	}
}

static int fail_errno(const char *what, int e)
{
	int cu = cu_from_errno(e);

	cvm_debug("host: %s failed: %s (CUresult %d)", what, strerror(e), cu);
	return cu;
}

/* Overlapping spans compare equal, so tfind with a span finds any stored span that overlaps it. Stored spans
 * are disjoint, which keeps the order total among them. */
static int span_cmp(const void *a, const void *b)
{
	const struct host_span *x = a, *y = b;

	if (x->va + x->size <= y->va)
		return -1;
	if (x->va >= y->va + y->size)
		return 1;
	return 0;
}

static struct host_span *span_find(void *const *root, uintptr_t va, size_t size)
{
	struct host_span key = { va, size, 0 };
	void *node = tfind(&key, root, span_cmp);

	return node ? *(struct host_span **)node : NULL;
}

static int span_add(void **root, uintptr_t va, size_t size)
{
	struct host_span *s = malloc(sizeof(*s));
	void *node;

	if (!s)
		return CUDA_ERROR_OUT_OF_MEMORY;
	s->va = va;
	s->size = size;
	s->access = 0;
	node = tsearch(s, root, span_cmp);
	if (!node || *(struct host_span **)node != s) {
		free(s);
		return node ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_OUT_OF_MEMORY;
	}
	return CUDA_SUCCESS;
}

static void span_remove(void **root, struct host_span *s)
{
	tdelete(s, root, span_cmp);
	free(s);
}

/* True when every byte of [va, va+size) lies in some mapping; with whole, the range must also start and end on
 * mapping boundaries (cuMemUnmap cannot unmap part of a mapping). */
static bool covered(const struct host_state *st, uintptr_t va, size_t size, bool whole)
{
	uintptr_t end = va + size;
	uintptr_t at = va;

	while (at < end) {
		struct host_span *m = span_find(&st->mappings, at, 1);

		if (!m || (whole && (m->va != at || m->va + m->size > end)))
			return false;
		at = m->va + m->size;
	}
	return true;
}

static bool range_ok(uintptr_t va, size_t size)
{
	return size != 0 && va != 0 && va + size > va;
}

static size_t phys_bytes(size_t page)
{
	long pages = sysconf(_SC_PHYS_PAGES);

	return pages > 0 ? (size_t)pages * page : 0;
}

static int host_open(const struct cuvmm_config *cfg, void **state)
{
	long page = sysconf(_SC_PAGESIZE);
	size_t gran = cfg && cfg->host_granularity ? cfg->host_granularity : HOST_DEFAULT_GRANULARITY;
	int ndev = cfg && cfg->host_devices ? cfg->host_devices : 1;
	struct host_state *st;

	if (page <= 0 || gran < (size_t)page || (gran & (gran - 1))) {
		cvm_err("host backend: granularity %zu is not a power of two >= the page size (%ld)", gran, page);
		return CUVMM_EINVAL;
	}
	if (ndev < 1 || ndev > HOST_MAX_DEVICES) {
		cvm_err("host backend: %d devices asked for; 1 to %d can be emulated", ndev, HOST_MAX_DEVICES);
		return CUVMM_EINVAL;
	}
	st = calloc(1, sizeof(*st));
	if (!st)
		return CUVMM_ENOMEM;
	if (pthread_mutex_init(&st->lock, NULL)) {
		free(st);
		return CUVMM_ENOMEM;
	}
	st->page = (size_t)page;
	st->granularity = gran;
	st->ndev = ndev;
	st->total_bytes = cfg && cfg->device_limit_bytes ? cfg->device_limit_bytes : phys_bytes(st->page);
	cvm_info("host backend: %d device(s), granularity %zu, %zu bytes", ndev, st->granularity, st->total_bytes);
	pthread_mutex_lock(&states_lock);
	st->next = states;
	states = st;
	pthread_mutex_unlock(&states_lock);
	*state = st;
	return CUVMM_OK;
}

static void host_close(void *state)
{
	struct host_state *st = state;

	if (!st)
		return;
	pthread_mutex_lock(&states_lock);
	for (struct host_state **pp = &states; *pp; pp = &(*pp)->next) {
		if (*pp == st) {
			*pp = st->next;
			break;
		}
	}
	pthread_mutex_unlock(&states_lock);
	/* Leftovers are a library bug; their memory is left alone because the application may still touch it. */
	if (st->reservations || st->mappings || st->live_chunks)
		cvm_warn("host backend: closed with %s%s%zu chunks still held",
			 st->reservations ? "reservations, " : "", st->mappings ? "mappings, " : "", st->live_chunks);
	tdestroy(st->mappings, free);
	tdestroy(st->reservations, free);
	pthread_mutex_destroy(&st->lock);
	free(st);
}

static int host_device_count(void *state, int *count)
{
	*count = ((struct host_state *)state)->ndev;
	return CUDA_SUCCESS;
}

static int host_device_open(void *state, int dev, struct cvm_devinfo *info)
{
	struct host_state *st = state;

	if (bad_dev(st, dev))
		return CUDA_ERROR_INVALID_DEVICE;
	info->granularity = st->granularity;
	info->total_bytes = st->total_bytes;
	if (st->ndev > 1)
		snprintf(info->name, sizeof(info->name), "host %d", dev);
	else
		snprintf(info->name, sizeof(info->name), "host");
	return CUDA_SUCCESS;
}

static void host_device_close(void *state, int dev)
{
	(void)state;
	(void)dev;
}

static int host_reserve(void *state, int dev, size_t size, uintptr_t *va)
{
	struct host_state *st = state;
	size_t gran = st->granularity;
	uintptr_t base, aligned;
	void *p;
	int cu;

	if (bad_dev(state, dev))
		return CUDA_ERROR_INVALID_DEVICE;
	if (size == 0 || size % gran)
		return CUDA_ERROR_INVALID_VALUE;
	if (size > SIZE_MAX - gran)
		return CUDA_ERROR_OUT_OF_MEMORY;
	/* mmap aligns only to pages: over-reserve by one granule and trim, so chunks can sit on granule boundaries
	 * as on the GPU (and the kernel may back them with huge pages). */
	p = mmap(NULL, size + gran, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
	if (p == MAP_FAILED)
		return fail_errno("reserve mmap", errno);
	base = (uintptr_t)p;
	aligned = (base + gran - 1) & ~(uintptr_t)(gran - 1);
	if (aligned > base)
		munmap(p, aligned - base);
	if (base + size + gran > aligned + size)
		munmap((void *)(aligned + size), base + size + gran - (aligned + size));

	pthread_mutex_lock(&st->lock);
	cu = span_add(&st->reservations, aligned, size);
	pthread_mutex_unlock(&st->lock);
	if (cu) {
		munmap((void *)aligned, size);
		return cu;
	}
	*va = aligned;
	return CUDA_SUCCESS;
}

static int host_unreserve(void *state, int dev, uintptr_t va, size_t size)
{
	struct host_state *st = state;
	struct host_span *r;
	int cu = CUDA_SUCCESS;

	if (bad_dev(state, dev))
		return CUDA_ERROR_INVALID_DEVICE;
	if (!range_ok(va, size))
		return CUDA_ERROR_INVALID_VALUE;
	pthread_mutex_lock(&st->lock);
	r = span_find(&st->reservations, va, 1);
	if (!r || r->va != va || r->size != size || span_find(&st->mappings, va, size)) {
		cu = CUDA_ERROR_INVALID_VALUE;
	} else if (munmap((void *)va, size)) {
		cu = fail_errno("unreserve munmap", errno);
	} else {
		span_remove(&st->reservations, r);
	}
	pthread_mutex_unlock(&st->lock);
	return cu;
}

static int host_create(void *state, int dev, size_t size, cvm_handle *h)
{
	struct host_state *st = state;
	struct host_chunk *c;
	int fd, r, e;

	if (bad_dev(state, dev))
		return CUDA_ERROR_INVALID_DEVICE;
	if (size == 0 || size % st->granularity || size > (size_t)INT64_MAX)
		return CUDA_ERROR_INVALID_VALUE;
	c = malloc(sizeof(*c));
	if (!c)
		return CUDA_ERROR_OUT_OF_MEMORY;
	/* Tests find the library's chunks in /proc/self/fd by this name. */
	fd = memfd_create("cuvmm", MFD_CLOEXEC);
	if (fd < 0) {
		e = errno;
		free(c);
		return fail_errno("create memfd_create", e);
	}
	if (ftruncate(fd, (off_t)size)) {
		e = errno;
		close(fd);
		free(c);
		return fail_errno("create ftruncate", e);
	}
	/* Commit now, as cuMemCreate does: the allocation fails here rather than as a SIGBUS on first touch.
	 * shmem's fallocate gives up with EINTR when a signal arrives; redoing it is harmless. */
	do
		r = fallocate(fd, 0, 0, (off_t)size);
	while (r && errno == EINTR);
	if (r) {
		e = errno;
		close(fd);
		free(c);
		return fail_errno("create fallocate", e);
	}
	c->magic = HOST_CHUNK_MAGIC;
	c->fd = fd;
	c->dev = dev;
	c->size = size;
	pthread_mutex_lock(&st->lock);
	st->live_chunks++;
	st->dev_chunks[dev]++;
	pthread_mutex_unlock(&st->lock);
	*h = (cvm_handle)(uintptr_t)c;
	return CUDA_SUCCESS;
}

static int host_release(void *state, int dev, cvm_handle h)
{
	struct host_state *st = state;
	struct host_chunk *c = (struct host_chunk *)(uintptr_t)h;

	run_hook(CUVMM_CALL_RELEASE);
	if (bad_dev(state, dev))
		return CUDA_ERROR_INVALID_DEVICE;
	if (!c || c->magic != HOST_CHUNK_MAGIC)
		return CUDA_ERROR_INVALID_VALUE;
	c->magic = 0;
	dev = c->dev;
	/* As with cuMemRelease, pages still mapped stay until unmapped: the mapping holds its own file reference. */
	close(c->fd);
	free(c);
	pthread_mutex_lock(&st->lock);
	st->live_chunks--;
	st->dev_chunks[dev]--;
	pthread_mutex_unlock(&st->lock);
	return CUDA_SUCCESS;
}

/* Put a new reservation over [va, va+size): what cuMemUnmap leaves behind, and what a failed MAP_FIXED may
 * have torn a hole in. Same flags as host_reserve, so the kernel merges it with its neighbours. */
static int rereserve(uintptr_t va, size_t size)
{
	void *p = mmap((void *)va, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);

	return p == MAP_FAILED ? errno : 0;
}

static int host_map(void *state, int dev, uintptr_t va, size_t size, cvm_handle h)
{
	struct host_state *st = state;
	struct host_chunk *c = (struct host_chunk *)(uintptr_t)h;
	struct host_span *r;
	void *p;
	int cu, e;

	if (bad_dev(state, dev))
		return CUDA_ERROR_INVALID_DEVICE;
	/* A handle is mapped whole, as on the H200: partial mappings of a chunk are not something the library does. */
	if (!c || c->magic != HOST_CHUNK_MAGIC || size != c->size || !range_ok(va, size) || va % st->granularity)
		return CUDA_ERROR_INVALID_VALUE;
	pthread_mutex_lock(&st->lock);
	r = span_find(&st->reservations, va, 1);
	if (!r || va + size > r->va + r->size || span_find(&st->mappings, va, size)) {
		pthread_mutex_unlock(&st->lock);
		return CUDA_ERROR_INVALID_VALUE;
	}
	cu = span_add(&st->mappings, va, size);
	if (cu) {
		pthread_mutex_unlock(&st->lock);
		return cu;
	}
	/* PROT_NONE: cuMemMap gives no access until cuMemSetAccess. */
	p = mmap((void *)va, size, PROT_NONE, MAP_SHARED | MAP_FIXED, c->fd, 0);
	if (p == MAP_FAILED) {
		e = errno;
		rereserve(va, size);
		span_remove(&st->mappings, span_find(&st->mappings, va, size));
		pthread_mutex_unlock(&st->lock);
		return fail_errno("map mmap", e);
	}
	pthread_mutex_unlock(&st->lock);
	return CUDA_SUCCESS;
}

static int host_unmap(void *state, int dev, uintptr_t va, size_t size)
{
	struct host_state *st = state;
	struct host_span *m;
	uintptr_t at;
	int e;

	run_hook(CUVMM_CALL_UNMAP);
	if (bad_dev(state, dev))
		return CUDA_ERROR_INVALID_DEVICE;
	if (!range_ok(va, size))
		return CUDA_ERROR_INVALID_VALUE;
	pthread_mutex_lock(&st->lock);
	if (!covered(st, va, size, true)) {
		pthread_mutex_unlock(&st->lock);
		return CUDA_ERROR_INVALID_VALUE;
	}
	e = rereserve(va, size);
	if (e) {
		/* Only the VMA limit (vm.max_map_count) makes this fail; the mappings are then still in place. */
		pthread_mutex_unlock(&st->lock);
		return fail_errno("unmap mmap", e);
	}
	for (at = va; at < va + size;) {
		m = span_find(&st->mappings, at, 1);
		at += m->size;
		span_remove(&st->mappings, m);
	}
	pthread_mutex_unlock(&st->lock);
	return CUDA_SUCCESS;
}

static int host_set_access(void *state, int dev, uintptr_t va, size_t size, uint64_t devs)
{
	struct host_state *st = state;
	int cu = CUDA_SUCCESS;

	if (bad_dev(st, dev))
		return CUDA_ERROR_INVALID_DEVICE;
	if (!range_ok(va, size))
		return CUDA_ERROR_INVALID_VALUE;
	/* Every device named must exist and be able to reach `dev`'s memory, as cuMemSetAccess demands. */
	for (int p = 0; p < HOST_MAX_DEVICES; p++)
		if ((devs >> p & 1) && (p >= st->ndev || peer_denied(p, dev)))
			return CUDA_ERROR_INVALID_DEVICE;
	/* mprotect would happily make a bare reservation writable (as private anonymous memory); the driver
	 * refuses a range that is not fully mapped, so refuse it too. */
	pthread_mutex_lock(&st->lock);
	if (!covered(st, va, size, false))
		cu = CUDA_ERROR_INVALID_VALUE;
	else if (mprotect((void *)va, size, PROT_READ | PROT_WRITE))
		cu = fail_errno("set_access mprotect", errno);
	for (uintptr_t at = va; !cu && at < va + size;) {
		struct host_span *m = span_find(&st->mappings, at, 1);

		m->access |= devs;
		at = m->va + m->size;
	}
	pthread_mutex_unlock(&st->lock);
	return cu;
}

uint64_t cvm_host_access(const void *p)
{
	uint64_t access = 0;

	pthread_mutex_lock(&states_lock);
	for (struct host_state *st = states; st && !access; st = st->next) {
		struct host_span *m;

		pthread_mutex_lock(&st->lock);
		m = span_find(&st->mappings, (uintptr_t)p, 1);
		if (m)
			access = m->access;
		pthread_mutex_unlock(&st->lock);
	}
	pthread_mutex_unlock(&states_lock);
	return access;
}

static int host_can_access_peer(void *state, int dev, int peer, int *can)
{
	if (bad_dev(state, dev) || bad_dev(state, peer))
		return CUDA_ERROR_INVALID_DEVICE;
	*can = !peer_denied(dev, peer);
	return CUDA_SUCCESS;
}

static int host_event_create(void *state, int dev, cvm_event *ev)
{
	struct host_event *e;

	(void)state;
	if (bad_dev(state, dev))
		return CUDA_ERROR_INVALID_DEVICE;
	e = calloc(1, sizeof(*e));
	if (!e)
		return CUDA_ERROR_OUT_OF_MEMORY;
	*ev = e;
	return CUDA_SUCCESS;
}

static int host_event_destroy(void *state, int dev, cvm_event ev)
{
	(void)state;
	(void)dev;
	free(ev);
	return CUDA_SUCCESS;
}

static int host_event_record(void *state, int dev, cvm_event ev, CUstream stream)
{
	struct host_event *e = ev;

	(void)state;
	(void)stream;
	if (bad_dev(state, dev))
		return CUDA_ERROR_INVALID_DEVICE;
	if (!e)
		return CUDA_ERROR_INVALID_VALUE;
	e->dev = dev;
	e->capture = capture_of(stream);
	if (e->capture)
		return CUDA_SUCCESS; /* a node of the graph: nothing runs now */
	pthread_mutex_lock(&gate.lock);
	e->seq = gate.d[dev].closed ? ++gate.d[dev].pending_seq : 0;
	pthread_mutex_unlock(&gate.lock);
	return CUDA_SUCCESS;
}

static int host_event_query(void *state, int dev, cvm_event ev)
{
	struct host_event *e = ev;
	bool done;

	(void)state;
	if (bad_dev(state, dev))
		return CUDA_ERROR_INVALID_DEVICE;
	if (!e)
		return CUDA_ERROR_INVALID_VALUE;
	if (e->capture)
		return capture_break(e->capture, CUDA_ERROR_CAPTURED_EVENT);
	pthread_mutex_lock(&gate.lock);
	done = e->seq <= gate.d[e->dev].completed_seq;
	pthread_mutex_unlock(&gate.lock);
	return done ? CUDA_SUCCESS : CVM_CU_NOT_READY;
}

static int host_event_sync(void *state, int dev, cvm_event ev)
{
	struct host_event *e = ev;

	(void)state;
	if (bad_dev(state, dev))
		return CUDA_ERROR_INVALID_DEVICE;
	if (!e)
		return CUDA_ERROR_INVALID_VALUE;
	if (e->capture)
		return capture_break(e->capture, CUDA_ERROR_CAPTURED_EVENT);
	pthread_mutex_lock(&gate.lock);
	gate.d[e->dev].waiters++;
	while (e->seq > gate.d[e->dev].completed_seq)
		pthread_cond_wait(&gate.done, &gate.lock);
	gate.d[e->dev].waiters--;
	pthread_mutex_unlock(&gate.lock);
	return CUDA_SUCCESS;
}

/* Everything recorded so far, not "the gate is open": work queued after this call is not waited for, and a
 * closed gate with nothing recorded behind it holds nothing up. */
static int sync_all(int dev)
{
	pthread_mutex_lock(&gate.lock);
	gate.d[dev].waiters++;
	while (gate.d[dev].completed_seq != gate.d[dev].pending_seq)
		pthread_cond_wait(&gate.done, &gate.lock);
	gate.d[dev].waiters--;
	pthread_mutex_unlock(&gate.lock);
	return CUDA_SUCCESS;
}

static int host_device_sync(void *state, int dev)
{
	(void)state;
	if (bad_dev(state, dev))
		return CUDA_ERROR_INVALID_DEVICE;
	/* Synchronising a context while any of its streams captures is invalid. */
	if (capture_any(dev))
		return capture_break_dev(0, dev, CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
	return sync_all(dev);
}

static int host_stream_wait(void *state, int dev, CUstream stream, cvm_event ev)
{
	const struct host_event *e = ev;

	(void)state;
	/* A captured event can be waited for only inside its own capture. */
	if (e && e->capture && capture_of(stream) != e->capture)
		return capture_break(e->capture, CUDA_ERROR_STREAM_CAPTURE_ISOLATION);
	/* Host work runs in call order, so it is already behind the event. */
	return bad_dev(state, dev) ? CUDA_ERROR_INVALID_DEVICE : CUDA_SUCCESS;
}

/*
 * Registered host ranges, process-wide as CUDA's are: registering a range that overlaps one is refused
 * (CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED), unregistering what is not the start of one too
 * (CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED), so a library that loses track of a piece fails here; tests read
 * the bytes still registered (cvm_host_registered_bytes) to see that every failure path unregisters.
 */
static struct {
	pthread_mutex_t lock;
	struct host_reg {
		uintptr_t p;
		size_t size;
	} *r;
	size_t n, cap, bytes;
} host_regs = {.lock = PTHREAD_MUTEX_INITIALIZER};

static int host_host_register(void *state, void *p, size_t size)
{
	uintptr_t a = (uintptr_t)p;
	int cu = CUDA_SUCCESS;

	(void)state;
	if (!p || !size)
		return CUDA_ERROR_INVALID_VALUE;
	pthread_mutex_lock(&host_regs.lock);
	for (size_t i = 0; i < host_regs.n && !cu; i++)
		if (a < host_regs.r[i].p + host_regs.r[i].size && host_regs.r[i].p < a + size)
			cu = CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
	if (!cu && host_regs.n == host_regs.cap) {
		size_t cap = host_regs.cap ? 2 * host_regs.cap : 64;
		struct host_reg *r = realloc(host_regs.r, cap * sizeof(*r));

		if (r) {
			host_regs.r = r;
			host_regs.cap = cap;
		} else {
			cu = CUDA_ERROR_OUT_OF_MEMORY;
		}
	}
	if (!cu) {
		host_regs.r[host_regs.n++] = (struct host_reg){a, size};
		host_regs.bytes += size;
	}
	pthread_mutex_unlock(&host_regs.lock);
	return cu;
}

static int host_host_unregister(void *state, void *p)
{
	int cu = CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED;

	(void)state;
	pthread_mutex_lock(&host_regs.lock);
	for (size_t i = 0; i < host_regs.n; i++) {
		if (host_regs.r[i].p != (uintptr_t)p)
			continue;
		host_regs.bytes -= host_regs.r[i].size;
		host_regs.r[i] = host_regs.r[--host_regs.n];
		cu = CUDA_SUCCESS;
		break;
	}
	pthread_mutex_unlock(&host_regs.lock);
	return cu;
}

size_t cvm_host_registered_bytes(void)
{
	size_t b;

	pthread_mutex_lock(&host_regs.lock);
	b = host_regs.bytes;
	pthread_mutex_unlock(&host_regs.lock);
	return b;
}

static int host_copy_dtoh(void *state, int dev, void *dst, uintptr_t src, size_t size, CUstream stream)
{
	(void)state;
	if (capture_of(stream))
		return capture_break(capture_of(stream), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
	if (bad_dev(state, dev))
		return CUDA_ERROR_INVALID_DEVICE;
	if (size && (!dst || !src))
		return CUDA_ERROR_INVALID_VALUE;
	memcpy(dst, (const void *)src, size);
	return CUDA_SUCCESS;
}

static int host_copy_htod(void *state, int dev, uintptr_t dst, const void *src, size_t size, CUstream stream)
{
	(void)state;
	if (capture_of(stream))
		return capture_break(capture_of(stream), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
	if (bad_dev(state, dev))
		return CUDA_ERROR_INVALID_DEVICE;
	if (size && (!dst || !src))
		return CUDA_ERROR_INVALID_VALUE;
	memcpy((void *)dst, src, size);
	return CUDA_SUCCESS;
}

/* There is one queue of work on the host, so a stream's work is all the work. */
static int host_stream_sync(void *state, int dev, CUstream stream)
{
	(void)state;
	if (bad_dev(state, dev))
		return CUDA_ERROR_INVALID_DEVICE;
	if (capture_of(stream))
		return capture_break(capture_of(stream), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
	return sync_all(dev);
}

static int host_capture_id(void *state, int dev, CUstream stream, uint64_t *id)
{
	(void)state;
	if (bad_dev(state, dev))
		return CUDA_ERROR_INVALID_DEVICE;
	*id = capture_of(stream);
	return CUDA_SUCCESS;
}

const struct cvm_backend cvm_backend_host = {
	.name = "host",
	.kind = CUVMM_BACKEND_HOST,
	.open = host_open,
	.close = host_close,
	.device_count = host_device_count,
	.device_open = host_device_open,
	.device_close = host_device_close,
	.reserve = host_reserve,
	.unreserve = host_unreserve,
	.create = host_create,
	.release = host_release,
	.map = host_map,
	.unmap = host_unmap,
	.set_access = host_set_access,
	.event_create = host_event_create,
	.event_destroy = host_event_destroy,
	.event_record = host_event_record,
	.event_query = host_event_query,
	.event_sync = host_event_sync,
	.device_sync = host_device_sync,
	.stream_wait = host_stream_wait,
	.copy_dtoh = host_copy_dtoh,
	.copy_htod = host_copy_htod,
	.stream_sync = host_stream_sync,
	.capture_id = host_capture_id,
	.can_access_peer = host_can_access_peer,
	.host_register = host_host_register,
	.host_unregister = host_host_unregister,
};
