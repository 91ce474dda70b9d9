/*
 * The captures seen: the context's registry of the CUDA stream captures under way that the library has met,
 * which answers "may the device be synchronised now?" (not while a capture the library has seen is under
 * way on it: synchronising a context with a capturing stream invalidates the capture).
 *
 * A capture is first met by an allocation or free on a capturing stream, or by cuvmm_capture_pool (graph.c,
 * the graph pools, records it with the graph pool its memory joins); it is forgotten once the driver says it
 * has ended, or once its stream is seen not capturing.
 *
 * The registry's lock also guards the graph pools (graph.c), whose state the registry keeps as an opaque
 * pointer, made on first use and freed with the registry. Lock order: a pool's lock is never held while the
 * registry's lock is taken, and the other way round.
 */
#ifndef CVM_CTX_CAPTURE_H
#define CVM_CTX_CAPTURE_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "cuvmm.h"

struct cvm_gpool;  /* a graph pool (graph.c) */
struct cvm_graphs; /* all graph pools of the context (graph.c) */

/* A capture seen under way: which graph pool its memory joins, and whether it still runs. */
struct cvm_capture {
	struct cvm_capture *next;
	uint64_t id;
	CUstream stream;                   /* a stream of the capture, to ask whether it has ended */
	int device;
	struct cvm_gpool *gp;
};

struct cvm_captures {
	pthread_mutex_t lock;              /* the captures, and the graph pools (graph.c) */
	_Atomic size_t ncaptures;          /* captures seen and not yet known to have ended */
	struct cvm_capture *list;
	/* The graph pools: set under lock by graph.c on first use, read without it; freed by
	 * cvm_captures_fini through graphs_free. */
	struct cvm_graphs *_Atomic graphs;
	void (*graphs_free)(struct cvm_graphs *g);
};

int cvm_captures_init(struct cvm_captures *reg);
void cvm_captures_fini(struct cvm_captures *reg);

/* Capture `id` if it has been seen and not forgotten, else NULL. Lock held. */
struct cvm_capture *cvm_capture_find_locked(struct cvm_captures *reg, uint64_t id);
/* Record capture `id` (not recorded yet), seen on `stream` of `device`, its memory joining `gp`. NULL when
 * out of memory. Lock held. */
struct cvm_capture *cvm_capture_add_locked(struct cvm_captures *reg, uint64_t id, CUstream stream, int device,
					   struct cvm_gpool *gp);
/*
 * Forget the captures that have ended: on `device` (-1: all) those the driver says have ended, or, with
 * `stream`, every capture seen on that stream (the caller saw it not capturing). Lock held.
 */
void cvm_capture_prune_locked(struct cuvmm_ctx *ctx, int device, CUstream stream);
/* `stream` was seen not capturing: forget the captures seen on it (they have ended). Cheap while none is
 * remembered. */
void cvm_capture_not_capturing(struct cuvmm_ctx *ctx, CUstream stream);
/* No capture the library has seen is still under way on `device` (it may synchronise the device). */
bool cvm_capture_quiet(struct cuvmm_ctx *ctx, int device);

#endif /* CVM_CTX_CAPTURE_H */
