/*
 * KV blocks: `tensors` parallel regions with the same block layout; a block id is backed in all of them
 * at once, and page p (granule p of every tensor) is mapped while any block touching it is allocated.
 *
 * Pages: a block's home page is the page holding its first byte; a page's capacity is its number of home
 * blocks (blocks may straddle pages, and a block larger than a page has continuation pages with no home
 * blocks). refs[p] counts allocated blocks touching page p; a page is mapped while refs > 0, and kept
 * mapped once empty until the idle delay, for reuse.
 *
 * Page-aware allocation: mapped pages with a free home block sit in buckets by occupancy (allocated home
 * blocks); allocation takes from the fullest, so holes are refilled and sparse pages drain. A new page is
 * mapped only when no mapped page has room. The background pass keeps a few empty pages mapped ahead of
 * demand while allocation is active, so the allocating thread rarely pays the `tensors` map calls.
 */
#ifndef CVM_KV_H
#define CVM_KV_H

#include "region.h"

#define CVM_KV_MAX_TENSORS 65536 /* cuvmm_kv_config.tensors at most (documented in cuvmm.h) */

struct cvm_kv_page {
	uint32_t used;          /* allocated home blocks */
	uint32_t refs;          /* allocated blocks touching the page */
	uint32_t cap;           /* home blocks */
	bool mapped;
	uint64_t empty_ns;      /* mapped and refs == 0 since */
	/* The fence of the free that last emptied it (fence.h: an event, or the device epoch without a stream),
	 * shared by the pages that free emptied; NULL: nothing to wait for. Kept while the page is in use, so
	 * that a failed call that takes blocks and gives them back leaves it as it was. */
	struct cvm_fence *fence;
	uint32_t bnext, bprev;  /* occupancy bucket list (page indices; UINT32_MAX: none) */
	bool in_bucket;
	bool mapping;           /* being mapped ahead by the background pass, without the kv lock */
};

struct cuvmm_kv {
	struct cvm_client client;
	struct cuvmm_ctx *ctx;
	struct cvm_dev *dev;
	pthread_mutex_t lock;     /* taken before the tensors' region locks */
	size_t block_bytes;
	uint32_t max_blocks, tensors, npages, max_cap;
	struct cuvmm_region *t;   /* the tensors' regions */
	struct cvm_kv_page *pg;
	uint64_t *busy;           /* one bit per block: allocated */
	uint32_t *bucket;         /* head page per occupancy 0..max_cap-1 (UINT32_MAX: empty) */
	uint32_t top;             /* highest bucket that may be non-empty */
	uint32_t nblocks_live;
	uint32_t mapped_pages, empty_pages;
	uint64_t last_alloc_ns;
	uint32_t ahead;           /* empty pages to keep mapped ahead of demand while active */
	uint32_t mapping_ahead;   /* pages the background pass is mapping right now */
	uint64_t backing_ns, backings; /* cost of backing new page ids on the allocating thread */
	struct cvm_acct acct;     /* live: allocated blocks x block_bytes x tensors */
};

#endif /* CVM_KV_H */
