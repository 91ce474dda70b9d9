/*
 * The pool's runs and their index: boundary tags (edge[]) so that neighbours coalesce in O(1), size bins of
 * FREE runs (best fit), segment trees of VA and settled FREE runs (first fit from an address, seg.h), the
 * age and pending lists, split and coalesce, and the settling of FREE runs freed on a stream (their event
 * completed) or before a device synchronisation (their epoch). See pool.h for the kinds of run.
 */
#include <stdlib.h>

#include "pool_int.h"

/* ----- bins and segment trees ----- */

unsigned cvm_bin_of(size_t len)
{
	unsigned b;

	if (len <= 64)
		return (unsigned)len - 1;
	b = 64 + (63 - (unsigned)__builtin_clzll(len)) - 6;
	return b < CVM_NBINS ? b : CVM_NBINS - 1;
}

/*
 * Index a VA or FREE run: VA runs in the VA segment tree (first fit from an address: map_fresh, in
 * pool_place.c); FREE runs in the size bins (best fit: slabs, runs pending on a stream) and, once settled,
 * in the FREE segment tree (next fit).
 */
void cvm_bin_insert(struct cuvmm_pool *p, struct cvm_run *run)
{
	unsigned b = cvm_bin_of(run->len);

	if (run->kind == CVM_RUN_VA) {
		cvm_seg_set(&p->vseg, run->start, (uint32_t)run->len);
		return;
	}
	run->bin = (uint8_t)b;
	run->bprev = NULL;
	run->bnext = p->free.head[b];
	if (run->bnext)
		run->bnext->bprev = run;
	p->free.head[b] = run;
	p->free.nonempty[b / 64] |= (uint64_t)1 << (b % 64);
	if (!run->fence.ev)
		cvm_seg_set(&p->fseg, run->start, (uint32_t)run->len);
}

void cvm_bin_remove(struct cuvmm_pool *p, struct cvm_run *run)
{
	unsigned b = run->bin;

	if (run->kind == CVM_RUN_VA) {
		cvm_seg_set(&p->vseg, run->start, 0);
		return;
	}
	if (run->bprev)
		run->bprev->bnext = run->bnext;
	else
		p->free.head[b] = run->bnext;
	if (run->bnext)
		run->bnext->bprev = run->bprev;
	if (!p->free.head[b])
		p->free.nonempty[b / 64] &= ~((uint64_t)1 << (b % 64));
	run->bnext = run->bprev = NULL;
	cvm_seg_set(&p->fseg, run->start, 0);
}

/* ----- boundary tags, split and coalesce ----- */

void cvm_edges_set(struct cuvmm_pool *p, struct cvm_run *run)
{
	p->edge[run->start] = run;
	p->edge[run->start + run->len - 1] = run;
}

void cvm_edges_clear(struct cuvmm_pool *p, struct cvm_run *run)
{
	p->edge[run->start] = NULL;
	p->edge[run->start + run->len - 1] = NULL;
}

/* Take a FREE run out of every index (bins, age or pending list, free_bytes); edges stay. */
void cvm_free_unlink(struct cuvmm_pool *p, struct cvm_run *run)
{
	cvm_bin_remove(p, run);
	cvm_list_remove(run);
	p->free_bytes -= cvm_gbytes(p, run->len);
}

/* Put a FREE run into the indexes: pending runs in the pending list, settled ones at the young end of
 * the age list. */
void cvm_free_link(struct cuvmm_pool *p, struct cvm_run *run)
{
	cvm_bin_insert(p, run);
	cvm_list_append(run->fence.ev ? &p->pend : &p->age, run);
	p->free_bytes += cvm_gbytes(p, run->len);
}

/* Can two FREE runs become one? Settled ones always; pending ones only on the same stream. */
static bool free_compatible(const struct cvm_run *a, const struct cvm_run *b)
{
	if (!a->fence.ev && !b->fence.ev)
		return true;
	return a->fence.ev && b->fence.ev && a->fence.stream == b->fence.stream;
}

/* Merge `run` (already linked, edges set) with its neighbours of the same kind. Returns the survivor. */
struct cvm_run *cvm_coalesce(struct cuvmm_pool *p, struct cvm_run *run)
{
	struct cvm_run *left = run->start ? p->edge[run->start - 1] : NULL;
	struct cvm_run *right = run->start + run->len < p->r.ngran ? p->edge[run->start + run->len] : NULL;
	struct cvm_run *nb[2] = {left, right};

	for (int i = 0; i < 2; i++) {
		struct cvm_run *o = nb[i];

		if (!o || o->kind != run->kind)
			continue;
		if (run->kind == CVM_RUN_FREE && !free_compatible(run, o))
			continue;
		if (run->kind == CVM_RUN_FREE) {
			cvm_free_unlink(p, o);
			cvm_free_unlink(p, run);
			if (o->freed_ns > run->freed_ns)
				run->freed_ns = o->freed_ns;
			if (o->first_freed_ns < run->first_freed_ns)
				run->first_freed_ns = o->first_freed_ns;
			/* The later epoch; or, pending on the same stream, `run` is the newest free, and its
			 * event covers the neighbour's, which completes first on that stream. */
			cvm_fence_merge(&p->r.dev->fence, &run->fence, &o->fence);
		} else {
			cvm_bin_remove(p, o);
			cvm_bin_remove(p, run);
		}
		cvm_edges_clear(p, o);
		cvm_edges_clear(p, run);
		if (i == 0)
			run->start = o->start;
		run->len += o->len;
		cvm_edges_set(p, run);
		if (run->kind == CVM_RUN_FREE)
			cvm_free_link(p, run);
		else
			cvm_bin_insert(p, run);
		free(o);
	}
	return run;
}

/* Split `run` so that its first `k` granules become a new run returned to the caller (edges set, in no
 * index); the rest stays in `run`, re-indexed. `run` must be out of the indexes (caller unlinked it). A
 * NULL return means no memory for the bookkeeping. */
struct cvm_run *cvm_split_front(struct cuvmm_pool *p, struct cvm_run *run, size_t k)
{
	struct cvm_run *front;

	if (run->len == k)
		return run;
	front = calloc(1, sizeof(*front));
	if (!front)
		return NULL;
	cvm_edges_clear(p, run);
	front->start = run->start;
	front->len = k;
	front->kind = run->kind;
	run->start += k;
	run->len -= k;
	cvm_edges_set(p, front);
	cvm_edges_set(p, run);
	return front;
}

/* Take the first k granules of a settled FREE run (k < its length, a chunk boundary) out of the indexes as a
 * run of their own, edges set, carrying the run's age and fence; the rest keeps its place in the age list.
 * NULL: no memory for the bookkeeping (nothing changed). */
struct cvm_run *cvm_free_take_front(struct cuvmm_pool *p, struct cvm_run *run, size_t k)
{
	struct cvm_run *front;

	cvm_bin_remove(p, run);
	front = cvm_split_front(p, run, k);
	cvm_bin_insert(p, run);
	if (!front)
		return NULL;
	front->freed_ns = run->freed_ns;
	front->first_freed_ns = run->first_freed_ns;
	front->fence = run->fence; /* settled: no event to share, at most an epoch already reached */
	p->free_bytes -= cvm_gbytes(p, k);
	return front;
}

/* ----- settling: FREE runs freed on a stream, or before a device synchronisation ----- */

/* May an allocation on `stream` (NULL: no stream) take this FREE run now? Settled runs, yes; a run pending on
 * that very stream, yes; one pending on another, once its event has completed (the run is left pending: the
 * caller takes it, or cvm_settle_pending settles it). */
bool cvm_free_usable(struct cuvmm_pool *p, struct cvm_run *run, CUstream stream)
{
	return cvm_fence_usable(&p->r.dev->fence, &run->fence, stream);
}

/* Settle a pending FREE run whose event has completed: it becomes safe to unmap and joins its neighbours. */
static void settle(struct cuvmm_pool *p, struct cvm_run *run)
{
	cvm_free_unlink(p, run);
	cvm_fence_clear(&p->r.dev->fence, &run->fence);
	cvm_free_link(p, run);
	cvm_coalesce(p, run);
}

void cvm_settle_pending(struct cuvmm_pool *p, int max)
{
	struct cvm_run *run = p->pend.lnext, *next;

	for (; run != &p->pend && max-- > 0; run = next) {
		next = run->lnext;
		if (cvm_fence_done(&p->r.dev->fence, &run->fence) > 0)
			settle(p, run);
	}
}

/* Turn a USED or SLAB run into FREE after a free, fenced by f (an event fence) or by the device epoch. */
void cvm_run_release(struct cuvmm_pool *p, struct cvm_run *run, const struct cvm_fence *f)
{
	cvm_fp_add(p, run->len, false);
	run->kind = CVM_RUN_FREE;
	run->bytes = 0;
	run->slab = NULL;
	run->freed_ns = run->first_freed_ns = cvm_now_ns();
	if (f)
		run->fence = *f;
	else
		cvm_fence_set_epoch(&p->r.dev->fence, &run->fence);
	cvm_free_link(p, run);
	cvm_coalesce(p, run);
}
