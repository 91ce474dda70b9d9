/*
 * CUDA backend: the real driver, loaded at run time.
 *
 * libcuda is never linked, so the library loads (and its host backend works) on machines without a driver.
 * Only cuGetProcAddress_v2 is taken with dlsym; every other entry point is resolved through it, pinned to
 * the CUDA 12.0 ABI. Asking for 12.0 rather than the headers' CUDA_VERSION keeps two promises: any 12.x or
 * newer driver answers (a request above the driver's own version fails with CUDA_ERROR_INVALID_VALUE), and
 * the variant returned matches the typedefs below even when built against newer headers that add variants.
 *
 * Every call that touches a context runs with the device's primary context current, pushed only when it
 * is not already, so that the application's current context is the same after each call as before it.
 */
#include <dlfcn.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include <cuda.h>

#include "drv.h"
#include "log.h"

/* The ABI the entry points are requested for; see the top of the file. */
#define CVM_CUDA_ABI 12000
#define CVM_CUDA_MAX_DEVICES 64

/* Entry point types, as of the 12.0 ABI (cuDeviceTotalMem is cuDeviceTotalMem_v2, and so on). */
typedef CUresult (*pfn_cuGetProcAddress)(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
					 CUdriverProcAddressQueryResult *symbolStatus);
typedef CUresult (*pfn_cuInit)(unsigned int flags);
typedef CUresult (*pfn_cuDriverGetVersion)(int *version);
typedef CUresult (*pfn_cuDeviceGetCount)(int *count);
typedef CUresult (*pfn_cuDeviceGet)(CUdevice *device, int ordinal);
typedef CUresult (*pfn_cuDeviceGetAttribute)(int *pi, CUdevice_attribute attrib, CUdevice dev);
typedef CUresult (*pfn_cuDeviceCanAccessPeer)(int *can, CUdevice dev, CUdevice peer);
typedef CUresult (*pfn_cuDeviceGetName)(char *name, int len, CUdevice dev);
typedef CUresult (*pfn_cuDeviceTotalMem)(size_t *bytes, CUdevice dev);
typedef CUresult (*pfn_cuDevicePrimaryCtxRetain)(CUcontext *pctx, CUdevice dev);
typedef CUresult (*pfn_cuDevicePrimaryCtxRelease)(CUdevice dev);
typedef CUresult (*pfn_cuCtxGetCurrent)(CUcontext *pctx);
typedef CUresult (*pfn_cuCtxPushCurrent)(CUcontext ctx);
typedef CUresult (*pfn_cuCtxPopCurrent)(CUcontext *pctx);
typedef CUresult (*pfn_cuCtxSynchronize)(void);
typedef CUresult (*pfn_cuMemGetAllocationGranularity)(size_t *granularity, const CUmemAllocationProp *prop,
						      CUmemAllocationGranularity_flags option);
typedef CUresult (*pfn_cuMemAddressReserve)(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
					    unsigned long long flags);
typedef CUresult (*pfn_cuMemAddressFree)(CUdeviceptr ptr, size_t size);
typedef CUresult (*pfn_cuMemCreate)(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
				    unsigned long long flags);
typedef CUresult (*pfn_cuMemRelease)(CUmemGenericAllocationHandle handle);
typedef CUresult (*pfn_cuMemMap)(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
				 unsigned long long flags);
typedef CUresult (*pfn_cuMemUnmap)(CUdeviceptr ptr, size_t size);
typedef CUresult (*pfn_cuMemSetAccess)(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count);
typedef CUresult (*pfn_cuEventCreate)(CUevent *event, unsigned int flags);
typedef CUresult (*pfn_cuEventDestroy)(CUevent event);
typedef CUresult (*pfn_cuEventRecord)(CUevent event, CUstream stream);
typedef CUresult (*pfn_cuEventQuery)(CUevent event);
typedef CUresult (*pfn_cuEventSynchronize)(CUevent event);
typedef CUresult (*pfn_cuStreamWaitEvent)(CUstream stream, CUevent event, unsigned int flags);
typedef CUresult (*pfn_cuStreamSynchronize)(CUstream stream);
typedef CUresult (*pfn_cuMemHostRegister)(void *p, size_t size, unsigned int flags);
typedef CUresult (*pfn_cuMemHostUnregister)(void *p);
typedef CUresult (*pfn_cuMemcpyDtoHAsync)(void *dst, CUdeviceptr src, size_t size, CUstream stream);
typedef CUresult (*pfn_cuMemcpyHtoDAsync)(CUdeviceptr dst, const void *src, size_t size, CUstream stream);
typedef CUresult (*pfn_cuThreadExchangeStreamCaptureMode)(CUstreamCaptureMode *mode);
/* cuStreamGetCaptureInfo as of the 12.0 ABI (cuStreamGetCaptureInfo_v2; the headers' v3 adds edge data). */
typedef CUresult (*pfn_cuStreamGetCaptureInfo)(CUstream stream, CUstreamCaptureStatus *status, cuuint64_t *id,
					       CUgraph *graph, const CUgraphNode **deps, size_t *ndeps);

/*
 * The entry points the backend cannot work without. The names are given without their "cu" so that none
 * collides with the versioning macros of cuda.h (cuDeviceTotalMem -> cuDeviceTotalMem_v2, ...): the field is the
 * bare name, the type pfn_cu<name>, the symbol asked for "cu<name>", the base name cuGetProcAddress wants.
 */
#define CVM_CUDA_ENTRY_POINTS(X)                                                                             \
	X(DeviceGetCount)                                                                                    \
	X(DeviceGet)                                                                                         \
	X(DeviceGetAttribute)                                                                                \
	X(DeviceCanAccessPeer)                                                                               \
	X(DeviceGetName)                                                                                     \
	X(DeviceTotalMem)                                                                                    \
	X(DevicePrimaryCtxRetain)                                                                            \
	X(DevicePrimaryCtxRelease)                                                                           \
	X(CtxGetCurrent)                                                                                     \
	X(CtxPushCurrent)                                                                                    \
	X(CtxPopCurrent)                                                                                     \
	X(CtxSynchronize)                                                                                    \
	X(MemGetAllocationGranularity)                                                                       \
	X(MemAddressReserve)                                                                                 \
	X(MemAddressFree)                                                                                    \
	X(MemCreate)                                                                                         \
	X(MemRelease)                                                                                        \
	X(MemMap)                                                                                            \
	X(MemUnmap)                                                                                          \
	X(MemSetAccess)                                                                                      \
	X(EventCreate)                                                                                       \
	X(EventDestroy)                                                                                      \
	X(EventRecord)                                                                                       \
	X(EventQuery)                                                                                        \
	X(EventSynchronize)                                                                                  \
	X(StreamWaitEvent)                                                                                   \
	X(StreamSynchronize)                                                                                 \
	X(MemcpyDtoHAsync)                                                                                   \
	X(MemcpyHtoDAsync)                                                                                   \
	X(ThreadExchangeStreamCaptureMode)                                                                   \
	X(StreamGetCaptureInfo)                                                                              \
	X(MemHostRegister)                                                                                   \
	X(MemHostUnregister)

struct cuda_fn {
	pfn_cuGetProcAddress GetProcAddress;
	pfn_cuInit Init;
	pfn_cuDriverGetVersion DriverGetVersion; /* optional: only for the log */
#define CVM_CUDA_FIELD_(name) pfn_cu##name name;
	CVM_CUDA_ENTRY_POINTS(CVM_CUDA_FIELD_)
#undef CVM_CUDA_FIELD_
};

static const struct {
	const char *symbol;
	size_t offset;
} entry_points[] = {
#define CVM_CUDA_ENTRY_(name) {"cu" #name, offsetof(struct cuda_fn, name)},
	CVM_CUDA_ENTRY_POINTS(CVM_CUDA_ENTRY_)
#undef CVM_CUDA_ENTRY_
};

/* Resolved addresses arrive as void * and are copied into function pointers, as POSIX allows for dlsym. */
_Static_assert(sizeof(void *) == sizeof(pfn_cuInit), "function pointers must be the size of void *");

struct cuda_dev {
	CUdevice dev;
	CUcontext ctx;      /* retained primary context; NULL until device_open */
	size_t granularity; /* also the alignment of reservations */
};

struct cuda_state {
	void *lib;
	struct cuda_fn fn;
	int ndev;
	/* Device 0's primary context, retained for pinned host memory independently of device_open/close
	 * (a registration dies with the context it was made in). Set once, by whichever thread wins. */
	_Atomic(CUcontext) host_ctx;
	struct cuda_dev dev[CVM_CUDA_MAX_DEVICES];
};

/* The failures of cuInit that mean "this driver cannot be used here", as opposed to a failing call. */
static int init_error_code(CUresult r)
{
	switch ((int)r) {
	case CUDA_ERROR_NO_DEVICE:
		return CUVMM_ENODEV;
	case CUDA_ERROR_NOT_INITIALIZED:
	case CUDA_ERROR_DEINITIALIZED:
	case CUDA_ERROR_STUB_LIBRARY:
	case CUDA_ERROR_CALL_REQUIRES_NEWER_DRIVER:
	case CUDA_ERROR_SYSTEM_NOT_READY:
	case CUDA_ERROR_SYSTEM_DRIVER_MISMATCH:
	case CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE:
		return CUVMM_ENODRIVER;
	default:
		return CUVMM_EDRIVER;
	}
}

/* Resolve one entry point into *slot. A symbol the driver lacks comes back as success with a NULL pointer,
 * so that case is folded into CUDA_ERROR_NOT_FOUND. */
static CUresult resolve(const struct cuda_state *s, const char *symbol, void *slot)
{
	CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
	void *p = NULL;
	CUresult r;

	r = s->fn.GetProcAddress(symbol, &p, CVM_CUDA_ABI, CU_GET_PROC_ADDRESS_DEFAULT, &status);
	if (r != CUDA_SUCCESS)
		return r;
	if (!p || status != CU_GET_PROC_ADDRESS_SUCCESS)
		return CUDA_ERROR_NOT_FOUND;
	memcpy(slot, &p, sizeof(p));
	return CUDA_SUCCESS;
}

/*
 * One driver call's scope: what ctx_enter changed on the calling thread, for ctx_leave to restore. r is the
 * enter's result; when it is not CUDA_SUCCESS, nothing was changed and the call is not made.
 */
struct cu_scope {
	CUresult r;
	bool pushed;              /* the context was pushed: pop it */
	CUstreamCaptureMode mode; /* the thread's capture mode before the call */
	const struct cuda_dev *d; /* the device, from dev_enter */
};

/*
 * Make ctx current for one call, in relaxed stream-capture mode. Relaxed mode is what keeps the library's
 * calls (maps, unmaps, event queries, from the application's threads and the background thread alike) from
 * invalidating a CUDA graph capture that some thread has under way in global mode, PyTorch's default: in
 * global mode every "potentially unsafe" call of any thread breaks it. The thread's own mode is restored by
 * ctx_leave. If the current context cannot even be read (e.g. the application's was destroyed), pushing
 * anyway is still safe: the pop restores whatever was there.
 */
static struct cu_scope ctx_enter_mode(const struct cuda_state *s, CUcontext ctx, bool relaxed)
{
	struct cu_scope sc = { .r = CUDA_SUCCESS, .mode = CU_STREAM_CAPTURE_MODE_RELAXED };
	CUcontext cur = NULL;

	/* Cannot fail for a valid mode; if it did, the call below runs in the thread's own mode. */
	if (relaxed && s->fn.ThreadExchangeStreamCaptureMode(&sc.mode) != CUDA_SUCCESS)
		sc.mode = CU_STREAM_CAPTURE_MODE_RELAXED;
	if (s->fn.CtxGetCurrent(&cur) == CUDA_SUCCESS && cur == ctx)
		return sc;
	sc.r = s->fn.CtxPushCurrent(ctx);
	if (sc.r == CUDA_SUCCESS)
		sc.pushed = true;
	else if (sc.mode != CU_STREAM_CAPTURE_MODE_RELAXED)
		s->fn.ThreadExchangeStreamCaptureMode(&sc.mode);
	return sc;
}

static struct cu_scope ctx_enter(const struct cuda_state *s, CUcontext ctx)
{
	return ctx_enter_mode(s, ctx, true);
}

/* Restore what ctx_enter changed; returns r, the result of the call made in the scope. */
static CUresult ctx_leave(const struct cuda_state *s, struct cu_scope sc, CUresult r)
{
	CUcontext popped = NULL;
	CUresult pr;

	if (sc.mode != CU_STREAM_CAPTURE_MODE_RELAXED)
		s->fn.ThreadExchangeStreamCaptureMode(&sc.mode);
	if (!sc.pushed)
		return r;
	pr = s->fn.CtxPopCurrent(&popped);
	/* Nothing to hand back through the caller's result, but a stack left wrong would confuse the application
	 * long after; say so. */
	if (pr != CUDA_SUCCESS)
		cvm_warn("cuCtxPopCurrent failed (CUresult %d); the thread's current context may be wrong", (int)pr);
	return r;
}

/*
 * The driver call `call` (an expression) made in the scope sc, which ctx_enter, dev_enter or host_enter
 * returned: made only if the enter succeeded, and the scope left right after it. A plain expression: the
 * call's CUresult, or the enter's. Every driver call that needs a context goes through here.
 */
#define IN_SCOPE(s, sc, call) ((sc).r != CUDA_SUCCESS ? (sc).r : ctx_leave((s), (sc), (call)))

/* Validate dev and make its primary context current. */
static struct cu_scope dev_enter_mode(struct cuda_state *s, int dev, bool relaxed)
{
	struct cu_scope sc = { .r = CUDA_ERROR_INVALID_DEVICE, .mode = CU_STREAM_CAPTURE_MODE_RELAXED };

	if (dev < 0 || dev >= s->ndev)
		return sc;
	if (!s->dev[dev].ctx) {
		sc.r = CUDA_ERROR_INVALID_CONTEXT;
		return sc;
	}
	sc = ctx_enter_mode(s, s->dev[dev].ctx, relaxed);
	sc.d = &s->dev[dev];
	return sc;
}

static struct cu_scope dev_enter(struct cuda_state *s, int dev)
{
	return dev_enter_mode(s, dev, true);
}

/* Device 0's primary context for pinned host memory, retained on first use. */
static CUresult host_ctx_get(struct cuda_state *s, CUcontext *out)
{
	CUcontext ctx = atomic_load_explicit(&s->host_ctx, memory_order_acquire);
	CUcontext expected = NULL;
	CUdevice dev;
	CUresult r;

	if (ctx) {
		*out = ctx;
		return CUDA_SUCCESS;
	}
	r = s->fn.DeviceGet(&dev, 0);
	if (r != CUDA_SUCCESS)
		return r;
	r = s->fn.DevicePrimaryCtxRetain(&ctx, dev);
	if (r != CUDA_SUCCESS)
		return r;
	if (!atomic_compare_exchange_strong_explicit(&s->host_ctx, &expected, ctx, memory_order_acq_rel,
						     memory_order_acquire)) {
		/* Another thread retained it first; one reference is enough. Same context either way. */
		s->fn.DevicePrimaryCtxRelease(dev);
		ctx = expected;
	}
	*out = ctx;
	return CUDA_SUCCESS;
}

/* Device 0's primary context made current, for pinned host memory. */
static struct cu_scope host_enter(struct cuda_state *s)
{
	struct cu_scope sc = { .mode = CU_STREAM_CAPTURE_MODE_RELAXED };
	CUcontext ctx = NULL;

	sc.r = host_ctx_get(s, &ctx);
	return sc.r != CUDA_SUCCESS ? sc : ctx_enter(s, ctx);
}

static void release_contexts(struct cuda_state *s)
{
	CUcontext host = atomic_exchange(&s->host_ctx, NULL);
	CUdevice dev;

	for (int i = 0; i < s->ndev; i++) {
		if (s->dev[i].ctx) {
			s->fn.DevicePrimaryCtxRelease(s->dev[i].dev);
			s->dev[i].ctx = NULL;
		}
	}
	if (host && s->fn.DeviceGet(&dev, 0) == CUDA_SUCCESS)
		s->fn.DevicePrimaryCtxRelease(dev);
}

static void cuda_close(void *state)
{
	struct cuda_state *s = state;

	if (!s)
		return;
	release_contexts(s);
	dlclose(s->lib);
	free(s);
}

static int cuda_open(const struct cuvmm_config *cfg, void **state)
{
	struct cuda_state *s;
	void *sym;
	CUresult r;
	int count = 0, version = 0, err;

	(void)cfg;
	s = calloc(1, sizeof(*s));
	if (!s)
		return CUVMM_ENOMEM;
	atomic_init(&s->host_ctx, NULL);

	s->lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
	if (!s->lib) {
		cvm_info("cannot load the CUDA driver: %s", dlerror());
		free(s);
		return CUVMM_ENODRIVER;
	}
	sym = dlsym(s->lib, "cuGetProcAddress_v2");
	if (!sym) {
		/* Drivers before CUDA 12.0 lack it; they are too old for the ABI asked for anyway. */
		cvm_info("the CUDA driver has no cuGetProcAddress_v2 (older than CUDA 12.0?): %s", dlerror());
		err = CUVMM_ENODRIVER;
		goto fail;
	}
	memcpy(&s->fn.GetProcAddress, &sym, sizeof(sym));

	/* cuInit first, so that no lookup depends on whether the driver resolves symbols before it. */
	r = resolve(s, "cuInit", &s->fn.Init);
	if (r != CUDA_SUCCESS) {
		cvm_info("the CUDA driver has no usable cuInit (CUresult %d)", (int)r);
		cvm_drv_set_last(r);
		err = CUVMM_ENODRIVER;
		goto fail;
	}
	r = s->fn.Init(0);
	if (r != CUDA_SUCCESS) {
		cvm_info("cuInit failed (CUresult %d)", (int)r);
		cvm_drv_set_last(r);
		err = init_error_code(r);
		goto fail;
	}
	for (size_t i = 0; i < sizeof(entry_points) / sizeof(entry_points[0]); i++) {
		r = resolve(s, entry_points[i].symbol, (char *)&s->fn + entry_points[i].offset);
		if (r != CUDA_SUCCESS) {
			cvm_info("the CUDA driver lacks %s for the CUDA %d.%d ABI (CUresult %d)",
				 entry_points[i].symbol, CVM_CUDA_ABI / 1000, CVM_CUDA_ABI % 1000 / 10, (int)r);
			cvm_drv_set_last(r);
			err = CUVMM_ENODRIVER;
			goto fail;
		}
	}
	if (resolve(s, "cuDriverGetVersion", &s->fn.DriverGetVersion) != CUDA_SUCCESS)
		s->fn.DriverGetVersion = NULL;

	r = s->fn.DeviceGetCount(&count);
	if (r != CUDA_SUCCESS) {
		cvm_info("cuDeviceGetCount failed (CUresult %d)", (int)r);
		cvm_drv_set_last(r);
		err = r == CUDA_ERROR_NO_DEVICE ? CUVMM_ENODEV : CUVMM_EDRIVER;
		goto fail;
	}
	if (count <= 0) {
		cvm_info("the CUDA driver sees no device");
		cvm_drv_set_last(CUDA_ERROR_NO_DEVICE);
		err = CUVMM_ENODEV;
		goto fail;
	}
	if (count > CVM_CUDA_MAX_DEVICES) {
		cvm_info("the CUDA driver sees %d devices; using the first %d", count, CVM_CUDA_MAX_DEVICES);
		count = CVM_CUDA_MAX_DEVICES;
	}
	s->ndev = count;

	if (s->fn.DriverGetVersion && s->fn.DriverGetVersion(&version) == CUDA_SUCCESS)
		cvm_info("CUDA driver %d.%d loaded, %d device(s)", version / 1000, version % 1000 / 10, count);
	else
		cvm_info("CUDA driver loaded, %d device(s)", count);
	*state = s;
	return CUVMM_OK;

fail:
	dlclose(s->lib);
	free(s);
	return err;
}

static int cuda_device_count(void *state, int *count)
{
	const struct cuda_state *s = state;

	*count = s->ndev;
	return CUDA_SUCCESS;
}

static int cuda_device_open(void *state, int dev, struct cvm_devinfo *info)
{
	struct cuda_state *s = state;
	struct cuda_dev *d;
	struct cvm_devinfo out;
	CUmemAllocationProp prop;
	CUdevice cudev;
	CUcontext ctx;
	CUresult r;
	struct cu_scope sc;
	int vmm = 0, retained = 0;

	if (dev < 0 || dev >= s->ndev)
		return CUDA_ERROR_INVALID_DEVICE;
	d = &s->dev[dev];
	r = s->fn.DeviceGet(&cudev, dev);
	if (r != CUDA_SUCCESS)
		return r;
	r = s->fn.DeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, cudev);
	if (r != CUDA_SUCCESS)
		return r;
	if (!vmm) {
		cvm_info("CUDA device %d lacks virtual memory management", dev);
		return CUDA_ERROR_NOT_SUPPORTED;
	}

	/* Opened twice: keep the one reference, which the one device_close drops. */
	ctx = d->ctx;
	if (!ctx) {
		r = s->fn.DevicePrimaryCtxRetain(&ctx, cudev);
		if (r != CUDA_SUCCESS)
			return r;
		retained = 1;
	}

	memset(&out, 0, sizeof(out));
	memset(&prop, 0, sizeof(prop));
	prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
	prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;
	prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
	prop.location.id = dev;
	sc = ctx_enter(s, ctx);
	r = IN_SCOPE(s, sc, s->fn.MemGetAllocationGranularity(&out.granularity, &prop,
								  CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
	if (r != CUDA_SUCCESS)
		goto fail;
	if (!out.granularity) {
		r = CUDA_ERROR_UNKNOWN;
		goto fail;
	}
	r = s->fn.DeviceTotalMem(&out.total_bytes, cudev);
	if (r != CUDA_SUCCESS)
		goto fail;
	r = s->fn.DeviceGetName(out.name, (int)sizeof(out.name), cudev);
	if (r != CUDA_SUCCESS)
		goto fail;
	out.name[sizeof(out.name) - 1] = '\0';

	d->dev = cudev;
	d->ctx = ctx;
	d->granularity = out.granularity;
	*info = out;
	cvm_info("CUDA device %d: %s, %zu MiB, granularity %zu KiB", dev, out.name, out.total_bytes >> 20,
		 out.granularity >> 10);
	return CUDA_SUCCESS;

fail:
	if (retained)
		s->fn.DevicePrimaryCtxRelease(cudev);
	return r;
}

static void cuda_device_close(void *state, int dev)
{
	struct cuda_state *s = state;
	struct cuda_dev *d;

	if (dev < 0 || dev >= s->ndev)
		return;
	d = &s->dev[dev];
	if (!d->ctx)
		return;
	s->fn.DevicePrimaryCtxRelease(d->dev);
	d->ctx = NULL;
}

static int cuda_reserve(void *state, int dev, size_t size, uintptr_t *va)
{
	struct cuda_state *s = state;
	struct cu_scope sc = dev_enter(s, dev);
	CUdeviceptr p = 0;
	CUresult r = IN_SCOPE(s, sc, s->fn.MemAddressReserve(&p, size, sc.d->granularity, 0, 0));

	if (r == CUDA_SUCCESS)
		*va = (uintptr_t)p;
	return r;
}

static int cuda_unreserve(void *state, int dev, uintptr_t va, size_t size)
{
	struct cuda_state *s = state;
	struct cu_scope sc = dev_enter(s, dev);

	return IN_SCOPE(s, sc, s->fn.MemAddressFree((CUdeviceptr)va, size));
}

static int cuda_create(void *state, int dev, size_t size, cvm_handle *h)
{
	struct cuda_state *s = state;
	CUmemAllocationProp prop;
	CUmemGenericAllocationHandle handle = 0;
	struct cu_scope sc;
	CUresult r;

	memset(&prop, 0, sizeof(prop));
	prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
	prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;
	prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
	prop.location.id = dev;
	sc = dev_enter(s, dev);
	r = IN_SCOPE(s, sc, s->fn.MemCreate(&handle, size, &prop, 0));
	if (r == CUDA_SUCCESS)
		*h = (cvm_handle)handle;
	return r;
}

static int cuda_release(void *state, int dev, cvm_handle h)
{
	struct cuda_state *s = state;
	struct cu_scope sc = dev_enter(s, dev);

	return IN_SCOPE(s, sc, s->fn.MemRelease((CUmemGenericAllocationHandle)h));
}

static int cuda_map(void *state, int dev, uintptr_t va, size_t size, cvm_handle h)
{
	struct cuda_state *s = state;
	struct cu_scope sc = dev_enter(s, dev);

	return IN_SCOPE(s, sc, s->fn.MemMap((CUdeviceptr)va, size, 0, (CUmemGenericAllocationHandle)h, 0));
}

static int cuda_unmap(void *state, int dev, uintptr_t va, size_t size)
{
	struct cuda_state *s = state;
	struct cu_scope sc = dev_enter(s, dev);

	return IN_SCOPE(s, sc, s->fn.MemUnmap((CUdeviceptr)va, size));
}

/* One CUmemAccessDesc per device of `devs` (the owner `dev` among them), in one call: the driver's cost is
 * per handle covered, not per device. */
static int cuda_set_access(void *state, int dev, uintptr_t va, size_t size, uint64_t devs)
{
	struct cuda_state *s = state;
	CUmemAccessDesc desc[CVM_CUDA_MAX_DEVICES];
	struct cu_scope sc;
	size_t n = 0;

	memset(desc, 0, sizeof(desc));
	for (int i = 0; i < CVM_CUDA_MAX_DEVICES; i++) {
		if (!(devs >> i & 1))
			continue;
		if (i >= s->ndev)
			return CUDA_ERROR_INVALID_DEVICE;
		desc[n].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
		desc[n].location.id = i;
		desc[n].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
		n++;
	}
	sc = dev_enter(s, dev);
	return IN_SCOPE(s, sc, s->fn.MemSetAccess((CUdeviceptr)va, size, desc, n));
}

/* A device query, like those of cuda_device_open: it needs no context, so it is made outside any scope. */
static int cuda_can_access_peer(void *state, int dev, int peer, int *can)
{
	struct cuda_state *s = state;
	CUdevice a, b;
	CUresult r;

	if (dev < 0 || dev >= s->ndev || peer < 0 || peer >= s->ndev)
		return CUDA_ERROR_INVALID_DEVICE;
	r = s->fn.DeviceGet(&a, dev);
	if (r == CUDA_SUCCESS)
		r = s->fn.DeviceGet(&b, peer);
	if (r == CUDA_SUCCESS)
		r = s->fn.DeviceCanAccessPeer(can, a, b);
	return r;
}

static int cuda_event_create(void *state, int dev, cvm_event *ev)
{
	struct cuda_state *s = state;
	struct cu_scope sc = dev_enter(s, dev);
	CUevent e = NULL;
	/* Only ordering is wanted; timing makes record and query slower. */
	CUresult r = IN_SCOPE(s, sc, s->fn.EventCreate(&e, CU_EVENT_DISABLE_TIMING));

	if (r == CUDA_SUCCESS)
		*ev = (cvm_event)e;
	return r;
}

static int cuda_event_destroy(void *state, int dev, cvm_event ev)
{
	struct cuda_state *s = state;
	struct cu_scope sc = dev_enter(s, dev);

	return IN_SCOPE(s, sc, s->fn.EventDestroy((CUevent)ev));
}

static int cuda_event_record(void *state, int dev, cvm_event ev, CUstream stream)
{
	struct cuda_state *s = state;
	struct cu_scope sc = dev_enter(s, dev);

	return IN_SCOPE(s, sc, s->fn.EventRecord((CUevent)ev, stream));
}

static int cuda_event_query(void *state, int dev, cvm_event ev)
{
	struct cuda_state *s = state;
	struct cu_scope sc = dev_enter(s, dev);

	return IN_SCOPE(s, sc, s->fn.EventQuery((CUevent)ev));
}

static int cuda_event_sync(void *state, int dev, cvm_event ev)
{
	struct cuda_state *s = state;
	struct cu_scope sc = dev_enter(s, dev);

	return IN_SCOPE(s, sc, s->fn.EventSynchronize((CUevent)ev));
}

static int cuda_device_sync(void *state, int dev)
{
	struct cuda_state *s = state;
	struct cu_scope sc = dev_enter(s, dev);

	return IN_SCOPE(s, sc, s->fn.CtxSynchronize());
}

static int cuda_stream_wait(void *state, int dev, CUstream stream, cvm_event ev)
{
	struct cuda_state *s = state;
	struct cu_scope sc = dev_enter(s, dev);

	return IN_SCOPE(s, sc, s->fn.StreamWaitEvent(stream, (CUevent)ev, 0));
}

/* Pinning ordinary memory: in device 0's primary context, from any thread; portable, since the copies run
 * on whichever device's stream, not only device 0's. */
static int cuda_host_register(void *state, void *p, size_t size)
{
	struct cuda_state *s = state;
	struct cu_scope sc = host_enter(s);

	return IN_SCOPE(s, sc, s->fn.MemHostRegister(p, size, CU_MEMHOSTREGISTER_PORTABLE));
}

static int cuda_host_unregister(void *state, void *p)
{
	struct cuda_state *s = state;
	struct cu_scope sc = host_enter(s);

	return IN_SCOPE(s, sc, s->fn.MemHostUnregister(p));
}

static int cuda_copy_dtoh(void *state, int dev, void *dst, uintptr_t src, size_t size, CUstream stream)
{
	struct cuda_state *s = state;
	struct cu_scope sc = dev_enter(s, dev);

	return IN_SCOPE(s, sc, s->fn.MemcpyDtoHAsync(dst, (CUdeviceptr)src, size, stream));
}

static int cuda_copy_htod(void *state, int dev, uintptr_t dst, const void *src, size_t size, CUstream stream)
{
	struct cuda_state *s = state;
	struct cu_scope sc = dev_enter(s, dev);

	return IN_SCOPE(s, sc, s->fn.MemcpyHtoDAsync((CUdeviceptr)dst, src, size, stream));
}

static int cuda_stream_sync(void *state, int dev, CUstream stream)
{
	struct cuda_state *s = state;
	struct cu_scope sc = dev_enter(s, dev);

	return IN_SCOPE(s, sc, s->fn.StreamSynchronize(stream));
}

static int cuda_capture_id(void *state, int dev, CUstream stream, uint64_t *id)
{
	struct cuda_state *s = state;
	/* Legal in every capture mode, and asked on every stream-ordered malloc and free: no exchange of the
	 * thread's capture mode. */
	struct cu_scope sc = dev_enter_mode(s, dev, false);
	CUstreamCaptureStatus st = CU_STREAM_CAPTURE_STATUS_NONE;
	cuuint64_t cid = 0;
	CUresult r = IN_SCOPE(s, sc, s->fn.StreamGetCaptureInfo(stream, &st, &cid, NULL, NULL, NULL));

	if (r == CUDA_SUCCESS)
		*id = st == CU_STREAM_CAPTURE_STATUS_NONE ? 0 : (uint64_t)cid;
	/* A capture invalidated by someone else still has an id; its graph will never exist. */
	return r;
}

const struct cvm_backend cvm_backend_cuda = {
	.name = "cuda",
	.kind = CUVMM_BACKEND_CUDA,
	.open = cuda_open,
	.close = cuda_close,
	.device_count = cuda_device_count,
	.device_open = cuda_device_open,
	.device_close = cuda_device_close,
	.reserve = cuda_reserve,
	.unreserve = cuda_unreserve,
	.create = cuda_create,
	.release = cuda_release,
	.map = cuda_map,
	.unmap = cuda_unmap,
	.set_access = cuda_set_access,
	.can_access_peer = cuda_can_access_peer,
	.event_create = cuda_event_create,
	.event_destroy = cuda_event_destroy,
	.event_record = cuda_event_record,
	.event_query = cuda_event_query,
	.event_sync = cuda_event_sync,
	.device_sync = cuda_device_sync,
	.stream_wait = cuda_stream_wait,
	.copy_dtoh = cuda_copy_dtoh,
	.copy_htod = cuda_copy_htod,
	.stream_sync = cuda_stream_sync,
	.capture_id = cuda_capture_id,
	.host_register = cuda_host_register,
	.host_unregister = cuda_host_unregister,
};
