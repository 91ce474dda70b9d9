/* Prints the layout of the structs and the values of the enums of <cuvmm.h> as "name value" lines, for
 * test_cuvmm.py to compare with the ctypes mirror in cuvmm/_lib.py. */
#include <stddef.h>
#include <stdio.h>

#include <cuvmm.h>

#define SIZE(s) printf("%s.sizeof %zu\n", #s, sizeof(struct s))
#define OFF(s, f) printf("%s.%s %zu\n", #s, #f, offsetof(struct s, f))
#define VAL(e) printf("%s %d\n", #e, (int)(e))

int main(void)
{
	SIZE(cuvmm_config);
	OFF(cuvmm_config, backend);
	OFF(cuvmm_config, release_delay_ms);
	OFF(cuvmm_config, retain_bytes);
	OFF(cuvmm_config, background_release);
	OFF(cuvmm_config, device_limit_bytes);
	OFF(cuvmm_config, host_granularity);
	OFF(cuvmm_config, host_devices);
	OFF(cuvmm_config, peer_access);
	SIZE(cuvmm_stats);
	OFF(cuvmm_stats, reserved_bytes);
	OFF(cuvmm_stats, held_bytes);
	OFF(cuvmm_stats, mapped_bytes);
	OFF(cuvmm_stats, live_bytes);
	OFF(cuvmm_stats, peak_held_bytes);
	OFF(cuvmm_stats, peak_live_bytes);
	OFF(cuvmm_stats, create_calls);
	OFF(cuvmm_stats, release_calls);
	OFF(cuvmm_stats, map_calls);
	OFF(cuvmm_stats, unmap_calls);
	OFF(cuvmm_stats, driver_ns);
	SIZE(cuvmm_pool_config);
	OFF(cuvmm_pool_config, device);
	OFF(cuvmm_pool_config, max_bytes);
	OFF(cuvmm_pool_config, name);
	OFF(cuvmm_pool_config, peer_access);
	OFF(cuvmm_pool_config, coarse_bytes);
	SIZE(cuvmm_kv_config);
	OFF(cuvmm_kv_config, device);
	OFF(cuvmm_kv_config, block_bytes);
	OFF(cuvmm_kv_config, max_blocks);
	OFF(cuvmm_kv_config, tensors);
	OFF(cuvmm_kv_config, peer_access);
	SIZE(cuvmm_kv_move);
	OFF(cuvmm_kv_move, from);
	OFF(cuvmm_kv_move, to);
	SIZE(cuvmm_torch_stats);
	OFF(cuvmm_torch_stats, allocated_bytes);
	OFF(cuvmm_torch_stats, peak_allocated_bytes);
	OFF(cuvmm_torch_stats, allocated_bytes_total);
	OFF(cuvmm_torch_stats, freed_bytes_total);
	OFF(cuvmm_torch_stats, allocations);
	OFF(cuvmm_torch_stats, peak_allocations);
	OFF(cuvmm_torch_stats, allocation_count);
	OFF(cuvmm_torch_stats, free_count);
	OFF(cuvmm_torch_stats, reserved_bytes);
	OFF(cuvmm_torch_stats, peak_reserved_bytes);
	OFF(cuvmm_torch_stats, mapped_bytes);
	OFF(cuvmm_torch_stats, create_calls);
	OFF(cuvmm_torch_stats, release_calls);
	OFF(cuvmm_torch_stats, ooms);
	printf("enum.sizeof %zu\n", sizeof(enum cuvmm_call));
	VAL(CUVMM_BACKEND_AUTO);
	VAL(CUVMM_BACKEND_CUDA);
	VAL(CUVMM_BACKEND_HOST);
	VAL(CUVMM_SLEEP_OFFLOAD);
	VAL(CUVMM_SLEEP_DISCARD);
	VAL(CUVMM_LOG_ERROR);
	VAL(CUVMM_LOG_WARN);
	VAL(CUVMM_LOG_INFO);
	VAL(CUVMM_LOG_DEBUG);
	VAL(CUVMM_CALL_RESERVE);
	VAL(CUVMM_CALL_UNRESERVE);
	VAL(CUVMM_CALL_CREATE);
	VAL(CUVMM_CALL_RELEASE);
	VAL(CUVMM_CALL_MAP);
	VAL(CUVMM_CALL_UNMAP);
	VAL(CUVMM_CALL_SET_ACCESS);
	VAL(CUVMM_CALL_EVENT_CREATE);
	VAL(CUVMM_CALL_EVENT_RECORD);
	VAL(CUVMM_CALL_EVENT_QUERY);
	VAL(CUVMM_CALL_EVENT_SYNC);
	VAL(CUVMM_CALL_DEVICE_SYNC);
	VAL(CUVMM_CALL_STREAM_WAIT);
	VAL(CUVMM_CALL_HOST_REGISTER);
	VAL(CUVMM_CALL_COPY);
	VAL(CUVMM_CALL_CAPTURE_INFO);
	VAL(CUVMM_CALL_PEER_QUERY);
	VAL(CUVMM_CALL_COUNT_);
#define CUVMM_ERR_VAL_(name, value, msg) printf("CUVMM_%s %d\n", #name, CUVMM_##name);
	CUVMM_ERRNO_MAP(CUVMM_ERR_VAL_)
	return 0;
}
