"""cuvmm: GPU memory through the CUDA driver's virtual memory API, from Python (ctypes, standard library only).

    import cuvmm
    with cuvmm.Context(backend="host") as ctx, ctx.pool("activations") as pool:
        p = pool.malloc(1 << 20)
        pool.free(p)
        print(ctx.stats(0).held_bytes)

The library is found through $CUVMM_LIBRARY (a path), else next to this package's install, else in the
source tree's build/lib, else by the system loader. See doc/python.md.
"""

import atexit as _atexit
import ctypes as _ctypes
import threading as _threading

from ._lib import LOG_FN as _LOG_FN, lib as _c, path as library_path
from ._errors import (Backend, Busy, Call, ClosedError, DriverError, Error, ErrorCode, InvalidArgument,
                      LogLevel, NoDevice, NoDriver, NoSpace, NotSupported, OutOfMemory, StateError,
                      call_name, err_name, last_driver_error, strerror)
from ._objects import KV, Context, Pool, Region, Stats

OK = ErrorCode.OK
EINVAL = ErrorCode.EINVAL
ENOMEM = ErrorCode.ENOMEM
ENOSPC = ErrorCode.ENOSPC
ENODRIVER = ErrorCode.ENODRIVER
ENODEV = ErrorCode.ENODEV
ENOTSUP = ErrorCode.ENOTSUP
EBUSY = ErrorCode.EBUSY
ESTATE = ErrorCode.ESTATE
EDRIVER = ErrorCode.EDRIVER

__all__ = [
    "Context", "Pool", "Region", "KV", "Stats",
    "Error", "InvalidArgument", "OutOfMemory", "NoSpace", "NoDriver", "NoDevice", "NotSupported", "Busy",
    "StateError", "DriverError", "ClosedError",
    "ErrorCode", "Backend", "Call", "LogLevel",
    "OK", "EINVAL", "ENOMEM", "ENOSPC", "ENODRIVER", "ENODEV", "ENOTSUP", "EBUSY", "ESTATE", "EDRIVER",
    "version", "strerror", "err_name", "call_name", "last_driver_error", "set_log_callback", "library_path",
]


def version():
    """The C library's version, "MAJOR.MINOR.PATCH"."""
    return _c.cuvmm_version().decode()


__version__ = version()

# The ctypes callback object must outlive every call the library may make to it; the C side swaps the sink
# under a lock, so once cuvmm_set_log_callback() returns the old one is no longer called.
_log_lock = _threading.Lock()
_log_cb = None


def _log_level(level):
    """A LogLevel from a LogLevel, its int, or a name as CUVMM_LOG takes it ("warn" or "warning", any case)."""
    if isinstance(level, str):
        name = level.upper()
        try:
            return LogLevel["WARN" if name == "WARNING" else name]
        except KeyError:
            raise ValueError("unknown log level %r; one of error, warn, info, debug" % level) from None
    if isinstance(level, bool) or not isinstance(level, int):
        raise TypeError("a log level is a LogLevel, an int or a name, not %r" % type(level).__name__)
    return LogLevel(level)


def set_log_callback(fn, level=LogLevel.WARN):
    """Send the library's messages to fn(level: LogLevel, message: str) instead of stderr; None restores
    stderr. Process-wide. Exceptions raised by fn are ignored. level: the least severe level passed on."""
    global _log_cb
    if fn is not None and not callable(fn):
        raise TypeError("set_log_callback: fn must be callable or None, not %r" % type(fn).__name__)
    with _log_lock:
        if fn is None:
            _c.cuvmm_set_log_callback(_LOG_FN(), None, LogLevel.WARN)
            _log_cb = None
            return

        def sink(lvl, msg, _user):
            try:
                fn(LogLevel(lvl), msg.decode(errors="replace"))
            except BaseException:  # an exception must not unwind into C
                pass

        cb = _LOG_FN(sink)
        _c.cuvmm_set_log_callback(cb, None, _log_level(level))
        _log_cb = cb  # the previous callback may go now: the library no longer calls it


def _reset_log_callback():
    # The background thread may log while the interpreter is torn down: stop calling into Python first.
    if _log_cb is not None:
        set_log_callback(None)


_atexit.register(_reset_log_callback)
