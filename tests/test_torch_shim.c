/*
 * The PyTorch entry points (lib/torch.c) as PyTorch's pluggable allocator calls them, without PyTorch: malloc
 * and free with its signatures, per-thread named pools, record_stream, statistics in PyTorch's terms. The
 * integration has one process-wide context, so each test needs a process of its own (Check's CK_FORK, the
 * default): a test that finds the context made already fails, rather than checking what another left.
 */
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "common.h"

#define MiB TC_MiB
#define CVM_TC_MAX_DEVICES 64 /* the library's device limit (CVM_MAX_DEVICES) */

static struct cuvmm_torch_stats tstats(void)
{
	struct cuvmm_torch_stats s = {.size = sizeof(s)};

	ck_assert_int_eq(cuvmm_torch_stats(0, &s), CUVMM_OK);
	return s;
}

static void *named_worker(void *arg)
{
	void **out = arg;

	ck_assert_int_eq(cuvmm_torch_use_pool("worker"), CUVMM_OK);
	out[0] = cuvmm_torch_malloc(3 * MiB, 0, NULL);
	ck_assert_int_eq(cuvmm_torch_use_pool(NULL), CUVMM_OK);
	out[1] = cuvmm_torch_malloc(3 * MiB, 0, NULL);
	return NULL;
}

START_TEST(test_torch_entry_points)
{
	struct cuvmm_config cfg;
	struct cuvmm_torch_stats s;
	struct cuvmm_pool *def, *w, *again;
	struct cuvmm_stats ps = {.size = sizeof(ps)};
	CUstream s2;
	void *a, *b, *got[2];
	pthread_t t;
	char longname[64];

	ck_assert_ptr_null(cuvmm_torch_ctx());
	tc_config(&cfg);
	cfg.release_delay_ms = 50;
	ck_assert_int_eq(cuvmm_torch_init(&cfg), CUVMM_OK);
	ck_assert_int_eq(cuvmm_torch_init(&cfg), CUVMM_ESTATE);
	ck_assert_ptr_nonnull(cuvmm_torch_ctx());

	/* Size 0 and bad devices give NULL; freeing NULL is a no-op. */
	ck_assert_ptr_null(cuvmm_torch_malloc(0, 0, NULL));
	ck_assert_ptr_null(cuvmm_torch_malloc(1, -1, NULL));
	cuvmm_torch_free(NULL, 0, 0, NULL);

	a = cuvmm_torch_malloc(5 * MiB + 3, 0, NULL);
	ck_assert_ptr_nonnull(a);
	ck_assert_int_eq(tc_fill(a, (5 * MiB) / 4, 0x5a5a), 0);
	s = tstats();
	ck_assert_uint_eq(s.allocated_bytes, 5 * MiB + 3);
	ck_assert_uint_eq(s.allocations, 1);
	ck_assert_uint_ge(s.reserved_bytes, 6 * MiB);
	ck_assert_uint_ge(s.peak_reserved_bytes, s.reserved_bytes);

	/* record_stream: only for addresses of the integration's pools. */
	ck_assert_int_eq(tc_stream_create(&s2), 0);
	ck_assert_int_eq(cuvmm_torch_record_stream(a, s2), CUVMM_OK);
	ck_assert_int_eq(cuvmm_torch_record_stream(a, s2), CUVMM_OK);
	ck_assert_int_eq(cuvmm_torch_record_stream(&s, s2), CUVMM_EINVAL);
	ck_assert_int_eq(cuvmm_torch_record_stream(NULL, s2), CUVMM_EINVAL);
	cuvmm_torch_free(a, 5 * MiB + 3, 0, NULL);
	s = tstats();
	ck_assert_uint_eq(s.allocated_bytes, 0);
	ck_assert_uint_eq(s.peak_allocated_bytes, 5 * MiB + 3);
	ck_assert_uint_eq(s.allocation_count, 1);
	ck_assert_uint_eq(s.free_count, 1);
	ck_assert_int_eq(cuvmm_torch_reset_peak(0), CUVMM_OK);
	ck_assert_uint_eq(tstats().peak_allocated_bytes, 0);
	ck_assert_int_eq(cuvmm_torch_reset_totals(0), CUVMM_OK);
	ck_assert_uint_eq(tstats().allocation_count, 0);
	ck_assert_int_eq(cuvmm_torch_reset_peak(-1), CUVMM_EINVAL);
	s.size = 1;
	ck_assert_int_eq(cuvmm_torch_stats(0, &s), CUVMM_EINVAL);

	/* Stream-ordered reuse on the same (legacy) stream. */
	b = cuvmm_torch_malloc(5 * MiB, 0, NULL);
	ck_assert_ptr_eq(b, a);
	cuvmm_torch_free(b, 5 * MiB, 0, NULL);

	/* Named pools, per thread. */
	memset(longname, 'x', sizeof(longname) - 1);
	longname[sizeof(longname) - 1] = '\0';
	ck_assert_int_eq(cuvmm_torch_use_pool(longname), CUVMM_EINVAL);
	ck_assert_int_eq(cuvmm_torch_pool("worker", 0, &w), CUVMM_OK);
	ck_assert_int_eq(cuvmm_torch_pool("worker", 0, &again), CUVMM_OK);
	ck_assert_ptr_eq(w, again);
	ck_assert_int_eq(cuvmm_torch_pool(NULL, 0, &def), CUVMM_OK);
	ck_assert_ptr_ne(w, def);
	ck_assert_int_eq(cuvmm_torch_pool("worker", -1, &w), CUVMM_EINVAL);
	pthread_create(&t, NULL, named_worker, got);
	pthread_join(t, NULL);
	ck_assert_ptr_nonnull(got[0]);
	ck_assert_ptr_nonnull(got[1]);
	ck_assert_int_eq(cuvmm_pool_stats(w, &ps), CUVMM_OK);
	ck_assert_uint_eq(ps.live_bytes, 3 * MiB);
	/* This thread's allocations are still in the default pool. */
	a = cuvmm_torch_malloc(1 * MiB, 0, NULL);
	ck_assert_int_eq(cuvmm_pool_stats(w, &ps), CUVMM_OK);
	ck_assert_uint_eq(ps.live_bytes, 3 * MiB);
	/* A sleeping named pool keeps its addresses and contents. */
	ck_assert_int_eq(tc_fill(got[0], 3 * MiB / 4, 77), 0);
	ck_assert_int_eq(cuvmm_pool_sleep(w, CUVMM_SLEEP_OFFLOAD, NULL), CUVMM_OK);
	ck_assert_int_eq(cuvmm_pool_wake(w, NULL), CUVMM_OK);
	ck_assert_uint_eq(tc_check(got[0], 3 * MiB / 4, 77), 0);
	/* Frees find their pool by address. */
	cuvmm_torch_free(got[0], 3 * MiB, 0, NULL);
	cuvmm_torch_free(got[1], 3 * MiB, 0, NULL);
	cuvmm_torch_free(a, 1 * MiB, 0, NULL);
	ck_assert_int_eq(cuvmm_pool_stats(w, &ps), CUVMM_OK);
	ck_assert_uint_eq(ps.live_bytes, 0);
	ck_assert_uint_eq(tstats().allocated_bytes, 0);

	/* Idle memory goes back without a call. */
	ck_assert_uint_le(tc_wait_held_le(cuvmm_torch_ctx(), 0, 3000), 0);
	tc_stream_destroy(s2);
}
END_TEST

/* A named pool configured before its first use: its pools take the config (coarse handles here), an
 * unconfigured one keeps the defaults, and a name whose pools exist already cannot be configured. */
START_TEST(test_torch_pool_configure)
{
	struct cuvmm_config cfg;
	struct cuvmm_pool_config pc;
	struct cuvmm_pool *w, *def;
	struct cuvmm_ctx *ctx;
	uint64_t creates;
	void *a, *b, *d;

	tc_config(&cfg);
	cfg.release_delay_ms = -1;
	cfg.host_granularity = 2 * MiB;
	ck_assert_int_eq(cuvmm_torch_init(&cfg), CUVMM_OK);
	ctx = cuvmm_torch_ctx();

	cuvmm_pool_config_init(&pc);
	pc.coarse_bytes = 16 * MiB;
	ck_assert_int_eq(cuvmm_torch_pool_configure("weights", NULL), CUVMM_EINVAL);
	pc.size = offsetof(struct cuvmm_pool_config, coarse_bytes) - 1;
	ck_assert_int_eq(cuvmm_torch_pool_configure("weights", &pc), CUVMM_EINVAL);
	pc.size = sizeof(pc);
	ck_assert_int_eq(cuvmm_torch_pool_configure("weights", &pc), CUVMM_OK);
	pc.device = 5;   /* ignored */
	pc.name = "x";   /* ignored */
	ck_assert_int_eq(cuvmm_torch_pool_configure("weights", &pc), CUVMM_OK); /* replaces, no pool yet */

	/* 32 MiB in the configured pool: one handle. The default pool: 16 of one granule. */
	ck_assert_int_eq(cuvmm_torch_use_pool("weights"), CUVMM_OK);
	creates = cuvmm_ctx_call_count(ctx, CUVMM_CALL_CREATE);
	a = cuvmm_torch_malloc(32 * MiB, 0, NULL);
	ck_assert_ptr_nonnull(a);
	ck_assert_uint_eq(cuvmm_ctx_call_count(ctx, CUVMM_CALL_CREATE) - creates, 1);
	ck_assert_int_eq(cuvmm_torch_use_pool(NULL), CUVMM_OK);
	creates = cuvmm_ctx_call_count(ctx, CUVMM_CALL_CREATE);
	d = cuvmm_torch_malloc(32 * MiB, 0, NULL);
	ck_assert_ptr_nonnull(d);
	ck_assert_uint_eq(cuvmm_ctx_call_count(ctx, CUVMM_CALL_CREATE) - creates, 16);
	ck_assert_int_eq(tc_fill(a, 8 * MiB, 3), 0);
	ck_assert_int_eq(tc_fill(d, 8 * MiB, 4), 0);

	/* The pool was created on device 0 with its own name, and its config can no longer change. */
	ck_assert_int_eq(cuvmm_torch_pool("weights", 0, &w), CUVMM_OK);
	ck_assert_int_eq(cuvmm_torch_pool(NULL, 0, &def), CUVMM_OK);
	ck_assert_int_eq(cuvmm_torch_pool_configure("weights", &pc), CUVMM_ESTATE);
	ck_assert_int_eq(cuvmm_torch_pool_configure(NULL, &pc), CUVMM_ESTATE);
	ck_assert_int_eq(cuvmm_torch_pool_configure("", &pc), CUVMM_ESTATE);

	/* A bad value shows when the pool is created: the allocation gets NULL, the name stays usable. */
	pc.peer_access = (uint64_t)1 << 40; /* a device the context lacks */
	ck_assert_int_eq(cuvmm_torch_pool_configure("peers", &pc), CUVMM_OK);
	ck_assert_int_eq(cuvmm_torch_use_pool("peers"), CUVMM_OK);
	ck_assert_ptr_null(cuvmm_torch_malloc(2 * MiB, 0, NULL));
	ck_assert_int_eq(cuvmm_torch_pool("peers", 0, &w), CUVMM_EINVAL);
	pc.peer_access = 0;
	ck_assert_int_eq(cuvmm_torch_pool_configure("peers", &pc), CUVMM_OK);
	b = cuvmm_torch_malloc(2 * MiB, 0, NULL);
	ck_assert_ptr_nonnull(b);
	cuvmm_torch_free(b, 2 * MiB, 0, NULL);
	ck_assert_int_eq(cuvmm_torch_use_pool(NULL), CUVMM_OK);

	ck_assert_uint_eq(tc_check(a, 8 * MiB, 3), 0);
	ck_assert_int_eq(cuvmm_torch_pool("weights", 0, &w), CUVMM_OK);
	cuvmm_torch_free(a, 32 * MiB, 0, NULL);
	ck_assert_uint_eq(tc_check(d, 8 * MiB, 4), 0);
	cuvmm_torch_free(d, 32 * MiB, 0, NULL);
	ck_assert_int_eq(cuvmm_pool_trim(w, 0), CUVMM_OK);
	ck_assert_uint_eq(tc_pool_stats(w).held_bytes, 0);
	ck_assert_uint_eq(tstats().allocated_bytes, 0);
}
END_TEST

struct race {
	pthread_barrier_t go;
	char name[16];
	int configured;  /* what cuvmm_torch_pool_configure returned */
	uint64_t creates; /* chunks the first allocation created */
	void *p;
};

static void *race_configure(void *arg)
{
	struct race *r = arg;
	struct cuvmm_pool_config pc;

	cuvmm_pool_config_init(&pc);
	pc.coarse_bytes = 16 * MiB;
	pthread_barrier_wait(&r->go);
	r->configured = cuvmm_torch_pool_configure(r->name, &pc);
	return NULL;
}

static void *race_allocate(void *arg)
{
	struct race *r = arg;
	struct cuvmm_ctx *ctx = cuvmm_torch_ctx();
	uint64_t c0;

	ck_assert_int_eq(cuvmm_torch_use_pool(r->name), CUVMM_OK);
	c0 = cuvmm_ctx_call_count(ctx, CUVMM_CALL_CREATE);
	pthread_barrier_wait(&r->go);
	r->p = cuvmm_torch_malloc(32 * MiB, 0, NULL);
	r->creates = cuvmm_ctx_call_count(ctx, CUVMM_CALL_CREATE) - c0;
	return NULL;
}

/* A config racing the first allocation of its name: either the config came first and the pool has it
 * (32 MiB on one handle), or the pool came first, the config was refused with ESTATE and the pool has the
 * defaults (16 handles). Never a config accepted that its pool lacks, or refused when the pool has it. */
START_TEST(test_torch_pool_configure_race)
{
	struct cuvmm_config cfg;
	unsigned first = 0, later = 0;

	tc_config(&cfg);
	cfg.release_delay_ms = -1;
	cfg.host_granularity = 2 * MiB;
	ck_assert_int_eq(cuvmm_torch_init(&cfg), CUVMM_OK);
	for (int i = 0; i < 15; i++) { /* the names of the integration, less the default pool's */
		struct race r = {0};
		struct cuvmm_pool *pool;
		pthread_t a, b;

		snprintf(r.name, sizeof(r.name), "race%d", i);
		ck_assert_int_eq(pthread_barrier_init(&r.go, NULL, 2), 0);
		ck_assert_int_eq(pthread_create(&a, NULL, race_configure, &r), 0);
		ck_assert_int_eq(pthread_create(&b, NULL, race_allocate, &r), 0);
		pthread_join(a, NULL);
		pthread_join(b, NULL);
		pthread_barrier_destroy(&r.go);
		ck_assert_ptr_nonnull(r.p);
		if (r.configured == CUVMM_OK) {
			ck_assert_uint_eq(r.creates, 1);
			first++;
		} else {
			ck_assert_int_eq(r.configured, CUVMM_ESTATE);
			ck_assert_uint_eq(r.creates, 16);
			later++;
		}
		ck_assert_int_eq(tc_fill(r.p, MiB, (uint8_t)i), 0);
		ck_assert_uint_eq(tc_check(r.p, MiB, (uint8_t)i), 0);
		ck_assert_int_eq(cuvmm_torch_pool(r.name, 0, &pool), CUVMM_OK);
		cuvmm_torch_free(r.p, 32 * MiB, 0, NULL);
		ck_assert_int_eq(cuvmm_pool_trim(pool, 0), CUVMM_OK);
		ck_assert_uint_eq(tc_pool_stats(pool).held_bytes, 0);
	}
	ck_assert_uint_eq(first + later, 15);
	ck_assert_uint_eq(tstats().allocated_bytes, 0);
}
END_TEST

/* Names: "torch" is the default pool's own name; a lookup on a device the context lacks fails without
 * taking a name; every name has a pool on every device (16 names x 8 host devices: 128 pools). */
START_TEST(test_torch_pool_names)
{
	struct cuvmm_config cfg;
	struct cuvmm_pool_config pc;
	struct cuvmm_pool *a, *b;
	char name[16];
	int ndev;

	tc_config(&cfg);
	cfg.host_devices = 8;
	cfg.release_delay_ms = -1;
	cfg.device_limit_bytes = 64 * MiB; /* pools reserve 1 GiB each, not twice the device: 136 of them */
	ck_assert_int_eq(cuvmm_torch_init(&cfg), CUVMM_OK);
	ck_assert_int_eq(cuvmm_ctx_device_count(cuvmm_torch_ctx(), &ndev), CUVMM_OK);

	ck_assert_int_eq(cuvmm_torch_pool("torch", 0, &a), CUVMM_OK);
	ck_assert_int_eq(cuvmm_torch_pool(NULL, 0, &b), CUVMM_OK);
	ck_assert_ptr_eq(a, b);
	cuvmm_pool_config_init(&pc);
	ck_assert_int_eq(cuvmm_torch_pool_configure("torch", &pc), CUVMM_ESTATE);
	ck_assert_int_eq(cuvmm_torch_use_pool("torch"), CUVMM_OK);
	ck_assert_int_eq(cuvmm_torch_use_pool(NULL), CUVMM_OK);

	/* Failed lookups on a device the context lacks: ENODEV, and no name is taken by them. */
	for (int i = 0; i < 20; i++) {
		snprintf(name, sizeof(name), "bad%d", i);
		ck_assert_int_eq(cuvmm_torch_pool(name, ndev, &a), CUVMM_ENODEV);
	}
	ck_assert_int_eq(cuvmm_torch_pool("x", CVM_TC_MAX_DEVICES, &a), CUVMM_EINVAL);

	/* 15 names besides the default, each with a pool on every device; the 16th name is refused. */
	for (int i = 1; i <= 15; i++) {
		snprintf(name, sizeof(name), "n%d", i);
		for (int d = 0; d < ndev; d++) {
			ck_assert_int_eq(cuvmm_torch_pool(name, d, &a), CUVMM_OK);
			ck_assert_int_eq(cuvmm_torch_pool(name, d, &b), CUVMM_OK);
			ck_assert_ptr_eq(a, b);
		}
	}
	for (int d = 0; d < ndev; d++)
		ck_assert_int_eq(cuvmm_torch_pool(NULL, d, &a), CUVMM_OK);
	ck_assert_int_eq(cuvmm_torch_use_pool("n16"), CUVMM_ENOSPC);
	ck_assert_int_eq(cuvmm_torch_pool("n16", 0, &a), CUVMM_ENOSPC);
	ck_assert_int_eq(cuvmm_torch_use_pool("n15"), CUVMM_OK);
	ck_assert_int_eq(cuvmm_torch_use_pool(NULL), CUVMM_OK);
}
END_TEST

static Suite *suite(void)
{
	Suite *s = suite_create("torch_shim");
	TCase *tc = tcase_create("torch_shim");

	tcase_set_timeout(tc, TC_TIMEOUT);
	tcase_add_test(tc, test_torch_entry_points);
	tcase_add_test(tc, test_torch_pool_configure);
	tcase_add_test(tc, test_torch_pool_configure_race);
	tcase_add_test(tc, test_torch_pool_names);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	return tc_run(suite());
}
