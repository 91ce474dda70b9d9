/*
 * Fences and the device's event cache: the one place that decides whether GPU work that may still touch
 * memory has completed. See fence.h.
 */
#include <stdlib.h>
#include <string.h>

#include "fence.h"
#include "log.h"

void cvm_fence_dev_init(struct cvm_fence_dev *fd, struct cvm_drv_dev *dd)
{
	memset(fd, 0, sizeof(*fd));
	fd->dd = dd;
	atomic_init(&fd->epoch, 1);
	atomic_init(&fd->safe_epoch, 1);
	/* No attributes: cannot fail on Linux, as the other mutexes of the library. */
	pthread_mutex_init(&fd->lock, NULL);
}

void cvm_fence_dev_fini(struct cvm_fence_dev *fd)
{
	for (size_t i = 0; i < fd->n; i++)
		cvm_drv_event_destroy(fd->dd, fd->ev[i]);
	free(fd->ev);
	fd->ev = NULL;
	fd->n = fd->cap = 0;
	pthread_mutex_destroy(&fd->lock);
}

int cvm_fence_event_get(struct cvm_fence_dev *fd, cvm_event *ev)
{
	pthread_mutex_lock(&fd->lock);
	if (fd->n) {
		*ev = fd->ev[--fd->n];
		pthread_mutex_unlock(&fd->lock);
		return CUVMM_OK;
	}
	pthread_mutex_unlock(&fd->lock);
	return cvm_drv_event_create(fd->dd, ev);
}

void cvm_fence_event_put(struct cvm_fence_dev *fd, cvm_event ev)
{
	if (!ev)
		return;
	pthread_mutex_lock(&fd->lock);
	if (fd->n == fd->cap && fd->cap < CVM_FENCE_CACHE_MAX) {
		size_t cap = fd->cap ? 2 * fd->cap : 16;
		cvm_event *grown = realloc(fd->ev, cap * sizeof(*grown));

		if (grown) {
			fd->ev = grown;
			fd->cap = cap;
		}
	}
	if (fd->n < fd->cap) {
		fd->ev[fd->n++] = ev;
		ev = NULL;
	}
	pthread_mutex_unlock(&fd->lock);
	if (ev)
		cvm_drv_event_destroy(fd->dd, ev);
}

uint64_t cvm_fence_sync_begin(struct cvm_fence_dev *fd)
{
	return atomic_fetch_add(&fd->epoch, 1) + 1;
}

void cvm_fence_sync_end(struct cvm_fence_dev *fd, uint64_t e)
{
	uint64_t cur = atomic_load(&fd->safe_epoch);

	/* Racing synchronisations: keep the highest. */
	while (cur < e && !atomic_compare_exchange_weak(&fd->safe_epoch, &cur, e))
		;
}

static int record(struct cvm_fence_dev *fd, struct cvm_fence *f, CUstream stream, bool uncaptured)
{
	cvm_event ev;
	int err = cvm_fence_event_get(fd, &ev);

	if (err)
		return err;
	if (uncaptured)
		err = cvm_drv_event_record_uncaptured(fd->dd, ev, stream);
	else
		err = cvm_drv_event_record(fd->dd, ev, stream);
	if (err) {
		cvm_fence_event_put(fd, ev);
		return err;
	}
	f->ev = ev;
	f->stream = stream;
	f->epoch = 0;
	f->done = false;
	return CUVMM_OK;
}

int cvm_fence_record(struct cvm_fence_dev *fd, struct cvm_fence *f, CUstream stream)
{
	return record(fd, f, stream, false);
}

int cvm_fence_record_uncaptured(struct cvm_fence_dev *fd, struct cvm_fence *f, CUstream stream)
{
	return record(fd, f, stream, true);
}

void cvm_fence_set_epoch(struct cvm_fence_dev *fd, struct cvm_fence *f)
{
	f->ev = NULL;
	f->stream = NULL;
	f->epoch = atomic_load(&fd->epoch);
	f->done = false;
}

int cvm_fence_done(struct cvm_fence_dev *fd, struct cvm_fence *f)
{
	int done;

	if (f->done)
		return 1;
	if (f->ev) {
		done = cvm_drv_event_done(fd->dd, f->ev);
		if (done < 0)
			return done;
	} else {
		done = !f->epoch || cvm_fence_epoch_safe(fd, f->epoch);
	}
	f->done = done;
	return done;
}

bool cvm_fence_usable(struct cvm_fence_dev *fd, struct cvm_fence *f, CUstream stream)
{
	if (!f->ev || f->done)
		return true;
	if (stream && f->stream == stream)
		return true;
	return cvm_fence_done(fd, f) > 0;
}

int cvm_fence_wait(struct cvm_fence_dev *fd, struct cvm_fence *f)
{
	/* ev only: `done` may be written meanwhile by the owner, under its lock, which a waiter does not hold. */
	if (!f->ev)
		return CUVMM_OK;
	return cvm_drv_event_sync(fd->dd, f->ev);
}

void cvm_fence_clear(struct cvm_fence_dev *fd, struct cvm_fence *f)
{
	uint32_t refs = f->refs;

	cvm_fence_event_put(fd, f->ev);
	memset(f, 0, sizeof(*f));
	f->refs = refs;
}

void cvm_fence_merge(struct cvm_fence_dev *fd, struct cvm_fence *dst, struct cvm_fence *src)
{
	if (src->ev) {
		/* Same stream: dst's event completes after src's. */
		cvm_fence_event_put(fd, src->ev);
		src->ev = NULL;
		return;
	}
	if (src->epoch > dst->epoch) {
		dst->epoch = src->epoch;
		dst->done = src->done;
	}
}

struct cvm_fence *cvm_fence_new(void)
{
	struct cvm_fence *f = calloc(1, sizeof(*f));

	if (f)
		f->refs = 1;
	return f;
}

void cvm_fence_unref(struct cvm_fence_dev *fd, struct cvm_fence *f)
{
	if (f && --f->refs == 0) {
		cvm_fence_event_put(fd, f->ev);
		free(f);
	}
}
