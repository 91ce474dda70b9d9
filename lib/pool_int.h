/*
 * The pool's internals: what its files share, and no other layer needs (those include pool.h).
 *
 *   pool.c          the entry points: create, destroy, malloc, free (and _async), stats, sleep, wake
 *   pool_runs.c     runs: boundary tags, size bins, segment trees, coalesce and split, settling of FREE
 *                   runs freed on a stream or before a device synchronisation
 *   pool_place.c    placement: next fit, best fit, compose fit, fresh mapping
 *   pool_slab.c     small allocations: size classes, slabs, the queue of small and packed frees on
 *                   streams
 *   pool_pack.c     packed allocations (above the slab limit, up to CVM_PACK_MAX_GRANULES granules): the
 *                   packer's granules (PACK runs) taken from and given back to the runs
 *   pool_reclaim.c  giving memory back: the slack cap, unmapping FREE runs, the reclaim pass, trim
 *
 * Everything here runs under the pool's lock (p->r.lock) unless a function says otherwise.
 */
#ifndef CVM_POOL_INT_H
#define CVM_POOL_INT_H

#include "pool.h"

static inline size_t cvm_gbytes(const struct cuvmm_pool *p, size_t granules)
{
	return granules << p->r.gshift;
}

/* The granules `bytes` take (rounded up; no overflow, even for SIZE_MAX). */
static inline size_t cvm_gcount(const struct cuvmm_pool *p, size_t bytes)
{
	return bytes ? ((bytes - 1) >> p->r.gshift) + 1 : 0;
}

/* Bytes handed out: the pool's count and its account (which feeds the device's). */
static inline void cvm_pool_live_add(struct cuvmm_pool *p, int64_t delta)
{
	p->live += (size_t)delta;
	cvm_acct_live(&p->pacct, delta);
}

/* The age and pending lists of FREE runs (lnext/lprev, around a sentinel). */
static inline void cvm_list_init(struct cvm_run *h)
{
	h->lnext = h->lprev = h;
}

static inline void cvm_list_append(struct cvm_run *h, struct cvm_run *run)
{
	run->lprev = h->lprev;
	run->lnext = h;
	h->lprev->lnext = run;
	h->lprev = run;
}

static inline void cvm_list_remove(struct cvm_run *run)
{
	run->lprev->lnext = run->lnext;
	run->lnext->lprev = run->lprev;
	run->lnext = run->lprev = NULL;
}

/* ----- pool_runs.c ----- */

/* The size bin of a FREE run of len granules. */
unsigned cvm_bin_of(size_t len);
/* Index a VA run (VA segment tree) or a FREE run (size bins; the FREE segment tree once settled). */
void cvm_bin_insert(struct cuvmm_pool *p, struct cvm_run *run);
void cvm_bin_remove(struct cuvmm_pool *p, struct cvm_run *run);
/* Boundary tags: a run's first and last granule point to it. */
void cvm_edges_set(struct cuvmm_pool *p, struct cvm_run *run);
void cvm_edges_clear(struct cuvmm_pool *p, struct cvm_run *run);
/* A FREE run into / out of every index (bins, age or pending list, free_bytes); edges stay. */
void cvm_free_link(struct cuvmm_pool *p, struct cvm_run *run);
void cvm_free_unlink(struct cuvmm_pool *p, struct cvm_run *run);
/* Merge `run` (linked, edges set) with its neighbours of the same kind. Returns the survivor. */
struct cvm_run *cvm_coalesce(struct cuvmm_pool *p, struct cvm_run *run);
/* Split off the first k granules of `run` (out of the indexes) as a new run (edges set, in no index); the
 * rest stays in `run`. NULL: no memory for the bookkeeping. */
struct cvm_run *cvm_split_front(struct cuvmm_pool *p, struct cvm_run *run, size_t k);
/* Take the first k granules (a chunk boundary) of a settled FREE run out of the indexes as a run of their
 * own; the rest keeps its place. NULL: no memory for the bookkeeping. */
struct cvm_run *cvm_free_take_front(struct cuvmm_pool *p, struct cvm_run *run, size_t k);
/* May an allocation on `stream` (NULL: no stream) take this FREE run now? */
bool cvm_free_usable(struct cuvmm_pool *p, struct cvm_run *run, CUstream stream);
/* Settle up to `max` pending FREE runs whose events have completed. */
void cvm_settle_pending(struct cuvmm_pool *p, int max);
/* A USED or SLAB run becomes FREE after a free, fenced by f (an event fence, taken over) or, f NULL, by the
 * device epoch. */
void cvm_run_release(struct cuvmm_pool *p, struct cvm_run *run, const struct cvm_fence *f);

/* ----- pool_place.c ----- */

/* A run of k granules for a large allocation (`ring`: next fit, moving the rover) or a slab (best fit), from
 * FREE memory if possible, else composed or freshly mapped; edges set, in no index. CUVMM_ESTATE when the
 * pool was put to sleep while the lock was dropped. */
int cvm_get_run(struct cuvmm_pool *p, size_t k, CUstream stream, bool ring, struct cvm_run **out);
/* The chunk class (in granules) of large handles for an allocation of k >= 16 granules. */
unsigned cvm_large_cls(size_t k);
/* Handles as large as fit in k granules: the largest power of two <= k, at most 2^CVM_POOL_MAX_CLS granules. */
unsigned cvm_whole_cls(size_t k);
/* The granules an allocation of k granules would take from the start of FREE run `run` (every run boundary a
 * chunk boundary), or 0 if it cannot. */
size_t cvm_cut_len(struct cuvmm_pool *p, const struct cvm_run *run, size_t k);
/* Does an allocation of `bytes` take handles as large as fit (cuvmm_pool_config.coarse_bytes): whole
 * granules of its own, not packed? */
static inline bool cvm_pool_coarse(const struct cuvmm_pool *p, size_t bytes)
{
	return p->coarse_k && cvm_gcount(p, bytes) >= p->coarse_k;
}

/* ----- pool_slab.c ----- */

/* Set the pool's small_max and nsmall from its granularity (create). */
void cvm_slab_setup(struct cuvmm_pool *p);
/* A small allocation (bytes <= small_max). */
int cvm_slab_alloc(struct cuvmm_pool *p, size_t bytes, CUstream stream, void **ptr);
/* Free the live small allocation at `a`: at once, or, with f (an event fence, taken over), once it has
 * completed (at once for work on its stream). */
void cvm_slab_free(struct cuvmm_pool *p, uintptr_t a, const struct cvm_fence *f);
/* The class size of a live small allocation at `a` (a granule of a SLAB run), or 0 if `a` is not one. */
size_t cvm_slab_live_bytes(struct cuvmm_pool *p, uintptr_t a);
/* Complete small and packed stream frees whose events are done (oldest first, at most `max` looked at). */
void cvm_slab_drain(struct cuvmm_pool *p, int max);
/* Queue the stream free of packed allocation `x` at `a` until its fence `f` (an event on the stream, taken
 * over) has completed. false: no memory for the entry (nothing queued). */
bool cvm_dq_add(struct cuvmm_pool *p, uintptr_t a, struct cvm_pack_alloc *x, const struct cvm_fence *f);
/* A packed allocation of length `len` freed on `stream` and still queued, taken out of the queue (its fence
 * cleared: the stream orders the reuse), or NULL. */
struct cvm_pack_alloc *cvm_dq_take_packed(struct cuvmm_pool *p, CUstream stream, size_t len);
/* Drop the queue of stream frees (destroy); the slabs go with their runs, packed allocations with the
 * packer (cvm_pool_pack_fini). */
void cvm_slab_discard(struct cuvmm_pool *p);

/* ----- pool_pack.c ----- */

/* Set pack_max and set up the packer (create); CUVMM_ENOMEM. */
int cvm_pool_pack_init(struct cuvmm_pool *p);
/* Free the packer's bookkeeping (destroy; the PACK runs go with the runs). */
void cvm_pool_pack_fini(struct cuvmm_pool *p);
/* The packed allocation starting at `a` (live, or freed on a stream and pending), or NULL. */
struct cvm_pack_alloc *cvm_pool_pack_find(struct cuvmm_pool *p, uintptr_t a);
/* A packed allocation (small_max < bytes <= pack_max); on `stream` (or NULL), one of the same length freed
 * on that stream is reused at once. */
int cvm_pool_pack_alloc(struct cuvmm_pool *p, size_t bytes, CUstream stream, void **ptr);
/* Free live packed allocation `x`: at once (f NULL: fenced by the device epoch), or, with fence `f` (an event
 * on the freeing stream, taken over), its bytes stay taken until the fence has completed. */
void cvm_pool_pack_free(struct cuvmm_pool *p, struct cvm_pack_alloc *x, const struct cvm_fence *f);
/* A queued stream free of `x` whose event has completed (cvm_slab_drain): its bytes are free. */
void cvm_pool_pack_settled(struct cuvmm_pool *p, struct cvm_pack_alloc *x);
/* After a wake that mapped back-to-back PACK runs in large chunks (cuvmm_pool_sleep coarsened them): the PACK
 * runs each chunk covers become one. */
void cvm_pool_pack_woken(struct cuvmm_pool *p);

/* ----- pool_reclaim.c ----- */

/* A run starts or stops holding allocations: the footprint, and its peak for the slack cap. */
void cvm_fp_add(struct cuvmm_pool *p, size_t granules, bool add);
/* The slack allowed before memory is given back early, with `extra` bytes about to be mapped. */
size_t cvm_slack_cap_after(struct cuvmm_pool *p, size_t extra);
size_t cvm_slack_cap(struct cuvmm_pool *p);
/* Unmap a FREE run (settled, safe) and turn it into VA. */
void cvm_free_to_va(struct cuvmm_pool *p, struct cvm_run *run);
/* Out of memory: synchronise the device (lock dropped), unmap every safe FREE run, release the device's
 * cache. CUVMM_ESTATE (nothing done) when the pool was put to sleep meanwhile. */
int cvm_drop_slack(struct cuvmm_pool *p);
/* Before mapping memory for an allocation of k granules (extending FREE run `keep`, or NULL): wait for a
 * reclaim pass unmapping without the lock, then move slack beyond the cap it leaves (synchronising the
 * device when too much waits for that). 0: nothing moved; 1: runs were unmapped and merged, or the lock
 * dropped (`keep` may be gone): look again; CUVMM_ESTATE when the pool was put to sleep meanwhile. */
int cvm_make_room(struct cuvmm_pool *p, size_t k, const struct cvm_run *keep);
/* Wait (lock dropped meanwhile) until no reclaim pass is unmapping GOING runs of this pool. */
void cvm_wait_going(struct cuvmm_pool *p);
/* The pool's reclaim pass (its client op). */
uint64_t cvm_pool_reclaim(struct cvm_client *c, uint64_t now, bool force);

#endif /* CVM_POOL_INT_H */
