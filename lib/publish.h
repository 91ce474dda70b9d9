/*
 * The published page's format and its reader: each context (unless CUVMM_PUBLISH=0) keeps one small
 * file, <dir>/cuvmm.<pid>.<n> (dir: $CUVMM_PUBLISH_DIR, else /dev/shm; n counts the contexts of the
 * process), mapped shared, that holds a snapshot of its counters per device and per object, for cuvmm-top.
 *
 * Writers (ctx_publish.h): one at a time, behind a seqlock: `seq` is odd while a snapshot is being written,
 * so a reader that copies the page and sees the same even `seq` before and after has a consistent snapshot.
 *
 * This header is also the reader's (tools/cuvmm-top.c): the page layout and cvm_pub_read() need nothing
 * else of the library.
 */
#ifndef CVM_PUBLISH_H
#define CVM_PUBLISH_H

#include <stdbool.h>
#include <stdint.h>

#define CVM_PUB_MAGIC "CUVMMPUB" /* the first 8 bytes of a page (no NUL) */
#define CVM_PUB_VERSION 1
#define CVM_PUB_MAX_DEVICES 8
#define CVM_PUB_MAX_OBJECTS 64
#define CVM_PUB_DEFAULT_DIR "/dev/shm"
#define CVM_PUB_PREFIX "cuvmm."
#define CVM_PUB_INTERVAL_NS 100000000ull /* 100 ms between snapshots at most */

/* One device's bytes: cached = held - mapped, physical memory held and mapped nowhere (the chunk cache). */
struct cvm_pub_dev {
	int32_t index;
	uint32_t pad_;
	uint64_t held, mapped, live, cached, peak_held;
	uint64_t total; /* the device's memory */
};

/* One object: a pool (by name), a kv object or a region. */
struct cvm_pub_obj {
	char kind[8];  /* "pool", "kv", "region" */
	char name[32]; /* the pool's name; the kind for others */
	int32_t device;
	uint32_t pad_;
	uint64_t held, live;
};

/* The shared page. Fixed-width fields only: the reader may be built apart from the library. */
struct cvm_pub_page {
	char magic[8];
	uint32_t version;
	uint32_t size;        /* sizeof(struct cvm_pub_page) */
	uint64_t seq;         /* seqlock: odd while a snapshot is written, 0 before the first one */
	int64_t pid;
	uint64_t start_time;  /* field 22 of /proc/<pid>/stat: tells a reused pid from the writer */
	int32_t backend;      /* enum cuvmm_backend */
	uint32_t ndev, nobj;  /* rows filled */
	uint32_t nobj_all;    /* objects of the context, nobj of them listed */
	char comm[16];        /* /proc/self/comm */
	uint64_t mono_ns;     /* when the snapshot was taken: CLOCK_MONOTONIC */
	uint64_t real_ns;     /* and CLOCK_REALTIME */
	uint64_t updates;     /* snapshots written so far */
	struct cvm_pub_dev dev[CVM_PUB_MAX_DEVICES];
	struct cvm_pub_obj obj[CVM_PUB_MAX_OBJECTS];
};

/* ----- reader (publish_read.c, also built into cuvmm-top) ----- */

/* CVM_PUB_READ_*: why a file could not be read. */
enum { CVM_PUB_READ_OK = 0, CVM_PUB_READ_IO = -1, CVM_PUB_READ_FORMAT = -2, CVM_PUB_READ_EMPTY = -3 };
/* A consistent copy of the page at `path` (retrying while a snapshot is being written). IO: cannot open
 * or map it; FORMAT: not a page of this version (magic, version, size); EMPTY: no snapshot yet, or none
 * could be read whole. */
int cvm_pub_read(const char *path, struct cvm_pub_page *out);
/* Field 22 of /proc/<pid>/stat (start time in clock ticks since boot), 0 if unreadable. */
uint64_t cvm_pub_start_time(int64_t pid);
/* Has the process that wrote the page gone (no such pid, a zombie, or the pid now names a later process)? */
bool cvm_pub_dead(const struct cvm_pub_page *p);

#endif /* CVM_PUBLISH_H */
