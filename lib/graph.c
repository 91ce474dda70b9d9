/*
 * Graph memory: the graph pools, which keep what CUDA graphs use of the pools' memory (graph.h).
 */
#include <stdlib.h>

#include "ctx.h"
#include "graph.h"

/* One allocation owned by a graph pool. */
struct cvm_gblock {
	struct cvm_gblock *hnext;          /* hash chain */
	struct cvm_gblock *gnext, *gprev;  /* the graph pool's blocks */
	struct cvm_gpool *gp;
	struct cuvmm_pool *pool;
	void *ptr;
	size_t bytes;                      /* as the pool counts the allocation: what a reuse may use */
	bool free;                         /* freed by the application: reusable inside the graph pool */
	uint64_t free_cap;                 /* the capture it was freed in (0: outside any) */
	CUstream free_stream;              /* ... and on which stream */
};

struct cvm_gpool {
	struct cvm_gpool *next;
	uint64_t id;
	struct cvm_gblock head;            /* sentinel of the block list */
	size_t nblocks;
};


static void graphs_free(struct cvm_graphs *g)
{
	while (g->pools) {
		struct cvm_gpool *gp = g->pools;

		g->pools = gp->next;
		while (gp->head.gnext != &gp->head) {
			struct cvm_gblock *b = gp->head.gnext;

			gp->head.gnext = b->gnext;
			free(b);
		}
		free(gp);
	}
	free(g);
}

/* The context's graph pools, made on first use (NULL: out of memory). Registry lock held. */
static struct cvm_graphs *graphs_get(struct cvm_captures *reg)
{
	struct cvm_graphs *g = atomic_load_explicit(&reg->graphs, memory_order_relaxed);

	if (g)
		return g;
	g = calloc(1, sizeof(*g));
	if (!g)
		return NULL;
	atomic_init(&g->nblocks, 0);
	reg->graphs_free = graphs_free;
	atomic_store_explicit(&reg->graphs, g, memory_order_release);
	return g;
}

static size_t hslot(const void *ptr)
{
	return ((uintptr_t)ptr >> 8) % CVM_GRAPH_HASH;
}

static struct cvm_gblock **hfind(struct cvm_graphs *g, const void *ptr)
{
	struct cvm_gblock **pp = &g->hash[hslot(ptr)];

	while (*pp && (*pp)->ptr != ptr)
		pp = &(*pp)->hnext;
	return pp;
}

/* Put b at the end of gp's block list, or take it out of its graph pool's list. */
static void block_list_add(struct cvm_gpool *gp, struct cvm_gblock *b)
{
	b->gp = gp;
	b->gnext = &gp->head;
	b->gprev = gp->head.gprev;
	gp->head.gprev->gnext = b;
	gp->head.gprev = b;
	gp->nblocks++;
}

static void block_list_remove(struct cvm_gblock *b)
{
	b->gprev->gnext = b->gnext;
	b->gnext->gprev = b->gprev;
	b->gp->nblocks--;
}

static void block_unlink(struct cvm_graphs *g, struct cvm_gblock *b)
{
	struct cvm_gblock **pp = hfind(g, b->ptr);

	if (*pp == b)
		*pp = b->hnext;
	block_list_remove(b);
	atomic_fetch_sub_explicit(&g->nblocks, 1, memory_order_release);
}

static struct cvm_gpool *gpool_find(struct cvm_graphs *g, uint64_t id)
{
	struct cvm_gpool *gp = g->pools;

	while (gp && gp->id != id)
		gp = gp->next;
	return gp;
}

static struct cvm_gpool *gpool_new(struct cvm_graphs *g, uint64_t id)
{
	struct cvm_gpool *gp = calloc(1, sizeof(*gp));

	if (!gp)
		return NULL;
	gp->id = id;
	gp->head.gnext = gp->head.gprev = &gp->head;
	gp->next = g->pools;
	g->pools = gp;
	return gp;
}

/* The record of capture `cap` (created on first sight, with a graph pool named after it). Lock held. */
static struct cvm_capture *capture_get(struct cvm_captures *reg, struct cvm_graphs *g, uint64_t cap,
				       CUstream stream, int device)
{
	struct cvm_capture *c = cvm_capture_find_locked(reg, cap);
	struct cvm_gpool *gp;

	if (c)
		return c;
	gp = gpool_find(g, cap);
	if (gp)
		return cvm_capture_add_locked(reg, cap, stream, device, gp);
	gp = gpool_new(g, cap);
	if (!gp)
		return NULL;
	c = cvm_capture_add_locked(reg, cap, stream, device, gp);
	if (!c) {
		g->pools = gp->next; /* just made, at the head: nothing else knows it */
		free(gp);
	}
	return c;
}

static int block_add(struct cvm_graphs *g, struct cvm_gpool *gp, struct cuvmm_pool *p, void *ptr, size_t bytes,
		     struct cvm_gblock **out)
{
	struct cvm_gblock *b = calloc(1, sizeof(*b)), **pp;

	if (!b)
		return CUVMM_ENOMEM;
	b->pool = p;
	b->ptr = ptr;
	b->bytes = bytes;
	pp = &g->hash[hslot(ptr)];
	b->hnext = *pp;
	*pp = b;
	block_list_add(gp, b);
	atomic_fetch_add_explicit(&g->nblocks, 1, memory_order_release);
	*out = b;
	return CUVMM_OK;
}

bool cvm_graph_take(struct cuvmm_ctx *ctx, struct cuvmm_pool *p, CUstream stream, uint64_t cap, size_t bytes,
		    void **ptr)
{
	struct cvm_captures *reg = &ctx->captures;
	struct cvm_capture *c;
	struct cvm_gblock *best = NULL;

	if (!cvm_graph_maybe(reg))
		return false;
	pthread_mutex_lock(&reg->lock);
	c = cvm_capture_find_locked(reg, cap);
	if (!c)
		goto out;
	/* Best fit, wasting at most as much as is asked for: a block freed outside this capture (an earlier
	 * graph of the pool, replayed before this one), or freed in it on this very stream. */
	for (struct cvm_gblock *b = c->gp->head.gnext; b != &c->gp->head; b = b->gnext) {
		if (!b->free || b->pool != p || b->bytes < bytes || b->bytes / 2 > bytes)
			continue;
		if (b->free_cap == cap && b->free_stream != stream)
			continue;
		if (!best || b->bytes < best->bytes)
			best = b;
	}
	if (best) {
		best->free = false;
		*ptr = best->ptr;
	}
out:
	pthread_mutex_unlock(&reg->lock);
	return best != NULL;
}

int cvm_graph_own(struct cuvmm_ctx *ctx, struct cuvmm_pool *p, int device, CUstream stream, uint64_t cap,
		  void *ptr, size_t bytes)
{
	struct cvm_captures *reg = &ctx->captures;
	struct cvm_graphs *g;
	struct cvm_capture *c = NULL;
	struct cvm_gblock *b;
	int err = CUVMM_ENOMEM;

	pthread_mutex_lock(&reg->lock);
	g = graphs_get(reg);
	if (g)
		c = capture_get(reg, g, cap, stream, device);
	if (c)
		err = block_add(g, c->gp, p, ptr, bytes, &b);
	pthread_mutex_unlock(&reg->lock);
	return err;
}

int cvm_graph_free(struct cuvmm_ctx *ctx, struct cuvmm_pool *p, int device, void *ptr, CUstream stream,
		   uint64_t cap, size_t bytes)
{
	struct cvm_captures *reg = &ctx->captures;
	struct cvm_graphs *g;
	struct cvm_gblock *b;
	struct cvm_capture *c;
	int ret = 0;

	pthread_mutex_lock(&reg->lock);
	g = graphs_get(reg);
	if (!g) {
		ret = cap ? CUVMM_ENOMEM : 0; /* none yet (then ptr is no graph block), and none to be had */
		goto out;
	}
	b = *hfind(g, ptr);
	if (b && b->pool == p) {
		if (b->free) {
			ret = CUVMM_EINVAL; /* double free */
			goto out;
		}
		ret = 1;
	} else if (cap) {
		/* Memory from outside the capture, freed inside it: its graph uses it from now on. bytes 0: not a
		 * live allocation of the pool (a bad pointer, or freed already). */
		if (!bytes) {
			ret = CUVMM_EINVAL;
			goto out;
		}
		c = capture_get(reg, g, cap, stream, device);
		ret = c ? block_add(g, c->gp, p, ptr, bytes, &b) : CUVMM_ENOMEM;
		if (ret)
			goto out;
		ret = 1;
	} else {
		goto out;
	}
	b->free = true;
	b->free_cap = cap;
	b->free_stream = stream;
out:
	pthread_mutex_unlock(&reg->lock);
	return ret;
}

void cvm_graph_forget_pool(struct cuvmm_ctx *ctx, struct cuvmm_pool *p)
{
	struct cvm_captures *reg = &ctx->captures;
	struct cvm_graphs *g;

	if (!cvm_graph_maybe(reg))
		return;
	pthread_mutex_lock(&reg->lock);
	g = atomic_load_explicit(&reg->graphs, memory_order_relaxed);
	for (struct cvm_gpool *gp = g->pools; gp; gp = gp->next) {
		for (struct cvm_gblock *b = gp->head.gnext, *next; b != &gp->head; b = next) {
			next = b->gnext;
			if (b->pool == p) {
				block_unlink(g, b);
				free(b);
			}
		}
	}
	pthread_mutex_unlock(&reg->lock);
}

int cuvmm_capture_pool(struct cuvmm_ctx *ctx, int device, CUstream stream, uint64_t share, uint64_t *graph_pool)
{
	struct cvm_captures *reg;
	struct cvm_graphs *g;
	struct cvm_capture *c;
	struct cvm_gpool *to;
	struct cvm_dev *dev;
	uint64_t cap = 0;
	int err;

	if (!ctx || !stream || !graph_pool)
		return CUVMM_EINVAL;
	err = cvm_ctx_dev(ctx, device, &dev);
	if (err)
		return err;
	err = cvm_drv_capture_id(&dev->drv, stream, &cap);
	if (err)
		return err;
	if (!cap)
		return CUVMM_ESTATE;
	reg = &ctx->captures;
	pthread_mutex_lock(&reg->lock);
	g = graphs_get(reg);
	if (!g) {
		err = CUVMM_ENOMEM;
		goto out;
	}
	to = share ? gpool_find(g, share) : NULL;
	if (share && !to) {
		err = CUVMM_EINVAL; /* no such graph pool (released, or never created) */
		goto out;
	}
	c = capture_get(reg, g, cap, stream, device);
	if (!c) {
		err = CUVMM_ENOMEM;
		goto out;
	}
	if (to && c->gp != to) {
		/* Join the shared pool: what this capture has already allocated goes with it. */
		struct cvm_gpool *from = c->gp, **pp;

		while (from->head.gnext != &from->head) {
			struct cvm_gblock *b = from->head.gnext;

			block_list_remove(b);
			block_list_add(to, b);
		}
		for (pp = &g->pools; *pp != from; pp = &(*pp)->next)
			;
		*pp = from->next;
		free(from);
		c->gp = to;
	}
	*graph_pool = c->gp->id;
out:
	pthread_mutex_unlock(&reg->lock);
	return err;
}

int cuvmm_graph_release(struct cuvmm_ctx *ctx, uint64_t graph_pool)
{
	struct cvm_captures *reg;
	struct cvm_graphs *g;
	struct cvm_gpool *gp, **pp;
	struct cvm_gblock *freed = NULL;
	int err = CUVMM_OK;

	if (!ctx || !graph_pool)
		return CUVMM_EINVAL;
	reg = &ctx->captures;
	pthread_mutex_lock(&reg->lock);
	cvm_capture_prune_locked(ctx, -1, NULL);
	g = atomic_load_explicit(&reg->graphs, memory_order_relaxed);
	if (!g) {
		err = CUVMM_EINVAL; /* no graph pool at all */
		goto out;
	}
	for (pp = &g->pools; *pp && (*pp)->id != graph_pool; pp = &(*pp)->next)
		;
	gp = *pp;
	if (!gp) {
		err = CUVMM_EINVAL;
		goto out;
	}
	for (struct cvm_capture *c = reg->list; c; c = c->next) {
		if (c->gp == gp) {
			err = CUVMM_EBUSY; /* a capture into it is still under way */
			goto out;
		}
	}
	*pp = gp->next;
	/* Free blocks go back to their pools; live ones become ordinary allocations, freed as usual later. */
	while (gp->head.gnext != &gp->head) {
		struct cvm_gblock *b = gp->head.gnext;

		block_unlink(g, b);
		if (b->free) {
			b->hnext = freed;
			freed = b;
		} else {
			free(b);
		}
	}
	free(gp);
out:
	pthread_mutex_unlock(&reg->lock);
	/* As cuvmm_free: reusable at once (the graphs are gone), unmapped only after a device synchronisation
	 * (a replay may still be running). */
	while (freed) {
		struct cvm_gblock *b = freed;
		int e = cuvmm_free(b->pool, b->ptr);

		if (e && !err)
			err = e;
		freed = b->hnext;
		free(b);
	}
	return err;
}
