/*
 * The context: the driver connection, the devices opened so far, the objects that hold memory (clients),
 * and the background thread that gives idle memory back.
 */
#ifndef CVM_CTX_H
#define CVM_CTX_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>

#include "ctx_capture.h"
#include "drv.h"
#include "fence.h"
#include "phys.h"
#include "policy.h"

#define CVM_MAX_DEVICES 64

struct cvm_pub;

struct cvm_dev {
	struct cuvmm_ctx *ctx;
	struct cvm_drv_dev drv; /* its connection, index, and the counters of every driver call made for it */
	_Atomic bool opened;
	pthread_mutex_t pass_lock; /* one reclaim pass at a time on this device's clients and cache */
	struct cvm_devinfo info;
	struct cvm_acct acct;        /* every byte on this device */
	struct cvm_phys phys;
	struct cvm_fence_dev fence; /* its epochs and event cache: every fence of the device's objects (fence.h) */
	/* Peer access (region.c): every region of this device's memory (pools' and kv objects' included), and
	 * the devices that cuvmm_ctx_add_peer gave access to it, under regions_lock (taken before a region's). */
	pthread_mutex_t regions_lock;
	struct cuvmm_region *regions;
	uint64_t peers_added;
};

/* The release lead (cvm_policy_lead) of `chunks` handles on this device, at the cost per driver call
 * measured on it so far. */
uint64_t cvm_dev_release_lead(struct cvm_dev *dev, size_t chunks);

/* Synchronise the device (call with no lock held) and advance its safe epoch past every earlier free
 * (cvm_fence_sync_begin/end): epoch fences taken before then complete.
 * CUVMM_EBUSY, with no driver call, while a stream capture the library has seen is under way on the device
 * (synchronising would invalidate it): the caller leaves what needed the synchronisation for later. */
int cvm_dev_sync_epoch(struct cvm_dev *dev);
/* The same without the epoch: every device synchronisation of the library goes through one of these two. */
int cvm_dev_sync(struct cvm_dev *dev);

/*
 * An object that can give memory back (region, pool, kv). reclaim() unmaps what has been free long enough
 * (or everything free, with force) and returns when it next has something to do (ns, UINT64_MAX: nothing).
 * Without force it must not block: it trylocks its own lock and returns `now + a little` when busy.
 */
struct cvm_client;
struct cvm_client_ops {
	uint64_t (*reclaim)(struct cvm_client *c, uint64_t now, bool force);
	/* Its statistics as its cuvmm_*_stats() gives them, and a name for cuvmm-top (left as the kind when it
	 * has none). Takes no lock but the device's account lock: called with clients_lock held. */
	void (*stats)(struct cvm_client *c, struct cuvmm_stats *out, const char **name);
	const char *kind;
};
struct cvm_client {
	const struct cvm_client_ops *ops;
	struct cvm_dev *dev;
	struct cvm_client *next, *prev;
	unsigned pins; /* reclaim passes inside it with clients_lock dropped; removal waits for 0 */
	void (*destroy)(struct cvm_client *c); /* for ctx_destroy of objects the application forgot */
};

struct cuvmm_ctx {
	struct cuvmm_config cfg;
	struct cvm_drv drv;
	int ndev;
	struct cvm_policy policy; /* when idle memory goes back: every client and device asks it */

	pthread_mutex_t dev_lock; /* opening devices */
	struct cvm_dev dev[CVM_MAX_DEVICES];

	/* The client list; held briefly by reclaim passes (which pin the client they are in and drop it, so a
	 * pass waiting for one device's GPU holds up no other device), never by allocations. */
	pthread_mutex_t clients_lock;
	pthread_cond_t clients_cond; /* a client unpinned */
	struct cvm_client clients;

	/* Background release. next_deadline is read lock-free on hot paths to decide whether to wake it. */
	pthread_t bg;
	bool bg_running;
	pthread_mutex_t bg_lock;
	pthread_cond_t bg_cond;
	bool bg_stop;
	_Atomic uint64_t next_deadline;

	struct cvm_captures captures; /* the captures seen (ctx_capture.h), and the graph pools' state */
	struct cvm_pub *pub;          /* the counters published for cuvmm-top (ctx_publish.h); NULL: not published */
};

/* The device, opened on first use. CUVMM_ENODEV if out of range or without VMM support. */
int cvm_ctx_dev(struct cuvmm_ctx *ctx, int device, struct cvm_dev **out);
/* The devices to get access to memory on `device` (bit i: device i, `device` itself always among them) for a
 * peer mask `mask` (CUVMM_PEERS_ALL: every device of the context): CUVMM_EINVAL for a bit naming a device
 * the context lacks, CUVMM_ENOTSUP when one of them cannot access `device`'s memory (cuDeviceCanAccessPeer),
 * or the error of that query. */
int cvm_ctx_peers(struct cuvmm_ctx *ctx, int device, uint64_t mask, uint64_t *out);

void cvm_ctx_add_client(struct cuvmm_ctx *ctx, struct cvm_client *c);
void cvm_ctx_remove_client(struct cuvmm_ctx *ctx, struct cvm_client *c);

/*
 * Tell the context that something will be due at `deadline` (ns). Wakes the background thread if that is
 * earlier than what it waits for; without a background thread, the next cvm_ctx_poll after the deadline
 * does the work. Cheap when nothing changes: one atomic load.
 */
void cvm_ctx_kick(struct cuvmm_ctx *ctx, uint64_t deadline);
/* Memory idle since `since` comes due when the policy says, at the latest (with the longest lead): wake the
 * pass by then. Nothing when it never comes due. */
static inline void cvm_ctx_kick_freed(struct cuvmm_ctx *ctx, uint64_t since)
{
	if (!cvm_policy_never(&ctx->policy))
		cvm_ctx_kick(ctx, cvm_policy_deadline(&ctx->policy, since, cvm_policy_max_lead(&ctx->policy)));
}
/* Called on library entry points: runs a reclaim pass if one is due and there is no background thread. */
void cvm_ctx_poll(struct cuvmm_ctx *ctx);
/* One reclaim pass over every client and device; returns the next deadline. */
uint64_t cvm_ctx_reclaim(struct cuvmm_ctx *ctx, uint64_t now, bool force, int device, size_t keep);

#endif /* CVM_CTX_H */
