/*
 * KV blocks: configuration and argument checks, all-or-nothing allocation, block contents in every tensor
 * under churn (blocks that divide a page, straddle pages, or span several), page-aware allocation (holes
 * refilled, fullest page first), release (idle delay, trim, fenced on a stream), compaction plans, every
 * driver call of the alloc/free paths made to fail, mapping ahead of demand, several threads, and (CUDA)
 * blocks freed on a stream while a kernel still writes them.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "drv_test.h"
#include "gpu.h"
#include "kv.h"

#define G (2 * TC_MiB) /* the granularity on both backends (host default, H200) */
#define KSENTINEL ((struct cuvmm_kv *)(uintptr_t)0xdeadbeef)
#define IDSENTINEL 0xa5a5a5a5u
#define HOST_STREAM ((CUstream)(uintptr_t)0x1)

static void teardown(void)
{
	cvm_host_gate_open();
	tc_log_release();
}

/* ----- helpers ----- */

static uint64_t rnd(uint64_t *s)
{
	uint64_t x = *s;

	x ^= x << 13;
	x ^= x >> 7;
	x ^= x << 17;
	*s = x;
	return x;
}

static struct cuvmm_ctx *ctx_with(int64_t delay_ms, bool background)
{
	struct cuvmm_config cfg;

	tc_config(&cfg);
	cfg.release_delay_ms = delay_ms;
	cfg.background_release = background;
	return tc_ctx(&cfg);
}

static struct cuvmm_kv *kv_new(struct cuvmm_ctx *ctx, size_t block_bytes, uint32_t max_blocks, uint32_t tensors)
{
	struct cuvmm_kv_config cfg;
	struct cuvmm_kv *kv = NULL;
	int err;

	cuvmm_kv_config_init(&cfg);
	cfg.block_bytes = block_bytes;
	cfg.max_blocks = max_blocks;
	cfg.tensors = tensors;
	err = cuvmm_kv_create(ctx, &cfg, &kv);
	ck_assert_msg(err == CUVMM_OK, "cuvmm_kv_create(%zu x %u x %u): %s", block_bytes, max_blocks, tensors,
		      cuvmm_err_name(err));
	ck_assert_ptr_nonnull(kv);
	return kv;
}

static struct cuvmm_stats kv_st(struct cuvmm_kv *kv)
{
	struct cuvmm_stats st;
	int err;

	memset(&st, 0, sizeof(st));
	st.size = sizeof(st);
	err = cuvmm_kv_stats(kv, &st);
	ck_assert_msg(err == CUVMM_OK, "cuvmm_kv_stats: %s", cuvmm_err_name(err));
	return st;
}

static void *blk(struct cuvmm_kv *kv, uint32_t t, uint32_t b, size_t B)
{
	return (char *)cuvmm_kv_tensor(kv, t) + (size_t)b * B;
}

static uint32_t key(uint32_t t, uint32_t b, uint32_t gen)
{
	return (gen * 0x9e3779b9u) ^ (t * 0x85ebca6bu) ^ (b * 0xc2b2ae35u) ^ 0x5bd1e995u;
}

/* Write / check block b in every tensor with a pattern keyed by (tensor, kb, gen). */
static void fill_blk(struct cuvmm_kv *kv, uint32_t T, size_t B, uint32_t b, uint32_t kb, uint32_t gen)
{
	for (uint32_t t = 0; t < T; t++)
		ck_assert_int_eq(tc_fill(blk(kv, t, b, B), B / 4, key(t, kb, gen)), 0);
}

static uint64_t check_blk(struct cuvmm_kv *kv, uint32_t T, size_t B, uint32_t b, uint32_t kb, uint32_t gen)
{
	uint64_t bad = 0;

	for (uint32_t t = 0; t < T; t++)
		bad += tc_check(blk(kv, t, b, B), B / 4, key(t, kb, gen));
	return bad;
}

/* Copy block `from` to block `to` in every tensor (applying a compaction move). */
static void copy_blk(struct cuvmm_kv *kv, uint32_t T, size_t B, uint32_t from, uint32_t to)
{
	for (uint32_t t = 0; t < T; t++) {
		if (tc_on_host()) {
			memcpy(blk(kv, t, to, B), blk(kv, t, from, B), B);
		} else {
			void *tmp = malloc(B);

			ck_assert_ptr_nonnull(tmp);
			ck_assert_int_eq(tg_memcpy_dtoh(tmp, (CUdeviceptr)(uintptr_t)blk(kv, t, from, B), B), 0);
			ck_assert_int_eq(tg_memcpy_htod((CUdeviceptr)(uintptr_t)blk(kv, t, to, B), tmp, B), 0);
			free(tmp);
		}
	}
}

static size_t npages_of(size_t B, uint32_t max_blocks)
{
	return ((size_t)max_blocks * B + G - 1) / G;
}

/* Pages (granules of one tensor) touched by the blocks marked in live[]. */
static size_t touched_pages(size_t B, uint32_t max_blocks, const uint8_t *live)
{
	size_t np = npages_of(B, max_blocks), n = 0;
	uint8_t *seen = calloc(np, 1);

	ck_assert_ptr_nonnull(seen);
	for (uint32_t b = 0; b < max_blocks; b++) {
		if (!live[b])
			continue;
		for (size_t p = (size_t)b * B / G; p <= ((size_t)b * B + B - 1) / G; p++)
			seen[p] = 1;
	}
	for (size_t p = 0; p < np; p++)
		n += seen[p];
	free(seen);
	return n;
}

static uint32_t page_of(uint32_t b, size_t B)
{
	return (uint32_t)((size_t)b * B / G);
}

/* kv statistics: live exactly nlive blocks in every tensor; mapped exactly (or at least) pages in every tensor;
 * held == mapped (a kv object holds only what it maps). */
static void expect_kv(struct cuvmm_kv *kv, uint32_t T, size_t B, uint32_t nlive, size_t pages, bool exact)
{
	struct cuvmm_stats st = kv_st(kv);

	ck_assert_msg(st.live_bytes == (uint64_t)nlive * B * T, "kv live %llu, want %u blocks = %llu",
		      (unsigned long long)st.live_bytes, nlive, (unsigned long long)nlive * B * T);
	if (exact)
		ck_assert_msg(st.mapped_bytes == (uint64_t)pages * G * T, "kv mapped %llu (%llu pages), want %zu pages",
			      (unsigned long long)st.mapped_bytes, (unsigned long long)(st.mapped_bytes / G / T), pages);
	else
		ck_assert_msg(st.mapped_bytes >= (uint64_t)pages * G * T,
			      "kv mapped %llu (%llu pages), but live blocks touch %zu pages",
			      (unsigned long long)st.mapped_bytes, (unsigned long long)(st.mapped_bytes / G / T), pages);
	ck_assert_uint_eq(st.held_bytes, st.mapped_bytes);
	ck_assert_uint_ge(st.peak_live_bytes, st.live_bytes);
}

static void trim(struct cuvmm_ctx *ctx)
{
	int err = cuvmm_ctx_trim(ctx, -1, 0);

	ck_assert_msg(err == CUVMM_OK, "cuvmm_ctx_trim: %s", cuvmm_err_name(err));
}

/* ----- configuration, creation, accessors ----- */

START_TEST(test_config_init)
{
	struct cuvmm_kv_config cfg;

	cuvmm_kv_config_init(NULL);
	memset(&cfg, 0x5a, sizeof(cfg));
	cuvmm_kv_config_init(&cfg);
	ck_assert_uint_eq(cfg.size, sizeof(cfg));
	ck_assert_int_eq(cfg.device, 0);
	ck_assert_uint_eq(cfg.block_bytes, 0);
	ck_assert_uint_eq(cfg.max_blocks, 0);
	ck_assert_uint_eq(cfg.tensors, 1);
}
END_TEST

START_TEST(test_create_einval)
{
	struct cuvmm_ctx *ctx = tc_ctx(NULL);
	struct cuvmm_kv_config cfg, bad;
	struct cuvmm_kv *kv = KSENTINEL;
	int count, got;

	cuvmm_kv_config_init(&cfg);
	cfg.block_bytes = 64 * TC_KiB;
	cfg.max_blocks = 64;
	ck_assert_int_eq(cuvmm_kv_create(NULL, &cfg, &kv), CUVMM_EINVAL);
	ck_assert_int_eq(cuvmm_kv_create(ctx, NULL, &kv), CUVMM_EINVAL);
	ck_assert_int_eq(cuvmm_kv_create(ctx, &cfg, NULL), CUVMM_EINVAL);
	bad = cfg;
	bad.size = 0;
	ck_assert_int_eq(cuvmm_kv_create(ctx, &bad, &kv), CUVMM_EINVAL);
	bad.size = sizeof(bad) - 1;
	ck_assert_int_eq(cuvmm_kv_create(ctx, &bad, &kv), CUVMM_EINVAL);
	bad = cfg;
	bad.block_bytes = 0;
	ck_assert_int_eq(cuvmm_kv_create(ctx, &bad, &kv), CUVMM_EINVAL);
	bad = cfg;
	bad.max_blocks = 0;
	ck_assert_int_eq(cuvmm_kv_create(ctx, &bad, &kv), CUVMM_EINVAL);
	bad = cfg;
	bad.tensors = 0;
	ck_assert_int_eq(cuvmm_kv_create(ctx, &bad, &kv), CUVMM_EINVAL);
	/* block_bytes * max_blocks overflows */
	bad = cfg;
	bad.block_bytes = SIZE_MAX / 2 + 1;
	bad.max_blocks = 2;
	ck_assert_int_eq(cuvmm_kv_create(ctx, &bad, &kv), CUVMM_EINVAL);
	bad.block_bytes = SIZE_MAX / 3 + 1;
	bad.max_blocks = 3;
	ck_assert_int_eq(cuvmm_kv_create(ctx, &bad, &kv), CUVMM_EINVAL);
	bad.block_bytes = (size_t)1 << 40;
	bad.max_blocks = UINT32_MAX;
	ck_assert_int_eq(cuvmm_kv_create(ctx, &bad, &kv), CUVMM_EINVAL);
	/* rounding up to the granularity overflows */
	bad.block_bytes = SIZE_MAX;
	bad.max_blocks = 1;
	ck_assert_int_eq(cuvmm_kv_create(ctx, &bad, &kv), CUVMM_EINVAL);
	bad.block_bytes = SIZE_MAX - G + 2;
	ck_assert_int_eq(cuvmm_kv_create(ctx, &bad, &kv), CUVMM_EINVAL);
	/* devices out of range */
	ck_assert_int_eq(cuvmm_ctx_device_count(ctx, &count), CUVMM_OK);
	bad = cfg;
	bad.device = count;
	ck_assert_int_eq(cuvmm_kv_create(ctx, &bad, &kv), CUVMM_ENODEV);
	bad.device = -1;
	ck_assert_int_eq(cuvmm_kv_create(ctx, &bad, &kv), CUVMM_ENODEV);
	ck_assert_ptr_eq(kv, KSENTINEL);
	ck_assert_uint_eq(tc_ctx_stats(ctx).reserved_bytes, 0);

	/* The reservation of the third tensor fails: the first two are given back. */
	cfg.tensors = 3;
	ck_assert_int_eq(cuvmm_ctx_inject_fault(ctx, CUVMM_CALL_RESERVE, 2, 1, CUVMM_EDRIVER), CUVMM_OK);
	got = cuvmm_kv_create(ctx, &cfg, &kv);
	ck_assert_msg(got == CUVMM_EDRIVER, "reserve failing for tensor 2: %s", cuvmm_err_name(got));
	ck_assert_ptr_eq(kv, KSENTINEL);
	ck_assert_uint_eq(tc_ctx_stats(ctx).reserved_bytes, 0);
	ck_assert_uint_eq(cuvmm_ctx_call_count(ctx, CUVMM_CALL_UNRESERVE), 2);
	ck_assert_int_eq(cuvmm_ctx_inject_fault(ctx, CUVMM_CALL_RESERVE, 0, 1, CUVMM_ENOMEM), CUVMM_OK);
	ck_assert_int_eq(cuvmm_kv_create(ctx, &cfg, &kv), CUVMM_ENOSPC);
	ck_assert_ptr_eq(kv, KSENTINEL);

	/* And then it works. */
	ck_assert_int_eq(cuvmm_kv_create(ctx, &cfg, &kv), CUVMM_OK);
	ck_assert_ptr_ne(kv, KSENTINEL);
	ck_assert_uint_eq(tc_ctx_stats(ctx).reserved_bytes, 3 * 2 * G);
	cuvmm_kv_destroy(kv);
	ck_assert_uint_eq(tc_ctx_stats(ctx).reserved_bytes, 0);
	cuvmm_kv_destroy(NULL);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

START_TEST(test_tensor_addresses)
{
	const size_t B = 96 * TC_KiB;
	const uint32_t max = 50, T = 4; /* 4800 KiB: 3 granules per tensor */
	const size_t span = 3 * G;
	struct cuvmm_ctx *ctx = tc_ctx(NULL);
	struct cuvmm_kv *kv = kv_new(ctx, B, max, T);
	struct cuvmm_stats st;

	for (uint32_t t = 0; t < T; t++) {
		uintptr_t a = (uintptr_t)cuvmm_kv_tensor(kv, t);

		ck_assert_msg(a != 0, "tensor %u has no address", t);
		ck_assert_uint_eq(a % G, 0);
		for (uint32_t u = 0; u < t; u++) {
			uintptr_t b = (uintptr_t)cuvmm_kv_tensor(kv, u);

			ck_assert_msg(a + span <= b || b + span <= a, "tensors %u and %u overlap", u, t);
		}
	}
	ck_assert_ptr_null(cuvmm_kv_tensor(kv, T));
	ck_assert_ptr_null(cuvmm_kv_tensor(kv, UINT32_MAX));
	ck_assert_ptr_null(cuvmm_kv_tensor(NULL, 0));

	st = kv_st(kv);
	ck_assert_uint_eq(st.reserved_bytes, T * span);
	ck_assert_uint_eq(st.held_bytes, 0);
	ck_assert_uint_eq(st.mapped_bytes, 0);
	ck_assert_uint_eq(st.live_bytes, 0);
	ck_assert_uint_eq(st.map_calls, 0);
	ck_assert_uint_eq(st.create_calls, 0);
	st = tc_ctx_stats(ctx);
	ck_assert_uint_eq(st.reserved_bytes, T * span);
	ck_assert_uint_eq(st.held_bytes, 0);

	/* stats argument checks */
	memset(&st, 0, sizeof(st));
	st.size = sizeof(st);
	ck_assert_int_eq(cuvmm_kv_stats(NULL, &st), CUVMM_EINVAL);
	ck_assert_int_eq(cuvmm_kv_stats(kv, NULL), CUVMM_EINVAL);
	st.size = sizeof(st) - 8;
	ck_assert_int_eq(cuvmm_kv_stats(kv, &st), CUVMM_EINVAL);

	/* The last block ends inside the reserved range of every tensor and is usable. */
	{
		uint32_t ids[1];
		uint8_t live[50] = {0};

		for (uint32_t i = 0; i < max; i++) {
			ck_assert_int_eq(cuvmm_kv_alloc(kv, 1, ids), CUVMM_OK);
			live[ids[0]] = 1;
		}
		for (uint32_t b = 0; b < max; b++)
			ck_assert(live[b]);
		fill_blk(kv, T, B, max - 1, max - 1, 7);
		fill_blk(kv, T, B, 0, 0, 7);
		ck_assert_uint_eq(check_blk(kv, T, B, max - 1, max - 1, 7) + check_blk(kv, T, B, 0, 0, 7), 0);
		expect_kv(kv, T, B, max, 3, true);
	}
	cuvmm_kv_destroy(kv);
	ck_assert_uint_eq(tc_ctx_stats(ctx).reserved_bytes, 0);
	ck_assert_uint_eq(tc_ctx_stats(ctx).mapped_bytes, 0);
	ck_assert_uint_eq(tc_ctx_stats(ctx).live_bytes, 0);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/* ----- alloc and free: arguments, all or nothing ----- */

START_TEST(test_alloc_einval_enospc)
{
	const size_t B = 64 * TC_KiB;
	const uint32_t max = 100, T = 2;
	struct cuvmm_ctx *ctx = ctx_with(-1, true);
	struct cuvmm_kv *kv = kv_new(ctx, B, max, T);
	uint32_t ids[128], more[64];
	uint8_t seen[100] = {0};
	struct cuvmm_stats a, b;

	for (int i = 0; i < 128; i++)
		ids[i] = IDSENTINEL;
	ck_assert_int_eq(cuvmm_kv_alloc(NULL, 1, ids), CUVMM_EINVAL);
	ck_assert_int_eq(cuvmm_kv_alloc(kv, 1, NULL), CUVMM_EINVAL);
	ck_assert_int_eq(cuvmm_kv_alloc(kv, 0, ids), CUVMM_EINVAL);
	ck_assert_uint_eq(ids[0], IDSENTINEL);
	ck_assert_int_eq(cuvmm_kv_alloc(kv, max + 1, ids), CUVMM_ENOSPC);
	ck_assert_int_eq(cuvmm_kv_alloc(kv, UINT32_MAX, ids), CUVMM_ENOSPC);
	ck_assert_uint_eq(ids[0], IDSENTINEL);
	expect_kv(kv, T, B, 0, 0, true);

	ck_assert_int_eq(cuvmm_kv_alloc(kv, 60, ids), CUVMM_OK);
	a = kv_st(kv);
	for (int i = 0; i < 64; i++)
		more[i] = IDSENTINEL;
	ck_assert_int_eq(cuvmm_kv_alloc(kv, 41, more), CUVMM_ENOSPC);
	for (int i = 0; i < 64; i++)
		ck_assert_uint_eq(more[i], IDSENTINEL);
	b = kv_st(kv);
	ck_assert_uint_eq(a.live_bytes, b.live_bytes);
	ck_assert_uint_eq(a.mapped_bytes, b.mapped_bytes);
	ck_assert_uint_eq(a.held_bytes, b.held_bytes);
	ck_assert_uint_eq(a.map_calls, b.map_calls);
	ck_assert_uint_eq(a.create_calls, b.create_calls);
	ck_assert_int_eq(cuvmm_kv_alloc(kv, 40, ids + 60), CUVMM_OK);
	ck_assert_int_eq(cuvmm_kv_alloc(kv, 1, more), CUVMM_ENOSPC);
	ck_assert_uint_eq(more[0], IDSENTINEL);
	for (uint32_t i = 0; i < max; i++) {
		ck_assert_msg(ids[i] < max, "id %u out of range", ids[i]);
		ck_assert_msg(!seen[ids[i]], "id %u handed out twice", ids[i]);
		seen[ids[i]] = 1;
	}
	/* 100 blocks of 64 KiB: 6.25 MiB, 4 pages per tensor */
	expect_kv(kv, T, B, max, 4, true);
	tc_assert_os_matches(ctx);

	/* Everything back, everything again. */
	ck_assert_int_eq(cuvmm_kv_free(kv, max, ids, NULL), CUVMM_OK);
	expect_kv(kv, T, B, 0, 0, false);
	memset(seen, 0, sizeof(seen));
	ck_assert_int_eq(cuvmm_kv_alloc(kv, max, ids), CUVMM_OK);
	for (uint32_t i = 0; i < max; i++) {
		ck_assert(ids[i] < max && !seen[ids[i]]);
		seen[ids[i]] = 1;
	}
	expect_kv(kv, T, B, max, 4, true);
	ck_assert_uint_eq(kv_st(kv).map_calls, 4 * T); /* the pages stayed mapped (delay -1) */
	cuvmm_kv_destroy(kv);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

START_TEST(test_free_einval)
{
	const size_t B = 64 * TC_KiB;
	const uint32_t max = 64;
	struct cuvmm_ctx *ctx = ctx_with(-1, true);
	struct cuvmm_kv *kv = kv_new(ctx, B, max, 1);
	uint32_t a[10], other = UINT32_MAX, list[4];
	uint8_t mine[64] = {0};
	CUstream s;

	ck_assert_int_eq(tc_stream_create(&s), 0);
	ck_assert_int_eq(cuvmm_kv_alloc(kv, 10, a), CUVMM_OK);
	for (int i = 0; i < 10; i++)
		mine[a[i]] = 1;
	for (uint32_t b = 0; b < max && other == UINT32_MAX; b++)
		if (!mine[b])
			other = b;
	ck_assert_uint_ne(other, UINT32_MAX);

	ck_assert_int_eq(cuvmm_kv_free(NULL, 1, a, NULL), CUVMM_EINVAL);
	ck_assert_int_eq(cuvmm_kv_free(kv, 1, NULL, NULL), CUVMM_EINVAL);
	ck_assert_int_eq(cuvmm_kv_free(kv, 0, a, NULL), CUVMM_EINVAL);
	/* out of range, last in the list */
	list[0] = a[0];
	list[1] = a[1];
	list[2] = max;
	ck_assert_int_eq(cuvmm_kv_free(kv, 3, list, NULL), CUVMM_EINVAL);
	list[2] = UINT32_MAX;
	ck_assert_int_eq(cuvmm_kv_free(kv, 3, list, s), CUVMM_EINVAL);
	/* not allocated */
	list[2] = other;
	ck_assert_int_eq(cuvmm_kv_free(kv, 3, list, NULL), CUVMM_EINVAL);
	list[0] = other;
	ck_assert_int_eq(cuvmm_kv_free(kv, 1, list, NULL), CUVMM_EINVAL);
	/* the same id twice */
	list[0] = a[0];
	list[1] = a[1];
	list[2] = a[0];
	ck_assert_int_eq(cuvmm_kv_free(kv, 3, list, NULL), CUVMM_EINVAL);
	list[0] = a[2];
	list[1] = a[2];
	ck_assert_int_eq(cuvmm_kv_free(kv, 2, list, NULL), CUVMM_EINVAL);
	/* nothing was freed */
	expect_kv(kv, 1, B, 10, 1, true);
	ck_assert_int_eq(cuvmm_kv_alloc(kv, max - 10, (uint32_t[64]){0}), CUVMM_OK);
	ck_assert_int_eq(cuvmm_kv_alloc(kv, 1, list), CUVMM_ENOSPC);

	/* the ten are still allocated: freeing them works once, not twice */
	ck_assert_int_eq(cuvmm_kv_free(kv, 10, a, NULL), CUVMM_OK);
	expect_kv(kv, 1, B, max - 10, 2, true);
	ck_assert_int_eq(cuvmm_kv_free(kv, 1, a, NULL), CUVMM_EINVAL);
	ck_assert_int_eq(cuvmm_kv_free(kv, 10, a, s), CUVMM_EINVAL);
	expect_kv(kv, 1, B, max - 10, 2, true);
	tc_stream_destroy(s);
	cuvmm_kv_destroy(kv);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/* ----- contents under churn: random allocs and frees, every live block checked in every tensor ----- */

static const struct kv_shape {
	size_t B;
	uint32_t max, tensors;
	const char *what;
} shapes[] = {
	{64 * TC_KiB, 256, 3, "64 KiB blocks (32 per page)"},
	{48 * TC_KiB, 300, 2, "48 KiB blocks (straddling pages)"},
	{4 * TC_KiB, 2048, 1, "4 KiB blocks (512 per page)"},
	{2 * TC_MiB, 16, 2, "blocks of one page"},
	{1536 * TC_KiB, 20, 2, "1.5 MiB blocks (straddling)"},
	{3 * TC_MiB, 12, 2, "3 MiB blocks (larger than a page)"},
	{7 * TC_MiB, 6, 2, "7 MiB blocks (3.5 pages)"},
};
#define NSHAPES ((int)(sizeof(shapes) / sizeof(shapes[0])))

START_TEST(test_data_churn)
{
	const struct kv_shape *sh = &shapes[_i];
	const size_t B = sh->B;
	const uint32_t max = sh->max, T = sh->tensors;
	struct cuvmm_ctx *ctx = ctx_with(-1, true);
	struct cuvmm_kv *kv = kv_new(ctx, B, max, T);
	uint32_t *gen = calloc(max, sizeof(*gen)), *ids = calloc(max, sizeof(*ids)), *pool = calloc(max, 4);
	uint8_t *live = calloc(max, 1);
	uint64_t rng = 0x9e3779b97f4a7c15ull + (uint64_t)_i;
	uint32_t nlive = 0, next_gen = 1;
	CUstream s;

	ck_assert(gen && ids && live && pool);
	ck_assert_int_eq(tc_stream_create(&s), 0);
	for (int round = 0; round < 48; round++) {
		bool alloc = nlive == 0 || (nlive < max && rnd(&rng) % 3 != 0);

		if (alloc) {
			uint32_t room = max - nlive, cap = room < 24 ? room : 24;
			uint32_t k = 1 + (uint32_t)(rnd(&rng) % cap);
			int err = cuvmm_kv_alloc(kv, k, ids);

			ck_assert_msg(err == CUVMM_OK, "%s: alloc %u with %u free: %s", sh->what, k, room,
				      cuvmm_err_name(err));
			for (uint32_t i = 0; i < k; i++) {
				ck_assert_msg(ids[i] < max && !live[ids[i]], "%s: id %u handed out while in use", sh->what,
					      ids[i]);
				live[ids[i]] = 1;
				gen[ids[i]] = next_gen++;
				fill_blk(kv, T, B, ids[i], ids[i], gen[ids[i]]);
			}
			nlive += k;
		} else {
			uint32_t n = 0, k = 1 + (uint32_t)(rnd(&rng) % nlive);

			for (uint32_t b = 0; b < max; b++)
				if (live[b])
					pool[n++] = b;
			for (uint32_t i = 0; i < k; i++) { /* partial Fisher-Yates: k random live ids */
				uint32_t j = i + (uint32_t)(rnd(&rng) % (n - i)), x = pool[i];

				pool[i] = pool[j];
				pool[j] = x;
			}
			ck_assert_int_eq(cuvmm_kv_free(kv, k, pool, round % 2 ? s : NULL), CUVMM_OK);
			for (uint32_t i = 0; i < k; i++)
				live[pool[i]] = 0;
			nlive -= k;
		}
		expect_kv(kv, T, B, nlive, touched_pages(B, max, live), false);
		if (round % 8 == 7) {
			/* Every page no live block touches goes; every page one touches stays, contents and all. */
			trim(ctx);
			expect_kv(kv, T, B, nlive, touched_pages(B, max, live), true);
			for (uint32_t b = 0; b < max; b++)
				if (live[b])
					ck_assert_msg(check_blk(kv, T, B, b, b, gen[b]) == 0, "%s: block %u corrupted",
						      sh->what, b);
			tc_assert_os_matches(ctx);
		}
	}
	/* Everything back. */
	{
		uint32_t n = 0;

		for (uint32_t b = 0; b < max; b++)
			if (live[b]) {
				ck_assert_uint_eq(check_blk(kv, T, B, b, b, gen[b]), 0);
				pool[n++] = b;
			}
		if (n)
			ck_assert_int_eq(cuvmm_kv_free(kv, n, pool, NULL), CUVMM_OK);
	}
	trim(ctx);
	expect_kv(kv, T, B, 0, 0, true);
	ck_assert_uint_eq(tc_ctx_stats(ctx).held_bytes, 0);
	tc_assert_os_matches(ctx);
	tc_stream_destroy(s);
	cuvmm_kv_destroy(kv);
	cuvmm_ctx_destroy(ctx);
	free(gen);
	free(ids);
	free(live);
	free(pool);
}
END_TEST

/* Straddling blocks: a page is given back only when every block touching it is free, including the block
 * whose tail (or middle) lies in it. _i: 0 = 48 KiB, 1 = 3 MiB, 2 = 7 MiB blocks. */
START_TEST(test_straddle_pages_kept)
{
	static const size_t sizes[] = {48 * TC_KiB, 3 * TC_MiB, 7 * TC_MiB};
	const size_t B = sizes[_i];
	const uint32_t max = (uint32_t)(_i == 0 ? 200 : 8), T = 2;
	struct cuvmm_ctx *ctx = ctx_with(-1, true);
	struct cuvmm_kv *kv = kv_new(ctx, B, max, T);
	uint32_t *ids = calloc(max, 4), *rest = calloc(max, 4);
	uint8_t *live = calloc(max, 1);
	uint32_t keep[2], nrest = 0;
	CUstream s;

	ck_assert(ids && rest && live);
	ck_assert_int_eq(tc_stream_create(&s), 0);
	/* All at once, in one call. */
	ck_assert_int_eq(cuvmm_kv_alloc(kv, max, ids), CUVMM_OK);
	for (uint32_t b = 0; b < max; b++) {
		live[b] = 1;
		fill_blk(kv, T, B, b, b, 1);
	}
	expect_kv(kv, T, B, max, npages_of(B, max), true);
	for (uint32_t b = 0; b < max; b++)
		ck_assert_uint_eq(check_blk(kv, T, B, b, b, 1), 0);

	/* Keep two blocks that straddle a page boundary, free the rest. */
	if (_i == 0) {
		keep[0] = 42; /* [2016K, 2064K): pages 0 and 1 */
		keep[1] = 85; /* [4080K, 4128K): pages 1 and 2 */
	} else {
		keep[0] = 1; /* 3 MiB: [3M, 6M) pages 1-2; 7 MiB: [7M, 14M) pages 3-6 */
		keep[1] = 5; /* 3 MiB: [15M, 18M) pages 7-8; 7 MiB: [35M, 42M) pages 17-20 */
	}
	for (uint32_t b = 0; b < max; b++)
		if (b != keep[0] && b != keep[1])
			rest[nrest++] = b;
	ck_assert_int_eq(cuvmm_kv_free(kv, nrest, rest, NULL), CUVMM_OK);
	for (uint32_t i = 0; i < nrest; i++)
		live[rest[i]] = 0;
	trim(ctx);
	expect_kv(kv, T, B, 2, touched_pages(B, max, live), true);
	ck_assert_uint_eq(check_blk(kv, T, B, keep[0], keep[0], 1) + check_blk(kv, T, B, keep[1], keep[1], 1), 0);
	tc_assert_os_matches(ctx);

	/* The neighbours come back and share the kept pages. */
	ck_assert_int_eq(cuvmm_kv_alloc(kv, nrest, ids), CUVMM_OK);
	for (uint32_t i = 0; i < nrest; i++) {
		ck_assert(!live[ids[i]]);
		live[ids[i]] = 1;
		fill_blk(kv, T, B, ids[i], ids[i], 2);
	}
	expect_kv(kv, T, B, max, npages_of(B, max), true);
	ck_assert_uint_eq(check_blk(kv, T, B, keep[0], keep[0], 1) + check_blk(kv, T, B, keep[1], keep[1], 1), 0);
	for (uint32_t i = 0; i < nrest; i++)
		ck_assert_uint_eq(check_blk(kv, T, B, ids[i], ids[i], 2), 0);

	/* One kept block goes: only the pages no other block touches go with it. */
	ck_assert_int_eq(cuvmm_kv_free(kv, nrest, ids, NULL), CUVMM_OK);
	for (uint32_t i = 0; i < nrest; i++)
		live[ids[i]] = 0;
	ck_assert_int_eq(cuvmm_kv_free(kv, 1, &keep[0], s), CUVMM_OK);
	live[keep[0]] = 0;
	trim(ctx);
	expect_kv(kv, T, B, 1, touched_pages(B, max, live), true);
	ck_assert_uint_eq(check_blk(kv, T, B, keep[1], keep[1], 1), 0);
	ck_assert_int_eq(cuvmm_kv_free(kv, 1, &keep[1], NULL), CUVMM_OK);
	trim(ctx);
	expect_kv(kv, T, B, 0, 0, true);
	ck_assert_uint_eq(tc_ctx_stats(ctx).held_bytes, 0);
	tc_assert_os_matches(ctx);
	tc_stream_destroy(s);
	cuvmm_kv_destroy(kv);
	cuvmm_ctx_destroy(ctx);
	free(ids);
	free(rest);
	free(live);
}
END_TEST

/* ----- page-aware allocation ----- */

/* 64 blocks per page: 640 blocks fill 10 pages; a scattered half freed and allocated again maps nothing new:
 * the holes are refilled. */
START_TEST(test_holes_refilled)
{
	const size_t B = G / 64;
	const uint32_t max = 64 * 16, T = 2;
	struct cuvmm_ctx *ctx = ctx_with(-1, true);
	struct cuvmm_kv *kv = kv_new(ctx, B, max, T);
	uint32_t *ids = calloc(max, 4), *freed = calloc(max, 4), nfreed = 0;
	uint8_t *live = calloc(max, 1), *was_freed = calloc(max, 1);
	uint64_t rng = 42;
	struct cuvmm_stats st;
	CUstream s;

	ck_assert(ids && freed && live && was_freed);
	ck_assert_int_eq(tc_stream_create(&s), 0);
	ck_assert_int_eq(cuvmm_kv_alloc(kv, 640, ids), CUVMM_OK);
	for (uint32_t i = 0; i < 640; i++) {
		ck_assert(!live[ids[i]]);
		live[ids[i]] = 1;
	}
	ck_assert_uint_eq(touched_pages(B, max, live), 10); /* filled page by page */
	expect_kv(kv, T, B, 640, 10, true);
	st = kv_st(kv);
	ck_assert_uint_eq(st.map_calls, 10 * T);

	/* Free a scattered half: 32 random blocks of each page (no page empties). */
	for (uint32_t p = 0; p < 10; p++) {
		uint32_t pg[64], n = 0;

		for (uint32_t b = p * 64; b < (p + 1) * 64; b++)
			if (live[b])
				pg[n++] = b;
		ck_assert_uint_eq(n, 64);
		for (uint32_t i = 0; i < 32; i++) {
			uint32_t j = i + (uint32_t)(rnd(&rng) % (64 - i)), x = pg[i];

			pg[i] = pg[j];
			pg[j] = x;
			freed[nfreed++] = pg[i];
		}
	}
	/* in three calls, one on a stream */
	ck_assert_int_eq(cuvmm_kv_free(kv, 100, freed, NULL), CUVMM_OK);
	ck_assert_int_eq(cuvmm_kv_free(kv, 100, freed + 100, s), CUVMM_OK);
	ck_assert_int_eq(cuvmm_kv_free(kv, 120, freed + 200, NULL), CUVMM_OK);
	for (uint32_t i = 0; i < nfreed; i++) {
		live[freed[i]] = 0;
		was_freed[freed[i]] = 1;
	}
	expect_kv(kv, T, B, 320, 10, true);

	/* 320 again: exactly the holes, no map call. */
	ck_assert_int_eq(cuvmm_kv_alloc(kv, 320, ids), CUVMM_OK);
	for (uint32_t i = 0; i < 320; i++) {
		ck_assert_msg(was_freed[ids[i]] && !live[ids[i]], "block %u (page %u) is not one of the holes", ids[i],
			      page_of(ids[i], B));
		live[ids[i]] = 1;
	}
	expect_kv(kv, T, B, 640, 10, true);
	ck_assert_uint_eq(kv_st(kv).map_calls, st.map_calls);
	ck_assert_uint_eq(kv_st(kv).create_calls, st.create_calls);

	/* Full: the next block takes a new page. */
	ck_assert_int_eq(cuvmm_kv_alloc(kv, 1, ids), CUVMM_OK);
	ck_assert_uint_ge(page_of(ids[0], B), 10);
	ck_assert_uint_eq(kv_st(kv).map_calls, st.map_calls + T);
	tc_stream_destroy(s);
	cuvmm_kv_destroy(kv);
	cuvmm_ctx_destroy(ctx);
	free(ids);
	free(freed);
	free(live);
	free(was_freed);
}
END_TEST

/* Allocation fills the fullest page first: pages at 60/64, 30/64 and 4/64. */
START_TEST(test_fullest_first)
{
	const size_t B = G / 64;
	const uint32_t max = 64 * 8, T = 1;
	struct cuvmm_ctx *ctx = ctx_with(-1, true);
	struct cuvmm_kv *kv = kv_new(ctx, B, max, T);
	uint32_t ids[256], list[64], n, per[8];
	uint64_t maps;

	ck_assert_int_eq(cuvmm_kv_alloc(kv, 192, ids), CUVMM_OK);
	expect_kv(kv, T, B, 192, 3, true);
	maps = kv_st(kv).map_calls;
	/* page 0 keeps 60, page 1 keeps 4, page 2 keeps 30; blocks freed from the middle of each */
	n = 0;
	for (uint32_t b = 10; b < 14; b++)
		list[n++] = b;
	ck_assert_int_eq(cuvmm_kv_free(kv, n, list, NULL), CUVMM_OK);
	n = 0;
	for (uint32_t b = 64 + 2; b < 64 + 62; b++)
		list[n++] = b;
	ck_assert_int_eq(cuvmm_kv_free(kv, n, list, NULL), CUVMM_OK);
	n = 0;
	for (uint32_t b = 128 + 20; b < 128 + 54; b++)
		list[n++] = b;
	ck_assert_int_eq(cuvmm_kv_free(kv, n, list, NULL), CUVMM_OK);
	expect_kv(kv, T, B, 94, 3, true);

	/* 10 blocks: the 4 holes of page 0, then 6 of page 2 (30/64), none of page 1 (4/64). */
	ck_assert_int_eq(cuvmm_kv_alloc(kv, 10, ids), CUVMM_OK);
	memset(per, 0, sizeof(per));
	for (int i = 0; i < 10; i++)
		per[page_of(ids[i], B)]++;
	ck_assert_msg(per[0] == 4 && per[2] == 6 && per[1] == 0, "10 blocks went to pages 0/1/2: %u/%u/%u, want 4/0/6",
		      per[0], per[1], per[2]);
	/* 28: the rest of page 2. */
	ck_assert_int_eq(cuvmm_kv_alloc(kv, 28, ids), CUVMM_OK);
	for (int i = 0; i < 28; i++)
		ck_assert_msg(page_of(ids[i], B) == 2, "block %u is on page %u, want 2", ids[i], page_of(ids[i], B));
	/* 60: page 1. */
	ck_assert_int_eq(cuvmm_kv_alloc(kv, 60, ids), CUVMM_OK);
	for (int i = 0; i < 60; i++)
		ck_assert_msg(page_of(ids[i], B) == 1, "block %u is on page %u, want 1", ids[i], page_of(ids[i], B));
	ck_assert_uint_eq(kv_st(kv).map_calls, maps); /* no page mapped so far */
	expect_kv(kv, T, B, 192, 3, true);
	/* now a new page */
	ck_assert_int_eq(cuvmm_kv_alloc(kv, 1, ids), CUVMM_OK);
	ck_assert_uint_eq(page_of(ids[0], B), 3);
	ck_assert_uint_eq(kv_st(kv).map_calls, maps + T);

	/* An empty page that stayed mapped is used before a new one is mapped, but after fuller pages. */
	n = 0;
	for (uint32_t b = 0; b < 64; b++)
		list[n++] = b; /* page 0 empties (stays mapped: delay -1) */
	ck_assert_int_eq(cuvmm_kv_free(kv, n, list, NULL), CUVMM_OK);
	ck_assert_int_eq(cuvmm_kv_alloc(kv, 63, ids), CUVMM_OK); /* page 3 has 63 free: fuller than empty page 0 */
	for (int i = 0; i < 63; i++)
		ck_assert_msg(page_of(ids[i], B) == 3, "block %u is on page %u, want 3", ids[i], page_of(ids[i], B));
	ck_assert_int_eq(cuvmm_kv_alloc(kv, 64, ids), CUVMM_OK);
	for (int i = 0; i < 64; i++)
		ck_assert_msg(page_of(ids[i], B) == 0, "block %u is on page %u, want 0", ids[i], page_of(ids[i], B));
	ck_assert_uint_eq(kv_st(kv).map_calls, maps + T);
	cuvmm_kv_destroy(kv);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/* ----- release ----- */

/* With a 50 ms delay, the background thread gives every page back after the blocks are freed. */
START_TEST(test_release_after_delay)
{
	const size_t B = G / 8;
	const uint32_t max = 64, T = 2;
	struct cuvmm_ctx *ctx = ctx_with(50, true);
	struct cuvmm_kv *kv = kv_new(ctx, B, max, T);
	uint32_t ids[64];
	uint64_t held;
	CUstream s;

	ck_assert_int_eq(tc_stream_create(&s), 0);
	ck_assert_int_eq(cuvmm_kv_alloc(kv, max, ids), CUVMM_OK);
	for (uint32_t i = 0; i < max; i++)
		fill_blk(kv, T, B, ids[i], ids[i], 3);
	expect_kv(kv, T, B, max, 8, true);
	ck_assert_uint_eq(tc_ctx_stats(ctx).held_bytes, 8 * G * T);
	ck_assert_int_eq(cuvmm_kv_free(kv, 32, ids, NULL), CUVMM_OK);
	ck_assert_int_eq(cuvmm_kv_free(kv, 32, ids + 32, s), CUVMM_OK);
	held = tc_wait_held_le(ctx, 0, 5000);
	ck_assert_msg(held == 0, "held %llu bytes 5 s after freeing every block", (unsigned long long)held);
	expect_kv(kv, T, B, 0, 0, true);
	ck_assert_uint_eq(tc_ctx_stats(ctx).mapped_bytes, 0);
	tc_assert_os_matches(ctx);
	if (tc_on_host())
		ck_assert_int_eq(tc_memfd_bytes(), 0);
	/* and the pages come back on demand */
	ck_assert_int_eq(cuvmm_kv_alloc(kv, 9, ids), CUVMM_OK);
	for (uint32_t i = 0; i < 9; i++)
		fill_blk(kv, T, B, ids[i], ids[i], 4);
	for (uint32_t i = 0; i < 9; i++)
		ck_assert_uint_eq(check_blk(kv, T, B, ids[i], ids[i], 4), 0);
	ck_assert_uint_ge(kv_st(kv).mapped_bytes, 2 * G * T);
	tc_stream_destroy(s);
	cuvmm_kv_destroy(kv);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/* With delay -1 nothing goes by itself; cuvmm_ctx_trim gives it back. */
START_TEST(test_release_never_then_trim)
{
	const size_t B = G / 8;
	const uint32_t max = 64, T = 2;
	struct cuvmm_ctx *ctx = ctx_with(-1, true);
	struct cuvmm_kv *kv = kv_new(ctx, B, max, T);
	uint32_t ids[64];
	struct cuvmm_stats st;

	ck_assert_int_eq(cuvmm_kv_alloc(kv, max, ids), CUVMM_OK);
	ck_assert_int_eq(cuvmm_kv_free(kv, max, ids, NULL), CUVMM_OK);
	tc_sleep_ms(150);
	expect_kv(kv, T, B, 0, 8, true);
	st = tc_ctx_stats(ctx);
	ck_assert_uint_eq(st.held_bytes, 8 * G * T);
	ck_assert_uint_eq(st.live_bytes, 0);
	ck_assert_uint_eq(kv_st(kv).unmap_calls, 0);
	tc_assert_os_matches(ctx);

	/* trim keeping 4 granules of free memory: every free page goes, 4 granules stay cached */
	ck_assert_int_eq(cuvmm_ctx_trim(ctx, -1, 4 * G), CUVMM_OK);
	expect_kv(kv, T, B, 0, 0, true);
	ck_assert_uint_eq(tc_ctx_stats(ctx).held_bytes, 4 * G);
	tc_assert_os_matches(ctx);
	ck_assert_int_eq(cuvmm_ctx_trim(ctx, 0, 0), CUVMM_OK);
	ck_assert_uint_eq(tc_ctx_stats(ctx).held_bytes, 0);
	tc_assert_os_matches(ctx);
	if (tc_on_host())
		ck_assert_int_eq(tc_memfd_bytes(), 0);
	cuvmm_kv_destroy(kv);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/* Blocks freed on a stream: their pages stay mapped while the stream's work runs (the host gate closed), even
 * through trim, and go once it completes. _i: 0 = no background thread (delay -1, trim), 1 = the background
 * thread with a 20 ms delay. */
START_TEST(test_release_fenced_gate)
{
	const size_t B = G / 8;
	const uint32_t max = 64, T = 2;
	const bool bg = _i == 1;
	struct cuvmm_ctx *ctx;
	struct cuvmm_kv *kv;
	uint32_t ids[64], again[8];
	struct cuvmm_stats st;
	uint64_t end, unmaps;

	if (!tc_on_host()) {
		printf("test_release_fenced_gate: host backend only (the CUDA equivalent is test_gpu_free_under_kernel)\n");
		return;
	}
	ctx = ctx_with(bg ? 20 : -1, true);
	kv = kv_new(ctx, B, max, T);
	ck_assert_int_eq(cuvmm_kv_alloc(kv, 32, ids), CUVMM_OK); /* pages 0..3 */
	for (uint32_t i = 0; i < 32; i++)
		fill_blk(kv, T, B, ids[i], ids[i], 5);
	if (bg) {
		/* Pages the background pass mapped ahead go again once idle for the delay. */
		end = tc_now_ms() + 5000;
		while (kv_st(kv).mapped_bytes != (uint64_t)4 * G * T && tc_now_ms() < end)
			tc_sleep_ms(5);
	}
	expect_kv(kv, T, B, 32, 4, true);
	unmaps = kv_st(kv).unmap_calls;

	cvm_host_gate_close();
	ck_assert_int_eq(cuvmm_kv_free(kv, 16, ids, HOST_STREAM), CUVMM_OK);
	/* No device synchronisation is needed for these pages, so trim returns with the gate closed. */
	if (!bg)
		trim(ctx);
	else
		tc_sleep_ms(200);
	expect_kv(kv, T, B, 16, 4, true);
	ck_assert_uint_eq(kv_st(kv).unmap_calls, unmaps);
	/* the "kernel" may still write them */
	for (uint32_t i = 0; i < 16; i++)
		fill_blk(kv, T, B, ids[i], ids[i], 6);
	ck_assert_int_eq(cuvmm_kv_free(kv, 16, ids + 16, HOST_STREAM), CUVMM_OK);
	if (!bg)
		trim(ctx);
	else
		tc_sleep_ms(100);
	expect_kv(kv, T, B, 0, 4, true);
	for (uint32_t i = 0; i < 32; i++)
		fill_blk(kv, T, B, ids[i], ids[i], 6);

	/* Ids freed on a stream may come back at once; a fenced empty page is refilled, no page is mapped. */
	st = kv_st(kv);
	ck_assert_int_eq(cuvmm_kv_alloc(kv, 8, again), CUVMM_OK);
	ck_assert_uint_eq(kv_st(kv).map_calls, st.map_calls);
	for (int i = 0; i < 8; i++)
		fill_blk(kv, T, B, again[i], again[i], 7);
	ck_assert_int_eq(cuvmm_kv_free(kv, 8, again, HOST_STREAM), CUVMM_OK);
	if (!bg)
		trim(ctx);
	expect_kv(kv, T, B, 0, 4, true);

	cvm_host_gate_open();
	if (!bg) {
		trim(ctx);
	} else {
		end = tc_now_ms() + 5000;
		while (kv_st(kv).mapped_bytes && tc_now_ms() < end)
			tc_sleep_ms(5);
	}
	expect_kv(kv, T, B, 0, 0, true);
	ck_assert_uint_eq(kv_st(kv).unmap_calls, unmaps + 4 * T);
	if (bg)
		tc_wait_held_le(ctx, 0, 5000);
	else
		trim(ctx);
	ck_assert_uint_eq(tc_ctx_stats(ctx).held_bytes, 0);
	tc_assert_os_matches(ctx);
	cuvmm_kv_destroy(kv);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/* ----- compaction ----- */

struct plan_check {
	uint32_t n_moves, drained_pages;
};

/*
 * Check a plan against the state before it (live0[], occupancy occ0[] per page). B divides the granularity
 * here, so a block's page is its home page.
 */
static struct plan_check check_plan(size_t B, uint32_t max, const uint8_t *live0, const uint32_t *occ0,
				    const struct cuvmm_kv_move *mv, uint32_t n, uint32_t max_moves)
{
	const uint32_t per = (uint32_t)(G / B), np = max / per;
	uint8_t *from = calloc(max, 1), *to = calloc(max, 1), *src_page = calloc(np, 1), *dst_page = calloc(np, 1);
	struct plan_check pc = {n, 0};
	uint32_t max_src_occ = 0, min_other_occ = UINT32_MAX;

	ck_assert(from && to && src_page && dst_page);
	ck_assert_msg(n <= max_moves, "%u moves proposed with room for %u", n, max_moves);
	for (uint32_t i = 0; i < n; i++) {
		ck_assert_msg(mv[i].from < max && mv[i].to < max, "move %u: %u -> %u out of range", i, mv[i].from,
			      mv[i].to);
		ck_assert_msg(live0[mv[i].from], "move %u: from %u was not in use", i, mv[i].from);
		ck_assert_msg(!live0[mv[i].to], "move %u: to %u was already in use", i, mv[i].to);
		ck_assert_msg(!from[mv[i].from], "block %u moved twice", mv[i].from);
		ck_assert_msg(!to[mv[i].to], "block %u is the destination of two moves", mv[i].to);
		from[mv[i].from] = 1;
		to[mv[i].to] = 1;
		src_page[page_of(mv[i].from, B)] = 1;
		dst_page[page_of(mv[i].to, B)] = 1;
	}
	for (uint32_t i = 0; i < n; i++) {
		uint32_t ps = page_of(mv[i].from, B), pd = page_of(mv[i].to, B);

		ck_assert_msg(!from[mv[i].to], "block %u is the destination of one move and the source of another",
			      mv[i].to);
		ck_assert_msg(!src_page[pd], "move %u -> %u: into page %u, which is being drained", mv[i].from,
			      mv[i].to, pd);
		ck_assert_msg(occ0[pd] >= occ0[ps], "move %u -> %u: from page %u (%u used) to a sparser page %u (%u used)",
			      mv[i].from, mv[i].to, ps, occ0[ps], pd, occ0[pd]);
	}
	/* whole pages only, sparsest first */
	for (uint32_t p = 0; p < np; p++) {
		if (src_page[p]) {
			pc.drained_pages++;
			for (uint32_t b = p * per; b < (p + 1) * per; b++)
				ck_assert_msg(!live0[b] || from[b], "page %u is drained but its block %u stays", p, b);
			if (occ0[p] > max_src_occ)
				max_src_occ = occ0[p];
		} else if (occ0[p] && occ0[p] < min_other_occ) {
			min_other_occ = occ0[p];
		}
	}
	if (pc.drained_pages)
		ck_assert_msg(max_src_occ <= min_other_occ, "a page with %u blocks drained before one with %u",
			      max_src_occ, min_other_occ);
	free(from);
	free(to);
	free(src_page);
	free(dst_page);
	return pc;
}

static void occupancy(size_t B, uint32_t max, const uint8_t *live, uint32_t *occ)
{
	const uint32_t per = (uint32_t)(G / B);

	memset(occ, 0, sizeof(*occ) * (max / per));
	for (uint32_t b = 0; b < max; b++)
		occ[b / per] += live[b];
}

/* Keep `keep[p]` blocks of page p (the lowest `keep[p]` after an offset), free the rest in page order. */
static void shape_pages(struct cuvmm_kv *kv, size_t B, uint32_t max, uint8_t *live, const uint32_t *keep,
			const uint32_t *order, uint32_t np)
{
	const uint32_t per = (uint32_t)(G / B);
	uint32_t *list = calloc(per, 4);

	ck_assert_ptr_nonnull(list);
	for (uint32_t k = 0; k < np; k++) {
		uint32_t p = order ? order[k] : k, n = 0;

		for (uint32_t j = 0; j < per; j++) {
			uint32_t b = p * per + (j * 7 + p) % per; /* scattered within the page */

			if (j >= keep[p] && live[b]) {
				list[n++] = b;
				live[b] = 0;
			}
		}
		if (n)
			ck_assert_int_eq(cuvmm_kv_free(kv, n, list, NULL), CUVMM_OK);
	}
	(void)max;
	free(list);
}

START_TEST(test_compact_plan)
{
	const size_t B = G / 16;
	const uint32_t per = 16, np = 20, max = per * np, T = 2;
	/* 6 sparse pages (1..3 blocks, 12 in all), 4 roomy pages (10 each: 24 free), 10 full pages */
	static const uint32_t keep[20] = {2, 3, 1, 2, 3, 1, 10, 10, 10, 10, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16};
	struct cuvmm_ctx *ctx = ctx_with(-1, true);
	struct cuvmm_kv *kv = kv_new(ctx, B, max, T);
	uint32_t *ids = calloc(max, 4), occ0[20], n = UINT32_MAX, nlive0 = 0;
	uint32_t *src = calloc(max, 4), *whose = calloc(max, 4);
	uint8_t *live = calloc(max, 1), *live0 = calloc(max, 1);
	struct cuvmm_kv_move mv[64];
	struct cuvmm_stats before;
	struct plan_check pc;
	CUstream s;

	ck_assert(ids && live && live0 && src && whose);
	ck_assert_int_eq(tc_stream_create(&s), 0);
	ck_assert_int_eq(cuvmm_kv_alloc(kv, max, ids), CUVMM_OK);
	for (uint32_t b = 0; b < max; b++) {
		live[b] = 1;
		whose[b] = b;
		fill_blk(kv, T, B, b, b, 8);
	}
	shape_pages(kv, B, max, live, keep, NULL, np);
	trim(ctx);
	memcpy(live0, live, max);
	occupancy(B, max, live, occ0);
	for (uint32_t b = 0; b < max; b++)
		nlive0 += live[b];
	expect_kv(kv, T, B, nlive0, np, true);

	/* argument checks */
	ck_assert_int_eq(cuvmm_kv_compact(NULL, 64, mv, &n), CUVMM_EINVAL);
	ck_assert_int_eq(cuvmm_kv_compact(kv, 64, NULL, &n), CUVMM_EINVAL);
	ck_assert_int_eq(cuvmm_kv_compact(kv, 64, mv, NULL), CUVMM_EINVAL);
	ck_assert_uint_eq(n, UINT32_MAX);
	ck_assert_int_eq(cuvmm_kv_compact(kv, 0, NULL, &n), CUVMM_OK);
	ck_assert_uint_eq(n, 0);
	/* room for one move: the sparsest page has 1 block */
	ck_assert_int_eq(cuvmm_kv_compact(kv, 1, mv, &n), CUVMM_OK);
	pc = check_plan(B, max, live0, occ0, mv, n, 1);
	ck_assert_uint_eq(pc.n_moves, 1);
	ck_assert_uint_eq(pc.drained_pages, 1);
	/* drop that plan: free the destinations */
	ck_assert_int_eq(cuvmm_kv_free(kv, 1, &mv[0].to, NULL), CUVMM_OK);
	expect_kv(kv, T, B, nlive0, np, true);

	/* The full plan. */
	before = kv_st(kv);
	ck_assert_int_eq(cuvmm_kv_compact(kv, 64, mv, &n), CUVMM_OK);
	ck_assert_uint_eq(kv_st(kv).map_calls, before.map_calls); /* no page mapped for it */
	pc = check_plan(B, max, live0, occ0, mv, n, 64);
	ck_assert_msg(pc.n_moves == 12 && pc.drained_pages == 6, "%u moves draining %u pages, want 12 and 6", pc.n_moves,
		      pc.drained_pages);
	expect_kv(kv, T, B, nlive0 + n, np, true); /* destinations allocated */

	/* Apply it: copy, free the sources, trim. */
	for (uint32_t i = 0; i < n; i++) {
		copy_blk(kv, T, B, mv[i].from, mv[i].to);
		src[i] = mv[i].from;
		live[mv[i].to] = 1;
		whose[mv[i].to] = whose[mv[i].from];
	}
	ck_assert_int_eq(cuvmm_kv_free(kv, n, src, s), CUVMM_OK);
	for (uint32_t i = 0; i < n; i++)
		live[src[i]] = 0;
	trim(ctx);
	expect_kv(kv, T, B, nlive0, np - pc.drained_pages, true);
	ck_assert_uint_eq(kv_st(kv).held_bytes, before.held_bytes - (uint64_t)pc.drained_pages * G * T);
	for (uint32_t b = 0; b < max; b++)
		if (live[b])
			ck_assert_msg(check_blk(kv, T, B, b, whose[b], 8) == 0, "block %u (content of %u) corrupted", b,
				      whose[b]);
	tc_assert_os_matches(ctx);

	/* Nothing left to drain: two pages at 10/16 cannot take each other's blocks. */
	ck_assert_int_eq(cuvmm_kv_compact(kv, 64, mv, &n), CUVMM_OK);
	ck_assert_uint_eq(n, 0);
	tc_stream_destroy(s);
	cuvmm_kv_destroy(kv);
	cuvmm_ctx_destroy(ctx);
	free(ids);
	free(live);
	free(live0);
	free(src);
	free(whose);
}
END_TEST

/*
 * Pages of equal occupancy: page 0 has 1 block, pages 1..3 have 4 each, and page 1 is the one most recently
 * brought down to 4. The sparsest page must not be drained into a page that the same plan drains next (the
 * block would be moved twice, and a plan applied in one batch would lose it).
 */
START_TEST(test_compact_no_chain)
{
	const size_t B = G / 16;
	const uint32_t per = 16, np = 4, max = per * np, T = 1;
	static const uint32_t keep[4] = {1, 4, 4, 4};
	static const uint32_t order[4] = {0, 3, 2, 1}; /* page 1 last */
	struct cuvmm_ctx *ctx = ctx_with(-1, true);
	struct cuvmm_kv *kv = kv_new(ctx, B, max, T);
	uint32_t ids[64], occ0[4], n = 0;
	uint8_t live[64], live0[64];
	struct cuvmm_kv_move mv[64];

	ck_assert_int_eq(cuvmm_kv_alloc(kv, max, ids), CUVMM_OK);
	memset(live, 1, sizeof(live));
	shape_pages(kv, B, max, live, keep, order, np);
	memcpy(live0, live, max);
	occupancy(B, max, live, occ0);
	ck_assert_int_eq(cuvmm_kv_compact(kv, 64, mv, &n), CUVMM_OK);
	for (uint32_t i = 0; i < n; i++)
		printf("test_compact_no_chain: move %u: %u (page %u) -> %u (page %u)\n", i, mv[i].from,
		       page_of(mv[i].from, B), mv[i].to, page_of(mv[i].to, B));
	fflush(stdout);
	check_plan(B, max, live0, occ0, mv, n, 64);
	ck_assert_uint_ge(n, 1);
	cuvmm_kv_destroy(kv);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/*
 * Straddling blocks (48 KiB): page 0 keeps blocks 5 and 20; page 1 has two free home blocks, 84 (inside the page)
 * and 85 (straddling into page 2, which no live block touches, so it is unmapped). Draining page 0 would need
 * block 85, i.e. mapping page 2: cuvmm.h says compaction maps no page. _i: 0 = as is (no map call may happen),
 * 1 = with every MAP failing (a failed compact must leave nothing allocated).
 */
START_TEST(test_compact_straddle)
{
	const size_t B = 48 * TC_KiB;
	const uint32_t max = 130, T = 1;
	struct cuvmm_ctx *ctx = ctx_with(-1, true);
	struct cuvmm_kv *kv = kv_new(ctx, B, max, T);
	uint32_t ids[130], list[130], n = 0, nmoves = UINT32_MAX;
	struct cuvmm_kv_move mv[64];
	struct cuvmm_stats before, after;
	int got;

	ck_assert_int_eq(cuvmm_kv_alloc(kv, max, ids), CUVMM_OK);
	for (uint32_t b = 0; b <= 42; b++)
		if (b != 5 && b != 20)
			list[n++] = b;
	list[n++] = 84;
	list[n++] = 85;
	for (uint32_t b = 86; b < max; b++)
		list[n++] = b;
	ck_assert_int_eq(cuvmm_kv_free(kv, n, list, NULL), CUVMM_OK);
	trim(ctx);
	expect_kv(kv, T, B, max - n, 2, true); /* pages 0 and 1 */
	before = kv_st(kv);
	if (_i)
		ck_assert_int_eq(cuvmm_ctx_inject_fault(ctx, CUVMM_CALL_MAP, 0, UINT32_MAX, CUVMM_ENOMEM), CUVMM_OK);
	got = cuvmm_kv_compact(kv, 64, mv, &nmoves);
	after = kv_st(kv);
	if (got == CUVMM_OK) {
		printf("test_compact_straddle(%d): %u moves\n", _i, nmoves);
		for (uint32_t i = 0; i < nmoves; i++)
			printf("  %u -> %u\n", mv[i].from, mv[i].to);
		fflush(stdout);
	}
	if (_i) {
		ck_assert_int_eq(cuvmm_ctx_inject_fault(ctx, CUVMM_CALL_MAP, 0, 0, CUVMM_ENOMEM), CUVMM_OK);
		if (got != CUVMM_OK) {
			ck_assert_uint_eq(nmoves, UINT32_MAX);
			ck_assert_msg(after.live_bytes == before.live_bytes,
				      "compact failed (%s) but left %llu bytes of destination blocks allocated",
				      cuvmm_err_name(got), (unsigned long long)(after.live_bytes - before.live_bytes));
		}
	} else {
		ck_assert_int_eq(got, CUVMM_OK);
		ck_assert_msg(after.map_calls == before.map_calls, "compact mapped %llu chunks (%u moves)",
			      (unsigned long long)(after.map_calls - before.map_calls), nmoves);
	}
	cuvmm_kv_destroy(kv);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/* ----- fault injection ----- */

struct kvsnap {
	uint64_t k_held, k_mapped, k_live, d_mapped, d_live, d_held;
	int64_t memfd;
};

static struct kvsnap kvsnap_take(struct cuvmm_ctx *ctx, struct cuvmm_kv *kv)
{
	struct kvsnap s;
	struct cuvmm_stats st = kv_st(kv);

	s.k_held = st.held_bytes;
	s.k_mapped = st.mapped_bytes;
	s.k_live = st.live_bytes;
	st = tc_ctx_stats(ctx);
	s.d_mapped = st.mapped_bytes;
	s.d_live = st.live_bytes;
	s.d_held = st.held_bytes;
	s.memfd = tc_on_host() ? tc_memfd_bytes() : 0;
	return s;
}

#define KVSNAP_FIELD(a, b, f, what)                                                                          \
	ck_assert_msg((a)->f == (b)->f, "%s: " #f " was %llu before the failed call, %llu after", what,        \
		      (unsigned long long)(a)->f, (unsigned long long)(b)->f)

/*
 * CREATE, MAP or SET_ACCESS failing in the middle of a kv_alloc that takes 2 free blocks of a mapped page and
 * maps 3 new pages in 3 tensors (9 chunks): at the first, second, fifth and last chunk.
 * _i = call * 4 + skip index.
 */
static const enum cuvmm_call alloc_calls[] = {CUVMM_CALL_CREATE, CUVMM_CALL_MAP, CUVMM_CALL_SET_ACCESS};
static const uint64_t alloc_skips[] = {0, 1, 4, 8};
#define ALLOC_FAULT_CASES (3 * 4)

struct alloc_fault {
	struct cuvmm_ctx *ctx;
	struct cuvmm_kv *kv;
	uint32_t first[6];
	char what[96];
	int err;
};

static const size_t AF_B = G / 4;
static const uint32_t AF_MAX = 64, AF_T = 3;

static void alloc_fault_setup(struct alloc_fault *af, int i)
{
	const enum cuvmm_call call = alloc_calls[i / 4];
	const uint64_t skip = alloc_skips[i % 4];

	af->err = skip % 2 ? CUVMM_ENOMEM : CUVMM_EDRIVER;
	snprintf(af->what, sizeof(af->what), "%s failing after %llu calls in a kv_alloc", cuvmm_call_name(call),
		 (unsigned long long)skip);
	af->ctx = ctx_with(-1, true);
	af->kv = kv_new(af->ctx, AF_B, AF_MAX, AF_T);
	ck_assert_int_eq(cuvmm_kv_alloc(af->kv, 6, af->first), CUVMM_OK); /* pages 0 and half of 1 */
	for (int k = 0; k < 6; k++)
		fill_blk(af->kv, AF_T, AF_B, af->first[k], af->first[k], 9);
	trim(af->ctx); /* an empty cache: every chunk is created */
	ck_assert_int_eq(cuvmm_ctx_inject_fault(af->ctx, call, skip, 1, af->err), CUVMM_OK);
}

START_TEST(test_fault_alloc)
{
	struct alloc_fault af;
	struct kvsnap before, after;
	uint32_t ids[14];
	int got;

	alloc_fault_setup(&af, _i);
	before = kvsnap_take(af.ctx, af.kv);
	got = cuvmm_kv_alloc(af.kv, 14, ids);
	ck_assert_msg(got == af.err, "%s: returned %s, want %s", af.what, cuvmm_err_name(got), cuvmm_err_name(af.err));
	ck_assert_int_eq(cuvmm_last_driver_error(),
			 af.err == CUVMM_ENOMEM ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_ERROR_UNKNOWN);
	after = kvsnap_take(af.ctx, af.kv);
	KVSNAP_FIELD(&before, &after, k_held, af.what);
	KVSNAP_FIELD(&before, &after, k_mapped, af.what);
	KVSNAP_FIELD(&before, &after, k_live, af.what);
	KVSNAP_FIELD(&before, &after, d_mapped, af.what);
	KVSNAP_FIELD(&before, &after, d_live, af.what);
	/* The six blocks are intact. */
	for (int k = 0; k < 6; k++)
		ck_assert_uint_eq(check_blk(af.kv, AF_T, AF_B, af.first[k], af.first[k], 9), 0);
	/* Nothing was allocated: the same count fits, then exactly the rest. */
	ck_assert_int_eq(cuvmm_kv_alloc(af.kv, 14, ids), CUVMM_OK);
	for (int k = 0; k < 14; k++)
		fill_blk(af.kv, AF_T, AF_B, ids[k], ids[k], 10);
	expect_kv(af.kv, AF_T, AF_B, 20, 5, true);
	ck_assert_int_eq(cuvmm_kv_alloc(af.kv, AF_MAX - 20, (uint32_t[64]){0}), CUVMM_OK);
	ck_assert_int_eq(cuvmm_kv_alloc(af.kv, 1, ids), CUVMM_ENOSPC);
	for (int k = 0; k < 6; k++)
		ck_assert_uint_eq(check_blk(af.kv, AF_T, AF_B, af.first[k], af.first[k], 9), 0);
	cuvmm_kv_destroy(af.kv);
	tc_assert_os_matches(af.ctx);
	cuvmm_ctx_destroy(af.ctx);
}
END_TEST

/* The same failures, the fault in the middle (fifth chunk) of each call kind: the ids array is written only on
 * success (cuvmm.h: "written only on success"). _i: call. */
START_TEST(test_fault_alloc_ids_untouched)
{
	struct alloc_fault af;
	uint32_t ids[14];
	int got;

	alloc_fault_setup(&af, _i * 4 + 2);
	for (int k = 0; k < 14; k++)
		ids[k] = IDSENTINEL;
	got = cuvmm_kv_alloc(af.kv, 14, ids);
	ck_assert_int_eq(got, af.err);
	for (int k = 0; k < 14; k++)
		ck_assert_msg(ids[k] == IDSENTINEL, "%s: ids[%d] was written (%u) by the failed call", af.what, k,
			      ids[k]);
	cuvmm_kv_destroy(af.kv);
	cuvmm_ctx_destroy(af.ctx);
}
END_TEST

/* The same failures, the fault in the middle (fifth chunk) of each call kind: "nothing it created stays held"
 * (the device's held bytes, the OS's memfds). _i: call. */
START_TEST(test_fault_alloc_nothing_held)
{
	struct alloc_fault af;
	struct kvsnap before, after;
	uint32_t ids[14];

	alloc_fault_setup(&af, _i * 4 + 2);
	before = kvsnap_take(af.ctx, af.kv);
	ck_assert_int_eq(cuvmm_kv_alloc(af.kv, 14, ids), af.err);
	after = kvsnap_take(af.ctx, af.kv);
	KVSNAP_FIELD(&before, &after, d_held, af.what);
	KVSNAP_FIELD(&before, &after, memfd, af.what);
	cuvmm_kv_destroy(af.kv);
	cuvmm_ctx_destroy(af.ctx);
}
END_TEST

/* device_limit_bytes reached in the middle of an alloc: ENOMEM, nothing changes. */
START_TEST(test_alloc_device_limit)
{
	const size_t B = G / 4;
	const uint32_t T = 2;
	struct cuvmm_config cfg;
	struct cuvmm_ctx *ctx;
	struct cuvmm_kv *kv;
	uint32_t ids[64], more[16];
	struct kvsnap before, after;

	tc_config(&cfg);
	cfg.release_delay_ms = -1;
	cfg.device_limit_bytes = 4 * G; /* 2 pages of 2 tensors */
	ctx = tc_ctx(&cfg);
	kv = kv_new(ctx, B, 64, T);
	ck_assert_int_eq(cuvmm_kv_alloc(kv, 6, ids), CUVMM_OK);
	for (int k = 0; k < 6; k++)
		fill_blk(kv, T, B, ids[k], ids[k], 11);
	before = kvsnap_take(ctx, kv);
	ck_assert_int_eq(cuvmm_kv_alloc(kv, 3, more), CUVMM_ENOMEM); /* 2 fit, the third needs a page */
	after = kvsnap_take(ctx, kv);
	KVSNAP_FIELD(&before, &after, k_mapped, "device limit");
	KVSNAP_FIELD(&before, &after, k_live, "device limit");
	KVSNAP_FIELD(&before, &after, d_held, "device limit");
	KVSNAP_FIELD(&before, &after, memfd, "device limit");
	ck_assert_int_eq(cuvmm_kv_alloc(kv, 2, more), CUVMM_OK);
	ck_assert_int_eq(cuvmm_kv_alloc(kv, 1, more + 2), CUVMM_ENOMEM);
	expect_kv(kv, T, B, 8, 2, true);
	/* freeing a page's blocks makes room (the page is reused as it is) */
	ck_assert_int_eq(cuvmm_kv_free(kv, 2, more, NULL), CUVMM_OK);
	ck_assert_int_eq(cuvmm_kv_alloc(kv, 2, more), CUVMM_OK);
	for (int k = 0; k < 6; k++)
		ck_assert_uint_eq(check_blk(kv, T, B, ids[k], ids[k], 11), 0);
	cuvmm_kv_destroy(kv);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/* EVENT_CREATE or EVENT_RECORD failing in a kv_free on a stream: EDRIVER, nothing freed. A free without a stream
 * needs no event. _i: 0 = EVENT_CREATE, 1 = EVENT_RECORD. */
START_TEST(test_fault_free_fence)
{
	const enum cuvmm_call call = _i ? CUVMM_CALL_EVENT_RECORD : CUVMM_CALL_EVENT_CREATE;
	const size_t B = G / 4;
	const uint32_t T = 2;
	struct cuvmm_ctx *ctx = ctx_with(-1, true);
	struct cuvmm_kv *kv = kv_new(ctx, B, 64, T);
	uint32_t ids[8], x[1];
	struct kvsnap before, after;
	CUstream s;
	int got;

	ck_assert_int_eq(tc_stream_create(&s), 0);
	ck_assert_int_eq(cuvmm_kv_alloc(kv, 8, ids), CUVMM_OK);
	for (int k = 0; k < 8; k++)
		fill_blk(kv, T, B, ids[k], ids[k], 12);
	before = kvsnap_take(ctx, kv);
	ck_assert_int_eq(cuvmm_ctx_inject_fault(ctx, call, 0, UINT32_MAX, CUVMM_EDRIVER), CUVMM_OK);
	got = cuvmm_kv_free(kv, 8, ids, s);
	ck_assert_msg(got == CUVMM_EDRIVER, "%s failing in kv_free: %s", cuvmm_call_name(call), cuvmm_err_name(got));
	ck_assert_int_ge(cuvmm_ctx_call_count(ctx, call), 1);
	trim(ctx);
	after = kvsnap_take(ctx, kv);
	KVSNAP_FIELD(&before, &after, k_mapped, cuvmm_call_name(call));
	KVSNAP_FIELD(&before, &after, k_live, cuvmm_call_name(call));
	KVSNAP_FIELD(&before, &after, d_live, cuvmm_call_name(call));
	ck_assert_int_eq(cuvmm_kv_alloc(kv, 56, (uint32_t[64]){0}), CUVMM_OK); /* the 8 are still taken */
	ck_assert_int_eq(cuvmm_kv_alloc(kv, 1, x), CUVMM_ENOSPC);
	for (int k = 0; k < 8; k++)
		ck_assert_uint_eq(check_blk(kv, T, B, ids[k], ids[k], 12), 0);
	/* Without a stream no event is needed. */
	ck_assert_int_eq(cuvmm_kv_free(kv, 4, ids, NULL), CUVMM_OK);
	/* The fault cleared: the free on the stream works. */
	ck_assert_int_eq(cuvmm_ctx_inject_fault(ctx, call, 0, 0, CUVMM_EDRIVER), CUVMM_OK);
	ck_assert_int_eq(cuvmm_kv_free(kv, 4, ids + 4, s), CUVMM_OK);
	ck_assert_uint_eq(kv_st(kv).live_bytes, (uint64_t)56 * B * T);
	tc_stream_destroy(s);
	cuvmm_kv_destroy(kv);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/* ----- mapping ahead of demand ----- */

START_TEST(test_map_ahead)
{
	const size_t B = G / 8;
	const uint32_t max = 8 * 32, T = 2;
	struct cuvmm_ctx *ctx = ctx_with(1000, true);
	struct cuvmm_kv *kv = kv_new(ctx, B, max, T);
	uint32_t ids[16];
	uint64_t mapped = 0, end, backings;

	/* One full page: no room left in mapped pages, so the background pass maps ahead. */
	ck_assert_int_eq(cuvmm_kv_alloc(kv, 8, ids), CUVMM_OK);
	end = tc_now_ms() + 2000;
	for (;;) {
		uint32_t ready;

		/* Mapped bytes count while the map is under way; the page is the allocator's once it is empty
		 * and no map-ahead is in flight (a slow run, ASan's, otherwise races the allocation below). */
		pthread_mutex_lock(&kv->lock);
		ready = kv->mapping_ahead == 0 ? kv->empty_pages : 0;
		pthread_mutex_unlock(&kv->lock);
		mapped = kv_st(kv).mapped_bytes;
		if ((ready && mapped > (uint64_t)G * T) || tc_now_ms() >= end)
			break;
		tc_sleep_ms(2);
	}
	ck_assert_msg(mapped > (uint64_t)G * T, "no page mapped ahead within 2 s (%llu pages mapped, 1 needed)",
		      (unsigned long long)(mapped / G / T));
	ck_assert_uint_eq(kv_st(kv).live_bytes, (uint64_t)8 * B * T);

	/* The next page's worth of blocks lands on a page mapped ahead: the allocating thread maps nothing. */
	backings = kv->backings;
	ck_assert_int_eq(cuvmm_kv_alloc(kv, 8, ids + 8), CUVMM_OK);
	ck_assert_msg(kv->backings == backings, "the allocating thread backed %llu new pages",
		      (unsigned long long)(kv->backings - backings));
	for (int i = 0; i < 16; i++)
		fill_blk(kv, T, B, ids[i], ids[i], 13);
	for (int i = 0; i < 16; i++)
		ck_assert_uint_eq(check_blk(kv, T, B, ids[i], ids[i], 13), 0);

	/* Idle for the delay: the pages mapped ahead and never used go back. */
	end = tc_now_ms() + 5000;
	while (kv_st(kv).mapped_bytes > (uint64_t)2 * G * T && tc_now_ms() < end)
		tc_sleep_ms(10);
	expect_kv(kv, T, B, 16, 2, true);
	cuvmm_kv_destroy(kv);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/* ----- destroy ----- */

/* A kv destroyed with blocks allocated and pages fenced on a stream, and one left to the context: everything
 * goes (no leak under ASan), every count back to 0. */
START_TEST(test_destroy_with_blocks)
{
	const size_t B = G / 8;
	struct cuvmm_ctx *ctx = ctx_with(-1, true);
	struct cuvmm_kv *kv = kv_new(ctx, B, 64, 2), *kv2;
	uint32_t ids[64];
	struct cuvmm_stats st;
	CUstream s;

	ck_assert_int_eq(tc_stream_create(&s), 0);
	ck_assert_int_eq(cuvmm_kv_alloc(kv, 40, ids), CUVMM_OK);
	ck_assert_int_eq(cuvmm_kv_free(kv, 16, ids, s), CUVMM_OK);
	ck_assert_int_eq(cuvmm_kv_free(kv, 8, ids + 16, NULL), CUVMM_OK);
	ck_assert_int_eq(tc_stream_sync(s), 0);
	tc_log_capture(CUVMM_LOG_WARN);
	cuvmm_kv_destroy(kv);
	ck_assert_int_ge(tc_log_count(CUVMM_LOG_WARN, "still allocated"), 1);
	st = tc_ctx_stats(ctx);
	ck_assert_uint_eq(st.reserved_bytes, 0);
	ck_assert_uint_eq(st.mapped_bytes, 0);
	ck_assert_uint_eq(st.live_bytes, 0);
	tc_assert_os_matches(ctx);
	ck_assert_int_eq(cuvmm_ctx_trim(ctx, -1, 0), CUVMM_OK);
	ck_assert_uint_eq(tc_ctx_stats(ctx).held_bytes, 0);

	kv2 = kv_new(ctx, B, 64, 3);
	ck_assert_int_eq(cuvmm_kv_alloc(kv2, 20, ids), CUVMM_OK);
	ck_assert_int_eq(cuvmm_kv_free(kv2, 4, ids, s), CUVMM_OK);
	ck_assert_int_eq(tc_stream_sync(s), 0);
	tc_log_reset();
	cuvmm_ctx_destroy(ctx);
	ck_assert_int_ge(tc_log_count(CUVMM_LOG_WARN, "kv"), 1);
	tc_stream_destroy(s);
}
END_TEST

/* ----- threads ----- */

#define MT_THREADS 4

struct mt_arg {
	struct cuvmm_kv *kv;
	size_t B;
	uint32_t T, index;
	int errors;
	char msg[160];
};

static void *mt_main(void *p)
{
	struct mt_arg *a = p;
	uint32_t mine[64], gen[64], n = 0;
	uint64_t rng = 0xabcdef12345ull * (a->index + 1);

	for (int it = 0; it < 300 && !a->errors; it++) {
		if (n < 8 || (n < 56 && rnd(&rng) % 2)) {
			uint32_t k = 1 + (uint32_t)(rnd(&rng) % 8), got[8];
			int err = cuvmm_kv_alloc(a->kv, k, got);

			if (err == CUVMM_ENOSPC)
				continue;
			if (err) {
				a->errors++;
				snprintf(a->msg, sizeof(a->msg), "alloc: %s", cuvmm_err_name(err));
				break;
			}
			for (uint32_t i = 0; i < k; i++) {
				mine[n] = got[i];
				gen[n] = (a->index << 24) | (uint32_t)it;
				for (uint32_t t = 0; t < a->T; t++)
					if (tc_fill(blk(a->kv, t, got[i], a->B), a->B / 4, key(t, got[i], gen[n]))) {
						a->errors++;
						snprintf(a->msg, sizeof(a->msg), "fill failed");
					}
				n++;
			}
		} else {
			uint32_t k = 1 + (uint32_t)(rnd(&rng) % n), list[64];
			int err;

			for (uint32_t i = 0; i < k; i++) {
				uint32_t j = n - 1 - i;

				for (uint32_t t = 0; t < a->T; t++)
					if (tc_check(blk(a->kv, t, mine[j], a->B), a->B / 4, key(t, mine[j], gen[j]))) {
						a->errors++;
						snprintf(a->msg, sizeof(a->msg), "block %u of tensor %u corrupted", mine[j], t);
					}
				list[i] = mine[j];
			}
			err = cuvmm_kv_free(a->kv, k, list, NULL);
			if (err) {
				a->errors++;
				snprintf(a->msg, sizeof(a->msg), "free: %s", cuvmm_err_name(err));
				break;
			}
			n -= k;
		}
	}
	for (uint32_t j = 0; j < n; j++)
		for (uint32_t t = 0; t < a->T; t++)
			if (tc_check(blk(a->kv, t, mine[j], a->B), a->B / 4, key(t, mine[j], gen[j]))) {
				a->errors++;
				snprintf(a->msg, sizeof(a->msg), "block %u of tensor %u corrupted at the end", mine[j], t);
			}
	if (n && cuvmm_kv_free(a->kv, n, mine, NULL)) {
		a->errors++;
		snprintf(a->msg, sizeof(a->msg), "final free failed");
	}
	return NULL;
}

/* Threads allocating, writing, checking and freeing blocks of one kv; pages come and go under them
 * (_i: 0 = delay 0, released on the freeing thread at once; 1 = 5 ms delay and the background thread). */
START_TEST(test_threads)
{
	const size_t B = 32 * TC_KiB;
	const uint32_t T = 2, max = 64 * 4; /* 4 pages for up to 4 x 56 blocks: pages fill, drain and move */
	struct cuvmm_ctx *ctx = ctx_with(_i ? 5 : 0, true);
	struct cuvmm_kv *kv = kv_new(ctx, B, max, T);
	struct mt_arg args[MT_THREADS];
	pthread_t th[MT_THREADS];

	for (uint32_t i = 0; i < MT_THREADS; i++) {
		memset(&args[i], 0, sizeof(args[i]));
		args[i].kv = kv;
		args[i].B = B;
		args[i].T = T;
		args[i].index = i;
		ck_assert_int_eq(pthread_create(&th[i], NULL, mt_main, &args[i]), 0);
	}
	for (int i = 0; i < MT_THREADS; i++)
		pthread_join(th[i], NULL);
	for (int i = 0; i < MT_THREADS; i++)
		ck_assert_msg(args[i].errors == 0, "thread %d: %d errors; last: %s", i, args[i].errors, args[i].msg);
	trim(ctx);
	expect_kv(kv, T, B, 0, 0, true);
	ck_assert_uint_eq(tc_ctx_stats(ctx).held_bytes, 0);
	tc_assert_os_matches(ctx);
	cuvmm_kv_destroy(kv);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/* ----- CUDA: blocks freed on a stream while a kernel still writes them ----- */

static int calibrate_iters(void *p, size_t words, CUstream s, int target_ms)
{
	uint64_t t0 = 0, t1 = 0;
	int iters;

	for (int pass = 0; pass < 2; pass++) {
		t0 = tc_now_ms();
		ck_assert_int_eq(tc_fill_async(p, words, 1, 8, s), 0);
		ck_assert_int_eq(tc_stream_sync(s), 0);
		t1 = tc_now_ms();
	}
	iters = (int)(8 * (uint64_t)target_ms / (t1 - t0 ? t1 - t0 : 1));
	return iters < 8 ? 8 : iters > 1000000 ? 1000000 : iters;
}

/* _i: 0 = freed on the kernel's stream (trim must not unmap under it), 1 = freed without a stream (trim
 * synchronises the device first). */
START_TEST(test_gpu_free_under_kernel)
{
	const size_t B = 256 * TC_KiB;
	const uint32_t max = 256, T = 2; /* 64 MiB per tensor: 32 pages */
	struct cuvmm_ctx *ctx;
	struct cuvmm_kv *kv;
	uint32_t ids[256];
	CUstream s;
	int iters, q, sync;

	if (tc_on_host()) {
		printf("test_gpu_free_under_kernel: CUDA backend only (the host equivalent is test_release_fenced_gate)\n");
		return;
	}
	ctx = ctx_with(-1, true);
	kv = kv_new(ctx, B, max, T);
	ck_assert_int_eq(tc_stream_create(&s), 0);
	ck_assert_int_eq(cuvmm_kv_alloc(kv, max, ids), CUVMM_OK);
	for (uint32_t t = 0; t < T; t++) /* every id is taken: the whole tensor is blocks in use */
		ck_assert_int_eq(tc_fill(cuvmm_kv_tensor(kv, t), (size_t)max * B / 4, 20 + t), 0);
	for (uint32_t t = 0; t < T; t++)
		ck_assert_uint_eq(tc_check(cuvmm_kv_tensor(kv, t), (size_t)max * B / 4, 20 + t), 0);
	iters = calibrate_iters(cuvmm_kv_tensor(kv, 0), (size_t)max * B / 4, s, 150);

	for (uint32_t t = 0; t < T; t++)
		ck_assert_int_eq(tc_fill_async(cuvmm_kv_tensor(kv, t), (size_t)max * B / 4, 30 + t, iters, s), 0);
	ck_assert_int_eq(cuvmm_kv_free(kv, max, ids, _i ? NULL : s), CUVMM_OK);
	trim(ctx);
	q = tg_stream_query(s);
	printf("test_gpu_free_under_kernel(%s): %d passes, kernel %s after trim\n", _i ? "NULL" : "stream", iters,
	       q == CUDA_ERROR_NOT_READY ? "still running" : "done");
	if (_i)
		ck_assert_msg(q == CUDA_SUCCESS, "trim returned while the kernel ran (query %d)", q);
	if (q == CUDA_ERROR_NOT_READY)
		expect_kv(kv, T, B, 0, 32, true);
	sync = tc_stream_sync(s);
	ck_assert_msg(sync == 0, "the kernel failed (%d %s): pages were unmapped under it", sync, tg_error_name(sync));
	ck_assert_int_eq(tg_ctx_sync(), 0);
	trim(ctx);
	expect_kv(kv, T, B, 0, 0, true);
	ck_assert_uint_eq(tc_ctx_stats(ctx).held_bytes, 0);

	/* The pages come back usable. */
	ck_assert_int_eq(cuvmm_kv_alloc(kv, 16, ids), CUVMM_OK);
	for (int i = 0; i < 16; i++)
		fill_blk(kv, T, B, ids[i], ids[i], 14);
	for (int i = 0; i < 16; i++)
		ck_assert_uint_eq(check_blk(kv, T, B, ids[i], ids[i], 14), 0);
	tc_stream_destroy(s);
	cuvmm_kv_destroy(kv);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

static Suite *kv_suite(void)
{
	Suite *s = suite_create("kv");
	TCase *tc;

	tc = tcase_create("api");
	tcase_add_checked_fixture(tc, NULL, teardown);
	tcase_set_timeout(tc, TC_TIMEOUT);
	tcase_add_test(tc, test_config_init);
	tcase_add_test(tc, test_create_einval);
	tcase_add_test(tc, test_tensor_addresses);
	tcase_add_test(tc, test_alloc_einval_enospc);
	tcase_add_test(tc, test_free_einval);
	suite_add_tcase(s, tc);

	tc = tcase_create("data");
	tcase_add_checked_fixture(tc, NULL, teardown);
	tcase_set_timeout(tc, TC_TIMEOUT);
	tcase_add_loop_test(tc, test_data_churn, 0, NSHAPES);
	tcase_add_loop_test(tc, test_straddle_pages_kept, 0, 3);
	suite_add_tcase(s, tc);

	tc = tcase_create("pages");
	tcase_add_checked_fixture(tc, NULL, teardown);
	tcase_set_timeout(tc, TC_TIMEOUT);
	tcase_add_test(tc, test_holes_refilled);
	tcase_add_test(tc, test_fullest_first);
	tcase_add_test(tc, test_map_ahead);
	suite_add_tcase(s, tc);

	tc = tcase_create("release");
	tcase_add_checked_fixture(tc, NULL, teardown);
	tcase_set_timeout(tc, TC_TIMEOUT);
	tcase_add_test(tc, test_release_after_delay);
	tcase_add_test(tc, test_release_never_then_trim);
	tcase_add_loop_test(tc, test_release_fenced_gate, 0, 2);
	tcase_add_loop_test(tc, test_gpu_free_under_kernel, 0, 2);
	suite_add_tcase(s, tc);

	tc = tcase_create("compact");
	tcase_add_checked_fixture(tc, NULL, teardown);
	tcase_set_timeout(tc, TC_TIMEOUT);
	tcase_add_test(tc, test_compact_plan);
	tcase_add_test(tc, test_compact_no_chain);
	tcase_add_loop_test(tc, test_compact_straddle, 0, 2);
	suite_add_tcase(s, tc);

	tc = tcase_create("fault");
	tcase_add_checked_fixture(tc, NULL, teardown);
	tcase_set_timeout(tc, TC_TIMEOUT);
	tcase_add_loop_test(tc, test_fault_alloc, 0, ALLOC_FAULT_CASES);
	tcase_add_loop_test(tc, test_fault_alloc_ids_untouched, 0, 3);
	tcase_add_loop_test(tc, test_fault_alloc_nothing_held, 0, 3);
	tcase_add_test(tc, test_alloc_device_limit);
	tcase_add_loop_test(tc, test_fault_free_fence, 0, 2);
	suite_add_tcase(s, tc);

	tc = tcase_create("threads");
	tcase_add_checked_fixture(tc, NULL, teardown);
	tcase_set_timeout(tc, TC_TIMEOUT);
	tcase_add_test(tc, test_destroy_with_blocks);
	tcase_add_loop_test(tc, test_threads, 0, 2);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	return tc_run(kv_suite());
}
