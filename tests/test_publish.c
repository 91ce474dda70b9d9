/*
 * The counters a context publishes for cuvmm-top (lib/publish.h), read back with the tool's own reader.
 */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common.h"
#include "ctx.h" /* struct cuvmm_ctx: its pub, to force a snapshot and find the file */
#include "ctx_publish.h"

static char dir[64];

/* Each test publishes into a private directory, empty at the start. */
static void setup(void)
{
	snprintf(dir, sizeof(dir), "/tmp/cuvmm-pub.XXXXXX");
	ck_assert_ptr_nonnull(mkdtemp(dir));
	tc_env_set("CUVMM_PUBLISH", NULL);
	tc_env_set("CUVMM_PUBLISH_DIR", dir);
}

static int count_files(void)
{
	DIR *d = opendir(dir);
	struct dirent *e;
	int n = 0;

	ck_assert_ptr_nonnull(d);
	while ((e = readdir(d)))
		n += strncmp(e->d_name, "cuvmm.", 6) == 0;
	closedir(d);
	return n;
}

static void teardown(void)
{
	DIR *d = opendir(dir);
	struct dirent *e;

	while (d && (e = readdir(d))) {
		char path[512];

		if (e->d_name[0] == '.')
			continue;
		snprintf(path, sizeof(path), "%s/%s", dir, e->d_name);
		unlink(path);
	}
	if (d)
		closedir(d);
	rmdir(dir);
	tc_log_release();
	tc_env_restore();
}

static struct cuvmm_ctx *ctx_delay(int64_t delay_ms, bool background)
{
	struct cuvmm_config cfg;

	tc_config(&cfg);
	cfg.release_delay_ms = delay_ms;
	cfg.background_release = background;
	return tc_ctx(&cfg);
}

static struct cuvmm_pool *pool_named(struct cuvmm_ctx *ctx, const char *name)
{
	struct cuvmm_pool_config pc;
	struct cuvmm_pool *p = NULL;

	cuvmm_pool_config_init(&pc);
	pc.name = name;
	ck_assert_int_eq(cuvmm_pool_create(ctx, &pc, &p), CUVMM_OK);
	return p;
}

static struct cvm_pub_page read_page(struct cuvmm_ctx *ctx)
{
	struct cvm_pub_page pg;

	ck_assert_ptr_nonnull(ctx->pub);
	ck_assert_int_eq(cvm_pub_read(ctx->pub->path, &pg), CVM_PUB_READ_OK);
	return pg;
}

static const struct cvm_pub_obj *find_obj(const struct cvm_pub_page *pg, const char *name)
{
	for (uint32_t i = 0; i < pg->nobj; i++)
		if (strcmp(pg->obj[i].name, name) == 0)
			return &pg->obj[i];
	return NULL;
}

/* The page holds what the stats functions say: per device, per pool (by name) and per region. */
START_TEST(test_publish_matches_stats)
{
	struct cuvmm_ctx *ctx = ctx_delay(-1, true);
	struct cuvmm_pool *w = pool_named(ctx, "weights");
	struct cuvmm_region *r = NULL;
	struct cuvmm_stats ds = {.size = sizeof(ds)}, ps = {.size = sizeof(ps)}, rs = {.size = sizeof(rs)};
	struct cvm_pub_page pg;
	const struct cvm_pub_obj *o;
	void *a, *b, *c;
	char want_path[256];

	ck_assert_int_eq(cuvmm_malloc(w, 5 * TC_MiB, &a), CUVMM_OK);
	ck_assert_int_eq(cuvmm_malloc(w, 3 * TC_MiB, &b), CUVMM_OK);
	ck_assert_int_eq(cuvmm_malloc(w, 1000, &c), CUVMM_OK);
	ck_assert_int_eq(cuvmm_free(w, b), CUVMM_OK); /* slack: held above live */
	ck_assert_int_eq(cuvmm_region_create(ctx, 0, 64 * TC_MiB, &r), CUVMM_OK);
	ck_assert_int_eq(cuvmm_region_map(r, 0, 4 * TC_MiB), CUVMM_OK);
	ck_assert_int_eq(cuvmm_region_unmap(r, 0, 4 * TC_MiB, NULL), CUVMM_OK);
	tc_settle(ctx); /* the region's chunks go to the cache: cached > 0 */
	ck_assert_int_eq(cuvmm_region_map(r, 0, 2 * TC_MiB), CUVMM_OK);

	cvm_pub_update(ctx, cvm_now_ns(), true);
	pg = read_page(ctx);
	ck_assert_int_eq(cuvmm_ctx_stats(ctx, 0, &ds), CUVMM_OK);
	ck_assert_int_eq(cuvmm_pool_stats(w, &ps), CUVMM_OK);
	ck_assert_int_eq(cuvmm_region_stats(r, &rs), CUVMM_OK);

	snprintf(want_path, sizeof(want_path), "%s/cuvmm.%d.", dir, (int)getpid());
	ck_assert_int_eq(strncmp(ctx->pub->path, want_path, strlen(want_path)), 0);
	ck_assert_int_eq(memcmp(pg.magic, "CUVMMPUB", 8), 0);
	ck_assert_int_eq(pg.version, CVM_PUB_VERSION);
	ck_assert_int_eq(pg.pid, getpid());
	ck_assert_int_eq(pg.backend, tc_backend());
	ck_assert_str_eq(pg.comm, "test_publish");
	ck_assert(!cvm_pub_dead(&pg));
	ck_assert_uint_gt(pg.updates, 1);
	ck_assert_uint_eq(pg.seq % 2, 0);

	ck_assert_uint_eq(pg.ndev, 1);
	ck_assert_int_eq(pg.dev[0].index, 0);
	ck_assert_uint_eq(pg.dev[0].held, ds.held_bytes);
	ck_assert_uint_eq(pg.dev[0].mapped, ds.mapped_bytes);
	ck_assert_uint_eq(pg.dev[0].live, ds.live_bytes);
	ck_assert_uint_eq(pg.dev[0].peak_held, ds.peak_held_bytes);
	ck_assert_uint_eq(pg.dev[0].cached, ds.held_bytes - ds.mapped_bytes);
	ck_assert_uint_gt(pg.dev[0].cached, 0);

	ck_assert_uint_eq(pg.nobj, 2);
	ck_assert_uint_eq(pg.nobj_all, 2);
	o = find_obj(&pg, "weights");
	ck_assert_ptr_nonnull(o);
	ck_assert_str_eq(o->kind, "pool");
	ck_assert_int_eq(o->device, 0);
	ck_assert_uint_eq(o->held, ps.held_bytes);
	ck_assert_uint_eq(o->live, ps.live_bytes);
	ck_assert_uint_gt(o->held, o->live);
	o = find_obj(&pg, "region");
	ck_assert_ptr_nonnull(o);
	ck_assert_str_eq(o->kind, "region");
	ck_assert_uint_eq(o->held, rs.held_bytes);
	ck_assert_uint_eq(o->live, rs.live_bytes);

	/* A destroyed object leaves the page with the next snapshot. */
	cuvmm_region_destroy(r);
	cvm_pub_update(ctx, cvm_now_ns(), true);
	pg = read_page(ctx);
	ck_assert_uint_eq(pg.nobj, 1);
	ck_assert_ptr_null(find_obj(&pg, "region"));
	ck_assert_int_eq(cuvmm_free(w, a), CUVMM_OK);
	ck_assert_int_eq(cuvmm_free(w, c), CUVMM_OK);
	cuvmm_pool_destroy(w);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/* Several contexts of one process: one file each; destroy removes each context's own. */
START_TEST(test_publish_files_per_ctx)
{
	struct cuvmm_ctx *a = ctx_delay(-1, true), *b = ctx_delay(-1, false);
	char pa[256], pb[256];
	struct stat st;

	ck_assert_int_eq(count_files(), 2);
	snprintf(pa, sizeof(pa), "%s", a->pub->path);
	snprintf(pb, sizeof(pb), "%s", b->pub->path);
	ck_assert_str_ne(pa, pb);
	ck_assert_int_eq(stat(pa, &st), 0);
	ck_assert_int_eq(st.st_mode & 0777, 0600); /* the owner's (and root's) to read */
	cuvmm_ctx_destroy(a);
	ck_assert_int_ne(stat(pa, &st), 0);
	ck_assert_int_eq(stat(pb, &st), 0);
	cuvmm_ctx_destroy(b);
	ck_assert_int_eq(count_files(), 0);
}
END_TEST

/* CUVMM_PUBLISH=0: no file. */
START_TEST(test_publish_off)
{
	struct cuvmm_ctx *ctx;
	struct cuvmm_pool *p;
	void *x;

	tc_env_set("CUVMM_PUBLISH", "0");
	ctx = ctx_delay(1000, true);
	ck_assert_ptr_null(ctx->pub);
	p = pool_named(ctx, "weights");
	ck_assert_int_eq(cuvmm_malloc(p, TC_MiB, &x), CUVMM_OK);
	ck_assert_int_eq(count_files(), 0);
	ck_assert_int_eq(cuvmm_free(p, x), CUVMM_OK);
	cuvmm_pool_destroy(p);
	cuvmm_ctx_destroy(ctx);
	tc_env_set("CUVMM_PUBLISH", "off");
	ctx = ctx_delay(1000, false);
	ck_assert_ptr_null(ctx->pub);
	cuvmm_ctx_destroy(ctx);
	ck_assert_int_eq(count_files(), 0);
}
END_TEST

/* A directory that cannot take the file: the context works, without a page, and says why at info. */
START_TEST(test_publish_bad_dir)
{
	struct cuvmm_ctx *ctx;
	struct cuvmm_pool *p;
	void *x;

	tc_log_capture(CUVMM_LOG_INFO);
	tc_env_set("CUVMM_PUBLISH_DIR", "/nonexistent/cuvmm-publish");
	ctx = ctx_delay(1000, true);
	ck_assert_ptr_null(ctx->pub);
	ck_assert_int_eq(tc_log_count(CUVMM_LOG_INFO, "cannot create"), 1);
	ck_assert_int_eq(tc_log_count(CUVMM_LOG_WARN, NULL), 0);
	p = pool_named(ctx, "weights");
	ck_assert_int_eq(cuvmm_malloc(p, TC_MiB, &x), CUVMM_OK);
	ck_assert_int_eq(cuvmm_free(p, x), CUVMM_OK);
	cuvmm_pool_destroy(p);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/* Without a forced snapshot, the page follows the program: by the background thread, or without one by
 * the library call that finds a snapshot due. */
START_TEST(test_publish_refreshes)
{
	bool background = _i;
	struct cuvmm_ctx *ctx = ctx_delay(1000, background); /* (a delay of -1 has no background thread) */
	struct cuvmm_pool *p = pool_named(ctx, "acts"), *poke = pool_named(ctx, "poke");
	struct cvm_pub_page pg;
	const struct cvm_pub_obj *o = NULL;
	void *x, *y;
	uint64_t t0 = tc_now_ms();

	ck_assert(ctx->bg_running == background);
	ck_assert_int_eq(cuvmm_malloc(p, 6 * TC_MiB, &x), CUVMM_OK);
	for (;;) {
		pg = read_page(ctx);
		o = find_obj(&pg, "acts");
		if (o && o->live == 6 * TC_MiB)
			break;
		ck_assert_msg(tc_now_ms() - t0 < 5000, "the page did not show the allocation in 5 s (%s)",
			      background ? "background thread" : "library calls");
		tc_sleep_ms(20);
		if (!background) { /* a library call on the pool: cvm_ctx_poll */
			ck_assert_int_eq(cuvmm_malloc(poke, 4096, &y), CUVMM_OK);
			ck_assert_int_eq(cuvmm_free(poke, y), CUVMM_OK);
		}
	}
	ck_assert_uint_ge(pg.dev[0].live, 6 * TC_MiB);
	ck_assert_int_eq(cuvmm_free(p, x), CUVMM_OK);
	cuvmm_pool_destroy(poke);
	cuvmm_pool_destroy(p);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/* A process that ends without destroying its context leaves its file; the reader knows it for dead. */
START_TEST(test_publish_dead_process)
{
	pid_t child = fork();
	int status;
	DIR *d;
	struct dirent *e;
	int seen = 0;

	ck_assert_int_ge(child, 0);
	if (child == 0) {
		struct cuvmm_ctx *ctx;
		struct cuvmm_config cfg;

		tc_config(&cfg);
		cfg.backend = CUVMM_BACKEND_HOST; /* CUDA is not for a forked child; the page is the same */
		cfg.background_release = false;
		_exit(cuvmm_ctx_create(&cfg, &ctx) == CUVMM_OK ? 0 : 1); /* no destroy: a crash */
	}
	ck_assert_int_eq(waitpid(child, &status, 0), child);
	ck_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0);
	d = opendir(dir);
	ck_assert_ptr_nonnull(d);
	while ((e = readdir(d))) {
		char path[512];
		struct cvm_pub_page pg;

		if (strncmp(e->d_name, "cuvmm.", 6))
			continue;
		snprintf(path, sizeof(path), "%s/%s", dir, e->d_name);
		ck_assert_int_eq(cvm_pub_read(path, &pg), CVM_PUB_READ_OK);
		ck_assert_int_eq(pg.pid, child);
		ck_assert(cvm_pub_dead(&pg));
		seen++;
	}
	closedir(d);
	ck_assert_int_eq(seen, 1);
}
END_TEST

/* A process that exits normally without destroying its context (the PyTorch shim's lives as long as the
 * process) leaves no file. */
START_TEST(test_publish_exit_unlinks)
{
	pid_t child = fork();
	int status;

	ck_assert_int_ge(child, 0);
	if (child == 0) {
		struct cuvmm_ctx *a, *b;
		struct cuvmm_config cfg;

		tc_config(&cfg);
		cfg.backend = CUVMM_BACKEND_HOST; /* CUDA is not for a forked child */
		if (cuvmm_ctx_create(&cfg, &a) || cuvmm_ctx_create(&cfg, &b))
			_exit(1);
		cuvmm_ctx_destroy(a); /* one destroyed, one not */
		exit(count_files() == 1 ? 0 : 2);
	}
	ck_assert_int_eq(waitpid(child, &status, 0), child);
	ck_assert(WIFEXITED(status));
	ck_assert_int_eq(WEXITSTATUS(status), 0);
	ck_assert_int_eq(count_files(), 0);
}
END_TEST

/* Files that are not pages are refused, not misread. */
START_TEST(test_publish_reader_refuses)
{
	char path[512];
	struct cvm_pub_page pg;
	FILE *f;

	snprintf(path, sizeof(path), "%s/cuvmm.1.0", dir);
	ck_assert_int_eq(cvm_pub_read(path, &pg), CVM_PUB_READ_IO); /* none */
	f = fopen(path, "w");
	ck_assert_ptr_nonnull(f);
	fputs("not a page", f);
	fclose(f);
	ck_assert_int_eq(cvm_pub_read(path, &pg), CVM_PUB_READ_FORMAT); /* too short */
	ck_assert_int_eq(truncate(path, sizeof(pg)), 0);
	ck_assert_int_eq(cvm_pub_read(path, &pg), CVM_PUB_READ_FORMAT); /* no magic */
}
END_TEST

static Suite *publish_suite(void)
{
	Suite *s = suite_create("publish");
	TCase *tc = tcase_create("publish");

	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_set_timeout(tc, TC_TIMEOUT);
	tcase_add_test(tc, test_publish_matches_stats);
	tcase_add_test(tc, test_publish_files_per_ctx);
	tcase_add_test(tc, test_publish_off);
	tcase_add_test(tc, test_publish_bad_dir);
	tcase_add_loop_test(tc, test_publish_refreshes, 0, 2);
	tcase_add_test(tc, test_publish_dead_process);
	tcase_add_test(tc, test_publish_exit_unlinks);
	tcase_add_test(tc, test_publish_reader_refuses);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	return tc_run(publish_suite());
}
