/*
 * Sleep and wake: regions (OFFLOAD keeps contents at the same addresses, DISCARD keeps the mapping layout),
 * pools (every allocation comes back at its address), the host copy pinned in pieces by several threads
 * (CUVMM_PIN_THREADS) under CUVMM_SLEEP_HOST_LIMIT, the calls refused while asleep, memory given back to
 * the driver and to the OS (host backend), every driver call of the sleep and wake paths made to fail (the
 * object is left awake and intact, or asleep and wakeable), and (CUDA) a graph captured before sleep that
 * replays after wake.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "drv_test.h"
#include "gpu.h"

#define G (2 * TC_MiB) /* the granularity on both backends (host default, H200) */

static void teardown(void)
{
	cvm_host_gate_open();
	tc_log_release();
}

/* ----- helpers ----- */

static struct cuvmm_ctx *ctx_with(int64_t delay_ms)
{
	struct cuvmm_config cfg;

	tc_config(&cfg);
	cfg.release_delay_ms = delay_ms;
	return tc_ctx(&cfg);
}

static struct cuvmm_region *region_ex(struct cuvmm_ctx *ctx, size_t bytes, size_t gran)
{
	struct cuvmm_region *r = NULL;
	int err = cuvmm_region_create_ex(ctx, 0, bytes, gran, &r);

	ck_assert_msg(err == CUVMM_OK, "cuvmm_region_create_ex(%zu, %zu): %s", bytes, gran, cuvmm_err_name(err));
	ck_assert_ptr_nonnull(r);
	return r;
}

static struct cuvmm_region *region(struct cuvmm_ctx *ctx, size_t bytes)
{
	return region_ex(ctx, bytes, 0);
}

static void *at(struct cuvmm_region *r, size_t offset)
{
	return (char *)cuvmm_region_base(r) + offset;
}

/* Per-granule (G) patterns keyed by v, so ranges can be checked piecewise. */
static void fill_g(struct cuvmm_region *r, size_t first, size_t n, uint32_t v)
{
	for (size_t g = first; g < first + n; g++)
		ck_assert_int_eq(tc_fill(at(r, g * G), G / 4, v + (uint32_t)g * 0x9e3779b9u), 0);
}

static uint64_t check_g(struct cuvmm_region *r, size_t first, size_t n, uint32_t v)
{
	uint64_t bad = 0;

	for (size_t g = first; g < first + n; g++)
		bad += tc_check(at(r, g * G), G / 4, v + (uint32_t)g * 0x9e3779b9u);
	return bad;
}

/* The layout most tests use: 5 separate ranges of 2 granules (10 chunks, 5 spans to copy). */
#define NRANGES 5
static const size_t range_first[NRANGES] = {0, 4, 8, 12, 16};
#define RANGE_LEN 2
#define LAYOUT_BYTES ((size_t)NRANGES * RANGE_LEN * G)

static void map_layout(struct cuvmm_region *r, uint32_t v)
{
	for (int i = 0; i < NRANGES; i++) {
		ck_assert_int_eq(cuvmm_region_map(r, range_first[i] * G, RANGE_LEN * G), CUVMM_OK);
		fill_g(r, range_first[i], RANGE_LEN, v);
	}
}

static uint64_t check_layout(struct cuvmm_region *r, uint32_t v)
{
	uint64_t bad = 0;

	for (int i = 0; i < NRANGES; i++)
		bad += check_g(r, range_first[i], RANGE_LEN, v);
	return bad;
}

static void fill_layout(struct cuvmm_region *r, uint32_t v)
{
	for (int i = 0; i < NRANGES; i++)
		fill_g(r, range_first[i], RANGE_LEN, v);
}

/* Asleep: every call but wake, stats and destroy is refused, and changes nothing. */
static void expect_region_asleep(struct cuvmm_region *r, CUstream s, const char *what)
{
	const size_t gr = cuvmm_region_granularity(r);
	struct cuvmm_stats before = tc_region_stats(r), after;

	ck_assert_msg(cuvmm_region_map(r, 0, gr) == CUVMM_ESTATE, "%s: map of a sleeping region", what);
	ck_assert_msg(cuvmm_region_map(r, 2 * gr, gr) == CUVMM_ESTATE, "%s: map of a sleeping region", what);
	ck_assert_msg(cuvmm_region_unmap(r, 0, 2 * gr, NULL) == CUVMM_ESTATE, "%s: unmap of a sleeping region", what);
	ck_assert_msg(cuvmm_region_unmap(r, 0, 2 * gr, s) == CUVMM_ESTATE, "%s: unmap of a sleeping region", what);
	ck_assert_msg(cuvmm_region_resize(r, 4 * gr, NULL) == CUVMM_ESTATE, "%s: resize of a sleeping region", what);
	ck_assert_msg(cuvmm_region_resize(r, 0, s) == CUVMM_ESTATE, "%s: resize of a sleeping region", what);
	ck_assert_msg(cuvmm_region_sleep(r, CUVMM_SLEEP_OFFLOAD, NULL) == CUVMM_ESTATE, "%s: sleep again", what);
	ck_assert_msg(cuvmm_region_sleep(r, CUVMM_SLEEP_DISCARD, s) == CUVMM_ESTATE, "%s: sleep again", what);
	after = tc_region_stats(r);
	ck_assert_uint_eq(after.mapped_bytes, 0);
	ck_assert_uint_eq(after.held_bytes, 0);
	ck_assert_uint_eq(after.live_bytes, before.live_bytes);
	ck_assert_uint_eq(after.map_calls, before.map_calls);
	ck_assert_uint_eq(after.unmap_calls, before.unmap_calls);
}

/* ----- regions ----- */

/* Scattered ranges of a region, in units of its granularity: 2, 3, 1 and 4 units of 16. */
static const struct {
	size_t first, n;
} scattered[] = {{0, 2}, {3, 3}, {7, 1}, {12, 4}};
#define NSCATTERED 4
#define SCATTERED_UNITS 10

static void map_scattered(struct cuvmm_region *r)
{
	const size_t gr = cuvmm_region_granularity(r);

	for (int i = 0; i < NSCATTERED; i++)
		ck_assert_int_eq(cuvmm_region_map(r, scattered[i].first * gr, scattered[i].n * gr), CUVMM_OK);
}

static void fill_scattered(struct cuvmm_region *r, uint32_t v)
{
	const size_t k = cuvmm_region_granularity(r) / G;

	for (int i = 0; i < NSCATTERED; i++)
		fill_g(r, scattered[i].first * k, scattered[i].n * k, v);
}

static uint64_t check_scattered(struct cuvmm_region *r, uint32_t v)
{
	const size_t k = cuvmm_region_granularity(r) / G;
	uint64_t bad = 0;

	for (int i = 0; i < NSCATTERED; i++)
		bad += check_g(r, scattered[i].first * k, scattered[i].n * k, v);
	return bad;
}

/*
 * OFFLOAD and wake, twice: memory given back (device and OS), refused calls, same addresses, same contents,
 * same statistics. _i: bit 0 = on a stream (else NULL), bit 1 = a region of 4-granule (8 MiB) units.
 */
START_TEST(test_region_offload)
{
	const bool on_stream = _i & 1, coarse = _i & 2;
	const size_t gr = coarse ? 4 * G : G;
	struct cuvmm_ctx *ctx = ctx_with(-1);
	struct cuvmm_region *r = region_ex(ctx, 16 * gr, coarse ? gr : 0);
	void *base = cuvmm_region_base(r);
	struct tc_snap awake, asleep, now;
	struct cuvmm_stats st0, st;
	CUstream s = NULL;
	char what[64];

	snprintf(what, sizeof(what), "offload%s%s", on_stream ? " on a stream" : "", coarse ? ", 8 MiB units" : "");
	ck_assert_uint_eq(cuvmm_region_granularity(r), gr);
	if (on_stream)
		ck_assert_int_eq(tc_stream_create(&s), 0);
	map_scattered(r);
	fill_scattered(r, 51);
	ck_assert_int_eq(cuvmm_ctx_trim(ctx, -1, 0), CUVMM_OK);
	awake = tc_snap_take(ctx, r);
	st0 = tc_region_stats(r);
	ck_assert_uint_eq(awake.r_mapped, SCATTERED_UNITS * gr);
	ck_assert_uint_eq(awake.r_live, SCATTERED_UNITS * gr);
	ck_assert_uint_eq(awake.d_held, awake.r_held);

	for (uint32_t cycle = 0; cycle < 2; cycle++) {
		uint32_t v = 51 + cycle;

		ck_assert_int_eq(cuvmm_region_sleep(r, CUVMM_SLEEP_OFFLOAD, s), CUVMM_OK);
		asleep = tc_snap_take(ctx, r);
		ck_assert_uint_eq(asleep.r_mapped, 0);
		ck_assert_uint_eq(asleep.r_held, 0);
		ck_assert_uint_eq(asleep.r_live, awake.r_live); /* what wake brings back */
		ck_assert_uint_eq(asleep.r_reserved, awake.r_reserved);
		ck_assert_uint_eq(asleep.d_mapped, 0);
		ck_assert_uint_eq(asleep.d_held, 0); /* given back to the driver, not cached */
		ck_assert_uint_eq(asleep.d_live, awake.d_live);
		if (tc_on_host())
			ck_assert_int_eq(asleep.memfd, 0);
		st = tc_ctx_stats(ctx);
		ck_assert_uint_eq(st.create_calls, st.release_calls);
		expect_region_asleep(r, s, what);
		ck_assert_ptr_eq(cuvmm_region_base(r), base);
		ck_assert_uint_eq(cuvmm_region_size(r), 16 * gr);

		ck_assert_int_eq(cuvmm_region_wake(r, s), CUVMM_OK);
		ck_assert_int_eq(tc_stream_sync(s), 0);
		ck_assert_ptr_eq(cuvmm_region_base(r), base);
		now = tc_snap_take(ctx, r);
		tc_snap_expect_same(&awake, &now, what, true);
		ck_assert_uint_eq(check_scattered(r, v), 0);
		st = tc_region_stats(r);
		ck_assert_uint_eq(st.map_calls - st0.map_calls, (cycle + 1) * SCATTERED_UNITS); /* one chunk per unit */
		ck_assert_int_eq(cuvmm_region_wake(r, s), CUVMM_ESTATE);
		tc_assert_os_matches(ctx);
		fill_scattered(r, v + 1); /* new contents for the next cycle */
	}
	/* Awake and usable: map, unmap and resize work again. */
	ck_assert_int_eq(cuvmm_region_map(r, 2 * gr, gr), CUVMM_OK);
	ck_assert_uint_eq(tc_region_stats(r).mapped_bytes, awake.r_mapped + gr);
	ck_assert_int_eq(cuvmm_region_unmap(r, 2 * gr, gr, s), CUVMM_OK);
	ck_assert_int_eq(cuvmm_region_resize(r, 2 * gr, s), CUVMM_OK);
	tc_settle(ctx);
	ck_assert_uint_eq(tc_region_stats(r).mapped_bytes, 2 * gr);
	ck_assert_uint_eq(check_g(r, 0, 2 * gr / G, 53), 0);
	tc_stream_destroy(s);
	cuvmm_region_destroy(r);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/* DISCARD: the memory goes without a copy; wake maps exactly the same ranges again, usable. _i: stream. */
START_TEST(test_region_discard)
{
	struct cuvmm_ctx *ctx = ctx_with(-1);
	struct cuvmm_region *r = region(ctx, 16 * G);
	struct tc_snap awake, asleep, now;
	uint64_t host_regs, copies;
	CUstream s = NULL;

	if (_i)
		ck_assert_int_eq(tc_stream_create(&s), 0);
	map_scattered(r);
	fill_scattered(r, 61);
	ck_assert_int_eq(cuvmm_ctx_trim(ctx, -1, 0), CUVMM_OK);
	awake = tc_snap_take(ctx, r);
	host_regs = cuvmm_ctx_call_count(ctx, CUVMM_CALL_HOST_REGISTER);
	copies = cuvmm_ctx_call_count(ctx, CUVMM_CALL_COPY);

	ck_assert_int_eq(cuvmm_region_sleep(r, CUVMM_SLEEP_DISCARD, s), CUVMM_OK);
	asleep = tc_snap_take(ctx, r);
	ck_assert_uint_eq(asleep.r_mapped, 0);
	ck_assert_uint_eq(asleep.r_held, 0);
	ck_assert_uint_eq(asleep.r_live, awake.r_live);
	ck_assert_uint_eq(asleep.d_held, 0);
	if (tc_on_host())
		ck_assert_int_eq(asleep.memfd, 0);
	expect_region_asleep(r, s, "discard");

	ck_assert_int_eq(cuvmm_region_wake(r, s), CUVMM_OK);
	ck_assert_int_eq(tc_stream_sync(s), 0);
	now = tc_snap_take(ctx, r);
	tc_snap_expect_same(&awake, &now, "discard", true);
	/* no pinned memory, no copy either way */
	ck_assert_uint_eq(cuvmm_ctx_call_count(ctx, CUVMM_CALL_HOST_REGISTER), host_regs);
	ck_assert_uint_eq(cuvmm_ctx_call_count(ctx, CUVMM_CALL_COPY), copies);
	/* the same ranges are mapped and usable (contents unspecified) */
	fill_scattered(r, 62);
	ck_assert_uint_eq(check_scattered(r, 62), 0);
	ck_assert_int_eq(cuvmm_region_map(r, 2 * G, G), CUVMM_OK);
	ck_assert_uint_eq(tc_region_stats(r).mapped_bytes, (SCATTERED_UNITS + 1) * G);
	tc_stream_destroy(s);
	cuvmm_region_destroy(r);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/* A region with nothing mapped sleeps and wakes; nothing is copied or allocated. */
START_TEST(test_region_sleep_empty)
{
	struct cuvmm_ctx *ctx = ctx_with(-1);
	struct cuvmm_region *r = region(ctx, 8 * G);
	struct cuvmm_stats st;

	for (int mode = 0; mode < 2; mode++) {
		ck_assert_int_eq(cuvmm_region_sleep(r, (enum cuvmm_sleep_mode)mode, NULL), CUVMM_OK);
		expect_region_asleep(r, NULL, "empty");
		ck_assert_int_eq(cuvmm_region_wake(r, NULL), CUVMM_OK);
		st = tc_region_stats(r);
		ck_assert_uint_eq(st.mapped_bytes, 0);
		ck_assert_uint_eq(st.live_bytes, 0);
	}
	ck_assert_uint_eq(cuvmm_ctx_call_count(ctx, CUVMM_CALL_HOST_REGISTER), 0);
	ck_assert_uint_eq(cuvmm_ctx_call_count(ctx, CUVMM_CALL_COPY), 0);

	/* mapped, then unmapped again: nothing to sleep either */
	ck_assert_int_eq(cuvmm_region_map(r, 0, 4 * G), CUVMM_OK);
	ck_assert_int_eq(cuvmm_region_unmap(r, 0, 4 * G, NULL), CUVMM_OK);
	ck_assert_int_eq(cuvmm_region_sleep(r, CUVMM_SLEEP_OFFLOAD, NULL), CUVMM_OK);
	ck_assert_uint_eq(tc_ctx_stats(ctx).held_bytes, 0); /* the cached chunks went too */
	ck_assert_int_eq(cuvmm_region_wake(r, NULL), CUVMM_OK);
	ck_assert_uint_eq(tc_region_stats(r).mapped_bytes, 0);
	ck_assert_int_eq(cuvmm_region_map(r, 0, G), CUVMM_OK);
	fill_g(r, 0, 1, 71);
	ck_assert_uint_eq(check_g(r, 0, 1, 71), 0);
	cuvmm_region_destroy(r);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/* Argument and state checks. */
START_TEST(test_sleep_einval_estate)
{
	struct cuvmm_ctx *ctx = ctx_with(-1);
	struct cuvmm_region *r = region(ctx, 8 * G);
	struct cuvmm_pool_config pc;
	struct cuvmm_pool *p = NULL;
	void *ptr;

	ck_assert_int_eq(cuvmm_region_map(r, 0, 2 * G), CUVMM_OK);
	fill_g(r, 0, 2, 81);
	ck_assert_int_eq(cuvmm_region_sleep(NULL, CUVMM_SLEEP_OFFLOAD, NULL), CUVMM_EINVAL);
	ck_assert_int_eq(cuvmm_region_wake(NULL, NULL), CUVMM_EINVAL);
	ck_assert_int_eq(cuvmm_region_sleep(r, (enum cuvmm_sleep_mode)2, NULL), CUVMM_EINVAL);
	ck_assert_int_eq(cuvmm_region_sleep(r, (enum cuvmm_sleep_mode)-1, NULL), CUVMM_EINVAL);
	ck_assert_int_eq(cuvmm_region_wake(r, NULL), CUVMM_ESTATE); /* awake */
	/* still awake, untouched */
	ck_assert_uint_eq(tc_region_stats(r).mapped_bytes, 2 * G);
	ck_assert_int_eq(cuvmm_region_map(r, 2 * G, G), CUVMM_OK);
	ck_assert_uint_eq(check_g(r, 0, 2, 81), 0);
	/* a bad mode on a sleeping region is still a bad mode, and it stays asleep */
	ck_assert_int_eq(cuvmm_region_sleep(r, CUVMM_SLEEP_OFFLOAD, NULL), CUVMM_OK);
	ck_assert_int_eq(cuvmm_region_sleep(r, (enum cuvmm_sleep_mode)7, NULL), CUVMM_EINVAL);
	ck_assert_int_eq(cuvmm_region_map(r, 0, G), CUVMM_ESTATE);
	ck_assert_int_eq(cuvmm_region_wake(r, NULL), CUVMM_OK);
	ck_assert_uint_eq(check_g(r, 0, 2, 81), 0);

	cuvmm_pool_config_init(&pc);
	pc.max_bytes = 64 * TC_MiB;
	ck_assert_int_eq(cuvmm_pool_create(ctx, &pc, &p), CUVMM_OK);
	ck_assert_int_eq(cuvmm_malloc(p, 4096, &ptr), CUVMM_OK);
	ck_assert_int_eq(cuvmm_pool_sleep(NULL, CUVMM_SLEEP_OFFLOAD, NULL), CUVMM_EINVAL);
	ck_assert_int_eq(cuvmm_pool_wake(NULL, NULL), CUVMM_EINVAL);
	ck_assert_int_eq(cuvmm_pool_sleep(p, (enum cuvmm_sleep_mode)2, NULL), CUVMM_EINVAL);
	ck_assert_int_eq(cuvmm_pool_wake(p, NULL), CUVMM_ESTATE);
	ck_assert_int_eq(cuvmm_free(p, ptr), CUVMM_OK); /* awake */
	cuvmm_pool_destroy(p);
	cuvmm_region_destroy(r);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/* Destroying a sleeping region (or leaving it to the context) frees its host copy (no leak under ASan) and gives
 * back every count, live bytes included. */
START_TEST(test_region_destroy_asleep)
{
	struct cuvmm_ctx *ctx = ctx_with(-1);
	struct cuvmm_region *r = region(ctx, 16 * G), *r2;
	struct cuvmm_stats st;

	map_scattered(r);
	fill_scattered(r, 91);
	ck_assert_int_eq(cuvmm_region_sleep(r, CUVMM_SLEEP_OFFLOAD, NULL), CUVMM_OK);
	ck_assert_uint_eq(tc_ctx_stats(ctx).live_bytes, SCATTERED_UNITS * G);
	cuvmm_region_destroy(r);
	st = tc_ctx_stats(ctx);
	ck_assert_uint_eq(st.reserved_bytes, 0);
	ck_assert_uint_eq(st.held_bytes, 0);
	ck_assert_uint_eq(st.mapped_bytes, 0);
	tc_assert_os_matches(ctx);

	/* one left to the context */
	r2 = region(ctx, 16 * G);
	map_scattered(r2);
	ck_assert_int_eq(cuvmm_region_sleep(r2, CUVMM_SLEEP_OFFLOAD, NULL), CUVMM_OK);
	tc_log_capture(CUVMM_LOG_WARN);
	cuvmm_ctx_destroy(ctx);
	ck_assert_int_ge(tc_log_count(CUVMM_LOG_WARN, "region"), 1);
	/* checked last, so that the rest runs (and ASan sees the whole teardown) whatever this says */
	ck_assert_msg(st.live_bytes == 0, "the device counts %llu live bytes after its only region was destroyed asleep",
		      (unsigned long long)st.live_bytes);
}
END_TEST

/* Pending unmaps are not contents: sleep waits for their fence (the host gate), and they stay unmapped. */
START_TEST(test_region_sleep_pending_unmap)
{
	struct cuvmm_ctx *ctx;
	struct cuvmm_region *r;
	struct tc_opener o = {150, 0};
	pthread_t t;
	struct cuvmm_stats st;
	CUstream s;

	if (!tc_on_host()) {
		printf("test_region_sleep_pending_unmap: host backend only (uses the host gate)\n");
		return;
	}
	ctx = ctx_with(-1);
	r = region(ctx, 16 * G);
	ck_assert_int_eq(tc_stream_create(&s), 0);
	map_scattered(r);
	fill_scattered(r, 101);
	cvm_host_gate_close();
	ck_assert_int_eq(cuvmm_region_unmap(r, 12 * G, 4 * G, s), CUVMM_OK); /* pending behind the gate */
	st = tc_region_stats(r);
	ck_assert_uint_eq(st.mapped_bytes, SCATTERED_UNITS * G);
	ck_assert_uint_eq(st.live_bytes, (SCATTERED_UNITS - 4) * G);
	ck_assert_int_eq(pthread_create(&t, NULL, tc_open_gate_later, &o), 0);
	ck_assert_int_eq(cuvmm_region_sleep(r, CUVMM_SLEEP_OFFLOAD, NULL), CUVMM_OK);
	ck_assert_msg(__atomic_load_n(&o.opened, __ATOMIC_SEQ_CST), "sleep returned before the pending unmap's fence");
	pthread_join(t, NULL);
	st = tc_region_stats(r);
	ck_assert_uint_eq(st.mapped_bytes, 0);
	ck_assert_uint_eq(st.live_bytes, (SCATTERED_UNITS - 4) * G);
	ck_assert_uint_eq(tc_ctx_stats(ctx).held_bytes, 0);
	ck_assert_int_eq(cuvmm_region_wake(r, NULL), CUVMM_OK);
	st = tc_region_stats(r);
	ck_assert_uint_eq(st.mapped_bytes, (SCATTERED_UNITS - 4) * G);
	ck_assert_uint_eq(st.live_bytes, (SCATTERED_UNITS - 4) * G);
	ck_assert_uint_eq(check_g(r, 0, 2, 101) + check_g(r, 3, 3, 101) + check_g(r, 7, 1, 101), 0);
	tc_assert_os_matches(ctx);
	cuvmm_region_destroy(r);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/* ----- pools ----- */

static const size_t pool_sizes[] = {
	256, 400, 4096, 10000, 65536, 300 * TC_KiB, TC_MiB, TC_MiB + 4096, 3 * TC_MiB, 5 * TC_MiB + 4096,
	17 * TC_MiB, 40 * TC_MiB,
};
#define NPOOL_SIZES ((int)(sizeof(pool_sizes) / sizeof(pool_sizes[0])))
#define NPTR (3 * NPOOL_SIZES)

struct pool_state {
	struct cuvmm_pool *p;
	void *ptr[NPTR];
	size_t size[NPTR];
	bool live[NPTR];
};

static uint32_t pkey(int i, uint32_t gen)
{
	return 0x3c6ef372u ^ ((uint32_t)i * 0x27d4eb2fu) ^ gen;
}

static struct cuvmm_pool *pool_new(struct cuvmm_ctx *ctx)
{
	struct cuvmm_pool_config pc;
	struct cuvmm_pool *p = NULL;

	cuvmm_pool_config_init(&pc);
	pc.max_bytes = 512 * TC_MiB;
	pc.name = "sleepy";
	ck_assert_int_eq(cuvmm_pool_create(ctx, &pc, &p), CUVMM_OK);
	return p;
}

/* Small and large allocations, every third one freed again. */
static void pool_populate(struct pool_state *ps, uint32_t gen)
{
	for (int i = 0; i < NPTR; i++) {
		ps->size[i] = pool_sizes[i % NPOOL_SIZES];
		ck_assert_int_eq(cuvmm_malloc(ps->p, ps->size[i], &ps->ptr[i]), CUVMM_OK);
		ck_assert_int_eq(tc_fill(ps->ptr[i], ps->size[i] / 4, pkey(i, gen)), 0);
		ps->live[i] = true;
	}
	for (int i = 0; i < NPTR; i += 3) {
		ck_assert_int_eq(cuvmm_free(ps->p, ps->ptr[i]), CUVMM_OK);
		ps->live[i] = false;
	}
}

static uint64_t pool_check(struct pool_state *ps, uint32_t gen)
{
	uint64_t bad = 0;

	for (int i = 0; i < NPTR; i++)
		if (ps->live[i])
			bad += tc_check(ps->ptr[i], ps->size[i] / 4, pkey(i, gen));
	return bad;
}

/* Asleep: malloc, free and sleep refused (pool_trim is checked on its own in test_pool_trim_asleep). */
static void expect_pool_asleep(struct pool_state *ps, CUstream s)
{
	void *q = (void *)(uintptr_t)0x1234;
	int live = -1;

	for (int i = 0; i < NPTR && live < 0; i++)
		if (ps->live[i])
			live = i;
	ck_assert_int_eq(cuvmm_malloc(ps->p, 4096, &q), CUVMM_ESTATE);
	ck_assert_int_eq(cuvmm_malloc(ps->p, 8 * TC_MiB, &q), CUVMM_ESTATE);
	ck_assert_int_eq(cuvmm_malloc_async(ps->p, 4096, s, &q), CUVMM_ESTATE);
	ck_assert_ptr_eq(q, (void *)(uintptr_t)0x1234);
	ck_assert_int_eq(cuvmm_free(ps->p, ps->ptr[live]), CUVMM_ESTATE);
	ck_assert_int_eq(cuvmm_free_async(ps->p, ps->ptr[live], s), CUVMM_ESTATE);
	ck_assert_int_eq(cuvmm_pool_sleep(ps->p, CUVMM_SLEEP_OFFLOAD, NULL), CUVMM_ESTATE);
	ck_assert_int_eq(cuvmm_pool_sleep(ps->p, CUVMM_SLEEP_DISCARD, s), CUVMM_ESTATE);
}

/* _i: 0 = OFFLOAD, 1 = DISCARD. */
START_TEST(test_pool_sleep_wake)
{
	const enum cuvmm_sleep_mode mode = _i ? CUVMM_SLEEP_DISCARD : CUVMM_SLEEP_OFFLOAD;
	struct cuvmm_ctx *ctx = ctx_with(-1);
	struct pool_state ps;
	struct cuvmm_stats before, st;
	CUstream s;
	void *q[4];

	memset(&ps, 0, sizeof(ps));
	ck_assert_int_eq(tc_stream_create(&s), 0);
	ps.p = pool_new(ctx);
	pool_populate(&ps, 1);
	before = tc_pool_stats(ps.p);
	ck_assert_uint_gt(before.held_bytes, 0);

	ck_assert_int_eq(cuvmm_pool_sleep(ps.p, mode, NULL), CUVMM_OK);
	st = tc_pool_stats(ps.p);
	ck_assert_uint_eq(st.held_bytes, 0); /* free memory given back too */
	ck_assert_uint_eq(st.mapped_bytes, 0);
	ck_assert_uint_eq(st.live_bytes, before.live_bytes);
	st = tc_ctx_stats(ctx);
	ck_assert_uint_eq(st.held_bytes, 0);
	ck_assert_uint_eq(st.mapped_bytes, 0);
	ck_assert_uint_eq(st.live_bytes, before.live_bytes);
	if (tc_on_host())
		ck_assert_int_eq(tc_memfd_bytes(), 0);
	expect_pool_asleep(&ps, s);
	ck_assert_uint_eq(tc_pool_stats(ps.p).live_bytes, before.live_bytes);

	ck_assert_int_eq(cuvmm_pool_wake(ps.p, NULL), CUVMM_OK);
	ck_assert_int_eq(cuvmm_pool_wake(ps.p, NULL), CUVMM_ESTATE);
	st = tc_pool_stats(ps.p);
	ck_assert_uint_eq(st.live_bytes, before.live_bytes);
	ck_assert_uint_eq(st.held_bytes, st.mapped_bytes);
	ck_assert_uint_le(st.mapped_bytes, before.mapped_bytes); /* the free memory stays given back */
	ck_assert_uint_ge(st.mapped_bytes, st.live_bytes);
	tc_assert_os_matches(ctx);
	if (mode == CUVMM_SLEEP_OFFLOAD) {
		ck_assert_uint_eq(pool_check(&ps, 1), 0);
	} else {
		for (int i = 0; i < NPTR; i++) /* pointers valid, contents unspecified */
			if (ps.live[i])
				ck_assert_int_eq(tc_fill(ps.ptr[i], ps.size[i] / 4, pkey(i, 1)), 0);
		ck_assert_uint_eq(pool_check(&ps, 1), 0);
	}

	/* The allocator works: new allocations of every kind, old pointers freed. */
	ck_assert_int_eq(cuvmm_malloc(ps.p, 512, &q[0]), CUVMM_OK);
	ck_assert_int_eq(cuvmm_malloc(ps.p, 200 * TC_KiB, &q[1]), CUVMM_OK);
	ck_assert_int_eq(cuvmm_malloc(ps.p, 6 * TC_MiB, &q[2]), CUVMM_OK);
	ck_assert_int_eq(cuvmm_malloc_async(ps.p, 64 * TC_KiB, s, &q[3]), CUVMM_OK);
	ck_assert_int_eq(tc_fill(q[0], 512 / 4, 5), 0);
	ck_assert_int_eq(tc_fill(q[1], 200 * TC_KiB / 4, 6), 0);
	ck_assert_int_eq(tc_fill(q[2], 6 * TC_MiB / 4, 7), 0);
	ck_assert_int_eq(tc_stream_sync(s), 0);
	ck_assert_int_eq(tc_fill(q[3], 64 * TC_KiB / 4, 8), 0);
	ck_assert_uint_eq(pool_check(&ps, 1), 0);
	ck_assert_uint_eq(tc_check(q[0], 512 / 4, 5) + tc_check(q[1], 200 * TC_KiB / 4, 6) +
				  tc_check(q[2], 6 * TC_MiB / 4, 7) + tc_check(q[3], 64 * TC_KiB / 4, 8),
			  0);
	for (int i = 0; i < NPTR; i++)
		if (ps.live[i]) {
			ck_assert_int_eq(cuvmm_free(ps.p, ps.ptr[i]), CUVMM_OK);
			ps.live[i] = false;
		}
	for (int i = 0; i < 3; i++)
		ck_assert_int_eq(cuvmm_free(ps.p, q[i]), CUVMM_OK);
	ck_assert_int_eq(cuvmm_free_async(ps.p, q[3], s), CUVMM_OK);
	ck_assert_uint_eq(tc_pool_stats(ps.p).live_bytes, 0);
	ck_assert_int_eq(cuvmm_pool_trim(ps.p, 0), CUVMM_OK);
	ck_assert_uint_eq(tc_pool_stats(ps.p).held_bytes, 0);

	/* And a second cycle on an empty pool. */
	ck_assert_int_eq(cuvmm_pool_sleep(ps.p, mode, s), CUVMM_OK);
	ck_assert_int_eq(cuvmm_pool_wake(ps.p, s), CUVMM_OK);
	ck_assert_int_eq(cuvmm_malloc(ps.p, 4096, &q[0]), CUVMM_OK);
	ck_assert_int_eq(cuvmm_free(ps.p, q[0]), CUVMM_OK);
	tc_stream_destroy(s);
	cuvmm_pool_destroy(ps.p);
	st = tc_ctx_stats(ctx);
	ck_assert_uint_eq(st.live_bytes, 0);
	ck_assert_uint_eq(st.reserved_bytes, 0);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/* The end of a test whose pool has everything freed: trim gives all of it back, then both go. */
static void trim_close(struct cuvmm_ctx *ctx, struct cuvmm_pool *p)
{
	ck_assert_int_eq(cuvmm_pool_trim(p, 0), CUVMM_OK);
	ck_assert_uint_eq(tc_ctx_stats(ctx).held_bytes, 0);
	tc_assert_os_matches(ctx);
	cuvmm_pool_destroy(p);
	cuvmm_ctx_destroy(ctx);
}

/*
 * A pool's wake maps each large allocation with handles as large as fit (up to 64 granules) instead of the
 * 2 MiB ones it had: a 64-granule allocation at granule 0 comes back as one chunk, its contents intact, and
 * the next sleep unmaps and releases one handle instead of 64. The coarse memory is reused like any large-handle
 * memory once freed, and trim gives all of it back.
 */
START_TEST(test_pool_wake_coarsens)
{
	struct cuvmm_ctx *ctx = ctx_with(-1);
	struct cuvmm_pool *p = pool_new(ctx);
	size_t g, k = 64;
	void *a, *small, *again;
	uint64_t maps, unmaps, releases;

	g = tc_granularity(ctx);

	ck_assert_int_eq(cuvmm_malloc(p, k * g, &a), CUVMM_OK);
	ck_assert_int_eq(cuvmm_malloc(p, 1000, &small), CUVMM_OK);
	ck_assert_int_eq(tc_fill(a, k * g / 4, 0xa11), 0);
	ck_assert_int_eq(tc_fill(small, 1000 / 4, 0x5a1), 0);
	ck_assert_uint_eq(cuvmm_ctx_call_count(ctx, CUVMM_CALL_MAP), k + 1); /* 2 MiB handles below 1 GiB */

	for (int cycle = 0; cycle < 2; cycle++) {
		unmaps = cuvmm_ctx_call_count(ctx, CUVMM_CALL_UNMAP);
		releases = cuvmm_ctx_call_count(ctx, CUVMM_CALL_RELEASE);
		ck_assert_int_eq(cuvmm_pool_sleep(p, CUVMM_SLEEP_OFFLOAD, NULL), CUVMM_OK);
		ck_assert_uint_eq(cuvmm_ctx_call_count(ctx, CUVMM_CALL_UNMAP) - unmaps, cycle ? 2 : k + 1);
		ck_assert_uint_eq(cuvmm_ctx_call_count(ctx, CUVMM_CALL_RELEASE) - releases, cycle ? 2 : k + 1);
		ck_assert_uint_eq(tc_ctx_stats(ctx).held_bytes, 0);
		if (cycle == 0) {
			/* A coarse chunk that fails to map: the wake undoes what it mapped and the pool stays asleep. */
			void *q = NULL;

			ck_assert_int_eq(cuvmm_ctx_inject_fault(ctx, CUVMM_CALL_MAP, 1, 1, CUVMM_EDRIVER), CUVMM_OK);
			ck_assert_int_eq(cuvmm_pool_wake(p, NULL), CUVMM_EDRIVER);
			ck_assert_uint_eq(tc_ctx_stats(ctx).held_bytes, 0);
			ck_assert_uint_eq(tc_pool_stats(p).mapped_bytes, 0);
			ck_assert_int_eq(cuvmm_malloc(p, 4096, &q), CUVMM_ESTATE);
			tc_assert_os_matches(ctx);
		}
		maps = cuvmm_ctx_call_count(ctx, CUVMM_CALL_MAP);
		ck_assert_int_eq(cuvmm_pool_wake(p, NULL), CUVMM_OK);
		ck_assert_uint_eq(cuvmm_ctx_call_count(ctx, CUVMM_CALL_MAP) - maps, 2);
		ck_assert_uint_eq(tc_check(a, k * g / 4, 0xa11), 0);
		ck_assert_uint_eq(tc_check(small, 1000 / 4, 0x5a1), 0);
		ck_assert_uint_eq(tc_pool_stats(p).mapped_bytes, (k + 1) * g);
		tc_assert_os_matches(ctx);
	}
	/* Freed, the coarse run serves the same size again without a driver call. */
	ck_assert_int_eq(cuvmm_free(p, a), CUVMM_OK);
	maps = cuvmm_ctx_call_count(ctx, CUVMM_CALL_MAP);
	ck_assert_int_eq(cuvmm_malloc(p, k * g, &again), CUVMM_OK);
	ck_assert_ptr_eq(again, a);
	ck_assert_uint_eq(cuvmm_ctx_call_count(ctx, CUVMM_CALL_MAP), maps);
	ck_assert_int_eq(tc_fill(again, k * g / 4, 0xb22), 0);
	ck_assert_uint_eq(tc_check(again, k * g / 4, 0xb22), 0);
	ck_assert_int_eq(cuvmm_free(p, again), CUVMM_OK);
	ck_assert_int_eq(cuvmm_free(p, small), CUVMM_OK);
	trim_close(ctx, p);
}
END_TEST

/*
 * Packed allocations (above the slab limit, up to 32 granules) lie on back-to-back granules of their own
 * 2 MiB handles; a wake maps them in handles of up to 32 granules, so the next sleep unmaps fewer, the
 * contents intact. The PACK runs of each coarse chunk become one: a chunk goes back once no live byte is
 * left on it, and not before (one live allocation keeps its chunk, not just its granules).
 */
START_TEST(test_pool_wake_coarsens_packed)
{
	struct cuvmm_ctx *ctx = ctx_with(-1);
	struct cuvmm_pool *p = pool_new(ctx);
	enum { N = 40 };
	void *a[N], *more = NULL;
	size_t g, each;
	uint64_t unmaps, first_unmaps;

	g = tc_granularity(ctx);
	each = g + g / 2; /* a granule and a half: packed, two allocations share a granule */
	for (int i = 0; i < N; i++) {
		ck_assert_int_eq(cuvmm_malloc(p, each, &a[i]), CUVMM_OK);
		ck_assert_int_eq(tc_fill(a[i], each / 4, 0x1000u + (uint32_t)i), 0);
	}
	ck_assert_uint_eq(tc_pool_stats(p).mapped_bytes, (size_t)N * each / g * g); /* 60 granules, no waste */
	for (int cycle = 0; cycle < 2; cycle++) {
		unmaps = cuvmm_ctx_call_count(ctx, CUVMM_CALL_UNMAP);
		ck_assert_int_eq(cuvmm_pool_sleep(p, CUVMM_SLEEP_OFFLOAD, NULL), CUVMM_OK);
		unmaps = cuvmm_ctx_call_count(ctx, CUVMM_CALL_UNMAP) - unmaps;
		if (cycle == 0) {
			ck_assert_uint_eq(unmaps, (size_t)N * each / g); /* one 2 MiB handle per granule */
			first_unmaps = unmaps;
		} else {
			ck_assert_msg(unmaps * 8 <= first_unmaps, "after a wake, a sleep unmapped %llu handles (first %llu)",
				      (unsigned long long)unmaps, (unsigned long long)first_unmaps);
		}
		ck_assert_uint_eq(tc_ctx_stats(ctx).held_bytes, 0);
		ck_assert_int_eq(cuvmm_pool_wake(p, NULL), CUVMM_OK);
		for (int i = 0; i < N; i++)
			ck_assert_uint_eq(tc_check(a[i], each / 4, 0x1000u + (uint32_t)i), 0);
		tc_assert_os_matches(ctx);
	}
	/* Packing goes on over the coarse chunks: a new allocation, then everything but one in the middle
	 * freed. What stays held is that allocation's chunks, at most two of 32 granules. */
	ck_assert_int_eq(cuvmm_malloc(p, each, &more), CUVMM_OK);
	ck_assert_int_eq(tc_fill(more, each / 4, 0x77), 0);
	ck_assert_int_eq(cuvmm_free(p, more), CUVMM_OK);
	for (int i = 0; i < N; i++)
		if (i != N / 2)
			ck_assert_int_eq(cuvmm_free(p, a[i]), CUVMM_OK);
	ck_assert_int_eq(cuvmm_pool_trim(p, 0), CUVMM_OK);
	ck_assert_uint_ge(tc_ctx_stats(ctx).held_bytes, 2 * g);
	ck_assert_uint_le(tc_ctx_stats(ctx).held_bytes, 64 * g);
	ck_assert_uint_eq(tc_check(a[N / 2], each / 4, 0x1000u + N / 2), 0);
	ck_assert_int_eq(cuvmm_free(p, a[N / 2]), CUVMM_OK);
	trim_close(ctx, p);
}
END_TEST

/* cuvmm_pool_trim on a sleeping pool: cuvmm.h, "While an object sleeps, calls on it other than wake, stats and
 * destroy fail with CUVMM_ESTATE". */
START_TEST(test_pool_trim_asleep)
{
	struct cuvmm_ctx *ctx = ctx_with(-1);
	struct pool_state ps;
	int got;

	memset(&ps, 0, sizeof(ps));
	ps.p = pool_new(ctx);
	pool_populate(&ps, 2);
	ck_assert_int_eq(cuvmm_pool_sleep(ps.p, CUVMM_SLEEP_OFFLOAD, NULL), CUVMM_OK);
	got = cuvmm_pool_trim(ps.p, 0);
	ck_assert_int_eq(cuvmm_pool_wake(ps.p, NULL), CUVMM_OK);
	ck_assert_uint_eq(pool_check(&ps, 2), 0);
	ck_assert_msg(got == CUVMM_ESTATE, "cuvmm_pool_trim on a sleeping pool returned %s, want CUVMM_ESTATE",
		      cuvmm_err_name(got));
	cuvmm_pool_destroy(ps.p);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/* Destroying a sleeping pool frees everything. */
START_TEST(test_pool_destroy_asleep)
{
	struct cuvmm_ctx *ctx = ctx_with(-1);
	struct pool_state ps;
	struct cuvmm_stats st;

	memset(&ps, 0, sizeof(ps));
	ps.p = pool_new(ctx);
	pool_populate(&ps, 3);
	ck_assert_int_eq(cuvmm_pool_sleep(ps.p, CUVMM_SLEEP_OFFLOAD, NULL), CUVMM_OK);
	tc_log_capture(CUVMM_LOG_WARN);
	cuvmm_pool_destroy(ps.p);
	st = tc_ctx_stats(ctx);
	ck_assert_uint_eq(st.reserved_bytes, 0);
	ck_assert_uint_eq(st.held_bytes, 0);
	ck_assert_uint_eq(st.live_bytes, 0);
	tc_assert_os_matches(ctx);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/* ----- fault injection ----- */

/* A region laid out as map_layout() with contents 111, the cache emptied. */
static struct cuvmm_region *fault_region(struct cuvmm_ctx *ctx)
{
	struct cuvmm_region *r = region(ctx, 20 * G);

	map_layout(r, 111);
	ck_assert_int_eq(cuvmm_ctx_trim(ctx, -1, 0), CUVMM_OK);
	return r;
}

/*
 * Sleep failing: HOST_REGISTER, COPY (first, second, last piece), UNMAP (first, second, sixth, last chunk), and
 * DEVICE_SYNC (NULL stream). The region stays awake and intact, every chunk back in place; sleep then works.
 */
static const struct {
	enum cuvmm_call call;
	uint64_t skip;
	int err;
	bool stream;
} sleep_faults[] = {
	{CUVMM_CALL_HOST_REGISTER, 0, CUVMM_ENOMEM, false},
	{CUVMM_CALL_HOST_REGISTER, 0, CUVMM_EDRIVER, true},
	{CUVMM_CALL_COPY, 0, CUVMM_EDRIVER, false},
	{CUVMM_CALL_COPY, 1, CUVMM_EDRIVER, true},
	{CUVMM_CALL_COPY, 4, CUVMM_EDRIVER, false},
	{CUVMM_CALL_UNMAP, 0, CUVMM_EDRIVER, false},
	{CUVMM_CALL_UNMAP, 1, CUVMM_EDRIVER, true},
	{CUVMM_CALL_UNMAP, 5, CUVMM_EDRIVER, false},
	{CUVMM_CALL_UNMAP, 9, CUVMM_EDRIVER, false},
	{CUVMM_CALL_DEVICE_SYNC, 0, CUVMM_EDRIVER, false},
};
#define SLEEP_FAULT_CASES ((int)(sizeof(sleep_faults) / sizeof(sleep_faults[0])))

START_TEST(test_fault_sleep)
{
	const enum cuvmm_call call = sleep_faults[_i].call;
	const uint64_t skip = sleep_faults[_i].skip;
	const int err = sleep_faults[_i].err;
	struct cuvmm_ctx *ctx = ctx_with(-1);
	struct cuvmm_region *r = fault_region(ctx);
	struct tc_snap before, after;
	CUstream s = NULL;
	uint64_t calls;
	char what[96];
	int got;

	snprintf(what, sizeof(what), "%s failing after %llu calls in a sleep%s", cuvmm_call_name(call),
		 (unsigned long long)skip, sleep_faults[_i].stream ? " on a stream" : "");
	if (sleep_faults[_i].stream)
		ck_assert_int_eq(tc_stream_create(&s), 0);
	before = tc_snap_take(ctx, r);
	calls = cuvmm_ctx_call_count(ctx, call);
	ck_assert_int_eq(cuvmm_ctx_inject_fault(ctx, call, skip, 1, err), CUVMM_OK);
	tc_log_capture(CUVMM_LOG_ERROR);
	got = cuvmm_region_sleep(r, CUVMM_SLEEP_OFFLOAD, s);
	ck_assert_msg(got == err, "%s: returned %s, want %s", what, cuvmm_err_name(got), cuvmm_err_name(err));
	ck_assert_uint_eq(cuvmm_ctx_call_count(ctx, call) - calls, skip + 1);
	after = tc_snap_take(ctx, r);
	tc_snap_expect_same(&before, &after, what, true);
	ck_assert_msg(check_layout(r, 111) == 0, "%s: contents changed", what);
	/* awake: it maps, and sleeps */
	ck_assert_int_eq(cuvmm_region_map(r, 2 * G, G), CUVMM_OK);
	ck_assert_int_eq(cuvmm_region_unmap(r, 2 * G, G, NULL), CUVMM_OK);
	ck_assert_int_eq(cuvmm_region_sleep(r, CUVMM_SLEEP_OFFLOAD, s), CUVMM_OK);
	ck_assert_uint_eq(tc_region_stats(r).held_bytes, 0);
	ck_assert_int_eq(cuvmm_region_wake(r, s), CUVMM_OK);
	ck_assert_int_eq(tc_stream_sync(s), 0);
	ck_assert_uint_eq(check_layout(r, 111), 0);
	ck_assert_uint_eq(tc_region_stats(r).mapped_bytes, LAYOUT_BYTES);
	tc_stream_destroy(s);
	cuvmm_region_destroy(r);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/* DISCARD pins nothing: a HOST_REGISTER or COPY fault does not stop it. */
START_TEST(test_fault_discard_needs_no_copy)
{
	struct cuvmm_ctx *ctx = ctx_with(-1);
	struct cuvmm_region *r = fault_region(ctx);

	ck_assert_int_eq(cuvmm_ctx_inject_fault(ctx, CUVMM_CALL_HOST_REGISTER, 0, UINT32_MAX, CUVMM_ENOMEM), CUVMM_OK);
	ck_assert_int_eq(cuvmm_ctx_inject_fault(ctx, CUVMM_CALL_COPY, 0, UINT32_MAX, CUVMM_EDRIVER), CUVMM_OK);
	ck_assert_int_eq(cuvmm_region_sleep(r, CUVMM_SLEEP_DISCARD, NULL), CUVMM_OK);
	ck_assert_int_eq(cuvmm_region_wake(r, NULL), CUVMM_OK);
	ck_assert_uint_eq(tc_region_stats(r).mapped_bytes, LAYOUT_BYTES);
	fill_layout(r, 112);
	ck_assert_uint_eq(check_layout(r, 112), 0);
	cuvmm_region_destroy(r);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/* ----- the host copy: pinned in pieces, by several threads ----- */

#define PIN_PIECE (64 * TC_MiB) /* lib/region_sleep.c's CVM_COPY_PIECE */

/* 72 granules, [0, 20) and [22, 70) mapped: spans of 40 and 96 MiB whose copies cross the host copy's
 * pieces (64 + 64 + 8 MiB) at 64 and 128 MiB, inside the second span. */
static struct cuvmm_region *pin_region(struct cuvmm_ctx *ctx, uint32_t v)
{
	struct cuvmm_region *r = region(ctx, 72 * G);

	ck_assert_int_eq(cuvmm_region_map(r, 0, 20 * G), CUVMM_OK);
	ck_assert_int_eq(cuvmm_region_map(r, 22 * G, 48 * G), CUVMM_OK);
	fill_g(r, 0, 20, v);
	fill_g(r, 22, 48, v);
	ck_assert_int_eq(cuvmm_ctx_trim(ctx, -1, 0), CUVMM_OK);
	return r;
}

static uint64_t pin_check(struct cuvmm_region *r, uint32_t v)
{
	return check_g(r, 0, 20, v) + check_g(r, 22, 48, v);
}

static void set_threads(unsigned n)
{
	char v[16];

	snprintf(v, sizeof(v), "%u", n);
	tc_env_set("CUVMM_PIN_THREADS", v);
}

static size_t registered(void)
{
	return tc_on_host() ? cvm_host_registered_bytes() : 0;
}

/* A 136 MiB copy: 3 pieces registered (one call each) by 1, 2, 3 and 16 threads (at most 3 start), the
 * contents back after wake, the pinned copy kept for the next sleep (no new registration) and unpinned by
 * destroy. */
static const unsigned pin_threads[] = {1, 2, 3, 16};

START_TEST(test_pin_pieces)
{
	struct cuvmm_ctx *ctx = ctx_with(-1);
	size_t reg0 = registered();
	struct cuvmm_region *r;
	uint64_t calls;
	CUstream s = NULL;

	set_threads(pin_threads[_i]);
	if (_i & 1)
		ck_assert_int_eq(tc_stream_create(&s), 0);
	r = pin_region(ctx, 71);
	calls = cuvmm_ctx_call_count(ctx, CUVMM_CALL_HOST_REGISTER);
	ck_assert_int_eq(cuvmm_region_sleep(r, CUVMM_SLEEP_OFFLOAD, s), CUVMM_OK);
	ck_assert_uint_eq(cuvmm_ctx_call_count(ctx, CUVMM_CALL_HOST_REGISTER) - calls, 3);
	if (tc_on_host())
		ck_assert_uint_eq(registered() - reg0, 68 * G);
	ck_assert_uint_eq(tc_region_stats(r).held_bytes, 0);
	ck_assert_int_eq(cuvmm_region_wake(r, s), CUVMM_OK);
	ck_assert_int_eq(tc_stream_sync(s), 0);
	ck_assert_uint_eq(pin_check(r, 71), 0);
	/* the kept copy serves the next sleep */
	fill_g(r, 22, 48, 72);
	fill_g(r, 0, 20, 72);
	ck_assert_int_eq(cuvmm_region_sleep(r, CUVMM_SLEEP_OFFLOAD, s), CUVMM_OK);
	ck_assert_uint_eq(cuvmm_ctx_call_count(ctx, CUVMM_CALL_HOST_REGISTER) - calls, 3);
	ck_assert_int_eq(cuvmm_region_wake(r, s), CUVMM_OK);
	ck_assert_int_eq(tc_stream_sync(s), 0);
	ck_assert_uint_eq(pin_check(r, 72), 0);
	cuvmm_region_destroy(r);
	ck_assert_uint_eq(registered(), reg0);
	tc_stream_destroy(s);
	cuvmm_ctx_destroy(ctx);
	tc_env_restore();
}
END_TEST

/*
 * A registration refused in a pinning thread (the first, second or last piece; 1 and 3 threads): the sleep
 * fails with the error, every piece registered is unregistered, and the region is awake and intact; then it
 * sleeps. With several threads, pieces after the refused one may have been claimed already: at least
 * skip + 1 calls (exactly, with one).
 */
START_TEST(test_fault_pin)
{
	const uint64_t skip = (uint64_t)(_i % 3);
	const unsigned threads = _i < 3 ? 1 : 3;
	const int err = _i & 1 ? CUVMM_ENOMEM : CUVMM_EDRIVER;
	struct cuvmm_ctx *ctx = ctx_with(-1);
	size_t reg0 = registered();
	struct cuvmm_region *r;
	struct tc_snap before, after;
	uint64_t calls;
	char what[64];
	int got;

	snprintf(what, sizeof(what), "register %llu refused, %u threads", (unsigned long long)skip, threads);
	set_threads(threads);
	r = pin_region(ctx, 81);
	before = tc_snap_take(ctx, r);
	calls = cuvmm_ctx_call_count(ctx, CUVMM_CALL_HOST_REGISTER);
	ck_assert_int_eq(cuvmm_ctx_inject_fault(ctx, CUVMM_CALL_HOST_REGISTER, skip, 1, err), CUVMM_OK);
	got = cuvmm_region_sleep(r, CUVMM_SLEEP_OFFLOAD, NULL);
	ck_assert_msg(got == err, "%s: returned %s, want %s", what, cuvmm_err_name(got), cuvmm_err_name(err));
	ck_assert_uint_ge(cuvmm_ctx_call_count(ctx, CUVMM_CALL_HOST_REGISTER) - calls, skip + 1);
	if (threads == 1)
		ck_assert_uint_eq(cuvmm_ctx_call_count(ctx, CUVMM_CALL_HOST_REGISTER) - calls, skip + 1);
	ck_assert_msg(registered() == reg0, "%s: %zu bytes left registered", what, registered() - reg0);
	after = tc_snap_take(ctx, r);
	tc_snap_expect_same(&before, &after, what, true);
	ck_assert_msg(pin_check(r, 81) == 0, "%s: contents changed", what);
	ck_assert_int_eq(cuvmm_region_sleep(r, CUVMM_SLEEP_OFFLOAD, NULL), CUVMM_OK);
	ck_assert_int_eq(cuvmm_region_wake(r, NULL), CUVMM_OK);
	ck_assert_uint_eq(pin_check(r, 81), 0);
	cuvmm_region_destroy(r);
	ck_assert_uint_eq(registered(), reg0);
	cuvmm_ctx_destroy(ctx);
	tc_env_restore();
}
END_TEST

/*
 * CUVMM_SLEEP_HOST_LIMIT caps the host copies of the process, kept ones included: a copy above it is
 * refused with ENOMEM before anything is pinned (the region awake and intact), one under it sleeps; with
 * the first region's copy kept after its wake, a second region's copy that would pass the cap is refused
 * too, and fits once the first region is destroyed.
 */
START_TEST(test_sleep_host_limit)
{
	struct cuvmm_ctx *ctx = ctx_with(-1);
	struct cuvmm_region *r = pin_region(ctx, 91), *r2 = fault_region(ctx); /* trims: made before any copy is kept */
	struct tc_snap before, after;
	uint64_t calls = cuvmm_ctx_call_count(ctx, CUVMM_CALL_HOST_REGISTER);

	tc_env_set("CUVMM_SLEEP_HOST_LIMIT", "135M"); /* 1 MiB short */
	before = tc_snap_take(ctx, r);
	tc_log_capture(CUVMM_LOG_WARN);
	ck_assert_int_eq(cuvmm_region_sleep(r, CUVMM_SLEEP_OFFLOAD, NULL), CUVMM_ENOMEM);
	ck_assert_int_eq(tc_log_count(CUVMM_LOG_WARN, "CUVMM_SLEEP_HOST_LIMIT"), 1);
	tc_log_release();
	ck_assert_uint_eq(cuvmm_ctx_call_count(ctx, CUVMM_CALL_HOST_REGISTER), calls);
	after = tc_snap_take(ctx, r);
	tc_snap_expect_same(&before, &after, "over the host limit", true);
	tc_env_set("CUVMM_SLEEP_HOST_LIMIT", "150M");
	ck_assert_int_eq(cuvmm_region_sleep(r, CUVMM_SLEEP_OFFLOAD, NULL), CUVMM_OK);
	ck_assert_int_eq(cuvmm_region_wake(r, NULL), CUVMM_OK);
	ck_assert_uint_eq(pin_check(r, 91), 0);
	/* 136 MiB kept + 20 MiB > 150 MiB */
	tc_log_capture(CUVMM_LOG_WARN);
	ck_assert_int_eq(cuvmm_region_sleep(r2, CUVMM_SLEEP_OFFLOAD, NULL), CUVMM_ENOMEM);
	tc_log_release();
	ck_assert_uint_eq(check_layout(r2, 111), 0);
	cuvmm_region_destroy(r);
	ck_assert_int_eq(cuvmm_region_sleep(r2, CUVMM_SLEEP_OFFLOAD, NULL), CUVMM_OK);
	ck_assert_int_eq(cuvmm_region_wake(r2, NULL), CUVMM_OK);
	ck_assert_uint_eq(check_layout(r2, 111), 0);
	cuvmm_region_destroy(r2);
	cuvmm_ctx_destroy(ctx);
	tc_env_restore();
}
END_TEST

/*
 * cuvmm_region_sleep_prepare pins the next sleep's host copy ahead (1 and 3 threads): 3 pieces registered
 * by the call, none by the sleep that follows, none by a second call; the contents come back after wake, and
 * destroy unpins the copy. A copy too small for the region (prepared for 64 MiB) is replaced by the sleep's
 * own; one prepared larger than the region serves it.
 */
START_TEST(test_prepare_region)
{
	struct cuvmm_ctx *ctx = ctx_with(-1);
	size_t reg0 = registered();
	struct cuvmm_region *r;
	uint64_t calls;

	set_threads(_i ? 3 : 1);
	r = pin_region(ctx, 61);
	calls = cuvmm_ctx_call_count(ctx, CUVMM_CALL_HOST_REGISTER);
	ck_assert_int_eq(cuvmm_region_sleep_prepare(r, 0), CUVMM_OK);
	ck_assert_uint_eq(cuvmm_ctx_call_count(ctx, CUVMM_CALL_HOST_REGISTER) - calls, 3);
	if (tc_on_host())
		ck_assert_uint_eq(registered() - reg0, 68 * G);
	ck_assert_int_eq(cuvmm_region_sleep_prepare(r, 0), CUVMM_OK);
	ck_assert_int_eq(cuvmm_region_sleep_prepare(r, 32 * G), CUVMM_OK);
	ck_assert_uint_eq(cuvmm_ctx_call_count(ctx, CUVMM_CALL_HOST_REGISTER) - calls, 3);
	ck_assert_int_eq(cuvmm_region_sleep(r, CUVMM_SLEEP_OFFLOAD, NULL), CUVMM_OK);
	ck_assert_uint_eq(cuvmm_ctx_call_count(ctx, CUVMM_CALL_HOST_REGISTER) - calls, 3);
	ck_assert_uint_eq(tc_region_stats(r).held_bytes, 0);
	ck_assert_int_eq(cuvmm_region_sleep_prepare(r, 0), CUVMM_ESTATE);
	ck_assert_int_eq(cuvmm_region_wake(r, NULL), CUVMM_OK);
	ck_assert_uint_eq(pin_check(r, 61), 0);
	cuvmm_region_destroy(r);
	ck_assert_uint_eq(registered(), reg0);

	/* Too small: the sleep pins its own (3 pieces) and the small one goes (on the host: only 68 granules
	 * stay registered). */
	r = pin_region(ctx, 62);
	calls = cuvmm_ctx_call_count(ctx, CUVMM_CALL_HOST_REGISTER);
	ck_assert_int_eq(cuvmm_region_sleep_prepare(r, 32 * G), CUVMM_OK);
	ck_assert_uint_eq(cuvmm_ctx_call_count(ctx, CUVMM_CALL_HOST_REGISTER) - calls, 1);
	ck_assert_int_eq(cuvmm_region_sleep(r, CUVMM_SLEEP_OFFLOAD, NULL), CUVMM_OK);
	ck_assert_uint_eq(cuvmm_ctx_call_count(ctx, CUVMM_CALL_HOST_REGISTER) - calls, 4);
	if (tc_on_host())
		ck_assert_uint_eq(registered() - reg0, 68 * G);
	ck_assert_int_eq(cuvmm_region_wake(r, NULL), CUVMM_OK);
	ck_assert_uint_eq(pin_check(r, 62), 0);
	/* Larger than what is mapped (the whole region): serves it. ctx_trim gives the kept copy back first. */
	ck_assert_int_eq(cuvmm_ctx_trim(ctx, -1, 0), CUVMM_OK);
	ck_assert_uint_eq(registered(), reg0);
	calls = cuvmm_ctx_call_count(ctx, CUVMM_CALL_HOST_REGISTER);
	ck_assert_int_eq(cuvmm_region_sleep_prepare(r, 72 * G), CUVMM_OK);
	ck_assert_uint_eq(cuvmm_ctx_call_count(ctx, CUVMM_CALL_HOST_REGISTER) - calls, 3);
	ck_assert_int_eq(cuvmm_region_sleep(r, CUVMM_SLEEP_OFFLOAD, NULL), CUVMM_OK);
	ck_assert_uint_eq(cuvmm_ctx_call_count(ctx, CUVMM_CALL_HOST_REGISTER) - calls, 3);
	ck_assert_int_eq(cuvmm_region_wake(r, NULL), CUVMM_OK);
	ck_assert_uint_eq(pin_check(r, 62), 0);
	cuvmm_region_destroy(r);
	ck_assert_uint_eq(registered(), reg0);
	ck_assert_int_eq(cuvmm_region_sleep_prepare(NULL, 0), CUVMM_EINVAL);
	ck_assert_int_eq(cuvmm_pool_sleep_prepare(NULL, 0), CUVMM_EINVAL);
	cuvmm_ctx_destroy(ctx);
	tc_env_restore();
}
END_TEST

/*
 * A prepare that fails keeps nothing and changes nothing: a registration refused at the first, second or
 * last piece (1 and 3 threads), and a copy over CUVMM_SLEEP_HOST_LIMIT (nothing registered). A copy kept
 * before stays kept through a failed replacement. The sleep afterwards pins its own and works.
 */
START_TEST(test_prepare_faults)
{
	const uint64_t skip = (uint64_t)(_i % 3);
	const unsigned threads = _i < 3 ? 1 : 3;
	struct cuvmm_ctx *ctx = ctx_with(-1);
	size_t reg0 = registered();
	struct cuvmm_region *r;
	struct tc_snap before, after;
	uint64_t calls;
	char what[64];
	int got;

	snprintf(what, sizeof(what), "register %llu refused, %u threads", (unsigned long long)skip, threads);
	set_threads(threads);
	r = pin_region(ctx, 63);
	before = tc_snap_take(ctx, r);
	calls = cuvmm_ctx_call_count(ctx, CUVMM_CALL_HOST_REGISTER);
	ck_assert_int_eq(cuvmm_ctx_inject_fault(ctx, CUVMM_CALL_HOST_REGISTER, skip, 1, CUVMM_EDRIVER), CUVMM_OK);
	got = cuvmm_region_sleep_prepare(r, 0);
	ck_assert_msg(got == CUVMM_EDRIVER, "%s: returned %s", what, cuvmm_err_name(got));
	ck_assert_uint_ge(cuvmm_ctx_call_count(ctx, CUVMM_CALL_HOST_REGISTER) - calls, skip + 1);
	ck_assert_msg(registered() == reg0, "%s: %zu bytes left registered", what, registered() - reg0);
	after = tc_snap_take(ctx, r);
	tc_snap_expect_same(&before, &after, what, true);

	/* Over the limit: refused before anything is registered. */
	tc_env_set("CUVMM_SLEEP_HOST_LIMIT", "135M");
	calls = cuvmm_ctx_call_count(ctx, CUVMM_CALL_HOST_REGISTER);
	tc_log_capture(CUVMM_LOG_WARN);
	ck_assert_int_eq(cuvmm_region_sleep_prepare(r, 0), CUVMM_ENOMEM);
	tc_log_release();
	ck_assert_uint_eq(cuvmm_ctx_call_count(ctx, CUVMM_CALL_HOST_REGISTER), calls);
	tc_env_set("CUVMM_SLEEP_HOST_LIMIT", "200M");

	/* A kept copy (one piece) survives a failed replacement, and still serves what fits in it. */
	ck_assert_int_eq(cuvmm_region_sleep_prepare(r, 32 * G), CUVMM_OK);
	ck_assert_int_eq(cuvmm_ctx_inject_fault(ctx, CUVMM_CALL_HOST_REGISTER, skip, 1, CUVMM_ENOMEM), CUVMM_OK);
	ck_assert_int_eq(cuvmm_region_sleep_prepare(r, 0), CUVMM_ENOMEM);
	if (tc_on_host())
		ck_assert_uint_eq(registered() - reg0, 32 * G);
	calls = cuvmm_ctx_call_count(ctx, CUVMM_CALL_HOST_REGISTER);
	ck_assert_int_eq(cuvmm_region_sleep_prepare(r, 32 * G), CUVMM_OK);
	ck_assert_uint_eq(cuvmm_ctx_call_count(ctx, CUVMM_CALL_HOST_REGISTER), calls);

	ck_assert_msg(pin_check(r, 63) == 0, "%s: contents changed", what);
	ck_assert_int_eq(cuvmm_region_sleep(r, CUVMM_SLEEP_OFFLOAD, NULL), CUVMM_OK);
	ck_assert_int_eq(cuvmm_region_wake(r, NULL), CUVMM_OK);
	ck_assert_uint_eq(pin_check(r, 63), 0);
	cuvmm_region_destroy(r);
	ck_assert_uint_eq(registered(), reg0);
	cuvmm_ctx_destroy(ctx);
	tc_env_restore();
}
END_TEST

/* A thread allocating and freeing in a pool while another prepares its sleep (one pinning thread: the
 * slowest). */
struct churn {
	struct cuvmm_pool *p;
	_Atomic int stop;
	unsigned long ops;
	int err;
};

static void *churn_thread(void *arg)
{
	struct churn *c = arg;
	void *q[8] = {0};

	for (unsigned long i = 0; !atomic_load(&c->stop) || i < 64; i++) {
		size_t k = i % 8, bytes = (i * 7919) % (6 * TC_MiB) + 1;

		if (q[k] && (c->err = cuvmm_free(c->p, q[k])) != CUVMM_OK)
			return NULL;
		q[k] = NULL;
		if ((c->err = cuvmm_malloc(c->p, bytes, &q[k])) != CUVMM_OK || tc_fill(q[k], bytes / 4, (uint32_t)i))
			return NULL;
		c->ops++;
	}
	for (int k = 0; k < 8; k++)
		if (q[k] && (c->err = cuvmm_free(c->p, q[k])) != CUVMM_OK)
			return NULL;
	return NULL;
}

/*
 * cuvmm_pool_sleep_prepare: with 0, the pool's mapped memory less its free memory, so the sleep that follows
 * registers nothing; pool trim gives the copy back. Allocations go on while it pins (the lock is not held
 * through the pinning).
 */
START_TEST(test_prepare_pool)
{
	struct cuvmm_ctx *ctx = ctx_with(-1);
	size_t reg0 = registered();
	struct pool_state ps;
	struct churn c = {0};
	pthread_t t;
	uint64_t calls;

	memset(&ps, 0, sizeof(ps));
	ps.p = pool_new(ctx);
	pool_populate(&ps, 5);
	calls = cuvmm_ctx_call_count(ctx, CUVMM_CALL_HOST_REGISTER);
	ck_assert_int_eq(cuvmm_pool_sleep_prepare(ps.p, 0), CUVMM_OK);
	ck_assert_uint_gt(cuvmm_ctx_call_count(ctx, CUVMM_CALL_HOST_REGISTER), calls);
	calls = cuvmm_ctx_call_count(ctx, CUVMM_CALL_HOST_REGISTER);
	ck_assert_int_eq(cuvmm_pool_sleep(ps.p, CUVMM_SLEEP_OFFLOAD, NULL), CUVMM_OK);
	ck_assert_uint_eq(cuvmm_ctx_call_count(ctx, CUVMM_CALL_HOST_REGISTER), calls);
	ck_assert_int_eq(cuvmm_pool_sleep_prepare(ps.p, 0), CUVMM_ESTATE);
	ck_assert_int_eq(cuvmm_pool_wake(ps.p, NULL), CUVMM_OK);
	ck_assert_uint_eq(pool_check(&ps, 5), 0);
	ck_assert_int_eq(cuvmm_pool_trim(ps.p, 0), CUVMM_OK);
	ck_assert_uint_eq(registered(), reg0);

	/* Churn meanwhile. */
	set_threads(1);
	c.p = ps.p;
	ck_assert_int_eq(pthread_create(&t, NULL, churn_thread, &c), 0);
	ck_assert_int_eq(cuvmm_pool_sleep_prepare(ps.p, 96 * TC_MiB), CUVMM_OK);
	atomic_store(&c.stop, 1);
	ck_assert_int_eq(pthread_join(t, NULL), 0);
	ck_assert_msg(c.err == CUVMM_OK, "the allocating thread failed: %s", cuvmm_err_name(c.err));
	ck_assert_uint_eq(pool_check(&ps, 5), 0);
	for (int i = 0; i < NPTR; i++)
		if (ps.live[i])
			ck_assert_int_eq(cuvmm_free(ps.p, ps.ptr[i]), CUVMM_OK);
	trim_close(ctx, ps.p);
	ck_assert_uint_eq(registered(), reg0);
	tc_env_restore();
}
END_TEST

/*
 * A sleep with its host copy pinned already (kept by a wake) queues every copy first and unmaps each chunk
 * once the event after its copy has passed (region_sleep.c, struct copy_marks): pin_region's 68 chunks, 3
 * pieces, 3 marks. Each case fails calls of one kind: a copy (before any unmap: the region awake and
 * intact), an unmap between marks (the ones before mapped back: awake and intact), the events (the sleep
 * falls back to synchronising the stream and succeeds), and an unmap refused with its map back refused too
 * (the sleep goes forward, after every copy, as without the overlap). Contents come back in every case.
 */
static const struct {
	enum cuvmm_call call;
	uint64_t skip;
	uint32_t count;
	int want;          /* what the sleep returns */
	bool map_back_refused;
} kept_faults[] = {
	{CUVMM_CALL_COPY, 0, 1, CUVMM_EDRIVER, false},
	{CUVMM_CALL_COPY, 2, 1, CUVMM_EDRIVER, false},
	{CUVMM_CALL_COPY, 3, 1, CUVMM_EDRIVER, false},
	{CUVMM_CALL_UNMAP, 0, 1, CUVMM_EDRIVER, false},
	{CUVMM_CALL_UNMAP, 31, 1, CUVMM_EDRIVER, false},
	{CUVMM_CALL_UNMAP, 67, 1, CUVMM_EDRIVER, false},
	{CUVMM_CALL_EVENT_SYNC, 0, UINT32_MAX, CUVMM_OK, false},
	{CUVMM_CALL_EVENT_SYNC, 1, 1, CUVMM_OK, false},
	{CUVMM_CALL_EVENT_CREATE, 0, UINT32_MAX, CUVMM_OK, false},
	{CUVMM_CALL_EVENT_RECORD, 1, UINT32_MAX, CUVMM_OK, false},
	{CUVMM_CALL_UNMAP, 40, UINT32_MAX, CUVMM_OK, true},
};
#define KEPT_FAULT_CASES ((int)(sizeof(kept_faults) / sizeof(kept_faults[0])))

START_TEST(test_fault_sleep_kept_copy)
{
	const enum cuvmm_call call = kept_faults[_i].call;
	struct cuvmm_ctx *ctx = ctx_with(-1);
	struct cuvmm_region *r;
	struct tc_snap before, after;
	uint64_t calls, regs;
	char what[96];
	int got;

	snprintf(what, sizeof(what), "%s failing after %llu calls in a sleep on a kept copy%s", cuvmm_call_name(call),
		 (unsigned long long)kept_faults[_i].skip, kept_faults[_i].map_back_refused ? ", map back refused" : "");
	r = pin_region(ctx, 51);
	ck_assert_int_eq(cuvmm_region_sleep(r, CUVMM_SLEEP_OFFLOAD, NULL), CUVMM_OK);
	ck_assert_int_eq(cuvmm_region_wake(r, NULL), CUVMM_OK);
	ck_assert_int_eq(cuvmm_ctx_trim(ctx, -1, 0), CUVMM_OK); /* (drops the kept copy: prepare again) */
	ck_assert_int_eq(cuvmm_region_sleep_prepare(r, 0), CUVMM_OK);
	fill_g(r, 0, 20, 52);
	fill_g(r, 22, 48, 52);
	before = tc_snap_take(ctx, r);
	calls = cuvmm_ctx_call_count(ctx, call);
	regs = cuvmm_ctx_call_count(ctx, CUVMM_CALL_HOST_REGISTER);
	ck_assert_int_eq(cuvmm_ctx_inject_fault(ctx, call, kept_faults[_i].skip, kept_faults[_i].count, CUVMM_EDRIVER),
			 CUVMM_OK);
	if (kept_faults[_i].map_back_refused)
		ck_assert_int_eq(cuvmm_ctx_inject_fault(ctx, CUVMM_CALL_MAP, 0, 1, CUVMM_EDRIVER), CUVMM_OK);
	tc_log_capture(CUVMM_LOG_ERROR);
	got = cuvmm_region_sleep(r, CUVMM_SLEEP_OFFLOAD, NULL);
	ck_assert_int_eq(cuvmm_ctx_inject_fault(ctx, call, 0, 0, CUVMM_EDRIVER), CUVMM_OK);
	ck_assert_int_eq(cuvmm_ctx_inject_fault(ctx, CUVMM_CALL_MAP, 0, 0, CUVMM_EDRIVER), CUVMM_OK);
	ck_assert_msg(got == kept_faults[_i].want, "%s: returned %s", what, cuvmm_err_name(got));
	ck_assert_msg(cuvmm_ctx_call_count(ctx, call) > calls + kept_faults[_i].skip, "%s: the call was not reached", what);
	ck_assert_msg(cuvmm_ctx_call_count(ctx, CUVMM_CALL_HOST_REGISTER) == regs, "%s: the kept copy was not used", what);
	if (got == CUVMM_OK) {
		ck_assert_int_eq(cuvmm_region_map(r, 0, G), CUVMM_ESTATE); /* asleep */
		ck_assert_int_eq(cuvmm_region_wake(r, NULL), CUVMM_OK);
	} else {
		after = tc_snap_take(ctx, r);
		tc_snap_expect_same(&before, &after, what, false);
	}
	ck_assert_msg(pin_check(r, 52) == 0, "%s: contents lost", what);
	/* And it sleeps and wakes again, with nothing failing. */
	ck_assert_int_eq(cuvmm_ctx_trim(ctx, -1, 0), CUVMM_OK);
	ck_assert_int_eq(cuvmm_region_sleep(r, CUVMM_SLEEP_OFFLOAD, NULL), CUVMM_OK);
	ck_assert_int_eq(cuvmm_region_wake(r, NULL), CUVMM_OK);
	ck_assert_uint_eq(pin_check(r, 52), 0);
	cuvmm_region_destroy(r);
	ck_assert_uint_eq(tc_ctx_stats(ctx).mapped_bytes, 0);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/*
 * Found by review: with the copies running behind the unmaps, a copy failing on the device after some
 * chunks were unmapped (here the second mark's event, then the stream synchronisation behind it, via its
 * capture check), with one of those chunks' map back refused too, left the region awake with a hole where
 * that chunk was. It must go forward instead: asleep, and the wake brings every granule back. 66 granules
 * in one span: copies of 64, 64 and 4 MiB, three marks; the capture checks before the failing
 * synchronisation are the sleep's own, the three copies' and the three marks'.
 */
START_TEST(test_fault_sleep_overlap_no_hole)
{
	struct cuvmm_ctx *ctx = ctx_with(-1);
	struct cuvmm_region *r = region(ctx, 128 * G);
	CUstream s = NULL;

	ck_assert_int_eq(tc_stream_create(&s), 0);
	ck_assert_int_eq(cuvmm_region_map(r, 0, 66 * G), CUVMM_OK);
	fill_g(r, 0, 66, 41);
	ck_assert_int_eq(cuvmm_region_sleep_prepare(r, 0), CUVMM_OK);
	ck_assert_int_eq(cuvmm_ctx_inject_fault(ctx, CUVMM_CALL_EVENT_SYNC, 1, 1, CUVMM_EDRIVER), CUVMM_OK);
	ck_assert_int_eq(cuvmm_ctx_inject_fault(ctx, CUVMM_CALL_CAPTURE_INFO, 7, 1, CUVMM_EDRIVER), CUVMM_OK);
	ck_assert_int_eq(cuvmm_ctx_inject_fault(ctx, CUVMM_CALL_MAP, 5, 1, CUVMM_EDRIVER), CUVMM_OK);
	tc_log_capture(CUVMM_LOG_ERROR);
	ck_assert_int_eq(cuvmm_region_sleep(r, CUVMM_SLEEP_OFFLOAD, s), CUVMM_OK);
	ck_assert_msg(tc_log_count(CUVMM_LOG_ERROR, "could not map granule") == 1,
		      "the case did not happen: no map back was refused after the copies failed");
	tc_log_release();
	ck_assert_int_eq(cuvmm_region_map(r, 70 * G, G), CUVMM_ESTATE); /* asleep */
	ck_assert_int_eq(cuvmm_region_wake(r, s), CUVMM_OK);
	ck_assert_int_eq(tc_stream_sync(s), 0);
	ck_assert_uint_eq(check_g(r, 0, 66, 41), 0);
	ck_assert_uint_eq(tc_region_stats(r).mapped_bytes, 66 * G);
	tc_stream_destroy(s);
	cuvmm_region_destroy(r);
	ck_assert_uint_eq(tc_ctx_stats(ctx).mapped_bytes, 0);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/*
 * Found by review: prepare of more than the region can ever map is refused (SIZE_MAX wrapped the host
 * copy's size to nothing, kept as if it were SIZE_MAX bytes, and the next sleep wrote past it); a copy kept
 * for the next sleep goes back on ctx_trim even while the object sleeps (after a DISCARD sleep, nothing else
 * could free it); and a sleep that fails keeps the prepared copy for the next one.
 */
START_TEST(test_prepare_review)
{
	struct cuvmm_ctx *ctx = ctx_with(-1);
	size_t reg0 = registered();
	struct cuvmm_region *r = pin_region(ctx, 43);
	struct cuvmm_pool *p = pool_new(ctx);
	uint64_t calls;
	void *q;

	ck_assert_int_eq(cuvmm_region_sleep_prepare(r, SIZE_MAX), CUVMM_EINVAL);
	ck_assert_int_eq(cuvmm_region_sleep_prepare(r, SIZE_MAX - 4095), CUVMM_EINVAL);
	ck_assert_int_eq(cuvmm_region_sleep_prepare(r, 72 * G + 1), CUVMM_EINVAL);
	ck_assert_int_eq(cuvmm_pool_sleep_prepare(p, SIZE_MAX), CUVMM_EINVAL);
	ck_assert_uint_eq(registered(), reg0);

	/* A failed sleep (an unmap refused, undone) keeps the prepared copy: the next sleep pins nothing. */
	ck_assert_int_eq(cuvmm_region_sleep_prepare(r, 0), CUVMM_OK);
	calls = cuvmm_ctx_call_count(ctx, CUVMM_CALL_HOST_REGISTER);
	ck_assert_int_eq(cuvmm_ctx_inject_fault(ctx, CUVMM_CALL_UNMAP, 10, 1, CUVMM_EDRIVER), CUVMM_OK);
	tc_log_capture(CUVMM_LOG_ERROR);
	ck_assert_int_eq(cuvmm_region_sleep(r, CUVMM_SLEEP_OFFLOAD, NULL), CUVMM_EDRIVER);
	tc_log_release();
	ck_assert_uint_eq(pin_check(r, 43), 0);
	ck_assert_int_eq(cuvmm_region_sleep(r, CUVMM_SLEEP_OFFLOAD, NULL), CUVMM_OK);
	ck_assert_uint_eq(cuvmm_ctx_call_count(ctx, CUVMM_CALL_HOST_REGISTER), calls);
	ck_assert_int_eq(cuvmm_region_wake(r, NULL), CUVMM_OK);
	ck_assert_uint_eq(pin_check(r, 43), 0);

	/* DISCARD sleeps with copies kept: ctx_trim gives them back while both sleep. */
	ck_assert_int_eq(cuvmm_malloc(p, 32 * TC_MiB, &q), CUVMM_OK);
	ck_assert_int_eq(cuvmm_pool_sleep_prepare(p, 0), CUVMM_OK);
	ck_assert_int_eq(cuvmm_pool_sleep(p, CUVMM_SLEEP_DISCARD, NULL), CUVMM_OK);
	ck_assert_int_eq(cuvmm_region_sleep(r, CUVMM_SLEEP_DISCARD, NULL), CUVMM_OK);
	if (tc_on_host())
		ck_assert_uint_gt(registered(), reg0);
	ck_assert_int_eq(cuvmm_ctx_trim(ctx, -1, 0), CUVMM_OK);
	ck_assert_uint_eq(registered(), reg0);
	ck_assert_int_eq(cuvmm_pool_wake(p, NULL), CUVMM_OK);
	ck_assert_int_eq(cuvmm_region_wake(r, NULL), CUVMM_OK);
	ck_assert_int_eq(cuvmm_free(p, q), CUVMM_OK);
	cuvmm_pool_destroy(p);
	cuvmm_region_destroy(r);
	ck_assert_uint_eq(registered(), reg0);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/*
 * Wake failing: CREATE, MAP, SET_ACCESS (first, second, sixth, last chunk) and COPY (first, second, last
 * piece). The region stays asleep with nothing of it mapped and its host copy intact: the next wake restores
 * everything. _i < 12: OFFLOAD; the last cases: DISCARD.
 */
static const struct {
	enum cuvmm_call call;
	uint64_t skip;
	int err;
	enum cuvmm_sleep_mode mode;
} wake_faults[] = {
	{CUVMM_CALL_CREATE, 0, CUVMM_ENOMEM, CUVMM_SLEEP_OFFLOAD},
	{CUVMM_CALL_CREATE, 1, CUVMM_EDRIVER, CUVMM_SLEEP_OFFLOAD},
	{CUVMM_CALL_CREATE, 5, CUVMM_ENOMEM, CUVMM_SLEEP_OFFLOAD},
	{CUVMM_CALL_CREATE, 9, CUVMM_EDRIVER, CUVMM_SLEEP_OFFLOAD},
	{CUVMM_CALL_MAP, 0, CUVMM_EDRIVER, CUVMM_SLEEP_OFFLOAD},
	{CUVMM_CALL_MAP, 1, CUVMM_ENOMEM, CUVMM_SLEEP_OFFLOAD},
	{CUVMM_CALL_MAP, 5, CUVMM_EDRIVER, CUVMM_SLEEP_OFFLOAD},
	{CUVMM_CALL_MAP, 9, CUVMM_EDRIVER, CUVMM_SLEEP_OFFLOAD},
	{CUVMM_CALL_SET_ACCESS, 0, CUVMM_EDRIVER, CUVMM_SLEEP_OFFLOAD},
	{CUVMM_CALL_SET_ACCESS, 1, CUVMM_EDRIVER, CUVMM_SLEEP_OFFLOAD},
	{CUVMM_CALL_SET_ACCESS, 5, CUVMM_EDRIVER, CUVMM_SLEEP_OFFLOAD},
	{CUVMM_CALL_SET_ACCESS, 9, CUVMM_EDRIVER, CUVMM_SLEEP_OFFLOAD},
	{CUVMM_CALL_COPY, 0, CUVMM_EDRIVER, CUVMM_SLEEP_OFFLOAD},
	{CUVMM_CALL_COPY, 1, CUVMM_EDRIVER, CUVMM_SLEEP_OFFLOAD},
	{CUVMM_CALL_COPY, 4, CUVMM_EDRIVER, CUVMM_SLEEP_OFFLOAD},
	{CUVMM_CALL_CREATE, 3, CUVMM_EDRIVER, CUVMM_SLEEP_DISCARD},
	{CUVMM_CALL_MAP, 7, CUVMM_EDRIVER, CUVMM_SLEEP_DISCARD},
};
#define WAKE_FAULT_CASES ((int)(sizeof(wake_faults) / sizeof(wake_faults[0])))

START_TEST(test_fault_wake)
{
	const enum cuvmm_call call = wake_faults[_i].call;
	const uint64_t skip = wake_faults[_i].skip;
	const int err = wake_faults[_i].err;
	const enum cuvmm_sleep_mode mode = wake_faults[_i].mode;
	struct cuvmm_ctx *ctx = ctx_with(-1);
	struct cuvmm_region *r = fault_region(ctx);
	struct tc_snap awake, asleep, after;
	uint64_t calls;
	char what[96];
	CUstream s;
	int got;

	snprintf(what, sizeof(what), "%s failing after %llu calls in a wake (%s)", cuvmm_call_name(call),
		 (unsigned long long)skip, mode == CUVMM_SLEEP_OFFLOAD ? "offload" : "discard");
	ck_assert_int_eq(tc_stream_create(&s), 0);
	awake = tc_snap_take(ctx, r);
	ck_assert_int_eq(cuvmm_region_sleep(r, mode, NULL), CUVMM_OK);
	asleep = tc_snap_take(ctx, r);
	calls = cuvmm_ctx_call_count(ctx, call);
	ck_assert_int_eq(cuvmm_ctx_inject_fault(ctx, call, skip, 1, err), CUVMM_OK);
	tc_log_capture(CUVMM_LOG_ERROR);
	got = cuvmm_region_wake(r, _i % 2 ? s : NULL);
	ck_assert_msg(got == err, "%s: returned %s, want %s", what, cuvmm_err_name(got), cuvmm_err_name(err));
	ck_assert_uint_eq(cuvmm_ctx_call_count(ctx, call) - calls, skip + 1);
	/* still asleep, nothing of it mapped (the device may cache the chunks the failed call got) */
	after = tc_snap_take(ctx, r);
	tc_snap_expect_same(&asleep, &after, what, false);
	ck_assert_uint_eq(after.d_mapped, 0);
	ck_assert_int_eq(tc_log_count(CUVMM_LOG_ERROR, "stays mapped"), 0);
	expect_region_asleep(r, s, what);
	tc_assert_os_matches(ctx);

	/* the next wake brings it all back */
	got = cuvmm_region_wake(r, s);
	ck_assert_msg(got == CUVMM_OK, "%s: the second wake returned %s", what, cuvmm_err_name(got));
	ck_assert_int_eq(tc_stream_sync(s), 0);
	after = tc_snap_take(ctx, r);
	tc_snap_expect_same(&awake, &after, what, false);
	if (mode == CUVMM_SLEEP_OFFLOAD)
		ck_assert_msg(check_layout(r, 111) == 0, "%s: contents lost", what);
	fill_layout(r, 113);
	ck_assert_uint_eq(check_layout(r, 113), 0);
	ck_assert_int_eq(cuvmm_ctx_trim(ctx, -1, 0), CUVMM_OK);
	after = tc_snap_take(ctx, r);
	tc_snap_expect_same(&awake, &after, what, true);
	tc_stream_destroy(s);
	cuvmm_region_destroy(r);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/* A pending unmap the driver refuses to do: sleep fails (cuvmm.h: "CUVMM_EDRIVER if a copy or unmap failed"),
 * the region stays awake and intact, and sleeps once the unmap goes through. */
START_TEST(test_fault_sleep_stuck_unmap)
{
	struct cuvmm_ctx *ctx = ctx_with(-1);
	struct cuvmm_region *r = fault_region(ctx);
	int got;

	tc_log_capture(CUVMM_LOG_ERROR);
	ck_assert_int_eq(cuvmm_ctx_inject_fault(ctx, CUVMM_CALL_UNMAP, 0, UINT32_MAX, CUVMM_EDRIVER), CUVMM_OK);
	ck_assert_int_eq(cuvmm_region_unmap(r, 16 * G, 2 * G, NULL), CUVMM_OK); /* stuck mapped */
	got = cuvmm_region_sleep(r, CUVMM_SLEEP_OFFLOAD, NULL);
	ck_assert_int_ne(got, CUVMM_OK);
	ck_assert_int_eq(cuvmm_region_map(r, 2 * G, G), CUVMM_OK); /* awake */
	ck_assert_uint_eq(check_g(r, 0, 2, 111) + check_g(r, 4, 2, 111) + check_g(r, 8, 2, 111) + check_g(r, 12, 2, 111),
			  0);
	ck_assert_int_eq(cuvmm_ctx_inject_fault(ctx, CUVMM_CALL_UNMAP, 0, 0, CUVMM_EDRIVER), CUVMM_OK);
	ck_assert_int_eq(cuvmm_ctx_trim(ctx, -1, 0), CUVMM_OK);
	ck_assert_int_eq(cuvmm_region_sleep(r, CUVMM_SLEEP_OFFLOAD, NULL), CUVMM_OK);
	ck_assert_int_eq(cuvmm_region_wake(r, NULL), CUVMM_OK);
	ck_assert_uint_eq(check_g(r, 0, 2, 111) + check_g(r, 4, 2, 111) + check_g(r, 8, 2, 111) + check_g(r, 12, 2, 111),
			  0);
	ck_assert_msg(got == CUVMM_EDRIVER, "sleep with an unmap the driver refused returned %s, want CUVMM_EDRIVER",
		      cuvmm_err_name(got));
	cuvmm_region_destroy(r);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/* Pools: COPY failing in sleep (the pool stays awake, allocations intact), MAP failing in wake (it stays
 * asleep; the next wake restores it). */
START_TEST(test_fault_pool)
{
	struct cuvmm_ctx *ctx = ctx_with(-1);
	struct pool_state ps;
	struct cuvmm_stats before, st;
	void *q;
	int got;

	memset(&ps, 0, sizeof(ps));
	ps.p = pool_new(ctx);
	pool_populate(&ps, 4);
	before = tc_pool_stats(ps.p);

	ck_assert_int_eq(cuvmm_ctx_inject_fault(ctx, CUVMM_CALL_COPY, 1, 1, CUVMM_EDRIVER), CUVMM_OK);
	got = cuvmm_pool_sleep(ps.p, CUVMM_SLEEP_OFFLOAD, NULL);
	ck_assert_int_eq(got, CUVMM_EDRIVER);
	st = tc_pool_stats(ps.p);
	ck_assert_uint_eq(st.live_bytes, before.live_bytes);
	ck_assert_uint_gt(st.mapped_bytes, 0);
	ck_assert_uint_eq(pool_check(&ps, 4), 0);
	ck_assert_int_eq(cuvmm_malloc(ps.p, 4096, &q), CUVMM_OK); /* awake */
	ck_assert_int_eq(cuvmm_free(ps.p, q), CUVMM_OK);

	ck_assert_int_eq(cuvmm_pool_sleep(ps.p, CUVMM_SLEEP_OFFLOAD, NULL), CUVMM_OK);
	ck_assert_int_eq(cuvmm_ctx_inject_fault(ctx, CUVMM_CALL_MAP, 2, 1, CUVMM_EDRIVER), CUVMM_OK);
	ck_assert_int_eq(cuvmm_pool_wake(ps.p, NULL), CUVMM_EDRIVER);
	st = tc_pool_stats(ps.p);
	ck_assert_uint_eq(st.mapped_bytes, 0);
	ck_assert_uint_eq(st.held_bytes, 0);
	ck_assert_uint_eq(st.live_bytes, before.live_bytes);
	ck_assert_int_eq(cuvmm_malloc(ps.p, 4096, &q), CUVMM_ESTATE); /* asleep */
	ck_assert_int_eq(cuvmm_pool_wake(ps.p, NULL), CUVMM_OK);
	ck_assert_uint_eq(pool_check(&ps, 4), 0);
	ck_assert_int_eq(cuvmm_malloc(ps.p, 4096, &q), CUVMM_OK);
	ck_assert_int_eq(cuvmm_free(ps.p, q), CUVMM_OK);
	cuvmm_pool_destroy(ps.p);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/* ----- CUDA: a graph captured before sleep replays after wake ----- */

static struct {
	void *lib;
	CUresult (*BeginCapture)(CUstream, CUstreamCaptureMode);
	CUresult (*EndCapture)(CUstream, CUgraph *);
	CUresult (*Instantiate)(CUgraphExec *, CUgraph, unsigned long long);
	CUresult (*Launch)(CUgraphExec, CUstream);
	CUresult (*ExecDestroy)(CUgraphExec);
	CUresult (*Destroy)(CUgraph);
} gr;

static void graph_sym(void *slot, const char *name)
{
	void *p = dlsym(gr.lib, name);

	ck_assert_msg(p != NULL, "libcuda.so.1 lacks %s", name);
	memcpy(slot, &p, sizeof(p));
}

static void graph_load(void)
{
	gr.lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
	ck_assert_msg(gr.lib != NULL, "cannot load libcuda.so.1");
	graph_sym(&gr.BeginCapture, "cuStreamBeginCapture_v2");
	graph_sym(&gr.EndCapture, "cuStreamEndCapture");
	graph_sym(&gr.Instantiate, "cuGraphInstantiateWithFlags");
	graph_sym(&gr.Launch, "cuGraphLaunch");
	graph_sym(&gr.ExecDestroy, "cuGraphExecDestroy");
	graph_sym(&gr.Destroy, "cuGraphDestroy");
}

/* _i: 0 = OFFLOAD, 1 = DISCARD. */
START_TEST(test_gpu_graph_survives_sleep)
{
	const enum cuvmm_sleep_mode mode = _i ? CUVMM_SLEEP_DISCARD : CUVMM_SLEEP_OFFLOAD;
	struct cuvmm_ctx *ctx;
	struct cuvmm_region *r;
	CUgraph graph = NULL;
	CUgraphExec exec = NULL;
	CUstream s;
	int cu;

	if (tc_on_host()) {
		printf("test_gpu_graph_survives_sleep: CUDA backend only\n");
		return;
	}
	ctx = ctx_with(-1);
	graph_load();
	r = region(ctx, 20 * G);
	ck_assert_int_eq(tc_stream_create(&s), 0);
	map_layout(r, 121);

	/* Capture: one fill kernel per mapped range, pattern 122. */
	ck_assert_int_eq(gr.BeginCapture(s, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL), CUDA_SUCCESS);
	for (int i = 0; i < NRANGES; i++)
		for (size_t g = range_first[i]; g < range_first[i] + RANGE_LEN; g++)
			ck_assert_int_eq(tg_fill((CUdeviceptr)(uintptr_t)at(r, g * G), G / 4, 122 + (uint32_t)g * 0x9e3779b9u,
						 1, s),
					 0);
	ck_assert_int_eq(gr.EndCapture(s, &graph), CUDA_SUCCESS);
	ck_assert_int_eq(gr.Instantiate(&exec, graph, 0), CUDA_SUCCESS);
	ck_assert_uint_eq(check_layout(r, 121), 0); /* capturing ran nothing */
	ck_assert_int_eq(gr.Launch(exec, s), CUDA_SUCCESS);
	ck_assert_int_eq(tg_stream_sync(s), CUDA_SUCCESS);
	ck_assert_uint_eq(check_layout(r, 122), 0);

	/* Other contents, sleep, wake. */
	fill_layout(r, 123);
	ck_assert_int_eq(cuvmm_region_sleep(r, mode, NULL), CUVMM_OK);
	ck_assert_uint_eq(tc_ctx_stats(ctx).held_bytes, 0);
	ck_assert_int_eq(cuvmm_region_wake(r, NULL), CUVMM_OK);
	if (mode == CUVMM_SLEEP_OFFLOAD)
		ck_assert_uint_eq(check_layout(r, 123), 0);

	/* Replay: the graph's pointers are valid again, with the same result. */
	ck_assert_int_eq(gr.Launch(exec, s), CUDA_SUCCESS);
	cu = tg_stream_sync(s);
	ck_assert_msg(cu == CUDA_SUCCESS, "the replayed graph failed: %s", tg_error_name(cu));
	ck_assert_uint_eq(check_layout(r, 122), 0);
	ck_assert_int_eq(tg_ctx_sync(), CUDA_SUCCESS);

	gr.ExecDestroy(exec);
	gr.Destroy(graph);
	tc_stream_destroy(s);
	cuvmm_region_destroy(r);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

static Suite *sleep_suite(void)
{
	Suite *s = suite_create("sleep");
	TCase *tc;

	tc = tcase_create("region");
	tcase_add_checked_fixture(tc, NULL, teardown);
	tcase_set_timeout(tc, TC_TIMEOUT);
	tcase_add_loop_test(tc, test_region_offload, 0, 4);
	tcase_add_loop_test(tc, test_region_discard, 0, 2);
	tcase_add_test(tc, test_region_sleep_empty);
	tcase_add_test(tc, test_sleep_einval_estate);
	tcase_add_test(tc, test_region_destroy_asleep);
	tcase_add_test(tc, test_region_sleep_pending_unmap);
	tcase_add_loop_test(tc, test_pin_pieces, 0, 4);
	suite_add_tcase(s, tc);

	tc = tcase_create("pool");
	tcase_add_checked_fixture(tc, NULL, teardown);
	tcase_set_timeout(tc, TC_TIMEOUT);
	tcase_add_loop_test(tc, test_pool_sleep_wake, 0, 2);
	tcase_add_test(tc, test_pool_wake_coarsens);
	tcase_add_test(tc, test_pool_wake_coarsens_packed);
	tcase_add_test(tc, test_pool_trim_asleep);
	tcase_add_test(tc, test_pool_destroy_asleep);
	suite_add_tcase(s, tc);

	tc = tcase_create("fault");
	tcase_add_checked_fixture(tc, NULL, teardown);
	tcase_set_timeout(tc, TC_TIMEOUT);
	tcase_add_loop_test(tc, test_fault_sleep, 0, SLEEP_FAULT_CASES);
	tcase_add_test(tc, test_fault_discard_needs_no_copy);
	tcase_add_loop_test(tc, test_fault_wake, 0, WAKE_FAULT_CASES);
	tcase_add_test(tc, test_fault_sleep_stuck_unmap);
	tcase_add_test(tc, test_fault_pool);
	tcase_add_loop_test(tc, test_fault_pin, 0, 6);
	tcase_add_test(tc, test_sleep_host_limit);
	tcase_add_loop_test(tc, test_prepare_region, 0, 2);
	tcase_add_loop_test(tc, test_prepare_faults, 0, 6);
	tcase_add_test(tc, test_prepare_pool);
	tcase_add_loop_test(tc, test_fault_sleep_kept_copy, 0, KEPT_FAULT_CASES);
	tcase_add_test(tc, test_fault_sleep_overlap_no_hole);
	tcase_add_test(tc, test_prepare_review);
	suite_add_tcase(s, tc);

	tc = tcase_create("gpu");
	tcase_add_checked_fixture(tc, NULL, teardown);
	tcase_set_timeout(tc, TC_TIMEOUT);
	tcase_add_loop_test(tc, test_gpu_graph_survives_sleep, 0, 2);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	return tc_run(sleep_suite());
}
