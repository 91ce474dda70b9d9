// The public header must compile from C++ (extern "C", no C-only constructs), with cuvmm's include
// directory an ordinary -I path. Built without cuda.h, with it first and with it after (tests/meson.build).
#if defined(HEADER_TEST_CUDA_FIRST)
#include <cuda.h>
#endif
#include <cuvmm.h>
#if defined(HEADER_TEST_CUDA_AFTER)
#include <cuda.h>
#endif

int main()
{
	int (*unmap)(struct cuvmm_region *, size_t, size_t, CUstream) = cuvmm_region_unmap;
	CUstream s = static_cast<struct CUstream_st *>(0);

	return (unmap != 0 && s == 0) ? 0 : 1;
}
