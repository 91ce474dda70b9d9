/*
 * Pools: malloc/free over reserved address space that gives memory back when idle. See pool.h for the
 * layout. Everything here runs under the pool's lock (p->r.lock) unless a function says otherwise.
 */
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "graph.h"
#include "log.h"
#include "pool.h"

#define CVM_SMALL_LIMIT ((size_t)1 << 20) /* largest small allocation, if the granule allows 4 slots */
#define CVM_DQ_SCAN 16                    /* small stream frees looked at per allocation */

struct cvm_slab {
	struct cvm_slab *next, *prev; /* partial list of its class */
	struct cvm_run *run;
	uint32_t cls, size, nslots, navail, hint;
	uint64_t *taken; /* slot not available: live, or freed on a stream and waiting */
	uint64_t *live;  /* slot handed out and not freed */
};

struct cvm_dfree {
	struct cvm_dfree *next;
	void *ptr;
	uint32_t cls;
	CUstream stream;
	cvm_event ev;
};

static void fp_add(struct cuvmm_pool *p, size_t granules, bool add);

/* ----- size classes of small allocations: 256-byte steps to 1 KiB, then four steps per doubling ----- */

static unsigned small_class(size_t s)
{
	unsigned p;

	if (s <= 1024)
		return (unsigned)((s + 255) / 256) - 1;
	p = 63 - (unsigned)__builtin_clzll(s - 1); /* s in (2^p, 2^(p+1)] */
	return 4 + (p - 10) * 4 + (unsigned)((s + ((size_t)1 << (p - 2)) - 1) >> (p - 2)) - 5;
}

static size_t class_size(unsigned c)
{
	if (c < 4)
		return (size_t)(c + 1) * 256;
	return (size_t)(5 + (c - 4) % 4) << (10 + (c - 4) / 4 - 2);
}

/* ----- runs and bins ----- */

static unsigned bin_of(size_t len)
{
	unsigned b;

	if (len <= 64)
		return (unsigned)len - 1;
	b = 64 + (63 - (unsigned)__builtin_clzll(len)) - 6;
	return b < CVM_NBINS ? b : CVM_NBINS - 1;
}

/*
 * Index a VA or FREE run: VA runs in the VA segment tree (first fit from an address: map_fresh); FREE runs
 * in the size bins (best fit: slabs, runs pending on a stream) and, once settled, in the FREE segment tree
 * (next fit).
 */
static void bin_insert(struct cuvmm_pool *p, struct cvm_run *run)
{
	unsigned b = bin_of(run->len);

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
	if (!run->ev)
		cvm_seg_set(&p->fseg, run->start, (uint32_t)run->len);
}

static void bin_remove(struct cuvmm_pool *p, struct cvm_run *run)
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

static void list_init(struct cvm_run *h)
{
	h->lnext = h->lprev = h;
}

static void list_append(struct cvm_run *h, struct cvm_run *run)
{
	run->lprev = h->lprev;
	run->lnext = h;
	h->lprev->lnext = run;
	h->lprev = run;
}

static void list_remove(struct cvm_run *run)
{
	run->lprev->lnext = run->lnext;
	run->lnext->lprev = run->lprev;
	run->lnext = run->lprev = NULL;
}

static void edges_set(struct cuvmm_pool *p, struct cvm_run *run)
{
	p->edge[run->start] = run;
	p->edge[run->start + run->len - 1] = run;
}

static void edges_clear(struct cuvmm_pool *p, struct cvm_run *run)
{
	p->edge[run->start] = NULL;
	p->edge[run->start + run->len - 1] = NULL;
}

static size_t gbytes(struct cuvmm_pool *p, size_t granules)
{
	return granules << p->r.gshift;
}

/* Take a FREE run out of every index (bins, age or pending list, free_bytes); edges stay. */
static void free_unlink(struct cuvmm_pool *p, struct cvm_run *run)
{
	bin_remove(p, run);
	list_remove(run);
	p->free_bytes -= gbytes(p, run->len);
}

/* Put a FREE run into the indexes: pending runs in the pending list, settled ones at the young end of
 * the age list. */
static void free_link(struct cuvmm_pool *p, struct cvm_run *run)
{
	bin_insert(p, run);
	list_append(run->ev ? &p->pend : &p->age, run);
	p->free_bytes += gbytes(p, run->len);
}

/* Can two FREE runs become one? Settled ones always; pending ones only on the same stream. */
static bool free_compatible(const struct cvm_run *a, const struct cvm_run *b)
{
	if (!a->ev && !b->ev)
		return true;
	return a->ev && b->ev && a->stream == b->stream;
}

/* Merge `run` (already linked, edges set) with its neighbours of the same kind. Returns the survivor. */
static struct cvm_run *coalesce(struct cuvmm_pool *p, struct cvm_run *run)
{
	struct cvm_run *left = run->start ? p->edge[run->start - 1] : NULL;
	struct cvm_run *right = run->start + run->len < p->r.npages ? p->edge[run->start + run->len] : NULL;
	struct cvm_run *nb[2] = {left, right};

	for (int i = 0; i < 2; i++) {
		struct cvm_run *o = nb[i];

		if (!o || o->kind != run->kind)
			continue;
		if (run->kind == CVM_RUN_FREE && !free_compatible(run, o))
			continue;
		if (run->kind == CVM_RUN_FREE) {
			free_unlink(p, o);
			free_unlink(p, run);
			if (o->epoch > run->epoch)
				run->epoch = o->epoch;
			if (o->freed_ns > run->freed_ns)
				run->freed_ns = o->freed_ns;
			/* Pending on the same stream: `run` is the newest free, and its event covers the
			 * neighbour's, which completes first on that stream. */
			cvm_region_event_put_locked(&p->r, o->ev);
		} else {
			bin_remove(p, o);
			bin_remove(p, run);
		}
		edges_clear(p, o);
		edges_clear(p, run);
		if (i == 0)
			run->start = o->start;
		run->len += o->len;
		edges_set(p, run);
		if (run->kind == CVM_RUN_FREE)
			free_link(p, run);
		else
			bin_insert(p, run);
		free(o);
	}
	return run;
}

/* Split `run` so that its first `k` granules become a new run returned to the caller (edges set, in no
 * index); the rest stays in `run`, re-indexed. `run` must be out of the indexes (caller unlinked it). A
 * NULL return means no memory for the bookkeeping. */
static struct cvm_run *split_front(struct cuvmm_pool *p, struct cvm_run *run, size_t k)
{
	struct cvm_run *front;

	if (run->len == k)
		return run;
	front = calloc(1, sizeof(*front));
	if (!front)
		return NULL;
	edges_clear(p, run);
	front->start = run->start;
	front->len = k;
	front->kind = run->kind;
	run->start += k;
	run->len -= k;
	edges_set(p, front);
	edges_set(p, run);
	return front;
}

/* ----- finding memory ----- */

/* May an allocation on `stream` (NULL: no stream) take this FREE run now? Settles it if its event is
 * done. */
static bool free_usable(struct cuvmm_pool *p, struct cvm_run *run, CUstream stream)
{
	int done;

	if (!run->ev)
		return true;
	if (stream && run->stream == stream)
		return true;
	done = cvm_drv_event_done(CVM_DRV(p->r.dev), p->r.dev->index, run->ev);
	return done > 0;
}

/*
 * Where may an allocation of k granules end inside this FREE run? Every run boundary is a chunk boundary
 * (so a large chunk is always wholly inside one allocation or wholly free, and never stranded): if
 * granule start+k falls inside a large chunk, the allocation extends to that chunk's end, which is allowed
 * only up to max(1, k/16) granules. Returns the granules to take, or 0 if this run cannot serve k.
 */
static size_t cut_len(struct cuvmm_pool *p, const struct cvm_run *run, size_t k)
{
	size_t c = run->start + k, ext;
	struct cvm_chunk *ch;

	if (k > run->len)
		return 0;
	if (k == run->len || p->r.slot[c].chunk != p->r.slot[c - 1].chunk)
		return k;
	ch = p->r.slot[c - 1].chunk;
	ext = (((c - 1) | (((size_t)1 << ch->cls) - 1)) + 1) - c;
	if (ext > (k / 16 > 1 ? k / 16 : 1) || k + ext > run->len)
		return 0;
	return k + ext;
}

/*
 * Best fit: the FREE run that serves k granules with the fewest granules left over, usable on `stream` now
 * and cut at a chunk boundary, with the granules it would take in *take. Bounded scans keep it O(1) in
 * practice: exact bins hold equal lengths, and any run of a higher bin fits.
 */
static struct cvm_run *best_fit(struct cuvmm_pool *p, size_t k, CUstream stream, size_t *take)
{
	struct cvm_run_bins *bs = &p->free;
	unsigned b = bin_of(k);
	struct cvm_run *best = NULL;
	size_t t, best_t = 0;
	int scanned = 0;

	for (struct cvm_run *run = bs->head[b]; run && scanned < 64; run = run->bnext, scanned++) {
		if (run->len < k || (best && run->len >= best->len))
			continue;
		t = cut_len(p, run, k);
		if (!t || !free_usable(p, run, stream))
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
					if (t && free_usable(p, run, stream)) {
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

/* Settle a pending FREE run whose event has completed: it becomes safe to unmap and joins its neighbours. */
static void settle(struct cuvmm_pool *p, struct cvm_run *run)
{
	free_unlink(p, run);
	cvm_region_event_put_locked(&p->r, run->ev);
	run->ev = NULL;
	run->stream = NULL;
	run->epoch = 0;
	free_link(p, run);
	coalesce(p, run);
}

static void settle_pending(struct cuvmm_pool *p, int max)
{
	struct cvm_run *run = p->pend.lnext, *next;

	for (; run != &p->pend && max-- > 0; run = next) {
		next = run->lnext;
		if (cvm_drv_event_done(CVM_DRV(p->r.dev), p->r.dev->index, run->ev) > 0)
			settle(p, run);
	}
}

/* Unmap a FREE run (settled, safe) and turn it into VA. */
static void free_to_va(struct cuvmm_pool *p, struct cvm_run *run)
{
	struct cvm_fence *f;

	/* A NULL stream fence is complete: the caller established safety (epoch or event). */
	if (cvm_region_fence_locked(&p->r, NULL, &f))
		return; /* no memory for the fence: leave it mapped, a later pass retries */
	free_unlink(p, run);
	/* The chunks have been idle since the run was freed: they carry that into the device's cache. */
	for (size_t g = run->start; g < run->start + run->len; g++)
		if (p->r.slot[g].chunk)
			p->r.slot[g].chunk->freed_ns = run->freed_ns;
	cvm_region_unmap_locked(&p->r, run->start, run->len, f);
	run->kind = CVM_RUN_VA;
	run->epoch = 0;
	bin_insert(p, run);
	coalesce(p, run);
}

/* Turn a USED or SLAB run into FREE after a free, fenced by `ev` on `stream` or by the device epoch. */
static void run_release(struct cuvmm_pool *p, struct cvm_run *run, CUstream stream, cvm_event ev)
{
	fp_add(p, run->len, false);
	run->kind = CVM_RUN_FREE;
	run->bytes = 0;
	run->slab = NULL;
	run->freed_ns = cvm_now_ns();
	run->stream = ev ? stream : NULL;
	run->ev = ev;
	run->epoch = ev ? 0 : atomic_load(&p->r.dev->epoch);
	free_link(p, run);
	coalesce(p, run);
}

/*
 * The slack (FREE runs, plus the device's cached chunks) allowed before memory is given back early: enough
 * to refill the footprint (plus `extra` bytes about to be mapped) up to its recent peak plus a quarter of
 * it, and at least 8 granules. Next fit keeps the slack a working pool needs at a few percent of its
 * footprint, so the cap binds only where the load has fallen (held follows it down without waiting for the
 * release delay) or in a pathological pattern. A tighter cap was measured to cost more than it saves:
 * slack unmapped to stay under it leaves holes the sweep cannot merge across, each later allocation that
 * misses moves memory again, and on the KV trace both held and the driver calls went up (design.md).
 */
#define CVM_SLACK_SHIFT 2

static size_t slack_cap_after(struct cuvmm_pool *p, size_t extra)
{
	size_t peak = p->win_peak > p->prev_peak ? p->win_peak : p->prev_peak, fp = p->fp + extra, floor = gbytes(p, 8);
	size_t cap;

	if (fp > peak)
		peak = fp;
	cap = peak + (peak >> CVM_SLACK_SHIFT) - fp;
	return cap > floor ? cap : floor;
}

static size_t slack_cap(struct cuvmm_pool *p)
{
	return slack_cap_after(p, 0);
}

static void live_add(struct cuvmm_pool *p, int64_t delta)
{
	p->live += (size_t)delta;
	cvm_acct_live(&p->pacct, delta);
}

/* A run starts or stops holding allocations. */
static void fp_add(struct cuvmm_pool *p, size_t granules, bool add)
{
	if (add) {
		p->fp += gbytes(p, granules);
		if (p->fp > p->win_peak)
			p->win_peak = p->fp;
	} else {
		p->fp -= gbytes(p, granules);
	}
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
static unsigned large_cls(size_t k)
{
	unsigned cls = 63 - (unsigned)__builtin_clzll(k / 16);

	return cls < CVM_POOL_MAX_CLS ? cls : CVM_POOL_MAX_CLS;
}

static unsigned fresh_cls(size_t k)
{
	return k < CVM_POOL_BIG ? 0 : large_cls(k);
}

/* Map k granules of fresh address space, aligned so that its large chunks sit on their own alignment;
 * returns the new run (edges set, in no index). */
static int map_fresh(struct cuvmm_pool *p, size_t k, struct cvm_run **out)
{
	unsigned cls = fresh_cls(k);
	size_t align = (size_t)1 << cls, lead;
	size_t i = cvm_seg_first(&p->vseg, 0, (uint32_t)(k + align - 1));
	struct cvm_run *va, *run, *front;
	int err;

	/* The lowest free address space: the pool's memory stays packed at the start of its range, and new
	 * memory lands where the sweep (next_fit) reaches it next. */
	if (i == CVM_SEG_NONE) {
		cls = 0;
		align = 1;
		i = cvm_seg_first(&p->vseg, 0, (uint32_t)k);
		if (i == CVM_SEG_NONE)
			return CUVMM_ENOSPC;
	}
	va = p->edge[i];
	bin_remove(p, va);
	/* Alignment for the run's large chunks stays VA. */
	lead = ((va->start + align - 1) & ~(align - 1)) - va->start;
	if (lead) {
		/* The unaligned head stays VA. */
		front = split_front(p, va, lead);
		if (!front) {
			bin_insert(p, va);
			return CUVMM_ENOMEM;
		}
		bin_insert(p, front);
	}
	run = split_front(p, va, k);
	if (!run) {
		bin_insert(p, va);
		coalesce(p, va);
		return CUVMM_ENOMEM;
	}
	if (run != va)
		bin_insert(p, va);
	err = cvm_region_map_locked(&p->r, run->start, k, cls);
	if (err) {
		run->kind = CVM_RUN_VA;
		bin_insert(p, run);
		coalesce(p, run);
		return err;
	}
	*out = run;
	return CUVMM_OK;
}

/* Unmap every safe FREE run (sync first, without the lock, if some are fenced by the device epoch) and
 * release the device's cached chunks: the answer to running out of memory. CUVMM_ESTATE (nothing done)
 * when the pool was put to sleep while the lock was dropped: the allocation must not map into it. */
static int drop_slack(struct cuvmm_pool *p)
{
	struct cvm_run *run, *next;

	pthread_mutex_unlock(&p->r.lock);
	cvm_dev_sync_epoch(p->r.dev);
	pthread_mutex_lock(&p->r.lock);
	if (p->r.sleep)
		return CUVMM_ESTATE;
	settle_pending(p, INT32_MAX);
	for (run = p->age.lnext; run != &p->age; run = next) {
		next = run->lnext;
		if (cvm_dev_epoch_safe(p->r.dev, run->epoch))
			free_to_va(p, run);
	}
	cvm_region_process_locked(&p->r, cvm_now_ns(), false);
	cvm_phys_reclaim(&p->r.dev->phys, cvm_now_ns(), true, 0);
	return CUVMM_OK;
}

/* Unmap the oldest FREE runs that are safe to unmap (no device sync here) while the slack exceeds its
 * cap; their chunks go to the device's cache, where map_fresh finds them. */
static bool steal_slack(struct cuvmm_pool *p, size_t cap)
{
	struct cvm_run *run, *next;
	bool unsafe = false;

	for (run = p->age.lnext; run != &p->age && p->free_bytes > cap; run = next) {
		next = run->lnext;
		if (cvm_dev_epoch_safe(p->r.dev, run->epoch))
			free_to_va(p, run);
		else
			unsafe = true;
	}
	if (p->r.npending)
		cvm_region_process_locked(&p->r, cvm_now_ns(), false);
	return unsafe;
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

	bin_remove(p, va);
	if (after) {
		piece = split_front(p, va, lack);
	} else {
		piece = va->len == lack ? va : split_front(p, va, va->len - lack);
		if (piece && piece != va) {
			/* split_front returned the part away from the run: swap roles */
			struct cvm_run *t = piece;

			piece = va;
			va = t;
		}
	}
	if (!piece) {
		bin_insert(p, va);
		return CUVMM_ENOMEM;
	}
	if (piece != va)
		bin_insert(p, va);
	err = cvm_region_map_locked(&p->r, piece->start, lack, fresh_cls(lack));
	if (err) {
		bin_insert(p, piece);
		coalesce(p, piece);
		return err;
	}
	/* One run of k granules: the FREE run and the piece. */
	free_unlink(p, run);
	edges_clear(p, run);
	edges_clear(p, piece);
	if (!after)
		run->start = piece->start;
	run->len = k;
	edges_set(p, run);
	free(piece);
	cvm_region_event_put_locked(&p->r, run->ev);
	run->ev = NULL;
	run->stream = NULL;
	*out = run;
	return CUVMM_OK;
}

static int compose_fit(struct cuvmm_pool *p, size_t k, CUstream stream, struct cvm_run **out)
{
	struct cvm_run *best = NULL, *bva = NULL;
	bool bafter = false;
	int scanned = 0;

	for (int b = (int)bin_of(k); b >= 0 && scanned < 64; b--) {
		if (!(p->free.nonempty[b / 64] & ((uint64_t)1 << (b % 64))))
			continue;
		for (struct cvm_run *run = p->free.head[b]; run && scanned < 64; run = run->bnext, scanned++) {
			size_t end = run->start + run->len;
			struct cvm_run *right = end < p->r.npages ? p->edge[end] : NULL;
			struct cvm_run *left = run->start ? p->edge[run->start - 1] : NULL;

			if (run->len >= k || (best && run->len <= best->len) || !free_usable(p, run, stream))
				continue;
			if (right && right->kind == CVM_RUN_VA && right->len >= k - run->len)
				best = run, bva = right, bafter = true;
			else if (left && left->kind == CVM_RUN_VA && left->len >= k - run->len)
				best = run, bva = left, bafter = false;
		}
		if (best)
			break; /* bins hold longer runs than the ones below them */
	}
	return best ? compose_map(p, best, bva, bafter, k, out) : CUVMM_ENOSPC;
}

/*
 * A run of k granules for a large allocation or a slab (`ring` false: best fit, so that slabs fill the
 * small holes), from FREE memory if possible. The rover moves to its start: the next search begins there,
 * so memory freed right there (a request that finished) is found without a lap of the pool.
 */
static int get_run(struct cuvmm_pool *p, size_t k, CUstream stream, bool ring, struct cvm_run **out)
{
	size_t take, cap;
	struct cvm_run *run = ring ? next_fit(p, k, &take) : NULL, *front;
	int err;

	if (!run)
		run = best_fit(p, k, stream, &take); /* pending runs usable on `stream` too */
	if (run) {
		free_unlink(p, run);
		front = split_front(p, run, take);
		if (!front) {
			free_link(p, run);
			return CUVMM_ENOMEM;
		}
		if (front != run) {
			free_link(p, run); /* the rest stays FREE, with its fence */
		} else {
			cvm_region_event_put_locked(&p->r, run->ev);
		}
		front->ev = NULL;
		front->stream = NULL;
		*out = front;
		goto found;
	}
	if (k > 1) {
		err = compose_fit(p, k, stream, out);
		if (!err)
			goto found;
		/* Out of memory for the few granules it lacked: all k elsewhere would not fit either. */
		if (err == CUVMM_ENOMEM && drop_slack(p))
			return CUVMM_ESTATE;
	}
	/* Slack beyond its cap is unmapped by the reclaim pass, without the pool's lock, while the allocating
	 * thread only maps. When the pass falls behind (the cap and 64 MiB more), the allocating thread
	 * moves slack itself: an unmap and a map cost about what a create and a map do, and held stays where
	 * it was. */
	cap = slack_cap_after(p, gbytes(p, k));
	if (p->free_bytes > cap && steal_slack(p, cap) && p->free_bytes > cap + ((size_t)64 << 20)) {
		/* What is left waits only for a device synchronisation (memory freed without a stream): do it
		 * here, as cudaFree always does, rather than let held grow by more than 64 MiB past the cap. */
		pthread_mutex_unlock(&p->r.lock);
		cvm_dev_sync_epoch(p->r.dev);
		pthread_mutex_lock(&p->r.lock);
		if (p->r.sleep)
			return CUVMM_ESTATE; /* put to sleep meanwhile */
		steal_slack(p, slack_cap_after(p, gbytes(p, k)));
	}
	err = map_fresh(p, k, out);
	if (err == CUVMM_ENOMEM && p->free_bytes + cvm_phys_cached(&p->r.dev->phys)) {
		err = drop_slack(p);
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

/* ----- packed allocations (pack.h): the pool gives the packer chunks and takes back the empty ones ----- */

#define CVM_PACKED UINT32_MAX /* cvm_dfree.cls of a packed allocation freed on a stream */

/* May the packer extend over granules [g, g + n): the start of a VA run or of a settled FREE run of small
 * chunks, at least n long? */
static bool pack_avail(void *arg, size_t g, size_t n)
{
	struct cuvmm_pool *p = arg;
	struct cvm_run *run = p->edge[g];

	if (!run || run->start != g || run->len < n)
		return false;
	/* Fresh memory only while the pool has no slack: where memory is being freed (a KV cache growing
	 * buffers), the bump would map ahead while FREE memory piles up behind it; get_run reuses it. */
	if (run->kind == CVM_RUN_VA)
		return p->free_bytes == 0;
	return run->kind == CVM_RUN_FREE && !run->ev && cut_len(p, run, n) == n;
}

/* Make `run` (mapped, edges set, in no index) the packer's: one PACK run per chunk, so that each goes back
 * alone once empty. On failure (no memory for the bookkeeping) it is FREE memory again. */
static int pack_own(struct cuvmm_pool *p, struct cvm_run *run)
{
	struct cvm_run *front;

	run->kind = CVM_RUN_PACK;
	fp_add(p, run->len, true);
	for (;;) {
		size_t span = cvm_span(&p->r, p->r.slot[run->start].chunk);

		if (span >= run->len)
			return CUVMM_OK;
		front = split_front(p, run, span);
		if (!front) {
			run_release(p, run, NULL, NULL);
			return CUVMM_ENOMEM;
		}
	}
}

/* Take granules [g, g + n) for the packer: a VA run is mapped, a FREE run taken as it is (pack_avail). */
static int pack_take(struct cuvmm_pool *p, size_t g, size_t n)
{
	struct cvm_run *run = p->edge[g], *piece;
	int err;

	if (run->kind == CVM_RUN_VA) {
		bin_remove(p, run);
		piece = split_front(p, run, n);
		if (!piece) {
			bin_insert(p, run);
			return CUVMM_ENOMEM;
		}
		if (piece != run)
			bin_insert(p, run);
		err = cvm_region_map_locked(&p->r, g, n, 0);
		if (err) {
			piece->kind = CVM_RUN_VA;
			bin_insert(p, piece);
			coalesce(p, piece);
			return err;
		}
	} else {
		free_unlink(p, run);
		piece = split_front(p, run, n);
		if (!piece) {
			free_link(p, run);
			return CUVMM_ENOMEM;
		}
		if (piece != run)
			free_link(p, run);
	}
	return pack_own(p, piece);
}

/* Give the wholly empty PACK runs of granules [g0, g0 + n) back as one FREE run, fenced by the device epoch,
 * or settled (`settled`: a stream free whose event has completed). */
static void pack_give_back(struct cuvmm_pool *p, size_t g0, size_t n, bool settled)
{
	struct cvm_run *run = NULL, *next;
	size_t g = g0;

	/* The run holding g0 may start before it (a chunk of several granules). */
	while (!p->edge[g] || (p->edge[g]->start != g && p->edge[g]->start + p->edge[g]->len - 1 != g))
		g--;
	g = p->edge[g]->start;
	for (; g < g0 + n; g = next->start + next->len) {
		bool empty = true;

		next = p->edge[g];
		for (size_t i = g; i < g + next->len && empty; i++)
			empty = !cvm_pack_holds(&p->pack, i);
		if (!empty)
			continue; /* a chunk still partly live (the first or the last) */
		if (!run) {
			run = next;
			continue;
		}
		edges_clear(p, run);
		edges_clear(p, next);
		run->len += next->len;
		edges_set(p, run);
		free(next);
		next = run;
	}
	if (!run)
		return;
	/* As run_release, but a stream free whose event has completed needs no device synchronisation. */
	fp_add(p, run->len, false);
	run->kind = CVM_RUN_FREE;
	run->freed_ns = cvm_now_ns();
	run->epoch = settled ? 0 : atomic_load(&p->r.dev->epoch);
	free_link(p, run);
	coalesce(p, run);
}

/* Take a packed allocation out of the packer and give back the granules it emptied. */
static void pack_release(struct cuvmm_pool *p, struct cvm_pack_alloc *x, bool settled)
{
	size_t g0, n;

	cvm_pack_remove(&p->pack, x, &g0, &n);
	free(x);
	if (n)
		pack_give_back(p, g0, n, settled);
}

static int pack_alloc(struct cuvmm_pool *p, size_t bytes, void **ptr)
{
	struct cvm_pack_alloc *x = calloc(1, sizeof(*x));
	struct cvm_pack_plan plan;
	struct cvm_run *run;
	int err = CUVMM_OK;

	if (!x)
		return CUVMM_ENOMEM;
	x->len = cvm_pack_len(bytes);
	x->bytes = bytes;
	cvm_pack_plan(&p->pack, x->len, pack_avail, p, &plan);
	if (!plan.fresh && plan.ng && pack_take(p, plan.g0, plan.ng))
		plan.fresh = true; /* out of memory for the bump: the way every allocation goes */
	if (plan.fresh) {
		/* Not a stream's: other allocations will share its granules. */
		err = get_run(p, plan.ng, NULL, true, &run);
		if (!err) {
			plan.off = gbytes(p, run->start);
			err = pack_own(p, run); /* (run is its last chunk's afterwards) */
		}
		if (err) {
			free(x);
			return err;
		}
	}
	x->off = plan.off;
	cvm_pack_insert(&p->pack, x, plan.fresh || plan.ng);
	live_add(p, (int64_t)bytes);
	*ptr = (void *)(p->r.base + x->off);
	return CUVMM_OK;
}

/* ----- small allocations ----- */

static void partial_insert(struct cuvmm_pool *p, struct cvm_slab *s)
{
	s->prev = NULL;
	s->next = p->partial[s->cls];
	if (s->next)
		s->next->prev = s;
	p->partial[s->cls] = s;
}

static void partial_remove(struct cuvmm_pool *p, struct cvm_slab *s)
{
	if (s->prev)
		s->prev->next = s->next;
	else
		p->partial[s->cls] = s->next;
	if (s->next)
		s->next->prev = s->prev;
	s->next = s->prev = NULL;
}

static int slab_new(struct cuvmm_pool *p, unsigned cls, struct cvm_slab **out)
{
	size_t size = class_size(cls), nslots = p->r.gran / size, words = (nslots + 63) / 64;
	struct cvm_slab *s = calloc(1, sizeof(*s) + 2 * words * sizeof(uint64_t));
	struct cvm_run *run;
	int err;

	if (!s)
		return CUVMM_ENOMEM;
	/* A slab serves every stream: its granule must not be pending on any (hence no stream here). */
	err = get_run(p, 1, NULL, false, &run);
	if (err) {
		free(s);
		return err;
	}
	s->taken = (uint64_t *)(s + 1);
	s->live = s->taken + words;
	s->cls = cls;
	s->size = (uint32_t)size;
	s->nslots = (uint32_t)nslots;
	s->navail = (uint32_t)nslots;
	s->run = run;
	run->kind = CVM_RUN_SLAB;
	run->slab = s;
	fp_add(p, 1, true);
	partial_insert(p, s);
	*out = s;
	return CUVMM_OK;
}

static void *slab_take(struct cuvmm_pool *p, struct cvm_slab *s)
{
	uint32_t words = (s->nslots + 63) / 64;

	for (uint32_t i = 0; i < words; i++) {
		uint32_t w = (s->hint + i) % words;
		uint64_t freebits = ~s->taken[w];
		uint32_t bit;

		if (w == words - 1 && s->nslots % 64)
			freebits &= ((uint64_t)1 << (s->nslots % 64)) - 1;
		if (!freebits)
			continue;
		bit = (uint32_t)__builtin_ctzll(freebits);
		s->taken[w] |= (uint64_t)1 << bit;
		s->live[w] |= (uint64_t)1 << bit;
		s->hint = w;
		if (--s->navail == 0)
			partial_remove(p, s);
		return (void *)(p->r.base + (s->run->start << p->r.gshift) + (size_t)(w * 64 + bit) * s->size);
	}
	return NULL; /* not reached: navail said there was a slot */
}

/* Make a taken slot available again; an empty slab gives its granule back as FREE memory. */
static void slab_put(struct cuvmm_pool *p, struct cvm_slab *s, uint32_t slot)
{
	s->taken[slot / 64] &= ~((uint64_t)1 << (slot % 64));
	if (s->navail++ == 0)
		partial_insert(p, s);
	if (s->navail == s->nslots) {
		struct cvm_run *run = s->run;

		partial_remove(p, s);
		free(s);
		run_release(p, run, NULL, NULL);
	}
}

static void dq_remove(struct cuvmm_pool *p, struct cvm_dfree *prev, struct cvm_dfree *d)
{
	if (prev)
		prev->next = d->next;
	else
		p->dq_head = d->next;
	if (p->dq_tail == d)
		p->dq_tail = prev;
	p->ndq--;
}

/* The slab and slot of a pointer into a SLAB run, or NULL. */
static struct cvm_slab *slab_of(struct cuvmm_pool *p, uintptr_t a, uint32_t *slot)
{
	size_t g = (a - p->r.base) >> p->r.gshift;
	struct cvm_run *run = p->edge[g];
	size_t off;

	if (!run || run->kind != CVM_RUN_SLAB || run->start != g)
		return NULL;
	off = a - (p->r.base + (g << p->r.gshift));
	if (off % run->slab->size)
		return NULL;
	*slot = (uint32_t)(off / run->slab->size);
	return *slot < run->slab->nslots ? run->slab : NULL;
}

/* Complete small stream frees whose events are done (oldest first, at most `max` looked at). */
static void dq_drain(struct cuvmm_pool *p, int max)
{
	struct cvm_dfree *prev = NULL, *d = p->dq_head, *next;

	for (; d && max-- > 0; d = next) {
		uint32_t slot;
		struct cvm_slab *s;

		next = d->next;
		if (cvm_drv_event_done(CVM_DRV(p->r.dev), p->r.dev->index, d->ev) <= 0) {
			prev = d;
			continue;
		}
		dq_remove(p, prev, d);
		if (d->cls == CVM_PACKED) {
			pack_release(p, cvm_pack_find(&p->pack, (uintptr_t)d->ptr - p->r.base), true);
		} else {
			s = slab_of(p, (uintptr_t)d->ptr, &slot);
			slab_put(p, s, slot);
		}
		cvm_region_event_put_locked(&p->r, d->ev);
		free(d);
	}
}

static int small_alloc(struct cuvmm_pool *p, size_t bytes, CUstream stream, void **ptr)
{
	unsigned cls = small_class(bytes);
	struct cvm_dfree *prev = NULL, *d = p->dq_head;
	struct cvm_slab *s;
	int err, n = 0;

	/* Stream-ordered reuse: a slot freed on this very stream is ready for it now. */
	for (; stream && d && n < CVM_DQ_SCAN; prev = d, d = d->next, n++) {
		uint32_t slot;

		if (d->stream != stream || d->cls != cls)
			continue;
		dq_remove(p, prev, d);
		s = slab_of(p, (uintptr_t)d->ptr, &slot);
		s->live[slot / 64] |= (uint64_t)1 << (slot % 64);
		*ptr = d->ptr;
		cvm_region_event_put_locked(&p->r, d->ev);
		free(d);
		live_add(p, (int64_t)class_size(cls));
		return CUVMM_OK;
	}
	s = p->partial[cls];
	if (!s) {
		err = slab_new(p, cls, &s);
		if (err)
			return err;
	}
	*ptr = slab_take(p, s);
	live_add(p, (int64_t)class_size(cls));
	return CUVMM_OK;
}

/* ----- public API ----- */

void cuvmm_pool_config_init(struct cuvmm_pool_config *cfg)
{
	if (!cfg)
		return;
	memset(cfg, 0, sizeof(*cfg));
	cfg->size = sizeof(*cfg);
}

static uint64_t pool_reclaim(struct cvm_client *c, uint64_t now, bool force);

static void pool_client_destroy(struct cvm_client *c)
{
	cuvmm_pool_destroy((struct cuvmm_pool *)c);
}

static void pool_client_stats(struct cvm_client *c, struct cuvmm_stats *out, const char **name)
{
	struct cuvmm_pool *p = (struct cuvmm_pool *)c;

	cuvmm_pool_stats(p, out);
	*name = p->name;
}

static const struct cvm_client_ops pool_ops = {.reclaim = pool_reclaim, .stats = pool_client_stats, .kind = "pool"};

int cuvmm_pool_create(struct cuvmm_ctx *ctx, const struct cuvmm_pool_config *cfg, struct cuvmm_pool **out)
{
	struct cuvmm_pool_config defaults;
	struct cuvmm_pool *p;
	struct cvm_dev *dev;
	struct cvm_run *va;
	size_t max;
	int err;

	if (!ctx || !out)
		return CUVMM_EINVAL;
	if (!cfg) {
		cuvmm_pool_config_init(&defaults);
		cfg = &defaults;
	}
	if (cfg->size < sizeof(*cfg))
		return CUVMM_EINVAL;
	err = cvm_ctx_dev(ctx, cfg->device, &dev);
	if (err)
		return err;
	max = cfg->max_bytes;
	if (!max) {
		/* Address space is plentiful: twice the memory a pool could ever hold, so fragmentation of
		 * address space never runs it out before physical memory does. */
		max = dev->phys.limit < (SIZE_MAX >> 2) ? 2 * dev->phys.limit : dev->phys.limit;
		if (max < ((size_t)1 << 30))
			max = (size_t)1 << 30;
	}
	p = calloc(1, sizeof(*p));
	if (!p)
		return CUVMM_ENOMEM;
	err = cvm_region_init(&p->r, ctx, cfg->device, max, 0);
	if (err) {
		free(p);
		return err;
	}
	p->r.acct.live_private = true;
	p->pacct.parent = &dev->acct;
	snprintf(p->name, sizeof(p->name), "%s", cfg->name ? cfg->name : "pool");
	p->edge = calloc(p->r.npages, sizeof(*p->edge));
	va = calloc(1, sizeof(*va));
	if (!p->edge || !va || cvm_seg_init(&p->vseg, p->r.npages) || cvm_seg_init(&p->fseg, p->r.npages) ||
	    cvm_pack_init(&p->pack, p->r.npages, p->r.gshift)) {
		cvm_seg_fini(&p->vseg);
		cvm_seg_fini(&p->fseg);
		cvm_pack_fini(&p->pack);
		free(va);
		free(p->edge);
		cvm_region_fini(&p->r);
		free(p);
		return CUVMM_ENOMEM;
	}
	list_init(&p->age);
	list_init(&p->pend);
	va->start = 0;
	va->len = p->r.npages;
	va->kind = CVM_RUN_VA;
	edges_set(p, va);
	bin_insert(p, va);
	p->small_max = p->r.gran / 4 < CVM_SMALL_LIMIT ? p->r.gran / 4 : CVM_SMALL_LIMIT;
	if (p->small_max < 256)
		p->small_max = 0;
	p->nsmall = p->small_max ? small_class(p->small_max) + 1 : 0;
	p->pack_max = p->small_max ? (size_t)CVM_PACK_MAX_GRANULES << p->r.gshift : 0;
	p->win_start = cvm_now_ns();
	p->client.ops = &pool_ops;
	p->client.dev = dev;
	p->client.destroy = pool_client_destroy;
	cvm_ctx_add_client(ctx, &p->client);
	*out = p;
	return CUVMM_OK;
}

void cuvmm_pool_destroy(struct cuvmm_pool *p)
{
	if (!p)
		return;
	cvm_ctx_remove_client(p->r.ctx, &p->client);
	cvm_graph_forget_pool(p->r.ctx, p);
	pthread_mutex_lock(&p->r.lock);
	if (p->live)
		cvm_warn("pool \"%s\" destroyed with %zu bytes still allocated", p->name, p->live);
	cvm_acct_live(&p->pacct, -(int64_t)p->live);
	while (p->dq_head) {
		struct cvm_dfree *d = p->dq_head;

		p->dq_head = d->next;
		cvm_region_event_put_locked(&p->r, d->ev);
		free(d);
	}
	for (size_t g = 0; g < p->r.npages;) {
		struct cvm_run *run = p->edge[g];
		size_t len = run->len;

		if (run->kind == CVM_RUN_SLAB)
			free(run->slab);
		cvm_region_event_put_locked(&p->r, run->ev);
		free(run);
		g += len;
	}
	pthread_mutex_unlock(&p->r.lock);
	/* Whatever was freed without a stream may still be in use by the GPU until the device is idle. */
	cvm_dev_sync(p->r.dev);
	cvm_region_fini(&p->r);
	cvm_seg_fini(&p->vseg);
	cvm_seg_fini(&p->fseg);
	cvm_pack_fini(&p->pack);
	free(p->edge);
	free(p);
}

/* The allocation itself. `stream` NULL: no stream-ordered reuse (also under capture, see pool_malloc). */
static int pool_alloc(struct cuvmm_pool *p, size_t bytes, CUstream stream, void **ptr)
{
	struct cvm_run *run;
	size_t k;
	int err;

	pthread_mutex_lock(&p->r.lock);
	if (p->r.sleep) {
		err = CUVMM_ESTATE;
		goto out;
	}
	if (p->ndq)
		dq_drain(p, 4);
	if (p->pend.lnext != &p->pend)
		settle_pending(p, 4);
	if (bytes <= p->small_max) {
		err = small_alloc(p, bytes, stream, ptr);
		goto out;
	}
	if (bytes <= p->pack_max) {
		err = pack_alloc(p, bytes, ptr);
		goto out;
	}
	k = (bytes + p->r.gran - 1) >> p->r.gshift;
	err = get_run(p, k, stream, true, &run);
	if (err)
		goto out;
	run->kind = CVM_RUN_USED;
	run->bytes = bytes;
	fp_add(p, run->len, true);
	live_add(p, (int64_t)bytes);
	*ptr = (void *)(p->r.base + (run->start << p->r.gshift));
out:
	pthread_mutex_unlock(&p->r.lock);
	cvm_ctx_poll(p->r.ctx);
	return err;
}

/* The bytes the pool counts for a live allocation at `a` (a large one's size, a small one's class), or 0 if `a`
 * is not one. Lock held. */
static size_t live_bytes_locked(struct cuvmm_pool *p, uintptr_t a)
{
	size_t g = (a - p->r.base) >> p->r.gshift;
	struct cvm_run *run = p->edge[g];
	struct cvm_pack_alloc *x = cvm_pack_find(&p->pack, a - p->r.base);
	struct cvm_slab *s;
	uint32_t slot;

	if (x)
		return x->pending ? 0 : x->bytes;
	if (run && run->kind == CVM_RUN_SLAB) {
		s = slab_of(p, a, &slot);
		return s && (s->live[slot / 64] & ((uint64_t)1 << (slot % 64))) ? s->size : 0;
	}
	if (!run || run->kind != CVM_RUN_USED || run->start != g || (a & (p->r.gran - 1)))
		return 0;
	return run->bytes;
}

/*
 * Under stream capture (graph.h): memory the capture freed is reused inside its graph pool first; otherwise
 * the pool serves it, with no stream-ordered reuse of memory freed on the capturing stream before the capture
 * began (the graph's replays run later, maybe elsewhere: only memory whose freeing work has completed is
 * taken), and the graph pool owns the result.
 */
static int pool_malloc(struct cuvmm_pool *p, size_t bytes, CUstream stream, void **ptr)
{
	uint64_t cap = 0;
	void *q;
	int err;

	if (!p || !ptr || bytes == 0 || bytes > p->r.size)
		return bytes > 0 && p && ptr ? CUVMM_ENOSPC : CUVMM_EINVAL;
	err = cvm_drv_capture_id(CVM_DRV(p->r.dev), p->r.dev->index, stream, &cap);
	if (err)
		return err;
	if (!cap) {
		cvm_graph_not_capturing(p->r.ctx, stream);
		return pool_alloc(p, bytes, stream, ptr);
	}
	if (cvm_graph_take(p->r.ctx, p, stream, cap, bytes, ptr))
		return CUVMM_OK;
	err = pool_alloc(p, bytes, NULL, &q);
	if (err)
		return err;
	pthread_mutex_lock(&p->r.lock);
	bytes = live_bytes_locked(p, (uintptr_t)q);
	pthread_mutex_unlock(&p->r.lock);
	err = cvm_graph_own(p->r.ctx, p, stream, cap, q, bytes);
	if (err) {
		cuvmm_free(p, q);
		return err;
	}
	*ptr = q;
	return CUVMM_OK;
}

int cuvmm_malloc(struct cuvmm_pool *p, size_t bytes, void **ptr)
{
	return pool_malloc(p, bytes, NULL, ptr);
}

int cuvmm_malloc_async(struct cuvmm_pool *p, size_t bytes, CUstream stream, void **ptr)
{
	return pool_malloc(p, bytes, stream, ptr);
}

static int pool_free(struct cuvmm_pool *p, void *ptr, CUstream stream, bool async)
{
	uintptr_t a = (uintptr_t)ptr;
	struct cvm_pack_alloc *x;
	struct cvm_run *run;
	struct cvm_slab *s;
	cvm_event ev = NULL;
	uint64_t cap = 0;
	uint32_t slot;
	size_t g;
	int err = CUVMM_OK;
	bool kick;

	if (!p)
		return CUVMM_EINVAL;
	if (!ptr)
		return CUVMM_OK;
	if (a < p->r.base || a >= p->r.base + p->r.size || (a & 255))
		return CUVMM_EINVAL;
	if (async && stream) {
		err = cvm_drv_capture_id(CVM_DRV(p->r.dev), p->r.dev->index, stream, &cap);
		if (err)
			return err;
		if (!cap)
			cvm_graph_not_capturing(p->r.ctx, stream);
	}
	if (cap || cvm_graph_maybe(&p->r.ctx->graphs)) {
		/* Graph memory stays with its graph pool; memory freed under capture joins it. */
		size_t bytes = 0;

		if (cap) {
			pthread_mutex_lock(&p->r.lock);
			bytes = p->r.sleep ? 0 : live_bytes_locked(p, a);
			err = p->r.sleep ? CUVMM_ESTATE : CUVMM_OK;
			pthread_mutex_unlock(&p->r.lock);
			if (err)
				return err;
		}
		/* Under capture it always decides (1 or an error); outside, 0 leaves the free to the pool. */
		err = cvm_graph_free(p->r.ctx, p, ptr, stream, cap, bytes);
		if (err)
			return err > 0 ? CUVMM_OK : err;
	}
	g = (a - p->r.base) >> p->r.gshift;
	pthread_mutex_lock(&p->r.lock);
	if (p->r.sleep) {
		err = CUVMM_ESTATE;
		goto out;
	}
	if (!live_bytes_locked(p, a)) {
		err = CUVMM_EINVAL; /* not an allocation of this pool, or freed already */
		goto out;
	}
	x = cvm_pack_find(&p->pack, a - p->r.base);
	run = p->edge[g];
	s = !x && run->kind == CVM_RUN_SLAB ? slab_of(p, a, &slot) : NULL;
	if (async && stream) {
		/* Fence the free on the stream; on failure nothing has changed yet. */
		err = cvm_region_event_get_locked(&p->r, &ev);
		if (!err) {
			/* cap is 0: the stream was seen not capturing above. */
			err = cvm_drv_event_record_uncaptured(CVM_DRV(p->r.dev), p->r.dev->index, ev, stream);
			if (err)
				cvm_region_event_put_locked(&p->r, ev);
		}
		if (err)
			goto out;
	}
	if (s || x) {
		/* A slot, or a packed allocation: its bytes share a granule with others, so a free on a stream
		 * keeps them taken until its event completes (dq_drain). */
		if (s)
			s->live[slot / 64] &= ~((uint64_t)1 << (slot % 64));
		live_add(p, -(int64_t)(s ? s->size : x->bytes));
		if (ev) {
			struct cvm_dfree *d = malloc(sizeof(*d));

			if (!d) {
				/* No memory to remember the fence: wait for it instead. */
				cvm_drv_event_sync(CVM_DRV(p->r.dev), p->r.dev->index, ev);
				cvm_region_event_put_locked(&p->r, ev);
				if (s)
					slab_put(p, s, slot);
				else
					pack_release(p, x, true);
			} else {
				if (x)
					x->pending = true;
				d->next = NULL;
				d->ptr = ptr;
				d->cls = s ? s->cls : CVM_PACKED;
				d->stream = stream;
				d->ev = ev;
				if (p->dq_tail)
					p->dq_tail->next = d;
				else
					p->dq_head = d;
				p->dq_tail = d;
				p->ndq++;
			}
		} else if (s) {
			slab_put(p, s, slot);
		} else {
			pack_release(p, x, false);
		}
	} else {
		live_add(p, -(int64_t)run->bytes);
		run_release(p, run, stream, ev);
	}
out:
	kick = !err && p->free_bytes > slack_cap(p);
	if (kick && !async)
		atomic_store_explicit(&p->want_sync, true, memory_order_relaxed);
	/* (the cache is counted by the pass itself; reading it here would take the device mutex) */
	pthread_mutex_unlock(&p->r.lock);
	if (kick)
		cvm_ctx_kick(p->r.ctx, cvm_now_ns());
	else if (!err)
		cvm_ctx_kick_freed(p->r.ctx, cvm_now_ns());
	cvm_ctx_poll(p->r.ctx);
	return err;
}

int cuvmm_free(struct cuvmm_pool *p, void *ptr)
{
	return pool_free(p, ptr, NULL, false);
}

int cuvmm_free_async(struct cuvmm_pool *p, void *ptr, CUstream stream)
{
	return pool_free(p, ptr, stream, true);
}

/*
 * The reclaim pass: settle stream frees whose work has completed, then unmap FREE runs that have been
 * free for the release delay (all of them, with force), and the oldest ones while the slack exceeds its
 * cap. Runs fenced by the device epoch need a device synchronisation first, done without the lock.
 * Returns when the next run expires.
 */
/*
 * Unmap the chunks of detached (GOING) runs with the pool's lock dropped: allocations go on meanwhile, and
 * nothing else touches these granules. Called with the lock held; returns with it held. The chunks keep
 * their idle time into the device's cache; a chunk the driver refused stays mapped, DONE, for the region's
 * retry. The runs become VA.
 */
static void unmap_going(struct cuvmm_pool *p, struct cvm_run *going)
{
	struct cuvmm_region *r = &p->r;
	struct cvm_drv *d = CVM_DRV(r->dev);
	struct cvm_run *run;
	size_t n = 0, i;
	struct { size_t g; struct cvm_chunk *c; uint64_t since; int err; } *v;

	for (run = going; run; run = run->lnext)
		for (size_t g = run->start; g < run->start + run->len; g += cvm_span(r, r->slot[g].chunk))
			n++;
	v = malloc((n ? n : 1) * sizeof(*v));
	if (!v) {
		/* No memory for the list: unmap them the slow way, under the lock. */
		for (run = going; run; run = going) {
			going = run->lnext;
			run->kind = CVM_RUN_FREE;
			p->going--;
			free_link(p, run);
			free_to_va(p, run);
		}
		return;
	}
	i = 0;
	for (run = going; run; run = run->lnext)
		for (size_t g = run->start; g < run->start + run->len; g += cvm_span(r, r->slot[g].chunk)) {
			v[i].g = g;
			v[i].c = r->slot[g].chunk;
			v[i].since = run->freed_ns;
			i++;
		}
	pthread_mutex_unlock(&r->lock);
	for (i = 0; i < n; i++)
		v[i].err = cvm_drv_unmap(d, &r->cnt, r->dev->index, r->base + (v[i].g << r->gshift), v[i].c->size);
	pthread_mutex_lock(&r->lock);
	for (i = 0; i < n; i++) {
		size_t span = cvm_span(r, v[i].c);

		cvm_acct_live(&r->acct, -(int64_t)(span << r->gshift));
		if (v[i].err) {
			for (size_t j = 0; j < span; j++)
				r->slot[v[i].g + j].state = CVM_SLOT_DONE;
			r->npending += span;
			continue;
		}
		for (size_t j = 0; j < span; j++) {
			r->slot[v[i].g + j].chunk = NULL;
			r->slot[v[i].g + j].state = CVM_SLOT_UNMAPPED;
		}
		cvm_acct_map(&r->acct, -(int64_t)v[i].c->size);
		v[i].c->freed_ns = v[i].since;
		cvm_phys_put(&r->dev->phys, v[i].c);
	}
	free(v);
	for (run = going; run; run = going) {
		going = run->lnext;
		run->lnext = run->lprev = NULL;
		run->kind = CVM_RUN_VA;
		run->epoch = 0;
		p->going--;
		bin_insert(p, run);
		coalesce(p, run);
	}
}

#define CVM_SYNC_RETRY_NS 100000000ull /* a failed device synchronisation is retried after 100 ms */
#define CVM_GOING_BATCH 16 /* granules unmapped per reclaim pass without the lock (32 MiB on the H200) */

/* Wait (lock held, dropped meanwhile) until no reclaim pass is unmapping GOING runs of this pool. */
static void wait_going(struct cuvmm_pool *p)
{
	while (p->going) {
		pthread_mutex_unlock(&p->r.lock);
		sched_yield();
		pthread_mutex_lock(&p->r.lock);
	}
}

static uint64_t reclaim_locked(struct cuvmm_pool *p, uint64_t now, bool force, size_t keep)
{
	struct cuvmm_ctx *ctx = p->r.ctx;
	struct cvm_run *run, *next;
	uint64_t deadline = UINT64_MAX, lead;
	bool want_sync = false, synced = false;
	struct cvm_run *going = NULL;
	size_t cap, batch = 0, by_delay = 0, by_cap = 0, by_trim = 0;

	if (cvm_elapsed(now, p->win_start) > (ctx->delay_ns < 100000000u ? 100000000u : ctx->delay_ns)) {
		p->prev_peak = p->win_peak;
		p->win_peak = p->fp;
		p->win_start = now;
	}
	/* A trim must see what another pass is giving back, or that pass's chunks land in the cache after
	 * the trim emptied it. */
	if (force)
		wait_going(p);
again:
	if (p->ndq)
		dq_drain(p, INT32_MAX);
	settle_pending(p, INT32_MAX);
	cap = slack_cap(p);
	/* Runs are due early enough for their unmaps and releases to be done when the delay is up. */
	lead = force ? 0 : cvm_dev_release_lead(p->r.dev, p->free_bytes >> p->r.gshift);
	for (run = p->age.lnext; run != &p->age; run = next) {
		bool due = ctx->delay_ns != UINT64_MAX && cvm_elapsed(now, run->freed_ns) + lead >= ctx->delay_ns;

		next = run->lnext;
		if (force) {
			if (p->free_bytes - gbytes(p, run->len) < keep)
				break;
		} else if (p->free_bytes <= cap && !due) {
			if (ctx->delay_ns != UINT64_MAX)
				deadline = run->freed_ns + ctx->delay_ns - lead;
			break;
		}
		if (!cvm_dev_epoch_safe(p->r.dev, run->epoch)) {
			want_sync = true;
			continue;
		}
		if (force) {
			by_trim += gbytes(p, run->len);
			free_to_va(p, run);
		} else {
			/* Detach it: out of every index, GOING, so nothing allocates or merges it while the
			 * chunks are unmapped below without the lock. In batches: while a batch is unmapped, an
			 * allocation cannot reuse its chunks and creates new ones, so held briefly counts both;
			 * a small batch keeps that overlap small, and the pass comes straight back for more.
			 * (Idle memory, due, needs no small batches: nothing allocates meanwhile.) */
			if (!due) {
				if (batch >= CVM_GOING_BATCH) {
					deadline = now;
					break;
				}
				batch += run->len;
			}
			*(due ? &by_delay : &by_cap) += gbytes(p, run->len);
			free_unlink(p, run);
			run->kind = CVM_RUN_GOING;
			run->lnext = going;
			going = run;
			p->going++;
		}
	}
	if (want_sync && !synced) {
		int err;

		pthread_mutex_unlock(&p->r.lock);
		err = cvm_dev_sync_epoch(p->r.dev);
		pthread_mutex_lock(&p->r.lock);
		synced = true;
		if (!err)
			goto again;
		/* EBUSY: a stream capture is under way (graph.h); expected, and over soon. */
		if (err != CUVMM_EBUSY)
			cvm_err("pool \"%s\": synchronising the device to release memory failed: %s; will retry",
				p->name, cuvmm_strerror(err));
		/* The runs that waited for it are still due: look again soon rather than never. */
		if (now + CVM_SYNC_RETRY_NS < deadline)
			deadline = now + CVM_SYNC_RETRY_NS;
	}
	if (going)
		unmap_going(p, going);
	/* The release decision: what this pass unmapped and why (its chunks go to the device's cache, which
	 * gives them back to the driver and says so). */
	if (by_delay)
		cvm_info("pool \"%s\": unmapped %.1f MiB free for release_delay_ms", p->name, by_delay / 1048576.0);
	if (by_cap)
		cvm_info("pool \"%s\": unmapped %.1f MiB: free memory was above the slack cap of %.1f MiB (a quarter "
			 "of the recent peak)", p->name, by_cap / 1048576.0, cap / 1048576.0);
	if (by_trim)
		cvm_info("pool \"%s\": unmapped %.1f MiB free on trim (keep %.1f MiB)", p->name, by_trim / 1048576.0,
			 keep / 1048576.0);
	if (p->ndq || p->pend.lnext != &p->pend)
		deadline = deadline < now + CVM_FENCE_POLL_NS ? deadline : now + CVM_FENCE_POLL_NS;
	if (p->r.npending) {
		uint64_t t = cvm_region_process_locked(&p->r, now, force);

		if (t < deadline)
			deadline = t;
	}
	return deadline;
}

static uint64_t pool_reclaim(struct cvm_client *c, uint64_t now, bool force)
{
	struct cuvmm_pool *p = (struct cuvmm_pool *)c;
	uint64_t next;
	size_t cap, free_bytes;

	/* The synchronisation that makes slack safe to unmap needs no lock: do it first, so that even when
	 * the pool is too busy for the pass below, its allocations can reuse the slack's chunks. */
	if (!force && atomic_exchange_explicit(&p->want_sync, false, memory_order_relaxed))
		cvm_dev_sync_epoch(p->r.dev);
	if (force)
		pthread_mutex_lock(&p->r.lock);
	else if (pthread_mutex_trylock(&p->r.lock))
		return now + CVM_FENCE_POLL_NS;
	next = p->r.sleep ? UINT64_MAX : reclaim_locked(p, now, force, 0);
	if (force && !p->r.sleep)
		cvm_region_host_drop(&p->r);
	cap = slack_cap(p);
	free_bytes = p->free_bytes;
	pthread_mutex_unlock(&p->r.lock);
	/* Unmapped slack went to the device's cache, which counts as slack too: release it beyond the cap,
	 * without the pool's lock. */
	if (!force && free_bytes + cvm_phys_cached(&p->r.dev->phys) > cap)
		cvm_phys_reclaim(&p->r.dev->phys, now, true,
				 cap > free_bytes ? cap - free_bytes : p->r.ctx->cfg.retain_bytes);
	return next;
}

int cuvmm_pool_trim(struct cuvmm_pool *p, size_t keep_bytes)
{
	size_t kept = 0;
	bool asleep;

	if (!p)
		return CUVMM_EINVAL;
	pthread_mutex_lock(&p->r.lock);
	asleep = p->r.sleep != NULL;
	pthread_mutex_unlock(&p->r.lock);
	if (asleep)
		return CUVMM_ESTATE;
	/* Stream frees first: wait for all work, so that every fence is complete. */
	if (cvm_dev_sync_epoch(p->r.dev) == CUVMM_OK) {
		pthread_mutex_lock(&p->r.lock);
		if (!p->r.sleep) {
			reclaim_locked(p, cvm_now_ns(), true, keep_bytes);
			cvm_region_host_drop(&p->r);
		}
		kept = p->free_bytes;
		pthread_mutex_unlock(&p->r.lock);
	}
	/* keep_bytes in all: what stayed mapped in the pool counts against it. */
	cvm_phys_reclaim(&p->r.dev->phys, cvm_now_ns(), true, keep_bytes > kept ? keep_bytes - kept : 0);
	return CUVMM_OK;
}

int cuvmm_pool_stats(struct cuvmm_pool *p, struct cuvmm_stats *out)
{
	if (!p || cvm_stats_check(out))
		return CUVMM_EINVAL;
	cvm_acct_lock(&p->r.acct); /* one snapshot of both accounts */
	cvm_acct_fill_locked(&p->r.acct, &p->r.cnt, out);
	out->live_bytes = atomic_load(&p->pacct.live);
	out->peak_live_bytes = atomic_load(&p->pacct.peak_live);
	cvm_acct_unlock(&p->r.acct);
	return CUVMM_OK;
}

/*
 * Sleep: synchronise the device (memory freed without a stream may still be in use, and stream frees
 * settle), give the free memory back, then sleep the region under the allocations. The lock is held
 * throughout: the pool is unusable while it goes to sleep anyway.
 */
int cuvmm_pool_sleep(struct cuvmm_pool *p, enum cuvmm_sleep_mode mode, CUstream stream)
{
	struct cvm_run *run, *next;
	int err;

	if (!p || (mode != CUVMM_SLEEP_OFFLOAD && mode != CUVMM_SLEEP_DISCARD))
		return CUVMM_EINVAL;
	pthread_mutex_lock(&p->r.lock);
	if (p->r.sleep) {
		err = CUVMM_ESTATE;
		goto out;
	}
	err = cvm_dev_sync_epoch(p->r.dev);
	if (err)
		goto out;
	wait_going(p);
	dq_drain(p, INT32_MAX);
	settle_pending(p, INT32_MAX);
	for (run = p->age.lnext; run != &p->age; run = next) {
		next = run->lnext;
		free_to_va(p, run);
	}
	if (p->r.npending)
		cvm_region_process_locked(&p->r, cvm_now_ns(), false);
	if (p->ndq || p->pend.lnext != &p->pend || p->free_bytes || p->r.npending) {
		err = CUVMM_EBUSY; /* work submitted meanwhile, or an unmap the driver refused */
		goto out;
	}
	err = cvm_region_sleep_locked(&p->r, mode, stream);
	/* (not with chunks quarantined by a refused unmap: the wake takes them back as recorded) */
	if (!err && !p->r.npending) {
		/* A pool that sleeps holds weights, or something as long-lived: the wake maps each allocation of
		 * 32 granules or more with handles of about k/16 granules (a power of two, up to 128 MiB), 16 to
		 * 32 per allocation instead of k, for the wake and every later sleep. Run boundaries stay chunk
		 * boundaries: the memory, once freed, is reused under the cut rule like any large-handle memory. */
		for (size_t g = 0; g < p->r.npages; g += p->edge[g]->len) {
			run = p->edge[g];
			if (run->kind == CVM_RUN_USED && run->len >= 32)
				cvm_sleep_coarsen(&p->r, run->start, run->len, large_cls(run->len));
		}
	}
out:
	pthread_mutex_unlock(&p->r.lock);
	if (!err)
		cvm_phys_reclaim(&p->r.dev->phys, cvm_now_ns(), true, p->r.ctx->cfg.retain_bytes);
	return err;
}

int cuvmm_pool_wake(struct cuvmm_pool *p, CUstream stream)
{
	int err;

	if (!p)
		return CUVMM_EINVAL;
	pthread_mutex_lock(&p->r.lock);
	err = cvm_region_wake_locked(&p->r, stream);
	pthread_mutex_unlock(&p->r.lock);
	return err;
}
