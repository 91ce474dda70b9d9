/*
 * Do the driver's VMM calls scale with threads? Maps 8 GiB as 2 MiB and as 32 MiB handles (create + map +
 * set access), then unmaps and releases them, with the handles split over 1, 2, 4 and 8 threads. Uses the
 * driver API directly (no cuvmm): it measures what any release could gain by issuing its calls in parallel.
 * On the H200 it gained nothing (doc/design.md, "Pools"): the driver serialises these calls. Then unmaps
 * 2 MiB handles in ranges of 1 to 4096 neighbours per cuMemUnmap: one call over many handles cost as much
 * as one call each (doc/performance.md), so an unmap is priced per handle.
 *
 *   bench/driver_threads [--help]      (GPU only)
 *
 * The driver is loaded with dlopen, as cuvmm loads it, so the program starts (and --help works) on a
 * machine without libcuda.so.1 and says there is no driver.
 */
#include <cuda.h>
#include <dlfcn.h>
#include <getopt.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "cli.h"

/* The entry points used, by their exported names (none of them has a _v2 variant). */
#define DRIVER_FUNCS(X)                                                                                      \
	X(cuInit, (unsigned int))                                                                            \
	X(cuDeviceGet, (CUdevice *, int))                                                                    \
	X(cuDevicePrimaryCtxRetain, (CUcontext *, CUdevice))                                                 \
	X(cuCtxSetCurrent, (CUcontext))                                                                      \
	X(cuMemAddressReserve, (CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long))             \
	X(cuMemAddressFree, (CUdeviceptr, size_t))                                                           \
	X(cuMemCreate, (CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long)) \
	X(cuMemRelease, (CUmemGenericAllocationHandle))                                                      \
	X(cuMemMap, (CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long))         \
	X(cuMemUnmap, (CUdeviceptr, size_t))                                                                 \
	X(cuMemSetAccess, (CUdeviceptr, size_t, const CUmemAccessDesc *, size_t))

#define DECLARE_(name, args) static CUresult(*p_##name) args;
DRIVER_FUNCS(DECLARE_)

#define CK(x) do { CUresult e_ = (x); if (e_) { fprintf(stderr, "%s: %d line %d\n", #x, e_, __LINE__); exit(1); } } while (0)
static CUdeviceptr base; static CUmemGenericAllocationHandle *h; static size_t n, sz; static CUcontext ctx; static CUmemAllocationProp prop; static CUmemAccessDesc acc;
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e3 + t.tv_nsec / 1e6; }
struct job { size_t a, b; int up; };
static void *work(void *arg) {
	struct job *j = arg; CK(p_cuCtxSetCurrent(ctx));
	for (size_t i = j->a; i < j->b; i++) {
		if (j->up) { CK(p_cuMemCreate(&h[i], sz, &prop, 0)); CK(p_cuMemMap(base + i * sz, sz, 0, h[i], 0)); CK(p_cuMemSetAccess(base + i * sz, sz, &acc, 1)); }
		else { CK(p_cuMemUnmap(base + i * sz, sz)); CK(p_cuMemRelease(h[i])); }
	}
	return NULL;
}
/* Unmap the n handles in ranges of r neighbours (one cuMemUnmap per range), then release them: is an unmap
 * priced per call or per handle? Times both parts apart; *rel_ms gets the releases. */
static double range_down(size_t r, double *rel_ms) {
	double t0 = now();
	for (size_t i = 0; i < n; i += r) CK(p_cuMemUnmap(base + i * sz, (i + r <= n ? r : n - i) * sz));
	double t1 = now();
	for (size_t i = 0; i < n; i++) CK(p_cuMemRelease(h[i]));
	*rel_ms = now() - t1;
	return t1 - t0;
}
static double phase(int T, int up) {
	pthread_t th[64]; struct job j[64]; double t0 = now();
	for (int t = 0; t < T; t++) { j[t] = (struct job){n * t / T, n * (t + 1) / T, up}; pthread_create(&th[t], NULL, work, &j[t]); }
	for (int t = 0; t < T; t++) pthread_join(th[t], NULL);
	return now() - t0;
}

/* 0, or 1 with a message when the driver cannot be loaded. */
static int load_driver(void)
{
	void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);

	if (!lib) {
		fprintf(stderr, "driver_threads: no CUDA driver: %s\n", dlerror());
		return 1;
	}
#define LOAD_(name, args)                                                                                    \
	*(void **)&p_##name = dlsym(lib, #name);                                                             \
	if (!p_##name) {                                                                                     \
		fprintf(stderr, "driver_threads: the CUDA driver lacks %s\n", #name);                        \
		return 1;                                                                                    \
	}
	DRIVER_FUNCS(LOAD_)
	return 0;
}

int main(int argc, char **argv) {
	static const struct option opts[] = {{"help", no_argument, NULL, 'h'}, {NULL, 0, NULL, 0}};
	static const char help[] =
		"Usage: driver_threads [--help]\n"
		"Do the CUDA driver's VMM calls scale with threads? Maps 8 GiB of device 0 as 2 MiB and as 32 MiB\n"
		"handles and unmaps them again, with the handles split over 1, 2, 4 and 8 threads; then unmaps 2 MiB\n"
		"handles in ranges of 1 to 4096 neighbours per call. GPU only.\n"
		"\n"
		"  --help   print this help and exit\n"
		"\n"
		"Exit status: 0 on success, 1 without a usable GPU or on a driver failure, 2 for a usage error.\n";
	int c;

	cli_init(argv[0]);
	while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
		if (c == 'h')
			cli_help(help);
		cli_bad_usage();
	}
	cli_no_operands(argc, argv, optind);
	if (load_driver())
		return 1;

	CUdevice dev; CK(p_cuInit(0)); CK(p_cuDeviceGet(&dev, 0)); CK(p_cuDevicePrimaryCtxRetain(&ctx, dev)); CK(p_cuCtxSetCurrent(ctx));
	prop.type = CU_MEM_ALLOCATION_TYPE_PINNED; prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE; prop.location.id = 0;
	acc.location = prop.location; acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
	size_t sizes[] = {2 << 20, 32 << 20};
	for (int s = 0; s < 2; s++) {
		sz = sizes[s]; n = (8ull << 30) / sz; h = calloc(n, sizeof(*h));
		CK(p_cuMemAddressReserve(&base, n * sz, 0, 0, 0));
		int Ts[] = {1, 2, 4, 8};
		for (int k = 0; k < 4; k++) {
			double up = phase(Ts[k], 1), down = phase(Ts[k], 0);
			printf("handle %zu MiB x %zu, threads %d: up (create+map+access) %.1f ms, down (unmap+release) %.1f ms\n", sz >> 20, n, Ts[k], up, down);
		}
		if (s == 0) {
			size_t rs[] = {1, 16, 32, 512, 4096};
			for (int k = 0; k < 5; k++) {
				double rel, up = phase(1, 1), un = range_down(rs[k], &rel);
				printf("handle %zu MiB x %zu, unmap in ranges of %zu handles: up %.1f ms, unmap %.1f ms (%zu calls), release %.1f ms\n", sz >> 20, n, rs[k], up, un, (n + rs[k] - 1) / rs[k], rel);
			}
		}
		CK(p_cuMemAddressFree(base, n * sz)); free(h);
	}
	return 0;
}
