/*
 * cuvmm-top: what every process using cuvmm on this machine holds, per device and per object, from the
 * pages the library publishes (lib/publish.h), next to the driver's own per-process figure (NVML, when it
 * can be loaded).
 */
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <getopt.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"
#include "publish.h"

static const char help_text[] =
	"Usage: cuvmm-top [OPTION]...\n"
	"Show what every process using cuvmm holds: per device, the bytes held from the driver, mapped, live\n"
	"(handed out) and cached (held, mapped nowhere), and per pool, kv object and region the bytes held and\n"
	"live; next to the driver's figure for the process (NVML, all devices; '-' where NVML is unavailable, as\n"
	"on the host backend). Redraws every interval until interrupted.\n"
	"\n"
	"  --once              print once and exit\n"
	"  --interval=SECONDS  time between redraws (0.1 to 3600; default 1)\n"
	"  --pid=PID           only this process\n"
	"  --dir=DIR           where the pages are (default $CUVMM_PUBLISH_DIR, else /dev/shm)\n"
	"  --clean             remove the pages of processes that are gone\n"
	"  --help              print this help and exit\n"
	"\n"
	"Each context of a process publishes DIR/cuvmm.PID.N (mode 0600: run as the same user, or as root, to\n"
	"see a process), refreshed at most every 100 ms while the process uses the library.\n"
	"CUVMM_PUBLISH=0 in a process's environment turns publishing off.\n";

/* ----- NVML, loaded at run time (optional) ----- */

typedef int (*nvml_init_fn)(void);
typedef int (*nvml_count_fn)(unsigned *);
typedef int (*nvml_handle_fn)(unsigned, void **);
struct nvml_proc { /* nvmlProcessInfo_t of nvmlDeviceGetComputeRunningProcesses_v3 */
	unsigned pid;
	unsigned long long used;
	unsigned gpu_instance, compute_instance;
};
typedef int (*nvml_procs_fn)(void *, unsigned *, struct nvml_proc *);

static struct {
	bool tried, ok;
	nvml_count_fn count;
	nvml_handle_fn handle;
	nvml_procs_fn procs;
} nvml;

static void nvml_load(void)
{
	void *lib;
	nvml_init_fn init;

	if (nvml.tried)
		return;
	nvml.tried = true;
	lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
	if (!lib)
		return;
	init = (nvml_init_fn)dlsym(lib, "nvmlInit_v2");
	nvml.count = (nvml_count_fn)dlsym(lib, "nvmlDeviceGetCount_v2");
	nvml.handle = (nvml_handle_fn)dlsym(lib, "nvmlDeviceGetHandleByIndex_v2");
	nvml.procs = (nvml_procs_fn)dlsym(lib, "nvmlDeviceGetComputeRunningProcesses_v3");
	nvml.ok = init && nvml.count && nvml.handle && nvml.procs && init() == 0;
}

/* The driver's bytes for a process over all devices (NVML's device order need not be CUDA's, so no
 * per-device figure), or -1 when NVML cannot say. */
static long long nvml_used(long long pid)
{
	unsigned ndev;
	long long sum = 0;
	bool seen = false;

	nvml_load();
	if (!nvml.ok || nvml.count(&ndev))
		return -1;
	for (unsigned d = 0; d < ndev; d++) {
		struct nvml_proc procs[256];
		unsigned n = 256;
		void *h;

		if (nvml.handle(d, &h) || nvml.procs(h, &n, procs))
			continue;
		for (unsigned i = 0; i < n && i < 256; i++) {
			/* (~0: NVML_VALUE_NOT_AVAILABLE, e.g. without the rights to see the process) */
			if ((long long)procs[i].pid == pid && procs[i].used != ~0ull) {
				sum += (long long)procs[i].used;
				seen = true;
			}
		}
	}
	return seen ? sum : -1;
}

/* ----- pages ----- */

struct proc {
	struct cvm_pub_page pg;
	char file[256];
};

static int by_pid(const void *a, const void *b)
{
	const struct proc *x = a, *y = b;

	if (x->pg.pid != y->pg.pid)
		return x->pg.pid < y->pg.pid ? -1 : 1;
	return strcmp(x->file, y->file);
}

/* Pages that could not be opened (another user's, mode 0600) in the last scan. */
static size_t unreadable;

/* Read every page of dir into *out (n of them); skip those of processes that are gone (removing them
 * with clean). 0, or -1 if dir cannot be read. */
static int scan(const char *dir, long long only_pid, bool clean, struct proc **out, size_t *n)
{
	DIR *d = opendir(dir);
	struct dirent *e;
	struct proc *v = NULL;
	size_t cap = 0;

	*n = 0;
	unreadable = 0;
	if (!d)
		return -1;
	while ((e = readdir(d))) {
		char path[4096];
		struct proc p;

		if (strncmp(e->d_name, CVM_PUB_PREFIX, strlen(CVM_PUB_PREFIX)))
			continue;
		if (only_pid > 0 && strtoll(e->d_name + strlen(CVM_PUB_PREFIX), NULL, 10) != only_pid)
			continue;
		snprintf(path, sizeof(path), "%s/%s", dir, e->d_name);
		if (cvm_pub_read(path, &p.pg) != CVM_PUB_READ_OK) {
			unreadable += access(path, R_OK) != 0;
			continue;
		}
		if (cvm_pub_dead(&p.pg)) {
			if (clean)
				unlink(path);
			continue;
		}
		snprintf(p.file, sizeof(p.file), "%s", e->d_name);
		if (*n == cap) {
			struct proc *nv = realloc(v, (cap ? cap * 2 : 16) * sizeof(*v));

			if (!nv)
				break;
			v = nv;
			cap = cap ? cap * 2 : 16;
		}
		v[(*n)++] = p;
	}
	closedir(d);
	qsort(v, *n, sizeof(*v), by_pid);
	*out = v;
	return 0;
}

static double mib(uint64_t b)
{
	return (double)b / (1 << 20);
}

static void show(const char *dir, const struct proc *v, size_t n)
{
	struct timespec now;
	char when[32];
	time_t t = time(NULL);

	clock_gettime(CLOCK_MONOTONIC, &now);
	strftime(when, sizeof(when), "%Y-%m-%d %H:%M:%S", localtime(&t));
	printf("cuvmm-top  %s  %zu context%s in %s\n", when, n, n == 1 ? "" : "s", dir);
	if (unreadable)
		printf("(%zu more not readable: another user's; run as root to see them)\n", unreadable);
	for (size_t i = 0; i < n; i++) {
		const struct cvm_pub_page *p = &v[i].pg;
		uint64_t mono = (uint64_t)now.tv_sec * 1000000000u + (uint64_t)now.tv_nsec;
		long long drv = nvml_used(p->pid);
		char dbuf[32] = "-";

		if (drv >= 0)
			snprintf(dbuf, sizeof(dbuf), "%.1f MiB", mib((uint64_t)drv));
		printf("\nPID %lld  %s  backend %s  %s  updated %.1f s ago  driver %s\n", (long long)p->pid, p->comm,
		       p->backend == 2 ? "host" : p->backend == 1 ? "cuda" : "?", v[i].file,
		       mono > p->mono_ns ? (double)(mono - p->mono_ns) / 1e9 : 0.0, dbuf);
		printf("  %-6s %12s %12s %12s %12s %12s\n", "DEV", "HELD", "MAPPED", "LIVE", "CACHED", "PEAK HELD");
		for (uint32_t d = 0; d < p->ndev; d++) {
			const struct cvm_pub_dev *x = &p->dev[d];

			printf("  %-6d %8.1f MiB %8.1f MiB %8.1f MiB %8.1f MiB %8.1f MiB\n", x->index, mib(x->held),
			       mib(x->mapped), mib(x->live), mib(x->cached), mib(x->peak_held));
		}
		if (p->nobj)
			printf("  %-6s %-24s %4s %12s %12s\n", "KIND", "NAME", "DEV", "HELD", "LIVE");
		for (uint32_t o = 0; o < p->nobj; o++) {
			const struct cvm_pub_obj *x = &p->obj[o];

			printf("  %-6s %-24s %4d %8.1f MiB %8.1f MiB\n", x->kind, x->name, x->device, mib(x->held),
			       mib(x->live));
		}
		if (p->nobj_all > p->nobj)
			printf("  (%u more objects not listed)\n", p->nobj_all - p->nobj);
	}
	fflush(stdout);
}

static volatile sig_atomic_t stop;

static void on_signal(int sig)
{
	(void)sig;
	stop = 1;
}

int main(int argc, char **argv)
{
	static const struct option opts[] = {
		{"once", no_argument, NULL, 'o'},
		{"interval", required_argument, NULL, 'i'},
		{"pid", required_argument, NULL, 'p'},
		{"dir", required_argument, NULL, 'd'},
		{"clean", no_argument, NULL, 'c'},
		{"help", no_argument, NULL, 'h'},
		{NULL, 0, NULL, 0},
	};
	const char *dir = getenv("CUVMM_PUBLISH_DIR");
	double interval = 1.0;
	long long only_pid = 0;
	bool once = false, clean = false;
	int c;

	cli_init(argv[0]);
	if (!dir || !*dir)
		dir = CVM_PUB_DEFAULT_DIR;
	while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
		switch (c) {
		case 'o': once = true; break;
		case 'i': interval = cli_double("interval", optarg, 0.1, 3600); break;
		case 'p': only_pid = cli_int("pid", optarg, 1, INT32_MAX); break;
		case 'd':
			if (!*optarg)
				cli_fail("--dir=%s: an empty directory name", optarg);
			dir = optarg;
			break;
		case 'c': clean = true; break;
		case 'h': cli_help(help_text);
		default: cli_bad_usage();
		}
	}
	cli_no_operands(argc, argv, optind);
	signal(SIGINT, on_signal);
	signal(SIGTERM, on_signal);
	for (;;) {
		struct proc *v = NULL;
		size_t n;
		struct timespec ts;

		if (scan(dir, only_pid, clean, &v, &n)) {
			fprintf(stderr, "cuvmm-top: cannot read %s: %s\n", dir, strerror(errno));
			return 1;
		}
		if (!once)
			fputs("\033[H\033[2J", stdout); /* home, clear screen */
		show(dir, v, n);
		free(v);
		if (once || stop)
			return 0;
		ts.tv_sec = (time_t)interval;
		ts.tv_nsec = (long)((interval - (double)ts.tv_sec) * 1e9);
		while (nanosleep(&ts, &ts) && errno == EINTR && !stop)
			;
		if (stop)
			return 0;
	}
}
