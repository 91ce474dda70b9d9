/*
 * The physical memory layer (lib/phys.c), through its internal header: the chunk cache (reuse, size classes,
 * most recently freed first), the limit and the trade rule, timed release with retain_bytes, trim's
 * keep_bytes, a cvm_phys made from its parameters alone (limit, policy, wake-up), and driver failures.
 */
#include <stdio.h>
#include <string.h>

#include "common.h"
#include "ctx.h"

#define G (2 * TC_MiB)

struct fixture {
	struct cuvmm_ctx *ctx;
	struct cvm_dev *dev;
	struct cvm_phys *p;
};

/* A context with the given delay/retain/limit, its device 0 opened. No background thread: these tests drive
 * cvm_phys_reclaim themselves, with the clock they choose. */
static struct fixture setup_fx(int64_t delay_ms, size_t retain, size_t limit)
{
	struct cuvmm_config cfg;
	struct fixture fx;

	tc_config(&cfg);
	cfg.release_delay_ms = delay_ms;
	cfg.retain_bytes = retain;
	cfg.device_limit_bytes = limit;
	cfg.background_release = false;
	fx.ctx = tc_ctx(&cfg);
	ck_assert_int_eq(cvm_ctx_dev(fx.ctx, 0, &fx.dev), CUVMM_OK);
	ck_assert_uint_eq(fx.dev->info.granularity, G);
	fx.p = &fx.dev->phys;
	return fx;
}

static struct cvm_chunk *get(struct fixture *fx, unsigned cls)
{
	struct cvm_chunk *c = NULL;
	int err = cvm_phys_get(fx->p, cls, NULL, &c);

	ck_assert_msg(err == CUVMM_OK, "cvm_phys_get(class %u): %s", cls, cuvmm_err_name(err));
	ck_assert_ptr_nonnull(c);
	ck_assert_uint_eq(c->cls, cls);
	ck_assert_uint_eq(c->size, (size_t)G << cls);
	return c;
}

static uint64_t creates(struct fixture *fx)
{
	return cuvmm_ctx_call_count(fx->ctx, CUVMM_CALL_CREATE);
}

static uint64_t releases(struct fixture *fx)
{
	return cuvmm_ctx_call_count(fx->ctx, CUVMM_CALL_RELEASE);
}

/* The layer's own count, the device's statistics and the OS agree, and equal `held`; `cached` is cached. */
static void expect_held(struct fixture *fx, size_t held, size_t cached)
{
	size_t p_held;

	pthread_mutex_lock(&fx->p->lock);
	p_held = fx->p->held;
	pthread_mutex_unlock(&fx->p->lock);
	ck_assert_msg(p_held == held, "phys held %zu, want %zu", p_held, held);
	ck_assert_uint_eq(atomic_load(&fx->dev->acct.held), held);
	ck_assert_uint_eq(tc_ctx_stats(fx->ctx).held_bytes, held);
	ck_assert_msg(cvm_phys_cached(fx->p) == cached, "cached %zu, want %zu", cvm_phys_cached(fx->p), cached);
	tc_assert_os_matches(fx->ctx);
}

static void teardown_fx(struct fixture *fx)
{
	cuvmm_ctx_destroy(fx->ctx);
	if (tc_on_host())
		ck_assert_int_eq(tc_memfd_bytes(), 0);
}

static void teardown(void)
{
	tc_log_release();
}

/* ----- reuse ----- */

START_TEST(test_reuse)
{
	struct fixture fx = setup_fx(-1, 0, 0);
	struct cvm_chunk *a, *b, *c;
	cvm_handle h;

	a = get(&fx, 0);
	h = a->h;
	ck_assert_uint_eq(creates(&fx), 1);
	expect_held(&fx, G, 0);
	cvm_phys_put(fx.p, a);
	expect_held(&fx, G, G);
	b = get(&fx, 0);
	ck_assert_ptr_eq(b, a); /* the same chunk, no driver call */
	ck_assert_uint_eq(b->h, h);
	ck_assert_uint_eq(creates(&fx), 1);
	expect_held(&fx, G, 0);

	/* Most recently freed first. */
	c = get(&fx, 0);
	cvm_phys_put(fx.p, b);
	cvm_phys_put(fx.p, c);
	ck_assert_ptr_eq(get(&fx, 0), c);
	ck_assert_ptr_eq(get(&fx, 0), b);
	ck_assert_uint_eq(creates(&fx), 2);
	expect_held(&fx, 2 * G, 0);
	cvm_phys_put(fx.p, b);
	cvm_phys_put(fx.p, c);
	ck_assert_uint_eq(releases(&fx), 0);
	teardown_fx(&fx); /* releases the cache */
}
END_TEST

/* ----- classes ----- */

START_TEST(test_classes)
{
	struct fixture fx = setup_fx(-1, 0, 0);
	struct cvm_chunk *c[4], *x = NULL;
	size_t total = 0;

	for (unsigned k = 0; k < 4; k++) {
		c[k] = get(&fx, k);
		total += (size_t)G << k;
	}
	expect_held(&fx, total, 0);
	ck_assert_int_eq(cvm_phys_get(fx.p, CVM_NCLASS, NULL, &x), CUVMM_EINVAL);
	ck_assert_ptr_null(x);
	for (unsigned k = 0; k < 4; k++)
		cvm_phys_put(fx.p, c[k]);
	expect_held(&fx, total, total);
	/* Each class finds its own chunk. */
	for (int k = 3; k >= 0; k--)
		ck_assert_ptr_eq(get(&fx, (unsigned)k), c[k]);
	ck_assert_uint_eq(creates(&fx), 4);
	expect_held(&fx, total, 0);
	for (unsigned k = 0; k < 4; k++)
		cvm_phys_put(fx.p, c[k]);
	teardown_fx(&fx);
}
END_TEST

/* A miss trades cached chunks of other classes for the new one, oldest first, so held does not pile up. */
START_TEST(test_trade_rule)
{
	struct fixture fx = setup_fx(-1, 0, 0);
	struct cvm_chunk *x, *y, *z;

	x = get(&fx, 1);
	y = get(&fx, 2);
	cvm_phys_put(fx.p, x); /* older */
	cvm_phys_put(fx.p, y);
	expect_held(&fx, 6 * G, 6 * G);

	/* A class-0 miss displaces the oldest other-class chunk, x (2G >= G), and keeps y. */
	z = get(&fx, 0);
	ck_assert_uint_eq(releases(&fx), 1);
	expect_held(&fx, G + 4 * G, 4 * G);
	ck_assert_ptr_eq(get(&fx, 2), y);

	/* A hit displaces nothing. */
	cvm_phys_put(fx.p, z);
	cvm_phys_put(fx.p, y);
	ck_assert_ptr_eq(get(&fx, 0), z);
	ck_assert_uint_eq(releases(&fx), 1);
	expect_held(&fx, 5 * G, 4 * G);

	/* Two class-0 chunks make way for one class-1 chunk. */
	ck_assert_ptr_eq(get(&fx, 2), y); /* y out of the cache */
	x = get(&fx, 0);                  /* a miss with nothing cached: nothing to trade */
	ck_assert_uint_eq(releases(&fx), 1);
	cvm_phys_put(fx.p, z);
	cvm_phys_put(fx.p, x);
	expect_held(&fx, 6 * G, 2 * G);
	z = get(&fx, 1);
	expect_held(&fx, 4 * G + 2 * G, 0);
	ck_assert_uint_eq(releases(&fx), 3);
	cvm_phys_put(fx.p, y);
	cvm_phys_put(fx.p, z);
	teardown_fx(&fx);
}
END_TEST

/* ----- the limit ----- */

START_TEST(test_limit_eviction)
{
	struct fixture fx = setup_fx(-1, 0, 4 * G);
	struct cvm_chunk *a, *b, *c, *d = NULL;

	a = get(&fx, 1);
	b = get(&fx, 1);
	expect_held(&fx, 4 * G, 0);
	ck_assert_int_eq(cvm_phys_get(fx.p, 0, NULL, &d), CUVMM_ENOMEM); /* full, nothing cached */
	ck_assert_ptr_null(d);
	expect_held(&fx, 4 * G, 0);

	cvm_phys_put(fx.p, a);
	cvm_phys_put(fx.p, b);
	/* 4G more would be 8G: both cached chunks go to make room. */
	c = get(&fx, 2);
	ck_assert_uint_eq(releases(&fx), 2);
	expect_held(&fx, 4 * G, 0);
	ck_assert_int_eq(cvm_phys_get(fx.p, 0, NULL, &d), CUVMM_ENOMEM);
	expect_held(&fx, 4 * G, 0);
	cvm_phys_put(fx.p, c);

	/* Not enough cached to make room: ENOMEM, and the cache is left as it was. */
	a = get(&fx, 0); /* evicts c (the limit) */
	b = get(&fx, 0);
	c = get(&fx, 0);
	expect_held(&fx, 3 * G, 0);
	cvm_phys_put(fx.p, c);
	ck_assert_int_eq(cvm_phys_get(fx.p, 2, NULL, &d), CUVMM_ENOMEM); /* needs 3G of room, G cached */
	expect_held(&fx, 3 * G, G);
	ck_assert_ptr_eq(get(&fx, 0), c);
	d = get(&fx, 0);
	expect_held(&fx, 4 * G, 0);
	cvm_phys_put(fx.p, a);
	cvm_phys_put(fx.p, b);
	cvm_phys_put(fx.p, c);
	cvm_phys_put(fx.p, d);
	teardown_fx(&fx);
}
END_TEST

/* ----- timed release, retain, keep ----- */

START_TEST(test_reclaim_delay_and_retain)
{
	const int64_t delay_ms = 100000; /* never reached by the clock: the test passes its own "now" */
	const uint64_t delay_ns = (uint64_t)delay_ms * 1000000;
	struct fixture fx = setup_fx(delay_ms, 2 * G, 0);
	struct cvm_chunk *c[4];
	uint64_t now, next;

	for (int i = 0; i < 4; i++)
		c[i] = get(&fx, 0);
	for (int i = 0; i < 4; i++)
		cvm_phys_put(fx.p, c[i]); /* c[0] oldest */
	expect_held(&fx, 4 * G, 4 * G);

	/* Not yet due: nothing released; it says when the oldest is. */
	now = cvm_now_ns();
	next = cvm_phys_reclaim(fx.p, now, false, 0);
	expect_held(&fx, 4 * G, 4 * G);
	ck_assert_uint_ne(next, UINT64_MAX);
	ck_assert_uint_gt(next, now);
	ck_assert_uint_le(next, now + delay_ns);
	/* Due early enough for the releases to be done by then (4 chunks at the measured cost per call). */
	{
		uint64_t lead = cvm_policy_lead(fx.p->policy, &fx.p->dd->cnt, 4);

		ck_assert_uint_gt(lead, 0);
		ck_assert_uint_le(lead, delay_ns / 4);
		ck_assert_uint_eq(next, c[0]->freed_ns + delay_ns - lead);
		/* The device's lead is the policy's at the device's cost per call. */
		ck_assert_uint_eq(cvm_dev_release_lead(fx.dev, 4), lead);
		/* Proportional to the chunks, up to a quarter of the delay. */
		ck_assert_uint_eq(cvm_dev_release_lead(fx.dev, 0), 0);
		ck_assert_uint_ge(cvm_dev_release_lead(fx.dev, 8), lead);
		ck_assert_uint_eq(cvm_dev_release_lead(fx.dev, SIZE_MAX / 2), delay_ns / 4);
	}

	/* Due: released beyond retain_bytes (keep_bytes is ignored without force), oldest first. */
	next = cvm_phys_reclaim(fx.p, now + delay_ns + 1, false, 0);
	ck_assert_uint_eq(next, UINT64_MAX);
	expect_held(&fx, 2 * G, 2 * G);
	ck_assert_uint_eq(releases(&fx), 2);
	ck_assert_ptr_eq(get(&fx, 0), c[3]);
	ck_assert_ptr_eq(get(&fx, 0), c[2]);
	cvm_phys_put(fx.p, c[2]);
	cvm_phys_put(fx.p, c[3]);

	/* Force with keep_bytes: the most recently freed keep_bytes stay, retain_bytes does not matter. */
	cvm_phys_reclaim(fx.p, now, true, G);
	expect_held(&fx, G, G);
	ck_assert_ptr_eq(get(&fx, 0), c[3]);
	cvm_phys_put(fx.p, c[3]);
	cvm_phys_reclaim(fx.p, now, true, 0);
	expect_held(&fx, 0, 0);
	teardown_fx(&fx);
}
END_TEST

START_TEST(test_reclaim_never_and_zero)
{
	struct fixture fx = setup_fx(-1, 0, 0);
	struct cvm_chunk *c, *d;

	c = get(&fx, 0);
	cvm_phys_put(fx.p, c);
	/* -1: time never releases anything; force does. */
	ck_assert_uint_eq(cvm_phys_reclaim(fx.p, UINT64_MAX / 2, false, 0), UINT64_MAX);
	expect_held(&fx, G, G);
	cvm_phys_reclaim(fx.p, cvm_now_ns(), true, 0);
	expect_held(&fx, 0, 0);
	teardown_fx(&fx);

	/* 0: released on put, beyond retain_bytes (most recently freed kept). */
	fx = setup_fx(0, G, 0);
	c = get(&fx, 0);
	d = get(&fx, 0);
	cvm_phys_put(fx.p, c); /* G <= retain: kept */
	expect_held(&fx, 2 * G, G);
	cvm_phys_put(fx.p, d); /* 2G: the older, c, goes */
	expect_held(&fx, G, G);
	ck_assert_uint_eq(releases(&fx), 1);
	ck_assert_ptr_eq(get(&fx, 0), d);
	cvm_phys_put(fx.p, d);
	teardown_fx(&fx);
}
END_TEST

/* ----- driver failures ----- */

START_TEST(test_fault_create)
{
	struct fixture fx = setup_fx(-1, 0, 0);
	struct cvm_chunk *a, *b, *c = NULL;

	ck_assert_int_eq(cuvmm_ctx_inject_fault(fx.ctx, CUVMM_CALL_CREATE, 0, 1, CUVMM_EDRIVER), CUVMM_OK);
	ck_assert_int_eq(cvm_phys_get(fx.p, 0, NULL, &c), CUVMM_EDRIVER);
	ck_assert_ptr_null(c);
	expect_held(&fx, 0, 0);
	ck_assert_int_eq(cuvmm_ctx_inject_fault(fx.ctx, CUVMM_CALL_CREATE, 0, 1, CUVMM_ENOMEM), CUVMM_OK);
	ck_assert_int_eq(cvm_phys_get(fx.p, 0, NULL, &c), CUVMM_ENOMEM); /* nothing cached to give back */
	expect_held(&fx, 0, 0);

	/* The device is full (ENOMEM) while chunks are cached: the cache is given back and the create retried. */
	a = get(&fx, 1);
	b = get(&fx, 1);
	cvm_phys_put(fx.p, a);
	cvm_phys_put(fx.p, b);
	ck_assert_int_eq(cuvmm_ctx_inject_fault(fx.ctx, CUVMM_CALL_CREATE, 0, 1, CUVMM_ENOMEM), CUVMM_OK);
	c = get(&fx, 0); /* the trade rule releases a; the failed create then releases b and retries */
	ck_assert_uint_eq(creates(&fx), 2 + 2 + 2);
	ck_assert_uint_eq(releases(&fx), 2);
	expect_held(&fx, G, 0);
	cvm_phys_put(fx.p, c);
	cvm_phys_reclaim(fx.p, cvm_now_ns(), true, 0);
	expect_held(&fx, 0, 0);

	/* EDRIVER is not "full": no retry, and what the trade rule did not take stays cached. */
	a = get(&fx, 1);
	b = get(&fx, 1);
	cvm_phys_put(fx.p, a);
	cvm_phys_put(fx.p, b);
	ck_assert_int_eq(cuvmm_ctx_inject_fault(fx.ctx, CUVMM_CALL_CREATE, 0, 1, CUVMM_EDRIVER), CUVMM_OK);
	{
		uint64_t before_creates = creates(&fx);

		c = NULL;
		ck_assert_int_eq(cvm_phys_get(fx.p, 0, NULL, &c), CUVMM_EDRIVER);
		ck_assert_uint_eq(creates(&fx), before_creates + 1);
		ck_assert_ptr_null(c);
	}
	expect_held(&fx, 2 * G, 2 * G); /* a was traded before the create; b stays */
	ck_assert_ptr_eq(get(&fx, 1), b);
	cvm_phys_put(fx.p, b);
	teardown_fx(&fx);
}
END_TEST

START_TEST(test_fault_release)
{
	struct fixture fx = setup_fx(-1, 0, 0);
	struct cvm_chunk *c[3];

	for (int i = 0; i < 3; i++)
		c[i] = get(&fx, 0);
	for (int i = 0; i < 3; i++)
		cvm_phys_put(fx.p, c[i]);
	tc_log_capture(CUVMM_LOG_ERROR);
	ck_assert_int_eq(cuvmm_ctx_inject_fault(fx.ctx, CUVMM_CALL_RELEASE, 1, 1, CUVMM_EDRIVER), CUVMM_OK);
	cvm_phys_reclaim(fx.p, cvm_now_ns(), true, 0);
	ck_assert_uint_eq(releases(&fx), 3); /* the failure does not stop the others */
	ck_assert_int_ge(tc_log_count(CUVMM_LOG_ERROR, NULL), 1);
	/* The chunk the driver kept is still held (and cached), and the next pass retries it. (Before ebb8b82 it
	 * was forgotten: held dropped while the driver, or the memfd, still had the memory.) */
	expect_held(&fx, G, G);
	cvm_phys_reclaim(fx.p, cvm_now_ns(), true, 0);
	expect_held(&fx, 0, 0);
	teardown_fx(&fx);
}
END_TEST

/* ----- physical memory on its own: what it is given at init, and nothing of the context ----- */

struct wakes {
	int n;
	uint64_t last;
};

static void record_wake(void *arg, uint64_t deadline)
{
	struct wakes *w = arg;

	w->n++;
	w->last = deadline;
}

/*
 * A cvm_phys made from parameters alone (the context's driver and device 0, but its own counters, account,
 * limit, policy and wake-up): it obeys them. A chunk put with an idle time keeps it, the wake-up hears its
 * deadline, the pass releases it when the policy says (beyond the policy's retain_bytes), and the limit is
 * the one given.
 */
START_TEST(test_params_only)
{
	const uint64_t delay_ns = 1000000000ull, max_lead = delay_ns / 4;
	struct fixture fx = setup_fx(-1, 0, 0); /* the context's own policy would never release */
	struct cvm_drv_dev dd; /* the context's connection and device 0, its own counters */
	struct cvm_acct acct;
	struct cvm_policy pol;
	struct wakes w = {0, 0};
	struct cvm_phys p;
	struct cvm_chunk *a, *b, *c = NULL;
	uint64_t now, t, next;
	struct cvm_phys_params par = {
		.dd = &dd,
		.granularity = G,
		.limit = 2 * G,
		.acct = &acct,
		.policy = &pol,
		.wake = record_wake,
		.wake_arg = &w,
	};

	memset(&dd, 0, sizeof(dd));
	dd.drv = &fx.ctx->drv;
	dd.index = 0;
	memset(&acct, 0, sizeof(acct));
	cvm_policy_init(&pol, 1000, G);
	ck_assert_int_eq(cvm_phys_init(&p, &par), CUVMM_OK);
	ck_assert_int_eq(cvm_phys_get(&p, 0, NULL, &a), CUVMM_OK);
	ck_assert_int_eq(cvm_phys_get(&p, 0, NULL, &b), CUVMM_OK);
	ck_assert(a->created && b->created);
	ck_assert_uint_eq(atomic_load(&acct.held), 2 * G);
	ck_assert_uint_eq(atomic_load(&dd.cnt.create_calls), 2);
	ck_assert_uint_eq(tc_ctx_stats(fx.ctx).held_bytes, 0); /* not the device's account */
	/* The limit given: a third chunk does not fit, and nothing is cached to make room. */
	ck_assert_int_eq(cvm_phys_get(&p, 0, NULL, &c), CUVMM_ENOMEM);
	ck_assert_ptr_null(c);

	/* Idle for 600 ms already: it keeps that, and the wake-up hears when it comes due. */
	now = cvm_now_ns();
	t = now - 600000000ull;
	a->freed_ns = t;
	cvm_phys_put(&p, a);
	ck_assert_int_eq(w.n, 1);
	ck_assert_uint_eq(a->freed_ns, t);
	ck_assert_uint_eq(w.last, t + delay_ns - max_lead);
	cvm_phys_put(&p, b); /* idle from now */
	ck_assert_int_eq(w.n, 2);
	ck_assert_uint_ge(b->freed_ns, now);
	ck_assert_uint_eq(w.last, b->freed_ns + delay_ns - max_lead);

	/* Neither due yet; then a is, b is not: a goes, and b would stay for retain_bytes anyway. */
	next = cvm_phys_reclaim(&p, now, false, 0);
	ck_assert_uint_eq(atomic_load(&acct.held), 2 * G);
	ck_assert_uint_eq(next, t + delay_ns - cvm_policy_lead(&pol, &dd.cnt, 2));
	next = cvm_phys_reclaim(&p, t + delay_ns, false, 0);
	ck_assert_uint_eq(atomic_load(&acct.held), G);
	ck_assert_uint_eq(atomic_load(&dd.cnt.release_calls), 1);
	ck_assert_uint_eq(cvm_phys_cached(&p), G);
	ck_assert_uint_eq(next, UINT64_MAX); /* what is left is retain_bytes */
	cvm_phys_fini(&p);
	ck_assert_uint_eq(atomic_load(&acct.held), 0);
	ck_assert_uint_eq(atomic_load(&dd.cnt.release_calls), 2);
	teardown_fx(&fx);
}
END_TEST

static Suite *phys_suite(void)
{
	Suite *s = suite_create("phys");
	TCase *tc;

	tc = tcase_create("cache");
	tcase_add_checked_fixture(tc, NULL, teardown);
	tcase_set_timeout(tc, TC_TIMEOUT);
	tcase_add_test(tc, test_reuse);
	tcase_add_test(tc, test_classes);
	tcase_add_test(tc, test_trade_rule);
	tcase_add_test(tc, test_limit_eviction);
	tcase_add_test(tc, test_reclaim_delay_and_retain);
	tcase_add_test(tc, test_reclaim_never_and_zero);
	tcase_add_test(tc, test_params_only);
	suite_add_tcase(s, tc);

	tc = tcase_create("fault");
	tcase_add_checked_fixture(tc, NULL, teardown);
	tcase_set_timeout(tc, TC_TIMEOUT);
	tcase_add_test(tc, test_fault_create);
	tcase_add_test(tc, test_fault_release);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	return tc_run(phys_suite());
}
