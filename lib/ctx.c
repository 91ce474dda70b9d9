/*
 * Context: creation, devices, statistics, trim, and the background thread that gives idle memory back.
 *
 * The background thread sleeps until the earliest deadline any client or device reported (jemalloc-style:
 * it wakes only when something is due), runs a reclaim pass in which every client trylocks, and sleeps
 * again. Without it, library entry points run the pass themselves once a deadline has passed.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "config.h"
#include "ctx.h"
#include "ctx_publish.h"
#include "log.h"

static void *bg_main(void *arg);

/* AUTO: $CUVMM_BACKEND, read by the one environment parser (a config not made by cuvmm_config_init has not
 * read it), else CUDA. */
static void resolve_backend(struct cuvmm_config *cfg)
{
	if (cfg->backend == CUVMM_BACKEND_AUTO)
		cfg->backend = cvm_env_backend();
	if (cfg->backend == CUVMM_BACKEND_AUTO)
		cfg->backend = CUVMM_BACKEND_CUDA;
}

/* Say at the default level why a context could not be had: the caller only sees the code, and the
 * driver's own reason is logged at info. */
static void no_backend(const struct cuvmm_config *cfg, int err)
{
	if (cfg->backend == CUVMM_BACKEND_HOST) {
		cvm_warn("cuvmm_ctx_create: the host backend could not start: %s", cuvmm_strerror(err));
		return;
	}
	cvm_warn("cuvmm_ctx_create: the CUDA backend is unavailable: %s (%s, last CUresult %d); CUVMM_LOG=info "
		 "gives the driver's reason, CUVMM_BACKEND=host selects the host backend",
		 cuvmm_strerror(err), cuvmm_err_name(err), cuvmm_last_driver_error());
}

int cuvmm_ctx_create(const struct cuvmm_config *cfg, struct cuvmm_ctx **out)
{
	struct cuvmm_ctx *ctx;
	struct cuvmm_config defaults;
	int err;

	if (!out)
		return CUVMM_EINVAL;
	if (!cfg) {
		cuvmm_config_init(&defaults);
		cfg = &defaults;
	}
	err = cvm_config_check(cfg);
	if (err)
		return err;
	ctx = calloc(1, sizeof(*ctx));
	if (!ctx)
		return CUVMM_ENOMEM;
	ctx->cfg = *cfg;
	ctx->cfg.size = sizeof(ctx->cfg);
	if (!ctx->cfg.host_granularity)
		ctx->cfg.host_granularity = CVM_DEFAULT_HOST_GRANULARITY;
	resolve_backend(&ctx->cfg);
	cvm_policy_init(&ctx->policy, ctx->cfg.release_delay_ms, ctx->cfg.retain_bytes);
	ctx->clients.next = ctx->clients.prev = &ctx->clients;
	atomic_init(&ctx->next_deadline, UINT64_MAX);

	if (pthread_mutex_init(&ctx->dev_lock, NULL)) {
		free(ctx);
		return CUVMM_ENOMEM;
	}
	if (pthread_mutex_init(&ctx->clients_lock, NULL)) {
		err = CUVMM_ENOMEM;
		goto fail_dev_lock;
	}
	if (pthread_cond_init(&ctx->clients_cond, NULL)) {
		err = CUVMM_ENOMEM;
		goto fail_clients_lock;
	}
	if (pthread_mutex_init(&ctx->bg_lock, NULL)) {
		err = CUVMM_ENOMEM;
		goto fail_clients_cond;
	}
	if (pthread_cond_init(&ctx->bg_cond, NULL)) {
		err = CUVMM_ENOMEM;
		goto fail_bg_lock;
	}
	err = cvm_captures_init(&ctx->captures);
	if (err)
		goto fail_cond;
	err = cvm_drv_open(&ctx->drv, &ctx->cfg);
	if (err) {
		no_backend(&ctx->cfg, err);
		goto fail_captures;
	}
	err = cvm_drv_device_count(&ctx->drv, &ctx->ndev);
	if (!err && ctx->ndev <= 0)
		err = CUVMM_ENODEV;
	if (err) {
		no_backend(&ctx->cfg, err);
		goto fail_drv;
	}
	if (ctx->ndev > CVM_MAX_DEVICES)
		ctx->ndev = CVM_MAX_DEVICES;
	/* Peers named must exist; whether they can reach a device is asked when an object is made there. */
	if (ctx->cfg.peer_access != CUVMM_PEERS_ALL && ctx->ndev < 64 && ctx->cfg.peer_access >> ctx->ndev) {
		cvm_warn("cuvmm_ctx_create: peer_access names a device beyond the %d the context has", ctx->ndev);
		err = CUVMM_EINVAL;
		goto fail_drv;
	}
	for (int i = 0; i < CVM_MAX_DEVICES; i++) {
		ctx->dev[i].ctx = ctx;
		ctx->dev[i].drv.drv = &ctx->drv;
		ctx->dev[i].drv.index = i;
		cvm_fence_dev_init(&ctx->dev[i].fence, &ctx->dev[i].drv);
		/* No attributes: these cannot fail on Linux, as the other mutexes of the library. */
		pthread_mutex_init(&ctx->dev[i].pass_lock, NULL);
		pthread_mutex_init(&ctx->dev[i].regions_lock, NULL);
	}
	cvm_pub_open(ctx); /* before the background thread, which writes it */
	if (ctx->cfg.background_release && !cvm_policy_never(&ctx->policy) && !cvm_policy_at_once(&ctx->policy)) {
		if (pthread_create(&ctx->bg, NULL, bg_main, ctx)) {
			err = CUVMM_ENOMEM;
			cvm_pub_close(ctx);
			goto fail_devs;
		}
		ctx->bg_running = true;
	}
	cvm_info("context created on the %s backend, %d device(s), release delay %lld ms", ctx->drv.be->name,
		 ctx->ndev, (long long)ctx->cfg.release_delay_ms);
	*out = ctx;
	return CUVMM_OK;

fail_devs:
	for (int i = 0; i < CVM_MAX_DEVICES; i++) {
		cvm_fence_dev_fini(&ctx->dev[i].fence);
		pthread_mutex_destroy(&ctx->dev[i].pass_lock);
		pthread_mutex_destroy(&ctx->dev[i].regions_lock);
	}
fail_drv:
	cvm_drv_close(&ctx->drv);
fail_captures:
	cvm_captures_fini(&ctx->captures);
fail_cond:
	pthread_cond_destroy(&ctx->bg_cond);
fail_bg_lock:
	pthread_mutex_destroy(&ctx->bg_lock);
fail_clients_cond:
	pthread_cond_destroy(&ctx->clients_cond);
fail_clients_lock:
	pthread_mutex_destroy(&ctx->clients_lock);
fail_dev_lock:
	pthread_mutex_destroy(&ctx->dev_lock);
	free(ctx);
	return err;
}

void cuvmm_ctx_destroy(struct cuvmm_ctx *ctx)
{
	if (!ctx)
		return;
	if (ctx->bg_running) {
		pthread_mutex_lock(&ctx->bg_lock);
		ctx->bg_stop = true;
		pthread_cond_signal(&ctx->bg_cond);
		pthread_mutex_unlock(&ctx->bg_lock);
		pthread_join(ctx->bg, NULL);
	}
	/* Objects the application did not destroy: destroy them, newest first, so nothing leaks. */
	for (;;) {
		struct cvm_client *c;

		pthread_mutex_lock(&ctx->clients_lock);
		c = ctx->clients.next != &ctx->clients ? ctx->clients.next : NULL;
		pthread_mutex_unlock(&ctx->clients_lock);
		if (!c)
			break;
		cvm_warn("context destroyed with a %s still alive on device %d; destroying it", c->ops->kind,
			 c->dev->drv.index);
		c->destroy(c);
	}
	cvm_pub_close(ctx);
	for (int i = 0; i < CVM_MAX_DEVICES; i++) {
		cvm_fence_dev_fini(&ctx->dev[i].fence); /* its cached events: none on a device never opened */
		if (atomic_load(&ctx->dev[i].opened)) {
			cvm_phys_fini(&ctx->dev[i].phys);
			cvm_drv_device_close(&ctx->drv, i);
		}
	}
	for (int i = 0; i < CVM_MAX_DEVICES; i++) {
		pthread_mutex_destroy(&ctx->dev[i].pass_lock);
		pthread_mutex_destroy(&ctx->dev[i].regions_lock);
	}
	cvm_drv_close(&ctx->drv);
	cvm_captures_fini(&ctx->captures);
	pthread_cond_destroy(&ctx->bg_cond);
	pthread_mutex_destroy(&ctx->bg_lock);
	pthread_cond_destroy(&ctx->clients_cond);
	pthread_mutex_destroy(&ctx->clients_lock);
	pthread_mutex_destroy(&ctx->dev_lock);
	free(ctx);
}

enum cuvmm_backend cuvmm_ctx_backend(const struct cuvmm_ctx *ctx)
{
	return ctx ? ctx->cfg.backend : CUVMM_BACKEND_AUTO;
}

int cuvmm_ctx_device_count(const struct cuvmm_ctx *ctx, int *count)
{
	if (!ctx || !count)
		return CUVMM_EINVAL;
	*count = ctx->ndev;
	return CUVMM_OK;
}

/* Physical memory's wake-up: cached chunks come due at `deadline`. */
static void phys_wake(void *arg, uint64_t deadline)
{
	cvm_ctx_kick(arg, deadline);
}

/* Open the device's physical memory: its limit is device_limit_bytes, at most the device's memory. */
static int dev_phys_init(struct cvm_dev *dev)
{
	struct cuvmm_ctx *ctx = dev->ctx;
	size_t limit = ctx->cfg.device_limit_bytes, total = dev->info.total_bytes;
	struct cvm_phys_params par = {
		.dd = &dev->drv,
		.granularity = dev->info.granularity,
		.limit = limit && limit < total ? limit : total,
		.acct = &dev->acct,
		.policy = &ctx->policy,
		.wake = phys_wake,
		.wake_arg = ctx,
	};

	if (!limit && !total)
		par.limit = SIZE_MAX;
	return cvm_phys_init(&dev->phys, &par);
}

int cvm_ctx_dev(struct cuvmm_ctx *ctx, int device, struct cvm_dev **out)
{
	struct cvm_dev *dev;
	int err = CUVMM_OK;

	if (device < 0 || device >= ctx->ndev)
		return CUVMM_ENODEV;
	dev = &ctx->dev[device];
	if (atomic_load_explicit(&dev->opened, memory_order_acquire)) {
		*out = dev;
		return CUVMM_OK;
	}
	pthread_mutex_lock(&ctx->dev_lock);
	if (!atomic_load(&dev->opened)) {
		err = cvm_drv_device_open(&ctx->drv, device, &dev->info);
		if (err == CUVMM_ENOTSUP) {
			cvm_err("device %d does not support virtual memory management", device);
			err = CUVMM_ENODEV;
		}
		if (!err && (!dev->info.granularity || (dev->info.granularity & (dev->info.granularity - 1)))) {
			cvm_err("device %d reports a granularity of %zu bytes", device, dev->info.granularity);
			cvm_drv_device_close(&ctx->drv, device);
			err = CUVMM_ENOTSUP;
		}
		if (!err) {
			err = dev_phys_init(dev);
			if (err)
				cvm_drv_device_close(&ctx->drv, device);
		}
		if (!err) {
			cvm_info("device %d (%s): granularity %zu KiB, %zu MiB", device, dev->info.name,
				 dev->info.granularity >> 10, dev->info.total_bytes >> 20);
			atomic_store_explicit(&dev->opened, true, memory_order_release);
		}
	}
	pthread_mutex_unlock(&ctx->dev_lock);
	if (!err)
		*out = dev;
	return err;
}

int cvm_ctx_peers(struct cuvmm_ctx *ctx, int device, uint64_t mask, uint64_t *out)
{
	uint64_t all = ctx->ndev >= 64 ? UINT64_MAX : ((uint64_t)1 << ctx->ndev) - 1;
	bool can;
	int err;

	if (mask == CUVMM_PEERS_ALL)
		mask = all;
	else if (mask & ~all)
		return CUVMM_EINVAL;
	mask |= (uint64_t)1 << device;
	for (int p = 0; p < ctx->ndev; p++) {
		if (p == device || !(mask >> p & 1))
			continue;
		err = cvm_drv_can_access_peer(&ctx->drv, p, device, &can);
		if (err)
			return err;
		if (!can) {
			cvm_warn("device %d cannot access the memory of device %d (no peer access between them)", p,
				 device);
			cvm_drv_set_last(CUDA_ERROR_PEER_ACCESS_UNSUPPORTED);
			return CUVMM_ENOTSUP;
		}
	}
	*out = mask;
	return CUVMM_OK;
}

int cuvmm_ctx_can_access_peer(struct cuvmm_ctx *ctx, int device, int peer, bool *can)
{
	if (!ctx || !can || device < 0 || device >= ctx->ndev || peer < 0 || peer >= ctx->ndev)
		return CUVMM_EINVAL;
	return cvm_drv_can_access_peer(&ctx->drv, device, peer, can);
}

uint64_t cvm_dev_release_lead(struct cvm_dev *dev, size_t chunks)
{
	return cvm_policy_lead(&dev->ctx->policy, &dev->drv.cnt, chunks);
}

int cvm_dev_sync(struct cvm_dev *dev)
{
	if (!cvm_capture_quiet(dev->ctx, dev->drv.index))
		return CUVMM_EBUSY;
	return cvm_drv_device_sync(&dev->drv);
}

int cvm_dev_sync_epoch(struct cvm_dev *dev)
{
	uint64_t e = cvm_fence_sync_begin(&dev->fence);
	int err = cvm_dev_sync(dev);

	if (!err)
		cvm_fence_sync_end(&dev->fence, e);
	return err;
}

void cvm_ctx_add_client(struct cuvmm_ctx *ctx, struct cvm_client *c)
{
	pthread_mutex_lock(&ctx->clients_lock);
	c->next = ctx->clients.next;
	c->prev = &ctx->clients;
	ctx->clients.next->prev = c;
	ctx->clients.next = c;
	pthread_mutex_unlock(&ctx->clients_lock);
	cvm_pub_touch(ctx);
}

void cvm_ctx_remove_client(struct cuvmm_ctx *ctx, struct cvm_client *c)
{
	/* Wait out a reclaim pass that may be inside this client. */
	pthread_mutex_lock(&ctx->clients_lock);
	while (c->pins)
		pthread_cond_wait(&ctx->clients_cond, &ctx->clients_lock);
	c->prev->next = c->next;
	c->next->prev = c->prev;
	c->next = c->prev = NULL;
	pthread_mutex_unlock(&ctx->clients_lock);
	cvm_pub_touch(ctx);
}

void cvm_ctx_kick(struct cuvmm_ctx *ctx, uint64_t deadline)
{
	uint64_t cur = atomic_load_explicit(&ctx->next_deadline, memory_order_relaxed);

	/* Lower the deadline; only a thread that actually lowers it needs to wake the sleeper. */
	while (deadline < cur) {
		if (atomic_compare_exchange_weak(&ctx->next_deadline, &cur, deadline)) {
			if (ctx->bg_running) {
				pthread_mutex_lock(&ctx->bg_lock);
				pthread_cond_signal(&ctx->bg_cond);
				pthread_mutex_unlock(&ctx->bg_lock);
			}
			return;
		}
	}
}

/*
 * One pass over one device: its clients, then its cache. Passes of one device take turns (pass_lock); those
 * of different devices run side by side, since the client list lock is dropped inside each client (which
 * stays pinned, so it is neither removed nor skipped meanwhile): a trim waiting for device 0's GPU holds up
 * neither a trim of device 1 nor the background thread's release on it.
 */
static uint64_t reclaim_dev(struct cuvmm_ctx *ctx, struct cvm_dev *dev, uint64_t now, bool force, size_t keep)
{
	uint64_t next = UINT64_MAX, t;
	struct cvm_client *c, *n;

	if (force) {
		pthread_mutex_lock(&dev->pass_lock);
	} else if (pthread_mutex_trylock(&dev->pass_lock)) {
		/* Another pass (a trim, perhaps waiting for the GPU) is running: never wait behind it. */
		return now + CVM_FENCE_POLL_NS;
	}
	pthread_mutex_lock(&ctx->clients_lock);
	for (c = ctx->clients.next; c != &ctx->clients; c = n) {
		if (c->dev != dev) {
			n = c->next;
			continue;
		}
		c->pins++;
		pthread_mutex_unlock(&ctx->clients_lock);
		t = c->ops->reclaim(c, now, force);
		if (t < next)
			next = t;
		pthread_mutex_lock(&ctx->clients_lock);
		n = c->next;
		if (--c->pins == 0)
			pthread_cond_broadcast(&ctx->clients_cond);
	}
	pthread_mutex_unlock(&ctx->clients_lock);
	t = cvm_phys_reclaim(&dev->phys, now, force, keep);
	if (t < next)
		next = t;
	pthread_mutex_unlock(&dev->pass_lock);
	return next;
}

uint64_t cvm_ctx_reclaim(struct cuvmm_ctx *ctx, uint64_t now, bool force, int device, size_t keep)
{
	uint64_t next = UINT64_MAX, t;

	for (int i = 0; i < ctx->ndev; i++) {
		if ((device >= 0 && i != device) || !atomic_load(&ctx->dev[i].opened))
			continue;
		t = reclaim_dev(ctx, &ctx->dev[i], now, force, keep);
		if (t < next)
			next = t;
	}
	return next;
}

/* Run a pass and publish its deadline. The deadline is taken first (set to "nothing due"), so a kick that
 * races with the pass lowers it again and is not lost. */
static uint64_t reclaim_pass(struct cuvmm_ctx *ctx)
{
	uint64_t next;

	atomic_store(&ctx->next_deadline, UINT64_MAX);
	next = cvm_ctx_reclaim(ctx, cvm_now_ns(), false, -1, 0);
	cvm_ctx_kick(ctx, next);
	if (ctx->pub) /* what the pass gave back shows in the next snapshot */
		atomic_store(&ctx->pub->dirty, true);
	return atomic_load(&ctx->next_deadline);
}

void cvm_ctx_poll(struct cuvmm_ctx *ctx)
{
	uint64_t now;

	/* The published page: one load while it is marked dirty already (a busy program); the first call
	 * after a snapshot marks it and wakes the background thread, which writes the next when due. */
	if (ctx->pub && !atomic_load_explicit(&ctx->pub->dirty, memory_order_relaxed))
		cvm_pub_touch(ctx);
	if (ctx->bg_running)
		return;
	now = cvm_now_ns();
	if (atomic_load_explicit(&ctx->next_deadline, memory_order_relaxed) <= now)
		reclaim_pass(ctx);
	/* Without a background thread, the call that finds a snapshot due writes it. */
	if (ctx->pub && cvm_pub_deadline(ctx) <= now)
		cvm_pub_update(ctx, now, false);
}

static void *bg_main(void *arg)
{
	struct cuvmm_ctx *ctx = arg;

	pthread_mutex_lock(&ctx->bg_lock);
	while (!ctx->bg_stop) {
		uint64_t deadline = atomic_load(&ctx->next_deadline), now = cvm_now_ns();
		uint64_t pub = cvm_pub_deadline(ctx);

		if (deadline <= now) {
			pthread_mutex_unlock(&ctx->bg_lock);
			reclaim_pass(ctx);
			pthread_mutex_lock(&ctx->bg_lock);
			continue;
		}
		if (pub <= now) {
			pthread_mutex_unlock(&ctx->bg_lock);
			cvm_pub_update(ctx, now, false);
			pthread_mutex_lock(&ctx->bg_lock);
			continue;
		}
		if (pub < deadline)
			deadline = pub;
		if (deadline == UINT64_MAX) {
			pthread_cond_wait(&ctx->bg_cond, &ctx->bg_lock);
		} else {
			struct timespec ts;
			uint64_t wait = deadline - now;

			clock_gettime(CLOCK_REALTIME, &ts);
			ts.tv_sec += (time_t)(wait / 1000000000u);
			ts.tv_nsec += (long)(wait % 1000000000u);
			if (ts.tv_nsec >= 1000000000L) {
				ts.tv_sec++;
				ts.tv_nsec -= 1000000000L;
			}
			pthread_cond_timedwait(&ctx->bg_cond, &ctx->bg_lock, &ts);
		}
	}
	pthread_mutex_unlock(&ctx->bg_lock);
	return NULL;
}

int cuvmm_ctx_trim(struct cuvmm_ctx *ctx, int device, size_t keep_bytes)
{
	uint64_t failures = 0;

	if (!ctx || device < -1 || device >= ctx->ndev)
		return CUVMM_EINVAL;
	for (int i = 0; i < ctx->ndev; i++)
		if (atomic_load(&ctx->dev[i].opened))
			failures += atomic_load(&ctx->dev[i].phys.release_failures);
	cvm_ctx_reclaim(ctx, cvm_now_ns(), true, device, keep_bytes);
	for (int i = 0; i < ctx->ndev; i++)
		if (atomic_load(&ctx->dev[i].opened))
			failures -= atomic_load(&ctx->dev[i].phys.release_failures);
	return failures ? CUVMM_EDRIVER : CUVMM_OK;
}

int cuvmm_ctx_stats(struct cuvmm_ctx *ctx, int device, struct cuvmm_stats *out)
{
	struct cvm_dev *dev;
	int err;

	if (!ctx || cvm_stats_check(out))
		return CUVMM_EINVAL;
	err = cvm_ctx_dev(ctx, device, &dev);
	if (err)
		return err == CUVMM_ENODEV ? CUVMM_EINVAL : err;
	cvm_acct_fill(&dev->acct, &dev->drv.cnt, out);
	return CUVMM_OK;
}

int cuvmm_ctx_inject_fault(struct cuvmm_ctx *ctx, enum cuvmm_call call, uint64_t skip, uint32_t count, int err)
{
	struct cvm_fault *f;

	if (!ctx || (int)call < 0 || call >= CUVMM_CALL_COUNT_ || (err != CUVMM_ENOMEM && err != CUVMM_EDRIVER))
		return CUVMM_EINVAL;
	f = &ctx->drv.fault[call];
	atomic_store(&f->count, 0);
	atomic_store(&f->err, err);
	atomic_store(&f->skip, skip);
	atomic_store(&f->count, count);
	return CUVMM_OK;
}

uint64_t cuvmm_ctx_call_count(const struct cuvmm_ctx *ctx, enum cuvmm_call call)
{
	if (!ctx || (int)call < 0 || call >= CUVMM_CALL_COUNT_)
		return 0;
	return atomic_load(&((struct cuvmm_ctx *)ctx)->drv.calls[call]);
}
