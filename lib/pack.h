/*
 * Packed runs: allocations of a few granules that share granules with their neighbours (the pool's
 * allocations above the slab limit and up to CVM_PACK_MAX_GRANULES granules).
 *
 * The packer places byte ranges (multiples of CVM_PACK_ALIGN) over the granules of an address space and
 * counts, per granule, the bytes of allocations on it. A granule with a live byte belongs to the packer;
 * one whose last byte leaves is reported empty, for the pool to give back (as FREE memory, behind the
 * same fences as any free). Placement, in order of preference:
 *   1. a gap between allocations that lies on granules the packer already holds (address-ordered first
 *      fit, through a max segment tree of the longest gap starting in each granule): no granule needed;
 *   2. the end of the cursor, the last allocation placed on new granules, extended over the granules that
 *      follow it if the caller says it can have them: loading tensors in order is a bump, and wastes only
 *      the last granule's tail;
 *   3. otherwise the caller finds ceil(len / granule) granules anywhere and the allocation starts there.
 * This file is logic only (no driver call, no lock: the caller's lock covers it), so tests/test_pack.c
 * checks it alone.
 */
#ifndef CVM_PACK_H
#define CVM_PACK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "seg.h"

#define CVM_PACK_ALIGN 512       /* what PyTorch rounds to; the API promises 256 */
#define CVM_PACK_MAX_GRANULES 32 /* largest packed allocation (64 MiB with 2 MiB granules) */

struct cvm_pack_alloc {
	size_t off, len;                    /* bytes from the start of the address space; len aligned */
	size_t bytes;                       /* as requested (what the pool counts live) */
	struct cvm_pack_alloc *prev, *next; /* address order */
	bool pending;                       /* freed on a stream, its fence not complete: still occupies */
	uint64_t freed_ns;                  /* the pool's: when it was freed on a stream (pending) */
};

struct cvm_pack {
	unsigned gshift;
	size_t ngran;
	uint32_t *live;                /* per granule: bytes of allocations on it */
	struct cvm_pack_alloc **head;  /* per granule: the first allocation touching it */
	struct cvm_seg gaps;           /* per granule: longest gap starting in it, in CVM_PACK_ALIGN units */
	struct cvm_seg held;           /* per granule: 1 where live[] is not 0 (finds the next allocation) */
	struct cvm_pack_alloc *last;   /* the highest allocation */
	struct cvm_pack_alloc *cursor; /* the last allocation placed on new granules (placement 2) */
	size_t n;                      /* allocations */
};

/* Where an allocation goes: at byte `off`, on `ng` new granules from `g0` that the caller must provide
 * (ng 0: a gap on held granules). `anywhere`: no place found; the caller provides ng granules anywhere and
 * the allocation starts at the first (off is then set by the caller). */
struct cvm_pack_plan {
	size_t off, g0, ng;
	bool anywhere;
};

/* May the packer take granules [g, g + n) (free in the caller's eyes, not cut inside a larger chunk)? */
typedef bool (*cvm_pack_avail_fn)(void *arg, size_t g, size_t n);

/* Cover ngran granules of 2^gshift bytes (gshift 9..31). CUVMM_ENOMEM / CUVMM_EINVAL on failure. */
int cvm_pack_init(struct cvm_pack *k, size_t ngran, unsigned gshift);
/* Frees the bookkeeping of every allocation still placed. */
void cvm_pack_fini(struct cvm_pack *k);
/* Round a request to what the packer places. */
size_t cvm_pack_len(size_t bytes);
/* Plan the placement of `len` bytes (from cvm_pack_len). Changes nothing. */
void cvm_pack_plan(const struct cvm_pack *k, size_t len, cvm_pack_avail_fn avail, void *arg,
		   struct cvm_pack_plan *plan);
/* Place `x` (off, len, bytes set) once the granules of its plan are there. `bump`: it was placed on new
 * granules (becomes the cursor). Cannot fail. */
void cvm_pack_insert(struct cvm_pack *k, struct cvm_pack_alloc *x, bool bump);
/* Take `x` out; granules [*g0, *g0 + *ng) became empty (none: *ng = 0). The caller frees x. */
void cvm_pack_remove(struct cvm_pack *k, struct cvm_pack_alloc *x, size_t *g0, size_t *ng);
/* The allocation starting at byte off, or NULL. */
struct cvm_pack_alloc *cvm_pack_find(const struct cvm_pack *k, size_t off);
/* Does the packer hold granule g (a byte of some allocation on it)? */
static inline bool cvm_pack_holds(const struct cvm_pack *k, size_t g)
{
	return k->live && g < k->ngran && k->live[g] != 0;
}
/* Check every invariant (live counts, heads, order, gap index); 0 or the number of the first violated. */
int cvm_pack_check(const struct cvm_pack *k);

#endif /* CVM_PACK_H */
