/*
 * bench/sleep_bench: the speed of a pool's sleep (OFFLOAD) and wake against a plain pinned copy of the same
 * bytes, in one run (issue #11, target 3: first sleep >= 50% of the plain copy, steady state >= 90%).
 *
 * A pool gets --gib GiB in --tensor-mib MiB allocations, filled. Then, in this order:
 *   plain      cudaHostAlloc of the same bytes (its time reported apart, "pin"), then D2H and H2D copies of
 *              every allocation in 64 MiB pieces on one stream, timed from the first queued to the sync
 *   cuvmm      cuvmm_pool_sleep(OFFLOAD) and cuvmm_pool_wake, --cycles times: the first sleep pins a new
 *              host copy (lib/region_sleep.c: $CUVMM_PIN_THREADS threads), later ones reuse it (steady state)
 * Each figure is bytes / wall time of the call (GB/s, 1e9) and its share of the plain copy's rate the same
 * way. On the host backend (no GPU, or --backend=host) the "device" is memfd host memory and the plain copy
 * is memcpy into malloc'ed memory, first-touched as its "pin": host figures, not GPU figures.
 *
 * Usage: sleep_bench [--backend=cuda|host] [--gib=N] [--tensor-mib=N] [--cycles=N] [--coarse-mib=N] [--prepare]   (--help)
 */
#include <getopt.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime_api.h>

#include <cuvmm.h>

#include "cli.h"

#define MIB ((size_t)1 << 20)
#define PIECE (64 * MIB)

static double now_s(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static int ck_cuvmm(int err, const char *what)
{
	if (err)
		fprintf(stderr, "sleep_bench: %s: %s: %s\n", what, cuvmm_err_name(err), cuvmm_strerror(err));
	return err;
}

static int ck_cuda(cudaError_t e, const char *what)
{
	if (e != cudaSuccess)
		fprintf(stderr, "sleep_bench: %s: %s\n", what, cudaGetErrorString(e));
	return e != cudaSuccess;
}

/* One direction of the plain copy: every allocation, in pieces, into/out of one host buffer. */
static int plain_copy(bool gpu, cudaStream_t st, void **p, size_t n, size_t each, char *host, bool d2h, double *s)
{
	double t0 = now_s();

	for (size_t i = 0; i < n; i++) {
		for (size_t off = 0; off < each; off += PIECE) {
			size_t k = each - off < PIECE ? each - off : PIECE;
			char *dev = (char *)p[i] + off, *h = host + i * each + off;

			if (!gpu)
				memcpy(d2h ? h : dev, d2h ? dev : h, k);
			else if (ck_cuda(cudaMemcpyAsync(d2h ? (void *)h : (void *)dev, d2h ? (void *)dev : (void *)h, k,
							 d2h ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice, st),
					 "cudaMemcpyAsync"))
				return -1;
		}
	}
	if (gpu && ck_cuda(cudaStreamSynchronize(st), "cudaStreamSynchronize"))
		return -1;
	*s = now_s() - t0;
	return 0;
}

int main(int argc, char **argv)
{
	static const struct option opts[] = {{"backend", required_argument, NULL, 'b'},
					     {"gib", required_argument, NULL, 'g'},
					     {"tensor-mib", required_argument, NULL, 't'},
					     {"cycles", required_argument, NULL, 'c'},
					     {"coarse-mib", required_argument, NULL, 'k'},
					     {"prepare", no_argument, NULL, 'p'},
					     {"help", no_argument, NULL, 'h'},
					     {NULL, 0, NULL, 0}};
	static const char help[] =
		"Usage: sleep_bench [OPTION]...\n"
		"Sleep (OFFLOAD) and wake of a pool against a plain pinned copy of the same bytes, in one run.\n"
		"\n"
		"  --backend=NAME    cuda or host (default: cuda if a GPU is usable, else host)\n"
		"  --gib=N           GiB in the pool, 1 to 1024 (default 8 on a GPU, 1 on the host)\n"
		"  --tensor-mib=N    allocation size in MiB, 1 to 65536 (default 128)\n"
		"  --cycles=N        sleep/wake cycles, 1 to 100 (default 3: the first pins, the rest reuse)\n"
		"  --coarse-mib=N    the pool's coarse_bytes in MiB, 0 to 65536 (default 0: off)\n"
		"  --prepare         cuvmm_pool_sleep_prepare() before the first sleep (timed on its own)\n"
		"  --help            print this help and exit\n"
		"\n"
		"GB/s = 1e9 bytes per second of the call's wall time; % = of the plain pinned copy's rate.\n"
		"CUVMM_PIN_THREADS sets the pinning threads of the first sleep. Exit status: 0, 1 on a failure, 2 for a\n"
		"usage error.\n";
	enum cuvmm_backend be = CUVMM_BACKEND_AUTO;
	long gib = 0, tensor_mib = 128, cycles = 3, coarse_mib = 0;
	struct cuvmm_config cfg;
	struct cuvmm_pool_config pcfg;
	struct cuvmm_ctx *ctx = NULL;
	struct cuvmm_pool *pool = NULL;
	cudaStream_t st = NULL;
	double pin_s, d2h_s, h2d_s, t0;
	size_t bytes, each, n;
	bool gpu = false, prepare = false;
	void **p;
	char *host;
	int c, ndev = 0;

	cli_init(argv[0]);
	while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
		switch (c) {
		case 'b':
			be = cli_choice("backend", optarg, CLI_BACKENDS) ? CUVMM_BACKEND_HOST : CUVMM_BACKEND_CUDA;
			break;
		case 'g':
			gib = (long)cli_int("gib", optarg, 1, 1024);
			break;
		case 't':
			tensor_mib = (long)cli_int("tensor-mib", optarg, 1, 65536);
			break;
		case 'c':
			cycles = (long)cli_int("cycles", optarg, 1, 100);
			break;
		case 'k':
			coarse_mib = (long)cli_int("coarse-mib", optarg, 0, 65536);
			break;
		case 'p':
			prepare = true;
			break;
		case 'h':
			cli_help(help);
		default:
			cli_bad_usage();
		}
	}
	cli_no_operands(argc, argv, optind);

	if (be != CUVMM_BACKEND_HOST && cudaGetDeviceCount(&ndev) == cudaSuccess && ndev > 0 &&
	    cudaSetDevice(0) == cudaSuccess && cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking) == cudaSuccess)
		gpu = true;
	(void)cudaGetLastError();
	if (be == CUVMM_BACKEND_CUDA && !gpu) {
		fprintf(stderr, "sleep_bench: --backend=cuda, but no GPU is usable\n");
		return 1;
	}
	be = gpu ? CUVMM_BACKEND_CUDA : CUVMM_BACKEND_HOST;
	if (!gib)
		gib = gpu ? 8 : 1;
	each = (size_t)tensor_mib * MIB;
	n = ((size_t)gib << 30) / each;
	if (!n)
		n = 1;
	bytes = n * each;

	cuvmm_config_init(&cfg);
	cfg.backend = be;
	cuvmm_pool_config_init(&pcfg);
	pcfg.name = "weights";
	pcfg.coarse_bytes = (size_t)coarse_mib * MIB;
	p = calloc(n, sizeof(*p));
	if (!p || ck_cuvmm(cuvmm_ctx_create(&cfg, &ctx), "cuvmm_ctx_create") ||
	    ck_cuvmm(cuvmm_pool_create(ctx, &pcfg, &pool), "cuvmm_pool_create"))
		return 1;
	for (size_t i = 0; i < n; i++) {
		if (ck_cuvmm(cuvmm_malloc(pool, each, &p[i]), "cuvmm_malloc"))
			return 1;
		if (gpu ? ck_cuda(cudaMemset(p[i], (int)(i & 0xff), each), "cudaMemset")
			: (memset(p[i], (int)(i & 0xff), each), 0))
			return 1;
	}
	if (gpu && ck_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize"))
		return 1;
	printf("sleep_bench: %s backend, %.2f GiB in %zu allocations of %ld MiB, coarse_bytes %ld MiB%s\n",
	       gpu ? "CUDA" : "HOST", (double)bytes / (1u << 30), n, tensor_mib, coarse_mib,
	       gpu ? "" : " (host figures: memfd memory and memcpy, not a GPU)");

	/* The plain pinned copy, in the same run. */
	t0 = now_s();
	if (gpu) {
		if (ck_cuda(cudaHostAlloc((void **)&host, bytes, cudaHostAllocPortable), "cudaHostAlloc"))
			return 1;
	} else {
		host = malloc(bytes);
		if (!host)
			return 1;
		memset(host, 1, bytes); /* not 0: malloc + memset(0) may become calloc, touching nothing */
	}
	pin_s = now_s() - t0;
	if (plain_copy(gpu, st, p, n, each, host, true, &d2h_s) || plain_copy(gpu, st, p, n, each, host, false, &h2d_s))
		return 1;
	if (gpu)
		cudaFreeHost(host);
	else
		free(host);

	printf("%-30s %10s %9s %8s\n", "", "seconds", "GB/s", "% plain");
	printf("%-30s %10.3f %9.2f %8s\n", gpu ? "plain pin (cudaHostAlloc)" : "plain pin (malloc+touch)", pin_s,
	       bytes / pin_s / 1e9, "-");
	printf("%-30s %10.3f %9.2f %8s\n", "plain D2H (pinned)", d2h_s, bytes / d2h_s / 1e9, "100");
	printf("%-30s %10.3f %9.2f %8s\n", "plain H2D (pinned)", h2d_s, bytes / h2d_s / 1e9, "100");
	if (prepare) {
		t0 = now_s();
		if (ck_cuvmm(cuvmm_pool_sleep_prepare(pool, 0), "cuvmm_pool_sleep_prepare"))
			return 1;
		t0 = now_s() - t0;
		printf("%-30s %10.3f %9.2f %8s\n", "cuvmm sleep_prepare (pins)", t0, bytes / t0 / 1e9, "-");
	}
	for (long cyc = 0; cyc < cycles; cyc++) {
		double s_s, w_s;
		char what[40];

		t0 = now_s();
		if (ck_cuvmm(cuvmm_pool_sleep(pool, CUVMM_SLEEP_OFFLOAD, st), "cuvmm_pool_sleep"))
			return 1;
		s_s = now_s() - t0;
		t0 = now_s();
		if (ck_cuvmm(cuvmm_pool_wake(pool, st), "cuvmm_pool_wake"))
			return 1;
		if (gpu && ck_cuda(cudaStreamSynchronize(st), "cudaStreamSynchronize"))
			return 1;
		w_s = now_s() - t0;
		snprintf(what, sizeof(what), "cuvmm sleep %ld%s", cyc + 1, cyc || prepare ? "" : " (pins)");
		printf("%-30s %10.3f %9.2f %8.0f\n", what, s_s, bytes / s_s / 1e9, 100 * d2h_s / s_s);
		snprintf(what, sizeof(what), "cuvmm wake %ld", cyc + 1);
		printf("%-30s %10.3f %9.2f %8.0f\n", what, w_s, bytes / w_s / 1e9, 100 * h2d_s / w_s);
	}
	for (size_t i = 0; i < n; i++) {
		unsigned char b = 0;

		if (gpu)
			cudaMemcpy(&b, (char *)p[i] + each - 1, 1, cudaMemcpyDeviceToHost);
		else
			b = ((unsigned char *)p[i])[each - 1];
		if (b != (unsigned char)(i & 0xff)) {
			fprintf(stderr, "sleep_bench: allocation %zu lost its contents\n", i);
			return 1;
		}
		cuvmm_free(pool, p[i]);
	}
	cuvmm_pool_destroy(pool);
	cuvmm_ctx_destroy(ctx);
	free(p);
	if (gpu)
		cudaStreamDestroy(st);
	return 0;
}
