/*
 * Fences: the one type that says "the GPU work that may still touch this memory", for every object above
 * (region granules, pool runs and slab slots, kv pages), and each device's cache of the events they record.
 *
 * A fence is one of:
 * - none: complete (a zeroed fence): nothing touched the memory, or the caller synchronised already;
 * - an event recorded on a stream (cvm_fence_record): complete when the event is, and usable at once for
 *   work queued on that same stream;
 * - a device epoch (cvm_fence_set_epoch, a free without a stream): complete once a device synchronisation
 *   that started after it has returned (cvm_fence_sync_begin/end, which ctx.c's cvm_dev_sync_epoch calls).
 * Completion is cached once seen (`done`). A fence is guarded by its owner's lock; fences shared by several
 * holders (kv pages emptied by one free, a trim waiting on a region's fences without the lock) are made by
 * cvm_fence_new and counted (cvm_fence_ref/unref): the event goes back to the cache with the last reference,
 * so it is never recycled while someone still waits on it.
 *
 * The layer knows nothing of the context: cvm_fence_dev_init gets the device as the driver layer sees it
 * (struct cvm_drv_dev: its connection and index). Events come from, and go back to, the device's cache
 * (under its own mutex, a leaf), so that a fence rarely creates one.
 */
#ifndef CVM_FENCE_H
#define CVM_FENCE_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>

#include "drv.h"

#define CVM_FENCE_CACHE_MAX 256 /* events a device keeps for reuse; those beyond are destroyed */

/* A device's fence state: its epochs and its event cache. */
struct cvm_fence_dev {
	struct cvm_drv_dev *dd; /* the device's driver connection and index */
	/* A free without a stream is tagged with `epoch`; once a device synchronisation that started after the
	 * free has returned, safe_epoch exceeds the tag. */
	_Atomic uint64_t epoch, safe_epoch;
	pthread_mutex_t lock; /* the cache below; a leaf */
	cvm_event *ev;
	size_t n, cap;
};

struct cvm_fence {
	cvm_event ev;     /* recorded on `stream`; NULL: no event */
	CUstream stream;  /* the stream of ev (NULL without one) */
	uint64_t epoch;   /* without an event: the device epoch it waits for (0: none) */
	uint32_t refs;    /* holders of a fence from cvm_fence_new; 0 for one embedded in its owner */
	bool done;        /* known complete */
};

void cvm_fence_dev_init(struct cvm_fence_dev *fd, struct cvm_drv_dev *dd);
/* Destroy the cached events (before the device is closed). */
void cvm_fence_dev_fini(struct cvm_fence_dev *fd);
/* An event from the cache, or a new one; and back (destroyed beyond CVM_FENCE_CACHE_MAX). */
int cvm_fence_event_get(struct cvm_fence_dev *fd, cvm_event *ev);
void cvm_fence_event_put(struct cvm_fence_dev *fd, cvm_event ev);

/* Around a device synchronisation (call with no lock held): begin returns the epoch it makes safe, end (once
 * it has returned successfully) advances safe_epoch to it; racing synchronisations keep the highest. */
uint64_t cvm_fence_sync_begin(struct cvm_fence_dev *fd);
void cvm_fence_sync_end(struct cvm_fence_dev *fd, uint64_t e);

/* The fence of work queued on `stream` (not NULL) so far: an event from the cache, recorded there. On failure
 * (the create, the record, or a capturing stream: CUVMM_ENOTSUP) nothing changes, *f included. _uncaptured for
 * a caller that has just seen the stream not capturing (one driver call fewer). */
int cvm_fence_record(struct cvm_fence_dev *fd, struct cvm_fence *f, CUstream stream);
int cvm_fence_record_uncaptured(struct cvm_fence_dev *fd, struct cvm_fence *f, CUstream stream);
/* The fence of a free without a stream: the device's current epoch. */
void cvm_fence_set_epoch(struct cvm_fence_dev *fd, struct cvm_fence *f);
/* Has it completed? 1 yes (cached from then on), 0 not yet, <0 the query's error. Never waits. */
int cvm_fence_done(struct cvm_fence_dev *fd, struct cvm_fence *f);
/* May work on `stream` (NULL: none) use the memory now? Without an event yes (an epoch fence guards the unmap,
 * not the reuse); on the event's own stream yes; elsewhere once the event has completed. */
bool cvm_fence_usable(struct cvm_fence_dev *fd, struct cvm_fence *f, CUstream stream);
/* Wait for an event fence (call with no lock held; the caller holds a reference or owns the fence; reads only
 * its event, so that its owner may query it meanwhile). An
 * epoch fence needs a device synchronisation, which is the context's (cvm_dev_sync_epoch): not waited here. */
int cvm_fence_wait(struct cvm_fence_dev *fd, struct cvm_fence *f);
/* Give the event back to the cache: the fence becomes none (complete). For an embedded fence, once its
 * owner no longer needs it. */
void cvm_fence_clear(struct cvm_fence_dev *fd, struct cvm_fence *f);
/* One fence for memory guarded by dst and src (freed after dst's): both without events (the later epoch
 * wins), or both with events on the same stream (dst's covers src's, which is given back). */
void cvm_fence_merge(struct cvm_fence_dev *fd, struct cvm_fence *dst, struct cvm_fence *src);

/* A shared fence, none, one reference (the caller's); NULL without memory. */
struct cvm_fence *cvm_fence_new(void);
static inline struct cvm_fence *cvm_fence_ref(struct cvm_fence *f)
{
	if (f)
		f->refs++;
	return f;
}
/* Drop a reference (NULL: nothing); the last gives the event back and frees the fence. */
void cvm_fence_unref(struct cvm_fence_dev *fd, struct cvm_fence *f);

static inline bool cvm_fence_epoch_safe(struct cvm_fence_dev *fd, uint64_t tag)
{
	return tag < atomic_load_explicit(&fd->safe_epoch, memory_order_acquire);
}

#endif /* CVM_FENCE_H */
