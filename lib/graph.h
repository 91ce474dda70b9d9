/*
 * Graph memory: what CUDA graph capture needs of the allocators.
 *
 * A kernel captured into a graph reads and writes the addresses it had at capture time on every replay, long
 * after the capture. So memory that an allocation under capture got, and memory freed on a capturing stream
 * (the graph still uses it), belongs to a graph pool: it is never handed to work outside the graphs of that
 * pool, never unmapped, and never reclaimed, until the application releases the graph pool
 * (cuvmm_graph_release). Inside its pool it is reused: by later allocations of the same capture on the same
 * stream (stream order holds inside a graph), and by later captures into the same pool (graphs that share a
 * pool are replayed in capture order, as with PyTorch's graph_pool_handle()).
 *
 * A capture's graph pool is named by the capture's CUDA id unless cuvmm_capture_pool() joins it to an earlier
 * one. The captures themselves are the context's (ctx_capture.h: the registry that also answers "may the
 * device be synchronised now?"); its lock guards the graph pools too, and it keeps their state (struct
 * cvm_graphs, made on first use).
 *
 * Lock order: a pool's lock is never held while the registry's lock is taken, and the other way round.
 */
#ifndef CVM_GRAPH_H
#define CVM_GRAPH_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ctx_capture.h"
#include "cuvmm.h"

#define CVM_GRAPH_HASH 1024

struct cvm_gblock;
struct cvm_gpool;

/* The graph pools of a context (in its capture registry, under the registry's lock). */
struct cvm_graphs {
	_Atomic size_t nblocks;        /* blocks owned by graph pools: frees skip the registry while 0 */
	struct cvm_gblock *hash[CVM_GRAPH_HASH]; /* by address */
	struct cvm_gpool *pools;
};

/* Allocation under capture `cap` on `stream` (pool p's device): a block of p freed into the capture's graph pool
 * that fits `bytes` and may be reused on `stream` now. true: *ptr set, the block is live again. */
bool cvm_graph_take(struct cuvmm_ctx *ctx, struct cuvmm_pool *p, CUstream stream, uint64_t cap, size_t bytes,
		    void **ptr);
/* Give the capture's graph pool a new live allocation of p (on `device`; `bytes` as the pool counts them). */
int cvm_graph_own(struct cuvmm_ctx *ctx, struct cuvmm_pool *p, int device, CUstream stream, uint64_t cap,
		  void *ptr, size_t bytes);
/*
 * A free of `ptr` of pool p (on `device`) on `stream` (capture `cap`, 0: none). If ptr belongs to a graph pool, or the
 * free happens under capture (the graph uses the memory: it joins the capture's graph pool, `bytes` as the
 * pool counts it; 0 when it is not a live allocation), the registry keeps it: returns 1. Returns 0 where the
 * pool should free it as usual, CUVMM_EINVAL for a block already free or, under capture, a pointer that is
 * not a live allocation, CUVMM_ENOMEM if the bookkeeping could not be allocated.
 */
int cvm_graph_free(struct cuvmm_ctx *ctx, struct cuvmm_pool *p, int device, void *ptr, CUstream stream,
		   uint64_t cap, size_t bytes);
/* May a graph pool hold a pointer (a live or free graph block)? For frees outside capture, without the lock
 * when there is none. */
static inline bool cvm_graph_maybe(struct cvm_captures *reg)
{
	struct cvm_graphs *g = atomic_load_explicit(&reg->graphs, memory_order_acquire);

	return g && atomic_load_explicit(&g->nblocks, memory_order_acquire) != 0;
}
/* Pool p is being destroyed: forget its blocks. */
void cvm_graph_forget_pool(struct cuvmm_ctx *ctx, struct cuvmm_pool *p);

#endif /* CVM_GRAPH_H */
