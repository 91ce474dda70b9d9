/*
 * Regions: reserved address ranges mapped on demand, with fenced unmaps. See region.h.
 *
 * Access: every mapping of the library (a region's, a pool's, a kv object's, a wake's) is granted here, by
 * region_access, to the region's device and its peers (r->peers); cuvmm_ctx_add_peer grants a new peer
 * what every region of a device has mapped already.
 */
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "region.h"

#define CVM_SLOT_NEW 4 /* mapped by the map call in progress; MAPPED once it succeeds */

static void *slot_va(const struct cuvmm_region *r, size_t g)
{
	return (void *)(r->base + (g << r->gshift));
}

/* ----- fences (fence.h: one type, the device's event cache) ----- */

int cvm_region_fence_locked(struct cuvmm_region *r, CUstream stream, struct cvm_unmap **out)
{
	struct cvm_unmap *u = calloc(1, sizeof(*u));
	int err;

	if (!u)
		return CUVMM_ENOMEM;
	if (stream) {
		u->f = cvm_fence_new();
		err = u->f ? cvm_fence_record(&r->dev->fence, u->f, stream) : CUVMM_ENOMEM;
		if (err) {
			free(u->f);
			free(u);
			return err;
		}
	}
	u->id = ++r->next_fence_id;
	*out = u;
	return CUVMM_OK;
}

void cvm_region_fence_drop_locked(struct cuvmm_region *r, struct cvm_unmap *u)
{
	if (!u)
		return;
	cvm_fence_unref(&r->dev->fence, u->f);
	free(u);
}

/* ----- mapping ----- */

/* Grant [va, va+size) to the devices that get access to the region's memory: the one place that does. */
static int region_access(struct cuvmm_region *r, uintptr_t va, size_t size)
{
	return cvm_drv_set_access_devs(&r->dev->drv, &r->cnt, r->peers, va, size);
}

static void slots_set(struct cuvmm_region *r, size_t g, struct cvm_chunk *c, uint8_t state)
{
	size_t n = cvm_span(r, c);

	for (size_t i = 0; i < n; i++) {
		r->slot[g + i].chunk = c;
		r->slot[g + i].state = state;
		r->slot[g + i].pend = 0;
		r->slot[g + i].noacc = 0;
	}
}

/*
 * An unmap the driver refused (the chunk of `span` granules at g, whose granules were not counted pending):
 * the chunk stays mapped, its granules DONE and counted pending, so that cvm_region_process_locked retries
 * it (over the whole region once no fence is left). The one place of that rule.
 */
static void keep_stuck(struct cuvmm_region *r, size_t g, size_t span)
{
	for (size_t i = 0; i < span; i++)
		r->slot[g + i].state = CVM_SLOT_DONE;
	r->npending += span;
}

/* The chunk c at granule g has been unmapped: its slots are empty, its bytes no longer mapped. */
static void chunk_gone(struct cuvmm_region *r, size_t g, struct cvm_chunk *c)
{
	for (size_t i = 0; i < cvm_span(r, c); i++) {
		r->slot[g + i].chunk = NULL;
		r->slot[g + i].state = CVM_SLOT_UNMAPPED;
		r->slot[g + i].noacc = 0;
	}
	cvm_acct_map(&r->acct, -(int64_t)c->size);
}

void cvm_region_quarantine_locked(struct cuvmm_region *r, size_t g, struct cvm_chunk *c)
{
	size_t span = cvm_span(r, c);

	cvm_err("%zu bytes at %p could not be unmapped; kept mapped without access, to be retried", c->size,
		slot_va(r, g));
	for (size_t i = 0; i < span; i++) {
		r->slot[g + i].chunk = c;
		r->slot[g + i].pend = 0;
		r->slot[g + i].noacc = 1;
	}
	keep_stuck(r, g, span);
}

int cvm_region_grant_locked(struct cuvmm_region *r, size_t g)
{
	struct cvm_chunk *c = r->slot[g].chunk;
	size_t span, first;
	int err;

	if (!c || !r->slot[g].noacc)
		return CUVMM_OK;
	span = cvm_span(r, c);
	first = g & ~(span - 1); /* chunks sit on their own alignment */
	err = region_access(r, (uintptr_t)slot_va(r, first), c->size);
	if (err)
		return err;
	for (size_t i = 0; i < span; i++)
		r->slot[first + i].noacc = 0;
	return CUVMM_OK;
}

int cvm_region_chunk_unmap_locked(struct cuvmm_region *r, size_t g, struct cvm_chunk **keep)
{
	struct cvm_chunk *c = r->slot[g].chunk;
	int err = cvm_drv_unmap(&r->dev->drv, &r->cnt, (uintptr_t)slot_va(r, g), c->size);

	if (err) {
		cvm_err("unmapping %zu bytes at %p failed: %s (CUresult %d)", c->size, slot_va(r, g),
			cuvmm_strerror(err), cuvmm_last_driver_error());
		return err;
	}
	chunk_gone(r, g, c);
	if (keep)
		*keep = c;
	else
		cvm_phys_put(&r->dev->phys, c);
	return CUVMM_OK;
}

int cvm_region_chunk_map_locked(struct cuvmm_region *r, size_t g, struct cvm_chunk *c, uint8_t state)
{
	struct cvm_drv_dev *d = &r->dev->drv;
	uintptr_t va = (uintptr_t)slot_va(r, g);
	int err = cvm_drv_map(d, &r->cnt, va, c->size, c->h);

	if (err) {
		cvm_phys_undo(&r->dev->phys, c);
		return err;
	}
	err = region_access(r, va, c->size);
	if (err) {
		if (cvm_drv_unmap(d, &r->cnt, va, c->size)) {
			/* Still mapped: it must not reach the cache (another object would map it twice). */
			cvm_acct_map(&r->acct, (int64_t)c->size);
			cvm_region_quarantine_locked(r, g, c);
		} else {
			cvm_phys_undo(&r->dev->phys, c);
		}
		return err;
	}
	cvm_acct_map(&r->acct, (int64_t)c->size);
	slots_set(r, g, c, state);
	return CUVMM_OK;
}

int cvm_region_take_back_locked(struct cuvmm_region *r, size_t g)
{
	struct cvm_chunk *c = r->slot[g].chunk;
	size_t span = cvm_span(r, c);
	int err = cvm_region_grant_locked(r, g);

	if (err)
		return err;
	for (size_t i = 0; i < span; i++)
		r->slot[g + i].state = CVM_SLOT_MAPPED;
	r->npending -= span;
	return CUVMM_OK;
}

/* Unmap one chunk (first granule g) and hand it back to the device. On failure the chunk stays mapped
 * and its granules DONE, to be retried by a later pass. */
static int chunk_unmap(struct cuvmm_region *r, size_t g)
{
	return cvm_region_chunk_unmap_locked(r, g, NULL);
}

/* Undo the NEW granules of a failed map call: nothing was written to them, so no fence is needed. */
static void undo_new(struct cuvmm_region *r, size_t first, size_t end)
{
	for (size_t g = first; g < end;) {
		struct cvm_chunk *c = r->slot[g].chunk;
		size_t span;

		if (r->slot[g].state != CVM_SLOT_NEW) {
			g++;
			continue;
		}
		span = cvm_span(r, c);
		if (cvm_region_chunk_unmap_locked(r, g, &c) == CUVMM_OK) {
			/* What this call created goes back to the driver; what it took from the cache, back there. */
			cvm_phys_undo(&r->dev->phys, c);
		} else {
			/* Stuck mapped, perhaps without access: quarantined, so a later pass retries the unmap and
			 * a map that takes it back grants access first. */
			cvm_region_quarantine_locked(r, g, c);
		}
		g += span;
	}
}

size_t cvm_region_straddle_locked(const struct cuvmm_region *r, size_t first, size_t n)
{
	for (size_t g = first; g < first + n; g++) {
		const struct cvm_chunk *c = r->slot[g].chunk;
		size_t span, start;

		if (!c || (r->slot[g].state != CVM_SLOT_PENDING && r->slot[g].state != CVM_SLOT_DONE))
			continue;
		span = cvm_span(r, c);
		start = g & ~(span - 1); /* chunks sit on their own alignment (cvm_fit_cls) */
		if (start < first || start + span > first + n)
			return start + span;
	}
	return 0;
}

int cvm_region_map_locked(struct cuvmm_region *r, size_t first, size_t n, unsigned max_cls)
{
	struct cvm_drv_dev *d = &r->dev->drv;
	size_t end = first + n, g = first, newly = 0, back = 0;
	int err = CUVMM_OK;

	/* A chunk is taken back whole or not at all. Taken back in part, the rest of it would stay pending
	 * inside address space its owner (a pool) counts as unmapped, and the pool's next map or release there
	 * would cut through the chunk (the fuzzer found a pool whose live allocation was unmapped that way,
	 * once a wake had mapped packed memory in chunks of two granules and the driver refused their unmap).
	 * Such a chunk is one whose unmap failed: retry it now. */
	if (r->npending && cvm_region_straddle_locked(r, first, n)) {
		cvm_region_process_locked(r, cvm_now_ns(), false);
		if (cvm_region_straddle_locked(r, first, n))
			return CUVMM_EDRIVER;
	}

	/* Granules to take back that a failed map left without access: grant it first, so that nothing
	 * handed out faults; a refusal fails the call before anything changed. */
	for (g = first; g < end; g++) {
		err = cvm_region_grant_locked(r, g);
		if (err)
			return err;
	}
	g = first;
	while (g < end) {
		size_t run, j;

		if (r->slot[g].state != CVM_SLOT_UNMAPPED) {
			g++;
			continue;
		}
		for (run = g; run < end && r->slot[run].state == CVM_SLOT_UNMAPPED; run++)
			;
		for (j = g; j < run;) {
			unsigned cls = cvm_fit_cls(r, j, run, max_cls);
			struct cvm_chunk *c;

			err = cvm_phys_get(&r->dev->phys, r->cls0 + cls, &r->cnt, &c);
			if (err)
				goto undo;
			err = cvm_drv_map(d, &r->cnt, (uintptr_t)slot_va(r, j), c->size, c->h);
			if (err) {
				cvm_phys_undo(&r->dev->phys, c);
				goto undo;
			}
			cvm_acct_map(&r->acct, (int64_t)c->size);
			slots_set(r, j, c, CVM_SLOT_NEW);
			j += (size_t)1 << cls;
		}
		err = region_access(r, (uintptr_t)slot_va(r, g), (run - g) << r->gshift);
		if (err)
			goto undo;
		newly += run - g;
		g = run;
	}
	/* Success is certain from here: commit the new granules and take back the pending ones. */
	for (g = first; g < end; g++) {
		switch (r->slot[g].state) {
		case CVM_SLOT_NEW:
			r->slot[g].state = CVM_SLOT_MAPPED;
			break;
		case CVM_SLOT_PENDING:
		case CVM_SLOT_DONE:
			/* In use again: an idle time its last holder gave it (policy.h) no longer holds. */
			r->slot[g].chunk->freed_ns = 0;
			r->slot[g].state = CVM_SLOT_MAPPED;
			r->npending--;
			back++;
			break;
		default:
			break;
		}
	}
	cvm_acct_live(&r->acct, (int64_t)((newly + back) << r->gshift));
	return CUVMM_OK;
undo:
	undo_new(r, first, end);
	return err;
}

void cvm_region_unmap_locked(struct cuvmm_region *r, size_t first, size_t n, struct cvm_unmap *u)
{
	size_t marked = 0;

	for (size_t g = first; g < first + n; g++) {
		if (r->slot[g].state != CVM_SLOT_MAPPED)
			continue;
		r->slot[g].state = CVM_SLOT_PENDING;
		r->slot[g].pend = u->id;
		marked++;
	}
	if (!marked) {
		cvm_region_fence_drop_locked(r, u);
		return;
	}
	r->npending += marked;
	cvm_acct_live(&r->acct, -(int64_t)(marked << r->gshift));
	u->first = first;
	u->n = n;
	u->next = r->fences;
	r->fences = u;
}

/* Unmap every chunk in [first, end) (widened to chunk boundaries) whose granules are all DONE. */
static int unmap_done(struct cuvmm_region *r, size_t first, size_t end)
{
	int stuck = 0;

	if (first < end && r->slot[first].chunk)
		first &= ~(cvm_span(r, r->slot[first].chunk) - 1);
	for (size_t g = first; g < end;) {
		struct cvm_chunk *c = r->slot[g].chunk;
		size_t span, i;

		if (!c) {
			g++;
			continue;
		}
		span = cvm_span(r, c);
		for (i = 0; i < span && r->slot[g + i].state == CVM_SLOT_DONE; i++)
			;
		if (i == span) {
			if (chunk_unmap(r, g))
				stuck = 1; /* DONE and counted pending already: keep_stuck's rule holds */
			else
				r->npending -= span;
		}
		g += span;
	}
	return stuck;
}

uint64_t cvm_region_process_locked(struct cuvmm_region *r, uint64_t now, bool wait)
{
	struct cvm_fence_dev *fd = &r->dev->fence;
	struct cvm_unmap **pu, *u;
	bool busy = false;

	if (wait) {
		/* Wait without the lock: collect the fences, each with a reference of ours, so that a call that
		 * processes them meanwhile cannot give their events away; then wait on each and drop them. */
		size_t nf = 0, cap = 0;
		struct cvm_fence **fs = NULL;

		for (u = r->fences; u; u = u->next)
			cap += u->f != NULL;
		if (cap && (fs = malloc(cap * sizeof(*fs)))) {
			for (u = r->fences; u; u = u->next)
				if (u->f)
					fs[nf++] = cvm_fence_ref(u->f);
			pthread_mutex_unlock(&r->lock);
			for (size_t i = 0; i < nf; i++)
				cvm_fence_wait(fd, fs[i]);
			pthread_mutex_lock(&r->lock);
			for (size_t i = 0; i < nf; i++)
				cvm_fence_unref(fd, fs[i]);
			free(fs);
		}
	}
	for (pu = &r->fences; (u = *pu);) {
		if (u->f) {
			int done = cvm_fence_done(fd, u->f);

			if (done < 0)
				cvm_err("querying an unmap fence failed: %s (CUresult %d); keeping the memory mapped",
					cuvmm_strerror(done), cuvmm_last_driver_error());
			if (done <= 0) {
				busy = true;
				pu = &u->next;
				continue;
			}
			cvm_fence_unref(fd, u->f);
			u->f = NULL;
		}
		for (size_t g = u->first; g < u->first + u->n; g++)
			if (r->slot[g].state == CVM_SLOT_PENDING && r->slot[g].pend == u->id)
				r->slot[g].state = CVM_SLOT_DONE;
		if (unmap_done(r, u->first, u->first + u->n))
			busy = true;
		*pu = u->next;
		free(u);
	}
	if (!busy && r->npending && !r->fences) {
		/* DONE granules left over from failed unmaps: retry them over the whole region. */
		if (unmap_done(r, 0, r->ngran))
			busy = true;
	}
	return busy || r->fences ? now + CVM_FENCE_POLL_NS : UINT64_MAX;
}

size_t cvm_region_count_locked(struct cuvmm_region *r, size_t first, size_t n, enum cvm_slot_state st)
{
	size_t k = 0;

	for (size_t g = first; g < first + n; g++)
		k += r->slot[g].state == st;
	return k;
}

/* ----- for allocators that unmap what they freed (pool) ----- */

size_t cvm_region_chunk_end_locked(const struct cuvmm_region *r, size_t g)
{
	const struct cvm_chunk *c = r->slot[g].chunk;

	return c ? (g | (cvm_span(r, c) - 1)) + 1 : g + 1; /* chunks sit on their own alignment */
}

int cvm_region_release_locked(struct cuvmm_region *r, size_t first, size_t n, uint64_t since)
{
	struct cvm_unmap *f;
	int err;

	/* An unmap without a stream is complete: the caller established that no work touches the granules. */
	err = cvm_region_fence_locked(r, NULL, &f);
	if (err)
		return err;
	/* The chunks have been idle since `since`: they carry that into the device's cache. */
	for (size_t g = first; g < first + n; g++)
		if (r->slot[g].chunk)
			r->slot[g].chunk->freed_ns = since;
	cvm_region_unmap_locked(r, first, n, f);
	return CUVMM_OK;
}

int cvm_region_unmap_now_locked(struct cuvmm_region *r, const struct cvm_granules *v, size_t nv)
{
	struct cvm_drv_dev *d = &r->dev->drv;
	struct { size_t g; struct cvm_chunk *c; uint64_t since; int err; } *u;
	size_t n = 0, i = 0;

	for (size_t k = 0; k < nv; k++)
		for (size_t g = v[k].first; g < v[k].first + v[k].n; g = cvm_region_chunk_end_locked(r, g))
			n += r->slot[g].chunk != NULL;
	u = malloc((n ? n : 1) * sizeof(*u));
	if (!u)
		return CUVMM_ENOMEM;
	for (size_t k = 0; k < nv; k++)
		for (size_t g = v[k].first; g < v[k].first + v[k].n; g = cvm_region_chunk_end_locked(r, g)) {
			if (!r->slot[g].chunk)
				continue;
			u[i].g = g;
			u[i].c = r->slot[g].chunk;
			u[i].since = v[k].since;
			/* Being unmapped without the lock: cuvmm_ctx_add_peer must not grant access to it meanwhile
			 * (the driver refuses a range partly unmapped). A refused unmap keeps it noacc, so taking it
			 * back grants every device (cvm_region_grant_locked); chunk_gone clears the flag. */
			for (size_t j = 0; j < cvm_span(r, u[i].c); j++)
				r->slot[g + j].noacc = 1;
			i++;
		}
	pthread_mutex_unlock(&r->lock);
	for (i = 0; i < n; i++)
		u[i].err = cvm_drv_unmap(d, &r->cnt, (uintptr_t)slot_va(r, u[i].g), u[i].c->size);
	pthread_mutex_lock(&r->lock);
	for (i = 0; i < n; i++) {
		size_t span = cvm_span(r, u[i].c);

		cvm_acct_live(&r->acct, -(int64_t)(span << r->gshift));
		if (u[i].err) {
			keep_stuck(r, u[i].g, span);
			continue;
		}
		chunk_gone(r, u[i].g, u[i].c);
		u[i].c->freed_ns = u[i].since;
		cvm_phys_put(&r->dev->phys, u[i].c);
	}
	free(u);
	return CUVMM_OK;
}

/* ----- lifetime ----- */

static uint64_t region_reclaim(struct cvm_client *c, uint64_t now, bool force)
{
	struct cuvmm_region *r = (struct cuvmm_region *)c;
	uint64_t next;

	if (force)
		pthread_mutex_lock(&r->lock);
	else if (pthread_mutex_trylock(&r->lock))
		return now + CVM_FENCE_POLL_NS;
	next = r->npending ? cvm_region_process_locked(r, now, force) : UINT64_MAX;
	if (force)
		cvm_region_host_drop(r);
	pthread_mutex_unlock(&r->lock);
	return next;
}

static void region_client_stats(struct cvm_client *c, struct cuvmm_stats *out, const char **name)
{
	(void)name;
	cuvmm_region_stats((struct cuvmm_region *)c, out);
}

static const struct cvm_client_ops region_ops = {.reclaim = region_reclaim, .stats = region_client_stats,
						 .kind = "region"};

/* Join the device's list of regions, taking the peers added to the device meanwhile. */
static void dev_link(struct cuvmm_region *r)
{
	struct cvm_dev *dev = r->dev;

	pthread_mutex_lock(&dev->regions_lock);
	r->peers |= dev->peers_added;
	r->dev_next = dev->regions;
	r->dev_prev = &dev->regions;
	if (dev->regions)
		dev->regions->dev_prev = &r->dev_next;
	dev->regions = r;
	pthread_mutex_unlock(&dev->regions_lock);
}

static void dev_unlink(struct cuvmm_region *r)
{
	pthread_mutex_lock(&r->dev->regions_lock);
	*r->dev_prev = r->dev_next;
	if (r->dev_next)
		r->dev_next->dev_prev = r->dev_prev;
	pthread_mutex_unlock(&r->dev->regions_lock);
}

int cvm_region_init(struct cuvmm_region *r, struct cuvmm_ctx *ctx, int device, size_t max_bytes, size_t gran)
{
	return cvm_region_init_peers(r, ctx, device, max_bytes, gran, 0);
}

int cvm_region_init_peers(struct cuvmm_region *r, struct cuvmm_ctx *ctx, int device, size_t max_bytes, size_t gran,
			  uint64_t peers)
{
	struct cvm_dev *dev;
	size_t size;
	unsigned cls0 = 0;
	int err;

	err = cvm_ctx_dev(ctx, device, &dev);
	if (err)
		return err;
	err = cvm_ctx_peers(ctx, device, peers ? peers : ctx->cfg.peer_access, &peers);
	if (err)
		return err;
	if (!gran)
		gran = dev->info.granularity;
	if ((gran & (gran - 1)) || gran < dev->info.granularity)
		return CUVMM_EINVAL;
	while ((dev->info.granularity << cls0) < gran)
		cls0++;
	if (cls0 >= CVM_NCLASS)
		return CUVMM_EINVAL;
	if (max_bytes == 0 || max_bytes > SIZE_MAX - gran + 1)
		return CUVMM_EINVAL;
	size = (max_bytes + gran - 1) & ~(gran - 1);
	memset(r, 0, sizeof(*r));
	r->ctx = ctx;
	r->dev = dev;
	r->gran = gran;
	r->gshift = (unsigned)__builtin_ctzll(gran);
	r->cls0 = (uint8_t)cls0;
	r->peers = peers;
	r->size = size;
	r->ngran = size >> r->gshift;
	r->acct.parent = &dev->acct;
	r->cnt.parent = &dev->drv.cnt;
	r->client.ops = &region_ops;
	r->client.dev = dev;
	/* Reserve before allocating the per-granule table: a range that cannot be reserved is ENOSPC, and its
	 * table (16 bytes per granule: 128 GiB for 2^63 bytes) must not be tried, let alone fail first. */
	err = cvm_drv_reserve(&dev->drv, size, &r->base);
	if (err)
		return err == CUVMM_ENOMEM || err == CUVMM_EINVAL ? CUVMM_ENOSPC : err;
	r->slot = calloc(r->ngran, sizeof(*r->slot));
	if (!r->slot || pthread_mutex_init(&r->lock, NULL)) {
		err = CUVMM_ENOMEM;
		goto fail;
	}
	cvm_acct_reserved(&r->acct, (int64_t)size);
	dev_link(r);
	return CUVMM_OK;
fail:
	if (cvm_drv_unreserve(&dev->drv, r->base, size))
		cvm_err("freeing %zu bytes of address space at %p failed", size, (void *)r->base);
	free(r->slot);
	return err;
}

void cvm_region_fini(struct cuvmm_region *r)
{
	struct cvm_drv_dev *d = &r->dev->drv;

	dev_unlink(r);
	pthread_mutex_lock(&r->lock);
	if (r->npending)
		cvm_region_process_locked(r, cvm_now_ns(), true);
	/* Whatever is still mapped: the caller guarantees no GPU work touches it any more. */
	for (size_t g = 0; g < r->ngran;) {
		struct cvm_chunk *c = r->slot[g].chunk;
		size_t span = c ? cvm_span(r, c) : 1;

		if (c) {
			size_t live = 0;

			for (size_t i = 0; i < span; i++)
				live += r->slot[g + i].state == CVM_SLOT_MAPPED;
			if (chunk_unmap(r, g) == CUVMM_OK)
				cvm_acct_live(&r->acct, -(int64_t)(live << r->gshift));
		}
		g += span;
	}
	while (r->fences) {
		struct cvm_unmap *f = r->fences;

		r->fences = f->next;
		cvm_region_fence_drop_locked(r, f);
	}
	cvm_region_sleep_fini(r);
	pthread_mutex_unlock(&r->lock);
	if (cvm_drv_unreserve(d, r->base, r->size))
		cvm_err("freeing %zu bytes of address space at %p failed", r->size, (void *)r->base);
	cvm_acct_reserved(&r->acct, -(int64_t)r->size);
	/* What is still counted live (a sleeping region's, or chunks that could not be unmapped) goes too. */
	cvm_acct_live(&r->acct, -(int64_t)atomic_load(&r->acct.live));
	pthread_mutex_destroy(&r->lock);
	free(r->slot);
}

/* ----- public API ----- */

static void region_client_destroy(struct cvm_client *c)
{
	cuvmm_region_destroy((struct cuvmm_region *)c);
}

int cuvmm_region_create_ex(struct cuvmm_ctx *ctx, int device, size_t max_bytes, size_t granularity,
			   struct cuvmm_region **out)
{
	struct cuvmm_region *r;
	int err;

	if (!ctx || !out || max_bytes == 0)
		return CUVMM_EINVAL;
	r = malloc(sizeof(*r));
	if (!r)
		return CUVMM_ENOMEM;
	err = cvm_region_init(r, ctx, device, max_bytes, granularity);
	if (err) {
		free(r);
		return err;
	}
	r->client.destroy = region_client_destroy;
	cvm_ctx_add_client(ctx, &r->client);
	*out = r;
	return CUVMM_OK;
}

int cuvmm_region_create(struct cuvmm_ctx *ctx, int device, size_t max_bytes, struct cuvmm_region **out)
{
	return cuvmm_region_create_ex(ctx, device, max_bytes, 0, out);
}

void cuvmm_region_destroy(struct cuvmm_region *r)
{
	if (!r)
		return;
	cvm_ctx_remove_client(r->ctx, &r->client);
	cvm_region_fini(r);
	free(r);
}

void *cuvmm_region_base(const struct cuvmm_region *r)
{
	return r ? (void *)r->base : NULL;
}

size_t cuvmm_region_size(const struct cuvmm_region *r)
{
	return r ? r->size : 0;
}

size_t cuvmm_region_granularity(const struct cuvmm_region *r)
{
	return r ? r->gran : 0;
}

static int check_range(const struct cuvmm_region *r, size_t offset, size_t len)
{
	if (!r || len == 0 || (offset & (r->gran - 1)) || (len & (r->gran - 1)))
		return CUVMM_EINVAL;
	if (offset > r->size || len > r->size - offset)
		return CUVMM_EINVAL;
	return CUVMM_OK;
}

int cuvmm_region_map(struct cuvmm_region *r, size_t offset, size_t len)
{
	int err = check_range(r, offset, len);

	if (err)
		return err;
	pthread_mutex_lock(&r->lock);
	if (cvm_region_asleep(r)) {
		err = CUVMM_ESTATE;
	} else {
		if (r->npending)
			cvm_region_process_locked(r, cvm_now_ns(), false);
		err = cvm_region_map_locked(r, offset >> r->gshift, len >> r->gshift, 0);
	}
	pthread_mutex_unlock(&r->lock);
	cvm_ctx_poll(r->ctx);
	return err;
}

/*
 * The shared tail of unmap and resize: with the lock held and `need` granules to unmap, get a fence for
 * `stream`. A NULL stream means all work on the device: synchronise it without the lock, then the fence is
 * complete. Returns with the lock held; *f NULL when nothing needs unmapping.
 */
static int fence_for(struct cuvmm_region *r, CUstream stream, size_t need, struct cvm_unmap **f)
{
	int err;

	*f = NULL;
	if (!need)
		return CUVMM_OK;
	if (!stream) {
		pthread_mutex_unlock(&r->lock);
		err = cvm_dev_sync(r->dev);
		pthread_mutex_lock(&r->lock);
		if (err)
			return err;
		if (cvm_region_asleep(r))
			return CUVMM_ESTATE;
	}
	return cvm_region_fence_locked(r, stream, f);
}

static void after_unmap(struct cuvmm_region *r)
{
	uint64_t next = cvm_region_process_locked(r, cvm_now_ns(), false);

	pthread_mutex_unlock(&r->lock);
	if (next != UINT64_MAX)
		cvm_ctx_kick(r->ctx, next);
	cvm_ctx_poll(r->ctx);
}

int cuvmm_region_unmap(struct cuvmm_region *r, size_t offset, size_t len, CUstream stream)
{
	struct cvm_unmap *f;
	size_t first, n;
	int err = check_range(r, offset, len);

	if (err)
		return err;
	first = offset >> r->gshift;
	n = len >> r->gshift;
	pthread_mutex_lock(&r->lock);
	if (cvm_region_asleep(r)) {
		pthread_mutex_unlock(&r->lock);
		return CUVMM_ESTATE;
	}
	err = fence_for(r, stream, cvm_region_count_locked(r, first, n, CVM_SLOT_MAPPED), &f);
	if (err) {
		pthread_mutex_unlock(&r->lock);
		return err;
	}
	if (f)
		cvm_region_unmap_locked(r, first, n, f);
	after_unmap(r);
	return CUVMM_OK;
}

int cuvmm_region_resize(struct cuvmm_region *r, size_t bytes, CUstream stream)
{
	struct cvm_unmap *f;
	size_t keep;
	int err;

	if (!r || bytes > r->size)
		return CUVMM_EINVAL;
	keep = (bytes + r->gran - 1) >> r->gshift;
	pthread_mutex_lock(&r->lock);
	if (cvm_region_asleep(r)) {
		pthread_mutex_unlock(&r->lock);
		return CUVMM_ESTATE;
	}
	if (r->npending)
		cvm_region_process_locked(r, cvm_now_ns(), false);
	err = fence_for(r, stream, cvm_region_count_locked(r, keep, r->ngran - keep, CVM_SLOT_MAPPED), &f);
	if (!err && keep)
		err = cvm_region_map_locked(r, 0, keep, 0);
	if (err) {
		cvm_region_fence_drop_locked(r, f);
		pthread_mutex_unlock(&r->lock);
		return err;
	}
	if (f)
		cvm_region_unmap_locked(r, keep, r->ngran - keep, f);
	after_unmap(r);
	return CUVMM_OK;
}

int cuvmm_region_stats(struct cuvmm_region *r, struct cuvmm_stats *out)
{
	if (!r || cvm_stats_check(out))
		return CUVMM_EINVAL;
	cvm_acct_fill(&r->acct, &r->cnt, out);
	return CUVMM_OK;
}

/* ----- peers ----- */

/* Grant `peer` everything the region has mapped (live, or pending its unmap: a kernel of the peer may
 * still read it), run by run. Quarantined chunks are left to cvm_region_grant_locked, which grants r->peers
 * when they are taken back. On failure r->peers is unchanged (some runs may be granted already). */
static int region_add_peer_locked(struct cuvmm_region *r, int peer)
{
	uint64_t bit = (uint64_t)1 << peer;

	if (r->peers & bit)
		return CUVMM_OK;
	for (size_t g = 0; g < r->ngran;) {
		size_t run = g;
		int err;

		while (run < r->ngran && r->slot[run].chunk && r->slot[run].state != CVM_SLOT_UNMAPPED &&
		       !r->slot[run].noacc)
			run++;
		if (run == g) {
			g++;
			continue;
		}
		err = cvm_drv_set_access_devs(&r->dev->drv, &r->cnt, bit, (uintptr_t)slot_va(r, g),
					      (run - g) << r->gshift);
		if (err)
			return err;
		g = run;
	}
	r->peers |= bit;
	return CUVMM_OK;
}

int cuvmm_ctx_add_peer(struct cuvmm_ctx *ctx, int device, int peer)
{
	struct cvm_dev *dev;
	uint64_t peers;
	int err;

	if (!ctx || device < 0 || device >= ctx->ndev || peer < 0 || peer >= ctx->ndev)
		return CUVMM_EINVAL;
	err = cvm_ctx_dev(ctx, device, &dev);
	if (!err)
		err = cvm_ctx_peers(ctx, device, (uint64_t)1 << peer, &peers);
	if (err)
		return err;
	pthread_mutex_lock(&dev->regions_lock);
	for (struct cuvmm_region *r = dev->regions; r && !err; r = r->dev_next) {
		pthread_mutex_lock(&r->lock);
		err = region_add_peer_locked(r, peer);
		pthread_mutex_unlock(&r->lock);
	}
	if (!err)
		dev->peers_added |= (uint64_t)1 << peer;
	pthread_mutex_unlock(&dev->regions_lock);
	cvm_ctx_poll(ctx);
	return err;
}

uint64_t cuvmm_region_peers(struct cuvmm_region *r)
{
	uint64_t peers;

	if (!r)
		return 0;
	pthread_mutex_lock(&r->lock);
	peers = r->peers;
	pthread_mutex_unlock(&r->lock);
	return peers;
}
