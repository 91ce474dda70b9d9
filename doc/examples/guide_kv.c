/* KV blocks: one block id backed in every layer's K and V tensor, pages given back once empty. */
#include <stdint.h>
#include <stdio.h>

#include <cuvmm.h>

int main(void)
{
	struct cuvmm_ctx *ctx;
	struct cuvmm_kv_config kc;
	struct cuvmm_kv *kv;
	struct cuvmm_stats st = {.size = sizeof(st)};
	uint32_t ids[16];
	int err;

	err = cuvmm_ctx_create(NULL, &ctx);
	if (err) {
		fprintf(stderr, "cuvmm_ctx_create: %s\n", cuvmm_strerror(err));
		return 1;
	}
	cuvmm_kv_config_init(&kc);
	kc.block_bytes = 16 * 8 * 128 * 2; /* 16 tokens x 8 heads x 128 dims x bf16 */
	kc.max_blocks = 4096;
	kc.tensors = 2 * 4; /* K and V of 4 layers */
	err = cuvmm_kv_create(ctx, &kc, &kv);
	if (!err)
		err = cuvmm_kv_alloc(kv, 16, ids);
	if (!err) {
		/* Block ids[0] of layer l: K at tensor 2l, V at tensor 2l + 1. */
		char *k0 = (char *)cuvmm_kv_tensor(kv, 0) + (size_t)ids[0] * kc.block_bytes;

		printf("kv: block %u of layer 0's K at %p\n", ids[0], (void *)k0);
		err = cuvmm_kv_stats(kv, &st);
	}
	if (!err) {
		printf("kv: %llu bytes live in %u tensors\n", (unsigned long long)st.live_bytes, kc.tensors);
		err = cuvmm_kv_free(kv, 16, ids, NULL); /* pages go back after the idle delay */
	}
	if (err)
		fprintf(stderr, "kv: %s\n", cuvmm_strerror(err));
	cuvmm_kv_destroy(kv);
	cuvmm_ctx_destroy(ctx);
	return err ? 1 : 0;
}
