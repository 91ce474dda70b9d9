/*
 * The public header must compile as strict C99 (-std=c99 -pedantic -Werror -Wall -Wextra), with cuvmm's
 * include directory an ordinary -I path, not a system one. Built three times (tests/meson.build):
 * without cuda.h anywhere on the search path, with <cuda.h> included first and with it included after
 * (cuda.h itself is not -pedantic clean, so it comes from a system directory in those two).
 */
#if defined(HEADER_TEST_CUDA_FIRST)
#include <cuda.h>
#endif
#include <cuvmm.h>
#if defined(HEADER_TEST_CUDA_AFTER)
#include <cuda.h>
#endif

#if !defined(CUVMM_CUSTREAM_DECLARED)
#error "cuvmm.h did not declare CUstream"
#endif

/* CUstream is a pointer to the opaque struct CUstream_st, as in cuda.h (and cudaStream_t). */
static int pass_stream(struct cuvmm_pool *pool, struct CUstream_st *s)
{
	CUstream stream = s;

	return cuvmm_free_async(pool, NULL, stream);
}

int main(void)
{
	/* The function types the header promises, with the stream type it declares. */
	int (*unmap)(struct cuvmm_region *, size_t, size_t, CUstream) = cuvmm_region_unmap;
	int (*fn)(struct cuvmm_pool *, struct CUstream_st *) = pass_stream;

	return (unmap != NULL && fn != NULL) ? 0 : 1;
}
