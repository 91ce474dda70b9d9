/*
 * bench/trace: replay a KV-cache serving trace against several GPU allocators and compare their speed and
 * the memory they hold.
 *
 * The trace (doc/performance.md, facts/h200-vmm.md): up to --concurrency requests at once, --requests in
 * all; prompt length ~ lognormal(6.0, 1.0) tokens clipped to [16, 4096], output length ~ lognormal(5.0,
 * 1.0) clipped to [8, 2048]; --kv-per-token bytes of KV per token (128 KiB). A request starts by allocating
 * its prompt's KV; each decode step re-allocates every active request's buffer one token larger and frees
 * the old one (allocate new first, then free old: the torch.cat pattern); a finished request frees its
 * buffer; new requests are admitted at the start of a step whenever fewer than --concurrency are active.
 * The operations are generated once from --seed (own PRNG: splitmix64 + xoshiro256**, Box-Muller) and the
 * identical list is replayed for every allocator.
 *
 * Allocators (--allocators, run in the order given):
 *   cuvmm       cuvmm_malloc/cuvmm_free on one pool "kv" of a fresh context (--backend, --release-delay-ms)
 *   cuvmmasync  cuvmm_malloc_async/cuvmm_free_async on one non-blocking stream (host backend: a dummy stream)
 *   cudamalloc  cudaMalloc/cudaFree
 *   async0      cudaMallocAsync/cudaFreeAsync, default pool, release threshold 0, one non-blocking stream
 *   asyncmax    the same with release threshold UINT64_MAX
 *
 * Per allocator: wall time of the replay (minus the time spent sampling held bytes), latency of each call
 * (clock_gettime around it; mean and p99), peak live (from the op list) and peak held, held after the trace
 * has been idle for release_delay_ms + 200 ms, how long the memory took to come back by itself, and the
 * time of the explicit return (cuvmm_ctx_trim, cudaMemPoolTrimTo). Held bytes: for cuvmm from
 * cuvmm_ctx_stats() after every op (exact); for the CUDA allocators from the driver, cuMemGetInfo()'s
 * (total - free) minus the value before the replay, sampled every --driver-sample-ops ops (so their peak
 * is a sampled peak). Separately, "return test": allocate --return-test-bytes in --return-piece-bytes pieces (64 MiB), free them,
 * and time cuvmm_pool_trim(pool, 0) against cudaMemPoolTrimTo(pool, 0) after the same with
 * cudaMallocAsync/cudaFreeAsync.
 *
 * Without a usable GPU only cuvmm runs, on the host backend (memfd-backed host memory: the default trace
 * commits about twice its peak live bytes, ~8-17 GiB, of host memory, and took ~5 minutes on 2 cores; use
 * --scale=0.05 for a quick run, ~2 s).
 *
 * CSV (--csv): allocator,t_ms,live_bytes,held_bytes,driver_held_bytes,phase -- sampled every
 * --csv-every-ops ops during the replay (phase "replay"), at the op of peak live and at every new peak of
 * held, every 20 ms and at every change while idle ("idle"), and after the explicit return ("returned").
 * driver_held_bytes is empty where there is no driver (host backend). bench/plot_trace.py plots it.
 * Summary CSV (--summary-csv): one row per allocator (kind "trace") and per return-test allocator (kind
 * "return"); see write_summary() for the columns.
 *
 * Usage: trace [--allocators=LIST] [--backend=cuda|host] [--scale=F] [--csv=FILE] ... (--help for all)
 */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda.h> /* the driver API it calls directly (cuMemGetInfo) */
#include <cuda_runtime_api.h>

#include "cuvmm.h"

#define MIB ((uint64_t)1 << 20)
#define GIB ((uint64_t)1 << 30)

/* ----- options ----- */

enum akind { A_CUVMM = 0, A_CUVMMASYNC, A_CUDAMALLOC, A_ASYNC0, A_ASYNCMAX, A_COUNT };
static const char *const aname[A_COUNT] = {"cuvmm", "cuvmmasync", "cudamalloc", "async0", "asyncmax"};

static struct {
	enum akind list[16];
	int nlist;
	bool list_given;
	enum cuvmm_backend backend; /* AUTO until resolved */
	uint32_t requests, concurrency;
	uint64_t kv_per_token;
	uint64_t seed;
	int64_t release_delay_ms;
	uint64_t coarse_bytes; /* cuvmm_pool_config.coarse_bytes of the cuvmm pools (trace and return test) */
	double scale;
	double prompt_mu, prompt_sigma, output_mu, output_sigma;
	uint32_t prompt_min, prompt_max, output_min, output_max;
	const char *csv, *summary_csv;
	bool quiet;
	int64_t return_test_bytes; /* -1: default */
	bool sync_every_step;
	uint32_t driver_sample_ops, csv_every_ops;
} opt = {
	.backend = CUVMM_BACKEND_AUTO,
	.requests = 400,
	.concurrency = 48,
	.kv_per_token = 128 * 1024,
	.seed = 1,
	.release_delay_ms = 1000,
	.scale = 1.0,
	.prompt_mu = 6.0,
	.prompt_sigma = 1.0,
	.output_mu = 5.0,
	.output_sigma = 1.0,
	.prompt_min = 16,
	.prompt_max = 4096,
	.output_min = 8,
	.output_max = 2048,
	.return_test_bytes = -1,
	.driver_sample_ops = 16,
	.csv_every_ops = 1000,
};

static void info(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void info(const char *fmt, ...)
{
	va_list ap;

	if (opt.quiet)
		return;
	va_start(ap, fmt);
	vprintf(fmt, ap);
	va_end(ap);
	fflush(stdout);
}

static uint64_t now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void sleep_ns(uint64_t ns)
{
	struct timespec ts = {.tv_sec = (time_t)(ns / 1000000000u), .tv_nsec = (long)(ns % 1000000000u)};

	while (nanosleep(&ts, &ts) && errno == EINTR)
		;
}

#include "kvtrace.h"

/* ----- the trace: a list of operations ----- */

enum { OP_ALLOC = 0, OP_FREE, OP_STEP };

struct op {
	uint64_t bytes; /* ALLOC: size; FREE: size of the buffer freed */
	uint32_t id;    /* ALLOC/FREE: buffer id (each allocation has its own) */
	uint8_t kind;
};

struct trace {
	struct op *ops;
	size_t nops, cap;
	size_t nalloc, nfree, nsteps;
	uint64_t *live_after;   /* bytes live after op i */
	uint32_t *nlive_after;  /* allocations live after op i */
	uint64_t peak_live;
	size_t peak_op;
	uint64_t total_tokens_prompt, total_tokens_output;
};

static void *xmalloc(size_t n)
{
	void *p = malloc(n ? n : 1);

	if (!p) {
		fprintf(stderr, "trace: out of host memory (%zu bytes)\n", n);
		exit(2);
	}
	return p;
}

static void *xrealloc(void *p, size_t n)
{
	p = realloc(p, n);
	if (!p) {
		fprintf(stderr, "trace: out of host memory (%zu bytes)\n", n);
		exit(2);
	}
	return p;
}

static void push_op(struct trace *t, uint8_t kind, uint32_t id, uint64_t bytes)
{
	if (t->nops == t->cap) {
		t->cap = t->cap ? 2 * t->cap : 4096;
		t->ops = xrealloc(t->ops, t->cap * sizeof(*t->ops));
	}
	t->ops[t->nops++] = (struct op){.bytes = bytes, .id = id, .kind = kind};
	if (kind == OP_ALLOC)
		t->nalloc++;
	else if (kind == OP_FREE)
		t->nfree++;
	else
		t->nsteps++;
}

struct req {
	uint64_t prompt, output; /* tokens */
	uint64_t cur, done;      /* tokens in the buffer, output tokens generated */
	uint32_t buf;            /* id of its current buffer */
};

static void trace_build(struct trace *t)
{
	struct rng rng;
	struct req *reqs = xmalloc((size_t)opt.requests * sizeof(*reqs));
	uint32_t *active = xmalloc((size_t)opt.concurrency * sizeof(*active));
	uint32_t nactive = 0, next = 0, next_id = 0;
	uint64_t live = 0;
	uint32_t nlive = 0;

	memset(t, 0, sizeof(*t));
	rng_seed(&rng, opt.seed);
	/* Lengths are drawn up front, in request order, so they do not depend on the schedule. */
	for (uint32_t i = 0; i < opt.requests; i++) {
		reqs[i].prompt = draw_tokens(&rng, opt.prompt_mu, opt.prompt_sigma, opt.prompt_min, opt.prompt_max, opt.scale);
		reqs[i].output = draw_tokens(&rng, opt.output_mu, opt.output_sigma, opt.output_min, opt.output_max, opt.scale);
		reqs[i].cur = reqs[i].prompt;
		reqs[i].done = 0;
		t->total_tokens_prompt += reqs[i].prompt;
		t->total_tokens_output += reqs[i].output;
	}
	while (next < opt.requests || nactive > 0) {
		uint32_t keep = 0;

		while (nactive < opt.concurrency && next < opt.requests) {
			struct req *q = &reqs[next];

			q->buf = next_id++;
			push_op(t, OP_ALLOC, q->buf, q->cur * opt.kv_per_token);
			active[nactive++] = next++;
		}
		for (uint32_t i = 0; i < nactive; i++) {
			struct req *q = &reqs[active[i]];
			uint32_t nb = next_id++;

			push_op(t, OP_ALLOC, nb, (q->cur + 1) * opt.kv_per_token);
			push_op(t, OP_FREE, q->buf, q->cur * opt.kv_per_token);
			q->buf = nb;
			q->cur++;
			if (++q->done == q->output)
				push_op(t, OP_FREE, q->buf, q->cur * opt.kv_per_token);
			else
				active[keep++] = active[i];
		}
		nactive = keep;
		push_op(t, OP_STEP, 0, 0); /* end of a decode step */
	}
	t->live_after = xmalloc(t->nops * sizeof(*t->live_after));
	t->nlive_after = xmalloc(t->nops * sizeof(*t->nlive_after));
	for (size_t i = 0; i < t->nops; i++) {
		const struct op *o = &t->ops[i];

		if (o->kind == OP_ALLOC) {
			live += o->bytes;
			nlive++;
		} else if (o->kind == OP_FREE) {
			live -= o->bytes;
			nlive--;
		}
		t->live_after[i] = live;
		t->nlive_after[i] = nlive;
		if (live > t->peak_live) {
			t->peak_live = live;
			t->peak_op = i;
		}
	}
	free(reqs);
	free(active);
}

/*
 * The granule floor of a trace (issue #11): the peak over the trace of its live allocations each rounded up
 * to the granule, the held bytes of an allocator that gives every allocation granules of its own and
 * frees them at once. Allocations that share granules (the pool's packed ones) can go below it; no
 * allocator that rounds each allocation to whole granules can.
 */
static uint64_t trace_granule_floor(const struct trace *t, uint64_t gran)
{
	uint64_t rounded = 0, peak = 0;

	for (size_t i = 0; i < t->nops; i++) {
		const struct op *o = &t->ops[i];
		uint64_t r = (o->bytes + gran - 1) / gran * gran;

		if (o->kind == OP_ALLOC) {
			rounded += r;
			if (rounded > peak)
				peak = rounded;
		} else if (o->kind == OP_FREE) {
			rounded -= r;
		}
	}
	return peak;
}

/* ----- the CUDA side ----- */

static bool g_gpu;             /* a GPU is usable through the runtime */
static cudaStream_t g_stream;  /* non-blocking stream for the async allocators */
static cudaMemPool_t g_mempool; /* the device's default pool */
static bool g_have_mempool;
typedef CUresult (*pfn_cuMemGetInfo)(size_t *free_bytes, size_t *total_bytes);
static pfn_cuMemGetInfo g_cuMemGetInfo; /* from the driver; NULL: cudaMemGetInfo (the same numbers) */
static char g_dummy_stream_obj;        /* the stream cuvmmasync uses on the host backend */

static int cuda_fail(cudaError_t e, const char *what)
{
	fprintf(stderr, "trace: %s failed: %s (%s)\n", what, cudaGetErrorName(e), cudaGetErrorString(e));
	return -1;
}

#define CK(call)                                                                                             \
	do {                                                                                                 \
		cudaError_t ck_e_ = (call);                                                                  \
		if (ck_e_ != cudaSuccess)                                                                    \
			return cuda_fail(ck_e_, #call);                                                      \
	} while (0)

static int cuvmm_fail(int err, const char *what)
{
	if (err == CUVMM_EDRIVER)
		fprintf(stderr, "trace: %s failed: %s: %s (CUresult %d)\n", what, cuvmm_err_name(err),
			cuvmm_strerror(err), cuvmm_last_driver_error());
	else
		fprintf(stderr, "trace: %s failed: %s: %s\n", what, cuvmm_err_name(err), cuvmm_strerror(err));
	return -1;
}

#define CV(call)                                                                                             \
	do {                                                                                                 \
		int cv_e_ = (call);                                                                          \
		if (cv_e_ != CUVMM_OK)                                                                       \
			return cuvmm_fail(cv_e_, #call);                                                     \
	} while (0)

/* Device memory in use according to the driver: total - free. */
static int driver_used(uint64_t *used)
{
	size_t fr = 0, tot = 0;

	if (g_cuMemGetInfo) {
		CUresult r = g_cuMemGetInfo(&fr, &tot);

		if (r != CUDA_SUCCESS) {
			fprintf(stderr, "trace: cuMemGetInfo failed: CUresult %d\n", (int)r);
			return -1;
		}
	} else {
		CK(cudaMemGetInfo(&fr, &tot));
	}
	*used = (uint64_t)(tot - fr);
	return 0;
}

static void gpu_probe(void)
{
	int n = 0, pools = 0;
	cudaError_t e = cudaGetDeviceCount(&n);

	if (e != cudaSuccess || n < 1) {
		if (e != cudaSuccess)
			info("cudaGetDeviceCount: %s (%s)\n", cudaGetErrorName(e), cudaGetErrorString(e));
		(void)cudaGetLastError();
		return;
	}
	if ((e = cudaSetDevice(0)) != cudaSuccess || (e = cudaFree(NULL)) != cudaSuccess) {
		info("device 0 not usable: %s (%s)\n", cudaGetErrorName(e), cudaGetErrorString(e));
		(void)cudaGetLastError();
		return;
	}
	g_gpu = true;
	{
		enum cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
		void *fn = NULL;
#if CUDART_VERSION >= 12050
		e = cudaGetDriverEntryPointByVersion("cuMemGetInfo", &fn, 12000, cudaEnableDefault, &q);
#else
		e = cudaGetDriverEntryPoint("cuMemGetInfo", &fn, cudaEnableDefault, &q);
#endif
		if (e == cudaSuccess && q == cudaDriverEntryPointSuccess && fn)
			g_cuMemGetInfo = (pfn_cuMemGetInfo)fn;
		else
			info("note: cuMemGetInfo entry point not found; using cudaMemGetInfo (same numbers)\n");
		(void)cudaGetLastError();
	}
	if (cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, 0) == cudaSuccess && pools &&
	    cudaDeviceGetDefaultMemPool(&g_mempool, 0) == cudaSuccess)
		g_have_mempool = true;
	(void)cudaGetLastError();
	e = cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking);
	if (e != cudaSuccess) {
		cuda_fail(e, "cudaStreamCreateWithFlags");
		g_gpu = false;
	}
}

/* ----- one replay ----- */

enum { PH_REPLAY = 0, PH_IDLE, PH_RETURNED };
static const char *const phname[] = {"replay", "idle", "returned"};

struct sample {
	uint64_t t_ns, live, held;
	int64_t drv; /* -1: no driver figure */
	uint8_t phase;
};

struct result {
	enum akind k;
	bool ran, ok;
	const char *backend;
	double wall_ms, sample_ms;
	uint64_t nm, nf;
	double m_mean, m_p99, f_mean, f_p99, m_max, f_max;
	uint64_t peak_live, peak_held;
	uint64_t floor_held;      /* trace_granule_floor() at this allocator's granule */
	bool held_exact;          /* held read from the library after every op (else sampled from the driver) */
	uint64_t lib_peak_held;   /* cuvmm: the library's own peak_held_bytes */
	int64_t drv_peak;         /* driver-side peak (cuvmm on CUDA: the cross-check); -1 n/a */
	int64_t max_excess;       /* cuvmm: max over ops of held - (live + retain + granule * live allocations) */
	uint64_t peak_pool_held;  /* cuvmm: peak of the pool's own held (mapped) bytes */
	uint64_t peak_cache;      /* cuvmm: peak of context held - pool held (the chunk cache and releases) */
	size_t max_excess_op;
	uint64_t bound;           /* held target once idle */
	uint64_t held_idle;
	int64_t drv_held_idle;
	double idle_to_bound_ms;  /* -1: not reached while idle */
	double sync_ms, trim_ms, return_ms;
	uint64_t held_returned;
	int64_t drv_held_returned;
	double free_total_ms;
	bool have_stats;
	struct cuvmm_stats pool_st, ctx_st;
	struct sample *s;
	size_t ns, scap;
};

struct runner {
	enum akind k;
	struct result *res;
	struct cuvmm_ctx *ctx;
	struct cuvmm_pool *pool;
	size_t gran, retain;
	CUstream stream;
	uint64_t old_threshold;
	bool drv;          /* driver figures available (a GPU, and a CUDA allocator or cuvmm on the CUDA backend) */
	uint64_t drv_base; /* driver used bytes before the replay */
	uint64_t t_start;  /* start of the replay: time zero of the allocator's time series */
	uint64_t t_end;    /* end of the replay: the start of the idle phase */
	uint64_t *lm, *lf; /* latencies of the mallocs and the frees, ns */
	size_t nm, nf;
	char err[256];
};

static bool is_cuvmm(enum akind k)
{
	return k == A_CUVMM || k == A_CUVMMASYNC;
}

static void add_sample(struct result *res, uint64_t t, uint64_t live, uint64_t held, int64_t drv, uint8_t ph)
{
	if (res->ns == res->scap) {
		res->scap = res->scap ? 2 * res->scap : 1024;
		res->s = xrealloc(res->s, res->scap * sizeof(*res->s));
	}
	res->s[res->ns++] = (struct sample){.t_ns = t, .live = live, .held = held, .drv = drv, .phase = ph};
}

/* Driver-side held: used bytes over the baseline; -1 without a driver or on failure (reported). */
static int64_t drv_held(struct runner *r)
{
	uint64_t u;

	if (!r->drv || driver_used(&u))
		return -1;
	return u > r->drv_base ? (int64_t)(u - r->drv_base) : 0;
}

/* Held bytes: the library's count for cuvmm, the driver's for the others. */
static int held_now(struct runner *r, uint64_t *held)
{
	if (is_cuvmm(r->k)) {
		struct cuvmm_stats s = {.size = sizeof(s)};

		CV(cuvmm_ctx_stats(r->ctx, 0, &s));
		*held = s.held_bytes;
		return 0;
	} else {
		int64_t h = drv_held(r);

		if (h < 0)
			return -1;
		*held = (uint64_t)h;
		return 0;
	}
}

static void errbuf_cuvmm(struct runner *r, int err)
{
	if (err == CUVMM_EDRIVER)
		snprintf(r->err, sizeof(r->err), "%s: %s (CUresult %d)", cuvmm_err_name(err), cuvmm_strerror(err),
			 cuvmm_last_driver_error());
	else
		snprintf(r->err, sizeof(r->err), "%s: %s", cuvmm_err_name(err), cuvmm_strerror(err));
}

static void errbuf_cuda(struct runner *r, cudaError_t e)
{
	snprintf(r->err, sizeof(r->err), "%s: %s", cudaGetErrorName(e), cudaGetErrorString(e));
}

static int do_malloc(struct runner *r, size_t bytes, void **p)
{
	int err;
	cudaError_t e;

	switch (r->k) {
	case A_CUVMM:
		err = cuvmm_malloc(r->pool, bytes, p);
		break;
	case A_CUVMMASYNC:
		err = cuvmm_malloc_async(r->pool, bytes, r->stream, p);
		break;
	case A_CUDAMALLOC:
		e = cudaMalloc(p, bytes);
		goto cuda;
	default:
		e = cudaMallocAsync(p, bytes, g_stream);
		goto cuda;
	}
	if (err)
		errbuf_cuvmm(r, err);
	return err ? -1 : 0;
cuda:
	if (e != cudaSuccess)
		errbuf_cuda(r, e);
	return e != cudaSuccess ? -1 : 0;
}

static int do_free(struct runner *r, void *p)
{
	int err;
	cudaError_t e;

	switch (r->k) {
	case A_CUVMM:
		err = cuvmm_free(r->pool, p);
		break;
	case A_CUVMMASYNC:
		err = cuvmm_free_async(r->pool, p, r->stream);
		break;
	case A_CUDAMALLOC:
		e = cudaFree(p);
		goto cuda;
	default:
		e = cudaFreeAsync(p, g_stream);
		goto cuda;
	}
	if (err)
		errbuf_cuvmm(r, err);
	return err ? -1 : 0;
cuda:
	if (e != cudaSuccess)
		errbuf_cuda(r, e);
	return e != cudaSuccess ? -1 : 0;
}

/* The end of a decode step, with --sync-every-step: what a serving loop does to read its tokens. */
static int do_step_sync(struct runner *r)
{
	cudaError_t e;

	if (!g_gpu || (is_cuvmm(r->k) && cuvmm_ctx_backend(r->ctx) == CUVMM_BACKEND_HOST))
		return 0;
	e = r->k == A_ASYNC0 || r->k == A_ASYNCMAX || r->k == A_CUVMMASYNC ? cudaStreamSynchronize(g_stream)
									   : cudaDeviceSynchronize();
	if (e != cudaSuccess) {
		errbuf_cuda(r, e);
		return -1;
	}
	return 0;
}

/* Everything back to the driver and the device idle, so one allocator does not affect the next. */
static int cuda_quiesce(void)
{
	if (!g_gpu)
		return 0;
	CK(cudaDeviceSynchronize());
	if (g_have_mempool)
		CK(cudaMemPoolTrimTo(g_mempool, 0));
	return 0;
}

static int runner_setup(struct runner *r)
{
	struct result *res = r->res;

	if (cuda_quiesce())
		return -1;
	if (is_cuvmm(r->k)) {
		struct cuvmm_config cfg;
		struct cuvmm_pool_config pc;
		struct cuvmm_region *probe = NULL;
		void *p = NULL;

		cuvmm_config_init(&cfg);
		cfg.backend = opt.backend;
		cfg.release_delay_ms = opt.release_delay_ms;
		CV(cuvmm_ctx_create(&cfg, &r->ctx));
		r->retain = cfg.retain_bytes;
		res->backend = cuvmm_ctx_backend(r->ctx) == CUVMM_BACKEND_HOST ? "host" : "cuda";
		/* The granularity, for the bound on held memory: from a throwaway region (address space only). */
		CV(cuvmm_region_create(r->ctx, 0, 1, &probe));
		r->gran = cuvmm_region_granularity(probe);
		cuvmm_region_destroy(probe);
		cuvmm_pool_config_init(&pc);
		pc.name = "kv";
		pc.coarse_bytes = (size_t)opt.coarse_bytes;
		CV(cuvmm_pool_create(r->ctx, &pc, &r->pool));
		if (r->k == A_CUVMMASYNC)
			r->stream = cuvmm_ctx_backend(r->ctx) == CUVMM_BACKEND_HOST ? (CUstream)(void *)&g_dummy_stream_obj
										   : (CUstream)g_stream;
		/* Warm-up: one allocation and free, then everything back, so lazy set-up is not in the trace. */
		if (r->k == A_CUVMMASYNC) {
			CV(cuvmm_malloc_async(r->pool, 2 * MIB, r->stream, &p));
			CV(cuvmm_free_async(r->pool, p, r->stream));
		} else {
			CV(cuvmm_malloc(r->pool, 2 * MIB, &p));
			CV(cuvmm_free(r->pool, p));
		}
		CV(cuvmm_ctx_trim(r->ctx, -1, 0));
		r->drv = g_gpu && cuvmm_ctx_backend(r->ctx) == CUVMM_BACKEND_CUDA;
		res->held_exact = true;
		info("  cuvmm %s: backend %s, release_delay_ms %" PRId64 ", retain_bytes %zu, background_release %d, "
		     "granularity %zu\n",
		     cuvmm_version(), res->backend, (int64_t)cfg.release_delay_ms, cfg.retain_bytes,
		     (int)cfg.background_release, r->gran);
	} else {
		void *p = NULL;

		res->backend = "cuda";
		r->drv = true;
		r->gran = 2 * MIB; /* the driver's granularity on current GPUs; only for the printed bound */
		if (r->k == A_CUDAMALLOC) {
			CK(cudaMalloc(&p, 2 * MIB));
			CK(cudaFree(p));
		} else {
			uint64_t th = r->k == A_ASYNC0 ? 0 : UINT64_MAX;

			if (!g_have_mempool) {
				fprintf(stderr, "trace: %s: the device has no memory pools\n", aname[r->k]);
				return -1;
			}
			CK(cudaMemPoolGetAttribute(g_mempool, cudaMemPoolAttrReleaseThreshold, &r->old_threshold));
			CK(cudaMemPoolSetAttribute(g_mempool, cudaMemPoolAttrReleaseThreshold, &th));
			CK(cudaMallocAsync(&p, 2 * MIB, g_stream));
			CK(cudaFreeAsync(p, g_stream));
			CK(cudaStreamSynchronize(g_stream));
		}
		if (cuda_quiesce())
			return -1;
	}
	if (r->drv && driver_used(&r->drv_base))
		return -1;
	res->bound = r->retain; /* + live + granule per live allocation, both 0 when idle */
	return 0;
}

static void runner_teardown(struct runner *r)
{
	cudaError_t e;

	if (is_cuvmm(r->k)) {
		if (r->res->ok && r->pool) {
			r->res->have_stats = true;
			r->res->pool_st.size = sizeof(r->res->pool_st);
			r->res->ctx_st.size = sizeof(r->res->ctx_st);
			if (cuvmm_pool_stats(r->pool, &r->res->pool_st) || cuvmm_ctx_stats(r->ctx, 0, &r->res->ctx_st))
				r->res->have_stats = false;
		}
		cuvmm_pool_destroy(r->pool);
		cuvmm_ctx_destroy(r->ctx);
		r->pool = NULL;
		r->ctx = NULL;
	} else if ((r->k == A_ASYNC0 || r->k == A_ASYNCMAX) && g_have_mempool) {
		if ((e = cudaStreamSynchronize(g_stream)) != cudaSuccess ||
		    (e = cudaMemPoolTrimTo(g_mempool, 0)) != cudaSuccess ||
		    (e = cudaMemPoolSetAttribute(g_mempool, cudaMemPoolAttrReleaseThreshold, &r->old_threshold)) !=
			    cudaSuccess) {
			cuda_fail(e, "restoring the default pool (sync, trim, release threshold)");
			r->res->ok = false;
		}
	}
	if (cuda_quiesce())
		r->res->ok = false;
}

static int cmp_u64(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;

	return x < y ? -1 : x > y;
}

static void lat_stats(uint64_t *v, size_t n, double *mean, double *p99, double *max)
{
	double sum = 0;
	size_t idx;

	*mean = *p99 = *max = 0;
	if (!n)
		return;
	for (size_t i = 0; i < n; i++)
		sum += (double)v[i];
	qsort(v, n, sizeof(*v), cmp_u64);
	idx = (n * 99 + 99) / 100 - 1; /* nearest rank: ceil(0.99 n) - 1 */
	*mean = sum / (double)n;
	*p99 = (double)v[idx];
	*max = (double)v[n - 1];
}

static const char *fmt_bytes_op(const struct op *o, char *buf, size_t n)
{
	snprintf(buf, n, "%s of %" PRIu64 " bytes (buffer %u)", o->kind == OP_ALLOC ? "malloc" : "free", o->bytes,
		 o->id);
	return buf;
}

/* Replay the trace; on failure, frees what is still live and says which op failed. */
static int replay(struct runner *r, const struct trace *t)
{
	struct result *res = r->res;
	void **ptrs;
	uint64_t *lm, *lf;
	uint64_t t_start, t_end, sample_ns = 0, held = 0, free_ns = 0;
	size_t nm = 0, nf = 0, i;
	int64_t d;
	int rc = 0;
	bool cuvmm = is_cuvmm(r->k);

	res->drv_peak = r->drv ? 0 : -1;
	res->max_excess = INT64_MIN;
	if (held_now(r, &held))
		return -1;
	ptrs = xmalloc(t->nalloc * sizeof(*ptrs));
	lm = r->lm = xmalloc(t->nalloc * sizeof(*lm));
	lf = r->lf = xmalloc(t->nfree * sizeof(*lf));
	memset(ptrs, 0, t->nalloc * sizeof(*ptrs));
	t_start = r->t_start = now_ns();
	add_sample(res, 0, 0, held, drv_held(r), PH_REPLAY);
	for (i = 0; i < t->nops; i++) {
		const struct op *o = &t->ops[i];
		uint64_t t0, t1;
		bool drv_tick, csv_tick;

		if (o->kind == OP_ALLOC) {
			void *p = NULL;

			t0 = now_ns();
			rc = do_malloc(r, o->bytes, &p);
			t1 = now_ns();
			if (rc)
				break;
			ptrs[o->id] = p;
			lm[nm++] = t1 - t0;
		} else if (o->kind == OP_FREE) {
			t0 = now_ns();
			rc = do_free(r, ptrs[o->id]);
			t1 = now_ns();
			if (rc)
				break;
			ptrs[o->id] = NULL;
			lf[nf++] = t1 - t0;
			free_ns += t1 - t0;
		} else {
			rc = opt.sync_every_step ? do_step_sync(r) : 0;
			if (rc)
				break;
			continue;
		}
		/* Sampling, excluded from the wall time. */
		drv_tick = r->drv && (nm + nf) % opt.driver_sample_ops == 0;
		csv_tick = (nm + nf) % opt.csv_every_ops == 0 || i == t->peak_op || i + 1 == t->nops;
		if (!cuvmm && !drv_tick && !csv_tick)
			continue;
		d = -1;
		if (cuvmm) {
			struct cuvmm_stats s = {.size = sizeof(s)}, ps = {.size = sizeof(ps)};
			int64_t excess;

			if ((rc = cuvmm_ctx_stats(r->ctx, 0, &s)) != CUVMM_OK ||
			    (rc = cuvmm_pool_stats(r->pool, &ps)) != CUVMM_OK) {
				errbuf_cuvmm(r, rc);
				rc = -1;
				break;
			}
			held = s.held_bytes;
			if (ps.held_bytes > res->peak_pool_held)
				res->peak_pool_held = ps.held_bytes;
			if (held > ps.held_bytes && held - ps.held_bytes > res->peak_cache)
				res->peak_cache = held - ps.held_bytes;
			excess = (int64_t)held - (int64_t)(t->live_after[i] + r->retain +
							   (uint64_t)t->nlive_after[i] * r->gran);
			if (excess > res->max_excess) {
				res->max_excess = excess;
				res->max_excess_op = i;
			}
			if (drv_tick || (csv_tick && r->drv))
				d = drv_held(r);
		} else {
			d = drv_held(r);
			if (d < 0) {
				snprintf(r->err, sizeof(r->err), "reading the driver's memory info failed");
				rc = -1;
				break;
			}
			held = (uint64_t)d;
		}
		if (held > res->peak_held) {
			res->peak_held = held;
			csv_tick = true; /* every new peak goes into the series, so the plot shows the peak */
		}
		if (d > res->drv_peak)
			res->drv_peak = d;
		if (csv_tick)
			add_sample(res, t1 - t_start, t->live_after[i], held, d, PH_REPLAY);
		sample_ns += now_ns() - t1;
	}
	t_end = r->t_end = now_ns();
	if (rc) {
		char buf[96];

		fprintf(stderr, "trace: %s: op %zu of %zu (%s) failed: %s\n", aname[r->k], i, t->nops,
			fmt_bytes_op(&t->ops[i], buf, sizeof(buf)), r->err);
		for (size_t j = 0; j < t->nalloc; j++)
			if (ptrs[j])
				(void)do_free(r, ptrs[j]);
	} else {
		res->wall_ms = (double)(t_end - t_start - sample_ns) / 1e6;
		res->sample_ms = (double)sample_ns / 1e6;
		res->free_total_ms = (double)free_ns / 1e6;
		res->nm = r->nm = nm;
		res->nf = r->nf = nf;
		res->peak_live = t->peak_live;
		res->floor_held = trace_granule_floor(t, r->gran);
	}
	free(ptrs);
	return rc;
}

/*
 * After the replay: the idle phase (release_delay_ms + 200 ms, held polled every 1 ms), then the explicit
 * return. Times in the series count from the start of the replay.
 */
static int idle_and_return(struct runner *r)
{
	uint64_t t_start = r->t_start;
	struct result *res = r->res;
	uint64_t idle_ns = (uint64_t)(opt.release_delay_ms > 0 ? opt.release_delay_ms : 0) * 1000000u + 200000000u;
	uint64_t t_idle = r->t_end, t, last_row = 0, held = 0, last_held = UINT64_MAX, t0;
	int64_t d;

	res->idle_to_bound_ms = -1;
	res->sync_ms = 0;
	/* What each allocator's owner would do when the work stops: the stream-ordered pools release at a
	 * synchronisation; cuvmm is left alone (its background thread is what is measured). */
	if (r->k == A_ASYNC0 || r->k == A_ASYNCMAX || r->k == A_CUDAMALLOC) {
		t0 = now_ns();
		CK(r->k == A_CUDAMALLOC ? cudaDeviceSynchronize() : cudaStreamSynchronize(g_stream));
		res->sync_ms = (double)(now_ns() - t0) / 1e6;
	}
	for (;;) {
		t = now_ns();
		if (held_now(r, &held))
			return -1;
		d = is_cuvmm(r->k) ? drv_held(r) : (int64_t)held;
		if (res->idle_to_bound_ms < 0 && held <= res->bound)
			res->idle_to_bound_ms = (double)(t - t_idle) / 1e6;
		if (held != last_held || t - last_row >= 20000000u || t - t_idle >= idle_ns) {
			add_sample(res, t - t_start, 0, held, d, PH_IDLE);
			last_row = t;
			last_held = held;
		}
		if (t - t_idle >= idle_ns)
			break;
		sleep_ns(1000000u);
	}
	res->held_idle = held;
	res->drv_held_idle = d;
	/* The explicit return. */
	res->trim_ms = 0;
	if (is_cuvmm(r->k)) {
		t0 = now_ns();
		CV(cuvmm_ctx_trim(r->ctx, -1, 0));
		res->trim_ms = (double)(now_ns() - t0) / 1e6;
		res->return_ms = res->trim_ms;
	} else if (r->k == A_ASYNC0 || r->k == A_ASYNCMAX) {
		t0 = now_ns();
		CK(cudaMemPoolTrimTo(g_mempool, 0));
		res->trim_ms = (double)(now_ns() - t0) / 1e6;
		res->return_ms = res->sync_ms + res->trim_ms;
	} else {
		res->return_ms = 0; /* cudaFree gives memory back eagerly: the cost is inside the frees */
	}
	t = now_ns();
	if (held_now(r, &held))
		return -1;
	d = is_cuvmm(r->k) ? drv_held(r) : (int64_t)held;
	res->held_returned = held;
	res->drv_held_returned = d;
	add_sample(res, t - t_start, 0, held, d, PH_RETURNED);
	return 0;
}

static void print_detail(const struct result *res, const struct trace *t)
{
	const struct cuvmm_stats *ps = &res->pool_st, *cs = &res->ctx_st;

	info("  replay %.1f ms (+%.1f ms sampling, excluded); %" PRIu64 " mallocs: mean %.0f ns, p99 %.0f ns, "
	     "max %.0f ns; %" PRIu64 " frees: mean %.0f ns, p99 %.0f ns, max %.0f ns (all frees: %.1f ms)\n",
	     res->wall_ms, res->sample_ms, res->nm, res->m_mean, res->m_p99, res->m_max, res->nf, res->f_mean,
	     res->f_p99, res->f_max, res->free_total_ms);
	info("  peak live %.3f GiB, peak held %.3f GiB (%s) = %.3fx", (double)res->peak_live / GIB,
	     (double)res->peak_held / GIB,
	     res->held_exact ? "library count, every op" : "driver, sampled",
	     res->peak_live ? (double)res->peak_held / (double)res->peak_live : 0.0);
	if (res->held_exact && res->lib_peak_held)
		info("; library's own peak_held_bytes %.3f GiB", (double)res->lib_peak_held / GIB);
	if (res->held_exact && res->drv_peak >= 0)
		info("; driver-side peak (sampled every %u ops) %.3f GiB", opt.driver_sample_ops,
		     (double)res->drv_peak / GIB);
	info("\n");
	if (res->held_exact)
		info("  of which: peak held in the pool's mappings %.3f GiB; peak held outside them (chunk cache, "
		     "releases in flight) %.3f GiB\n",
		     (double)res->peak_pool_held / GIB, (double)res->peak_cache / GIB);
	if (res->held_exact && res->max_excess != INT64_MIN)
		info("  max held over (live + retain + granule per live allocation) during the replay: %.1f MiB at op "
		     "%zu (live %.1f MiB in %u allocations)\n",
		     (double)res->max_excess / MIB, res->max_excess_op, (double)t->live_after[res->max_excess_op] / MIB,
		     t->nlive_after[res->max_excess_op]);
	info("  idle: held %.1f MiB after %" PRId64 " ms (bound %.1f MiB, reached %s%.1f ms after the last op)",
	     (double)res->held_idle / MIB, (opt.release_delay_ms > 0 ? opt.release_delay_ms : 0) + 200,
	     (double)res->bound / MIB, res->idle_to_bound_ms < 0 ? "never: " : "", res->idle_to_bound_ms);
	if (res->drv_held_idle >= 0 && res->held_exact)
		info("; driver-side %.1f MiB", (double)res->drv_held_idle / MIB);
	info("\n");
	info("  return: sync %.3f ms, trim %.3f ms -> held %.1f MiB", res->sync_ms, res->trim_ms,
	     (double)res->held_returned / MIB);
	if (res->drv_held_returned >= 0 && res->held_exact)
		info(" (driver-side %.1f MiB)", (double)res->drv_held_returned / MIB);
	if (res->k == A_CUDAMALLOC)
		info(" (cudaFree returns memory eagerly: its cost is in the frees, %.1f ms in all)", res->free_total_ms);
	info("\n");
	if (res->have_stats)
		info("  pool \"kv\": create %" PRIu64 ", release %" PRIu64 ", map %" PRIu64 ", unmap %" PRIu64
		     ", driver %.1f ms; context: create %" PRIu64 ", release %" PRIu64 ", map %" PRIu64 ", unmap %" PRIu64
		     ", driver %.1f ms, peak held %.3f GiB\n",
		     ps->create_calls, ps->release_calls, ps->map_calls, ps->unmap_calls, (double)ps->driver_ns / 1e6,
		     cs->create_calls, cs->release_calls, cs->map_calls, cs->unmap_calls, (double)cs->driver_ns / 1e6,
		     (double)cs->peak_held_bytes / GIB);
}

static int run_one(enum akind k, const struct trace *t, struct result *res)
{
	struct runner r = {.k = k, .res = res};
	int rc;

	memset(res, 0, sizeof(*res));
	res->k = k;
	res->ran = true;
	res->drv_held_idle = res->drv_held_returned = res->drv_peak = -1;
	info("\n== %s ==\n", aname[k]);
	rc = runner_setup(&r);
	if (!rc)
		rc = replay(&r, t);
	if (!rc)
		rc = idle_and_return(&r);
	if (!rc) {
		/* After the idle phase, so the sorting does not delay its start. */
		lat_stats(r.lm, r.nm, &res->m_mean, &res->m_p99, &res->m_max);
		lat_stats(r.lf, r.nf, &res->f_mean, &res->f_p99, &res->f_max);
	}
	free(r.lm);
	free(r.lf);
	res->ok = rc == 0;
	if (res->ok && is_cuvmm(k)) {
		struct cuvmm_stats s = {.size = sizeof(s)};

		if (cuvmm_ctx_stats(r.ctx, 0, &s) == CUVMM_OK)
			res->lib_peak_held = s.peak_held_bytes;
		if (res->lib_peak_held > res->peak_held)
			res->peak_held = res->lib_peak_held;
	}
	runner_teardown(&r);
	if (res->ok)
		print_detail(res, t);
	else
		fprintf(stderr, "trace: %s FAILED\n", aname[k]);
	return res->ok ? 0 : -1;
}

/* ----- the return test: N bytes in 64 MiB pieces, freed, then returned ----- */

struct rtest {
	const char *name;
	bool ran, ok, cuvmm;
	uint64_t bytes;
	double alloc_ms, free_ms, trim_ms;
	uint64_t held_before, held_after;
	int64_t drv_before, drv_after;
	uint64_t driver_ns; /* cuvmm: time in driver calls from the frees to the end of the trim */
	uint64_t unmap_calls, release_calls;
	uint64_t probe_pairs; /* malloc + free pairs of 1 MiB that another thread made during the trim */
	uint64_t probe_over_1ms, probe_over_10ms; /* how many of them took longer than 1 ms, 10 ms */
	double probe_max_us;  /* the longest of them */
	double probe_max_at_ms; /* when it began, from the start of the thread (just before the trim) */
};

static uint64_t RT_PIECE = 64 * MIB; /* --return-piece-bytes */

/*
 * Another thread allocating from the same pool (cuvmm) or memory pool (cudaMallocAsync, its own stream)
 * while the memory is given back: how long the give-back stops it. One 1 MiB malloc + free pair after the
 * other until told to stop; the longest pair and the count.
 */
struct probe {
	pthread_t t;
	struct cuvmm_pool *pool; /* NULL: cudaMallocAsync on `stream` */
	cudaStream_t stream;
	atomic_bool go, stop;
	uint64_t pairs, max_ns, max_at, over_1ms, over_10ms, t0;
	int err;
};

static void *probe_main(void *arg)
{
	struct probe *pr = arg;

	atomic_store(&pr->go, true);
	while (!atomic_load(&pr->stop) && !pr->err) {
		uint64_t t0 = now_ns(), dt;
		void *q = NULL;

		if (pr->pool) {
			if (!(pr->err = cuvmm_malloc(pr->pool, MIB, &q)))
				pr->err = cuvmm_free(pr->pool, q);
		} else if (!(pr->err = (int)cudaMallocAsync(&q, MIB, pr->stream))) {
			if (!(pr->err = (int)cudaFreeAsync(q, pr->stream)))
				pr->err = (int)cudaStreamSynchronize(pr->stream);
		}
		dt = now_ns() - t0;
		pr->pairs++;
		pr->over_1ms += dt > 1000000;
		pr->over_10ms += dt > 10000000;
		if (dt > pr->max_ns) {
			pr->max_ns = dt;
			pr->max_at = t0 - pr->t0;
		}
	}
	return NULL;
}

static int probe_start(struct probe *pr, struct cuvmm_pool *pool, cudaStream_t stream)
{
	memset(pr, 0, sizeof(*pr));
	pr->pool = pool;
	pr->stream = stream;
	pr->t0 = now_ns(); /* the give-back starts right after the thread does */
	if (pthread_create(&pr->t, NULL, probe_main, pr))
		return -1;
	while (!atomic_load(&pr->go))
		;
	return 0;
}

static int probe_stop(struct probe *pr, struct rtest *rt)
{
	atomic_store(&pr->stop, true);
	pthread_join(pr->t, NULL);
	rt->probe_pairs = pr->pairs;
	rt->probe_max_us = (double)pr->max_ns / 1e3;
	rt->probe_over_1ms = pr->over_1ms;
	rt->probe_over_10ms = pr->over_10ms;
	rt->probe_max_at_ms = (double)pr->max_at / 1e6;
	if (pr->err)
		fprintf(stderr, "trace: return test: the allocating thread failed: %d\n", pr->err);
	return pr->err ? -1 : 0;
}

static int rtest_cuvmm(struct rtest *rt, uint64_t bytes)
{
	struct cuvmm_config cfg;
	struct cuvmm_pool_config pc;
	struct cuvmm_ctx *ctx = NULL;
	struct cuvmm_pool *pool = NULL;
	struct cuvmm_stats s0 = {.size = sizeof(s0)}, s1 = {.size = sizeof(s1)};
	size_t n = (size_t)((bytes + RT_PIECE - 1) / RT_PIECE), i;
	void **p = xmalloc(n * sizeof(*p));
	uint64_t t0, base = 0, u;
	int err = CUVMM_OK, rc = -1;
	struct probe pr;
	bool drv;

	memset(p, 0, n * sizeof(*p));
	rt->name = "cuvmm_pool_trim";
	rt->ran = rt->cuvmm = true;
	rt->bytes = (uint64_t)n * RT_PIECE;
	rt->drv_before = rt->drv_after = -1;
	if (cuda_quiesce())
		goto out;
	cuvmm_config_init(&cfg);
	cfg.backend = opt.backend;
	/* Never release by age: the trim is what gives the memory back (the pool may still move its slack
	 * to the chunk cache in the background; held counts the cache). */
	cfg.release_delay_ms = -1;
	if ((err = cuvmm_ctx_create(&cfg, &ctx)) != CUVMM_OK) {
		cuvmm_fail(err, "cuvmm_ctx_create");
		goto out;
	}
	drv = g_gpu && cuvmm_ctx_backend(ctx) == CUVMM_BACKEND_CUDA;
	cuvmm_pool_config_init(&pc);
	pc.name = "return-test";
	pc.coarse_bytes = (size_t)opt.coarse_bytes;
	if (opt.coarse_bytes)
		rt->name = "cuvmm_pool_trim (coarse)";
	if ((err = cuvmm_pool_create(ctx, &pc, &pool)) != CUVMM_OK) {
		cuvmm_fail(err, "cuvmm_pool_create");
		goto out;
	}
	if (drv && driver_used(&base))
		goto out;
	t0 = now_ns();
	for (i = 0; i < n; i++)
		if ((err = cuvmm_malloc(pool, RT_PIECE, &p[i])) != CUVMM_OK) {
			fprintf(stderr, "trace: return test: cuvmm_malloc #%zu of %zu: ", i, n);
			cuvmm_fail(err, "cuvmm_malloc");
			goto out;
		}
	rt->alloc_ms = (double)(now_ns() - t0) / 1e6;
	if ((err = cuvmm_pool_stats(pool, &s0)) != CUVMM_OK) {
		cuvmm_fail(err, "cuvmm_pool_stats");
		goto out;
	}
	t0 = now_ns();
	for (i = 0; i < n; i++) {
		if ((err = cuvmm_free(pool, p[i])) != CUVMM_OK) {
			cuvmm_fail(err, "cuvmm_free");
			goto out;
		}
		p[i] = NULL;
	}
	rt->free_ms = (double)(now_ns() - t0) / 1e6;
	if ((err = cuvmm_ctx_stats(ctx, 0, &s1)) != CUVMM_OK) {
		cuvmm_fail(err, "cuvmm_ctx_stats");
		goto out;
	}
	rt->held_before = s1.held_bytes;
	if (drv) {
		if (driver_used(&u))
			goto out;
		rt->drv_before = u > base ? (int64_t)(u - base) : 0;
	}
	if (probe_start(&pr, pool, NULL))
		goto out;
	t0 = now_ns();
	err = cuvmm_pool_trim(pool, 0);
	rt->trim_ms = (double)(now_ns() - t0) / 1e6;
	if (probe_stop(&pr, rt))
		goto out;
	if (err != CUVMM_OK) {
		cuvmm_fail(err, "cuvmm_pool_trim");
		goto out;
	}
	if ((err = cuvmm_ctx_stats(ctx, 0, &s1)) != CUVMM_OK || (err = cuvmm_pool_stats(pool, &s0)) != CUVMM_OK) {
		cuvmm_fail(err, "cuvmm_*_stats");
		goto out;
	}
	rt->held_after = s1.held_bytes;
	rt->unmap_calls = s0.unmap_calls;
	rt->release_calls = s1.release_calls;
	rt->driver_ns = s1.driver_ns;
	if (drv) {
		if (driver_used(&u))
			goto out;
		rt->drv_after = u > base ? (int64_t)(u - base) : 0;
	}
	rc = 0;
out:
	for (i = 0; i < n; i++)
		if (p[i])
			(void)cuvmm_free(pool, p[i]);
	free(p);
	cuvmm_pool_destroy(pool);
	cuvmm_ctx_destroy(ctx);
	rt->ok = rc == 0;
	return rc;
}

static int rtest_async_body(struct rtest *rt, void **p, size_t n, cudaStream_t side)
{
	uint64_t th = UINT64_MAX, base, u, t0;
	struct probe pr;
	cudaError_t e;

	CK(cudaMemPoolSetAttribute(g_mempool, cudaMemPoolAttrReleaseThreshold, &th));
	if (driver_used(&base))
		return -1;
	t0 = now_ns();
	for (size_t i = 0; i < n; i++)
		CK(cudaMallocAsync(&p[i], RT_PIECE, g_stream));
	CK(cudaStreamSynchronize(g_stream));
	rt->alloc_ms = (double)(now_ns() - t0) / 1e6;
	t0 = now_ns();
	for (size_t i = 0; i < n; i++) {
		CK(cudaFreeAsync(p[i], g_stream));
		p[i] = NULL;
	}
	CK(cudaStreamSynchronize(g_stream));
	rt->free_ms = (double)(now_ns() - t0) / 1e6;
	if (driver_used(&u))
		return -1;
	rt->drv_before = u > base ? (int64_t)(u - base) : 0;
	rt->held_before = (uint64_t)rt->drv_before;
	if (probe_start(&pr, NULL, side))
		return -1;
	t0 = now_ns();
	e = cudaMemPoolTrimTo(g_mempool, 0);
	rt->trim_ms = (double)(now_ns() - t0) / 1e6;
	if (probe_stop(&pr, rt))
		return -1;
	CK(e);
	if (driver_used(&u))
		return -1;
	rt->drv_after = u > base ? (int64_t)(u - base) : 0;
	rt->held_after = (uint64_t)rt->drv_after;
	return 0;
}

static int rtest_async(struct rtest *rt, uint64_t bytes)
{
	size_t n = (size_t)((bytes + RT_PIECE - 1) / RT_PIECE);
	void **p = xmalloc(n * sizeof(*p));
	uint64_t old = 0;
	cudaStream_t side = NULL;
	int rc = -1;

	memset(p, 0, n * sizeof(*p));
	rt->name = "cudaMemPoolTrimTo";
	rt->ran = true;
	rt->bytes = (uint64_t)n * RT_PIECE;
	rt->drv_before = rt->drv_after = -1;
	if (!cuda_quiesce() && cudaMemPoolGetAttribute(g_mempool, cudaMemPoolAttrReleaseThreshold, &old) == cudaSuccess &&
	    cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking) == cudaSuccess) {
		rc = rtest_async_body(rt, p, n, side);
		for (size_t i = 0; i < n; i++)
			if (p[i])
				(void)cudaFreeAsync(p[i], g_stream);
		(void)cudaStreamSynchronize(g_stream);
		(void)cudaMemPoolTrimTo(g_mempool, 0);
		if (cudaMemPoolSetAttribute(g_mempool, cudaMemPoolAttrReleaseThreshold, &old) != cudaSuccess)
			rc = -1;
	}
	if (side)
		(void)cudaStreamDestroy(side);
	free(p);
	rt->ok = rc == 0;
	return rc;
}

/* ----- output ----- */

static void print_table(const struct result *res, int n, const struct trace *t)
{
	printf("\n");
	printf("Trace: %u requests, concurrency %u, %" PRIu64 " B KV/token, seed %" PRIu64 ", scale %g: %zu mallocs, "
	       "%zu frees, %zu steps; peak live %.3f GiB\n",
	       opt.requests, opt.concurrency, opt.kv_per_token, opt.seed, opt.scale, t->nalloc, t->nfree, t->nsteps,
	       (double)t->peak_live / GIB);
	printf("%-11s %-7s %9s %17s %17s %8s %9s %9s %-22s %6s %9s %10s %9s\n", "allocator", "backend", "wall ms",
	       "malloc mean/p99", "free mean/p99", "pair ns", "live GiB", "held GiB", "held/live", "floor", "idle MiB",
	       "->bound ms", "return ms");
	for (int i = 0; i < n; i++) {
		const struct result *r = &res[i];
		char ratio[32], mal[24], fre[24], bound[16];

		if (!r->ran)
			continue;
		if (!r->ok) {
			printf("%-11s %-7s FAILED\n", aname[r->k], r->backend ? r->backend : "-");
			continue;
		}
		snprintf(ratio, sizeof(ratio), "%s%.3f (target <= 1.10)", r->held_exact ? " " : "~",
			 r->peak_live ? (double)r->peak_held / (double)r->peak_live : 0.0);
		snprintf(mal, sizeof(mal), "%.0f/%.0f", r->m_mean, r->m_p99);
		snprintf(fre, sizeof(fre), "%.0f/%.0f", r->f_mean, r->f_p99);
		if (r->idle_to_bound_ms < 0)
			snprintf(bound, sizeof(bound), "never");
		else
			snprintf(bound, sizeof(bound), "%.1f", r->idle_to_bound_ms);
		printf("%-11s %-7s %9.1f %17s %17s %8.0f %9.3f %9.3f %-22s %6.3f %9.1f %10s %9.3f\n", aname[r->k],
		       r->backend, r->wall_ms, mal, fre, r->m_mean + r->f_mean, (double)r->peak_live / GIB,
		       (double)r->peak_held / GIB, ratio,
		       r->peak_live ? (double)r->floor_held / (double)r->peak_live : 0.0, (double)r->held_idle / MIB,
		       bound, r->return_ms);
	}
	printf("latencies in ns (clock_gettime around each call); pair = mean malloc + mean free; floor = the "
	       "granule floor (peak of the live allocations each rounded up to the granule, over peak live: what "
	       "an allocator holds that gives each allocation granules of its own); '~' = peak held "
	       "sampled from cuMemGetInfo every %u ops (else cuvmm's own count after every op); idle MiB = held %" PRId64
	       " ms after the last op; ->bound = time after the last op until held <= retain_bytes (polled every "
	       "1 ms); return = explicit return (cuvmm_ctx_trim; async: stream sync + cudaMemPoolTrimTo; cudaMalloc: "
	       "0, it frees eagerly)%s\n",
	       opt.driver_sample_ops, (opt.release_delay_ms > 0 ? opt.release_delay_ms : 0) + 200,
	       opt.sync_every_step ? "; synchronised at the end of every decode step" : "");
}

static void print_rtests(const struct rtest *rt, int n)
{
	bool any = false;

	for (int i = 0; i < n; i++)
		any |= rt[i].ran;
	if (!any)
		return;
	printf("\nReturn test: allocate in %.0f MiB pieces, free all, then give the memory back\n", (double)RT_PIECE / MIB);
	printf("%-24s %10s %10s %10s %14s %10s %14s %s\n", "method", "bytes MiB", "alloc ms", "free ms",
	       "held pre MiB", "trim ms", "held post MiB", "notes");
	for (int i = 0; i < n; i++) {
		const struct rtest *r = &rt[i];

		if (!r->ran)
			continue;
		if (!r->ok) {
			printf("%-24s FAILED\n", r->name);
			continue;
		}
		printf("%-24s %10.0f %10.3f %10.3f %14.1f %10.3f %14.1f", r->name, (double)r->bytes / MIB, r->alloc_ms,
		       r->free_ms, (double)r->held_before / MIB, r->trim_ms, (double)r->held_after / MIB);
		if (r->driver_ns || r->unmap_calls || r->release_calls)
			printf(" pool unmaps %" PRIu64 ", releases %" PRIu64 ", context driver time (alloc to trim) %.1f ms",
			       r->unmap_calls, r->release_calls, (double)r->driver_ns / 1e6);
		if (r->drv_before >= 0 && r->cuvmm)
			printf(" (driver-side %.1f -> %.1f MiB)", (double)r->drv_before / MIB, (double)r->drv_after / MIB);
		if (!r->cuvmm)
			printf(" cudaMallocAsync/cudaFreeAsync, threshold UINT64_MAX; held from the driver");
		printf("; another thread meanwhile: %" PRIu64 " pairs (%" PRIu64 " over 1 ms, %" PRIu64 " over 10 ms), "
		       "the longest %.1f us, from %.1f ms\n", r->probe_pairs, r->probe_over_1ms, r->probe_over_10ms,
		       r->probe_max_us, r->probe_max_at_ms);
	}
	printf("cuvmm side: context with release_delay_ms = -1, so the trim is what gives the memory back; free ms "
	       "includes the stream synchronisation for cudaFreeAsync\n");
}

static int write_csv(const char *path, const struct result *res, int n)
{
	FILE *f = fopen(path, "w");

	if (!f) {
		fprintf(stderr, "trace: cannot open %s: %s\n", path, strerror(errno));
		return -1;
	}
	fprintf(f, "allocator,t_ms,live_bytes,held_bytes,driver_held_bytes,phase\n");
	for (int i = 0; i < n; i++) {
		if (!res[i].ran || !res[i].ok)
			continue;
		for (size_t j = 0; j < res[i].ns; j++) {
			const struct sample *s = &res[i].s[j];

			fprintf(f, "%s,%.3f,%" PRIu64 ",%" PRIu64 ",", aname[res[i].k], (double)s->t_ns / 1e6, s->live,
				s->held);
			if (s->drv >= 0)
				fprintf(f, "%" PRId64, s->drv);
			fprintf(f, ",%s\n", phname[s->phase]);
		}
	}
	if (fclose(f)) {
		fprintf(stderr, "trace: writing %s: %s\n", path, strerror(errno));
		return -1;
	}
	return 0;
}

/*
 * Columns: kind (trace|return), allocator, backend, ok, wall_ms, mallocs, frees, malloc_mean_ns,
 * malloc_p99_ns, free_mean_ns, free_p99_ns, pair_mean_ns, peak_live_bytes, peak_held_bytes, ratio,
 * held_exact (1: the library's count after every op; 0: driver, sampled), driver_peak_held_bytes,
 * held_after_idle_bytes, idle_to_bound_ms (-1: never), sync_ms, trim_ms, return_ms, held_after_return_bytes,
 * map_calls, unmap_calls, create_calls, release_calls, driver_ms (pool map/unmap counts; context
 * create/release counts and driver time), granule_floor_bytes (trace_granule_floor()). Return rows: wall_ms =
 * alloc ms, free_mean_ns empty, return_ms = trim ms, held_after_idle_bytes = held before the trim, with
 * free_ms in sync_ms.
 */
static int write_summary(const char *path, const struct result *res, int n, const struct rtest *rt, int nrt)
{
	FILE *f = fopen(path, "w");

	if (!f) {
		fprintf(stderr, "trace: cannot open %s: %s\n", path, strerror(errno));
		return -1;
	}
	fprintf(f, "kind,allocator,backend,ok,wall_ms,mallocs,frees,malloc_mean_ns,malloc_p99_ns,free_mean_ns,"
		   "free_p99_ns,pair_mean_ns,peak_live_bytes,peak_held_bytes,ratio,held_exact,driver_peak_held_bytes,"
		   "held_after_idle_bytes,idle_to_bound_ms,sync_ms,trim_ms,return_ms,held_after_return_bytes,"
		   "map_calls,unmap_calls,create_calls,release_calls,driver_ms,granule_floor_bytes\n");
	for (int i = 0; i < n; i++) {
		const struct result *r = &res[i];

		if (!r->ran)
			continue;
		fprintf(f, "trace,%s,%s,%d,%.3f,%" PRIu64 ",%" PRIu64 ",%.1f,%.0f,%.1f,%.0f,%.1f,%" PRIu64 ",%" PRIu64
			   ",%.4f,%d,",
			aname[r->k], r->backend ? r->backend : "", (int)r->ok, r->wall_ms, r->nm, r->nf, r->m_mean,
			r->m_p99, r->f_mean, r->f_p99, r->m_mean + r->f_mean, r->peak_live, r->peak_held,
			r->peak_live ? (double)r->peak_held / (double)r->peak_live : 0.0, (int)r->held_exact);
		if (r->drv_peak >= 0)
			fprintf(f, "%" PRId64, r->drv_peak);
		fprintf(f, ",%" PRIu64 ",%.3f,%.3f,%.3f,%.3f,%" PRIu64 ",", r->held_idle, r->idle_to_bound_ms,
			r->sync_ms, r->trim_ms, r->return_ms, r->held_returned);
		if (r->have_stats)
			fprintf(f, "%" PRIu64 ",%" PRIu64 ",%" PRIu64 ",%" PRIu64 ",%.3f,", r->pool_st.map_calls,
				r->pool_st.unmap_calls, r->ctx_st.create_calls, r->ctx_st.release_calls,
				(double)r->ctx_st.driver_ns / 1e6);
		else
			fprintf(f, ",,,,,");
		fprintf(f, "%" PRIu64 "\n", r->floor_held);
	}
	for (int i = 0; i < nrt; i++) {
		const struct rtest *r = &rt[i];

		if (!r->ran)
			continue;
		/* kind,allocator,backend,ok,wall_ms(=alloc ms),mallocs,frees */
		fprintf(f, "return,%s,%s,%d,%.3f,%" PRIu64 ",%" PRIu64 ",", r->name,
			r->cuvmm && opt.backend == CUVMM_BACKEND_HOST ? "host" : "cuda", (int)r->ok, r->alloc_ms,
			r->bytes / RT_PIECE, r->bytes / RT_PIECE);
		/* malloc_mean,malloc_p99,free_mean,free_p99,pair_mean: empty; peak_live,peak_held(=held before) */
		fprintf(f, ",,,,,%" PRIu64 ",%" PRIu64 ",", r->bytes, r->held_before);
		/* ratio,held_exact: empty; driver_peak_held(=driver-side held before),held_after_idle(=held before) */
		fprintf(f, ",,");
		if (r->drv_before >= 0)
			fprintf(f, "%" PRId64, r->drv_before);
		fprintf(f, ",%" PRIu64 ",", r->held_before);
		/* idle_to_bound: empty; sync_ms(=free ms),trim_ms,return_ms(=trim ms),held_after_return */
		fprintf(f, ",%.3f,%.3f,%.3f,%" PRIu64 ",", r->free_ms, r->trim_ms, r->trim_ms, r->held_after);
		/* map_calls: empty; unmap_calls; create_calls: empty; release_calls; driver_ms */
		if (r->cuvmm)
			fprintf(f, ",%" PRIu64 ",,%" PRIu64 ",%.3f,\n", r->unmap_calls, r->release_calls,
				(double)r->driver_ns / 1e6);
		else
			fprintf(f, ",,,,,\n");
	}
	if (fclose(f)) {
		fprintf(stderr, "trace: writing %s: %s\n", path, strerror(errno));
		return -1;
	}
	return 0;
}

/* ----- options ----- */

static void usage(FILE *f)
{
	fprintf(f,
		"Usage: trace [OPTION]...\n"
		"Replays a KV-cache serving trace against GPU allocators; see the comment at the top of "
		"bench/trace.c.\n"
		"  --allocators=LIST      comma list of cuvmm,cuvmmasync,cudamalloc,async0,asyncmax (run in that\n"
		"                         order); default: all with a GPU, else cuvmm on the host backend\n"
		"  --backend=cuda|host    cuvmm's backend; default cuda if a GPU is usable, else host\n"
		"  --requests=N           requests in all (400)\n"
		"  --concurrency=N        requests active at once (48)\n"
		"  --kv-per-token=BYTES   KV bytes per token (131072; k/m/g suffixes are binary)\n"
		"  --seed=N               PRNG seed (1)\n"
		"  --prompt-mu=X --prompt-sigma=X --prompt-min=N --prompt-max=N   prompt tokens (6.0 1.0 16 4096)\n"
		"  --output-mu=X --output-sigma=X --output-min=N --output-max=N   output tokens (5.0 1.0 8 2048)\n"
		"  --scale=F              multiply every token count by F (e.g. 0.05 for a quick CI run)\n"
		"  --release-delay-ms=MS  cuvmm context release delay (1000; -1 never); the idle phase lasts\n"
		"                         max(MS, 0) + 200 ms for every allocator\n"
		"  --sync-every-step      synchronise at the end of every decode step (as a serving loop reading\n"
		"                         its tokens would): cudaStreamSynchronize for the stream allocators,\n"
		"                         cudaDeviceSynchronize for the others; counted in the wall time\n"
		"  --driver-sample-ops=N  read cuMemGetInfo every N ops for the CUDA allocators (16)\n"
		"  --csv-every-ops=N      time-series row every N ops (1000)\n"
		"  --return-test-bytes=B  return test size (8g on a GPU, 256m on the host; 0 skips it)\n"
		"  --return-piece-bytes=B return test allocation size (64m)\n"
		"  --coarse-bytes=B       cuvmm pools (trace and return test): allocations from B up take handles\n"
		"                         as large as fit (cuvmm_pool_config.coarse_bytes; default 0: off)\n"
		"  --csv=FILE             time series: allocator,t_ms,live_bytes,held_bytes,driver_held_bytes,phase\n"
		"  --summary-csv=FILE     one row per allocator and per return-test method\n"
		"  --quiet                only the final tables\n"
		"  --help                 print this help and exit\n"
		"Exit status: 0 on success, 1 on a failure, 2 for a usage error.\n");
}

static int parse_u64(const char *s, const char *name, uint64_t *out, bool suffix)
{
	char *end;
	unsigned long long v;
	uint64_t mul = 1;

	errno = 0;
	if (*s < '0' || *s > '9') /* strtoull would take blanks and a sign */
		goto bad;
	v = strtoull(s, &end, 0);
	if (errno || end == s)
		goto bad;
	if (suffix && *end) {
		switch (*end | 0x20) {
		case 'k': mul = 1ull << 10; break;
		case 'm': mul = 1ull << 20; break;
		case 'g': mul = 1ull << 30; break;
		case 't': mul = 1ull << 40; break;
		default: goto bad;
		}
		end++;
		if ((*end | 0x20) == 'i' && (end[1] | 0x20) == 'b')
			end += 2;
		else if ((*end | 0x20) == 'b')
			end++;
	}
	if (*end || (v && mul > UINT64_MAX / v))
		goto bad;
	*out = v * mul;
	return 0;
bad:
	fprintf(stderr, "trace: bad value for --%s: '%s'\n", name, s);
	return -1;
}

static int parse_u32(const char *s, const char *name, uint32_t *out, uint32_t min)
{
	uint64_t v;

	if (parse_u64(s, name, &v, false))
		return -1;
	if (v < min || v > UINT32_MAX) {
		fprintf(stderr, "trace: --%s=%s: must be in [%u, %u]\n", name, s, min, UINT32_MAX);
		return -1;
	}
	*out = (uint32_t)v;
	return 0;
}

static int parse_double(const char *s, const char *name, double *out)
{
	char *end;

	errno = 0;
	*out = strtod(s, &end);
	if (errno || end == s || *end || *out != *out || *out > 1e300 || *out < -1e300) {
		fprintf(stderr, "trace: bad value for --%s: '%s'\n", name, s);
		return -1;
	}
	return 0;
}

static int parse_list(const char *s)
{
	char *dup = strdup(s), *save = NULL, *tok;

	if (!dup)
		return -1;
	opt.nlist = 0;
	for (tok = strtok_r(dup, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
		int k;

		for (k = 0; k < A_COUNT; k++)
			if (!strcmp(tok, aname[k]))
				break;
		if (k == A_COUNT) {
			fprintf(stderr, "trace: unknown allocator '%s' (cuvmm, cuvmmasync, cudamalloc, async0, asyncmax)\n",
				tok);
			free(dup);
			return -1;
		}
		if (opt.nlist == (int)(sizeof(opt.list) / sizeof(opt.list[0]))) {
			fprintf(stderr, "trace: too many allocators in --allocators\n");
			free(dup);
			return -1;
		}
		opt.list[opt.nlist++] = (enum akind)k;
	}
	free(dup);
	if (!opt.nlist) {
		fprintf(stderr, "trace: --allocators is empty\n");
		return -1;
	}
	opt.list_given = true;
	return 0;
}

enum {
	O_ALLOC = 256, O_BACKEND, O_REQ, O_CONC, O_KV, O_SEED, O_DELAY, O_SCALE, O_CSV, O_SUMMARY, O_QUIET, O_RET, O_RETPIECE,
	O_COARSE,	O_SYNC, O_DSAMPLE, O_CSVEVERY, O_PMU, O_PSIG, O_PMIN, O_PMAX, O_OMU, O_OSIG, O_OMIN, O_OMAX, O_HELP,
};

static int parse_args(int argc, char **argv)
{
	static const struct option lo[] = {
		{"allocators", required_argument, NULL, O_ALLOC},
		{"backend", required_argument, NULL, O_BACKEND},
		{"requests", required_argument, NULL, O_REQ},
		{"concurrency", required_argument, NULL, O_CONC},
		{"kv-per-token", required_argument, NULL, O_KV},
		{"seed", required_argument, NULL, O_SEED},
		{"release-delay-ms", required_argument, NULL, O_DELAY},
		{"scale", required_argument, NULL, O_SCALE},
		{"csv", required_argument, NULL, O_CSV},
		{"summary-csv", required_argument, NULL, O_SUMMARY},
		{"quiet", no_argument, NULL, O_QUIET},
		{"return-test-bytes", required_argument, NULL, O_RET},
		{"return-piece-bytes", required_argument, NULL, O_RETPIECE},
		{"coarse-bytes", required_argument, NULL, O_COARSE},
		{"sync-every-step", no_argument, NULL, O_SYNC},
		{"driver-sample-ops", required_argument, NULL, O_DSAMPLE},
		{"csv-every-ops", required_argument, NULL, O_CSVEVERY},
		{"prompt-mu", required_argument, NULL, O_PMU},
		{"prompt-sigma", required_argument, NULL, O_PSIG},
		{"prompt-min", required_argument, NULL, O_PMIN},
		{"prompt-max", required_argument, NULL, O_PMAX},
		{"output-mu", required_argument, NULL, O_OMU},
		{"output-sigma", required_argument, NULL, O_OSIG},
		{"output-min", required_argument, NULL, O_OMIN},
		{"output-max", required_argument, NULL, O_OMAX},
		{"help", no_argument, NULL, O_HELP},
		{NULL, 0, NULL, 0},
	};
	int c;
	uint64_t v;

	while ((c = getopt_long(argc, argv, "", lo, NULL)) != -1) {
		switch (c) {
		case O_ALLOC:
			if (parse_list(optarg))
				return -1;
			break;
		case O_BACKEND:
			if (!strcmp(optarg, "cuda"))
				opt.backend = CUVMM_BACKEND_CUDA;
			else if (!strcmp(optarg, "host"))
				opt.backend = CUVMM_BACKEND_HOST;
			else {
				fprintf(stderr, "trace: --backend=%s: must be cuda or host\n", optarg);
				return -1;
			}
			break;
		case O_REQ:
			if (parse_u32(optarg, "requests", &opt.requests, 1))
				return -1;
			break;
		case O_CONC:
			if (parse_u32(optarg, "concurrency", &opt.concurrency, 1))
				return -1;
			break;
		case O_KV:
			if (parse_u64(optarg, "kv-per-token", &opt.kv_per_token, true))
				return -1;
			if (!opt.kv_per_token) {
				fprintf(stderr, "trace: --kv-per-token=%s: must be > 0\n", optarg);
				return -1;
			}
			break;
		case O_SEED:
			if (parse_u64(optarg, "seed", &opt.seed, false))
				return -1;
			break;
		case O_DELAY: {
			char *end;

			errno = 0;
			opt.release_delay_ms = strtoll(optarg, &end, 0);
			if (errno || end == optarg || *end || opt.release_delay_ms < -1 ||
			    opt.release_delay_ms > CUVMM_RELEASE_DELAY_MS_MAX) {
				fprintf(stderr, "trace: --release-delay-ms=%s: must be -1 or 0 to 9223372036854\n", optarg);
				return -1;
			}
			break;
		}
		case O_SCALE:
			if (parse_double(optarg, "scale", &opt.scale))
				return -1;
			if (opt.scale <= 0) {
				fprintf(stderr, "trace: --scale=%s: must be > 0\n", optarg);
				return -1;
			}
			break;
		case O_CSV:
			opt.csv = optarg;
			break;
		case O_SUMMARY:
			opt.summary_csv = optarg;
			break;
		case O_QUIET:
			opt.quiet = true;
			break;
		case O_RET:
			if (parse_u64(optarg, "return-test-bytes", &v, true))
				return -1;
			if (v > INT64_MAX) {
				fprintf(stderr, "trace: --return-test-bytes=%s: too large\n", optarg);
				return -1;
			}
			opt.return_test_bytes = (int64_t)v;
			break;
		case O_RETPIECE:
			if (parse_u64(optarg, "return-piece-bytes", &v, true))
				return -1;
			if (v == 0) {
				fprintf(stderr, "trace: --return-piece-bytes=%s: must be positive\n", optarg);
				return -1;
			}
			RT_PIECE = v;
			break;
		case O_COARSE:
			if (parse_u64(optarg, "coarse-bytes", &v, true))
				return -1;
			opt.coarse_bytes = v;
			break;
		case O_SYNC:
			opt.sync_every_step = true;
			break;
		case O_DSAMPLE:
			if (parse_u32(optarg, "driver-sample-ops", &opt.driver_sample_ops, 1))
				return -1;
			break;
		case O_CSVEVERY:
			if (parse_u32(optarg, "csv-every-ops", &opt.csv_every_ops, 1))
				return -1;
			break;
		case O_PMU:
			if (parse_double(optarg, "prompt-mu", &opt.prompt_mu))
				return -1;
			break;
		case O_PSIG:
			if (parse_double(optarg, "prompt-sigma", &opt.prompt_sigma))
				return -1;
			break;
		case O_PMIN:
			if (parse_u32(optarg, "prompt-min", &opt.prompt_min, 1))
				return -1;
			break;
		case O_PMAX:
			if (parse_u32(optarg, "prompt-max", &opt.prompt_max, 1))
				return -1;
			break;
		case O_OMU:
			if (parse_double(optarg, "output-mu", &opt.output_mu))
				return -1;
			break;
		case O_OSIG:
			if (parse_double(optarg, "output-sigma", &opt.output_sigma))
				return -1;
			break;
		case O_OMIN:
			if (parse_u32(optarg, "output-min", &opt.output_min, 1))
				return -1;
			break;
		case O_OMAX:
			if (parse_u32(optarg, "output-max", &opt.output_max, 1))
				return -1;
			break;
		case O_HELP:
			usage(stdout);
			exit(0);
		default:
			usage(stderr);
			return -1;
		}
	}
	if (optind < argc) {
		fprintf(stderr, "trace: unexpected argument '%s'\n", argv[optind]);
		return -1;
	}
	if (opt.prompt_min > opt.prompt_max || opt.output_min > opt.output_max) {
		fprintf(stderr, "trace: a --*-min exceeds its --*-max\n");
		return -1;
	}
	if (opt.prompt_sigma < 0 || opt.output_sigma < 0) {
		fprintf(stderr, "trace: sigmas must be >= 0\n");
		return -1;
	}
	return 0;
}

static uint64_t host_mem_available(void)
{
	FILE *f = fopen("/proc/meminfo", "r");
	char line[256];
	unsigned long long kb;
	uint64_t v = 0;

	if (!f)
		return 0;
	while (fgets(line, sizeof(line), f))
		if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1) {
			v = (uint64_t)kb * 1024;
			break;
		}
	fclose(f);
	return v;
}

int main(int argc, char **argv)
{
	struct trace t;
	struct result res[16];
	struct rtest rt[2];
	int failed = 0, nres = 0;
	uint64_t rbytes;

	setvbuf(stdout, NULL, _IOLBF, 0);
	if (parse_args(argc, argv))
		return 2;
	gpu_probe();
	if (opt.backend == CUVMM_BACKEND_AUTO) {
		opt.backend = g_gpu ? CUVMM_BACKEND_CUDA : CUVMM_BACKEND_HOST;
		if (!g_gpu)
			printf("\n"
			       "**************************************************************************\n"
			       "*** NO USABLE GPU: cuvmm runs on the HOST backend (memfd host memory); ***\n"
			       "*** the CUDA allocators are skipped. These are not GPU numbers.       ***\n"
			       "**************************************************************************\n\n");
	} else if (opt.backend == CUVMM_BACKEND_CUDA && !g_gpu) {
		fprintf(stderr, "trace: --backend=cuda, but no GPU is usable\n");
		return 2;
	}
	if (opt.backend == CUVMM_BACKEND_HOST && g_gpu)
		printf("*** NOTE: cuvmm runs on the HOST backend (--backend=host) although a GPU is usable ***\n");
	if (!opt.list_given) {
		opt.nlist = 0;
		opt.list[opt.nlist++] = A_CUVMM;
		if (g_gpu) {
			if (opt.backend == CUVMM_BACKEND_CUDA)
				opt.list[opt.nlist++] = A_CUVMMASYNC;
			opt.list[opt.nlist++] = A_CUDAMALLOC;
			if (g_have_mempool) {
				opt.list[opt.nlist++] = A_ASYNC0;
				opt.list[opt.nlist++] = A_ASYNCMAX;
			}
		}
	}
	for (int i = 0; i < opt.nlist; i++) {
		enum akind k = opt.list[i];

		if (!is_cuvmm(k) && !g_gpu) {
			fprintf(stderr, "trace: allocator %s needs a usable GPU\n", aname[k]);
			return 2;
		}
		if ((k == A_ASYNC0 || k == A_ASYNCMAX) && !g_have_mempool) {
			fprintf(stderr, "trace: allocator %s needs memory pool support on device 0\n", aname[k]);
			return 2;
		}
	}

	trace_build(&t);
	info("trace: %u requests (prompt %.0f tokens, output %.0f tokens on average), concurrency %u, %" PRIu64
	     " B/token, seed %" PRIu64 ", scale %g\n",
	     opt.requests, (double)t.total_tokens_prompt / opt.requests, (double)t.total_tokens_output / opt.requests,
	     opt.concurrency, opt.kv_per_token, opt.seed, opt.scale);
	info("trace: %zu ops (%zu mallocs, %zu frees, %zu decode steps); peak live %.3f GiB at op %zu (%u "
	     "allocations)\n",
	     t.nops, t.nalloc, t.nfree, t.nsteps, (double)t.peak_live / GIB, t.peak_op, t.nlive_after[t.peak_op]);
	info("allocators:");
	for (int i = 0; i < opt.nlist; i++)
		info(" %s", aname[opt.list[i]]);
	info("; cuvmm backend %s\n", opt.backend == CUVMM_BACKEND_HOST ? "HOST" : "cuda");
	if (opt.backend == CUVMM_BACKEND_HOST) {
		uint64_t avail = host_mem_available();

		info("note: the host backend commits real host memory: the peak held bytes, at least %.1f GiB (peak live) "
		     "and up to about twice that%s\n",
		     (double)t.peak_live / GIB,
		     avail && (double)t.peak_live * 2.2 > (double)avail ? " -- MAY EXCEED MemAvailable; try --scale" : "");
	}

	for (int i = 0; i < opt.nlist; i++) {
		if (run_one(opt.list[i], &t, &res[nres++]))
			failed = 1;
	}

	memset(rt, 0, sizeof(rt));
	rbytes = opt.return_test_bytes >= 0 ? (uint64_t)opt.return_test_bytes
					     : (opt.backend == CUVMM_BACKEND_CUDA ? 8 * GIB : 256 * MIB);
	if (rbytes) {
		info("\n== return test: %.0f MiB in %.0f MiB pieces ==\n", (double)rbytes / MIB, (double)RT_PIECE / MIB);
		if (rtest_cuvmm(&rt[0], rbytes))
			failed = 1;
		if (g_gpu && g_have_mempool && rtest_async(&rt[1], rbytes))
			failed = 1;
	}

	print_table(res, nres, &t);
	print_rtests(rt, 2);
	if (opt.csv && write_csv(opt.csv, res, nres))
		failed = 1;
	if (opt.summary_csv && write_summary(opt.summary_csv, res, nres, rt, 2))
		failed = 1;
	if (failed)
		fprintf(stderr, "trace: at least one allocator failed\n");
	for (int i = 0; i < nres; i++)
		free(res[i].s);
	free(t.ops);
	free(t.live_after);
	free(t.nlive_after);
	if (g_gpu) {
		cudaError_t e = cudaStreamDestroy(g_stream);

		if (e != cudaSuccess) {
			cuda_fail(e, "cudaStreamDestroy");
			failed = 1;
		}
	}
	return failed;
}
