/*
 * What a user outside the project writes: only <cuvmm.h> and `pkg-config --cflags --libs cuvmm`.
 * Creates a context, reserves a 64 MiB region, maps 4 MiB, writes and reads it from the CPU (host backend
 * only: CUDA device memory is not CPU-accessible), unmaps, prints statistics.
 * Exits 0 on success, 1 on failure, 77 (skip) when there is no CUDA driver or device.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuvmm.h>

#define MiB ((size_t)1 << 20)

static int fail(const char *what, int err)
{
	fprintf(stderr, "outside: %s: %s (%s)\n", what, cuvmm_strerror(err), cuvmm_err_name(err));
	return 1;
}

static void print_stats(const char *what, const struct cuvmm_stats *s)
{
	printf("%s: reserved %" PRIu64 " held %" PRIu64 " mapped %" PRIu64 " live %" PRIu64
	       " peak_held %" PRIu64 " peak_live %" PRIu64 " create %" PRIu64 " release %" PRIu64
	       " map %" PRIu64 " unmap %" PRIu64 " driver_ns %" PRIu64 "\n",
	       what, s->reserved_bytes, s->held_bytes, s->mapped_bytes, s->live_bytes, s->peak_held_bytes,
	       s->peak_live_bytes, s->create_calls, s->release_calls, s->map_calls, s->unmap_calls, s->driver_ns);
}

int main(void)
{
	struct cuvmm_config cfg;
	struct cuvmm_ctx *ctx = NULL;
	struct cuvmm_region *r = NULL;
	struct cuvmm_stats st;
	size_t gran, len;
	int ret = 1;
	int err;

	printf("cuvmm %s\n", cuvmm_version());

	cuvmm_config_init(&cfg);
	err = cuvmm_ctx_create(&cfg, &ctx);
	if (err == CUVMM_ENODRIVER || err == CUVMM_ENODEV) {
		fprintf(stderr, "outside: no GPU: %s\n", cuvmm_strerror(err));
		return 77;
	}
	if (err != CUVMM_OK)
		return fail("cuvmm_ctx_create", err);

	err = cuvmm_region_create(ctx, 0, 64 * MiB, &r);
	if (err != CUVMM_OK) {
		fail("cuvmm_region_create", err);
		goto out;
	}

	gran = cuvmm_region_granularity(r);
	if (gran == 0 || cuvmm_region_size(r) < 64 * MiB) {
		fprintf(stderr, "outside: bad region: size %zu granularity %zu\n", cuvmm_region_size(r), gran);
		goto out;
	}
	len = (4 * MiB + gran - 1) / gran * gran;

	err = cuvmm_region_map(r, 0, len);
	if (err != CUVMM_OK) {
		fail("cuvmm_region_map", err);
		goto out;
	}

	if (cuvmm_ctx_backend(ctx) == CUVMM_BACKEND_HOST) {
		unsigned char *p = cuvmm_region_base(r);
		for (size_t i = 0; i < len; i++)
			p[i] = (unsigned char)(i * 7u + 1u);
		for (size_t i = 0; i < len; i++) {
			if (p[i] != (unsigned char)(i * 7u + 1u)) {
				fprintf(stderr, "outside: byte %zu reads %u\n", i, p[i]);
				goto out;
			}
		}
		printf("wrote and read back %zu bytes at %p\n", len, (void *)p);
	} else {
		printf("CUDA backend: memory not CPU-accessible, not touched\n");
	}

	memset(&st, 0, sizeof(st));
	st.size = sizeof(st);
	err = cuvmm_region_stats(r, &st);
	if (err != CUVMM_OK) {
		fail("cuvmm_region_stats", err);
		goto out;
	}
	print_stats("region after map", &st);

	err = cuvmm_region_unmap(r, 0, len, NULL);
	if (err != CUVMM_OK) {
		fail("cuvmm_region_unmap", err);
		goto out;
	}

	memset(&st, 0, sizeof(st));
	st.size = sizeof(st);
	err = cuvmm_ctx_stats(ctx, 0, &st);
	if (err != CUVMM_OK) {
		fail("cuvmm_ctx_stats", err);
		goto out;
	}
	print_stats("device 0 after unmap", &st);
	ret = 0;
out:
	cuvmm_region_destroy(r);
	cuvmm_ctx_destroy(ctx);
	if (ret == 0)
		printf("outside: ok\n");
	return ret;
}
