/*
 * Configuration defaults and the CUVMM_* environment variables.
 *
 * Every variable is one row of env_vars[]: its name, how its value is spelled (a word from a list, a size,
 * a count of milliseconds) and what a valid value looks like. One parser reads them all with the same
 * rules: words are case-insensitive; sizes are digits with an optional K, M, G or T suffix (KiB, MB also
 * read); no blanks, no sign (so " -1" is not 2^64-1); an empty value is the same as an unset one. A value
 * that is malformed, or well formed but out of what the library can serve (a host granularity that is not a
 * power of two, a device limit below one granule, a delay whose nanoseconds overflow), is reported as a
 * warning naming the variable and what was used instead, once per process for each value, and ignored.
 */
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "config.h"
#include "log.h"
#include "publish.h"

static const char *const backend_words[] = {"auto", "cuda", "host", NULL};           /* enum cuvmm_backend */
static const char *const bool_words[] = {"0", "1", "false", "true", "no", "yes", "off", "on", NULL}; /* odd: true */
static const char *const peer_words[] = {"none", "all", "0", "1", "no", "yes", "off", "on", NULL}; /* odd: all */
static const char *const log_words[] = {"error", "warn", "info", "debug", "warning", NULL}; /* enum cuvmm_log_level */

enum env_kind {
	ENV_WORD, /* one of words[], case-insensitive; the value is its index */
	ENV_SIZE, /* bytes, with an optional K/M/G/T suffix */
	ENV_MS,   /* -1 or a count of milliseconds */
	ENV_PATH, /* an absolute path */
	ENV_COUNT, /* digits: a count from 1 to CVM_MAX_HOST_DEVICES */
};

static const struct env_var {
	const char *name;
	enum env_kind kind;
	const char *const *words; /* ENV_WORD only */
	const char *expect;       /* what a valid value looks like, for the report */
} env_vars[CVM_ENV_COUNT_] = {
	[CVM_ENV_BACKEND] = {"CUVMM_BACKEND", ENV_WORD, backend_words, "cuda, host or auto"},
	[CVM_ENV_RELEASE_DELAY_MS] = {"CUVMM_RELEASE_DELAY_MS", ENV_MS, NULL,
				      "-1 (never), 0 (at once) or milliseconds up to 9223372036854"},
	[CVM_ENV_RETAIN_BYTES] = {"CUVMM_RETAIN_BYTES", ENV_SIZE, NULL, "a size such as 512M"},
	[CVM_ENV_DEVICE_LIMIT] = {"CUVMM_DEVICE_LIMIT", ENV_SIZE, NULL, "0 (none) or a size of at least one granule"},
	[CVM_ENV_BACKGROUND_RELEASE] = {"CUVMM_BACKGROUND_RELEASE", ENV_WORD, bool_words, "0 or 1 (no/yes, off/on)"},
	[CVM_ENV_HOST_GRANULARITY] = {"CUVMM_HOST_GRANULARITY", ENV_SIZE, NULL,
				      "a power of two, at least the page size, such as 2M"},
	[CVM_ENV_LOG] = {"CUVMM_LOG", ENV_WORD, log_words, "error, warn, info or debug"},
	[CVM_ENV_PUBLISH] = {"CUVMM_PUBLISH", ENV_WORD, bool_words, "0 or 1 (no/yes, off/on)"},
	[CVM_ENV_PUBLISH_DIR] = {"CUVMM_PUBLISH_DIR", ENV_PATH, NULL, "an absolute directory such as /dev/shm"},
	[CVM_ENV_HOST_DEVICES] = {"CUVMM_HOST_DEVICES", ENV_COUNT, NULL, "a number of devices from 1 to 64"},
	[CVM_ENV_PEER_ACCESS] = {"CUVMM_PEER_ACCESS", ENV_WORD, peer_words, "all or none (1/0, yes/no, on/off)"},
	[CVM_ENV_PIN_THREADS] = {"CUVMM_PIN_THREADS", ENV_SIZE, NULL, "a thread count from 1 to 256"},
	[CVM_ENV_SLEEP_HOST_LIMIT] = {"CUVMM_SLEEP_HOST_LIMIT", ENV_SIZE, NULL, "0 (none) or a size such as 16G"},
};

/* The last bad value reported for each variable: a value is reported once per process (config_init runs
 * once per context, and a program may make several), a new bad value again. */
static pthread_mutex_t reported_lock = PTHREAD_MUTEX_INITIALIZER;
static char reported[CVM_ENV_COUNT_][96];

int cvm_parse_size(const char *s, size_t *out)
{
	char *end;
	unsigned long long v;
	unsigned shift = 0;

	/* strtoull would skip blanks and accept a sign (" -1" is 2^64-1): only digits may start a size. */
	if (!s || *s < '0' || *s > '9')
		return CUVMM_EINVAL;
	errno = 0;
	v = strtoull(s, &end, 10);
	if (errno || end == s)
		return CUVMM_EINVAL;
	switch (*end) {
	case 'k': case 'K': shift = 10; end++; break;
	case 'm': case 'M': shift = 20; end++; break;
	case 'g': case 'G': shift = 30; end++; break;
	case 't': case 'T': shift = 40; end++; break;
	default: break;
	}
	if ((*end == 'i' || *end == 'I') && shift)
		end++;
	if ((*end == 'b' || *end == 'B') && shift)
		end++;
	if (*end)
		return CUVMM_EINVAL;
	if (v > SIZE_MAX || (shift && v > (SIZE_MAX >> shift)))
		return CUVMM_EINVAL;
	*out = (size_t)v << shift;
	return CUVMM_OK;
}

int cvm_parse_i64(const char *s, int64_t *out)
{
	char *end;
	long long v;

	/* As for sizes: no leading blanks or '+'; a '-' only right before a digit. */
	if (!s || !(*s == '-' ? s[1] >= '0' && s[1] <= '9' : *s >= '0' && *s <= '9'))
		return CUVMM_EINVAL;
	errno = 0;
	v = strtoll(s, &end, 10);
	if (errno || end == s || *end)
		return CUVMM_EINVAL;
	*out = v;
	return CUVMM_OK;
}

static const char *env_value(enum cvm_env which)
{
	const char *s = getenv(env_vars[which].name);

	return s && *s ? s : NULL;
}

/* Report a bad value once: "CUVMM_X="v" <why>; using <used>. Valid: <expect>". */
static void env_report(enum cvm_env which, const char *s, const char *why, const char *used)
{
	const struct env_var *v = &env_vars[which];
	bool unreported;

	pthread_mutex_lock(&reported_lock);
	unreported = strncmp(reported[which], s, sizeof(reported[which]) - 1) != 0 || !reported[which][0];
	if (unreported)
		snprintf(reported[which], sizeof(reported[which]), "%s", s);
	pthread_mutex_unlock(&reported_lock);
	if (!unreported)
		return;
	if (which == CVM_ENV_LOG) /* the logger is reading its own level: write directly */
		fprintf(stderr, "cuvmm: warn: %s=\"%s\" %s; using %s. Valid: %s\n", v->name, s, why, used, v->expect);
	else
		cvm_warn("%s=\"%s\" %s; using %s. Valid: %s", v->name, s, why, used, v->expect);
}

/* Read one variable. 1: set and well formed, *out holds the word's index, the bytes or the ms; 0: unset;
 * -1: malformed (reported, with `used` naming what the caller keeps). */
static int env_read(enum cvm_env which, int64_t *out, const char *used)
{
	const struct env_var *v = &env_vars[which];
	const char *s = env_value(which);
	size_t bytes;

	if (!s)
		return 0;
	switch (v->kind) {
	case ENV_WORD:
		for (int i = 0; v->words[i]; i++) {
			if (strcasecmp(s, v->words[i]) == 0) {
				*out = i;
				return 1;
			}
		}
		env_report(which, s, "is not a known word", used);
		return -1;
	case ENV_SIZE:
		if (cvm_parse_size(s, &bytes) == CUVMM_OK && (uint64_t)bytes <= INT64_MAX) {
			*out = (int64_t)bytes;
			return 1;
		}
		env_report(which, s, "is not a size (digits with an optional K, M, G or T suffix)", used);
		return -1;
	case ENV_MS:
		if (cvm_parse_i64(s, out) == CUVMM_OK && *out >= -1 && *out <= CUVMM_RELEASE_DELAY_MS_MAX)
			return 1;
		env_report(which, s, "is not -1 or a number of milliseconds in range", used);
		return -1;
	case ENV_PATH:
		if (*s == '/')
			return 1;
		env_report(which, s, "is not an absolute path", used);
		return -1;
	case ENV_COUNT:
		if (*s != '-' && cvm_parse_i64(s, out) == CUVMM_OK && *out >= 1 && *out <= CVM_MAX_HOST_DEVICES)
			return 1;
		env_report(which, s, "is not a count in range", used);
		return -1;
	}
	return -1;
}

/* Size variables: read, then check against what the library can serve. */
static void env_size(enum cvm_env which, size_t *field, size_t min, bool pow2, const char *used)
{
	int64_t v;

	if (env_read(which, &v, used) != 1)
		return;
	if (pow2 && (v & (v - 1))) {
		env_report(which, env_value(which), "is not a power of two", used);
		return;
	}
	if (v != 0 && (uint64_t)v < min) {
		char why[96];

		snprintf(why, sizeof(why), "is below %zu bytes, the smallest that can be served", min);
		env_report(which, env_value(which), why, used);
		return;
	}
	if (pow2 && v == 0) {
		env_report(which, env_value(which), "is 0", used);
		return;
	}
	*field = (size_t)v;
}

enum cuvmm_backend cvm_env_backend(void)
{
	int64_t i;

	return env_read(CVM_ENV_BACKEND, &i, "auto (the CUDA backend)") == 1 ? (enum cuvmm_backend)i
									      : CUVMM_BACKEND_AUTO;
}

int cvm_env_log_level(int fallback)
{
	int64_t i;

	if (env_read(CVM_ENV_LOG, &i, "warn") != 1)
		return fallback;
	return i == 4 ? CUVMM_LOG_WARN : (int)i; /* "warning" */
}

bool cvm_env_publish(void)
{
	int64_t i;

	return env_read(CVM_ENV_PUBLISH, &i, "1 (the default)") != 1 || (i & 1);
}

const char *cvm_env_publish_dir(void)
{
	int64_t unused;

	return env_read(CVM_ENV_PUBLISH_DIR, &unused, CVM_PUB_DEFAULT_DIR " (the default)") == 1
		       ? env_value(CVM_ENV_PUBLISH_DIR)
		       : CVM_PUB_DEFAULT_DIR;
}

unsigned cvm_env_pin_threads(void)
{
	long cpus = sysconf(_SC_NPROCESSORS_ONLN);
	unsigned def = cpus < 1 ? 1 : cpus > 16 ? 16 : (unsigned)cpus;
	char used[48];
	int64_t v;

	snprintf(used, sizeof(used), "%u (the default)", def);
	if (env_read(CVM_ENV_PIN_THREADS, &v, used) != 1)
		return def;
	if (v < 1 || v > CVM_PIN_THREADS_MAX) {
		env_report(CVM_ENV_PIN_THREADS, env_value(CVM_ENV_PIN_THREADS), "is out of range", used);
		return def;
	}
	return (unsigned)v;
}

size_t cvm_env_sleep_host_limit(void)
{
	int64_t v;

	return env_read(CVM_ENV_SLEEP_HOST_LIMIT, &v, "no limit (the default)") == 1 ? (size_t)v : 0;
}

void cuvmm_config_init(struct cuvmm_config *cfg)
{
	long page = sysconf(_SC_PAGESIZE);
	int64_t v;

	if (!cfg)
		return;
	memset(cfg, 0, sizeof(*cfg));
	cfg->size = sizeof(*cfg);
	cfg->backend = CUVMM_BACKEND_AUTO;
	cfg->release_delay_ms = CVM_DEFAULT_RELEASE_DELAY_MS;
	cfg->retain_bytes = 0;
	cfg->background_release = true;
	cfg->device_limit_bytes = 0;
	cfg->host_granularity = CVM_DEFAULT_HOST_GRANULARITY;
	cfg->host_devices = 1;
	cfg->peer_access = 0;

	cfg->backend = cvm_env_backend();
	if (env_read(CVM_ENV_RELEASE_DELAY_MS, &v, "1000 ms (the default)") == 1)
		cfg->release_delay_ms = v;
	env_size(CVM_ENV_RETAIN_BYTES, &cfg->retain_bytes, 0, false, "0 (the default)");
	if (env_read(CVM_ENV_BACKGROUND_RELEASE, &v, "1 (the default)") == 1)
		cfg->background_release = v & 1;
	/* The granularity first: the device limit is checked against the granule it gives. */
	env_size(CVM_ENV_HOST_GRANULARITY, &cfg->host_granularity, page > 0 ? (size_t)page : 4096, true,
		 "2M (the default)");
	env_size(CVM_ENV_DEVICE_LIMIT, &cfg->device_limit_bytes,
		 cfg->backend == CUVMM_BACKEND_HOST ? cfg->host_granularity : CVM_MIN_DEVICE_GRANULE, false,
		 "no limit (the default)");
	if (env_read(CVM_ENV_HOST_DEVICES, &v, "1 (the default)") == 1)
		cfg->host_devices = (int)v;
	if (env_read(CVM_ENV_PEER_ACCESS, &v, "none (the default)") == 1)
		cfg->peer_access = (v & 1) ? CUVMM_PEERS_ALL : 0;
}

int cvm_config_check(const struct cuvmm_config *cfg)
{
	if (cfg->size < sizeof(struct cuvmm_config))
		return CUVMM_EINVAL;
	if (cfg->backend != CUVMM_BACKEND_AUTO && cfg->backend != CUVMM_BACKEND_CUDA &&
	    cfg->backend != CUVMM_BACKEND_HOST)
		return CUVMM_EINVAL;
	/* Above the maximum, the delay in nanoseconds (and a deadline now + delay) would wrap. */
	if (cfg->release_delay_ms < -1 || cfg->release_delay_ms > CUVMM_RELEASE_DELAY_MS_MAX)
		return CUVMM_EINVAL;
	if (cfg->host_granularity & (cfg->host_granularity - 1))
		return CUVMM_EINVAL;
	if (cfg->host_devices < 0 || cfg->host_devices > CVM_MAX_HOST_DEVICES)
		return CUVMM_EINVAL;
	return CUVMM_OK;
}
