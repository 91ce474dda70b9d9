/*
 * Packed runs: byte-range placement over shared granules, with per-granule live counts (pack.h). Logic
 * only: no driver call, no lock.
 *
 * Allocations are kept in one list in address order; head[g] is the first one touching granule g, so the
 * allocations on a granule (a handful: each is longer than a quarter granule) are found from it. A gap is
 * free space between two neighbours that lies on held granules: after A, up to its successor B if B
 * starts on A's last granule or the next one, else to the end of A's last granule; and before B, from the
 * start of its first granule, when its predecessor does not reach that far. Every granule strictly
 * between two neighbours that are further apart has no live byte, so it is not the packer's.
 */
#include <stdlib.h>

#include "cuvmm.h"
#include "pack.h"

static size_t end_of(const struct cvm_pack_alloc *x)
{
	return x->off + x->len;
}

static size_t gfirst(const struct cvm_pack *k, const struct cvm_pack_alloc *x)
{
	return x->off >> k->gshift;
}

static size_t glast(const struct cvm_pack *k, const struct cvm_pack_alloc *x)
{
	return (end_of(x) - 1) >> k->gshift;
}

/* The gap after a: [end(a), *lim); empty when *lim == end(a). */
static size_t gap_after(const struct cvm_pack *k, const struct cvm_pack_alloc *a)
{
	size_t ag = glast(k, a), lim = (ag + 1) << k->gshift;

	if (a->next && gfirst(k, a->next) <= ag + 1)
		lim = a->next->off;
	return lim;
}

/* Does b have a gap before it on its first granule (its predecessor ends two granules or more before)? */
static bool has_gap_before(const struct cvm_pack *k, const struct cvm_pack_alloc *b)
{
	return !b->prev || gfirst(k, b) > glast(k, b->prev) + 1;
}

/*
 * Visit the gaps starting in granule g in address order; stop at the first at least `need` bytes long
 * (0: visit all). Returns the longest seen, and the start of the one that stopped the visit in *at.
 */
static size_t gaps_in(const struct cvm_pack *k, size_t g, size_t need, size_t *at)
{
	const struct cvm_pack_alloc *x = k->head[g], *p;
	size_t gstart = g << k->gshift, gend = (g + 1) << k->gshift, best = 0, len;

	if (!x)
		return 0;
	p = x->prev;
	/* A predecessor ending exactly at the granule's start: its gap starts here. */
	if (p && end_of(p) == gstart) {
		len = gap_after(k, p) - gstart;
		if (need && len >= need) {
			*at = gstart;
			return len;
		}
		best = len > best ? len : best;
	}
	for (; x && x->off < gend; x = x->next) {
		if (x->off >= gstart && has_gap_before(k, x)) {
			len = x->off - gstart;
			if (need && len >= need) {
				*at = gstart;
				return len;
			}
			best = len > best ? len : best;
		}
		if (end_of(x) > gstart && end_of(x) < gend) {
			len = gap_after(k, x) - end_of(x);
			if (need && len >= need) {
				*at = end_of(x);
				return len;
			}
			best = len > best ? len : best;
		}
	}
	return need ? 0 : best;
}

static void reindex(struct cvm_pack *k, size_t g)
{
	size_t at;

	if (g < k->ngran)
		cvm_seg_set(&k->gaps, g, (uint32_t)(gaps_in(k, g, 0, &at) / CVM_PACK_ALIGN));
}

/* Re-index the granules whose gaps may have changed around x (inserted or about to be removed), and
 * around its neighbours p and n. */
static void reindex_around(struct cvm_pack *k, const struct cvm_pack_alloc *p, const struct cvm_pack_alloc *x,
			   const struct cvm_pack_alloc *n)
{
	if (p)
		reindex(k, end_of(p) >> k->gshift);
	if (x) {
		reindex(k, gfirst(k, x));
		reindex(k, glast(k, x));
		reindex(k, end_of(x) >> k->gshift);
	}
	if (n)
		reindex(k, gfirst(k, n));
}

int cvm_pack_init(struct cvm_pack *k, size_t ngran, unsigned gshift)
{
	int err;

	if (ngran == 0 || gshift < 9 || gshift > 31)
		return CUVMM_EINVAL;
	k->gshift = gshift;
	k->ngran = ngran;
	k->cursor = NULL;
	k->n = 0;
	k->last = NULL;
	k->live = calloc(ngran, sizeof(*k->live));
	k->head = calloc(ngran, sizeof(*k->head));
	err = k->live && k->head ? cvm_seg_init(&k->gaps, ngran) : CUVMM_ENOMEM;
	if (!err) {
		err = cvm_seg_init(&k->held, ngran);
		if (err)
			cvm_seg_fini(&k->gaps);
	}
	if (err) {
		free(k->live);
		free(k->head);
		k->live = NULL;
		k->head = NULL;
	}
	return err;
}

void cvm_pack_fini(struct cvm_pack *k)
{
	struct cvm_pack_alloc *x, *prev;

	if (!k->live)
		return;
	for (x = k->last; x; x = prev) {
		prev = x->prev;
		free(x);
	}
	cvm_seg_fini(&k->gaps);
	cvm_seg_fini(&k->held);
	free(k->live);
	free(k->head);
	k->live = NULL;
	k->head = NULL;
	k->n = 0;
	k->cursor = NULL;
	k->last = NULL;
}

size_t cvm_pack_len(size_t bytes)
{
	return (bytes + CVM_PACK_ALIGN - 1) & ~(size_t)(CVM_PACK_ALIGN - 1);
}

void cvm_pack_plan(const struct cvm_pack *k, size_t len, cvm_pack_avail_fn avail, void *arg,
		   struct cvm_pack_plan *plan)
{
	size_t gran = (size_t)1 << k->gshift, g, at = 0;
	const struct cvm_pack_alloc *c = k->cursor;

	plan->anywhere = false;
	/* 1. A gap on held granules, lowest address first. */
	if (len / CVM_PACK_ALIGN <= UINT32_MAX) {
		g = cvm_seg_first(&k->gaps, 0, (uint32_t)(len / CVM_PACK_ALIGN));
		if (g != CVM_SEG_NONE && gaps_in(k, g, len, &at) >= len) {
			plan->off = at;
			plan->g0 = 0;
			plan->ng = 0;
			return;
		}
	}
	/* 2. Bump: the cursor's end, extended over the granules after it (none of them the packer's: its
	 * successor starts beyond the last one). */
	if (c) {
		size_t s = end_of(c), first = (s + gran - 1) >> k->gshift, last = (s + len - 1) >> k->gshift;

		if (last >= first && last < k->ngran && (!c->next || gfirst(k, c->next) > last) &&
		    avail(arg, first, last - first + 1)) {
			plan->off = s;
			plan->g0 = first;
			plan->ng = last - first + 1;
			return;
		}
	}
	/* 3. Granules anywhere. */
	plan->anywhere = true;
	plan->off = 0;
	plan->g0 = 0;
	plan->ng = (len + gran - 1) >> k->gshift;
}

/* The bytes of [off, off + len) on granule g. */
static uint32_t bytes_on(const struct cvm_pack *k, const struct cvm_pack_alloc *x, size_t g)
{
	size_t a = g << k->gshift, b = a + ((size_t)1 << k->gshift);

	if (x->off > a)
		a = x->off;
	if (end_of(x) < b)
		b = end_of(x);
	return (uint32_t)(b - a);
}

void cvm_pack_insert(struct cvm_pack *k, struct cvm_pack_alloc *x, bool bump)
{
	size_t g0 = gfirst(k, x), g1 = glast(k, x), g;
	struct cvm_pack_alloc *p, *n;

	/* The successor: the first allocation at or after x, found from the lowest held granule at or after
	 * x's first; the predecessor is the one before it. */
	g = cvm_seg_first(&k->held, g0, 1);
	for (n = g == CVM_SEG_NONE ? NULL : k->head[g]; n && n->off < x->off;)
		n = n->next;
	p = n ? n->prev : k->last;
	x->prev = p;
	x->next = n;
	if (p)
		p->next = x;
	if (n)
		n->prev = x;
	else
		k->last = x;
	for (g = g0; g <= g1; g++) {
		if (!k->head[g] || k->head[g]->off > x->off)
			k->head[g] = x;
		if (!k->live[g])
			cvm_seg_set(&k->held, g, 1);
		k->live[g] += bytes_on(k, x, g);
	}
	k->n++;
	x->pending = false;
	if (bump || (k->cursor && k->cursor == p && end_of(p) == x->off))
		k->cursor = x;
	reindex_around(k, p, x, n);
}

void cvm_pack_remove(struct cvm_pack *k, struct cvm_pack_alloc *x, size_t *e0, size_t *en)
{
	size_t g0 = gfirst(k, x), g1 = glast(k, x), lo = g1 + 1, hi = g0;
	struct cvm_pack_alloc *p = x->prev, *n = x->next;

	if (p)
		p->next = n;
	if (n)
		n->prev = p;
	else
		k->last = p;
	for (size_t g = g0; g <= g1; g++) {
		if (k->head[g] == x)
			k->head[g] = n && gfirst(k, n) <= g ? n : NULL;
		k->live[g] -= bytes_on(k, x, g);
		if (!k->live[g]) {
			cvm_seg_set(&k->held, g, 0);
			lo = g < lo ? g : lo;
			hi = g + 1;
		}
	}
	k->n--;
	if (k->cursor == x)
		k->cursor = p && end_of(p) == x->off ? p : NULL;
	/* The gaps x bordered: its granules' entries, its neighbours'. */
	reindex(k, g0);
	reindex(k, g1);
	reindex(k, end_of(x) >> k->gshift);
	reindex_around(k, p, NULL, n);
	x->prev = x->next = NULL;
	*e0 = lo <= g1 ? lo : 0;
	*en = lo <= g1 ? hi - lo : 0;
}

struct cvm_pack_alloc *cvm_pack_find(const struct cvm_pack *k, size_t off)
{
	size_t g = off >> k->gshift;
	struct cvm_pack_alloc *x;

	if (!k->head || g >= k->ngran)
		return NULL;
	for (x = k->head[g]; x && x->off <= off; x = x->next)
		if (x->off == off)
			return x;
	return NULL;
}

int cvm_pack_check(const struct cvm_pack *k)
{
	const struct cvm_pack_alloc *x = NULL, *prev = NULL;
	const struct cvm_pack_alloc **head;
	uint32_t *live;
	size_t n = 0, at;
	int bad = 0;

	for (size_t g = 0; g < k->ngran && !x; g++)
		x = k->head[g];
	live = calloc(k->ngran, sizeof(*live));
	head = calloc(k->ngran, sizeof(*head));
	if (!live || !head) {
		free(live);
		free(head);
		return -1;
	}
	for (; x && !bad; prev = x, x = x->next) {
		n++;
		if (x->prev != prev)
			bad = 1; /* broken links */
		else if (prev && end_of(prev) > x->off)
			bad = 2; /* out of order or overlapping */
		else if (x->len == 0 || x->off % CVM_PACK_ALIGN || x->len % CVM_PACK_ALIGN || glast(k, x) >= k->ngran)
			bad = 3;
		for (size_t g = gfirst(k, x); !bad && g <= glast(k, x); g++) {
			live[g] += bytes_on(k, x, g);
			if (!head[g])
				head[g] = x;
		}
	}
	if (!bad && (n != k->n || k->last != prev))
		bad = 5;
	for (size_t g = 0; g < k->ngran && !bad; g++) {
		if (live[g] != k->live[g])
			bad = 6;
		else if (head[g] != k->head[g])
			bad = 4;
		else if (k->held.t[k->held.n + g] != (live[g] != 0))
			bad = 7;
		else if (k->gaps.t[k->gaps.n + g] != (uint32_t)(gaps_in(k, g, 0, &at) / CVM_PACK_ALIGN))
			bad = 8;
	}
	if (!bad && k->cursor && cvm_pack_find(k, k->cursor->off) != k->cursor)
		bad = 9;
	free(live);
	free(head);
	return bad;
}
