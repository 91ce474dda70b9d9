/*
 * Harness shared by the unit test programs (Check).
 *
 * Every program runs on the backend named by $CUVMM_BACKEND (host by default; tests/meson.build registers each
 * program once per backend). The same test bodies run on both: "kernels" are CPU loops on the host backend and
 * real kernels (tests/kernels.cu, through gpu.c) on the CUDA backend. A program on the CUDA backend that cannot
 * create a context (no driver, no device) exits 77, which meson reports as skipped.
 *
 * Check runs each test in a child process (CK_FORK), so a test may change the environment, the log callback or
 * the host backend's gate without restoring them; tests restore them anyway, so CK_FORK=no also works.
 */
#ifndef TC_COMMON_H
#define TC_COMMON_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <check.h>

#include <cuda.h> /* CUresult codes; the tests build against the toolkit headers */

#include "cuvmm.h"

#define TC_KiB ((size_t)1 << 10)
#define TC_MiB ((size_t)1 << 20)

/* Per-tcase limit (s): generous, for sanitizer builds on slow machines; no test comes near it on its own. */
#define TC_TIMEOUT 120

/* The backend of this run: CUVMM_BACKEND=cuda gives CUDA, anything else (or unset) the host. */
enum cuvmm_backend tc_backend(void);
bool tc_on_host(void);

/* Create a context on this run's backend. cfg NULL: cuvmm_config_init() defaults. cfg->backend is overwritten. */
int tc_ctx_create(struct cuvmm_config *cfg, struct cuvmm_ctx **out);
/* The same, asserting success. */
struct cuvmm_ctx *tc_ctx(struct cuvmm_config *cfg);
/* cuvmm_config_init() with this run's backend. */
void tc_config(struct cuvmm_config *cfg);

/* main(): skip (exit 77) on the CUDA backend without a GPU, else run the suite; returns main's exit status. */
int tc_run(Suite *s);

/* OS accounting (host backend). Bytes of shared memory mapped into this process and resident (exact:
 * Pss_Shmem of /proc/self/smaps_rollup, else RssShmem of /proc/self/status); -1 if unreadable. */
int64_t tc_rss_shmem(void);
/* Bytes allocated in the library's physical chunks: the memfds named "cuvmm" open in this process. */
int64_t tc_memfd_bytes(void);

/* Statistics, asserting success. */
/* The device granularity of device 0, through the public API (a region reports it). */
size_t tc_granularity(struct cuvmm_ctx *ctx);
struct cuvmm_stats tc_ctx_stats(struct cuvmm_ctx *ctx);
struct cuvmm_stats tc_region_stats(struct cuvmm_region *r);
struct cuvmm_stats tc_pool_stats(struct cuvmm_pool *p);
/* On the host backend, assert that the memfds hold exactly the device's held_bytes. */
void tc_assert_os_matches(struct cuvmm_ctx *ctx);

/* A thread (pthread_create(..., tc_open_gate_later, &o)) that opens the host backend's gate after delay_ms:
 * the "GPU work" fencing pending unmaps completes then. `opened` is set just before it does. */
struct tc_opener {
	int delay_ms;
	volatile int opened;
};
void *tc_open_gate_later(void *arg);
/* Unmap whatever pending unmaps have become due (waiting for their fences), releasing no cached chunk. */
void tc_settle(struct cuvmm_ctx *ctx);
/* Poll device 0's held_bytes until it is <= bytes or timeout_ms passed; returns the last value seen. */
uint64_t tc_wait_held_le(struct cuvmm_ctx *ctx, uint64_t bytes, int timeout_ms);
void tc_sleep_ms(int ms);
uint64_t tc_now_ms(void);
uint64_t tc_now_us(void);

/*
 * "Kernels": n counts uint32_t words; word i of a buffer filled with v holds v ^ i.
 * Host backend: CPU loops, synchronous. CUDA backend: kernels; tc_fill and tc_check wait for completion,
 * tc_fill_async launches on stream and returns (iters: how many times the kernel rewrites the buffer).
 * Return 0 or a CUresult; tc_check returns the number of mismatching words, UINT64_MAX on a CUDA error.
 * Callable from any thread (they do not use ck_assert).
 */
int tc_fill(void *ptr, size_t n, uint32_t v);
uint64_t tc_check(const void *ptr, size_t n, uint32_t v);
int tc_fill_async(void *ptr, size_t n, uint32_t v, int iters, CUstream stream);
/* A stream for fenced unmaps: a real one on CUDA; on the host any non-NULL value works. */
int tc_stream_create(CUstream *stream);
void tc_stream_destroy(CUstream stream);
int tc_stream_sync(CUstream stream);

/* Log capture: a callback that keeps the last messages at or above `level`. Thread-safe. */
void tc_log_capture(enum cuvmm_log_level level);
void tc_log_release(void);
void tc_log_reset(void);
/* Messages captured at exactly `level` (or any level for -1) that contain `substr` (NULL: all). */
int tc_log_count(int level, const char *substr);

/* Run fn(arg) in a forked child with stderr captured into buf (NUL-terminated); returns fn's return value, the
 * child's exit status (or -1 if it did not exit normally). For what must start from a fresh process, such as
 * the once-read $CUVMM_LOG. fn must not use ck_assert. */
int tc_in_child(int (*fn)(void *), void *arg, char *buf, size_t bufsize);

/* Set or unset (value NULL) an environment variable, remembering the old value for tc_env_restore(). */
void tc_env_set(const char *name, const char *value);
void tc_env_restore(void);


/* A snapshot of a region's counters (when r is not NULL), its device's, and the OS's view of the host
 * chunks, for checking that a failed call left everything as it was. */
struct tc_snap {
	uint64_t r_reserved, r_mapped, r_held, r_live, d_mapped, d_held, d_live, d_reserved;
	int64_t memfd;
};
struct tc_snap tc_snap_take(struct cuvmm_ctx *ctx, struct cuvmm_region *r);
/* Assert that nothing changed between a and b: region and device mapped, live and reserved always; the
 * device's held bytes and the OS's memfd bytes too when `held` is set ("nothing it created stays held"). */
void tc_snap_expect_same(const struct tc_snap *a, const struct tc_snap *b, const char *what, bool held);

#endif /* TC_COMMON_H */
