/*
 * sleep_wake: give a model's GPU memory back to the driver while it is not needed, and get it back at the
 * same addresses.
 *
 * A "model" (random weights: 32 large tensors and 32 small ones) is loaded into a pool. A kernel computes
 * its checksum, and a CUDA graph of that kernel is captured. Then:
 *   1. cuvmm_pool_sleep(OFFLOAD) copies the contents to pinned host memory and releases the physical
 *      memory: the driver's free memory goes up by the model's size. The pool's addresses stay reserved.
 *   2. cuvmm_pool_wake() maps the same addresses again and copies the contents back. The checksum, run
 *      directly and by replaying the graph captured before the sleep, must be unchanged: pointers, and
 *      graphs holding them, survive.
 *   3. The same with DISCARD: nothing is copied (fast), and after wake the weights are reloaded.
 * The copy speeds of sleep and wake are compared with plain pinned copies of the same tensors in the same
 * run (cuMemcpyDtoH/HtoD into cuMemHostAlloc memory; on the host backend, memcpy).
 *
 * Exits 1 if a checksum does not match. On the host backend the "GPU" is host memory and the kernels are
 * CPU loops, so the run shows the same behaviour with CPU speeds.
 *
 * Usage: sleep_wake [--gib=GIB] [--quick] [--help]
 *   --gib    model size (default 8 on a GPU, 0.25 on the host backend)
 *   --quick  64 MiB (the test suite's run)
 * CUVMM_BACKEND=host|cuda picks the backend; unset, the GPU is tried first, then the host backend.
 */
#include <getopt.h>
#include <string.h>

#include "cli.h"
#include "example_util.h"

#define NT 32 /* large tensors, and as many small ones */

static bool host;
static CUstream stream;  /* the GPU work's stream (NULL on the host backend) */
static uint64_t *counter; /* the checksum's accumulator: device memory outside the pool (cuMemAlloc) */
static void *t_ptr[2 * NT];
static size_t t_bytes[2 * NT];

/* Write the weights: a pseudo-random pattern from a seed per tensor (a kernel on the GPU). */
static void load_weights(void)
{
	for (int i = 0; i < 2 * NT; i++) {
		if (host)
			ex_fill_host(t_ptr[i], t_bytes[i] / 4, 1000 + i);
		else
			CU_CHECK(ex_cu_fill(t_ptr[i], t_bytes[i] / 4, 1000 + i, stream));
	}
	if (!host)
		CU_CHECK(ex_cu_stream_sync(stream));
}

/* Queue the checksum of every tensor on the stream (the GPU work that a graph captures). */
static void queue_checksum(void)
{
	CU_CHECK(ex_cu_memset32_async(counter, 0, 2, stream));
	for (int i = 0; i < 2 * NT; i++)
		CU_CHECK(ex_cu_checksum(t_ptr[i], t_bytes[i] / 4, (uint64_t)i << 48, counter, stream));
}

/* The checksum of the model: by launching the kernels directly or, with a graph, by replaying it. */
static uint64_t checksum(CUgraphExec graph)
{
	uint64_t sum = 0;

	if (host) {
		for (int i = 0; i < 2 * NT; i++)
			ex_checksum_host(t_ptr[i], t_bytes[i] / 4, (uint64_t)i << 48, &sum);
		return sum;
	}
	if (graph)
		CU_CHECK(ex_cu_graph_launch(graph, stream));
	else
		queue_checksum();
	CU_CHECK(ex_cu_stream_sync(stream));
	CU_CHECK(ex_cu_memcpy_dtoh(&sum, counter, sizeof(sum)));
	return sum;
}

/* Device memory held by the context, and the driver's free memory (host backend: MemAvailable). */
static void memory(struct cuvmm_ctx *ctx, uint64_t *held, uint64_t *free_bytes)
{
	struct cuvmm_stats d = {.size = sizeof(d)};
	size_t f = 0, total = 0;

	CHECK(cuvmm_ctx_stats(ctx, 0, &d));
	*held = d.held_bytes;
	if (host)
		f = ex_host_mem_available();
	else
		CU_CHECK(ex_cu_mem_info(&f, &total));
	*free_bytes = f;
}

static void verify(const char *when, uint64_t want, uint64_t graph_sum, bool have_graph, uint64_t direct)
{
	bool ok = direct == want && (!have_graph || graph_sum == want);

	printf("   checksum after %s: %016llx (%s)", when, (unsigned long long)direct, host ? "CPU" : "kernel");
	if (have_graph)
		printf(", %016llx (graph captured before the first sleep)", (unsigned long long)graph_sum);
	printf(": %s\n", ok ? "matches" : "MISMATCH");
	if (!ok) {
		fprintf(stderr, "sleep_wake: the model's contents changed across sleep and wake\n");
		exit(1);
	}
}

static double gbps(uint64_t bytes, double ms)
{
	return ms > 0 ? bytes / (ms * 1e6) : 0;
}

int main(int argc, char **argv)
{
	static const struct option opts[] = {{"gib", required_argument, NULL, 'g'},
					     {"quick", no_argument, NULL, 'q'},
					     {"help", no_argument, NULL, 'h'},
					     {NULL, 0, NULL, 0}};
	static const char help[] =
		"Usage: sleep_wake [OPTION]...\n"
		"Give a model's memory back with cuvmm_pool_sleep (OFFLOAD, then DISCARD) and bring it back at the\n"
		"same addresses with cuvmm_pool_wake; checks the contents and a CUDA graph captured before.\n"
		"\n"
		"  --gib=GIB   model size in GiB (a positive number, up to 1024); default 8 on a GPU, 0.25 on the\n"
		"              host backend\n"
		"  --quick     a 64 MiB model (the test suite's run); --gib wins if both are given\n"
		"  --help      print this help and exit\n"
		"\n"
		"CUVMM_BACKEND=host|cuda picks the backend; unset, the GPU is tried first, then the host backend.\n"
		"Exit status: 0 on success, 1 if a check fails, 2 for a usage error.\n";
	double gib = 0, t0;
	bool quick = false;
	int c;

	cli_init(argv[0]);
	while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
		switch (c) {
		case 'g':
			gib = cli_double("gib", optarg, 0, 1024);
			if (gib == 0)
				cli_fail("--gib=%s: must be positive", optarg);
			break;
		case 'q':
			quick = true;
			break;
		case 'h':
			cli_help(help);
		default:
			cli_bad_usage();
		}
	}
	cli_no_operands(argc, argv, optind);

	struct cuvmm_config cfg;
	struct cuvmm_ctx *ctx;
	cuvmm_config_init(&cfg);
	host = ex_ctx_create(&cfg, &ctx, "sleep_wake");
	gib = gib ? gib : quick ? 1.0 / 16 : host ? 0.25 : 8;
	if (!host) {
		CU_CHECK(ex_cu_stream_create(&stream));
		CU_CHECK(ex_cu_malloc((void **)&counter, sizeof(*counter)));
	}

	/* The model's pool. Its address space is reserved once; sleep keeps it reserved. */
	struct cuvmm_pool_config pc;
	struct cuvmm_pool *pool;
	cuvmm_pool_config_init(&pc);
	pc.name = "weights";
	pc.max_bytes = (size_t)(2 * gib * EX_GiB) + ((size_t)256 << 20);
	CHECK(cuvmm_pool_create(ctx, &pc, &pool));

	uint64_t model = 0;
	for (int i = 0; i < 2 * NT; i++) {
		/* even: a large tensor (its own granules); odd: a small one (slots in a shared granule) */
		t_bytes[i] = i % 2 == 0 ? (size_t)(gib * EX_GiB / NT) / 256 * 256 : 16384;
		CHECK(cuvmm_malloc(pool, t_bytes[i], &t_ptr[i]));
		model += t_bytes[i];
	}
	t0 = ex_now_ms();
	load_weights();
	double fill_ms = ex_now_ms() - t0;
	t0 = ex_now_ms();
	const uint64_t want = checksum(NULL);
	double sum_ms = ex_now_ms() - t0;

	struct cuvmm_stats ps = {.size = sizeof(ps)};
	CHECK(cuvmm_pool_stats(pool, &ps));
	printf("model: %d tensors of %.1f MiB and %d of 16 KiB = %.1f MiB in pool \"weights\" (live %.1f, held %.1f "
	       "MiB)\n", NT, t_bytes[0] / EX_MiB, NT, model / EX_MiB, ps.live_bytes / EX_MiB, ps.held_bytes / EX_MiB);
	printf("loaded in %.1f ms; checksum %016llx in %.1f ms (%s)\n", fill_ms, (unsigned long long)want, sum_ms,
	       host ? "CPU loop" : "kernel");

	/* A CUDA graph of the checksum, captured now, while the pool is awake. Its kernel nodes hold the
	 * tensors' addresses; since sleep keeps the addresses reserved, it can be replayed after wake. */
	CUgraphExec graph = NULL;
	if (!host) {
		CU_CHECK(ex_cu_capture_begin(stream));
		queue_checksum();
		CU_CHECK(ex_cu_capture_end(stream, &graph));
		uint64_t g = checksum(graph);
		printf("CUDA graph of the checksum captured; replay gives %016llx: %s\n", (unsigned long long)g,
		       g == want ? "matches" : "MISMATCH");
		if (g != want)
			return 1;
	}

	/* ----- the baseline: plain copies of the same tensors through pinned host memory ----- */
	void *buf;
	t0 = ex_now_ms();
	if (host) {
		buf = malloc(model);
		if (!buf) {
			fprintf(stderr, "out of host memory\n");
			return 1;
		}
		for (size_t off = 0; off < model; off += 4096) /* fault the pages in, as pinning would */
			((volatile char *)buf)[off] = 0;
	} else {
		CU_CHECK(ex_cu_host_alloc(&buf, model));
	}
	double pin_ms = ex_now_ms() - t0;
	t0 = ex_now_ms();
	for (size_t i = 0, off = 0; i < 2 * NT; off += t_bytes[i++]) {
		if (host)
			memcpy((char *)buf + off, t_ptr[i], t_bytes[i]);
		else
			CU_CHECK(ex_cu_memcpy_dtoh((char *)buf + off, t_ptr[i], t_bytes[i]));
	}
	double plain_d2h_ms = ex_now_ms() - t0;
	t0 = ex_now_ms();
	for (size_t i = 0, off = 0; i < 2 * NT; off += t_bytes[i++]) { /* the same bytes back: no harm done */
		if (host)
			memcpy(t_ptr[i], (char *)buf + off, t_bytes[i]);
		else
			CU_CHECK(ex_cu_memcpy_htod(t_ptr[i], (char *)buf + off, t_bytes[i]));
	}
	double plain_h2d_ms = ex_now_ms() - t0;
	t0 = ex_now_ms();
	if (host)
		free(buf);
	else
		CU_CHECK(ex_cu_host_free(buf));
	double unpin_ms = ex_now_ms() - t0;
	printf("\nplain copies of the %d tensors (%s):\n   %s %.1f ms; D2H %.1f ms = %.1f GB/s; H2D %.1f ms = %.1f GB/s; "
	       "%s %.1f ms\n",
	       2 * NT, host ? "memcpy" : "cuMemcpyDtoH/HtoD, pinned buffer", host ? "malloc+fault-in" : "cuMemHostAlloc",
	       pin_ms, plain_d2h_ms, gbps(model, plain_d2h_ms), plain_h2d_ms, gbps(model, plain_h2d_ms),
	       host ? "free" : "cuMemFreeHost", unpin_ms);

	/* ----- 1. sleep with OFFLOAD ----- */
	uint64_t held0, free0, held1, free1, held2, free2;
	CHECK(cuvmm_pool_stats(pool, &ps));
	uint64_t copied = ps.held_bytes; /* OFFLOAD copies every mapped granule of the pool */
	memory(ctx, &held0, &free0);
	t0 = ex_now_ms();
	CHECK(cuvmm_pool_sleep(pool, CUVMM_SLEEP_OFFLOAD, stream)); /* after the work queued on stream */
	double sleep_ms = ex_now_ms() - t0;
	memory(ctx, &held1, &free1);
	printf("\nOFFLOAD sleep: %.1f MiB copied out and released in %.1f ms = %.1f GB/s\n", copied / EX_MiB, sleep_ms,
	       gbps(copied, sleep_ms));
	printf("   device held %.1f -> %.1f MiB; %s %.2f -> %.2f GiB (%+.2f GiB)\n", held0 / EX_MiB, held1 / EX_MiB,
	       host ? "host MemAvailable" : "GPU free", free0 / EX_GiB, free1 / EX_GiB,
	       ((double)free1 - (double)free0) / EX_GiB);

	/* While asleep the pool keeps its live bytes (what wake brings back) but holds nothing, and refuses
	 * everything but wake, stats and destroy. */
	CHECK(cuvmm_pool_stats(pool, &ps));
	void *p = NULL;
	int err = cuvmm_malloc(pool, 4096, &p);
	printf("   asleep: pool live %.1f MiB, held %.1f MiB; cuvmm_malloc on it returns %s\n", ps.live_bytes / EX_MiB,
	       ps.held_bytes / EX_MiB, cuvmm_err_name(err));
	if (err != CUVMM_ESTATE) {
		fprintf(stderr, "sleep_wake: expected CUVMM_ESTATE from a sleeping pool\n");
		return 1;
	}

	/* ----- 2. wake: same addresses, same contents ----- */
	t0 = ex_now_ms();
	CHECK(cuvmm_pool_wake(pool, stream)); /* work queued on stream after this runs after the restore */
	double wake_ms = ex_now_ms() - t0;
	memory(ctx, &held2, &free2);
	printf("wake: %.1f MiB mapped and copied back in %.1f ms = %.1f GB/s; device held %.1f MiB; %s %.2f GiB\n",
	       copied / EX_MiB, wake_ms, gbps(copied, wake_ms), held2 / EX_MiB, host ? "host MemAvailable" : "GPU free",
	       free2 / EX_GiB);
	uint64_t direct = checksum(NULL), replay = host ? 0 : checksum(graph);
	verify("OFFLOAD + wake", want, replay, !host, direct);

	/* ----- 2b. the same again: wake kept the pinned buffer, so this cycle is copies and mappings only ----- */
	t0 = ex_now_ms();
	CHECK(cuvmm_pool_sleep(pool, CUVMM_SLEEP_OFFLOAD, stream));
	double sleep2_ms = ex_now_ms() - t0;
	t0 = ex_now_ms();
	CHECK(cuvmm_pool_wake(pool, stream));
	double wake2_ms = ex_now_ms() - t0;
	printf("second OFFLOAD cycle (pinned buffer kept by the first wake): sleep %.1f ms = %.1f GB/s, "
	       "wake %.1f ms = %.1f GB/s\n", sleep2_ms, gbps(copied, sleep2_ms), wake2_ms, gbps(copied, wake2_ms));
	direct = checksum(NULL);
	replay = host ? 0 : checksum(graph);
	verify("second OFFLOAD + wake", want, replay, !host, direct);

	/* ----- 3. sleep with DISCARD: nothing copied; the contents are gone, reload them after wake ----- */
	t0 = ex_now_ms();
	CHECK(cuvmm_pool_sleep(pool, CUVMM_SLEEP_DISCARD, stream));
	double dsleep_ms = ex_now_ms() - t0;
	memory(ctx, &held1, &free1);
	t0 = ex_now_ms();
	CHECK(cuvmm_pool_wake(pool, stream));
	double dwake_ms = ex_now_ms() - t0;
	memory(ctx, &held2, &free2);
	printf("\nDISCARD sleep: %.1f ms (device held %.1f MiB while asleep); wake: %.1f ms (held %.1f MiB); "
	       "contents now unspecified: reload\n", dsleep_ms, held1 / EX_MiB, dwake_ms, held2 / EX_MiB);
	load_weights();
	direct = checksum(NULL);
	replay = host ? 0 : checksum(graph);
	verify("DISCARD + wake + reload", want, replay, !host, direct);

	/* ----- summary: how close sleep and wake come to plain pinned copies ----- */
	double r_d2h = gbps(copied, sleep2_ms) / gbps(model, plain_d2h_ms);
	double r_h2d = gbps(copied, wake2_ms) / gbps(model, plain_h2d_ms);
	printf("\nsummary (%s backend, %.1f MiB):\n", host ? "host" : "CUDA", model / EX_MiB);
	printf("   steady state (second cycle; the pinned buffer is reused):\n");
	printf("   D2H: sleep(OFFLOAD) %6.1f GB/s vs plain pinned copy %6.1f GB/s = %3.0f%%\n", gbps(copied, sleep2_ms),
	       gbps(model, plain_d2h_ms), 100 * r_d2h);
	printf("   H2D: wake           %6.1f GB/s vs plain pinned copy %6.1f GB/s = %3.0f%%\n", gbps(copied, wake2_ms),
	       gbps(model, plain_h2d_ms), 100 * r_h2d);
	/* The first sleep also pins its buffer, which costs what the plain copies' buffer cost outside the
	 * timed copies: the fair comparison for a first cycle includes it. */
	printf("   first cycle (sleep pins its buffer): sleep %.1f GB/s, wake %.1f GB/s; against a plain copy that "
	       "pins too (%.1f ms): D2H %3.0f%%\n", gbps(copied, sleep_ms), gbps(copied, wake_ms), pin_ms,
	       100 * gbps(copied, sleep_ms) / gbps(model, pin_ms + plain_d2h_ms));
	/* The target is the GPU's: on the host backend sleep and wake also create and fault in memory, so the
	 * ratio says nothing about it. */
	if (!host)
		printf("   target >= 90%% of the plain copy each way (steady state): %s\n",
		       r_d2h >= 0.9 && r_h2d >= 0.9 ? "met" : "not met");

	if (graph)
		CU_CHECK(ex_cu_graph_destroy(graph));
	for (int i = 0; i < 2 * NT; i++)
		CHECK(cuvmm_free(pool, t_ptr[i]));
	cuvmm_pool_destroy(pool);
	if (!host) {
		CU_CHECK(ex_cu_free(counter));
		CU_CHECK(ex_cu_stream_destroy(stream));
	}
	cuvmm_ctx_destroy(ctx);
	return 0;
}
