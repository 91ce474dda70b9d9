/*
 * Driver layer: the one place the library reaches the CUDA driver (or its host stand-in).
 *
 * A backend is a table of functions (struct cvm_backend) that speak CUresult: 0 on success, a CUDA error
 * code on failure, exactly as the driver would. The wrappers below (cvm_drv_*) are what the rest of the
 * library calls: they apply fault injection, count the calls and time them into the device's statistics,
 * remember the CUresult for cuvmm_last_driver_error(), and translate it to a CUVMM_E* code.
 *
 * Preconditions common to all backend functions: `dev` is a device opened with device_open; sizes and
 * addresses passed to reserve/create/map/unmap/set_access are multiples of that device's granularity.
 * Backend functions are thread-safe and never block on the library's locks.
 */
#ifndef CVM_DRV_H
#define CVM_DRV_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cuda.h> /* CUresult codes: the library builds against the toolkit's header */

#include "cuvmm.h"

/* A physical chunk: CUmemGenericAllocationHandle, or the host backend's chunk pointer. */
typedef uint64_t cvm_handle;
/* A completion marker: CUevent, or the host backend's event. */
typedef void *cvm_event;

struct cvm_devinfo {
	size_t granularity;  /* smallest chunk; every size and address is a multiple */
	size_t total_bytes;  /* physical memory of the device */
	char name[64];       /* for logs */
};

struct cvm_backend {
	const char *name;
	enum cuvmm_backend kind;
	/* Load and initialise. Returns CUVMM_OK or CUVMM_ENODRIVER/ENODEV/EDRIVER (a CUVMM code, not a
	 * CUresult: this is the one function that decides between "no driver" and "no device"). *state is the
	 * backend's private state, passed back to every other function. `cfg` is the context's config. */
	int (*open)(const struct cuvmm_config *cfg, void **state);
	void (*close)(void *state);
	int (*device_count)(void *state, int *count);
	/* Prepare a device for use: check VMM support (CUDA_ERROR_NOT_SUPPORTED if absent), retain the primary
	 * context, read the granularity. Called once per device per context. */
	int (*device_open)(void *state, int dev, struct cvm_devinfo *info);
	void (*device_close)(void *state, int dev);

	/* Virtual address space. */
	int (*reserve)(void *state, int dev, size_t size, uintptr_t *va);
	int (*unreserve)(void *state, int dev, uintptr_t va, size_t size);
	/* Physical chunks: committed at create, returned to the OS/driver at release. */
	int (*create)(void *state, int dev, size_t size, cvm_handle *h);
	int (*release)(void *state, int dev, cvm_handle h);
	/* Map a whole chunk at va (no access until set_access); unmap a range of whole mapped chunks. */
	int (*map)(void *state, int dev, uintptr_t va, size_t size, cvm_handle h);
	int (*unmap)(void *state, int dev, uintptr_t va, size_t size);
	/* Make [va, va+size), mapped with chunks of device `dev`, readable and writable from every device in
	 * `devs` (bit i: device i; one CUmemAccessDesc each). `devs` includes `dev`; devices not in it keep
	 * the access they had. */
	int (*set_access)(void *state, int dev, uintptr_t va, size_t size, uint64_t devs);

	/* Ordering with GPU work. query returns 0 (complete), CUDA_ERROR_NOT_READY (600), or an error. */
	int (*event_create)(void *state, int dev, cvm_event *ev);
	int (*event_destroy)(void *state, int dev, cvm_event ev);
	int (*event_record)(void *state, int dev, cvm_event ev, CUstream stream);
	int (*event_query)(void *state, int dev, cvm_event ev);
	int (*event_sync)(void *state, int dev, cvm_event ev);
	int (*device_sync)(void *state, int dev);
	int (*stream_wait)(void *state, int dev, CUstream stream, cvm_event ev);

	/* Copies for sleep/wake: asynchronous, on a stream of the caller's, to and from pinned host memory
	 * (host_register, below). */
	int (*copy_dtoh)(void *state, int dev, void *dst, uintptr_t src, size_t size, CUstream stream);
	int (*copy_htod)(void *state, int dev, uintptr_t dst, const void *src, size_t size, CUstream stream);
	int (*stream_sync)(void *state, int dev, CUstream stream);
	/* Is `stream` being captured into a CUDA graph? *id: the capture's id (unique in the process, never 0)
	 * while a capture is active or was invalidated and not yet ended, else 0. Legal during any capture. */
	int (*capture_id)(void *state, int dev, CUstream stream, uint64_t *id);
	/* Peers: *can = 1 if device `dev` can access memory that lives on device `peer` (cuDeviceCanAccessPeer),
	 * else 0. Needs neither device opened. */
	int (*can_access_peer)(void *state, int dev, int peer, int *can);
	/* Pin [p, p+size) of ordinary host memory for copies (cuMemHostRegister, portable), and unpin it: p
	 * is the start of a range registered before. Any thread; size a multiple of the page size. */
	int (*host_register)(void *state, void *p, size_t size);
	int (*host_unregister)(void *state, void *p);
};

extern const struct cvm_backend cvm_backend_cuda;
extern const struct cvm_backend cvm_backend_host;

/* CUresult values the library looks at; spelled here so backends need not agree on cuda.h's enum. */
#define CVM_CU_NOT_READY 600

/* Fault injection state of one call kind (cuvmm_ctx_inject_fault). */
struct cvm_fault {
	_Atomic uint64_t skip;    /* calls still to let through */
	_Atomic uint32_t count;   /* calls still to fail after that; UINT32_MAX: forever */
	_Atomic int err;          /* CUVMM_ENOMEM or CUVMM_EDRIVER; atomic: set while other threads call */
};

/* Per-device counters the wrappers feed (a part of struct cuvmm_stats; the rest is kept by phys). */
struct cvm_drv_counters {
	_Atomic uint64_t create_calls, release_calls, map_calls, unmap_calls, driver_ns;
	struct cvm_drv_counters *parent; /* the device's counters, for an object's; NULL for the device's */
};

/* The driver connection of one context. */
struct cvm_drv {
	const struct cvm_backend *be;
	void *state;
	struct cvm_fault fault[CUVMM_CALL_COUNT_];
	_Atomic uint64_t calls[CUVMM_CALL_COUNT_];
};

/*
 * A device as the driver layer sees it: its connection, its index, and the counters of every driver call
 * made for it. The context's device (ctx.h, struct cvm_dev) embeds it as `drv`; the layers below the
 * context (phys.h, fence.h) are given a pointer to it; the per-device wrappers take it.
 */
struct cvm_drv_dev {
	struct cvm_drv *drv;
	int index;                   /* the driver's device index */
	struct cvm_drv_counters cnt; /* the parent of its objects' counters */
};

int cvm_drv_open(struct cvm_drv *d, const struct cuvmm_config *cfg);
void cvm_drv_close(struct cvm_drv *d);

/* Record a CUresult as this thread's last driver error (for errors noticed outside the wrappers). */
void cvm_drv_set_last(int cu);

/* The connection's devices: counted, opened (before their struct cvm_drv_dev is used) and closed. */
int cvm_drv_device_count(struct cvm_drv *d, int *count);
int cvm_drv_device_open(struct cvm_drv *d, int dev, struct cvm_devinfo *info);
void cvm_drv_device_close(struct cvm_drv *d, int dev);
/* *can: whether device `dev` can access memory on device `peer` (always for dev == peer, with no call).
 * Between two devices of the connection, neither of which needs to be opened. */
int cvm_drv_can_access_peer(struct cvm_drv *d, int dev, int peer, bool *can);

/* The wrappers: calls for one device. All return CUVMM_OK or a negative CUVMM code. `cnt` (the calling
 * object's counters, whose parent is dd->cnt, or dd->cnt itself) may be NULL: the call is then not counted. */
int cvm_drv_reserve(struct cvm_drv_dev *dd, size_t size, uintptr_t *va);
int cvm_drv_unreserve(struct cvm_drv_dev *dd, uintptr_t va, size_t size);
int cvm_drv_create(struct cvm_drv_dev *dd, struct cvm_drv_counters *cnt, size_t size, cvm_handle *h);
int cvm_drv_release(struct cvm_drv_dev *dd, struct cvm_drv_counters *cnt, cvm_handle h);
int cvm_drv_map(struct cvm_drv_dev *dd, struct cvm_drv_counters *cnt, uintptr_t va, size_t size, cvm_handle h);
int cvm_drv_unmap(struct cvm_drv_dev *dd, struct cvm_drv_counters *cnt, uintptr_t va, size_t size);
int cvm_drv_set_access(struct cvm_drv_dev *dd, struct cvm_drv_counters *cnt, uintptr_t va, size_t size);
/* The same for the devices of the mask `devs` (bit i: device i), to which dd's own is added. */
int cvm_drv_set_access_devs(struct cvm_drv_dev *dd, struct cvm_drv_counters *cnt, uint64_t devs, uintptr_t va,
			    size_t size);
int cvm_drv_event_create(struct cvm_drv_dev *dd, cvm_event *ev);
void cvm_drv_event_destroy(struct cvm_drv_dev *dd, cvm_event ev);
int cvm_drv_event_record(struct cvm_drv_dev *dd, cvm_event ev, CUstream stream);
/* The same for a caller that has just seen `stream` not capturing (one driver call fewer on a hot path). */
int cvm_drv_event_record_uncaptured(struct cvm_drv_dev *dd, cvm_event ev, CUstream stream);
/* 1: complete, 0: not yet, <0: error. */
int cvm_drv_event_done(struct cvm_drv_dev *dd, cvm_event ev);
int cvm_drv_event_sync(struct cvm_drv_dev *dd, cvm_event ev);
int cvm_drv_device_sync(struct cvm_drv_dev *dd);
int cvm_drv_stream_wait(struct cvm_drv_dev *dd, CUstream stream, cvm_event ev);
int cvm_drv_copy_dtoh(struct cvm_drv_dev *dd, void *dst, uintptr_t src, size_t size, CUstream stream);
int cvm_drv_copy_htod(struct cvm_drv_dev *dd, uintptr_t dst, const void *src, size_t size, CUstream stream);
int cvm_drv_stream_sync(struct cvm_drv_dev *dd, CUstream stream);
/* CUVMM_ENOTSUP if `stream` is being captured (work queued there would be captured into the graph instead of
 * running); event_record, the copies and stream_sync check it themselves. */
int cvm_drv_refuse_captured(struct cvm_drv_dev *dd, CUstream stream);
/* The id of the capture under way on `stream` (0: none). A NULL stream is never captured: 0, no call. */
int cvm_drv_capture_id(struct cvm_drv_dev *dd, CUstream stream, uint64_t *id);
/* Pin host memory for the copies of this device (CUVMM_CALL_HOST_REGISTER), unpin it (a refusal is logged,
 * not returned). The registration is portable (usable by every device): dd names the connection, for one
 * shape at every call site. */
int cvm_drv_host_register(struct cvm_drv_dev *dd, void *p, size_t size);
void cvm_drv_host_unregister(struct cvm_drv_dev *dd, void *p);

/* The host backend's test hooks (gates, stream capture, peers, registered bytes) are declared in drv_test.h,
 * for tests only. */

/* Monotonic time in nanoseconds. */
uint64_t cvm_now_ns(void);
/* Time from `then` to `now`, 0 if `then` is later (a stamp taken after a pass read its clock). */
static inline uint64_t cvm_elapsed(uint64_t now, uint64_t then)
{
	return now > then ? now - then : 0;
}

#endif /* CVM_DRV_H */
