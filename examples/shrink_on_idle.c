/*
 * shrink_on_idle: a simulated inference server whose memory falls back to what it uses once it is idle.
 *
 * Three objects share one context, as in a real server:
 *   weights      a pool holding the model's layers, allocated once and kept for the whole run;
 *   kv           a KV-blocks object (paged attention): requests take blocks as they decode and give them
 *                all back when they finish;
 *   activations  a pool of per-step temporaries: a few MiB and a handful of small buffers, allocated and
 *                freed on every decode step.
 * Requests come in bursts with idle gaps between them. While a burst runs, the context keeps freed memory
 * mapped for reuse ("held" > "live"); once nothing has been allocated or freed for release_delay_ms, the
 * background thread gives it back to the driver and held falls back to live. Every 100 ms a line shows live
 * and held for each object, the chunk cache (chunks the context holds unmapped, for reuse, until the release
 * delay), the device as a whole (the objects' held plus the cache: the columns add up) and the driver's free
 * memory, so you can watch it. On the host backend the "device" is host memory and the columns say so.
 *
 * The run ends with a summary and doubles as a test: it exits 1 if, after the final idle gap, the device
 * still holds more than cuvmm promises (live rounded up to the granularity of each allocation, plus
 * retain_bytes).
 *
 * Usage: shrink_on_idle [OPTION]...   (--help describes the options)
 * Weights are 2 GiB on a GPU, 256 MiB on the host backend. CUVMM_BACKEND=host|cuda picks the backend;
 * unset, the GPU is tried first, then the host backend.
 */
#include <getopt.h>
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>

#include "cli.h"
#include "example_util.h"

/* ----- the simulated workload ----- */

struct shape {
	size_t layers;           /* weights: one large allocation per layer ... */
	size_t layer_bytes;
	size_t norm_bytes;       /* ... and one small one (a norm vector) */
	size_t kv_token_bytes;   /* KV bytes per token, all layers together */
	uint32_t block_tokens;   /* tokens per KV block */
	uint32_t concurrency;    /* requests decoding at once */
	uint32_t requests;       /* requests per burst */
	uint32_t prompt_lo, prompt_hi, output_lo, output_hi; /* tokens, uniform */
	uint32_t tokens_per_step;
	double step_ms;          /* simulated compute time of one decode step */
	size_t act_per_request;  /* activations of one step: hidden states ... */
	size_t logits_per_request; /* ... logits ... */
	size_t small_bytes;      /* ... and 8 small buffers up to this size */
};

static const struct shape gpu_shape = {
	.layers = 8, .layer_bytes = 256u << 20, .norm_bytes = 64u << 10,
	.kv_token_bytes = 128u << 10, .block_tokens = 16,
	.concurrency = 16, .requests = 32, .prompt_lo = 128, .prompt_hi = 1024, .output_lo = 64, .output_hi = 384,
	.tokens_per_step = 4, .step_ms = 10,
	.act_per_request = 256u << 10, .logits_per_request = 128u << 10, .small_bytes = 32u << 10,
};
static const struct shape host_shape = {
	.layers = 8, .layer_bytes = 32u << 20, .norm_bytes = 64u << 10,
	.kv_token_bytes = 16u << 10, .block_tokens = 16,
	.concurrency = 16, .requests = 32, .prompt_lo = 128, .prompt_hi = 1024, .output_lo = 64, .output_hi = 384,
	.tokens_per_step = 4, .step_ms = 10,
	.act_per_request = 32u << 10, .logits_per_request = 16u << 10, .small_bytes = 8u << 10,
};
static const struct shape quick_shape = {
	.layers = 8, .layer_bytes = 2u << 20, .norm_bytes = 16u << 10,
	.kv_token_bytes = 16u << 10, .block_tokens = 16,
	.concurrency = 8, .requests = 16, .prompt_lo = 32, .prompt_hi = 256, .output_lo = 32, .output_hi = 128,
	.tokens_per_step = 4, .step_ms = 5,
	.act_per_request = 32u << 10, .logits_per_request = 16u << 10, .small_bytes = 8u << 10,
};

struct request {
	uint32_t prompt, output; /* tokens */
	uint32_t tokens;         /* tokens in the KV cache so far */
	uint32_t nblocks, cap;   /* blocks held, room in ids */
	uint32_t *ids;           /* its block table */
};

static uint64_t rng_state = 42;

static uint32_t uniform(uint32_t lo, uint32_t hi)
{
	return lo + (uint32_t)(ex_mix64(rng_state++) % (hi - lo + 1));
}

/* ----- what the sampler thread watches ----- */

static struct {
	struct cuvmm_ctx *ctx;
	struct cuvmm_pool *weights, *act;
	struct cuvmm_kv *kv;
	bool host;
	FILE *csv;
	double t0, bar_bytes;
	uint64_t bound;              /* held the device may keep once idle (see main) */
	atomic_int phase;            /* k > 0: burst k; -k: the idle gap after burst k; 0: setup */
	atomic_bool stop;
	pthread_mutex_t lock;        /* guards the fields below */
	double idle_start[64];       /* when the idle gap after burst k began (ms since t0) */
	double back_ms[64];          /* how long into that gap held came within the bound; < 0: not yet */
} W = {.lock = PTHREAD_MUTEX_INITIALIZER};

static void stats_of_pool(struct cuvmm_pool *p, struct cuvmm_stats *s)
{
	s->size = sizeof(*s); /* the struct can grow: tell the library which version we have */
	CHECK(cuvmm_pool_stats(p, s));
}

/* "1234" for big numbers, "12.3" for small ones, so both the GPU and the host sizes read well. */
static const char *mib(char *buf, uint64_t bytes)
{
	double m = bytes / EX_MiB;

	snprintf(buf, 16, m >= 1000 ? "%6.0f" : "%6.1f", m);
	return buf;
}

static void phase_name(int phase, char *buf, size_t n)
{
	if (phase > 0)
		snprintf(buf, n, "burst %d", phase % 100);
	else if (phase < 0)
		snprintf(buf, n, "idle");
	else
		snprintf(buf, n, "setup");
}

/* One sample: read the statistics (all thread-safe), print a line, append to the CSV. */
static void sample(void)
{
	struct cuvmm_stats w, a, k = {.size = sizeof(k)}, d = {.size = sizeof(d)};
	char b[5][2][16], ph[16], bar[41];
	uint64_t objects, cache;
	double t = ex_now_ms() - W.t0;
	int phase = atomic_load(&W.phase);
	size_t free_b = 0, total_b = 0;

	stats_of_pool(W.weights, &w);
	stats_of_pool(W.act, &a);
	CHECK(cuvmm_kv_stats(W.kv, &k));
	CHECK(cuvmm_ctx_stats(W.ctx, 0, &d)); /* the device as a whole: all objects, plus cached chunks */
	if (W.host)
		free_b = ex_host_mem_available(); /* the host backend's memory is the machine's */
	else
		CU_CHECK(ex_cu_mem_info(&free_b, &total_b));
	phase_name(phase, ph, sizeof(ph));
	/* What the device holds beyond the objects: chunks unmapped and cached for reuse until the delay. The
	 * statistics are read one after another, so clamp a transient difference at 0. */
	objects = w.held_bytes + k.held_bytes + a.held_bytes;
	cache = d.held_bytes > objects ? d.held_bytes - objects : 0;

	/* The bar: '#' for live bytes, '.' for held bytes that are not live (kept for reuse, or waiting for
	 * the release delay), on a fixed scale so that lines compare. */
	int nl = (int)(40.0 * d.live_bytes / W.bar_bytes + 0.5), nh = (int)(40.0 * d.held_bytes / W.bar_bytes + 0.5);
	nh = nh > 40 ? 40 : nh;
	nl = nl > nh ? nh : nl;
	memset(bar, '#', (size_t)nl);
	memset(bar + nl, '.', (size_t)(nh - nl));
	bar[nh] = 0;
	printf("%6.1f %-8s| %s/%s | %s/%s | %s/%s | %s | %s/%s | %7.1f GiB |%-40s|\n", t / 1e3, ph,
	       mib(b[0][0], w.live_bytes), mib(b[0][1], w.held_bytes), mib(b[1][0], k.live_bytes),
	       mib(b[1][1], k.held_bytes), mib(b[2][0], a.live_bytes), mib(b[2][1], a.held_bytes),
	       mib(b[4][0], cache), mib(b[3][0], d.live_bytes), mib(b[3][1], d.held_bytes), free_b / EX_GiB, bar);
	fflush(stdout);

	if (W.csv) {
		const char *names[4] = {"weights", "kv", "activations", "device"};
		const struct cuvmm_stats *s[4] = {&w, &k, &a, &d};

		for (int i = 0; i < 4; i++)
			fprintf(W.csv, "%.1f,%s,%s,%llu,%llu,\n", t, ph, names[i], (unsigned long long)s[i]->live_bytes,
				(unsigned long long)s[i]->held_bytes);
		fprintf(W.csv, "%.1f,%s,cache,0,%llu,\n", t, ph, (unsigned long long)cache);
		fprintf(W.csv, "%.1f,%s,%s,,,%llu\n", t, ph, W.host ? "host_available" : "gpu_free",
			(unsigned long long)free_b);
	}

	/* Note when, in an idle gap, the device's held memory first came within the promised bound. */
	pthread_mutex_lock(&W.lock);
	if (phase < 0 && -phase < 64 && W.back_ms[-phase] < 0 && d.held_bytes <= W.bound)
		W.back_ms[-phase] = t - W.idle_start[-phase];
	pthread_mutex_unlock(&W.lock);
}

static void *sampler(void *arg)
{
	(void)arg;
	for (double next = ex_now_ms(); !atomic_load(&W.stop); next += 100) {
		sample();
		ex_sleep_ms(next + 100 - ex_now_ms());
	}
	return NULL;
}

/* ----- the server ----- */

/* One decode step's temporaries: allocated at the start of the step, used by its kernels, freed at its
 * end. On the GPU they are stream-ordered, as a real server's would be: malloc_async and free_async on the
 * stream the kernels run on, so the next step's allocations can reuse the memory at once, without waiting
 * for the GPU. */
#define NACT 10

static void activations_alloc(const struct shape *sh, uint32_t active, CUstream stream, void **p)
{
	size_t sizes[NACT];
	int n = 0;

	sizes[n++] = sh->act_per_request * active;    /* hidden states */
	sizes[n++] = sh->logits_per_request * active; /* logits */
	while (n < NACT)
		sizes[n++] = uniform(256, (uint32_t)sh->small_bytes); /* small odds and ends */
	for (int i = 0; i < NACT; i++) {
		if (W.host) {
			CHECK(cuvmm_malloc(W.act, sizes[i], &p[i]));
			memset(p[i], 0, sizes[i]); /* host backend: "device" memory is CPU memory */
		} else {
			CHECK(cuvmm_malloc_async(W.act, sizes[i], stream, &p[i]));
			CU_CHECK(ex_cu_fill(p[i], sizes[i] / 4, i, stream)); /* a kernel writes it */
		}
	}
}

static void activations_free(void **p, CUstream stream)
{
	for (int i = 0; i < NACT; i++)
		CHECK(W.host ? cuvmm_free(W.act, p[i]) : cuvmm_free_async(W.act, p[i], stream));
}

/* Give a request the blocks it needs for `tokens` tokens. */
static void kv_grow(const struct shape *sh, struct request *r, uint32_t tokens)
{
	uint32_t need = (tokens + sh->block_tokens - 1) / sh->block_tokens;

	if (need > r->nblocks) {
		/* All or nothing: the ids are written only when every block is backed in every tensor. */
		CHECK(cuvmm_kv_alloc(W.kv, need - r->nblocks, r->ids + r->nblocks));
		r->nblocks = need;
	}
	r->tokens = tokens;
}

static void burst(const struct shape *sh, int k, CUstream stream)
{
	struct request *reqs = calloc(sh->requests, sizeof(*reqs));
	uint32_t *active = calloc(sh->concurrency, sizeof(*active));
	uint32_t next = 0, nactive = 0;

	atomic_store(&W.phase, k);
	while (next < sh->requests || nactive > 0) {
		/* Admit new requests: their prompt's KV is written at once (prefill). */
		while (nactive < sh->concurrency && next < sh->requests) {
			struct request *r = &reqs[next];

			r->prompt = uniform(sh->prompt_lo, sh->prompt_hi);
			r->output = uniform(sh->output_lo, sh->output_hi);
			r->cap = (r->prompt + r->output + sh->block_tokens - 1) / sh->block_tokens;
			r->ids = calloc(r->cap, sizeof(*r->ids));
			kv_grow(sh, r, r->prompt);
			active[nactive++] = next++;
		}
		/* One decode step: temporaries, then a few tokens per request; finished requests free their
		 * blocks (on the GPU ordered after the step's work on the stream). */
		void *act[NACT];
		activations_alloc(sh, nactive, stream, act);
		uint32_t keep = 0;
		for (uint32_t i = 0; i < nactive; i++) {
			struct request *r = &reqs[active[i]];
			uint32_t t = r->tokens + sh->tokens_per_step, end = r->prompt + r->output;

			kv_grow(sh, r, t < end ? t : end);
			if (r->tokens < end) {
				active[keep++] = active[i];
				continue;
			}
			CHECK(cuvmm_kv_free(W.kv, r->nblocks, r->ids, W.host ? NULL : stream));
			free(r->ids);
		}
		nactive = keep;
		ex_sleep_ms(sh->step_ms); /* the GPU would be computing here */
		activations_free(act, stream);
	}
	if (!W.host)
		CU_CHECK(ex_cu_stream_sync(stream));
	free(active);
	free(reqs);
}

int main(int argc, char **argv)
{
	static const struct option opts[] = {
		{"bursts", required_argument, NULL, 'b'}, {"idle-ms", required_argument, NULL, 'i'},
		{"release-delay-ms", required_argument, NULL, 'r'}, {"csv", required_argument, NULL, 'c'},
		{"quick", no_argument, NULL, 'q'}, {"help", no_argument, NULL, 'h'}, {NULL, 0, NULL, 0}};
	static const char help[] =
		"Usage: shrink_on_idle [OPTION]...\n"
		"A simulated inference server (weights pool, KV blocks, activations pool) whose held memory falls\n"
		"back to its live memory once it is idle; a line every 100 ms shows live/held per object, the chunk\n"
		"cache and the device (host memory on the host backend) as a whole.\n"
		"\n"
		"  --bursts=N              bursts of requests, 1 to 63 (default 4; 2 with --quick)\n"
		"  --idle-ms=MS            idle gap after each burst, 0 to 3600000 ms (default 1500; 500 with --quick)\n"
		"  --release-delay-ms=MS   the context's release_delay_ms: -1 never, 0 at once, up to 3600000\n"
		"                          (default 500, so the shrink shows quickly; 100 with --quick)\n"
		"  --csv=FILE              write the series t_ms,phase,object,live_bytes,held_bytes,free_bytes: per\n"
		"                          sample one row for weights, kv, activations, cache and device, and one\n"
		"                          \"gpu_free\" (CUDA) or \"host_available\" (host) row with the free memory;\n"
		"                          plot it with examples/plot_shrink_on_idle.py\n"
		"  --quick                 a short run with tiny sizes (the test suite's run, under 3 s); options\n"
		"                          given explicitly keep their values\n"
		"  --help                  print this help and exit\n"
		"\n"
		"CUVMM_BACKEND=host|cuda picks the backend; unset, the GPU is tried first, then the host backend.\n"
		"Exit status: 0 on success, 1 if held memory stays above the bound after the idle gap, 2 for a\n"
		"usage error.\n";
	int bursts = 4, c;
	double idle_ms = 1500;
	long long delay = 500;
	const char *csv = NULL;
	bool quick = false, idle_set = false, delay_set = false, bursts_set = false;

	cli_init(argv[0]);
	while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
		switch (c) {
		case 'b': bursts = (int)cli_int("bursts", optarg, 1, 63); bursts_set = true; break;
		case 'i': idle_ms = cli_double("idle-ms", optarg, 0, 3600000); idle_set = true; break;
		case 'r': delay = cli_int("release-delay-ms", optarg, -1, 3600000); delay_set = true; break;
		case 'c': csv = optarg; break;
		case 'q': quick = true; break;
		case 'h': cli_help(help);
		default: cli_bad_usage();
		}
	}
	cli_no_operands(argc, argv, optind);
	if (quick) { /* the test suite's run: short, tiny */
		bursts = bursts_set ? bursts : 2;
		idle_ms = idle_set ? idle_ms : 500;
		delay = delay_set ? delay : 100;
	}

	/* The context: memory that has been free for release_delay_ms goes back to the driver, given back by a
	 * background thread (background_release, on by default) while the application is idle. */
	struct cuvmm_config cfg;
	cuvmm_config_init(&cfg); /* defaults, then CUVMM_* environment variables */
	cfg.release_delay_ms = delay;
	W.host = ex_ctx_create(&cfg, &W.ctx, "shrink_on_idle");
	const struct shape *sh = quick ? &quick_shape : W.host ? &host_shape : &gpu_shape;
	size_t gran = ex_granularity(W.ctx);
	CUstream stream = NULL;
	if (!W.host)
		CU_CHECK(ex_cu_stream_create(&stream));

	/* Two pools, each with its own name (shown in cuvmm's logs) and its own reserved address space. */
	struct cuvmm_pool_config pc;
	cuvmm_pool_config_init(&pc);
	pc.name = "weights";
	pc.max_bytes = 2 * sh->layers * (sh->layer_bytes + gran); /* address space only: costs no memory */
	CHECK(cuvmm_pool_create(W.ctx, &pc, &W.weights));
	cuvmm_pool_config_init(&pc);
	pc.name = "activations";
	pc.max_bytes = (size_t)1 << 30;
	CHECK(cuvmm_pool_create(W.ctx, &pc, &W.act));

	/* The KV cache: K and V of every layer are parallel tensors sharing block ids; block b of tensor t is
	 * at cuvmm_kv_tensor(kv, t) + b * block_bytes. Sized for the worst case of a burst: every request at
	 * its longest (address space again; physical pages are mapped only where blocks are in use). */
	struct cuvmm_kv_config kc;
	cuvmm_kv_config_init(&kc);
	kc.tensors = (uint32_t)(2 * sh->layers);
	kc.block_bytes = sh->block_tokens * sh->kv_token_bytes / kc.tensors;
	kc.max_blocks = sh->concurrency * ((sh->prompt_hi + sh->output_hi) / sh->block_tokens + 1);
	CHECK(cuvmm_kv_create(W.ctx, &kc, &W.kv));

	/* Load the "model": one large tensor and one small one per layer, written once. The small ones share a
	 * granule (pools serve allocations up to 1 MiB from slabs). */
	uint64_t weights_bytes = 0;
	void **wptr = calloc(2 * sh->layers, sizeof(*wptr));
	W.bound = cfg.retain_bytes;
	for (size_t l = 0; l < sh->layers; l++) {
		size_t sizes[2] = {sh->layer_bytes, sh->norm_bytes};
		for (int i = 0; i < 2; i++) {
			void *p;
			CHECK(cuvmm_malloc(W.weights, sizes[i], &p));
			wptr[2 * l + i] = p;
			if (W.host)
				memset(p, 1, sizes[i]);
			else
				CU_CHECK(ex_cu_fill(p, sizes[i] / 4, l, stream));
			weights_bytes += sizes[i];
			/* cuvmm's promise: once idle, held <= live rounded up to the granularity of each allocation,
			 * plus retain_bytes. The weights are all that stays live, so that is the bound here. */
			W.bound += (sizes[i] + gran - 1) / gran * gran;
		}
	}
	if (!W.host)
		CU_CHECK(ex_cu_stream_sync(stream));

	printf("weights %.1f MiB in %zu layers; kv: %u tensors, %zu KiB blocks of %u tokens, room for %u blocks "
	       "(%.0f MiB); granularity %zu KiB\n",
	       weights_bytes / EX_MiB, sh->layers, kc.tensors, kc.block_bytes >> 10, sh->block_tokens, kc.max_blocks,
	       (double)kc.max_blocks * kc.block_bytes * kc.tensors / EX_MiB, gran >> 10);
	printf("%d bursts of %u requests (%u at once), %.0f ms idle after each; release_delay_ms %lld\n\n", bursts,
	       sh->requests, sh->concurrency, idle_ms, delay);
	/* On the host backend the "device" is host memory: say so. */
	const char *dev = W.host ? "host" : "device";
	char devh[16];
	snprintf(devh, sizeof(devh), "%s MiB", dev);
	printf("   t/s phase   | weights MiB   |      kv MiB   | activations   | cache  |%13s  | %-11s | %s held: "
	       "'#' live, '.' not live\n", devh, W.host ? "host avail" : "GPU free", dev);
	printf("               |  live/held    |  live/held    |  live/held    |  held  |  live/held    |             |\n");

	if (csv) {
		W.csv = fopen(csv, "w");
		if (!W.csv) {
			perror(csv);
			return 1;
		}
		fprintf(W.csv, "t_ms,phase,object,live_bytes,held_bytes,free_bytes\n");
	}
	/* The bar's scale: the weights plus the KV cache's worst case. */
	W.bar_bytes = weights_bytes + (double)kc.max_blocks * kc.block_bytes * kc.tensors;
	for (int k = 0; k < 64; k++)
		W.back_ms[k] = -1;
	W.t0 = ex_now_ms();
	pthread_t th;
	if (pthread_create(&th, NULL, sampler, NULL)) {
		fprintf(stderr, "cannot start the sampler thread\n");
		return 1;
	}

	for (int k = 1; k <= bursts; k++) {
		burst(sh, k, stream);
		/* Idle: no cuvmm call at all. The background thread gives the memory back by itself. */
		pthread_mutex_lock(&W.lock);
		W.idle_start[k] = ex_now_ms() - W.t0;
		pthread_mutex_unlock(&W.lock);
		atomic_store(&W.phase, -k);
		ex_sleep_ms(idle_ms);
	}
	atomic_store(&W.stop, true);
	pthread_join(th, NULL);
	sample(); /* the final state, once more */

	/* ----- summary ----- */
	struct cuvmm_stats d = {.size = sizeof(d)}, w, k = {.size = sizeof(k)}, a;
	CHECK(cuvmm_ctx_stats(W.ctx, 0, &d));
	CHECK(cuvmm_kv_stats(W.kv, &k));
	stats_of_pool(W.weights, &w);
	stats_of_pool(W.act, &a);
	printf("\nsummary (release_delay_ms %lld, idle gaps of %.0f ms):\n", delay, idle_ms);
	printf("  peak held %.1f MiB for a peak live of %.1f MiB (%.2fx); driver calls: %llu creates, %llu releases, "
	       "%llu maps, %llu unmaps, %.1f ms in all\n",
	       d.peak_held_bytes / EX_MiB, d.peak_live_bytes / EX_MiB,
	       d.peak_live_bytes ? (double)d.peak_held_bytes / d.peak_live_bytes : 0.0,
	       (unsigned long long)d.create_calls, (unsigned long long)d.release_calls,
	       (unsigned long long)d.map_calls, (unsigned long long)d.unmap_calls, d.driver_ns / 1e6);
	printf("  map calls by object (cuMemMap; mmap on the host backend): weights %llu, kv %llu, activations %llu "
	       "(memory given back and taken again between bursts, and within them where the slack exceeds its "
	       "cap)\n",
	       (unsigned long long)w.map_calls, (unsigned long long)k.map_calls, (unsigned long long)a.map_calls);
	for (int b = 1; b <= bursts; b++) {
		if (W.back_ms[b] >= 0)
			printf("  after burst %d: held back within the bound %.0f ms into the idle gap\n", b, W.back_ms[b]);
		else
			printf("  after burst %d: held did NOT come back within the bound during the idle gap\n", b);
	}
	printf("  after the final idle gap: %s held %.1f MiB, live %.1f MiB (weights %.1f/%.1f, kv %.1f/%.1f, "
	       "activations %.1f/%.1f live/held)\n", dev,
	       d.held_bytes / EX_MiB, d.live_bytes / EX_MiB, w.live_bytes / EX_MiB, w.held_bytes / EX_MiB,
	       k.live_bytes / EX_MiB, k.held_bytes / EX_MiB, a.live_bytes / EX_MiB, a.held_bytes / EX_MiB);
	printf("  bound: live rounded up per allocation + retain_bytes = %.1f MiB: %s\n", W.bound / EX_MiB,
	       d.held_bytes <= W.bound ? "OK" : "EXCEEDED");
	int status = d.held_bytes <= W.bound ? 0 : 1;
	if (status)
		fprintf(stderr, "shrink_on_idle: held %.1f MiB after %.0f ms idle exceeds the bound %.1f MiB\n",
			d.held_bytes / EX_MiB, idle_ms, W.bound / EX_MiB);
	if (W.csv && fclose(W.csv)) {
		perror(csv);
		status = 1;
	}

	/* Destroying an object gives all its memory back. A pool destroyed with live allocations warns about
	 * them, so unload the model first, as a real server would. */
	for (size_t i = 0; i < 2 * sh->layers; i++)
		CHECK(cuvmm_free(W.weights, wptr[i]));
	free(wptr);
	cuvmm_kv_destroy(W.kv);
	cuvmm_pool_destroy(W.act);
	cuvmm_pool_destroy(W.weights);
	if (!W.host)
		CU_CHECK(ex_cu_stream_destroy(stream));
	cuvmm_ctx_destroy(W.ctx);
	return status;
}
