/*
 * Regions: one reserved address range on one device, mapped granule by granule.
 *
 * Each granule of the range has a slot: the chunk mapped there (a chunk of class k covers 2^k granules,
 * every slot of which points to it) and a state. An unmap does not call the driver at once: it marks the
 * granules PENDING behind a fence (an event recorded on the caller's stream) and the chunks are unmapped
 * when the fence has completed, by a later call on the region or by the background thread. A map over a
 * PENDING granule takes it back as it is, contents and all. Fences are fence.h's, their events from the
 * device's cache.
 *
 * The internal functions below are for allocators built on regions (pool, kv). "_locked" functions expect
 * r->lock held. The region's sleep and wake (region_sleep.c, the same layer) are declared at the end.
 */
#ifndef CVM_REGION_H
#define CVM_REGION_H

#include "ctx.h"

enum cvm_slot_state {
	CVM_SLOT_UNMAPPED = 0,
	CVM_SLOT_MAPPED,   /* mapped and live */
	CVM_SLOT_PENDING,  /* mapped, to be unmapped once fence `pend` has completed */
	CVM_SLOT_DONE,     /* mapped, its fence completed; the chunk is unmapped when all its granules are DONE */
};

struct cvm_slot {
	struct cvm_chunk *chunk;
	uint32_t pend;     /* id of the fence a PENDING granule waits for */
	uint8_t state;
	/* DONE, mapped with no access granted: the undo of a failed map or wake could not unmap it (the
	 * driver refused). Quarantined: a later pass retries the unmap, and a map that takes it back grants
	 * access first, so memory that faults is never handed out. */
	uint8_t noacc;
};

/* An unmap waiting for its fence: the granules it marked PENDING with its id. */
struct cvm_unmap {
	struct cvm_unmap *next;
	struct cvm_fence *f; /* the region's reference (fence.h); NULL: complete (no work to wait for) */
	uint32_t id;
	size_t first, n;     /* granules it covers (some may have been taken back since) */
};

struct cvm_region_sleep; /* region_sleep.c's, opaque here */

struct cuvmm_region {
	struct cvm_client client;
	struct cuvmm_ctx *ctx;
	struct cvm_dev *dev;
	pthread_mutex_t lock;
	uintptr_t base;
	size_t size;          /* reserved bytes, a multiple of gran */
	size_t gran;
	unsigned gshift;      /* log2(gran) */
	uint8_t cls0;         /* size class of a chunk of one slot: gran == device granularity << cls0 */
	size_t ngran;         /* granules: size >> gshift */
	struct cvm_slot *slot;
	struct cvm_unmap *fences;     /* pending unmaps, newest first */
	uint32_t next_fence_id;
	size_t npending;              /* granules PENDING or DONE */
	struct cvm_region_sleep *zzz; /* region_sleep.c's: the record while asleep, the host copy kept for the
				       * next sleep; NULL until the first sleep */
	struct cvm_acct acct;
	struct cvm_drv_counters cnt;
	uint64_t peers;       /* devices granted access to every mapping (bit i: device i; its own included) */
	struct cuvmm_region *dev_next, **dev_prev; /* in dev->regions */
};

/*
 * The class (in slots: a chunk of 2^cls slots) of the largest chunk that can start at slot g, aligned to its
 * size, and end by slot `end`: at most max_cls, and at most the largest class the device's chunks have.
 */
static inline unsigned cvm_fit_cls(const struct cuvmm_region *r, size_t g, size_t end, unsigned max_cls)
{
	unsigned cls = max_cls < (unsigned)CVM_NCLASS - 1 - r->cls0 ? max_cls : (unsigned)CVM_NCLASS - 1 - r->cls0;

	while (cls > 0 && ((g & (((size_t)1 << cls) - 1)) || g + ((size_t)1 << cls) > end))
		cls--;
	return cls;
}

/* Slots covered by a chunk. */
static inline size_t cvm_span(const struct cuvmm_region *r, const struct cvm_chunk *c)
{
	return (size_t)1 << (c->cls - r->cls0);
}

/* Create a region without registering it as a client (for objects that own one and reclaim it).
 * gran: its unit of mapping, a power of two >= the device granularity; 0: the device granularity. */
int cvm_region_init(struct cuvmm_region *r, struct cuvmm_ctx *ctx, int device, size_t max_bytes, size_t gran);
/* The same with the devices to grant access to its memory: `peers` as a pool or kv config's peer_access
 * (0: the context's peer_access), plus those cuvmm_ctx_add_peer added to the device. CUVMM_ENOTSUP where
 * one cannot access the device's memory (nothing reserved then). */
int cvm_region_init_peers(struct cuvmm_region *r, struct cuvmm_ctx *ctx, int device, size_t max_bytes, size_t gran,
			  uint64_t peers);
void cvm_region_fini(struct cuvmm_region *r);

/* Map granules [first, first+n) that are not mapped (UNMAPPED), using chunks of up to 2^max_cls slots where a
 * chunk aligned to its size fits in an unmapped run; PENDING/DONE granules are taken back as MAPPED, a chunk
 * of several granules only whole: one that straddles the range (its unmap refused, so it is still mapped) is
 * unmapped first, and if the driver still refuses, the call fails with CUVMM_EDRIVER. All or nothing. */
int cvm_region_map_locked(struct cuvmm_region *r, size_t first, size_t n, unsigned max_cls);
/* Granules [first, first+n) cover part of a chunk of several granules still mapped to be unmapped (PENDING or
 * DONE), which cvm_region_map_locked would refuse: the end of the first such chunk, else 0. */
size_t cvm_region_straddle_locked(const struct cuvmm_region *r, size_t first, size_t n);

/* Prepare the unmap of work on `stream` (NULL: the caller synchronised the device already, so its fence is
 * complete). Recording fails cleanly: nothing changes. */
int cvm_region_fence_locked(struct cuvmm_region *r, CUstream stream, struct cvm_unmap **out);
/* Give back an unmap that ended up unused. */
void cvm_region_fence_drop_locked(struct cuvmm_region *r, struct cvm_unmap *u);
/* Mark MAPPED granules of [first, first+n) PENDING behind unmap u's fence (it takes u over). Chunks that
 * straddle the range's ends are unmapped only once all their granules are pending. */
void cvm_region_unmap_locked(struct cuvmm_region *r, size_t first, size_t n, struct cvm_unmap *u);
/* Unmap whatever pending granules have completed fences. With wait, wait for the fences first (drops and
 * retakes the lock around the waits). Returns when to look again (ns) or UINT64_MAX. */
uint64_t cvm_region_process_locked(struct cuvmm_region *r, uint64_t now, bool wait);
/* Map chunk c whole at granule g (which must be UNMAPPED over the chunk's span) with access, slots set to
 * `state`; all or nothing. Accounts mapped and held, not live. On failure c is given back (cvm_phys_undo)
 * or, when the driver mapped it, refused access and then refused to unmap it, kept in the region
 * quarantined (DONE, noacc: see struct cvm_slot), never in the cache while still mapped. */
int cvm_region_chunk_map_locked(struct cuvmm_region *r, size_t g, struct cvm_chunk *c, uint8_t state);
/* Quarantine chunk c, mapped at granule g (its slots set or not), which could not be unmapped: DONE,
 * noacc, counted pending, so that a later pass retries the unmap. Its bytes stay accounted mapped. */
void cvm_region_quarantine_locked(struct cuvmm_region *r, size_t g, struct cvm_chunk *c);
/* Grant access to the quarantined (noacc) chunk covering granule g, if it is; before it is taken back.
 * On failure nothing changes. */
int cvm_region_grant_locked(struct cuvmm_region *r, size_t g);
/* Unmap the chunk whose first granule is g; hand it to *keep if given, else back to the device's cache.
 * On failure nothing changes. Accounts mapped and held, not live. */
int cvm_region_chunk_unmap_locked(struct cuvmm_region *r, size_t g, struct cvm_chunk **keep);
/* Is any granule of [first, first+n) in the given state? */
size_t cvm_region_count_locked(struct cuvmm_region *r, size_t first, size_t n, enum cvm_slot_state st);

/*
 * For an allocator that hands out the region's granules and unmaps them once they are free (pool.c): it
 * never touches the slots itself.
 */
/* Granules waiting to be unmapped (PENDING or DONE, including unmaps the driver refused, to be retried). */
static inline size_t cvm_region_pending_locked(const struct cuvmm_region *r)
{
	return r->npending;
}
/* The granule after the chunk mapped at granule g (g + 1 where nothing is mapped): whether a cut at granule
 * c falls between chunks is cvm_region_chunk_end_locked(r, c - 1) == c. */
size_t cvm_region_chunk_end_locked(const struct cuvmm_region *r, size_t g);
/* The MAPPED granules [first, first+n), which no GPU work touches any more (the caller established it), are
 * to be unmapped: by the next cvm_region_process_locked, their chunks idle since `since` into the device's
 * cache. CUVMM_ENOMEM, nothing changed, when there is no memory for the bookkeeping. */
int cvm_region_release_locked(struct cuvmm_region *r, size_t first, size_t n, uint64_t since);
struct cvm_granules {
	size_t first, n;
	uint64_t since; /* idle since (ns): the chunks carry it into the device's cache */
};
/* Unmap now, with r->lock dropped around the driver calls, the chunks of the granule ranges v[0..nv): MAPPED,
 * whole chunks, no GPU work touching them, and kept from every other use by the caller meanwhile. Called with
 * the lock held, returns with it held. A chunk the driver refuses stays mapped, DONE, for a later pass to
 * retry. CUVMM_ENOMEM, nothing done and the lock kept, when there is no memory for the list. */
int cvm_region_unmap_now_locked(struct cuvmm_region *r, const struct cvm_granules *v, size_t nv);
/* Take back, MAPPED with access, the quarantined chunk (DONE, see struct cvm_slot) whose first granule is
 * g: the very chunk a sleeping region's record asks for at g. Live is not accounted. On failure (access
 * refused) nothing changes. */
int cvm_region_take_back_locked(struct cuvmm_region *r, size_t g);

/*
 * The region's sleep and wake (region_sleep.c): the record of its MAPPED chunks, their host copy, and the
 * copy kept after a wake for the next sleep, all in struct cvm_region_sleep. region_sleep.c builds on the
 * chunk calls above; region.c calls it only to ask whether the region sleeps and to free what it holds.
 */
/* Is the region asleep? (Its map, unmap and resize, and a pool's calls, then fail with CUVMM_ESTATE.) */
bool cvm_region_asleep(const struct cuvmm_region *r);
/* Sleep and wake of the region's MAPPED chunks; the caller holds r->lock and has made sure no granule is
 * PENDING or DONE. */
int cvm_region_sleep_locked(struct cuvmm_region *r, enum cuvmm_sleep_mode mode, CUstream stream);
int cvm_region_wake_locked(struct cuvmm_region *r, CUstream stream);
/*
 * While asleep: let the wake map granules [first, first + n) with chunks of up to 2^max_cls slots (aligned,
 * inside the range) instead of the chunks they had. The range must be wholly mapped in the record; the
 * contents are unaffected (the host copy is in address order either way). For a pool's allocations, whose
 * boundaries are all the chunk boundaries it needs: fewer handles for the wake and for every later sleep.
 */
void cvm_region_sleep_coarsen(struct cuvmm_region *r, size_t first, size_t n, unsigned max_cls);
/* Pin a host copy of `bytes` now and keep it for the next OFFLOAD sleep (unless one as large is kept
 * already), with r->lock taken only around the pinning, never during it: cuvmm_region_sleep_prepare,
 * cuvmm_pool_sleep_prepare. CUVMM_ESTATE if the region sleeps (or was put to sleep meanwhile); as a sleep's
 * pinning otherwise. On failure nothing is kept that was not before. */
int cvm_region_sleep_prepare(struct cuvmm_region *r, size_t bytes);
/* Give back the pinned buffer kept for the next sleep (trim, destroy). */
void cvm_region_host_drop(struct cuvmm_region *r);
/* Free what sleep holds: a sleeping region's record and host copy, the kept host copy (cvm_region_fini). */
void cvm_region_sleep_fini(struct cuvmm_region *r);

#endif /* CVM_REGION_H */
