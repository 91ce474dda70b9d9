/*
 * Small allocations: size classes (256-byte steps to 1 KiB, then four steps per doubling), slabs (one
 * granule cut into equal slots of one class, in a SLAB run), and the queue of frees on streams whose slots
 * (or packed allocations, pool_pack.c: their bytes share granules too) become available once their fence
 * (fence.h) has completed.
 */
#include <stdlib.h>

#include "pool_int.h"

#define CVM_SMALL_LIMIT ((size_t)1 << 20) /* largest small allocation, if the granule allows 4 slots */
#define CVM_DQ_SCAN 16                    /* stream frees looked at per allocation */

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
	struct cvm_pack_alloc *pack; /* a packed allocation (pool_pack.c); NULL: a slot of class cls */
	uint32_t cls;
	struct cvm_fence fence; /* an event fence on the stream it was freed on */
};

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

/* ----- slabs ----- */

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
	err = cvm_get_run(p, 1, NULL, false, &run);
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
	/* (A run of two granules where its granule is half of a chunk that a FREE run of large chunks could not
	 * be cut inside: the footprint counts what goes back when the slab is released.) */
	cvm_fp_add(p, run->len, true);
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
		cvm_run_release(p, run, NULL); /* the device epoch */
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

/* Append a stream free (d's pack or cls set) to the queue. */
static void dq_push(struct cuvmm_pool *p, struct cvm_dfree *d, uintptr_t a, const struct cvm_fence *f)
{
	d->next = NULL;
	d->ptr = (void *)a;
	d->fence = *f;
	if (p->dq_tail)
		p->dq_tail->next = d;
	else
		p->dq_head = d;
	p->dq_tail = d;
	p->ndq++;
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

/* Complete stream frees whose events are done (oldest first, at most `max` looked at). */
void cvm_slab_drain(struct cuvmm_pool *p, int max)
{
	struct cvm_dfree *prev = NULL, *d = p->dq_head, *next;

	for (; d && max-- > 0; d = next) {
		uint32_t slot;
		struct cvm_slab *s;

		next = d->next;
		if (cvm_fence_done(&p->r.dev->fence, &d->fence) <= 0) {
			prev = d;
			continue;
		}
		dq_remove(p, prev, d);
		if (d->pack) {
			cvm_pool_pack_settled(p, d->pack);
		} else {
			s = slab_of(p, (uintptr_t)d->ptr, &slot);
			slab_put(p, s, slot);
		}
		cvm_fence_clear(&p->r.dev->fence, &d->fence);
		free(d);
	}
}

int cvm_slab_alloc(struct cuvmm_pool *p, size_t bytes, CUstream stream, void **ptr)
{
	unsigned cls = small_class(bytes);
	struct cvm_dfree *prev = NULL, *d = p->dq_head;
	struct cvm_slab *s;
	int err, n = 0;

	/* Stream-ordered reuse: a slot freed on this very stream is ready for it now. */
	for (; stream && d && n < CVM_DQ_SCAN; prev = d, d = d->next, n++) {
		uint32_t slot;

		if (d->fence.stream != stream || d->pack || d->cls != cls)
			continue;
		dq_remove(p, prev, d);
		s = slab_of(p, (uintptr_t)d->ptr, &slot);
		s->live[slot / 64] |= (uint64_t)1 << (slot % 64);
		*ptr = d->ptr;
		cvm_fence_clear(&p->r.dev->fence, &d->fence);
		free(d);
		cvm_pool_live_add(p, (int64_t)class_size(cls));
		return CUVMM_OK;
	}
	s = p->partial[cls];
	if (!s) {
		err = slab_new(p, cls, &s);
		if (err)
			return err;
	}
	*ptr = slab_take(p, s);
	cvm_pool_live_add(p, (int64_t)class_size(cls));
	return CUVMM_OK;
}

/* ----- entry points of the pool's files ----- */

void cvm_slab_setup(struct cuvmm_pool *p)
{
	p->small_max = p->r.gran / 4 < CVM_SMALL_LIMIT ? p->r.gran / 4 : CVM_SMALL_LIMIT;
	if (p->small_max < 256)
		p->small_max = 0;
	p->nsmall = p->small_max ? small_class(p->small_max) + 1 : 0;
}

size_t cvm_slab_live_bytes(struct cuvmm_pool *p, uintptr_t a)
{
	uint32_t slot;
	struct cvm_slab *s = slab_of(p, a, &slot);

	return s && (s->live[slot / 64] & ((uint64_t)1 << (slot % 64))) ? s->size : 0;
}

void cvm_slab_free(struct cuvmm_pool *p, uintptr_t a, const struct cvm_fence *f)
{
	uint32_t slot;
	struct cvm_slab *s = slab_of(p, a, &slot);

	s->live[slot / 64] &= ~((uint64_t)1 << (slot % 64));
	cvm_pool_live_add(p, -(int64_t)s->size);
	if (f) {
		struct cvm_dfree *d = malloc(sizeof(*d));

		if (!d) {
			/* No memory to remember the fence: wait for it instead. */
			struct cvm_fence w = *f;

			cvm_fence_wait(&p->r.dev->fence, &w);
			cvm_fence_clear(&p->r.dev->fence, &w);
			slab_put(p, s, slot);
		} else {
			d->pack = NULL;
			d->cls = s->cls;
			dq_push(p, d, a, f);
		}
	} else {
		slab_put(p, s, slot);
	}
}

bool cvm_dq_add(struct cuvmm_pool *p, uintptr_t a, struct cvm_pack_alloc *x, const struct cvm_fence *f)
{
	struct cvm_dfree *d = malloc(sizeof(*d));

	if (!d)
		return false;
	d->pack = x;
	d->cls = 0;
	dq_push(p, d, a, f);
	return true;
}

struct cvm_pack_alloc *cvm_dq_take_packed(struct cuvmm_pool *p, CUstream stream, size_t len)
{
	struct cvm_dfree *prev = NULL, *d = p->dq_head;
	struct cvm_pack_alloc *x;

	for (int n = 0; d && n < CVM_DQ_SCAN; prev = d, d = d->next, n++) {
		if (d->fence.stream != stream || !d->pack || d->pack->len != len)
			continue;
		dq_remove(p, prev, d);
		x = d->pack;
		cvm_fence_clear(&p->r.dev->fence, &d->fence);
		free(d);
		return x;
	}
	return NULL;
}

void cvm_slab_discard(struct cuvmm_pool *p)
{
	while (p->dq_head) {
		struct cvm_dfree *d = p->dq_head;

		p->dq_head = d->next;
		cvm_fence_clear(&p->r.dev->fence, &d->fence);
		free(d);
	}
}
