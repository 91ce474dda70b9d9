/*
 * bench/pin_bench: what pinning a host copy costs, by part (issue #11, target 3: the first sleep of a pool
 * pins its host copy, lib/region_sleep.c). For each way of doing it, a fresh anonymous mapping of --gib GiB
 * is cut into --piece-mib MiB pieces that --threads threads claim in order; each thread populates its piece
 * (or not) and registers it with cudaHostRegister. Reported: the wall time of the whole, and its parts
 * summed over the threads (populate, register), so that it shows which part is the floor:
 *
 *   thp+populate+register    what region_sleep.c does (MADV_HUGEPAGE, MADV_POPULATE_WRITE, register)
 *   4k+populate+register     the same with MADV_NOHUGEPAGE (small pages)
 *   thp+register             no populate: the driver faults the pages in while pinning them
 *   thp+populate             populate only (no register): the kernel's share
 *   cudaHostAlloc            one call of the whole size (what sleep did before)
 *
 * It prints the system's transparent huge page settings first. GPU only (it needs the CUDA runtime).
 *
 * Usage: pin_bench [--gib=N] [--piece-mib=N] [--threads=N[,N...]]   (--help)
 */
#include <errno.h>
#include <getopt.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#define MIB ((size_t)1 << 20)

enum { POPULATE = 1, REGISTER = 2, SMALL_PAGES = 4 };

struct job {
	char *base;
	size_t piece, npieces;
	int how;
	_Atomic size_t next;
	_Atomic long pop_ns, reg_ns;
	_Atomic int failed;
};

static long now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

static void *worker(void *arg)
{
	struct job *j = arg;
	size_t i;

	while ((i = atomic_fetch_add(&j->next, 1)) < j->npieces && !atomic_load(&j->failed)) {
		char *a = j->base + i * j->piece;
		long t0 = now_ns(), t1;

		if (j->how & POPULATE) {
#ifdef MADV_POPULATE_WRITE
			if (madvise(a, j->piece, MADV_POPULATE_WRITE))
#endif
				for (size_t off = 0; off < j->piece; off += 4096)
					((volatile char *)a)[off] = 0;
		}
		t1 = now_ns();
		atomic_fetch_add(&j->pop_ns, t1 - t0);
		if (j->how & REGISTER) {
			if (cudaHostRegister(a, j->piece, cudaHostRegisterDefault) != cudaSuccess)
				atomic_store(&j->failed, 1);
			atomic_fetch_add(&j->reg_ns, now_ns() - t1);
		}
	}
	return NULL;
}

static void run(const char *name, size_t bytes, size_t piece, unsigned threads, int how)
{
	struct job j = {.piece = piece, .npieces = bytes / piece, .how = how};
	pthread_t *tid = calloc(threads, sizeof(*tid));
	long t0;
	char *m;

	m = mmap(NULL, bytes + 2 * MIB, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (m == MAP_FAILED || !tid) {
		printf("%-26s %3u threads: no memory\n", name, threads);
		free(tid);
		return;
	}
	j.base = m + (2 * MIB - (uintptr_t)m % (2 * MIB)) % (2 * MIB);
	(void)madvise(j.base, bytes, (how & SMALL_PAGES) ? MADV_NOHUGEPAGE : MADV_HUGEPAGE);
	t0 = now_ns();
	for (unsigned t = 0; t < threads; t++)
		pthread_create(&tid[t], NULL, worker, &j);
	for (unsigned t = 0; t < threads; t++)
		pthread_join(tid[t], NULL);
	long wall = now_ns() - t0;
	printf("%-26s %3u threads: %7.3f s  %6.2f GB/s   (summed over threads: populate %.3f s, register %.3f s)%s\n",
	       name, threads, wall / 1e9, bytes / (wall / 1e9) / 1e9, atomic_load(&j.pop_ns) / 1e9,
	       atomic_load(&j.reg_ns) / 1e9, atomic_load(&j.failed) ? "  REGISTER FAILED" : "");
	t0 = now_ns();
	if (how & REGISTER)
		for (size_t i = 0; i < j.npieces; i++)
			cudaHostUnregister(j.base + i * piece);
	munmap(m, bytes + 2 * MIB);
	if (how & REGISTER)
		printf("%-26s              unregister and unmap %.3f s\n", "", (now_ns() - t0) / 1e9);
	fflush(stdout);
	free(tid);
}

static void show(const char *path)
{
	char buf[256] = "";
	FILE *f = fopen(path, "r");

	if (f) {
		if (!fgets(buf, sizeof(buf), f))
			buf[0] = 0;
		fclose(f);
	}
	buf[strcspn(buf, "\n")] = 0;
	printf("%s: %s\n", path, f ? buf : "(not readable)");
}

int main(int argc, char **argv)
{
	static const struct option opts[] = {{"gib", required_argument, NULL, 'g'},
					     {"piece-mib", required_argument, NULL, 'p'},
					     {"threads", required_argument, NULL, 't'},
					     {"help", no_argument, NULL, 'h'},
					     {NULL, 0, NULL, 0}};
	size_t gib = 8, piece_mib = 64;
	char threads[64] = "1,16";
	int c;

	while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
		switch (c) {
		case 'g':
		case 'p': {
			char *end;
			unsigned long v = strtoul(optarg, &end, 10);

			if (*end || !v || v > 4096 || optarg[0] == '-') {
				fprintf(stderr, "pin_bench: bad --%s value '%s' (1 to 4096)\n", c == 'g' ? "gib" : "piece-mib",
					optarg);
				return 2;
			}
			*(c == 'g' ? &gib : &piece_mib) = v;
			break;
		}
		case 't':
			if (!optarg[0] || strspn(optarg, "0123456789,") != strlen(optarg) || strstr(optarg, ",,") ||
			    optarg[0] == ',' || strlen(optarg) >= sizeof(threads)) {
				fprintf(stderr, "pin_bench: bad --threads value '%s' (a list such as 1,16)\n", optarg);
				return 2;
			}
			snprintf(threads, sizeof(threads), "%s", optarg);
			break;
		case 'h':
			printf("Usage: pin_bench [--gib=N] [--piece-mib=N] [--threads=N[,N...]]\n"
			       "What pinning a host copy costs, by part (the floor of a pool's first sleep).\n"
			       "  --gib=N            size of each host copy in GiB (default 8)\n"
			       "  --piece-mib=N      pieces claimed by the threads, in MiB (default 64, as sleep)\n"
			       "  --threads=N,...    thread counts to run each way with (default 1,16)\n"
			       "  --help             this text\n");
			return 0;
		default:
			return 2;
		}
	}
	if (optind < argc) {
		fprintf(stderr, "pin_bench: unexpected argument '%s' (--help)\n", argv[optind]);
		return 2;
	}
	if ((gib * 1024) % piece_mib) {
		fprintf(stderr, "pin_bench: bad --piece-mib value '%zu' (it must divide --gib)\n", piece_mib);
		return 2;
	}
	if (cudaFree(NULL) != cudaSuccess) {
		printf("pin_bench: NO USABLE GPU: skipped\n");
		return 77;
	}
	show("/sys/kernel/mm/transparent_hugepage/enabled");
	show("/sys/kernel/mm/transparent_hugepage/defrag");
	show("/proc/sys/vm/nr_hugepages");
	printf("pin_bench: %zu GiB in %zu MiB pieces, %ld CPUs online\n", gib, piece_mib, sysconf(_SC_NPROCESSORS_ONLN));
	size_t bytes = gib << 30, piece = piece_mib * MIB;
	for (char *s = threads; *s;) {
		unsigned t = (unsigned)strtoul(s, &s, 10);

		if (*s == ',')
			s++;
		if (!t || t > 256)
			break;
		run("thp+populate+register", bytes, piece, t, POPULATE | REGISTER);
		run("4k+populate+register", bytes, piece, t, POPULATE | REGISTER | SMALL_PAGES);
		run("thp+register", bytes, piece, t, REGISTER);
		run("thp+populate", bytes, piece, t, POPULATE);
	}
	void *h = NULL;
	long t0 = now_ns();
	if (cudaHostAlloc(&h, bytes, cudaHostAllocDefault) == cudaSuccess) {
		printf("%-26s             : %7.3f s  %6.2f GB/s\n", "cudaHostAlloc", (now_ns() - t0) / 1e9,
		       bytes / ((now_ns() - t0) / 1e9) / 1e9);
		cudaFreeHost(h);
	}
	return 0;
}
