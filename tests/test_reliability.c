/*
 * Reliability (issue #9): what an adversary found on the host backend, one regression test per finding.
 *
 *   1. a map whose undo's unmap is refused must not leave memory that a later map hands out without access
 *      (region map, malloc, kv alloc);
 *   2. a wake whose cleanup unmap is refused must leave the object asleep and wakeable, and no chunk in the
 *      cache while it is still mapped;
 *   3. a malloc racing a sleep of its pool (the malloc drops the lock to synchronise) must not map into it;
 *   4. device_limit_bytes holds even when the driver refuses the releases that were to make room;
 *   5. cuvmm_ctx_inject_fault from one thread while others call the driver (a data race; this test fails
 *      under ThreadSanitizer on the old code, see .ci/run);
 *   6. statistics are a snapshot: mapped <= held, live <= mapped, held <= peak, held <= the limit, for a
 *      reader racing mapping threads and the KV map-ahead;
 *   9. a range that cannot be reserved is ENOSPC, and no per-granule table is tried first;
 * and the size arguments at their limits.
 *
 * Memory "without access" is touched here on purpose: on the old code these tests crash (Check reports
 * the signal as a failure).
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "drv_test.h"

#define G (2 * TC_MiB)

static void teardown(void)
{
	cvm_host_gate_open();
}

static struct cuvmm_ctx *ctx_quiet(size_t limit)
{
	struct cuvmm_config cfg;

	tc_config(&cfg);
	cfg.release_delay_ms = -1;        /* keep cached chunks: the tests decide when memory goes back */
	cfg.background_release = false;   /* no pass racing the injected faults */
	cfg.device_limit_bytes = limit;
	return tc_ctx(&cfg);
}

static void inject(struct cuvmm_ctx *ctx, enum cuvmm_call call, uint64_t skip, uint32_t count, int err)
{
	ck_assert_int_eq(cuvmm_ctx_inject_fault(ctx, call, skip, count, err), CUVMM_OK);
}

static void clear_faults(struct cuvmm_ctx *ctx)
{
	for (int c = 0; c < CUVMM_CALL_COUNT_; c++)
		inject(ctx, (enum cuvmm_call)c, 0, 0, CUVMM_EDRIVER);
}

/* Write and read back every granule of [p, p + bytes): crashes if any of it has no access. */
static void touch(void *p, size_t bytes, uint32_t v)
{
	for (size_t off = 0; off < bytes; off += G) {
		ck_assert_int_eq(tc_fill((char *)p + off, G / 4, v + (uint32_t)off), 0);
		ck_assert_uint_eq(tc_check((char *)p + off, G / 4, v + (uint32_t)off), 0);
	}
}

/* ----- 1. memory handed out without access ----- */

/* Case 0: set-access refused; case 1: the limit runs out after the first chunk was mapped. Either way the
 * undo's unmap is refused too. */
START_TEST(test_map_undo_refused_region)
{
	struct cuvmm_ctx *ctx = ctx_quiet(_i == 1 ? G : 0);
	struct cuvmm_region *r;
	struct cuvmm_stats st;

	ck_assert_int_eq(cuvmm_region_create(ctx, 0, 8 * G, &r), CUVMM_OK);
	if (_i == 0)
		inject(ctx, CUVMM_CALL_SET_ACCESS, 0, 1, CUVMM_EDRIVER);
	inject(ctx, CUVMM_CALL_UNMAP, 0, UINT32_MAX, CUVMM_EDRIVER);
	ck_assert_int_eq(cuvmm_region_map(r, 0, 2 * G), _i == 0 ? CUVMM_EDRIVER : CUVMM_ENOMEM);
	st = tc_region_stats(r);
	ck_assert_uint_eq(st.live_bytes, 0);
	/* The granule the undo could not unmap is taken back by the next map: with access. */
	ck_assert_int_eq(cuvmm_region_map(r, 0, G), CUVMM_OK);
	touch(cuvmm_region_base(r), G, 1);
	/* A refused grant fails the map and changes nothing. */
	clear_faults(ctx);
	ck_assert_int_eq(cuvmm_region_unmap(r, 0, G, NULL), CUVMM_OK);
	ck_assert_uint_eq(tc_region_stats(r).mapped_bytes, 0);
	cuvmm_region_destroy(r);
	st = tc_ctx_stats(ctx);
	ck_assert_uint_eq(st.reserved_bytes, 0);
	ck_assert_uint_eq(st.mapped_bytes, 0);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/* The take-back's grant refused: the map fails and the granule stays quarantined; then it works. */
START_TEST(test_map_grant_refused)
{
	struct cuvmm_ctx *ctx = ctx_quiet(0);
	struct cuvmm_region *r;

	ck_assert_int_eq(cuvmm_region_create(ctx, 0, 4 * G, &r), CUVMM_OK);
	inject(ctx, CUVMM_CALL_SET_ACCESS, 0, 1, CUVMM_EDRIVER);
	inject(ctx, CUVMM_CALL_UNMAP, 0, UINT32_MAX, CUVMM_EDRIVER);
	ck_assert_int_eq(cuvmm_region_map(r, 0, G), CUVMM_EDRIVER);
	inject(ctx, CUVMM_CALL_SET_ACCESS, 0, 1, CUVMM_EDRIVER);
	ck_assert_int_eq(cuvmm_region_map(r, 0, 2 * G), CUVMM_EDRIVER);
	ck_assert_uint_eq(tc_region_stats(r).live_bytes, 0);
	ck_assert_int_eq(cuvmm_region_map(r, 0, 2 * G), CUVMM_OK);
	touch(cuvmm_region_base(r), 2 * G, 2);
	clear_faults(ctx);
	cuvmm_region_destroy(r);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/* malloc: one refused unmap plus a natural ENOMEM at the device limit. */
START_TEST(test_map_undo_refused_malloc)
{
	struct cuvmm_ctx *ctx = ctx_quiet(G);
	struct cuvmm_pool_config pc;
	struct cuvmm_pool *p;
	void *a = NULL;

	cuvmm_pool_config_init(&pc);
	pc.max_bytes = 16 * G;
	ck_assert_int_eq(cuvmm_pool_create(ctx, &pc, &p), CUVMM_OK);
	inject(ctx, CUVMM_CALL_UNMAP, 0, UINT32_MAX, CUVMM_EDRIVER);
	ck_assert_int_eq(cuvmm_malloc(p, 2 * G, &a), CUVMM_ENOMEM);
	ck_assert_int_eq(cuvmm_malloc(p, G, &a), CUVMM_OK);
	touch(a, G, 3);
	clear_faults(ctx);
	ck_assert_int_eq(cuvmm_free(p, a), CUVMM_OK);
	cuvmm_pool_destroy(p);
	ck_assert_uint_eq(tc_ctx_stats(ctx).mapped_bytes, 0);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

START_TEST(test_map_undo_refused_kv)
{
	struct cuvmm_ctx *ctx = ctx_quiet(0);
	struct cuvmm_kv_config kc;
	struct cuvmm_kv *kv;
	uint32_t id;

	cuvmm_kv_config_init(&kc);
	kc.block_bytes = G;
	kc.max_blocks = 8;
	kc.tensors = 2;
	ck_assert_int_eq(cuvmm_kv_create(ctx, &kc, &kv), CUVMM_OK);
	/* tensor 0 maps, tensor 1's set-access is refused, and no unmap goes through. */
	inject(ctx, CUVMM_CALL_SET_ACCESS, 1, 1, CUVMM_EDRIVER);
	inject(ctx, CUVMM_CALL_UNMAP, 0, UINT32_MAX, CUVMM_EDRIVER);
	ck_assert_int_eq(cuvmm_kv_alloc(kv, 1, &id), CUVMM_EDRIVER);
	ck_assert_int_eq(cuvmm_kv_alloc(kv, 1, &id), CUVMM_OK);
	for (uint32_t t = 0; t < kc.tensors; t++)
		touch((char *)cuvmm_kv_tensor(kv, t) + (size_t)id * G, G, 4 + t);
	clear_faults(ctx);
	ck_assert_int_eq(cuvmm_kv_free(kv, 1, &id, NULL), CUVMM_OK);
	cuvmm_kv_destroy(kv);
	ck_assert_uint_eq(tc_ctx_stats(ctx).mapped_bytes, 0);
	ck_assert_uint_eq(tc_ctx_stats(ctx).reserved_bytes, 0);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/* ----- 2. a wake that could never succeed again ----- */

static void sleep_filled(struct cuvmm_region *r, size_t bytes)
{
	for (size_t off = 0; off < bytes; off += G)
		ck_assert_int_eq(tc_fill((char *)cuvmm_region_base(r) + off, G / 4, 100 + (uint32_t)off), 0);
	ck_assert_int_eq(cuvmm_region_sleep(r, CUVMM_SLEEP_OFFLOAD, NULL), CUVMM_OK);
}

static void check_filled(void *base, size_t bytes)
{
	for (size_t off = 0; off < bytes; off += G)
		ck_assert_uint_eq(tc_check((char *)base + off, G / 4, 100 + (uint32_t)off), 0);
}

/* Case 0: the second wake still cannot unmap (it takes the chunk back); case 1: it can again. */
START_TEST(test_wake_cleanup_refused_region)
{
	struct cuvmm_ctx *ctx = ctx_quiet(0);
	struct cuvmm_region *r, *other;
	struct cuvmm_stats st;

	ck_assert_int_eq(cuvmm_region_create(ctx, 0, 4 * G, &r), CUVMM_OK);
	ck_assert_int_eq(cuvmm_region_create(ctx, 0, 4 * G, &other), CUVMM_OK);
	ck_assert_int_eq(cuvmm_region_map(r, 0, 3 * G), CUVMM_OK);
	sleep_filled(r, 3 * G);
	/* Second chunk's set-access refused; the cleanup cannot unmap the first two. */
	inject(ctx, CUVMM_CALL_SET_ACCESS, 1, 1, CUVMM_EDRIVER);
	inject(ctx, CUVMM_CALL_UNMAP, 0, UINT32_MAX, CUVMM_EDRIVER);
	ck_assert_int_eq(cuvmm_region_wake(r, NULL), CUVMM_EDRIVER);
	/* Still asleep: calls other than wake are refused. */
	ck_assert_int_eq(cuvmm_region_map(r, 0, G), CUVMM_ESTATE);
	/* Nothing still mapped here may be handed to another object. */
	ck_assert_int_eq(cuvmm_region_map(other, 0, 4 * G), CUVMM_OK);
	touch(cuvmm_region_base(other), 4 * G, 9);
	if (_i == 1)
		clear_faults(ctx);
	ck_assert_int_eq(cuvmm_region_wake(r, NULL), CUVMM_OK);
	check_filled(cuvmm_region_base(r), 3 * G);
	touch(cuvmm_region_base(r), 3 * G, 7);
	clear_faults(ctx);
	st = tc_region_stats(r);
	ck_assert_uint_eq(st.mapped_bytes, 3 * G);
	ck_assert_uint_eq(st.live_bytes, 3 * G);
	cuvmm_region_destroy(other);
	cuvmm_region_destroy(r);
	st = tc_ctx_stats(ctx);
	ck_assert_uint_eq(st.reserved_bytes, 0);
	ck_assert_uint_eq(st.mapped_bytes, 0);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

START_TEST(test_wake_cleanup_refused_pool)
{
	struct cuvmm_ctx *ctx = ctx_quiet(0);
	struct cuvmm_pool_config pc;
	struct cuvmm_pool *p;
	void *a, *b;

	cuvmm_pool_config_init(&pc);
	pc.max_bytes = 64 * G;
	ck_assert_int_eq(cuvmm_pool_create(ctx, &pc, &p), CUVMM_OK);
	ck_assert_int_eq(cuvmm_malloc(p, 2 * G, &a), CUVMM_OK);
	ck_assert_int_eq(cuvmm_malloc(p, 3 * G, &b), CUVMM_OK);
	ck_assert_int_eq(tc_fill(a, 2 * G / 4, 11), 0);
	ck_assert_int_eq(tc_fill(b, 3 * G / 4, 12), 0);
	ck_assert_int_eq(cuvmm_pool_sleep(p, CUVMM_SLEEP_OFFLOAD, NULL), CUVMM_OK);
	/* The two packed allocations (5 granules, back to back) wake in two chunks (4 + 1 granules): the
	 * second's access is refused, and so is every unmap of the undo. */
	inject(ctx, CUVMM_CALL_SET_ACCESS, 1, 1, CUVMM_EDRIVER);
	inject(ctx, CUVMM_CALL_UNMAP, 0, UINT32_MAX, CUVMM_EDRIVER);
	ck_assert_int_eq(cuvmm_pool_wake(p, NULL), CUVMM_EDRIVER);
	ck_assert_int_eq(cuvmm_free(p, a), CUVMM_ESTATE);
	ck_assert_int_eq(cuvmm_pool_wake(p, NULL), CUVMM_OK);
	ck_assert_uint_eq(tc_check(a, 2 * G / 4, 11), 0);
	ck_assert_uint_eq(tc_check(b, 3 * G / 4, 12), 0);
	clear_faults(ctx);
	ck_assert_int_eq(cuvmm_free(p, a), CUVMM_OK);
	ck_assert_int_eq(cuvmm_free(p, b), CUVMM_OK);
	cuvmm_pool_destroy(p);
	ck_assert_uint_eq(tc_ctx_stats(ctx).reserved_bytes, 0);
	ck_assert_uint_eq(tc_ctx_stats(ctx).mapped_bytes, 0);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/* Sleep: an unmap refused, then the map that would undo it refused: the sleep completes instead (found
 * by tests/fuzz: the granules were left unmapped but counted live, and a freed chunk was read). */
START_TEST(test_sleep_undo_refused)
{
	struct cuvmm_ctx *ctx = ctx_quiet(0);
	struct cuvmm_region *r;
	struct cuvmm_stats st;

	ck_assert_int_eq(cuvmm_region_create(ctx, 0, 4 * G, &r), CUVMM_OK);
	ck_assert_int_eq(cuvmm_region_map(r, 0, 3 * G), CUVMM_OK);
	for (size_t off = 0; off < 3 * G; off += G)
		ck_assert_int_eq(tc_fill((char *)cuvmm_region_base(r) + off, G / 4, 100 + (uint32_t)off), 0);
	inject(ctx, CUVMM_CALL_UNMAP, 1, UINT32_MAX, CUVMM_EDRIVER);
	inject(ctx, CUVMM_CALL_MAP, 0, 1, CUVMM_EDRIVER);
	ck_assert_int_eq(cuvmm_region_sleep(r, CUVMM_SLEEP_OFFLOAD, NULL), CUVMM_OK);
	ck_assert_int_eq(cuvmm_region_map(r, 0, G), CUVMM_ESTATE);
	st = tc_region_stats(r);
	ck_assert_uint_eq(st.live_bytes, 3 * G);
	ck_assert_uint_le(st.mapped_bytes, 2 * G); /* the quarantined chunks */
	ck_assert_int_eq(cuvmm_region_wake(r, NULL), CUVMM_OK);
	check_filled(cuvmm_region_base(r), 3 * G);
	clear_faults(ctx);
	ck_assert_uint_eq(tc_region_stats(r).mapped_bytes, 3 * G);
	cuvmm_region_destroy(r);
	st = tc_ctx_stats(ctx);
	ck_assert_uint_eq(st.reserved_bytes, 0);
	ck_assert_uint_eq(st.mapped_bytes, 0);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/* ----- 3. malloc into a sleeping pool ----- */

struct race_arg {
	struct cuvmm_pool *p;
	size_t bytes;
	void *ptr;
	int err;
};

static void *malloc_thread(void *arg)
{
	struct race_arg *a = arg;

	a->err = cuvmm_malloc(a->p, a->bytes, &a->ptr);
	return NULL;
}

static void *sleep_thread(void *arg)
{
	struct race_arg *a = arg;

	a->err = cuvmm_pool_sleep(a->p, CUVMM_SLEEP_DISCARD, NULL);
	return NULL;
}

static void wait_calls(struct cuvmm_ctx *ctx, enum cuvmm_call call, uint64_t n)
{
	uint64_t t0 = tc_now_ms();

	while (cuvmm_ctx_call_count(ctx, call) < n) {
		ck_assert_msg(tc_now_ms() - t0 < 10000, "call %d never reached %llu", (int)call,
			      (unsigned long long)n);
		tc_sleep_ms(1);
	}
}

/* The malloc runs out of memory and drops the pool's lock to synchronise the device (held up by the
 * closed gate); the pool is put to sleep meanwhile. The malloc must then fail with ESTATE. */
START_TEST(test_malloc_races_sleep)
{
	struct cuvmm_ctx *ctx;
	struct cuvmm_pool_config pc;
	struct cuvmm_pool *p;
	struct cuvmm_region *r;
	struct race_arg ma = {0}, sa = {0};
	pthread_t mt, st;
	uint64_t syncs;
	void *a;

	if (!tc_on_host())
		return; /* the gate is the host backend's */
	ctx = ctx_quiet(0);
	cuvmm_pool_config_init(&pc);
	pc.max_bytes = 16 * G;
	ck_assert_int_eq(cuvmm_pool_create(ctx, &pc, &p), CUVMM_OK);
	ck_assert_int_eq(cuvmm_region_create(ctx, 0, G, &r), CUVMM_OK);
	/* One granule of slack, so the malloc's out-of-memory answer is to drop it (after a sync). */
	ck_assert_int_eq(cuvmm_malloc(p, G, &a), CUVMM_OK);
	ck_assert_int_eq(cuvmm_free(p, a), CUVMM_OK);
	/* Work the device sync must wait for: an unmap fenced on a stream behind the closed gate. */
	cvm_host_gate_close();
	ck_assert_int_eq(cuvmm_region_map(r, 0, G), CUVMM_OK);
	ck_assert_int_eq(cuvmm_region_unmap(r, 0, G, (CUstream)(uintptr_t)1), CUVMM_OK);
	inject(ctx, CUVMM_CALL_CREATE, 0, 1, CUVMM_ENOMEM);
	syncs = cuvmm_ctx_call_count(ctx, CUVMM_CALL_DEVICE_SYNC);
	ma.p = p;
	ma.bytes = 2 * G;
	ck_assert_int_eq(pthread_create(&mt, NULL, malloc_thread, &ma), 0);
	wait_calls(ctx, CUVMM_CALL_DEVICE_SYNC, syncs + 1);  /* the malloc waits, without the pool's lock */
	sa.p = p;
	ck_assert_int_eq(pthread_create(&st, NULL, sleep_thread, &sa), 0);
	wait_calls(ctx, CUVMM_CALL_DEVICE_SYNC, syncs + 2);  /* the sleep holds the lock and waits too */
	cvm_host_gate_open();
	pthread_join(st, NULL);
	pthread_join(mt, NULL);
	ck_assert_int_eq(sa.err, CUVMM_OK);
	ck_assert_msg(ma.err == CUVMM_ESTATE, "malloc into a sleeping pool returned %s", cuvmm_err_name(ma.err));
	ck_assert_uint_eq(tc_pool_stats(p).mapped_bytes, 0);
	ck_assert_uint_eq(tc_pool_stats(p).live_bytes, 0);
	ck_assert_int_eq(cuvmm_pool_wake(p, NULL), CUVMM_OK);
	ck_assert_int_eq(cuvmm_malloc(p, 2 * G, &a), CUVMM_OK);
	touch(a, 2 * G, 5);
	ck_assert_int_eq(cuvmm_free(p, a), CUVMM_OK);
	cuvmm_region_destroy(r);
	cuvmm_pool_destroy(p);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/* ----- 4. the device limit when releases are refused ----- */

START_TEST(test_limit_release_refused)
{
	struct cuvmm_ctx *ctx = ctx_quiet(2 * G);
	struct cuvmm_region *small, *big;
	struct cuvmm_stats st;

	ck_assert_int_eq(cuvmm_region_create(ctx, 0, 2 * G, &small), CUVMM_OK);
	ck_assert_int_eq(cuvmm_region_create_ex(ctx, 0, 2 * G, 2 * G, &big), CUVMM_OK);
	ck_assert_int_eq(cuvmm_region_map(small, 0, 2 * G), CUVMM_OK);
	ck_assert_int_eq(cuvmm_region_unmap(small, 0, 2 * G, NULL), CUVMM_OK); /* two chunks cached */
	ck_assert_uint_eq(tc_ctx_stats(ctx).held_bytes, 2 * G);
	inject(ctx, CUVMM_CALL_RELEASE, 0, UINT32_MAX, CUVMM_EDRIVER);
	/* A chunk of the other class needs the cached ones released: refused, so no room. */
	ck_assert_int_eq(cuvmm_region_map(big, 0, 2 * G), CUVMM_ENOMEM);
	st = tc_ctx_stats(ctx);
	ck_assert_uint_le(st.held_bytes, 2 * G);
	ck_assert_uint_le(st.peak_held_bytes, 2 * G);
	clear_faults(ctx);
	ck_assert_int_eq(cuvmm_region_map(big, 0, 2 * G), CUVMM_OK);
	touch(cuvmm_region_base(big), 2 * G, 6);
	st = tc_ctx_stats(ctx);
	ck_assert_uint_eq(st.held_bytes, 2 * G);
	ck_assert_uint_le(st.peak_held_bytes, 2 * G);
	cuvmm_region_destroy(big);
	cuvmm_region_destroy(small);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/* ----- 5. cuvmm_ctx_inject_fault racing driver calls ----- */

struct inj_arg {
	struct cuvmm_ctx *ctx;
	atomic_bool stop;
};

static void *inject_thread(void *arg)
{
	struct inj_arg *a = arg;

	for (int i = 0; !atomic_load(&a->stop); i++)
		cuvmm_ctx_inject_fault(a->ctx, CUVMM_CALL_EVENT_RECORD, 0, UINT32_MAX,
				       i & 1 ? CUVMM_ENOMEM : CUVMM_EDRIVER);
	return NULL;
}

/* Without an error under ThreadSanitizer (and without a wrong code anywhere). */
START_TEST(test_inject_fault_race)
{
	struct cuvmm_ctx *ctx = ctx_quiet(0);
	struct cuvmm_region *r;
	struct inj_arg a = {.ctx = ctx};
	pthread_t t;

	ck_assert_int_eq(cuvmm_region_create(ctx, 0, 2 * G, &r), CUVMM_OK);
	ck_assert_int_eq(cuvmm_region_map(r, 0, G), CUVMM_OK);
	ck_assert_int_eq(pthread_create(&t, NULL, inject_thread, &a), 0);
	for (int i = 0; i < 20000; i++) {
		int err;

		/* a mapped granule, so that the unmap records a fence (the call the faults hit) */
		ck_assert_int_eq(cuvmm_region_map(r, 0, G), CUVMM_OK);
		err = cuvmm_region_unmap(r, 0, G, (CUstream)(uintptr_t)1);
		ck_assert_msg(err == CUVMM_OK || err == CUVMM_ENOMEM || err == CUVMM_EDRIVER, "unmap: %s",
			      cuvmm_err_name(err));
	}
	atomic_store(&a.stop, true);
	pthread_join(t, NULL);
	clear_faults(ctx);
	cuvmm_region_destroy(r);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/* ----- 6. statistics as a snapshot ----- */

struct stats_arg {
	struct cuvmm_ctx *ctx;
	struct cuvmm_region *r;
	struct cuvmm_pool *p;
	struct cuvmm_kv *kv;
	size_t limit;
	atomic_bool stop;
	atomic_ulong reads;
	atomic_int failed;  /* set once by the first thread that saw a violation, which wrote `bad` */
	char bad[256];
};

/* Record a violation once (several threads may see one). */
static void stats_bad(struct stats_arg *a, const char *why)
{
	if (atomic_exchange(&a->failed, 1) == 0)
		snprintf(a->bad, sizeof(a->bad), "%s", why);
}

static bool stats_ok(const struct cuvmm_stats *s, size_t limit, bool live_le_mapped, const char *who, char *bad)
{
	const char *why = NULL;

	if (s->mapped_bytes > s->held_bytes)
		why = "mapped > held";
	else if (s->held_bytes > s->peak_held_bytes)
		why = "held > peak_held";
	else if (s->live_bytes > s->peak_live_bytes)
		why = "live > peak_live";
	else if (limit && s->peak_held_bytes > limit)
		why = "peak_held > device limit";
	else if (live_le_mapped && s->live_bytes > s->mapped_bytes)
		why = "live > mapped";
	if (!why)
		return true;
	snprintf(bad, 256, "%s: %s (held %llu mapped %llu live %llu peak_held %llu)", who, why,
		 (unsigned long long)s->held_bytes, (unsigned long long)s->mapped_bytes,
		 (unsigned long long)s->live_bytes, (unsigned long long)s->peak_held_bytes);
	return false;
}

static void *stats_reader(void *arg)
{
	struct stats_arg *a = arg;
	char why[256] = "";

	while (!atomic_load(&a->stop) && !atomic_load(&a->failed)) {
		struct cuvmm_stats s = {.size = sizeof(s)};

		cuvmm_ctx_stats(a->ctx, 0, &s);
		if (!stats_ok(&s, a->limit, false, "device", why))
			break;
		cuvmm_region_stats(a->r, &s);
		if (!stats_ok(&s, 0, true, "region", why))
			break;
		cuvmm_pool_stats(a->p, &s);
		if (!stats_ok(&s, 0, true, "pool", why))
			break;
		cuvmm_kv_stats(a->kv, &s);
		if (!stats_ok(&s, 0, true, "kv", why))
			break;
		atomic_fetch_add(&a->reads, 1);
	}
	if (why[0])
		stats_bad(a, why);
	return NULL;
}

static void *region_churn(void *arg)
{
	struct stats_arg *a = arg;

	while (!atomic_load(&a->stop)) {
		cuvmm_region_map(a->r, 0, 4 * G);
		cuvmm_region_unmap(a->r, 0, 4 * G, NULL);
	}
	return NULL;
}

static void *pool_churn(void *arg)
{
	struct stats_arg *a = arg;
	unsigned seed = 1;

	while (!atomic_load(&a->stop)) {
		void *p[4] = {0};

		for (int i = 0; i < 4; i++)
			cuvmm_malloc(a->p, 1 + (size_t)rand_r(&seed) % (3 * G), &p[i]);
		for (int i = 0; i < 4; i++)
			cuvmm_free(a->p, p[i]);
		cuvmm_pool_trim(a->p, 0);
	}
	return NULL;
}

static void *kv_churn(void *arg)
{
	struct stats_arg *a = arg;

	while (!atomic_load(&a->stop)) {
		uint32_t ids[8];

		if (cuvmm_kv_alloc(a->kv, 8, ids) == CUVMM_OK)
			cuvmm_kv_free(a->kv, 8, ids, NULL);
		cuvmm_ctx_trim(a->ctx, 0, 0);
	}
	return NULL;
}

START_TEST(test_stats_snapshot)
{
	struct cuvmm_config cfg;
	struct stats_arg a = {0};
	struct cuvmm_pool_config pc;
	struct cuvmm_kv_config kc;
	pthread_t t[5];
	uint64_t t0;

	tc_config(&cfg);
	cfg.release_delay_ms = 0;      /* every free goes back at once: the most churn */
	cfg.device_limit_bytes = a.limit = 24 * G;
	a.ctx = tc_ctx(&cfg);
	ck_assert_int_eq(cuvmm_region_create(a.ctx, 0, 4 * G, &a.r), CUVMM_OK);
	cuvmm_pool_config_init(&pc);
	pc.max_bytes = 32 * G;
	ck_assert_int_eq(cuvmm_pool_create(a.ctx, &pc, &a.p), CUVMM_OK);
	cuvmm_kv_config_init(&kc);
	kc.block_bytes = 256 * TC_KiB;
	kc.max_blocks = 256;
	kc.tensors = 2;
	ck_assert_int_eq(cuvmm_kv_create(a.ctx, &kc, &a.kv), CUVMM_OK);
	ck_assert_int_eq(pthread_create(&t[0], NULL, stats_reader, &a), 0);
	ck_assert_int_eq(pthread_create(&t[1], NULL, stats_reader, &a), 0);
	ck_assert_int_eq(pthread_create(&t[2], NULL, region_churn, &a), 0);
	ck_assert_int_eq(pthread_create(&t[3], NULL, pool_churn, &a), 0);
	ck_assert_int_eq(pthread_create(&t[4], NULL, kv_churn, &a), 0);
	t0 = tc_now_ms();
	while (tc_now_ms() - t0 < 3000 && !atomic_load(&a.failed))
		tc_sleep_ms(10);
	atomic_store(&a.stop, true);
	for (int i = 0; i < 5; i++)
		pthread_join(t[i], NULL);
	ck_assert_msg(!a.bad[0], "after %lu reads: %s", (unsigned long)atomic_load(&a.reads), a.bad);
	ck_assert_uint_gt(atomic_load(&a.reads), 100);
	cuvmm_kv_destroy(a.kv);
	cuvmm_pool_destroy(a.p);
	cuvmm_region_destroy(a.r);
	cuvmm_ctx_destroy(a.ctx);
}
END_TEST

/* ----- stress: several threads on one pool and one kv object ----- */

/*
 * Three threads malloc, fill, check and free on one pool (sync and async), two allocate, tag, check and free
 * kv blocks, one trims and reads statistics, and the background thread releases on a 1 ms delay. Each
 * thread checks its own memory (an overlap between threads corrupts it) and the reader the invariants.
 * Run under ThreadSanitizer by .ci/run; $CUVMM_STRESS_MS sets the duration (default 2000).
 */
struct stress {
	struct stats_arg a;
	atomic_int failed;
	char why[256];
};

static void stress_fail(struct stress *st, const char *why)
{
	if (atomic_exchange(&st->failed, 1) == 0)
		snprintf(st->why, sizeof(st->why), "%s", why);
}

static void *stress_pool(void *arg)
{
	struct stress *st = arg;
	unsigned seed = (unsigned)(uintptr_t)&seed;
	CUstream stream = (CUstream)(uintptr_t)(1 + (seed & 7));

	while (!atomic_load(&st->a.stop) && !atomic_load(&st->failed)) {
		void *p[6] = {0};
		size_t n[6];

		for (int i = 0; i < 6; i++) {
			n[i] = 1 + (size_t)rand_r(&seed) % (i < 3 ? 64 * TC_KiB : 3 * G);
			if ((i & 1 ? cuvmm_malloc_async(st->a.p, n[i], stream, &p[i]) : cuvmm_malloc(st->a.p, n[i], &p[i])))
				p[i] = NULL;
			else
				memset(p[i], 0x40 + i, n[i] < 4096 ? n[i] : 4096);
		}
		for (int i = 0; i < 6; i++) {
			if (!p[i])
				continue;
			for (size_t k = 0; k < (n[i] < 4096 ? n[i] : 4096); k++)
				if (((unsigned char *)p[i])[k] != 0x40 + i) {
					stress_fail(st, "pool: an allocation was overwritten");
					break;
				}
			if ((i & 1 ? cuvmm_free_async(st->a.p, p[i], stream) : cuvmm_free(st->a.p, p[i])))
				stress_fail(st, "pool: free failed");
		}
	}
	return NULL;
}

static void *stress_kv(void *arg)
{
	struct stress *st = arg;
	uint32_t tag = (uint32_t)(uintptr_t)&tag;

	while (!atomic_load(&st->a.stop) && !atomic_load(&st->failed)) {
		uint32_t ids[16];

		if (cuvmm_kv_alloc(st->a.kv, 16, ids))
			continue;
		for (int i = 0; i < 16; i++)
			for (uint32_t t = 0; t < 2; t++)
				memcpy((char *)cuvmm_kv_tensor(st->a.kv, t) + (size_t)ids[i] * 256 * TC_KiB, &tag, 4);
		for (int i = 0; i < 16; i++)
			for (uint32_t t = 0; t < 2; t++)
				if (memcmp((char *)cuvmm_kv_tensor(st->a.kv, t) + (size_t)ids[i] * 256 * TC_KiB, &tag, 4))
					stress_fail(st, "kv: a block was overwritten");
		if (cuvmm_kv_free(st->a.kv, 16, ids, (CUstream)(uintptr_t)(tag & 1 ? 1 : 0)))
			stress_fail(st, "kv: free failed");
		tag++;
	}
	return NULL;
}

static void *stress_trim(void *arg)
{
	struct stress *st = arg;

	while (!atomic_load(&st->a.stop) && !atomic_load(&st->failed)) {
		struct cuvmm_stats s = {.size = sizeof(s)};
		char why[256];

		cuvmm_pool_trim(st->a.p, 0);
		cuvmm_ctx_trim(st->a.ctx, -1, 0);
		cuvmm_ctx_stats(st->a.ctx, 0, &s);
		if (!stats_ok(&s, st->a.limit, false, "device", why))
			stress_fail(st, why);
		tc_sleep_ms(1);
	}
	return NULL;
}

START_TEST(test_stress)
{
	struct cuvmm_config cfg;
	struct stress st;
	struct cuvmm_pool_config pc;
	struct cuvmm_kv_config kc;
	const char *env = getenv("CUVMM_STRESS_MS");
	int ms = env ? atoi(env) : 2000;
	pthread_t t[8];
	int n = 0;
	uint64_t t0;

	if (!tc_on_host())
		return; /* the threads check memory from the CPU */
	memset(&st, 0, sizeof(st));
	tc_config(&cfg);
	cfg.release_delay_ms = 1;
	cfg.background_release = true;
	cfg.device_limit_bytes = st.a.limit = 64 * G;
	st.a.ctx = tc_ctx(&cfg);
	ck_assert_int_eq(cuvmm_region_create(st.a.ctx, 0, 4 * G, &st.a.r), CUVMM_OK);
	cuvmm_pool_config_init(&pc);
	pc.max_bytes = 64 * G;
	ck_assert_int_eq(cuvmm_pool_create(st.a.ctx, &pc, &st.a.p), CUVMM_OK);
	cuvmm_kv_config_init(&kc);
	kc.block_bytes = 256 * TC_KiB;
	kc.max_blocks = 512;
	kc.tensors = 2;
	ck_assert_int_eq(cuvmm_kv_create(st.a.ctx, &kc, &st.a.kv), CUVMM_OK);
	for (int i = 0; i < 3; i++)
		ck_assert_int_eq(pthread_create(&t[n++], NULL, stress_pool, &st), 0);
	for (int i = 0; i < 2; i++)
		ck_assert_int_eq(pthread_create(&t[n++], NULL, stress_kv, &st), 0);
	ck_assert_int_eq(pthread_create(&t[n++], NULL, stress_trim, &st), 0);
	ck_assert_int_eq(pthread_create(&t[n++], NULL, stats_reader, &st.a), 0);
	t0 = tc_now_ms();
	while (tc_now_ms() - t0 < (uint64_t)ms && !atomic_load(&st.failed) && !atomic_load(&st.a.failed))
		tc_sleep_ms(10);
	atomic_store(&st.a.stop, true);
	for (int i = 0; i < n; i++)
		pthread_join(t[i], NULL);
	ck_assert_msg(!atomic_load(&st.failed), "%s", st.why);
	ck_assert_msg(!st.a.bad[0], "%s", st.a.bad);
	cuvmm_kv_destroy(st.a.kv);
	cuvmm_pool_destroy(st.a.p);
	cuvmm_region_destroy(st.a.r);
	ck_assert_uint_eq(tc_ctx_stats(st.a.ctx).live_bytes, 0);
	cuvmm_ctx_destroy(st.a.ctx);
}
END_TEST

/* ----- 9. ranges that cannot be reserved ----- */

START_TEST(test_unreservable_enospc)
{
	static const size_t sizes[] = {SIZE_MAX / 2, (size_t)1 << 47, (size_t)1 << 62};
	struct cuvmm_ctx *ctx = ctx_quiet(0);

	if (!tc_on_host()) {
		cuvmm_ctx_destroy(ctx);
		return; /* what a GPU's address space can hold is the driver's */
	}
	for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
		struct cuvmm_region *r = NULL;
		struct cuvmm_kv_config kc;
		struct cuvmm_kv *kv = NULL;
		struct cuvmm_pool_config pc;
		struct cuvmm_pool *p = NULL;

		ck_assert_int_eq(cuvmm_region_create(ctx, 0, sizes[i], &r), CUVMM_ENOSPC);
		ck_assert_ptr_null(r);
		cuvmm_kv_config_init(&kc);
		kc.block_bytes = sizes[i] / 4;
		kc.max_blocks = 4;
		ck_assert_int_eq(cuvmm_kv_create(ctx, &kc, &kv), CUVMM_ENOSPC);
		ck_assert_ptr_null(kv);
		cuvmm_pool_config_init(&pc);
		pc.max_bytes = sizes[i];
		ck_assert_int_eq(cuvmm_pool_create(ctx, &pc, &p), CUVMM_ENOSPC);
		ck_assert_ptr_null(p);
	}
	ck_assert_uint_eq(tc_ctx_stats(ctx).reserved_bytes, 0);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/* ----- size arguments at their limits ----- */

/* Item 7: a delay that does not count in nanoseconds is refused (2^62 ms wrapped to 0, "at once"); the
 * longest one accepted keeps free memory. */
START_TEST(test_delay_limits)
{
	static const int64_t refused[] = {CUVMM_RELEASE_DELAY_MS_MAX + 1, (int64_t)1 << 58, (int64_t)1 << 62,
					  INT64_MAX, (int64_t)(UINT64_MAX / 1000000u) + 1, -2};
	static const int64_t kept[] = {CUVMM_RELEASE_DELAY_MS_MAX, CUVMM_RELEASE_DELAY_MS_MAX - 1};

	for (size_t i = 0; i < sizeof(refused) / sizeof(refused[0]); i++) {
		struct cuvmm_config cfg;
		struct cuvmm_ctx *ctx = NULL;

		tc_config(&cfg);
		cfg.release_delay_ms = refused[i];
		ck_assert_int_eq(cuvmm_ctx_create(&cfg, &ctx), CUVMM_EINVAL);
		ck_assert_ptr_null(ctx);
	}
	for (size_t i = 0; i < sizeof(kept) / sizeof(kept[0]); i++) {
		struct cuvmm_config cfg;
		struct cuvmm_ctx *ctx;
		struct cuvmm_region *r;

		tc_config(&cfg);
		cfg.release_delay_ms = kept[i];
		cfg.background_release = false;
		ctx = tc_ctx(&cfg);
		ck_assert_int_eq(cuvmm_region_create(ctx, 0, G, &r), CUVMM_OK);
		ck_assert_int_eq(cuvmm_region_map(r, 0, G), CUVMM_OK);
		ck_assert_int_eq(cuvmm_region_unmap(r, 0, G, NULL), CUVMM_OK);
		tc_sleep_ms(20);
		ck_assert_int_eq(cuvmm_region_map(r, 0, G), CUVMM_OK); /* a call runs any pass that is due */
		ck_assert_int_eq(cuvmm_region_unmap(r, 0, G, NULL), CUVMM_OK);
		ck_assert_msg(tc_ctx_stats(ctx).held_bytes == G, "delay %lld ms: the free chunk was released",
			      (long long)kept[i]);
		cuvmm_region_destroy(r);
		cuvmm_ctx_destroy(ctx);
	}
}
END_TEST

START_TEST(test_size_limits)
{
	struct cuvmm_ctx *ctx = ctx_quiet(0);
	struct cuvmm_region *r, *x = NULL;
	struct cuvmm_pool_config pc;
	struct cuvmm_pool *p;
	struct cuvmm_kv_config kc;
	struct cuvmm_kv *kv = NULL;
	struct cuvmm_stats before, after;
	void *a = NULL;
	uint32_t id;

	ck_assert_int_eq(cuvmm_region_create(ctx, 0, 4 * G, &r), CUVMM_OK);
	before = tc_ctx_stats(ctx);
	/* region create: sizes whose rounding overflows */
	ck_assert_int_eq(cuvmm_region_create(ctx, 0, SIZE_MAX, &x), CUVMM_EINVAL);
	ck_assert_int_eq(cuvmm_region_create(ctx, 0, SIZE_MAX - G + 2, &x), CUVMM_EINVAL);
	ck_assert_int_eq(cuvmm_region_create_ex(ctx, 0, G, SIZE_MAX, &x), CUVMM_EINVAL);
	ck_assert_int_eq(cuvmm_region_create_ex(ctx, 0, G, (size_t)1 << 63, &x), CUVMM_EINVAL);
	ck_assert_ptr_null(x);
	/* map/unmap: offset + len past the end or wrapping around */
	ck_assert_int_eq(cuvmm_region_map(r, 4 * G, G), CUVMM_EINVAL);
	ck_assert_int_eq(cuvmm_region_map(r, G, SIZE_MAX - G + 1), CUVMM_EINVAL);
	ck_assert_int_eq(cuvmm_region_map(r, SIZE_MAX - G + 1, 2 * G), CUVMM_EINVAL);
	ck_assert_int_eq(cuvmm_region_map(r, 0, 4 * G + G), CUVMM_EINVAL);
	ck_assert_int_eq(cuvmm_region_unmap(r, G, SIZE_MAX - G + 1, NULL), CUVMM_EINVAL);
	ck_assert_int_eq(cuvmm_region_unmap(r, SIZE_MAX - G + 1, 2 * G, NULL), CUVMM_EINVAL);
	ck_assert_int_eq(cuvmm_region_resize(r, SIZE_MAX, NULL), CUVMM_EINVAL);
	ck_assert_int_eq(cuvmm_region_resize(r, 4 * G + 1, NULL), CUVMM_EINVAL);
	ck_assert_int_eq(cuvmm_region_resize(r, 4 * G, NULL), CUVMM_OK); /* the very end */
	ck_assert_int_eq(cuvmm_region_resize(r, 0, NULL), CUVMM_OK);
	/* pool: sizes at and past the address space, and whose rounding overflows */
	cuvmm_pool_config_init(&pc);
	pc.max_bytes = 8 * G;
	ck_assert_int_eq(cuvmm_pool_create(ctx, &pc, &p), CUVMM_OK);
	ck_assert_int_eq(cuvmm_malloc(p, SIZE_MAX, &a), CUVMM_ENOSPC);
	ck_assert_int_eq(cuvmm_malloc(p, SIZE_MAX - 255, &a), CUVMM_ENOSPC);
	ck_assert_int_eq(cuvmm_malloc(p, 8 * G + 1, &a), CUVMM_ENOSPC);
	ck_assert_int_eq(cuvmm_malloc_async(p, SIZE_MAX, (CUstream)(uintptr_t)1, &a), CUVMM_ENOSPC);
	ck_assert_ptr_null(a);
	ck_assert_int_eq(cuvmm_malloc(p, 8 * G, &a), CUVMM_OK); /* all of it */
	ck_assert_int_eq(cuvmm_free(p, (char *)a + 8 * G), CUVMM_EINVAL);
	ck_assert_int_eq(cuvmm_free(p, (void *)UINTPTR_MAX), CUVMM_EINVAL);
	ck_assert_int_eq(cuvmm_free(p, a), CUVMM_OK);
	ck_assert_int_eq(cuvmm_pool_trim(p, SIZE_MAX), CUVMM_OK);
	cuvmm_pool_destroy(p);
	pc.max_bytes = SIZE_MAX;
	p = NULL;
	ck_assert_int_eq(cuvmm_pool_create(ctx, &pc, &p), CUVMM_EINVAL);
	ck_assert_ptr_null(p);
	/* kv: block_bytes x max_blocks overflowing, ids past max_blocks */
	cuvmm_kv_config_init(&kc);
	kc.block_bytes = SIZE_MAX / 2 + 1;
	kc.max_blocks = 2;
	ck_assert_int_eq(cuvmm_kv_create(ctx, &kc, &kv), CUVMM_EINVAL);
	kc.block_bytes = SIZE_MAX;
	kc.max_blocks = 1;
	ck_assert_int_eq(cuvmm_kv_create(ctx, &kc, &kv), CUVMM_EINVAL);
	kc.block_bytes = G;
	kc.max_blocks = UINT32_MAX;
	kc.tensors = UINT32_MAX;
	ck_assert_int_eq(cuvmm_kv_create(ctx, &kc, &kv), CUVMM_EINVAL); /* no table of 2^32 tensors tried */
	kc.max_blocks = 1;
	ck_assert_int_eq(cuvmm_kv_create(ctx, &kc, &kv), CUVMM_EINVAL);
	kc.tensors = 65537;
	ck_assert_int_eq(cuvmm_kv_create(ctx, &kc, &kv), CUVMM_EINVAL);
	kc.block_bytes = (size_t)1 << 50; /* 2^50 x 2^14 tensors overflows */
	kc.tensors = (uint32_t)1 << 14;
	ck_assert_int_eq(cuvmm_kv_create(ctx, &kc, &kv), CUVMM_EINVAL);
	ck_assert_ptr_null(kv);
	kc.block_bytes = G;
	kc.max_blocks = 2;
	kc.tensors = 1;
	ck_assert_int_eq(cuvmm_kv_create(ctx, &kc, &kv), CUVMM_OK);
	ck_assert_int_eq(cuvmm_kv_alloc(kv, UINT32_MAX, &id), CUVMM_ENOSPC);
	ck_assert_int_eq(cuvmm_kv_alloc(kv, 3, &id), CUVMM_ENOSPC);
	id = 2;
	ck_assert_int_eq(cuvmm_kv_free(kv, 1, &id, NULL), CUVMM_EINVAL);
	id = UINT32_MAX;
	ck_assert_int_eq(cuvmm_kv_free(kv, 1, &id, NULL), CUVMM_EINVAL);
	ck_assert_int_eq(cuvmm_kv_free(kv, UINT32_MAX, &id, NULL), CUVMM_EINVAL);
	ck_assert_ptr_null(cuvmm_kv_tensor(kv, 1));
	ck_assert_ptr_null(cuvmm_kv_tensor(kv, UINT32_MAX));
	cuvmm_kv_destroy(kv);
	/* trim: any keep_bytes */
	ck_assert_int_eq(cuvmm_ctx_trim(ctx, 0, SIZE_MAX), CUVMM_OK);
	ck_assert_int_eq(cuvmm_ctx_trim(ctx, 1, 0), CUVMM_EINVAL);
	ck_assert_int_eq(cuvmm_ctx_trim(ctx, -2, 0), CUVMM_EINVAL);
	ck_assert_int_eq(cuvmm_ctx_trim(ctx, 0x7fffffff, 0), CUVMM_EINVAL);
	after = tc_ctx_stats(ctx);
	ck_assert_uint_eq(after.reserved_bytes, before.reserved_bytes);
	ck_assert_uint_eq(after.mapped_bytes, before.mapped_bytes);
	cuvmm_region_destroy(r);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

static Suite *reliability_suite(void)
{
	Suite *s = suite_create("reliability");
	TCase *tc = tcase_create("double_faults");

	tcase_set_timeout(tc, TC_TIMEOUT);
	tcase_add_checked_fixture(tc, NULL, teardown);
	tcase_add_loop_test(tc, test_map_undo_refused_region, 0, 2);
	tcase_add_test(tc, test_map_grant_refused);
	tcase_add_test(tc, test_map_undo_refused_malloc);
	tcase_add_test(tc, test_map_undo_refused_kv);
	tcase_add_loop_test(tc, test_wake_cleanup_refused_region, 0, 2);
	tcase_add_test(tc, test_wake_cleanup_refused_pool);
	tcase_add_test(tc, test_sleep_undo_refused);
	tcase_add_test(tc, test_limit_release_refused);
	suite_add_tcase(s, tc);

	tc = tcase_create("races");
	tcase_set_timeout(tc, TC_TIMEOUT);
	tcase_add_checked_fixture(tc, NULL, teardown);
	tcase_add_test(tc, test_malloc_races_sleep);
	tcase_add_test(tc, test_inject_fault_race);
	tcase_add_test(tc, test_stats_snapshot);
	suite_add_tcase(s, tc);

	tc = tcase_create("stress");
	tcase_set_timeout(tc, TC_TIMEOUT);
	tcase_add_checked_fixture(tc, NULL, teardown);
	tcase_add_test(tc, test_stress);
	suite_add_tcase(s, tc);

	tc = tcase_create("limits");
	tcase_set_timeout(tc, TC_TIMEOUT);
	tcase_add_test(tc, test_unreservable_enospc);
	tcase_add_test(tc, test_size_limits);
	tcase_add_test(tc, test_delay_limits);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	return tc_run(reliability_suite());
}
