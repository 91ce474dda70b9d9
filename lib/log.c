/*
 * Logging. The level comes from $CUVMM_LOG once, at the first message; an application's callback replaces
 * stderr. Messages are formatted into a stack buffer so logging never allocates.
 */
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "log.h"

static pthread_once_t env_once = PTHREAD_ONCE_INIT;
static _Atomic int env_level = CUVMM_LOG_WARN;

/* The callback and its user pointer must change together: a lock, taken only to log or to change them. */
static pthread_mutex_t sink_lock = PTHREAD_MUTEX_INITIALIZER;
static cuvmm_log_fn sink_fn;
static void *sink_user;
static _Atomic int sink_level = -1; /* -1: no callback; use env_level */

static const char *const level_names[] = {"error", "warn", "info", "debug"};

/* The parser shared with the other CUVMM_* variables (config.c) reports a bad value itself. */
static void read_env(void)
{
	atomic_store(&env_level, cvm_env_log_level(CUVMM_LOG_WARN));
}

int cvm_log_enabled(enum cuvmm_log_level level)
{
	int cb = atomic_load(&sink_level);

	pthread_once(&env_once, read_env);
	return (int)level <= (cb >= 0 ? cb : atomic_load(&env_level));
}

void cvm_log(enum cuvmm_log_level level, const char *fmt, ...)
{
	char buf[512];
	va_list ap;

	if (!cvm_log_enabled(level))
		return;
	va_start(ap, fmt);
	vsnprintf(buf, sizeof(buf), fmt, ap);
	va_end(ap);

	pthread_mutex_lock(&sink_lock);
	if (sink_fn)
		sink_fn(level, buf, sink_user);
	else
		fprintf(stderr, "cuvmm: %s: %s\n", level_names[level], buf);
	pthread_mutex_unlock(&sink_lock);
}

void cuvmm_set_log_callback(cuvmm_log_fn fn, void *user, enum cuvmm_log_level level)
{
	if ((int)level < CUVMM_LOG_ERROR || level > CUVMM_LOG_DEBUG)
		level = CUVMM_LOG_DEBUG;
	pthread_mutex_lock(&sink_lock);
	sink_fn = fn;
	sink_user = user;
	atomic_store(&sink_level, fn ? (int)level : -1);
	pthread_mutex_unlock(&sink_lock);
}
