/*
 * Placement: where an allocation of k granules goes. Next fit over settled FREE runs from the rover (large
 * allocations), best fit (slabs, and runs pending on the allocating stream), compose (a FREE run extended
 * into the address space beside it), and fresh address space mapped last, with the chunk class the size
 * calls for; every run boundary stays a chunk boundary. doc/design.md, "Pools".
 */
#include <stdlib.h>

#include "pool_int.h"

/*
 * Where may an allocation of k granules end inside this FREE run? Every run boundary is a chunk boundary
 * (so a large chunk is always wholly inside one allocation or wholly free, and never stranded): if
 * granule start+k falls inside a large chunk, the allocation extends to that chunk's end, which is allowed
 * only up to max(1, k/16) granules. Returns the granules to take, or 0 if this run cannot serve k.
 */
static size_t cut_len(struct cuvmm_pool *p, const struct cvm_run *run, size_t k)
{
	size_t c = run->start + k, ext;

	if (k > run->len)
		return 0;
	if (k == run->len)
		return k;
	ext = cvm_region_chunk_end_locked(&p->r, c - 1) - c;
	if (!ext)
		return k; /* a chunk boundary */
	if (ext > (k / 16 > 1 ? k / 16 : 1) || k + ext > run->len)
		return 0;
	return k + ext;
}

size_t cvm_cut_len(struct cuvmm_pool *p, const struct cvm_run *run, size_t k)
{
	return cut_len(p, run, k);
}

/*
 * Best fit: the FREE run that serves k granules with the fewest granules left over, usable on `stream` now
 * and cut at a chunk boundary, with the granules it would take in *take. Bounded scans keep it O(1) in
 * practice: exact bins hold equal lengths, and any run of a higher bin fits.
 */
static struct cvm_run *best_fit(struct cuvmm_pool *p, size_t k, CUstream stream, size_t *take)
{
	struct cvm_run_bins *bs = &p->free;
	unsigned b = cvm_bin_of(k);
	struct cvm_run *best = NULL;
	size_t t, best_t = 0;
	int scanned = 0;

	for (struct cvm_run *run = bs->head[b]; run && scanned < 64; run = run->bnext, scanned++) {
		if (run->len < k || (best && run->len >= best->len))
			continue;
		t = cut_len(p, run, k);
		if (!t || !cvm_free_usable(p, run, stream))
			continue;
		best = run;
		best_t = t;
		if (run->len == k)
			break;
	}
	if (!best) {
		for (unsigned w = (b + 1) / 64, bit = (b + 1) % 64; w < CVM_NBINS / 64 && !best; w++, bit = 0) {
			uint64_t m = bs->nonempty[w] & (~(uint64_t)0 << bit);

			while (m && !best) {
				unsigned nb = w * 64 + (unsigned)__builtin_ctzll(m);

				m &= m - 1;
				scanned = 0;
				for (struct cvm_run *run = bs->head[nb]; run && scanned < 16;
				     run = run->bnext, scanned++) {
					t = cut_len(p, run, k);
					if (t && cvm_free_usable(p, run, stream)) {
						best = run;
						best_t = t;
						break;
					}
				}
			}
		}
	}
	if (best)
		*take = best_t;
	return best;
}

/*
 * Next fit: the first settled FREE run starting at or after the rover (wrapping around once) that can serve k
 * granules, with the granules it would take in *take. Allocations then sweep the pool's memory in address
 * order, and memory freed behind the sweep joins its neighbours into long runs before the sweep comes
 * back to it (doc/design.md, "Pools": in bench/placement_model.py's model of the KV trace, 1.084 peak held
 * over peak live against best fit's 1.178, with no driver call in either).
 */
static struct cvm_run *next_fit(struct cuvmm_pool *p, size_t k, size_t *take)
{
	size_t from = p->rover, i;
	bool wrapped = false;

	for (int tries = 0; tries < 64; tries++) {
		i = cvm_seg_first(&p->fseg, from, (uint32_t)k);
		if (i == CVM_SEG_NONE || (wrapped && i >= p->rover)) {
			if (wrapped || p->rover == 0)
				return NULL;
			wrapped = true;
			from = 0;
			continue;
		}
		*take = cut_len(p, p->edge[i], k);
		if (*take)
			return p->edge[i];
		from = i + 1; /* a large chunk straddles the cut: try the next run */
	}
	return NULL;
}

/*
 * Chunk class for a fresh allocation of k granules. Larger handles cost fewer driver calls, but FREE runs of
 * large chunks can be cut only near chunk boundaries, so memory freed by a large allocation serves smaller
 * ones poorly; and their alignment leaves holes in the address space that keep free runs from coalescing.
 * Measured on the KV trace (doc/performance.md), whose largest buffers are 768 MiB: with large handles from
 * 512 MiB up, peak held / peak live over six seeds was 1.07-1.27; from 1 GiB up (none in the trace),
 * 1.03-1.14. So 2 MiB handles below 512 granules (1 GiB); above, handles of k/16 granules (up to 128 MiB),
 * where an allocation is large enough for the driver's per-handle cost to dominate (weights).
 */
#define CVM_POOL_MAX_CLS 6
#define CVM_POOL_BIG 512

/* Large handles for k >= 16 granules: about k/16 granules each (a power of two), at most 2^CVM_POOL_MAX_CLS. */
unsigned cvm_large_cls(size_t k)
{
	unsigned cls = 63 - (unsigned)__builtin_clzll(k / 16);

	return cls < CVM_POOL_MAX_CLS ? cls : CVM_POOL_MAX_CLS;
}

unsigned cvm_whole_cls(size_t k)
{
	unsigned cls = 63 - (unsigned)__builtin_clzll(k);

	return cls < CVM_POOL_MAX_CLS ? cls : CVM_POOL_MAX_CLS;
}

/* The chunk class for n fresh granules of an allocation of k (n < k where compose maps what a FREE run lacks):
 * by the rule above, or as large as fit for a pool's coarse allocations (cuvmm_pool_config.coarse_bytes). */
static unsigned fresh_cls(const struct cuvmm_pool *p, size_t k, size_t n)
{
	if (p->coarse_k && k >= p->coarse_k)
		return cvm_whole_cls(n);
	return n < CVM_POOL_BIG ? 0 : cvm_large_cls(n);
}

/*
 * The lowest VA run with room for k granules aligned to `align`, and where in it they start: the pool's
 * memory stays packed at the start of its range, and new memory lands where the sweep (next_fit) reaches it
 * next. Where a chunk the driver refused to unmap is still there (it is taken back only whole), the start
 * moves past it, so that one stuck chunk does not fail every allocation that lands on it.
 */
static struct cvm_run *find_va(struct cuvmm_pool *p, size_t k, size_t align, size_t *start)
{
	size_t from = 0, i, s, end;

	for (int tries = 0; tries < 64; tries++) {
		i = cvm_seg_first(&p->vseg, from, (uint32_t)(k + align - 1));
		if (i == CVM_SEG_NONE)
			return NULL;
		end = p->edge[i]->start + p->edge[i]->len;
		for (s = (i + align - 1) & ~(align - 1); s + k <= end;) {
			size_t past = p->r.npending ? cvm_region_straddle_locked(&p->r, s, k) : 0;

			if (!past) {
				*start = s;
				return p->edge[i];
			}
			s = (past + align - 1) & ~(align - 1);
		}
		from = end;
	}
	return NULL;
}

/* Map k granules of fresh address space, aligned so that its large chunks sit on their own alignment;
 * returns the new run (edges set, in no index). */
static int map_fresh(struct cuvmm_pool *p, size_t k, struct cvm_run **out)
{
	unsigned cls = fresh_cls(p, k, k);
	size_t align = (size_t)1 << cls, lead, s;
	struct cvm_run *va = find_va(p, k, align, &s), *run, *front;
	int err;

	if (!va) {
		cls = 0;
		align = 1;
		va = find_va(p, k, 1, &s);
		if (!va)
			return CUVMM_ENOSPC;
	}
	cvm_bin_remove(p, va);
	/* Alignment (and a stuck chunk skipped) stays VA. */
	lead = s - va->start;
	if (lead) {
		/* The unaligned head stays VA. */
		front = cvm_split_front(p, va, lead);
		if (!front) {
			cvm_bin_insert(p, va);
			return CUVMM_ENOMEM;
		}
		cvm_bin_insert(p, front);
	}
	run = cvm_split_front(p, va, k);
	if (!run) {
		cvm_bin_insert(p, va);
		cvm_coalesce(p, va);
		return CUVMM_ENOMEM;
	}
	if (run != va)
		cvm_bin_insert(p, va);
	err = cvm_region_map_locked(&p->r, run->start, k, cls);
	if (err) {
		run->kind = CVM_RUN_VA;
		cvm_bin_insert(p, run);
		cvm_coalesce(p, run);
		return err;
	}
	*out = run;
	return CUVMM_OK;
}

/*
 * Compose: when no FREE run holds k granules, a FREE run of m < k granules with free address space right
 * after (or right before) it serves k by mapping only the k - m granules it lacks, instead of all k being
 * mapped elsewhere while it stays behind. The longest such run wins (looking at up to 64 runs, longest
 * bins first). This is how the memory grows at the end of the sweep, and the torch.cat pattern's case:
 * the next buffer of a request is one granule larger than a buffer just freed.
 */
/* Extend FREE run `run` to k granules with the granules it lacks from VA run `va` beside it (after it, or
 * before), mapped now; *out is the run of k granules. On failure nothing has changed. */
static int compose_map(struct cuvmm_pool *p, struct cvm_run *run, struct cvm_run *va, bool after, size_t k,
		       struct cvm_run **out)
{
	size_t lack = k - run->len;
	struct cvm_run *piece;
	int err;

	cvm_bin_remove(p, va);
	if (after) {
		piece = cvm_split_front(p, va, lack);
	} else {
		piece = va->len == lack ? va : cvm_split_front(p, va, va->len - lack);
		if (piece && piece != va) {
			/* split_front returned the part away from the run: swap roles */
			struct cvm_run *t = piece;

			piece = va;
			va = t;
		}
	}
	if (!piece) {
		cvm_bin_insert(p, va);
		return CUVMM_ENOMEM;
	}
	if (piece != va)
		cvm_bin_insert(p, va);
	err = cvm_region_map_locked(&p->r, piece->start, lack, fresh_cls(p, k, lack));
	if (err) {
		cvm_bin_insert(p, piece);
		cvm_coalesce(p, piece);
		return err;
	}
	/* One run of k granules: the FREE run and the piece. */
	cvm_free_unlink(p, run);
	cvm_edges_clear(p, run);
	cvm_edges_clear(p, piece);
	if (!after)
		run->start = piece->start;
	run->len = k;
	cvm_edges_set(p, run);
	free(piece);
	cvm_fence_clear(&p->r.dev->fence, &run->fence);
	*out = run;
	return CUVMM_OK;
}

/* The FREE run to compose k granules from and the VA run beside it (after it, or before), or NULL. */
static struct cvm_run *compose_find(struct cuvmm_pool *p, size_t k, CUstream stream, struct cvm_run **va,
				    bool *after)
{
	struct cvm_run *best = NULL;
	int scanned = 0;

	for (int b = (int)cvm_bin_of(k); b >= 0 && scanned < 64; b--) {
		if (!(p->free.nonempty[b / 64] & ((uint64_t)1 << (b % 64))))
			continue;
		for (struct cvm_run *run = p->free.head[b]; run && scanned < 64; run = run->bnext, scanned++) {
			size_t end = run->start + run->len;
			struct cvm_run *right = end < p->r.ngran ? p->edge[end] : NULL;
			struct cvm_run *left = run->start ? p->edge[run->start - 1] : NULL;

			if (run->len >= k || (best && run->len <= best->len) || !cvm_free_usable(p, run, stream))
				continue;
			if (right && right->kind == CVM_RUN_VA && right->len >= k - run->len)
				best = run, *va = right, *after = true;
			else if (left && left->kind == CVM_RUN_VA && left->len >= k - run->len)
				best = run, *va = left, *after = false;
		}
		if (best)
			break; /* bins hold longer runs than the ones below them */
	}
	return best;
}

/* Compose k granules (compose_find), after making room for what it maps (cvm_make_room): ENOSPC when no run
 * serves. */
static int compose_fit(struct cuvmm_pool *p, size_t k, CUstream stream, struct cvm_run **out)
{
	struct cvm_run *run, *va;
	bool after;
	int err;

	run = compose_find(p, k, stream, &va, &after);
	if (!run)
		return CUVMM_ENOSPC;
	err = cvm_make_room(p, k, run);
	if (err < 0)
		return err;
	if (err) {
		/* Look again: the slack it unmapped merged with the address space beside it, perhaps the very VA
		 * run found (freed then), and with the lock dropped anything may have changed. */
		run = compose_find(p, k, stream, &va, &after);
		if (!run)
			return CUVMM_ENOSPC;
	}
	return compose_map(p, run, va, after, k, out);
}

/*
 * A run of k granules for a large allocation or a slab (`ring` false: best fit, so that slabs fill the
 * small holes), from FREE memory if possible. The rover moves to its start: the next search begins there,
 * so memory freed right there (a request that finished) is found without a lap of the pool.
 */
int cvm_get_run(struct cuvmm_pool *p, size_t k, CUstream stream, bool ring, struct cvm_run **out)
{
	size_t take;
	struct cvm_run *run, *front;
	bool again = true;
	int err;

look:
	run = ring ? next_fit(p, k, &take) : NULL;
	if (!run)
		run = best_fit(p, k, stream, &take); /* pending runs usable on `stream` too */
	if (run) {
		cvm_free_unlink(p, run);
		front = cvm_split_front(p, run, take);
		if (!front) {
			cvm_free_link(p, run);
			return CUVMM_ENOMEM;
		}
		if (front != run)
			cvm_free_link(p, run); /* the rest stays FREE, with its fence */
		cvm_fence_clear(&p->r.dev->fence, &front->fence); /* a split front's is none already */
		*out = front;
		goto found;
	}
	if (k > 1) {
		err = compose_fit(p, k, stream, out);
		if (!err)
			goto found;
		if (err == CUVMM_ESTATE)
			return err;
		/* Out of memory for the few granules it lacked: all k elsewhere would not fit either. */
		if (err == CUVMM_ENOMEM && cvm_drop_slack(p))
			return CUVMM_ESTATE;
	}
	/* Slack beyond its cap is unmapped by the reclaim pass, without the pool's lock, while the allocating
	 * thread only maps; where the pass falls behind, the allocating thread moves slack itself (an unmap
	 * and a map cost about what a create and a map do, and held stays where it was). */
	err = cvm_make_room(p, k, NULL);
	if (err < 0)
		return err;
	if (err && again) {
		/* The lock was dropped (a wait or a synchronisation): memory freed meanwhile may serve. Once. */
		again = false;
		goto look;
	}
	err = map_fresh(p, k, out);
	if (err == CUVMM_ENOMEM && p->free_bytes + cvm_phys_cached(&p->r.dev->phys)) {
		err = cvm_drop_slack(p);
		if (!err)
			err = map_fresh(p, k, out);
	}
	if (err)
		return err;
found:
	if (ring)
		p->rover = (*out)->start;
	return CUVMM_OK;
}
