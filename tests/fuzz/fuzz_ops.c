/*
 * libFuzzer harness (issue #9): operation sequences over every object of one host-backend context, with
 * single and double faults injected into the driver calls, against a shadow model.
 *
 * The input is a byte string read as a program: a header (device limit, release delay, kv block size; without
 * a limit, bit 7 picks mode 2: a pool with coarse_bytes of 1-8 granules and sleep_prepare calls), then
 * one opcode byte and its argument bytes per step. The objects: a region in granules, a region mapped in
 * units of 4 granules, a pool, a kv object of 2 tensors. The model keeps what the API promises:
 *   - which granules of each region are mapped (live), and a tag written at both ends of each, which must
 *     read back (OFFLOAD sleep included) until the granule is unmapped; touching memory without access
 *     crashes, which is a finding;
 *   - the pool's live allocations: aligned, inside the pool, never overlapping, tags intact;
 *   - the kv object's allocated ids: unique, below max_blocks, tags intact in every tensor;
 *   - sleep state: calls on a sleeping object fail with ESTATE, a failed sleep leaves it awake, a failed
 *     wake asleep;
 * and after every step the statistics invariants: mapped <= held <= peak_held, live <= peak_live, live <=
 * mapped for an awake object, device held <= device_limit_bytes, and live exactly as the model says. Return
 * codes must be documented ones. At the end, with the faults cleared, destroying everything must give every
 * byte back. Any violation aborts (a finding).
 *
 * Built by tests/fuzz/build.sh (clang, -fsanitize=fuzzer,address,undefined); run by .ci/run over the seed
 * corpus in tests/fuzz/corpus for a fixed time. Crash inputs found are kept in tests/fuzz/regressions and
 * replayed by CI.
 */
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuvmm.h"

#define GRAN ((size_t)64 << 10)   /* host granularity: small, so a step costs little */
#define R_PAGES 16                /* region: granules */
#define X_UNITS 4                 /* coarse region: units of X_GRAN */
#define X_GRAN (4 * GRAN)
#define P_PAGES 64                /* pool: granules of address space */
#define P_MAX 64                  /* pool: live allocations tracked */
#define KV_BLOCKS 48
#define KV_TENSORS 2

#define STREAM ((CUstream)(uintptr_t)0x51)

static void fail(const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	fprintf(stderr, "fuzz_ops: ");
	vfprintf(stderr, fmt, ap);
	fprintf(stderr, "\n");
	va_end(ap);
	abort();
}

#define CHECK(cond, ...)                                                                                     \
	do {                                                                                                 \
		if (!(cond))                                                                                 \
			fail(__VA_ARGS__);                                                                   \
	} while (0)

/* ----- input ----- */

struct input {
	const uint8_t *p;
	size_t n;
};

static uint8_t u8(struct input *in)
{
	if (!in->n)
		return 0;
	in->n--;
	return *in->p++;
}

static uint32_t u16(struct input *in)
{
	return (uint32_t)u8(in) | (uint32_t)u8(in) << 8;
}

/* ----- model ----- */

struct reg {
	struct cuvmm_region *r;
	size_t gran, units;
	bool live[R_PAGES];
	uint64_t tag[R_PAGES];
	bool asleep;
	bool discarded;  /* slept with DISCARD: contents unspecified after wake */
};

struct alloc {
	char *p;
	size_t size;
	uint64_t tag;
};

struct model {
	struct cuvmm_ctx *ctx;
	size_t limit;
	struct reg reg[2];
	struct cuvmm_pool *pool;
	struct alloc a[P_MAX];
	size_t na;
	bool pool_asleep, pool_discarded;
	struct cuvmm_kv *kv;
	size_t block_bytes;
	bool kv_busy[KV_BLOCKS];
	uint64_t kv_tag[KV_BLOCKS];
	uint64_t next_tag;
	bool faults;     /* some fault may be armed */
	bool mode2;      /* header bit 7 without a device limit: a pool with coarse_bytes, and sleep_prepare ops */
};

static void put_tag(char *p, size_t size, uint64_t tag)
{
	size_t n = size < 8 ? size : 8;

	memcpy(p, &tag, n);
	if (size >= 16)
		memcpy(p + size - 8, &tag, 8);
}

static bool has_tag(const char *p, size_t size, uint64_t tag)
{
	size_t n = size < 8 ? size : 8;
	uint64_t a = 0, b = tag;

	memcpy(&a, p, n);
	if (memcmp(&a, &tag, n))
		return false;
	if (size >= 16)
		memcpy(&b, p + size - 8, 8);
	return b == tag;
}

static char *reg_at(struct reg *g, size_t u)
{
	return (char *)cuvmm_region_base(g->r) + u * g->gran;
}

static char *kv_at(struct model *m, uint32_t t, uint32_t b)
{
	return (char *)cuvmm_kv_tensor(m->kv, t) + (size_t)b * m->block_bytes;
}

static bool code_ok(int err, bool einval)
{
	switch (err) {
	case CUVMM_OK:
	case CUVMM_ENOMEM:
	case CUVMM_ENOSPC:
	case CUVMM_EDRIVER:
	case CUVMM_ESTATE:
	case CUVMM_EBUSY:
		return true;
	case CUVMM_EINVAL:
		return einval;
	default:
		return false;
	}
}

static struct cuvmm_stats stats_of(int (*fn)(void *, struct cuvmm_stats *), void *obj)
{
	struct cuvmm_stats s = {.size = sizeof(s)};

	CHECK(fn(obj, &s) == CUVMM_OK, "stats failed");
	return s;
}

static void check_stats(const struct cuvmm_stats *s, const char *who, bool awake)
{
	CHECK(s->mapped_bytes <= s->held_bytes, "%s: mapped %llu > held %llu", who,
	      (unsigned long long)s->mapped_bytes, (unsigned long long)s->held_bytes);
	CHECK(s->held_bytes <= s->peak_held_bytes, "%s: held > peak", who);
	CHECK(s->live_bytes <= s->peak_live_bytes, "%s: live > peak", who);
	if (awake)
		CHECK(s->live_bytes <= s->mapped_bytes, "%s: live %llu > mapped %llu", who,
		      (unsigned long long)s->live_bytes, (unsigned long long)s->mapped_bytes);
}

/* The invariants and the model, after every step. */
static void verify(struct model *m)
{
	struct cuvmm_stats s = {.size = sizeof(s)};
	size_t sum = 0, nkv = 0;

	CHECK(cuvmm_ctx_stats(m->ctx, 0, &s) == CUVMM_OK, "ctx stats");
	check_stats(&s, "device", false);
	if (m->limit)
		CHECK(s.peak_held_bytes <= m->limit, "device: peak_held %llu > limit %zu",
		      (unsigned long long)s.peak_held_bytes, m->limit);
	for (int i = 0; i < 2; i++) {
		struct reg *g = &m->reg[i];
		size_t live = 0;

		s = stats_of((int (*)(void *, struct cuvmm_stats *))cuvmm_region_stats, g->r);
		check_stats(&s, i ? "coarse region" : "region", !g->asleep);
		for (size_t u = 0; u < g->units; u++) {
			if (!g->live[u])
				continue;
			live += g->gran;
			if (!g->asleep)
				CHECK(has_tag(reg_at(g, u), g->gran, g->tag[u]), "region %d unit %zu: contents lost", i,
				      u);
		}
		CHECK(s.live_bytes == live, "region %d: live %llu, model %zu", i,
		      (unsigned long long)s.live_bytes, live);
	}
	s = stats_of((int (*)(void *, struct cuvmm_stats *))cuvmm_pool_stats, m->pool);
	check_stats(&s, "pool", !m->pool_asleep);
	for (size_t i = 0; i < m->na; i++) {
		sum += m->a[i].size;
		if (!m->pool_asleep)
			CHECK(has_tag(m->a[i].p, m->a[i].size, m->a[i].tag), "pool allocation %p: contents lost",
			      (void *)m->a[i].p);
	}
	CHECK(s.live_bytes >= sum, "pool: live %llu < allocated %zu", (unsigned long long)s.live_bytes, sum);
	if (!m->na)
		CHECK(s.live_bytes == 0, "pool: live %llu with nothing allocated", (unsigned long long)s.live_bytes);
	s = stats_of((int (*)(void *, struct cuvmm_stats *))cuvmm_kv_stats, m->kv);
	check_stats(&s, "kv", true);
	for (uint32_t b = 0; b < KV_BLOCKS; b++) {
		if (!m->kv_busy[b])
			continue;
		nkv++;
		for (uint32_t t = 0; t < KV_TENSORS; t++)
			CHECK(has_tag(kv_at(m, t, b), m->block_bytes, m->kv_tag[b] + t), "kv block %u: contents lost",
			      b);
	}
	CHECK(s.live_bytes == nkv * m->block_bytes * KV_TENSORS, "kv: live %llu, model %zu blocks",
	      (unsigned long long)s.live_bytes, nkv);
}

/* ----- steps ----- */

static void reg_refill(struct model *m, struct reg *g)
{
	for (size_t u = 0; u < g->units; u++)
		if (g->live[u]) {
			g->tag[u] = ++m->next_tag;
			put_tag(reg_at(g, u), g->gran, g->tag[u]);
		}
}

static void op_region(struct model *m, struct input *in, int op)
{
	struct reg *g = &m->reg[u8(in) & 1];
	size_t a = u8(in) % g->units, n = 1 + u8(in) % (g->units - a);
	bool was[R_PAGES];
	int err;

	memcpy(was, g->live, sizeof(was));
	switch (op) {
	case 0: /* map */
		err = cuvmm_region_map(g->r, a * g->gran, n * g->gran);
		CHECK(code_ok(err, false), "region map: %s", cuvmm_err_name(err));
		CHECK(!g->asleep || err == CUVMM_ESTATE, "map of a sleeping region: %s", cuvmm_err_name(err));
		if (err)
			return;
		for (size_t u = a; u < a + n; u++)
			if (!g->live[u]) {
				g->live[u] = true;
				g->tag[u] = ++m->next_tag;
				put_tag(reg_at(g, u), g->gran, g->tag[u]);
			}
		return;
	case 1: /* unmap */
		err = cuvmm_region_unmap(g->r, a * g->gran, n * g->gran, u8(in) & 1 ? STREAM : NULL);
		CHECK(code_ok(err, false), "region unmap: %s", cuvmm_err_name(err));
		CHECK(!g->asleep || err == CUVMM_ESTATE, "unmap of a sleeping region: %s", cuvmm_err_name(err));
		if (!err)
			for (size_t u = a; u < a + n; u++)
				g->live[u] = false;
		return;
	case 2: /* resize */
		n = (size_t)u16(in) * 16 % (g->units * g->gran + 1);
		err = cuvmm_region_resize(g->r, n, u8(in) & 1 ? STREAM : NULL);
		CHECK(code_ok(err, false), "region resize: %s", cuvmm_err_name(err));
		CHECK(!g->asleep || err == CUVMM_ESTATE, "resize of a sleeping region: %s", cuvmm_err_name(err));
		if (err)
			return;
		for (size_t u = 0; u < g->units; u++) {
			g->live[u] = u * g->gran < n;
			if (g->live[u] && !was[u]) {
				g->tag[u] = ++m->next_tag;
				put_tag(reg_at(g, u), g->gran, g->tag[u]);
			}
		}
		return;
	case 3: { /* sleep */
		enum cuvmm_sleep_mode mode = u8(in) & 1 ? CUVMM_SLEEP_DISCARD : CUVMM_SLEEP_OFFLOAD;

		err = cuvmm_region_sleep(g->r, mode, u8(in) & 1 ? STREAM : NULL);
		CHECK(code_ok(err, false), "region sleep: %s", cuvmm_err_name(err));
		CHECK(!g->asleep || err == CUVMM_ESTATE, "sleep of a sleeping region: %s", cuvmm_err_name(err));
		if (!err) {
			g->asleep = true;
			g->discarded = mode == CUVMM_SLEEP_DISCARD;
		}
		return;
	}
	default: /* wake; in mode 2, every other one a prepare */
		if (m->mode2 && (a & 1)) {
			size_t bytes = (size_t)u8(in) * GRAN / 4;

			err = cuvmm_region_sleep_prepare(g->r, bytes);
			if (bytes > g->units * g->gran) {
				CHECK(err == CUVMM_EINVAL, "region sleep_prepare beyond its size: %s", cuvmm_err_name(err));
				return;
			}
			CHECK(code_ok(err, false), "region sleep_prepare: %s", cuvmm_err_name(err));
			CHECK(!g->asleep || err == CUVMM_ESTATE, "prepare of a sleeping region: %s", cuvmm_err_name(err));
			CHECK(g->asleep || err != CUVMM_ESTATE, "prepare of an awake region: ESTATE");
			return;
		}
		err = cuvmm_region_wake(g->r, u8(in) & 1 ? STREAM : NULL);
		CHECK(code_ok(err, false), "region wake: %s", cuvmm_err_name(err));
		CHECK(g->asleep || err == CUVMM_ESTATE, "wake of an awake region: %s", cuvmm_err_name(err));
		if (!err) {
			g->asleep = false;
			if (g->discarded)
				reg_refill(m, g);
		}
		return;
	}
}

static void op_malloc(struct model *m, struct input *in)
{
	/* Slab sizes up to GRAN / 4; packed ones (byte ranges sharing granules) up to 32 granules; one above
	 * (whole granules); one beyond the pool. */
	static const size_t sizes[] = {1, 255, 256, 4000, 16 << 10, GRAN - 1, GRAN, GRAN + 1, 3 * GRAN, 7 * GRAN + 5,
				       33 * GRAN + 5, (P_PAGES + 1) * GRAN};
	size_t size = sizes[u8(in) % (sizeof(sizes) / sizeof(sizes[0]))];
	bool async = u8(in) & 1;
	void *p = NULL;
	int err;

	if (m->na == P_MAX)
		return;
	err = async ? cuvmm_malloc_async(m->pool, size, STREAM, &p) : cuvmm_malloc(m->pool, size, &p);
	CHECK(code_ok(err, false), "malloc: %s", cuvmm_err_name(err));
	/* (a size beyond the pool's address space is ENOSPC before the state is looked at) */
	CHECK(!m->pool_asleep || err == CUVMM_ESTATE || (err == CUVMM_ENOSPC && size > P_PAGES * GRAN),
	      "malloc in a sleeping pool: %s", cuvmm_err_name(err));
	if (err) {
		CHECK(p == NULL, "malloc failed but wrote the pointer");
		return;
	}
	CHECK(((uintptr_t)p & 255) == 0, "malloc: %p not aligned", p);
	for (size_t i = 0; i < m->na; i++)
		CHECK((char *)p + size <= m->a[i].p || m->a[i].p + m->a[i].size <= (char *)p,
		      "malloc: [%p, +%zu) overlaps [%p, +%zu)", p, size, (void *)m->a[i].p, m->a[i].size);
	m->a[m->na].p = p;
	m->a[m->na].size = size;
	m->a[m->na].tag = ++m->next_tag;
	put_tag(p, size, m->a[m->na].tag);
	m->na++;
}

static void op_free(struct model *m, struct input *in)
{
	size_t i;
	uint8_t how = u8(in);
	char *p;
	int err;

	if (!m->na) {
		/* A pointer outside the pool: refused (arguments are checked before the state), nothing changes. */
		err = cuvmm_free(m->pool, (char *)cuvmm_region_base(m->reg[0].r));
		CHECK(err == CUVMM_EINVAL, "free of a foreign pointer: %s", cuvmm_err_name(err));
		return;
	}
	i = u8(in) % m->na;
	p = m->a[i].p;
	err = how & 1 ? cuvmm_free_async(m->pool, p, STREAM) : cuvmm_free(m->pool, p);
	CHECK(code_ok(err, false), "free: %s", cuvmm_err_name(err));
	CHECK(!m->pool_asleep || err == CUVMM_ESTATE, "free in a sleeping pool: %s", cuvmm_err_name(err));
	if (err)
		return;
	m->a[i] = m->a[--m->na];
	if (how & 2) {
		err = cuvmm_free(m->pool, p);
		CHECK(err == CUVMM_EINVAL, "double free: %s", cuvmm_err_name(err));
	}
}

static void op_pool_misc(struct model *m, struct input *in)
{
	uint8_t what = u8(in) % (m->mode2 ? 4 : 3);
	int err;

	if (what == 3) {
		err = cuvmm_pool_sleep_prepare(m->pool, (size_t)u8(in) * GRAN / 4);
		CHECK(code_ok(err, false), "pool sleep_prepare: %s", cuvmm_err_name(err));
		CHECK(!m->pool_asleep || err == CUVMM_ESTATE, "prepare of a sleeping pool: %s", cuvmm_err_name(err));
		CHECK(m->pool_asleep || err != CUVMM_ESTATE, "prepare of an awake pool: ESTATE");
	} else if (what == 0) {
		err = cuvmm_pool_trim(m->pool, (size_t)u8(in) * GRAN);
		CHECK(err == (m->pool_asleep ? CUVMM_ESTATE : CUVMM_OK), "pool trim: %s", cuvmm_err_name(err));
	} else if (what == 1) {
		enum cuvmm_sleep_mode mode = u8(in) & 1 ? CUVMM_SLEEP_DISCARD : CUVMM_SLEEP_OFFLOAD;

		err = cuvmm_pool_sleep(m->pool, mode, u8(in) & 1 ? STREAM : NULL);
		CHECK(code_ok(err, false), "pool sleep: %s", cuvmm_err_name(err));
		CHECK(!m->pool_asleep || err == CUVMM_ESTATE, "sleep of a sleeping pool: %s", cuvmm_err_name(err));
		if (!err) {
			m->pool_asleep = true;
			m->pool_discarded = mode == CUVMM_SLEEP_DISCARD;
		}
	} else {
		err = cuvmm_pool_wake(m->pool, u8(in) & 1 ? STREAM : NULL);
		CHECK(code_ok(err, false), "pool wake: %s", cuvmm_err_name(err));
		CHECK(m->pool_asleep || err == CUVMM_ESTATE, "wake of an awake pool: %s", cuvmm_err_name(err));
		if (!err) {
			m->pool_asleep = false;
			if (m->pool_discarded)
				for (size_t i = 0; i < m->na; i++)
					put_tag(m->a[i].p, m->a[i].size, m->a[i].tag);
		}
	}
}

static void op_kv_alloc(struct model *m, struct input *in)
{
	uint32_t n = 1 + u8(in) % 8, ids[8];
	int err = cuvmm_kv_alloc(m->kv, n, ids);

	CHECK(code_ok(err, false), "kv alloc: %s", cuvmm_err_name(err));
	if (err)
		return;
	for (uint32_t i = 0; i < n; i++) {
		CHECK(ids[i] < KV_BLOCKS, "kv alloc: id %u out of range", ids[i]);
		CHECK(!m->kv_busy[ids[i]], "kv alloc: id %u handed out twice", ids[i]);
		m->kv_busy[ids[i]] = true;
		m->kv_tag[ids[i]] = (m->next_tag += KV_TENSORS);
		for (uint32_t t = 0; t < KV_TENSORS; t++)
			put_tag(kv_at(m, t, ids[i]), m->block_bytes, m->kv_tag[ids[i]] + t);
	}
}

static void op_kv_free(struct model *m, struct input *in)
{
	uint32_t ids[KV_BLOCKS], n = 0;
	uint64_t pick = (uint64_t)u16(in) << 16 | u16(in);
	CUstream stream = u8(in) & 1 ? STREAM : NULL;
	int err;

	for (uint32_t b = 0; b < KV_BLOCKS; b++)
		if (m->kv_busy[b] && (pick >> (b % 32) & 1))
			ids[n++] = b;
	if (!n) {
		ids[0] = KV_BLOCKS; /* out of range: EINVAL */
		err = cuvmm_kv_free(m->kv, 1, ids, stream);
		CHECK(err == CUVMM_EINVAL, "kv free of a bad id: %s", cuvmm_err_name(err));
		return;
	}
	err = cuvmm_kv_free(m->kv, n, ids, stream);
	CHECK(code_ok(err, false), "kv free: %s", cuvmm_err_name(err));
	if (!err)
		for (uint32_t i = 0; i < n; i++)
			m->kv_busy[ids[i]] = false;
}

static const enum cuvmm_call fault_calls[] = {
	CUVMM_CALL_CREATE,      CUVMM_CALL_RELEASE,      CUVMM_CALL_MAP,        CUVMM_CALL_UNMAP,
	CUVMM_CALL_SET_ACCESS,  CUVMM_CALL_EVENT_CREATE, CUVMM_CALL_EVENT_RECORD, CUVMM_CALL_EVENT_QUERY,
	CUVMM_CALL_EVENT_SYNC,  CUVMM_CALL_DEVICE_SYNC,  CUVMM_CALL_STREAM_WAIT, CUVMM_CALL_HOST_REGISTER,
	CUVMM_CALL_COPY,
};
#define NFAULT_CALLS (sizeof(fault_calls) / sizeof(fault_calls[0]))

static void clear_faults(struct model *m)
{
	for (int c = 0; c < CUVMM_CALL_COUNT_; c++)
		cuvmm_ctx_inject_fault(m->ctx, (enum cuvmm_call)c, 0, 0, CUVMM_EDRIVER);
	m->faults = false;
}

/* One fault, or two at once (the double fault: a call and the call its undo makes). */
static void op_fault(struct model *m, struct input *in, bool twice)
{
	for (int k = 0; k < (twice ? 2 : 1); k++) {
		enum cuvmm_call call = fault_calls[u8(in) % NFAULT_CALLS];
		uint8_t how = u8(in);
		uint32_t count = how & 0x40 ? UINT32_MAX : 1 + (how & 1);
		int err = how & 0x80 ? CUVMM_ENOMEM : CUVMM_EDRIVER;

		CHECK(cuvmm_ctx_inject_fault(m->ctx, call, (how >> 1) & 3, count, err) == CUVMM_OK, "inject");
		m->faults = true;
	}
}

/* ----- one input ----- */

static void quiet(enum cuvmm_log_level level, const char *msg, void *user)
{
	(void)level;
	(void)msg;
	(void)user;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	static const size_t block_sizes[] = {GRAN / 4, GRAN / 3 + 8, GRAN, GRAN + GRAN / 2};
	struct input in = {data, size};
	struct cuvmm_config cfg;
	struct cuvmm_pool_config pc;
	struct cuvmm_kv_config kc;
	struct model *m;
	struct cuvmm_stats s = {.size = sizeof(s)};
	uint8_t h;
	int steps = 0, err;

	cuvmm_set_log_callback(quiet, NULL, CUVMM_LOG_ERROR);
	m = calloc(1, sizeof(*m));
	CHECK(m, "no memory");
	h = u8(&in);
	cuvmm_config_init(&cfg);
	cfg.backend = CUVMM_BACKEND_HOST;
	cfg.host_granularity = GRAN;
	cfg.background_release = false; /* one thread: every input replays exactly */
	cfg.release_delay_ms = h & 1 ? 0 : -1;
	m->limit = cfg.device_limit_bytes = h & 2 ? (size_t)(8 + (h >> 2) % 40) * GRAN : 0;
	err = cuvmm_ctx_create(&cfg, &m->ctx);
	CHECK(err == CUVMM_OK, "ctx create: %s", cuvmm_err_name(err));
	CHECK(cuvmm_region_create(m->ctx, 0, R_PAGES * GRAN, &m->reg[0].r) == CUVMM_OK, "region create");
	m->reg[0].gran = GRAN;
	m->reg[0].units = R_PAGES;
	CHECK(cuvmm_region_create_ex(m->ctx, 0, X_UNITS * X_GRAN, X_GRAN, &m->reg[1].r) == CUVMM_OK,
	      "coarse region create");
	m->reg[1].gran = X_GRAN;
	m->reg[1].units = X_UNITS;
	cuvmm_pool_config_init(&pc);
	pc.max_bytes = P_PAGES * GRAN;
	m->mode2 = !(h & 2) && (h & 0x80);
	if (m->mode2)
		pc.coarse_bytes = (1 + ((h >> 2) & 7)) * GRAN;
	CHECK(cuvmm_pool_create(m->ctx, &pc, &m->pool) == CUVMM_OK, "pool create");
	cuvmm_kv_config_init(&kc);
	m->block_bytes = kc.block_bytes = block_sizes[u8(&in) % 4];
	kc.max_blocks = KV_BLOCKS;
	kc.tensors = KV_TENSORS;
	CHECK(cuvmm_kv_create(m->ctx, &kc, &m->kv) == CUVMM_OK, "kv create");

	while (in.n && steps++ < 200) {
		uint8_t op = u8(&in) % 16;

		switch (op) {
		case 0: case 1: case 2: case 3: case 4:
			op_region(m, &in, op);
			break;
		case 5: case 6:
			op_malloc(m, &in);
			break;
		case 7:
			op_free(m, &in);
			break;
		case 8:
			op_pool_misc(m, &in);
			break;
		case 9:
			op_kv_alloc(m, &in);
			break;
		case 10:
			op_kv_free(m, &in);
			break;
		case 11:
			op_fault(m, &in, false);
			break;
		case 12:
			op_fault(m, &in, true);
			break;
		case 13:
			clear_faults(m);
			break;
		case 14:
			err = cuvmm_ctx_trim(m->ctx, u8(&in) & 1 ? -1 : 0, (size_t)u8(&in) * GRAN);
			CHECK(err == CUVMM_OK || err == CUVMM_EDRIVER, "ctx trim: %s", cuvmm_err_name(err));
			break;
		default: { /* compaction plan, dropped at once */
			struct cuvmm_kv_move mv[16];
			uint32_t n = 0;

			err = cuvmm_kv_compact(m->kv, 16, mv, &n);
			CHECK(err == CUVMM_OK || err == CUVMM_ENOMEM, "kv compact: %s", cuvmm_err_name(err));
			for (uint32_t i = 0; i < n; i++) {
				CHECK(mv[i].from < KV_BLOCKS && m->kv_busy[mv[i].from], "compact: bad from %u",
				      mv[i].from);
				CHECK(mv[i].to < KV_BLOCKS && !m->kv_busy[mv[i].to], "compact: bad to %u", mv[i].to);
				m->kv_busy[mv[i].to] = true;
				m->kv_tag[mv[i].to] = (m->next_tag += KV_TENSORS);
				for (uint32_t t = 0; t < KV_TENSORS; t++)
					put_tag(kv_at(m, t, mv[i].to), m->block_bytes, m->kv_tag[mv[i].to] + t);
				err = cuvmm_kv_free(m->kv, 1, &mv[i].to, NULL);
				CHECK(code_ok(err, false), "compact drop: %s", cuvmm_err_name(err));
				if (!err)
					m->kv_busy[mv[i].to] = false;
			}
			break;
		}
		}
		verify(m);
	}

	/* Teardown with the driver well again: every byte must come back. */
	clear_faults(m);
	/* Sleeping objects wake (the rest of the limit may be taken: then they are destroyed asleep). */
	cuvmm_ctx_trim(m->ctx, -1, 0);
	for (int i = 0; i < 2; i++) {
		struct reg *g = &m->reg[i];

		err = g->asleep ? cuvmm_region_wake(g->r, NULL) : CUVMM_OK;
		CHECK(err == CUVMM_OK || (err == CUVMM_ENOMEM && m->limit), "final wake of region %d: %s", i,
		      cuvmm_err_name(err));
		if (g->asleep && !err) {
			g->asleep = false;
			if (g->discarded)
				reg_refill(m, g);
		}
	}
	err = m->pool_asleep ? cuvmm_pool_wake(m->pool, NULL) : CUVMM_OK;
	CHECK(err == CUVMM_OK || (err == CUVMM_ENOMEM && m->limit), "final pool wake: %s", cuvmm_err_name(err));
	if (m->pool_asleep && !err) {
		m->pool_asleep = false;
		if (m->pool_discarded)
			for (size_t i = 0; i < m->na; i++)
				put_tag(m->a[i].p, m->a[i].size, m->a[i].tag);
	}
	verify(m);
	for (size_t i = 0; i < m->na && !m->pool_asleep; i++)
		CHECK(cuvmm_free(m->pool, m->a[i].p) == CUVMM_OK, "final free");
	cuvmm_kv_destroy(m->kv);
	cuvmm_pool_destroy(m->pool);
	cuvmm_region_destroy(m->reg[0].r);
	cuvmm_region_destroy(m->reg[1].r);
	CHECK(cuvmm_ctx_trim(m->ctx, -1, 0) == CUVMM_OK, "final trim");
	CHECK(cuvmm_ctx_stats(m->ctx, 0, &s) == CUVMM_OK, "final stats");
	CHECK(s.reserved_bytes == 0 && s.mapped_bytes == 0 && s.live_bytes == 0 && s.held_bytes == 0,
	      "after destroying everything: reserved %llu mapped %llu live %llu held %llu",
	      (unsigned long long)s.reserved_bytes, (unsigned long long)s.mapped_bytes,
	      (unsigned long long)s.live_bytes, (unsigned long long)s.held_bytes);
	cuvmm_ctx_destroy(m->ctx);
	free(m);
	return 0;
}
