/* A pool: malloc and free that give memory back to the driver once the program is idle. */
#include <stdio.h>
#include <unistd.h>

#include <cuvmm.h>

int main(void)
{
	struct cuvmm_config cfg;
	struct cuvmm_pool_config pc;
	struct cuvmm_ctx *ctx;
	struct cuvmm_pool *pool;
	struct cuvmm_stats st = {.size = sizeof(st)};
	void *p[8];
	int err;

	cuvmm_config_init(&cfg);
	cfg.release_delay_ms = 100; /* give idle memory back after 100 ms (default 1000) */
	err = cuvmm_ctx_create(&cfg, &ctx);
	if (err) {
		fprintf(stderr, "cuvmm_ctx_create: %s\n", cuvmm_strerror(err));
		return 1;
	}
	cuvmm_pool_config_init(&pc);
	pc.name = "activations";
	err = cuvmm_pool_create(ctx, &pc, &pool);
	for (int i = 0; i < 8 && !err; i++)
		err = cuvmm_malloc(pool, (size_t)(i + 1) << 20, &p[i]); /* or cuvmm_malloc_async(..., stream, ...) */
	for (int i = 0; i < 8 && !err; i++)
		err = cuvmm_free(pool, p[i]); /* reusable at once; given back after the delay */
	if (!err) {
		usleep(300 * 1000); /* idle */
		err = cuvmm_pool_stats(pool, &st);
	}
	if (!err)
		printf("pool: %llu bytes live, %llu bytes held after the idle delay\n",
		       (unsigned long long)st.live_bytes, (unsigned long long)st.held_bytes);
	else
		fprintf(stderr, "pool: %s\n", cuvmm_strerror(err));
	cuvmm_pool_destroy(pool);
	cuvmm_ctx_destroy(ctx);
	return err ? 1 : 0;
}
