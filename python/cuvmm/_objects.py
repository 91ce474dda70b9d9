"""The objects of the C API as Python classes: Context, Pool, Region, KV, and Stats.

Every object holds its C handle and a reference to its parent, so a pool keeps its context alive. close()
is idempotent; __exit__ and __del__ call it. A context closes the objects still open on it before it
destroys itself. Calls and close() are guarded: close() waits for the calls in flight on the object, and a
call after close() raises ClosedError instead of passing a dangling handle to C.
"""

import ctypes
import threading

from ._errors import _BY_CODE, Backend, Busy, Call, ClosedError, Error, ErrorCode, check
from ._lib import Config, KVConfig, KVMove, PoolConfig, StatsStruct, bad_int_arg, lib

__all__ = ["Context", "Pool", "Region", "KV", "Stats"]

_FIELDS = tuple(name for name, _ in StatsStruct._fields_ if name != "size")


class Stats:
    """struct cuvmm_stats as attributes (s.held_bytes) and keys (s["held_bytes"])."""

    __slots__ = _FIELDS

    def __init__(self, **values):
        for f in _FIELDS:
            setattr(self, f, int(values.get(f, 0)))

    @classmethod
    def _from_struct(cls, st):
        return cls(**{f: getattr(st, f) for f in _FIELDS})

    def __getitem__(self, key):
        if key not in _FIELDS:
            raise KeyError(key)
        return getattr(self, key)

    def __contains__(self, key):
        return key in _FIELDS

    def __iter__(self):
        return iter(_FIELDS)

    def __len__(self):
        return len(_FIELDS)

    def keys(self):
        return list(_FIELDS)

    def values(self):
        return [getattr(self, f) for f in _FIELDS]

    def items(self):
        return [(f, getattr(self, f)) for f in _FIELDS]

    def get(self, key, default=None):
        return getattr(self, key) if key in _FIELDS else default

    def as_dict(self):
        return dict(self.items())

    def __eq__(self, other):
        return isinstance(other, Stats) and self.values() == other.values()

    def __repr__(self):
        return "Stats(%s)" % ", ".join("%s=%d" % kv for kv in self.items())


def _checked(fn, *args):
    """fn(*args), after refusing an int argument that its C type would silently wrap (EINVAL)."""
    bad = bad_int_arg(fn, args)
    if bad:
        raise Error(ErrorCode.EINVAL, fn.__name__, bad)
    return fn(*args)


def _set(st, field, value, function):
    """st.field = value, refusing (EINVAL) a value that the field would silently wrap or truncate, and one
    of the wrong kind: a bool or a non-integer for an integer field (True would become 1)."""
    ctype = dict(type(st)._fields_)[field]
    if ctype is ctypes.c_bool:
        ok = isinstance(value, int) and value in (0, 1)
    else:
        ok = isinstance(value, int) and not isinstance(value, bool)
    if not ok:
        raise Error(ErrorCode.EINVAL, function, "%s=%r: not %s" % (
            field, value, "a bool" if ctype is ctypes.c_bool else "an integer"))
    setattr(st, field, value)
    if getattr(st, field) != value:
        raise Error(ErrorCode.EINVAL, function, "%s=%r out of range" % (field, value))


PEERS_ALL = (1 << 64) - 1  # CUVMM_PEERS_ALL


def pool_name(name, function, max_len=None):
    """A pool name for the C API: None, or a str without NUL bytes (C would cut it there: "a\0b" would
    name "a", "\0" the default pool), at most max_len bytes in UTF-8 when given (C keeps no more); anything
    else is EINVAL."""
    if name is None:
        return None
    if not isinstance(name, str) or "\0" in name:
        raise Error(ErrorCode.EINVAL, function, "pool name %r: a str without NUL bytes, or None" % (name,))
    b = name.encode()
    if max_len is not None and len(b) > max_len:
        raise Error(ErrorCode.EINVAL, function, "pool name %r: longer than %d bytes" % (name, max_len))
    return b


def pool_config(function, device=0, max_bytes=0, peer_access=None, coarse_bytes=0, any_device=False):
    """A struct cuvmm_pool_config with these values (peer_access: as Context.pool()), for `function`'s
    errors. any_device: the config serves pools of every device (cuvmm.torch.configure_pool), where no one
    mask says "no peers"."""
    cfg = PoolConfig()
    lib.cuvmm_pool_config_init(ctypes.byref(cfg))
    _set(cfg, "device", device, function)
    _set(cfg, "max_bytes", max_bytes, function)
    _set(cfg, "coarse_bytes", coarse_bytes, function)
    _set(cfg, "peer_access", _object_peers(peer_access, device, function, any_device), function)
    return cfg


def _object_peers(value, device, function, any_device=False):
    """An object's peer_access mask (pool, kv) from the Python value: None is the context's (the C API's 0);
    no devices (False, [], 0) is the object's own device alone (1 << device), since the C API's 0 would
    mean the context's. For a config of every device's pools (any_device) "none" has no mask: EINVAL."""
    mask = _peers(value, function)
    if mask is None:
        return 0
    if mask == 0:
        if any_device:
            raise Error(ErrorCode.EINVAL, function, "peer_access=%r: a config for every device's pool cannot "
                        "name no peers (leave it None: the context's peer_access, which enable(peer_access="
                        "False) makes none)" % (value,))
        return _device_bit(device, function, "device=%r")
    return mask


def _device_bit(d, function, what):
    """1 << d for a device index d (an int, not a bool, 0 to 63), else EINVAL saying `what` % d."""
    if not isinstance(d, int) or isinstance(d, bool) or not 0 <= d < 64:
        raise Error(ErrorCode.EINVAL, function, what % (d,))
    return 1 << d


def _peers(value, function):
    """A peer_access mask from True ("every device"), False (none), a mask, or an iterable of device indices.
    None stays None (the default)."""
    if value is None or isinstance(value, int):
        return PEERS_ALL if value is True else value  # True/False are ints: False is the mask 0
    try:
        mask = 0
        for d in value:
            mask |= _device_bit(d, function, "peer_access names device %r")
        return mask
    except TypeError:
        raise Error(ErrorCode.EINVAL, function, "peer_access=%r" % (value,)) from None


def _stream(stream):
    """A CUstream from 0/None, an int handle, a ctypes value, or an object with .cuda_stream (torch)."""
    if stream is None:
        return None
    if isinstance(stream, bool):
        raise TypeError("stream must be an int, None, or have .cuda_stream or ._as_parameter_, not a bool")
    if isinstance(stream, int):
        return stream or None
    if hasattr(stream, "cuda_stream"):
        return int(stream.cuda_stream) or None
    if isinstance(stream, ctypes.c_void_p):
        return stream.value
    if hasattr(stream, "_as_parameter_"):
        p = stream._as_parameter_
        return p.value if isinstance(p, ctypes.c_void_p) else (int(p) or None)
    raise TypeError("stream must be an int, None, or have .cuda_stream or ._as_parameter_, not %r"
                    % type(stream).__name__)


def _ptr(ptr):
    """A device address (int) from an int, None, or a ctypes pointer (c_void_p or a POINTER instance).
    Anything else (a str, a float, a bool) goes through as it is, for the call's argument check to refuse
    with EINVAL, as it refuses an address out of range."""
    if isinstance(ptr, ctypes.c_void_p):
        return ptr.value
    if isinstance(ptr, ctypes._Pointer):
        return ctypes.cast(ptr, ctypes.c_void_p).value
    return ptr


class _State:
    """The C handle of one object and the guard of its life cycle.

    Kept apart from the Python object so that a context can close its children's C objects without
    holding the children themselves: in a garbage cycle, the collector clears weak references and then
    finalizes objects in any order, so a context finalized before its pool must still find the pool's
    handle (it is here) and destroy it first; the pool's own __del__ then finds it closed.
    """

    __slots__ = ("h", "destroy", "cv", "busy", "callers", "closer", "children", "parent")

    def __init__(self, destroy, parent=None):
        self.h = None
        self.destroy = destroy
        self.cv = threading.Condition(threading.Lock())
        self.busy = 0
        self.callers = {}  # thread id: calls it has in flight on the object
        self.closer = None  # the thread destroying the object, until it is destroyed
        self.children = set()  # the states of the objects created on a context
        self.parent = parent

    def enter(self, what):
        me = threading.get_ident()
        with self.cv:
            if self.h is None:
                raise ClosedError(what)
            self.busy += 1
            self.callers[me] = self.callers.get(me, 0) + 1
            return self.h

    def leave(self):
        me = threading.get_ident()
        with self.cv:
            self.busy -= 1
            if self.callers[me] == 1:
                del self.callers[me]
            else:
                self.callers[me] -= 1
            if not self.busy:
                self.cv.notify_all()

    def _in_call(self, me):
        """Whether thread `me` is inside a call on this object or on one of its children (a log callback
        run by that call, say): closing would wait for that call, that is for itself."""
        with self.cv:
            if me in self.callers:
                return True
            children = list(self.children)
        return any(c._in_call(me) for c in children)

    def close(self, what):
        me = threading.get_ident()
        if self._in_call(me):
            raise Busy(ErrorCode.EBUSY, None, "%s closed from inside a call on it (a log callback?)" % what)
        with self.cv:
            h = self.h
            if h is None:
                # Another thread may be destroying it: done means destroyed (a context destroys its
                # children first, and a destroyed child must not be destroyed again under it).
                while self.closer is not None and self.closer != me:
                    self.cv.wait()
                return
            self.h = None  # new calls fail from here on
            self.closer = me
            while self.busy:  # calls in flight finish first
                self.cv.wait()
        try:
            # Children first: cuvmm_ctx_destroy would otherwise destroy them under their Python objects.
            for child in list(self.children):
                child.close("a child")
            self.destroy(h)
        finally:
            with self.cv:
                self.closer = None
                self.cv.notify_all()
            if self.parent is not None:
                self.parent.children.discard(self)


class _Handle:
    """A Python object over a C object (see the module's docstring)."""

    _destroy = None  # the C destroy function of the subclass
    _s = None

    def _what(self):
        return type(self).__name__

    def _enter(self):
        return self._s.enter(self._what())

    def _leave(self):
        self._s.leave()

    def _get(self, fn, *args):
        """fn(handle, *args)."""
        h = self._enter()
        try:
            return _checked(fn, h, *args)
        finally:
            self._leave()

    def _call(self, fn, *args):
        """fn(handle, *args), raising Error for a negative return code."""
        return check(self._get(fn, *args), fn.__name__)

    def _stats(self, fn, *args):
        st = StatsStruct()
        st.size = ctypes.sizeof(StatsStruct)
        self._call(fn, *args, ctypes.byref(st))
        return Stats._from_struct(st)

    @property
    def closed(self):
        return self._s is None or self._s.h is None

    def close(self):
        """Destroy the C object (a context: its pools, regions and kv objects first); later calls raise
        ClosedError. Idempotent."""
        if self._s is not None:
            self._s.close(self._what())

    def __copy__(self):
        raise TypeError("a cuvmm.%s cannot be copied: it owns its C object" % type(self).__name__)

    def __deepcopy__(self, memo):
        self.__copy__()

    def __reduce_ex__(self, protocol):
        raise TypeError("a cuvmm.%s cannot be pickled: it owns a C object of this process" % type(self).__name__)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):
        try:
            self.close()
        except Exception:  # at interpreter shutdown, modules may be half torn down
            pass


def _backend(value):
    if value is None:
        return None
    if isinstance(value, str):
        try:
            return Backend[value.upper()]
        except KeyError:
            raise ValueError("backend must be 'cuda', 'host' or 'auto', not %r" % value) from None
    return Backend(value)


def _call_enum(call):
    if isinstance(call, bool) or not isinstance(call, (int, str)):
        raise TypeError("a driver call is a str (\"map\") or a cuvmm.Call, not %r" % type(call).__name__)
    if isinstance(call, str):
        try:
            return Call[call.upper()]
        except KeyError:
            raise ValueError("unknown driver call %r; one of %s"
                             % (call, ", ".join(c.name.lower() for c in Call))) from None
    return Call(call)


def _err_code(err):
    if isinstance(err, str):
        name = err.upper()
        try:
            return ErrorCode[name[6:] if name.startswith("CUVMM_") else name]
        except KeyError:
            raise ValueError("unknown error name %r; one of %s"
                             % (err, ", ".join(e.name for e in ErrorCode if e < 0))) from None
    if isinstance(err, type):
        for code, cls in _BY_CODE.items():
            if cls is err:
                return code
        raise ValueError("%s names no single error code" % err.__name__)
    if isinstance(err, bool) or not isinstance(err, int):
        raise TypeError("an error is a cuvmm code, its name or its exception class, not %r" % (err,))
    return err


class Context(_Handle):
    """A cuvmm context (struct cuvmm_ctx): the driver or host backend, and the memory of each device.

    Every argument None keeps the library's default, after the CUVMM_* environment variables.
    backend: "cuda", "host", "auto" (or Backend); release_delay_ms: idle time before free memory is given
    back (-1 never, 0 at once); retain_bytes: free memory kept per device anyway; device_limit_bytes: cap
    on memory held per device (0 none); background_release: a thread gives memory back while idle;
    host_granularity: the host backend's chunk size; host_devices: devices the host backend emulates;
    peer_access: devices given access to the memory of every object besides its own device: True (every
    device), False (none, the default), an iterable of device indices, or a bit mask.
    """

    def __init__(self, backend=None, release_delay_ms=None, retain_bytes=None, device_limit_bytes=None,
                 background_release=None, host_granularity=None, host_devices=None, peer_access=None):
        cfg = Config()
        lib.cuvmm_config_init(ctypes.byref(cfg))
        fn = "cuvmm_ctx_create"
        if backend is not None:
            cfg.backend = _backend(backend)
        peer_access = _peers(peer_access, fn)
        for field, value in (("release_delay_ms", release_delay_ms), ("retain_bytes", retain_bytes),
                             ("device_limit_bytes", device_limit_bytes), ("host_granularity", host_granularity),
                             ("host_devices", host_devices), ("peer_access", peer_access),
                             ("background_release", background_release)):
            if value is not None:
                _set(cfg, field, value, fn)  # the kind first: "1G" < 0 would be a TypeError
                if value < (-1 if field == "release_delay_ms" else 0):
                    raise Error(ErrorCode.EINVAL, fn, "%s=%r" % (field, value))
        out = ctypes.c_void_p()
        check(lib.cuvmm_ctx_create(ctypes.byref(cfg), ctypes.byref(out)), "cuvmm_ctx_create")
        self._s = _State(lib.cuvmm_ctx_destroy)
        self._s.h = out.value

    @property
    def backend(self):
        """"cuda" or "host"."""
        return Backend(self._get(lib.cuvmm_ctx_backend)).name.lower()

    @property
    def device_count(self):
        n = ctypes.c_int()
        self._call(lib.cuvmm_ctx_device_count, ctypes.byref(n))
        return n.value

    def stats(self, device=0):
        """Stats of one device: everything the context holds there, and the live bytes of its objects."""
        return self._stats(lib.cuvmm_ctx_stats, device)

    def trim(self, device=-1, keep_bytes=0):
        """Give free physical memory back now, beyond keep_bytes per device (device -1: all)."""
        self._call(lib.cuvmm_ctx_trim, device, keep_bytes)

    def can_access_peer(self, device, peer):
        """Can `device` access memory that lives on `peer` (cuDeviceCanAccessPeer)?"""
        can = ctypes.c_bool()
        self._call(lib.cuvmm_ctx_can_access_peer, device, peer, ctypes.byref(can))
        return can.value

    def add_peer(self, device, peer):
        """Give `peer` access to the memory on `device`: what is mapped now and everything mapped later."""
        self._call(lib.cuvmm_ctx_add_peer, device, peer)

    def pool(self, name, device=0, max_bytes=0, peer_access=None, coarse_bytes=0):
        """A new Pool on this context (peer_access: as Context's; None: the context's). coarse_bytes: allocations
        from this size up take handles as large as fit, so that they go back in few driver calls (for pools whose
        large allocations stay large, such as weights; cuvmm_pool_config.coarse_bytes)."""
        return Pool(self, name, device, max_bytes, peer_access, coarse_bytes)

    def region(self, max_bytes, device=0, granularity=0):
        """A new Region reserving max_bytes on device (granularity 0: the device's)."""
        return Region(self, max_bytes, device, granularity)

    def kv(self, block_bytes, max_blocks, tensors=1, device=0, peer_access=None):
        """A new KV block allocator (peer_access: as pool())."""
        return KV(self, block_bytes, max_blocks, tensors, device, peer_access)

    def inject_fault(self, call, skip=0, count=1, err=ErrorCode.ENOMEM):
        """Make driver calls fail: after `skip` calls of `call` ("map", Call.MAP, ...), `count` fail with
        err (cuvmm.ENOMEM or cuvmm.EDRIVER); count 0 cancels, 0xffffffff fails every later call."""
        self._call(lib.cuvmm_ctx_inject_fault, _call_enum(call), skip, count, _err_code(err))

    def call_count(self, call):
        """How many calls of one driver call this context has made (failed ones included)."""
        return self._get(lib.cuvmm_ctx_call_count, _call_enum(call))

    def __repr__(self):
        if self.closed:
            return "<cuvmm.Context closed>"
        return "<cuvmm.Context backend=%s>" % self.backend


class _Child(_Handle):
    """An object created on a context."""

    def __init__(self, ctx, create, *args):
        if not isinstance(ctx, Context):
            raise TypeError("expected a cuvmm.Context, not %r" % type(ctx).__name__)
        self._ctx = ctx  # keeps the context alive
        h = ctx._enter()
        try:
            out = ctypes.c_void_p()
            check(_checked(create, h, *args, ctypes.byref(out)), create.__name__)
            self._s = _State(type(self)._destroy, ctx._s)
            self._s.h = out.value
            ctx._s.children.add(self._s)
        finally:
            ctx._leave()

    @property
    def context(self):
        return self._ctx

    def stats(self):
        return self._stats(self._stats_fn)


def _sleep_mode(offload):
    return 0 if offload else 1  # CUVMM_SLEEP_OFFLOAD, CUVMM_SLEEP_DISCARD


class Pool(_Child):
    """malloc and free over reserved address space (struct cuvmm_pool). Create with Context.pool()."""

    _destroy = lib.cuvmm_pool_destroy
    _stats_fn = lib.cuvmm_pool_stats

    def __init__(self, ctx, name, device=0, max_bytes=0, peer_access=None, coarse_bytes=0):
        cfg = pool_config("cuvmm_pool_create", device, max_bytes, peer_access, coarse_bytes)
        self.name = name
        self.device = device
        cfg.name = pool_name(name, "cuvmm_pool_create", 31)  # the library copies it
        super().__init__(ctx, lib.cuvmm_pool_create, ctypes.byref(cfg))

    def _what(self):
        return "Pool %r" % self.name

    def malloc(self, nbytes, stream=0):
        """Allocate nbytes; returns the device address (int). With a stream: stream-ordered."""
        out = ctypes.c_void_p()
        s = _stream(stream)
        if s is None:
            self._call(lib.cuvmm_malloc, nbytes, ctypes.byref(out))
        else:
            self._call(lib.cuvmm_malloc_async, nbytes, s, ctypes.byref(out))
        return out.value

    def free(self, ptr, stream=0):
        """Free an address from malloc() (an int or a ctypes pointer); None/0 is a no-op. With a stream:
        stream-ordered. Another kind, or an int that is no address, is EINVAL and frees nothing."""
        s = _stream(stream)
        if s is None:
            self._call(lib.cuvmm_free, _ptr(ptr))
        else:
            self._call(lib.cuvmm_free_async, _ptr(ptr), s)

    def trim(self, keep_bytes=0):
        """Give the pool's free memory back now, keeping about keep_bytes."""
        self._call(lib.cuvmm_pool_trim, keep_bytes)

    def sleep(self, offload=True, stream=0):
        """Give all physical memory back, keeping the addresses; offload: keep the contents in host memory."""
        self._call(lib.cuvmm_pool_sleep, _sleep_mode(offload), _stream(stream))

    def wake(self, stream=0):
        """Map every allocation again at its address (with its contents after an offloading sleep)."""
        self._call(lib.cuvmm_pool_wake, _stream(stream))

    def sleep_prepare(self, nbytes=0):
        """Pin the host copy of the next offloading sleep now (0: what a sleep would copy now), so that the
        sleep runs at the speed of the copy; kept until a sleep uses it or trim gives it back."""
        self._call(lib.cuvmm_pool_sleep_prepare, nbytes)

    def __repr__(self):
        return "<cuvmm.Pool %r device=%d%s>" % (self.name, self.device, " closed" if self.closed else "")


class Region(_Child):
    """A reserved address range mapped on demand (struct cuvmm_region). Create with Context.region()."""

    _destroy = lib.cuvmm_region_destroy
    _stats_fn = lib.cuvmm_region_stats

    def __init__(self, ctx, max_bytes, device=0, granularity=0):
        self.device = device
        if granularity:
            super().__init__(ctx, lib.cuvmm_region_create_ex, device, max_bytes, granularity)
        else:
            super().__init__(ctx, lib.cuvmm_region_create, device, max_bytes)
        # Fixed for the region's life: read once.
        self.base = self._get(lib.cuvmm_region_base)
        self.size = self._get(lib.cuvmm_region_size)
        self.granularity = self._get(lib.cuvmm_region_granularity)

    @property
    def peers(self):
        """The devices with access to the region's mappings, as a set of indices."""
        mask = self._get(lib.cuvmm_region_peers)
        return {i for i in range(64) if mask >> i & 1}

    def map(self, offset, length):
        """Back [offset, offset+length) with physical memory (multiples of the granularity)."""
        self._call(lib.cuvmm_region_map, offset, length)

    def unmap(self, offset, length, stream=0):
        """Stop backing [offset, offset+length) once the work queued on stream has completed."""
        self._call(lib.cuvmm_region_unmap, offset, length, _stream(stream))

    def resize(self, nbytes, stream=0):
        """Make the mapped part exactly [0, round_up(nbytes)), keeping the contents that stay."""
        self._call(lib.cuvmm_region_resize, nbytes, _stream(stream))

    def sleep(self, offload=True, stream=0):
        self._call(lib.cuvmm_region_sleep, _sleep_mode(offload), _stream(stream))

    def wake(self, stream=0):
        self._call(lib.cuvmm_region_wake, _stream(stream))

    def sleep_prepare(self, nbytes=0):
        """Pin the host copy of the next offloading sleep now (0: the mapped bytes)."""
        self._call(lib.cuvmm_region_sleep_prepare, nbytes)

    def __repr__(self):
        if self.closed:
            return "<cuvmm.Region closed>"
        return "<cuvmm.Region base=0x%x size=%d granularity=%d>" % (self.base, self.size, self.granularity)


class KV(_Child):
    """Paged-attention KV blocks (struct cuvmm_kv). Create with Context.kv().

    Block b of tensor t lives at kv.tensor(t) + b * kv.block_bytes (kv.address(t, b)).
    """

    _destroy = lib.cuvmm_kv_destroy
    _stats_fn = lib.cuvmm_kv_stats

    def __init__(self, ctx, block_bytes, max_blocks, tensors=1, device=0, peer_access=None):
        cfg = KVConfig()
        lib.cuvmm_kv_config_init(ctypes.byref(cfg))
        for field, value in (("device", device), ("block_bytes", block_bytes), ("max_blocks", max_blocks),
                             ("tensors", tensors),
                             ("peer_access", _object_peers(peer_access, device, "cuvmm_kv_create"))):
            _set(cfg, field, value, "cuvmm_kv_create")
        self.device, self.block_bytes, self.max_blocks, self.tensors = device, block_bytes, max_blocks, tensors
        super().__init__(ctx, lib.cuvmm_kv_create, ctypes.byref(cfg))

    def tensor(self, i):
        """The device address of block 0 of tensor i."""
        if not 0 <= i < self.tensors:
            raise IndexError("tensor %d out of range(%d)" % (i, self.tensors))
        return self._get(lib.cuvmm_kv_tensor, i)

    def address(self, tensor, block):
        """The device address of one block of one tensor."""
        if isinstance(block, bool) or not isinstance(block, int):
            raise TypeError("block must be an int, not %r" % type(block).__name__)
        if not 0 <= block < self.max_blocks:
            raise IndexError("block %d out of range(%d)" % (block, self.max_blocks))
        return self.tensor(tensor) + block * self.block_bytes

    def _count(self, n, function):
        if isinstance(n, bool) or not isinstance(n, int):
            raise Error(ErrorCode.EINVAL, function, "%r is not an integer" % (n,))
        return n

    def alloc(self, n):
        """Allocate n block ids (all or nothing), backed in every tensor; returns a list of ints."""
        if not 0 < self._count(n, "cuvmm_kv_alloc") <= 0xFFFFFFFF:  # the C call rejects 0 too
            raise Error(ErrorCode.EINVAL, "cuvmm_kv_alloc", "n=%d" % n)
        if n > self.max_blocks:  # before an array of n ids is made: the C call could never grant it
            raise Error(ErrorCode.ENOSPC, "cuvmm_kv_alloc", "n=%d > max_blocks=%d" % (n, self.max_blocks))
        ids = (ctypes.c_uint32 * n)()
        self._call(lib.cuvmm_kv_alloc, n, ids)
        return list(ids)

    def free(self, ids, stream=0):
        """Free block ids (each allocated, each once, else nothing is freed)."""
        ids = list(ids)
        if not ids or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i <= 0xFFFFFFFF for i in ids):
            raise Error(ErrorCode.EINVAL, "cuvmm_kv_free", "ids=%r" % (ids[:8],))
        arr = (ctypes.c_uint32 * len(ids))(*ids)
        self._call(lib.cuvmm_kv_free, len(ids), arr, _stream(stream))

    def compact(self, max_moves):
        """Propose moves that empty the sparsest pages: a list of (from, to) block ids. The `to` blocks are
        allocated for the caller: copy, then free the `from` blocks (or free the `to` ones to drop the plan)."""
        if self._count(max_moves, "cuvmm_kv_compact") <= 0:
            return []
        # A move per block in use at most: the array is sized by those, not by the argument or max_blocks.
        in_use = self.stats().live_bytes // (self.block_bytes * self.tensors)
        max_moves = max(1, min(max_moves, in_use, 0xFFFFFFFF))  # 1: the call still says ESTATE when asleep
        moves = (KVMove * max_moves)()
        n = ctypes.c_uint32()
        self._call(lib.cuvmm_kv_compact, max_moves, moves, ctypes.byref(n))
        return [(m.from_, m.to) for m in moves[:n.value]]

    def __repr__(self):
        return "<cuvmm.KV block_bytes=%d max_blocks=%d tensors=%d%s>" % (
            self.block_bytes, self.max_blocks, self.tensors, " closed" if self.closed else "")
