/*
 * Physical memory of one device: chunk cache and byte accounting. See phys.h for the contract.
 */
#include <sched.h>
#include <stdlib.h>
#include <string.h>

#include "drv.h"
#include "log.h"
#include "phys.h"
#include "policy.h"

static pthread_mutex_t *acct_lock(struct cvm_acct *a)
{
	while (a->parent)
		a = a->parent;
	return &a->lock;
}

void cvm_acct_lock(struct cvm_acct *a)
{
	pthread_mutex_lock(acct_lock(a));
}

void cvm_acct_unlock(struct cvm_acct *a)
{
	pthread_mutex_unlock(acct_lock(a));
}

/* Called with the account lock held: plain read-modify-write, the peak in the same step. */
static void acct_add(_Atomic uint64_t *f, _Atomic uint64_t *peak, int64_t delta)
{
	uint64_t v = atomic_load_explicit(f, memory_order_relaxed) + (uint64_t)delta;

	atomic_store_explicit(f, v, memory_order_relaxed);
	if (peak && v > atomic_load_explicit(peak, memory_order_relaxed))
		atomic_store_explicit(peak, v, memory_order_relaxed);
}

void cvm_acct_reserved(struct cvm_acct *a, int64_t delta)
{
	cvm_acct_lock(a);
	for (struct cvm_acct *x = a; x; x = x->parent)
		acct_add(&x->reserved, NULL, delta);
	cvm_acct_unlock(a);
}

void cvm_acct_held(struct cvm_acct *a, int64_t delta)
{
	cvm_acct_lock(a);
	for (struct cvm_acct *x = a; x; x = x->parent)
		acct_add(&x->held, &x->peak_held, delta);
	cvm_acct_unlock(a);
}

void cvm_acct_map(struct cvm_acct *a, int64_t delta)
{
	cvm_acct_lock(a);
	acct_add(&a->held, &a->peak_held, delta);
	for (struct cvm_acct *x = a; x; x = x->parent)
		acct_add(&x->mapped, NULL, delta);
	cvm_acct_unlock(a);
}

void cvm_acct_live(struct cvm_acct *a, int64_t delta)
{
	cvm_acct_lock(a);
	for (struct cvm_acct *x = a; x; x = x->live_private ? NULL : x->parent)
		acct_add(&x->live, &x->peak_live, delta);
	cvm_acct_unlock(a);
}

int cvm_stats_check(const struct cuvmm_stats *out)
{
	return out && out->size >= sizeof(struct cuvmm_stats) ? CUVMM_OK : CUVMM_EINVAL;
}

void cvm_acct_fill_locked(struct cvm_acct *a, const struct cvm_drv_counters *c, struct cuvmm_stats *out)
{
	size_t size = out->size;

	memset(out, 0, sizeof(*out));
	out->size = size;
	out->reserved_bytes = atomic_load(&a->reserved);
	out->held_bytes = atomic_load(&a->held);
	out->mapped_bytes = atomic_load(&a->mapped);
	out->live_bytes = atomic_load(&a->live);
	out->peak_held_bytes = atomic_load(&a->peak_held);
	out->peak_live_bytes = atomic_load(&a->peak_live);
	out->create_calls = atomic_load(&c->create_calls);
	out->release_calls = atomic_load(&c->release_calls);
	out->map_calls = atomic_load(&c->map_calls);
	out->unmap_calls = atomic_load(&c->unmap_calls);
	out->driver_ns = atomic_load(&c->driver_ns);
}

void cvm_acct_fill(struct cvm_acct *a, const struct cvm_drv_counters *c, struct cuvmm_stats *out)
{
	cvm_acct_lock(a);
	cvm_acct_fill_locked(a, c, out);
	cvm_acct_unlock(a);
}

/* Circular doubly-linked lists with a sentinel; two link sets per chunk. */
static void list_init(struct cvm_chunk *h)
{
	h->cnext = h->cprev = h;
	h->anext = h->aprev = h;
}

static void cache_insert(struct cvm_phys *p, struct cvm_chunk *c)
{
	struct cvm_chunk *ch = &p->cls[c->cls], *ah = &p->age;

	/* class list: newest first (reuse the warmest); age list: oldest first (release the coldest) */
	c->cnext = ch->cnext;
	c->cprev = ch;
	ch->cnext->cprev = c;
	ch->cnext = c;
	c->aprev = ah->aprev;
	c->anext = ah;
	ah->aprev->anext = c;
	ah->aprev = c;
	p->cached += c->size;
	p->ncached++;
}

static void cache_remove(struct cvm_phys *p, struct cvm_chunk *c)
{
	c->cprev->cnext = c->cnext;
	c->cnext->cprev = c->cprev;
	c->aprev->anext = c->anext;
	c->anext->aprev = c->aprev;
	c->cnext = c->cprev = c->anext = c->aprev = NULL;
	p->cached -= c->size;
	p->ncached--;
}

int cvm_phys_init(struct cvm_phys *p, const struct cvm_phys_params *par)
{
	memset(p, 0, sizeof(*p));
	if (pthread_mutex_init(&p->lock, NULL))
		return CUVMM_ENOMEM;
	if (pthread_mutex_init(&par->acct->lock, NULL)) {
		pthread_mutex_destroy(&p->lock);
		return CUVMM_ENOMEM;
	}
	p->dd = par->dd;
	p->granularity = par->granularity;
	p->limit = par->limit;
	p->acct = par->acct;
	p->policy = par->policy;
	p->wake = par->wake;
	p->wake_arg = par->wake_arg;
	for (int i = 0; i < CVM_NCLASS; i++)
		list_init(&p->cls[i]);
	list_init(&p->age);
	return CUVMM_OK;
}

/* Release a chunk to the driver; the caller holds no lock, and has taken it out of the cache (`taken`:
 * counted in p->releasing) or has it from its holder. Returns the bytes given back: 0 when the driver
 * refused (the chunk is then cached again, still held). */
static size_t chunk_release(struct cvm_phys *p, struct cvm_chunk *c, bool taken)
{
	size_t size = c->size;
	int err = cvm_drv_release(p->dd, &p->dd->cnt, c->h);

	if (err) {
		/* The driver kept it, so it is still held: back into the cache, to be retried by a later pass. */
		cvm_err("releasing a %zu-byte chunk on device %d failed: %s (CUresult %d); will retry", c->size,
			p->dd->index, cuvmm_strerror(err), cuvmm_last_driver_error());
		atomic_fetch_add(&p->release_failures, 1);
		pthread_mutex_lock(&p->lock);
		cache_insert(p, c);
		p->releasing -= taken;
		pthread_mutex_unlock(&p->lock);
		return 0;
	}
	/* The account first, the claim second: a creator that sees the room can count its chunk only after
	 * this one left the statistics, so held never reads above the limit. */
	cvm_acct_held(p->acct, -(int64_t)size);
	pthread_mutex_lock(&p->lock);
	p->held -= size;
	p->releasing -= taken;
	pthread_mutex_unlock(&p->lock);
	free(c);
	return size;
}

/* Take chunks out of the cache, oldest first, until `bytes` are out, passing over chunks of class `skip_cls`
 * (-1: none); returns a chain (through anext) for the caller to release once it dropped the lock. Called with
 * the lock held. */
static struct cvm_chunk *take_oldest(struct cvm_phys *p, size_t bytes, int skip_cls)
{
	struct cvm_chunk *chain = NULL, *c = p->age.anext, *next;
	size_t got = 0;

	while (c != &p->age && got < bytes) {
		next = c->anext;
		if (c->cls != skip_cls) {
			got += c->size;
			cache_remove(p, c);
			p->releasing++;
			c->anext = chain;
			chain = c;
		}
		c = next;
	}
	return chain;
}

static size_t release_chain(struct cvm_phys *p, struct cvm_chunk *chain)
{
	size_t freed = 0;

	while (chain) {
		struct cvm_chunk *next = chain->anext;

		freed += chunk_release(p, chain, true);
		chain = next;
	}
	return freed;
}

int cvm_phys_get(struct cvm_phys *p, unsigned cls, struct cvm_drv_counters *cnt, struct cvm_chunk **out)
{
	size_t size = p->granularity << cls;
	struct cvm_chunk *c, *evict = NULL;
	int err;

	if (cls >= CVM_NCLASS)
		return CUVMM_EINVAL;
	pthread_mutex_lock(&p->lock);
again:
	c = p->cls[cls].cnext;
	if (c != &p->cls[cls]) {
		cache_remove(p, c);
		pthread_mutex_unlock(&p->lock);
		c->freed_ns = 0;
		c->created = false;
		*out = c;
		return CUVMM_OK;
	}
	/* A miss: make room under the limit first. The room is claimed only once the releases that make it
	 * have succeeded: a release the driver refuses keeps its chunk held (cached again), and then there
	 * is no room. Each round releases something or gives up, so this ends. */
	if (p->held + size > p->limit) {
		size_t need = p->held + size - p->limit;

		if (p->cached < need) {
			pthread_mutex_unlock(&p->lock);
			return CUVMM_ENOMEM;
		}
		evict = take_oldest(p, need, -1);
		pthread_mutex_unlock(&p->lock);
		if (!release_chain(p, evict))
			return CUVMM_ENOMEM;
		pthread_mutex_lock(&p->lock);
		goto again;
	}
	/* Trade cached chunks of other sizes for the new one. */
	evict = NULL;
	if (p->cached)
		evict = take_oldest(p, size, (int)cls);
	p->held += size; /* claimed now so that racing creators respect the limit */
	pthread_mutex_unlock(&p->lock);
	release_chain(p, evict);

	c = calloc(1, sizeof(*c));
	if (!c) {
		err = CUVMM_ENOMEM;
		goto fail;
	}
	c->size = size;
	c->cls = (uint8_t)cls;
	c->created = true;
	err = cvm_drv_create(p->dd, cnt ? cnt : &p->dd->cnt, size, &c->h);
	if (err == CUVMM_ENOMEM) {
		/* The device is full even though we are under our limit: give back the whole cache and retry. */
		pthread_mutex_lock(&p->lock);
		evict = take_oldest(p, SIZE_MAX, -1);
		pthread_mutex_unlock(&p->lock);
		if (evict) {
			release_chain(p, evict);
			err = cvm_drv_create(p->dd, cnt ? cnt : &p->dd->cnt, size, &c->h);
		}
	}
	if (err)
		goto fail;
	cvm_acct_held(p->acct, (int64_t)size);
	*out = c;
	return CUVMM_OK;
fail:
	free(c);
	pthread_mutex_lock(&p->lock);
	p->held -= size;
	pthread_mutex_unlock(&p->lock);
	return err;
}

void cvm_phys_release(struct cvm_phys *p, struct cvm_chunk *c)
{
	(void)chunk_release(p, c, false);
}

void cvm_phys_undo(struct cvm_phys *p, struct cvm_chunk *c)
{
	if (c->created)
		chunk_release(p, c, false);
	else
		cvm_phys_put(p, c);
}

void cvm_phys_put(struct cvm_phys *p, struct cvm_chunk *c)
{
	const struct cvm_policy *pol = p->policy;
	uint64_t now = cvm_now_ns(), since;

	/* A chunk that was idle before it was unmapped (a pool's slack, a kv page) keeps its idle time. */
	if (!c->freed_ns || c->freed_ns > now)
		c->freed_ns = now;
	since = c->freed_ns; /* once cached, the chunk is the cache's: another thread may take it */
	pthread_mutex_lock(&p->lock);
	cache_insert(p, c);
	pthread_mutex_unlock(&p->lock);
	if (cvm_policy_at_once(pol))
		cvm_phys_reclaim(p, now, true, pol->retain_bytes);
	else if (!cvm_policy_never(pol))
		p->wake(p->wake_arg, cvm_policy_deadline(pol, since, cvm_policy_max_lead(pol)));
}

#define CVM_RELEASE_BATCH 64 /* chunks taken out of the cache per round of releases */

uint64_t cvm_phys_reclaim(struct cvm_phys *p, uint64_t now, bool force, size_t keep_bytes)
{
	const struct cvm_policy *pol = p->policy;
	struct cvm_chunk *chain = NULL, *c;
	uint64_t next = UINT64_MAX, lead;
	size_t gone = 0, left;
	unsigned n = 0;

	if (force) {
		/* Everything beyond keep_bytes means what another thread is releasing too: wait for it (a trim
		 * must not return while that still counts as held, and a chunk the driver refused it comes back
		 * to the cache for this pass). Those releases take no lock the caller may hold. */
		pthread_mutex_lock(&p->lock);
		while (p->releasing) {
			pthread_mutex_unlock(&p->lock);
			sched_yield();
			pthread_mutex_lock(&p->lock);
		}
	} else {
		if (cvm_policy_never(pol))
			return UINT64_MAX;
		if (pthread_mutex_trylock(&p->lock))
			return now + CVM_FENCE_POLL_NS;
		keep_bytes = pol->retain_bytes;
	}
	/* Oldest first; the most recently freed keep_bytes stay. Released early enough to be done on time.
	 * CVM_RELEASE_BATCH chunks at a time, the rest left in the cache meanwhile: an allocation that misses
	 * while the driver releases 4096 handles (70 ms on the H200) takes one of those rather than create a
	 * handle behind the releases (1-40 ms for one cuMemCreate, bench/trace's return test). */
	lead = force ? 0 : cvm_policy_lead(pol, &p->dd->cnt, p->ncached);
	for (bool more = true; more;) {
		size_t taken = 0, freed;
		unsigned batch = 0;

		chain = NULL;
		while ((c = p->age.anext) != &p->age && p->cached - c->size >= keep_bytes) {
			if (!force && !cvm_policy_due(pol, c->freed_ns, now, lead)) {
				next = cvm_policy_deadline(pol, c->freed_ns, lead);
				break;
			}
			if (batch == CVM_RELEASE_BATCH)
				break;
			cache_remove(p, c);
			p->releasing++;
			c->anext = chain;
			chain = c;
			taken += c->size;
			n++;
			batch++;
		}
		left = p->cached;
		pthread_mutex_unlock(&p->lock);
		freed = release_chain(p, chain);
		gone += freed;
		/* A refused release went back to the cache, oldest first: another round would take it again
		 * (and again, while the driver refuses); a later pass retries it. */
		more = batch == CVM_RELEASE_BATCH && freed == taken;
		if (more)
			pthread_mutex_lock(&p->lock);
	}
	/* The release decision, for "why is my memory still held": what went back, why, and what stays. */
	if (n)
		cvm_info("device %d: gave %.1f MiB (%u chunks) back to the driver: %s; %.1f MiB stay cached (keep %.1f MiB)",
			 p->dd->index, gone / 1048576.0, n,
			 !force ? "free for release_delay_ms" :
			 cvm_policy_at_once(pol) ? "release_delay_ms is 0" : "trim, sleep or destroy",
			 left / 1048576.0, keep_bytes / 1048576.0);
	return next;
}

size_t cvm_phys_cached(struct cvm_phys *p)
{
	size_t v;

	pthread_mutex_lock(&p->lock);
	v = p->cached;
	pthread_mutex_unlock(&p->lock);
	return v;
}

void cvm_phys_fini(struct cvm_phys *p)
{
	cvm_phys_reclaim(p, cvm_now_ns(), true, 0);
	if (p->held)
		cvm_warn("device %d: %zu bytes of chunks still in use at context destruction", p->dd->index,
			 p->held);
	pthread_mutex_destroy(&p->lock);
	pthread_mutex_destroy(&p->acct->lock);
}
