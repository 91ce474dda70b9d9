/*
 * The release policy (lib/policy.c): its answers on a clock the tests choose (due, deadline, the lead,
 * recent activity, the slack cap's window and formula).
 */
#include <string.h>

#include "common.h"
#include "drv.h"
#include "policy.h"

#define MS 1000000ull /* ns */

static void teardown(void)
{
	tc_log_release();
}

/* ----- the policy's answers ----- */

START_TEST(test_init)
{
	struct cvm_policy pol;

	cvm_policy_init(&pol, -1, 7);
	ck_assert(cvm_policy_never(&pol));
	ck_assert(!cvm_policy_at_once(&pol));
	ck_assert_uint_eq(pol.retain_bytes, 7);
	ck_assert_uint_eq(cvm_policy_max_lead(&pol), 0);

	cvm_policy_init(&pol, 0, 0);
	ck_assert(!cvm_policy_never(&pol));
	ck_assert(cvm_policy_at_once(&pol));
	ck_assert_uint_eq(pol.delay_ns, 0);

	cvm_policy_init(&pol, 300, 0);
	ck_assert_uint_eq(pol.delay_ns, 300 * MS);
	ck_assert_uint_eq(cvm_policy_max_lead(&pol), 75 * MS);

	cvm_policy_init(&pol, CUVMM_RELEASE_DELAY_MS_MAX, 0);
	ck_assert(!cvm_policy_never(&pol));
	ck_assert_uint_eq(pol.delay_ns, (uint64_t)CUVMM_RELEASE_DELAY_MS_MAX * MS);
}
END_TEST

/* Memory idle since T is due at T + delay - lead, and that is the deadline reported for it. */
START_TEST(test_due_and_deadline)
{
	const uint64_t t = 1000 * MS, lead = 5 * MS;
	struct cvm_policy pol;

	cvm_policy_init(&pol, 300, 0);
	ck_assert_uint_eq(cvm_policy_deadline(&pol, t, 0), t + 300 * MS);
	ck_assert_uint_eq(cvm_policy_deadline(&pol, t, lead), t + 300 * MS - lead);
	ck_assert(!cvm_policy_due(&pol, t, t, 0));
	ck_assert(!cvm_policy_due(&pol, t, t + 300 * MS - 1, 0));
	ck_assert(cvm_policy_due(&pol, t, t + 300 * MS, 0));
	ck_assert(!cvm_policy_due(&pol, t, t + 300 * MS - lead - 1, lead));
	ck_assert(cvm_policy_due(&pol, t, t + 300 * MS - lead, lead));
	/* due exactly at the deadline it reports */
	ck_assert(cvm_policy_due(&pol, t, cvm_policy_deadline(&pol, t, lead), lead));
	ck_assert(!cvm_policy_due(&pol, t, cvm_policy_deadline(&pol, t, lead) - 1, lead));
	/* a stamp later than the pass's clock counts as idle for no time */
	ck_assert(!cvm_policy_due(&pol, t + 1, t, 0));

	cvm_policy_init(&pol, -1, 0);
	ck_assert(!cvm_policy_due(&pol, 0, UINT64_MAX - 1, 0));
	ck_assert_uint_eq(cvm_policy_deadline(&pol, t, 0), CVM_POLICY_NEVER);

	cvm_policy_init(&pol, 0, 0);
	ck_assert(cvm_policy_due(&pol, t, t, 0));
	ck_assert_uint_eq(cvm_policy_deadline(&pol, t, 0), t);
}
END_TEST

/* The lead: an unmap and a release per chunk at the measured cost per call (25 us before any), at most a
 * quarter of the delay, none for no chunk or a delay that never comes. */
START_TEST(test_lead)
{
	struct cvm_drv_counters cost;
	struct cvm_policy pol;

	memset(&cost, 0, sizeof(cost));
	cvm_policy_init(&pol, 1000, 0);
	ck_assert_uint_eq(cvm_policy_lead(&pol, &cost, 0), 0);
	ck_assert_uint_eq(cvm_policy_lead(&pol, &cost, 1), 2 * 25000);
	ck_assert_uint_eq(cvm_policy_lead(&pol, &cost, 100), 100 * 2 * 25000);
	/* 10 calls took 1 ms: 100 us each */
	atomic_store(&cost.map_calls, 4);
	atomic_store(&cost.unmap_calls, 3);
	atomic_store(&cost.create_calls, 2);
	atomic_store(&cost.release_calls, 1);
	atomic_store(&cost.driver_ns, 1 * MS);
	ck_assert_uint_eq(cvm_policy_lead(&pol, &cost, 3), 3 * 2 * 100000);
	ck_assert_uint_eq(cvm_policy_lead(&pol, &cost, 1250), 250 * MS);
	ck_assert_uint_eq(cvm_policy_lead(&pol, &cost, 1251), 250 * MS);
	ck_assert_uint_eq(cvm_policy_lead(&pol, &cost, SIZE_MAX), 250 * MS);
	cvm_policy_init(&pol, -1, 0);
	ck_assert_uint_eq(cvm_policy_lead(&pol, &cost, 3), 0);
	cvm_policy_init(&pol, 0, 0);
	ck_assert_uint_eq(cvm_policy_lead(&pol, &cost, 3), 0);
}
END_TEST

START_TEST(test_recent_window_cap)
{
	struct cvm_policy pol;

	cvm_policy_init(&pol, 300, 0);
	ck_assert(cvm_policy_recent(&pol, 10 * MS, 10 * MS));
	ck_assert(cvm_policy_recent(&pol, 10 * MS, 310 * MS - 1));
	ck_assert(!cvm_policy_recent(&pol, 10 * MS, 310 * MS));
	ck_assert_uint_eq(cvm_policy_window_ns(&pol), 300 * MS);
	cvm_policy_init(&pol, 20, 0);
	ck_assert_uint_eq(cvm_policy_window_ns(&pol), 100 * MS);
	cvm_policy_init(&pol, -1, 0);
	ck_assert(!cvm_policy_recent(&pol, 10 * MS, 10 * MS));
	ck_assert_uint_eq(cvm_policy_window_ns(&pol), CVM_POLICY_NEVER);

	/* peak 400, footprint 100: refill to 400 plus a quarter; at least the floor */
	ck_assert_uint_eq(cvm_policy_slack_cap(400, 100, 8), 400);
	ck_assert_uint_eq(cvm_policy_slack_cap(400, 100, 1000), 1000);
	/* a footprint above the recorded peak is the peak */
	ck_assert_uint_eq(cvm_policy_slack_cap(100, 400, 8), 100);
	ck_assert_uint_eq(cvm_policy_slack_cap(0, 0, 16), 16);
}
END_TEST

static Suite *policy_suite(void)
{
	Suite *s = suite_create("policy");
	TCase *tc = tcase_create("core");

	tcase_set_timeout(tc, TC_TIMEOUT);
	tcase_add_checked_fixture(tc, NULL, teardown);
	tcase_add_test(tc, test_init);
	tcase_add_test(tc, test_due_and_deadline);
	tcase_add_test(tc, test_lead);
	tcase_add_test(tc, test_recent_window_cap);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	return tc_run(policy_suite());
}
