/*
 * cuvmm: GPU memory through the CUDA driver's virtual memory management API.
 *
 * Copyright (c) 2026 The cuvmm authors. SPDX-License-Identifier: MIT
 *
 * This header is the specification. Conventions that hold for every function unless its own comment says
 * otherwise:
 *   - A function that can fail returns int: CUVMM_OK (0) or a negative CUVMM_E* code. Outputs go through
 *     pointer arguments, which are left untouched on failure, and a failed call leaves no partial state
 *     behind (nothing it mapped stays mapped, nothing it created stays held).
 *   - Destroy functions accept NULL.
 *   - Every function is thread-safe. Objects may be used from several threads at once.
 *   - When the driver refuses the library's own undo (a failed call's unmap of what it mapped), the library
 *     never hands out memory that faults and never loses track of a chunk: the chunk stays mapped where it
 *     was, without access, quarantined (counted in held_bytes and mapped_bytes, not live_bytes; never
 *     given to another object), its unmap is retried by later calls and the background pass, and a call
 *     that takes that range back grants access first (or fails, changing nothing). A release the driver
 *     refuses keeps its chunk cached and held, to be retried; device_limit_bytes still holds.
 *   - Device addresses are void * (as with cudaMalloc). Streams are CUstream (a cudaStream_t converts);
 *     NULL means "all work on the device" wherever a stream names the work to wait for.
 *   - Sizes are bytes.
 */
#ifndef CUVMM_H
#define CUVMM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/*
 * CUstream without the CUDA toolkit: the header declares the stream type exactly as cuda.h does (a pointer
 * to the opaque struct CUstream_st, which the runtime's cudaStream_t also points to), so a program that
 * only uses the host backend, or passes streams through, needs no cuda.h. Where cuda.h was included first
 * its typedef is used; where it comes later, it repeats the identical typedef (valid C11 and C++; in C99
 * cuda.h must be a system header anyway, as it is not -pedantic clean). Define CUVMM_INCLUDE_CUDA_H to
 * have this header include <cuda.h> itself.
 */
#if defined(CUVMM_INCLUDE_CUDA_H)
#include <cuda.h>
#endif
#if !defined(__cuda_cuda_h__) && !defined(CUVMM_CUSTREAM_DECLARED)
/** A CUDA stream, as cuda.h declares it (cudaStream_t converts). */
typedef struct CUstream_st *CUstream;
#endif
/** Defined once CUstream is declared (by cuda.h or by this header), so a wrapper need not declare it again. */
#define CUVMM_CUSTREAM_DECLARED 1

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define CUVMM_API __attribute__((visibility("default")))
#else
#define CUVMM_API
#endif

/**
 * @defgroup errors Errors and version
 * Error codes every failing function returns, their names and messages, the driver's last CUresult, and
 * the version of the header and of the library. See also @ref conventions.
 * @{
 */

/** X-macro list of error codes: name, value, message. The one list the enum and the strings come from. */
#define CUVMM_ERRNO_MAP(X)                                                                                   \
	X(OK, 0, "success")                                                                                  \
	X(EINVAL, -1, "invalid argument")                                                                    \
	X(ENOMEM, -2, "out of physical memory")                                                              \
	X(ENOSPC, -3, "no room left in the reserved address range")                                          \
	X(ENODRIVER, -4, "no CUDA driver could be loaded")                                                   \
	X(ENODEV, -5, "no such device, or it lacks virtual memory management")                               \
	X(ENOTSUP, -6, "not supported on this device, driver or backend")                                    \
	X(EBUSY, -7, "object still has live allocations or pending work")                                    \
	X(ESTATE, -8, "wrong state for this call")                                                           \
	X(EDRIVER, -9, "driver call failed")

/** Error codes. Every failing function returns one of these (negative). */
enum cuvmm_error {
#define CUVMM_ERR_ENUM_(name, value, msg) CUVMM_##name = value,
	CUVMM_ERRNO_MAP(CUVMM_ERR_ENUM_)
#undef CUVMM_ERR_ENUM_
};

/**
 * Describe an error code.
 * @param[in] err a CUVMM_* code (any int is accepted)
 * @return a static message such as "invalid argument"; "unknown error" for a code not in the list; never NULL
 */
CUVMM_API const char *cuvmm_strerror(int err);

/**
 * Name an error code.
 * @param[in] err a CUVMM_* code (any int is accepted)
 * @return a static string such as "CUVMM_EINVAL"; "CUVMM_E?" for a code not in the list; never NULL
 */
CUVMM_API const char *cuvmm_err_name(int err);

/**
 * The CUresult of the calling thread's last failing driver call.
 * @return the CUresult (an int), or 0 if no driver call failed on this thread yet
 */
CUVMM_API int cuvmm_last_driver_error(void);

/** Major version of this header: changes break the API or ABI. */
#define CUVMM_VERSION_MAJOR 0
/** Minor version of this header: additions. */
#define CUVMM_VERSION_MINOR 1
/** Patch version of this header: fixes. */
#define CUVMM_VERSION_PATCH 0
/** The version as one number for comparisons in the preprocessor: MAJOR * 10000 + MINOR * 100 + PATCH. */
#define CUVMM_VERSION_NUMBER (CUVMM_VERSION_MAJOR * 10000 + CUVMM_VERSION_MINOR * 100 + CUVMM_VERSION_PATCH)

/**
 * The library's version, the one it was built as (compare with the CUVMM_VERSION_* macros of the header a
 * program was compiled with).
 * @return a static string "MAJOR.MINOR.PATCH"
 */
CUVMM_API const char *cuvmm_version(void);

/** @} */

/**
 * @defgroup log Logging
 * Messages go to stderr, prefixed "cuvmm: ", at or above the level in $CUVMM_LOG (default warn), unless
 * the application installs its own callback.
 * @{
 */

/** Severity of a log message; a lower value is more severe. */
enum cuvmm_log_level {
	CUVMM_LOG_ERROR = 0, /**< the library could not do what it was asked */
	CUVMM_LOG_WARN = 1,  /**< something is off but the call went on (e.g. a malformed environment variable) */
	CUVMM_LOG_INFO = 2,  /**< driver loaded, context created, and each release decision: what a pool, kv object, device cache or sleep gave back and why (release delay, slack cap, trim, sleep) */
	CUVMM_LOG_DEBUG = 3, /**< also every driver call that fails or takes 1 ms or more, by name */
};

/**
 * A log sink.
 * @param[in] level severity of the message
 * @param[in] msg the message, without a trailing newline; valid only during the call
 * @param[in] user the pointer given to cuvmm_set_log_callback()
 */
typedef void (*cuvmm_log_fn)(enum cuvmm_log_level level, const char *msg, void *user);

/**
 * Route the library's messages to the application's logger. Process-wide.
 * @param[in] fn the sink; NULL restores the default (stderr)
 * @param[in] user passed to @p fn unchanged
 * @param[in] level messages less severe than this are dropped before @p fn is called
 */
CUVMM_API void cuvmm_set_log_callback(cuvmm_log_fn fn, void *user, enum cuvmm_log_level level);

/** @} */

/**
 * @defgroup ctx Context
 * The root object: a context owns the driver connection (or the host backend), the physical memory of
 * each device it touches, and the background thread that gives idle memory back.
 * @{
 */

/** Which implementation of the driver calls a context uses. */
enum cuvmm_backend {
	CUVMM_BACKEND_AUTO = 0, /**< $CUVMM_BACKEND if set, else CUDA; never falls back to the host silently */
	CUVMM_BACKEND_CUDA = 1, /**< the CUDA driver, loaded at run time */
	CUVMM_BACKEND_HOST = 2, /**< host memory with the same semantics, for tests and machines without a GPU */
};

/**
 * The longest release delay, in milliseconds (about 292 years): its nanoseconds must fit in an int64_t.
 * cuvmm_ctx_create() rejects a larger release_delay_ms with CUVMM_EINVAL.
 */
#define CUVMM_RELEASE_DELAY_MS_MAX INT64_C(9223372036854)

/** Context configuration. Initialise with cuvmm_config_init(), then change fields. */
struct cuvmm_config {
	size_t size;                 /**< sizeof(struct cuvmm_config), set by cuvmm_config_init() */
	enum cuvmm_backend backend;  /**< AUTO: $CUVMM_BACKEND if set, else CUDA */
	int64_t release_delay_ms;    /**< idle time before free physical memory is given back; -1 never, 0 at once, at most CUVMM_RELEASE_DELAY_MS_MAX; default 1000 */
	size_t retain_bytes;         /**< free physical memory kept per device anyway; default 0 */
	bool background_release;     /**< a thread gives memory back while the application is idle; default true */
	size_t device_limit_bytes;   /**< cap on physical memory held per device by this context, never exceeded; 0 = none */
	size_t host_granularity;     /**< host backend chunk size, a power of two >= the page size; default 2 MiB */
	int host_devices;            /**< devices the host backend emulates, 1 to 64 (0: 1); default 1 */
	uint64_t peer_access;        /**< devices given read/write access to the memory of every object besides its
	                                  own device (bit i: device i; CUVMM_PEERS_ALL: every device); default 0.
	                                  See @ref peers */
};

/** A peer_access mask naming every device of the context. */
#define CUVMM_PEERS_ALL UINT64_MAX

/**
 * Fill @p cfg with the defaults, then apply the CUVMM_* environment variables (CUVMM_BACKEND,
 * CUVMM_RELEASE_DELAY_MS, CUVMM_RETAIN_BYTES, CUVMM_DEVICE_LIMIT, CUVMM_BACKGROUND_RELEASE,
 * CUVMM_HOST_GRANULARITY, CUVMM_HOST_DEVICES (a count, 1 to 64), CUVMM_PEER_ACCESS (all or none: peer_access
 * CUVMM_PEERS_ALL or 0)). cuvmm_ctx_create() also reads CUVMM_PUBLISH (0/no/off/false: the context
 * publishes no counters for cuvmm-top) and CUVMM_PUBLISH_DIR (where it does; default /dev/shm), which
 * are no fields of this struct. Words are case-insensitive; sizes are digits with an optional K, M, G or T
 * suffix; an empty variable counts as unset. A value that is malformed or that the library cannot serve (a
 * host granularity that is not a power of two at least the page size, a device limit below one granule, a
 * delay above CUVMM_RELEASE_DELAY_MS_MAX) is ignored and reported as a warning naming the variable and what
 * was used instead, once per process for each value.
 * @param[out] cfg the configuration to fill; NULL is ignored
 */
CUVMM_API void cuvmm_config_init(struct cuvmm_config *cfg);

/** Opaque context. */
struct cuvmm_ctx;

/**
 * Create a context.
 * @param[in] cfg configuration; NULL: cuvmm_config_init() defaults. Its size field must be set.
 * @param[out] out the new context
 * @return CUVMM_OK; CUVMM_EINVAL for a NULL @p out or a bad field; CUVMM_ENODRIVER when the CUDA backend
 *         is asked for and no libcuda.so.1 can be loaded; CUVMM_ENODEV when the driver sees no device;
 *         CUVMM_ENOMEM when the host is out of memory; CUVMM_EDRIVER on another driver failure
 */
CUVMM_API int cuvmm_ctx_create(const struct cuvmm_config *cfg, struct cuvmm_ctx **out);

/**
 * Destroy a context: stops the background thread, waits for pending unmaps, gives every chunk back.
 * Objects still created on it (regions, pools, kv) are destroyed first, with a warning each.
 * Not thread-safe with respect to other calls on the same context or its objects.
 * @param[in] ctx the context; NULL is a no-op
 */
CUVMM_API void cuvmm_ctx_destroy(struct cuvmm_ctx *ctx);

/**
 * The backend a context runs on, AUTO resolved.
 * @param[in] ctx the context
 * @return CUVMM_BACKEND_CUDA or CUVMM_BACKEND_HOST; CUVMM_BACKEND_AUTO for a NULL @p ctx
 */
CUVMM_API enum cuvmm_backend cuvmm_ctx_backend(const struct cuvmm_ctx *ctx);

/**
 * Number of devices the context's backend sees (the host backend: host_devices, default one).
 * @param[in] ctx the context
 * @param[out] count the number of devices
 * @return CUVMM_OK, or CUVMM_EINVAL for a NULL argument
 */
CUVMM_API int cuvmm_ctx_device_count(const struct cuvmm_ctx *ctx, int *count);

/**
 * Give free physical memory back to the driver now, without waiting for the idle delay: every
 * pool's and kv object's free mapped memory is unmapped and every cached chunk released, beyond
 * @p keep_bytes per device. Waits for the GPU work that fences pending unmaps (never while holding a lock
 * an allocating thread needs).
 * @param[in] ctx the context
 * @param[in] device a device index, or -1 for all devices
 * @param[in] keep_bytes free physical memory to keep per device
 * @return CUVMM_OK; CUVMM_EINVAL for a NULL @p ctx or a device out of range; CUVMM_EDRIVER if a release
 *         failed (what could be released was)
 */
CUVMM_API int cuvmm_ctx_trim(struct cuvmm_ctx *ctx, int device, size_t keep_bytes);

/** @} */

/**
 * @defgroup peers Several devices: peer access
 * Memory that an object maps on its device is readable and writable from that device and from its peers:
 * the devices of the context's peer_access, or of the object's own peer_access (pool and kv configs; 0
 * there: the context's), plus the devices added with cuvmm_ctx_add_peer(). Every mapping grants them all
 * (pool, region, kv, a wake), in one cuMemSetAccess per range. Whether each peer can reach the device is
 * asked (cuDeviceCanAccessPeer) when an object is created: where one cannot, the creation fails with
 * CUVMM_ENOTSUP (cuvmm_last_driver_error(): CUDA_ERROR_PEER_ACCESS_UNSUPPORTED) and nothing is reserved.
 * Regions take the context's setting. Peer access needs no cuCtxEnablePeerAccess (that is for cudaMalloc
 * memory). Statistics, limits, idle release and cuvmm_ctx_trim() are per device, and a trim of one device
 * does not wait for another's GPU work.
 * @{
 */

/**
 * Can @p device access memory that lives on @p peer (cuDeviceCanAccessPeer)?
 * @param[in] ctx the context
 * @param[in] device the accessing device
 * @param[in] peer the device whose memory would be accessed (the same device: true)
 * @param[out] can the answer
 * @return CUVMM_OK; CUVMM_EINVAL for a NULL argument or a device out of range; CUVMM_EDRIVER if the query
 *         failed
 */
CUVMM_API int cuvmm_ctx_can_access_peer(struct cuvmm_ctx *ctx, int device, int peer, bool *can);

/**
 * Give @p peer read/write access to the memory on @p device: to what every object on @p device (region,
 * pool, kv) has mapped now, including memory whose unmap is pending, and to everything mapped there from
 * now on, by objects that exist and objects created later. Adding a peer twice, or @p device itself, does
 * nothing. Access is not taken back (a later peer_access of a new object narrower than this still grants
 * it).
 * @param[in] ctx the context
 * @param[in] device the device whose memory is to be reached
 * @param[in] peer the device to reach it
 * @return CUVMM_OK; CUVMM_EINVAL for a NULL @p ctx or a device out of range; CUVMM_ENOTSUP when @p peer
 *         cannot access @p device's memory (nothing changed); CUVMM_EDRIVER if a cuMemSetAccess failed:
 *         then the objects granted before the failure keep the access and the others do not; calling again
 *         completes it
 */
CUVMM_API int cuvmm_ctx_add_peer(struct cuvmm_ctx *ctx, int device, int peer);

/** @} */

/**
 * @defgroup stats Statistics
 * Counters of a device, region, pool or KV object: reserved, held, mapped and live bytes with their peaks,
 * and the driver calls made. The struct carries its size, so it can grow.
 * @{
 */

/**
 * Counters. Set size to sizeof(struct cuvmm_stats) before passing it in, so the struct can grow.
 * Each *_stats call returns one consistent snapshot, even while other threads (or the background pass)
 * map and unmap: mapped_bytes <= held_bytes <= peak_held_bytes, live_bytes <= peak_live_bytes, for a
 * device held_bytes <= device_limit_bytes (when set), and for a region, pool or kv object
 * live_bytes <= mapped_bytes (while it is awake), so that held - mapped never wraps around.
 */
struct cuvmm_stats {
	size_t size;                 /**< sizeof(struct cuvmm_stats), set by the caller */
	uint64_t reserved_bytes;     /**< virtual address space reserved */
	uint64_t held_bytes;         /**< physical memory obtained from the driver */
	uint64_t mapped_bytes;       /**< of which mapped into reserved ranges */
	uint64_t live_bytes;         /**< handed to callers and not yet freed */
	uint64_t peak_held_bytes;    /**< highest held_bytes seen */
	uint64_t peak_live_bytes;    /**< highest live_bytes seen */
	uint64_t create_calls;       /**< cuMemCreate calls so far */
	uint64_t release_calls;      /**< cuMemRelease calls so far */
	uint64_t map_calls;          /**< cuMemMap calls so far */
	uint64_t unmap_calls;        /**< cuMemUnmap calls so far */
	uint64_t driver_ns;          /**< time spent in those calls and in cuMemSetAccess */
};

/**
 * Statistics of one device of a context. held_bytes counts every chunk the context holds on the device,
 * mapped or cached for reuse; live_bytes sums the live bytes of every object on the device.
 * @param[in] ctx the context
 * @param[in] device a device index
 * @param[in,out] out statistics; out->size must be set
 * @return CUVMM_OK, or CUVMM_EINVAL for a NULL argument, a bad size or a device out of range
 */
CUVMM_API int cuvmm_ctx_stats(struct cuvmm_ctx *ctx, int device, struct cuvmm_stats *out);

/** @} */

/**
 * @defgroup region Regions: reserved address ranges mapped on demand
 * A region reserves max_bytes of address space on one device once; map, unmap and resize then back
 * parts of it with physical memory in chunks of the region's granularity, always at the same addresses.
 * @{
 */

/** Opaque region. */
struct cuvmm_region;

/**
 * Reserve a region.
 * @param[in] ctx the context
 * @param[in] device the device whose memory backs the region
 * @param[in] max_bytes address space to reserve; rounded up to the granularity
 * @param[out] out the new region
 * @return CUVMM_OK; CUVMM_EINVAL for a NULL argument or a zero or overflowing size; CUVMM_ENODEV for a
 *         device out of range or without VMM support; CUVMM_ENOSPC when the address space cannot be
 *         reserved; CUVMM_EDRIVER on another driver failure
 */
CUVMM_API int cuvmm_region_create(struct cuvmm_ctx *ctx, int device, size_t max_bytes, struct cuvmm_region **out);

/**
 * Reserve a region with a coarser unit of mapping. Every map and unmap then moves whole handles of
 * @p granularity bytes, and the driver's cost is per handle (about 40 us of cuMemSetAccess each on an
 * H200, whatever the size): a weights region mapped in 64 MiB units grows 32 times faster than in 2 MiB
 * units, at the price of giving memory back only in 64 MiB units.
 * @param[in] ctx the context
 * @param[in] device the device whose memory backs the region
 * @param[in] max_bytes address space to reserve; rounded up to @p granularity
 * @param[in] granularity the unit of mapping: a power of two, at least the device's granularity and at
 *            most 512 times it; 0: the device's granularity (as cuvmm_region_create())
 * @param[out] out the new region
 * @return as cuvmm_region_create(), and CUVMM_EINVAL for a bad @p granularity
 */
CUVMM_API int cuvmm_region_create_ex(struct cuvmm_ctx *ctx, int device, size_t max_bytes, size_t granularity,
				      struct cuvmm_region **out);

/**
 * Destroy a region: waits for pending unmaps, gives its chunks back to the device's cache, frees the
 * address space. The caller guarantees no GPU work still touches the region except the work that fences
 * its pending unmaps.
 * @param[in] r the region; NULL is a no-op
 */
CUVMM_API void cuvmm_region_destroy(struct cuvmm_region *r);

/**
 * @param[in] r the region
 * @return the first address of the region (a device pointer); NULL for a NULL @p r
 */
CUVMM_API void *cuvmm_region_base(const struct cuvmm_region *r);

/**
 * @param[in] r the region
 * @return the reserved size, max_bytes rounded up to the granularity; 0 for a NULL @p r
 */
CUVMM_API size_t cuvmm_region_size(const struct cuvmm_region *r);

/**
 * @param[in] r the region
 * @return the unit of mapping: the device's granularity (2 MiB on current GPUs) or the one given to
 *         cuvmm_region_create_ex(); 0 for a NULL @p r
 */
CUVMM_API size_t cuvmm_region_granularity(const struct cuvmm_region *r);

/**
 * The devices that get access to a region's mappings (@ref peers).
 * @param[in] r the region
 * @return bit i set: device i (the region's own device always); 0 for a NULL @p r
 */
CUVMM_API uint64_t cuvmm_region_peers(struct cuvmm_region *r);

/**
 * Back [offset, offset+len) with physical memory, readable and writable from the device. Parts already
 * mapped are left as they are, with their contents; a part whose unmap is still pending is kept mapped.
 * All or nothing: on failure nothing that was not mapped before is mapped, except a chunk whose undo the
 * driver refused: it stays mapped without access, quarantined (see the conventions at the top), and a
 * later map of its range grants access before taking it back.
 * @param[in] r the region
 * @param[in] offset a multiple of the granularity
 * @param[in] len a non-zero multiple of the granularity, offset+len <= the region's size
 * @return CUVMM_OK; CUVMM_EINVAL for bad arguments; CUVMM_ENOMEM when the device or device_limit_bytes
 *         is full; CUVMM_ESTATE when the region sleeps; CUVMM_EDRIVER on another driver failure
 */
CUVMM_API int cuvmm_region_map(struct cuvmm_region *r, size_t offset, size_t len);

/**
 * Stop backing [offset, offset+len) once the work queued on @p stream before this call has completed.
 * Does not wait for that work: the unmap is deferred behind an event and done by a later call or by
 * the background thread. Parts not mapped are ignored.
 * @param[in] r the region
 * @param[in] offset a multiple of the granularity
 * @param[in] len a non-zero multiple of the granularity, offset+len <= the region's size
 * @param[in] stream the work that may still touch the range; NULL: all work on the device (this
 *            synchronizes the device, as cudaFree does)
 * @return CUVMM_OK; CUVMM_EINVAL for bad arguments; CUVMM_ESTATE when the region sleeps; CUVMM_EDRIVER if
 *         the fence could not be recorded (then nothing changed)
 */
CUVMM_API int cuvmm_region_unmap(struct cuvmm_region *r, size_t offset, size_t len, CUstream stream);

/**
 * Make the mapped part exactly the prefix [0, round_up(bytes)): grow or shrink in place, keeping the
 * contents of the part that stays. Shrinking is fenced on @p stream as cuvmm_region_unmap().
 * @param[in] r the region
 * @param[in] bytes the new size, any byte count <= the region's size; 0 unmaps everything
 * @param[in] stream as for cuvmm_region_unmap()
 * @return as cuvmm_region_map() and cuvmm_region_unmap(); on failure the mapping is as before
 */
CUVMM_API int cuvmm_region_resize(struct cuvmm_region *r, size_t bytes, CUstream stream);

/**
 * Statistics of one region; live_bytes is what was mapped on request and not unmapped since.
 * @param[in] r the region
 * @param[in,out] out statistics; out->size must be set
 * @return CUVMM_OK, or CUVMM_EINVAL for a NULL argument or a bad size
 */
CUVMM_API int cuvmm_region_stats(struct cuvmm_region *r, struct cuvmm_stats *out);

/** @} */

/**
 * @defgroup pool Pools: malloc and free over reserved address space
 * A pool reserves address space once and hands out device memory from it. Physical memory is held only
 * where live allocations sit, plus free memory kept mapped for fast reuse (the slack); the slack is given
 * back once it has been free for release_delay_ms, and earlier where keeping it would raise held more than
 * a quarter above the pool's recent peak footprint. Allocations of up to a quarter of the granularity (512 KiB
 * on current GPUs) share granules (size classes with four steps per doubling); larger ones up to 32 granules
 * (64 MiB) are packed back to back at 512-byte alignment, so that they share granules with their neighbours
 * (a granule is held while a live byte sits on it); larger ones take whole granules of their own, and an
 * allocation may hold up to max(1, k/16) granules beyond its k, where it reuses memory mapped with large
 * handles.
 *
 * Memory is mapped with one handle per granule, except for allocations of 1 GiB or more (handles of about a
 * sixteenth of the allocation, up to 64 granules) and what a wake maps (cuvmm_pool_wake()). Each handle
 * costs its own driver calls when the memory goes back (about 40 us on an H200: 8 GiB in 2 MiB handles take
 * about 0.15 s to unmap and release), while a freed run of large handles can serve only allocations of
 * about its size. A pool whose large allocations stay large (weights loaded once) can ask for large handles
 * from a smaller size with cuvmm_pool_config.coarse_bytes; a pool of growing buffers (a KV cache) should not.
 * @{
 */

/** Pool configuration. Initialise with cuvmm_pool_config_init(), then change fields. */
struct cuvmm_pool_config {
	size_t size;       /**< sizeof(struct cuvmm_pool_config), set by cuvmm_pool_config_init() */
	int device;        /**< device whose memory the pool hands out; default 0 */
	size_t max_bytes;  /**< address space to reserve; 0: twice the device's memory (or device_limit_bytes) */
	const char *name;  /**< for statistics and logs, e.g. "weights", "kv", "activations"; copied, at most
	                        31 bytes of it (a longer name is cut); NULL: "pool" */
	uint64_t peer_access; /**< devices given access to the pool's memory (bit i: device i; the pool's own
	                           device always has it, so 1 << device means none other; CUVMM_PEERS_ALL: every
	                           device); 0: the context's peer_access (the default). See @ref peers */
	size_t coarse_bytes; /**< allocations of at least this many bytes (rounded up to a granule) take whole
	                          granules, mapped on handles as large as fit, up to 64 granules (128 MiB on
	                          current GPUs): they go back in few driver calls (trim, idle release, sleep) and
	                          the memory one frees is reused only by an allocation of about its size (up to
	                          a sixteenth smaller) until it is given back. For pools whose large allocations
	                          stay large. 0 (the default): only from 1 GiB up, with handles of about a
	                          sixteenth of the allocation. A config whose size is the offset of this field
	                          (built against an older header) is accepted, with 0. */
};

/**
 * Fill @p cfg with the defaults.
 * @param[out] cfg the configuration; NULL is ignored
 */
CUVMM_API void cuvmm_pool_config_init(struct cuvmm_pool_config *cfg);

/** Opaque pool. */
struct cuvmm_pool;

/**
 * Create a pool.
 * @param[in] ctx the context
 * @param[in] cfg configuration; NULL: defaults. Its size field must be set.
 * @param[out] out the new pool
 * @return CUVMM_OK; CUVMM_EINVAL for a NULL argument or a bad size field; CUVMM_ENODEV for a device out of
 *         range; CUVMM_ENOSPC when the address space cannot be reserved; CUVMM_ENOMEM when the host is out
 *         of memory; CUVMM_ENOTSUP when a device of peer_access cannot access the pool's device
 *         (@ref peers); CUVMM_EINVAL for a peer_access naming a device the context lacks
 */
CUVMM_API int cuvmm_pool_create(struct cuvmm_ctx *ctx, const struct cuvmm_pool_config *cfg, struct cuvmm_pool **out);

/**
 * Destroy a pool and give all its memory back. Allocations still live are freed with a warning.
 * Synchronises the device first, as memory freed without a stream may still be in use by the GPU.
 * Not thread-safe with respect to other calls on the same pool.
 * @param[in] pool the pool; NULL is a no-op
 */
CUVMM_API void cuvmm_pool_destroy(struct cuvmm_pool *pool);

/**
 * Allocate device memory, aligned to at least 256 bytes (above 512 KiB: 512 bytes; above 32 granules, 64 MiB
 * on the H200: to the granularity). Allocations above 512 KiB and up to 32 granules are packed: they share
 * granules with their neighbours, and a granule is given back once no live byte is on it.
 * Free memory of the pool is reused first (no driver call); new memory is mapped only when none fits.
 * Memory freed with cuvmm_free_async() is reused here only once its freeing work has completed.
 * @param[in] pool the pool
 * @param[in] bytes size; 0 is invalid
 * @param[out] ptr the device address
 * @return CUVMM_OK; CUVMM_EINVAL for a NULL argument or a zero size; CUVMM_ENOMEM when the device or
 *         device_limit_bytes is full; CUVMM_ENOSPC when the pool's address space has no room (any size
 *         above it, SIZE_MAX included); CUVMM_ESTATE when the pool sleeps, or was put to sleep while this
 *         call waited for the device; CUVMM_EDRIVER on another driver failure
 */
CUVMM_API int cuvmm_malloc(struct cuvmm_pool *pool, size_t bytes, void **ptr);

/**
 * Free memory from cuvmm_malloc() or cuvmm_malloc_async(). Like cudaFree, the caller will not touch the
 * memory again, and the memory may be handed out again at once by a later allocation; the library never
 * unmaps it before a device synchronisation that started after this call has completed.
 * @param[in] pool the pool
 * @param[in] ptr the address; NULL is a no-op
 * @return CUVMM_OK; CUVMM_EINVAL for a NULL pool or a pointer that is not a live allocation of this pool
 *         (double free included); CUVMM_ESTATE when the pool sleeps
 */
CUVMM_API int cuvmm_free(struct cuvmm_pool *pool, void *ptr);

/**
 * Allocate in stream order, as cudaMallocAsync: memory freed on @p stream is reusable at once, memory
 * freed on other streams once the freeing work has completed (checked with events, never by waiting).
 * Packed allocations (cuvmm_malloc()) freed on @p stream are taken at once by allocations of the same size
 * rounded up to 512 bytes; by other sizes once the freeing work has completed.
 * @param[in] pool the pool
 * @param[in] bytes size; 0 is invalid
 * @param[in] stream the stream the memory will be used on
 * @param[out] ptr the device address
 * @return as cuvmm_malloc()
 */
CUVMM_API int cuvmm_malloc_async(struct cuvmm_pool *pool, size_t bytes, CUstream stream, void **ptr);

/**
 * Free in stream order, as cudaFreeAsync: the memory is reusable at once by allocations on @p stream, by
 * other streams and for unmapping once the work queued on @p stream before this call has completed.
 * @param[in] pool the pool
 * @param[in] ptr the address; NULL is a no-op
 * @param[in] stream the stream whose work may still use the memory; NULL behaves as cuvmm_free()
 * @return as cuvmm_free(), and CUVMM_EDRIVER if the fence could not be recorded (then nothing changed)
 */
CUVMM_API int cuvmm_free_async(struct cuvmm_pool *pool, void *ptr, CUstream stream);

/**
 * Give the pool's free memory back now, keeping about @p keep_bytes of free memory in all: free memory
 * stays mapped in the pool in whole runs up to @p keep_bytes, and the device's cached chunks are released
 * beyond what that leaves of @p keep_bytes. Synchronises the device first, and unmaps a few runs at a time,
 * without holding the pool's lock: other threads allocate and free meanwhile (an allocation that must map
 * waits for one batch of unmaps at most). What was free when the trim began goes back; memory freed by
 * other threads meanwhile stays for the next trim or the release delay. A refused unmap is retried once
 * before it returns, and then by later passes. The pinned host copy kept for the pool's next sleep (cuvmm_pool_wake(), cuvmm_pool_sleep_prepare())
 * is given back too.
 * @param[in] pool the pool
 * @param[in] keep_bytes free memory to keep mapped
 * @return CUVMM_OK; CUVMM_EINVAL for a NULL pool; CUVMM_ESTATE while it sleeps (cuvmm_ctx_trim() still gives
 *         back a host copy kept for its next sleep)
 */
CUVMM_API int cuvmm_pool_trim(struct cuvmm_pool *pool, size_t keep_bytes);

/**
 * Statistics of one pool: reserved is its address space, held and mapped the physical memory mapped in
 * it (live allocations and free memory kept for reuse), live the bytes handed out (small allocations
 * count their size class).
 * @param[in] pool the pool
 * @param[in,out] out statistics; out->size must be set
 * @return CUVMM_OK, or CUVMM_EINVAL for a NULL argument or a bad size
 */
CUVMM_API int cuvmm_pool_stats(struct cuvmm_pool *pool, struct cuvmm_stats *out);

/** @} */

/**
 * @defgroup kv KV blocks: a paged-attention KV cache with page-aware mapping
 * A set of parallel tensors that share block ids, such as K and V of every layer (`tensors` of them), each
 * in its own reserved range; block b of tensor t lives at cuvmm_kv_tensor(kv, t) + b * block_bytes. A
 * block id is backed in every tensor at once, and physical memory is mapped page by page (one granule of
 * every tensor) only where blocks are in use.
 * Allocation fills free blocks on the fullest mapped pages first, so holes are reused and sparse pages
 * empty out; a page whose blocks are all free is given back after the idle delay (or by cuvmm_ctx_trim()).
 * While allocation is active, a background pass keeps a couple of empty pages mapped ahead of demand, so
 * that backing a new page (one map per tensor) rarely happens on the allocating thread.
 * @{
 */

/** KV configuration. Initialise with cuvmm_kv_config_init(), then set the fields. */
struct cuvmm_kv_config {
	size_t size;          /**< sizeof(struct cuvmm_kv_config), set by cuvmm_kv_config_init() */
	int device;           /**< device; default 0 */
	size_t block_bytes;   /**< bytes of one block in one tensor; any size (blocks may straddle pages) */
	uint32_t max_blocks;  /**< block ids are 0 .. max_blocks-1 */
	uint32_t tensors;     /**< tensors that share block ids, e.g. 2 * layers for K and V; 1 to 65536; default 1 */
	uint64_t peer_access; /**< devices given access to the blocks, as cuvmm_pool_config's; 0: the context's */
};

/**
 * Fill @p cfg with the defaults (block_bytes and max_blocks 0: the caller must set them).
 * @param[out] cfg the configuration; NULL is ignored
 */
CUVMM_API void cuvmm_kv_config_init(struct cuvmm_kv_config *cfg);

/** Opaque KV block allocator. */
struct cuvmm_kv;

/**
 * Create a KV block allocator: reserves max_blocks * block_bytes (rounded up to the granularity) per
 * tensor; maps nothing yet.
 * @param[in] ctx the context
 * @param[in] cfg configuration; its size field must be set
 * @param[out] out the new object
 * @return CUVMM_OK; CUVMM_EINVAL for a NULL argument, a zero field, more than 65536 tensors or an
 *         overflowing size (block_bytes x max_blocks x tensors); CUVMM_ENODEV for a device out of range;
 *         CUVMM_ENOSPC when the address space cannot be reserved; CUVMM_ENOTSUP, or CUVMM_EINVAL, for a
 *         peer_access as cuvmm_pool_create()
 */
CUVMM_API int cuvmm_kv_create(struct cuvmm_ctx *ctx, const struct cuvmm_kv_config *cfg, struct cuvmm_kv **out);

/**
 * Destroy: synchronises the device (blocks freed without a stream may still be read), then gives every
 * page back. Not thread-safe with respect to other calls on the same object.
 * @param[in] kv the object; NULL is a no-op
 */
CUVMM_API void cuvmm_kv_destroy(struct cuvmm_kv *kv);

/**
 * @param[in] kv the object
 * @param[in] tensor a tensor index
 * @return the device address of block 0 of the tensor; NULL for a NULL @p kv or an index out of range
 */
CUVMM_API void *cuvmm_kv_tensor(const struct cuvmm_kv *kv, uint32_t tensor);

/**
 * Allocate @p n block ids, all or nothing, backing them in every tensor. Ids freed earlier may come back at
 * once (as with a server's own block table: ordering its GPU work is the caller's job).
 * @param[in] kv the object
 * @param[in] n how many blocks; 0 is invalid
 * @param[out] ids array of @p n ids, written only on success
 * @return CUVMM_OK; CUVMM_EINVAL for a NULL argument or n == 0; CUVMM_ENOSPC when fewer than @p n ids are
 *         free; CUVMM_ENOMEM when the device or device_limit_bytes is full; CUVMM_EDRIVER on another
 *         driver failure. On failure nothing is allocated and nothing this call mapped stays mapped.
 */
CUVMM_API int cuvmm_kv_alloc(struct cuvmm_kv *kv, uint32_t n, uint32_t *ids);

/**
 * Free @p n block ids. Their pages are unmapped only after the work queued on @p stream before this call
 * has completed (NULL: after a device synchronisation, which the background pass performs).
 * @param[in] kv the object
 * @param[in] n how many; 0 is invalid
 * @param[in] ids the ids; every one must be allocated and appear once, else nothing is freed
 * @param[in] stream the work that may still read or write the blocks
 * @return CUVMM_OK; CUVMM_EINVAL for a NULL argument, n == 0, or a bad list; CUVMM_EDRIVER if the fence
 *         could not be recorded, CUVMM_ENOMEM without memory for it (then nothing changed)
 */
CUVMM_API int cuvmm_kv_free(struct cuvmm_kv *kv, uint32_t n, const uint32_t *ids, CUstream stream);

/** One proposed block move of cuvmm_kv_compact(). */
struct cuvmm_kv_move {
	uint32_t from; /**< a block in use on a sparse page */
	uint32_t to;   /**< a block on a fuller page, allocated for the caller by cuvmm_kv_compact() */
};

/**
 * Propose block moves that would empty the sparsest pages. Pages are drained whole, sparsest first, into
 * free blocks of fuller, mapped pages (no page is mapped for it). The destination blocks are allocated
 * by this call. To apply the plan: copy each `from` block to its `to` block in every tensor, update the
 * block tables, then cuvmm_kv_free() the `from` blocks on the stream of the copies; the drained pages
 * are given back after the idle delay. To drop the plan instead, cuvmm_kv_free() the `to` blocks.
 * @param[in] kv the object
 * @param[in] max_moves room in @p moves; only whole pages are drained, so fewer may be proposed
 * @param[out] moves the moves
 * @param[out] n_moves how many were written
 * @return CUVMM_OK; CUVMM_EINVAL for a NULL argument; CUVMM_ENOMEM when the host is out of memory
 */
CUVMM_API int cuvmm_kv_compact(struct cuvmm_kv *kv, uint32_t max_moves, struct cuvmm_kv_move *moves,
			       uint32_t *n_moves);

/**
 * Statistics summed over the tensors: live is allocated blocks x block_bytes x tensors.
 * @param[in] kv the object
 * @param[in,out] out statistics; out->size must be set
 * @return CUVMM_OK, or CUVMM_EINVAL for a NULL argument or a bad size
 */
CUVMM_API int cuvmm_kv_stats(struct cuvmm_kv *kv, struct cuvmm_stats *out);

/** @} */

/**
 * @defgroup sleep Sleep and wake
 * Give all physical memory of a region or pool back while keeping its addresses reserved, so pointers,
 * and CUDA graphs captured on them, stay valid; wake maps the same addresses again. While an object
 * sleeps, calls on it other than wake, stats and destroy fail with CUVMM_ESTATE; its live_bytes keep
 * counting what wake will bring back, its held and mapped bytes are 0.
 * @{
 */

/** What happens to the contents. */
enum cuvmm_sleep_mode {
	CUVMM_SLEEP_OFFLOAD = 0, /**< copy the mapped contents to pinned host memory first; wake restores them */
	CUVMM_SLEEP_DISCARD = 1, /**< drop the contents; after wake they are unspecified */
};

/**
 * Put a region to sleep: (OFFLOAD) copy its mapped contents to pinned host memory, then unmap them and
 * release their physical memory to the driver. Returns when the memory has been given back.
 * On failure the region is awake and intact. A double fault (an unmap refused, then the map that would
 * undo it refused too) cannot be undone: the sleep then completes instead and returns CUVMM_OK (the
 * contents are in the host copy), and chunks whose unmap is refused stay quarantined at their addresses
 * (counted in held and mapped, without access) until a later pass unmaps them or the wake takes them
 * back. (The same holds when the device fails the copies after some chunks were unmapped behind them
 * and mapping those back is refused; if the copies cannot be completed then, the context is lost and an
 * error is logged: contents not copied are lost.)
 * @param[in] r the region
 * @param[in] mode OFFLOAD or DISCARD
 * @param[in] stream the work that must complete before the contents are copied or dropped; NULL: all
 *            work on the device (this synchronises the device)
 * @return CUVMM_OK; CUVMM_EINVAL for a NULL region or an unknown mode; CUVMM_ESTATE if it sleeps already;
 *         CUVMM_ENOMEM if no pinned host memory could be had (or it would pass $CUVMM_SLEEP_HOST_LIMIT);
 *         CUVMM_EDRIVER if a copy, an unmap or the pinning of the host copy failed
 */
CUVMM_API int cuvmm_region_sleep(struct cuvmm_region *r, enum cuvmm_sleep_mode mode, CUstream stream);

/**
 * Wake a sleeping region: map the same ranges at the same addresses and, after OFFLOAD, copy the contents
 * back. Returns when the contents are in place. The pinned host buffer is kept for the next sleep
 * (pinning GiBs takes seconds where the copy takes milliseconds); cuvmm_ctx_trim(), cuvmm_pool_trim() and
 * destroy give it back. On failure the region stays asleep with its host copy
 * intact, so wake can be called again; it is never half awake. If the driver also refuses to unmap what
 * the failed wake had mapped, those chunks stay at their addresses, quarantined (counted in held and
 * mapped, never handed to another object), and the next wake takes them back.
 * @param[in] r the region
 * @param[in] stream work on it is ordered after the restore; NULL: the legacy default stream
 * @return CUVMM_OK; CUVMM_EINVAL for a NULL region; CUVMM_ESTATE if it is awake; CUVMM_ENOMEM when the
 *         device or device_limit_bytes is full; CUVMM_EDRIVER on another driver failure
 */
CUVMM_API int cuvmm_region_wake(struct cuvmm_region *r, CUstream stream);

/**
 * Pin the host copy of a region's next OFFLOAD sleep now, so that the sleep runs at the speed of the copy.
 * A first sleep must otherwise pin fresh host memory, and the kernel's first touch of that memory bounds it
 * (about 0.35 s for 8 GiB with 16 threads on an H200 machine, where the copy takes 0.16 s). Pinning runs as
 * a sleep's does ($CUVMM_PIN_THREADS threads, under $CUVMM_SLEEP_HOST_LIMIT) without the region's lock, so
 * the region stays usable meanwhile; the calling thread waits for it. The copy is kept as a wake keeps one:
 * until a sleep uses it (and its wake keeps it again), or cuvmm_ctx_trim(), cuvmm_region_destroy() give it
 * back. A copy already kept that is at least @p bytes is kept as it is; a smaller one is replaced.
 * A sleep that finds the copy too small (the region grew) pins a new one, as without this call. While a
 * larger copy replaces a smaller one, both count against $CUVMM_SLEEP_HOST_LIMIT.
 * @param[in] r the region
 * @param[in] bytes size of the host copy, at most the region's size; 0: what the region maps now
 * @return CUVMM_OK; CUVMM_EINVAL for a NULL region or @p bytes above its size; CUVMM_ESTATE if it sleeps (or was put to sleep
 *         meanwhile); CUVMM_ENOMEM if the host memory cannot be had (or would pass $CUVMM_SLEEP_HOST_LIMIT);
 *         CUVMM_EDRIVER if the pinning failed. On failure no new copy is kept.
 */
CUVMM_API int cuvmm_region_sleep_prepare(struct cuvmm_region *r, size_t bytes);

/**
 * Put a pool to sleep: its free memory is given back, and its allocations are treated as a region's
 * mapped contents (copied with OFFLOAD). Synchronises the device first, since memory freed without a
 * stream may still be in use. Pointers stay valid for after wake.
 * @param[in] pool the pool
 * @param[in] mode OFFLOAD or DISCARD
 * @param[in] stream as for cuvmm_region_sleep()
 * @return as cuvmm_region_sleep()
 */
CUVMM_API int cuvmm_pool_sleep(struct cuvmm_pool *pool, enum cuvmm_sleep_mode mode, CUstream stream);

/**
 * Wake a sleeping pool: every allocation is mapped again at its address (with its contents after
 * OFFLOAD). On failure the pool stays asleep and intact. A pool that sleeps holds long-lived memory such as
 * weights, and the driver's cost of this wake and of every later sleep is per handle, so each allocation of
 * 32 granules (64 MiB on current GPUs) or more comes back on handles as large as fit inside it (powers of
 * two up to 128 MiB) instead of one per granule. Packed allocations (above the slab limit, up to 32
 * granules: most tensors of a model) come back on handles of up to 32 granules across back-to-back
 * allocations. Such a handle goes back to the driver only once none of its granules holds a live byte;
 * until then its empty granules are where new packed allocations go first, before any new memory.
 * @param[in] pool the pool
 * @param[in] stream as for cuvmm_region_wake()
 * @return as cuvmm_region_wake()
 */
CUVMM_API int cuvmm_pool_wake(struct cuvmm_pool *pool, CUstream stream);

/**
 * Pin the host copy of a pool's next OFFLOAD sleep now: cuvmm_region_sleep_prepare() for a pool (allocating
 * and freeing go on meanwhile). cuvmm_pool_trim() gives the copy back too.
 * @param[in] pool the pool
 * @param[in] bytes size of the host copy, at most the pool's reserved size; 0: what a sleep would copy now
 *            (the pool's mapped memory less its free memory)
 * @return as cuvmm_region_sleep_prepare()
 */
CUVMM_API int cuvmm_pool_sleep_prepare(struct cuvmm_pool *pool, size_t bytes);

/** @} */

/**
 * @defgroup capture CUDA graph capture
 * Pools serve cuvmm_malloc_async() and cuvmm_free_async() on a stream that is being captured into a CUDA
 * graph (cuStreamBeginCapture, in any capture mode), and no call of the library, from any thread or from its
 * background thread, invalidates a capture: every driver call runs in relaxed capture mode, no event is
 * recorded and nothing copied on a capturing stream, and the device is not synchronised while a capture the
 * library has seen is under way (work that needs the synchronisation, such as unmapping memory freed without
 * a stream, waits for the capture to end; sleep with a NULL stream returns CUVMM_EBUSY meanwhile, and trims
 * give back only what needs no synchronisation).
 *
 * A captured kernel touches the same addresses at every replay, so the memory of a capture belongs to a
 * **graph pool**: what allocations on the capturing stream got, and what was freed on it during the capture
 * (the graph still uses it). That memory is never handed to work outside the graph pool, never unmapped and
 * never given back, until cuvmm_graph_release(). Inside the graph pool it is reused: by later allocations of
 * the same capture on the same stream (stream order holds inside a graph), and by later captures into the same
 * graph pool (graphs that share a pool must be replayed in the order they were captured, as with PyTorch's
 * graph_pool_handle()). A graph pool is named by the id of the capture that created it (the id
 * cuStreamGetCaptureInfo reports); cuvmm_capture_pool() makes a capture join an earlier one's pool.
 *
 * cuvmm_region_unmap(), cuvmm_region_resize(), cuvmm_kv_free(), sleep and wake on a capturing stream return
 * CUVMM_ENOTSUP: their work must run now, not at replay.
 *
 * The library asks a stream it saw capturing whether the capture is still under way (cuStreamGetCaptureInfo)
 * until it sees it ended: keep such a stream alive until the capture's graph pool is released (PyTorch's
 * streams live as long as the process).
 * @{
 */

/**
 * Tell the library about a capture under way on @p stream, and name its graph pool. Optional: the first
 * allocation or free on a capturing stream does the same with @p share 0. Calling it right after
 * cuStreamBeginCapture also keeps the library from synchronising the device during a capture that never
 * allocates from it.
 * @param[in] ctx the context
 * @param[in] device the device of @p stream
 * @param[in] stream a stream being captured
 * @param[in] share 0: the capture keeps its own graph pool; else the id of a graph pool that is not released,
 *            which the capture joins (with whatever it allocated already)
 * @param[out] graph_pool the id of the capture's graph pool
 * @return CUVMM_OK; CUVMM_EINVAL for a NULL argument or an unknown @p share; CUVMM_ESTATE when @p stream is
 *         not being captured; CUVMM_ENODEV for a bad @p device; CUVMM_ENOMEM when the host is out of memory
 */
CUVMM_API int cuvmm_capture_pool(struct cuvmm_ctx *ctx, int device, CUstream stream, uint64_t share,
				 uint64_t *graph_pool);

/**
 * The graphs of a graph pool are destroyed: its memory returns to general use. Allocations of the pool still
 * live become ordinary allocations (freed as usual later); the free ones are freed as by cuvmm_free(), so
 * they may be handed out again at once and are unmapped only after a device synchronisation. Release a graph
 * pool once the launches of its graphs have completed (cuGraphExecDestroy does not wait for them).
 * @param[in] ctx the context
 * @param[in] graph_pool the id from cuvmm_capture_pool() or the capture's id
 * @return CUVMM_OK; CUVMM_EINVAL for a NULL @p ctx or an unknown id (released already, or never used);
 *         CUVMM_EBUSY while a capture into the pool is still under way (nothing changes)
 */
CUVMM_API int cuvmm_graph_release(struct cuvmm_ctx *ctx, uint64_t graph_pool);

/** @} */

/**
 * @defgroup torch PyTorch allocator entry points
 * What python/cuvmm/torch installs as PyTorch's CUDA allocator (torch.cuda.memory.CUDAPluggableAllocator,
 * which takes a shared library and the names of a malloc and a free function; nothing here links to
 * libtorch). One process-wide context; one pool per (name, device), created on first use; each thread's
 * allocations go to the pool it chose with cuvmm_torch_use_pool(), the default pool ("torch") otherwise.
 * Stream 0, PyTorch's default stream, is the legacy default stream here (stream-ordered, not "the device").
 * @{
 */

/** PyTorch's view of one device: what torch.cuda.memory_stats() reports, from cuvmm's counters. */
struct cuvmm_torch_stats {
	size_t size;                    /**< sizeof(struct cuvmm_torch_stats), set by the caller */
	uint64_t allocated_bytes;       /**< bytes PyTorch holds in tensors (as it asked for them) */
	uint64_t peak_allocated_bytes;  /**< highest allocated_bytes since the last cuvmm_torch_reset_peak() */
	uint64_t allocated_bytes_total; /**< bytes ever allocated (since cuvmm_torch_reset_totals()) */
	uint64_t freed_bytes_total;     /**< bytes ever freed (likewise) */
	uint64_t allocations;           /**< live allocations */
	uint64_t peak_allocations;      /**< highest allocations since the last reset of peaks */
	uint64_t allocation_count;      /**< allocations ever made (since cuvmm_torch_reset_totals()) */
	uint64_t free_count;            /**< frees ever made (likewise) */
	uint64_t reserved_bytes;        /**< physical memory the context holds on the device (held_bytes) */
	uint64_t peak_reserved_bytes;   /**< highest reserved_bytes seen since the last reset of peaks */
	uint64_t mapped_bytes;          /**< of reserved, mapped into pools */
	uint64_t create_calls;          /**< cuMemCreate calls on the device (PyTorch's num_device_alloc) */
	uint64_t release_calls;         /**< cuMemRelease calls on the device (num_device_free) */
	uint64_t ooms;                  /**< allocations that failed for want of memory */
};

/**
 * Create the process-wide context of the PyTorch integration (else the first allocation creates one with
 * cuvmm_config_init() defaults).
 * @param[in] cfg configuration; NULL: defaults and CUVMM_* environment variables
 * @return CUVMM_OK; CUVMM_ESTATE if the context exists already; as cuvmm_ctx_create() otherwise
 */
CUVMM_API int cuvmm_torch_init(const struct cuvmm_config *cfg);

/**
 * @return the PyTorch integration's context, or NULL before cuvmm_torch_init() or the first allocation
 */
CUVMM_API struct cuvmm_ctx *cuvmm_torch_ctx(void);

/**
 * PyTorch's malloc (CUDAPluggableAllocator's alloc_fn): stream-ordered on @p stream, from the calling
 * thread's pool. When the device is full, the context's cached memory is given back and the allocation tried
 * once more. PyTorch cannot be told why an allocation failed: the reason is logged as an error.
 * @param[in] size bytes; 0 gives NULL
 * @param[in] device the CUDA device
 * @param[in] stream a cudaStream_t; 0 is the legacy default stream
 * @return the device address, or NULL on failure
 */
CUVMM_API void *cuvmm_torch_malloc(size_t size, int device, void *stream);

/**
 * PyTorch's free (CUDAPluggableAllocator's free_fn), in stream order on the allocation's stream and after the
 * work of every stream given to cuvmm_torch_record_stream() for it. Errors are logged.
 * @param[in] ptr the address; NULL is a no-op
 * @param[in] size the size it was allocated with
 * @param[in] device its device
 * @param[in] stream the stream it was allocated on
 */
CUVMM_API void cuvmm_torch_free(void *ptr, size_t size, int device, void *stream);

/**
 * Tensor.record_stream: the allocation at @p ptr is also used on @p stream, so its free waits for the work
 * queued there before the free.
 * @param[in] ptr an address from cuvmm_torch_malloc() (the start of the allocation)
 * @param[in] stream a cudaStream_t; 0 is the legacy default stream
 * @return CUVMM_OK; CUVMM_EINVAL if no pool of the integration holds @p ptr; CUVMM_ENOMEM
 */
CUVMM_API int cuvmm_torch_record_stream(void *ptr, void *stream);

/**
 * Send the calling thread's later allocations to the pool named @p name (one per device, created on first
 * use).
 * @param[in] name up to 31 bytes; NULL, "" or "torch" (its own name): the default pool. A name is taken
 *            when a call first names it (this one, cuvmm_torch_pool_configure() or cuvmm_torch_pool()) and
 *            stays taken; up to 15 besides the default
 * @return CUVMM_OK; CUVMM_EINVAL for a name too long; CUVMM_ENOSPC when 15 names are in use already
 */
CUVMM_API int cuvmm_torch_use_pool(const char *name);

/**
 * Configure the pools named @p name before their first use: each one created later (one per device) takes
 * @p cfg's max_bytes, peer_access and coarse_bytes, e.g. coarse_bytes for a pool that holds a model's
 * weights, so that its sleep and trim make few driver calls. Errors in those values show when a pool is
 * created (cuvmm_torch_pool() returns them; an allocation gets NULL and logs them).
 * @param[in] name as for cuvmm_torch_use_pool()
 * @param[in] cfg the configuration, its size field set (cuvmm_pool_config_init()); its device and name are
 *            ignored. Copied: a later call replaces it
 * @return CUVMM_OK; CUVMM_EINVAL for a NULL @p cfg, a bad size field or a name too long; CUVMM_ESTATE when a
 *         pool of @p name exists already, on any device (nothing changes); CUVMM_ENOSPC when 15 names are
 *         in use already
 */
CUVMM_API int cuvmm_torch_pool_configure(const char *name, const struct cuvmm_pool_config *cfg);

/**
 * The pool of @p name on @p device, created if needed (for its statistics, sleep and wake).
 * @param[in] name as for cuvmm_torch_use_pool()
 * @param[in] device the device
 * @param[out] out the pool, owned by the integration: never destroy it
 * @return CUVMM_OK; CUVMM_EINVAL for a bad argument or a name too long; CUVMM_ENODEV for a device the
 *         context lacks (the name is not taken then); CUVMM_ENOSPC when 15 names are in use already; as
 *         cuvmm_ctx_create() when it creates the integration's context; as cuvmm_pool_create() otherwise
 */
CUVMM_API int cuvmm_torch_pool(const char *name, int device, struct cuvmm_pool **out);

/**
 * PyTorch's view of one device's memory.
 * @param[in] device the device
 * @param[in,out] out statistics; out->size must be set
 * @return CUVMM_OK, or CUVMM_EINVAL for a bad argument
 */
CUVMM_API int cuvmm_torch_stats(int device, struct cuvmm_torch_stats *out);

/**
 * torch.cuda.reset_peak_memory_stats(): peaks start again from the current values.
 * @param[in] device the device
 * @return CUVMM_OK, or CUVMM_EINVAL for a bad device
 */
CUVMM_API int cuvmm_torch_reset_peak(int device);

/**
 * torch.cuda.reset_accumulated_memory_stats(): the totals and counts start again from 0.
 * @param[in] device the device
 * @return CUVMM_OK, or CUVMM_EINVAL for a bad device
 */
CUVMM_API int cuvmm_torch_reset_totals(int device);

/** @} */

/**
 * @defgroup fault Fault injection
 * Make chosen driver calls fail, to test error paths (the library's own and the application's). Works on
 * both backends: a failing call is not passed to the driver at all.
 * @{
 */

/** X-macro list of the driver calls that can be made to fail: name, the driver function. The one list the
 * enum and cuvmm_call_name() come from. */
#define CUVMM_CALL_LIST(X)                                                                                   \
	X(RESERVE, "cuMemAddressReserve")                                                                    \
	X(UNRESERVE, "cuMemAddressFree")                                                                     \
	X(CREATE, "cuMemCreate")                                                                             \
	X(RELEASE, "cuMemRelease")                                                                           \
	X(MAP, "cuMemMap")                                                                                   \
	X(UNMAP, "cuMemUnmap")                                                                               \
	X(SET_ACCESS, "cuMemSetAccess")                                                                      \
	X(EVENT_CREATE, "cuEventCreate")                                                                     \
	X(EVENT_RECORD, "cuEventRecord")                                                                     \
	X(EVENT_QUERY, "cuEventQuery")                                                                       \
	X(EVENT_SYNC, "cuEventSynchronize")                                                                  \
	X(DEVICE_SYNC, "cuCtxSynchronize")                                                                   \
	X(STREAM_WAIT, "cuStreamWaitEvent")                                                                  \
	X(HOST_REGISTER, "cuMemHostRegister")                                                                \
	X(COPY, "cuMemcpyAsync")                                                                             \
	X(CAPTURE_INFO, "cuStreamGetCaptureInfo")                                                            \
	X(PEER_QUERY, "cuDeviceCanAccessPeer")

/** The driver calls that can be made to fail (CUVMM_CALL_LIST): CUVMM_CALL_RESERVE (cuMemAddressReserve),
 * ..., CUVMM_CALL_HOST_REGISTER (the pinning of a sleep's host copy, piece by piece), CUVMM_CALL_COPY (the
 * copies of sleep and wake), CUVMM_CALL_CAPTURE_INFO (is a stream being captured into a CUDA graph?), CUVMM_CALL_PEER_QUERY (can one
 * device access another's memory? asked when an object with peers is created or a peer added). */
enum cuvmm_call {
#define CUVMM_CALL_ENUM_(name, fn) CUVMM_CALL_##name,
	CUVMM_CALL_LIST(CUVMM_CALL_ENUM_)
#undef CUVMM_CALL_ENUM_
	CUVMM_CALL_COUNT_ /**< number of calls; not a call */
};

/**
 * Name the driver function behind a call kind.
 * @param[in] call a call kind (any value is accepted)
 * @return a static string such as "cuMemMap"; "?" for a value that is not a call; never NULL
 */
CUVMM_API const char *cuvmm_call_name(enum cuvmm_call call);

/**
 * Make calls of one kind fail: the next @p skip calls of @p call on this context succeed, then @p count
 * calls fail with @p err, then calls succeed again. Replaces an earlier setting for the same call.
 * @param[in] ctx the context
 * @param[in] call which driver call
 * @param[in] skip calls to let through first
 * @param[in] count calls to fail; 0 cancels; UINT32_MAX fails every call from then on
 * @param[in] err CUVMM_ENOMEM or CUVMM_EDRIVER (the CUresult reported is CUDA_ERROR_OUT_OF_MEMORY or
 *            CUDA_ERROR_UNKNOWN)
 * @return CUVMM_OK, or CUVMM_EINVAL for a NULL @p ctx, an unknown @p call or another @p err
 */
CUVMM_API int cuvmm_ctx_inject_fault(struct cuvmm_ctx *ctx, enum cuvmm_call call, uint64_t skip, uint32_t count,
				      int err);

/**
 * Count the calls of one kind made so far on this context (failed ones included).
 * @param[in] ctx the context
 * @param[in] call which driver call
 * @return the count; 0 for a NULL @p ctx or an unknown @p call
 */
CUVMM_API uint64_t cuvmm_ctx_call_count(const struct cuvmm_ctx *ctx, enum cuvmm_call call);

/** @} */

#ifdef __cplusplus
}
#endif

#endif /* CUVMM_H */
