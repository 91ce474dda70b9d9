/*
 * Driver wrappers: fault injection, call counting and timing, error translation. Every driver call the
 * library makes passes through here, so every call site can be made to fail in a test.
 */
#include <time.h>

#include "drv.h"
#include "log.h"

static _Thread_local int last_cu;

/* A call slower than this is logged at debug level (a 2 MiB map or release takes 2-50 us on an H200;
 * releasing a 2 GiB handle 1.5 ms). */
#define CVM_SLOW_CALL_NS 1000000u

/* The driver function behind each enum cuvmm_call, for messages. */
static const char *const call_names[CUVMM_CALL_COUNT_] = {
#define CVM_CALL_NAME_(name, fn) [CUVMM_CALL_##name] = fn,
	CUVMM_CALL_LIST(CVM_CALL_NAME_)
#undef CVM_CALL_NAME_
};

const char *cuvmm_call_name(enum cuvmm_call call)
{
	return (int)call >= 0 && call < CUVMM_CALL_COUNT_ ? call_names[call] : "?";
}

/* Log a driver call that failed or was slow (debug level), and pass its CUresult on. t0 is its start, or 0
 * when it was not timed. */
static int noted(enum cuvmm_call call, int cu, uint64_t t0)
{
	uint64_t dt;

	if (!cvm_log_enabled(CUVMM_LOG_DEBUG))
		return cu;
	dt = t0 ? cvm_now_ns() - t0 : 0;
	if (cu)
		cvm_debug("%s failed: CUresult %d after %.1f us", call_names[call], cu, dt / 1e3);
	else if (dt >= CVM_SLOW_CALL_NS)
		cvm_debug("%s took %.2f ms (slow)", call_names[call], dt / 1e6);
	return cu;
}

/* The start of a call, when debug logging will want its duration. */
static uint64_t call_start(void)
{
	return cvm_log_enabled(CUVMM_LOG_DEBUG) ? cvm_now_ns() : 0;
}

uint64_t cvm_now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

int cuvmm_last_driver_error(void)
{
	return last_cu;
}

void cvm_drv_set_last(int cu)
{
	last_cu = cu;
}

/* Translate a CUresult to a CUVMM code, recording it as this thread's last driver error if non-zero. */
static int cu_to_err(int cu)
{
	if (cu == 0)
		return CUVMM_OK;
	last_cu = cu;
	switch (cu) {
	case CUDA_ERROR_OUT_OF_MEMORY:
		return CUVMM_ENOMEM;
	case CUDA_ERROR_NOT_SUPPORTED:
		return CUVMM_ENOTSUP;
	case CUDA_ERROR_NO_DEVICE:
	case CUDA_ERROR_INVALID_DEVICE:
		return CUVMM_ENODEV;
	case CUDA_ERROR_INVALID_VALUE:
		return CUVMM_EINVAL;
	default:
		return CUVMM_EDRIVER;
	}
}

/* Decide whether this call is to fail. Lock-free: calls of one kind racing for the last skip or the last
 * failure each take one unit with a compare-and-swap, so exactly `count` calls fail. */
static int injected(struct cvm_drv *d, enum cuvmm_call call)
{
	struct cvm_fault *f = &d->fault[call];
	uint64_t skip;
	uint32_t count;

	atomic_fetch_add_explicit(&d->calls[call], 1, memory_order_relaxed);
	if (atomic_load_explicit(&f->count, memory_order_acquire) == 0)
		return 0;
	skip = atomic_load(&f->skip);
	while (skip > 0) {
		if (atomic_compare_exchange_weak(&f->skip, &skip, skip - 1))
			return 0;
	}
	count = atomic_load(&f->count);
	while (count > 0) {
		if (count == UINT32_MAX || atomic_compare_exchange_weak(&f->count, &count, count - 1)) {
			int err = atomic_load_explicit(&f->err, memory_order_relaxed);
			int cu = err == CUVMM_ENOMEM ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_ERROR_UNKNOWN;

			cvm_debug("%s: injected failure (CUresult %d)", call_names[call], cu);
			return cu;
		}
	}
	return 0;
}


int cvm_drv_open(struct cvm_drv *d, const struct cuvmm_config *cfg)
{
	for (int i = 0; i < CUVMM_CALL_COUNT_; i++) {
		atomic_init(&d->fault[i].skip, 0);
		atomic_init(&d->fault[i].count, 0);
		atomic_init(&d->fault[i].err, 0);
		atomic_init(&d->calls[i], 0);
	}
	d->be = cfg->backend == CUVMM_BACKEND_HOST ? &cvm_backend_host : &cvm_backend_cuda;
	d->state = NULL;
	return d->be->open(cfg, &d->state);
}

void cvm_drv_close(struct cvm_drv *d)
{
	if (d->be && d->state)
		d->be->close(d->state);
	d->state = NULL;
}

int cvm_drv_device_count(struct cvm_drv *d, int *count)
{
	return cu_to_err(d->be->device_count(d->state, count));
}

int cvm_drv_device_open(struct cvm_drv *d, int dev, struct cvm_devinfo *info)
{
	return cu_to_err(d->be->device_open(d->state, dev, info));
}

void cvm_drv_device_close(struct cvm_drv *d, int dev)
{
	d->be->device_close(d->state, dev);
}

/*
 * Every wrapper below has one shape: call_begin() decides whether the call is made to fail (the backend is then
 * not called at all) and notes its start; the backend's CUresult then goes through counted() or logged().
 */
static inline int call_begin(struct cvm_drv *d, enum cuvmm_call call, bool timed, uint64_t *t0)
{
	int inj = injected(d, call);

	if (inj)
		return cu_to_err(inj);
	/* Counted calls are always timed (their time feeds driver_ns); others only for the debug log. */
	*t0 = timed ? cvm_now_ns() : call_start();
	return CUVMM_OK;
}

/* The counter of each level that a call of kind `call` bumps; NULL for a call only timed (set_access). */
static inline _Atomic uint64_t *call_counter(struct cvm_drv_counters *c, enum cuvmm_call call)
{
	switch (call) {
	case CUVMM_CALL_CREATE:
		return &c->create_calls;
	case CUVMM_CALL_RELEASE:
		return &c->release_calls;
	case CUVMM_CALL_MAP:
		return &c->map_calls;
	case CUVMM_CALL_UNMAP:
		return &c->unmap_calls;
	default:
		return NULL;
	}
}

/* The end of a counted call, started at t0 (cvm_now_ns()) and returning `cu`: feeds the object's counters
 * and their parent's (the device's), logs a failing or slow call at debug level, translates `cu`. */
static inline int counted(enum cuvmm_call call, struct cvm_drv_counters *cnt, int cu, uint64_t t0)
{
	uint64_t dt = cvm_now_ns() - t0;

	noted(call, cu, t0);
	for (struct cvm_drv_counters *c = cnt; c; c = c->parent) {
		_Atomic uint64_t *n = call_counter(c, call);

		atomic_fetch_add_explicit(&c->driver_ns, dt, memory_order_relaxed);
		if (n)
			atomic_fetch_add_explicit(n, 1, memory_order_relaxed);
	}
	return cu_to_err(cu);
}

/* The end of a call that is not counted, started at t0 (call_start()): logged and translated. */
static inline int logged(enum cuvmm_call call, int cu, uint64_t t0)
{
	return cu_to_err(noted(call, cu, t0));
}

int cvm_drv_reserve(struct cvm_drv_dev *dd, size_t size, uintptr_t *va)
{
	struct cvm_drv *d = dd->drv;
	uint64_t t0 = 0;
	int err = call_begin(d, CUVMM_CALL_RESERVE, false, &t0);

	return err ? err : logged(CUVMM_CALL_RESERVE, d->be->reserve(d->state, dd->index, size, va), t0);
}

int cvm_drv_unreserve(struct cvm_drv_dev *dd, uintptr_t va, size_t size)
{
	struct cvm_drv *d = dd->drv;
	uint64_t t0 = 0;
	int err = call_begin(d, CUVMM_CALL_UNRESERVE, false, &t0);

	return err ? err : logged(CUVMM_CALL_UNRESERVE, d->be->unreserve(d->state, dd->index, va, size), t0);
}

int cvm_drv_create(struct cvm_drv_dev *dd, struct cvm_drv_counters *cnt, size_t size, cvm_handle *h)
{
	struct cvm_drv *d = dd->drv;
	uint64_t t0 = 0;
	int err = call_begin(d, CUVMM_CALL_CREATE, true, &t0);

	return err ? err : counted(CUVMM_CALL_CREATE, cnt, d->be->create(d->state, dd->index, size, h), t0);
}

int cvm_drv_release(struct cvm_drv_dev *dd, struct cvm_drv_counters *cnt, cvm_handle h)
{
	struct cvm_drv *d = dd->drv;
	uint64_t t0 = 0;
	int err = call_begin(d, CUVMM_CALL_RELEASE, true, &t0);

	return err ? err : counted(CUVMM_CALL_RELEASE, cnt, d->be->release(d->state, dd->index, h), t0);
}

int cvm_drv_map(struct cvm_drv_dev *dd, struct cvm_drv_counters *cnt, uintptr_t va, size_t size, cvm_handle h)
{
	struct cvm_drv *d = dd->drv;
	uint64_t t0 = 0;
	int err = call_begin(d, CUVMM_CALL_MAP, true, &t0);

	return err ? err : counted(CUVMM_CALL_MAP, cnt, d->be->map(d->state, dd->index, va, size, h), t0);
}

int cvm_drv_unmap(struct cvm_drv_dev *dd, struct cvm_drv_counters *cnt, uintptr_t va, size_t size)
{
	struct cvm_drv *d = dd->drv;
	uint64_t t0 = 0;
	int err = call_begin(d, CUVMM_CALL_UNMAP, true, &t0);

	return err ? err : counted(CUVMM_CALL_UNMAP, cnt, d->be->unmap(d->state, dd->index, va, size), t0);
}

int cvm_drv_set_access(struct cvm_drv_dev *dd, struct cvm_drv_counters *cnt, uintptr_t va, size_t size)
{
	return cvm_drv_set_access_devs(dd, cnt, 0, va, size);
}

int cvm_drv_set_access_devs(struct cvm_drv_dev *dd, struct cvm_drv_counters *cnt, uint64_t devs, uintptr_t va,
			    size_t size)
{
	struct cvm_drv *d = dd->drv;
	int dev = dd->index;
	uint64_t t0 = 0;
	int err = call_begin(d, CUVMM_CALL_SET_ACCESS, true, &t0);

	devs |= (uint64_t)1 << dev;
	return err ? err : counted(CUVMM_CALL_SET_ACCESS, cnt, d->be->set_access(d->state, dev, va, size, devs), t0);
}

int cvm_drv_event_create(struct cvm_drv_dev *dd, cvm_event *ev)
{
	struct cvm_drv *d = dd->drv;
	uint64_t t0 = 0;
	int err = call_begin(d, CUVMM_CALL_EVENT_CREATE, false, &t0);

	return err ? err : logged(CUVMM_CALL_EVENT_CREATE, d->be->event_create(d->state, dd->index, ev), t0);
}

void cvm_drv_event_destroy(struct cvm_drv_dev *dd, cvm_event ev)
{
	struct cvm_drv *d = dd->drv;
	int cu = d->be->event_destroy(d->state, dd->index, ev);

	if (cu)
		cvm_warn("destroying an event failed (CUresult %d)", cu);
}

/*
 * Work the library queues on a stream of the application's (a fence's event, a sleep's copy) must really run:
 * on a stream under capture it would become a node of the graph instead, and an event recorded there can
 * never be queried. Refused before the driver sees it.
 */
int cvm_drv_refuse_captured(struct cvm_drv_dev *dd, CUstream stream)
{
	uint64_t cap = 0;
	int err = cvm_drv_capture_id(dd, stream, &cap);

	if (err)
		return err;
	if (cap) {
		cvm_drv_set_last(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
		return CUVMM_ENOTSUP;
	}
	return CUVMM_OK;
}

int cvm_drv_event_record(struct cvm_drv_dev *dd, cvm_event ev, CUstream stream)
{
	int err = cvm_drv_refuse_captured(dd, stream);

	if (err)
		return err;
	return cvm_drv_event_record_uncaptured(dd, ev, stream);
}

int cvm_drv_event_record_uncaptured(struct cvm_drv_dev *dd, cvm_event ev, CUstream stream)
{
	struct cvm_drv *d = dd->drv;
	uint64_t t0 = 0;
	int err = call_begin(d, CUVMM_CALL_EVENT_RECORD, false, &t0);

	return err ? err : logged(CUVMM_CALL_EVENT_RECORD, d->be->event_record(d->state, dd->index, ev, stream), t0);
}

int cvm_drv_event_done(struct cvm_drv_dev *dd, cvm_event ev)
{
	struct cvm_drv *d = dd->drv;
	int inj = injected(d, CUVMM_CALL_EVENT_QUERY);
	int cu = inj ? inj : d->be->event_query(d->state, dd->index, ev);

	if (cu == CVM_CU_NOT_READY)
		return 0;
	if (cu && !inj)
		noted(CUVMM_CALL_EVENT_QUERY, cu, 0);
	return cu ? cu_to_err(cu) : 1;
}

int cvm_drv_event_sync(struct cvm_drv_dev *dd, cvm_event ev)
{
	struct cvm_drv *d = dd->drv;
	uint64_t t0 = 0;
	int err = call_begin(d, CUVMM_CALL_EVENT_SYNC, false, &t0);

	return err ? err : logged(CUVMM_CALL_EVENT_SYNC, d->be->event_sync(d->state, dd->index, ev), t0);
}

int cvm_drv_device_sync(struct cvm_drv_dev *dd)
{
	struct cvm_drv *d = dd->drv;
	uint64_t t0 = 0;
	int err = call_begin(d, CUVMM_CALL_DEVICE_SYNC, false, &t0);

	return err ? err : logged(CUVMM_CALL_DEVICE_SYNC, d->be->device_sync(d->state, dd->index), t0);
}

int cvm_drv_stream_wait(struct cvm_drv_dev *dd, CUstream stream, cvm_event ev)
{
	struct cvm_drv *d = dd->drv;
	uint64_t t0 = 0;
	int err = call_begin(d, CUVMM_CALL_STREAM_WAIT, false, &t0);

	return err ? err : logged(CUVMM_CALL_STREAM_WAIT, d->be->stream_wait(d->state, dd->index, stream, ev), t0);
}

int cvm_drv_copy_dtoh(struct cvm_drv_dev *dd, void *dst, uintptr_t src, size_t size, CUstream stream)
{
	struct cvm_drv *d = dd->drv;
	uint64_t t0 = 0;
	int err = cvm_drv_refuse_captured(dd, stream);

	if (!err)
		err = call_begin(d, CUVMM_CALL_COPY, false, &t0);
	return err ? err : logged(CUVMM_CALL_COPY, d->be->copy_dtoh(d->state, dd->index, dst, src, size, stream), t0);
}

int cvm_drv_copy_htod(struct cvm_drv_dev *dd, uintptr_t dst, const void *src, size_t size, CUstream stream)
{
	struct cvm_drv *d = dd->drv;
	uint64_t t0 = 0;
	int err = cvm_drv_refuse_captured(dd, stream);

	if (!err)
		err = call_begin(d, CUVMM_CALL_COPY, false, &t0);
	return err ? err : logged(CUVMM_CALL_COPY, d->be->copy_htod(d->state, dd->index, dst, src, size, stream), t0);
}

int cvm_drv_stream_sync(struct cvm_drv_dev *dd, CUstream stream)
{
	struct cvm_drv *d = dd->drv;
	int err = cvm_drv_refuse_captured(dd, stream);

	if (err)
		return err;
	return cu_to_err(d->be->stream_sync(d->state, dd->index, stream));
}

int cvm_drv_capture_id(struct cvm_drv_dev *dd, CUstream stream, uint64_t *id)
{
	struct cvm_drv *d = dd->drv;
	if (!stream) {
		*id = 0;
		return CUVMM_OK;
	}
	uint64_t t0 = 0;
	int err = call_begin(d, CUVMM_CALL_CAPTURE_INFO, false, &t0);

	return err ? err : logged(CUVMM_CALL_CAPTURE_INFO, d->be->capture_id(d->state, dd->index, stream, id), t0);
}

int cvm_drv_can_access_peer(struct cvm_drv *d, int dev, int peer, bool *can)
{
	uint64_t t0 = 0;
	int yes = 0, err;

	if (dev == peer) {
		*can = true;
		return CUVMM_OK;
	}
	err = call_begin(d, CUVMM_CALL_PEER_QUERY, false, &t0);
	if (err)
		return err;
	err = logged(CUVMM_CALL_PEER_QUERY, d->be->can_access_peer(d->state, dev, peer, &yes), t0);
	if (!err)
		*can = yes != 0;
	return err;
}

int cvm_drv_host_register(struct cvm_drv_dev *dd, void *p, size_t size)
{
	struct cvm_drv *d = dd->drv;
	uint64_t t0 = 0;
	int err = call_begin(d, CUVMM_CALL_HOST_REGISTER, false, &t0);

	return err ? err : logged(CUVMM_CALL_HOST_REGISTER, d->be->host_register(d->state, p, size), t0);
}

void cvm_drv_host_unregister(struct cvm_drv_dev *dd, void *p)
{
	struct cvm_drv *d = dd->drv;
	int cu = d->be->host_unregister(d->state, p);

	if (cu)
		cvm_warn("unregistering pinned host memory failed (CUresult %d)", cu);
}
