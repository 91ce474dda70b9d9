/*
 * kv_server: a paged-attention KV cache on cuvmm's KV blocks, driven by a serving trace, with and without
 * compaction.
 *
 * The trace is the pool benchmark's (bench/trace.c, same generator and seed): 400 requests, at most 48 at
 * once; prompt ~ lognormal(6, 1) tokens clipped to [16, 4096], output ~ lognormal(5, 1) clipped to
 * [8, 2048]; new requests are admitted at the start of a decode step while fewer than 48 run, and every
 * running request generates one token per step. Here the KV cache is paged, as in vLLM: a block holds 16
 * tokens, a request holds ceil(tokens / 16) blocks in its block table, takes one more block when it crosses
 * a block boundary, and frees all of them when it finishes.
 *
 * The KV-blocks object keeps K and V of every layer as parallel tensors (32 layers: 64 tensors) that share
 * block ids; one block is 16 tokens x 2 KiB = 32 KiB per tensor, so a 2 MiB page of a tensor holds 64
 * blocks, and a page id is backed in all 64 tensors at once (128 MiB). Allocation fills the fullest mapped
 * pages first, so holes are reused; but a page goes back to the driver only when all its blocks are free,
 * and long requests keep sparse pages alive. Compaction fixes that: cuvmm_kv_compact() proposes moves that
 * drain the sparsest pages into free blocks of fuller ones; the server copies those blocks (every tensor),
 * updates its block tables and frees the sources, and the drained pages go back after the idle delay.
 *
 * The trace runs twice, without and with compaction (every --compact-every steps), each on a fresh
 * context, and the example reports held vs live over time and in summary, and what backing new pages cost
 * on the allocating thread compared with the pages the background thread mapped ahead of demand.
 *
 * Usage: kv_server [OPTION]...   (--help describes the options)
 * CUVMM_BACKEND=host|cuda picks the backend; unset, the GPU is tried first, then the host backend.
 */
#include <getopt.h>
#include <math.h>
#include <string.h>

#include "cli.h"
#include "example_util.h"

#define BLOCK_TOKENS 16
#define TENSOR_TOKEN_BYTES 2048 /* KV bytes of one token in one tensor (8 heads x 128 x fp16) */

static struct {
	uint32_t requests, concurrency, layers, compact_every;
	uint64_t seed;
	double scale, step_us;
	long long delay_ms;
	const char *csv;
	bool quick;
} opt = {.requests = 400, .concurrency = 48, .seed = 1, .scale = 1.0, .compact_every = 50, .step_us = 1000,
	 .delay_ms = 50};

static bool host;

/* ----- the trace: the benchmark's own generator (bench/kvtrace.h), so both replay the same requests ----- */

#include "kvtrace.h"

struct request {
	uint32_t prompt, output; /* tokens */
	uint32_t tokens, done;   /* tokens in the cache; output tokens generated */
	uint32_t nblocks, cap;   /* blocks in the table; its room */
	uint32_t *ids;           /* the block table: token i lives in block ids[i / 16] */
};

static struct request *make_trace(void)
{
	struct request *reqs = calloc(opt.requests, sizeof(*reqs));
	struct rng rng;

	rng_seed(&rng, opt.seed);
	/* Lengths are drawn up front, in request order, so they do not depend on the schedule. */
	for (uint32_t i = 0; i < opt.requests; i++) {
		reqs[i].prompt = (uint32_t)draw_tokens(&rng, 6.0, 1.0, 16, 4096, opt.scale);
		reqs[i].output = (uint32_t)draw_tokens(&rng, 5.0, 1.0, 8, 2048, opt.scale);
		reqs[i].cap = (reqs[i].prompt + reqs[i].output + BLOCK_TOKENS - 1) / BLOCK_TOKENS;
	}
	return reqs;
}

/* A dry run of the schedule, without memory: its steps, and the most blocks live at once (to size the KV
 * object). The same loop as run() below. */
static void dry_run(const struct request *reqs, uint32_t *steps, uint32_t *peak_blocks)
{
	uint32_t *active = calloc(opt.concurrency, sizeof(*active)), *tok = calloc(opt.requests, sizeof(*tok));
	uint32_t nactive = 0, next = 0, nsteps = 0;
	uint64_t live = 0, peak = 0;

#define BLOCKS(t) (((t) + BLOCK_TOKENS - 1) / BLOCK_TOKENS)
	while (next < opt.requests || nactive > 0) {
		while (nactive < opt.concurrency && next < opt.requests) {
			tok[next] = reqs[next].prompt;
			live += BLOCKS(tok[next]);
			active[nactive++] = next++;
		}
		peak = live > peak ? live : peak;
		uint32_t keep = 0;
		for (uint32_t i = 0; i < nactive; i++) {
			uint32_t q = active[i];

			live += BLOCKS(tok[q] + 1) - BLOCKS(tok[q]);
			tok[q]++;
			peak = live > peak ? live : peak;
			if (tok[q] - reqs[q].prompt < reqs[q].output)
				active[keep++] = q;
			else
				live -= BLOCKS(tok[q]);
		}
		nactive = keep;
		nsteps++;
	}
#undef BLOCKS
	*steps = nsteps;
	*peak_blocks = (uint32_t)peak;
	free(active);
	free(tok);
}

/* ----- one run of the trace ----- */

struct sample {
	double t_ms;
	uint32_t active;
	uint64_t live, held, dev_held;
};

struct result {
	const char *name;
	uint32_t steps, tail_from;          /* the tail: steps after the last admission */
	struct sample *s;
	double wall_ms;
	uint64_t peak_live, peak_held, held_after_idle;
	uint64_t alloc_calls, backing_calls, backed_pages, pages_total;
	double alloc_ns, backing_ns;        /* time in calls that mapped nothing / that mapped pages */
	double alloc_max_ns, backing_max_ns;
	uint64_t compactions, moves;
	double compact_ms;                  /* cuvmm_kv_compact() + copies + frees */
};

static struct cuvmm_ctx *ctx;
static struct cuvmm_kv *kv;
static uint32_t tensors;
static size_t block_bytes;
static CUstream stream;
static uint32_t *owner_req, *owner_slot; /* block id -> (request, index in its table), for compaction */
static struct result *cur;

/* Host backend only: the first 8 bytes of a block in every tensor hold (request, slot), written when the
 * block is taken and checked when it is freed, so a compaction move applied wrongly shows. */
static void tag(uint32_t b, uint64_t v, bool check)
{
	if (!host)
		return;
	for (uint32_t t = 0; t < tensors; t++) {
		uint64_t *p = (uint64_t *)((char *)cuvmm_kv_tensor(kv, t) + (size_t)b * block_bytes);
		if (!check) {
			*p = v;
		} else if (*p != v) {
			fprintf(stderr, "kv_server: block %u of tensor %u holds %llx, expected %llx\n", b, t,
				(unsigned long long)*p, (unsigned long long)v);
			exit(1);
		}
	}
}

static uint64_t tag_of(uint32_t req, uint32_t slot)
{
	return (uint64_t)(req + 1) << 32 | slot;
}

/* Grow request q's table to cover `tokens`, timing the allocation and noting whether it mapped pages. */
static void kv_grow(struct request *reqs, uint32_t q, uint32_t tokens)
{
	struct request *r = &reqs[q];
	uint32_t need = (tokens + BLOCK_TOKENS - 1) / BLOCK_TOKENS;
	struct cuvmm_stats before = {.size = sizeof(before)}, after = {.size = sizeof(after)};

	r->tokens = tokens;
	if (need <= r->nblocks)
		return;
	/* map_calls counts cuMemMap calls, one per tensor for each page id backed. The background thread
	 * may map a page ahead between the two reads, so the split is close, not exact. */
	CHECK(cuvmm_kv_stats(kv, &before));
	double t0 = ex_now_ms();
	CHECK(cuvmm_kv_alloc(kv, need - r->nblocks, r->ids + r->nblocks));
	double dt = (ex_now_ms() - t0) * 1e6;
	CHECK(cuvmm_kv_stats(kv, &after));
	uint64_t pages = (after.map_calls - before.map_calls) / tensors;
	if (pages) {
		cur->backing_calls++;
		cur->backed_pages += pages;
		cur->backing_ns += dt;
		cur->backing_max_ns = dt > cur->backing_max_ns ? dt : cur->backing_max_ns;
	} else {
		cur->alloc_calls++;
		cur->alloc_ns += dt;
		cur->alloc_max_ns = dt > cur->alloc_max_ns ? dt : cur->alloc_max_ns;
	}
	for (uint32_t i = r->nblocks; i < need; i++) {
		owner_req[r->ids[i]] = q;
		owner_slot[r->ids[i]] = i;
		tag(r->ids[i], tag_of(q, i), false);
	}
	r->nblocks = need;
}

/* Compaction: ask for a plan, apply it (copy, update the tables), free the sources. */
static void compact(struct request *reqs, struct cuvmm_kv_move *moves, uint32_t max_moves, uint32_t *from)
{
	uint32_t n = 0;
	double t0 = ex_now_ms();

	/* The destinations are allocated by this call; the pages it drains are mapped ones, none is mapped. */
	CHECK(cuvmm_kv_compact(kv, max_moves, moves, &n));
	if (n == 0)
		return;
	for (uint32_t i = 0; i < n; i++) {
		uint32_t a = moves[i].from, b = moves[i].to, q = owner_req[a], slot = owner_slot[a];

		for (uint32_t t = 0; t < tensors; t++) { /* block a -> block b, in every tensor */
			char *base = cuvmm_kv_tensor(kv, t);
			if (host)
				memcpy(base + (size_t)b * block_bytes, base + (size_t)a * block_bytes, block_bytes);
			else
				CU_CHECK(ex_cu_memcpy_dtod_async(base + (size_t)b * block_bytes,
								 base + (size_t)a * block_bytes, block_bytes, stream));
		}
		reqs[q].ids[slot] = b; /* the block table now points at the copy */
		owner_req[b] = q;
		owner_slot[b] = slot;
		from[i] = a;
	}
	/* Free the sources once the copies on the stream are done (on the host, they are). Their pages, now
	 * empty, go back to the driver after the release delay. */
	CHECK(cuvmm_kv_free(kv, n, from, host ? NULL : stream));
	cur->compactions++;
	cur->moves += n;
	cur->compact_ms += ex_now_ms() - t0;
}

static void run(struct result *res, struct request *reqs, bool compaction, uint32_t max_blocks, FILE *csv)
{
	struct cuvmm_config cfg;
	struct cuvmm_kv_config kc;
	uint32_t *active = calloc(opt.concurrency, sizeof(*active)), nactive = 0, next = 0;
	struct cuvmm_kv_move *moves = calloc(max_blocks, sizeof(*moves));
	uint32_t *from = calloc(max_blocks, sizeof(*from));
	struct cuvmm_stats ks = {.size = sizeof(ks)}, ds = {.size = sizeof(ds)};

	cur = res;
	res->name = compaction ? "compaction" : "no compaction";
	res->tail_from = UINT32_MAX;
	for (uint32_t i = 0; i < opt.requests; i++) {
		reqs[i].tokens = reqs[i].done = reqs[i].nblocks = 0;
		reqs[i].ids = calloc(reqs[i].cap, sizeof(*reqs[i].ids));
	}

	/* A fresh context per run, so that peaks and driver counters are the run's own. */
	cuvmm_config_init(&cfg);
	cfg.release_delay_ms = opt.delay_ms;
	cfg.backend = host ? CUVMM_BACKEND_HOST : CUVMM_BACKEND_CUDA;
	CHECK(cuvmm_ctx_create(&cfg, &ctx));
	cuvmm_kv_config_init(&kc);
	kc.tensors = tensors;
	kc.block_bytes = block_bytes;
	kc.max_blocks = max_blocks; /* address space only: pages are mapped where blocks are in use */
	CHECK(cuvmm_kv_create(ctx, &kc, &kv));

	if (compaction)
		printf("\nwith compaction every %u steps:\n", opt.compact_every);
	else
		printf("\nwithout compaction:\n");
	printf("   step    t/s active   live GiB   held GiB  held/live\n");
	double t_start = ex_now_ms();
	uint32_t step = 0, print_every = res->steps / 16 ? res->steps / 16 : 1;
	while (next < opt.requests || nactive > 0) {
		/* Admit: a new request's prompt is written into the cache at once (prefill). */
		while (nactive < opt.concurrency && next < opt.requests) {
			kv_grow(reqs, next, reqs[next].prompt);
			active[nactive++] = next++;
		}
		if (next == opt.requests && res->tail_from == UINT32_MAX)
			res->tail_from = step;
		/* Decode: one token per running request; a request that is done frees its whole table. Here the
		 * GPU would run the step's kernels on `stream`. */
		uint32_t keep = 0;
		for (uint32_t i = 0; i < nactive; i++) {
			uint32_t q = active[i];
			struct request *r = &reqs[q];

			kv_grow(reqs, q, r->tokens + 1);
			if (++r->done < r->output) {
				active[keep++] = q;
				continue;
			}
			for (uint32_t k = 0; k < r->nblocks; k++)
				tag(r->ids[k], tag_of(q, k), true);
			CHECK(cuvmm_kv_free(kv, r->nblocks, r->ids, host ? NULL : stream));
			free(r->ids);
			r->ids = NULL;
		}
		nactive = keep;
		if (compaction && step % opt.compact_every == opt.compact_every - 1)
			compact(reqs, moves, max_blocks, from);

		CHECK(cuvmm_kv_stats(kv, &ks));
		CHECK(cuvmm_ctx_stats(ctx, 0, &ds));
		if (step >= res->steps) {
			fprintf(stderr, "kv_server: the run took more steps than the dry run\n");
			exit(1);
		}
		struct sample *s = &res->s[step];
		*s = (struct sample){ex_now_ms() - t_start, nactive, ks.live_bytes, ks.held_bytes, ds.held_bytes};
		if (step % print_every == 0 || step + 1 == res->steps)
			printf("  %5u %6.2f %6u %10.2f %10.2f %9.2fx\n", step, s->t_ms / 1e3, s->active, s->live / EX_GiB,
			       s->held / EX_GiB, s->live ? (double)s->held / s->live : 0.0);
		if (csv)
			fprintf(csv, "%s,%u,%.3f,%u,%llu,%llu,%llu\n", compaction ? "compaction" : "none", step, s->t_ms,
				s->active, (unsigned long long)s->live, (unsigned long long)s->held,
				(unsigned long long)s->dev_held);
		step++;
		ex_sleep_ms(opt.step_us / 1e3);
	}
	if (!host)
		CU_CHECK(ex_cu_stream_sync(stream));
	res->steps = step;
	res->wall_ms = ex_now_ms() - t_start;
	CHECK(cuvmm_kv_stats(kv, &ks));
	res->peak_live = ks.peak_live_bytes;
	res->peak_held = ks.peak_held_bytes;
	res->pages_total = ks.map_calls / tensors;

	/* Idle: after release_delay_ms the background thread gives every empty page back. */
	ex_sleep_ms(opt.delay_ms + 200);
	CHECK(cuvmm_ctx_stats(ctx, 0, &ds));
	res->held_after_idle = ds.held_bytes;

	cuvmm_kv_destroy(kv);
	cuvmm_ctx_destroy(ctx);
	free(active);
	free(moves);
	free(from);
}

/* Held over live across steps [a, b): ratio of the sums (a time average, steps being equally long). */
static double ratio(const struct result *r, uint32_t a, uint32_t b)
{
	double h = 0, l = 0;

	for (uint32_t i = a; i < b; i++) {
		h += r->s[i].held;
		l += r->s[i].live;
	}
	return l ? h / l : 0;
}

int main(int argc, char **argv)
{
	static const struct option opts[] = {
		{"requests", required_argument, NULL, 'n'}, {"concurrency", required_argument, NULL, 'c'},
		{"seed", required_argument, NULL, 's'}, {"scale", required_argument, NULL, 'x'},
		{"layers", required_argument, NULL, 'l'}, {"compact-every", required_argument, NULL, 'k'},
		{"step-us", required_argument, NULL, 'u'}, {"release-delay-ms", required_argument, NULL, 'r'},
		{"csv", required_argument, NULL, 'f'}, {"quick", no_argument, NULL, 'q'},
		{"help", no_argument, NULL, 'h'}, {NULL, 0, NULL, 0}};
	static const char help[] =
		"Usage: kv_server [OPTION]...\n"
		"A paged-attention KV cache on cuvmm's KV blocks, driven by a serving trace (bench/trace.c's), run\n"
		"without and then with compaction; reports held vs live and what backing new pages cost.\n"
		"\n"
		"  --requests=N            requests in the trace, 1 to 10000000 (default 400; 100 with --quick)\n"
		"  --concurrency=N         requests running at once, 1 to 100000 (default 48)\n"
		"  --seed=S                the trace's PRNG seed, 0 to 2^63-1 (default 1)\n"
		"  --scale=F               multiply every token count by F, above 0 up to 100 (default 1.0; 0.3\n"
		"                          with --quick)\n"
		"  --layers=L              K and V tensors of L layers, 1 to 1024 (default 32 on a GPU; 8 on the\n"
		"                          host backend, a quarter of the bytes with the same page geometry; 2\n"
		"                          with --quick)\n"
		"  --compact-every=K       decode steps between compactions in the second run, 1 to 1000000\n"
		"                          (default 50; 8 with --quick)\n"
		"  --step-us=U             simulated compute time of a decode step, 0 to 10000000 us (default\n"
		"                          1000; 200 with --quick)\n"
		"  --release-delay-ms=MS   the context's release_delay_ms, 0 to 3600000 (default 50; 20 with\n"
		"                          --quick)\n"
		"  --csv=FILE              write run,step,t_ms,active,live_bytes,held_bytes,device_held_bytes for\n"
		"                          every step\n"
		"  --quick                 a small trace (the test suite's run); options given explicitly keep\n"
		"                          their values\n"
		"  --help                  print this help and exit\n"
		"\n"
		"CUVMM_BACKEND=host|cuda picks the backend; unset, the GPU is tried first, then the host backend.\n"
		"Exit status: 0 on success, 1 if a check fails, 2 for a usage error.\n";
	bool set_step = false, set_delay = false, set_scale = false, set_req = false, set_every = false;
	int c;

	cli_init(argv[0]);
	while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
		switch (c) {
		case 'n': opt.requests = (uint32_t)cli_int("requests", optarg, 1, 10000000); set_req = true; break;
		case 'c': opt.concurrency = (uint32_t)cli_int("concurrency", optarg, 1, 100000); break;
		case 's': opt.seed = (uint64_t)cli_int("seed", optarg, 0, INT64_MAX); break;
		case 'x':
			opt.scale = cli_double("scale", optarg, 0, 100);
			if (opt.scale == 0)
				cli_fail("--scale=%s: must be above 0", optarg);
			set_scale = true;
			break;
		case 'l': opt.layers = (uint32_t)cli_int("layers", optarg, 1, 1024); break;
		case 'k': opt.compact_every = (uint32_t)cli_int("compact-every", optarg, 1, 1000000); set_every = true; break;
		case 'u': opt.step_us = cli_double("step-us", optarg, 0, 10000000); set_step = true; break;
		case 'r': opt.delay_ms = cli_int("release-delay-ms", optarg, 0, 3600000); set_delay = true; break;
		case 'f': opt.csv = optarg; break;
		case 'q': opt.quick = true; break;
		case 'h': cli_help(help);
		default: cli_bad_usage();
		}
	}
	cli_no_operands(argc, argv, optind);
	if (opt.quick) { /* the test suite's run: a small trace, no step time */
		opt.requests = set_req ? opt.requests : 100;
		opt.scale = set_scale ? opt.scale : 0.3;
		opt.step_us = set_step ? opt.step_us : 200;
		opt.delay_ms = set_delay ? opt.delay_ms : 20;
		opt.compact_every = set_every ? opt.compact_every : 8;
		opt.layers = opt.layers ? opt.layers : 2; /* 0: not given (--layers=0 is refused above) */
	}

	/* Which backend: a throwaway context answers (ex_ctx_create prints it and loads the driver helpers). */
	struct cuvmm_config cfg;
	cuvmm_config_init(&cfg);
	host = ex_ctx_create(&cfg, &ctx, "kv_server");
	size_t gran = ex_granularity(ctx);
	cuvmm_ctx_destroy(ctx);
	if (!host)
		CU_CHECK(ex_cu_stream_create(&stream));
	opt.layers = opt.layers ? opt.layers : host ? 8 : 32;
	tensors = 2 * opt.layers;
	block_bytes = (size_t)BLOCK_TOKENS * TENSOR_TOKEN_BYTES;

	struct request *reqs = make_trace();
	uint32_t steps, peak_blocks;
	uint64_t prompt_tokens = 0, output_tokens = 0;
	for (uint32_t i = 0; i < opt.requests; i++) {
		prompt_tokens += reqs[i].prompt;
		output_tokens += reqs[i].output;
	}
	dry_run(reqs, &steps, &peak_blocks);
	uint32_t per_page = (uint32_t)(gran / block_bytes);
	/* Room for twice the peak: block ids are cheap (address space), running out of them is not. */
	uint32_t max_blocks = 2 * peak_blocks + 4 * (per_page ? per_page : 1);
	double page_mib = (double)gran * tensors / EX_MiB;
	printf("trace: %u requests, %u at once, seed %llu, scale %.2f: %llu prompt + %llu output tokens, %u steps, "
	       "peak %u blocks (%.2f GiB)\n",
	       opt.requests, opt.concurrency, (unsigned long long)opt.seed, opt.scale,
	       (unsigned long long)prompt_tokens, (unsigned long long)output_tokens, steps, peak_blocks,
	       (double)peak_blocks * block_bytes * tensors / EX_GiB);
	printf("kv: %u tensors (%u layers, K and V), blocks of %d tokens = %zu KiB per tensor, %u blocks per page, "
	       "a page id = %.0f MiB over all tensors; %u block ids\n",
	       tensors, opt.layers, BLOCK_TOKENS, block_bytes >> 10, per_page, page_mib, max_blocks);
	printf("step time %.0f us, release_delay_ms %lld, compaction every %u steps in the second run\n", opt.step_us,
	       opt.delay_ms, opt.compact_every);

	FILE *csv = NULL;
	if (opt.csv) {
		csv = fopen(opt.csv, "w");
		if (!csv) {
			perror(opt.csv);
			return 1;
		}
		fprintf(csv, "run,step,t_ms,active,live_bytes,held_bytes,device_held_bytes\n");
	}
	owner_req = calloc(max_blocks, sizeof(*owner_req));
	owner_slot = calloc(max_blocks, sizeof(*owner_slot));
	struct result res[2] = {0};
	for (int i = 0; i < 2; i++) {
		res[i].steps = steps;
		res[i].s = calloc(steps + 1, sizeof(*res[i].s));
		run(&res[i], reqs, i == 1, max_blocks, csv);
	}
	if (csv && fclose(csv)) {
		perror(opt.csv);
		return 1;
	}

	/* ----- summary ----- */
	printf("\nsummary                          %14s %14s\n", res[0].name, res[1].name);
	printf("  peak held / peak live GiB      %6.2f / %5.2f %6.2f / %5.2f\n", res[0].peak_held / EX_GiB,
	       res[0].peak_live / EX_GiB, res[1].peak_held / EX_GiB, res[1].peak_live / EX_GiB);
	printf("  held / live, whole run         %13.2fx %13.2fx\n", ratio(&res[0], 0, res[0].steps),
	       ratio(&res[1], 0, res[1].steps));
	printf("  held / live, tail (no admits)  %13.2fx %13.2fx   (from step %u of %u)\n",
	       ratio(&res[0], res[0].tail_from, res[0].steps), ratio(&res[1], res[1].tail_from, res[1].steps),
	       res[0].tail_from, res[0].steps);
	printf("  held after the run + idle MiB  %14.1f %14.1f\n", res[0].held_after_idle / EX_MiB,
	       res[1].held_after_idle / EX_MiB);
	printf("  compactions / blocks moved     %14s %7llu / %4llu  (%.1f ms: plans, copies, frees)\n", "-",
	       (unsigned long long)res[1].compactions, (unsigned long long)res[1].moves, res[1].compact_ms);
	printf("  wall time s                    %14.2f %14.2f\n", res[0].wall_ms / 1e3, res[1].wall_ms / 1e3);
	printf("\ncuvmm_kv_alloc, timed on the allocating thread:\n");
	for (int i = 0; i < 2; i++) {
		const struct result *r = &res[i];
		printf("  [%s] %llu calls that mapped nothing: mean %.2f us, max %.0f us\n", r->name,
		       (unsigned long long)r->alloc_calls, r->alloc_calls ? r->alloc_ns / r->alloc_calls / 1e3 : 0,
		       r->alloc_max_ns / 1e3);
		printf("  [%s] %llu calls that backed %llu page ids: mean %.1f us per call, max %.0f us; %.1f us per page "
		       "id (%.1f us per tensor)\n",
		       r->name, (unsigned long long)r->backing_calls, (unsigned long long)r->backed_pages,
		       r->backing_calls ? r->backing_ns / r->backing_calls / 1e3 : 0, r->backing_max_ns / 1e3,
		       r->backed_pages ? r->backing_ns / r->backed_pages / 1e3 : 0,
		       r->backed_pages ? r->backing_ns / r->backed_pages / tensors / 1e3 : 0);
		printf("  [%s] page ids backed in all: %llu; on the allocating thread %llu, ahead of demand by the "
		       "background thread %llu (%.0f%%)\n",
		       r->name, (unsigned long long)r->pages_total, (unsigned long long)r->backed_pages,
		       (unsigned long long)(r->pages_total - r->backed_pages),
		       r->pages_total ? 100.0 * (r->pages_total - r->backed_pages) / r->pages_total : 0);
	}
	if (host)
		printf("\nblock contents checked at every free (host backend): every compaction move was applied right\n");

	int status = 0;
	for (int i = 0; i < 2; i++) {
		if (res[i].held_after_idle > cfg.retain_bytes) {
			fprintf(stderr, "kv_server: [%s] %.1f MiB still held after the idle delay, nothing live\n",
				res[i].name, res[i].held_after_idle / EX_MiB);
			status = 1;
		}
		free(res[i].s);
	}
	if (!host)
		CU_CHECK(ex_cu_stream_destroy(stream));
	free(owner_req);
	free(owner_slot);
	free(reqs);
	return status;
}
