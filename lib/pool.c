/*
 * Pools: the entry points (create, destroy, malloc, free and their stream-ordered forms, stats, sleep, wake).
 * The layout is in pool.h; the pool's other files are listed in pool_int.h. Everything here runs under the
 * pool's lock (p->r.lock) unless a function says otherwise.
 */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "graph.h"
#include "log.h"
#include "pool_int.h"

void cuvmm_pool_config_init(struct cuvmm_pool_config *cfg)
{
	if (!cfg)
		return;
	memset(cfg, 0, sizeof(*cfg));
	cfg->size = sizeof(*cfg);
}

static void pool_client_destroy(struct cvm_client *c)
{
	cuvmm_pool_destroy((struct cuvmm_pool *)c);
}

static void pool_client_stats(struct cvm_client *c, struct cuvmm_stats *out, const char **name)
{
	struct cuvmm_pool *p = (struct cuvmm_pool *)c;

	cuvmm_pool_stats(p, out);
	*name = p->name;
}

static const struct cvm_client_ops pool_ops = {.reclaim = cvm_pool_reclaim, .stats = pool_client_stats, .kind = "pool"};

int cvm_pool_config_read(const struct cuvmm_pool_config *in, struct cuvmm_pool_config *out)
{
	/* A config of a header before coarse_bytes (its size ends where that field begins) gets its default. */
	size_t old = offsetof(struct cuvmm_pool_config, coarse_bytes);

	cuvmm_pool_config_init(out);
	if (!in)
		return CUVMM_OK;
	if (in->size != old && in->size < sizeof(*in))
		return CUVMM_EINVAL;
	memcpy(out, in, in->size == old ? old : sizeof(*out));
	out->size = sizeof(*out);
	return CUVMM_OK;
}

int cuvmm_pool_create(struct cuvmm_ctx *ctx, const struct cuvmm_pool_config *user, struct cuvmm_pool **out)
{
	struct cuvmm_pool_config c, *cfg = &c;
	struct cuvmm_pool *p;
	struct cvm_dev *dev;
	struct cvm_run *va;
	size_t max, coarse;
	int err;

	if (!ctx || !out)
		return CUVMM_EINVAL;
	err = cvm_pool_config_read(user, &c);
	if (err)
		return err;
	coarse = cfg->coarse_bytes;
	err = cvm_ctx_dev(ctx, cfg->device, &dev);
	if (err)
		return err;
	max = cfg->max_bytes;
	if (!max) {
		/* Address space is plentiful: twice the memory a pool could ever hold, so fragmentation of
		 * address space never runs it out before physical memory does. */
		max = dev->phys.limit < (SIZE_MAX >> 2) ? 2 * dev->phys.limit : dev->phys.limit;
		if (max < ((size_t)1 << 30))
			max = (size_t)1 << 30;
	}
	p = calloc(1, sizeof(*p));
	if (!p)
		return CUVMM_ENOMEM;
	err = cvm_region_init_peers(&p->r, ctx, cfg->device, max, 0, cfg->peer_access);
	if (err) {
		free(p);
		return err;
	}
	p->r.acct.live_private = true;
	p->coarse_k = cvm_gcount(p, coarse);
	p->pacct.parent = &dev->acct;
	snprintf(p->name, sizeof(p->name), "%s", cfg->name ? cfg->name : "pool");
	p->edge = calloc(p->r.ngran, sizeof(*p->edge));
	va = calloc(1, sizeof(*va));
	cvm_slab_setup(p);
	if (!p->edge || !va || cvm_seg_init(&p->vseg, p->r.ngran) || cvm_seg_init(&p->fseg, p->r.ngran) ||
	    cvm_pool_pack_init(p)) {
		cvm_seg_fini(&p->vseg);
		cvm_seg_fini(&p->fseg);
		cvm_pool_pack_fini(p);
		free(va);
		free(p->edge);
		cvm_region_fini(&p->r);
		free(p);
		return CUVMM_ENOMEM;
	}
	cvm_list_init(&p->age);
	cvm_list_init(&p->pend);
	va->start = 0;
	va->len = p->r.ngran;
	va->kind = CVM_RUN_VA;
	cvm_edges_set(p, va);
	cvm_bin_insert(p, va);
	p->win_start = cvm_now_ns();
	p->client.ops = &pool_ops;
	p->client.dev = dev;
	p->client.destroy = pool_client_destroy;
	cvm_ctx_add_client(ctx, &p->client);
	*out = p;
	return CUVMM_OK;
}

void cuvmm_pool_destroy(struct cuvmm_pool *p)
{
	if (!p)
		return;
	cvm_ctx_remove_client(p->r.ctx, &p->client);
	cvm_graph_forget_pool(p->r.ctx, p);
	pthread_mutex_lock(&p->r.lock);
	if (p->live)
		cvm_warn("pool \"%s\" destroyed with %zu bytes still allocated", p->name, p->live);
	cvm_acct_live(&p->pacct, -(int64_t)p->live);
	cvm_slab_discard(p);
	for (size_t g = 0; g < p->r.ngran;) {
		struct cvm_run *run = p->edge[g];
		size_t len = run->len;

		if (run->kind == CVM_RUN_SLAB)
			free(run->slab);
		cvm_fence_clear(&p->r.dev->fence, &run->fence);
		free(run);
		g += len;
	}
	pthread_mutex_unlock(&p->r.lock);
	/* Whatever was freed without a stream may still be in use by the GPU until the device is idle. */
	cvm_dev_sync(p->r.dev);
	cvm_region_fini(&p->r);
	cvm_seg_fini(&p->vseg);
	cvm_seg_fini(&p->fseg);
	cvm_pool_pack_fini(p);
	free(p->edge);
	free(p);
}

/* The allocation itself. `stream` NULL: no stream-ordered reuse (also under capture, see pool_malloc). */
static int pool_alloc(struct cuvmm_pool *p, size_t bytes, CUstream stream, void **ptr)
{
	struct cvm_run *run;
	size_t k;
	int err;

	pthread_mutex_lock(&p->r.lock);
	if (cvm_region_asleep(&p->r)) {
		err = CUVMM_ESTATE;
		goto out;
	}
	if (p->ndq)
		cvm_slab_drain(p, 4);
	if (p->pend.lnext != &p->pend)
		cvm_settle_pending(p, 4);
	if (bytes <= p->small_max) {
		err = cvm_slab_alloc(p, bytes, stream, ptr);
		goto out;
	}
	if (bytes <= p->pack_max && !cvm_pool_coarse(p, bytes)) {
		err = cvm_pool_pack_alloc(p, bytes, stream, ptr);
		goto out;
	}
	k = cvm_gcount(p, bytes);
	err = cvm_get_run(p, k, stream, true, &run);
	if (err)
		goto out;
	run->kind = CVM_RUN_USED;
	run->bytes = bytes;
	cvm_fp_add(p, run->len, true);
	cvm_pool_live_add(p, (int64_t)bytes);
	*ptr = (void *)(p->r.base + (run->start << p->r.gshift));
out:
	pthread_mutex_unlock(&p->r.lock);
	cvm_ctx_poll(p->r.ctx);
	return err;
}

/* The bytes the pool counts for a live allocation at `a` (a large or packed one's size, a small one's class),
 * or 0 if `a` is not one. Lock held. */
static size_t live_bytes_locked(struct cuvmm_pool *p, uintptr_t a)
{
	size_t g = (a - p->r.base) >> p->r.gshift;
	struct cvm_run *run = p->edge[g];
	struct cvm_pack_alloc *x = cvm_pool_pack_find(p, a);

	if (x)
		return x->pending ? 0 : x->bytes; /* (pending: freed on a stream already) */
	if (run && run->kind == CVM_RUN_SLAB)
		return cvm_slab_live_bytes(p, a);
	if (!run || run->kind != CVM_RUN_USED || run->start != g || (a & (p->r.gran - 1)))
		return 0;
	return run->bytes;
}

/*
 * Under stream capture (graph.h): memory the capture freed is reused inside its graph pool first; otherwise
 * the pool serves it, with no stream-ordered reuse of memory freed on the capturing stream before the capture
 * began (the graph's replays run later, maybe elsewhere: only memory whose freeing work has completed is
 * taken), and the graph pool owns the result.
 */
static int pool_malloc(struct cuvmm_pool *p, size_t bytes, CUstream stream, void **ptr)
{
	uint64_t cap = 0;
	void *q;
	int err;

	if (!p || !ptr || bytes == 0 || bytes > p->r.size)
		return bytes > 0 && p && ptr ? CUVMM_ENOSPC : CUVMM_EINVAL;
	err = cvm_drv_capture_id(&p->r.dev->drv, stream, &cap);
	if (err)
		return err;
	if (!cap) {
		cvm_capture_not_capturing(p->r.ctx, stream);
		return pool_alloc(p, bytes, stream, ptr);
	}
	if (cvm_graph_take(p->r.ctx, p, stream, cap, bytes, ptr))
		return CUVMM_OK;
	err = pool_alloc(p, bytes, NULL, &q);
	if (err)
		return err;
	pthread_mutex_lock(&p->r.lock);
	bytes = live_bytes_locked(p, (uintptr_t)q);
	pthread_mutex_unlock(&p->r.lock);
	err = cvm_graph_own(p->r.ctx, p, p->r.dev->drv.index, stream, cap, q, bytes);
	if (err) {
		cuvmm_free(p, q);
		return err;
	}
	*ptr = q;
	return CUVMM_OK;
}

int cuvmm_malloc(struct cuvmm_pool *p, size_t bytes, void **ptr)
{
	return pool_malloc(p, bytes, NULL, ptr);
}

int cuvmm_malloc_async(struct cuvmm_pool *p, size_t bytes, CUstream stream, void **ptr)
{
	return pool_malloc(p, bytes, stream, ptr);
}

static int pool_free(struct cuvmm_pool *p, void *ptr, CUstream stream, bool async)
{
	uintptr_t a = (uintptr_t)ptr;
	struct cvm_pack_alloc *x;
	struct cvm_run *run;
	struct cvm_fence fence, *f = NULL;
	uint64_t cap = 0;
	size_t g;
	int err = CUVMM_OK;
	bool kick;

	if (!p)
		return CUVMM_EINVAL;
	if (!ptr)
		return CUVMM_OK;
	if (a < p->r.base || a >= p->r.base + p->r.size || (a & 255))
		return CUVMM_EINVAL;
	if (async && stream) {
		err = cvm_drv_capture_id(&p->r.dev->drv, stream, &cap);
		if (err)
			return err;
		if (!cap)
			cvm_capture_not_capturing(p->r.ctx, stream);
	}
	if (cap || cvm_graph_maybe(&p->r.ctx->captures)) {
		/* Graph memory stays with its graph pool; memory freed under capture joins it. */
		size_t bytes = 0;

		if (cap) {
			pthread_mutex_lock(&p->r.lock);
			bytes = cvm_region_asleep(&p->r) ? 0 : live_bytes_locked(p, a);
			err = cvm_region_asleep(&p->r) ? CUVMM_ESTATE : CUVMM_OK;
			pthread_mutex_unlock(&p->r.lock);
			if (err)
				return err;
		}
		/* Under capture it always decides (1 or an error); outside, 0 leaves the free to the pool. */
		err = cvm_graph_free(p->r.ctx, p, p->r.dev->drv.index, ptr, stream, cap, bytes);
		if (err)
			return err > 0 ? CUVMM_OK : err;
	}
	g = (a - p->r.base) >> p->r.gshift;
	pthread_mutex_lock(&p->r.lock);
	if (cvm_region_asleep(&p->r)) {
		err = CUVMM_ESTATE;
		goto out;
	}
	if (!live_bytes_locked(p, a)) {
		err = CUVMM_EINVAL; /* not an allocation of this pool, or freed already */
		goto out;
	}
	run = p->edge[g];
	if (async && stream) {
		/* Fence the free on the stream; on failure nothing has changed yet. cap is 0: the stream was
		 * seen not capturing above. */
		err = cvm_fence_record_uncaptured(&p->r.dev->fence, &fence, stream);
		if (err)
			goto out;
		f = &fence;
	}
	x = cvm_pool_pack_find(p, a);
	if (x) {
		cvm_pool_pack_free(p, x, f);
	} else if (run->kind == CVM_RUN_SLAB) {
		cvm_slab_free(p, a, f);
	} else {
		cvm_pool_live_add(p, -(int64_t)run->bytes);
		cvm_run_release(p, run, f);
	}
out:
	kick = !err && p->free_bytes > cvm_slack_cap(p);
	if (kick && !async)
		atomic_store_explicit(&p->want_sync, true, memory_order_relaxed);
	/* (the cache is counted by the pass itself; reading it here would take the device mutex) */
	pthread_mutex_unlock(&p->r.lock);
	if (kick)
		cvm_ctx_kick(p->r.ctx, cvm_now_ns());
	else if (!err)
		cvm_ctx_kick_freed(p->r.ctx, cvm_now_ns());
	cvm_ctx_poll(p->r.ctx);
	return err;
}

int cuvmm_free(struct cuvmm_pool *p, void *ptr)
{
	return pool_free(p, ptr, NULL, false);
}

int cuvmm_free_async(struct cuvmm_pool *p, void *ptr, CUstream stream)
{
	return pool_free(p, ptr, stream, true);
}

int cuvmm_pool_stats(struct cuvmm_pool *p, struct cuvmm_stats *out)
{
	if (!p || cvm_stats_check(out))
		return CUVMM_EINVAL;
	cvm_acct_lock(&p->r.acct); /* one snapshot of both accounts */
	cvm_acct_fill_locked(&p->r.acct, &p->r.cnt, out);
	out->live_bytes = atomic_load(&p->pacct.live);
	out->peak_live_bytes = atomic_load(&p->pacct.peak_live);
	cvm_acct_unlock(&p->r.acct);
	return CUVMM_OK;
}

int cuvmm_pool_sleep_prepare(struct cuvmm_pool *p, size_t bytes)
{
	if (!p)
		return CUVMM_EINVAL;
	if (!bytes) {
		/* What a sleep would copy now: the mapped memory but the free runs, which it gives back first. */
		pthread_mutex_lock(&p->r.lock);
		bytes = (size_t)atomic_load(&p->r.acct.mapped);
		bytes = bytes > p->free_bytes ? bytes - p->free_bytes : 0;
		pthread_mutex_unlock(&p->r.lock);
	}
	return cvm_region_sleep_prepare(&p->r, bytes);
}

/*
 * Sleep: synchronise the device (memory freed without a stream may still be in use, and stream frees
 * settle), give the free memory back, then sleep the region under the allocations. The lock is held
 * throughout: the pool is unusable while it goes to sleep anyway.
 */
int cuvmm_pool_sleep(struct cuvmm_pool *p, enum cuvmm_sleep_mode mode, CUstream stream)
{
	struct cvm_run *run, *next;
	int err;

	if (!p || (mode != CUVMM_SLEEP_OFFLOAD && mode != CUVMM_SLEEP_DISCARD))
		return CUVMM_EINVAL;
	pthread_mutex_lock(&p->r.lock);
	if (cvm_region_asleep(&p->r)) {
		err = CUVMM_ESTATE;
		goto out;
	}
	err = cvm_dev_sync_epoch(p->r.dev);
	if (err)
		goto out;
	cvm_wait_going(p);
	cvm_slab_drain(p, INT32_MAX);
	cvm_settle_pending(p, INT32_MAX);
	for (run = p->age.lnext; run != &p->age; run = next) {
		next = run->lnext;
		cvm_free_to_va(p, run);
	}
	if (cvm_region_pending_locked(&p->r))
		cvm_region_process_locked(&p->r, cvm_now_ns(), false);
	if (p->ndq || p->pend.lnext != &p->pend || p->free_bytes || cvm_region_pending_locked(&p->r)) {
		err = CUVMM_EBUSY; /* work submitted meanwhile, or an unmap the driver refused */
		goto out;
	}
	err = cvm_region_sleep_locked(&p->r, mode, stream);
	/* (not with chunks quarantined by a refused unmap: the wake takes them back as recorded) */
	if (!err && !cvm_region_pending_locked(&p->r)) {
		/* A pool that sleeps holds weights, or something as long-lived: the wake maps each allocation of
		 * 32 granules or more with handles as large as fit (powers of two, up to 128 MiB: a 128 MiB tensor
		 * in one handle instead of 64), for the wake and every later sleep, whose unmaps and releases then
		 * cost little beside the copies. Run boundaries stay chunk boundaries: the memory, once freed, is
		 * reused under the cut rule like any large-handle memory. Packed allocations below. */
		for (size_t g = 0; g < p->r.ngran;) {
			size_t end = g;

			run = p->edge[g];
			if (run->kind == CVM_RUN_USED && run->len >= 32)
				cvm_region_sleep_coarsen(&p->r, run->start, run->len, cvm_whole_cls(run->len));
			if (run->kind != CVM_RUN_PACK) {
				g += run->len;
				continue;
			}
			/* Packed allocations (tensors of 512 KiB to 64 MiB, most of a model's bytes) lie on
			 * back-to-back PACK runs of 2 MiB chunks: those come back in handles of up to
			 * CVM_PACK_MAX_GRANULES granules (the largest packed allocation), and pool_wake_pack
			 * merges the PACK runs of each. Such a chunk goes back once none of its granules holds a
			 * live byte. */
			while (end < p->r.ngran && p->edge[end]->kind == CVM_RUN_PACK)
				end += p->edge[end]->len;
			cvm_region_sleep_coarsen(&p->r, g, end - g, cvm_whole_cls(CVM_PACK_MAX_GRANULES));
			g = end;
		}
	}
out:
	pthread_mutex_unlock(&p->r.lock);
	if (!err)
		cvm_phys_reclaim(&p->r.dev->phys, cvm_now_ns(), true, p->r.ctx->policy.retain_bytes);
	return err;
}

int cuvmm_pool_wake(struct cuvmm_pool *p, CUstream stream)
{
	int err;

	if (!p)
		return CUVMM_EINVAL;
	pthread_mutex_lock(&p->r.lock);
	err = cvm_region_wake_locked(&p->r, stream);
	if (!err)
		cvm_pool_pack_woken(p);
	pthread_mutex_unlock(&p->r.lock);
	return err;
}
