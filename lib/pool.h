/*
 * Pools: malloc and free over one region.
 *
 * The region's granules are divided into runs, each of one kind:
 *   VA    free address space, not mapped;
 *   FREE  free and mapped: physical memory kept for reuse (the pool's slack);
 *   USED  one large allocation (granule-aligned, ceil(bytes / granularity) granules);
 *   SLAB  one granule cut into equal slots for small allocations of one size class;
 *   PACK  one chunk of the packer's (pack.h): allocations of up to CVM_PACK_MAX_GRANULES granules, byte
 *         ranges that share granules with their neighbours; given back (FREE) once no live byte is on it
 *         (a coarse one, mapped by a wake, keeps its empty granules for the packer until then);
 *   GOING FREE memory the reclaim pass is unmapping right now, without the pool's lock.
 * Runs carry boundary tags (edge[] at their first and last granule) so that neighbours coalesce in O(1);
 * FREE runs sit in size bins (best fit) and, like VA runs, in a segment tree (first fit from an address,
 * seg.h).
 * Allocation takes FREE memory first (next fit from the rover, no driver call), then extends a FREE run
 * into the address space beside it, and maps fresh VA last. FREE memory goes back to VA (unmapped) when
 * it has been free for release_delay_ms, or early when the slack exceeds a quarter of the recent peak
 * footprint, by the reclaim pass with the pool's lock dropped (doc/design.md, "Pools").
 *
 * Frees without a stream are fenced device-wide (an epoch fence, fence.h); frees on a stream carry an
 * event fence and are reusable at once on that stream, on others once the event has completed.
 *
 * This header is the pool's struct, for the layers that reach it (graph.c, torch.c). The functions the
 * pool's own files share, and which file does what, are in pool_int.h.
 */
#ifndef CVM_POOL_H
#define CVM_POOL_H

#include "region.h"
#include "pack.h"
#include "seg.h"

enum cvm_run_kind { CVM_RUN_VA = 0, CVM_RUN_FREE, CVM_RUN_USED, CVM_RUN_SLAB, CVM_RUN_GOING, CVM_RUN_PACK };

struct cvm_slab;

struct cvm_run {
	size_t start, len;           /* granules */
	uint8_t kind;
	uint8_t bin;                 /* FREE: the bin it is in */
	bool unsynced;               /* PACK: bytes on it were freed without a stream since it was last FREE */
	size_t bytes;                /* USED: bytes handed out */
	uint64_t freed_ns;           /* FREE: when it was last freed */
	uint64_t first_freed_ns;     /* FREE: when its oldest part was freed (0: unknown, old) */
	/* FREE: the fence of the free (fence.h): an event on the stream it was freed on until it has completed
	 * and the run is settled (fence.ev NULL once settled), or the device epoch of a free without a stream. */
	struct cvm_fence fence;
	struct cvm_run *bnext, *bprev; /* FREE: bin list */
	struct cvm_run *lnext, *lprev; /* FREE: age list (settled runs, oldest first) or pending list */
	struct cvm_slab *slab;       /* SLAB */
};

#define CVM_NBINS 128
#define CVM_NSMALL 48 /* size classes of small allocations */

struct cvm_run_bins {
	struct cvm_run *head[CVM_NBINS];
	uint64_t nonempty[CVM_NBINS / 64];
};

struct cvm_dfree; /* a small or packed allocation freed on a stream, waiting for its event */

struct cuvmm_pool {
	struct cvm_client client;
	struct cuvmm_region r;         /* r.lock is the pool's lock */
	char name[32];
	struct cvm_run **edge;         /* per granule: the run it starts or ends, else NULL */
	struct cvm_run_bins free;      /* FREE runs by length */
	struct cvm_seg vseg, fseg;     /* VA runs, settled FREE runs: length at their start, for first fit */
	size_t rover;                  /* next fit resumes here: the first granule of the last large allocation */
	struct cvm_run age;            /* settled FREE runs, oldest first (sentinel) */
	struct cvm_run pend;           /* FREE runs with an event pending (sentinel) */
	size_t free_bytes;             /* bytes in FREE runs */
	size_t small_max;              /* largest size served from slabs */
	size_t pack_max;               /* largest size the packer places (above small_max) */
	size_t coarse_k;               /* allocations of at least this many granules take handles as large as
	                                  fit (cuvmm_pool_config.coarse_bytes); 0: none */
	struct cvm_pack pack;          /* allocations above small_max up to pack_max */
	size_t npack_coarse;           /* PACK runs of more than one granule (a chunk a wake mapped coarse) */
	unsigned nsmall;               /* size classes in use */
	struct cvm_slab *partial[CVM_NSMALL]; /* slabs with a free slot, per class */
	struct cvm_dfree *dq_head, *dq_tail;   /* small and packed frees on streams, oldest first */
	size_t ndq;
	size_t live;                   /* bytes handed out (under the lock; pacct mirrors it) */
	size_t fp;                     /* footprint: bytes of USED, SLAB and PACK runs */
	size_t win_peak, prev_peak;    /* peak footprint in this and the previous window, for the slack cap */
	uint64_t win_start;
	struct cvm_acct pacct;         /* live bytes of the pool, feeding the device's */
	_Atomic bool want_sync;        /* slack over its cap waits for a device sync (set by frees) */
	unsigned going;                /* GOING runs: the reclaim pass is unmapping them without the lock */
	unsigned going_waiters;        /* threads in cvm_wait_going: a trim lets them in between its batches */
};

/* The caller's config as this library's struct, its defaults where it has none: NULL gives the defaults, and
 * a config of an older header (its size the offset of a later field) gets that field's default. The size
 * rule of cuvmm_pool_create(), for the layers that keep a config to create pools later (torch.c).
 * Returns CUVMM_EINVAL for a size no header had. */
int cvm_pool_config_read(const struct cuvmm_pool_config *in, struct cuvmm_pool_config *out);

#endif /* CVM_POOL_H */
