/* Sleep and wake: give a pool's memory back while keeping its addresses, then bring it back. */
#include <stdio.h>

#include <cuvmm.h>

int main(void)
{
	struct cuvmm_ctx *ctx;
	struct cuvmm_pool *weights;
	struct cuvmm_stats st = {.size = sizeof(st)};
	void *w, *again;
	int err;

	err = cuvmm_ctx_create(NULL, &ctx);
	if (err) {
		fprintf(stderr, "cuvmm_ctx_create: %s\n", cuvmm_strerror(err));
		return 1;
	}
	err = cuvmm_pool_create(ctx, NULL, &weights);
	if (!err)
		err = cuvmm_malloc(weights, 64 << 20, &w); /* load the weights into w */
	if (!err)
		err = cuvmm_pool_sleep(weights, CUVMM_SLEEP_OFFLOAD, NULL); /* copied to pinned host memory */
	if (!err)
		err = cuvmm_pool_stats(weights, &st);
	if (!err) {
		printf("asleep: %llu bytes held, %llu live\n", (unsigned long long)st.held_bytes,
		       (unsigned long long)st.live_bytes);
		/* While it sleeps, calls other than wake, stats and destroy fail with CUVMM_ESTATE. */
		if (cuvmm_malloc(weights, 4096, &again) != CUVMM_ESTATE)
			err = CUVMM_EINVAL;
	}
	if (!err)
		err = cuvmm_pool_wake(weights, NULL); /* same address w, same contents; CUDA graphs stay valid */
	if (!err)
		err = cuvmm_free(weights, w);
	if (err)
		fprintf(stderr, "sleep: %s\n", cuvmm_strerror(err));
	else
		printf("awake again at %p\n", w);
	cuvmm_pool_destroy(weights);
	cuvmm_ctx_destroy(ctx);
	return err ? 1 : 0;
}
