/*
 * Configuration helpers shared by the context and the environment parser.
 */
#ifndef CVM_CONFIG_H
#define CVM_CONFIG_H

#include <stddef.h>
#include <stdint.h>

#include "cuvmm.h"

#define CVM_DEFAULT_RELEASE_DELAY_MS 1000
#define CVM_DEFAULT_HOST_GRANULARITY ((size_t)2 << 20)

/* "64M", "2G", "4096", "1KiB" -> bytes. CUVMM_EINVAL on anything else (negative, overflow, junk). */
int cvm_parse_size(const char *s, size_t *out);
int cvm_parse_i64(const char *s, int64_t *out);
/* CUVMM_EINVAL if a field of a caller's config is out of range. */
int cvm_config_check(const struct cuvmm_config *cfg);

#endif /* CVM_CONFIG_H */
