/*
 * The packer alone (lib/pack.c): placement of byte ranges over shared granules, live counts per granule,
 * the granules reported empty, against a shadow model of what a pool would do with the plans.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "pack.h"

#define GSHIFT 21
#define GRAN ((size_t)1 << GSHIFT)
#define NPAGES 4096

/* The pool as the packer sees it: which granules it has given to the packer, and bytes live per granule
 * computed from the allocations (the shadow). */
struct shadow {
	struct cvm_pack k;
	bool taken[NPAGES];   /* given to the packer (mapped for it) */
	bool blocked[NPAGES]; /* the pool's own (a large allocation): never available */
	struct cvm_pack_alloc *a[4096];
	size_t n;
	size_t anywhere, bumps, gaps;
};

static bool avail(void *arg, size_t g, size_t n)
{
	struct shadow *s = arg;

	for (size_t i = g; i < g + n; i++)
		if (i >= NPAGES || s->taken[i] || s->blocked[i])
			return false;
	return true;
}

static void sh_init(struct shadow *s)
{
	memset(s, 0, sizeof(*s));
	ck_assert_int_eq(cvm_pack_init(&s->k, NPAGES, GSHIFT), CUVMM_OK);
}

static size_t sh_held(const struct shadow *s)
{
	size_t n = 0;

	for (size_t g = 0; g < NPAGES; g++)
		n += s->taken[g];
	return n;
}

/* Place `bytes` the way the pool does; returns the allocation. */
static struct cvm_pack_alloc *sh_alloc(struct shadow *s, size_t bytes)
{
	struct cvm_pack_alloc *x = calloc(1, sizeof(*x));
	struct cvm_pack_plan plan;
	size_t len = cvm_pack_len(bytes), g;
	int e;

	ck_assert_ptr_nonnull(x);
	cvm_pack_plan(&s->k, len, avail, s, &plan);
	if (plan.anywhere) {
		/* The lowest run of free granules, as map_fresh would. */
		for (g = 0; g + plan.ng <= NPAGES && !avail(s, g, plan.ng); g++)
			;
		ck_assert_uint_lt(g + plan.ng, NPAGES + 1);
		plan.g0 = g;
		plan.off = g << GSHIFT;
		s->anywhere++;
	} else if (plan.ng) {
		s->bumps++;
	} else {
		s->gaps++;
	}
	ck_assert_uint_eq(plan.ng, plan.anywhere ? (len + GRAN - 1) / GRAN : plan.ng);
	/* The plan's new granules are free; the rest of the range lies on granules the packer holds. */
	for (g = plan.off >> GSHIFT; g <= (plan.off + len - 1) >> GSHIFT; g++) {
		bool newly = g >= plan.g0 && g < plan.g0 + plan.ng;

		ck_assert_msg(newly ? !s->taken[g] && !s->blocked[g] : s->taken[g],
			      "granule %zu: new %d, taken %d", g, newly, s->taken[g]);
		ck_assert(newly == !cvm_pack_holds(&s->k, g));
	}
	for (g = plan.g0; g < plan.g0 + plan.ng; g++)
		s->taken[g] = true;
	x->off = plan.off;
	x->len = len;
	x->bytes = bytes;
	cvm_pack_insert(&s->k, x, plan.ng != 0);
	e = cvm_pack_check(&s->k);
	ck_assert_msg(e == 0, "invariant %d broken after placing %zu bytes at %#zx", e, bytes, plan.off);
	ck_assert_ptr_eq(cvm_pack_find(&s->k, x->off), x);
	s->a[s->n++] = x;
	return x;
}

static void sh_free(struct shadow *s, size_t i)
{
	struct cvm_pack_alloc *x = s->a[i];
	size_t g0, ng, first = x->off >> GSHIFT, last = (x->off + x->len - 1) >> GSHIFT;
	int e;

	s->a[i] = s->a[--s->n];
	cvm_pack_remove(&s->k, x, &g0, &ng);
	e = cvm_pack_check(&s->k);
	ck_assert_msg(e == 0, "invariant %d broken after freeing %#zx", e, x->off);
	/* Exactly the granules of x that no other allocation touches are reported. */
	for (size_t g = first; g <= last; g++) {
		bool other = false, rep = ng && g >= g0 && g < g0 + ng;

		for (size_t j = 0; j < s->n; j++)
			other |= s->a[j]->off < ((g + 1) << GSHIFT) && s->a[j]->off + s->a[j]->len > (g << GSHIFT);
		ck_assert_msg(rep == !other, "granule %zu: reported %d, still used %d", g, rep, other);
		if (rep)
			s->taken[g] = false;
	}
	ck_assert(!ng || (g0 >= first && g0 + ng <= last + 1));
	ck_assert_ptr_null(cvm_pack_find(&s->k, x->off));
	free(x);
}

static void sh_fini(struct shadow *s)
{
	cvm_pack_fini(&s->k); /* frees what is left */
}

/* The tensors of one Qwen2-1.5B layer above the slab limit (bf16): q, k, v, o, gate, up, down. */
static const size_t qwen_layer[] = {
	1536 * 1536 * 2, 256 * 1536 * 2, 256 * 1536 * 2, 1536 * 1536 * 2, 8960 * 1536 * 2, 8960 * 1536 * 2,
	1536 * 8960 * 2,
};

/* Loaded in order, tensor by tensor: a bump; the only waste is the tail of the last granule. */
START_TEST(test_pack_in_order_is_a_bump)
{
	static struct shadow s;
	size_t total = 0;

	sh_init(&s);
	for (int l = 0; l < 28; l++)
		for (size_t i = 0; i < sizeof(qwen_layer) / sizeof(qwen_layer[0]); i++) {
			sh_alloc(&s, qwen_layer[i] - 7 * (size_t)l); /* odd sizes: rounded to 512 */
			total += cvm_pack_len(qwen_layer[i] - 7 * (size_t)l);
		}
	printf("in order: %zu tensors, %zu MiB, %zu granules held (%zu anywhere, %zu bumps, %zu in gaps)\n", s.n,
	       total >> 20, sh_held(&s), s.anywhere, s.bumps, s.gaps);
	ck_assert_uint_eq(sh_held(&s), (total + GRAN - 1) / GRAN);
	ck_assert_uint_eq(s.anywhere, 1);
	/* Contiguous: each allocation starts where the previous ended. */
	for (size_t i = 1; i < s.n; i++)
		ck_assert_uint_eq(s.a[i]->off, s.a[i - 1]->off + s.a[i - 1]->len);
	sh_fini(&s);
}
END_TEST

/* A freed range is reused by the lowest gap that fits; granules are reported empty only when the last
 * byte on them leaves. */
START_TEST(test_pack_gaps_first_fit)
{
	static struct shadow s;
	struct cvm_pack_alloc *a, *b, *c, *d, *e;
	size_t g0, ng;

	sh_init(&s);
	a = sh_alloc(&s, 3 * GRAN / 2);     /* [0, 1.5) */
	b = sh_alloc(&s, GRAN);             /* [1.5, 2.5) */
	c = sh_alloc(&s, 3 * GRAN / 4);     /* [2.5, 3.25) */
	ck_assert_uint_eq(b->off, a->off + a->len);
	ck_assert_uint_eq(sh_held(&s), 4);
	/* Freeing b empties no granule: a and c hold granules 1 and 2. */
	sh_free(&s, 1);
	ck_assert_uint_eq(sh_held(&s), 4);
	ck_assert_uint_eq(s.k.live[1], GRAN / 2);
	/* Something of up to 1 granule goes back where b was, even though c's granule has room too. */
	d = sh_alloc(&s, GRAN - 4096);
	ck_assert_uint_eq(d->off, 3 * GRAN / 2);
	ck_assert_uint_eq(s.gaps, 1);
	/* The tail of c's granule (0.75 granule): a 0.6-granule allocation fits there. */
	e = sh_alloc(&s, 6 * GRAN / 10);
	ck_assert_uint_eq(e->off, c->off + c->len);
	ck_assert_uint_eq(sh_held(&s), 4);
	/* Free everything but e: granules 0-2 go back, one call at a time, when their last byte leaves. */
	while (s.n > 1) {
		size_t i = s.a[0] == e ? 1 : 0;

		sh_free(&s, i);
	}
	ck_assert_uint_eq(sh_held(&s), 1);
	ck_assert(s.taken[3]);
	cvm_pack_remove(&s.k, e, &g0, &ng);
	ck_assert_uint_eq(g0, 3);
	ck_assert_uint_eq(ng, 1);
	free(e);
	s.n = 0;
	ck_assert_int_eq(cvm_pack_check(&s.k), 0);
	sh_fini(&s);
}
END_TEST

/* The cursor extends only over granules the caller says it may have; otherwise granules anywhere. */
START_TEST(test_pack_bump_respects_avail)
{
	static struct shadow s;
	struct cvm_pack_alloc *a, *b;

	sh_init(&s);
	a = sh_alloc(&s, GRAN + GRAN / 2); /* granules 0-1 */
	s.blocked[2] = true;               /* a large allocation of the pool */
	b = sh_alloc(&s, GRAN);            /* does not fit a's tail, cannot extend over 2 */
	ck_assert_uint_eq(b->off, 3 * GRAN);
	ck_assert_uint_eq(s.anywhere, 2);
	/* The next bumps from b, and a's tail (half a granule) still takes what fits. */
	ck_assert_uint_eq(sh_alloc(&s, GRAN)->off, 4 * GRAN);
	ck_assert_uint_eq(sh_alloc(&s, GRAN / 2)->off, a->off + a->len);
	sh_fini(&s);
}
END_TEST

/* Pointers that are not the start of an allocation are not found; the rounding is to 512 bytes. */
START_TEST(test_pack_find_and_len)
{
	static struct shadow s;
	struct cvm_pack_alloc *a;

	ck_assert_uint_eq(cvm_pack_len(1), 512);
	ck_assert_uint_eq(cvm_pack_len(512), 512);
	ck_assert_uint_eq(cvm_pack_len(513), 1024);
	sh_init(&s);
	ck_assert_ptr_null(cvm_pack_find(&s.k, 0));
	a = sh_alloc(&s, GRAN - 100);
	ck_assert_ptr_eq(cvm_pack_find(&s.k, a->off), a);
	ck_assert_ptr_null(cvm_pack_find(&s.k, a->off + 512));
	ck_assert_ptr_null(cvm_pack_find(&s.k, (size_t)NPAGES << GSHIFT));
	ck_assert(cvm_pack_holds(&s.k, 0));
	ck_assert(!cvm_pack_holds(&s.k, 1));
	ck_assert_int_eq(cvm_pack_init(&s.k, 0, GSHIFT), CUVMM_EINVAL);
	sh_fini(&s);
}
END_TEST

static uint64_t rnd(uint64_t *x)
{
	uint64_t z = (*x += 0x9e3779b97f4a7c15ull);

	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

/* Random churn of sizes from a quarter granule to 32 granules, with granules of the pool's own in the way:
 * every invariant after every step, and no more granules held than the allocations' own, rounded up, plus
 * one each. */
START_TEST(test_pack_churn)
{
	static struct shadow s;
	uint64_t x = 12345 + (uint64_t)_i;
	size_t maxheld = 0;

	sh_init(&s);
	for (int g = 0; g < NPAGES; g += 37)
		s.blocked[g] = true;
	for (int op = 0; op < 6000; op++) {
		uint64_t r = rnd(&x) % 100;

		if (s.n == 0 || (r < 52 && s.n < 250)) {
			size_t b = r % 4 == 0 ? GRAN / 4 + 1 + rnd(&x) % (31 * GRAN + GRAN / 4)
					      : GRAN / 4 + 1 + rnd(&x) % (3 * GRAN);

			sh_alloc(&s, b);
		} else {
			sh_free(&s, rnd(&x) % s.n);
		}
		{
			size_t bound = 0;

			/* Each allocation touches at most its granules, rounded up, and one more. */
			for (size_t i = 0; i < s.n; i++)
				bound += (s.a[i]->len + GRAN - 1) / GRAN + 1;
			ck_assert_uint_le(sh_held(&s), bound);
			if (sh_held(&s) > maxheld)
				maxheld = sh_held(&s);
		}
	}
	printf("churn %d: %zu anywhere, %zu bumps, %zu in gaps; at most %zu granules held\n", _i, s.anywhere, s.bumps,
	       s.gaps, maxheld);
	while (s.n)
		sh_free(&s, s.n - 1);
	ck_assert_uint_eq(sh_held(&s), 0);
	ck_assert_uint_eq(s.k.n, 0);
	sh_fini(&s);
}
END_TEST

static Suite *pack_suite(void)
{
	Suite *s = suite_create("pack");
	TCase *tc = tcase_create("pack");

	tcase_set_timeout(tc, TC_TIMEOUT);
	tcase_add_test(tc, test_pack_in_order_is_a_bump);
	tcase_add_test(tc, test_pack_gaps_first_fit);
	tcase_add_test(tc, test_pack_bump_respects_avail);
	tcase_add_test(tc, test_pack_find_and_len);
	tcase_add_loop_test(tc, test_pack_churn, 0, 3);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	return tc_run(pack_suite());
}
