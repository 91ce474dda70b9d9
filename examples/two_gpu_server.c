/*
 * two_gpu_server: a model split across two GPUs, each reading the other's memory, memory back to what is
 * used on both once idle.
 *
 * One context with peer_access = CUVMM_PEERS_ALL: every mapping on either device is granted to both, so a
 * kernel on GPU 1 can read GPU 0's weights and the other way round (no cuCtxEnablePeerAccess: that is for
 * cudaMalloc memory). The weights are split in two pools, one per device; each device then checksums the
 * other's half with a kernel, and the result must equal the owner's own checksum. A burst of activations on
 * both devices follows, then an idle gap: the background thread gives the burst's memory back on both
 * devices, and held falls back to live (the weights) on each. Exits 1 if it does not.
 *
 * With fewer than two GPUs it says so and exits 77 (skipped); CUVMM_BACKEND=host runs it on the host
 * backend, which emulates two devices here (host_devices = 2), with memcpy-like CPU loops for kernels.
 *
 * Usage: two_gpu_server [--quick] [--release-delay-ms=MS]   (--help describes the options)
 */
#include <getopt.h>
#include <string.h>

#include "cli.h"
#include "example_util.h"

#define NDEV 2

static struct cuvmm_ctx *ctx;
static bool on_host;

static void fill(int dev, void *p, size_t bytes, uint64_t seed)
{
	if (on_host) {
		ex_fill_host(p, bytes / 4, seed);
		return;
	}
	CU_CHECK(ex_cu_use_device(dev));
	CU_CHECK(ex_cu_fill(p, bytes / 4, seed, NULL));
	CU_CHECK(ex_cu_stream_sync(NULL));
}

/* The checksum of [p, p+bytes) computed by a kernel on device `dev`, wherever the memory lives. */
static uint64_t checksum(int dev, const void *p, size_t bytes, uint64_t salt)
{
	uint64_t sum = 0, *dsum;

	if (on_host) {
		ex_checksum_host(p, bytes / 4, salt, &sum);
		return sum;
	}
	CU_CHECK(ex_cu_use_device(dev));
	CU_CHECK(ex_cu_malloc((void **)&dsum, sizeof(*dsum)));
	CU_CHECK(ex_cu_memset32_async(dsum, 0, 2, NULL));
	CU_CHECK(ex_cu_checksum(p, bytes / 4, salt, dsum, NULL));
	CU_CHECK(ex_cu_memcpy_dtoh(&sum, dsum, sizeof(sum)));
	CU_CHECK(ex_cu_free(dsum));
	return sum;
}

static struct cuvmm_stats dev_stats(int dev)
{
	struct cuvmm_stats st = {.size = sizeof(st)};

	CHECK(cuvmm_ctx_stats(ctx, dev, &st));
	return st;
}

static void show(const char *when)
{
	printf("%-22s", when);
	for (int d = 0; d < NDEV; d++) {
		struct cuvmm_stats st = dev_stats(d);

		printf("  %s %d: live %7.1f MiB held %7.1f MiB", on_host ? "host dev" : "GPU", d, st.live_bytes / EX_MiB,
		       st.held_bytes / EX_MiB);
	}
	printf("\n");
}

int main(int argc, char **argv)
{
	static const struct option opts[] = {
		{"quick", no_argument, NULL, 'q'},
		{"release-delay-ms", required_argument, NULL, 'd'},
		{"help", no_argument, NULL, 'h'},
		{NULL, 0, NULL, 0},
	};
	struct cuvmm_config cfg;
	struct cuvmm_pool *weights[NDEV], *act[NDEV];
	struct cuvmm_pool_config pc;
	enum { LAYERS = 8, BURST = 48 };
	void *layer[LAYERS], *buf[NDEV][BURST];
	size_t layer_bytes, buf_bytes;
	long long delay = 300;
	bool quick = false, ok = true;
	int n = 0, c;

	cli_init(argv[0]);
	while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
		switch (c) {
		case 'q':
			quick = true;
			break;
		case 'd':
			delay = cli_int("--release-delay-ms", optarg, 0, 60000);
			break;
		case 'h':
			cli_help("Usage: two_gpu_server [OPTION]...\n"
				 "Weights split across two GPUs, each reading the other's half; a burst, then held\n"
				 "back to live on both. Exits 77 with fewer than two GPUs (CUVMM_BACKEND=host: two\n"
				 "emulated devices).\n\n"
				 "  --quick                 smaller weights and burst\n"
				 "  --release-delay-ms=MS   idle time before memory is given back, 0 to 60000 (300)\n"
				 "  --help                  this text\n");
		default:
			cli_bad_usage();
		}
	}
	cli_no_operands(argc, argv, optind);

	cuvmm_config_init(&cfg);
	cfg.host_devices = NDEV;           /* the host backend emulates two devices; CUDA ignores it */
	cfg.peer_access = CUVMM_PEERS_ALL; /* every device reads every other's memory */
	cfg.release_delay_ms = delay;
	on_host = ex_ctx_create(&cfg, &ctx, "two_gpu_server");
	CHECK(cuvmm_ctx_device_count(ctx, &n));
	if (n < NDEV) {
		printf("two_gpu_server: %d GPU(s); this example needs two (CUVMM_BACKEND=host runs it on two "
		       "emulated devices): skipped\n", n);
		cuvmm_ctx_destroy(ctx);
		return 77;
	}
	if (on_host)
		printf("two_gpu_server: the host backend emulates %d devices; \"kernels\" are CPU loops\n", NDEV);
	layer_bytes = (on_host || quick ? 16u : 256u) << 20;
	buf_bytes = (on_host || quick ? 4u : 64u) << 20;

	for (int d = 0; d < NDEV; d++) {
		cuvmm_pool_config_init(&pc);
		pc.device = d;
		pc.name = d ? "weights1" : "weights0";
		CHECK(cuvmm_pool_create(ctx, &pc, &weights[d]));
		pc.name = d ? "act1" : "act0";
		CHECK(cuvmm_pool_create(ctx, &pc, &act[d]));
	}
	/* Layers 0..3 on device 0, 4..7 on device 1. */
	for (int l = 0; l < LAYERS; l++) {
		int d = l * NDEV / LAYERS;

		CHECK(cuvmm_malloc(weights[d], layer_bytes, &layer[l]));
		fill(d, layer[l], layer_bytes, (uint64_t)l + 1);
	}
	show("weights loaded");

	/* Each device reads the other's half: the sums must equal the owner's. */
	for (int l = 0; l < LAYERS; l++) {
		int own = l * NDEV / LAYERS, other = NDEV - 1 - own;
		uint64_t a = checksum(own, layer[l], layer_bytes, (uint64_t)l), b = checksum(other, layer[l], layer_bytes, (uint64_t)l);

		if (a != b) {
			printf("layer %d: checksum %016llx on its device %d, %016llx read from device %d\n", l,
			       (unsigned long long)a, own, (unsigned long long)b, other);
			ok = false;
		}
	}
	printf("cross-device reads: %s\n", ok ? "every layer reads the same from both devices" : "MISMATCH");

	/* A burst of activations on both devices, then all freed. */
	for (int i = 0; i < BURST; i++)
		for (int d = 0; d < NDEV; d++) {
			CHECK(cuvmm_malloc(act[d], buf_bytes * (1 + i % 3), &buf[d][i]));
			fill(d, buf[d][i], buf_bytes, (uint64_t)i);
		}
	show("burst");
	for (int i = 0; i < BURST; i++)
		for (int d = 0; d < NDEV; d++)
			CHECK(cuvmm_free(act[d], buf[d][i]));
	if (!on_host)
		for (int d = 0; d < NDEV; d++) { /* the frees above are fenced by the work on each device */
			CU_CHECK(ex_cu_use_device(d));
			CU_CHECK(ex_cu_stream_sync(NULL));
		}
	show("burst freed");

	/* Idle: the background thread serves both devices. Generous bound: ten delays and a second. */
	for (double end = ex_now_ms() + 10.0 * (double)delay + 1000; ex_now_ms() < end;) {
		bool back = true;

		for (int d = 0; d < NDEV; d++) {
			struct cuvmm_stats st = dev_stats(d);

			back &= st.held_bytes == st.live_bytes;
		}
		if (back)
			break;
		ex_sleep_ms(10);
	}
	show("idle");
	for (int d = 0; d < NDEV; d++) {
		struct cuvmm_stats st = dev_stats(d);

		if (st.held_bytes != st.live_bytes || st.live_bytes != (uint64_t)LAYERS / NDEV * layer_bytes) {
			printf("device %d holds %llu bytes for %llu live\n", d, (unsigned long long)st.held_bytes,
			       (unsigned long long)st.live_bytes);
			ok = false;
		}
	}
	for (int l = 0; l < LAYERS; l++)
		CHECK(cuvmm_free(weights[l * NDEV / LAYERS], layer[l]));
	for (int d = 0; d < NDEV; d++) {
		cuvmm_pool_destroy(act[d]);
		cuvmm_pool_destroy(weights[d]);
	}
	cuvmm_ctx_destroy(ctx);
	printf("two_gpu_server: %s\n", ok ? "OK" : "FAILED");
	return ok ? 0 : 1;
}
