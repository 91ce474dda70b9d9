/*
 * Fences and the device's event cache (lib/fence.c), through its internal header: events reused across
 * fences, the cache's bound, event fences (completion, reuse on their own stream, the cached answer, shared
 * references), epoch fences against device synchronisations, merging, and the failures of event create,
 * record and query: a fence that could not be made changes nothing.
 */
#include <stdio.h>
#include <string.h>

#include "common.h"
#include "ctx.h"
#include "drv_test.h"

struct fixture {
	struct cuvmm_ctx *ctx;
	struct cvm_dev *dev;
	struct cvm_fence_dev *fd;
	CUstream s, s2;
};

static struct fixture fx;

static void setup(void)
{
	struct cuvmm_config cfg;

	tc_config(&cfg);
	cfg.background_release = false;
	fx.ctx = tc_ctx(&cfg);
	ck_assert_int_eq(cvm_ctx_dev(fx.ctx, 0, &fx.dev), CUVMM_OK);
	fx.fd = &fx.dev->fence;
	ck_assert_int_eq(tc_stream_create(&fx.s), 0);
	ck_assert_int_eq(tc_stream_create(&fx.s2), 0);
	if (tc_on_host())
		fx.s2 = (CUstream)(uintptr_t)0x2; /* tc_stream_create gives every host test the same one */
}

static void teardown(void)
{
	if (tc_on_host())
		cvm_host_gate_open();
	tc_stream_destroy(fx.s);
	tc_stream_destroy(fx.s2);
	cuvmm_ctx_destroy(fx.ctx);
}

static uint64_t calls(enum cuvmm_call c)
{
	return cuvmm_ctx_call_count(fx.ctx, c);
}

static size_t cached(void)
{
	size_t n;

	pthread_mutex_lock(&fx.fd->lock);
	n = fx.fd->n;
	pthread_mutex_unlock(&fx.fd->lock);
	return n;
}

static bool host_only(const char *name)
{
	if (!tc_on_host())
		printf("%s: host backend only (the gate)\n", name);
	return tc_on_host();
}

/* ----- the event cache ----- */

START_TEST(test_cache_reuse)
{
	struct cvm_fence a, b;

	ck_assert_int_eq(cvm_fence_record(fx.fd, &a, fx.s), CUVMM_OK);
	ck_assert_uint_eq(calls(CUVMM_CALL_EVENT_CREATE), 1);
	ck_assert_uint_eq(calls(CUVMM_CALL_EVENT_RECORD), 1);
	ck_assert_int_eq(tc_stream_sync(fx.s), 0);
	ck_assert_int_eq(cvm_fence_done(fx.fd, &a), 1);
	cvm_fence_clear(fx.fd, &a);
	ck_assert_ptr_null(a.ev);
	ck_assert_uint_eq(cached(), 1);
	/* The next fence of the device reuses that event: no create. */
	ck_assert_int_eq(cvm_fence_record(fx.fd, &b, fx.s2), CUVMM_OK);
	ck_assert_uint_eq(calls(CUVMM_CALL_EVENT_CREATE), 1);
	ck_assert_uint_eq(calls(CUVMM_CALL_EVENT_RECORD), 2);
	ck_assert_uint_eq(cached(), 0);
	ck_assert_int_eq(tc_stream_sync(fx.s2), 0);
	cvm_fence_clear(fx.fd, &b);
	ck_assert_uint_eq(cached(), 1);
}
END_TEST

START_TEST(test_cache_bound)
{
	const size_t n = CVM_FENCE_CACHE_MAX + 20;
	cvm_event *ev = calloc(n, sizeof(*ev));

	ck_assert_ptr_nonnull(ev);
	for (size_t i = 0; i < n; i++)
		ck_assert_int_eq(cvm_fence_event_get(fx.fd, &ev[i]), CUVMM_OK);
	ck_assert_uint_eq(calls(CUVMM_CALL_EVENT_CREATE), n);
	for (size_t i = 0; i < n; i++)
		cvm_fence_event_put(fx.fd, ev[i]);
	ck_assert_uint_eq(cached(), CVM_FENCE_CACHE_MAX); /* the rest destroyed */
	cvm_fence_event_put(fx.fd, NULL);                  /* nothing */
	ck_assert_uint_eq(cached(), CVM_FENCE_CACHE_MAX);
	free(ev);
}
END_TEST

/* ----- event fences ----- */

START_TEST(test_event_fence)
{
	struct cvm_fence f, none;

	if (!host_only("test_event_fence"))
		return;
	memset(&none, 0, sizeof(none));
	ck_assert_int_eq(cvm_fence_done(fx.fd, &none), 1); /* a zeroed fence is complete */
	ck_assert(cvm_fence_usable(fx.fd, &none, fx.s));

	cvm_host_gate_close();
	ck_assert_int_eq(cvm_fence_record(fx.fd, &f, fx.s), CUVMM_OK);
	ck_assert_ptr_eq(f.stream, fx.s);
	ck_assert_int_eq(cvm_fence_done(fx.fd, &f), 0);
	ck_assert(cvm_fence_usable(fx.fd, &f, fx.s));    /* work on its own stream runs after it */
	ck_assert(!cvm_fence_usable(fx.fd, &f, fx.s2));  /* another stream must wait */
	ck_assert(!cvm_fence_usable(fx.fd, &f, NULL));
	cvm_host_gate_open();
	ck_assert(cvm_fence_usable(fx.fd, &f, fx.s2));
	ck_assert_int_eq(cvm_fence_done(fx.fd, &f), 1);
	/* Cached: no further query. */
	{
		uint64_t q = calls(CUVMM_CALL_EVENT_QUERY);

		ck_assert_int_eq(cvm_fence_done(fx.fd, &f), 1);
		ck_assert_uint_eq(calls(CUVMM_CALL_EVENT_QUERY), q);
	}
	ck_assert_int_eq(cvm_fence_wait(fx.fd, &f), CUVMM_OK);
	cvm_fence_clear(fx.fd, &f);
	ck_assert_uint_eq(cached(), 1);
	ck_assert_int_eq(cvm_fence_done(fx.fd, &f), 1);
}
END_TEST

/* A fence on a capturing stream would be a graph node: refused, nothing taken. */
START_TEST(test_event_fence_captured)
{
	struct cvm_fence f;

	if (!host_only("test_event_fence_captured"))
		return;
	memset(&f, 0x5a, sizeof(f));
	cvm_host_capture_begin(fx.s);
	ck_assert_int_eq(cvm_fence_record(fx.fd, &f, fx.s), CUVMM_ENOTSUP);
	ck_assert(cvm_host_capture_end(fx.s));
	ck_assert_uint_eq(f.refs, 0x5a5a5a5a); /* untouched */
	ck_assert_uint_eq(calls(CUVMM_CALL_EVENT_RECORD), 0);
}
END_TEST

/* A fence shared by several holders gives its event back with the last reference only. */
START_TEST(test_shared_refs)
{
	struct cvm_fence *f = cvm_fence_new();

	ck_assert_ptr_nonnull(f);
	ck_assert_uint_eq(f->refs, 1);
	ck_assert_int_eq(cvm_fence_done(fx.fd, f), 1); /* none yet: complete */
	f->done = false;
	ck_assert_int_eq(cvm_fence_record(fx.fd, f, fx.s), CUVMM_OK);
	ck_assert_ptr_eq(cvm_fence_ref(f), f);
	cvm_fence_ref(f);
	cvm_fence_unref(fx.fd, f);
	cvm_fence_unref(fx.fd, f);
	ck_assert_uint_eq(cached(), 0); /* one holder left: the event stays with the fence */
	ck_assert_int_eq(cvm_fence_wait(fx.fd, f), CUVMM_OK);
	ck_assert_int_eq(cvm_fence_done(fx.fd, f), 1);
	cvm_fence_unref(fx.fd, f);
	ck_assert_uint_eq(cached(), 1);
	cvm_fence_unref(fx.fd, NULL);
	ck_assert_ptr_null(cvm_fence_ref(NULL));
}
END_TEST

/* ----- epoch fences ----- */

START_TEST(test_epoch_fence)
{
	struct cvm_fence a, b;
	uint64_t e;

	cvm_fence_set_epoch(fx.fd, &a);
	ck_assert_ptr_null(a.ev);
	ck_assert_int_eq(cvm_fence_done(fx.fd, &a), 0);
	ck_assert(cvm_fence_usable(fx.fd, &a, fx.s2)); /* reusable at once; only its unmap waits */
	/* A synchronisation that began before a fence was taken does not complete it. */
	e = cvm_fence_sync_begin(fx.fd);
	cvm_fence_set_epoch(fx.fd, &b);
	cvm_fence_sync_end(fx.fd, e);
	ck_assert_int_eq(cvm_fence_done(fx.fd, &a), 1);
	ck_assert_int_eq(cvm_fence_done(fx.fd, &b), 0);
	/* An older synchronisation ending late does not move the safe epoch back. */
	cvm_fence_sync_end(fx.fd, e - 1);
	ck_assert_int_eq(cvm_fence_done(fx.fd, &b), 0);
	ck_assert_int_eq(cvm_dev_sync_epoch(fx.dev), CUVMM_OK);
	ck_assert_int_eq(cvm_fence_done(fx.fd, &b), 1);
	ck_assert_uint_eq(calls(CUVMM_CALL_EVENT_CREATE), 0);
}
END_TEST

START_TEST(test_merge)
{
	struct cvm_fence a, b;

	/* Epochs: the later wins. */
	cvm_fence_set_epoch(fx.fd, &a);
	ck_assert_int_eq(cvm_dev_sync_epoch(fx.dev), CUVMM_OK);
	cvm_fence_set_epoch(fx.fd, &b);
	ck_assert_int_eq(cvm_fence_done(fx.fd, &a), 1);
	cvm_fence_merge(fx.fd, &a, &b);
	ck_assert_int_eq(cvm_fence_done(fx.fd, &a), 0);
	ck_assert_int_eq(cvm_dev_sync_epoch(fx.dev), CUVMM_OK);
	ck_assert_int_eq(cvm_fence_done(fx.fd, &a), 1);

	/* Events on one stream: the later covers the earlier, whose event goes back to the cache. */
	ck_assert_int_eq(cvm_fence_record(fx.fd, &b, fx.s), CUVMM_OK);
	ck_assert_int_eq(cvm_fence_record(fx.fd, &a, fx.s), CUVMM_OK);
	cvm_fence_merge(fx.fd, &a, &b);
	ck_assert_ptr_null(b.ev);
	ck_assert_ptr_nonnull(a.ev);
	ck_assert_uint_eq(cached(), 1);
	ck_assert_int_eq(cvm_fence_wait(fx.fd, &a), CUVMM_OK);
	cvm_fence_clear(fx.fd, &a);
	ck_assert_uint_eq(cached(), 2);
}
END_TEST

/* ----- driver failures ----- */

/* EVENT_CREATE (_i 0) or EVENT_RECORD (_i 1) failing: the error, the fence untouched, the cache as before. */
START_TEST(test_fault_record)
{
	const enum cuvmm_call call = _i ? CUVMM_CALL_EVENT_RECORD : CUVMM_CALL_EVENT_CREATE;
	struct cvm_fence f, g;
	size_t before;
	int err;

	/* One event in the cache for the record case (the create case must miss it). */
	if (_i) {
		ck_assert_int_eq(cvm_fence_record(fx.fd, &g, fx.s), CUVMM_OK);
		ck_assert_int_eq(cvm_fence_wait(fx.fd, &g), CUVMM_OK);
		cvm_fence_clear(fx.fd, &g);
	}
	before = cached();
	memset(&f, 0x5a, sizeof(f));
	memcpy(&g, &f, sizeof(g));
	ck_assert_int_eq(cuvmm_ctx_inject_fault(fx.ctx, call, 0, 1, CUVMM_EDRIVER), CUVMM_OK);
	err = cvm_fence_record(fx.fd, &f, fx.s);
	ck_assert_msg(err == CUVMM_EDRIVER, "%s failing: %s", cuvmm_call_name(call), cuvmm_err_name(err));
	ck_assert_int_eq(memcmp(&f, &g, sizeof(f)), 0);
	ck_assert_uint_eq(cached(), before); /* a taken event went back */
	ck_assert_uint_eq(calls(call), _i ? 2 : 1);
	/* Cleared (count 1): the next record works. */
	ck_assert_int_eq(cvm_fence_record_uncaptured(fx.fd, &f, fx.s), CUVMM_OK);
	ck_assert_int_eq(cvm_fence_wait(fx.fd, &f), CUVMM_OK);
	cvm_fence_clear(fx.fd, &f);
	ck_assert_uint_eq(cached(), 1);
}
END_TEST

/* EVENT_QUERY failing: the error, not taken for an answer; the next query gives the truth. */
START_TEST(test_fault_query)
{
	struct cvm_fence f;

	ck_assert_int_eq(cvm_fence_record(fx.fd, &f, fx.s), CUVMM_OK);
	ck_assert_int_eq(tc_stream_sync(fx.s), 0);
	ck_assert_int_eq(cuvmm_ctx_inject_fault(fx.ctx, CUVMM_CALL_EVENT_QUERY, 0, 1, CUVMM_EDRIVER), CUVMM_OK);
	ck_assert_int_eq(cvm_fence_done(fx.fd, &f), CUVMM_EDRIVER);
	ck_assert(!f.done);
	ck_assert_int_eq(cvm_fence_done(fx.fd, &f), 1);
	cvm_fence_clear(fx.fd, &f);
}
END_TEST

static Suite *fence_suite(void)
{
	Suite *s = suite_create("fence");
	TCase *tc;

	tc = tcase_create("fence");
	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_set_timeout(tc, TC_TIMEOUT);
	tcase_add_test(tc, test_cache_reuse);
	tcase_add_test(tc, test_cache_bound);
	tcase_add_test(tc, test_event_fence);
	tcase_add_test(tc, test_event_fence_captured);
	tcase_add_test(tc, test_shared_refs);
	tcase_add_test(tc, test_epoch_fence);
	tcase_add_test(tc, test_merge);
	suite_add_tcase(s, tc);

	tc = tcase_create("fault");
	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_set_timeout(tc, TC_TIMEOUT);
	tcase_add_loop_test(tc, test_fault_record, 0, 2);
	tcase_add_test(tc, test_fault_query);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	return tc_run(fence_suite());
}
