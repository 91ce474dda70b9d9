/*
 * region_bench: cost of growing a region by --size (default 1 GiB) and shrinking it back, next to
 * cudaMalloc/cudaFree of the same size in the same run.
 *
 * Each rep, after one discarded warm-up rep:
 *   trim (not timed)                        -> the device cache is empty
 *   cudaMalloc, touch, cudaFree             -> (e), (f)   [CUDA only]
 *   resize 0 -> size                        -> (a) cold grow: every chunk created, mapped, given access
 *   touch (cudaMemset + sync; host: memset) -> timed on its own, not part of the grow
 *   resize size -> 0, NULL stream           -> (c) shrink: time to return, and until mapped_bytes == 0
 *   resize 0 -> size                        -> (b) warm grow: the chunks come from the cache (no create)
 *   touch, shrink                           -> (c) again, reported apart from the shrink after (a)
 *   cuvmm_ctx_trim(ctx, -1, 0)              -> (d) release: the cached chunks go back to the driver
 * The context never gives memory back on its own (release_delay_ms = -1), so the warm grow always finds
 * the chunks the shrink cached.
 *
 * Usage: region_bench [--size=BYTES[K|M|G]] [--reps=N] [--backend=cuda|host] [--csv=FILE] [--help]
 */
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime_api.h>
#include <cuvmm.h>

#include "cli.h"

#define MiB (1024.0 * 1024.0)

#define CHECK(call)                                                                                          \
	do {                                                                                                 \
		int err_ = (call);                                                                           \
		if (err_ != CUVMM_OK) {                                                                      \
			fprintf(stderr, "%s:%d: %s failed: %s (%s, last CUresult %d)\n", __FILE__, __LINE__,  \
				#call, cuvmm_strerror(err_), cuvmm_err_name(err_), cuvmm_last_driver_error()); \
			exit(1);                                                                             \
		}                                                                                            \
	} while (0)

#define CUDA_CHECK(call)                                                                                     \
	do {                                                                                                 \
		cudaError_t e_ = (call);                                                                     \
		if (e_ != cudaSuccess) {                                                                     \
			fprintf(stderr, "%s:%d: %s failed: %s (%s)\n", __FILE__, __LINE__, #call,            \
				cudaGetErrorString(e_), cudaGetErrorName(e_));                               \
			exit(1);                                                                             \
		}                                                                                            \
	} while (0)

/* What is measured; the order of the report. */
enum meas {
	COLD, WARM, SHRINK_C, DONE_C, SHRINK_W, DONE_W, RELEASE, TOUCH_C, TOUCH_W, MALLOC, TOUCH_MALLOC, FREE, NMEAS
};

static const struct {
	const char *key;   /* CSV name */
	const char *label; /* report name */
	bool per_chunk;    /* report us per chunk */
	bool cudart;       /* needs the CUDA runtime */
	double facts_us;   /* us per 2 MiB chunk in facts/h200-vmm.md; 0: none */
} M[NMEAS] = {
	[COLD] = {"cold_grow", "(a) cold grow (create+map+access)", true, false, 16.4 + 2.8 + 40.4},
	[WARM] = {"warm_grow", "(b) warm grow (map+access, cached)", true, false, 35.0},
	[SHRINK_C] = {"shrink_cold", "(c) shrink after (a): call returns", true, false, 22.9},
	[DONE_C] = {"shrink_cold_unmapped", "(c) shrink after (a): mapped == 0", true, false, 22.9},
	[SHRINK_W] = {"shrink_warm", "(c) shrink after (b): call returns", true, false, 22.0},
	[DONE_W] = {"shrink_warm_unmapped", "(c) shrink after (b): mapped == 0", true, false, 22.0},
	[RELEASE] = {"release", "(d) release (cuvmm_ctx_trim)", true, false, 16.2},
	[TOUCH_C] = {"touch_after_cold_grow", "    touch after (a) (memset+sync)", false, false, 0},
	[TOUCH_W] = {"touch_after_warm_grow", "    touch after (b) (memset+sync)", false, false, 0},
	[MALLOC] = {"cudaMalloc", "(e) cudaMalloc", false, true, 0},
	[TOUCH_MALLOC] = {"touch_cudaMalloc", "    touch after (e) (memset+sync)", false, true, 0},
	[FREE] = {"cudaFree", "(f) cudaFree", false, true, 0},
};

struct sample {
	double ms;
	struct cuvmm_stats d; /* driver counter deltas */
};

static struct sample *samples[NMEAS];
static int nsamples[NMEAS];
static FILE *csv;
static const char *backend_name;
static size_t size, gran;

static double now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static struct cuvmm_stats delta(const struct cuvmm_stats *a, const struct cuvmm_stats *b)
{
	struct cuvmm_stats d = {.size = sizeof(d)};

	d.create_calls = b->create_calls - a->create_calls;
	d.release_calls = b->release_calls - a->release_calls;
	d.map_calls = b->map_calls - a->map_calls;
	d.unmap_calls = b->unmap_calls - a->unmap_calls;
	d.driver_ns = b->driver_ns - a->driver_ns;
	return d;
}

static void record(enum meas m, int rep, double ms, const struct cuvmm_stats *d)
{
	struct sample *s;

	if (rep < 0)
		return; /* warm-up */
	s = &samples[m][nsamples[m]++];
	s->ms = ms;
	if (d)
		s->d = *d;
	if (csv) {
		double nchunks = (double)(size / gran);

		fprintf(csv, "%s,%zu,%zu,%s,%d,%.4f,%.3f,%llu,%llu,%llu,%llu,%llu\n", backend_name, size, gran,
			M[m].key, rep, ms, M[m].per_chunk ? ms * 1e3 / nchunks : 0.0,
			d ? (unsigned long long)d->create_calls : 0, d ? (unsigned long long)d->map_calls : 0,
			d ? (unsigned long long)d->unmap_calls : 0, d ? (unsigned long long)d->release_calls : 0,
			d ? (unsigned long long)d->driver_ns : 0);
	}
}

static int cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;

	return (x > y) - (x < y);
}

/* Median (mean of the middle two for an even count) and minimum of n values; sorts v. */
static double median(double *v, int n, double *min)
{
	qsort(v, (size_t)n, sizeof(*v), cmp_double);
	*min = v[0];
	return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}


/* Prove the memory is usable: write it all, then (CUDA) read back its last bytes. */
static double touch(void *p, size_t len, bool cuda, int value)
{
	double t0 = now_ms(), ms;

	if (cuda) {
		unsigned char tail[16];

		CUDA_CHECK(cudaMemset(p, value, len));
		CUDA_CHECK(cudaDeviceSynchronize());
		ms = now_ms() - t0;
		CUDA_CHECK(cudaMemcpy(tail, (char *)p + len - sizeof(tail), sizeof(tail), cudaMemcpyDeviceToHost));
		for (size_t i = 0; i < sizeof(tail); i++)
			if (tail[i] != (unsigned char)value) {
				fprintf(stderr, "touch: read back %u, wrote %d\n", tail[i], value);
				exit(1);
			}
	} else {
		memset(p, value, len);
		ms = now_ms() - t0;
		if (((unsigned char *)p)[len - 1] != (unsigned char)value) {
			fprintf(stderr, "touch: read back %u, wrote %d\n", ((unsigned char *)p)[len - 1], value);
			exit(1);
		}
	}
	return ms;
}

/* Shrink to 0 with a NULL stream; record the time to return and the time until nothing is mapped. */
static void shrink(struct cuvmm_region *r, int rep, enum meas m_ret, enum meas m_done)
{
	struct cuvmm_stats a = {.size = sizeof(a)}, b = {.size = sizeof(b)}, d;
	double t0, t1, t2;

	CHECK(cuvmm_region_stats(r, &a));
	t0 = now_ms();
	CHECK(cuvmm_region_resize(r, 0, NULL));
	t1 = now_ms();
	for (;;) {
		CHECK(cuvmm_region_stats(r, &b));
		t2 = now_ms();
		if (b.mapped_bytes == 0)
			break;
		if (t2 - t0 > 30e3) {
			fprintf(stderr, "shrink: still %llu bytes mapped after 30 s\n",
				(unsigned long long)b.mapped_bytes);
			exit(1);
		}
	}
	d = delta(&a, &b);
	record(m_ret, rep, t1 - t0, &d);
	record(m_done, rep, t2 - t0, &d);
}

static void grow(struct cuvmm_region *r, enum meas m, int rep, bool cuda)
{
	struct cuvmm_stats a = {.size = sizeof(a)}, b = {.size = sizeof(b)}, d;
	double t0, ms;

	CHECK(cuvmm_region_stats(r, &a));
	t0 = now_ms();
	CHECK(cuvmm_region_resize(r, size, NULL));
	ms = now_ms() - t0;
	CHECK(cuvmm_region_stats(r, &b));
	if (b.mapped_bytes != size) {
		fprintf(stderr, "grow: %llu bytes mapped, expected %zu\n", (unsigned long long)b.mapped_bytes, size);
		exit(1);
	}
	d = delta(&a, &b);
	record(m, rep, ms, &d);
	record(m == COLD ? TOUCH_C : TOUCH_W, rep, touch(cuvmm_region_base(r), size, cuda, m == COLD ? 0x5a : 0xa5),
	       NULL);
}

static void one_rep(struct cuvmm_ctx *ctx, struct cuvmm_region *r, int rep, bool cuda)
{
	struct cuvmm_stats a = {.size = sizeof(a)}, b = {.size = sizeof(b)}, d;
	double t0;

	/* Start from an empty cache, so the next grow creates every chunk. */
	CHECK(cuvmm_ctx_trim(ctx, -1, 0));
	CHECK(cuvmm_ctx_stats(ctx, 0, &a));
	if (a.held_bytes != 0) {
		fprintf(stderr, "trim left %llu bytes held\n", (unsigned long long)a.held_bytes);
		exit(1);
	}

	if (cuda) {
		void *p = NULL;

		t0 = now_ms();
		CUDA_CHECK(cudaMalloc(&p, size));
		record(MALLOC, rep, now_ms() - t0, NULL);
		record(TOUCH_MALLOC, rep, touch(p, size, true, 0x3c), NULL);
		t0 = now_ms();
		CUDA_CHECK(cudaFree(p));
		record(FREE, rep, now_ms() - t0, NULL);
	}

	grow(r, COLD, rep, cuda);
	shrink(r, rep, SHRINK_C, DONE_C);
	grow(r, WARM, rep, cuda);
	shrink(r, rep, SHRINK_W, DONE_W);

	/* The chunks are cached now: held = size, mapped = 0. Give them back. Releases are counted on the
	 * device, not the region (a cached chunk belongs to no region). */
	CHECK(cuvmm_ctx_stats(ctx, 0, &a));
	if (a.held_bytes != size || a.mapped_bytes != 0) {
		fprintf(stderr, "after the shrink: held %llu, mapped %llu; expected %zu cached\n",
			(unsigned long long)a.held_bytes, (unsigned long long)a.mapped_bytes, size);
		exit(1);
	}
	t0 = now_ms();
	CHECK(cuvmm_ctx_trim(ctx, -1, 0));
	double ms = now_ms() - t0;
	CHECK(cuvmm_ctx_stats(ctx, 0, &b));
	d = delta(&a, &b);
	record(RELEASE, rep, ms, &d);
}

static const char help[] =
	"Usage: region_bench [OPTION]...\n"
	"The cost of growing a region by --size and shrinking it back (cold grow, warm grow from the cache,\n"
	"shrink, release), next to cudaMalloc/cudaFree of the same size on the CUDA backend.\n"
	"\n"
	"  -s, --size=BYTES      bytes to grow by: digits with an optional K, M, G or T suffix, 1 to 1T\n"
	"                        (default 1G)\n"
	"  -r, --reps=N          timed repetitions after one warm-up, 1 to 100000 (default 10)\n"
	"  -b, --backend=NAME    cuda or host (default: $CUVMM_BACKEND, else cuda)\n"
	"  -c, --csv=FILE        write one row per repetition and phase\n"
	"  -h, --help            print this help and exit\n"
	"\n"
	"Exit status: 0 on success, 1 on a failure, 2 for a usage error.\n";

int main(int argc, char **argv)
{
	static const struct option opts[] = {
		{"size", required_argument, NULL, 's'}, {"reps", required_argument, NULL, 'r'},
		{"backend", required_argument, NULL, 'b'}, {"csv", required_argument, NULL, 'c'},
		{"help", no_argument, NULL, 'h'}, {NULL, 0, NULL, 0},
	};
	const char *want_backend = NULL, *csv_path = NULL;
	size_t req_size = (size_t)1 << 30;
	int reps = 10, opt;
	struct cuvmm_config cfg;
	struct cuvmm_ctx *ctx = NULL;
	struct cuvmm_region *r;
	bool cuda;
	int err;

	cli_init(argv[0]);
	while ((opt = getopt_long(argc, argv, "s:r:b:c:h", opts, NULL)) != -1) {
		switch (opt) {
		case 's':
			req_size = (size_t)cli_size("size", optarg, 1, (uint64_t)1 << 40);
			break;
		case 'r':
			reps = (int)cli_int("reps", optarg, 1, 100000);
			break;
		case 'b':
			want_backend = CLI_BACKENDS[cli_choice("backend", optarg, CLI_BACKENDS)];
			break;
		case 'c':
			csv_path = optarg;
			break;
		case 'h':
			cli_help(help);
		default:
			cli_bad_usage();
		}
	}
	cli_no_operands(argc, argv, optind);

	cuvmm_config_init(&cfg);
	cfg.release_delay_ms = -1; /* nothing goes back to the driver unless trimmed */
	cfg.retain_bytes = 0;
	if (!want_backend && getenv("CUVMM_BACKEND") && !strcmp(getenv("CUVMM_BACKEND"), "host"))
		want_backend = "host";

	/* CUDA: start the runtime first, so cuvmm and cudart share the device's primary context. Without
	 * --backend, a machine without a usable GPU falls back to the host backend, loudly. */
	cuda = !want_backend || !strcmp(want_backend, "cuda");
	if (cuda) {
		cudaError_t ce = cudaSetDevice(0);

		if (ce == cudaSuccess)
			ce = cudaFree(0);
		if (ce != cudaSuccess) {
			if (want_backend) {
				fprintf(stderr, "--backend=cuda: the CUDA runtime failed: %s\n", cudaGetErrorString(ce));
				return 1;
			}
			printf("*** NO USABLE GPU (CUDA runtime: %s): running on the HOST backend; the numbers below "
			       "are NOT GPU numbers ***\n",
			       cudaGetErrorString(ce));
			cuda = false;
		}
	}
	if (cuda) {
		cfg.backend = CUVMM_BACKEND_CUDA;
		err = cuvmm_ctx_create(&cfg, &ctx);
		if ((err == CUVMM_ENODRIVER || err == CUVMM_ENODEV) && !want_backend) {
			printf("*** cuvmm found no GPU (%s): running on the HOST backend; the numbers below are NOT "
			       "GPU numbers ***\n",
			       cuvmm_strerror(err));
			cuda = false;
		} else {
			CHECK(err);
		}
	}
	if (!cuda) {
		cfg.backend = CUVMM_BACKEND_HOST;
		CHECK(cuvmm_ctx_create(&cfg, &ctx));
	}
	backend_name = cuda ? "cuda" : "host";

	CHECK(cuvmm_region_create(ctx, 0, req_size, &r));
	size = cuvmm_region_size(r);
	gran = cuvmm_region_granularity(r);
	double nchunks = (double)(size / gran);

	/* One sample per rep of each measurement, and scratch space to sort them. */
	double *v = calloc((size_t)reps, sizeof(*v));
	for (int m = 0; m < NMEAS; m++)
		if (!v || !(samples[m] = calloc((size_t)reps, sizeof(struct sample)))) {
			fprintf(stderr, "out of memory\n");
			return 1;
		}
	if (csv_path) {
		csv = fopen(csv_path, "w");
		if (!csv) {
			fprintf(stderr, "%s: %s\n", csv_path, strerror(errno));
			return 1;
		}
		fprintf(csv, "backend,size_bytes,granularity,measurement,rep,ms,us_per_chunk,create_calls,map_calls,"
			     "unmap_calls,release_calls,driver_ns\n");
	}

	if (cuda) {
		struct cudaDeviceProp prop;
		int dev;

		CUDA_CHECK(cudaGetDevice(&dev));
		CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
		printf("region_bench: cuvmm %s, CUDA backend, device %d: %s (%.1f GiB)\n", cuvmm_version(), dev,
		       prop.name, prop.totalGlobalMem / (MiB * 1024));
	} else {
		printf("region_bench: cuvmm %s, HOST backend (host memory with the semantics of the driver)\n",
		       cuvmm_version());
	}
	printf("size %.0f MiB = %.0f chunks of %zu KiB; %d reps after 1 warm-up; median and min in ms\n\n",
	       size / MiB, nchunks, gran / 1024, reps);

	for (int rep = -1; rep < reps; rep++)
		one_rep(ctx, r, rep, cuda);

	printf("%-36s %4s %10s %10s %11s %11s\n", "measurement", "n", "median ms", "min ms", "us/chunk", "facts us");
	for (int m = 0; m < NMEAS; m++) {
		double mn, md;
		int n = nsamples[m];

		if (M[m].cudart && !cuda) {
			printf("%-36s %4s %10s\n", M[m].label, "", "n/a (host backend)");
			continue;
		}
		for (int i = 0; i < n; i++)
			v[i] = samples[m][i].ms;
		md = median(v, n, &mn);
		printf("%-36s %4d %10.3f %10.3f", M[m].label, n, md, mn);
		if (M[m].per_chunk)
			printf(" %11.2f", md * 1e3 / nchunks);
		else
			printf(" %11s", "");
		if (M[m].facts_us > 0 && gran == ((size_t)2 << 20))
			printf(" %11.1f", M[m].facts_us);
		printf("\n");
	}

	/* Driver calls per operation, from the region's counters (the device's for the release). */
	printf("\ndriver calls per operation (median over reps; driver_ns covers create, map, set access, unmap, "
	       "release)\n");
	printf("%-36s %7s %7s %7s %7s %12s %11s\n", "operation", "create", "map", "unmap", "release",
	       "driver ms", "drv us/chk");
	static const enum meas ops[] = {COLD, WARM, SHRINK_C, SHRINK_W, RELEASE};
	for (size_t i = 0; i < sizeof(ops) / sizeof(ops[0]); i++) {
		enum meas m = ops[i];
		int n = nsamples[m];
		double mn, md[5];

		for (int k = 0; k < 5; k++) {
			for (int j = 0; j < n; j++) {
				const struct cuvmm_stats *d = &samples[m][j].d;
				uint64_t x[5] = {d->create_calls, d->map_calls, d->unmap_calls, d->release_calls,
						 d->driver_ns};

				v[j] = k == 4 ? x[k] / 1e6 : (double)x[k];
			}
			md[k] = median(v, n, &mn);
		}
		printf("%-36s %7.0f %7.0f %7.0f %7.0f %12.3f %11.2f\n", M[m].label, md[0], md[1], md[2], md[3], md[4],
		       md[4] * 1e3 / nchunks);
	}
	printf("\nfacts (H200, 2 MiB handles): create 16.4 + map 2.8 + set access 40.4 us; unmap 22.9; release 16.2;"
	       " cached remap: map+access 35, unmap 22\n");

	if (csv && fclose(csv)) {
		fprintf(stderr, "%s: %s\n", csv_path, strerror(errno));
		return 1;
	}
	cuvmm_region_destroy(r);
	cuvmm_ctx_destroy(ctx);
	for (int m = 0; m < NMEAS; m++)
		free(samples[m]);
	free(v);
	if (cuda)
		CUDA_CHECK(cudaDeviceSynchronize());
	return 0;
}
