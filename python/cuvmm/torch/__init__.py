"""cuvmm as PyTorch's CUDA allocator: GPU memory that goes back to the driver when the program is idle.

    import cuvmm.torch
    cuvmm.torch.enable()              # before the first CUDA allocation
    ...                               # unchanged PyTorch code

or, without changing the script: ``python -m cuvmm.torch script.py [args]``.

enable() installs the library's PyTorch entry points (cuvmm_torch_malloc / cuvmm_torch_free) through
torch.cuda.memory.CUDAPluggableAllocator, then makes what PyTorch's pluggable allocator leaves out work
again: torch.cuda.memory_stats() and everything built on it, reset_peak_memory_stats(), empty_cache(),
Tensor.record_stream(), and CUDA graphs (torch.cuda.graph, shared graph pools, make_graphed_callables,
torch.compile(mode="reduce-overhead")), whose memory is kept while a graph lives and given back after.
doc/torch.md says how and what does not work.

This module imports without torch. configure_pool(), trim() and graph_pools() work without it; enable()
and stats() raise ImportError naming torch when it is missing; pool(), sleep(), sleep_prepare() and wake()
raise RuntimeError until enable() has run.
"""
import contextlib
import ctypes
import threading

from .. import _lib, _objects
from .._errors import Error, ErrorCode, check

__all__ = ["enable", "enabled", "stats", "trim", "pool", "configure_pool", "sleep", "sleep_prepare", "wake",
           "graph_pools"]

_enabled = False
_lock = threading.Lock()
_tls = threading.local()



TorchStats = _lib.TorchStats


def _c():
    return _lib.lib


def _check(fn, err):
    return check(err, fn)


def _torch():
    try:
        import torch
    except ImportError as e:
        raise ImportError("cuvmm.torch needs PyTorch (the 'torch' package), which is not installed") from e
    if not torch.cuda.is_available():
        raise RuntimeError("cuvmm.torch: torch.cuda.is_available() is False: no CUDA device to manage")
    return torch


def enabled():
    """True once enable() has installed cuvmm as PyTorch's CUDA allocator in this process."""
    return _enabled


def enable(release_delay_ms=None, retain_bytes=None, device_limit_bytes=None, background_release=None,
           peer_access=None):
    """Install cuvmm as PyTorch's CUDA allocator. Call it before anything allocates CUDA memory.

    Keyword arguments set the context (None: the library's default, or the CUVMM_* environment variable).
    peer_access=True gives every GPU read/write access to the tensors of every other (a model split across
    GPUs whose kernels read a peer's tensors directly); an iterable of device indices or a mask names some.
    A second call is a no-op. Raises RuntimeError, saying what to do, when PyTorch's allocator is in use
    already.
    """
    global _enabled
    torch = _torch()
    with _lock:
        if _enabled:
            return
        lib = _c()
        cfg = _lib.Config()
        lib.cuvmm_config_init(ctypes.byref(cfg))
        cfg.backend = 1  # CUDA: PyTorch's memory is the GPU's
        for name, value in (("release_delay_ms", release_delay_ms), ("retain_bytes", retain_bytes),
                            ("device_limit_bytes", device_limit_bytes),
                            ("background_release", background_release),
                            ("peer_access", _objects._peers(peer_access, "cuvmm_torch_init"))):
            if value is not None:
                _objects._set(cfg, name, value, "cuvmm_torch_init")
        # The context first: if the library refuses the settings, PyTorch keeps its own allocator and nothing
        # has changed. (After a swap refused below, the idle context stays; a second enable() finds it.)
        err = lib.cuvmm_torch_init(ctypes.byref(cfg))
        if err < 0 and err != -8:  # ESTATE: made already (an earlier enable() whose swap was refused)
            _check("cuvmm_torch_init", err)
        alloc = torch.cuda.memory.CUDAPluggableAllocator(_lib.path, "cuvmm_torch_malloc", "cuvmm_torch_free")
        try:
            torch.cuda.memory.change_current_allocator(alloc)
        except RuntimeError as e:
            raise RuntimeError(
                "cuvmm.torch.enable() came after PyTorch allocated CUDA memory with its own allocator, which "
                "cannot be swapped any more. Call it first thing in the program (before any tensor, model "
                "or torch.cuda call that allocates), or run the program with 'python -m cuvmm.torch "
                "script.py'. (PyTorch said: %s)" % e) from e
        _install(torch)
        _enabled = True


# ----- torch.cuda's memory API, from cuvmm's counters -----

def _stat(cur, peak, alloc, freed):
    return {"current": cur, "peak": peak, "allocated": alloc, "freed": freed}


def _pools(cur, peak, alloc, freed):
    # cuvmm has no small/large split of PyTorch's kind: everything counts as "large_pool".
    return {"all": _stat(cur, peak, alloc, freed), "large_pool": _stat(cur, peak, alloc, freed),
            "small_pool": _stat(0, 0, 0, 0)}


def _raw_stats(device):
    s = TorchStats()
    s.size = ctypes.sizeof(s)
    _check("cuvmm_torch_stats", _c().cuvmm_torch_stats(device, ctypes.byref(s)))
    return s


def _memory_stats(device):
    s = _raw_stats(_device_index(device))
    bytes_ = _pools(s.allocated_bytes, s.peak_allocated_bytes, s.allocated_bytes_total, s.freed_bytes_total)
    counts = _pools(s.allocations, s.peak_allocations, s.allocation_count, s.free_count)
    reserved = _pools(s.reserved_bytes, s.peak_reserved_bytes, 0, 0)
    zero = _pools(0, 0, 0, 0)
    return {
        "allocated_bytes": bytes_, "active_bytes": bytes_, "requested_bytes": bytes_,
        "reserved_bytes": reserved, "inactive_split_bytes": zero,
        "allocation": counts, "active": counts, "segment": _pools(0, 0, s.create_calls, s.release_calls),
        "inactive_split": zero,
        "num_alloc_retries": 0, "num_ooms": s.ooms, "num_sync_all_streams": 0,
        "num_device_alloc": s.create_calls, "num_device_free": s.release_calls,
        "oversize_allocations": _stat(0, 0, 0, 0), "oversize_segments": _stat(0, 0, 0, 0),
        "max_split_size": -1,
    }


def _device_index(device):
    torch = _torch()
    return torch.cuda._utils._get_device_index(device, optional=True)


def _reset_peak(device):
    _check("cuvmm_torch_reset_peak", _c().cuvmm_torch_reset_peak(_device_index(device)))


def _reset_totals(device):
    _check("cuvmm_torch_reset_totals", _c().cuvmm_torch_reset_totals(_device_index(device)))


def trim(device=-1, keep_bytes=0):
    """Give cached GPU memory back to the driver now (torch.cuda.empty_cache() does this under cuvmm).
    Returns False when a CUDA graph capture is under way (nothing can be synchronised then)."""
    lib = _c()
    ctx = lib.cuvmm_torch_ctx()
    if not ctx:
        return True
    err = lib.cuvmm_ctx_trim(ctx, device, keep_bytes)
    if err == -7:  # EBUSY: a capture is under way
        return False
    _check("cuvmm_ctx_trim", err)
    return True


def _empty_cache():
    trim()


def stats(device=None):
    """cuvmm's figures for a device (the current one by default) as a dict: PyTorch's allocated/reserved
    in cuvmm's terms, and the context's held/mapped/live bytes."""
    s = _raw_stats(_device_index(device))
    out = {name: getattr(s, name) for name, _ in TorchStats._fields_ if name != "size"}
    return out


def _record_stream(orig):
    def record_stream(self, stream):
        orig(self, stream)
        if self.is_cuda:
            ptr = self.untyped_storage().data_ptr()
            if ptr:
                _c().cuvmm_torch_record_stream(ptr, stream.cuda_stream)
    record_stream.__doc__ = orig.__doc__
    return record_stream


# ----- CUDA graphs -----
# Each torch graph pool (CUDAGraph.pool(), a pair of ints) is one cuvmm graph pool; graphs that share a torch
# pool share the cuvmm one. The cuvmm graph pool is released when the last graph using it is reset or deleted.

_graph_pools = {}  # torch pool id -> [cuvmm graph pool id, number of graphs]


def graph_pools():
    """The graph pools alive: {torch pool id: (cuvmm graph pool id, graphs using it)}."""
    with _lock:
        return {k: tuple(v) for k, v in _graph_pools.items()}


def _graph_begin(torch, graph, pool):
    """Right after capture_begin: tell cuvmm which graph pool the capture's memory belongs to. `pool` is the
    torch pool id the capture shares (graph_pool_handle(), another graph's pool()), or None for a private
    one, which is keyed by the graph until capture_end gives it its torch id."""
    lib = _c()
    key = tuple(pool) if pool is not None else ("graph", id(graph))
    device = torch.cuda.current_device()
    stream = torch.cuda.current_stream(device).cuda_stream
    with _lock:
        entry = _graph_pools.get(key)
        share = entry[0] if entry else 0
        gp = ctypes.c_uint64(0)
        _check("cuvmm_capture_pool",
               lib.cuvmm_capture_pool(lib.cuvmm_torch_ctx(), device, stream, share, ctypes.byref(gp)))
        if entry:
            entry[1] += 1
        else:
            _graph_pools[key] = [gp.value, 1]
        graph._cuvmm_pool_key = key


def _graph_end(graph):
    """After capture_end: a private pool is known by its torch id from now on, so that later graphs can
    share it (torch.cuda.graph(pool=g.pool()))."""
    key = getattr(graph, "_cuvmm_pool_key", None)
    if key is None or key[0] != "graph":
        return
    new = tuple(graph.pool())
    with _lock:
        entry = _graph_pools.pop(key, None)
        if entry is None:
            return
        if new in _graph_pools:
            _graph_pools[new][1] += entry[1]
        else:
            _graph_pools[new] = entry
        graph._cuvmm_pool_key = new


def _graph_done(graph):
    key = getattr(graph, "_cuvmm_pool_key", None)
    if key is None:
        return
    graph._cuvmm_pool_key = None
    with _lock:
        entry = _graph_pools.get(key)
        if not entry:
            return
        entry[1] -= 1
        if entry[1] > 0:
            return
        del _graph_pools[key]
    lib = _c()
    err = lib.cuvmm_graph_release(lib.cuvmm_torch_ctx(), entry[0])
    if err < 0:
        import warnings
        warnings.warn("cuvmm: releasing the memory of a CUDA graph failed: %s"
                      % lib.cuvmm_strerror(err).decode(), RuntimeWarning)


def _patch_graphs(torch):
    cls = torch.cuda.graphs.CUDAGraph
    orig_begin, orig_end, orig_reset = cls.capture_begin, cls.capture_end, cls.reset
    orig_del = getattr(cls, "__del__", None)

    def capture_begin(self, pool=None, *args, **kwargs):
        orig_begin(self, pool, *args, **kwargs)
        _graph_begin(torch, self, pool)

    def capture_end(self):
        orig_end(self)
        _graph_end(self)

    def reset(self):
        orig_reset(self)
        _graph_done(self)

    def __del__(self):
        try:
            _graph_done(self)
        except Exception:  # at interpreter exit the module may be half torn down; the process ends anyway
            pass
        if orig_del:
            orig_del(self)

    capture_begin.__doc__ = orig_begin.__doc__
    capture_end.__doc__ = orig_end.__doc__
    reset.__doc__ = orig_reset.__doc__
    cls.capture_begin, cls.capture_end, cls.reset, cls.__del__ = capture_begin, capture_end, reset, __del__


def _unsupported(what, instead):
    def fail(*args, **kwargs):
        raise RuntimeError("%s is not supported with cuvmm as the CUDA allocator; %s" % (what, instead))
    return fail


def _install(torch):
    C = torch._C
    # PyTorch's pluggable allocator would ignore this one silently.
    C._cuda_setMemoryFraction = _unsupported(
        "torch.cuda.set_per_process_memory_fraction()",
        "cap the memory with cuvmm.torch.enable(device_limit_bytes=...) or CUVMM_DEVICE_LIMIT")
    mempool = getattr(torch.cuda.memory, "MemPool", None)
    if mempool is not None:
        # PyTorch's pools are the caching allocator's; under a pluggable allocator they would not isolate
        # anything, silently.
        mempool.__init__ = _unsupported("torch.cuda.MemPool", "use cuvmm.torch.pool(name) instead")
    C._cuda_memoryStats = _memory_stats
    C._cuda_resetPeakMemoryStats = _reset_peak
    C._cuda_resetAccumulatedMemoryStats = _reset_totals
    C._cuda_emptyCache = _empty_cache
    torch.Tensor.record_stream = _record_stream(torch.Tensor.record_stream)
    _patch_graphs(torch)
    # torch.compile(mode="reduce-overhead") records CUDA graph *trees* by default, which checkpoint and
    # restore the caching allocator's private state (torch._C._cuda_getCheckpointState), something no
    # pluggable allocator has. Its plain CUDA graphs path works under cuvmm.
    try:
        import torch._inductor.config as inductor_config
        inductor_config.triton.cudagraph_trees = False
    except Exception:  # inductor missing or changed: torch.compile is then not ours to fix
        pass


# ----- named pools -----

def _name(name, function):
    """A pool name for the C API (cuvmm._objects.pool_name); its length is the library's to check."""
    return _objects.pool_name(name, function)


@contextlib.contextmanager
def pool(name):
    """Send this thread's CUDA allocations inside the block to the cuvmm pool `name` (one per device; None
    or "torch": the default pool)."""
    if not _enabled:
        raise RuntimeError("cuvmm.torch.pool(): call cuvmm.torch.enable() first")
    lib = _c()
    cname = _name(name, "cuvmm_torch_use_pool")
    stack = getattr(_tls, "stack", None)
    if stack is None:
        stack = _tls.stack = []
    _check("cuvmm_torch_use_pool", lib.cuvmm_torch_use_pool(cname))
    stack.append(cname)
    try:
        yield
    finally:
        stack.pop()
        lib.cuvmm_torch_use_pool(stack[-1] if stack else None)


def configure_pool(name, max_bytes=0, peer_access=None, coarse_bytes=0):
    """Set how the pools named `name` (None: the default pool) are created, before their first use on any
    device: coarse_bytes makes allocations from that size up take handles as large as fit (up to 128 MiB),
    so that sleep, trim and idle release give them back in few driver calls; for a pool whose tensors stay
    large, such as a model's weights (see Context.pool()). max_bytes and peer_access: as Context.pool().
    Works before or after enable(). Raises cuvmm.Error ESTATE once a pool of that name exists; a value the
    device refuses (a peer it cannot access) shows when the pool is created. peer_access names the devices
    given access to every device's pool of that name (each pool's own device has it anyway); None, the
    default, is the context's; no devices at all (False, []) is refused with EINVAL, since one config
    serves every device: leave it None and give enable() peer_access=False."""
    fn = "cuvmm_torch_pool_configure"
    cname = _name(name, fn)
    cfg = _objects.pool_config(fn, 0, max_bytes, peer_access, coarse_bytes, any_device=True)
    _check(fn, _c().cuvmm_torch_pool_configure(cname, ctypes.byref(cfg)))


def _named(name, device):
    torch = _torch()
    lib = _c()
    cname = _name(name, "cuvmm_torch_pool")
    devices = range(torch.cuda.device_count()) if device is None else [device]
    out = []
    for d in devices:
        p = ctypes.c_void_p()
        _check("cuvmm_torch_pool", lib.cuvmm_torch_pool(cname, d, ctypes.byref(p)))
        out.append(p)
    return out


def sleep(name, offload=True, device=None):
    """Give all GPU memory of pool `name` back to the driver, keeping its addresses: tensors in it (and CUDA
    graphs that use them) stay valid for after wake(). offload=True keeps the contents in pinned host
    memory; False drops them. Waits for all GPU work first."""
    if not _enabled:
        raise RuntimeError("cuvmm.torch.sleep(): call cuvmm.torch.enable() first")
    lib = _c()
    done = []
    try:
        for p in _named(name, device):
            _check("cuvmm_pool_sleep", lib.cuvmm_pool_sleep(p, 0 if offload else 1, None))
            done.append(p)
    except Exception:
        for p in done:
            lib.cuvmm_pool_wake(p, None)
        raise


def sleep_prepare(name, device=None):
    """Pin the host memory that the next sleep(name) will copy into, now (while the GPU still serves), so
    that the sleep runs at the speed of the copy instead of waiting for fresh host memory: about 0.35 s for
    8 GiB on 16 cores, where the copy takes 0.16 s. Costs that much pinned host memory until the sleep uses
    it (and keeps it for the next one) or the pool is trimmed."""
    if not _enabled:
        raise RuntimeError("cuvmm.torch.sleep_prepare(): call cuvmm.torch.enable() first")
    lib = _c()
    for p in _named(name, device):
        _check("cuvmm_pool_sleep_prepare", lib.cuvmm_pool_sleep_prepare(p, 0))


def wake(name, device=None):
    """Bring pool `name` back at the same addresses (with its contents, after sleep(offload=True))."""
    if not _enabled:
        raise RuntimeError("cuvmm.torch.wake(): call cuvmm.torch.enable() first")
    lib = _c()
    for p in _named(name, device):
        err = lib.cuvmm_pool_wake(p, None)
        if err != -8:  # ESTATE: that device's pool was not asleep
            _check("cuvmm_pool_wake", err)
