/*
 * KV blocks: page-aware block allocation over `tensors` parallel regions. See kv.h.
 * Lock order: kv->lock, then a tensor region's lock.
 */
#include <sched.h>
#include <stdlib.h>
#include <string.h>

#include "kv.h"
#include "log.h"

#define NONE UINT32_MAX
#define CVM_KV_AHEAD 2 /* empty pages kept mapped ahead of demand while allocation is active */

static size_t page_shift(const struct cuvmm_kv *kv)
{
	return kv->t[0].gshift;
}

static void block_pages(const struct cuvmm_kv *kv, uint32_t b, uint32_t *first, uint32_t *last)
{
	size_t lo = (size_t)b * kv->block_bytes;

	*first = (uint32_t)(lo >> page_shift(kv));
	*last = (uint32_t)((lo + kv->block_bytes - 1) >> page_shift(kv));
}

/* Home blocks of page p: [lo, hi). */
static void page_blocks(const struct cuvmm_kv *kv, uint32_t p, uint32_t *lo, uint32_t *hi)
{
	size_t g = kv->t[0].gran, B = kv->block_bytes;
	size_t a = ((size_t)p * g + B - 1) / B, z = ((size_t)(p + 1) * g + B - 1) / B;

	*lo = (uint32_t)(a < kv->max_blocks ? a : kv->max_blocks);
	*hi = (uint32_t)(z < kv->max_blocks ? z : kv->max_blocks);
}

static bool busy(const struct cuvmm_kv *kv, uint32_t b)
{
	return kv->busy[b / 64] >> (b % 64) & 1;
}

static void set_busy(struct cuvmm_kv *kv, uint32_t b, bool v)
{
	if (v)
		kv->busy[b / 64] |= (uint64_t)1 << (b % 64);
	else
		kv->busy[b / 64] &= ~((uint64_t)1 << (b % 64));
}

/* ----- occupancy buckets: mapped pages with a free home block, by allocated home blocks ----- */

static void bucket_remove(struct cuvmm_kv *kv, uint32_t p)
{
	struct cvm_kv_page *pg = &kv->pg[p];

	if (!pg->in_bucket)
		return;
	if (pg->bprev != NONE)
		kv->pg[pg->bprev].bnext = pg->bnext;
	else
		kv->bucket[pg->used] = pg->bnext;
	if (pg->bnext != NONE)
		kv->pg[pg->bnext].bprev = pg->bprev;
	pg->in_bucket = false;
}

static void bucket_insert(struct cuvmm_kv *kv, uint32_t p)
{
	struct cvm_kv_page *pg = &kv->pg[p];

	if (pg->in_bucket || !pg->mapped || pg->used >= pg->cap)
		return;
	pg->bprev = NONE;
	pg->bnext = kv->bucket[pg->used];
	if (pg->bnext != NONE)
		kv->pg[pg->bnext].bprev = p;
	kv->bucket[pg->used] = p;
	pg->in_bucket = true;
	if (pg->used > kv->top)
		kv->top = pg->used;
}

/* The fullest mapped page with room, or NONE. */
static uint32_t fullest(struct cuvmm_kv *kv)
{
	for (;;) {
		if (kv->bucket[kv->top] != NONE)
			return kv->bucket[kv->top];
		if (kv->top == 0)
			return NONE;
		kv->top--;
	}
}

/* ----- mapping pages in every tensor ----- */

static void fence_put(struct cuvmm_kv *kv, struct cvm_fence *f)
{
	cvm_fence_unref(&kv->dev->fence, f);
}

/* Undo of a failed call: unmap page p of tensors [0, n) at once (nothing used it), giving chunks this call
 * created back to the driver and cached ones back to the cache, so held is as before the call. */
static void unmap_page_undo(struct cuvmm_kv *kv, uint32_t p, uint32_t n)
{
	for (uint32_t t = 0; t < n; t++) {
		struct cuvmm_region *r = &kv->t[t];
		struct cvm_chunk *c;

		pthread_mutex_lock(&r->lock);
		c = r->slot[p].chunk;
		cvm_acct_live(&r->acct, -(int64_t)r->gran);
		if (cvm_region_chunk_unmap_locked(r, p, &c) == CUVMM_OK)
			cvm_phys_undo(&r->dev->phys, c);
		else
			cvm_region_quarantine_locked(r, p, c); /* a later map of the page takes it back */
		pthread_mutex_unlock(&r->lock);
	}
}

/* Unmap empty page p in every tensor; its chunks go to the device's cache idle since the page emptied, so
 * that the release delay is counted once (policy.h). */
static void unmap_page(struct cuvmm_kv *kv, uint32_t p)
{
	for (uint32_t t = 0; t < kv->tensors; t++) {
		struct cuvmm_region *r = &kv->t[t];

		pthread_mutex_lock(&r->lock);
		/* The caller established that no GPU work touches the page. */
		if (cvm_region_release_locked(r, p, 1, kv->pg[p].empty_ns) == CUVMM_OK)
			cvm_region_process_locked(r, cvm_now_ns(), false);
		pthread_mutex_unlock(&r->lock);
	}
	bucket_remove(kv, p);
	kv->pg[p].mapped = false;
	kv->mapped_pages--;
}

/* Map page p in every tensor; all or nothing. Touches only the tensors' regions (their locks), so the
 * background pass can call it without the kv lock. */
static int map_page_tensors(struct cuvmm_kv *kv, uint32_t p)
{
	uint32_t t;
	int err = CUVMM_OK;

	for (t = 0; t < kv->tensors; t++) {
		struct cuvmm_region *r = &kv->t[t];

		pthread_mutex_lock(&r->lock);
		err = cvm_region_map_locked(r, p, 1, 0);
		pthread_mutex_unlock(&r->lock);
		if (err)
			break;
	}
	if (err)
		unmap_page_undo(kv, p, t);
	return err;
}

static int map_page(struct cuvmm_kv *kv, uint32_t p)
{
	int err = map_page_tensors(kv, p);

	if (!err) {
		kv->pg[p].mapped = true;
		kv->mapped_pages++;
	}
	return err;
}

/* A page to back next: the lowest page that is unmapped, not being mapped, and has room. */
static uint32_t unmapped_page(struct cuvmm_kv *kv)
{
	for (uint32_t p = 0; p < kv->npages; p++)
		if (!kv->pg[p].mapped && !kv->pg[p].mapping && kv->pg[p].used < kv->pg[p].cap)
			return p;
	return NONE;
}

/* A page becomes empty (refs 0): it stays mapped, fenced by f, until the idle delay passes. f NULL: blocks a
 * failed call took and gives back, which no work touched: the page keeps the fence it had. */
static void page_emptied(struct cuvmm_kv *kv, uint32_t p, struct cvm_fence *f, uint64_t now)
{
	struct cvm_kv_page *pg = &kv->pg[p];

	pg->empty_ns = now;
	if (f) {
		fence_put(kv, pg->fence);
		pg->fence = cvm_fence_ref(f);
	}
	kv->empty_pages++;
}

/* A page gains its first block again: no longer empty (its fence stays until it empties again). */
static void page_filled(struct cuvmm_kv *kv)
{
	kv->empty_pages--;
}

/* Take block b for the caller: map the pages it touches that are not mapped (recorded in newp[] so a
 * failed call can undo them). */
static int take_block(struct cuvmm_kv *kv, uint32_t b, uint32_t *newp, uint32_t *nnew)
{
	uint32_t first, last, home;
	int err;

	block_pages(kv, b, &first, &last);
	for (uint32_t q = first; q <= last; q++) {
		if (kv->pg[q].mapped)
			continue;
		err = map_page(kv, q);
		if (err)
			return err;
		newp[(*nnew)++] = q;
		kv->pg[q].empty_ns = cvm_now_ns();
		kv->empty_pages++;
		bucket_insert(kv, q);
	}
	for (uint32_t q = first; q <= last; q++) {
		if (kv->pg[q].refs++ == 0)
			page_filled(kv);
	}
	home = first;
	bucket_remove(kv, home);
	kv->pg[home].used++;
	bucket_insert(kv, home);
	set_busy(kv, b, true);
	return CUVMM_OK;
}

/* Give block b back (its pages stay mapped). */
static void put_block(struct cuvmm_kv *kv, uint32_t b, struct cvm_fence *f, uint64_t now)
{
	uint32_t first, last;

	block_pages(kv, b, &first, &last);
	set_busy(kv, b, false);
	bucket_remove(kv, first);
	kv->pg[first].used--;
	bucket_insert(kv, first);
	for (uint32_t q = first; q <= last; q++) {
		if (--kv->pg[q].refs == 0)
			page_emptied(kv, q, f, now);
	}
}

/* A free home block of page p that touches no page the background pass is mapping, or NONE. */
static uint32_t free_home_block(struct cuvmm_kv *kv, uint32_t p)
{
	uint32_t lo, hi, first, last;

	page_blocks(kv, p, &lo, &hi);
	for (uint32_t b = lo; b < hi; b++) {
		bool ok = !busy(kv, b);

		if (ok && kv->mapping_ahead) {
			block_pages(kv, b, &first, &last);
			for (uint32_t q = first; ok && q <= last; q++)
				ok = !kv->pg[q].mapping;
		}
		if (ok)
			return b;
	}
	return NONE;
}

/* ----- public API ----- */

void cuvmm_kv_config_init(struct cuvmm_kv_config *cfg)
{
	if (!cfg)
		return;
	memset(cfg, 0, sizeof(*cfg));
	cfg->size = sizeof(*cfg);
	cfg->tensors = 1;
}

static uint64_t kv_reclaim(struct cvm_client *c, uint64_t now, bool force);

static void kv_client_destroy(struct cvm_client *c)
{
	cuvmm_kv_destroy((struct cuvmm_kv *)c);
}

static void kv_client_stats(struct cvm_client *c, struct cuvmm_stats *out, const char **name)
{
	(void)name;
	cuvmm_kv_stats((struct cuvmm_kv *)c, out);
}

static const struct cvm_client_ops kv_ops = {.reclaim = kv_reclaim, .stats = kv_client_stats, .kind = "kv"};

int cuvmm_kv_create(struct cuvmm_ctx *ctx, const struct cuvmm_kv_config *cfg, struct cuvmm_kv **out)
{
	struct cuvmm_kv *kv;
	size_t total;
	uint32_t t = 0;
	int err;

	/* Tensors are bounded before their table is allocated: 2^32 of them asked for a terabyte of it. */
	if (!ctx || !cfg || !out || cfg->size < sizeof(*cfg) || !cfg->block_bytes || !cfg->max_blocks ||
	    !cfg->tensors || cfg->tensors > CVM_KV_MAX_TENSORS || cfg->block_bytes > SIZE_MAX / cfg->max_blocks)
		return CUVMM_EINVAL;
	total = cfg->block_bytes * cfg->max_blocks;
	if (total > SIZE_MAX / cfg->tensors)
		return CUVMM_EINVAL; /* the address space of all tensors together overflows */
	kv = calloc(1, sizeof(*kv));
	if (!kv)
		return CUVMM_ENOMEM;
	kv->ctx = ctx;
	kv->block_bytes = cfg->block_bytes;
	kv->max_blocks = cfg->max_blocks;
	kv->tensors = cfg->tensors;
	kv->ahead = CVM_KV_AHEAD;
	kv->t = calloc(cfg->tensors, sizeof(*kv->t));
	if (!kv->t) {
		err = CUVMM_ENOMEM;
		goto fail;
	}
	for (t = 0; t < cfg->tensors; t++) {
		err = cvm_region_init_peers(&kv->t[t], ctx, cfg->device, total, 0, cfg->peer_access);
		if (err)
			goto fail;
		kv->t[t].acct.live_private = true;
	}
	kv->dev = kv->t[0].dev;
	if (kv->t[0].ngran > UINT32_MAX - 1) {
		err = CUVMM_EINVAL;
		goto fail;
	}
	kv->npages = (uint32_t)kv->t[0].ngran;
	kv->pg = calloc(kv->npages, sizeof(*kv->pg));
	kv->busy = calloc((kv->max_blocks + 63) / 64, sizeof(*kv->busy));
	if (!kv->pg || !kv->busy || pthread_mutex_init(&kv->lock, NULL)) {
		err = CUVMM_ENOMEM;
		goto fail;
	}
	for (uint32_t p = 0; p < kv->npages; p++) {
		uint32_t lo, hi;

		page_blocks(kv, p, &lo, &hi);
		kv->pg[p].cap = hi - lo;
		if (kv->pg[p].cap > kv->max_cap)
			kv->max_cap = kv->pg[p].cap;
		kv->pg[p].bnext = kv->pg[p].bprev = NONE;
	}
	kv->bucket = malloc(((size_t)kv->max_cap + 1) * sizeof(*kv->bucket));
	if (!kv->bucket) {
		pthread_mutex_destroy(&kv->lock);
		err = CUVMM_ENOMEM;
		goto fail;
	}
	for (uint32_t i = 0; i <= kv->max_cap; i++)
		kv->bucket[i] = NONE;
	kv->acct.parent = &kv->dev->acct;
	kv->client.ops = &kv_ops;
	kv->client.dev = kv->dev;
	kv->client.destroy = kv_client_destroy;
	cvm_ctx_add_client(ctx, &kv->client);
	*out = kv;
	return CUVMM_OK;
fail:
	while (t-- > 0)
		cvm_region_fini(&kv->t[t]);
	free(kv->t);
	free(kv->pg);
	free(kv->busy);
	free(kv);
	return err;
}

void cuvmm_kv_destroy(struct cuvmm_kv *kv)
{
	if (!kv)
		return;
	cvm_ctx_remove_client(kv->ctx, &kv->client);
	if (kv->nblocks_live)
		cvm_warn("kv destroyed with %u blocks still allocated", kv->nblocks_live);
	cvm_acct_live(&kv->acct, -(int64_t)atomic_load(&kv->acct.live));
	/* Blocks freed without a stream may still be read by the GPU until the device is idle. */
	cvm_dev_sync(kv->dev);
	for (uint32_t p = 0; p < kv->npages; p++)
		fence_put(kv, kv->pg[p].fence);
	for (uint32_t t = 0; t < kv->tensors; t++)
		cvm_region_fini(&kv->t[t]);
	pthread_mutex_destroy(&kv->lock);
	free(kv->t);
	free(kv->pg);
	free(kv->busy);
	free(kv->bucket);
	free(kv);
}

void *cuvmm_kv_tensor(const struct cuvmm_kv *kv, uint32_t tensor)
{
	return kv && tensor < kv->tensors ? (void *)kv->t[tensor].base : NULL;
}

int cuvmm_kv_alloc(struct cuvmm_kv *kv, uint32_t n, uint32_t *ids)
{
	uint32_t *newp, *got_ids, nnew = 0, got = 0, ppb, nset = 0, aside;
	uint64_t t0;
	int err = CUVMM_OK;

	if (!kv || !ids || n == 0)
		return CUVMM_EINVAL;
	pthread_mutex_lock(&kv->lock);
	if (n > kv->max_blocks - kv->nblocks_live) {
		pthread_mutex_unlock(&kv->lock);
		return CUVMM_ENOSPC;
	}
	/* Each block maps at most the pages it touches, plus the page chosen for it: room to record them for
	 * undo; the ids go to the caller's array only on success. */
	ppb = (uint32_t)((kv->block_bytes + kv->t[0].gran - 1) >> page_shift(kv)) + 2;
	/* [0, n*ppb+1): pages this call mapped; then the ids; then pages set aside (at most all of them). */
	newp = malloc(((size_t)n * (ppb + 1) + 1 + kv->npages) * sizeof(*newp));
	if (!newp) {
		pthread_mutex_unlock(&kv->lock);
		return CUVMM_ENOMEM;
	}
	got_ids = newp + (size_t)n * ppb + 1;
	aside = (uint32_t)((size_t)n * (ppb + 1) + 1);
	t0 = cvm_now_ns();
	while (got < n) {
		uint32_t p = fullest(kv), b;

		/* A page whose free blocks all reach into a page being mapped ahead: set aside for this call. */
		while (p != NONE && free_home_block(kv, p) == NONE) {
			bucket_remove(kv, p);
			newp[nset++ + aside] = p;
			p = fullest(kv);
		}

		if (p == NONE) {
			uint64_t m0 = cvm_now_ns();

			p = unmapped_page(kv);
			if (p == NONE) {
				err = CUVMM_ENOSPC;
				break;
			}
			err = map_page(kv, p);
			if (err)
				break;
			kv->backing_ns += cvm_now_ns() - m0;
			kv->backings++;
			newp[nnew++] = p;
			kv->pg[p].empty_ns = t0;
			kv->empty_pages++;
			bucket_insert(kv, p);
		}
		b = free_home_block(kv, p);
		err = take_block(kv, b, newp, &nnew);
		if (err)
			break;
		got_ids[got++] = b;
	}
	if (err) {
		/* All or nothing: give back the blocks and unmap the pages this call mapped. */
		while (got > 0)
			put_block(kv, got_ids[--got], NULL, t0);
		for (uint32_t i = 0; i < nnew; i++) {
			struct cvm_kv_page *pg = &kv->pg[newp[i]];

			fence_put(kv, pg->fence);
			pg->fence = NULL;
			kv->empty_pages--;
			unmap_page_undo(kv, newp[i], kv->tensors);
			bucket_remove(kv, newp[i]);
			pg->mapped = false;
			kv->mapped_pages--;
		}
	} else {
		memcpy(ids, got_ids, (size_t)n * sizeof(*ids));
		kv->nblocks_live += n;
		kv->last_alloc_ns = t0;
		cvm_acct_live(&kv->acct, (int64_t)((size_t)n * kv->block_bytes * kv->tensors));
	}
	for (uint32_t i = 0; i < nset; i++)
		bucket_insert(kv, newp[aside + i]);
	free(newp);
	/* Running low on room in mapped pages: let the background pass map ahead. */
	if (!err && kv->empty_pages < kv->ahead && (kv->top == 0 || fullest(kv) == NONE))
		cvm_ctx_kick(kv->ctx, cvm_now_ns());
	pthread_mutex_unlock(&kv->lock);
	cvm_ctx_poll(kv->ctx);
	return err;
}

int cuvmm_kv_free(struct cuvmm_kv *kv, uint32_t n, const uint32_t *ids, CUstream stream)
{
	struct cvm_fence *f = NULL;
	uint64_t now;
	uint32_t i;
	int err = CUVMM_OK;

	if (!kv || !ids || n == 0)
		return CUVMM_EINVAL;
	pthread_mutex_lock(&kv->lock);
	/* Validate everything first (range, allocated, no id twice) so a bad list changes nothing. */
	for (i = 0; i < n; i++) {
		if (ids[i] >= kv->max_blocks || !busy(kv, ids[i])) {
			err = CUVMM_EINVAL;
			break;
		}
		set_busy(kv, ids[i], false);
	}
	while (i-- > 0)
		set_busy(kv, ids[i], true);
	if (err)
		goto out;
	/* One fence shared by the pages this call empties: an event on the stream, or the device epoch. */
	f = cvm_fence_new();
	if (!f) {
		err = CUVMM_ENOMEM;
		goto out;
	}
	if (stream)
		err = cvm_fence_record(&kv->dev->fence, f, stream);
	else
		cvm_fence_set_epoch(&kv->dev->fence, f);
	if (err) {
		fence_put(kv, f);
		goto out;
	}
	now = cvm_now_ns();
	for (i = 0; i < n; i++)
		put_block(kv, ids[i], f, now);
	kv->nblocks_live -= n;
	cvm_acct_live(&kv->acct, -(int64_t)((size_t)n * kv->block_bytes * kv->tensors));
	fence_put(kv, f);
	cvm_ctx_kick_freed(kv->ctx, now);
out:
	pthread_mutex_unlock(&kv->lock);
	cvm_ctx_poll(kv->ctx);
	return err;
}

/* Is an empty page safe to unmap? Asks its fence; `sync` is set when a device synchronisation would make it
 * safe (an epoch fence). */
static bool page_safe(struct cuvmm_kv *kv, struct cvm_kv_page *pg, bool *sync)
{
	if (!pg->fence || cvm_fence_done(&kv->dev->fence, pg->fence) > 0)
		return true;
	if (!pg->fence->ev)
		*sync = true;
	return false;
}

/*
 * The reclaim pass: map pages ahead of demand while allocation is active, and unmap pages that the policy
 * says are due (every empty page, with force), the release lead early: their chunks go to the device's
 * cache idle since the page emptied, so they are back with the driver release_delay_ms after that.
 */
static uint64_t kv_reclaim(struct cvm_client *c, uint64_t now, bool force)
{
	struct cuvmm_kv *kv = (struct cuvmm_kv *)c;
	const struct cvm_policy *pol = &kv->ctx->policy;
	uint64_t next = UINT64_MAX, lead;
	bool sync = false, synced = false, active;
	uint32_t unmapped = 0;

	if (force)
		pthread_mutex_lock(&kv->lock);
	else if (pthread_mutex_trylock(&kv->lock))
		return now + CVM_FENCE_POLL_NS;
	if (force) {
		/* A trim: let a map-ahead in flight (lock dropped) finish so its page is seen below, and map
		 * nothing ahead again until the next allocation. */
		while (kv->mapping_ahead) {
			pthread_mutex_unlock(&kv->lock);
			sched_yield();
			pthread_mutex_lock(&kv->lock);
		}
		kv->last_alloc_ns = 0;
	}
	/* Ahead of demand only while blocks are in use and allocation was recent. */
	active = !force && kv->nblocks_live && kv->last_alloc_ns && cvm_policy_recent(pol, kv->last_alloc_ns, now);
	while (active && kv->empty_pages + kv->mapping_ahead < kv->ahead) {
		uint32_t p = unmapped_page(kv);
		int err;

		if (p == NONE)
			break;
		/* Map without the kv lock (one map per tensor takes milliseconds): allocations go on meanwhile,
		 * and skip this page. A block straddling into it from a mapped page may map it first; then
		 * the pass finds it mapped and backs off. */
		kv->pg[p].mapping = true;
		kv->mapping_ahead++;
		pthread_mutex_unlock(&kv->lock);
		err = map_page_tensors(kv, p);
		pthread_mutex_lock(&kv->lock);
		kv->pg[p].mapping = false;
		kv->mapping_ahead--;
		if (err)
			break;
		if (kv->pg[p].mapped)
			continue; /* not reached: nothing maps a page that is being mapped ahead */
		kv->pg[p].mapped = true;
		kv->mapped_pages++;
		kv->pg[p].empty_ns = now;
		kv->empty_pages++;
		bucket_insert(kv, p);
	}
	/* Each empty page is one chunk per tensor to unmap and release. */
	lead = force ? 0 : cvm_dev_release_lead(kv->dev, (size_t)kv->empty_pages * kv->tensors);
again:
	for (uint32_t p = 0; p < kv->npages && kv->empty_pages; p++) {
		struct cvm_kv_page *pg = &kv->pg[p];

		if (!pg->mapped || pg->refs)
			continue;
		if (!force && !cvm_policy_due(pol, pg->empty_ns, now, lead)) {
			uint64_t t = cvm_policy_deadline(pol, pg->empty_ns, lead);

			if (t < next)
				next = t;
			continue;
		}
		if (!page_safe(kv, pg, &sync)) {
			if (pg->fence->ev && now + CVM_FENCE_POLL_NS < next)
				next = now + CVM_FENCE_POLL_NS;
			continue;
		}
		fence_put(kv, pg->fence);
		pg->fence = NULL;
		kv->empty_pages--;
		unmap_page(kv, p);
		unmapped++;
	}
	if (sync && !synced) {
		pthread_mutex_unlock(&kv->lock);
		cvm_dev_sync_epoch(kv->dev);
		pthread_mutex_lock(&kv->lock);
		synced = true;
		sync = false;
		goto again;
	}
	pthread_mutex_unlock(&kv->lock);
	/* The release decision: pages whose blocks are all free, unmapped in every tensor. */
	if (unmapped)
		cvm_info("kv: unmapped %u empty page(s) in %u tensors (%.1f MiB): %s", unmapped, kv->tensors,
			 (double)unmapped * kv->tensors * cuvmm_region_granularity(kv->t) / 1048576.0,
			 force ? "trim" : "empty for release_delay_ms");
	return next;
}

/* Could block b take a block without mapping anything: free, and every page it touches mapped? */
static bool placeable(struct cuvmm_kv *kv, uint32_t b)
{
	uint32_t first, last;

	if (busy(kv, b))
		return false;
	block_pages(kv, b, &first, &last);
	for (uint32_t q = first; q <= last; q++)
		if (!kv->pg[q].mapped)
			return false;
	return true;
}

/* A placeable home block of page p (a compaction destination), or NONE. */
static uint32_t free_mapped_block(struct cuvmm_kv *kv, uint32_t p)
{
	uint32_t lo, hi;

	page_blocks(kv, p, &lo, &hi);
	for (uint32_t b = lo; b < hi; b++)
		if (placeable(kv, b))
			return b;
	return NONE;
}

/* Placeable home blocks of page p: the room compaction may count on there. */
static uint32_t eligible_room(struct cuvmm_kv *kv, uint32_t p)
{
	uint32_t lo, hi, n = 0;

	page_blocks(kv, p, &lo, &hi);
	for (uint32_t b = lo; b < hi; b++)
		n += placeable(kv, b);
	return n;
}

/*
 * Compaction plan. Sources are chosen up front: the sparsest pages in use (whose blocks all start on them),
 * as many as the other mapped pages have room for; all of them leave the buckets before any move, so no
 * block moves into a page that is being drained, and no block moves twice. Destinations are blocks whose
 * pages are all mapped, so compaction never maps a page. On failure nothing stays allocated.
 */
int cuvmm_kv_compact(struct cuvmm_kv *kv, uint32_t max_moves, struct cuvmm_kv_move *moves, uint32_t *n_moves)
{
	uint32_t *order = NULL, *skipped = NULL, nsrc = 0, nskip = 0, n = 0, take = 0;
	uint64_t room = 0, need = 0;
	int err = CUVMM_OK;

	if (!kv || !n_moves || (max_moves && !moves))
		return CUVMM_EINVAL;
	pthread_mutex_lock(&kv->lock);
	order = malloc((size_t)kv->npages * sizeof(*order));
	skipped = malloc((size_t)kv->npages * sizeof(*skipped));
	if (!order || !skipped) {
		err = CUVMM_ENOMEM;
		goto out;
	}
	for (uint32_t p = 0; p < kv->npages; p++) {
		if (!kv->pg[p].mapped)
			continue;
		room += eligible_room(kv, p);
		if (kv->pg[p].used && kv->pg[p].used == kv->pg[p].refs)
			order[nsrc++] = p;
	}
	for (uint32_t i = 1; i < nsrc; i++) { /* insertion sort by occupancy */
		uint32_t p = order[i], j = i;

		while (j > 0 && kv->pg[order[j - 1]].used > kv->pg[p].used) {
			order[j] = order[j - 1];
			j--;
		}
		order[j] = p;
	}
	/* The longest prefix of sparse pages whose blocks fit in the room the rest leaves. */
	for (; take < nsrc; take++) {
		struct cvm_kv_page *pg = &kv->pg[order[take]];

		uint32_t own = eligible_room(kv, order[take]);

		if (need + pg->used > max_moves || need + pg->used > room - own)
			break;
		need += pg->used;
		room -= own;
	}
	for (uint32_t i = 0; i < take; i++)
		bucket_remove(kv, order[i]);
	for (uint32_t i = 0; i < take && !err; i++) {
		uint32_t lo, hi;

		page_blocks(kv, order[i], &lo, &hi);
		for (uint32_t b = lo; b < hi && !err; b++) {
			uint32_t dst, to = NONE, nf = 0, newp[2];

			if (!busy(kv, b))
				continue;
			while ((dst = fullest(kv)) != NONE && (to = free_mapped_block(kv, dst)) == NONE) {
				bucket_remove(kv, dst); /* only straddling free blocks left there */
				skipped[nskip++] = dst;
			}
			if (to == NONE || take_block(kv, to, newp, &nf)) {
				err = CUVMM_ENOMEM; /* not reached when the room count holds */
				break;
			}
			moves[n].from = b;
			moves[n].to = to;
			n++;
		}
	}
	if (err) {
		while (n > 0)
			put_block(kv, moves[--n].to, NULL, cvm_now_ns());
	} else {
		kv->nblocks_live += n;
		cvm_acct_live(&kv->acct, (int64_t)((size_t)n * kv->block_bytes * kv->tensors));
	}
	for (uint32_t i = 0; i < take; i++)
		bucket_insert(kv, order[i]);
	for (uint32_t i = 0; i < nskip; i++)
		bucket_insert(kv, skipped[i]);
out:
	free(order);
	free(skipped);
	if (!err)
		*n_moves = n;
	pthread_mutex_unlock(&kv->lock);
	return err;
}

int cuvmm_kv_stats(struct cuvmm_kv *kv, struct cuvmm_stats *out)
{
	struct cuvmm_stats s;

	if (!kv || cvm_stats_check(out))
		return CUVMM_EINVAL;
	memset(&s, 0, sizeof(s));
	s.size = out->size;
	cvm_acct_lock(&kv->acct); /* the device's: one snapshot of every tensor */
	for (uint32_t t = 0; t < kv->tensors; t++) {
		struct cuvmm_stats r = {.size = sizeof(r)};

		cvm_acct_fill_locked(&kv->t[t].acct, &kv->t[t].cnt, &r);
		s.reserved_bytes += r.reserved_bytes;
		s.held_bytes += r.held_bytes;
		s.mapped_bytes += r.mapped_bytes;
		s.peak_held_bytes += r.peak_held_bytes;
		s.create_calls += r.create_calls;
		s.release_calls += r.release_calls;
		s.map_calls += r.map_calls;
		s.unmap_calls += r.unmap_calls;
		s.driver_ns += r.driver_ns;
	}
	s.live_bytes = atomic_load(&kv->acct.live);
	s.peak_live_bytes = atomic_load(&kv->acct.peak_live);
	cvm_acct_unlock(&kv->acct);
	*out = s;
	return CUVMM_OK;
}
