/*
 * bench/weights: load a model's weights tensor by tensor into an allocator and report the memory it holds
 * against the tensors' bytes (issue #11, target 2: at most 1.02x).
 *
 * Each FILE lists one model's tensor byte sizes in load order, one per line (the first number of a line;
 * '#' lines are comments): bench/weights/gen.py writes them from config numbers (Qwen2-1.5B, Llama-3.2-1B).
 * Every tensor is allocated in turn and kept, as a loader does; nothing is freed until the model is loaded.
 *
 * Allocators (--allocators, in the order given; default cuvmm, plus cudamalloc and async0 with a GPU):
 *   cuvmm       cuvmm_malloc into one pool of a fresh context (--backend); held = the pool's held bytes
 *               (cuvmm_pool_stats), exact
 *   cudamalloc  cudaMalloc; held = the driver's used memory (cuMemGetInfo: total - free) after the load minus
 *               before it, as bench/trace measures it
 *   async0      cudaMallocAsync on a non-blocking stream, default pool, release threshold 0; held = the
 *               same driver difference, and the pool's cudaMemPoolAttrReservedMemCurrent
 *
 * Usage: weights [--backend=cuda|host] [--allocators=LIST] FILE...   (--help)
 */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda.h> /* cuMemGetInfo, through the runtime's entry point */
#include <cuda_runtime_api.h>

#include <cuvmm.h>

#include "cli.h"

#define MIB ((double)(1 << 20))

enum akind { A_CUVMM = 0, A_CUDAMALLOC, A_ASYNC0, A_COUNT };
static const char *const aname[A_COUNT] = {"cuvmm", "cudamalloc", "async0"};

struct model {
	const char *path;
	uint64_t *size;
	size_t n;
	uint64_t bytes;
};

static bool g_gpu;
static cudaStream_t g_stream;
static cudaMemPool_t g_mempool;
static bool g_have_mempool;
typedef CUresult (*pfn_cuMemGetInfo)(size_t *free_bytes, size_t *total_bytes);
static pfn_cuMemGetInfo g_cuMemGetInfo;

static double now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

/* Read a size list; a missing file or a line that is not a size is a usage error (exit 2, before any work). */
static void model_read(struct model *m, const char *path)
{
	FILE *f = fopen(path, "r");
	char line[512];
	size_t cap = 0, lineno = 0;

	if (!f)
		cli_fail("%s: %s", path, strerror(errno));
	*m = (struct model){.path = path};
	while (fgets(line, sizeof(line), f)) {
		char *p = line, *end;
		unsigned long long v;

		lineno++;
		while (*p == ' ' || *p == '\t')
			p++;
		if (*p == '#' || *p == '\n' || !*p)
			continue;
		errno = 0;
		v = strtoull(p, &end, 10);
		if (*p < '0' || *p > '9' || errno || end == p || v == 0 || (*end && *end != ' ' && *end != '\t' &&
									    *end != '\n'))
			cli_fail("%s:%zu: '%.40s' is not a tensor size in bytes", path, lineno, p);
		if (m->n == cap) {
			cap = cap ? 2 * cap : 512;
			m->size = realloc(m->size, cap * sizeof(*m->size));
			if (!m->size) {
				fprintf(stderr, "weights: out of host memory\n");
				exit(1);
			}
		}
		m->size[m->n++] = v;
		m->bytes += v;
	}
	fclose(f);
	if (!m->n)
		cli_fail("%s: no tensor sizes", path);
}

static void gpu_probe(void)
{
	int n = 0, pools = 0;
	enum cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
	void *fn = NULL;

	if (cudaGetDeviceCount(&n) != cudaSuccess || n < 1 || cudaSetDevice(0) != cudaSuccess ||
	    cudaFree(NULL) != cudaSuccess) {
		(void)cudaGetLastError();
		return;
	}
#if CUDART_VERSION >= 12050
	if (cudaGetDriverEntryPointByVersion("cuMemGetInfo", &fn, 12000, cudaEnableDefault, &q) == cudaSuccess &&
	    q == cudaDriverEntryPointSuccess && fn)
#else
	if (cudaGetDriverEntryPoint("cuMemGetInfo", &fn, cudaEnableDefault, &q) == cudaSuccess &&
	    q == cudaDriverEntryPointSuccess && fn)
#endif
		g_cuMemGetInfo = (pfn_cuMemGetInfo)fn;
	(void)cudaGetLastError();
	if (cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking) != cudaSuccess) {
		(void)cudaGetLastError();
		return;
	}
	g_gpu = true;
	if (cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, 0) == cudaSuccess && pools &&
	    cudaDeviceGetDefaultMemPool(&g_mempool, 0) == cudaSuccess)
		g_have_mempool = true;
	(void)cudaGetLastError();
}

static int driver_used(uint64_t *used)
{
	size_t fr = 0, tot = 0;

	if (g_cuMemGetInfo ? g_cuMemGetInfo(&fr, &tot) != CUDA_SUCCESS : cudaMemGetInfo(&fr, &tot) != cudaSuccess) {
		fprintf(stderr, "weights: cuMemGetInfo failed\n");
		return -1;
	}
	*used = (uint64_t)(tot - fr);
	return 0;
}

struct result {
	bool ok;
	uint64_t held, reserved; /* reserved: async0's pool attribute (0: none) */
	uint64_t maps;           /* cuvmm: the pool's map calls */
	double ms;
};

static int load_cuvmm(const struct model *m, enum cuvmm_backend be, struct result *res)
{
	struct cuvmm_config cfg;
	struct cuvmm_pool_config pcfg;
	struct cuvmm_ctx *ctx = NULL;
	struct cuvmm_pool *pool = NULL;
	struct cuvmm_stats st = {.size = sizeof(st)};
	void **p = calloc(m->n, sizeof(*p));
	size_t i = 0;
	int err;
	double t0;

	cuvmm_config_init(&cfg);
	cfg.backend = be;
	cuvmm_pool_config_init(&pcfg);
	pcfg.name = "weights";
	err = p ? cuvmm_ctx_create(&cfg, &ctx) : CUVMM_ENOMEM;
	if (!err)
		err = cuvmm_pool_create(ctx, &pcfg, &pool);
	t0 = now_ms();
	for (; !err && i < m->n; i++)
		err = cuvmm_malloc(pool, m->size[i], &p[i]);
	res->ms = now_ms() - t0;
	if (!err)
		err = cuvmm_pool_stats(pool, &st);
	if (err)
		fprintf(stderr, "weights: cuvmm (tensor %zu of %zu): %s: %s\n", i, m->n, cuvmm_err_name(err),
			cuvmm_strerror(err));
	res->ok = !err;
	res->held = st.held_bytes;
	res->maps = st.map_calls;
	while (i-- > 0)
		if (p[i])
			cuvmm_free(pool, p[i]);
	cuvmm_pool_destroy(pool);
	cuvmm_ctx_destroy(ctx);
	free(p);
	return err ? -1 : 0;
}

static int load_cuda(const struct model *m, enum akind k, struct result *res)
{
	void **p = calloc(m->n, sizeof(*p));
	uint64_t before = 0, after = 0, zero = 0;
	cudaError_t e = cudaSuccess;
	size_t i = 0;
	double t0;

	if (!p || driver_used(&before))
		goto out;
	if (k == A_ASYNC0 && cudaMemPoolSetAttribute(g_mempool, cudaMemPoolAttrReleaseThreshold, &zero) != cudaSuccess)
		goto out;
	t0 = now_ms();
	for (; e == cudaSuccess && i < m->n; i++)
		e = k == A_CUDAMALLOC ? cudaMalloc(&p[i], m->size[i])
				      : cudaMallocAsync(&p[i], m->size[i], g_stream);
	if (e == cudaSuccess && k == A_ASYNC0)
		e = cudaStreamSynchronize(g_stream);
	res->ms = now_ms() - t0;
	if (e != cudaSuccess) {
		fprintf(stderr, "weights: %s (tensor %zu of %zu): %s\n", aname[k], i, m->n, cudaGetErrorString(e));
		i--;
	} else if (!driver_used(&after)) {
		res->ok = true;
		res->held = after > before ? after - before : 0;
		if (k == A_ASYNC0)
			cudaMemPoolGetAttribute(g_mempool, cudaMemPoolAttrReservedMemCurrent, &res->reserved);
	}
	while (i-- > 0)
		k == A_CUDAMALLOC ? cudaFree(p[i]) : cudaFreeAsync(p[i], g_stream);
	if (k == A_ASYNC0) {
		cudaStreamSynchronize(g_stream);
		cudaMemPoolTrimTo(g_mempool, 0);
	}
out:
	(void)cudaGetLastError();
	free(p);
	return res->ok ? 0 : -1;
}

int main(int argc, char **argv)
{
	static const struct option opts[] = {{"backend", required_argument, NULL, 'b'},
					     {"allocators", required_argument, NULL, 'a'},
					     {"help", no_argument, NULL, 'h'},
					     {NULL, 0, NULL, 0}};
	static const char help[] =
		"Usage: weights [OPTION]... FILE...\n"
		"Load each model's tensors (FILE: byte sizes, one per line, in load order; bench/weights/*.txt) one\n"
		"by one into an allocator and report the memory held against the tensors' bytes.\n"
		"\n"
		"  --backend=NAME     cuvmm's backend: cuda or host (default: cuda if a GPU is usable, else host)\n"
		"  --allocators=LIST  comma list of cuvmm, cudamalloc, async0 (default: cuvmm, and with a GPU\n"
		"                     cudamalloc and async0: cudaMallocAsync, default pool, release threshold 0)\n"
		"  --help             print this help and exit\n"
		"\n"
		"held: cuvmm's pool held bytes (exact); for the CUDA allocators, the driver's used memory after the\n"
		"load minus before it (cuMemGetInfo). Exit status: 0 on success, 1 on a failure, 2 for a usage error.\n";
	enum cuvmm_backend be = CUVMM_BACKEND_AUTO;
	enum akind list[8];
	int nlist = 0, c, failed = 0;
	const char *alist = NULL;
	struct model *models;
	int nmodels;

	cli_init(argv[0]);
	while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
		switch (c) {
		case 'b':
			be = cli_choice("backend", optarg, CLI_BACKENDS) ? CUVMM_BACKEND_HOST : CUVMM_BACKEND_CUDA;
			break;
		case 'a':
			alist = optarg;
			for (const char *t = optarg;;) {
				size_t len = strcspn(t, ",");
				int k;

				for (k = 0; k < A_COUNT; k++)
					if (strlen(aname[k]) == len && strncmp(t, aname[k], len) == 0)
						break;
				if (k == A_COUNT || nlist == 8)
					cli_fail("--allocators=%s: want a comma list of cuvmm, cudamalloc, async0", optarg);
				list[nlist++] = (enum akind)k;
				if (!t[len])
					break;
				t += len + 1;
			}
			break;
		case 'h':
			cli_help(help);
		default:
			cli_bad_usage();
		}
	}
	if (optind >= argc)
		cli_fail("no FILE given (bench/weights/*.txt)");
	nmodels = argc - optind;
	models = calloc((size_t)nmodels, sizeof(*models));
	if (!models)
		return 1;
	for (int i = 0; i < nmodels; i++)
		model_read(&models[i], argv[optind + i]);

	gpu_probe();
	if (be == CUVMM_BACKEND_AUTO)
		be = g_gpu ? CUVMM_BACKEND_CUDA : CUVMM_BACKEND_HOST;
	if (be == CUVMM_BACKEND_CUDA && !g_gpu) {
		fprintf(stderr, "weights: --backend=cuda, but no GPU is usable\n");
		return 1;
	}
	if (!alist) {
		list[nlist++] = A_CUVMM;
		if (g_gpu)
			list[nlist++] = A_CUDAMALLOC;
		if (g_have_mempool)
			list[nlist++] = A_ASYNC0;
	}
	for (int i = 0; i < nlist; i++) {
		if (list[i] != A_CUVMM && !(g_gpu && (list[i] != A_ASYNC0 || g_have_mempool))) {
			fprintf(stderr, "weights: %s needs a usable GPU%s\n", aname[list[i]],
				list[i] == A_ASYNC0 ? " with memory pools" : "");
			return 1;
		}
	}
	if (be == CUVMM_BACKEND_HOST)
		printf("weights: cuvmm on the HOST backend (memfd host memory, 2 MiB granules unless "
		       "CUVMM_HOST_GRANULARITY): host figures\n");

	printf("%-22s %7s %11s %-11s %-7s %11s %9s %8s %9s %s\n", "model", "tensors", "tensor MiB", "allocator",
	       "backend", "held MiB", "held/t", "ms", "maps", "notes");
	for (int mi = 0; mi < nmodels; mi++) {
		const struct model *m = &models[mi];
		const char *name = strrchr(m->path, '/') ? strrchr(m->path, '/') + 1 : m->path;

		for (int i = 0; i < nlist; i++) {
			struct result r = {0};
			int err = list[i] == A_CUVMM ? load_cuvmm(m, be, &r) : load_cuda(m, list[i], &r);

			if (err) {
				printf("%-22s %7zu %11.1f %-11s FAILED\n", name, m->n, m->bytes / MIB, aname[list[i]]);
				failed = 1;
				continue;
			}
			printf("%-22s %7zu %11.1f %-11s %-7s %11.1f %9.4f %8.1f ", name, m->n, m->bytes / MIB,
			       aname[list[i]], list[i] == A_CUVMM && be == CUVMM_BACKEND_HOST ? "host" : "cuda",
			       r.held / MIB, (double)r.held / (double)m->bytes, r.ms);
			if (list[i] == A_CUVMM)
				printf("%9" PRIu64 " target <= 1.02\n", r.maps);
			else if (r.reserved)
				printf("%9s pool reserved %.1f MiB (%.4f)\n", "-", r.reserved / MIB,
				       (double)r.reserved / (double)m->bytes);
			else
				printf("%9s driver used, after - before\n", "-");
		}
	}
	for (int i = 0; i < nmodels; i++)
		free(models[i].size);
	free(models);
	if (g_gpu)
		cudaStreamDestroy(g_stream);
	return failed;
}
