/*
 * Helpers shared by the examples; see example_util.h. Nothing here is part of cuvmm.
 *
 * The CUDA driver is loaded with dlopen and its entry points taken with dlsym under their versioned names
 * (cuMemAlloc_v2, ...), the ones cuda.h's macros would pick, so the examples build and run (on the host
 * backend) on machines without CUDA. The two kernels come from this CUDA source, compiled to PTX and
 * embedded below as ex_kernels_ptx; the driver JIT-compiles compute_80 PTX for the GPU at hand (sm_80 and
 * newer). After editing the kernels, regenerate the string from the repository root with
 *   sed -n '/^ \* ----- kernels/,/^ \* ----- end of kernels/p' examples/example_util.c |
 *     sed -e '1d;$d' -e 's/^ [*]//' -e 's/^ //' > /tmp/k.cu &&
 *   nvcc -ptx -arch=compute_80 /tmp/k.cu -o - | sed 's/\\/\\\\/g; s/"/\\"/g; s/^/\t"/; s/$/\\n"/'
 * and paste its output over the string at the end of this file.
 *
 * ----- kernels (CUDA source of ex_kernels_ptx) -----
 * #include <stddef.h>
 * #include <stdint.h>
 *
 * __device__ __forceinline__ unsigned long long ex_mix64(unsigned long long z)
 * {
 * 	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
 * 	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
 * 	return z ^ (z >> 31);
 * }
 *
 * extern "C" __global__ void ex_fill(uint32_t *p, size_t n, unsigned long long seed)
 * {
 * 	size_t stride = (size_t)gridDim.x * blockDim.x;
 *
 * 	for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
 * 		p[i] = (uint32_t)ex_mix64(seed + i * 0x9e3779b97f4a7c15ull);
 * }
 *
 * extern "C" __global__ void ex_checksum(const uint32_t *p, size_t n, unsigned long long salt,
 * 				       unsigned long long *sum)
 * {
 * 	size_t stride = (size_t)gridDim.x * blockDim.x;
 * 	unsigned long long s = 0;
 *
 * 	for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
 * 		s += ex_mix64(((unsigned long long)p[i] << 32 | (uint32_t)i) ^ salt);
 * 	for (int o = 16; o > 0; o >>= 1)
 * 		s += __shfl_down_sync(0xffffffffu, s, o);
 * 	if ((threadIdx.x & 31) == 0 && s)
 * 		atomicAdd(sum, s);
 * }
 * ----- end of kernels -----
 */
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <string.h>
#include <time.h>

#include "example_util.h"

/* ----- backend choice ----- */

/* The library's errors only, to stderr as its default sink writes them: for the GPU probe below, whose
 * warning that the CUDA backend is unavailable the example answers itself. */
static void errors_only(enum cuvmm_log_level level, const char *msg, void *user)
{
	(void)level;
	(void)user;
	fprintf(stderr, "cuvmm: error: %s\n", msg);
}

bool ex_ctx_create(struct cuvmm_config *cfg, struct cuvmm_ctx **ctx, const char *example)
{
	bool forced = getenv("CUVMM_BACKEND") != NULL, quiet = !forced && !getenv("CUVMM_LOG");
	int err;

	/* Without CUVMM_BACKEND, ask for the GPU: the AUTO backend never falls back to the host by itself, so
	 * we do it here, and say so (the library's own warning about it is left out unless CUVMM_LOG asks). */
	if (!forced)
		cfg->backend = CUVMM_BACKEND_CUDA;
	if (quiet)
		cuvmm_set_log_callback(errors_only, NULL, CUVMM_LOG_ERROR);
	err = cuvmm_ctx_create(cfg, ctx);
	if (quiet)
		cuvmm_set_log_callback(NULL, NULL, CUVMM_LOG_WARN);
	if ((err == CUVMM_ENODRIVER || err == CUVMM_ENODEV) && !forced) {
		printf("%s: no GPU found (%s; CUVMM_LOG=info says why): running on the host backend (host memory "
		       "with the same semantics)\n", example, cuvmm_strerror(err));
		cfg->backend = CUVMM_BACKEND_HOST;
		err = cuvmm_ctx_create(cfg, ctx);
	}
	if (err) {
		fprintf(stderr, "%s: cuvmm_ctx_create failed: %s (%s)\n", example, cuvmm_strerror(err),
			cuvmm_err_name(err));
		exit(1);
	}
	if (cuvmm_ctx_backend(*ctx) == CUVMM_BACKEND_HOST) {
		printf("%s: cuvmm %s on the host backend\n", example, cuvmm_version());
		return true;
	}
	if (ex_cu_init() != 0) {
		fprintf(stderr, "%s: cuvmm runs on the GPU but the example's driver helpers could not load\n",
			example);
		exit(1);
	}
	printf("%s: cuvmm %s on the CUDA backend (GPU 0)\n", example, cuvmm_version());
	return false;
}

/* ----- small things ----- */

double ex_now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

void ex_sleep_ms(double ms)
{
	struct timespec ts;

	if (ms <= 0)
		return;
	ts.tv_sec = (time_t)(ms / 1e3);
	ts.tv_nsec = (long)((ms - ts.tv_sec * 1e3) * 1e6);
	while (nanosleep(&ts, &ts) && errno == EINTR)
		;
}

uint64_t ex_host_mem_available(void)
{
	FILE *f = fopen("/proc/meminfo", "r");
	char line[256];
	unsigned long long kib = 0;

	if (!f)
		return 0;
	while (fgets(line, sizeof(line), f))
		if (sscanf(line, "MemAvailable: %llu kB", &kib) == 1)
			break;
	fclose(f);
	return (uint64_t)kib * 1024;
}

size_t ex_granularity(struct cuvmm_ctx *ctx)
{
	struct cuvmm_region *probe;
	size_t g;

	/* Pools and KV objects map in units of the device's granularity, which a region reports: reserve one
	 * granule of address space (no physical memory) just to ask. */
	CHECK(cuvmm_region_create(ctx, 0, 1, &probe));
	g = cuvmm_region_granularity(probe);
	cuvmm_region_destroy(probe);
	return g;
}

void ex_fill_host(void *p, size_t n, uint64_t seed)
{
	uint32_t *w = p;

	for (size_t i = 0; i < n; i++)
		w[i] = (uint32_t)ex_mix64(seed + i * 0x9e3779b97f4a7c15ull);
}

void ex_checksum_host(const void *p, size_t n, uint64_t salt, uint64_t *sum)
{
	const uint32_t *w = p;
	uint64_t s = 0;

	for (size_t i = 0; i < n; i++)
		s += ex_mix64(((uint64_t)w[i] << 32 | (uint32_t)i) ^ salt);
	*sum += s;
}

/* ----- the CUDA driver, loaded at run time ----- */

#define EX_BLOCK 256
#define EX_MAX_GRID 4096

extern const char ex_kernels_ptx[];

static struct {
	void *lib;
	CUcontext ctx;
	CUmodule mod;
	CUfunction fill, checksum;
	int status; /* 0 usable, else the CUresult (or -1) that stopped the load */
	CUresult (*Init)(unsigned int);
	CUresult (*DeviceGet)(CUdevice *, int);
	CUresult (*DevicePrimaryCtxRetain)(CUcontext *, CUdevice);
	CUresult (*CtxSetCurrent)(CUcontext);
	CUresult (*CtxGetCurrent)(CUcontext *);
	CUresult (*MemGetInfo)(size_t *, size_t *);
	CUresult (*StreamCreate)(CUstream *, unsigned int);
	CUresult (*StreamDestroy)(CUstream);
	CUresult (*StreamSynchronize)(CUstream);
	CUresult (*ModuleLoadData)(CUmodule *, const void *);
	CUresult (*ModuleGetFunction)(CUfunction *, CUmodule, const char *);
	CUresult (*LaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
				 CUstream, void **, void **);
	CUresult (*MemAlloc)(CUdeviceptr *, size_t);
	CUresult (*MemFree)(CUdeviceptr);
	CUresult (*MemHostAlloc)(void **, size_t, unsigned int);
	CUresult (*MemFreeHost)(void *);
	CUresult (*MemcpyDtoH)(void *, CUdeviceptr, size_t);
	CUresult (*MemcpyHtoD)(CUdeviceptr, const void *, size_t);
	CUresult (*MemcpyDtoDAsync)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
	CUresult (*MemsetD32Async)(CUdeviceptr, unsigned int, size_t, CUstream);
	CUresult (*StreamBeginCapture)(CUstream, CUstreamCaptureMode);
	CUresult (*StreamEndCapture)(CUstream, CUgraph *);
	CUresult (*GraphInstantiate)(CUgraphExec *, CUgraph, unsigned long long);
	CUresult (*GraphLaunch)(CUgraphExec, CUstream);
	CUresult (*GraphExecDestroy)(CUgraphExec);
	CUresult (*GraphDestroy)(CUgraph);
	CUresult (*GetErrorName)(CUresult, const char **);
} g;

static pthread_once_t once = PTHREAD_ONCE_INIT;

/* Devices other than 0 (ex_cu_use_device): their primary context and kernels, loaded on first use. */
#define EX_MAX_DEVICES 16
static struct {
	CUcontext ctx;
	CUfunction fill, checksum;
} gd[EX_MAX_DEVICES];
static pthread_mutex_t gd_lock = PTHREAD_MUTEX_INITIALIZER;
static _Thread_local int cur_dev;

static int sym(void *slot, const char *name)
{
	void *p = dlsym(g.lib, name);

	if (!p) {
		fprintf(stderr, "libcuda.so.1 lacks %s\n", name);
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
		fprintf(stderr, "cannot load libcuda.so.1: %s\n", dlerror());
		return;
	}
	bad |= sym(&g.Init, "cuInit");
	bad |= sym(&g.DeviceGet, "cuDeviceGet");
	bad |= sym(&g.DevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
	bad |= sym(&g.CtxSetCurrent, "cuCtxSetCurrent");
	bad |= sym(&g.CtxGetCurrent, "cuCtxGetCurrent");
	bad |= sym(&g.MemGetInfo, "cuMemGetInfo_v2");
	bad |= sym(&g.StreamCreate, "cuStreamCreate");
	bad |= sym(&g.StreamDestroy, "cuStreamDestroy_v2");
	bad |= sym(&g.StreamSynchronize, "cuStreamSynchronize");
	bad |= sym(&g.ModuleLoadData, "cuModuleLoadData");
	bad |= sym(&g.ModuleGetFunction, "cuModuleGetFunction");
	bad |= sym(&g.LaunchKernel, "cuLaunchKernel");
	bad |= sym(&g.MemAlloc, "cuMemAlloc_v2");
	bad |= sym(&g.MemFree, "cuMemFree_v2");
	bad |= sym(&g.MemHostAlloc, "cuMemHostAlloc");
	bad |= sym(&g.MemFreeHost, "cuMemFreeHost");
	bad |= sym(&g.MemcpyDtoH, "cuMemcpyDtoH_v2");
	bad |= sym(&g.MemcpyHtoD, "cuMemcpyHtoD_v2");
	bad |= sym(&g.MemcpyDtoDAsync, "cuMemcpyDtoDAsync_v2");
	bad |= sym(&g.MemsetD32Async, "cuMemsetD32Async");
	bad |= sym(&g.StreamBeginCapture, "cuStreamBeginCapture_v2");
	bad |= sym(&g.StreamEndCapture, "cuStreamEndCapture");
	bad |= sym(&g.GraphInstantiate, "cuGraphInstantiateWithFlags");
	bad |= sym(&g.GraphLaunch, "cuGraphLaunch");
	bad |= sym(&g.GraphExecDestroy, "cuGraphExecDestroy");
	bad |= sym(&g.GraphDestroy, "cuGraphDestroy");
	bad |= sym(&g.GetErrorName, "cuGetErrorName");
	if (bad)
		return;
	if ((r = g.Init(0)) != CUDA_SUCCESS || (r = g.DeviceGet(&dev, 0)) != CUDA_SUCCESS ||
	    (r = g.DevicePrimaryCtxRetain(&g.ctx, dev)) != CUDA_SUCCESS || (r = g.CtxSetCurrent(g.ctx)) != CUDA_SUCCESS) {
		fprintf(stderr, "no usable GPU 0: %s\n", ex_cu_error_name(r));
		g.status = r;
		return;
	}
	if ((r = g.ModuleLoadData(&g.mod, ex_kernels_ptx)) != CUDA_SUCCESS ||
	    (r = g.ModuleGetFunction(&g.fill, g.mod, "ex_fill")) != CUDA_SUCCESS ||
	    (r = g.ModuleGetFunction(&g.checksum, g.mod, "ex_checksum")) != CUDA_SUCCESS) {
		fprintf(stderr, "cannot load the example kernels: %s\n", ex_cu_error_name(r));
		g.status = r;
		return;
	}
	g.status = 0;
}

/* Device cur_dev's context and kernels, loaded on first use (device 0's by load()). */
static int load_dev(void)
{
	CUmodule mod;
	CUdevice dev;
	CUresult r = CUDA_SUCCESS;

	if (cur_dev == 0) {
		gd[0].ctx = g.ctx;
		gd[0].fill = g.fill;
		gd[0].checksum = g.checksum;
		return 0;
	}
	pthread_mutex_lock(&gd_lock);
	if (!gd[cur_dev].ctx) {
		CUcontext ctx = NULL;

		if ((r = g.DeviceGet(&dev, cur_dev)) == CUDA_SUCCESS &&
		    (r = g.DevicePrimaryCtxRetain(&ctx, dev)) == CUDA_SUCCESS &&
		    (r = g.CtxSetCurrent(ctx)) == CUDA_SUCCESS && (r = g.ModuleLoadData(&mod, ex_kernels_ptx)) == CUDA_SUCCESS &&
		    (r = g.ModuleGetFunction(&gd[cur_dev].fill, mod, "ex_fill")) == CUDA_SUCCESS &&
		    (r = g.ModuleGetFunction(&gd[cur_dev].checksum, mod, "ex_checksum")) == CUDA_SUCCESS)
			gd[cur_dev].ctx = ctx;
	}
	pthread_mutex_unlock(&gd_lock);
	return r;
}

/* Load on first use, then make the current device's primary context current on this thread. */
static int enter(void)
{
	CUcontext cur = NULL;
	int r;

	pthread_once(&once, load);
	if (g.status)
		return g.status;
	if (!gd[cur_dev].ctx && (r = load_dev()) != 0)
		return r;
	if (g.CtxGetCurrent(&cur) == CUDA_SUCCESS && cur == gd[cur_dev].ctx)
		return CUDA_SUCCESS;
	return g.CtxSetCurrent(gd[cur_dev].ctx);
}

int ex_cu_use_device(int dev)
{
	if (dev < 0 || dev >= EX_MAX_DEVICES)
		return CUDA_ERROR_INVALID_DEVICE;
	cur_dev = dev;
	return enter();
}

#define DP(p) ((CUdeviceptr)(uintptr_t)(p))
#define ENTER()                                                                                              \
	do {                                                                                                 \
		int r_ = enter();                                                                            \
		if (r_)                                                                                      \
			return r_;                                                                           \
	} while (0)

int ex_cu_init(void)
{
	return enter();
}

const char *ex_cu_error_name(int cu)
{
	const char *s = NULL;

	if (cu == -1)
		return "no CUDA driver";
	if (g.GetErrorName && g.GetErrorName((CUresult)cu, &s) == CUDA_SUCCESS && s)
		return s;
	return "CUDA_ERROR_?";
}

int ex_cu_mem_info(size_t *free_bytes, size_t *total_bytes)
{
	ENTER();
	return g.MemGetInfo(free_bytes, total_bytes);
}

int ex_cu_stream_create(CUstream *stream)
{
	ENTER();
	return g.StreamCreate(stream, CU_STREAM_NON_BLOCKING);
}

int ex_cu_stream_destroy(CUstream stream)
{
	ENTER();
	return g.StreamDestroy(stream);
}

int ex_cu_stream_sync(CUstream stream)
{
	ENTER();
	return g.StreamSynchronize(stream);
}

int ex_cu_malloc(void **p, size_t bytes)
{
	CUdeviceptr d;
	int r;

	ENTER();
	r = g.MemAlloc(&d, bytes);
	if (!r)
		*p = (void *)(uintptr_t)d;
	return r;
}

int ex_cu_free(void *p)
{
	ENTER();
	return g.MemFree(DP(p));
}

int ex_cu_host_alloc(void **p, size_t bytes)
{
	ENTER();
	return g.MemHostAlloc(p, bytes, 0);
}

int ex_cu_host_free(void *p)
{
	ENTER();
	return g.MemFreeHost(p);
}

int ex_cu_memcpy_dtoh(void *dst, const void *src, size_t bytes)
{
	ENTER();
	return g.MemcpyDtoH(dst, DP(src), bytes);
}

int ex_cu_memcpy_htod(void *dst, const void *src, size_t bytes)
{
	ENTER();
	return g.MemcpyHtoD(DP(dst), src, bytes);
}

int ex_cu_memcpy_dtod_async(void *dst, const void *src, size_t bytes, CUstream stream)
{
	ENTER();
	return g.MemcpyDtoDAsync(DP(dst), DP(src), bytes, stream);
}

int ex_cu_memset32_async(void *p, uint32_t v, size_t words, CUstream stream)
{
	ENTER();
	return g.MemsetD32Async(DP(p), v, words, stream);
}

static unsigned grid_for(size_t n)
{
	size_t blocks = (n + EX_BLOCK - 1) / EX_BLOCK;

	return blocks == 0 ? 1 : blocks > EX_MAX_GRID ? EX_MAX_GRID : (unsigned)blocks;
}

int ex_cu_fill(void *p, size_t n, uint64_t seed, CUstream stream)
{
	CUdeviceptr d = DP(p);
	unsigned long long s = seed;
	void *args[] = {&d, &n, &s};

	ENTER();
	return g.LaunchKernel(gd[cur_dev].fill, grid_for(n), 1, 1, EX_BLOCK, 1, 1, 0, stream, args, NULL);
}

int ex_cu_checksum(const void *p, size_t n, uint64_t salt, uint64_t *sum, CUstream stream)
{
	CUdeviceptr d = DP(p), out = DP(sum);
	unsigned long long s = salt;
	void *args[] = {&d, &n, &s, &out};

	ENTER();
	return g.LaunchKernel(gd[cur_dev].checksum, grid_for(n), 1, 1, EX_BLOCK, 1, 1, 0, stream, args, NULL);
}

int ex_cu_capture_begin(CUstream stream)
{
	ENTER();
	/* THREAD_LOCAL: only this thread's capture-unsafe calls are affected; cuvmm's background thread is
	 * not this thread's business. */
	return g.StreamBeginCapture(stream, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL);
}

int ex_cu_capture_end(CUstream stream, CUgraphExec *exec)
{
	CUgraph graph;
	int r;

	ENTER();
	r = g.StreamEndCapture(stream, &graph);
	if (r)
		return r;
	r = g.GraphInstantiate(exec, graph, 0);
	g.GraphDestroy(graph); /* the executable graph keeps what it needs */
	return r;
}

int ex_cu_graph_launch(CUgraphExec exec, CUstream stream)
{
	ENTER();
	return g.GraphLaunch(exec, stream);
}

int ex_cu_graph_destroy(CUgraphExec exec)
{
	ENTER();
	return g.GraphExecDestroy(exec);
}

/* ----- the PTX of the kernels at the top (generated; see there) ----- */

const char ex_kernels_ptx[] =
	"//\n"
	"// Generated by NVIDIA NVVM Compiler\n"
	"//\n"
	"// Compiler Build ID: CL-36424714\n"
	"// Cuda compilation tools, release 13.0, V13.0.88\n"
	"// Based on NVVM 7.0.1\n"
	"//\n"
	"\n"
	".version 9.0\n"
	".target sm_80\n"
	".address_size 64\n"
	"\n"
	"	// .globl	ex_fill\n"
	"\n"
	".visible .entry ex_fill(\n"
	"	.param .u64 ex_fill_param_0,\n"
	"	.param .u64 ex_fill_param_1,\n"
	"	.param .u64 ex_fill_param_2\n"
	")\n"
	"{\n"
	"	.reg .pred 	%p<3>;\n"
	"	.reg .b32 	%r<5>;\n"
	"	.reg .b64 	%rd<26>;\n"
	"\n"
	"\n"
	"	ld.param.u64 	%rd7, [ex_fill_param_0];\n"
	"	ld.param.u64 	%rd8, [ex_fill_param_1];\n"
	"	ld.param.u64 	%rd9, [ex_fill_param_2];\n"
	"	mov.u32 	%r1, %ntid.x;\n"
	"	cvt.u64.u32 	%rd1, %r1;\n"
	"	mov.u32 	%r2, %ctaid.x;\n"
	"	mul.wide.u32 	%rd10, %r2, %r1;\n"
	"	mov.u32 	%r3, %tid.x;\n"
	"	cvt.u64.u32 	%rd11, %r3;\n"
	"	add.s64 	%rd25, %rd10, %rd11;\n"
	"	setp.ge.u64 	%p1, %rd25, %rd8;\n"
	"	@%p1 bra 	$L__BB0_3;\n"
	"\n"
	"	mov.u32 	%r4, %nctaid.x;\n"
	"	cvt.u64.u32 	%rd12, %r4;\n"
	"	mul.lo.s64 	%rd3, %rd12, %rd1;\n"
	"	cvta.to.global.u64 	%rd4, %rd7;\n"
	"\n"
	"$L__BB0_2:\n"
	"	mul.lo.s64 	%rd13, %rd25, -7046029254386353131;\n"
	"	add.s64 	%rd14, %rd13, %rd9;\n"
	"	shr.u64 	%rd15, %rd14, 30;\n"
	"	xor.b64  	%rd16, %rd15, %rd14;\n"
	"	mul.lo.s64 	%rd17, %rd16, -4658895280553007687;\n"
	"	shr.u64 	%rd18, %rd17, 27;\n"
	"	xor.b64  	%rd19, %rd18, %rd17;\n"
	"	mul.lo.s64 	%rd20, %rd19, -7723592293110705685;\n"
	"	shr.u64 	%rd21, %rd20, 31;\n"
	"	xor.b64  	%rd22, %rd21, %rd20;\n"
	"	shl.b64 	%rd23, %rd25, 2;\n"
	"	add.s64 	%rd24, %rd4, %rd23;\n"
	"	st.global.u32 	[%rd24], %rd22;\n"
	"	add.s64 	%rd25, %rd25, %rd3;\n"
	"	setp.lt.u64 	%p2, %rd25, %rd8;\n"
	"	@%p2 bra 	$L__BB0_2;\n"
	"\n"
	"$L__BB0_3:\n"
	"	ret;\n"
	"\n"
	"}\n"
	"	// .globl	ex_checksum\n"
	".visible .entry ex_checksum(\n"
	"	.param .u64 ex_checksum_param_0,\n"
	"	.param .u64 ex_checksum_param_1,\n"
	"	.param .u64 ex_checksum_param_2,\n"
	"	.param .u64 ex_checksum_param_3\n"
	")\n"
	"{\n"
	"	.reg .pred 	%p<16>;\n"
	"	.reg .b32 	%r<37>;\n"
	"	.reg .b64 	%rd<52>;\n"
	"\n"
	"\n"
	"	ld.param.u64 	%rd11, [ex_checksum_param_0];\n"
	"	ld.param.u64 	%rd12, [ex_checksum_param_1];\n"
	"	ld.param.u64 	%rd13, [ex_checksum_param_2];\n"
	"	ld.param.u64 	%rd14, [ex_checksum_param_3];\n"
	"	mov.u32 	%r1, %ntid.x;\n"
	"	cvt.u64.u32 	%rd1, %r1;\n"
	"	mov.u32 	%r2, %ctaid.x;\n"
	"	mul.wide.u32 	%rd16, %r2, %r1;\n"
	"	mov.u32 	%r3, %tid.x;\n"
	"	cvt.u64.u32 	%rd17, %r3;\n"
	"	add.s64 	%rd49, %rd16, %rd17;\n"
	"	setp.ge.u64 	%p1, %rd49, %rd12;\n"
	"	mov.u64 	%rd51, 0;\n"
	"	@%p1 bra 	$L__BB1_3;\n"
	"\n"
	"	mov.u32 	%r7, %nctaid.x;\n"
	"	cvt.u64.u32 	%rd22, %r7;\n"
	"	mul.lo.s64 	%rd3, %rd22, %rd1;\n"
	"	cvta.to.global.u64 	%rd4, %rd11;\n"
	"	mov.u64 	%rd51, 0;\n"
	"\n"
	"$L__BB1_2:\n"
	"	shl.b64 	%rd23, %rd49, 2;\n"
	"	add.s64 	%rd24, %rd4, %rd23;\n"
	"	ld.global.u32 	%rd25, [%rd24];\n"
	"	and.b64  	%rd26, %rd49, 4294967295;\n"
	"	bfi.b64 	%rd27, %rd25, %rd26, 32, 32;\n"
	"	xor.b64  	%rd28, %rd27, %rd13;\n"
	"	shr.u64 	%rd29, %rd28, 30;\n"
	"	xor.b64  	%rd30, %rd29, %rd28;\n"
	"	mul.lo.s64 	%rd31, %rd30, -4658895280553007687;\n"
	"	shr.u64 	%rd32, %rd31, 27;\n"
	"	xor.b64  	%rd33, %rd32, %rd31;\n"
	"	mul.lo.s64 	%rd34, %rd33, -7723592293110705685;\n"
	"	shr.u64 	%rd35, %rd34, 31;\n"
	"	xor.b64  	%rd36, %rd35, %rd34;\n"
	"	add.s64 	%rd51, %rd36, %rd51;\n"
	"	add.s64 	%rd49, %rd49, %rd3;\n"
	"	setp.lt.u64 	%p2, %rd49, %rd12;\n"
	"	@%p2 bra 	$L__BB1_2;\n"
	"\n"
	"$L__BB1_3:\n"
	"	// begin inline asm\n"
	"	mov.b64 {%r8,%r9}, %rd51;\n"
	"	// end inline asm\n"
	"	mov.u32 	%r28, 2;\n"
	"	mov.u32 	%r29, 31;\n"
	"	mov.u32 	%r30, 16;\n"
	"	mov.u32 	%r31, -1;\n"
	"	shfl.sync.down.b32 	%r11|%p3, %r9, %r30, %r29, %r31;\n"
	"	shfl.sync.down.b32 	%r10|%p4, %r8, %r30, %r29, %r31;\n"
	"	// begin inline asm\n"
	"	mov.b64 %rd38, {%r10,%r11};\n"
	"	// end inline asm\n"
	"	add.s64 	%rd39, %rd38, %rd51;\n"
	"	// begin inline asm\n"
	"	mov.b64 {%r12,%r13}, %rd39;\n"
	"	// end inline asm\n"
	"	mov.u32 	%r32, 8;\n"
	"	shfl.sync.down.b32 	%r15|%p5, %r13, %r32, %r29, %r31;\n"
	"	shfl.sync.down.b32 	%r14|%p6, %r12, %r32, %r29, %r31;\n"
	"	// begin inline asm\n"
	"	mov.b64 %rd40, {%r14,%r15};\n"
	"	// end inline asm\n"
	"	add.s64 	%rd41, %rd40, %rd39;\n"
	"	// begin inline asm\n"
	"	mov.b64 {%r16,%r17}, %rd41;\n"
	"	// end inline asm\n"
	"	mov.u32 	%r33, 4;\n"
	"	shfl.sync.down.b32 	%r19|%p7, %r17, %r33, %r29, %r31;\n"
	"	shfl.sync.down.b32 	%r18|%p8, %r16, %r33, %r29, %r31;\n"
	"	// begin inline asm\n"
	"	mov.b64 %rd42, {%r18,%r19};\n"
	"	// end inline asm\n"
	"	add.s64 	%rd43, %rd42, %rd41;\n"
	"	// begin inline asm\n"
	"	mov.b64 {%r20,%r21}, %rd43;\n"
	"	// end inline asm\n"
	"	shfl.sync.down.b32 	%r23|%p9, %r21, %r28, %r29, %r31;\n"
	"	shfl.sync.down.b32 	%r22|%p10, %r20, %r28, %r29, %r31;\n"
	"	// begin inline asm\n"
	"	mov.b64 %rd44, {%r22,%r23};\n"
	"	// end inline asm\n"
	"	add.s64 	%rd45, %rd44, %rd43;\n"
	"	// begin inline asm\n"
	"	mov.b64 {%r24,%r25}, %rd45;\n"
	"	// end inline asm\n"
	"	mov.u32 	%r34, 1;\n"
	"	shfl.sync.down.b32 	%r27|%p11, %r25, %r34, %r29, %r31;\n"
	"	shfl.sync.down.b32 	%r26|%p12, %r24, %r34, %r29, %r31;\n"
	"	// begin inline asm\n"
	"	mov.b64 %rd46, {%r26,%r27};\n"
	"	// end inline asm\n"
	"	add.s64 	%rd10, %rd46, %rd45;\n"
	"	and.b32  	%r36, %r3, 31;\n"
	"	setp.ne.s32 	%p13, %r36, 0;\n"
	"	setp.eq.s64 	%p14, %rd10, 0;\n"
	"	or.pred  	%p15, %p13, %p14;\n"
	"	@%p15 bra 	$L__BB1_5;\n"
	"\n"
	"	cvta.to.global.u64 	%rd47, %rd14;\n"
	"	atom.global.add.u64 	%rd48, [%rd47], %rd10;\n"
	"\n"
	"$L__BB1_5:\n"
	"	ret;\n"
	"\n"
	"}\n"
	"\n"
	;
