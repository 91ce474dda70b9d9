/*
 * Publishing the context's counters for cuvmm-top (the page: publish.h): the context's own sub-module,
 * called by ctx.c alone (and tests).
 *
 * When: at most every CVM_PUB_INTERVAL_NS, once something changed (a library call, a reclaim pass, an
 * object created or destroyed), by the background thread, or without one by the library call that finds
 * it due (doc/design.md, "Publishing").
 */
#ifndef CVM_CTX_PUBLISH_H
#define CVM_CTX_PUBLISH_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "publish.h"

struct cuvmm_ctx;

struct cvm_pub {
	_Atomic bool dirty;       /* something changed since the last snapshot */
	_Atomic uint64_t due;     /* no snapshot before this (CLOCK_MONOTONIC ns) unless forced */
	pthread_mutex_t lock;     /* one writer at a time; taken before the context's clients_lock */
	struct cvm_pub_page *page;
	int64_t pid;              /* the creator: a forked child neither writes nor unlinks the file */
	char path[256];
	struct cvm_pub_page snap; /* the snapshot being taken, under lock */
	struct cvm_pub *next;     /* the process's open pages, unlinked at exit (ctx_publish.c) */
};

/* Create the context's page (ctx->pub) unless CUVMM_PUBLISH says no. Never fails the context: a page that
 * cannot be made is logged at info and ctx->pub stays NULL. */
void cvm_pub_open(struct cuvmm_ctx *ctx);
/* Unmap and unlink the page (ctx_destroy, after every object is gone). */
void cvm_pub_close(struct cuvmm_ctx *ctx);
/*
 * Take a snapshot and write it. With force: now, waiting for a running pass (tests, creation); else only
 * if something changed and it is due, never waiting for a lock (a busy clients_lock puts it off by a few
 * ms). Takes pub->lock, then clients_lock, then the device account locks (through the stats functions):
 * call it with none of them held.
 */
void cvm_pub_update(struct cuvmm_ctx *ctx, uint64_t now, bool force);
/* Something changed: mark the page dirty and, the first time since the last snapshot, wake the
 * background thread so that it writes one when due. */
void cvm_pub_touch(struct cuvmm_ctx *ctx);
/* The next time the background thread must write a snapshot: UINT64_MAX when nothing changed. */
uint64_t cvm_pub_deadline(struct cuvmm_ctx *ctx);

#endif /* CVM_CTX_PUBLISH_H */
