/*
 * Giving the pool's free memory back: the slack cap and the footprint window it is measured against, the
 * unmapping of FREE runs (turning them into VA), the reclaim pass, which unmaps with the pool's lock dropped
 * (GOING runs), and trim.
 */
#include <sched.h>
#include <stdlib.h>

#include "log.h"
#include "pool_int.h"

/* ----- the slack cap ----- */

/*
 * The slack (FREE runs, plus the device's cached chunks) allowed before memory is given back early: enough
 * to refill the footprint (plus `extra` bytes about to be mapped) up to its recent peak plus a quarter of
 * it, and at least 8 granules. Next fit keeps the slack a working pool needs at a few percent of its
 * footprint, so the cap binds only where the load has fallen (held follows it down without waiting for the
 * release delay) or in a pathological pattern. A tighter cap was measured to cost more than it saves:
 * slack unmapped to stay under it leaves holes the sweep cannot merge across, each later allocation that
 * misses moves memory again, and on the KV trace both held and the driver calls went up (design.md).
 */
size_t cvm_slack_cap_after(struct cuvmm_pool *p, size_t extra)
{
	size_t peak = p->win_peak > p->prev_peak ? p->win_peak : p->prev_peak;

	return cvm_policy_slack_cap(peak, p->fp + extra, cvm_gbytes(p, 8));
}

size_t cvm_slack_cap(struct cuvmm_pool *p)
{
	return cvm_slack_cap_after(p, 0);
}

/* A run starts or stops holding allocations. */
void cvm_fp_add(struct cuvmm_pool *p, size_t granules, bool add)
{
	if (add) {
		p->fp += cvm_gbytes(p, granules);
		if (p->fp > p->win_peak)
			p->win_peak = p->fp;
	} else {
		p->fp -= cvm_gbytes(p, granules);
	}
}

/* The recent peak is that of the current window and the one before (the window: cvm_policy_window_ns). */
static void window_roll(struct cuvmm_pool *p, uint64_t now)
{
	if (cvm_elapsed(now, p->win_start) > cvm_policy_window_ns(&p->r.ctx->policy)) {
		p->prev_peak = p->win_peak;
		p->win_peak = p->fp;
		p->win_start = now;
	}
}

/* ----- unmapping FREE runs ----- */

/* Unmap a FREE run (settled, safe) and turn it into VA. */
void cvm_free_to_va(struct cuvmm_pool *p, struct cvm_run *run)
{
	/* Safe: the caller established it (epoch or event). The chunks have been idle since the run was freed. */
	if (cvm_region_release_locked(&p->r, run->start, run->len, run->freed_ns))
		return; /* no memory for the bookkeeping: leave it mapped, a later pass retries */
	cvm_free_unlink(p, run);
	run->kind = CVM_RUN_VA;
	cvm_fence_clear(&p->r.dev->fence, &run->fence);
	cvm_bin_insert(p, run);
	cvm_coalesce(p, run);
}

/* Unmap every safe FREE run (sync first, without the lock, if some are fenced by the device epoch) and
 * release the device's cached chunks: the answer to running out of memory. CUVMM_ESTATE (nothing done)
 * when the pool was put to sleep while the lock was dropped: the allocation must not map into it. */
int cvm_drop_slack(struct cuvmm_pool *p)
{
	struct cvm_run *run, *next;

	pthread_mutex_unlock(&p->r.lock);
	cvm_dev_sync_epoch(p->r.dev);
	pthread_mutex_lock(&p->r.lock);
	if (cvm_region_asleep(&p->r))
		return CUVMM_ESTATE;
	cvm_settle_pending(p, INT32_MAX);
	for (run = p->age.lnext; run != &p->age; run = next) {
		next = run->lnext;
		if (cvm_fence_done(&p->r.dev->fence, &run->fence) > 0)
			cvm_free_to_va(p, run);
	}
	cvm_region_process_locked(&p->r, cvm_now_ns(), false);
	cvm_phys_reclaim(&p->r.dev->phys, cvm_now_ns(), true, 0);
	return CUVMM_OK;
}

/* Unmap the oldest FREE runs that are safe to unmap (no device sync here), except `keep`, while the slack
 * (without `keep`) exceeds `cap`; their chunks go to the device's cache, where map_fresh finds them. True if
 * unsafe ones (epoch) were left. */
static bool steal_slack(struct cuvmm_pool *p, size_t cap, const struct cvm_run *keep)
{
	size_t kept = keep ? cvm_gbytes(p, keep->len) : 0;
	struct cvm_run *run, *next;
	bool unsafe = false;

	for (run = p->age.lnext; run != &p->age && p->free_bytes - kept > cap; run = next) {
		next = run->lnext;
		if (run == keep)
			continue;
		if (cvm_fence_done(&p->r.dev->fence, &run->fence) > 0)
			cvm_free_to_va(p, run);
		else
			unsafe = true;
	}
	if (cvm_region_pending_locked(&p->r))
		cvm_region_process_locked(&p->r, cvm_now_ns(), false);
	return unsafe;
}

#define CVM_GOING_BATCH 16 /* granules unmapped per reclaim pass without the lock (32 MiB on the H200) */

/*
 * Before the allocating thread maps memory for an allocation of k granules (fresh, or what a composed run
 * lacks): slack beyond the cap the allocation leaves is moved instead of added to (unmapped here, its
 * chunks remapped by the map that follows). `keep`: the FREE run the allocation extends (compose), which it
 * takes whole and which is not slack after it. Slack that waits only for a device synchronisation (memory
 * freed without a stream) is left to the reclaim pass up to half the cap (at most one batch, at least one
 * granule); beyond that the allocating thread synchronises itself, as cudaFree always does. And while the
 * pass is unmapping a batch without the lock, the allocating thread waits for it (one batch of unmaps)
 * rather than create chunks beside the ones going to the cache. So held stays within the peak footprint
 * plus a quarter, plus half of that at most waiting for its synchronisation, however the two threads
 * interleave. Before, a fixed allowance of one batch (32 MiB on the H200) past the cap, and chunks created
 * while a batch was being unmapped, were each a quarter of the held memory of a pool of 130 MiB on the
 * sweep's smallest trace (1.6x at a 1/16 cap); earlier still a composing allocation skipped the check.
 * 0 when nothing was moved; 1 when slack was unmapped (it went back to address space and merged with the
 * VA runs beside it) or the lock was dropped (a wait or the synchronisation; then `keep` may be gone too):
 * a caller holding runs looks again; CUVMM_ESTATE when the pool was put to sleep meanwhile.
 */
int cvm_make_room(struct cuvmm_pool *p, size_t k, const struct cvm_run *keep)
{
	size_t kept, cap, wait_sync;
	bool waited = false;

	if (p->going) {
		/* A reclaim pass is unmapping runs without the lock: mapped now, this allocation would create
		 * chunks while theirs are still held. Once the pass is done they are in the device's cache, where
		 * the map takes them. (The wait is one batch of unmaps at most.) */
		cvm_wait_going(p);
		if (cvm_region_asleep(&p->r))
			return CUVMM_ESTATE;
		waited = true;
		keep = NULL; /* (may be gone: the caller looks again) */
	}
	kept = keep ? cvm_gbytes(p, keep->len) : 0;
	cap = cvm_slack_cap_after(p, cvm_gbytes(p, k));
	if (p->free_bytes - kept <= cap)
		return waited; /* nothing moved */
	/* Slack that waits for a device synchronisation is left to the pass up to half the cap (at most one
	 * batch, at least a granule); past that the allocating thread synchronises. */
	wait_sync = cap / 2 < cvm_gbytes(p, CVM_GOING_BATCH) ? cap / 2 : cvm_gbytes(p, CVM_GOING_BATCH);
	if (wait_sync < cvm_gbytes(p, 1))
		wait_sync = cvm_gbytes(p, 1);
	if (!steal_slack(p, cap, keep) || p->free_bytes - kept <= cap + wait_sync)
		return 1;
	pthread_mutex_unlock(&p->r.lock);
	cvm_dev_sync_epoch(p->r.dev);
	pthread_mutex_lock(&p->r.lock);
	if (cvm_region_asleep(&p->r))
		return CUVMM_ESTATE;
	steal_slack(p, cvm_slack_cap_after(p, cvm_gbytes(p, k)), NULL);
	return 1;
}

/* ----- the reclaim pass ----- */

/*
 * Unmap the chunks of detached (GOING) runs with the pool's lock dropped: allocations go on meanwhile, and
 * nothing else touches these granules. Called with the lock held; returns with it held. The chunks keep
 * their idle time into the device's cache; a chunk the driver refused stays mapped, DONE, for the region's
 * retry. The runs become VA.
 */
static void unmap_going(struct cuvmm_pool *p, struct cvm_run *going)
{
	struct cvm_granules *v;
	struct cvm_run *run;
	size_t n = 0, i = 0;

	for (run = going; run; run = run->lnext)
		n++;
	v = calloc(n ? n : 1, sizeof(*v));
	if (v) {
		for (run = going; run; run = run->lnext, i++) {
			v[i].first = run->start;
			v[i].n = run->len;
			v[i].since = run->freed_ns;
		}
	}
	if (!v || cvm_region_unmap_now_locked(&p->r, v, n)) {
		free(v);
		/* No memory for the list: unmap them the slow way, under the lock. */
		for (run = going; run; run = going) {
			going = run->lnext;
			run->kind = CVM_RUN_FREE;
			p->going--;
			cvm_free_link(p, run);
			cvm_free_to_va(p, run);
		}
		return;
	}
	free(v);
	for (run = going; run; run = going) {
		going = run->lnext;
		run->lnext = run->lprev = NULL;
		run->kind = CVM_RUN_VA;
		cvm_fence_clear(&p->r.dev->fence, &run->fence);
		p->going--;
		cvm_bin_insert(p, run);
		cvm_coalesce(p, run);
	}
}

#define CVM_SYNC_RETRY_NS 100000000ull /* a failed device synchronisation is retried after 100 ms */

/*
 * A trim's batch of detached runs: synchronise the device first (lock dropped) when a run in it is younger
 * than the last synchronisation (a free beside it, after the trim began, merged into it and gave it its
 * epoch), then unmap it. Detached, no allocation can take it and no free can merge into it meanwhile, so
 * one synchronisation covers it: under a steady stream of frees beside a long run, a trim that skipped
 * such runs and synchronised again found them young again, and gave back nothing. On a failed
 * synchronisation (a stream capture under way) the runs go back to FREE and the error is returned.
 */
static int trim_going(struct cuvmm_pool *p, struct cvm_run *going, bool sync)
{
	struct cvm_run *run;
	int err = CUVMM_OK;

	if (sync) {
		pthread_mutex_unlock(&p->r.lock);
		err = cvm_dev_sync_epoch(p->r.dev);
		pthread_mutex_lock(&p->r.lock);
	}
	if (!err) {
		unmap_going(p, going);
		return CUVMM_OK;
	}
	for (run = going; run; run = going) {
		going = run->lnext;
		run->lnext = run->lprev = NULL;
		run->kind = CVM_RUN_FREE;
		p->going--;
		cvm_free_link(p, run);
		cvm_coalesce(p, run);
	}
	return err;
}

/* Wait (lock held, dropped meanwhile) until no reclaim pass is unmapping GOING runs of this pool. */
void cvm_wait_going(struct cuvmm_pool *p)
{
	if (!p->going)
		return;
	p->going_waiters++;
	while (p->going) {
		pthread_mutex_unlock(&p->r.lock);
		sched_yield();
		pthread_mutex_lock(&p->r.lock);
	}
	p->going_waiters--;
}

/*
 * The reclaim pass: settle stream frees whose work has completed, then unmap FREE runs that have been
 * free for the release delay (all of them, with force), and the oldest ones while the slack exceeds its
 * cap. Runs fenced by the device epoch need a device synchronisation first, done without the lock.
 * Returns when the next run expires.
 */
static uint64_t reclaim_locked(struct cuvmm_pool *p, uint64_t now, bool force, size_t keep)
{
	struct cuvmm_ctx *ctx = p->r.ctx;
	struct cvm_run *run, *next;
	uint64_t deadline = UINT64_MAX, lead;
	bool want_sync = false, synced = false, young = false;
	struct cvm_run *going = NULL;
	int err = CUVMM_OK;
	size_t cap, batch = 0, by_delay = 0, by_cap = 0, by_trim = 0;

	window_roll(p, now);
	/* A trim must see what another pass is giving back, or that pass's chunks land in the cache after
	 * the trim emptied it. */
	if (force)
		cvm_wait_going(p);
again:
	if (p->ndq)
		cvm_slab_drain(p, INT32_MAX);
	cvm_settle_pending(p, INT32_MAX);
	cap = cvm_slack_cap(p);
	/* Runs are due early enough for their unmaps and releases to be done when the delay is up. */
	lead = force ? 0 : cvm_dev_release_lead(p->r.dev, p->free_bytes >> p->r.gshift);
	for (run = p->age.lnext; run != &p->age; run = next) {
		bool due = cvm_policy_due(&ctx->policy, run->freed_ns, now, lead);

		next = run->lnext;
		if (force) {
			if (p->free_bytes - cvm_gbytes(p, run->len) < keep)
				break;
			/* A trim gives back what was free when it began (`now`): what another thread frees
			 * meanwhile is for the next pass, or the trim could chase that thread's frees for as long
			 * as it keeps freeing (test_trim_does_not_chase). */
			if (run->first_freed_ns > now)
				continue;
		} else if (p->free_bytes <= cap && !due) {
			deadline = cvm_policy_deadline(&ctx->policy, run->freed_ns, lead);
			break;
		}
		if (cvm_fence_done(&p->r.dev->fence, &run->fence) <= 0) {
			if (!force) {
				want_sync = true;
				continue;
			}
			young = true; /* detached all the same; its batch synchronises first (trim_going) */
		}
		/* Detach it: out of every index, GOING, so nothing allocates or merges it while the chunks are
		 * unmapped below without the lock. In batches while the pool holds allocations, for runs due by
		 * the delay as for those over the cap: while a batch is unmapped, an allocation cannot reuse its
		 * chunks and creates new ones, so held briefly counts both; a small batch keeps that overlap
		 * small, and the pass comes straight back for more. (A pass stops once CVM_GOING_BATCH granules
		 * are detached; runs are taken whole, as cutting them would cost the cap the pass it loses to a
		 * busy pool.) Only an empty pool, which nothing allocates from, gives its memory back at once.
		 * A trim unmaps batch after batch itself, cutting long runs at a chunk boundary: under the lock,
		 * or in one batch that an allocation needing to map must wait for, 8 GiB of 2 MiB chunks (one
		 * FREE run once its allocations are all freed) would stop allocations from the pool for the
		 * 100 ms their unmaps take on the H200 (bench/trace's return test). */
		if (p->fp || force) {
			if (batch >= CVM_GOING_BATCH) {
				if (!force) {
					deadline = now;
					break;
				}
				err = trim_going(p, going, young);
				going = NULL;
				batch = 0;
				young = false;
				if (err)
					break;
				/* Allocations that waited for this batch go before the next one, or they could wait
				 * for the whole trim (test_trim_lets_allocations_in). */
				while (p->going_waiters) {
					pthread_mutex_unlock(&p->r.lock);
					sched_yield();
					pthread_mutex_lock(&p->r.lock);
				}
				if (cvm_region_asleep(&p->r))
					return UINT64_MAX;
				goto again;
			}
			if (force && run->len > CVM_GOING_BATCH - batch) {
				size_t cut = cvm_region_chunk_end_locked(&p->r, run->start + CVM_GOING_BATCH - batch - 1) -
					     run->start;
				struct cvm_run *front = cut < run->len ? cvm_free_take_front(p, run, cut) : NULL;

				if (front) {
					batch += cut;
					by_trim += cvm_gbytes(p, cut);
					front->kind = CVM_RUN_GOING;
					front->lnext = going;
					going = front;
					p->going++;
					next = run; /* the rest, after this batch */
					continue;
				}
			}
			batch += run->len;
		}
		cvm_free_unlink(p, run);
		*(force ? &by_trim : due ? &by_delay : &by_cap) += cvm_gbytes(p, run->len);
		run->kind = CVM_RUN_GOING;
		run->lnext = going;
		going = run;
		p->going++;
	}
	if (want_sync && !synced) {
		/* The runs detached so far are unmapped first: an allocation that must map waits for GOING
		 * runs (cvm_make_room), and it must wait for one batch of unmaps, never for the GPU. */
		if (going) {
			unmap_going(p, going);
			going = NULL;
		}
		pthread_mutex_unlock(&p->r.lock);
		err = cvm_dev_sync_epoch(p->r.dev);
		pthread_mutex_lock(&p->r.lock);
		synced = true;
		/* Put to sleep meanwhile: the sleep gave back all the free memory itself. */
		if (cvm_region_asleep(&p->r))
			return UINT64_MAX;
		if (!err)
			goto again;
		/* EBUSY: a stream capture is under way (graph.h); expected, and over soon. */
		if (err != CUVMM_EBUSY)
			cvm_err("pool \"%s\": synchronising the device to release memory failed: %s; will retry",
				p->name, cuvmm_strerror(err));
		/* The runs that waited for it are still due: look again soon rather than never. */
		if (now + CVM_SYNC_RETRY_NS < deadline)
			deadline = now + CVM_SYNC_RETRY_NS;
	}
	if (going) {
		if (force)
			err = trim_going(p, going, young);
		else
			unmap_going(p, going);
	}
	/* A trim that could not synchronise for runs freed after it began leaves them mapped, FREE. */
	if (force && err)
		cvm_log(err == CUVMM_EBUSY ? CUVMM_LOG_INFO : CUVMM_LOG_ERROR,
			"pool \"%s\": trim: synchronising the device failed: %s; runs freed meanwhile stay mapped",
			p->name, cuvmm_strerror(err));
	/* The release decision: what this pass unmapped and why (its chunks go to the device's cache, which
	 * gives them back to the driver and says so). */
	if (by_delay)
		cvm_info("pool \"%s\": unmapped %.1f MiB free for release_delay_ms", p->name, by_delay / 1048576.0);
	if (by_cap)
		cvm_info("pool \"%s\": unmapped %.1f MiB: free memory was above the slack cap of %.1f MiB (a quarter "
			 "of the recent peak)", p->name, by_cap / 1048576.0, cap / 1048576.0);
	if (by_trim)
		cvm_info("pool \"%s\": unmapped %.1f MiB free on trim (keep %.1f MiB)", p->name, by_trim / 1048576.0,
			 keep / 1048576.0);
	if (p->ndq || p->pend.lnext != &p->pend)
		deadline = deadline < now + CVM_FENCE_POLL_NS ? deadline : now + CVM_FENCE_POLL_NS;
	if (cvm_region_pending_locked(&p->r)) {
		uint64_t t = cvm_region_process_locked(&p->r, now, force);

		if (t < deadline)
			deadline = t;
	}
	return deadline;
}

uint64_t cvm_pool_reclaim(struct cvm_client *c, uint64_t now, bool force)
{
	struct cuvmm_pool *p = (struct cuvmm_pool *)c;
	uint64_t next;
	size_t cap, free_bytes;

	/* The synchronisation that makes slack safe to unmap needs no lock: do it first, so that even when
	 * the pool is too busy for the pass below, its allocations can reuse the slack's chunks. */
	if (!force && atomic_exchange_explicit(&p->want_sync, false, memory_order_relaxed))
		cvm_dev_sync_epoch(p->r.dev);
	if (force)
		pthread_mutex_lock(&p->r.lock);
	else if (pthread_mutex_trylock(&p->r.lock))
		return now + CVM_FENCE_POLL_NS;
	next = cvm_region_asleep(&p->r) ? UINT64_MAX : reclaim_locked(p, now, force, 0);
	/* (asleep too: the copy kept for a next sleep is not the sleeping record's, e.g. after a DISCARD sleep) */
	if (force)
		cvm_region_host_drop(&p->r);
	cap = cvm_slack_cap(p);
	free_bytes = p->free_bytes;
	pthread_mutex_unlock(&p->r.lock);
	/* Unmapped slack went to the device's cache, which counts as slack too: release it beyond the cap,
	 * without the pool's lock. */
	if (!force && free_bytes + cvm_phys_cached(&p->r.dev->phys) > cap)
		cvm_phys_reclaim(&p->r.dev->phys, now, true,
				 cap > free_bytes ? cap - free_bytes : p->r.ctx->policy.retain_bytes);
	return next;
}

int cuvmm_pool_trim(struct cuvmm_pool *p, size_t keep_bytes)
{
	size_t kept = 0;
	bool asleep;

	if (!p)
		return CUVMM_EINVAL;
	pthread_mutex_lock(&p->r.lock);
	asleep = cvm_region_asleep(&p->r);
	pthread_mutex_unlock(&p->r.lock);
	if (asleep)
		return CUVMM_ESTATE;
	/* Stream frees first: wait for all work, so that every fence is complete. */
	if (cvm_dev_sync_epoch(p->r.dev) == CUVMM_OK) {
		pthread_mutex_lock(&p->r.lock);
		if (!cvm_region_asleep(&p->r)) {
			reclaim_locked(p, cvm_now_ns(), true, keep_bytes);
			cvm_region_host_drop(&p->r);
		}
		kept = p->free_bytes;
		pthread_mutex_unlock(&p->r.lock);
	}
	/* keep_bytes in all: what stayed mapped in the pool counts against it. */
	cvm_phys_reclaim(&p->r.dev->phys, cvm_now_ns(), true, keep_bytes > kept ? keep_bytes - kept : 0);
	return CUVMM_OK;
}
