/*
 * Errors, version, configuration from the environment, logging, and the last driver error.
 */
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common.h"
#include "config.h" /* cvm_env_log_level, cvm_env_publish, cvm_env_publish_dir */

static const char *const env_vars[] = {
	"CUVMM_BACKEND",      "CUVMM_RELEASE_DELAY_MS",   "CUVMM_RETAIN_BYTES", "CUVMM_DEVICE_LIMIT",
	"CUVMM_HOST_GRANULARITY", "CUVMM_BACKGROUND_RELEASE", "CUVMM_LOG", "CUVMM_PUBLISH", "CUVMM_PUBLISH_DIR",
};

/* Every test starts with none of the configuration variables set (CUVMM_BACKEND is set by meson). */
static void clear_env(void)
{
	for (size_t i = 0; i < sizeof(env_vars) / sizeof(env_vars[0]); i++)
		tc_env_set(env_vars[i], NULL);
}

static void teardown(void)
{
	tc_log_release();
	tc_env_restore();
}

/* ----- error codes ----- */

static const struct {
	int code;
	int value;
	const char *name;
	const char *msg;
} codes[] = {
	{CUVMM_OK, 0, "CUVMM_OK", "success"},
	{CUVMM_EINVAL, -1, "CUVMM_EINVAL", "invalid argument"},
	{CUVMM_ENOMEM, -2, "CUVMM_ENOMEM", NULL},
	{CUVMM_ENOSPC, -3, "CUVMM_ENOSPC", NULL},
	{CUVMM_ENODRIVER, -4, "CUVMM_ENODRIVER", NULL},
	{CUVMM_ENODEV, -5, "CUVMM_ENODEV", NULL},
	{CUVMM_ENOTSUP, -6, "CUVMM_ENOTSUP", NULL},
	{CUVMM_EBUSY, -7, "CUVMM_EBUSY", NULL},
	{CUVMM_ESTATE, -8, "CUVMM_ESTATE", NULL},
	{CUVMM_EDRIVER, -9, "CUVMM_EDRIVER", NULL},
};
#define NCODES (sizeof(codes) / sizeof(codes[0]))

START_TEST(test_error_values_names_messages)
{
	for (size_t i = 0; i < NCODES; i++) {
		const char *name = cuvmm_err_name(codes[i].code);
		const char *msg = cuvmm_strerror(codes[i].code);

		ck_assert_int_eq(codes[i].code, codes[i].value);
		ck_assert_ptr_nonnull(name);
		ck_assert_ptr_nonnull(msg);
		ck_assert_str_eq(name, codes[i].name);
		ck_assert_msg(strlen(msg) > 0, "empty message for %s", name);
		ck_assert_str_ne(msg, "unknown error");
		if (codes[i].msg)
			ck_assert_str_eq(msg, codes[i].msg);
		/* Messages tell codes apart. */
		for (size_t j = 0; j < i; j++)
			ck_assert_str_ne(msg, cuvmm_strerror(codes[j].code));
	}
}
END_TEST

START_TEST(test_error_unknown_codes)
{
	static const int unknown[] = {1, 2, -10, -11, -100, 600, INT_MIN, INT_MAX};

	for (size_t i = 0; i < sizeof(unknown) / sizeof(unknown[0]); i++) {
		ck_assert_ptr_nonnull(cuvmm_strerror(unknown[i]));
		ck_assert_ptr_nonnull(cuvmm_err_name(unknown[i]));
		ck_assert_str_eq(cuvmm_strerror(unknown[i]), "unknown error");
		ck_assert_str_eq(cuvmm_err_name(unknown[i]), "CUVMM_E?");
	}
}
END_TEST

START_TEST(test_version)
{
	const char *v = cuvmm_version();
	unsigned major, minor, patch;
	int end = -1;

	ck_assert_ptr_nonnull(v);
	ck_assert_int_eq(sscanf(v, "%u.%u.%u%n", &major, &minor, &patch, &end), 3);
	ck_assert_msg(end == (int)strlen(v), "version \"%s\" is not MAJOR.MINOR.PATCH", v);
	ck_assert_ptr_eq(cuvmm_version(), v); /* static */
	/* The header's macros name the same version as the library. */
	ck_assert_uint_eq(major, CUVMM_VERSION_MAJOR);
	ck_assert_uint_eq(minor, CUVMM_VERSION_MINOR);
	ck_assert_uint_eq(patch, CUVMM_VERSION_PATCH);
	ck_assert_int_eq(CUVMM_VERSION_NUMBER, CUVMM_VERSION_MAJOR * 10000 + CUVMM_VERSION_MINOR * 100 +
						      CUVMM_VERSION_PATCH);
#if CUVMM_VERSION_NUMBER < 100
#error "CUVMM_VERSION_NUMBER is not usable in #if"
#endif
}
END_TEST

/* ----- configuration ----- */

START_TEST(test_config_defaults)
{
	struct cuvmm_config cfg;

	clear_env();
	tc_log_capture(CUVMM_LOG_DEBUG);
	memset(&cfg, 0xa5, sizeof(cfg));
	cuvmm_config_init(&cfg);
	ck_assert_uint_eq(cfg.size, sizeof(cfg));
	ck_assert_int_eq(cfg.backend, CUVMM_BACKEND_AUTO);
	ck_assert_int_eq(cfg.release_delay_ms, 1000);
	ck_assert_uint_eq(cfg.retain_bytes, 0);
	ck_assert(cfg.background_release);
	ck_assert_uint_eq(cfg.device_limit_bytes, 0);
	ck_assert_uint_eq(cfg.host_granularity, 2 * TC_MiB);
	ck_assert_int_eq(tc_log_count(CUVMM_LOG_WARN, NULL), 0);
	cuvmm_config_init(NULL); /* ignored */
}
END_TEST

/* A variable set to a valid value, and the field it must produce. */
struct env_case {
	const char *var, *value;
	enum { F_BACKEND, F_DELAY, F_RETAIN, F_LIMIT, F_GRAN, F_BG } field;
	int64_t want;
};

static int64_t field_of(const struct cuvmm_config *cfg, int field)
{
	switch (field) {
	case F_BACKEND: return cfg->backend;
	case F_DELAY: return cfg->release_delay_ms;
	case F_RETAIN: return (int64_t)cfg->retain_bytes;
	case F_LIMIT: return (int64_t)cfg->device_limit_bytes;
	case F_GRAN: return (int64_t)cfg->host_granularity;
	case F_BG: return cfg->background_release;
	}
	return -12345;
}

static const struct env_case good_env[] = {
	{"CUVMM_BACKEND", "host", F_BACKEND, CUVMM_BACKEND_HOST},
	{"CUVMM_BACKEND", "cuda", F_BACKEND, CUVMM_BACKEND_CUDA},
	{"CUVMM_BACKEND", "auto", F_BACKEND, CUVMM_BACKEND_AUTO},
	{"CUVMM_BACKEND", "HOST", F_BACKEND, CUVMM_BACKEND_HOST}, /* words are case-insensitive */
	{"CUVMM_BACKEND", "Cuda", F_BACKEND, CUVMM_BACKEND_CUDA},
	{"CUVMM_BACKEND", "", F_BACKEND, CUVMM_BACKEND_AUTO},     /* empty: as if unset */
	{"CUVMM_RELEASE_DELAY_MS", "250", F_DELAY, 250},
	{"CUVMM_RELEASE_DELAY_MS", "0", F_DELAY, 0},
	{"CUVMM_RELEASE_DELAY_MS", "-1", F_DELAY, -1},
	{"CUVMM_RELEASE_DELAY_MS", "3600000", F_DELAY, 3600000},
	{"CUVMM_RELEASE_DELAY_MS", "9223372036854", F_DELAY, CUVMM_RELEASE_DELAY_MS_MAX}, /* the limit */
	{"CUVMM_RELEASE_DELAY_MS", "", F_DELAY, 1000},
	{"CUVMM_RETAIN_BYTES", "4096", F_RETAIN, 4096},
	{"CUVMM_RETAIN_BYTES", "0", F_RETAIN, 0},
	{"CUVMM_RETAIN_BYTES", "64K", F_RETAIN, 64 << 10},
	{"CUVMM_RETAIN_BYTES", "64k", F_RETAIN, 64 << 10},
	{"CUVMM_RETAIN_BYTES", "3M", F_RETAIN, 3 << 20},
	{"CUVMM_RETAIN_BYTES", "2G", F_RETAIN, (int64_t)2 << 30},
	{"CUVMM_RETAIN_BYTES", "2GiB", F_RETAIN, (int64_t)2 << 30},
	{"CUVMM_RETAIN_BYTES", "2mb", F_RETAIN, 2 << 20},
	{"CUVMM_RETAIN_BYTES", "", F_RETAIN, 0},
	{"CUVMM_DEVICE_LIMIT", "512M", F_LIMIT, (int64_t)512 << 20},
	{"CUVMM_DEVICE_LIMIT", "80G", F_LIMIT, (int64_t)80 << 30},
	{"CUVMM_DEVICE_LIMIT", "2M", F_LIMIT, 2 << 20}, /* one granule: the smallest limit */
	{"CUVMM_DEVICE_LIMIT", "0", F_LIMIT, 0},
	{"CUVMM_HOST_GRANULARITY", "64K", F_GRAN, 64 << 10},
	{"CUVMM_HOST_GRANULARITY", "1g", F_GRAN, (int64_t)1 << 30},
	{"CUVMM_BACKGROUND_RELEASE", "0", F_BG, 0},
	{"CUVMM_BACKGROUND_RELEASE", "1", F_BG, 1},
	{"CUVMM_BACKGROUND_RELEASE", "no", F_BG, 0},
	{"CUVMM_BACKGROUND_RELEASE", "YES", F_BG, 1},
	{"CUVMM_BACKGROUND_RELEASE", "off", F_BG, 0},
	{"CUVMM_BACKGROUND_RELEASE", "On", F_BG, 1},
	{"CUVMM_BACKGROUND_RELEASE", "False", F_BG, 0},
	{"CUVMM_BACKGROUND_RELEASE", "true", F_BG, 1},
};

START_TEST(test_config_env_each)
{
	const struct env_case *c = &good_env[_i];
	struct cuvmm_config cfg;

	clear_env();
	tc_log_capture(CUVMM_LOG_DEBUG);
	if (c->field == F_BG) {
		/* Start from the opposite of what the variable asks for, so the value is seen to be applied. */
		tc_env_set(c->var, c->want ? "0" : "1");
		cuvmm_config_init(&cfg);
		ck_assert_int_eq(field_of(&cfg, c->field), !c->want);
	}
	tc_env_set(c->var, c->value);
	cuvmm_config_init(&cfg);
	ck_assert_msg(field_of(&cfg, c->field) == c->want, "%s=%s gave %lld, want %lld", c->var, c->value,
		      (long long)field_of(&cfg, c->field), (long long)c->want);
	ck_assert_msg(tc_log_count(CUVMM_LOG_WARN, NULL) == 0, "%s=%s (valid) was warned about", c->var, c->value);
	tc_env_restore();
}
END_TEST

/* Malformed values: ignored (the field keeps its default) and reported as a warning naming the variable. */
static const struct env_case bad_env[] = {
	{"CUVMM_BACKEND", "gpu", F_BACKEND, CUVMM_BACKEND_AUTO},
	{"CUVMM_BACKEND", "HOST ", F_BACKEND, CUVMM_BACKEND_AUTO},
	{"CUVMM_RELEASE_DELAY_MS", "-2", F_DELAY, 1000},
	{"CUVMM_RELEASE_DELAY_MS", "abc", F_DELAY, 1000},
	{"CUVMM_RELEASE_DELAY_MS", "10ms", F_DELAY, 1000},
	{"CUVMM_RELEASE_DELAY_MS", "99999999999999999999999", F_DELAY, 1000},
	{"CUVMM_RELEASE_DELAY_MS", "9223372036855", F_DELAY, 1000},       /* CUVMM_RELEASE_DELAY_MS_MAX + 1 */
	{"CUVMM_RELEASE_DELAY_MS", "4611686018427387904", F_DELAY, 1000}, /* 2^62 ms: wrapped to 0 ns */
	{"CUVMM_RELEASE_DELAY_MS", "18446744073710", F_DELAY, 1000},      /* wrapped to 448 us */
	{"CUVMM_RELEASE_DELAY_MS", " 5", F_DELAY, 1000},
	{"CUVMM_RELEASE_DELAY_MS", "+5", F_DELAY, 1000},
	{"CUVMM_RELEASE_DELAY_MS", "-", F_DELAY, 1000},
	{"CUVMM_RETAIN_BYTES", "12Q", F_RETAIN, 0},
	{"CUVMM_RETAIN_BYTES", "-5", F_RETAIN, 0},
	{"CUVMM_RETAIN_BYTES", "1.5G", F_RETAIN, 0},
	{"CUVMM_RETAIN_BYTES", "\t-5", F_RETAIN, 0}, /* strtoull: 2^64-5 */
	{"CUVMM_RETAIN_BYTES", " 5", F_RETAIN, 0},
	{"CUVMM_RETAIN_BYTES", "+5", F_RETAIN, 0},
	{"CUVMM_RETAIN_BYTES", "M", F_RETAIN, 0},
	{"CUVMM_RETAIN_BYTES", "99999999999999999999999", F_RETAIN, 0},
	{"CUVMM_RETAIN_BYTES", "17179869184G", F_RETAIN, 0},
	{"CUVMM_DEVICE_LIMIT", "lots", F_LIMIT, 0},
	{"CUVMM_DEVICE_LIMIT", "8 G", F_LIMIT, 0},
	{"CUVMM_DEVICE_LIMIT", " -1", F_LIMIT, 0}, /* strtoull: 2^64-1 */
	{"CUVMM_DEVICE_LIMIT", "1k", F_LIMIT, 0},  /* below one granule: every allocation would fail */
	{"CUVMM_DEVICE_LIMIT", "1000", F_LIMIT, 0},
	{"CUVMM_DEVICE_LIMIT", "2097151", F_LIMIT, 0},
	{"CUVMM_HOST_GRANULARITY", "big", F_GRAN, 2 << 20},
	{"CUVMM_HOST_GRANULARITY", "3M", F_GRAN, 2 << 20},  /* not a power of two */
	{"CUVMM_HOST_GRANULARITY", "1K", F_GRAN, 2 << 20},  /* below the page size */
	{"CUVMM_HOST_GRANULARITY", "0", F_GRAN, 2 << 20},
	{"CUVMM_BACKGROUND_RELEASE", "2", F_BG, 1},
	{"CUVMM_BACKGROUND_RELEASE", "maybe", F_BG, 1},
	{"CUVMM_BACKGROUND_RELEASE", " 0", F_BG, 1},
};

START_TEST(test_config_env_malformed)
{
	const struct env_case *c = &bad_env[_i];
	struct cuvmm_config cfg;

	clear_env();
	tc_log_capture(CUVMM_LOG_DEBUG);
	tc_env_set(c->var, c->value);
	cuvmm_config_init(&cfg);
	ck_assert_msg(field_of(&cfg, c->field) == c->want, "%s=\"%s\" gave %lld, want the default %lld", c->var,
		      c->value, (long long)field_of(&cfg, c->field), (long long)c->want);
	ck_assert_msg(tc_log_count(CUVMM_LOG_WARN, c->var) == 1, "%s=\"%s\": %d warnings naming it, want 1", c->var,
		      c->value, tc_log_count(CUVMM_LOG_WARN, c->var));
	tc_env_restore();
}
END_TEST

/* A malformed variable does not spoil the others. */
START_TEST(test_config_env_mixed)
{
	struct cuvmm_config cfg;

	clear_env();
	tc_log_capture(CUVMM_LOG_DEBUG);
	tc_env_set("CUVMM_RELEASE_DELAY_MS", "nope");
	tc_env_set("CUVMM_RETAIN_BYTES", "16M");
	tc_env_set("CUVMM_DEVICE_LIMIT", "1G");
	tc_env_set("CUVMM_BACKGROUND_RELEASE", "0");
	cuvmm_config_init(&cfg);
	ck_assert_int_eq(cfg.release_delay_ms, 1000);
	ck_assert_uint_eq(cfg.retain_bytes, 16 * TC_MiB);
	ck_assert_uint_eq(cfg.device_limit_bytes, 1024 * TC_MiB);
	ck_assert(!cfg.background_release);
	ck_assert_int_eq(tc_log_count(CUVMM_LOG_WARN, NULL), 1);
	ck_assert_int_eq(tc_log_count(CUVMM_LOG_WARN, "CUVMM_RELEASE_DELAY_MS"), 1);
}
END_TEST

/* A bad value is reported once per process however often the configuration is read; another bad value of
 * the same variable is reported again. The warning names the variable and what is used instead. */
START_TEST(test_config_env_reported_once)
{
	struct cuvmm_config cfg;

	clear_env();
	tc_log_capture(CUVMM_LOG_DEBUG);
	tc_env_set("CUVMM_HOST_GRANULARITY", "3M");
	for (int i = 0; i < 5; i++)
		cuvmm_config_init(&cfg);
	ck_assert_int_eq(tc_log_count(CUVMM_LOG_WARN, "CUVMM_HOST_GRANULARITY=\"3M\""), 1);
	ck_assert_int_eq(tc_log_count(CUVMM_LOG_WARN, "using 2M"), 1);
	tc_env_set("CUVMM_HOST_GRANULARITY", "5M");
	cuvmm_config_init(&cfg);
	cuvmm_config_init(&cfg);
	ck_assert_int_eq(tc_log_count(CUVMM_LOG_WARN, "CUVMM_HOST_GRANULARITY"), 2);
	ck_assert_int_eq(tc_log_count(CUVMM_LOG_WARN, NULL), 2);
}
END_TEST

/* A bad value is ignored, so the context made from the environment works (CUVMM_HOST_GRANULARITY=3M made
 * cuvmm_ctx_create fail with CUVMM_EINVAL; CUVMM_DEVICE_LIMIT=1k made every allocation fail). */
START_TEST(test_config_env_bad_ctx_works)
{
	struct cuvmm_ctx *ctx = NULL;
	struct cuvmm_region *r = NULL;

	clear_env();
	tc_log_capture(CUVMM_LOG_DEBUG);
	tc_env_set("CUVMM_BACKEND", tc_on_host() ? "host" : "cuda");
	tc_env_set("CUVMM_HOST_GRANULARITY", "3M");
	tc_env_set("CUVMM_DEVICE_LIMIT", "1k");
	tc_env_set("CUVMM_RETAIN_BYTES", "\t-5");
	tc_env_set("CUVMM_RELEASE_DELAY_MS", "4611686018427387904");
	ck_assert_int_eq(cuvmm_ctx_create(NULL, &ctx), CUVMM_OK);
	ck_assert_int_eq(cuvmm_region_create(ctx, 0, 16 * TC_MiB, &r), CUVMM_OK);
	ck_assert_int_eq(cuvmm_region_map(r, 0, 4 * TC_MiB), CUVMM_OK);
	ck_assert_int_eq(tc_log_count(CUVMM_LOG_WARN, NULL), 4);
	cuvmm_region_destroy(r);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/* CUVMM_LOG goes through the same parser: case-insensitive words; unset, empty or bad: the fallback. */
START_TEST(test_config_env_log_words)
{
	static const struct {
		const char *value;
		int want;
	} cases[] = {
		{"error", CUVMM_LOG_ERROR}, {"WARN", CUVMM_LOG_WARN},   {"warning", CUVMM_LOG_WARN},
		{"Info", CUVMM_LOG_INFO},   {"DEBUG", CUVMM_LOG_DEBUG}, {"", 99},
		{NULL, 99},                 {"loud", 99},               {" debug", 99},
	};

	clear_env();
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		tc_env_set("CUVMM_LOG", cases[i].value);
		ck_assert_msg(cvm_env_log_level(99) == cases[i].want, "CUVMM_LOG=\"%s\": %d, want %d",
			      cases[i].value ? cases[i].value : "(unset)", cvm_env_log_level(99), cases[i].want);
	}
}
END_TEST

/* CUVMM_PUBLISH (a boolean word, internal: no config field) and CUVMM_PUBLISH_DIR (an absolute path) go
 * through the same parser: a bad value is warned about once, naming the variable, and the default kept. */
START_TEST(test_config_env_publish)
{
	static const struct {
		const char *value;
		bool want;
		int warns;
	} on[] = {
		{NULL, true, 0}, {"", true, 0},   {"0", false, 0},   {"1", true, 0},      {"no", false, 0},
		{"Off", false, 0}, {"YES", true, 0}, {"false", false, 0}, {"maybe", true, 1}, {" 0", true, 1},
	};
	static const struct {
		const char *value, *want;
		int warns;
	} dirs[] = {
		{NULL, "/dev/shm", 0},   {"", "/dev/shm", 0}, {"/tmp/x", "/tmp/x", 0},
		{"tmp/x", "/dev/shm", 1}, {" /tmp", "/dev/shm", 1},
	};

	clear_env();
	for (size_t i = 0; i < sizeof(on) / sizeof(on[0]); i++) {
		tc_log_capture(CUVMM_LOG_DEBUG);
		tc_env_set("CUVMM_PUBLISH", on[i].value);
		ck_assert_msg(cvm_env_publish() == on[i].want, "CUVMM_PUBLISH=\"%s\": %d, want %d",
			      on[i].value ? on[i].value : "(unset)", cvm_env_publish(), on[i].want);
		ck_assert_int_eq(tc_log_count(CUVMM_LOG_WARN, "CUVMM_PUBLISH="), on[i].warns);
		tc_log_release();
	}
	for (size_t i = 0; i < sizeof(dirs) / sizeof(dirs[0]); i++) {
		tc_log_capture(CUVMM_LOG_DEBUG);
		tc_env_set("CUVMM_PUBLISH_DIR", dirs[i].value);
		ck_assert_str_eq(cvm_env_publish_dir(), dirs[i].want);
		ck_assert_int_eq(tc_log_count(CUVMM_LOG_WARN, "CUVMM_PUBLISH_DIR"), dirs[i].warns);
		tc_log_release();
	}
}
END_TEST

/* CUVMM_BACKEND is read by one parser, whether cuvmm_config_init() or cuvmm_ctx_create() resolves AUTO. */
START_TEST(test_config_env_backend_one_rule)
{
	struct cuvmm_config cfg;
	struct cuvmm_ctx *ctx = NULL;

	if (!tc_on_host())
		return;
	clear_env();
	tc_env_set("CUVMM_BACKEND", "HOST");
	memset(&cfg, 0, sizeof(cfg));
	cuvmm_config_init(&cfg);
	ck_assert_int_eq(cfg.backend, CUVMM_BACKEND_HOST);
	cfg.backend = CUVMM_BACKEND_AUTO; /* resolved again by the context */
	ck_assert_int_eq(cuvmm_ctx_create(&cfg, &ctx), CUVMM_OK);
	ck_assert_int_eq(cuvmm_ctx_backend(ctx), CUVMM_BACKEND_HOST);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/* Without a driver, a context on the CUDA backend fails and says why at the default level (warn). On a
 * machine with a GPU the context is made and nothing is to be said. */
START_TEST(test_ctx_no_driver_says_why)
{
	struct cuvmm_ctx *ctx = NULL;
	int err;

	clear_env();
	tc_log_capture(CUVMM_LOG_WARN);
	tc_env_set("CUVMM_BACKEND", "cuda");
	err = cuvmm_ctx_create(NULL, &ctx);
	if (err == CUVMM_OK) {
		cuvmm_ctx_destroy(ctx);
		return;
	}
	ck_assert_msg(err == CUVMM_ENODRIVER || err == CUVMM_ENODEV, "%s", cuvmm_err_name(err));
	ck_assert_int_eq(tc_log_count(CUVMM_LOG_WARN, cuvmm_err_name(err)), 1);
	ck_assert_int_eq(tc_log_count(CUVMM_LOG_WARN, "CUVMM_BACKEND=host"), 1);
}
END_TEST

/* The environment reaches a context made with cfg == NULL. */
START_TEST(test_config_env_reaches_ctx)
{
	struct cuvmm_ctx *ctx = NULL;
	struct cuvmm_region *r = NULL;
	struct cuvmm_stats st;

	clear_env();
	tc_env_set("CUVMM_BACKEND", tc_on_host() ? "host" : "cuda");
	tc_env_set("CUVMM_DEVICE_LIMIT", "4M");
	ck_assert_int_eq(cuvmm_ctx_create(NULL, &ctx), CUVMM_OK);
	ck_assert_int_eq(cuvmm_ctx_backend(ctx), tc_backend());
	ck_assert_int_eq(cuvmm_region_create(ctx, 0, 16 * TC_MiB, &r), CUVMM_OK);
	ck_assert_int_eq(cuvmm_region_map(r, 0, 4 * TC_MiB), CUVMM_OK);
	/* The limit of 4 MiB from the environment: nothing more can be mapped. */
	ck_assert_int_eq(cuvmm_region_map(r, 4 * TC_MiB, 2 * TC_MiB), CUVMM_ENOMEM);
	st = tc_region_stats(r);
	ck_assert_uint_eq(st.mapped_bytes, 4 * TC_MiB);
	cuvmm_region_destroy(r);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/* ----- logging ----- */

struct sink {
	int calls[4];
	void *user_seen;
	char last[512];
	int newline;
};

static void sink_fn(enum cuvmm_log_level level, const char *msg, void *user)
{
	struct sink *s = user;

	if ((int)level >= 0 && (int)level < 4)
		s->calls[level]++;
	s->user_seen = user;
	snprintf(s->last, sizeof(s->last), "%s", msg);
	if (strchr(msg, '\n'))
		s->newline = 1;
}

/* A warning: a malformed variable. */
static void emit_warn(void)
{
	static int n;
	struct cuvmm_config cfg;
	char value[32];

	/* A new value each time: a value is reported once per process. */
	snprintf(value, sizeof(value), "garbage%d", n++);
	tc_env_set("CUVMM_RETAIN_BYTES", value);
	cuvmm_config_init(&cfg);
	tc_env_restore();
}

/* A debug message: an injected driver failure is logged at debug level. */
static void emit_debug(struct cuvmm_ctx *ctx, struct cuvmm_region *r)
{
	ck_assert_int_eq(cuvmm_ctx_inject_fault(ctx, CUVMM_CALL_CREATE, 0, 1, CUVMM_EDRIVER), CUVMM_OK);
	ck_assert_int_eq(cuvmm_region_map(r, 0, 2 * TC_MiB), CUVMM_EDRIVER);
}

START_TEST(test_log_callback_routing_and_level)
{
	struct sink s;
	struct cuvmm_ctx *ctx;
	struct cuvmm_region *r;

	clear_env();
	memset(&s, 0, sizeof(s));
	ctx = tc_ctx(NULL);
	ck_assert_int_eq(cuvmm_region_create(ctx, 0, 8 * TC_MiB, &r), CUVMM_OK);

	cuvmm_set_log_callback(sink_fn, &s, CUVMM_LOG_WARN);
	emit_warn();
	ck_assert_int_eq(s.calls[CUVMM_LOG_WARN], 1);
	ck_assert_ptr_eq(s.user_seen, &s);
	ck_assert_msg(strstr(s.last, "CUVMM_RETAIN_BYTES") != NULL, "warning text: \"%s\"", s.last);
	ck_assert_msg(strncmp(s.last, "cuvmm: ", 7) != 0, "the callback gets the bare message, not the stderr prefix: \"%s\"",
		      s.last);
	ck_assert_int_eq(s.newline, 0);

	/* Below the callback's level: dropped. */
	emit_debug(ctx, r);
	ck_assert_int_eq(s.calls[CUVMM_LOG_DEBUG], 0);
	ck_assert_int_eq(s.calls[CUVMM_LOG_INFO], 0);

	/* At DEBUG it arrives, with its level. */
	cuvmm_set_log_callback(sink_fn, &s, CUVMM_LOG_DEBUG);
	emit_debug(ctx, r);
	ck_assert_int_ge(s.calls[CUVMM_LOG_DEBUG], 1);

	/* At ERROR even warnings are dropped. */
	memset(&s, 0, sizeof(s));
	cuvmm_set_log_callback(sink_fn, &s, CUVMM_LOG_ERROR);
	emit_warn();
	emit_debug(ctx, r);
	ck_assert_int_eq(s.calls[CUVMM_LOG_WARN] + s.calls[CUVMM_LOG_DEBUG] + s.calls[CUVMM_LOG_INFO], 0);

	/* NULL restores stderr: the callback is not called any more. */
	memset(&s, 0, sizeof(s));
	cuvmm_set_log_callback(NULL, NULL, CUVMM_LOG_DEBUG);
	emit_warn();
	ck_assert_int_eq(s.calls[CUVMM_LOG_WARN], 0);

	cuvmm_region_destroy(r);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/* At info, each release decision says what it freed and why; at debug, a failing driver call is named. */
START_TEST(test_log_release_decisions)
{
	struct cuvmm_config cfg;
	struct cuvmm_ctx *ctx;
	struct cuvmm_pool *pool;
	struct cuvmm_region *r = NULL;
	void *p;

	clear_env();
	tc_log_capture(CUVMM_LOG_DEBUG);
	tc_config(&cfg);
	cfg.release_delay_ms = 100;
	ctx = tc_ctx(&cfg);
	ck_assert_int_eq(cuvmm_pool_create(ctx, NULL, &pool), CUVMM_OK);

	/* Idle for the delay: the pool unmaps, the device gives the chunks back. */
	ck_assert_int_eq(cuvmm_malloc(pool, 64 * TC_MiB, &p), CUVMM_OK);
	ck_assert_int_eq(cuvmm_free(pool, p), CUVMM_OK);
	for (int i = 0; i < 100 && tc_log_count(CUVMM_LOG_INFO, "back to the driver: free for release_delay_ms") == 0;
	     i++)
		usleep(20 * 1000);
	ck_assert_int_ge(tc_log_count(CUVMM_LOG_INFO, "free for release_delay_ms"), 2); /* pool, then device */
	ck_assert_int_ge(tc_log_count(CUVMM_LOG_INFO, "back to the driver: free for release_delay_ms"), 1);

	/* A trim says so, with what it keeps. */
	ck_assert_int_eq(cuvmm_malloc(pool, 32 * TC_MiB, &p), CUVMM_OK);
	ck_assert_int_eq(cuvmm_free(pool, p), CUVMM_OK);
	ck_assert_int_eq(cuvmm_pool_trim(pool, 0), CUVMM_OK);
	ck_assert_int_ge(tc_log_count(CUVMM_LOG_INFO, "on trim (keep 0.0 MiB)"), 1);
	ck_assert_int_ge(tc_log_count(CUVMM_LOG_INFO, "back to the driver: trim"), 1);
	cuvmm_pool_destroy(pool);

	/* A driver call that fails is named at debug: an address range as large as the whole user address space
	 * (the host backend's mmap refuses it), and an injected failure. */
	ck_assert_int_eq(cuvmm_region_create(ctx, 0, 8 * TC_MiB, &r), CUVMM_OK);
	if (tc_on_host()) {
		struct cuvmm_region *huge = NULL;
		size_t unit = 512 * cuvmm_region_granularity(r); /* few slots to allocate for 128 TiB */

		ck_assert_int_ne(cuvmm_region_create_ex(ctx, 0, (size_t)1 << 47, unit, &huge), CUVMM_OK);
		ck_assert_int_ge(tc_log_count(CUVMM_LOG_DEBUG, "cuMemAddressReserve failed"), 1);
	}
	ck_assert_int_eq(cuvmm_ctx_inject_fault(ctx, CUVMM_CALL_MAP, 0, 1, CUVMM_EDRIVER), CUVMM_OK);
	ck_assert_int_eq(cuvmm_region_map(r, 0, 2 * TC_MiB), CUVMM_EDRIVER);
	ck_assert_int_ge(tc_log_count(CUVMM_LOG_DEBUG, "cuMemMap: injected failure"), 1);
	cuvmm_region_destroy(r);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

/* In a fresh process (the level is read from $CUVMM_LOG once): the default sink is stderr with "cuvmm: ". */
struct log_child {
	const char *level_env; /* NULL: unset */
};

static int log_child_main(void *arg)
{
	struct log_child *lc = arg;
	struct cuvmm_config cfg;
	struct cuvmm_ctx *ctx = NULL;
	struct cuvmm_region *r = NULL;

	if (lc->level_env)
		setenv("CUVMM_LOG", lc->level_env, 1);
	else
		unsetenv("CUVMM_LOG");
	setenv("CUVMM_RETAIN_BYTES", "garbage", 1);
	cuvmm_config_init(&cfg); /* a warning */
	unsetenv("CUVMM_RETAIN_BYTES");
	cfg.backend = tc_backend();
	if (cuvmm_ctx_create(&cfg, &ctx)) /* info messages */
		return 2;
	if (cuvmm_region_create(ctx, 0, 4 * TC_MiB, &r))
		return 3;
	cuvmm_ctx_inject_fault(ctx, CUVMM_CALL_CREATE, 0, 1, CUVMM_EDRIVER);
	if (cuvmm_region_map(r, 0, 2 * TC_MiB) != CUVMM_EDRIVER) /* a debug message */
		return 4;
	cuvmm_region_destroy(r);
	cuvmm_ctx_destroy(ctx);
	return 0;
}

START_TEST(test_log_env_levels)
{
	static const struct {
		const char *env;
		int warn, info, debug, complaint;
	} cases[] = {
		{NULL, 1, 0, 0, 0},     {"warn", 1, 0, 0, 0},  {"error", 0, 0, 0, 0},
		{"info", 1, 1, 0, 0},   {"debug", 1, 1, 1, 0}, {"loud", 1, 0, 0, 1},
	};
	char out[16384];

	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		struct log_child lc = {cases[i].env};
		int rc = tc_in_child(log_child_main, &lc, out, sizeof(out));
		const char *env = cases[i].env ? cases[i].env : "(unset)";

		ck_assert_msg(rc == 0, "CUVMM_LOG=%s: child failed with %d; stderr:\n%s", env, rc, out);
		ck_assert_msg((strstr(out, "cuvmm: warn: ") != NULL) == cases[i].warn,
			      "CUVMM_LOG=%s: warning %s on stderr:\n%s", env, cases[i].warn ? "missing" : "shown", out);
		ck_assert_msg((strstr(out, "cuvmm: info: ") != NULL) == cases[i].info,
			      "CUVMM_LOG=%s: info %s on stderr:\n%s", env, cases[i].info ? "missing" : "shown", out);
		ck_assert_msg((strstr(out, "cuvmm: debug: ") != NULL) == cases[i].debug,
			      "CUVMM_LOG=%s: debug %s on stderr:\n%s", env, cases[i].debug ? "missing" : "shown", out);
		if (cases[i].warn)
			ck_assert_msg(strstr(out, "CUVMM_RETAIN_BYTES") != NULL, "CUVMM_LOG=%s:\n%s", env, out);
		if (cases[i].complaint)
			ck_assert_msg(strstr(out, "CUVMM_LOG") != NULL, "a malformed CUVMM_LOG is not reported:\n%s", out);
	}
}
END_TEST

/* ----- last driver error ----- */

static void *last_error_thread(void *arg)
{
	*(int *)arg = cuvmm_last_driver_error();
	return NULL;
}

START_TEST(test_last_driver_error)
{
	struct cuvmm_ctx *ctx = tc_ctx(NULL);
	struct cuvmm_region *r;
	pthread_t t;
	int other = -1;

	ck_assert_int_eq(cuvmm_region_create(ctx, 0, 8 * TC_MiB, &r), CUVMM_OK);
	ck_assert_int_eq(cuvmm_region_map(r, 0, 2 * TC_MiB), CUVMM_OK);

	ck_assert_int_eq(cuvmm_ctx_inject_fault(ctx, CUVMM_CALL_CREATE, 0, 1, CUVMM_EDRIVER), CUVMM_OK);
	ck_assert_int_eq(cuvmm_region_map(r, 2 * TC_MiB, 2 * TC_MiB), CUVMM_EDRIVER);
	ck_assert_int_eq(cuvmm_last_driver_error(), CUDA_ERROR_UNKNOWN);

	/* A success does not clear it: it is the last *failing* call. */
	ck_assert_int_eq(cuvmm_region_map(r, 2 * TC_MiB, 2 * TC_MiB), CUVMM_OK);
	ck_assert_int_eq(cuvmm_last_driver_error(), CUDA_ERROR_UNKNOWN);

	ck_assert_int_eq(cuvmm_ctx_inject_fault(ctx, CUVMM_CALL_MAP, 0, 1, CUVMM_ENOMEM), CUVMM_OK);
	ck_assert_int_eq(cuvmm_region_map(r, 4 * TC_MiB, 2 * TC_MiB), CUVMM_ENOMEM);
	ck_assert_int_eq(cuvmm_last_driver_error(), CUDA_ERROR_OUT_OF_MEMORY);

	/* Per thread: a thread that made no failing call sees 0. */
	ck_assert_int_eq(pthread_create(&t, NULL, last_error_thread, &other), 0);
	pthread_join(t, NULL);
	ck_assert_int_eq(other, 0);

	cuvmm_region_destroy(r);
	cuvmm_ctx_destroy(ctx);
}
END_TEST

static Suite *errors_suite(void)
{
	Suite *s = suite_create("errors");
	TCase *tc;

	tc = tcase_create("codes");
	tcase_add_checked_fixture(tc, NULL, teardown);
	tcase_set_timeout(tc, TC_TIMEOUT);
	tcase_add_test(tc, test_error_values_names_messages);
	tcase_add_test(tc, test_error_unknown_codes);
	tcase_add_test(tc, test_version);
	tcase_add_test(tc, test_last_driver_error);
	suite_add_tcase(s, tc);

	tc = tcase_create("config");
	tcase_add_checked_fixture(tc, NULL, teardown);
	tcase_set_timeout(tc, TC_TIMEOUT);
	tcase_add_test(tc, test_config_defaults);
	tcase_add_loop_test(tc, test_config_env_each, 0, (int)(sizeof(good_env) / sizeof(good_env[0])));
	tcase_add_loop_test(tc, test_config_env_malformed, 0, (int)(sizeof(bad_env) / sizeof(bad_env[0])));
	tcase_add_test(tc, test_config_env_mixed);
	tcase_add_test(tc, test_config_env_reaches_ctx);
	tcase_add_test(tc, test_config_env_reported_once);
	tcase_add_test(tc, test_config_env_bad_ctx_works);
	tcase_add_test(tc, test_config_env_log_words);
	tcase_add_test(tc, test_config_env_backend_one_rule);
	tcase_add_test(tc, test_config_env_publish);
	tcase_add_test(tc, test_ctx_no_driver_says_why);
	suite_add_tcase(s, tc);

	tc = tcase_create("log");
	tcase_add_checked_fixture(tc, NULL, teardown);
	tcase_set_timeout(tc, TC_TIMEOUT);
	tcase_add_test(tc, test_log_callback_routing_and_level);
	tcase_add_test(tc, test_log_env_levels);
	tcase_add_test(tc, test_log_release_decisions);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	return tc_run(errors_suite());
}
