/*
 * Physical memory of one device: the chunks a context holds, the cache of free ones, and the accounting of
 * reserved/held/mapped/live bytes for the device.
 *
 * A chunk is one driver handle. Its size is the device granularity shifted left by a size class (0 for
 * regions; pools use larger classes for large allocations, since the driver's cost is per handle). Free
 * chunks stay cached for reuse and are released when the release policy (policy.h) says they are due,
 * beyond its retain_bytes (most recently freed kept first).
 *
 * The layer knows nothing of the context: cvm_phys_init gets the device as the driver layer sees it
 * (struct cvm_drv_dev: its connection, index and call counters), its account, its limit, the policy and a
 * wake-up callback, through which it reports when cached chunks come due.
 *
 * Locking: one mutex per device, never held across a call that waits for the GPU. Callers may hold their
 * own object lock when calling in (lock order: object, then phys). Releases to the driver happen outside
 * the mutex in cvm_phys_reclaim, so an allocating thread never waits behind a release there.
 */
#ifndef CVM_PHYS_H
#define CVM_PHYS_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>

#include "drv.h"
#include "policy.h"

#define CVM_NCLASS 10 /* chunk sizes: granularity << 0 .. << 9 (2 MiB .. 1 GiB on the H200) */

struct cvm_chunk {
	cvm_handle h;
	size_t size;
	uint8_t cls;                    /* size == granularity << cls */
	bool created;                   /* created for its holder, never cached: a failed call releases it */
	uint64_t freed_ns;              /* idle since: set on entering the cache unless its holder set it */
	struct cvm_chunk *cnext, *cprev; /* cache list of its class, most recently freed first */
	struct cvm_chunk *anext, *aprev; /* cache list of all classes, oldest first, for release */
};

/*
 * Bytes accounted to the device or to one object. Every change, to an account and its parents at once,
 * and every read for statistics happen under the device's account lock (the root's `lock`), so that a
 * reader sees a snapshot: mapped <= held, held <= peak_held, and the device's held <= its limit, never a
 * half-done update. The fields are atomics only so that a lone field may still be read without it.
 */
struct cvm_acct {
	_Atomic uint64_t reserved, held, mapped, live, peak_held, peak_live;
	struct cvm_acct *parent; /* the device's, for an object's */
	bool live_private;       /* live stays here: an allocator on this region counts live itself */
	pthread_mutex_t lock;    /* the device's account only (parent NULL); a leaf, taken last */
};

/* Add to one field of an account and its parent; peaks follow held and live. */
void cvm_acct_reserved(struct cvm_acct *a, int64_t delta);
void cvm_acct_held(struct cvm_acct *a, int64_t delta);
/* mapped and held of one object together (held of the object only: the device's held is the physical
 * layer's to count, and it counts a chunk before it is mapped and after it is unmapped). */
void cvm_acct_map(struct cvm_acct *a, int64_t delta);
void cvm_acct_live(struct cvm_acct *a, int64_t delta);
/* The device's account lock, for reading several accounts as one snapshot (kv, pool statistics). */
void cvm_acct_lock(struct cvm_acct *a);
void cvm_acct_unlock(struct cvm_acct *a);
/* Fill the byte fields of a cuvmm_stats from an account and the call fields from counters; _locked with
 * cvm_acct_lock held. */
void cvm_acct_fill(struct cvm_acct *a, const struct cvm_drv_counters *c, struct cuvmm_stats *out);
void cvm_acct_fill_locked(struct cvm_acct *a, const struct cvm_drv_counters *c, struct cuvmm_stats *out);
/* Check the caller's stats struct. */
int cvm_stats_check(const struct cuvmm_stats *out);

/* What physical memory is given at init: its device and the rules it follows. */
struct cvm_phys_params {
	/* The device's driver connection and index, and its counters: every call counted, the release lead's
	 * cost. Outlives the cvm_phys. */
	struct cvm_drv_dev *dd;
	size_t granularity;                     /* the size of a chunk of class 0 */
	size_t limit;                           /* the most it may hold (SIZE_MAX: no limit) */
	struct cvm_acct *acct;                  /* the device's account (its lock is initialised here) */
	const struct cvm_policy *policy;        /* when cached chunks go back; outlives the cvm_phys */
	/* Called (with no phys lock held) when cached chunks come due at `deadline` (ns), so that a reclaim
	 * pass runs cvm_phys_reclaim by then. */
	void (*wake)(void *arg, uint64_t deadline);
	void *wake_arg;
};

struct cvm_phys {
	pthread_mutex_t lock;
	/* From cvm_phys_params, read-only after init. */
	struct cvm_drv_dev *dd;
	size_t granularity, limit;
	struct cvm_acct *acct;
	const struct cvm_policy *policy;
	void (*wake)(void *arg, uint64_t deadline);
	void *wake_arg;
	/* Under the lock. */
	size_t held;                            /* created and not released: cached + in use + being released */
	size_t cached;                          /* in the cache */
	size_t ncached;                         /* chunks in the cache */
	size_t releasing;                       /* taken out of the cache, their release under way */
	_Atomic uint64_t release_failures;      /* releases the driver refused (the chunks stay cached) */
	struct cvm_chunk cls[CVM_NCLASS];       /* list heads of the per-class caches */
	struct cvm_chunk age;                   /* list head of the age list */
};

int cvm_phys_init(struct cvm_phys *p, const struct cvm_phys_params *par);
/* Release every cached chunk. Chunks still in use are the caller's bug; they are logged. */
void cvm_phys_fini(struct cvm_phys *p);

/*
 * A chunk of granularity << cls: from the cache if one is there, else created. Creating beyond the limit
 * first releases cached chunks (oldest first) to make room; CUVMM_ENOMEM if that is not enough, or if the
 * driver refuses those releases (the limit is never exceeded). A new
 * chunk also displaces up to its own size of cached chunks of other classes, so that switching sizes
 * does not pile up held memory. `cnt` are the calling object's driver counters.
 */
int cvm_phys_get(struct cvm_phys *p, unsigned cls, struct cvm_drv_counters *cnt, struct cvm_chunk **out);
/* Return a chunk (unmapped) to the cache, idle since c->freed_ns if its holder set it (a pool's slack, a kv
 * page: the time it has been idle already counts), else since now; released at once beyond retain_bytes
 * when the policy's delay is 0, else the wake-up callback hears when it comes due. */
void cvm_phys_put(struct cvm_phys *p, struct cvm_chunk *c);
/* Release a chunk (unmapped, not in the cache) to the driver now, bypassing the cache (sleep). */
void cvm_phys_release(struct cvm_phys *p, struct cvm_chunk *c);
/* Give back a chunk (unmapped) that a failed call took: released if it was created for that call, back
 * to the cache if it came from there, so that held is as before the call. */
void cvm_phys_undo(struct cvm_phys *p, struct cvm_chunk *c);
/*
 * Release cached chunks: with force, all beyond keep_bytes; else those the policy says are due (started
 * the release lead early), beyond its retain_bytes. Never blocks on the mutex unless force. Returns the
 * time (ns) the next cached chunk comes due, or UINT64_MAX.
 */
uint64_t cvm_phys_reclaim(struct cvm_phys *p, uint64_t now, bool force, size_t keep_bytes);
size_t cvm_phys_cached(struct cvm_phys *p);

#endif /* CVM_PHYS_H */
