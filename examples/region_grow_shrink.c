/*
 * region_grow_shrink: a buffer that grows and shrinks in place, at a fixed address.
 *
 * A region reserves address space once; cuvmm_region_resize() backs a prefix of it with physical memory in
 * chunks of the granularity (2 MiB on current GPUs). Pointers into the kept part stay valid, with their
 * contents. A shrink does not return memory to the driver at once: the context caches the chunks for reuse
 * and gives them back after release_delay_ms of idleness, or at once on cuvmm_ctx_trim().
 *
 * Usage: region_grow_shrink [-n GIB | --gib=GIB] [--help]   (default 4 GiB on a GPU, 1 GiB on the host backend)
 * CUVMM_BACKEND=host|cuda picks the backend; unset, the GPU is tried first, then the host backend.
 */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuvmm.h>

#include "cli.h"

#define MiB (1024.0 * 1024.0)

/* Every cuvmm call returns 0 or a negative CUVMM_E* code: stop on the first failure. */
#define CHECK(call)                                                                                          \
	do {                                                                                                 \
		int err_ = (call);                                                                           \
		if (err_ != CUVMM_OK) {                                                                      \
			fprintf(stderr, "%s:%d: %s failed: %s (%s)\n", __FILE__, __LINE__, #call,            \
				cuvmm_strerror(err_), cuvmm_err_name(err_));                                 \
			exit(1);                                                                             \
		}                                                                                            \
	} while (0)

static double now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* The byte expected at offset i: changes every 4 KiB page, so a page mapped at the wrong place shows. */
#define PATTERN(i) ((unsigned char)(((i) >> 12) * 131 + 7))

/* Host backend only, where the region's "device pointer" is a host address the CPU may use: write the
 * pattern over [from, to), or check that it is there, a 4 KiB page (or part of one) at a time. */
static void pattern(unsigned char *p, size_t from, size_t to, bool check)
{
	unsigned char page[4096];

	for (size_t i = from, next; i < to; i = next) {
		next = (i | 4095) + 1 < to ? (i | 4095) + 1 : to;
		memset(check ? page : p + i, PATTERN(i), next - i);
		if (check && memcmp(p + i, page, next - i)) {
			fprintf(stderr, "contents lost in the page at offset %zu\n", i);
			exit(1);
		}
	}
}

static void report(struct cuvmm_ctx *ctx, struct cuvmm_region *r, const char *what, double ms)
{
	struct cuvmm_stats rs = {.size = sizeof(rs)}, ds = {.size = sizeof(ds)};
	CHECK(cuvmm_region_stats(r, &rs));   /* this region */
	CHECK(cuvmm_ctx_stats(ctx, 0, &ds)); /* device 0 as a whole, cached chunks included */
	printf("%-10s %8.2f ms | region: reserved %6.0f  held %6.0f  mapped %6.0f  live %6.0f MiB"
	       " | device held %6.0f MiB\n",
	       what, ms, rs.reserved_bytes / MiB, rs.held_bytes / MiB, rs.mapped_bytes / MiB, rs.live_bytes / MiB,
	       ds.held_bytes / MiB);
}

int main(int argc, char **argv)
{
	static const struct option opts[] = {{"gib", required_argument, NULL, 'n'},
					     {"help", no_argument, NULL, 'h'},
					     {NULL, 0, NULL, 0}};
	static const char help[] =
		"Usage: region_grow_shrink [OPTION]...\n"
		"A buffer that grows and shrinks in place at a fixed address (cuvmm_region_resize).\n"
		"\n"
		"  -n, --gib=GIB   largest size of the buffer, in GiB (a positive number, up to 1024);\n"
		"                  default 4 on a GPU, 1 on the host backend\n"
		"  -h, --help      print this help and exit\n"
		"\n"
		"CUVMM_BACKEND=host|cuda picks the backend; unset, the GPU is tried first, then the host backend.\n"
		"Exit status: 0 on success, 1 if a check fails, 2 for a usage error.\n";
	struct cuvmm_config cfg;
	struct cuvmm_ctx *ctx;
	struct cuvmm_region *r;
	struct cuvmm_stats ds = {.size = sizeof(ds)};
	double gib = 0, t0, ms;
	int c, err;

	cli_init(argv[0]);
	while ((c = getopt_long(argc, argv, "n:h", opts, NULL)) != -1) {
		switch (c) {
		case 'n':
			gib = cli_double("gib", optarg, 0, 1024);
			if (gib == 0)
				cli_fail("--gib=%s: must be positive", optarg);
			break;
		case 'h':
			cli_help(help);
		default:
			cli_bad_usage();
		}
	}
	cli_no_operands(argc, argv, optind);

	/* Defaults, then the CUVMM_* environment variables. Without CUVMM_BACKEND, ask for the GPU: the AUTO
	 * backend never falls back to the host by itself, so we do it here, and say so. */
	cuvmm_config_init(&cfg);
	if (!getenv("CUVMM_BACKEND"))
		cfg.backend = CUVMM_BACKEND_CUDA;
	err = cuvmm_ctx_create(&cfg, &ctx);
	if ((err == CUVMM_ENODRIVER || err == CUVMM_ENODEV) && !getenv("CUVMM_BACKEND")) {
		printf("no GPU found (%s): running on the host backend (host memory with the same semantics)\n",
		       cuvmm_strerror(err));
		cfg.backend = CUVMM_BACKEND_HOST;
		err = cuvmm_ctx_create(&cfg, &ctx);
	}
	if (err) {
		fprintf(stderr, "cuvmm_ctx_create failed: %s (%s)\n", cuvmm_strerror(err), cuvmm_err_name(err));
		return 1;
	}
	bool host = cuvmm_ctx_backend(ctx) == CUVMM_BACKEND_HOST;
	gib = gib ? gib : host ? 1 : 4;

	/* Reserve N GiB of address space on device 0. */
	CHECK(cuvmm_region_create(ctx, 0, (size_t)(gib * 1024 * MiB), &r));
	size_t size = cuvmm_region_size(r); /* rounded up to the granularity */
	unsigned char *base = cuvmm_region_base(r);
	printf("cuvmm %s, %s backend: region of %.0f MiB at %p, granularity %zu KiB\n", cuvmm_version(),
	       host ? "host" : "CUDA", size / MiB, (void *)base, cuvmm_region_granularity(r) / 1024);
	report(ctx, r, "reserved", 0); /* nothing backed yet */

	/* Grow by quarters, then shrink by quarters down to nothing. The NULL stream makes each shrink wait
	 * for all work on the device, as cudaFree does, so the memory is unmapped when the call returns. */
	static const int steps[] = {1, 2, 3, 4, 3, 2, 1, 0};
	size_t cur = 0;
	for (size_t i = 0; i < sizeof(steps) / sizeof(steps[0]); i++) {
		size_t want = size / 4 * steps[i]; /* resize rounds up to the granularity */
		char what[32];
		t0 = now_ms();
		CHECK(cuvmm_region_resize(r, want, NULL));
		ms = now_ms() - t0;
		if (host) {
			/* The kept prefix must still hold what was written; a grow adds fresh memory after it. */
			pattern(base, 0, want < cur ? want : cur, true);
			pattern(base, cur, want, false); /* nothing when shrinking */
		}
		snprintf(what, sizeof(what), "%s %d/4", want >= cur ? "grow" : "shrink", steps[i]);
		report(ctx, r, what, ms);
		cur = want;
	}
	printf("%s\n", host ? "contents verified after every step" : "(contents not checked: device memory)");

	/* Nothing is mapped now, but the chunks are still held by the context, cached for the next grow; the
	 * background thread gives them back after release_delay_ms of idleness (-1: never, 0: at once). */
	CHECK(cuvmm_ctx_stats(ctx, 0, &ds));
	printf("after the shrink: device held %.0f MiB, mapped %.0f MiB: %s (release_delay_ms %lld)\n",
	       ds.held_bytes / MiB, ds.mapped_bytes / MiB, ds.held_bytes ? "cached for reuse" : "already given back",
	       (long long)cfg.release_delay_ms);

	/* Give every cached chunk back to the driver now, on all devices (-1), keeping nothing (0). */
	t0 = now_ms();
	CHECK(cuvmm_ctx_trim(ctx, -1, 0));
	ms = now_ms() - t0;
	CHECK(cuvmm_ctx_stats(ctx, 0, &ds));
	printf("after cuvmm_ctx_trim (%.2f ms): device held %.0f MiB\n", ms, ds.held_bytes / MiB);
	if (ds.held_bytes != 0) {
		fprintf(stderr, "expected nothing held after the trim\n");
		return 1;
	}

	cuvmm_region_destroy(r); /* frees the address space */
	cuvmm_ctx_destroy(ctx);
	return 0;
}
