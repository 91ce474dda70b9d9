/*
 * CUDA graph capture: allocation and free on a capturing stream, graph pools, and no call of the library
 * (application threads or the background thread) invalidating a capture. On the host backend the capture
 * is the backend's model of CUDA's rules (drv_test.h): it is invalidated by exactly what would invalidate a
 * real one. On the CUDA backend the captures are real, in global mode, and the graphs are replayed.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "drv_test.h"
#include "gpu.h"

#define MiB TC_MiB

/* A capture under way: on CUDA a real one on its own stream. */
struct cap {
	CUstream stream;
	uint64_t id;
	CUgraphExec exec;
};

static char host_streams[8];
static int next_host_stream;

static CUstream new_stream(void)
{
	CUstream s = NULL;

	if (tc_on_host())
		return (CUstream)&host_streams[next_host_stream++ % 8];
	ck_assert_int_eq(tg_stream_create(&s), 0);
	return s;
}

static void del_stream(CUstream s)
{
	if (!tc_on_host())
		tg_stream_destroy(s);
}

static void cap_begin(struct cap *c, CUstream s)
{
	memset(c, 0, sizeof(*c));
	c->stream = s;
	if (tc_on_host())
		c->id = cvm_host_capture_begin(s);
	else
		ck_assert_int_eq(tg_capture_begin(s), 0);
}

/* End the capture; asserts it was not invalidated. */
static void cap_end(struct cap *c)
{
	if (tc_on_host()) {
		ck_assert_msg(cvm_host_capture_end(c->stream), "the capture was invalidated");
		return;
	}
	int r = tg_capture_end(c->stream, &c->exec);

	ck_assert_msg(r == 0, "capture ended with %s", tg_error_name(r));
}

static void cap_replay(struct cap *c)
{
	if (tc_on_host())
		return;
	ck_assert_int_eq(tg_graph_launch(c->exec, c->stream), 0);
	ck_assert_int_eq(tg_stream_sync(c->stream), 0);
}

static void cap_destroy(struct cap *c)
{
	if (!tc_on_host() && c->exec)
		tg_graph_destroy(c->exec);
	c->exec = NULL;
}

static struct cuvmm_ctx *ctx_delay(int64_t delay_ms)
{
	struct cuvmm_config cfg;

	tc_config(&cfg);
	cfg.release_delay_ms = delay_ms;
	return tc_ctx(&cfg);
}

static struct cuvmm_pool *pool_new(struct cuvmm_ctx *ctx)
{
	struct cuvmm_pool_config pc;
	struct cuvmm_pool *p;

	cuvmm_pool_config_init(&pc);
	pc.max_bytes = 1ull << 30;
	pc.name = "capture";
	ck_assert_int_eq(cuvmm_pool_create(ctx, &pc, &p), CUVMM_OK);
	return p;
}

/* The id of the capture under way on s, as the library sees it. */
static uint64_t graph_pool_of(struct cuvmm_ctx *ctx, CUstream s)
{
	uint64_t id = 0;

	ck_assert_int_eq(cuvmm_capture_pool(ctx, 0, s, 0, &id), CUVMM_OK);
	ck_assert_uint_ne(id, 0);
	return id;
}

/*
 * Allocation and free under capture, in global mode, while the background thread gives memory back and
 * memory freed without a stream waits for a device synchronisation: the capture survives, the graph's
 * buffer is written at replay, memory freed in the capture is reused by the capture on its stream.
 */
START_TEST(test_capture_survives)
{
	struct cuvmm_ctx *ctx = ctx_delay(20);
	struct cuvmm_pool *p = pool_new(ctx);
	CUstream s = new_stream();
	void *pre, *a, *b, *c, *junk[8];
	struct cap cp;
	uint64_t gp;

	/* Work for the background thread during the capture: slack to release, stream-less frees to fence. */
	for (int i = 0; i < 8; i++)
		ck_assert_int_eq(cuvmm_malloc(p, 4 * MiB, &junk[i]), CUVMM_OK);
	ck_assert_int_eq(cuvmm_malloc_async(p, 8 * MiB, s, &pre), CUVMM_OK);
	for (int i = 0; i < 8; i++)
		ck_assert_int_eq(cuvmm_free(p, junk[i]), CUVMM_OK);

	cap_begin(&cp, s);
	gp = graph_pool_of(ctx, s);
	ck_assert_int_eq(cuvmm_malloc_async(p, 6 * MiB, s, &a), CUVMM_OK);
	ck_assert_int_eq(tc_fill_async(a, 6 * MiB / 4, 0xabcd, 1, s), 0);
	ck_assert_int_eq(cuvmm_malloc_async(p, 3 * MiB, s, &b), CUVMM_OK);
	ck_assert_int_eq(cuvmm_free_async(p, b, s), CUVMM_OK);
	/* Freed in this capture on this stream: this capture's next allocation of that size reuses it. */
	ck_assert_int_eq(cuvmm_malloc_async(p, 3 * MiB, s, &c), CUVMM_OK);
	ck_assert_ptr_eq(c, b);
	ck_assert_int_eq(cuvmm_free_async(p, c, s), CUVMM_OK);
	/* Memory from before the capture, freed in it: the graph owns it now. */
	ck_assert_int_eq(cuvmm_free_async(p, pre, s), CUVMM_OK);
	/* Let the background pass run (20 ms delay) and try to synchronise the device. */
	tc_sleep_ms(150);
	ck_assert_int_eq(cuvmm_pool_trim(p, 0), CUVMM_OK);
	cap_end(&cp);

	cap_replay(&cp);
	ck_assert_uint_eq(tc_check(a, 6 * MiB / 4, 0xabcd), 0);
	cap_destroy(&cp);
	ck_assert_int_eq(cuvmm_free_async(p, a, s), CUVMM_OK);
	ck_assert_int_eq(cuvmm_graph_release(ctx, gp), CUVMM_OK);
	tc_stream_sync(s);
	cuvmm_pool_destroy(p);
	del_stream(s);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/*
 * The calls added for issue #11 while a capture in global mode is under way on this thread's stream: a
 * sleep_prepare pins host memory (cuMemHostRegister, on the pinning threads) and a pool with coarse_bytes
 * maps fresh large handles for an allocation made outside the capture. Neither may invalidate the capture.
 */
START_TEST(test_capture_survives_prepare_and_coarse)
{
	struct cuvmm_ctx *ctx = ctx_delay(-1);
	struct cuvmm_pool *p = pool_new(ctx), *coarse;
	struct cuvmm_pool_config pc;
	CUstream s = new_stream();
	void *a, *big;
	struct cap cp;

	cuvmm_pool_config_init(&pc);
	pc.max_bytes = 1ull << 30;
	pc.name = "coarse";
	pc.coarse_bytes = 32 * MiB;
	ck_assert_int_eq(cuvmm_pool_create(ctx, &pc, &coarse), CUVMM_OK);
	ck_assert_int_eq(cuvmm_malloc(p, 96 * MiB, &a), CUVMM_OK);
	cap_begin(&cp, s);
	ck_assert_int_eq(cuvmm_pool_sleep_prepare(p, 0), CUVMM_OK);
	ck_assert_int_eq(cuvmm_malloc(coarse, 64 * MiB, &big), CUVMM_OK);
	ck_assert_int_eq(tc_fill_async(a, 96 * MiB / 4, 0x77, 1, s), 0);
	cap_end(&cp);
	cap_replay(&cp);
	ck_assert_uint_eq(tc_check(a, 96 * MiB / 4, 0x77), 0);
	cap_destroy(&cp);
	ck_assert_int_eq(cuvmm_pool_sleep(p, CUVMM_SLEEP_OFFLOAD, NULL), CUVMM_OK);
	ck_assert_int_eq(cuvmm_pool_wake(p, NULL), CUVMM_OK);
	ck_assert_uint_eq(tc_check(a, 96 * MiB / 4, 0x77), 0);
	ck_assert_int_eq(cuvmm_free(p, a), CUVMM_OK);
	ck_assert_int_eq(cuvmm_free(coarse, big), CUVMM_OK);
	cuvmm_pool_destroy(coarse);
	cuvmm_pool_destroy(p);
	del_stream(s);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/* Graph memory is not handed out outside its graph pool, nor given back, until the pool is released. */
START_TEST(test_graph_memory_kept)
{
	struct cuvmm_ctx *ctx = ctx_delay(0);
	struct cuvmm_pool *p = pool_new(ctx);
	CUstream s = new_stream(), s2 = new_stream();
	struct cuvmm_stats st = {.size = sizeof(st)};
	void *g[4], *q;
	struct cap cp;
	uint64_t gp;

	cap_begin(&cp, s);
	for (int i = 0; i < 4; i++)
		ck_assert_int_eq(cuvmm_malloc_async(p, 4 * MiB, s, &g[i]), CUVMM_OK);
	for (int i = 0; i < 4; i++)
		ck_assert_int_eq(cuvmm_free_async(p, g[i], s), CUVMM_OK);
	gp = graph_pool_of(ctx, s);
	cap_end(&cp);

	/* Released at once otherwise (delay 0): graph memory stays, and is live to the pool. */
	ck_assert_int_eq(cuvmm_pool_trim(p, 0), CUVMM_OK);
	ck_assert_int_eq(cuvmm_pool_stats(p, &st), CUVMM_OK);
	ck_assert_uint_ge(st.held_bytes, 16 * MiB);
	ck_assert_uint_ge(st.live_bytes, 16 * MiB);
	for (int round = 0; round < 2; round++) {
		CUstream on = round ? s2 : s;

		ck_assert_int_eq(cuvmm_malloc_async(p, 4 * MiB, on, &q), CUVMM_OK);
		for (int i = 0; i < 4; i++)
			ck_assert_ptr_ne(q, g[i]);
		ck_assert_int_eq(cuvmm_free_async(p, q, on), CUVMM_OK);
	}
	/* A double free of a freed graph block is refused. */
	ck_assert_int_eq(cuvmm_free_async(p, g[0], s), CUVMM_EINVAL);
	cap_replay(&cp);
	cap_destroy(&cp);
	ck_assert_int_eq(cuvmm_graph_release(ctx, gp), CUVMM_OK);
	ck_assert_int_eq(cuvmm_graph_release(ctx, gp), CUVMM_EINVAL);
	ck_assert_int_eq(cuvmm_pool_trim(p, 0), CUVMM_OK);
	ck_assert_int_eq(cuvmm_pool_stats(p, &st), CUVMM_OK);
	ck_assert_uint_eq(st.live_bytes, 0);
	ck_assert_uint_eq(st.held_bytes, 0);
	cuvmm_pool_destroy(p);
	del_stream(s);
	del_stream(s2);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/* Two graphs sharing a graph pool: the second reuses what the first freed; the first replays after other
 * streams allocated in between. */
START_TEST(test_shared_graph_pool)
{
	struct cuvmm_ctx *ctx = ctx_delay(10);
	struct cuvmm_pool *p = pool_new(ctx);
	CUstream s = new_stream(), s2 = new_stream();
	void *a, *b, *other[4];
	struct cap c1, c2;
	uint64_t gp1, gp2;

	cap_begin(&c1, s);
	gp1 = graph_pool_of(ctx, s);
	ck_assert_int_eq(cuvmm_malloc_async(p, 8 * MiB, s, &a), CUVMM_OK);
	ck_assert_int_eq(tc_fill_async(a, 8 * MiB / 4, 7, 1, s), 0);
	cap_end(&c1);
	/* The output dies: the block goes back to graph pool 1, not to the pool. */
	ck_assert_int_eq(cuvmm_free_async(p, a, s), CUVMM_OK);

	/* Other streams allocate and free meanwhile. */
	for (int i = 0; i < 4; i++)
		ck_assert_int_eq(cuvmm_malloc_async(p, 8 * MiB, s2, &other[i]), CUVMM_OK);
	for (int i = 0; i < 4; i++) {
		ck_assert_ptr_ne(other[i], a);
		ck_assert_int_eq(tc_fill_async(other[i], 8 * MiB / 4, 9, 1, s2), 0);
	}
	for (int i = 0; i < 4; i++)
		ck_assert_int_eq(cuvmm_free_async(p, other[i], s2), CUVMM_OK);
	tc_stream_sync(s2);

	cap_begin(&c2, s);
	ck_assert_int_eq(cuvmm_capture_pool(ctx, 0, s, gp1, &gp2), CUVMM_OK);
	ck_assert_uint_eq(gp2, gp1);
	ck_assert_int_eq(cuvmm_malloc_async(p, 8 * MiB, s, &b), CUVMM_OK);
	ck_assert_ptr_eq(b, a);
	ck_assert_int_eq(cuvmm_free_async(p, b, s), CUVMM_OK);
	/* Release refused while a capture into the pool runs. */
	ck_assert_int_eq(cuvmm_graph_release(ctx, gp1), CUVMM_EBUSY);
	cap_end(&c2);

	cap_replay(&c1);
	ck_assert_uint_eq(tc_check(a, 8 * MiB / 4, 7), 0);
	cap_destroy(&c1);
	cap_destroy(&c2);
	ck_assert_int_eq(cuvmm_graph_release(ctx, gp1), CUVMM_OK);
	cuvmm_pool_destroy(p);
	del_stream(s);
	del_stream(s2);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/* What cannot happen under capture is refused cleanly, and the capture survives the refusal. */
START_TEST(test_capture_refusals)
{
	struct cuvmm_ctx *ctx = ctx_delay(1000);
	struct cuvmm_pool *p = pool_new(ctx);
	struct cuvmm_region *r;
	CUstream s = new_stream(), idle = new_stream();
	struct cuvmm_stats before, after;
	uint64_t id;
	struct cap cp;
	void *q;

	ck_assert_int_eq(cuvmm_region_create(ctx, 0, 64 * MiB, &r), CUVMM_OK);
	ck_assert_int_eq(cuvmm_region_map(r, 0, 8 * MiB), CUVMM_OK);
	ck_assert_int_eq(cuvmm_malloc(p, 4 * MiB, &q), CUVMM_OK);
	ck_assert_int_eq(cuvmm_capture_pool(ctx, 0, idle, 0, &id), CUVMM_ESTATE);
	ck_assert_int_eq(cuvmm_capture_pool(ctx, 0, NULL, 0, &id), CUVMM_EINVAL);
	ck_assert_int_eq(cuvmm_graph_release(ctx, 12345), CUVMM_EINVAL);
	ck_assert_int_eq(cuvmm_graph_release(NULL, 1), CUVMM_EINVAL);

	cap_begin(&cp, s);
	ck_assert_int_eq(cuvmm_capture_pool(ctx, 0, s, 999999, &id), CUVMM_EINVAL);
	id = graph_pool_of(ctx, s);
	/* Under capture, a pointer that is not a live allocation is refused, and so is a second free of one the
	 * capture took over. */
	{
		void *big;
		struct cuvmm_stats ps0 = {.size = sizeof(ps0)}, ps1 = {.size = sizeof(ps1)};

		ck_assert_int_eq(cuvmm_malloc(p, 8 * MiB, &big), CUVMM_OK);
		ck_assert_int_eq(cuvmm_pool_stats(p, &ps0), CUVMM_OK);
		ck_assert_int_eq(cuvmm_free_async(p, (char *)big + 2 * MiB, s), CUVMM_EINVAL);
		ck_assert_int_eq(cuvmm_free_async(p, (char *)big + 256, s), CUVMM_EINVAL);
		ck_assert_int_eq(cuvmm_free_async(p, big, s), CUVMM_OK);
		ck_assert_int_eq(cuvmm_free_async(p, big, s), CUVMM_EINVAL);
		ck_assert_int_eq(cuvmm_free(p, big), CUVMM_EINVAL);
		ck_assert_int_eq(cuvmm_pool_stats(p, &ps1), CUVMM_OK);
		ck_assert_uint_eq(ps1.live_bytes, ps0.live_bytes); /* the graph keeps it */
	}
	before = tc_region_stats(r);
	ck_assert_int_eq(cuvmm_region_unmap(r, 0, 2 * MiB, s), CUVMM_ENOTSUP);
	ck_assert_int_eq(cuvmm_region_sleep(r, CUVMM_SLEEP_OFFLOAD, s), CUVMM_ENOTSUP);
	/* A device synchronisation would break the capture: refused while it is under way. */
	ck_assert_int_eq(cuvmm_region_sleep(r, CUVMM_SLEEP_DISCARD, NULL), CUVMM_EBUSY);
	ck_assert_int_eq(cuvmm_pool_sleep(p, CUVMM_SLEEP_DISCARD, NULL), CUVMM_EBUSY);
	after = tc_region_stats(r);
	ck_assert_uint_eq(after.mapped_bytes, before.mapped_bytes);
	/* A failing capture query fails the call and changes nothing. */
	{
		struct cuvmm_stats ps0 = {.size = sizeof(ps0)}, ps1 = {.size = sizeof(ps1)};
		void *untouched = q;

		ck_assert_int_eq(cuvmm_pool_stats(p, &ps0), CUVMM_OK);
		ck_assert_int_eq(cuvmm_ctx_inject_fault(ctx, CUVMM_CALL_CAPTURE_INFO, 0, 1, CUVMM_EDRIVER),
				 CUVMM_OK);
		ck_assert_int_eq(cuvmm_malloc_async(p, 1 * MiB, s, &q), CUVMM_EDRIVER);
		ck_assert_ptr_eq(q, untouched);
		ck_assert_int_eq(cuvmm_ctx_inject_fault(ctx, CUVMM_CALL_CAPTURE_INFO, 0, 1, CUVMM_EDRIVER),
				 CUVMM_OK);
		ck_assert_int_eq(cuvmm_free_async(p, q, s), CUVMM_EDRIVER);
		ck_assert_int_eq(cuvmm_pool_stats(p, &ps1), CUVMM_OK);
		ck_assert_uint_eq(ps1.live_bytes, ps0.live_bytes);
	}
	cap_end(&cp);
	cap_destroy(&cp);
	ck_assert_int_eq(cuvmm_free(p, q), CUVMM_OK);
	ck_assert_int_eq(cuvmm_graph_release(ctx, id), CUVMM_OK);
	cuvmm_region_destroy(r);
	cuvmm_pool_destroy(p);
	del_stream(s);
	del_stream(idle);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/* Threads allocating under capture on their own streams while other threads allocate outside. */
struct worker {
	struct cuvmm_pool *p;
	CUstream s;
	int capture;
	int failures;
};

static void *work(void *arg)
{
	struct worker *w = arg;
	void *q[16];

	for (int round = 0; round < 50; round++) {
		for (int i = 0; i < 16; i++)
			if (cuvmm_malloc_async(w->p, (size_t)(i + 1) * 256 * 1024, w->s, &q[i]))
				w->failures++, q[i] = NULL;
		for (int i = 0; i < 16; i++)
			if (q[i] && cuvmm_free_async(w->p, q[i], w->s))
				w->failures++;
	}
	return NULL;
}

START_TEST(test_capture_threads)
{
	struct cuvmm_ctx *ctx = ctx_delay(5);
	struct cuvmm_pool *p = pool_new(ctx);
	struct worker w[3];
	pthread_t t[3];
	struct cap cp;
	uint64_t id;

	for (int i = 0; i < 3; i++)
		w[i] = (struct worker){.p = p, .s = new_stream(), .capture = i == 0};
	cap_begin(&cp, w[0].s);
	for (int i = 0; i < 3; i++)
		pthread_create(&t[i], NULL, work, &w[i]);
	for (int i = 0; i < 3; i++)
		pthread_join(t[i], NULL);
	id = graph_pool_of(ctx, w[0].s);
	cap_end(&cp);
	for (int i = 0; i < 3; i++)
		ck_assert_int_eq(w[i].failures, 0);
	cap_destroy(&cp);
	ck_assert_int_eq(cuvmm_graph_release(ctx, id), CUVMM_OK);
	for (int i = 0; i < 3; i++) {
		tc_stream_sync(w[i].s);
		del_stream(w[i].s);
	}
	cuvmm_pool_destroy(p);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

static Suite *suite(void)
{
	Suite *s = suite_create("capture");
	TCase *tc = tcase_create("capture");

	tcase_set_timeout(tc, TC_TIMEOUT);
	tcase_add_test(tc, test_capture_survives);
	tcase_add_test(tc, test_capture_survives_prepare_and_coarse);
	tcase_add_test(tc, test_graph_memory_kept);
	tcase_add_test(tc, test_shared_graph_pool);
	tcase_add_test(tc, test_capture_refusals);
	tcase_add_test(tc, test_capture_threads);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	return tc_run(suite());
}
