/*
 * GPU kernels of the unit tests. Not compiled by the build: the tests embed their PTX (tests/kernels_ptx.c)
 * and load it with cuModuleLoadData, so neither nvcc nor the runtime library is needed to build or run them.
 * After editing this file, regenerate the PTX from the repository root:
 *
 *   the command at the top of tests/kernels_ptx.c (nvcc -ptx -arch=compute_80 tests/kernels.cu -o -, quoted)
 *
 * Every kernel uses a grid-stride loop, so any grid size covers any n.
 */
#include <stddef.h>
#include <stdint.h>

/*
 * The long-running writer: writes v ^ i into p[i], over the whole array, iters times. The stores are volatile
 * so the compiler keeps every pass; a kernel that is still writing when its memory is unmapped faults (and
 * kills the context), which is what the fenced-unmap tests look for.
 */
extern "C" __global__ void fill(uint32_t *p, size_t n, uint32_t v, int iters)
{
	volatile uint32_t *q = p;
	size_t stride = (size_t)gridDim.x * blockDim.x;

	for (int it = 0; it < iters; it++)
		for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
			q[i] = v ^ (uint32_t)i;
}

/* Count the words of p that do not hold what fill(p, n, v, ...) wrote. *bad must be zeroed by the caller. */
extern "C" __global__ void check(const uint32_t *p, size_t n, uint32_t v, unsigned long long *bad)
{
	size_t stride = (size_t)gridDim.x * blockDim.x;
	unsigned long long mine = 0;

	for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
		mine += p[i] != (v ^ (uint32_t)i);
	if (mine)
		atomicAdd(bad, mine);
}
