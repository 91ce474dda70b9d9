/*
 * pool_bench: the cost of a malloc + free pair served from mapped memory (no driver call), on one thread
 * and on several threads sharing one pool.
 *
 *   pool_bench [--backend=cuda|host] [--pairs=N] [--threads=LIST] [--help]
 *
 * Each size is warmed up first (the pool maps it once), then timed over --pairs pairs; the pool's map
 * calls are checked to have stayed constant during the timed part, so the figure really is the allocator's
 * bookkeeping. With several threads, every thread allocates and frees its own buffers in the same pool;
 * the output is the mean wall time per pair and the aggregate pairs per second.
 */
#include <getopt.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuvmm.h>

#include "cli.h"

static const size_t sizes[] = {256, 4096, 64 << 10, 512 << 10, 2 << 20, 32 << 20};
#define NSIZES (sizeof(sizes) / sizeof(sizes[0]))

static struct cuvmm_pool *pool;
static long pairs = 200000;

static double now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

static int check(int err, const char *what)
{
	if (err)
		fprintf(stderr, "pool_bench: %s: %s\n", what, cuvmm_strerror(err));
	return err;
}

struct job {
	size_t size;
	double ns;
	int err;
};

/* Timed pairs of one size; two buffers alive at a time, as an allocator under a real workload has. */
static void *worker(void *arg)
{
	struct job *j = arg;
	void *keep, *p;
	double t0;

	j->err = check(cuvmm_malloc(pool, j->size, &keep), "malloc");
	if (j->err)
		return NULL;
	t0 = now_ns();
	for (long i = 0; i < pairs && !j->err; i++) {
		j->err = cuvmm_malloc(pool, j->size, &p);
		if (!j->err)
			j->err = cuvmm_free(pool, p);
	}
	j->ns = (now_ns() - t0) / (double)pairs;
	check(j->err, "malloc/free");
	cuvmm_free(pool, keep);
	return NULL;
}

static uint64_t map_calls(void)
{
	struct cuvmm_stats s = {.size = sizeof(s)};

	cuvmm_pool_stats(pool, &s);
	return s.map_calls;
}

int main(int argc, char **argv)
{
	static const struct option opts[] = {{"backend", required_argument, NULL, 'b'},
					     {"pairs", required_argument, NULL, 'p'},
					     {"threads", required_argument, NULL, 't'},
					     {"help", no_argument, NULL, 'h'},
					     {NULL, 0, NULL, 0}};
	static const char help[] =
		"Usage: pool_bench [OPTION]...\n"
		"The cost of a malloc + free pair served from mapped memory, on one thread and on several threads\n"
		"sharing one pool.\n"
		"\n"
		"  --backend=NAME   cuda or host (default: $CUVMM_BACKEND, else cuda, falling back to host)\n"
		"  --pairs=N        timed malloc+free pairs per thread and size, 1 to 1000000000 (default 200000)\n"
		"  --threads=LIST   comma-separated thread counts, each 1 to 64 (default 1,2,4)\n"
		"  --help           print this help and exit\n"
		"\n"
		"Exit status: 0 on success, 1 on a failure, 2 for a usage error.\n";
	const char *threads = "1,2,4";
	int nthreads[64], nlist = 0;
	struct cuvmm_config cfg;
	struct cuvmm_ctx *ctx;
	int c, err;

	cli_init(argv[0]);
	cuvmm_config_init(&cfg);
	while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
		switch (c) {
		case 'b':
			cfg.backend = cli_choice("backend", optarg, CLI_BACKENDS) ? CUVMM_BACKEND_HOST : CUVMM_BACKEND_CUDA;
			break;
		case 'p':
			pairs = (long)cli_int("pairs", optarg, 1, 1000000000);
			break;
		case 't':
			threads = optarg;
			break;
		case 'h':
			cli_help(help);
		default:
			cli_bad_usage();
		}
	}
	cli_no_operands(argc, argv, optind);
	/* The whole list is checked before anything runs: "a,b" or "0" is an error, not an empty run. */
	for (const char *t = threads;;) {
		char item[32];
		size_t len = strcspn(t, ",");

		if (len == 0 || len >= sizeof(item) || nlist == 64)
			cli_fail("--threads=%s: want a comma-separated list of up to 64 counts", threads);
		memcpy(item, t, len);
		item[len] = 0;
		char *end;
		long v = strtol(item, &end, 10);

		if (*item < '0' || *item > '9' || *end || v < 1 || v > 64)
			cli_fail("--threads=%s: '%s' is not a thread count from 1 to 64", threads, item);
		nthreads[nlist++] = (int)v;
		if (!t[len])
			break;
		t += len + 1;
	}
	cfg.release_delay_ms = -1; /* nothing is given back while timing: the memory stays mapped */
	err = cuvmm_ctx_create(&cfg, &ctx);
	if (err && cfg.backend != CUVMM_BACKEND_HOST) {
		fprintf(stderr, "pool_bench: no GPU (%s): running on the host backend\n", cuvmm_strerror(err));
		cfg.backend = CUVMM_BACKEND_HOST;
		err = cuvmm_ctx_create(&cfg, &ctx);
	}
	if (check(err, "cuvmm_ctx_create") || check(cuvmm_pool_create(ctx, NULL, &pool), "cuvmm_pool_create"))
		return 1;
	printf("pool_bench: %s backend, %ld malloc+free pairs per thread and size, served from mapped memory\n",
	       cuvmm_ctx_backend(ctx) == CUVMM_BACKEND_HOST ? "host" : "CUDA", pairs);
	printf("%10s %8s %14s %16s %10s\n", "size", "threads", "ns per pair", "pairs/s (all)", "map calls");
	for (int ti = 0; ti < nlist; ti++) {
		int n = nthreads[ti];

		for (size_t s = 0; s < NSIZES; s++) {
			pthread_t tid[64];
			struct job job[64];
			uint64_t maps;
			double mean = 0;

			/* Warm up: all threads' buffers (two each) mapped at once, then freed; they stay mapped
			 * (release delay -1), so the timed part below maps nothing. */
			void *warm[128];

			for (int i = 0; i < 2 * n; i++)
				if (check(cuvmm_malloc(pool, sizes[s], &warm[i]), "warm-up malloc"))
					return 1;
			for (int i = 0; i < 2 * n; i++)
				cuvmm_free(pool, warm[i]);
			for (int i = 0; i < n; i++)
				job[i] = (struct job){.size = sizes[s]};
			maps = map_calls();
			for (int i = 0; i < n; i++)
				pthread_create(&tid[i], NULL, worker, &job[i]);
			for (int i = 0; i < n; i++) {
				pthread_join(tid[i], NULL);
				if (job[i].err)
					return 1;
				mean += job[i].ns / n;
			}
			printf("%10zu %8d %14.1f %16.0f %10llu\n", sizes[s], n, mean, 1e9 / mean * n,
			       (unsigned long long)(map_calls() - maps));
		}
	}
	cuvmm_pool_destroy(pool);
	cuvmm_ctx_destroy(ctx);
	return 0;
}
