/*
 * GPU helpers of the unit tests: the CUDA driver loaded with dlopen (the tests, like the library, have no
 * link-time dependency on libcuda), the primary context of device 0 made current, streams, copies, and the
 * kernels of tests/kernels.cu launched from their embedded PTX.
 *
 * Every function makes the primary context current on the calling thread first, so any thread may call them.
 * Functions returning int return a CUresult (0 = CUDA_SUCCESS); tg_init() returns 0 or -1.
 */
#ifndef TG_GPU_H
#define TG_GPU_H

#include <stddef.h>
#include <stdint.h>

#include <cuda.h>

/* The PTX of tests/kernels.cu (tests/kernels_ptx.c, generated). */
extern const char tg_kernels_ptx[];

/* Load the driver, retain device 0's primary context, load the kernels. Idempotent and thread-safe.
 * 0 on success; -1 (with a message on stderr) when there is no usable driver or device. */
int tg_init(void);

int tg_stream_create(CUstream *stream);
int tg_stream_destroy(CUstream stream);
int tg_stream_sync(CUstream stream);
/* CUDA_SUCCESS when the stream's work is complete, CUDA_ERROR_NOT_READY while it runs. */
int tg_stream_query(CUstream stream);
int tg_ctx_sync(void);

/* Stream capture in global mode (PyTorch's default), and the graph it gives: end instantiates it. */
int tg_capture_begin(CUstream stream);
int tg_capture_end(CUstream stream, CUgraphExec *exec);
int tg_graph_launch(CUgraphExec exec, CUstream stream);
int tg_graph_destroy(CUgraphExec exec);

/* Launch fill(p, n, v, iters) on stream (asynchronous). n counts uint32_t words. */
int tg_fill(CUdeviceptr p, size_t n, uint32_t v, int iters, CUstream stream);
/* Run check(p, n, v) on stream, wait for it and store the number of mismatching words in *bad. */
int tg_check(CUdeviceptr p, size_t n, uint32_t v, CUstream stream, uint64_t *bad);

int tg_memcpy_dtoh(void *dst, CUdeviceptr src, size_t bytes);
int tg_memcpy_htod(CUdeviceptr dst, const void *src, size_t bytes);

/* The driver's name for a CUresult ("CUDA_ERROR_ILLEGAL_ADDRESS"); never NULL. */
const char *tg_error_name(int cu);

#endif /* TG_GPU_H */
