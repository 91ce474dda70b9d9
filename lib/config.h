/*
 * The configuration's defaults and the CUVMM_* environment variables (config.c): one parser for all of them,
 * used by the context, the logger and the publisher.
 */
#ifndef CVM_CONFIG_H
#define CVM_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "cuvmm.h"

#define CVM_DEFAULT_RELEASE_DELAY_MS 1000
#define CVM_DEFAULT_HOST_GRANULARITY ((size_t)2 << 20)
/* The smallest granule of any CUDA device with virtual memory management: a device limit below it can
 * serve nothing. */
#define CVM_MIN_DEVICE_GRANULE ((size_t)2 << 20)
/* The most devices the host backend emulates (and a context uses): bits of a peer mask. */
#define CVM_MAX_HOST_DEVICES 64

/* The CUVMM_* environment variables, one row each in config.c's table. */
enum cvm_env {
	CVM_ENV_BACKEND,
	CVM_ENV_RELEASE_DELAY_MS,
	CVM_ENV_RETAIN_BYTES,
	CVM_ENV_DEVICE_LIMIT,
	CVM_ENV_BACKGROUND_RELEASE,
	CVM_ENV_HOST_GRANULARITY,
	CVM_ENV_LOG,
	CVM_ENV_PUBLISH,
	CVM_ENV_PUBLISH_DIR,
	CVM_ENV_HOST_DEVICES,
	CVM_ENV_PEER_ACCESS,
	CVM_ENV_PIN_THREADS,
	CVM_ENV_SLEEP_HOST_LIMIT,
	CVM_ENV_COUNT_
};

/* "64M", "2G", "4096", "1KiB" -> bytes. CUVMM_EINVAL on anything else (negative, overflow, junk). */
int cvm_parse_size(const char *s, size_t *out);
int cvm_parse_i64(const char *s, int64_t *out);
/* $CUVMM_BACKEND as a backend (AUTO when unset or bad; a bad value is reported once). */
enum cuvmm_backend cvm_env_backend(void);
/* $CUVMM_LOG as a level, or `fallback` when unset or bad (reported once, straight to stderr). */
int cvm_env_log_level(int fallback);
/* $CUVMM_PUBLISH: whether contexts publish their counters for cuvmm-top (default yes; a bad value is
 * reported once and counts as yes). Internal: not a field of struct cuvmm_config. */
bool cvm_env_publish(void);
/* $CUVMM_PUBLISH_DIR: where (an absolute directory; default /dev/shm; a bad value is reported once). */
const char *cvm_env_publish_dir(void);
/* $CUVMM_PIN_THREADS: threads that first-touch and pin a sleep's host copy, 1 to CVM_PIN_THREADS_MAX
 * (default: online CPUs, at most 16; a bad value is reported once). Read at each sleep. */
#define CVM_PIN_THREADS_MAX 256
unsigned cvm_env_pin_threads(void);
/* $CUVMM_SLEEP_HOST_LIMIT: cap on the host memory of all sleep copies of the process, pinned (asleep or
 * kept for the next sleep); 0 or unset: none. Read at each sleep. */
size_t cvm_env_sleep_host_limit(void);
/* CUVMM_EINVAL if a field of a caller's config is out of range. */
int cvm_config_check(const struct cuvmm_config *cfg);

#endif /* CVM_CONFIG_H */
