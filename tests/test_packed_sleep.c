/*
 * Sleep and wake of a pool holding packed allocations (512 KiB to 32 granules, sharing granules), under
 * faults and under load, with the run layer's invariants checked after each step (host backend only: it
 * reads the pool's runs). Written in a review of the packed-allocation coarsening that was then taken back
 * (design.md, "Sleep and wake"): a wake must leave the packed memory as reusable as it was before the sleep,
 * a failed wake or sleep must leave the pool intact, and sleeps racing allocating threads must neither
 * corrupt memory nor break the runs.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "drv_test.h"
#include "ctx.h"
#include "pool_int.h"

static void teardown(void)
{
	cvm_host_gate_open();
}

static struct cuvmm_ctx *ctx_delay(int64_t delay_ms)
{
	struct cuvmm_config cfg;

	tc_config(&cfg);
	cfg.release_delay_ms = delay_ms;
	cfg.background_release = false;
	return tc_ctx(&cfg);
}

static struct cuvmm_pool *pool_new(struct cuvmm_ctx *ctx)
{
	struct cuvmm_pool_config pc;
	struct cuvmm_pool *p = NULL;

	cuvmm_pool_config_init(&pc);
	pc.max_bytes = 512 * TC_MiB;
	pc.name = "packed";
	ck_assert_int_eq(cuvmm_pool_create(ctx, &pc, &p), CUVMM_OK);
	return p;
}

/* The run layer's invariants: tags, chunk boundaries at every run boundary, PACK runs whose chunks are theirs,
 * the packer's own check. Returns a description of the first violation, or NULL. */
static const char *runs_bad(struct cuvmm_pool *p, char *buf, size_t n)
{
	const char *bad = NULL;
	int pk;

	pthread_mutex_lock(&p->r.lock);
	for (size_t g = 0; g < p->r.ngran && !bad;) {
		struct cvm_run *run = p->edge[g];

		if (!run || run->start != g || !run->len || p->edge[g + run->len - 1] != run) {
			snprintf(buf, n, "bad tags at granule %zu", g);
			bad = buf;
			break;
		}
		for (size_t i = g + 1; i + 1 < g + run->len; i++)
			if (p->edge[i]) {
				snprintf(buf, n, "interior tag at %zu in run [%zu,+%zu)", i, g, run->len);
				bad = buf;
			}
		if (!bad && g && p->r.slot[g - 1].chunk && cvm_region_chunk_end_locked(&p->r, g - 1) != g) {
			snprintf(buf, n, "run boundary at %zu inside a chunk", g);
			bad = buf;
		}
		g += run->len;
	}
	if (!bad) {
		size_t coarse = 0;

		for (size_t g = 0; g < p->r.ngran; g += p->edge[g]->len)
			coarse += p->edge[g]->kind == CVM_RUN_PACK && p->edge[g]->len > 1;
		size_t fp = 0;

		for (size_t g = 0; g < p->r.ngran; g += p->edge[g]->len)
			if (p->edge[g]->kind == CVM_RUN_USED || p->edge[g]->kind == CVM_RUN_SLAB ||
			    p->edge[g]->kind == CVM_RUN_PACK)
				fp += p->edge[g]->len;
		if (fp << p->r.gshift != p->fp) {
			snprintf(buf, n, "footprint %zu bytes, the runs hold %zu granules", p->fp, fp);
			bad = buf;
		}
		if (!bad && coarse != p->npack_coarse) {
			snprintf(buf, n, "%zu coarse PACK runs, the pool counts %zu", coarse, p->npack_coarse);
			bad = buf;
		}
	}
	if (!bad && (pk = cvm_pack_check(&p->pack)) != 0) {
		snprintf(buf, n, "cvm_pack_check: %d", pk);
		bad = buf;
	}
	pthread_mutex_unlock(&p->r.lock);
	return bad;
}

#define CHECK_RUNS(p)                                                                                         \
	do {                                                                                                  \
		char b_[128];                                                                                 \
		const char *w_ = runs_bad(p, b_, sizeof(b_));                                                 \
		ck_assert_msg(!w_, "%s", w_);                                                                 \
	} while (0)

/* n packed allocations of `each` bytes, allocation i filled with tag + i. */
static void load(struct cuvmm_pool *p, void **a, int n, size_t each, uint32_t tag)
{
	for (int i = 0; i < n; i++) {
		ck_assert_int_eq(cuvmm_malloc(p, each, &a[i]), CUVMM_OK);
		ck_assert_int_eq(tc_fill(a[i], each / 4, tag + (uint32_t)i), 0);
	}
}

/* One clean OFFLOAD sleep and wake: packed memory comes back on coarse chunks. */
static void sleep_wake(struct cuvmm_pool *p)
{
	ck_assert_int_eq(cuvmm_pool_sleep(p, CUVMM_SLEEP_OFFLOAD, NULL), CUVMM_OK);
	ck_assert_int_eq(cuvmm_pool_wake(p, NULL), CUVMM_OK);
	CHECK_RUNS(p);
}

/* Everything freed: trim, and the pool must hold nothing, its runs intact; then destroy it and its context. */
static void close_empty(struct cuvmm_ctx *ctx, struct cuvmm_pool *p)
{
	ck_assert_int_eq(cuvmm_pool_trim(p, 0), CUVMM_OK);
	CHECK_RUNS(p);
	ck_assert_uint_eq(tc_ctx_stats(ctx).held_bytes, 0);
	cuvmm_pool_destroy(p);
	cuvmm_ctx_destroy(ctx);
}

/*
 * A sleep and wake leave packed memory as reusable as before: one tensor in 32 kept, the rest freed and
 * loaded again, held stays at what is live (64 granules), with or without a sleep and wake first. (With the
 * PACK runs of a coarse chunk merged at wake, the granules that emptied were neither the packer's nor FREE:
 * 126 granules held.)
 */
static size_t strand_held(bool sleep_wake)
{
	struct cuvmm_ctx *ctx = ctx_delay(-1);
	struct cuvmm_pool *p = pool_new(ctx);
	enum { N = 64 };
	void *a[N], *b[N];
	size_t g = tc_granularity(ctx), held;

	for (int i = 0; i < N; i++)
		ck_assert_int_eq(cuvmm_malloc(p, g, &a[i]), CUVMM_OK); /* packed: one granule each */
	if (sleep_wake) {
		ck_assert_int_eq(cuvmm_pool_sleep(p, CUVMM_SLEEP_OFFLOAD, NULL), CUVMM_OK);
		ck_assert_int_eq(cuvmm_pool_wake(p, NULL), CUVMM_OK);
	}
	CHECK_RUNS(p);
	/* Keep one tensor in 32; free the rest, then load as many again. */
	for (int i = 0; i < N; i++)
		if (i % 32)
			ck_assert_int_eq(cuvmm_free(p, a[i]), CUVMM_OK);
	ck_assert_int_eq(cuvmm_pool_trim(p, 0), CUVMM_OK);
	CHECK_RUNS(p);
	for (int i = 0; i < N; i++)
		if (i % 32)
			ck_assert_int_eq(cuvmm_malloc(p, g, &b[i]), CUVMM_OK);
	ck_assert_int_eq(cuvmm_pool_trim(p, 0), CUVMM_OK);
	CHECK_RUNS(p);
	held = tc_ctx_stats(ctx).held_bytes / g;
	fprintf(stderr, "strand (%s): live %zu granules, held %zu granules after trim\n",
		sleep_wake ? "after sleep/wake" : "no sleep", (size_t)(tc_pool_stats(p).live_bytes / g), held);
	for (int i = 0; i < N; i++)
		ck_assert_int_eq(cuvmm_free(p, i % 32 ? b[i] : a[i]), CUVMM_OK);
	ck_assert_int_eq(cuvmm_pool_trim(p, 0), CUVMM_OK);
	ck_assert_uint_eq(tc_ctx_stats(ctx).held_bytes, 0);
	cuvmm_pool_destroy(p);
	cuvmm_ctx_destroy(ctx);
	return held;
}

START_TEST(test_packed_chunk_strands_granules)
{
	size_t plain = strand_held(false), woken = strand_held(true);

	ck_assert_uint_eq(plain, 64); /* live 64 granules, held 64 */
	ck_assert_msg(woken <= plain + 2, "after a sleep/wake the same program holds %zu granules (without: %zu)",
		      woken, plain);
}
END_TEST

/*
 * After a wake, packed memory lies on coarse chunks, which go back only whole; what is freed on them is
 * placed on again before any new memory. 48 allocations of a granule and a half, two of every three freed:
 * each hole is half a granule, two empty granules, half a granule. Filled again with allocations of two
 * granules and of half a granule, the pool maps nothing and holds what it held, every content intact.
 */
START_TEST(test_packed_reuse_coarse)
{
	struct cuvmm_ctx *ctx = ctx_delay(-1);
	struct cuvmm_pool *p = pool_new(ctx);
	enum { N = 48 };
	void *a[N], *b[N] = {0};
	size_t g = tc_granularity(ctx), each = g + g / 2, sz[N], held;
	uint64_t maps;

	load(p, a, N, each, 0x3000u);
	sleep_wake(p);
	ck_assert_uint_gt(p->npack_coarse, 0);
	held = tc_ctx_stats(ctx).held_bytes;
	ck_assert_uint_eq(held, (size_t)N * each);
	for (int i = 0; i < N; i++)
		if (i % 3) {
			ck_assert_int_eq(cuvmm_free(p, a[i]), CUVMM_OK);
			a[i] = NULL;
		}
	CHECK_RUNS(p);
	ck_assert_int_eq(cuvmm_pool_trim(p, 0), CUVMM_OK);
	ck_assert_uint_eq(tc_ctx_stats(ctx).held_bytes, held); /* coarse chunks go back only whole */
	maps = cuvmm_ctx_call_count(ctx, CUVMM_CALL_MAP);
	for (int j = 0; j < N; j++) {
		sz[j] = j % 3 ? g / 2 : 2 * g;
		ck_assert_int_eq(cuvmm_malloc(p, sz[j], &b[j]), CUVMM_OK);
		ck_assert_int_eq(tc_fill(b[j], sz[j] / 4, 0x7000u + (uint32_t)j), 0);
	}
	CHECK_RUNS(p);
	ck_assert_uint_eq(cuvmm_ctx_call_count(ctx, CUVMM_CALL_MAP), maps);
	ck_assert_uint_eq(tc_ctx_stats(ctx).held_bytes, held);
	for (int i = 0; i < N; i += 3)
		ck_assert_uint_eq(tc_check(a[i], each / 4, 0x3000u + (uint32_t)i), 0);
	for (int j = 0; j < N; j++)
		ck_assert_uint_eq(tc_check(b[j], sz[j] / 4, 0x7000u + (uint32_t)j), 0);
	/* Full now: three granules in a row exist only in new memory. */
	{
		void *c;

		ck_assert_int_eq(cuvmm_malloc(p, 3 * g, &c), CUVMM_OK);
		ck_assert_uint_gt(cuvmm_ctx_call_count(ctx, CUVMM_CALL_MAP), maps);
		ck_assert_int_eq(cuvmm_free(p, c), CUVMM_OK);
	}
	for (int i = 0; i < N; i++) {
		if (a[i])
			ck_assert_int_eq(cuvmm_free(p, a[i]), CUVMM_OK);
		ck_assert_int_eq(cuvmm_free(p, b[i]), CUVMM_OK);
	}
	CHECK_RUNS(p);
	ck_assert_uint_eq(p->npack_coarse, 0);
	close_empty(ctx, p);
}
END_TEST

/*
 * A coarse chunk whose unmap the driver refuses stays mapped, to be unmapped later, inside address space the
 * pool counts as unmapped. A map over part of it must not take part of it back: the rest would stay pending
 * under memory the pool hands out, and the next release there cut through the chunk (the fuzzer found a live
 * allocation unmapped that way). While the driver refuses, allocations go to the address space past the
 * stuck chunk (slabs too: review found every allocation of up to 32 granules failing with CUVMM_EDRIVER);
 * once it unmaps again, the chunk goes; runs and contents stay intact throughout.
 */
START_TEST(test_packed_refused_unmap_coarse)
{
	struct cuvmm_ctx *ctx = ctx_delay(0);
	struct cuvmm_pool *p = pool_new(ctx);
	size_t g = tc_granularity(ctx);
	void *a[2], *b[3] = {0};
	size_t sz[3] = {g, g, 4096}; /* two packed allocations and a slab */
	int err;

	load(p, a, 2, g, 0x4000u);
	sleep_wake(p);
	ck_assert_uint_eq(p->npack_coarse, 1); /* one chunk of two granules */
	ck_assert_int_eq(cuvmm_ctx_inject_fault(ctx, CUVMM_CALL_UNMAP, 0, UINT32_MAX, CUVMM_EDRIVER), CUVMM_OK);
	ck_assert_int_eq(cuvmm_free(p, a[1]), CUVMM_OK);
	ck_assert_int_eq(cuvmm_free(p, a[0]), CUVMM_OK); /* the chunk empties; its unmap is refused */
	ck_assert_int_eq(cuvmm_pool_trim(p, 0), CUVMM_OK);
	CHECK_RUNS(p);
	ck_assert_uint_gt(p->r.npending, 0); /* stuck */
	for (int i = 0; i < 3; i++) {
		err = cuvmm_malloc(p, sz[i], &b[i]);
		ck_assert_msg(err == CUVMM_OK, "malloc: %s", cuvmm_err_name(err));
		ck_assert_int_eq(tc_fill(b[i], sz[i] / 4, 0x4400u + (uint32_t)i), 0);
		CHECK_RUNS(p);
	}
	ck_assert_int_eq(cuvmm_free(p, b[1]), CUVMM_OK);
	b[1] = NULL;
	CHECK_RUNS(p);
	for (int i = 0; i < 3; i++)
		if (b[i])
			ck_assert_uint_eq(tc_check(b[i], sz[i] / 4, 0x4400u + (uint32_t)i), 0);
	/* The driver unmaps again: the stuck chunk goes, allocations there work. */
	cuvmm_ctx_inject_fault(ctx, CUVMM_CALL_UNMAP, 0, 0, CUVMM_EDRIVER);
	ck_assert_int_eq(cuvmm_pool_trim(p, 0), CUVMM_OK);
	for (int i = 0; i < 3; i++) {
		if (!b[i]) {
			ck_assert_int_eq(cuvmm_malloc(p, sz[i], &b[i]), CUVMM_OK);
			ck_assert_int_eq(tc_fill(b[i], sz[i] / 4, 0x4400u + (uint32_t)i), 0);
		}
	}
	CHECK_RUNS(p);
	for (int i = 0; i < 3; i++) {
		ck_assert_uint_eq(tc_check(b[i], sz[i] / 4, 0x4400u + (uint32_t)i), 0);
		ck_assert_int_eq(cuvmm_free(p, b[i]), CUVMM_OK);
	}
	close_empty(ctx, p);
}
END_TEST

/*
 * A slab on an emptied coarse chunk of two granules takes both (a FREE run of large chunks is not cut inside
 * one), and the footprint counts both: it counted one and the release took two, and the footprint wrapped
 * below zero, which made the slack cap unbounded (review).
 */
START_TEST(test_slab_on_coarse_chunk)
{
	struct cuvmm_ctx *ctx = ctx_delay(-1);
	struct cuvmm_pool *p = pool_new(ctx);
	size_t g = tc_granularity(ctx);
	void *a[2], *s;

	load(p, a, 2, g, 0x6000u);
	sleep_wake(p);
	ck_assert_uint_eq(p->npack_coarse, 1);
	for (int i = 0; i < 2; i++)
		ck_assert_int_eq(cuvmm_free(p, a[i]), CUVMM_OK);
	ck_assert_int_eq(cuvmm_malloc(p, 4096, &s), CUVMM_OK); /* a slab */
	CHECK_RUNS(p);
	ck_assert_int_eq(cuvmm_free(p, s), CUVMM_OK);
	CHECK_RUNS(p);
	ck_assert_uint_eq(p->fp, 0);
	close_empty(ctx, p);
}
END_TEST

/*
 * Bytes freed without a stream go back behind a device synchronisation (work queued before the free may
 * still use them), even when they share a chunk with an allocation freed last, on a stream, whose event has
 * completed: that chunk is unmapped only after the synchronisation. Two allocations of a granule on one
 * coarse chunk (after a sleep), or, as before any sleep, two that share a granule (review: both lost the
 * synchronisation).
 */
static uint64_t syncs_before_unmap(bool coarse)
{
	struct cuvmm_ctx *ctx = ctx_delay(0);
	struct cuvmm_pool *p = pool_new(ctx);
	size_t g = tc_granularity(ctx), each = coarse ? g : g / 2 + 4096;
	CUstream st;
	void *a, *b;
	uint64_t sync0, unmap0;

	ck_assert_int_eq(tc_stream_create(&st), 0);
	ck_assert_int_eq(cuvmm_malloc(p, each, &a), CUVMM_OK);
	ck_assert_int_eq(cuvmm_malloc(p, each, &b), CUVMM_OK);
	if (coarse) {
		sleep_wake(p);
		ck_assert_uint_eq(p->npack_coarse, 1);
	}
	sync0 = cuvmm_ctx_call_count(ctx, CUVMM_CALL_DEVICE_SYNC);
	unmap0 = cuvmm_ctx_call_count(ctx, CUVMM_CALL_UNMAP);
	ck_assert_int_eq(cuvmm_free(p, a), CUVMM_OK);
	ck_assert_int_eq(cuvmm_free_async(p, b, st), CUVMM_OK);
	ck_assert_int_eq(tc_stream_sync(st), 0);
	pthread_mutex_lock(&p->r.lock);
	cvm_slab_drain(p, INT32_MAX); /* b's event has completed */
	pthread_mutex_unlock(&p->r.lock);
	cvm_pool_reclaim(&p->client, cvm_now_ns(), false); /* the reclaim pass (release_delay_ms 0) */
	ck_assert_uint_gt(cuvmm_ctx_call_count(ctx, CUVMM_CALL_UNMAP), unmap0);
	sync0 = cuvmm_ctx_call_count(ctx, CUVMM_CALL_DEVICE_SYNC) - sync0;
	tc_stream_destroy(st);
	close_empty(ctx, p);
	return sync0;
}

START_TEST(test_packed_unsynced_free_fenced)
{
	ck_assert_uint_gt(syncs_before_unmap(true), 0);
	ck_assert_uint_gt(syncs_before_unmap(false), 0);
}
END_TEST

/*
 * Wake with a fault at every MAP / SET_ACCESS / COPY of a pool with packed allocations (coarsened chunks):
 * the failed wake leaves it asleep, the next wake succeeds with contents and runs intact; then free some,
 * allocate, sleep again (OFFLOAD and DISCARD), wake.
 */
static const enum cuvmm_call wake_calls[] = {CUVMM_CALL_MAP, CUVMM_CALL_SET_ACCESS, CUVMM_CALL_COPY,
					     CUVMM_CALL_CREATE};

START_TEST(test_packed_wake_faults)
{
	struct cuvmm_ctx *ctx = ctx_delay(-1);
	struct cuvmm_pool *p = pool_new(ctx);
	enum { N = 12 };
	void *a[N];
	size_t g = tc_granularity(ctx), each = g + g / 2;
	enum cuvmm_call call = wake_calls[_i % 4];
	int failed = 0;

	load(p, a, N, each, 0x5000u);
	for (int round = 0; round < 3; round++) {
		enum cuvmm_sleep_mode mode = round == 2 ? CUVMM_SLEEP_DISCARD : CUVMM_SLEEP_OFFLOAD;

		ck_assert_int_eq(cuvmm_pool_sleep(p, mode, NULL), CUVMM_OK);
		for (uint64_t skip = 0;; skip++) {
			int err;

			ck_assert_int_eq(cuvmm_ctx_inject_fault(ctx, call, skip, 1, CUVMM_EDRIVER), CUVMM_OK);
			err = cuvmm_pool_wake(p, NULL);
			cuvmm_ctx_inject_fault(ctx, call, 0, 0, CUVMM_EDRIVER);
			if (!err)
				break;
			failed++;
			ck_assert_uint_eq(tc_ctx_stats(ctx).held_bytes, 0);
		}
		CHECK_RUNS(p);
		if (mode == CUVMM_SLEEP_OFFLOAD)
			for (int i = 0; i < N; i++)
				if (a[i])
					ck_assert_uint_eq(tc_check(a[i], each / 4, 0x5000u + (uint32_t)i), 0);
		/* Free every third, allocate smaller ones, refill. */
		for (int i = round; i < N; i += 3)
			if (a[i]) {
				ck_assert_int_eq(cuvmm_free(p, a[i]), CUVMM_OK);
				a[i] = NULL;
			}
		CHECK_RUNS(p);
		for (int i = 0; i < N; i++) {
			if (!a[i])
				ck_assert_int_eq(cuvmm_malloc(p, each, &a[i]), CUVMM_OK);
			ck_assert_int_eq(tc_fill(a[i], each / 4, 0x5000u + (uint32_t)i), 0);
		}
		CHECK_RUNS(p);
		{
			struct cuvmm_stats st = tc_ctx_stats(ctx);

			ck_assert_uint_le(st.live_bytes, st.mapped_bytes);
			ck_assert_uint_le(st.mapped_bytes, st.held_bytes);
		}
	}
	ck_assert_int_gt(failed, 0);
	for (int i = 0; i < N; i++)
		ck_assert_int_eq(cuvmm_free(p, a[i]), CUVMM_OK);
	close_empty(ctx, p);
}
END_TEST



/* Faults during the sleep of a pool with packed allocations, some freed after a first cycle: a failed sleep
 * leaves the pool awake and intact, a sleep with a refused unmap wakes with its quarantined chunk; runs and
 * packer stay consistent through further cycles, and everything goes back once freed. */
static const enum cuvmm_call sleep_calls[] = {CUVMM_CALL_UNMAP, CUVMM_CALL_HOST_REGISTER, CUVMM_CALL_COPY,
					      CUVMM_CALL_RELEASE};

START_TEST(test_packed_sleep_faults)
{
	enum cuvmm_call call = sleep_calls[_i % 4];

	for (uint64_t skip = 0; skip < 48; skip += 7) {
		struct cuvmm_ctx *ctx = ctx_delay(-1);
		struct cuvmm_pool *p = pool_new(ctx);
		enum { N = 12 };
		void *a[N];
		size_t g = tc_granularity(ctx), each = g + g / 2;
		int err;

		load(p, a, N, each, 0x9000u);
		sleep_wake(p); /* one clean cycle first */
		for (int i = 1; i < N; i += 4) {
			ck_assert_int_eq(cuvmm_free(p, a[i]), CUVMM_OK);
			a[i] = NULL;
		}
		CHECK_RUNS(p);
		for (int cyc = 0; cyc < 2; cyc++) {
			if (cyc == 0)
				ck_assert_int_eq(cuvmm_ctx_inject_fault(ctx, call, skip, 1, CUVMM_EDRIVER), CUVMM_OK);
			err = cuvmm_pool_sleep(p, CUVMM_SLEEP_OFFLOAD, NULL);
			cuvmm_ctx_inject_fault(ctx, call, 0, 0, CUVMM_EDRIVER);
			if (!err)
				ck_assert_int_eq(cuvmm_pool_wake(p, NULL), CUVMM_OK);
			CHECK_RUNS(p);
			for (int i = 0; i < N; i++)
				if (a[i])
					ck_assert_uint_eq(tc_check(a[i], each / 4, 0x9000u + (uint32_t)i), 0);
		}
		for (int i = 0; i < N; i++)
			if (a[i])
				ck_assert_int_eq(cuvmm_free(p, a[i]), CUVMM_OK);
		ck_assert_int_eq(cuvmm_pool_trim(p, 0), CUVMM_OK);
		ck_assert_int_eq(cuvmm_pool_trim(p, 0), CUVMM_OK);
		CHECK_RUNS(p);
		ck_assert_msg(tc_ctx_stats(ctx).held_bytes == 0, "%s fault at %llu: %llu bytes held after freeing all",
			      cuvmm_call_name(call), (unsigned long long)skip,
			      (unsigned long long)tc_ctx_stats(ctx).held_bytes);
		cuvmm_pool_destroy(p);
		cuvmm_ctx_destroy(ctx);
	}
}
END_TEST

/* Threads allocating and freeing packed and large memory while another sleeps and wakes the pool and the
 * background thread reclaims (delay 0). */
static pthread_rwlock_t awake_lock; /* readers touch memory; the sleeper writes */

struct churn {
	struct cuvmm_pool *p;
	size_t g;
	unsigned seed;
	_Atomic int *stop;
	_Atomic int bad;
};

static void *churn_thread(void *arg)
{
	struct churn *c = arg;
	void *v[32] = {0};
	size_t sz[32] = {0};

	while (!atomic_load(c->stop)) {
		int i = (int)(rand_r(&c->seed) % 32);

		if (v[i]) {
			pthread_rwlock_rdlock(&awake_lock);
			if (tc_check(v[i], sz[i] / 4, (uint32_t)(uintptr_t)v[i]) != 0)
				atomic_store(&c->bad, 1);
			int e = cuvmm_free(c->p, v[i]);
			pthread_rwlock_unlock(&awake_lock);
			if (e == CUVMM_ESTATE)
				continue;
			if (e)
				atomic_store(&c->bad, 2);
			v[i] = NULL;
		} else {
			unsigned r = rand_r(&c->seed) % 10;
			size_t n = r < 7 ? c->g / 2 + (rand_r(&c->seed) % (4 * c->g)) / 512 * 512 + 512
					 : (33 + rand_r(&c->seed) % 8) * c->g / 4;
			int e;

			pthread_rwlock_rdlock(&awake_lock);
			e = cuvmm_malloc(c->p, n, &v[i]);
			if (!e)
				tc_fill(v[i], n / 4, (uint32_t)(uintptr_t)v[i]);
			pthread_rwlock_unlock(&awake_lock);
			if (e) {
				v[i] = NULL;
				if (e != CUVMM_ESTATE && e != CUVMM_ENOSPC && e != CUVMM_ENOMEM) {
					fprintf(stderr, "churn malloc(%zu): %s\n", n, cuvmm_err_name(e));
					atomic_store(&c->bad, 3);
				}
				continue;
			}
			sz[i] = n;
		}
	}
	for (int i = 0; i < 32; i++)
		while (v[i] && cuvmm_free(c->p, v[i]) == CUVMM_ESTATE)
			tc_sleep_ms(1);
	return NULL;
}

START_TEST(test_packed_churn_sleep)
{
	struct cuvmm_config cfg;
	struct cuvmm_ctx *ctx;
	struct cuvmm_pool *p;
	struct churn c[3];
	pthread_t t[3];
	_Atomic int stop = 0;
	uint64_t t0;

	pthread_rwlockattr_t ra;

	pthread_rwlockattr_init(&ra);
	pthread_rwlockattr_setkind_np(&ra, PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
	pthread_rwlock_init(&awake_lock, &ra);
	tc_config(&cfg);
	cfg.release_delay_ms = 0;
	ctx = tc_ctx(&cfg);
	p = pool_new(ctx);
	for (int i = 0; i < 3; i++) {
		c[i] = (struct churn){.p = p, .g = tc_granularity(ctx), .seed = 7u + (unsigned)i, .stop = &stop};
		pthread_create(&t[i], NULL, churn_thread, &c[i]);
	}
	t0 = tc_now_ms();
	int nsleep = 0;

	while (tc_now_ms() - t0 < 5000) {
		int e;

		pthread_rwlock_wrlock(&awake_lock);
		e = cuvmm_pool_sleep(p, CUVMM_SLEEP_OFFLOAD, NULL);
		if (!e) {
			tc_sleep_ms(1);
			ck_assert_int_eq(cuvmm_pool_wake(p, NULL), CUVMM_OK);
			nsleep++;
		}
		pthread_rwlock_unlock(&awake_lock);
		CHECK_RUNS(p);
		if (e) {
			ck_assert_int_eq(e, CUVMM_EBUSY);
		}
		tc_sleep_ms(2);
	}
	atomic_store(&stop, 1);
	fprintf(stderr, "churn: %d sleeps\n", nsleep);
	for (int i = 0; i < 3; i++) {
		pthread_join(t[i], NULL);
		ck_assert_int_eq(atomic_load(&c[i].bad), 0);
	}
	CHECK_RUNS(p);
	ck_assert_int_eq(cuvmm_pool_trim(p, 0), CUVMM_OK);
	ck_assert_uint_eq(tc_ctx_stats(ctx).held_bytes, 0);
	cuvmm_pool_destroy(p);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

static Suite *packed_sleep_suite(void)
{
	Suite *s = suite_create("packed_sleep");
	TCase *tc = tcase_create("faults");

	tcase_add_checked_fixture(tc, NULL, teardown);
	tcase_set_timeout(tc, TC_TIMEOUT);
	tcase_add_test(tc, test_packed_chunk_strands_granules);
	tcase_add_test(tc, test_packed_reuse_coarse);
	tcase_add_test(tc, test_packed_refused_unmap_coarse);
	tcase_add_test(tc, test_slab_on_coarse_chunk);
	tcase_add_test(tc, test_packed_unsynced_free_fenced);
	tcase_add_loop_test(tc, test_packed_wake_faults, 0, 4);
	tcase_add_loop_test(tc, test_packed_sleep_faults, 0, 4);
	suite_add_tcase(s, tc);
	tc = tcase_create("churn");
	tcase_add_checked_fixture(tc, NULL, teardown);
	tcase_set_timeout(tc, TC_TIMEOUT);
	tcase_add_test(tc, test_packed_churn_sleep);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	if (!tc_on_host())
		return 77;
	return tc_run(packed_sleep_suite());
}
