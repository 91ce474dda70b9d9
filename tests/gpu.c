/*
 * GPU helpers of the unit tests; see gpu.h. Entry points are taken with dlsym under their versioned names
 * (cuMemAlloc_v2, ...), the ones cuda.h's macros would pick.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "gpu.h"

#define TG_BLOCK 256
#define TG_MAX_GRID 4096

static struct {
	void *lib;
	CUcontext ctx;
	CUmodule mod;
	CUfunction fill, check;
	int status; /* 0 ok, -1 unusable */
	CUresult (*Init)(unsigned int);
	CUresult (*DeviceGet)(CUdevice *, int);
	CUresult (*DevicePrimaryCtxRetain)(CUcontext *, CUdevice);
	CUresult (*CtxSetCurrent)(CUcontext);
	CUresult (*CtxGetCurrent)(CUcontext *);
	CUresult (*CtxSynchronize)(void);
	CUresult (*StreamCreate)(CUstream *, unsigned int);
	CUresult (*StreamDestroy)(CUstream);
	CUresult (*StreamSynchronize)(CUstream);
	CUresult (*StreamQuery)(CUstream);
	CUresult (*ModuleLoadData)(CUmodule *, const void *);
	CUresult (*ModuleGetFunction)(CUfunction *, CUmodule, const char *);
	CUresult (*LaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
				 CUstream, void **, void **);
	CUresult (*MemAlloc)(CUdeviceptr *, size_t);
	CUresult (*MemFree)(CUdeviceptr);
	CUresult (*MemcpyDtoH)(void *, CUdeviceptr, size_t);
	CUresult (*MemcpyHtoD)(CUdeviceptr, const void *, size_t);
	CUresult (*MemsetD32Async)(CUdeviceptr, unsigned int, size_t, CUstream);
	CUresult (*GetErrorName)(CUresult, const char **);
	CUresult (*StreamBeginCapture)(CUstream, CUstreamCaptureMode);
	CUresult (*StreamEndCapture)(CUstream, CUgraph *);
	CUresult (*GraphInstantiate)(CUgraphExec *, CUgraph, unsigned long long);
	CUresult (*GraphLaunch)(CUgraphExec, CUstream);
	CUresult (*GraphExecDestroy)(CUgraphExec);
	CUresult (*GraphDestroy)(CUgraph);
} g;

static pthread_once_t once = PTHREAD_ONCE_INIT;

static int sym(void *slot, const char *name)
{
	void *p = dlsym(g.lib, name);

	if (!p) {
		fprintf(stderr, "gpu: libcuda.so.1 lacks %s\n", name);
		return -1;
	}
	memcpy(slot, &p, sizeof(p));
	return 0;
}

static void load(void)
{
	CUdevice dev;
	CUresult r;
	int bad = 0;

	g.status = -1;
	g.lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
	if (!g.lib) {
		fprintf(stderr, "gpu: cannot load libcuda.so.1: %s\n", dlerror());
		return;
	}
	bad |= sym(&g.Init, "cuInit");
	bad |= sym(&g.DeviceGet, "cuDeviceGet");
	bad |= sym(&g.DevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
	bad |= sym(&g.CtxSetCurrent, "cuCtxSetCurrent");
	bad |= sym(&g.CtxGetCurrent, "cuCtxGetCurrent");
	bad |= sym(&g.CtxSynchronize, "cuCtxSynchronize");
	bad |= sym(&g.StreamCreate, "cuStreamCreate");
	bad |= sym(&g.StreamDestroy, "cuStreamDestroy_v2");
	bad |= sym(&g.StreamSynchronize, "cuStreamSynchronize");
	bad |= sym(&g.StreamQuery, "cuStreamQuery");
	bad |= sym(&g.ModuleLoadData, "cuModuleLoadData");
	bad |= sym(&g.ModuleGetFunction, "cuModuleGetFunction");
	bad |= sym(&g.LaunchKernel, "cuLaunchKernel");
	bad |= sym(&g.MemAlloc, "cuMemAlloc_v2");
	bad |= sym(&g.MemFree, "cuMemFree_v2");
	bad |= sym(&g.MemcpyDtoH, "cuMemcpyDtoH_v2");
	bad |= sym(&g.MemcpyHtoD, "cuMemcpyHtoD_v2");
	bad |= sym(&g.MemsetD32Async, "cuMemsetD32Async");
	bad |= sym(&g.GetErrorName, "cuGetErrorName");
	bad |= sym(&g.StreamBeginCapture, "cuStreamBeginCapture_v2");
	bad |= sym(&g.StreamEndCapture, "cuStreamEndCapture");
	bad |= sym(&g.GraphInstantiate, "cuGraphInstantiateWithFlags");
	bad |= sym(&g.GraphLaunch, "cuGraphLaunch");
	bad |= sym(&g.GraphExecDestroy, "cuGraphExecDestroy");
	bad |= sym(&g.GraphDestroy, "cuGraphDestroy");
	if (bad)
		return;
	if ((r = g.Init(0)) != CUDA_SUCCESS || (r = g.DeviceGet(&dev, 0)) != CUDA_SUCCESS ||
	    (r = g.DevicePrimaryCtxRetain(&g.ctx, dev)) != CUDA_SUCCESS || (r = g.CtxSetCurrent(g.ctx)) != CUDA_SUCCESS) {
		fprintf(stderr, "gpu: no usable device 0 (CUresult %d)\n", (int)r);
		return;
	}
	if ((r = g.ModuleLoadData(&g.mod, tg_kernels_ptx)) != CUDA_SUCCESS ||
	    (r = g.ModuleGetFunction(&g.fill, g.mod, "fill")) != CUDA_SUCCESS ||
	    (r = g.ModuleGetFunction(&g.check, g.mod, "check")) != CUDA_SUCCESS) {
		fprintf(stderr, "gpu: cannot load the test kernels (CUresult %d)\n", (int)r);
		return;
	}
	g.status = 0;
}

/* Make the primary context current on this thread: the first call loads everything. */
static int enter(void)
{
	CUcontext cur = NULL;

	pthread_once(&once, load);
	if (g.status)
		return CUDA_ERROR_NOT_INITIALIZED;
	if (g.CtxGetCurrent(&cur) == CUDA_SUCCESS && cur == g.ctx)
		return CUDA_SUCCESS;
	return g.CtxSetCurrent(g.ctx);
}

int tg_init(void)
{
	return enter() == CUDA_SUCCESS ? 0 : -1;
}

int tg_stream_create(CUstream *stream)
{
	int r = enter();

	return r ? r : (int)g.StreamCreate(stream, CU_STREAM_NON_BLOCKING);
}

int tg_stream_destroy(CUstream stream)
{
	int r = enter();

	return r ? r : (int)g.StreamDestroy(stream);
}

int tg_stream_sync(CUstream stream)
{
	int r = enter();

	return r ? r : (int)g.StreamSynchronize(stream);
}

int tg_stream_query(CUstream stream)
{
	int r = enter();

	return r ? r : (int)g.StreamQuery(stream);
}

int tg_capture_begin(CUstream stream)
{
	int r = enter();

	return r ? r : (int)g.StreamBeginCapture(stream, CU_STREAM_CAPTURE_MODE_GLOBAL);
}

int tg_capture_end(CUstream stream, CUgraphExec *exec)
{
	CUgraph graph = NULL;
	int r = enter();

	if (r)
		return r;
	r = (int)g.StreamEndCapture(stream, &graph);
	if (r)
		return r;
	r = (int)g.GraphInstantiate(exec, graph, 0);
	g.GraphDestroy(graph);
	return r;
}

int tg_graph_launch(CUgraphExec exec, CUstream stream)
{
	int r = enter();

	return r ? r : (int)g.GraphLaunch(exec, stream);
}

int tg_graph_destroy(CUgraphExec exec)
{
	int r = enter();

	return r ? r : (int)g.GraphExecDestroy(exec);
}

int tg_ctx_sync(void)
{
	int r = enter();

	return r ? r : (int)g.CtxSynchronize();
}

static unsigned grid_for(size_t n)
{
	size_t blocks = (n + TG_BLOCK - 1) / TG_BLOCK;

	return blocks == 0 ? 1 : blocks > TG_MAX_GRID ? TG_MAX_GRID : (unsigned)blocks;
}

int tg_fill(CUdeviceptr p, size_t n, uint32_t v, int iters, CUstream stream)
{
	void *args[] = {&p, &n, &v, &iters};
	int r = enter();

	return r ? r : (int)g.LaunchKernel(g.fill, grid_for(n), 1, 1, TG_BLOCK, 1, 1, 0, stream, args, NULL);
}

int tg_check(CUdeviceptr p, size_t n, uint32_t v, CUstream stream, uint64_t *bad)
{
	CUdeviceptr counter = 0;
	unsigned long long host = 0;
	void *args[] = {&p, &n, &v, &counter};
	int r = enter();

	if (r)
		return r;
	r = g.MemAlloc(&counter, sizeof(host));
	if (r)
		return r;
	r = g.MemsetD32Async(counter, 0, sizeof(host) / 4, stream);
	if (!r)
		r = g.LaunchKernel(g.check, grid_for(n), 1, 1, TG_BLOCK, 1, 1, 0, stream, args, NULL);
	if (!r)
		r = g.StreamSynchronize(stream);
	if (!r)
		r = g.MemcpyDtoH(&host, counter, sizeof(host));
	g.MemFree(counter);
	if (!r)
		*bad = host;
	return r;
}

int tg_memcpy_dtoh(void *dst, CUdeviceptr src, size_t bytes)
{
	int r = enter();

	return r ? r : (int)g.MemcpyDtoH(dst, src, bytes);
}

int tg_memcpy_htod(CUdeviceptr dst, const void *src, size_t bytes)
{
	int r = enter();

	return r ? r : (int)g.MemcpyHtoD(dst, src, bytes);
}

const char *tg_error_name(int cu)
{
	const char *s = NULL;

	if (g.GetErrorName && g.GetErrorName((CUresult)cu, &s) == CUDA_SUCCESS && s)
		return s;
	return "CUDA_ERROR_?";
}
