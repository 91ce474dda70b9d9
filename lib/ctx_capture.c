/*
 * The captures seen (ctx_capture.h): the context's registry of stream captures under way, asked before
 * every device synchronisation.
 */
#include <stdlib.h>

#include "ctx.h"
#include "log.h"

int cvm_captures_init(struct cvm_captures *reg)
{
	reg->list = NULL;
	atomic_init(&reg->ncaptures, 0);
	atomic_init(&reg->graphs, NULL);
	reg->graphs_free = NULL;
	return pthread_mutex_init(&reg->lock, NULL) ? CUVMM_ENOMEM : CUVMM_OK;
}

void cvm_captures_fini(struct cvm_captures *reg)
{
	struct cvm_graphs *g = atomic_load(&reg->graphs);

	while (reg->list) {
		struct cvm_capture *c = reg->list;

		reg->list = c->next;
		free(c);
	}
	if (g)
		reg->graphs_free(g);
	pthread_mutex_destroy(&reg->lock);
}

struct cvm_capture *cvm_capture_find_locked(struct cvm_captures *reg, uint64_t id)
{
	struct cvm_capture *c = reg->list;

	while (c && c->id != id)
		c = c->next;
	return c;
}

struct cvm_capture *cvm_capture_add_locked(struct cvm_captures *reg, uint64_t id, CUstream stream, int device,
					   struct cvm_gpool *gp)
{
	struct cvm_capture *c = calloc(1, sizeof(*c));

	if (!c)
		return NULL;
	c->id = id;
	c->stream = stream;
	c->device = device;
	c->gp = gp;
	c->next = reg->list;
	reg->list = c;
	atomic_fetch_add(&reg->ncaptures, 1);
	return c;
}

/* Has capture c ended (or can it no longer be asked about)? Lock held; one driver call, legal under capture. */
static bool capture_ended(struct cuvmm_ctx *ctx, struct cvm_capture *c)
{
	uint64_t id = 0;
	struct cvm_dev *dev;

	if (cvm_ctx_dev(ctx, c->device, &dev))
		return true;
	if (cvm_drv_capture_id(&dev->drv, c->stream, &id))
		return true;
	return id != c->id;
}

void cvm_capture_prune_locked(struct cuvmm_ctx *ctx, int device, CUstream stream)
{
	struct cvm_captures *reg = &ctx->captures;

	for (struct cvm_capture **pp = &reg->list, *c; (c = *pp);) {
		if (stream ? c->stream == stream : (device < 0 || c->device == device) && capture_ended(ctx, c)) {
			*pp = c->next;
			free(c);
			atomic_fetch_sub(&reg->ncaptures, 1);
		} else {
			pp = &c->next;
		}
	}
}

void cvm_capture_not_capturing(struct cuvmm_ctx *ctx, CUstream stream)
{
	struct cvm_captures *reg = &ctx->captures;

	if (!stream || atomic_load_explicit(&reg->ncaptures, memory_order_relaxed) == 0)
		return;
	pthread_mutex_lock(&reg->lock);
	cvm_capture_prune_locked(ctx, -1, stream);
	pthread_mutex_unlock(&reg->lock);
}

bool cvm_capture_quiet(struct cuvmm_ctx *ctx, int device)
{
	struct cvm_captures *reg = &ctx->captures;
	bool quiet = true;

	if (atomic_load(&reg->ncaptures) == 0)
		return true;
	pthread_mutex_lock(&reg->lock);
	cvm_capture_prune_locked(ctx, device, NULL);
	for (struct cvm_capture *c = reg->list; c && quiet; c = c->next)
		quiet = c->device != device;
	pthread_mutex_unlock(&reg->lock);
	if (!quiet)
		cvm_debug("device %d: a stream capture is under way; the device synchronisation waits for it", device);
	return quiet;
}
