/*
 * A process for tests/check-top.sh: a context, one pool named NAME holding MIB MiB, "ready" on stdout,
 * then sleeps until killed. Usage: top_child NAME MIB
 */
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include <cuvmm.h>

int main(int argc, char **argv)
{
	struct cuvmm_ctx *ctx;
	struct cuvmm_pool *pool;
	struct cuvmm_pool_config pc;
	void *p;
	int err;

	if (argc != 3) {
		fprintf(stderr, "usage: top_child NAME MIB\n");
		return 2;
	}
	err = cuvmm_ctx_create(NULL, &ctx);
	if (!err) {
		cuvmm_pool_config_init(&pc);
		pc.name = argv[1];
		err = cuvmm_pool_create(ctx, &pc, &pool);
	}
	if (!err)
		err = cuvmm_malloc(pool, (size_t)atoi(argv[2]) << 20, &p);
	if (err) {
		fprintf(stderr, "top_child: %s\n", cuvmm_strerror(err));
		return 1;
	}
	printf("ready\n");
	fflush(stdout);
	for (;;)
		pause();
}
