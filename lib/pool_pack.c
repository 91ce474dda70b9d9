/*
 * The pool's packed allocations (above the slab limit, up to CVM_PACK_MAX_GRANULES granules): the pool side
 * of pack.h. The packer places byte ranges; this file gives it granules from the run layer (one PACK run per
 * chunk) and takes back, as FREE memory behind the usual fences, the runs on which no live byte is left.
 * Stream frees wait in the deferred queue (pool_slab.c) for their event, and are reused at once by an
 * allocation of the same length on the same stream.
 *
 * A PACK run is one chunk. Packed memory is mapped in 2 MiB chunks, so each granule goes back the moment
 * its last live byte leaves; but a wake maps back-to-back PACK runs in chunks of up to
 * CVM_PACK_MAX_GRANULES granules (cuvmm_pool_sleep), and such a coarse chunk can only go back whole. Its
 * granules that empty meanwhile stay mapped and are the packer's to place on before any new memory
 * (coarse_empty, coarse_find): freed and loaded again, tensors land where the old ones were, and held
 * stays at live.
 */
#include <stdlib.h>

#include "pool_int.h"

/* Granules [g, g + n) all lie in coarse PACK runs (one chunk of more than one granule) and carry no live
 * byte: mapped and the packer's, to place on without a driver call. */
static bool coarse_empty(struct cuvmm_pool *p, size_t g, size_t n)
{
	if (!p->npack_coarse || g + n > p->r.ngran)
		return false;
	for (size_t i = g; i < g + n; i++) {
		struct cvm_chunk *c = p->r.slot[i].chunk;
		struct cvm_run *run;
		size_t span;

		if (!c || p->r.slot[i].state != CVM_SLOT_MAPPED || cvm_pack_holds(&p->pack, i))
			return false;
		span = cvm_span(&p->r, c);
		if (span == 1)
			return false;
		run = p->edge[cvm_region_chunk_end_locked(&p->r, i) - span]; /* runs start at chunk boundaries */
		if (!run || run->kind != CVM_RUN_PACK || run->len != span)
			return false;
	}
	return true;
}

/* The first n granules in a row (address order) on which coarse_empty holds, in *g; false if none. */
static bool coarse_find(struct cuvmm_pool *p, size_t n, size_t *g)
{
	size_t row = 0;

	for (size_t r = 0; r < p->r.ngran; r += p->edge[r]->len) {
		struct cvm_run *run = p->edge[r];

		if (run->kind != CVM_RUN_PACK || run->len == 1) {
			row = 0;
			continue;
		}
		for (size_t i = r; i < r + run->len; i++) {
			row = cvm_pack_holds(&p->pack, i) ? 0 : row + 1;
			if (row == n && coarse_empty(p, i + 1 - n, n)) {
				*g = i + 1 - n;
				return true;
			}
		}
	}
	return false;
}

/* May the packer extend over granules [g, g + n): the start of a VA run or of a settled FREE run of small
 * chunks, at least n long, or empty granules of coarse chunks? */
static bool pack_avail(void *arg, size_t g, size_t n)
{
	struct cuvmm_pool *p = arg;
	struct cvm_run *run = p->edge[g];

	if (coarse_empty(p, g, n))
		return true; /* the packer's already (placed on by the bump, pack_take has nothing to do) */
	if (!run || run->start != g || run->len < n)
		return false;
	/* Fresh memory only while the pool has no slack: where memory is being freed (a KV cache growing
	 * buffers), the bump would map ahead while FREE memory piles up behind it; cvm_get_run reuses it. */
	if (run->kind == CVM_RUN_VA)
		return p->free_bytes == 0 && !p->going; /* (not beside a batch being unmapped: cvm_make_room) */
	return run->kind == CVM_RUN_FREE && !run->fence.ev && cvm_cut_len(p, run, n) == n;
}

/* The run holding granule g (which may start before it: a chunk of several granules). */
static struct cvm_run *run_at(struct cuvmm_pool *p, size_t g)
{
	while (!p->edge[g] || (p->edge[g]->start != g && p->edge[g]->start + p->edge[g]->len - 1 != g))
		g--;
	return p->edge[g];
}

/* Merge `next`, the PACK run right after `run`, into `run` (neither in an index: PACK runs are in none). */
static void absorb(struct cuvmm_pool *p, struct cvm_run *run, struct cvm_run *next)
{
	cvm_edges_clear(p, run);
	cvm_edges_clear(p, next);
	run->len += next->len;
	cvm_edges_set(p, run);
	free(next);
}

/* Give the wholly empty PACK runs of granules [g0, g0 + n) back as one FREE run, freed at `freed_ns`, fenced
 * by the device epoch, or settled (`settled`: a stream free whose event has completed). */
static void pack_give_back(struct cuvmm_pool *p, size_t g0, size_t n, bool settled, uint64_t freed_ns)
{
	struct cvm_run *run = NULL, *next;
	size_t g;
	bool unsynced = !settled;

	for (g = run_at(p, g0)->start; g < g0 + n; g = next->start + next->len) {
		bool empty = true;

		next = p->edge[g];
		for (size_t i = g; i < g + next->len && empty; i++)
			empty = !cvm_pack_holds(&p->pack, i);
		if (!empty)
			continue; /* a chunk still partly live */
		p->npack_coarse -= next->len > 1;
		unsynced |= next->unsynced;
		next->unsynced = false;
		if (!run) {
			run = next;
			continue;
		}
		absorb(p, run, next);
		next = run;
	}
	if (!run)
		return;
	/* As cvm_run_release, but a stream free whose event has completed needs no device synchronisation,
	 * unless bytes freed without a stream lay on these chunks too (`unsynced`: the work queued before that
	 * free may still use them, and the device epoch now covers it). */
	cvm_fp_add(p, run->len, false);
	run->kind = CVM_RUN_FREE;
	run->freed_ns = run->first_freed_ns = freed_ns;
	cvm_fence_clear(&p->r.dev->fence, &run->fence);
	if (unsynced)
		cvm_fence_set_epoch(&p->r.dev->fence, &run->fence);
	cvm_free_link(p, run);
	cvm_coalesce(p, run);
}

/* Make `run` (mapped, edges set, in no index, no live byte of the packer on it) the packer's: one PACK run
 * per chunk, so that each goes back alone once empty. On failure (no memory for the bookkeeping) all of it is
 * FREE memory again. */
static int pack_own(struct cuvmm_pool *p, struct cvm_run *run)
{
	size_t g0 = run->start, n = run->len;

	run->kind = CVM_RUN_PACK;
	cvm_fp_add(p, run->len, true);
	for (;;) {
		size_t span = cvm_region_chunk_end_locked(&p->r, run->start) - run->start;

		if (span >= run->len) {
			p->npack_coarse += run->len > 1;
			return CUVMM_OK;
		}
		if (!cvm_split_front(p, run, span)) {
			/* The chunks split off so far are empty PACK runs too: all of it goes back. */
			p->npack_coarse += run->len > 1;
			pack_give_back(p, g0, n, false, cvm_now_ns());
			return CUVMM_ENOMEM;
		}
		p->npack_coarse += span > 1;
	}
}

/* Take granules [g, g + n) for the packer: a VA run is mapped, a FREE run taken as it is (pack_avail). */
static int pack_take(struct cuvmm_pool *p, size_t g, size_t n)
{
	struct cvm_run *run = p->edge[g], *piece;
	int err;

	if (coarse_empty(p, g, n))
		return CUVMM_OK;
	if (run->kind == CVM_RUN_VA) {
		cvm_bin_remove(p, run);
		piece = cvm_split_front(p, run, n);
		if (!piece) {
			cvm_bin_insert(p, run);
			return CUVMM_ENOMEM;
		}
		if (piece != run)
			cvm_bin_insert(p, run);
		err = cvm_region_map_locked(&p->r, g, n, 0);
		if (err) {
			piece->kind = CVM_RUN_VA;
			cvm_bin_insert(p, piece);
			cvm_coalesce(p, piece);
			return err;
		}
	} else {
		cvm_free_unlink(p, run);
		piece = cvm_split_front(p, run, n);
		if (!piece) {
			cvm_free_link(p, run);
			return CUVMM_ENOMEM;
		}
		if (piece != run)
			cvm_free_link(p, run);
	}
	return pack_own(p, piece);
}

/* Take a packed allocation out of the packer and give back the granules it emptied: idle since the free (a
 * stream free's settles later: the release delay counts from the free, as for a run). */
static void pack_release(struct cuvmm_pool *p, struct cvm_pack_alloc *x, bool settled)
{
	uint64_t freed_ns = x->pending ? x->freed_ns : cvm_now_ns();
	size_t g0, n;

	if (!settled) {
		/* Freed without a stream: the chunks it lay on go back behind a device synchronisation, even if
		 * another allocation on them is freed last, on a stream (pack_give_back). */
		size_t last = (x->off + x->len - 1) >> p->r.gshift;

		for (size_t g = run_at(p, x->off >> p->r.gshift)->start; g <= last; g += p->edge[g]->len)
			p->edge[g]->unsynced = true;
	}

	cvm_pack_remove(&p->pack, x, &g0, &n);
	free(x);
	if (n)
		pack_give_back(p, g0, n, settled, freed_ns);
}

/* ----- entry points of the pool's files ----- */

int cvm_pool_pack_init(struct cuvmm_pool *p)
{
	p->pack_max = p->small_max ? (size_t)CVM_PACK_MAX_GRANULES << p->r.gshift : 0;
	return cvm_pack_init(&p->pack, p->r.ngran, p->r.gshift);
}

void cvm_pool_pack_fini(struct cuvmm_pool *p)
{
	cvm_pack_fini(&p->pack);
}

struct cvm_pack_alloc *cvm_pool_pack_find(struct cuvmm_pool *p, uintptr_t a)
{
	return p->pack_max ? cvm_pack_find(&p->pack, a - p->r.base) : NULL;
}

int cvm_pool_pack_alloc(struct cuvmm_pool *p, size_t bytes, CUstream stream, void **ptr)
{
	struct cvm_pack_alloc *x;
	struct cvm_pack_plan plan;
	struct cvm_run *run;
	size_t len = cvm_pack_len(bytes), own = cvm_gcount(p, len); /* granules of its own */
	int err = CUVMM_OK;

	/* Stream-ordered reuse: an allocation of this length freed on this very stream is ready for it now
	 * (still in the packer, its bytes taken: pending). */
	x = stream ? cvm_dq_take_packed(p, stream, len) : NULL;
	if (x) {
		x->pending = false;
		x->bytes = bytes;
		goto done;
	}
	x = calloc(1, sizeof(*x));
	if (!x)
		return CUVMM_ENOMEM;
	x->len = len;
	x->bytes = bytes;
	cvm_pack_plan(&p->pack, x->len, pack_avail, p, &plan);
	if (p->npack_coarse && (plan.anywhere || (plan.ng && !coarse_empty(p, plan.g0, plan.ng)))) {
		/* New granules wanted: the empty granules of coarse chunks first (they are held anyway). */
		size_t g;

		if (coarse_find(p, own, &g)) {
			plan.anywhere = false;
			plan.off = cvm_gbytes(p, g);
			plan.g0 = g;
			plan.ng = own;
		}
	}
	if (!plan.anywhere && plan.ng && pack_take(p, plan.g0, plan.ng)) {
		/* The bump failed (no memory, or a refused map): the way every allocation goes, on granules
		 * of its own (the bump's ng counted only those past the cursor's last one). */
		plan.anywhere = true;
		plan.ng = own;
	}
	if (plan.anywhere) {
		/* Not a stream's: other allocations will share its granules. */
		err = cvm_get_run(p, plan.ng, NULL, true, &run);
		if (!err) {
			plan.off = cvm_gbytes(p, run->start);
			err = pack_own(p, run);
		}
		if (err) {
			free(x);
			return err;
		}
	}
	x->off = plan.off;
	cvm_pack_insert(&p->pack, x, plan.anywhere || plan.ng);
done:
	cvm_pool_live_add(p, (int64_t)bytes);
	*ptr = (void *)(p->r.base + x->off);
	return CUVMM_OK;
}

void cvm_pool_pack_free(struct cuvmm_pool *p, struct cvm_pack_alloc *x, const struct cvm_fence *f)
{
	struct cvm_fence w;

	cvm_pool_live_add(p, -(int64_t)x->bytes);
	if (!f) {
		pack_release(p, x, false);
		return;
	}
	/* Its bytes share granules with other allocations: they stay taken until the event completes
	 * (cvm_slab_drain), except for a later allocation of the same length on the same stream. */
	x->pending = true;
	x->freed_ns = cvm_now_ns();
	if (cvm_dq_add(p, (uintptr_t)(p->r.base + x->off), x, f))
		return;
	/* No memory to remember the fence: wait for it instead. */
	w = *f;
	cvm_fence_wait(&p->r.dev->fence, &w);
	cvm_fence_clear(&p->r.dev->fence, &w);
	pack_release(p, x, true);
}

void cvm_pool_pack_settled(struct cuvmm_pool *p, struct cvm_pack_alloc *x)
{
	pack_release(p, x, true);
}

void cvm_pool_pack_woken(struct cuvmm_pool *p)
{
	p->npack_coarse = 0;
	for (size_t g = 0; g < p->r.ngran; g += p->edge[g]->len) {
		struct cvm_run *run = p->edge[g];
		size_t end;

		if (run->kind != CVM_RUN_PACK)
			continue;
		/* The sleep coarsened back-to-back PACK runs only: whatever follows a PACK run inside its chunk
		 * is PACK. */
		end = cvm_region_chunk_end_locked(&p->r, run->start);
		while (run->start + run->len < end)
			absorb(p, run, p->edge[run->start + run->len]);
		p->npack_coarse += run->len > 1;
	}
}
