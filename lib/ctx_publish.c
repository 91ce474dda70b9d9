/*
 * Publishing the context's counters in a small shared file for cuvmm-top (ctx_publish.h, the page: publish.h).
 *
 * The file is created mode 0600: what a process holds, and its pool names, are its owner's (and root's) to
 * see, as with /proc/<pid>/smaps. A failure to create it is logged at info and the context goes on without.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "config.h"
#include "ctx.h"
#include "ctx_publish.h"
#include "log.h"

static _Atomic unsigned pub_count; /* contexts published by this process so far: the file's <n> */

/* The pages of this process still open: a context never destroyed (the PyTorch shim's lives as long as the
 * process) has its file unlinked at exit all the same. */
static pthread_mutex_t open_lock = PTHREAD_MUTEX_INITIALIZER;
static struct cvm_pub *open_pages;
static pthread_once_t exit_once = PTHREAD_ONCE_INIT;

static void unlink_at_exit(void)
{
	pthread_mutex_lock(&open_lock);
	for (struct cvm_pub *p = open_pages; p; p = p->next)
		if (getpid() == p->pid)
			unlink(p->path);
	pthread_mutex_unlock(&open_lock);
}

static void register_exit(void)
{
	atexit(unlink_at_exit);
}

static void track(struct cvm_pub *pub, bool add)
{
	pthread_mutex_lock(&open_lock);
	if (add) {
		pub->next = open_pages;
		open_pages = pub;
	} else {
		for (struct cvm_pub **pp = &open_pages; *pp; pp = &(*pp)->next) {
			if (*pp == pub) {
				*pp = pub->next;
				break;
			}
		}
	}
	pthread_mutex_unlock(&open_lock);
}

static uint64_t clock_ns(clockid_t id)
{
	struct timespec ts;

	clock_gettime(id, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

void cvm_pub_open(struct cuvmm_ctx *ctx)
{
	struct cvm_pub *pub;
	struct cvm_pub_page *page;
	const char *dir;
	int fd, n;

	if (!cvm_env_publish())
		return;
	dir = cvm_env_publish_dir();
	pub = calloc(1, sizeof(*pub));
	if (!pub || pthread_mutex_init(&pub->lock, NULL)) {
		free(pub);
		cvm_info("publish: out of memory; cuvmm-top will not see this context");
		return;
	}
	pub->pid = getpid();
	n = snprintf(pub->path, sizeof(pub->path), "%s/" CVM_PUB_PREFIX "%lld.%u", dir, (long long)pub->pid,
		     atomic_fetch_add(&pub_count, 1));
	if (n < 0 || (size_t)n >= sizeof(pub->path)) {
		cvm_info("publish: directory name too long (%s); cuvmm-top will not see this context", dir);
		goto fail;
	}
	/* A file of our pid is a dead process's (or ours, if a context of the same n was never unlinked). */
	fd = open(pub->path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
	if (fd < 0) {
		cvm_info("publish: cannot create %s: %s; cuvmm-top will not see this context", pub->path,
			 strerror(errno));
		goto fail;
	}
	if (ftruncate(fd, sizeof(*page))) {
		cvm_info("publish: cannot size %s: %s", pub->path, strerror(errno));
		close(fd);
		unlink(pub->path);
		goto fail;
	}
	page = mmap(NULL, sizeof(*page), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	close(fd);
	if (page == MAP_FAILED) {
		cvm_info("publish: cannot map %s: %s", pub->path, strerror(errno));
		unlink(pub->path);
		goto fail;
	}
	/* The header is constant; a reader takes the page only once seq is non-zero (the first snapshot). */
	page->version = CVM_PUB_VERSION;
	page->size = sizeof(*page);
	page->pid = pub->pid;
	page->start_time = cvm_pub_start_time(pub->pid);
	page->backend = ctx->cfg.backend;
	fd = open("/proc/self/comm", O_RDONLY | O_CLOEXEC);
	if (fd >= 0) {
		ssize_t got = read(fd, page->comm, sizeof(page->comm) - 1);

		close(fd);
		if (got > 0 && page->comm[got - 1] == '\n')
			page->comm[got - 1] = '\0';
	}
	memcpy(page->magic, CVM_PUB_MAGIC, 8);
	pub->page = page;
	pthread_once(&exit_once, register_exit);
	track(pub, true);
	atomic_init(&pub->dirty, true);
	atomic_init(&pub->due, 0);
	ctx->pub = pub;
	cvm_pub_update(ctx, clock_ns(CLOCK_MONOTONIC), true);
	cvm_info("publishing counters in %s", pub->path);
	return;

fail:
	pthread_mutex_destroy(&pub->lock);
	free(pub);
}

void cvm_pub_close(struct cuvmm_ctx *ctx)
{
	struct cvm_pub *pub = ctx->pub;

	if (!pub)
		return;
	ctx->pub = NULL;
	track(pub, false);
	if (getpid() == pub->pid)
		unlink(pub->path);
	munmap(pub->page, sizeof(*pub->page));
	pthread_mutex_destroy(&pub->lock);
	free(pub);
}

/* The page of every object, as its stats function sees it. Called with clients_lock held: the stats
 * functions take only the device's account lock, a leaf. */
static void snap_objects(struct cuvmm_ctx *ctx, struct cvm_pub_page *s)
{
	/* Oldest first: the list holds the newest at its head. */
	for (struct cvm_client *c = ctx->clients.prev; c != &ctx->clients; c = c->prev) {
		struct cvm_pub_obj *o;
		struct cuvmm_stats st = {.size = sizeof(st)};
		const char *name = c->ops->kind;

		s->nobj_all++;
		if (s->nobj == CVM_PUB_MAX_OBJECTS || !c->ops->stats)
			continue;
		c->ops->stats(c, &st, &name);
		o = &s->obj[s->nobj++];
		snprintf(o->kind, sizeof(o->kind), "%s", c->ops->kind);
		snprintf(o->name, sizeof(o->name), "%s", name);
		o->device = c->dev->drv.index;
		o->held = st.held_bytes;
		o->live = st.live_bytes;
	}
}

static void snap_devices(struct cuvmm_ctx *ctx, struct cvm_pub_page *s)
{
	for (int i = 0; i < ctx->ndev && s->ndev < CVM_PUB_MAX_DEVICES; i++) {
		struct cvm_dev *dev = &ctx->dev[i];
		struct cvm_pub_dev *d;
		struct cuvmm_stats st = {.size = sizeof(st)};

		if (!atomic_load(&dev->opened))
			continue;
		cvm_acct_fill(&dev->acct, &dev->drv.cnt, &st); /* one snapshot: mapped <= held */
		d = &s->dev[s->ndev++];
		d->index = i;
		d->held = st.held_bytes;
		d->mapped = st.mapped_bytes;
		d->live = st.live_bytes;
		d->cached = st.held_bytes - st.mapped_bytes;
		d->peak_held = st.peak_held_bytes;
		d->total = dev->info.total_bytes;
	}
}

void cvm_pub_update(struct cuvmm_ctx *ctx, uint64_t now, bool force)
{
	struct cvm_pub *pub = ctx->pub;
	struct cvm_pub_page *page, *s;
	uint64_t seq;

	if (!pub)
		return;
	if (force) {
		pthread_mutex_lock(&pub->lock);
	} else if (pthread_mutex_trylock(&pub->lock)) {
		return; /* another thread is writing one */
	}
	if (!force && (!atomic_load(&pub->dirty) || now < atomic_load(&pub->due)))
		goto out;
	if (getpid() != pub->pid) { /* a forked child: the file is the parent's */
		atomic_store(&pub->due, UINT64_MAX);
		goto out;
	}
	if (force) {
		pthread_mutex_lock(&ctx->clients_lock);
	} else if (pthread_mutex_trylock(&ctx->clients_lock)) {
		/* A pass (a trim, perhaps waiting for the GPU) holds it: look again shortly. */
		atomic_store(&pub->due, now + CVM_FENCE_POLL_NS);
		goto out;
	}
	/* Cleared before the snapshot: a change made while it is taken marks the page again. */
	atomic_store(&pub->dirty, false);
	s = &pub->snap;
	s->ndev = s->nobj = s->nobj_all = 0;
	snap_objects(ctx, s);
	pthread_mutex_unlock(&ctx->clients_lock);
	snap_devices(ctx, s);

	page = pub->page;
	seq = __atomic_load_n(&page->seq, __ATOMIC_RELAXED);
	__atomic_store_n(&page->seq, seq + 1, __ATOMIC_RELAXED); /* odd: readers retry */
	__atomic_thread_fence(__ATOMIC_RELEASE);
	page->ndev = s->ndev;
	page->nobj = s->nobj;
	page->nobj_all = s->nobj_all;
	memcpy(page->dev, s->dev, sizeof(page->dev));
	memcpy(page->obj, s->obj, sizeof(page->obj));
	page->mono_ns = clock_ns(CLOCK_MONOTONIC);
	page->real_ns = clock_ns(CLOCK_REALTIME);
	page->updates++;
	__atomic_store_n(&page->seq, seq + 2, __ATOMIC_RELEASE);
	atomic_store(&pub->due, now + CVM_PUB_INTERVAL_NS);
out:
	pthread_mutex_unlock(&pub->lock);
}

void cvm_pub_touch(struct cuvmm_ctx *ctx)
{
	struct cvm_pub *pub = ctx->pub;

	if (!pub || atomic_exchange(&pub->dirty, true))
		return;
	if (ctx->bg_running) {
		pthread_mutex_lock(&ctx->bg_lock);
		pthread_cond_signal(&ctx->bg_cond);
		pthread_mutex_unlock(&ctx->bg_lock);
	}
}

uint64_t cvm_pub_deadline(struct cuvmm_ctx *ctx)
{
	struct cvm_pub *pub = ctx->pub;

	return pub && atomic_load(&pub->dirty) ? atomic_load(&pub->due) : UINT64_MAX;
}
