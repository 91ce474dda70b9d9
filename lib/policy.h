/*
 * The release policy: when idle memory goes back to the driver. One object per context, set once from the
 * configuration (release_delay_ms, retain_bytes) and read-only after, so every client asks it without a
 * lock: "is memory idle since T due at NOW", "when is it due", and how early a release should start.
 *
 * After jemalloc's decay object (one place that owns the delay and answers the purging questions for
 * every cache), without its smoothed curve: here memory is either idle for the whole delay or kept.
 *
 * The rule, for every client (pool slack, KV pages, the device's chunk cache; a region's chunks enter the
 * cache when their fence completes): memory idle since T is due at T + delay - lead, where the lead is the
 * time the driver is expected to take to give it back (cvm_policy_lead), so that it is back with the
 * driver release_delay_ms after it went idle. Whoever hands idle memory on to another layer (a pool or a
 * kv object to the chunk cache) hands its idle time with it, so the delay is counted once.
 */
#ifndef CVM_POLICY_H
#define CVM_POLICY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct cvm_drv_counters;

/* A deadline that never comes (release_delay_ms -1). */
#define CVM_POLICY_NEVER UINT64_MAX

/* How soon to look again at something that could not be decided now: a fence still pending, a lock that
 * was busy (every reclaim pass trylocks). */
#define CVM_FENCE_POLL_NS 2000000ull

struct cvm_policy {
	uint64_t delay_ns;   /* release_delay_ms in ns; CVM_POLICY_NEVER: never; 0: at once */
	size_t retain_bytes; /* free memory kept cached per device anyway (beyond it only, memory goes back) */
};

/* From the configuration, which cvm_config_check has checked (-1 <= delay_ms <= CUVMM_RELEASE_DELAY_MS_MAX). */
void cvm_policy_init(struct cvm_policy *pol, int64_t release_delay_ms, size_t retain_bytes);

/* Idle memory never goes back by itself (only trim, sleep, the limit or destroy give it back). */
static inline bool cvm_policy_never(const struct cvm_policy *pol)
{
	return pol->delay_ns == CVM_POLICY_NEVER;
}

/* Idle memory goes back at once (release_delay_ms 0). */
static inline bool cvm_policy_at_once(const struct cvm_policy *pol)
{
	return pol->delay_ns == 0;
}

/* The most a release starts ahead of the delay: a quarter of it (0 when it never comes). */
uint64_t cvm_policy_max_lead(const struct cvm_policy *pol);

/*
 * How long before its deadline giving back `chunks` handles should start, so that it is done by then: an
 * unmap and a release each, at the cost per driver call measured so far in `cost` (the device's counters;
 * 25 us per call until there is a measurement), at most cvm_policy_max_lead(). Without it, 8 GiB of 2 MiB
 * handles came back about 135 ms late on the H200.
 */
uint64_t cvm_policy_lead(const struct cvm_policy *pol, const struct cvm_drv_counters *cost, size_t chunks);

/* Is memory idle since `since` due for release at `now`, started `lead` ns early? Never when the delay
 * never comes; at once with a delay of 0. */
bool cvm_policy_due(const struct cvm_policy *pol, uint64_t since, uint64_t now, uint64_t lead);

/* When memory idle since `since` comes due (released `lead` ns early); CVM_POLICY_NEVER when never. The
 * deadline a client reports to the context for it. */
uint64_t cvm_policy_deadline(const struct cvm_policy *pol, uint64_t since, uint64_t lead);

/* Has an activity last seen at `last` been recent at `now` (within the delay)? Never, when the delay never
 * comes. What keeps a KV object's pages mapped ahead of demand. */
bool cvm_policy_recent(const struct cvm_policy *pol, uint64_t last, uint64_t now);

/* The window over which a pool measures its recent peak footprint for the slack cap: the delay, at least
 * 100 ms (CVM_POLICY_NEVER when the delay never comes: the window never ends). */
uint64_t cvm_policy_window_ns(const struct cvm_policy *pol);

/*
 * The slack cap: the free memory (a pool's free runs and the device's cached chunks) kept beyond the delay
 * is at most what refills the footprint `fp` up to its recent `peak` plus a quarter of it, and at least
 * `floor` bytes. Above it, memory goes back before its delay (design.md, "The slack cap").
 */
size_t cvm_policy_slack_cap(size_t peak, size_t fp, size_t floor);

#endif /* CVM_POLICY_H */
