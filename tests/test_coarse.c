/*
 * Pools with cuvmm_pool_config.coarse_bytes: allocations from that size up take whole granules mapped on
 * handles as large as fit (up to 64 granules), so that trim, idle release and sleep give them back in few
 * driver calls. What the header promises is checked through the driver call counters: the handles a coarse
 * allocation maps, the threshold, what the memory it frees serves (an allocation of about its size, growth
 * in place) and what it does not strand, sleep and wake, configs of an older header, and a failure at every
 * driver call of a coarse map, with and without the undo's unmap failing too. Both backends.
 */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

#define U(x) ((unsigned long long)(x))

static void teardown(void)
{
	tc_env_restore();
}

/* A context that gives nothing back by time (trim only) unless delay_ms >= 0, with a background thread only
 * then. */
static struct cuvmm_ctx *new_ctx(int64_t delay_ms)
{
	struct cuvmm_config cfg;

	tc_config(&cfg);
	cfg.release_delay_ms = delay_ms;
	cfg.background_release = delay_ms >= 0;
	cfg.retain_bytes = 0;
	cfg.device_limit_bytes = 0;
	cfg.host_granularity = 2 * TC_MiB;
	return tc_ctx(&cfg);
}

static struct cuvmm_pool *new_pool(struct cuvmm_ctx *ctx, size_t coarse_bytes)
{
	struct cuvmm_pool_config pc;
	struct cuvmm_pool *pool = NULL;
	int err;

	cuvmm_pool_config_init(&pc);
	pc.name = "coarse";
	pc.coarse_bytes = coarse_bytes;
	err = cuvmm_pool_create(ctx, &pc, &pool);
	ck_assert_msg(err == CUVMM_OK, "cuvmm_pool_create: %s", cuvmm_err_name(err));
	return pool;
}

/* Driver calls of each kind made so far. */
struct calls {
	uint64_t create, release, map, unmap;
};

static struct calls calls_of(struct cuvmm_ctx *ctx)
{
	return (struct calls){cuvmm_ctx_call_count(ctx, CUVMM_CALL_CREATE), cuvmm_ctx_call_count(ctx, CUVMM_CALL_RELEASE),
			      cuvmm_ctx_call_count(ctx, CUVMM_CALL_MAP), cuvmm_ctx_call_count(ctx, CUVMM_CALL_UNMAP)};
}

#define EXPECT_CALLS(ctx, since, what, c_, r_, m_, u_)                                                           \
	do {                                                                                                     \
		struct calls now_ = calls_of(ctx);                                                               \
		ck_assert_msg(now_.create - (since).create == (c_) && now_.release - (since).release == (r_) &&  \
				      now_.map - (since).map == (m_) && now_.unmap - (since).unmap == (u_),      \
			      "%s: create/release/map/unmap %llu/%llu/%llu/%llu, expected %llu/%llu/%llu/%llu", what, \
			      U(now_.create - (since).create), U(now_.release - (since).release),                \
			      U(now_.map - (since).map), U(now_.unmap - (since).unmap), U(c_), U(r_), U(m_), U(u_)); \
	} while (0)

static void *alloc_filled(struct cuvmm_pool *pool, size_t bytes, uint32_t v)
{
	void *p = NULL;
	int err = cuvmm_malloc(pool, bytes, &p);

	ck_assert_msg(err == CUVMM_OK, "malloc(%zu): %s", bytes, cuvmm_err_name(err));
	ck_assert_int_eq(tc_fill(p, bytes / 4, v), 0);
	return p;
}

static void expect_contents(const void *p, size_t bytes, uint32_t v, const char *what)
{
	uint64_t bad = tc_check(p, bytes / 4, v);

	ck_assert_msg(bad == 0, "%s: %llu words of %zu bytes lost", what, U(bad), bytes);
}

static void close_empty(struct cuvmm_ctx *ctx, struct cuvmm_pool *pool)
{
	ck_assert_int_eq(cuvmm_pool_trim(pool, 0), CUVMM_OK);
	ck_assert_uint_eq(tc_pool_stats(pool).held_bytes, 0);
	cuvmm_pool_destroy(pool);
	ck_assert_int_eq(cuvmm_ctx_trim(ctx, 0, 0), CUVMM_OK);
	ck_assert_uint_eq(tc_ctx_stats(ctx).held_bytes, 0);
	tc_assert_os_matches(ctx);
	cuvmm_ctx_destroy(ctx);
}

/* 8 allocations of 32 granules: one handle each in a coarse pool (creates, maps and, after trim, unmaps and
 * releases), 32 each in a default pool, where they are packed. */
START_TEST(test_coarse_handle_per_allocation)
{
	struct cuvmm_ctx *ctx = new_ctx(-1);
	size_t g = tc_granularity(ctx);
	struct cuvmm_pool *coarse = new_pool(ctx, 32 * g), *plain = new_pool(ctx, 0);
	void *a[8], *b[8];
	struct calls c0;

	c0 = calls_of(ctx);
	for (int i = 0; i < 8; i++)
		a[i] = alloc_filled(coarse, 32 * g, 0xc0a0u + (uint32_t)i);
	EXPECT_CALLS(ctx, c0, "8 coarse allocations of 32 granules", 8, 0, 8, 0);
	ck_assert_uint_eq(tc_pool_stats(coarse).held_bytes, 8 * 32 * g);
	c0 = calls_of(ctx);
	for (int i = 0; i < 8; i++)
		b[i] = alloc_filled(plain, 32 * g, 0xb0a0u + (uint32_t)i);
	EXPECT_CALLS(ctx, c0, "8 packed allocations of 32 granules", 8 * 32, 0, 8 * 32, 0);
	for (int i = 0; i < 8; i++) {
		expect_contents(a[i], 32 * g, 0xc0a0u + (uint32_t)i, "coarse");
		expect_contents(b[i], 32 * g, 0xb0a0u + (uint32_t)i, "packed");
		ck_assert_int_eq(cuvmm_free(coarse, a[i]), CUVMM_OK);
		ck_assert_int_eq(cuvmm_free(plain, b[i]), CUVMM_OK);
	}
	c0 = calls_of(ctx);
	ck_assert_int_eq(cuvmm_pool_trim(coarse, 0), CUVMM_OK);
	EXPECT_CALLS(ctx, c0, "trim of the coarse pool", 0, 8, 0, 8);
	c0 = calls_of(ctx);
	ck_assert_int_eq(cuvmm_pool_trim(plain, 0), CUVMM_OK);
	EXPECT_CALLS(ctx, c0, "trim of the default pool", 0, 8 * 32, 0, 8 * 32);
	cuvmm_pool_destroy(plain);
	close_empty(ctx, coarse);
}
END_TEST

/* The handles of one coarse allocation: the largest powers of two that fit, at most 64 granules; the
 * threshold counted in granules; and below it, what the pool does anyway. */
START_TEST(test_coarse_sizes)
{
	static const struct {
		size_t coarse_g, bytes_g; /* coarse_bytes and the allocation, in granules */
		long bytes_delta;         /* bytes beyond bytes_g granules */
		unsigned handles;
		const char *what;
	} cases[] = {
		{32, 32, 0, 1, "32 granules: one handle"},
		{32, 32, -(long)(TC_MiB + 1), 1, "just over 31 granules takes 32: coarse"},
		{32, 31, 0, 31, "31 granules below 32: packed, a handle per granule"},
		{16, 100, 0, 3, "100 granules: 64 + 32 + 4"},
		{16, 200, 0, 4, "200 granules: 3 x 64 + 8"},
		{64, 40, 0, 40, "40 granules below 64, above the packed sizes: a handle per granule"},
		{1, 2, -1, 1, "coarse_bytes of 1: a granule; 2 granules less a byte: one handle"},
		{1, 0, 600 * 1024, 1, "coarse_bytes of 1: 600 KiB (above the slabs) takes a granule of its own"},
	};
	struct cuvmm_ctx *ctx = new_ctx(-1);
	size_t g = tc_granularity(ctx);

	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		size_t cb = cases[i].coarse_g == 1 ? 1 : cases[i].coarse_g * g;
		size_t bytes = (size_t)((long)(cases[i].bytes_g * g) + cases[i].bytes_delta);
		struct cuvmm_pool *pool = new_pool(ctx, cb);
		struct calls c0 = calls_of(ctx);
		void *p = alloc_filled(pool, bytes, 0x5eu + (uint32_t)i);
		size_t k = (bytes + g - 1) / g;

		EXPECT_CALLS(ctx, c0, cases[i].what, cases[i].handles, 0, cases[i].handles, 0);
		ck_assert_msg(tc_pool_stats(pool).held_bytes == k * g, "%s: held %llu, expected %zu granules",
			      cases[i].what, U(tc_pool_stats(pool).held_bytes), k);
		expect_contents(p, bytes, 0x5eu + (uint32_t)i, cases[i].what);
		ck_assert_int_eq(cuvmm_free(pool, p), CUVMM_OK);
		c0 = calls_of(ctx);
		ck_assert_int_eq(cuvmm_pool_trim(pool, 0), CUVMM_OK);
		EXPECT_CALLS(ctx, c0, cases[i].what, 0, cases[i].handles, 0, cases[i].handles);
		ck_assert_uint_eq(tc_pool_stats(pool).held_bytes, 0);
		cuvmm_pool_destroy(pool);
	}
	/* A threshold no allocation reaches: nothing is coarse, nothing overflows. */
	{
		struct cuvmm_pool *pool = new_pool(ctx, SIZE_MAX);
		struct calls c0 = calls_of(ctx);
		void *p = alloc_filled(pool, 40 * g, 1);

		EXPECT_CALLS(ctx, c0, "coarse_bytes SIZE_MAX", 40, 0, 40, 0);
		ck_assert_int_eq(cuvmm_free(pool, p), CUVMM_OK);
		close_empty(ctx, pool);
	}
}
END_TEST

/* Memory a coarse allocation freed: an allocation up to a sixteenth smaller reuses it without a driver call,
 * a larger one grows it in place, and a small one beside it does not keep it from going back whole. */
START_TEST(test_coarse_reuse)
{
	struct cuvmm_ctx *ctx = new_ctx(-1);
	size_t g = tc_granularity(ctx);
	struct cuvmm_pool *pool = new_pool(ctx, 16 * g);
	void *a = alloc_filled(pool, 32 * g, 1), *b, *c, *s;
	struct calls c0;

	ck_assert_int_eq(cuvmm_free(pool, a), CUVMM_OK);
	c0 = calls_of(ctx);
	b = alloc_filled(pool, 31 * g - 100, 2);
	EXPECT_CALLS(ctx, c0, "31 granules on a freed handle of 32", 0, 0, 0, 0);
	ck_assert_ptr_eq(b, a);
	ck_assert_uint_eq(tc_pool_stats(pool).held_bytes, 32 * g);
	ck_assert_int_eq(cuvmm_free(pool, b), CUVMM_OK);
	c0 = calls_of(ctx);
	c = alloc_filled(pool, 33 * g, 3);
	EXPECT_CALLS(ctx, c0, "33 granules grown from a freed handle of 32", 1, 0, 1, 0);
	ck_assert_ptr_eq(c, a);
	ck_assert_uint_eq(tc_pool_stats(pool).held_bytes, 33 * g);
	ck_assert_int_eq(cuvmm_free(pool, c), CUVMM_OK);

	/* A small allocation after the free lands beside the handle, not in it: trim gives the handle back whole
	 * while the small one lives. */
	s = alloc_filled(pool, 1000, 4);
	ck_assert_msg((uintptr_t)s < (uintptr_t)a || (uintptr_t)s >= (uintptr_t)a + 33 * g,
		      "a slab took part of a freed coarse handle");
	c0 = calls_of(ctx);
	ck_assert_int_eq(cuvmm_pool_trim(pool, 0), CUVMM_OK);
	EXPECT_CALLS(ctx, c0, "trim of a freed handle of 32 and one of 1 beside a live slab", 0, 2, 0, 2);
	ck_assert_uint_eq(tc_pool_stats(pool).held_bytes, g);
	expect_contents(s, 1000 & ~(size_t)3, 4, "the slab");
	ck_assert_int_eq(cuvmm_free(pool, s), CUVMM_OK);
	close_empty(ctx, pool);
}
END_TEST

/* With release_delay_ms 0 a freed coarse allocation goes back at once (the background thread), in one unmap
 * and one release. */
START_TEST(test_coarse_release_delay_zero)
{
	struct cuvmm_ctx *ctx = new_ctx(0);
	size_t g = tc_granularity(ctx);
	struct cuvmm_pool *pool = new_pool(ctx, 32 * g);
	void *a = alloc_filled(pool, 64 * g, 7);
	struct calls c0 = calls_of(ctx);

	ck_assert_int_eq(cuvmm_free(pool, a), CUVMM_OK);
	ck_assert_uint_eq(tc_wait_held_le(ctx, 0, 10000), 0);
	EXPECT_CALLS(ctx, c0, "free of 64 granules with delay 0", 0, 1, 0, 1);
	close_empty(ctx, pool);
}
END_TEST

/* Sleep and wake: contents kept, the same handles given back and mapped again. */
START_TEST(test_coarse_sleep_wake)
{
	struct cuvmm_ctx *ctx = new_ctx(-1);
	size_t g = tc_granularity(ctx);
	struct cuvmm_pool *pool = new_pool(ctx, 32 * g);
	void *a[4];
	struct calls c0;
	CUstream st = NULL;

	ck_assert_int_eq(tc_stream_create(&st), 0);
	for (int i = 0; i < 4; i++)
		a[i] = alloc_filled(pool, 32 * g, 0x51eeu + (uint32_t)i);
	c0 = calls_of(ctx);
	ck_assert_int_eq(cuvmm_pool_sleep(pool, CUVMM_SLEEP_OFFLOAD, st), CUVMM_OK);
	EXPECT_CALLS(ctx, c0, "sleep of 4 coarse allocations", 0, 4, 0, 4);
	ck_assert_uint_eq(tc_ctx_stats(ctx).held_bytes, 0);
	c0 = calls_of(ctx);
	ck_assert_int_eq(cuvmm_pool_wake(pool, st), CUVMM_OK);
	ck_assert_int_eq(tc_stream_sync(st), 0);
	EXPECT_CALLS(ctx, c0, "wake of 4 coarse allocations", 4, 0, 4, 0);
	for (int i = 0; i < 4; i++) {
		expect_contents(a[i], 32 * g, 0x51eeu + (uint32_t)i, "after wake");
		ck_assert_int_eq(cuvmm_free(pool, a[i]), CUVMM_OK);
	}
	tc_stream_destroy(st);
	close_empty(ctx, pool);
}
END_TEST

/* A config from a header before coarse_bytes (its size ends there) is accepted, with the default; a smaller
 * size is not. */
START_TEST(test_coarse_old_config)
{
	struct cuvmm_ctx *ctx = new_ctx(-1);
	size_t g = tc_granularity(ctx);
	struct cuvmm_pool_config pc;
	struct cuvmm_pool *pool = NULL;
	struct calls c0;
	void *p;

	cuvmm_pool_config_init(&pc);
	ck_assert_uint_eq(pc.coarse_bytes, 0);
	pc.coarse_bytes = g; /* beyond the size below: must not be read */
	pc.size = offsetof(struct cuvmm_pool_config, coarse_bytes) - 1;
	ck_assert_int_eq(cuvmm_pool_create(ctx, &pc, &pool), CUVMM_EINVAL);
	pc.size = offsetof(struct cuvmm_pool_config, coarse_bytes) + 1; /* ends inside the field */
	ck_assert_int_eq(cuvmm_pool_create(ctx, &pc, &pool), CUVMM_EINVAL);
	ck_assert_ptr_null(pool);
	pc.size = offsetof(struct cuvmm_pool_config, coarse_bytes);
	ck_assert_int_eq(cuvmm_pool_create(ctx, &pc, &pool), CUVMM_OK);
	c0 = calls_of(ctx);
	p = alloc_filled(pool, 32 * g, 9);
	EXPECT_CALLS(ctx, c0, "32 granules in a pool of an older config", 32, 0, 32, 0);
	ck_assert_int_eq(cuvmm_free(pool, p), CUVMM_OK);
	close_empty(ctx, pool);
}
END_TEST

/*
 * A coarse allocation of 100 granules maps handles of 64, 32 and 4 granules with one cuMemSetAccess. Each of
 * CREATE, MAP (at each handle) and SET_ACCESS fails once; _i & 1 also makes the undo's first unmap fail (the
 * handle stays quarantined until a later pass unmaps it). The malloc fails with the error, writes nothing,
 * leaves the pool's live bytes and the other allocation alone, and the pool works and empties afterwards.
 */
static const struct {
	enum cuvmm_call call;
	uint64_t skip;
} fault_cases[] = {
	{CUVMM_CALL_CREATE, 0},
	{CUVMM_CALL_CREATE, 2},
	{CUVMM_CALL_MAP, 0},
	{CUVMM_CALL_MAP, 1},
	{CUVMM_CALL_MAP, 2},
	{CUVMM_CALL_SET_ACCESS, 0},
};

START_TEST(test_coarse_map_faults)
{
	const int fc = _i / 2;
	const bool undo_fails = _i & 1;
	struct cuvmm_ctx *ctx = new_ctx(-1);
	size_t g = tc_granularity(ctx);
	struct cuvmm_pool *pool = new_pool(ctx, 16 * g);
	void *other = alloc_filled(pool, 20 * g, 0x07e7u), *p = (void *)(uintptr_t)0x5e5e5e00;
	uint64_t live0 = tc_pool_stats(pool).live_bytes, unmaps0 = cuvmm_ctx_call_count(ctx, CUVMM_CALL_UNMAP);
	char what[128];
	int err;

	snprintf(what, sizeof(what), "%s failing after %llu calls%s", cuvmm_call_name(fault_cases[fc].call),
		 U(fault_cases[fc].skip), undo_fails ? ", and the undo's unmap" : "");
	ck_assert_int_eq(cuvmm_ctx_inject_fault(ctx, fault_cases[fc].call, fault_cases[fc].skip, 1, CUVMM_EDRIVER),
			 CUVMM_OK);
	if (undo_fails)
		ck_assert_int_eq(cuvmm_ctx_inject_fault(ctx, CUVMM_CALL_UNMAP, 0, 1, CUVMM_EDRIVER), CUVMM_OK);
	err = cuvmm_malloc(pool, 100 * g, &p);
	ck_assert_int_eq(cuvmm_ctx_inject_fault(ctx, fault_cases[fc].call, 0, 0, CUVMM_EDRIVER), CUVMM_OK);
	ck_assert_int_eq(cuvmm_ctx_inject_fault(ctx, CUVMM_CALL_UNMAP, 0, 0, CUVMM_EDRIVER), CUVMM_OK);
	ck_assert_msg(err == CUVMM_EDRIVER, "%s: returned %s", what, cuvmm_err_name(err));
	ck_assert_msg(p == (void *)(uintptr_t)0x5e5e5e00, "%s: *ptr was written", what);
	ck_assert_msg(tc_pool_stats(pool).live_bytes == live0, "%s: live changed", what);
	if (undo_fails && cuvmm_ctx_call_count(ctx, CUVMM_CALL_UNMAP) == unmaps0)
		printf("%s: nothing to undo (the first handle failed)\n", what);
	expect_contents(other, 20 * g, 0x07e7u, what);

	/* The same allocation works now, over or beside what the failure left, and everything goes back. */
	p = alloc_filled(pool, 100 * g, 0x600du);
	expect_contents(p, 100 * g, 0x600du, what);
	expect_contents(other, 20 * g, 0x07e7u, what);
	ck_assert_int_eq(cuvmm_free(pool, p), CUVMM_OK);
	ck_assert_int_eq(cuvmm_free(pool, other), CUVMM_OK);
	close_empty(ctx, pool);
}
END_TEST

static Suite *coarse_suite(void)
{
	Suite *s = suite_create("coarse");
	TCase *tc = tcase_create("coarse");

	tcase_add_checked_fixture(tc, NULL, teardown);
	tcase_set_timeout(tc, TC_TIMEOUT);
	tcase_add_test(tc, test_coarse_handle_per_allocation);
	tcase_add_test(tc, test_coarse_sizes);
	tcase_add_test(tc, test_coarse_reuse);
	tcase_add_test(tc, test_coarse_release_delay_zero);
	tcase_add_test(tc, test_coarse_sleep_wake);
	tcase_add_test(tc, test_coarse_old_config);
	tcase_add_loop_test(tc, test_coarse_map_faults, 0, (int)(2 * sizeof(fault_cases) / sizeof(fault_cases[0])));
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	return tc_run(coarse_suite());
}
