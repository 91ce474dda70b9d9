/*
 * Several devices (issue #13): objects on two devices, peer access granted by every kind of map, refused where
 * a pair of devices cannot reach each other, a failing grant that leaves nothing mapped, statistics per device,
 * and a trim or release of one device that does not wait for another's GPU work.
 *
 * The host backend emulates two devices (host_devices = 2) and records which devices were granted each
 * mapping (cvm_host_access); the CUDA variant needs two GPUs and skips with fewer, and checks access by
 * running device 0's kernels on device 1's memory.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common.h"
#include "drv_test.h"

#define GRAN (2 * TC_MiB)
#define BOTH ((uint64_t)3)

static struct cuvmm_ctx *ctx_two(uint64_t peers, int64_t delay_ms)
{
	struct cuvmm_config cfg;

	tc_config(&cfg);
	cfg.host_devices = 2;
	cfg.peer_access = peers;
	cfg.release_delay_ms = delay_ms;
	return tc_ctx(&cfg);
}

static struct cuvmm_pool *pool_on(struct cuvmm_ctx *ctx, int device, uint64_t peers)
{
	struct cuvmm_pool_config pc;
	struct cuvmm_pool *p = NULL;

	cuvmm_pool_config_init(&pc);
	pc.device = device;
	pc.max_bytes = 256 * TC_MiB;
	pc.peer_access = peers;
	ck_assert_int_eq(cuvmm_pool_create(ctx, &pc, &p), CUVMM_OK);
	return p;
}

static struct cuvmm_stats dev_stats(struct cuvmm_ctx *ctx, int device)
{
	struct cuvmm_stats st = {.size = sizeof(st)};

	ck_assert_int_eq(cuvmm_ctx_stats(ctx, device, &st), CUVMM_OK);
	return st;
}

/* On the host, the devices granted the mapping at p; on CUDA, what the test can show: device 0 (whose
 * kernels gpu.c runs) reads and writes it, so its bit is set when that works. */
static void expect_access(void *p, uint64_t want)
{
	if (tc_on_host()) {
		ck_assert_msg(cvm_host_access(p) == want, "access %#llx, want %#llx",
			      (unsigned long long)cvm_host_access(p), (unsigned long long)want);
		return;
	}
	if (want & 1) {
		ck_assert_int_eq(tc_fill(p, GRAN / 4, 0x5eed), 0);
		ck_assert_uint_eq(tc_check(p, GRAN / 4, 0x5eed), 0);
	}
}

/* Objects on both devices; what each holds shows in its own device's statistics alone. */
START_TEST(test_two_devices)
{
	struct cuvmm_ctx *ctx = ctx_two(0, -1);
	struct cuvmm_pool *p0 = pool_on(ctx, 0, 0), *p1 = pool_on(ctx, 1, 0);
	void *a = NULL, *b = NULL;
	int n = 0;

	ck_assert_int_eq(cuvmm_ctx_device_count(ctx, &n), CUVMM_OK);
	ck_assert_int_eq(n, 2);
	ck_assert_int_eq(cuvmm_malloc(p0, 3 * GRAN, &a), CUVMM_OK);
	ck_assert_int_eq(cuvmm_malloc(p1, 5 * GRAN, &b), CUVMM_OK);
	ck_assert_uint_eq(dev_stats(ctx, 0).live_bytes, 3 * GRAN);
	ck_assert_uint_eq(dev_stats(ctx, 1).live_bytes, 5 * GRAN);
	ck_assert_uint_eq(dev_stats(ctx, 0).held_bytes, 3 * GRAN);
	ck_assert_uint_eq(dev_stats(ctx, 1).held_bytes, 5 * GRAN);
	expect_access(a, 1);
	if (tc_on_host())
		expect_access(b, 2);
	ck_assert_int_eq(cuvmm_free(p0, a), CUVMM_OK);
	ck_assert_int_eq(cuvmm_free(p1, b), CUVMM_OK);
	/* A trim of device 0 gives back device 0's memory and leaves device 1's alone. */
	ck_assert_int_eq(cuvmm_ctx_trim(ctx, 0, 0), CUVMM_OK);
	ck_assert_uint_eq(dev_stats(ctx, 0).held_bytes, 0);
	ck_assert_uint_eq(dev_stats(ctx, 1).held_bytes, 5 * GRAN);
	ck_assert_int_eq(cuvmm_ctx_trim(ctx, 1, 0), CUVMM_OK);
	ck_assert_uint_eq(dev_stats(ctx, 1).held_bytes, 0);
	ck_assert_int_eq(cuvmm_ctx_trim(ctx, 2, 0), CUVMM_EINVAL);
	cuvmm_pool_destroy(p0);
	cuvmm_pool_destroy(p1);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/* The context's peer_access: pool, region and kv maps on either device grant both devices. */
START_TEST(test_peers_every_map)
{
	struct cuvmm_ctx *ctx = ctx_two(CUVMM_PEERS_ALL, -1);
	struct cuvmm_pool *p = pool_on(ctx, 1, 0);
	struct cuvmm_region *r = NULL;
	struct cuvmm_kv_config kc;
	struct cuvmm_kv *kv = NULL;
	uint32_t id;
	void *a = NULL;

	ck_assert_int_eq(cuvmm_malloc(p, 2 * GRAN, &a), CUVMM_OK);
	expect_access(a, BOTH);
	ck_assert_int_eq(cuvmm_region_create(ctx, 1, 8 * GRAN, &r), CUVMM_OK);
	ck_assert_uint_eq(cuvmm_region_peers(r), BOTH);
	ck_assert_int_eq(cuvmm_region_map(r, GRAN, 2 * GRAN), CUVMM_OK);
	expect_access((char *)cuvmm_region_base(r) + GRAN, BOTH);
	cuvmm_kv_config_init(&kc);
	kc.device = 1;
	kc.block_bytes = GRAN;
	kc.max_blocks = 8;
	ck_assert_int_eq(cuvmm_kv_create(ctx, &kc, &kv), CUVMM_OK);
	ck_assert_int_eq(cuvmm_kv_alloc(kv, 1, &id), CUVMM_OK);
	expect_access((char *)cuvmm_kv_tensor(kv, 0) + (size_t)id * GRAN, BOTH);
	/* A wake maps again: it grants the peers too. */
	ck_assert_int_eq(tc_fill(a, 2 * GRAN / 4, 7), 0);
	ck_assert_int_eq(cuvmm_pool_sleep(p, CUVMM_SLEEP_OFFLOAD, NULL), CUVMM_OK);
	if (tc_on_host())
		ck_assert_uint_eq(cvm_host_access(a), 0);
	ck_assert_int_eq(cuvmm_pool_wake(p, NULL), CUVMM_OK);
	ck_assert_uint_eq(tc_check(a, 2 * GRAN / 4, 7), 0);
	expect_access(a, BOTH);
	cuvmm_kv_destroy(kv);
	cuvmm_region_destroy(r);
	cuvmm_pool_destroy(p);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/* Without peer_access, a mapping is its own device's alone; an object's peer_access overrides the
 * context's, both ways. */
START_TEST(test_peers_override)
{
	struct cuvmm_ctx *ctx;
	struct cuvmm_pool *p;
	void *a = NULL;

	if (!tc_on_host())
		return; /* no way to see access that is absent without faulting the context */
	ctx = ctx_two(0, -1);
	p = pool_on(ctx, 0, 0);
	ck_assert_int_eq(cuvmm_malloc(p, GRAN, &a), CUVMM_OK);
	expect_access(a, 1);
	cuvmm_pool_destroy(p);
	p = pool_on(ctx, 0, CUVMM_PEERS_ALL);
	ck_assert_int_eq(cuvmm_malloc(p, GRAN, &a), CUVMM_OK);
	expect_access(a, BOTH);
	cuvmm_pool_destroy(p);
	cuvmm_ctx_destroy(ctx);

	ctx = ctx_two(CUVMM_PEERS_ALL, -1);
	p = pool_on(ctx, 1, (uint64_t)1 << 1); /* its own device only */
	ck_assert_int_eq(cuvmm_malloc(p, GRAN, &a), CUVMM_OK);
	expect_access(a, 2);
	cuvmm_pool_destroy(p);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/* Where a device cannot reach another's memory: creation refused with ENOTSUP, nothing reserved; bits
 * naming devices the context lacks are EINVAL. */
START_TEST(test_peers_refused)
{
	struct cuvmm_config cfg;
	struct cuvmm_ctx *ctx, *bad = NULL;
	struct cuvmm_pool_config pc;
	struct cuvmm_pool *p = NULL;
	struct cuvmm_region *r = NULL;
	bool can = true;

	if (!tc_on_host())
		return; /* the H200 pairs all reach each other */
	cvm_host_peer_deny(1, 0, true); /* device 1 cannot access device 0's memory */
	ctx = ctx_two(0, -1);
	ck_assert_int_eq(cuvmm_ctx_can_access_peer(ctx, 1, 0, &can), CUVMM_OK);
	ck_assert(!can);
	ck_assert_int_eq(cuvmm_ctx_can_access_peer(ctx, 0, 1, &can), CUVMM_OK);
	ck_assert(can);
	ck_assert_int_eq(cuvmm_ctx_can_access_peer(ctx, 0, 2, &can), CUVMM_EINVAL);
	cuvmm_pool_config_init(&pc);
	pc.device = 0;
	pc.peer_access = CUVMM_PEERS_ALL;
	ck_assert_int_eq(cuvmm_pool_create(ctx, &pc, &p), CUVMM_ENOTSUP);
	ck_assert_ptr_null(p);
	ck_assert_int_eq(cuvmm_last_driver_error(), CUDA_ERROR_PEER_ACCESS_UNSUPPORTED);
	ck_assert_uint_eq(dev_stats(ctx, 0).reserved_bytes, 0);
	pc.peer_access = (uint64_t)1 << 5;
	ck_assert_int_eq(cuvmm_pool_create(ctx, &pc, &p), CUVMM_EINVAL);
	/* The other direction works. */
	pc.device = 1;
	pc.peer_access = CUVMM_PEERS_ALL;
	ck_assert_int_eq(cuvmm_pool_create(ctx, &pc, &p), CUVMM_OK);
	cuvmm_pool_destroy(p);
	ck_assert_int_eq(cuvmm_ctx_add_peer(ctx, 0, 1), CUVMM_ENOTSUP);
	ck_assert_int_eq(cuvmm_region_create(ctx, 0, 4 * GRAN, &r), CUVMM_OK);
	ck_assert_uint_eq(cuvmm_region_peers(r), 1);
	cuvmm_region_destroy(r);
	r = NULL;
	cuvmm_ctx_destroy(ctx);

	/* The context's own setting: regions refused too. */
	ctx = ctx_two(CUVMM_PEERS_ALL, -1);
	ck_assert_int_eq(cuvmm_region_create(ctx, 0, 4 * GRAN, &r), CUVMM_ENOTSUP);
	ck_assert_ptr_null(r);
	ck_assert_int_eq(cuvmm_region_create(ctx, 1, 4 * GRAN, &r), CUVMM_OK);
	cuvmm_region_destroy(r);
	cuvmm_ctx_destroy(ctx);
	cvm_host_peer_deny(1, 0, false);

	tc_config(&cfg);
	cfg.host_devices = 2;
	cfg.peer_access = (uint64_t)1 << 2;
	ck_assert_int_eq(tc_ctx_create(&cfg, &bad), CUVMM_EINVAL);
	ck_assert_ptr_null(bad);
	cfg.peer_access = 0;
	cfg.host_devices = 65;
	ck_assert_int_eq(tc_ctx_create(&cfg, &bad), CUVMM_EINVAL);
}
END_TEST

/* A grant refused by the driver leaves nothing mapped; a failing peer query fails the creation cleanly. */
START_TEST(test_peers_faults)
{
	struct cuvmm_ctx *ctx = ctx_two(CUVMM_PEERS_ALL, -1);
	struct cuvmm_region *r = NULL;
	struct cuvmm_pool_config pc;
	struct cuvmm_pool *p = NULL;
	struct cuvmm_stats before, after;
	void *a = NULL;

	ck_assert_int_eq(cuvmm_region_create(ctx, 0, 8 * GRAN, &r), CUVMM_OK);
	before = dev_stats(ctx, 0);
	ck_assert_int_eq(cuvmm_ctx_inject_fault(ctx, CUVMM_CALL_SET_ACCESS, 0, 1, CUVMM_EDRIVER), CUVMM_OK);
	ck_assert_int_eq(cuvmm_region_map(r, 0, 4 * GRAN), CUVMM_EDRIVER);
	after = dev_stats(ctx, 0);
	ck_assert_uint_eq(after.mapped_bytes, before.mapped_bytes);
	ck_assert_uint_eq(after.live_bytes, before.live_bytes);
	if (tc_on_host())
		ck_assert_uint_eq(cvm_host_access(cuvmm_region_base(r)), 0);
	ck_assert_int_eq(cuvmm_region_map(r, 0, 4 * GRAN), CUVMM_OK);
	expect_access(cuvmm_region_base(r), BOTH);
	cuvmm_region_destroy(r);

	p = pool_on(ctx, 1, 0);
	ck_assert_int_eq(cuvmm_ctx_inject_fault(ctx, CUVMM_CALL_SET_ACCESS, 0, 1, CUVMM_EDRIVER), CUVMM_OK);
	ck_assert_int_eq(cuvmm_malloc(p, 3 * GRAN, &a), CUVMM_EDRIVER);
	ck_assert_uint_eq(dev_stats(ctx, 1).mapped_bytes, 0);
	ck_assert_uint_eq(dev_stats(ctx, 1).live_bytes, 0);
	cuvmm_pool_destroy(p);
	p = NULL;

	cuvmm_pool_config_init(&pc);
	pc.device = 0;
	ck_assert_int_eq(cuvmm_ctx_inject_fault(ctx, CUVMM_CALL_PEER_QUERY, 0, 1, CUVMM_EDRIVER), CUVMM_OK);
	ck_assert_int_eq(cuvmm_pool_create(ctx, &pc, &p), CUVMM_EDRIVER);
	ck_assert_ptr_null(p);
	ck_assert_uint_eq(dev_stats(ctx, 0).reserved_bytes, 0);
	ck_assert_uint_ge(cuvmm_ctx_call_count(ctx, CUVMM_CALL_PEER_QUERY), 1);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/* A peer added later gets what is mapped already (live and pending unmap), later maps, and later objects;
 * a refused grant fails the call, and calling again completes it. */
START_TEST(test_add_peer)
{
	struct cuvmm_ctx *ctx = ctx_two(0, -1);
	struct cuvmm_region *r = NULL, *r2 = NULL;
	struct cuvmm_pool *p = pool_on(ctx, 0, 0);
	CUstream s;
	char *base;
	void *a = NULL;

	ck_assert_int_eq(tc_stream_create(&s), 0);
	ck_assert_int_eq(cuvmm_malloc(p, 2 * GRAN, &a), CUVMM_OK);
	ck_assert_int_eq(cuvmm_region_create(ctx, 0, 8 * GRAN, &r), CUVMM_OK);
	base = cuvmm_region_base(r);
	ck_assert_int_eq(cuvmm_region_map(r, 0, 4 * GRAN), CUVMM_OK);
	if (tc_on_host()) {
		cvm_host_gate_close_dev(0);
		ck_assert_int_eq(cuvmm_region_unmap(r, 2 * GRAN, 2 * GRAN, s), CUVMM_OK); /* pending */
		ck_assert_uint_eq(cvm_host_access(base + 3 * GRAN), 1);
	}
	ck_assert_int_eq(cuvmm_ctx_inject_fault(ctx, CUVMM_CALL_SET_ACCESS, 1, 1, CUVMM_EDRIVER), CUVMM_OK);
	ck_assert_int_eq(cuvmm_ctx_add_peer(ctx, 0, 1), CUVMM_EDRIVER);
	ck_assert_int_eq(cuvmm_ctx_add_peer(ctx, 0, 1), CUVMM_OK);
	ck_assert_int_eq(cuvmm_ctx_add_peer(ctx, 0, 1), CUVMM_OK); /* again: nothing to do */
	ck_assert_int_eq(cuvmm_ctx_add_peer(ctx, 0, 0), CUVMM_OK);
	ck_assert_int_eq(cuvmm_ctx_add_peer(ctx, 0, 2), CUVMM_EINVAL);
	ck_assert_uint_eq(cuvmm_region_peers(r), BOTH);
	expect_access(a, BOTH);
	expect_access(base, BOTH);
	if (tc_on_host()) {
		ck_assert_uint_eq(cvm_host_access(base + 3 * GRAN), BOTH);
		cvm_host_gate_open_dev(0);
	}
	ck_assert_int_eq(cuvmm_region_map(r, 4 * GRAN, 2 * GRAN), CUVMM_OK);
	expect_access(base + 4 * GRAN, BOTH);
	ck_assert_int_eq(cuvmm_region_create(ctx, 0, 4 * GRAN, &r2), CUVMM_OK);
	ck_assert_uint_eq(cuvmm_region_peers(r2), BOTH);
	if (tc_on_host()) { /* device 1's memory is not affected */
		struct cuvmm_region *r3 = NULL;

		ck_assert_int_eq(cuvmm_region_create(ctx, 1, 4 * GRAN, &r3), CUVMM_OK);
		ck_assert_uint_eq(cuvmm_region_peers(r3), 2);
		cuvmm_region_destroy(r3);
	}
	cuvmm_region_destroy(r2);
	cuvmm_region_destroy(r);
	cuvmm_pool_destroy(p);
	tc_stream_destroy(s);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

struct trim_arg {
	struct cuvmm_ctx *ctx;
	int device;
	volatile int done;
	int err;
};

static void *trim_main(void *arg)
{
	struct trim_arg *t = arg;

	t->err = cuvmm_ctx_trim(t->ctx, t->device, 0);
	t->done = 1;
	return NULL;
}

/* Wait (generously) for a condition another thread makes true. */
static bool wait_for(volatile int *flag, int timeout_ms)
{
	uint64_t end = tc_now_ms() + (uint64_t)timeout_ms;

	while (!*flag && tc_now_ms() < end)
		tc_sleep_ms(1);
	return *flag != 0;
}

/*
 * A peer added while the reclaim pass unmaps free memory without the region's lock: the chunks being unmapped
 * are not granted (the driver refuses access to a range partly unmapped). Before the fix, cuvmm_ctx_add_peer
 * returned an error in rounds whose add fell inside the pass (about one run of this test in two with 24 rounds).
 */
START_TEST(test_add_peer_during_reclaim)
{
	for (int round = 0; round < 64; round++) {
		struct cuvmm_ctx *ctx = ctx_two(1, 1);
		struct cuvmm_pool *p = pool_on(ctx, 0, 0);
		void *a[32];

		for (int i = 0; i < 32; i++)
			ck_assert_int_eq(cuvmm_malloc(p, 4 * TC_MiB, &a[i]), CUVMM_OK);
		for (int i = 0; i < 32; i++)
			ck_assert_int_eq(cuvmm_free(p, a[i]), CUVMM_OK);
		tc_sleep_ms(round % 4);
		ck_assert_int_eq(cuvmm_ctx_add_peer(ctx, 0, 1), CUVMM_OK);
		cuvmm_pool_destroy(p);
		cuvmm_ctx_destroy(ctx);
	}
}
END_TEST

/* A trim of device 0 waiting for its GPU work holds up neither a trim of device 1 nor the background
 * thread's release of device 1's idle memory. */
START_TEST(test_trim_independent)
{
	struct cuvmm_ctx *ctx;
	struct cuvmm_region *r0 = NULL;
	struct cuvmm_pool *p1;
	struct trim_arg t0 = {0}, t1 = {0};
	pthread_t th0, th1;
	CUstream s;
	void *a = NULL, *b = NULL;
	volatile int waiting = 0;
	bool ok;

	if (!tc_on_host())
		return; /* the blocked GPU work is the host gate's */
	ctx = ctx_two(0, 50);
	ck_assert_int_eq(tc_stream_create(&s), 0);
	ck_assert_int_eq(cuvmm_region_create(ctx, 0, 4 * GRAN, &r0), CUVMM_OK);
	ck_assert_int_eq(cuvmm_region_map(r0, 0, 2 * GRAN), CUVMM_OK);
	p1 = pool_on(ctx, 1, 0);
	ck_assert_int_eq(cuvmm_malloc(p1, 4 * GRAN, &a), CUVMM_OK);
	ck_assert_int_eq(cuvmm_malloc(p1, 2 * GRAN, &b), CUVMM_OK);

	cvm_host_gate_close_dev(0);
	ck_assert_int_eq(cuvmm_region_unmap(r0, 0, 2 * GRAN, s), CUVMM_OK); /* fenced behind device 0's work */
	t0.ctx = ctx;
	t0.device = 0;
	ck_assert_int_eq(pthread_create(&th0, NULL, trim_main, &t0), 0);
	for (uint64_t end = tc_now_ms() + 10000; !waiting && tc_now_ms() < end; tc_sleep_ms(1))
		waiting = cvm_host_gate_waiters(0) > 0;
	ck_assert_msg(waiting, "the trim of device 0 never waited for its fence");
	ck_assert(!t0.done);

	/* Device 1 is served meanwhile: a trim returns, and the background thread releases idle memory. */
	ck_assert_int_eq(cuvmm_free(p1, a), CUVMM_OK);
	t1.ctx = ctx;
	t1.device = 1;
	ck_assert_int_eq(pthread_create(&th1, NULL, trim_main, &t1), 0);
	ok = wait_for(&t1.done, 10000);
	ck_assert_msg(ok, "a trim of device 1 waited for device 0's GPU work");
	ck_assert_int_eq(t1.err, CUVMM_OK);
	ck_assert_uint_eq(dev_stats(ctx, 1).held_bytes, 2 * GRAN);
	ck_assert_int_eq(cuvmm_free(p1, b), CUVMM_OK);
	for (uint64_t end = tc_now_ms() + 10000; dev_stats(ctx, 1).held_bytes && tc_now_ms() < end;)
		tc_sleep_ms(5);
	ck_assert_uint_eq(dev_stats(ctx, 1).held_bytes, 0);
	ck_assert(!t0.done);
	ck_assert_uint_eq(dev_stats(ctx, 0).mapped_bytes, 2 * GRAN);

	cvm_host_gate_open_dev(0);
	pthread_join(th0, NULL);
	pthread_join(th1, NULL);
	ck_assert_int_eq(t0.err, CUVMM_OK);
	ck_assert_uint_eq(dev_stats(ctx, 0).held_bytes, 0);
	cuvmm_pool_destroy(p1);
	cuvmm_region_destroy(r0);
	tc_stream_destroy(s);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/* The host gate and captures of one device do not hold up the other's synchronisations. */
START_TEST(test_host_devices_apart)
{
	struct cuvmm_ctx *ctx;
	struct cuvmm_pool *p0, *p1;
	void *a = NULL;
	uint64_t syncs;

	if (!tc_on_host())
		return;
	ctx = ctx_two(0, -1);
	p0 = pool_on(ctx, 0, 0);
	p1 = pool_on(ctx, 1, 0);
	void *z = NULL;

	ck_assert_int_eq(cuvmm_malloc(p1, GRAN, &a), CUVMM_OK);
	ck_assert_int_eq(cuvmm_malloc(p0, GRAN, &z), CUVMM_OK);
	ck_assert_int_eq(cuvmm_free(p0, z), CUVMM_OK); /* its unmap needs a synchronisation of device 0 */
	cvm_host_gate_close_dev(1);
	/* A capture on a stream of device 1 does not stop device 0 from synchronising. */
	ck_assert_uint_ne(cvm_host_capture_begin_dev((CUstream)&a, 1), 0);
	syncs = cuvmm_ctx_call_count(ctx, CUVMM_CALL_DEVICE_SYNC);
	ck_assert_int_eq(cuvmm_ctx_trim(ctx, 0, 0), CUVMM_OK);
	ck_assert_uint_gt(cuvmm_ctx_call_count(ctx, CUVMM_CALL_DEVICE_SYNC), syncs);
	ck_assert_uint_eq(dev_stats(ctx, 0).held_bytes, 0);
	ck_assert(cvm_host_capture_end((CUstream)&a));
	cvm_host_gate_open_dev(1);
	ck_assert_int_eq(cuvmm_free(p1, a), CUVMM_OK);
	cuvmm_pool_destroy(p0);
	cuvmm_pool_destroy(p1);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/* The environment: CUVMM_HOST_DEVICES and CUVMM_PEER_ACCESS. */
START_TEST(test_env)
{
	struct cuvmm_config cfg;

	tc_env_set("CUVMM_HOST_DEVICES", "3");
	tc_env_set("CUVMM_PEER_ACCESS", "all");
	cuvmm_config_init(&cfg);
	ck_assert_int_eq(cfg.host_devices, 3);
	ck_assert(cfg.peer_access == CUVMM_PEERS_ALL);
	tc_env_set("CUVMM_HOST_DEVICES", "0");
	tc_env_set("CUVMM_PEER_ACCESS", "some");
	cuvmm_config_init(&cfg);
	ck_assert_int_eq(cfg.host_devices, 1);
	ck_assert(cfg.peer_access == 0);
	tc_env_set("CUVMM_HOST_DEVICES", "65");
	cuvmm_config_init(&cfg);
	ck_assert_int_eq(cfg.host_devices, 1);
	tc_env_restore();
}
END_TEST

/* The CUDA variant needs two GPUs: asked in a child, as CUDA must not start in the forking parent. */
static int two_gpus(void *arg)
{
	struct cuvmm_config cfg;
	struct cuvmm_ctx *ctx = NULL;
	int n = 0;

	(void)arg;
	cuvmm_config_init(&cfg);
	cfg.backend = CUVMM_BACKEND_CUDA;
	if (cuvmm_ctx_create(&cfg, &ctx))
		return 77;
	cuvmm_ctx_device_count(ctx, &n);
	cuvmm_ctx_destroy(ctx);
	return n >= 2 ? 0 : 77;
}

int main(void)
{
	Suite *s = suite_create("multi");
	TCase *tc = tcase_create("multi");
	char buf[4096];

	if (!tc_on_host() && tc_in_child(two_gpus, NULL, buf, sizeof(buf)) != 0) {
		printf("fewer than two GPUs: skipped\n");
		return 77;
	}
	tcase_set_timeout(tc, TC_TIMEOUT);
	tcase_add_test(tc, test_two_devices);
	tcase_add_test(tc, test_peers_every_map);
	tcase_add_test(tc, test_peers_override);
	tcase_add_test(tc, test_peers_refused);
	tcase_add_test(tc, test_peers_faults);
	tcase_add_test(tc, test_add_peer);
	tcase_add_test(tc, test_add_peer_during_reclaim);
	tcase_add_test(tc, test_trim_independent);
	tcase_add_test(tc, test_host_devices_apart);
	tcase_add_test(tc, test_env);
	suite_add_tcase(s, tc);
	return tc_run(s);
}
