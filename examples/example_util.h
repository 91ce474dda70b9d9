/*
 * Helpers shared by the examples; nothing here is part of cuvmm.
 *
 *  - ex_ctx_create(): pick the backend the way every example does (CUVMM_BACKEND if set, else the GPU,
 *    falling back to the host backend with a message), and say which one runs.
 *  - CHECK(): stop with cuvmm_strerror() on the first failing cuvmm call; CU_CHECK() likewise for a driver
 *    call of the helpers below.
 *  - A few CUDA driver calls (copies, pinned host memory, streams, graphs, cuMemGetInfo) and two kernels,
 *    reached without linking CUDA: libcuda.so.1 is loaded with dlopen, as cuvmm itself does, and the
 *    kernels are embedded as PTX and loaded with cuModuleLoadData. An application linking the CUDA runtime
 *    would simply call cudaMemcpy, cudaStreamBeginCapture, ... and launch its own kernels.
 *  - The same two "kernels" for the host backend, as CPU loops with identical results.
 *
 * The ex_cu* functions return a CUresult (0 = CUDA_SUCCESS) and make device 0's primary context (the one
 * cuvmm uses; another device's after ex_cu_use_device) current on the calling thread first, so any thread
 * may call them.
 */
#ifndef EXAMPLE_UTIL_H
#define EXAMPLE_UTIL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <cuda.h> /* the driver helpers below use its types; cuvmm.h itself does not need it */
#include <cuvmm.h>

#define EX_MiB (1024.0 * 1024.0)
#define EX_GiB (1024.0 * 1024.0 * 1024.0)

/* Every cuvmm call returns 0 or a negative CUVMM_E* code: stop on the first failure. */
#define CHECK(call)                                                                                          \
	do {                                                                                                 \
		int err_ = (call);                                                                           \
		if (err_ != CUVMM_OK) {                                                                      \
			fprintf(stderr, "%s:%d: %s failed: %s (%s)\n", __FILE__, __LINE__, #call,            \
				cuvmm_strerror(err_), cuvmm_err_name(err_));                                 \
			exit(1);                                                                             \
		}                                                                                            \
	} while (0)

/* The same for the driver calls of the ex_cu* helpers, which return a CUresult. */
#define CU_CHECK(call)                                                                                       \
	do {                                                                                                 \
		int cu_ = (call);                                                                            \
		if (cu_ != 0) {                                                                              \
			fprintf(stderr, "%s:%d: %s failed: %s\n", __FILE__, __LINE__, #call,                 \
				ex_cu_error_name(cu_));                                                      \
			exit(1);                                                                             \
		}                                                                                            \
	} while (0)

/*
 * Create a context from cfg (already cuvmm_config_init()ed and adjusted by the caller). Without
 * CUVMM_BACKEND in the environment the GPU is asked for; if there is no driver or no device, the host
 * backend is used instead, and the example says so (the AUTO backend never falls back by itself). On the
 * CUDA backend the driver helpers below are loaded too. Prints one line naming the backend; exits on
 * failure. Returns true when running on the host backend.
 */
bool ex_ctx_create(struct cuvmm_config *cfg, struct cuvmm_ctx **ctx, const char *example);

double ex_now_ms(void);           /* monotonic clock */
void ex_sleep_ms(double ms);
uint64_t ex_host_mem_available(void); /* MemAvailable of /proc/meminfo, bytes; 0 if unknown */
size_t ex_granularity(struct cuvmm_ctx *ctx); /* the device's mapping unit (2 MiB on current GPUs) */

/* The hash behind the fill and checksum kernels (the splitmix64 finaliser), for the host versions. */
static inline uint64_t ex_mix64(uint64_t z)
{
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

/* Host versions of the kernels: fill n 32-bit words with a pattern derived from seed; add the checksum of
 * n words (salted, so equal tensors at different places differ) to *sum. */
void ex_fill_host(void *p, size_t n, uint64_t seed);
void ex_checksum_host(const void *p, size_t n, uint64_t salt, uint64_t *sum);

/* ----- CUDA driver helpers (CUDA backend only) ----- */

int ex_cu_init(void); /* 0, or a CUresult / -1 (with a message) when the driver cannot be used */
/* Make device `dev` the one the helpers of this thread use (default 0): its primary context, its kernels. */
int ex_cu_use_device(int dev);
const char *ex_cu_error_name(int cu);
int ex_cu_mem_info(size_t *free_bytes, size_t *total_bytes);
int ex_cu_stream_create(CUstream *stream); /* a non-blocking stream */
int ex_cu_stream_destroy(CUstream stream);
int ex_cu_stream_sync(CUstream stream);
int ex_cu_malloc(void **p, size_t bytes); /* cuMemAlloc, outside any cuvmm pool */
int ex_cu_free(void *p);
int ex_cu_host_alloc(void **p, size_t bytes); /* pinned host memory (cuMemHostAlloc) */
int ex_cu_host_free(void *p);
int ex_cu_memcpy_dtoh(void *dst, const void *src, size_t bytes);
int ex_cu_memcpy_htod(void *dst, const void *src, size_t bytes);
int ex_cu_memcpy_dtod_async(void *dst, const void *src, size_t bytes, CUstream stream);
int ex_cu_memset32_async(void *p, uint32_t v, size_t words, CUstream stream);
/* The kernels: as ex_fill_host and ex_checksum_host, launched on stream; *sum is device memory. */
int ex_cu_fill(void *p, size_t n, uint64_t seed, CUstream stream);
int ex_cu_checksum(const void *p, size_t n, uint64_t salt, uint64_t *sum, CUstream stream);
/* CUDA graphs: capture the work queued on stream between begin and end, then replay it. */
int ex_cu_capture_begin(CUstream stream);
int ex_cu_capture_end(CUstream stream, CUgraphExec *exec);
int ex_cu_graph_launch(CUgraphExec exec, CUstream stream);
int ex_cu_graph_destroy(CUgraphExec exec);

#endif /* EXAMPLE_UTIL_H */
