/*
 * PyTorch integration: the entry points PyTorch's CUDAPluggableAllocator calls (malloc and free with its
 * signatures), plus what the Python side (python/cuvmm/torch) needs to keep torch.cuda's memory API true:
 * statistics in PyTorch's terms, record_stream, named pools chosen per thread, empty_cache.
 *
 * One process-wide context, created by cuvmm_torch_init() or on the first allocation; one pool per (name,
 * device), created on first use. The only layer above the allocators: nothing below includes this file.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "ctx.h"
#include "log.h"
#include "pool.h"

#define CVM_TORCH_MAX_NAMES 16
#define CVM_TORCH_MAX_POOLS (CVM_TORCH_MAX_NAMES * CVM_MAX_DEVICES) /* every (name, device) has room */
#define CVM_TORCH_REC_HASH 256

/* Streams that used an allocation besides the one it was allocated on (Tensor.record_stream). */
struct rec {
	struct rec *next;
	void *ptr;
	unsigned n, cap;
	CUstream *streams;
};

/* What PyTorch counts per device; the library's held bytes stand for PyTorch's "reserved". */
struct tdev {
	_Atomic uint64_t cur, peak, total_alloc, total_freed, n_cur, n_peak, n_alloc, n_free, peak_held, ooms;
};

static struct {
	pthread_mutex_t lock;               /* ctx creation, the pool table, the record table */
	struct cuvmm_ctx *_Atomic ctx;
	char names[CVM_TORCH_MAX_NAMES][32]; /* names[0] is "" : the default pool */
	unsigned nnames;
	struct cuvmm_pool_config cfg[CVM_TORCH_MAX_NAMES]; /* per name, from cuvmm_torch_pool_configure();
	                                                      size 0: never configured (the defaults) */
	struct {
		unsigned name;
		int device;
		struct cuvmm_pool *pool;
	} pools[CVM_TORCH_MAX_POOLS];
	_Atomic unsigned npools;
	struct rec *rec[CVM_TORCH_REC_HASH];
	_Atomic size_t nrec;
	struct tdev dev[CVM_MAX_DEVICES];
} T = {
	.lock = PTHREAD_MUTEX_INITIALIZER,
	.nnames = 1,
};

/* The pool this thread's allocations go to (an index into T.names; 0: the default). */
static _Thread_local unsigned tls_name;

static void max_store(_Atomic uint64_t *peak, uint64_t v)
{
	uint64_t cur = atomic_load_explicit(peak, memory_order_relaxed);

	while (cur < v && !atomic_compare_exchange_weak(peak, &cur, v))
		;
}

/* PyTorch's default stream is the legacy stream, passed as 0; the C API's NULL means "all work on the
 * device", which would fence every free with a device synchronisation. */
static CUstream torch_stream(void *stream)
{
	return stream ? (CUstream)stream : CU_STREAM_LEGACY;
}

static int ctx_get(struct cuvmm_ctx **out)
{
	struct cuvmm_ctx *ctx = atomic_load_explicit(&T.ctx, memory_order_acquire);
	int err = CUVMM_OK;

	if (!ctx) {
		pthread_mutex_lock(&T.lock);
		ctx = atomic_load(&T.ctx);
		if (!ctx) {
			err = cuvmm_ctx_create(NULL, &ctx);
			if (!err)
				atomic_store_explicit(&T.ctx, ctx, memory_order_release);
		}
		pthread_mutex_unlock(&T.lock);
	}
	if (!err)
		*out = ctx;
	return err;
}

int cuvmm_torch_init(const struct cuvmm_config *cfg)
{
	struct cuvmm_ctx *ctx;
	int err = CUVMM_OK;

	pthread_mutex_lock(&T.lock);
	if (atomic_load(&T.ctx)) {
		err = CUVMM_ESTATE;
		goto out;
	}
	err = cuvmm_ctx_create(cfg, &ctx);
	if (!err)
		atomic_store_explicit(&T.ctx, ctx, memory_order_release);
out:
	pthread_mutex_unlock(&T.lock);
	return err;
}

struct cuvmm_ctx *cuvmm_torch_ctx(void)
{
	return atomic_load_explicit(&T.ctx, memory_order_acquire);
}

/* The index of a pool name (created on first use). NULL, "" and "torch" (the default pool's own name) are
 * the default pool. Lock held. */
static int name_index(const char *name, unsigned *out)
{
	if (!name || !*name || !strcmp(name, "torch")) {
		*out = 0;
		return CUVMM_OK;
	}
	if (strlen(name) >= sizeof(T.names[0]))
		return CUVMM_EINVAL;
	for (unsigned i = 1; i < T.nnames; i++) {
		if (!strcmp(T.names[i], name)) {
			*out = i;
			return CUVMM_OK;
		}
	}
	if (T.nnames == CVM_TORCH_MAX_NAMES)
		return CUVMM_ENOSPC;
	strcpy(T.names[T.nnames], name);
	*out = T.nnames++;
	return CUVMM_OK;
}

/* The pool of (name, device), created on first use. */
static int pool_get(unsigned name, int device, struct cuvmm_pool **out)
{
	unsigned n = atomic_load_explicit(&T.npools, memory_order_acquire);
	struct cuvmm_pool_config pc;
	struct cuvmm_ctx *ctx;
	int err;

	for (unsigned i = 0; i < n; i++) {
		if (T.pools[i].name == name && T.pools[i].device == device) {
			*out = T.pools[i].pool;
			return CUVMM_OK;
		}
	}
	err = ctx_get(&ctx);
	if (err)
		return err;
	pthread_mutex_lock(&T.lock);
	n = atomic_load(&T.npools);
	for (unsigned i = 0; i < n; i++) {
		if (T.pools[i].name == name && T.pools[i].device == device) {
			*out = T.pools[i].pool;
			goto out;
		}
	}
	if (n == CVM_TORCH_MAX_POOLS) { /* cannot happen: a slot per (name, device) */
		err = CUVMM_ENOSPC;
		goto out;
	}
	if (T.cfg[name].size)
		pc = T.cfg[name];
	else
		cuvmm_pool_config_init(&pc);
	pc.device = device;
	pc.name = name ? T.names[name] : "torch";
	err = cuvmm_pool_create(ctx, &pc, &T.pools[n].pool);
	if (!err) {
		T.pools[n].name = name;
		T.pools[n].device = device;
		*out = T.pools[n].pool;
		atomic_store_explicit(&T.npools, n + 1, memory_order_release);
	}
out:
	pthread_mutex_unlock(&T.lock);
	return err;
}

/* The pool whose address space holds ptr, or NULL. */
static struct cuvmm_pool *pool_of(const void *ptr)
{
	unsigned n = atomic_load_explicit(&T.npools, memory_order_acquire);
	uintptr_t a = (uintptr_t)ptr;

	for (unsigned i = 0; i < n; i++) {
		struct cuvmm_pool *p = T.pools[i].pool;

		if (a >= p->r.base && a < p->r.base + p->r.size)
			return p;
	}
	return NULL;
}

int cuvmm_torch_use_pool(const char *name)
{
	unsigned i;
	int err;

	pthread_mutex_lock(&T.lock);
	err = name_index(name, &i);
	pthread_mutex_unlock(&T.lock);
	if (!err)
		tls_name = i;
	return err;
}

int cuvmm_torch_pool_configure(const char *name, const struct cuvmm_pool_config *cfg)
{
	struct cuvmm_pool_config c;
	unsigned i, n;
	int err;

	if (!cfg)
		return CUVMM_EINVAL;
	err = cvm_pool_config_read(cfg, &c);
	if (err)
		return err;
	pthread_mutex_lock(&T.lock);
	err = name_index(name, &i);
	n = atomic_load(&T.npools);
	for (unsigned k = 0; !err && k < n; k++) {
		if (T.pools[k].name == i)
			err = CUVMM_ESTATE; /* its pools have their config; a later device's would differ */
	}
	if (!err) {
		c.name = NULL; /* pools take the integration's copy of the name */
		T.cfg[i] = c; /* (its size set: cvm_pool_config_read) */
	}
	pthread_mutex_unlock(&T.lock);
	return err;
}

int cuvmm_torch_pool(const char *name, int device, struct cuvmm_pool **out)
{
	struct cuvmm_ctx *ctx;
	unsigned i;
	int err, ndev;

	if (!out || device < 0 || device >= CVM_MAX_DEVICES)
		return CUVMM_EINVAL;
	/* A device the context lacks fails before the name is taken: a failed lookup leaves nothing behind. */
	err = ctx_get(&ctx);
	if (!err)
		err = cuvmm_ctx_device_count(ctx, &ndev);
	if (err)
		return err;
	if (device >= ndev)
		return CUVMM_ENODEV;
	pthread_mutex_lock(&T.lock);
	err = name_index(name, &i);
	pthread_mutex_unlock(&T.lock);
	return err ? err : pool_get(i, device, out);
}

void *cuvmm_torch_malloc(size_t size, int device, void *stream)
{
	struct cuvmm_pool *p;
	struct tdev *td;
	void *ptr = NULL;
	int err;

	if (size == 0 || device < 0 || device >= CVM_MAX_DEVICES)
		return NULL;
	td = &T.dev[device];
	err = pool_get(tls_name, device, &p);
	if (!err) {
		err = cuvmm_malloc_async(p, size, torch_stream(stream), &ptr);
		if (err == CUVMM_ENOMEM) {
			/* What other pools keep for reuse is memory too. */
			cuvmm_ctx_trim(p->r.ctx, device, 0);
			err = cuvmm_malloc_async(p, size, torch_stream(stream), &ptr);
		}
	}
	if (err) {
		atomic_fetch_add(&td->ooms, 1);
		cvm_err("PyTorch allocation of %zu bytes on device %d failed: %s (the tensor gets no memory)", size,
			device, cuvmm_strerror(err));
		return NULL;
	}
	max_store(&td->peak, atomic_fetch_add(&td->cur, size) + size);
	max_store(&td->n_peak, atomic_fetch_add(&td->n_cur, 1) + 1);
	atomic_fetch_add(&td->total_alloc, size);
	atomic_fetch_add(&td->n_alloc, 1);
	/* One atomic load: the statistics call would take the device's account lock on every allocation. */
	max_store(&td->peak_held, atomic_load_explicit(&p->r.dev->acct.held, memory_order_relaxed));
	return ptr;
}

/* Take ptr's record of other streams out of the table (NULL if none). */
static struct rec *rec_take(void *ptr)
{
	struct rec **pp, *r = NULL;

	if (!atomic_load_explicit(&T.nrec, memory_order_acquire))
		return NULL;
	pthread_mutex_lock(&T.lock);
	for (pp = &T.rec[((uintptr_t)ptr >> 9) % CVM_TORCH_REC_HASH]; *pp; pp = &(*pp)->next) {
		if ((*pp)->ptr == ptr) {
			r = *pp;
			*pp = r->next;
			atomic_fetch_sub(&T.nrec, 1);
			break;
		}
	}
	pthread_mutex_unlock(&T.lock);
	return r;
}

/*
 * Order the free after the work of every stream that used the block: each such stream records an event the
 * allocation stream waits for (as PyTorch's cudaMallocAsync backend does), so the pool's ordinary stream-
 * ordered free on the allocation stream covers them all.
 */
static void join_streams(struct cuvmm_pool *p, struct rec *r, CUstream on)
{
	struct cvm_dev *dev = p->r.dev;

	for (unsigned i = 0; i < r->n; i++) {
		cvm_event ev;
		int err;

		if (r->streams[i] == on)
			continue;
		err = cvm_drv_event_create(&dev->drv, &ev);
		if (err)
			goto fail;
		err = cvm_drv_event_record(&dev->drv, ev, r->streams[i]);
		if (!err)
			err = cvm_drv_stream_wait(&dev->drv, on, ev);
		cvm_drv_event_destroy(&dev->drv, ev); /* freed once it has completed */
		if (!err)
			continue;
fail:
		/* No way to order the free: wait for the other stream instead. */
		cvm_warn("record_stream: cannot order a free after another stream (%s); synchronising it",
			 cuvmm_strerror(err));
		cvm_drv_stream_sync(&dev->drv, r->streams[i]);
	}
	free(r->streams);
	free(r);
}

void cuvmm_torch_free(void *ptr, size_t size, int device, void *stream)
{
	struct cuvmm_pool *p;
	struct rec *r;
	struct tdev *td;
	int err;

	if (!ptr)
		return;
	p = pool_of(ptr);
	if (!p) {
		cvm_err("PyTorch freed %p, which no cuvmm pool holds; ignored", ptr);
		return;
	}
	r = rec_take(ptr);
	if (r)
		join_streams(p, r, torch_stream(stream));
	err = cuvmm_free_async(p, ptr, torch_stream(stream));
	if (err) {
		cvm_err("PyTorch's free of %p on device %d failed: %s", ptr, device, cuvmm_strerror(err));
		return;
	}
	if (device >= 0 && device < CVM_MAX_DEVICES) {
		td = &T.dev[device];
		atomic_fetch_sub(&td->cur, size);
		atomic_fetch_sub(&td->n_cur, 1);
		atomic_fetch_add(&td->total_freed, size);
		atomic_fetch_add(&td->n_free, 1);
	}
}

int cuvmm_torch_record_stream(void *ptr, void *stream)
{
	struct rec **pp, *r;
	CUstream s = torch_stream(stream);
	int err = CUVMM_OK;

	if (!ptr || !pool_of(ptr))
		return CUVMM_EINVAL;
	pthread_mutex_lock(&T.lock);
	pp = &T.rec[((uintptr_t)ptr >> 9) % CVM_TORCH_REC_HASH];
	for (r = *pp; r && r->ptr != ptr; r = r->next)
		;
	if (!r) {
		r = calloc(1, sizeof(*r));
		if (!r) {
			err = CUVMM_ENOMEM;
			goto out;
		}
		r->ptr = ptr;
		r->next = *pp;
		*pp = r;
		atomic_fetch_add(&T.nrec, 1);
	}
	for (unsigned i = 0; i < r->n; i++)
		if (r->streams[i] == s)
			goto out;
	if (r->n == r->cap) {
		unsigned cap = r->cap ? 2 * r->cap : 4;
		CUstream *ns = realloc(r->streams, cap * sizeof(*ns));

		if (!ns) {
			err = CUVMM_ENOMEM;
			goto out;
		}
		r->streams = ns;
		r->cap = cap;
	}
	r->streams[r->n++] = s;
out:
	pthread_mutex_unlock(&T.lock);
	return err;
}

int cuvmm_torch_stats(int device, struct cuvmm_torch_stats *out)
{
	struct cuvmm_torch_stats s;
	struct cuvmm_stats cs = {.size = sizeof(cs)};
	struct cuvmm_ctx *ctx = cuvmm_torch_ctx();
	struct tdev *td;

	if (!out || out->size != sizeof(*out) || device < 0 || device >= CVM_MAX_DEVICES)
		return CUVMM_EINVAL;
	td = &T.dev[device];
	memset(&s, 0, sizeof(s));
	s.size = sizeof(s);
	s.allocated_bytes = atomic_load(&td->cur);
	s.peak_allocated_bytes = atomic_load(&td->peak);
	s.allocated_bytes_total = atomic_load(&td->total_alloc);
	s.freed_bytes_total = atomic_load(&td->total_freed);
	s.allocations = atomic_load(&td->n_cur);
	s.peak_allocations = atomic_load(&td->n_peak);
	s.allocation_count = atomic_load(&td->n_alloc);
	s.free_count = atomic_load(&td->n_free);
	s.ooms = atomic_load(&td->ooms);
	if (ctx && !cuvmm_ctx_stats(ctx, device, &cs)) {
		s.reserved_bytes = cs.held_bytes;
		max_store(&td->peak_held, cs.held_bytes);
		s.mapped_bytes = cs.mapped_bytes;
		s.create_calls = cs.create_calls;
		s.release_calls = cs.release_calls;
	}
	s.peak_reserved_bytes = atomic_load(&td->peak_held);
	*out = s;
	return CUVMM_OK;
}

int cuvmm_torch_reset_peak(int device)
{
	struct cuvmm_stats cs = {.size = sizeof(cs)};
	struct cuvmm_ctx *ctx = cuvmm_torch_ctx();
	struct tdev *td;

	if (device < 0 || device >= CVM_MAX_DEVICES)
		return CUVMM_EINVAL;
	td = &T.dev[device];
	atomic_store(&td->peak, atomic_load(&td->cur));
	atomic_store(&td->n_peak, atomic_load(&td->n_cur));
	atomic_store(&td->peak_held, ctx && !cuvmm_ctx_stats(ctx, device, &cs) ? cs.held_bytes : 0);
	return CUVMM_OK;
}

int cuvmm_torch_reset_totals(int device)
{
	struct tdev *td;

	if (device < 0 || device >= CVM_MAX_DEVICES)
		return CUVMM_EINVAL;
	td = &T.dev[device];
	atomic_store(&td->total_alloc, 0);
	atomic_store(&td->total_freed, 0);
	atomic_store(&td->n_alloc, 0);
	atomic_store(&td->n_free, 0);
	atomic_store(&td->ooms, 0);
	return CUVMM_OK;
}
