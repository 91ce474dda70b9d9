/*
 * Regions: argument checks, map/unmap/resize semantics and contents, statistics against the OS's view (host
 * backend), fenced unmaps (the host backend's gate, and real kernels on the CUDA backend), every driver call
 * of the region paths made to fail, and several threads at once.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common.h"
#include "drv_test.h"
#include "gpu.h"
#include "region.h"

#define G (2 * TC_MiB) /* the granularity on both backends (host default, H200) */
#define RSENTINEL ((struct cuvmm_region *)(uintptr_t)0xdeadbeef)

static void teardown(void)
{
	cvm_host_gate_open();
	tc_log_release();
}

static struct cuvmm_region *region(struct cuvmm_ctx *ctx, size_t bytes)
{
	struct cuvmm_region *r = NULL;
	int err = cuvmm_region_create(ctx, 0, bytes, &r);

	ck_assert_msg(err == CUVMM_OK, "cuvmm_region_create(%zu): %s", bytes, cuvmm_err_name(err));
	ck_assert_ptr_nonnull(r);
	return r;
}

static struct cuvmm_ctx *ctx_with_delay(int64_t delay_ms)
{
	struct cuvmm_config cfg;

	tc_config(&cfg);
	cfg.release_delay_ms = delay_ms;
	return tc_ctx(&cfg);
}

static void *at(struct cuvmm_region *r, size_t offset)
{
	return (char *)cuvmm_region_base(r) + offset;
}

/* Fill / check granules [first, first+n) with a pattern keyed by v; the pattern of a granule does not depend on
 * which range it was written with, so ranges can be checked piecewise. */
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

/* Region statistics as expected; region held always equals region mapped; the OS agrees with the device. */
static void expect_region(struct cuvmm_ctx *ctx, struct cuvmm_region *r, uint64_t mapped, uint64_t live)
{
	struct cuvmm_stats st = tc_region_stats(r);

	ck_assert_uint_eq(st.reserved_bytes, cuvmm_region_size(r));
	ck_assert_msg(st.mapped_bytes == mapped, "region mapped %llu, want %llu", (unsigned long long)st.mapped_bytes,
		      (unsigned long long)mapped);
	ck_assert_msg(st.live_bytes == live, "region live %llu, want %llu", (unsigned long long)st.live_bytes,
		      (unsigned long long)live);
	ck_assert_uint_eq(st.held_bytes, st.mapped_bytes);
	ck_assert_uint_le(st.live_bytes, st.mapped_bytes);
	ck_assert_uint_ge(st.peak_live_bytes, st.live_bytes);
	ck_assert_uint_ge(st.peak_held_bytes, st.held_bytes);
	st = tc_ctx_stats(ctx);
	ck_assert_uint_ge(st.held_bytes, st.mapped_bytes);
	tc_assert_os_matches(ctx);
}

/* ----- creation and accessors ----- */

START_TEST(test_create_destroy)
{
	struct cuvmm_ctx *ctx = tc_ctx(NULL);
	struct cuvmm_region *r;
	struct cuvmm_stats st;

	ck_assert_ptr_null(cuvmm_region_base(NULL));
	ck_assert_uint_eq(cuvmm_region_size(NULL), 0);
	ck_assert_uint_eq(cuvmm_region_granularity(NULL), 0);
	cuvmm_region_destroy(NULL);

	r = region(ctx, 5 * G + 1); /* rounds up */
	ck_assert_uint_eq(cuvmm_region_granularity(r), G);
	ck_assert_uint_eq(cuvmm_region_size(r), 6 * G);
	ck_assert_ptr_nonnull(cuvmm_region_base(r));
	ck_assert_uint_eq((uintptr_t)cuvmm_region_base(r) % G, 0);
	expect_region(ctx, r, 0, 0);
	st = tc_ctx_stats(ctx);
	ck_assert_uint_eq(st.reserved_bytes, 6 * G);
	ck_assert_uint_eq(st.held_bytes, 0);
	cuvmm_region_destroy(r);
	ck_assert_uint_eq(tc_ctx_stats(ctx).reserved_bytes, 0);

	r = region(ctx, 1); /* one granule */
	ck_assert_uint_eq(cuvmm_region_size(r), G);
	cuvmm_region_destroy(r);
	r = region(ctx, 4 * G); /* exact */
	ck_assert_uint_eq(cuvmm_region_size(r), 4 * G);
	cuvmm_region_destroy(r);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

START_TEST(test_create_einval)
{
	struct cuvmm_ctx *ctx = tc_ctx(NULL);
	struct cuvmm_region *r = RSENTINEL;
	int count;

	ck_assert_int_eq(cuvmm_region_create(NULL, 0, G, &r), CUVMM_EINVAL);
	ck_assert_int_eq(cuvmm_region_create(ctx, 0, G, NULL), CUVMM_EINVAL);
	ck_assert_int_eq(cuvmm_region_create(ctx, 0, 0, &r), CUVMM_EINVAL);
	ck_assert_int_eq(cuvmm_region_create(ctx, 0, SIZE_MAX, &r), CUVMM_EINVAL);     /* rounding up overflows */
	ck_assert_int_eq(cuvmm_region_create(ctx, 0, SIZE_MAX - G + 2, &r), CUVMM_EINVAL);
	ck_assert_int_eq(cuvmm_ctx_device_count(ctx, &count), CUVMM_OK);
	ck_assert_int_eq(cuvmm_region_create(ctx, count, G, &r), CUVMM_ENODEV);
	ck_assert_int_eq(cuvmm_region_create(ctx, -1, G, &r), CUVMM_ENODEV);
	ck_assert_ptr_eq(r, RSENTINEL);
	ck_assert_uint_eq(tc_ctx_stats(ctx).reserved_bytes, 0);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

START_TEST(test_range_einval)
{
	struct cuvmm_ctx *ctx = tc_ctx(NULL);
	struct cuvmm_region *r = region(ctx, 8 * G);
	const size_t size = 8 * G;
	static const struct {
		size_t off, len;
	} bad[] = {
		{1, G},
		{G / 2, G},
		{0, G + 1},
		{0, G / 2},
		{0, 0},
		{G, 0},
		{8 * G, G},                       /* starts at the end */
		{9 * G, G},                       /* starts beyond */
		{6 * G, 4 * G},                   /* runs past the end */
		{0, 9 * G},
		{G, SIZE_MAX - G + 1},            /* offset + len wraps to 0 */
		{2 * G, SIZE_MAX - G + 1},        /* wraps to G */
		{SIZE_MAX - G + 1, G},            /* offset + len wraps to 0 */
		{SIZE_MAX - G + 1, 2 * G},
	};
	struct cuvmm_stats st;

	ck_assert_uint_eq(cuvmm_region_size(r), size);
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		ck_assert_msg(cuvmm_region_map(r, bad[i].off, bad[i].len) == CUVMM_EINVAL, "map(%#zx, %#zx) accepted",
			      bad[i].off, bad[i].len);
		ck_assert_msg(cuvmm_region_unmap(r, bad[i].off, bad[i].len, NULL) == CUVMM_EINVAL,
			      "unmap(%#zx, %#zx) accepted", bad[i].off, bad[i].len);
	}
	ck_assert_int_eq(cuvmm_region_map(NULL, 0, G), CUVMM_EINVAL);
	ck_assert_int_eq(cuvmm_region_unmap(NULL, 0, G, NULL), CUVMM_EINVAL);
	ck_assert_int_eq(cuvmm_region_resize(NULL, G, NULL), CUVMM_EINVAL);
	ck_assert_int_eq(cuvmm_region_resize(r, size + 1, NULL), CUVMM_EINVAL);
	ck_assert_int_eq(cuvmm_region_resize(r, SIZE_MAX, NULL), CUVMM_EINVAL);
	memset(&st, 0, sizeof(st));
	st.size = sizeof(st);
	ck_assert_int_eq(cuvmm_region_stats(NULL, &st), CUVMM_EINVAL);
	ck_assert_int_eq(cuvmm_region_stats(r, NULL), CUVMM_EINVAL);
	st.size = sizeof(st) - 8;
	ck_assert_int_eq(cuvmm_region_stats(r, &st), CUVMM_EINVAL);
	/* Nothing happened. */
	expect_region(ctx, r, 0, 0);
	ck_assert_uint_eq(tc_region_stats(r).map_calls, 0);
	ck_assert_uint_eq(cuvmm_ctx_call_count(ctx, CUVMM_CALL_CREATE), 0);

	/* The largest valid ranges work. */
	ck_assert_int_eq(cuvmm_region_map(r, 7 * G, G), CUVMM_OK);
	ck_assert_int_eq(cuvmm_region_map(r, 0, size), CUVMM_OK);
	ck_assert_int_eq(cuvmm_region_resize(r, size, NULL), CUVMM_OK);
	expect_region(ctx, r, size, size);
	cuvmm_region_destroy(r);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/* ----- semantics ----- */

START_TEST(test_map_idempotent_keeps_contents)
{
	struct cuvmm_ctx *ctx = ctx_with_delay(-1);
	struct cuvmm_region *r = region(ctx, 16 * G);
	struct cuvmm_stats st;

	ck_assert_int_eq(cuvmm_region_map(r, 2 * G, 2 * G), CUVMM_OK);
	fill_g(r, 2, 2, 11);
	expect_region(ctx, r, 2 * G, 2 * G);
	ck_assert_uint_eq(tc_region_stats(r).map_calls, 2);

	/* A superset: only the new granules are mapped; the old ones keep their contents. */
	ck_assert_int_eq(cuvmm_region_map(r, 0, 6 * G), CUVMM_OK);
	expect_region(ctx, r, 6 * G, 6 * G);
	st = tc_region_stats(r);
	ck_assert_uint_eq(st.map_calls, 6);
	ck_assert_uint_eq(st.create_calls, 6);
	ck_assert_uint_eq(check_g(r, 2, 2, 11), 0);

	/* The same range again: nothing to do. */
	ck_assert_int_eq(cuvmm_region_map(r, 0, 6 * G), CUVMM_OK);
	ck_assert_int_eq(cuvmm_region_map(r, 2 * G, G), CUVMM_OK);
	st = tc_region_stats(r);
	ck_assert_uint_eq(st.map_calls, 6);
	ck_assert_uint_eq(st.create_calls, 6);
	expect_region(ctx, r, 6 * G, 6 * G);
	ck_assert_uint_eq(check_g(r, 2, 2, 11), 0);

	/* All of it is usable. */
	fill_g(r, 0, 6, 12);
	ck_assert_uint_eq(check_g(r, 0, 6, 12), 0);
	cuvmm_region_destroy(r);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

START_TEST(test_unmap_unmapped_ignored)
{
	struct cuvmm_ctx *ctx = ctx_with_delay(-1);
	struct cuvmm_region *r = region(ctx, 16 * G);

	ck_assert_int_eq(cuvmm_region_unmap(r, 0, 16 * G, NULL), CUVMM_OK); /* nothing mapped at all */
	ck_assert_int_eq(cuvmm_region_map(r, 0, 4 * G), CUVMM_OK);
	fill_g(r, 0, 4, 21);
	ck_assert_int_eq(cuvmm_region_unmap(r, 8 * G, 4 * G, NULL), CUVMM_OK);
	expect_region(ctx, r, 4 * G, 4 * G);
	ck_assert_uint_eq(tc_region_stats(r).unmap_calls, 0);

	/* Straddling: only the mapped half goes. */
	ck_assert_int_eq(cuvmm_region_unmap(r, 2 * G, 4 * G, NULL), CUVMM_OK);
	expect_region(ctx, r, 2 * G, 2 * G);
	ck_assert_uint_eq(tc_region_stats(r).unmap_calls, 2);
	ck_assert_uint_eq(check_g(r, 0, 2, 21), 0);
	/* Twice: nothing more. */
	ck_assert_int_eq(cuvmm_region_unmap(r, 2 * G, 4 * G, NULL), CUVMM_OK);
	ck_assert_uint_eq(tc_region_stats(r).unmap_calls, 2);
	expect_region(ctx, r, 2 * G, 2 * G);
	cuvmm_region_destroy(r);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

START_TEST(test_resize)
{
	struct cuvmm_ctx *ctx = ctx_with_delay(-1);
	struct cuvmm_region *r = region(ctx, 16 * G);

	ck_assert_int_eq(cuvmm_region_resize(r, 1, NULL), CUVMM_OK); /* rounds up to one granule */
	expect_region(ctx, r, G, G);
	fill_g(r, 0, 1, 31);

	/* Grow keeps the prefix. */
	ck_assert_int_eq(cuvmm_region_resize(r, 3 * G + 1, NULL), CUVMM_OK);
	expect_region(ctx, r, 4 * G, 4 * G);
	ck_assert_uint_eq(check_g(r, 0, 1, 31), 0);
	fill_g(r, 0, 4, 32);

	/* Shrink keeps the prefix. */
	ck_assert_int_eq(cuvmm_region_resize(r, 2 * G, NULL), CUVMM_OK);
	expect_region(ctx, r, 2 * G, 2 * G);
	ck_assert_uint_eq(check_g(r, 0, 2, 32), 0);

	/* A mapping that is not a prefix becomes one: [5G,7G) goes, [0,4G) comes. */
	ck_assert_int_eq(cuvmm_region_map(r, 5 * G, 2 * G), CUVMM_OK);
	ck_assert_int_eq(cuvmm_region_resize(r, 4 * G, NULL), CUVMM_OK);
	expect_region(ctx, r, 4 * G, 4 * G);
	ck_assert_uint_eq(check_g(r, 0, 2, 32), 0);

	/* The same size: nothing changes. */
	ck_assert_int_eq(cuvmm_region_resize(r, 4 * G, NULL), CUVMM_OK);
	expect_region(ctx, r, 4 * G, 4 * G);

	/* Everything, then nothing. */
	ck_assert_int_eq(cuvmm_region_resize(r, cuvmm_region_size(r), NULL), CUVMM_OK);
	expect_region(ctx, r, 16 * G, 16 * G);
	ck_assert_uint_eq(check_g(r, 0, 2, 32), 0);
	ck_assert_int_eq(cuvmm_region_resize(r, 0, NULL), CUVMM_OK);
	expect_region(ctx, r, 0, 0);
	cuvmm_region_destroy(r);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/* Every statistic after every step of a sequence; the OS agrees at each step (host backend). */
START_TEST(test_stats_steps)
{
	struct cuvmm_ctx *ctx = ctx_with_delay(-1);
	struct cuvmm_region *r = region(ctx, 32 * G);
	struct cuvmm_stats st, dev;

	expect_region(ctx, r, 0, 0);
	ck_assert_int_eq(cuvmm_region_map(r, 0, 4 * G), CUVMM_OK);
	fill_g(r, 0, 4, 41);
	expect_region(ctx, r, 4 * G, 4 * G);
	st = tc_region_stats(r);
	ck_assert_uint_eq(st.map_calls, 4);
	ck_assert_uint_eq(st.create_calls, 4);
	ck_assert_uint_eq(st.peak_live_bytes, 4 * G);

	ck_assert_int_eq(cuvmm_region_map(r, 2 * G, 4 * G), CUVMM_OK);
	expect_region(ctx, r, 6 * G, 6 * G);
	ck_assert_uint_eq(tc_region_stats(r).map_calls, 6);

	ck_assert_int_eq(cuvmm_region_unmap(r, 4 * G, 4 * G, NULL), CUVMM_OK);
	expect_region(ctx, r, 4 * G, 4 * G);
	st = tc_region_stats(r);
	ck_assert_uint_eq(st.unmap_calls, 2);
	ck_assert_uint_eq(st.peak_live_bytes, 6 * G);
	dev = tc_ctx_stats(ctx);
	ck_assert_uint_eq(dev.held_bytes, 6 * G); /* 2 cached */
	ck_assert_uint_eq(dev.mapped_bytes, 4 * G);
	ck_assert_uint_eq(dev.live_bytes, 4 * G);
	ck_assert_uint_eq(dev.reserved_bytes, 32 * G);

	ck_assert_int_eq(cuvmm_region_resize(r, G + 1, NULL), CUVMM_OK);
	expect_region(ctx, r, 2 * G, 2 * G);
	ck_assert_uint_eq(check_g(r, 0, 2, 41), 0);
	ck_assert_uint_eq(tc_ctx_stats(ctx).held_bytes, 6 * G);

	ck_assert_int_eq(cuvmm_region_resize(r, 5 * G, NULL), CUVMM_OK); /* 3 from the cache */
	expect_region(ctx, r, 5 * G, 5 * G);
	st = tc_region_stats(r);
	ck_assert_uint_eq(st.create_calls, 6);
	ck_assert_uint_eq(st.map_calls, 9);
	dev = tc_ctx_stats(ctx);
	ck_assert_uint_eq(dev.held_bytes, 6 * G);
	ck_assert_uint_eq(dev.peak_held_bytes, 6 * G);
	ck_assert_uint_eq(dev.release_calls, 0);

	ck_assert_int_eq(cuvmm_region_resize(r, 0, NULL), CUVMM_OK);
	expect_region(ctx, r, 0, 0);
	cuvmm_region_destroy(r);
	dev = tc_ctx_stats(ctx);
	ck_assert_uint_eq(dev.reserved_bytes, 0);
	ck_assert_uint_eq(dev.mapped_bytes, 0);
	ck_assert_uint_eq(dev.live_bytes, 0);
	ck_assert_uint_eq(dev.held_bytes, 6 * G);
	tc_assert_os_matches(ctx);
	ck_assert_int_eq(cuvmm_ctx_trim(ctx, -1, 0), CUVMM_OK);
	ck_assert_uint_eq(tc_ctx_stats(ctx).held_bytes, 0);
	tc_assert_os_matches(ctx);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/* Two regions share the device's cache and add up in its statistics. */
START_TEST(test_two_regions)
{
	struct cuvmm_ctx *ctx = ctx_with_delay(-1);
	struct cuvmm_region *a = region(ctx, 8 * G), *b = region(ctx, 8 * G);
	struct cuvmm_stats dev;

	ck_assert_ptr_ne(cuvmm_region_base(a), cuvmm_region_base(b));
	ck_assert_int_eq(cuvmm_region_map(a, 0, 3 * G), CUVMM_OK);
	ck_assert_int_eq(cuvmm_region_map(b, 0, 2 * G), CUVMM_OK);
	fill_g(a, 0, 3, 51);
	fill_g(b, 0, 2, 52);
	dev = tc_ctx_stats(ctx);
	ck_assert_uint_eq(dev.mapped_bytes, 5 * G);
	ck_assert_uint_eq(dev.live_bytes, 5 * G);
	ck_assert_uint_eq(dev.reserved_bytes, 16 * G);
	ck_assert_int_eq(cuvmm_region_unmap(a, 0, 3 * G, NULL), CUVMM_OK);
	ck_assert_int_eq(cuvmm_region_map(b, 2 * G, 3 * G), CUVMM_OK); /* a's chunks */
	ck_assert_uint_eq(tc_ctx_stats(ctx).create_calls, 5);
	ck_assert_uint_eq(tc_region_stats(b).create_calls, 2);
	ck_assert_uint_eq(check_g(b, 0, 2, 52), 0);
	expect_region(ctx, a, 0, 0);
	expect_region(ctx, b, 5 * G, 5 * G);
	cuvmm_region_destroy(a);
	cuvmm_region_destroy(b);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/* Host backend: the OS sees the memory come and go. */
START_TEST(test_os_accounting)
{
	struct cuvmm_ctx *ctx;
	struct cuvmm_region *r;
	int64_t base, touched, after, mapped_only;

	if (!tc_on_host()) {
		printf("test_os_accounting: host backend only (process RSS of memfds)\n");
		return;
	}
	ctx = ctx_with_delay(-1);
	r = region(ctx, 16 * G);
	base = tc_rss_shmem();
	ck_assert_int_ge(base, 0);
	ck_assert_int_eq(tc_memfd_bytes(), 0);

	ck_assert_int_eq(cuvmm_region_map(r, 0, 8 * G), CUVMM_OK);
	ck_assert_int_eq(tc_memfd_bytes(), 8 * G); /* committed at creation */
	mapped_only = tc_rss_shmem();
	ck_assert_int_lt(mapped_only - base, (int64_t)(8 * G)); /* not touched yet */

	fill_g(r, 0, 8, 61);
	touched = tc_rss_shmem();
	ck_assert_msg(touched - base >= (int64_t)(8 * G), "RSS of shared memory rose by %lld after touching %zu bytes",
		      (long long)(touched - base), 8 * G);

	ck_assert_int_eq(cuvmm_region_unmap(r, 0, 6 * G, NULL), CUVMM_OK);
	after = tc_rss_shmem();
	ck_assert_msg(touched - after >= (int64_t)(6 * G), "RSS fell by %lld after unmapping %zu bytes",
		      (long long)(touched - after), 6 * G);
	ck_assert_int_eq(tc_memfd_bytes(), 8 * G); /* cached: still held */
	tc_assert_os_matches(ctx);
	ck_assert_uint_eq(check_g(r, 6, 2, 61), 0);

	ck_assert_int_eq(cuvmm_ctx_trim(ctx, -1, 0), CUVMM_OK);
	ck_assert_int_eq(tc_memfd_bytes(), 2 * G);
	tc_assert_os_matches(ctx);
	cuvmm_region_destroy(r);
	ck_assert_int_eq(cuvmm_ctx_trim(ctx, -1, 0), CUVMM_OK);
	ck_assert_int_eq(tc_memfd_bytes(), 0);
	ck_assert_int_le(tc_rss_shmem(), base);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/* ----- fenced unmaps on the host backend (the gate) ----- */

#define HOST_STREAM ((CUstream)(uintptr_t)0x1)

START_TEST(test_fenced_unmap_gate)
{
	struct cuvmm_ctx *ctx;
	struct cuvmm_region *r;
	struct cuvmm_stats st;

	if (!tc_on_host()) {
		printf("test_fenced_unmap_gate: host backend only (the CUDA backend's equivalent is "
		       "test_gpu_shrink_under_kernel)\n");
		return;
	}
	ctx = tc_ctx(NULL);
	r = region(ctx, 16 * G);
	ck_assert_int_eq(cuvmm_region_map(r, 0, 4 * G), CUVMM_OK);
	fill_g(r, 0, 4, 71);

	cvm_host_gate_close(); /* "a kernel is still running" */
	ck_assert_int_eq(cuvmm_region_unmap(r, 0, 4 * G, HOST_STREAM), CUVMM_OK);
	expect_region(ctx, r, 4 * G, 0); /* still mapped, no longer live */
	st = tc_region_stats(r);
	ck_assert_uint_eq(st.unmap_calls, 0);
	/* The "kernel" may still write it. */
	fill_g(r, 0, 4, 72);
	ck_assert_uint_eq(check_g(r, 0, 4, 72), 0);
	tc_sleep_ms(20); /* the background thread looks at the fence meanwhile; it must not unmap */
	expect_region(ctx, r, 4 * G, 0);

	/* Mapping over the pending part takes it back as it is. */
	ck_assert_int_eq(cuvmm_region_map(r, 0, 2 * G), CUVMM_OK);
	expect_region(ctx, r, 4 * G, 2 * G);
	ck_assert_uint_eq(tc_region_stats(r).map_calls, 4);
	ck_assert_uint_eq(check_g(r, 0, 2, 72), 0);

	cvm_host_gate_open(); /* the kernel finished */
	/* The next call on the region does the unmap of what is still pending. */
	ck_assert_int_eq(cuvmm_region_unmap(r, 12 * G, G, NULL), CUVMM_OK);
	expect_region(ctx, r, 2 * G, 2 * G);
	ck_assert_uint_eq(tc_region_stats(r).unmap_calls, 2);
	ck_assert_uint_eq(check_g(r, 0, 2, 72), 0);

	/* The same through trim. */
	cvm_host_gate_close();
	ck_assert_int_eq(cuvmm_region_unmap(r, G, G, HOST_STREAM), CUVMM_OK);
	expect_region(ctx, r, 2 * G, G);
	cvm_host_gate_open();
	tc_settle(ctx);
	expect_region(ctx, r, G, G);
	cuvmm_region_destroy(r);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

START_TEST(test_fenced_resize_gate)
{
	struct cuvmm_ctx *ctx;
	struct cuvmm_region *r;

	if (!tc_on_host()) {
		printf("test_fenced_resize_gate: host backend only\n");
		return;
	}
	ctx = tc_ctx(NULL);
	r = region(ctx, 16 * G);
	ck_assert_int_eq(cuvmm_region_resize(r, 6 * G, NULL), CUVMM_OK);
	fill_g(r, 0, 6, 73);
	cvm_host_gate_close();
	ck_assert_int_eq(cuvmm_region_resize(r, 2 * G, HOST_STREAM), CUVMM_OK);
	expect_region(ctx, r, 6 * G, 2 * G);
	/* Growing back over the pending part takes it back, contents and all. */
	ck_assert_int_eq(cuvmm_region_resize(r, 4 * G, HOST_STREAM), CUVMM_OK);
	expect_region(ctx, r, 6 * G, 4 * G);
	ck_assert_uint_eq(check_g(r, 0, 4, 73), 0);
	cvm_host_gate_open();
	tc_settle(ctx);
	expect_region(ctx, r, 4 * G, 4 * G);
	ck_assert_uint_eq(check_g(r, 0, 4, 73), 0);
	cuvmm_region_destroy(r);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/* Region destroy waits for the fences of pending unmaps. */
START_TEST(test_destroy_waits_for_fence)
{
	struct cuvmm_ctx *ctx;
	struct cuvmm_region *r;
	struct tc_opener o = {200, 0};
	pthread_t t;

	if (!tc_on_host()) {
		printf("test_destroy_waits_for_fence: host backend only\n");
		return;
	}
	ctx = ctx_with_delay(-1);
	r = region(ctx, 8 * G);
	ck_assert_int_eq(cuvmm_region_map(r, 0, 3 * G), CUVMM_OK);
	cvm_host_gate_close();
	ck_assert_int_eq(cuvmm_region_unmap(r, 0, 3 * G, HOST_STREAM), CUVMM_OK);
	ck_assert_int_eq(pthread_create(&t, NULL, tc_open_gate_later, &o), 0);
	cuvmm_region_destroy(r);
	ck_assert_msg(__atomic_load_n(&o.opened, __ATOMIC_SEQ_CST), "region destroy did not wait for the fence");
	pthread_join(t, NULL);
	ck_assert_uint_eq(tc_ctx_stats(ctx).mapped_bytes, 0);
	ck_assert_uint_eq(tc_ctx_stats(ctx).held_bytes, 3 * G);
	tc_assert_os_matches(ctx);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/*
 * A forced pass (trim, destroy) collects the unmaps' fences and waits for them without the region lock; a
 * call on the region meanwhile may process those fences and give them up. The waiter must not then wait on a
 * destroyed or recycled event: it holds a reference to each fence (fence.h), so their events go back to the
 * device's cache only when it is done. Made deterministic with the gate and a failing EVENT_QUERY (which
 * keeps completed fences unprocessed until the fault is cleared).
 */
struct trim_arg {
	struct cuvmm_ctx *ctx;
	int err;
};

static void *trim_thread(void *p)
{
	struct trim_arg *a = p;

	a->err = cuvmm_ctx_trim(a->ctx, -1, 0);
	return NULL;
}

START_TEST(test_trim_races_fence_processing)
{
	const size_t g = 64 * TC_KiB, nfences = 70;
	struct cuvmm_config cfg;
	struct cuvmm_ctx *ctx;
	struct cuvmm_region *r;
	struct trim_arg ta;
	struct timespec deadline;
	pthread_t t;
	uint64_t end;
	int joined;

	if (!tc_on_host()) {
		printf("test_trim_races_fence_processing: host backend only (the gate)\n");
		return;
	}
	tc_config(&cfg);
	cfg.host_granularity = g;
	/* With a background thread the map below does not run a reclaim pass itself (which would wait for the
	 * trim: see test_poll_not_blocked_by_trim); the long delay keeps chunks cached. */
	cfg.background_release = true;
	cfg.release_delay_ms = 1000000;
	ctx = tc_ctx(&cfg);
	r = region(ctx, 80 * g);
	ck_assert_int_eq(cuvmm_region_map(r, 0, (nfences + 2) * g), CUVMM_OK);
	tc_log_capture(CUVMM_LOG_ERROR); /* every failed query is logged */
	ck_assert_int_eq(cuvmm_ctx_inject_fault(ctx, CUVMM_CALL_EVENT_QUERY, 0, UINT32_MAX, CUVMM_EDRIVER), CUVMM_OK);
	for (size_t i = 0; i < nfences; i++) /* complete, but left unprocessed: 70 events, none spare */
		ck_assert_int_eq(cuvmm_region_unmap(r, i * g, g, HOST_STREAM), CUVMM_OK);
	cvm_host_gate_close();
	ck_assert_int_eq(cuvmm_region_unmap(r, nfences * g, g, HOST_STREAM), CUVMM_OK); /* the one still running */
	expect_region(ctx, r, (nfences + 2) * g, g);

	/* A trim collects the 71 events and waits on the newest. */
	ta.ctx = ctx;
	ta.err = -100;
	ck_assert_int_eq(pthread_create(&t, NULL, trim_thread, &ta), 0);
	end = tc_now_ms() + 10000;
	while (cuvmm_ctx_call_count(ctx, CUVMM_CALL_EVENT_SYNC) == 0 && tc_now_ms() < end)
		tc_sleep_ms(1);
	ck_assert_msg(cuvmm_ctx_call_count(ctx, CUVMM_CALL_EVENT_SYNC) >= 1, "the trim never waited on a fence");

	/* Meanwhile a map processes the 70 completed fences (the trim's references keep their events). */
	ck_assert_int_eq(cuvmm_ctx_inject_fault(ctx, CUVMM_CALL_EVENT_QUERY, 0, 0, CUVMM_EDRIVER), CUVMM_OK);
	ck_assert_int_eq(cuvmm_region_map(r, (nfences + 1) * g, g), CUVMM_OK);
	expect_region(ctx, r, 2 * g, g); /* [70g, 71g) still pending, [71g, 72g) live */

	/* The "kernel" finishes: the trim must come back (it must not be waiting on a destroyed event). */
	cvm_host_gate_open();
	clock_gettime(CLOCK_REALTIME, &deadline);
	deadline.tv_sec += 5;
	joined = pthread_timedjoin_np(t, NULL, &deadline);
	/* Were the events given away while the trim waits (destroyed beyond the cache, as they once were), it
	 * would sync on destroyed events: a heap-use-after-free on the host backend (ASan reports it; without
	 * ASan the freed event reads as never complete and the trim hangs), cuEventSynchronize on a destroyed
	 * CUevent on CUDA. */
	ck_assert_msg(joined == 0, "the trim did not return 5 s after its fences completed");
	ck_assert_int_eq(ta.err, CUVMM_OK);
	expect_region(ctx, r, g, g);
	cuvmm_region_destroy(r);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/*
 * cuvmm_ctx_trim "waits for the GPU work that fences pending unmaps (never while holding a lock an allocating
 * thread needs)". Without a background thread, an application call whose reclaim deadline has passed runs the
 * reclaim pass itself: it must not wait for another thread's trim, which waits for the GPU.
 */
struct map_arg {
	struct cuvmm_region *r;
	size_t offset;
	int err;
	int done;
};

static void *map_thread(void *p)
{
	struct map_arg *a = p;

	a->err = cuvmm_region_map(a->r, a->offset, cuvmm_region_granularity(a->r));
	__atomic_store_n(&a->done, 1, __ATOMIC_SEQ_CST);
	return NULL;
}

START_TEST(test_poll_not_blocked_by_trim)
{
	struct cuvmm_config cfg;
	struct cuvmm_ctx *ctx;
	struct cuvmm_region *r;
	struct trim_arg ta;
	struct map_arg ma;
	pthread_t t, m;
	uint64_t end;
	int done;

	if (!tc_on_host()) {
		printf("test_poll_not_blocked_by_trim: host backend only (the gate)\n");
		return;
	}
	tc_config(&cfg);
	cfg.background_release = false;
	cfg.release_delay_ms = -1;
	ctx = tc_ctx(&cfg);
	r = region(ctx, 8 * G);
	ck_assert_int_eq(cuvmm_region_map(r, 0, 2 * G), CUVMM_OK);
	cvm_host_gate_close();
	ck_assert_int_eq(cuvmm_region_unmap(r, 0, G, HOST_STREAM), CUVMM_OK); /* a fence to poll: due in ~2 ms */

	ta.ctx = ctx;
	ta.err = -100;
	ck_assert_int_eq(pthread_create(&t, NULL, trim_thread, &ta), 0);
	end = tc_now_ms() + 10000;
	while (cuvmm_ctx_call_count(ctx, CUVMM_CALL_EVENT_SYNC) == 0 && tc_now_ms() < end)
		tc_sleep_ms(1);
	ck_assert_msg(cuvmm_ctx_call_count(ctx, CUVMM_CALL_EVENT_SYNC) >= 1, "the trim never waited on the fence");
	tc_sleep_ms(20); /* the fence's poll deadline has passed: the next call runs a reclaim pass */

	memset(&ma, 0, sizeof(ma));
	ma.r = r;
	ma.offset = 4 * G;
	ck_assert_int_eq(pthread_create(&m, NULL, map_thread, &ma), 0);
	end = tc_now_ms() + 3000;
	while (!__atomic_load_n(&ma.done, __ATOMIC_SEQ_CST) && tc_now_ms() < end)
		tc_sleep_ms(1);
	done = __atomic_load_n(&ma.done, __ATOMIC_SEQ_CST);
	cvm_host_gate_open();
	pthread_join(t, NULL);
	pthread_join(m, NULL);
	/* (Before ebb8b82, cvm_ctx_reclaim took clients_lock with pthread_mutex_lock in the passes that
	 * cvm_ctx_poll runs too, so the map waited the whole GPU wait out.) */
	ck_assert_msg(done, "a region map waited (3 s and more) for another thread's trim to finish its GPU wait");
	ck_assert_int_eq(ma.err, CUVMM_OK);
	ck_assert_int_eq(ta.err, CUVMM_OK);
	tc_settle(ctx);
	expect_region(ctx, r, 2 * G, 2 * G);
	cuvmm_region_destroy(r);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/* ----- fenced unmaps under real kernels (CUDA), or the CPU equivalent (host) ----- */

/* CUDA: how many passes of the fill kernel over `bytes` take about target_ms (at least 8). */
static int calibrate_iters(void *p, size_t bytes, CUstream s, int target_ms)
{
	uint64_t t0 = 0, t1 = 0;
	double per_pass_ms, iters;

	for (int pass = 0; pass < 2; pass++) { /* the first run may include loading the kernel */
		t0 = tc_now_us();
		ck_assert_int_eq(tc_fill_async(p, bytes / 4, 1, 16, s), 0);
		ck_assert_int_eq(tc_stream_sync(s), 0);
		t1 = tc_now_us();
	}
	per_pass_ms = (double)(t1 - t0) / 16 / 1000;
	iters = target_ms / (per_pass_ms > 0.001 ? per_pass_ms : 0.001);
	return iters < 8 ? 8 : iters > 1000000 ? 1000000 : (int)iters;
}

/* (a) Shrink to nothing while a kernel still writes the memory: the unmap must be fenced. */
START_TEST(test_gpu_shrink_under_kernel)
{
	const size_t bytes = tc_on_host() ? 16 * TC_MiB : 256 * TC_MiB;
	struct cuvmm_ctx *ctx = tc_ctx(NULL);
	struct cuvmm_region *r = region(ctx, 2 * bytes);
	CUstream s;
	struct cuvmm_stats st;
	int iters = 1, q, sync;
	uint64_t t0, t1, t2;

	ck_assert_int_eq(cuvmm_region_resize(r, bytes, NULL), CUVMM_OK);
	ck_assert_int_eq(tc_stream_create(&s), 0);
	if (!tc_on_host())
		iters = calibrate_iters(cuvmm_region_base(r), bytes, s, 200);
	else
		cvm_host_gate_close();

	t0 = tc_now_us();
	ck_assert_int_eq(tc_fill_async(cuvmm_region_base(r), bytes / 4, 81, iters, s), 0);
	ck_assert_int_eq(cuvmm_region_resize(r, 0, s), CUVMM_OK);
	t1 = tc_now_us();
	st = tc_region_stats(r);
	q = tc_on_host() ? CUDA_ERROR_NOT_READY : tg_stream_query(s);
	ck_assert_uint_eq(st.live_bytes, 0);
	/* While the kernel runs, the memory stays mapped. */
	if (q == CUDA_ERROR_NOT_READY)
		ck_assert_msg(st.mapped_bytes == bytes, "unmapped %llu bytes under a running kernel",
			      (unsigned long long)(bytes - st.mapped_bytes));
	if (tc_on_host()) {
		/* The "kernel" still writes: the memory must still be there. */
		ck_assert_int_eq(tc_fill(cuvmm_region_base(r), bytes / 4, 82), 0);
		ck_assert_uint_eq(tc_check(cuvmm_region_base(r), bytes / 4, 82), 0);
		cvm_host_gate_open();
	}
	sync = tc_stream_sync(s);
	t2 = tc_now_us();
	printf("test_gpu_shrink_under_kernel: %d passes over %zu MiB; resize returned after %.3f ms, the kernel "
	       "%s then and done after %.1f ms\n",
	       iters, bytes >> 20, (double)(t1 - t0) / 1000, q == CUDA_ERROR_NOT_READY ? "still ran" : "had finished",
	       (double)(t2 - t0) / 1000);
	ck_assert_msg(sync == 0, "the kernel failed (%d %s): the unmap was not fenced", sync,
		      tc_on_host() ? "" : tg_error_name(sync));
	tc_settle(ctx);
	expect_region(ctx, r, 0, 0);
	ck_assert_int_eq(cuvmm_ctx_trim(ctx, -1, 0), CUVMM_OK);
	ck_assert_uint_eq(tc_wait_held_le(ctx, 0, 5000), 0); /* the background thread may be mid-release */
	tc_assert_os_matches(ctx);
	tc_stream_destroy(s);
	cuvmm_region_destroy(r);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/* (b) Data written by a kernel survives a grow. */
START_TEST(test_gpu_grow_keeps_data)
{
	const size_t small = tc_on_host() ? 8 * TC_MiB : 64 * TC_MiB;
	const size_t big = tc_on_host() ? 64 * TC_MiB : 512 * TC_MiB;
	struct cuvmm_ctx *ctx = tc_ctx(NULL);
	struct cuvmm_region *r = region(ctx, big);

	ck_assert_int_eq(cuvmm_region_resize(r, small, NULL), CUVMM_OK);
	ck_assert_int_eq(tc_fill(cuvmm_region_base(r), small / 4, 91), 0);
	ck_assert_int_eq(cuvmm_region_resize(r, big, NULL), CUVMM_OK);
	expect_region(ctx, r, big, big);
	ck_assert_uint_eq(tc_check(cuvmm_region_base(r), small / 4, 91), 0);
	/* The new part is usable too. */
	ck_assert_int_eq(tc_fill(at(r, small), (big - small) / 4, 92), 0);
	ck_assert_uint_eq(tc_check(at(r, small), (big - small) / 4, 92), 0);
	ck_assert_uint_eq(tc_check(cuvmm_region_base(r), small / 4, 91), 0);
	cuvmm_region_destroy(r);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/* (c) An unmap with the NULL stream waits for all work on the device, then unmaps at once. */
START_TEST(test_gpu_null_stream_unmap_under_kernel)
{
	const size_t bytes = tc_on_host() ? 16 * TC_MiB : 256 * TC_MiB;
	struct cuvmm_ctx *ctx = tc_ctx(NULL);
	struct cuvmm_region *r = region(ctx, bytes + 2 * G);
	CUstream s;
	int sync;

	ck_assert_int_eq(cuvmm_region_map(r, 0, bytes + 2 * G), CUVMM_OK);
	ck_assert_int_eq(tc_stream_create(&s), 0);
	if (tc_on_host()) {
		struct tc_opener o = {200, 0};
		pthread_t t;

		/* Pending work on the "device": a fenced unmap recorded while the gate is closed. */
		cvm_host_gate_close();
		ck_assert_int_eq(cuvmm_region_unmap(r, bytes, 2 * G, HOST_STREAM), CUVMM_OK);
		ck_assert_int_eq(pthread_create(&t, NULL, tc_open_gate_later, &o), 0);
		ck_assert_int_eq(cuvmm_region_unmap(r, 0, bytes, NULL), CUVMM_OK);
		ck_assert_msg(__atomic_load_n(&o.opened, __ATOMIC_SEQ_CST),
			      "the NULL-stream unmap returned while work was pending");
		pthread_join(t, NULL);
	} else {
		int iters = calibrate_iters(cuvmm_region_base(r), bytes, s, 200);
		uint64_t t0 = tc_now_us(), t1;

		ck_assert_int_eq(tc_fill_async(cuvmm_region_base(r), bytes / 4, 93, iters, s), 0);
		ck_assert_int_eq(cuvmm_region_unmap(r, 0, bytes + 2 * G, NULL), CUVMM_OK);
		t1 = tc_now_us();
		/* It synchronised the device: the kernel is done. */
		ck_assert_int_eq(tg_stream_query(s), CUDA_SUCCESS);
		printf("test_gpu_null_stream_unmap_under_kernel: %d passes; the unmap returned after %.1f ms\n", iters,
		       (double)(t1 - t0) / 1000);
	}
	/* Nothing to wait for any more: unmapped at once. */
	expect_region(ctx, r, 0, 0);
	sync = tc_stream_sync(s);
	ck_assert_msg(sync == 0, "the kernel failed (%d)", sync);
	tc_stream_destroy(s);
	cuvmm_region_destroy(r);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/* ----- fault injection ----- */

START_TEST(test_fault_reserve)
{
	struct cuvmm_ctx *ctx = tc_ctx(NULL);
	struct cuvmm_region *r = RSENTINEL;

	ck_assert_int_eq(cuvmm_ctx_inject_fault(ctx, CUVMM_CALL_RESERVE, 0, 1, CUVMM_ENOMEM), CUVMM_OK);
	ck_assert_int_eq(cuvmm_region_create(ctx, 0, 8 * G, &r), CUVMM_ENOSPC);
	ck_assert_ptr_eq(r, RSENTINEL);
	ck_assert_int_eq(cuvmm_ctx_inject_fault(ctx, CUVMM_CALL_RESERVE, 0, 1, CUVMM_EDRIVER), CUVMM_OK);
	ck_assert_int_eq(cuvmm_region_create(ctx, 0, 8 * G, &r), CUVMM_EDRIVER);
	ck_assert_ptr_eq(r, RSENTINEL);
	ck_assert_int_eq(cuvmm_last_driver_error(), CUDA_ERROR_UNKNOWN);
	ck_assert_uint_eq(tc_ctx_stats(ctx).reserved_bytes, 0);
	ck_assert_uint_eq(cuvmm_ctx_call_count(ctx, CUVMM_CALL_RESERVE), 2);

	r = region(ctx, 8 * G);
	ck_assert_int_eq(cuvmm_region_map(r, 0, 2 * G), CUVMM_OK);
	fill_g(r, 0, 2, 101);
	ck_assert_uint_eq(check_g(r, 0, 2, 101), 0);
	cuvmm_region_destroy(r);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/*
 * CREATE, MAP and SET_ACCESS failing at the first, second, third or last of four chunks (or access runs), in a
 * map and in a resize. Layout: granules 0, 2, 4, 6 (and 9) are mapped with contents; the call maps 1, 3, 5, 7
 * (four chunks, four separate runs, so four SET_ACCESS calls); the resize also unmaps 9.
 * _i = ((call * 2 + is_resize) * 4) + skip.
 */
static const enum cuvmm_call map_path_calls[] = {CUVMM_CALL_CREATE, CUVMM_CALL_MAP, CUVMM_CALL_SET_ACCESS};
#define MAP_FAULT_CASES (3 * 2 * 4)

START_TEST(test_fault_map_path)
{
	const enum cuvmm_call call = map_path_calls[_i / 8];
	const bool resize = (_i / 4) % 2;
	const uint64_t skip = (uint64_t)(_i % 4);
	const int err = skip % 2 ? CUVMM_ENOMEM : CUVMM_EDRIVER;
	struct cuvmm_ctx *ctx = tc_ctx(NULL);
	struct cuvmm_region *r = region(ctx, 16 * G);
	struct tc_snap before, after;
	char what[96];
	CUstream s;
	int got;

	snprintf(what, sizeof(what), "%s failing after %llu calls in a %s", cuvmm_call_name(call), (unsigned long long)skip,
		 resize ? "resize" : "map");
	ck_assert_int_eq(tc_stream_create(&s), 0);
	for (size_t g = 0; g <= 6; g += 2)
		ck_assert_int_eq(cuvmm_region_map(r, g * G, G), CUVMM_OK);
	ck_assert_int_eq(cuvmm_region_map(r, 9 * G, G), CUVMM_OK);
	fill_g(r, 0, 1, 111);
	fill_g(r, 2, 1, 111);
	fill_g(r, 4, 1, 111);
	fill_g(r, 6, 1, 111);
	fill_g(r, 9, 1, 111);
	ck_assert_int_eq(cuvmm_ctx_trim(ctx, -1, 0), CUVMM_OK); /* an empty cache: every chunk is created */
	before = tc_snap_take(ctx, r);

	ck_assert_int_eq(cuvmm_ctx_inject_fault(ctx, call, skip, 1, err), CUVMM_OK);
	got = resize ? cuvmm_region_resize(r, 8 * G, s) : cuvmm_region_map(r, G, 7 * G);
	ck_assert_msg(got == err, "%s: returned %s, want %s", what, cuvmm_err_name(got), cuvmm_err_name(err));
	ck_assert_int_eq(cuvmm_last_driver_error(), err == CUVMM_ENOMEM ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_ERROR_UNKNOWN);
	tc_settle(ctx); /* nothing may have been left pending either */
	after = tc_snap_take(ctx, r);
	/* What was mapped is untouched. */
	ck_assert_uint_eq(check_g(r, 0, 1, 111) + check_g(r, 2, 1, 111) + check_g(r, 4, 1, 111) +
				  check_g(r, 6, 1, 111) + check_g(r, 9, 1, 111),
			  0);
	/* held and the memfds included: the chunks the failed call created must go back to the driver, not to
	 * the cache (a bug fixed in ebb8b82). */
	tc_snap_expect_same(&before, &after, what, true);

	/* The fault was used up: the same call now works. */
	got = resize ? cuvmm_region_resize(r, 8 * G, s) : cuvmm_region_map(r, G, 7 * G);
	ck_assert_msg(got == CUVMM_OK, "%s: the retry returned %s", what, cuvmm_err_name(got));
	tc_settle(ctx);
	expect_region(ctx, r, (resize ? 8 : 9) * G, (resize ? 8 : 9) * G);
	ck_assert_uint_eq(check_g(r, 0, 1, 111) + check_g(r, 2, 1, 111) + check_g(r, 4, 1, 111) +
				  check_g(r, 6, 1, 111),
			  0);
	fill_g(r, 0, 8, 112);
	ck_assert_uint_eq(check_g(r, 0, 8, 112), 0);
	tc_stream_destroy(s);
	cuvmm_region_destroy(r);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/*
 * The fence of an unmap or shrink: EVENT_CREATE, EVENT_RECORD (on a stream) and DEVICE_SYNC (NULL stream)
 * failing. The call fails and nothing changes. _i = call * 2 + is_resize.
 */
static const enum cuvmm_call fence_calls[] = {CUVMM_CALL_EVENT_CREATE, CUVMM_CALL_EVENT_RECORD,
					       CUVMM_CALL_DEVICE_SYNC};
#define FENCE_FAULT_CASES (3 * 2)

START_TEST(test_fault_fence)
{
	const enum cuvmm_call call = fence_calls[_i / 2];
	const bool resize = _i % 2;
	struct cuvmm_ctx *ctx = tc_ctx(NULL);
	struct cuvmm_region *r = region(ctx, 16 * G); /* fresh: no spare event, so the fence creates one */
	struct tc_snap before, after;
	char what[96];
	CUstream s = NULL;
	int got;

	snprintf(what, sizeof(what), "%s failing in a %s", cuvmm_call_name(call), resize ? "shrink" : "unmap");
	if (call != CUVMM_CALL_DEVICE_SYNC)
		ck_assert_int_eq(tc_stream_create(&s), 0);
	ck_assert_int_eq(cuvmm_region_map(r, 0, 4 * G), CUVMM_OK);
	fill_g(r, 0, 4, 121);
	before = tc_snap_take(ctx, r);

	ck_assert_int_eq(cuvmm_ctx_inject_fault(ctx, call, 0, 1, CUVMM_EDRIVER), CUVMM_OK);
	got = resize ? cuvmm_region_resize(r, 2 * G, s) : cuvmm_region_unmap(r, 2 * G, 2 * G, s);
	ck_assert_msg(got == CUVMM_EDRIVER, "%s: returned %s", what, cuvmm_err_name(got));
	ck_assert_uint_eq(cuvmm_ctx_call_count(ctx, call), 1);
	tc_settle(ctx);
	after = tc_snap_take(ctx, r);
	tc_snap_expect_same(&before, &after, what, true);
	ck_assert_uint_eq(check_g(r, 0, 4, 121), 0);

	got = resize ? cuvmm_region_resize(r, 2 * G, s) : cuvmm_region_unmap(r, 2 * G, 2 * G, s);
	ck_assert_msg(got == CUVMM_OK, "%s: the retry returned %s", what, cuvmm_err_name(got));
	tc_settle(ctx);
	expect_region(ctx, r, 2 * G, 2 * G);
	ck_assert_uint_eq(check_g(r, 0, 2, 121), 0);
	tc_stream_destroy(s);
	cuvmm_region_destroy(r);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/* UNMAP failing while pending unmaps are processed: the unmap call succeeds, the memory stays mapped (and
 * logged), it is retried later, and a map in the meantime takes it back with its contents. */
START_TEST(test_fault_unmap_retried)
{
	struct cuvmm_ctx *ctx = tc_ctx(NULL);
	struct cuvmm_region *r = region(ctx, 16 * G);
	struct cuvmm_stats st;

	ck_assert_int_eq(cuvmm_region_map(r, 0, 4 * G), CUVMM_OK);
	fill_g(r, 0, 4, 131);
	tc_log_capture(CUVMM_LOG_ERROR);
	ck_assert_int_eq(cuvmm_ctx_inject_fault(ctx, CUVMM_CALL_UNMAP, 0, UINT32_MAX, CUVMM_EDRIVER), CUVMM_OK);
	ck_assert_int_eq(cuvmm_region_unmap(r, 0, 3 * G, NULL), CUVMM_OK);
	expect_region(ctx, r, 4 * G, G); /* stuck mapped, but not live */
	ck_assert_int_ge(tc_log_count(CUVMM_LOG_ERROR, NULL), 1);
	ck_assert_uint_ge(cuvmm_ctx_call_count(ctx, CUVMM_CALL_UNMAP), 1);

	/* Still failing: trim keeps it mapped and does not crash. */
	ck_assert_int_eq(cuvmm_ctx_trim(ctx, -1, 0), CUVMM_OK);
	expect_region(ctx, r, 4 * G, G);

	/* A map takes a stuck granule back, contents intact. */
	ck_assert_int_eq(cuvmm_region_map(r, 0, G), CUVMM_OK);
	expect_region(ctx, r, 4 * G, 2 * G);
	ck_assert_uint_eq(check_g(r, 0, 1, 131), 0);
	ck_assert_uint_eq(check_g(r, 3, 1, 131), 0);

	/* The fault clears: the next trim does the unmap. */
	ck_assert_int_eq(cuvmm_ctx_inject_fault(ctx, CUVMM_CALL_UNMAP, 0, 0, CUVMM_EDRIVER), CUVMM_OK);
	ck_assert_int_eq(cuvmm_ctx_trim(ctx, -1, 0), CUVMM_OK);
	expect_region(ctx, r, 2 * G, 2 * G);
	st = tc_ctx_stats(ctx);
	ck_assert_uint_eq(st.held_bytes, 2 * G);
	ck_assert_uint_eq(check_g(r, 0, 1, 131) + check_g(r, 3, 1, 131), 0);
	/* And the granules are usable again. */
	ck_assert_int_eq(cuvmm_region_map(r, 0, 4 * G), CUVMM_OK);
	fill_g(r, 0, 4, 132);
	ck_assert_uint_eq(check_g(r, 0, 4, 132), 0);
	cuvmm_region_destroy(r);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/*
 * The calls a pool makes instead of touching slots (region.h): where a chunk ends, the release of safe
 * granules, and the unmap with the lock dropped, whose refused chunk stays mapped, pending, for a later pass.
 */
START_TEST(test_pool_calls)
{
	struct cuvmm_config cfg;
	struct cuvmm_ctx *ctx;
	struct cuvmm_region *r;
	struct cvm_granules v[2] = {{0, 4, 1}, {4, 4, 1}};

	tc_config(&cfg);
	cfg.background_release = false; /* no pass but the ones below */
	cfg.release_delay_ms = -1;
	ctx = tc_ctx(&cfg);
	r = region(ctx, 16 * G);
	pthread_mutex_lock(&r->lock);
	ck_assert_int_eq(cvm_region_map_locked(r, 0, 8, 2), CUVMM_OK); /* two chunks of 4 granules */
	ck_assert_uint_eq(cvm_region_chunk_end_locked(r, 0), 4);
	ck_assert_uint_eq(cvm_region_chunk_end_locked(r, 3), 4);
	ck_assert_uint_eq(cvm_region_chunk_end_locked(r, 5), 8);
	ck_assert_uint_eq(cvm_region_chunk_end_locked(r, 9), 10); /* nothing mapped there */
	ck_assert_uint_eq(cvm_region_pending_locked(r), 0);
	pthread_mutex_unlock(&r->lock);
	expect_region(ctx, r, 8 * G, 8 * G);

	/* The first chunk's unmap is refused: it stays mapped, not live, pending; the second goes at once. */
	ck_assert_int_eq(cuvmm_ctx_inject_fault(ctx, CUVMM_CALL_UNMAP, 0, 1, CUVMM_EDRIVER), CUVMM_OK);
	pthread_mutex_lock(&r->lock);
	ck_assert_int_eq(cvm_region_unmap_now_locked(r, v, 2), CUVMM_OK);
	ck_assert_uint_eq(cvm_region_pending_locked(r), 4);
	pthread_mutex_unlock(&r->lock);
	expect_region(ctx, r, 4 * G, 0);
	pthread_mutex_lock(&r->lock);
	cvm_region_process_locked(r, cvm_now_ns(), false); /* the retry */
	ck_assert_uint_eq(cvm_region_pending_locked(r), 0);
	pthread_mutex_unlock(&r->lock);
	expect_region(ctx, r, 0, 0);

	/* Release: pending behind a complete fence, unmapped by the next pass. */
	pthread_mutex_lock(&r->lock);
	ck_assert_int_eq(cvm_region_map_locked(r, 0, 4, 2), CUVMM_OK);
	ck_assert_int_eq(cvm_region_release_locked(r, 0, 4, cvm_now_ns()), CUVMM_OK);
	ck_assert_uint_eq(cvm_region_pending_locked(r), 4);
	pthread_mutex_unlock(&r->lock);
	expect_region(ctx, r, 4 * G, 0);
	pthread_mutex_lock(&r->lock);
	cvm_region_process_locked(r, cvm_now_ns(), false);
	ck_assert_uint_eq(cvm_region_pending_locked(r), 0);
	pthread_mutex_unlock(&r->lock);
	expect_region(ctx, r, 0, 0);
	cuvmm_region_destroy(r);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/* EVENT_QUERY failing: the memory stays mapped (logged), and a later pass unmaps it. */
START_TEST(test_fault_event_query)
{
	struct cuvmm_config cfg;
	struct cuvmm_ctx *ctx;
	struct cuvmm_region *r;
	CUstream s;

	tc_config(&cfg);
	cfg.background_release = false; /* only this thread's calls process the fence */
	ctx = tc_ctx(&cfg);
	r = region(ctx, 8 * G);
	ck_assert_int_eq(tc_stream_create(&s), 0);
	ck_assert_int_eq(cuvmm_region_map(r, 0, 2 * G), CUVMM_OK);
	tc_log_capture(CUVMM_LOG_ERROR);
	ck_assert_int_eq(cuvmm_ctx_inject_fault(ctx, CUVMM_CALL_EVENT_QUERY, 0, 1, CUVMM_EDRIVER), CUVMM_OK);
	ck_assert_int_eq(cuvmm_region_unmap(r, 0, 2 * G, s), CUVMM_OK);
	expect_region(ctx, r, 2 * G, 0);
	ck_assert_int_ge(tc_log_count(CUVMM_LOG_ERROR, NULL), 1);
	tc_settle(ctx);
	expect_region(ctx, r, 0, 0);
	tc_stream_destroy(s);
	cuvmm_region_destroy(r);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/*
 * RELEASE failing during trim. cuvmm.h: trim returns "CUVMM_EDRIVER if a release failed (what could be released
 * was)".
 */
START_TEST(test_fault_release_trim_result)
{
	struct cuvmm_ctx *ctx = ctx_with_delay(-1);
	struct cuvmm_region *r = region(ctx, 8 * G);
	int got;

	ck_assert_int_eq(cuvmm_region_map(r, 0, 4 * G), CUVMM_OK);
	ck_assert_int_eq(cuvmm_region_unmap(r, 0, 4 * G, NULL), CUVMM_OK);
	ck_assert_uint_eq(tc_ctx_stats(ctx).held_bytes, 4 * G);
	tc_log_capture(CUVMM_LOG_ERROR);
	ck_assert_int_eq(cuvmm_ctx_inject_fault(ctx, CUVMM_CALL_RELEASE, 1, 1, CUVMM_EDRIVER), CUVMM_OK);
	got = cuvmm_ctx_trim(ctx, -1, 0);
	ck_assert_int_ge(tc_log_count(CUVMM_LOG_ERROR, NULL), 1);
	ck_assert_uint_eq(cuvmm_ctx_call_count(ctx, CUVMM_CALL_RELEASE), 4); /* the others were released */
	/* KNOWN BUG (lib/ctx.c, cuvmm_ctx_trim): returns CUVMM_OK unconditionally; release failures inside
	 * cvm_phys_reclaim are only logged. */
	ck_assert_msg(got == CUVMM_EDRIVER, "trim with a failing release returned %s, want CUVMM_EDRIVER",
		      cuvmm_err_name(got));
	cuvmm_region_destroy(r);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/* After a failed release the chunk is still the driver's (the OS still holds the memfd): the statistics must
 * keep counting it, and a later trim, once the fault is gone, must give it back. */
START_TEST(test_fault_release_keeps_chunk)
{
	struct cuvmm_ctx *ctx = ctx_with_delay(-1);
	struct cuvmm_region *r = region(ctx, 8 * G);

	ck_assert_int_eq(cuvmm_region_map(r, 0, 4 * G), CUVMM_OK);
	ck_assert_int_eq(cuvmm_region_unmap(r, 0, 4 * G, NULL), CUVMM_OK);
	tc_log_capture(CUVMM_LOG_ERROR);
	ck_assert_int_eq(cuvmm_ctx_inject_fault(ctx, CUVMM_CALL_RELEASE, 1, 1, CUVMM_EDRIVER), CUVMM_OK);
	cuvmm_ctx_trim(ctx, -1, 0);
	/* (Before ebb8b82 the chunk was forgotten: held dropped while the memfd stayed open for good.) */
	tc_assert_os_matches(ctx);
	ck_assert_uint_eq(tc_ctx_stats(ctx).held_bytes, G);
	ck_assert_int_eq(cuvmm_ctx_trim(ctx, -1, 0), CUVMM_OK);
	ck_assert_uint_eq(tc_ctx_stats(ctx).held_bytes, 0);
	tc_assert_os_matches(ctx);
	cuvmm_region_destroy(r);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/* UNRESERVE failing on destroy: logged, no crash, and the context goes on working. */
START_TEST(test_fault_unreserve)
{
	struct cuvmm_ctx *ctx = tc_ctx(NULL);
	struct cuvmm_region *r = region(ctx, 8 * G);

	ck_assert_int_eq(cuvmm_region_map(r, 0, 2 * G), CUVMM_OK);
	tc_log_capture(CUVMM_LOG_ERROR);
	ck_assert_int_eq(cuvmm_ctx_inject_fault(ctx, CUVMM_CALL_UNRESERVE, 0, 1, CUVMM_EDRIVER), CUVMM_OK);
	cuvmm_region_destroy(r);
	ck_assert_uint_eq(cuvmm_ctx_call_count(ctx, CUVMM_CALL_UNRESERVE), 1);
	ck_assert_int_ge(tc_log_count(CUVMM_LOG_ERROR, "address space"), 1);
	ck_assert_uint_eq(tc_ctx_stats(ctx).mapped_bytes, 0);
	ck_assert_uint_eq(tc_ctx_stats(ctx).live_bytes, 0);
	tc_assert_os_matches(ctx);

	r = region(ctx, 8 * G);
	ck_assert_int_eq(cuvmm_region_map(r, 0, 4 * G), CUVMM_OK);
	fill_g(r, 0, 4, 141);
	ck_assert_uint_eq(check_g(r, 0, 4, 141), 0);
	cuvmm_region_destroy(r);
	tc_log_release();
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/* ----- threads ----- */

#define MT_THREADS 4
#define MT_GRANULES 4 /* per thread */
#define MT_ITERS 40

struct mt_arg {
	struct cuvmm_region *r;
	CUstream stream;
	int index;
	int errors;
	char msg[160];
};

static void mt_fail(struct mt_arg *a, const char *what, int it, long long v)
{
	if (!a->errors++)
		snprintf(a->msg, sizeof(a->msg), "thread %d, iteration %d: %s (%lld)", a->index, it, what, v);
}

static void *mt_main(void *p)
{
	struct mt_arg *a = p;
	const size_t first = (size_t)a->index * MT_GRANULES * G, half = MT_GRANULES / 2 * G;
	char *base = (char *)cuvmm_region_base(a->r) + first;

	for (int it = 0; it < MT_ITERS; it++) {
		uint32_t v = (uint32_t)(a->index * 100000 + it);
		CUstream s = it % 2 ? a->stream : NULL;
		uint64_t bad;
		int err;

		if ((err = cuvmm_region_map(a->r, first, 2 * half)))
			mt_fail(a, "map", it, err);
		if ((err = tc_fill(base, 2 * half / 4, v)))
			mt_fail(a, "fill", it, err);
		if ((bad = tc_check(base, 2 * half / 4, v)))
			mt_fail(a, "mismatches after fill", it, (long long)bad);
		if ((err = cuvmm_region_unmap(a->r, first, half, s)))
			mt_fail(a, "unmap of the first half", it, err);
		if ((err = cuvmm_region_map(a->r, first, half)))
			mt_fail(a, "map of the first half again", it, err);
		if ((bad = tc_check(base + half, half / 4, v ^ (uint32_t)(half / 4))))
			mt_fail(a, "second half damaged", it, (long long)bad);
		if ((err = tc_fill(base, half / 4, v)))
			mt_fail(a, "fill of the first half", it, err);
		if ((err = cuvmm_region_unmap(a->r, first, 2 * half, it % 3 ? s : a->stream)))
			mt_fail(a, "unmap of everything", it, err);
	}
	return NULL;
}

START_TEST(test_threads)
{
	struct cuvmm_config cfg;
	struct cuvmm_ctx *ctx;
	struct cuvmm_region *r;
	struct mt_arg args[MT_THREADS];
	pthread_t t[MT_THREADS];
	struct cuvmm_stats st;

	tc_config(&cfg);
	cfg.release_delay_ms = 2; /* keep the background thread busy releasing */
	cfg.background_release = true;
	ctx = tc_ctx(&cfg);
	r = region(ctx, (size_t)MT_THREADS * MT_GRANULES * G + 4 * G);
	memset(args, 0, sizeof(args));
	for (int i = 0; i < MT_THREADS; i++) {
		args[i].r = r;
		args[i].index = i;
		ck_assert_int_eq(tc_stream_create(&args[i].stream), 0);
	}
	for (int i = 0; i < MT_THREADS; i++)
		ck_assert_int_eq(pthread_create(&t[i], NULL, mt_main, &args[i]), 0);
	for (int i = 0; i < MT_THREADS; i++)
		pthread_join(t[i], NULL);
	for (int i = 0; i < MT_THREADS; i++) {
		ck_assert_msg(args[i].errors == 0, "%d errors; first: %s", args[i].errors, args[i].msg);
		tc_stream_destroy(args[i].stream);
	}
	tc_settle(ctx);
	expect_region(ctx, r, 0, 0);
	st = tc_region_stats(r);
	ck_assert_uint_eq(st.map_calls, st.unmap_calls);
	ck_assert_uint_ge(st.peak_live_bytes, MT_GRANULES * G);
	ck_assert_uint_le(st.peak_live_bytes, (uint64_t)MT_THREADS * MT_GRANULES * G);
	st = tc_ctx_stats(ctx);
	ck_assert_uint_eq(st.mapped_bytes, 0);
	ck_assert_uint_eq(st.live_bytes, 0);
	ck_assert_int_eq(cuvmm_ctx_trim(ctx, -1, 0), CUVMM_OK);
	/* (The background thread may still be releasing a chunk it took before the trim.) */
	ck_assert_uint_eq(tc_wait_held_le(ctx, 0, 5000), 0);
	st = tc_ctx_stats(ctx);
	ck_assert_uint_eq(st.create_calls, st.release_calls);
	tc_assert_os_matches(ctx);
	cuvmm_region_destroy(r);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/* A region with a coarser unit of mapping: every map is whole handles of that unit, and fewer of them. */
START_TEST(test_create_ex_coarse)
{
	struct cuvmm_ctx *ctx = ctx_with_delay(-1);
	struct cuvmm_region *r = NULL, *bad = NULL;
	struct cuvmm_stats st;
	size_t u = 4 * G;

	ck_assert_int_eq(cuvmm_region_create_ex(ctx, 0, 64 * G, 3 * G, &bad), CUVMM_EINVAL); /* not a power of 2 */
	ck_assert_int_eq(cuvmm_region_create_ex(ctx, 0, 64 * G, G / 2, &bad), CUVMM_EINVAL); /* below the device's */
	ck_assert_int_eq(cuvmm_region_create_ex(ctx, 0, 64 * G, G << 10, &bad), CUVMM_EINVAL); /* > 512x */
	ck_assert_ptr_null(bad);
	ck_assert_int_eq(cuvmm_region_create_ex(ctx, 0, 10 * G, u, &r), CUVMM_OK);
	ck_assert_uint_eq(cuvmm_region_granularity(r), u);
	ck_assert_uint_eq(cuvmm_region_size(r), 12 * G); /* rounded up to the unit */
	ck_assert_int_eq(cuvmm_region_map(r, G, u), CUVMM_EINVAL); /* offsets in units */
	ck_assert_int_eq(cuvmm_region_map(r, 0, G), CUVMM_EINVAL);
	ck_assert_int_eq(cuvmm_region_resize(r, 5 * G, NULL), CUVMM_OK); /* two units */
	st = tc_region_stats(r);
	ck_assert_uint_eq(st.mapped_bytes, 2 * u);
	ck_assert_uint_eq(st.live_bytes, 2 * u);
	ck_assert_uint_eq(st.create_calls, 2);
	ck_assert_uint_eq(st.map_calls, 2);
	if (tc_on_host()) {
		memset(cuvmm_region_base(r), 0x5a, 2 * u);
		ck_assert_int_eq(tc_memfd_bytes(), (int64_t)(2 * u));
	}
	ck_assert_int_eq(cuvmm_region_resize(r, u, NULL), CUVMM_OK);
	st = tc_region_stats(r);
	ck_assert_uint_eq(st.mapped_bytes, u);
	ck_assert_uint_eq(st.unmap_calls, 1);
	if (tc_on_host())
		ck_assert_uint_eq(((unsigned char *)cuvmm_region_base(r))[u - 1], 0x5a);
	/* sleep and wake keep the unit */
	ck_assert_int_eq(cuvmm_region_sleep(r, CUVMM_SLEEP_OFFLOAD, NULL), CUVMM_OK);
	ck_assert_int_eq(cuvmm_region_wake(r, NULL), CUVMM_OK);
	st = tc_region_stats(r);
	ck_assert_uint_eq(st.mapped_bytes, u);
	if (tc_on_host())
		ck_assert_uint_eq(((unsigned char *)cuvmm_region_base(r))[0], 0x5a);
	cuvmm_region_destroy(r);
	ck_assert_uint_eq(tc_ctx_stats(ctx).live_bytes, 0);
	ck_assert_int_eq(cuvmm_ctx_trim(ctx, -1, 0), CUVMM_OK);
	ck_assert_uint_eq(tc_ctx_stats(ctx).held_bytes, 0);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

static Suite *region_suite(void)
{
	Suite *s = suite_create("region");
	TCase *tc;

	tc = tcase_create("api");
	tcase_add_checked_fixture(tc, NULL, teardown);
	tcase_set_timeout(tc, TC_TIMEOUT);
	tcase_add_test(tc, test_create_destroy);
	tcase_add_test(tc, test_create_einval);
	tcase_add_test(tc, test_range_einval);
	tcase_add_test(tc, test_map_idempotent_keeps_contents);
	tcase_add_test(tc, test_unmap_unmapped_ignored);
	tcase_add_test(tc, test_resize);
	tcase_add_test(tc, test_stats_steps);
	tcase_add_test(tc, test_two_regions);
	tcase_add_test(tc, test_create_ex_coarse);
	tcase_add_test(tc, test_os_accounting);
	suite_add_tcase(s, tc);

	tc = tcase_create("fence");
	tcase_add_checked_fixture(tc, NULL, teardown);
	tcase_set_timeout(tc, TC_TIMEOUT);
	tcase_add_test(tc, test_fenced_unmap_gate);
	tcase_add_test(tc, test_fenced_resize_gate);
	tcase_add_test(tc, test_destroy_waits_for_fence);
	tcase_add_test(tc, test_trim_races_fence_processing);
	tcase_add_test(tc, test_poll_not_blocked_by_trim);
	tcase_add_test(tc, test_gpu_shrink_under_kernel);
	tcase_add_test(tc, test_gpu_grow_keeps_data);
	tcase_add_test(tc, test_gpu_null_stream_unmap_under_kernel);
	suite_add_tcase(s, tc);

	tc = tcase_create("fault");
	tcase_add_checked_fixture(tc, NULL, teardown);
	tcase_set_timeout(tc, TC_TIMEOUT);
	tcase_add_test(tc, test_fault_reserve);
	tcase_add_loop_test(tc, test_fault_map_path, 0, MAP_FAULT_CASES);
	tcase_add_loop_test(tc, test_fault_fence, 0, FENCE_FAULT_CASES);
	tcase_add_test(tc, test_fault_unmap_retried);
	tcase_add_test(tc, test_pool_calls);
	tcase_add_test(tc, test_fault_event_query);
	tcase_add_test(tc, test_fault_release_trim_result);
	tcase_add_test(tc, test_fault_release_keeps_chunk);
	tcase_add_test(tc, test_fault_unreserve);
	suite_add_tcase(s, tc);

	tc = tcase_create("threads");
	tcase_add_checked_fixture(tc, NULL, teardown);
	tcase_set_timeout(tc, TC_TIMEOUT);
	tcase_add_test(tc, test_threads);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	return tc_run(region_suite());
}
