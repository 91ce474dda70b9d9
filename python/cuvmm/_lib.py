"""ctypes binding of libcuvmm.so: finding the library, the structs of <cuvmm.h>, every function's prototype.

Nothing here is public; the classes in _objects.py and the functions in __init__.py are the Python API.
The structs mirror include/cuvmm.h field for field (tests/test_cuvmm.py compares them with the C compiler's
offsetof when the build tree's layout probe is available).
"""

import ctypes
import ctypes.util
import os

__all__ = ["lib", "path", "Config", "PoolConfig", "KVConfig", "StatsStruct", "KVMove", "TorchStats"]

c_size_t = ctypes.c_size_t
c_void_p = ctypes.c_void_p
c_int = ctypes.c_int
c_uint32 = ctypes.c_uint32
c_uint64 = ctypes.c_uint64
c_int64 = ctypes.c_int64
c_char_p = ctypes.c_char_p
c_bool = ctypes.c_bool
c_enum = ctypes.c_int  # every enum of <cuvmm.h> fits an int (gcc and clang give them int's size)
CUstream = ctypes.c_void_p

_SONAMES = ("libcuvmm.so", "libcuvmm.so.0")


class Config(ctypes.Structure):
    """struct cuvmm_config"""
    _fields_ = [
        ("size", c_size_t),
        ("backend", c_enum),
        ("release_delay_ms", c_int64),
        ("retain_bytes", c_size_t),
        ("background_release", c_bool),
        ("device_limit_bytes", c_size_t),
        ("host_granularity", c_size_t),
        ("host_devices", c_int),
        ("peer_access", c_uint64),
    ]


class StatsStruct(ctypes.Structure):
    """struct cuvmm_stats"""
    _fields_ = [
        ("size", c_size_t),
        ("reserved_bytes", c_uint64),
        ("held_bytes", c_uint64),
        ("mapped_bytes", c_uint64),
        ("live_bytes", c_uint64),
        ("peak_held_bytes", c_uint64),
        ("peak_live_bytes", c_uint64),
        ("create_calls", c_uint64),
        ("release_calls", c_uint64),
        ("map_calls", c_uint64),
        ("unmap_calls", c_uint64),
        ("driver_ns", c_uint64),
    ]


class PoolConfig(ctypes.Structure):
    """struct cuvmm_pool_config"""
    _fields_ = [
        ("size", c_size_t),
        ("device", c_int),
        ("max_bytes", c_size_t),
        ("name", c_char_p),
        ("peer_access", c_uint64),
        ("coarse_bytes", c_size_t),
    ]


class KVConfig(ctypes.Structure):
    """struct cuvmm_kv_config"""
    _fields_ = [
        ("size", c_size_t),
        ("device", c_int),
        ("block_bytes", c_size_t),
        ("max_blocks", c_uint32),
        ("tensors", c_uint32),
        ("peer_access", c_uint64),
    ]


class KVMove(ctypes.Structure):
    """struct cuvmm_kv_move"""
    _fields_ = [("from_", c_uint32), ("to", c_uint32)]


class TorchStats(ctypes.Structure):
    """struct cuvmm_torch_stats"""
    _fields_ = [("size", c_size_t)] + [(n, c_uint64) for n in (
        "allocated_bytes", "peak_allocated_bytes", "allocated_bytes_total", "freed_bytes_total",
        "allocations", "peak_allocations", "allocation_count", "free_count", "reserved_bytes",
        "peak_reserved_bytes", "mapped_bytes", "create_calls", "release_calls", "ooms")]


LOG_FN = ctypes.CFUNCTYPE(None, c_enum, c_char_p, c_void_p)

P = ctypes.POINTER
# name: (restype, argtypes). Every public function of <cuvmm.h>; tests check that none is missing.
PROTOTYPES = {
    "cuvmm_strerror": (c_char_p, [c_int]),
    "cuvmm_err_name": (c_char_p, [c_int]),
    "cuvmm_last_driver_error": (c_int, []),
    "cuvmm_version": (c_char_p, []),
    "cuvmm_set_log_callback": (None, [LOG_FN, c_void_p, c_enum]),
    "cuvmm_config_init": (None, [P(Config)]),
    "cuvmm_ctx_create": (c_int, [P(Config), P(c_void_p)]),
    "cuvmm_ctx_destroy": (None, [c_void_p]),
    "cuvmm_ctx_backend": (c_enum, [c_void_p]),
    "cuvmm_ctx_device_count": (c_int, [c_void_p, P(c_int)]),
    "cuvmm_ctx_trim": (c_int, [c_void_p, c_int, c_size_t]),
    "cuvmm_ctx_stats": (c_int, [c_void_p, c_int, P(StatsStruct)]),
    "cuvmm_ctx_can_access_peer": (c_int, [c_void_p, c_int, c_int, P(c_bool)]),
    "cuvmm_ctx_add_peer": (c_int, [c_void_p, c_int, c_int]),
    "cuvmm_region_peers": (c_uint64, [c_void_p]),
    "cuvmm_region_create": (c_int, [c_void_p, c_int, c_size_t, P(c_void_p)]),
    "cuvmm_region_create_ex": (c_int, [c_void_p, c_int, c_size_t, c_size_t, P(c_void_p)]),
    "cuvmm_region_destroy": (None, [c_void_p]),
    "cuvmm_region_base": (c_void_p, [c_void_p]),
    "cuvmm_region_size": (c_size_t, [c_void_p]),
    "cuvmm_region_granularity": (c_size_t, [c_void_p]),
    "cuvmm_region_map": (c_int, [c_void_p, c_size_t, c_size_t]),
    "cuvmm_region_unmap": (c_int, [c_void_p, c_size_t, c_size_t, CUstream]),
    "cuvmm_region_resize": (c_int, [c_void_p, c_size_t, CUstream]),
    "cuvmm_region_stats": (c_int, [c_void_p, P(StatsStruct)]),
    "cuvmm_pool_config_init": (None, [P(PoolConfig)]),
    "cuvmm_pool_create": (c_int, [c_void_p, P(PoolConfig), P(c_void_p)]),
    "cuvmm_pool_destroy": (None, [c_void_p]),
    "cuvmm_malloc": (c_int, [c_void_p, c_size_t, P(c_void_p)]),
    "cuvmm_free": (c_int, [c_void_p, c_void_p]),
    "cuvmm_malloc_async": (c_int, [c_void_p, c_size_t, CUstream, P(c_void_p)]),
    "cuvmm_free_async": (c_int, [c_void_p, c_void_p, CUstream]),
    "cuvmm_pool_trim": (c_int, [c_void_p, c_size_t]),
    "cuvmm_pool_stats": (c_int, [c_void_p, P(StatsStruct)]),
    "cuvmm_kv_config_init": (None, [P(KVConfig)]),
    "cuvmm_kv_create": (c_int, [c_void_p, P(KVConfig), P(c_void_p)]),
    "cuvmm_kv_destroy": (None, [c_void_p]),
    "cuvmm_kv_tensor": (c_void_p, [c_void_p, c_uint32]),
    "cuvmm_kv_alloc": (c_int, [c_void_p, c_uint32, P(c_uint32)]),
    "cuvmm_kv_free": (c_int, [c_void_p, c_uint32, P(c_uint32), CUstream]),
    "cuvmm_kv_compact": (c_int, [c_void_p, c_uint32, P(KVMove), P(c_uint32)]),
    "cuvmm_kv_stats": (c_int, [c_void_p, P(StatsStruct)]),
    "cuvmm_region_sleep": (c_int, [c_void_p, c_enum, CUstream]),
    "cuvmm_region_wake": (c_int, [c_void_p, CUstream]),
    "cuvmm_pool_sleep": (c_int, [c_void_p, c_enum, CUstream]),
    "cuvmm_pool_wake": (c_int, [c_void_p, CUstream]),
    "cuvmm_pool_sleep_prepare": (c_int, [c_void_p, c_size_t]),
    "cuvmm_region_sleep_prepare": (c_int, [c_void_p, c_size_t]),
    "cuvmm_ctx_inject_fault": (c_int, [c_void_p, c_enum, c_uint64, c_uint32, c_int]),
    "cuvmm_ctx_call_count": (c_uint64, [c_void_p, c_enum]),
    "cuvmm_call_name": (c_char_p, [c_enum]),
    "cuvmm_capture_pool": (c_int, [c_void_p, c_int, CUstream, c_uint64, P(c_uint64)]),
    "cuvmm_graph_release": (c_int, [c_void_p, c_uint64]),
    "cuvmm_torch_init": (c_int, [P(Config)]),
    "cuvmm_torch_ctx": (c_void_p, []),
    "cuvmm_torch_malloc": (c_void_p, [c_size_t, c_int, CUstream]),
    "cuvmm_torch_free": (None, [c_void_p, c_size_t, c_int, CUstream]),
    "cuvmm_torch_record_stream": (c_int, [c_void_p, CUstream]),
    "cuvmm_torch_use_pool": (c_int, [c_char_p]),
    "cuvmm_torch_pool": (c_int, [c_char_p, c_int, P(c_void_p)]),
    "cuvmm_torch_pool_configure": (c_int, [c_char_p, P(PoolConfig)]),
    "cuvmm_torch_stats": (c_int, [c_int, P(TorchStats)]),
    "cuvmm_torch_reset_peak": (c_int, [c_int]),
    "cuvmm_torch_reset_totals": (c_int, [c_int]),
}


def _int_range(t):
    """(lo, hi) of an integer or pointer ctypes type (a pointer: an address, 0 to 2**64 - 1); None for
    other types (bool, pointers to structs)."""
    code = getattr(t, "_type_", None)
    if not isinstance(code, str) or code not in "bBhHiIlLqQP":
        return None
    bits = 8 * ctypes.sizeof(t)
    return (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if code.islower() else (0, (1 << bits) - 1)


# name: ((argument index, lo, hi, is address), ...) for the integer and address arguments. ctypes wraps an
# int that does not fit (-1 becomes SIZE_MAX, 2**32 becomes 0, 2**64 + p becomes p) without a word, and
# takes True as 1; bad_int_arg finds both first.
INT_ARGS = {name: tuple((i,) + _int_range(t) + (getattr(t, "_type_", None) == "P",)
                        for i, t in enumerate(argtypes) if _int_range(t))
            for name, (_, argtypes) in PROTOTYPES.items()}


def bad_int_arg(fn, args):
    """A message for the first integer argument of fn(*args) that is not an int (a bool, a float, a str)
    or that its C type cannot hold; None if none. An address argument also takes None (NULL). Arguments
    are counted from 1, in C's order."""
    for i, lo, hi, address in INT_ARGS[fn.__name__]:
        v = args[i]
        if address and v is None:
            continue
        if not isinstance(v, int) or isinstance(v, bool):
            return "argument %d = %r is not %s" % (i + 1, v, "an address (int)" if address else "an integer")
        if not lo <= v <= hi:
            return "argument %d = %d does not fit its C type [%d, %d]" % (i + 1, v, lo, hi)
    return None


def _candidates():
    """(description, path or soname) pairs in lookup order."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = os.environ.get("CUVMM_LIBRARY")
    if env:
        # An explicit choice: nothing else is tried, so a wrong path fails loudly instead of silently
        # loading another copy.
        return [("$CUVMM_LIBRARY", env)]
    out = []
    try:
        from . import _config  # written by meson at install time
    except ImportError:
        _config = None
    if _config is not None:
        dirs = [os.path.normpath(os.path.join(here, _config.LIBDIR_FROM_PACKAGE)), _config.LIBDIR]
        for d in dict.fromkeys(dirs):
            out += [("installed libdir", os.path.join(d, n)) for n in _SONAMES]
    # Run from the source tree (PYTHONPATH=python): the default build directory.
    src_build = os.path.normpath(os.path.join(here, "..", "..", "build", "lib"))
    out += [("source tree build", os.path.join(src_build, n)) for n in _SONAMES]
    found = ctypes.util.find_library("cuvmm")
    out.append(("system loader", found or "libcuvmm.so.0"))
    return out


def _load():
    tried = []
    for what, cand in _candidates():
        if os.sep in cand and not os.path.exists(cand):
            tried.append("%s: %s (no such file)" % (what, cand))
            continue
        try:
            return ctypes.CDLL(cand), cand
        except OSError as e:
            tried.append("%s: %s (%s)" % (what, cand, e))
    raise ImportError("cuvmm: cannot load libcuvmm.so; tried:\n  " + "\n  ".join(tried) +
                      "\nInstall cuvmm (meson install), or point CUVMM_LIBRARY at the library, "
                      "e.g. CUVMM_LIBRARY=build/lib/libcuvmm.so")


def _bind(handle, where):
    for name, (restype, argtypes) in PROTOTYPES.items():
        try:
            fn = getattr(handle, name)
        except AttributeError:
            raise ImportError("cuvmm: %s lacks %s (an older libcuvmm?)" % (where, name)) from None
        fn.restype = restype
        fn.argtypes = argtypes


lib, path = _load()
_bind(lib, path)
