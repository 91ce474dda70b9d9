/*
 * Configuration defaults and the CUVMM_* environment variables. A malformed value is reported and ignored.
 */
#include <errno.h>
#include <limits.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "log.h"

int cvm_parse_size(const char *s, size_t *out)
{
	char *end;
	unsigned long long v;
	unsigned shift = 0;

	if (!s || !*s || *s == '-' || *s == '+')
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
	if (shift && v > (SIZE_MAX >> shift))
		return CUVMM_EINVAL;
	if (v > SIZE_MAX)
		return CUVMM_EINVAL;
	*out = (size_t)v << shift;
	return CUVMM_OK;
}

int cvm_parse_i64(const char *s, int64_t *out)
{
	char *end;
	long long v;

	if (!s || !*s)
		return CUVMM_EINVAL;
	errno = 0;
	v = strtoll(s, &end, 10);
	if (errno || end == s || *end)
		return CUVMM_EINVAL;
	*out = v;
	return CUVMM_OK;
}

static void env_size(const char *name, size_t *field)
{
	const char *s = getenv(name);
	size_t v;

	if (!s)
		return;
	if (cvm_parse_size(s, &v) == CUVMM_OK)
		*field = v;
	else
		cvm_warn("%s=\"%s\" is not a size (digits with an optional K, M, G or T suffix); ignored", name, s);
}

void cuvmm_config_init(struct cuvmm_config *cfg)
{
	const char *s;
	int64_t ms;

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

	s = getenv("CUVMM_BACKEND");
	if (s) {
		if (strcmp(s, "cuda") == 0)
			cfg->backend = CUVMM_BACKEND_CUDA;
		else if (strcmp(s, "host") == 0)
			cfg->backend = CUVMM_BACKEND_HOST;
		else if (strcmp(s, "auto") != 0 && *s)
			cvm_warn("CUVMM_BACKEND=\"%s\" is not cuda, host or auto; ignored", s);
	}
	s = getenv("CUVMM_RELEASE_DELAY_MS");
	if (s) {
		if (cvm_parse_i64(s, &ms) == CUVMM_OK && ms >= -1)
			cfg->release_delay_ms = ms;
		else
			cvm_warn("CUVMM_RELEASE_DELAY_MS=\"%s\" is not -1, 0 or a number of milliseconds; ignored", s);
	}
	env_size("CUVMM_RETAIN_BYTES", &cfg->retain_bytes);
	env_size("CUVMM_DEVICE_LIMIT", &cfg->device_limit_bytes);
	env_size("CUVMM_HOST_GRANULARITY", &cfg->host_granularity);
	s = getenv("CUVMM_BACKGROUND_RELEASE");
	if (s) {
		if (strcmp(s, "0") == 0)
			cfg->background_release = false;
		else if (strcmp(s, "1") == 0)
			cfg->background_release = true;
		else
			cvm_warn("CUVMM_BACKGROUND_RELEASE=\"%s\" is not 0 or 1; ignored", s);
	}
}

int cvm_config_check(const struct cuvmm_config *cfg)
{
	if (cfg->size < sizeof(struct cuvmm_config))
		return CUVMM_EINVAL;
	if (cfg->backend != CUVMM_BACKEND_AUTO && cfg->backend != CUVMM_BACKEND_CUDA &&
	    cfg->backend != CUVMM_BACKEND_HOST)
		return CUVMM_EINVAL;
	if (cfg->release_delay_ms < -1)
		return CUVMM_EINVAL;
	if (cfg->host_granularity & (cfg->host_granularity - 1))
		return CUVMM_EINVAL;
	return CUVMM_OK;
}
