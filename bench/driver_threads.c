/*
 * Do the driver's VMM calls scale with threads? Maps 8 GiB as 2 MiB and as 32 MiB handles (create + map +
 * set access), then unmaps and releases them, with the handles split over 1, 2, 4 and 8 threads. Uses the
 * driver API directly (no cuvmm): it measures what any release could gain by issuing its calls in parallel.
 * On the H200 it gained nothing (doc/design.md, "Pools"): the driver serialises these calls.
 *
 *   bench/driver_threads       (GPU only)
 */
#include <cuda.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#define CK(x) do { CUresult e_ = (x); if (e_) { fprintf(stderr, "%s: %d line %d\n", #x, e_, __LINE__); exit(1); } } while (0)
static CUdeviceptr base; static CUmemGenericAllocationHandle *h; static size_t n, sz; static CUcontext ctx; static CUmemAllocationProp prop; static CUmemAccessDesc acc;
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e3 + t.tv_nsec / 1e6; }
struct job { size_t a, b; int up; };
static void *work(void *arg) {
	struct job *j = arg; CK(cuCtxSetCurrent(ctx));
	for (size_t i = j->a; i < j->b; i++) {
		if (j->up) { CK(cuMemCreate(&h[i], sz, &prop, 0)); CK(cuMemMap(base + i * sz, sz, 0, h[i], 0)); CK(cuMemSetAccess(base + i * sz, sz, &acc, 1)); }
		else { CK(cuMemUnmap(base + i * sz, sz)); CK(cuMemRelease(h[i])); }
	}
	return NULL;
}
static double phase(int T, int up) {
	pthread_t th[64]; struct job j[64]; double t0 = now();
	for (int t = 0; t < T; t++) { j[t] = (struct job){n * t / T, n * (t + 1) / T, up}; pthread_create(&th[t], NULL, work, &j[t]); }
	for (int t = 0; t < T; t++) pthread_join(th[t], NULL);
	return now() - t0;
}
int main(void) {
	CUdevice dev; CK(cuInit(0)); CK(cuDeviceGet(&dev, 0)); CK(cuDevicePrimaryCtxRetain(&ctx, dev)); CK(cuCtxSetCurrent(ctx));
	prop.type = CU_MEM_ALLOCATION_TYPE_PINNED; prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE; prop.location.id = 0;
	acc.location = prop.location; acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
	size_t sizes[] = {2 << 20, 32 << 20};
	for (int s = 0; s < 2; s++) {
		sz = sizes[s]; n = (8ull << 30) / sz; h = calloc(n, sizeof(*h));
		CK(cuMemAddressReserve(&base, n * sz, 0, 0, 0));
		int Ts[] = {1, 2, 4, 8};
		for (int k = 0; k < 4; k++) {
			double up = phase(Ts[k], 1), down = phase(Ts[k], 0);
			printf("handle %zu MiB x %zu, threads %d: up (create+map+access) %.1f ms, down (unmap+release) %.1f ms\n", sz >> 20, n, Ts[k], up, down);
		}
		CK(cuMemAddressFree(base, n * sz)); free(h);
	}
	return 0;
}
