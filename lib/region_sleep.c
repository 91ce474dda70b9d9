/*
 * The region's sleep and wake: part of the region layer, under cuvmm_region_sleep/wake and
 * cuvmm_pool_sleep/wake. Its state (the record while asleep, the host copy kept for the next sleep) is
 * struct cvm_region_sleep, which the region holds (r->zzz) and only this file reads; it changes the
 * region's slots only through region.c's chunk calls (region.h).
 *
 * Sleep records every mapped chunk (first granule, size class), copies their contents to one pinned host
 * buffer (OFFLOAD), unmaps them all and only then releases them, so that a failure anywhere before the
 * release can put the very same chunks back and leave the region awake and intact. Only if the driver
 * refuses that too (an unmap refused, then a map back) does the sleep go forward instead: the contents are
 * in the host copy, and chunks it cannot unmap stay quarantined (see struct cvm_slot) for the wake. Wake maps chunks of
 * the same classes at the same granules, copies the contents back and frees the host copy only once the
 * copy has completed; a failure unmaps what it mapped and leaves the region asleep with its host copy.
 * Copies are issued in pieces of CVM_COPY_PIECE bytes, back to back on one stream, so the copy engine
 * stays busy while the host thread keeps queueing; wake maps the next piece while the last one copies.
 * With a host copy pinned before the sleep (kept by a wake, or prepared), every copy is queued first and
 * each chunk is unmapped as soon as its copy has passed (struct copy_marks): the unmaps overlap the copies.
 * A failure to queue a copy still comes before any unmap.
 *
 * The host copy (struct cvm_pinned) is anonymous memory (mmap, huge pages where the system allows),
 * pinned in pieces of CVM_COPY_PIECE bytes with cuMemHostRegister: one cudaHostAlloc-like call of 8 GiB
 * costs seconds, most of it first-touching the pages on one thread. Here min(online CPUs, 16) worker
 * threads ($CUVMM_PIN_THREADS; with 1, the sleeping thread alone) each take the next piece, touch it and
 * register it, and the sleeping thread queues each piece's copy as soon as that piece is pinned; so the
 * pinning of later pieces overlaps the copies of earlier ones. No copy crosses a piece (each is its own registration). A failure (a register
 * refused, a piece that cannot be populated) stops the workers; what was registered is unregistered and the
 * memory unmapped, and the sleep fails as any other. All host copies of the process, asleep or kept for the
 * next sleep, stay under $CUVMM_SLEEP_HOST_LIMIT if it is set.
 */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "config.h"
#include "log.h"
#include "region.h"

#define CVM_COPY_PIECE ((size_t)64 << 20)
#define CVM_PIN_ALIGN ((size_t)2 << 20) /* the host copy starts on a huge page */

/* A pinned host copy: struct cvm_region_sleep's keep and struct cvm_sleep's host point to one. */
struct cvm_pinned {
	char *p;
	size_t bytes;   /* mapped: the copy's bytes rounded up to the page size */
	size_t npieces; /* pieces of CVM_COPY_PIECE bytes (the last one shorter) */
	uint8_t *reg;   /* piece i is registered */
};

/* Bytes of all host copies of the process, against $CUVMM_SLEEP_HOST_LIMIT. */
static _Atomic size_t pinned_total;

static size_t piece_len(const struct cvm_pinned *h, size_t i)
{
	size_t off = i * CVM_COPY_PIECE;

	return h->bytes - off < CVM_COPY_PIECE ? h->bytes - off : CVM_COPY_PIECE;
}

static void pinned_free(struct cvm_drv_dev *d, struct cvm_pinned *h)
{
	if (!h)
		return;
	for (size_t i = 0; i < h->npieces; i++)
		if (h->reg[i])
			cvm_drv_host_unregister(d, h->p + i * CVM_COPY_PIECE);
	munmap(h->p, h->bytes);
	atomic_fetch_sub(&pinned_total, h->bytes);
	free(h->reg);
	free(h);
}

/* Map (not yet touched nor pinned) a host copy of `bytes`; CUVMM_ENOMEM beyond $CUVMM_SLEEP_HOST_LIMIT. */
static int pinned_map(size_t bytes, struct cvm_pinned **out)
{
	size_t page = (size_t)sysconf(_SC_PAGESIZE), limit = cvm_env_sleep_host_limit(), len, head;
	struct cvm_pinned *h;
	char *m;

	/* (a size no host could map: refused before any arithmetic on it wraps) */
	if (bytes > SIZE_MAX / 2)
		return CUVMM_ENOMEM;
	len = (bytes + page - 1) / page * page;
	if (atomic_fetch_add(&pinned_total, len) + len > limit && limit) {
		atomic_fetch_sub(&pinned_total, len);
		cvm_warn("sleep: a host copy of %.1f MiB would exceed CUVMM_SLEEP_HOST_LIMIT (%.1f MiB, %.1f MiB "
			 "in use)", len / 1048576.0, limit / 1048576.0, atomic_load(&pinned_total) / 1048576.0);
		return CUVMM_ENOMEM;
	}
	h = calloc(1, sizeof(*h));
	if (h) {
		h->npieces = (len + CVM_COPY_PIECE - 1) / CVM_COPY_PIECE;
		h->reg = calloc(h->npieces, 1);
	}
	m = MAP_FAILED;
	if (h && h->reg)
		m = mmap(NULL, len + CVM_PIN_ALIGN, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (m == MAP_FAILED) {
		if (h)
			free(h->reg);
		free(h);
		atomic_fetch_sub(&pinned_total, len);
		return CUVMM_ENOMEM;
	}
	/* Trim to a huge-page-aligned start, so every piece is made of whole huge pages. */
	head = (CVM_PIN_ALIGN - (uintptr_t)m % CVM_PIN_ALIGN) % CVM_PIN_ALIGN;
	if (head)
		munmap(m, head);
	if (CVM_PIN_ALIGN - head)
		munmap(m + head + len, CVM_PIN_ALIGN - head);
	h->p = m + head;
	h->bytes = len;
	(void)madvise(h->p, len, MADV_HUGEPAGE); /* a hint: refused where THP is off */
	*out = h;
	return CUVMM_OK;
}

/* The pinning of one host copy in progress: workers claim pieces in order (next), touch and register them. */
struct pin_job {
	struct cvm_drv_dev *d;
	struct cvm_pinned *h;
	_Atomic size_t next;
	_Atomic int err;   /* the first failure; set, it stops the claiming */
	pthread_mutex_t lock;
	pthread_cond_t cond;
	uint8_t *done;     /* piece i settled (registered or failed); under lock */
	pthread_t *tid;
	unsigned nthreads;
};

/* First touch (page faults on this thread, in parallel with the other workers), then register. */
static void pin_piece(struct pin_job *j, size_t i)
{
	char *a = j->h->p + i * CVM_COPY_PIECE;
	size_t n = piece_len(j->h, i), page = (size_t)sysconf(_SC_PAGESIZE);
	int err = CUVMM_OK;

#ifdef MADV_POPULATE_WRITE
	if (madvise(a, n, MADV_POPULATE_WRITE)) {
		if (errno != EINVAL) /* EINVAL: a kernel before 5.14; the loop below does the same */
			err = CUVMM_ENOMEM;
	} else {
		page = n; /* populated: the loop below touches one byte */
	}
#endif
	for (size_t off = 0; !err && off < n; off += page)
		((volatile char *)a)[off] = 0;
	if (!err)
		err = cvm_drv_host_register(j->d, a, n);
	pthread_mutex_lock(&j->lock);
	if (err) {
		int none = CUVMM_OK;

		atomic_compare_exchange_strong(&j->err, &none, err);
	} else {
		j->h->reg[i] = 1;
	}
	j->done[i] = 1;
	pthread_cond_broadcast(&j->cond);
	pthread_mutex_unlock(&j->lock);
}

/* Claim and pin the next piece; false when none is left or the job has failed. */
static bool pin_next(struct pin_job *j)
{
	size_t i;

	if (atomic_load(&j->err))
		return false;
	i = atomic_fetch_add(&j->next, 1);
	if (i >= j->h->npieces)
		return false;
	pin_piece(j, i);
	return true;
}

static void *pin_worker(void *arg)
{
	while (pin_next(arg))
		;
	return NULL;
}

/* Wait until piece i is pinned. With workers, the sleeping thread only waits: it must be free to queue
 * each piece's copy the moment that piece is pinned (when it pinned too, the copies of pieces the workers
 * had finished waited behind its own piece, and the first sleep of 8 GiB took 0.59 s to pin and copy where
 * pinning alone takes 0.32-0.39 s on 16 threads). With no worker started it pins every piece itself.
 * CUVMM_OK, or the job's failure. */
static int pin_wait(struct pin_job *j, size_t i)
{
	int err;

	if (!j)
		return CUVMM_OK; /* a kept copy: pinned already */
	for (;;) {
		bool help;

		pthread_mutex_lock(&j->lock);
		while (!j->done[i] && !atomic_load(&j->err) &&
		       (j->nthreads || atomic_load(&j->next) >= j->h->npieces))
			pthread_cond_wait(&j->cond, &j->lock);
		err = atomic_load(&j->err);
		help = !err && !j->done[i];
		pthread_mutex_unlock(&j->lock);
		if (!help)
			return err;
		pin_next(j);
	}
}

/* Start pinning a new host copy of `bytes`: map it, start the workers: $CUVMM_PIN_THREADS pinning threads
 * (at most one per piece). With one thread, no worker is started and the sleeping thread pins (pin_wait);
 * with more, the sleeping thread queues copies while the workers pin. A worker that cannot be started
 * leaves its share to the others (and if none starts, to the sleeping thread). */
static int pin_start(struct cvm_drv_dev *d, size_t bytes, struct pin_job **out)
{
	struct pin_job *j = calloc(1, sizeof(*j));
	unsigned want;
	int err;

	if (!j)
		return CUVMM_ENOMEM;
	err = pinned_map(bytes, &j->h);
	if (err) {
		free(j);
		return err;
	}
	want = cvm_env_pin_threads();
	if (want > j->h->npieces)
		want = (unsigned)j->h->npieces;
	j->d = d;
	j->done = calloc(j->h->npieces, 1);
	if (want == 1)
		want = 0; /* the sleeping thread pins alone */
	j->tid = calloc(want ? want : 1, sizeof(*j->tid));
	if (!j->done || !j->tid) {
		pinned_free(d, j->h);
		free(j->done);
		free(j->tid);
		free(j);
		return CUVMM_ENOMEM;
	}
	pthread_mutex_init(&j->lock, NULL);
	pthread_cond_init(&j->cond, NULL);
	while (j->nthreads < want && !pthread_create(&j->tid[j->nthreads], NULL, pin_worker, j))
		j->nthreads++;
	if (j->nthreads < want)
		cvm_info("sleep: %u of %u pinning threads started%s", j->nthreads, want,
			 j->nthreads ? "" : " (the sleeping thread pins alone)");
	*out = j;
	return CUVMM_OK;
}

/* Stop the workers (after the piece each is on) and wait for them. Returns the host copy, or NULL (freed)
 * when `fail` or a piece failed; then *err holds the failure if it was not set. */
static struct cvm_pinned *pin_finish(struct pin_job *j, bool fail, int *err)
{
	struct cvm_pinned *h = j->h;
	int none = CUVMM_OK;

	if (fail)
		atomic_compare_exchange_strong(&j->err, &none, CUVMM_EDRIVER);
	for (unsigned t = 0; t < j->nthreads; t++)
		pthread_join(j->tid[t], NULL);
	if (!fail && atomic_load(&j->err) && !*err)
		*err = atomic_load(&j->err);
	if (fail || *err) {
		pinned_free(j->d, h);
		h = NULL;
	}
	pthread_cond_destroy(&j->cond);
	pthread_mutex_destroy(&j->lock);
	free(j->done);
	free(j->tid);
	free(j);
	return h;
}

struct cvm_sleep_chunk {
	size_t g;      /* first granule */
	uint8_t cls;
};

/* The record of a sleeping region: its chunks and their contents. */
struct cvm_sleep {
	enum cuvmm_sleep_mode mode;
	struct cvm_sleep_chunk *chunks;
	size_t nchunks;
	struct cvm_pinned *host; /* OFFLOAD: contents of the chunks, in order */
	size_t host_bytes;
};

/* What sleep keeps in a region (r->zzz), made at its first sleep and freed with the region. */
struct cvm_region_sleep {
	struct cvm_sleep *rec;   /* non-NULL while asleep */
	struct cvm_pinned *keep; /* pinned host copy kept for the next sleep (by a wake, or prepared) */
	size_t keep_bytes;
};

/* Is a pinned host copy of at least `bytes` kept for the next sleep? */
static bool keep_fits(const struct cuvmm_region *r, size_t bytes)
{
	return r->zzz && r->zzz->keep && r->zzz->keep_bytes >= bytes;
}

/* Keep host copy h (`bytes` long) for the next sleep, in place of one kept before (r->zzz exists). */
static void keep_set(struct cuvmm_region *r, struct cvm_pinned *h, size_t bytes)
{
	cvm_region_host_drop(r);
	r->zzz->keep = h;
	r->zzz->keep_bytes = bytes;
}

bool cvm_region_asleep(const struct cuvmm_region *r)
{
	return r->zzz && r->zzz->rec;
}

static size_t chunk_bytes(const struct cuvmm_region *r, const struct cvm_sleep_chunk *c)
{
	return r->dev->info.granularity << c->cls;
}

/*
 * Where the queued copies of a sleep have got to: an event recorded on the copy stream each time the copies
 * reach the end of a piece of the host copy (and after the last copy), with the host offset it marks. With
 * a host copy pinned before the sleep, the sleep unmaps each chunk as soon as the mark after its copy has
 * passed, while later copies still run (the unmaps cost the driver about 20 us per handle, the copies of
 * 8 GiB 0.16 s: they overlap instead of adding up).
 */
struct copy_marks {
	cvm_event *ev;
	size_t *end;   /* host offset up to which the copies are done once ev[i] is */
	size_t n, cap;
	size_t next;   /* the first mark that may still be needed (the earlier ones end before what was asked) */
	size_t done;   /* ev[0 .. done) are known complete */
	bool all;      /* every copy is known complete (a stream synchronisation) */
};

static void marks_free(struct cvm_drv_dev *d, struct copy_marks *m)
{
	for (size_t i = 0; i < m->n; i++)
		cvm_drv_event_destroy(d, m->ev[i]);
	free(m->ev);
	free(m->end);
	memset(m, 0, sizeof(*m));
}

/* Record a mark at host offset `end`. A mark that cannot be had (no memory, an event refused) is not an
 * error: the copies before it are waited for with the next mark, or with the stream. */
static void marks_add(struct cvm_drv_dev *d, struct copy_marks *m, size_t end, CUstream stream)
{
	cvm_event ev;

	if (m->n == m->cap) {
		size_t cap = m->cap ? 2 * m->cap : 64;
		cvm_event *e = realloc(m->ev, cap * sizeof(*e));
		size_t *o;

		if (!e)
			return;
		m->ev = e;
		o = realloc(m->end, cap * sizeof(*o));
		if (!o)
			return;
		m->end = o;
		m->cap = cap;
	}
	if (cvm_drv_event_create(d, &ev))
		return;
	if (cvm_drv_event_record(d, ev, stream)) {
		cvm_drv_event_destroy(d, ev);
		return;
	}
	m->ev[m->n] = ev;
	m->end[m->n++] = end;
}

/* Wait until the copies up to host offset `end` are complete (SIZE_MAX: all of them). A mark that fails is
 * replaced by a synchronisation of the stream; its failure is returned. */
static int marks_wait(struct cvm_drv_dev *d, struct copy_marks *m, size_t end, CUstream stream)
{
	while (!m->all && m->next < m->n && m->end[m->next] < end)
		m->next++; /* a later mark covers it: the copies run in order on one stream */
	if (m->all || m->next < m->done)
		return CUVMM_OK;
	if (m->next < m->n && m->end[m->next] >= end && end != SIZE_MAX &&
	    !cvm_drv_event_sync(d, m->ev[m->next])) {
		m->done = m->next + 1;
		return CUVMM_OK;
	}
	if (cvm_drv_stream_sync(d, stream))
		return CUVMM_EDRIVER;
	m->all = true;
	return CUVMM_OK;
}

/* Copy the chunks to the host buffer, coalescing adjacent chunks into spans and cutting spans into the
 * host copy's pieces, each queued once its piece is pinned (`pin`; NULL: pinned already). Stops at the
 * first failure. With `marks`, returns once every copy is queued, with marks recorded (marks_wait), instead
 * of waiting for them; on failure the queued ones have finished and no mark is left. */
static int copy_out(struct cuvmm_region *r, struct cvm_sleep *s, struct pin_job *pin, CUstream stream,
		    struct copy_marks *marks)
{
	struct cvm_drv_dev *d = &r->dev->drv;
	size_t off = 0;

	for (size_t i = 0; i < s->nchunks;) {
		size_t g = s->chunks[i].g, bytes = 0;

		/* a span: chunks that follow one another in the address space */
		do {
			bytes += chunk_bytes(r, &s->chunks[i]);
			i++;
		} while (i < s->nchunks && s->chunks[i].g == g + (bytes >> r->gshift));
		for (size_t done = 0; done < bytes;) {
			size_t h = off + done, n = CVM_COPY_PIECE - h % CVM_COPY_PIECE;
			uintptr_t dev = r->base + (g << r->gshift) + done;
			int err;

			if (n > bytes - done)
				n = bytes - done;
			err = pin_wait(pin, h / CVM_COPY_PIECE);
			if (!err)
				err = cvm_drv_copy_dtoh(d, s->host->p + h, dev, n, stream);

			if (err) {
				/* Pieces already queued still read or write both sides: let them finish before the
				 * caller unmaps device memory or frees the host copy. */
				cvm_drv_stream_sync(d, stream);
				if (marks)
					marks_free(d, marks);
				return err;
			}
			done += n;
			if (marks && (h + n) % CVM_COPY_PIECE == 0)
				marks_add(d, marks, h + n, stream);
		}
		off += bytes;
	}
	if (!marks)
		return cvm_drv_stream_sync(d, stream);
	if (!marks->n || marks->end[marks->n - 1] < off)
		marks_add(d, marks, off, stream);
	return CUVMM_OK;
}

/* Map chunks [0, n) of `kept` back at their granules (undo of a partial unmap). Returns true if all went
 * back; each one that did, or that the driver refused (then given back or quarantined by the map), leaves
 * `kept`. */
static bool remap_kept(struct cuvmm_region *r, struct cvm_sleep *s, struct cvm_chunk **kept, size_t n)
{
	bool all = true;

	for (size_t i = 0; i < n; i++) {
		if (cvm_region_chunk_map_locked(r, s->chunks[i].g, kept[i], CVM_SLOT_MAPPED)) {
			cvm_err("sleep: could not map granule %zu back after a failed unmap; sleeping instead",
				s->chunks[i].g);
			all = false;
		}
		kept[i] = NULL;
	}
	return all;
}

int cvm_region_sleep_locked(struct cuvmm_region *r, enum cuvmm_sleep_mode mode, CUstream stream)
{
	struct cvm_drv_dev *d = &r->dev->drv;
	struct cvm_sleep *s;
	struct cvm_chunk **kept = NULL;
	size_t n = 0;
	struct cvm_region_sleep *z;
	struct copy_marks marks = {0};
	uint64_t t0 = cvm_now_ns(), t_copy, t_unmap;
	size_t off = 0, reused_bytes = 0;
	bool pinned_new = false, overlap = false;
	int err;

	if (cvm_region_asleep(r))
		return CUVMM_ESTATE;
	/* The copies and the fence must run now, not at a graph's replay. */
	err = cvm_drv_refuse_captured(d, stream);
	if (err)
		return err;
	if (!r->zzz)
		r->zzz = calloc(1, sizeof(*r->zzz));
	z = r->zzz;
	if (!z)
		return CUVMM_ENOMEM;
	s = calloc(1, sizeof(*s));
	if (!s)
		return CUVMM_ENOMEM;
	s->mode = mode;
	for (size_t g = 0; g < r->ngran; g += r->slot[g].chunk ? cvm_span(r, r->slot[g].chunk) : 1)
		n += r->slot[g].state == CVM_SLOT_MAPPED;
	s->chunks = calloc(n ? n : 1, sizeof(*s->chunks));
	kept = calloc(n ? n : 1, sizeof(*kept));
	if (!s->chunks || !kept) {
		err = CUVMM_ENOMEM;
		goto fail;
	}
	for (size_t g = 0; g < r->ngran;) {
		struct cvm_chunk *c = r->slot[g].chunk;

		if (c && r->slot[g].state == CVM_SLOT_MAPPED) {
			s->chunks[s->nchunks].g = g;
			s->chunks[s->nchunks].cls = c->cls;
			s->nchunks++;
			s->host_bytes += c->size;
		}
		g += c ? cvm_span(r, c) : 1;
	}
	if (!stream) {
		err = cvm_dev_sync(r->dev);
		if (err)
			goto fail;
	}
	if (mode == CUVMM_SLEEP_OFFLOAD && s->host_bytes) {
		/* Pinning is the slow part (seconds for GiBs, where the copy takes milliseconds): reuse the
		 * pinned buffer an earlier wake kept, if it is large enough. */
		struct pin_job *pin = NULL;

		if (keep_fits(r, s->host_bytes)) {
			s->host = z->keep;
			reused_bytes = z->keep_bytes;
			z->keep = NULL;
			z->keep_bytes = 0;
		} else {
			cvm_region_host_drop(r);
			err = pin_start(d, s->host_bytes, &pin);
			if (err)
				goto fail;
			s->host = pin->h;
			pinned_new = true;
		}
		/* A copy pinned already: the unmaps below follow the copies (marks) instead of waiting for all of
		 * them. Pinning now, the copies wait for the pins and the unmaps for the copies, as before. */
		overlap = !pin;
		err = copy_out(r, s, pin, stream, overlap ? &marks : NULL);
		if (pin)
			s->host = pin_finish(pin, err != CUVMM_OK, &err);
		if (err)
			goto fail;
	} else if (stream) {
		/* DISCARD still waits for the work on the stream before taking the memory away. */
		err = cvm_drv_stream_sync(d, stream);
		if (err)
			goto fail;
	}
	t_copy = cvm_now_ns();
	for (size_t i = 0; i < s->nchunks; i++) {
		off += chunk_bytes(r, &s->chunks[i]);
		if (overlap && marks_wait(d, &marks, off, stream)) {
			/* The copies failed (the context is likely lost): map back what was unmapped, whose
			 * contents were copied, and fail as a failed copy does. */
			if (remap_kept(r, s, kept, i)) {
				err = CUVMM_EDRIVER;
				goto fail;
			}
			/* A map back refused too: those contents are in the host copy alone, and the region must
			 * not be left awake with holes. Go forward, as below. */
		} else {
			if (!cvm_region_chunk_unmap_locked(r, s->chunks[i].g, &kept[i]))
				continue;
			/* Refused: map back what was unmapped, and the region is awake and intact. */
			if (remap_kept(r, s, kept, i)) {
				err = CUVMM_EDRIVER;
				goto fail;
			}
		}
		/* A map back was refused too: those contents are in the host copy alone (or were to be dropped),
		 * so the sleep goes forward instead, once every copy is done. Chunks whose unmap is refused stay
		 * quarantined at their granules, counted held, until a pass unmaps them or the wake takes them
		 * back. */
		if (overlap && marks_wait(d, &marks, SIZE_MAX, stream))
			cvm_err("sleep: going forward after a refused map back, but the copies failed: contents "
				"from granule %zu on may be lost", s->chunks[i].g);
		for (size_t k = 0; k < s->nchunks; k++) {
			size_t g = s->chunks[k].g;

			if (kept[k] || r->slot[g].state != CVM_SLOT_MAPPED)
				continue; /* unmapped, in hand or given back */
			if (cvm_region_chunk_unmap_locked(r, g, &kept[k]))
				cvm_region_quarantine_locked(r, g, r->slot[g].chunk);
		}
		break;
	}
	/* Unmapped, all of them: the copies that remain read host memory only. Done before the sleep returns. */
	if (overlap && marks_wait(d, &marks, SIZE_MAX, stream))
		cvm_err("sleep: the last copies failed after every chunk was unmapped; contents may be lost");
	marks_free(d, &marks);
	/* Past the point of no return: the physical memory goes back to the driver, not to the cache. */
	size_t slept = 0;
	t_unmap = cvm_now_ns();
	for (size_t i = 0; i < s->nchunks; i++) {
		if (!kept[i])
			continue;
		slept += kept[i]->size;
		cvm_phys_release(&r->dev->phys, kept[i]);
	}
	/* Where the time went, for "why was my sleep slow": the copy (and a first sleep's pinning), then one
	 * unmap and one release per chunk. */
	cvm_info("sleep (%s): gave %.1f MiB (%zu chunks) back to the driver in %.1f ms: %s %.1f ms, %s %.1f ms, "
		 "release %.1f ms", mode == CUVMM_SLEEP_OFFLOAD ? "offload" : "discard", slept / 1048576.0,
		 s->nchunks, (cvm_now_ns() - t0) / 1e6,
		 pinned_new ? "pin and copy" : overlap ? "queue the copies" : "copy", (t_copy - t0) / 1e6,
		 overlap ? "copy and unmap" : "unmap", (t_unmap - t_copy) / 1e6, (cvm_now_ns() - t_unmap) / 1e6);
	free(kept);
	z->rec = s;
	return CUVMM_OK;
fail:
	if (marks.n)
		cvm_drv_stream_sync(d, stream); /* (the copies read into s->host) */
	marks_free(d, &marks);
	if (reused_bytes && s->host && !z->keep) {
		/* A kept (or prepared) copy goes back to being kept: the next sleep needs no new pinning. */
		keep_set(r, s->host, reused_bytes);
		s->host = NULL;
	}
	pinned_free(d, s->host);
	free(kept);
	free(s->chunks);
	free(s);
	return err;
}

/* Copy host bytes [off, off+n) to `dev`, cut so that no copy crosses a piece of the host copy. */
static int copy_in(struct cuvmm_region *r, uintptr_t dev, const struct cvm_pinned *h, size_t off, size_t n,
		   CUstream stream)
{
	for (size_t done = 0; done < n;) {
		size_t k = CVM_COPY_PIECE - (off + done) % CVM_COPY_PIECE;
		int err;

		if (k > n - done)
			k = n - done;
		err = cvm_drv_copy_htod(&r->dev->drv, dev + done, h->p + off + done, k, stream);
		if (err)
			return err;
		done += k;
	}
	return CUVMM_OK;
}

/*
 * Wake, pipelined: chunks are mapped in pieces of up to CVM_COPY_PIECE bytes, and each piece's copy is
 * queued as soon as it is mapped, so the driver calls for the next piece overlap the DMA of this one.
 */
int cvm_region_wake_locked(struct cuvmm_region *r, CUstream stream)
{
	struct cvm_sleep *s = cvm_region_asleep(r) ? r->zzz->rec : NULL;
	struct cvm_drv_dev *d = &r->dev->drv;
	bool copy = s && s->mode == CUVMM_SLEEP_OFFLOAD && s->host_bytes;
	size_t i, off = 0, piece = 0, piece_first = 0;
	int err = CUVMM_OK;

	if (!s)
		return CUVMM_ESTATE;
	err = cvm_drv_refuse_captured(d, stream);
	if (err)
		return err;
	/* Chunks an earlier wake could not unmap stay quarantined at their granules: unmap them now if the
	 * driver lets us, else take them back below. */
	if (r->npending)
		cvm_region_process_locked(r, cvm_now_ns(), false);
	for (i = 0; i < s->nchunks; i++) {
		size_t g = s->chunks[i].g;
		struct cvm_chunk *c = r->slot[g].chunk;
		bool last, adjacent;

		if (c) {
			/* Quarantined by an earlier wake: the very chunk this record asks for, still mapped. */
			if (c->cls != s->chunks[i].cls || r->slot[g].state != CVM_SLOT_DONE) {
				err = CUVMM_EDRIVER;
				goto undo;
			}
			err = cvm_region_take_back_locked(r, g);
			if (err)
				goto undo;
		} else {
			err = cvm_phys_get(&r->dev->phys, s->chunks[i].cls, &r->cnt, &c);
			if (err)
				goto undo;
			err = cvm_region_chunk_map_locked(r, g, c, CVM_SLOT_MAPPED);
			if (err)
				goto undo; /* c is given back or quarantined */
		}
		if (!copy)
			continue;
		piece += chunk_bytes(r, &s->chunks[i]);
		last = i + 1 == s->nchunks;
		adjacent = !last && s->chunks[i + 1].g == s->chunks[i].g + cvm_span(r, c);
		if (last || !adjacent || piece >= CVM_COPY_PIECE) {
			err = copy_in(r, r->base + (s->chunks[piece_first].g << r->gshift), s->host, off, piece,
				      stream);
			if (err) {
				i++; /* chunk i is mapped too */
				goto undo;
			}
			off += piece;
			piece = 0;
			piece_first = i + 1;
		}
	}
	if (copy) {
		err = cvm_drv_stream_sync(d, stream);
		if (err)
			goto undo; /* i == nchunks: all of them */
		/* Kept, pinned, for the next sleep; trim and destroy give it back. */
		keep_set(r, s->host, s->host_bytes);
	}
	free(s->chunks);
	free(s);
	r->zzz->rec = NULL;
	return CUVMM_OK;
undo:
	/* Copies already queued write into what is about to be unmapped: let them finish first. Nothing
	 * written matters: unmap what this call mapped; the host copy stays. */
	if (copy)
		cvm_drv_stream_sync(d, stream);
	while (i-- > 0) {
		struct cvm_chunk *c = r->slot[s->chunks[i].g].chunk;

		if (cvm_region_chunk_unmap_locked(r, s->chunks[i].g, &c)) {
			/* Kept at its granule, out of the cache: the next wake takes it back (or a pass unmaps it). */
			cvm_region_quarantine_locked(r, s->chunks[i].g, c);
			continue;
		}
		cvm_phys_undo(&r->dev->phys, c);
	}
	return err;
}

void cvm_region_sleep_coarsen(struct cuvmm_region *r, size_t first, size_t n, unsigned max_cls)
{
	struct cvm_sleep *s = cvm_region_asleep(r) ? r->zzz->rec : NULL;
	size_t lo = 0, hi, g, m = 0, end = first + n;

	if (!s || !n)
		return;
	for (size_t step = s->nchunks; step;) { /* lower bound: first chunk at or after `first` */
		size_t half = step / 2;

		if (s->chunks[lo + half].g < first) {
			lo += half + 1;
			step -= half + 1;
		} else {
			step = half;
		}
	}
	/* The range must be exactly the chunks from lo on, back to back. */
	for (hi = lo, g = first; hi < s->nchunks && s->chunks[hi].g < end; hi++) {
		if (s->chunks[hi].g != g)
			return;
		g += (size_t)1 << (s->chunks[hi].cls - r->cls0);
	}
	if (g != end)
		return;
	/* Largest aligned chunks that fit, from the start (as cvm_region_map_locked lays them out). */
	for (g = first; g < end; m++)
		g += (size_t)1 << cvm_fit_cls(r, g, end, max_cls);
	if (m >= hi - lo)
		return; /* no fewer handles */
	for (g = first, m = lo; g < end; m++) {
		unsigned c = cvm_fit_cls(r, g, end, max_cls);

		s->chunks[m].g = g;
		s->chunks[m].cls = (uint8_t)(r->cls0 + c);
		g += (size_t)1 << c;
	}
	memmove(&s->chunks[m], &s->chunks[hi], (s->nchunks - hi) * sizeof(*s->chunks));
	s->nchunks -= hi - m;
}

int cvm_region_sleep_prepare(struct cuvmm_region *r, size_t bytes)
{
	struct cvm_drv_dev *d = &r->dev->drv;
	struct pin_job *pin;
	struct cvm_pinned *h;
	bool have;
	int err = CUVMM_OK;

	if (bytes > r->size)
		return CUVMM_EINVAL; /* more than the region can ever map */
	pthread_mutex_lock(&r->lock);
	if (cvm_region_asleep(r))
		err = CUVMM_ESTATE;
	have = !bytes || keep_fits(r, bytes);
	pthread_mutex_unlock(&r->lock);
	if (err || have)
		return err;
	/* The pinning, as a first sleep's (parallel, in pieces) but with nothing to copy: the calling thread
	 * waits for each piece in turn (or pins them all itself with one thread). */
	err = pin_start(d, bytes, &pin);
	if (err)
		return err;
	for (size_t i = 0; !err && i < pin->h->npieces; i++)
		err = pin_wait(pin, i);
	h = pin_finish(pin, err != CUVMM_OK, &err);
	if (!h)
		return err;
	pthread_mutex_lock(&r->lock);
	if (!r->zzz)
		r->zzz = calloc(1, sizeof(*r->zzz));
	if (!r->zzz || cvm_region_asleep(r)) {
		/* (asleep: put to sleep meanwhile, on a copy of its own; its wake keeps that one) */
		err = r->zzz ? CUVMM_ESTATE : CUVMM_ENOMEM;
		pinned_free(d, h);
	} else if (keep_fits(r, bytes)) {
		pinned_free(d, h); /* another call kept one as large meanwhile */
	} else {
		keep_set(r, h, bytes);
	}
	pthread_mutex_unlock(&r->lock);
	return err;
}

void cvm_region_host_drop(struct cuvmm_region *r)
{
	if (!r->zzz)
		return;
	pinned_free(&r->dev->drv, r->zzz->keep);
	r->zzz->keep = NULL;
	r->zzz->keep_bytes = 0;
}

void cvm_region_sleep_fini(struct cuvmm_region *r)
{
	struct cvm_sleep *s;

	if (!r->zzz)
		return;
	s = r->zzz->rec;
	if (s) {
		pinned_free(&r->dev->drv, s->host);
		free(s->chunks);
		free(s);
	}
	cvm_region_host_drop(r);
	free(r->zzz);
	r->zzz = NULL;
}

static int check_mode(enum cuvmm_sleep_mode mode)
{
	return mode == CUVMM_SLEEP_OFFLOAD || mode == CUVMM_SLEEP_DISCARD ? CUVMM_OK : CUVMM_EINVAL;
}

int cuvmm_region_sleep(struct cuvmm_region *r, enum cuvmm_sleep_mode mode, CUstream stream)
{
	int err;

	if (!r || check_mode(mode))
		return CUVMM_EINVAL;
	pthread_mutex_lock(&r->lock);
	if (cvm_region_asleep(r)) {
		err = CUVMM_ESTATE;
	} else {
		/* Pending unmaps are not contents: finish them (waiting for their fences) before sleeping. */
		if (r->npending)
			cvm_region_process_locked(r, cvm_now_ns(), true);
		/* Still pending: an unmap the driver refused (retried later); sleeping now would leave it mapped. */
		err = r->npending ? CUVMM_EDRIVER : cvm_region_sleep_locked(r, mode, stream);
	}
	pthread_mutex_unlock(&r->lock);
	/* Chunks of finished unmaps went to the device's cache: give those back too. */
	if (!err)
		cvm_phys_reclaim(&r->dev->phys, cvm_now_ns(), true, r->ctx->policy.retain_bytes);
	return err;
}

int cuvmm_region_sleep_prepare(struct cuvmm_region *r, size_t bytes)
{
	if (!r)
		return CUVMM_EINVAL;
	if (!bytes)
		bytes = (size_t)atomic_load(&r->acct.mapped);
	return cvm_region_sleep_prepare(r, bytes);
}

int cuvmm_region_wake(struct cuvmm_region *r, CUstream stream)
{
	int err;

	if (!r)
		return CUVMM_EINVAL;
	pthread_mutex_lock(&r->lock);
	err = cvm_region_wake_locked(r, stream);
	pthread_mutex_unlock(&r->lock);
	return err;
}
