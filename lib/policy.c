/*
 * The release policy: when idle memory is due to go back to the driver. See policy.h for the rule.
 */
#include "drv.h"
#include "policy.h"

#define CVM_LEAD_DEFAULT_CALL_NS 25000u /* cost per driver call assumed before any was measured */
#define CVM_WINDOW_MIN_NS 100000000u    /* the shortest footprint window of the slack cap: 100 ms */
#define CVM_SLACK_SHIFT 2               /* the slack cap: a quarter of the recent peak */

void cvm_policy_init(struct cvm_policy *pol, int64_t release_delay_ms, size_t retain_bytes)
{
	/* cvm_config_check refused delays above CUVMM_RELEASE_DELAY_MS_MAX, which count in nanoseconds. */
	pol->delay_ns = release_delay_ms < 0 ? CVM_POLICY_NEVER : (uint64_t)release_delay_ms * 1000000u;
	pol->retain_bytes = retain_bytes;
}

uint64_t cvm_policy_max_lead(const struct cvm_policy *pol)
{
	return cvm_policy_never(pol) ? 0 : pol->delay_ns / 4;
}

uint64_t cvm_policy_lead(const struct cvm_policy *pol, const struct cvm_drv_counters *cost, size_t chunks)
{
	uint64_t calls = atomic_load(&cost->create_calls) + atomic_load(&cost->release_calls) +
			 atomic_load(&cost->map_calls) + atomic_load(&cost->unmap_calls);
	uint64_t per_call = calls ? atomic_load(&cost->driver_ns) / calls : CVM_LEAD_DEFAULT_CALL_NS;
	uint64_t max = cvm_policy_max_lead(pol);

	if (!chunks || !max)
		return 0;
	return chunks > max / (2 * per_call + 1) ? max : chunks * 2 * per_call;
}

bool cvm_policy_due(const struct cvm_policy *pol, uint64_t since, uint64_t now, uint64_t lead)
{
	return !cvm_policy_never(pol) && cvm_elapsed(now, since) + lead >= pol->delay_ns;
}

uint64_t cvm_policy_deadline(const struct cvm_policy *pol, uint64_t since, uint64_t lead)
{
	return cvm_policy_never(pol) ? CVM_POLICY_NEVER : since + pol->delay_ns - lead;
}

bool cvm_policy_recent(const struct cvm_policy *pol, uint64_t last, uint64_t now)
{
	return !cvm_policy_never(pol) && cvm_elapsed(now, last) < pol->delay_ns;
}

uint64_t cvm_policy_window_ns(const struct cvm_policy *pol)
{
	return pol->delay_ns < CVM_WINDOW_MIN_NS ? CVM_WINDOW_MIN_NS : pol->delay_ns;
}

size_t cvm_policy_slack_cap(size_t peak, size_t fp, size_t floor)
{
	size_t cap;

	if (fp > peak)
		peak = fp;
	cap = peak + (peak >> CVM_SLACK_SHIFT) - fp;
	return cap > floor ? cap : floor;
}
