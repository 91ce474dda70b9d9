/*
 * Harness shared by the unit test programs; see common.h.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common.h"
#include "drv_test.h" /* cvm_host_gate_open */
#include "gpu.h"

/* ----- backend and context ----- */

enum cuvmm_backend tc_backend(void)
{
	const char *s = getenv("CUVMM_BACKEND");

	return s && strcmp(s, "cuda") == 0 ? CUVMM_BACKEND_CUDA : CUVMM_BACKEND_HOST;
}

bool tc_on_host(void)
{
	return tc_backend() == CUVMM_BACKEND_HOST;
}

void tc_config(struct cuvmm_config *cfg)
{
	cuvmm_config_init(cfg);
	cfg->backend = tc_backend();
}

int tc_ctx_create(struct cuvmm_config *cfg, struct cuvmm_ctx **out)
{
	struct cuvmm_config defaults;

	if (!cfg) {
		tc_config(&defaults);
		cfg = &defaults;
	}
	cfg->backend = tc_backend();
	return cuvmm_ctx_create(cfg, out);
}

struct cuvmm_ctx *tc_ctx(struct cuvmm_config *cfg)
{
	struct cuvmm_ctx *ctx = NULL;
	int err = tc_ctx_create(cfg, &ctx);

	ck_assert_msg(err == CUVMM_OK, "cuvmm_ctx_create: %s", cuvmm_err_name(err));
	ck_assert_ptr_nonnull(ctx);
	if (tc_backend() == CUVMM_BACKEND_CUDA)
		ck_assert_msg(tg_init() == 0, "the CUDA test helpers cannot run kernels");
	return ctx;
}

/*
 * Probe for a GPU in a child process: the parent must not initialise CUDA, because Check forks a child per
 * test and CUDA does not survive a fork. Exit status 0: usable; 77: no driver or device; else broken.
 */
static int probe_cuda(void)
{
	pid_t pid = fork();
	int status;

	if (pid < 0) {
		perror("fork");
		return 1;
	}
	if (pid == 0) {
		struct cuvmm_config cfg;
		struct cuvmm_ctx *ctx = NULL;
		int err;

		cuvmm_config_init(&cfg);
		cfg.backend = CUVMM_BACKEND_CUDA;
		err = cuvmm_ctx_create(&cfg, &ctx);
		if (err == CUVMM_ENODRIVER || err == CUVMM_ENODEV)
			_exit(77);
		if (err) {
			fprintf(stderr, "cuvmm_ctx_create on the CUDA backend failed: %s\n", cuvmm_err_name(err));
			_exit(1);
		}
		cuvmm_ctx_destroy(ctx);
		if (tg_init()) {
			fprintf(stderr, "the CUDA context works but the test kernels cannot be loaded\n");
			_exit(1);
		}
		_exit(0);
	}
	while (waitpid(pid, &status, 0) < 0 && errno == EINTR)
		;
	return WIFEXITED(status) ? WEXITSTATUS(status) : 1;
}

int tc_run(Suite *s)
{
	SRunner *sr;
	int failed;

	if (tc_backend() == CUVMM_BACKEND_CUDA) {
		int probe = probe_cuda();

		if (probe == 77) {
			printf("no GPU: skipped\n");
			exit(77);
		}
		if (probe != 0)
			return EXIT_FAILURE;
	}
	sr = srunner_create(s);
	srunner_run_all(sr, CK_ENV); /* CK_VERBOSITY=verbose lists every test */
	failed = srunner_ntests_failed(sr);
	srunner_free(sr);
	return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}

/* ----- OS accounting ----- */

static int64_t proc_field_kb(const char *path, const char *field)
{
	FILE *f = fopen(path, "re");
	char line[256];
	size_t len = strlen(field);
	int64_t v = -1;

	if (!f)
		return -1;
	while (fgets(line, sizeof(line), f)) {
		if (strncmp(line, field, len) == 0 && line[len] == ':') {
			v = strtoll(line + len + 1, NULL, 10) * 1024;
			break;
		}
	}
	fclose(f);
	return v;
}

int64_t tc_rss_shmem(void)
{
	int64_t v = proc_field_kb("/proc/self/smaps_rollup", "Pss_Shmem");

	return v >= 0 ? v : proc_field_kb("/proc/self/status", "RssShmem");
}

int64_t tc_memfd_bytes(void)
{
	DIR *d = opendir("/proc/self/fd");
	struct dirent *e;
	int64_t sum = 0;

	if (!d)
		return -1;
	while ((e = readdir(d))) {
		char path[320], link[256];
		struct stat st;
		ssize_t n;

		if (e->d_name[0] == '.')
			continue;
		snprintf(path, sizeof(path), "/proc/self/fd/%s", e->d_name);
		n = readlink(path, link, sizeof(link) - 1);
		if (n < 0)
			continue;
		link[n] = '\0';
		if (strncmp(link, "/memfd:cuvmm", 12) != 0)
			continue;
		/* stat() through the link, not fstat() of the library's fd: the background thread may close it
		 * meanwhile, and an fstat of a closed (or reused) descriptor is a data race TSan reports. */
		if (stat(path, &st) == 0)
			sum += (int64_t)st.st_blocks * 512;
	}
	closedir(d);
	return sum;
}

/* ----- statistics ----- */

size_t tc_granularity(struct cuvmm_ctx *ctx)
{
	struct cuvmm_region *r = NULL;
	size_t g;

	ck_assert_int_eq(cuvmm_region_create(ctx, 0, 1, &r), CUVMM_OK);
	g = cuvmm_region_granularity(r);
	cuvmm_region_destroy(r);
	ck_assert_uint_gt(g, 0);
	return g;
}

struct cuvmm_stats tc_ctx_stats(struct cuvmm_ctx *ctx)
{
	struct cuvmm_stats st;
	int err;

	memset(&st, 0, sizeof(st));
	st.size = sizeof(st);
	err = cuvmm_ctx_stats(ctx, 0, &st);
	ck_assert_msg(err == CUVMM_OK, "cuvmm_ctx_stats: %s", cuvmm_err_name(err));
	return st;
}

struct cuvmm_stats tc_region_stats(struct cuvmm_region *r)
{
	struct cuvmm_stats st;
	int err;

	memset(&st, 0, sizeof(st));
	st.size = sizeof(st);
	err = cuvmm_region_stats(r, &st);
	ck_assert_msg(err == CUVMM_OK, "cuvmm_region_stats: %s", cuvmm_err_name(err));
	return st;
}

struct cuvmm_stats tc_pool_stats(struct cuvmm_pool *p)
{
	struct cuvmm_stats st;
	int err;

	memset(&st, 0, sizeof(st));
	st.size = sizeof(st);
	err = cuvmm_pool_stats(p, &st);
	ck_assert_msg(err == CUVMM_OK, "cuvmm_pool_stats: %s", cuvmm_err_name(err));
	return st;
}

/*
 * The background thread may be releasing a chunk right now (the fd is closed before held_bytes drops), so a
 * mismatch is looked at again for a while: only one that persists is a failure.
 */
void tc_assert_os_matches(struct cuvmm_ctx *ctx)
{
	uint64_t held = 0;
	int64_t fd_bytes = -1;

	if (!tc_on_host())
		return;
	for (int attempt = 0; attempt < 100; attempt++) {
		uint64_t again;

		held = tc_ctx_stats(ctx).held_bytes;
		fd_bytes = tc_memfd_bytes();
		again = tc_ctx_stats(ctx).held_bytes;
		ck_assert_msg(fd_bytes >= 0, "cannot read /proc/self/fd");
		if (held == again && (uint64_t)fd_bytes == held)
			return;
		tc_sleep_ms(10);
	}
	ck_assert_msg((uint64_t)fd_bytes == held, "the OS sees %lld bytes in cuvmm memfds, stats say held %llu",
		      (long long)fd_bytes, (unsigned long long)held);
}

void tc_settle(struct cuvmm_ctx *ctx)
{
	int err = cuvmm_ctx_trim(ctx, -1, SIZE_MAX);

	ck_assert_msg(err == CUVMM_OK, "cuvmm_ctx_trim: %s", cuvmm_err_name(err));
}

uint64_t tc_now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

uint64_t tc_now_us(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000 + (uint64_t)ts.tv_nsec / 1000;
}

void tc_sleep_ms(int ms)
{
	struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};

	while (nanosleep(&ts, &ts) && errno == EINTR)
		;
}

uint64_t tc_wait_held_le(struct cuvmm_ctx *ctx, uint64_t bytes, int timeout_ms)
{
	uint64_t end = tc_now_ms() + (uint64_t)timeout_ms;
	uint64_t held;

	for (;;) {
		held = tc_ctx_stats(ctx).held_bytes;
		if (held <= bytes || tc_now_ms() >= end)
			return held;
		tc_sleep_ms(5);
	}
}

/* ----- kernels ----- */

int tc_fill(void *ptr, size_t n, uint32_t v)
{
	int r;

	if (tc_on_host()) {
		uint32_t *p = ptr;

		for (size_t i = 0; i < n; i++)
			p[i] = v ^ (uint32_t)i;
		return 0;
	}
	r = tg_fill((CUdeviceptr)(uintptr_t)ptr, n, v, 1, NULL);
	return r ? r : tg_stream_sync(NULL);
}

uint64_t tc_check(const void *ptr, size_t n, uint32_t v)
{
	uint64_t bad = 0;

	if (tc_on_host()) {
		const uint32_t *p = ptr;

		for (size_t i = 0; i < n; i++)
			bad += p[i] != (v ^ (uint32_t)i);
		return bad;
	}
	return tg_check((CUdeviceptr)(uintptr_t)ptr, n, v, NULL, &bad) ? UINT64_MAX : bad;
}

int tc_fill_async(void *ptr, size_t n, uint32_t v, int iters, CUstream stream)
{
	if (tc_on_host())
		return tc_fill(ptr, n, v);
	return tg_fill((CUdeviceptr)(uintptr_t)ptr, n, v, iters, stream);
}

int tc_stream_create(CUstream *stream)
{
	if (tc_on_host()) {
		*stream = (CUstream)(uintptr_t)0x1;
		return 0;
	}
	return tg_stream_create(stream);
}

void tc_stream_destroy(CUstream stream)
{
	if (!tc_on_host() && stream)
		tg_stream_destroy(stream);
}

int tc_stream_sync(CUstream stream)
{
	return tc_on_host() ? 0 : tg_stream_sync(stream);
}

/* ----- log capture ----- */

#define TC_LOG_KEEP 256

static struct {
	pthread_mutex_t lock;
	int n;                       /* messages kept (the first TC_LOG_KEEP) */
	int level[TC_LOG_KEEP];
	char msg[TC_LOG_KEEP][512];
} cap = {.lock = PTHREAD_MUTEX_INITIALIZER};

static void capture(enum cuvmm_log_level level, const char *msg, void *user)
{
	(void)user;
	pthread_mutex_lock(&cap.lock);
	if (cap.n < TC_LOG_KEEP) {
		cap.level[cap.n] = (int)level;
		snprintf(cap.msg[cap.n], sizeof(cap.msg[0]), "%s", msg);
		cap.n++;
	}
	pthread_mutex_unlock(&cap.lock);
}

void tc_log_capture(enum cuvmm_log_level level)
{
	tc_log_reset();
	cuvmm_set_log_callback(capture, NULL, level);
}

void tc_log_release(void)
{
	cuvmm_set_log_callback(NULL, NULL, CUVMM_LOG_WARN);
}

void tc_log_reset(void)
{
	pthread_mutex_lock(&cap.lock);
	cap.n = 0;
	pthread_mutex_unlock(&cap.lock);
}

int tc_log_count(int level, const char *substr)
{
	int k = 0;

	pthread_mutex_lock(&cap.lock);
	for (int i = 0; i < cap.n; i++)
		if ((level < 0 || cap.level[i] == level) && (!substr || strstr(cap.msg[i], substr)))
			k++;
	pthread_mutex_unlock(&cap.lock);
	return k;
}

/* ----- processes and environment ----- */

int tc_in_child(int (*fn)(void *), void *arg, char *buf, size_t bufsize)
{
	int fds[2], status;
	size_t got = 0;
	pid_t pid;

	if (pipe(fds))
		return -1;
	fflush(stdout);
	fflush(stderr);
	pid = fork();
	if (pid < 0) {
		close(fds[0]);
		close(fds[1]);
		return -1;
	}
	if (pid == 0) {
		int rc;

		close(fds[0]);
		dup2(fds[1], 2);
		close(fds[1]);
		rc = fn(arg);
		fflush(stderr);
		_exit(rc);
	}
	close(fds[1]);
	for (;;) {
		char sink[256];
		ssize_t n;

		if (got + 1 < bufsize)
			n = read(fds[0], buf + got, bufsize - 1 - got);
		else
			n = read(fds[0], sink, sizeof(sink));
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			break;
		if (got + 1 < bufsize)
			got += (size_t)n;
	}
	if (bufsize)
		buf[got] = '\0';
	close(fds[0]);
	while (waitpid(pid, &status, 0) < 0 && errno == EINTR)
		;
	return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

#define TC_ENV_KEEP 32

static struct {
	char *name, *value; /* value NULL: was unset */
} saved_env[TC_ENV_KEEP];
static int nsaved_env;

void tc_env_set(const char *name, const char *value)
{
	const char *old = getenv(name);

	ck_assert_int_lt(nsaved_env, TC_ENV_KEEP);
	saved_env[nsaved_env].name = strdup(name);
	saved_env[nsaved_env].value = old ? strdup(old) : NULL;
	nsaved_env++;
	if (value)
		setenv(name, value, 1);
	else
		unsetenv(name);
}

void tc_env_restore(void)
{
	while (nsaved_env > 0) {
		nsaved_env--;
		if (saved_env[nsaved_env].value)
			setenv(saved_env[nsaved_env].name, saved_env[nsaved_env].value, 1);
		else
			unsetenv(saved_env[nsaved_env].name);
		free(saved_env[nsaved_env].name);
		free(saved_env[nsaved_env].value);
	}
}

struct tc_snap tc_snap_take(struct cuvmm_ctx *ctx, struct cuvmm_region *r)
{
	struct tc_snap s;
	struct cuvmm_stats st;

	memset(&s, 0, sizeof(s));
	if (r) {
		st = tc_region_stats(r);
		s.r_reserved = st.reserved_bytes;
		s.r_mapped = st.mapped_bytes;
		s.r_held = st.held_bytes;
		s.r_live = st.live_bytes;
	}
	st = tc_ctx_stats(ctx);
	s.d_mapped = st.mapped_bytes;
	s.d_held = st.held_bytes;
	s.d_live = st.live_bytes;
	s.d_reserved = st.reserved_bytes;
	s.memfd = tc_on_host() ? tc_memfd_bytes() : 0;
	return s;
}

#define TC_SNAP_FIELD(a, b, f, what)                                                                         \
	ck_assert_msg((a)->f == (b)->f, "%s: " #f " was %llu before the failed call, %llu after", what,        \
		      (unsigned long long)(a)->f, (unsigned long long)(b)->f)

void tc_snap_expect_same(const struct tc_snap *a, const struct tc_snap *b, const char *what, bool held)
{
	TC_SNAP_FIELD(a, b, r_reserved, what);
	TC_SNAP_FIELD(a, b, r_mapped, what);
	TC_SNAP_FIELD(a, b, r_held, what);
	TC_SNAP_FIELD(a, b, r_live, what);
	TC_SNAP_FIELD(a, b, d_mapped, what);
	TC_SNAP_FIELD(a, b, d_live, what);
	TC_SNAP_FIELD(a, b, d_reserved, what);
	if (held) {
		TC_SNAP_FIELD(a, b, d_held, what);
		TC_SNAP_FIELD(a, b, memfd, what);
	}
}

void *tc_open_gate_later(void *arg)
{
	struct tc_opener *o = arg;

	tc_sleep_ms(o->delay_ms);
	__atomic_store_n(&o->opened, 1, __ATOMIC_SEQ_CST);
	cvm_host_gate_open();
	return NULL;
}
