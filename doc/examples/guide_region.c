/* A region: reserve once, grow and shrink in place, the address never changes. */
#include <stdio.h>

#include <cuvmm.h>

int main(void)
{
	struct cuvmm_ctx *ctx;
	struct cuvmm_region *r;
	struct cuvmm_stats st = {.size = sizeof(st)};
	int err;

	err = cuvmm_ctx_create(NULL, &ctx); /* defaults and CUVMM_* variables; CUVMM_BACKEND=host without a GPU */
	if (err) {
		fprintf(stderr, "cuvmm_ctx_create: %s\n", cuvmm_strerror(err));
		return 1;
	}
	err = cuvmm_region_create(ctx, 0, (size_t)1 << 30, &r); /* 1 GiB of address space, no memory yet */
	if (!err)
		err = cuvmm_region_resize(r, 64 << 20, NULL); /* map the first 64 MiB */
	if (!err) {
		void *base = cuvmm_region_base(r); /* launch kernels on base .. base + 64 MiB */

		err = cuvmm_region_resize(r, 256 << 20, NULL); /* grow in place: base is unchanged */
		if (!err && cuvmm_region_base(r) != base)
			err = CUVMM_ESTATE;
	}
	if (!err)
		err = cuvmm_region_resize(r, 16 << 20, NULL); /* shrink: unmapped once the device's work is done */
	if (!err)
		err = cuvmm_region_stats(r, &st);
	if (!err)
		printf("region: %llu MiB reserved, %llu MiB mapped\n", (unsigned long long)st.reserved_bytes >> 20,
		       (unsigned long long)st.mapped_bytes >> 20);
	else
		fprintf(stderr, "region: %s\n", cuvmm_strerror(err));
	cuvmm_region_destroy(r);
	cuvmm_ctx_destroy(ctx);
	return err ? 1 : 0;
}
