"""Error codes, the exception classes raised for them, and the enums of <cuvmm.h>."""

import enum

from ._lib import lib


class ErrorCode(enum.IntEnum):
    """enum cuvmm_error (CUVMM_ERRNO_MAP in <cuvmm.h>)."""
    OK = 0
    EINVAL = -1
    ENOMEM = -2
    ENOSPC = -3
    ENODRIVER = -4
    ENODEV = -5
    ENOTSUP = -6
    EBUSY = -7
    ESTATE = -8
    EDRIVER = -9


class Backend(enum.IntEnum):
    """enum cuvmm_backend."""
    AUTO = 0
    CUDA = 1
    HOST = 2


class Call(enum.IntEnum):
    """enum cuvmm_call: the driver calls that inject_fault() can make fail."""
    RESERVE = 0
    UNRESERVE = 1
    CREATE = 2
    RELEASE = 3
    MAP = 4
    UNMAP = 5
    SET_ACCESS = 6
    EVENT_CREATE = 7
    EVENT_RECORD = 8
    EVENT_QUERY = 9
    EVENT_SYNC = 10
    DEVICE_SYNC = 11
    STREAM_WAIT = 12
    HOST_REGISTER = 13
    COPY = 14
    CAPTURE_INFO = 15
    PEER_QUERY = 16


class LogLevel(enum.IntEnum):
    """enum cuvmm_log_level."""
    ERROR = 0
    WARN = 1
    INFO = 2
    DEBUG = 3


def _c_int(value, what):
    """value for a C int argument of a name lookup: an int (not a bool); one outside C's int range names
    nothing, so it becomes INT_MIN, which names nothing either (ctypes would wrap 2**32 - 1 to -1)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError("%s must be an int, not %r" % (what, type(value).__name__))
    return value if -(1 << 31) <= value < 1 << 31 else -(1 << 31)


def strerror(code):
    """The library's message for an error code ("invalid argument"); "unknown error" for any other int."""
    return lib.cuvmm_strerror(_c_int(code, "an error code")).decode()


def call_name(call):
    """The driver function behind a Call ("cuMemMap"); "?" for any other int."""
    return lib.cuvmm_call_name(_c_int(call, "a driver call")).decode()


def err_name(code):
    """The name of an error code ("CUVMM_EINVAL"); "CUVMM_E?" for any other int."""
    return lib.cuvmm_err_name(_c_int(code, "an error code")).decode()


def last_driver_error():
    """The CUresult of this thread's last failing driver call, 0 if none failed yet."""
    return lib.cuvmm_last_driver_error()


class Error(Exception):
    """A cuvmm call returned a negative code.

    .code is the int (cuvmm.EINVAL, ...), .name the C name ("CUVMM_EINVAL"), .function the C function
    that failed; str() is the library's message, with the function.
    """

    def __new__(cls, code, function=None, detail=None):
        # Error(code) builds the subclass for the code, so that `except cuvmm.OutOfMemory` catches it.
        if cls is Error:
            cls = _BY_CODE.get(int(code), Error)
        return Exception.__new__(cls)  # MemoryError's own __new__ refuses a subclass with a second base

    def __init__(self, code, function=None, detail=None):
        self.code = int(code)
        self.name = err_name(self.code)
        self.function = function
        msg = strerror(self.code)
        if detail:
            msg = "%s: %s" % (detail, msg)
        if function:
            msg = "%s: %s" % (function, msg)
        super().__init__(msg)
        self.args = (self.code, function, detail)
        self._msg = msg

    def __str__(self):
        return self._msg

    def __reduce__(self):
        return (Error, self.args)


class InvalidArgument(Error, ValueError):
    """CUVMM_EINVAL: a bad argument (zero size, misaligned offset, double free, a closed object)."""


class OutOfMemory(Error, MemoryError):
    """CUVMM_ENOMEM: the device or device_limit_bytes is full."""


class NoSpace(Error):
    """CUVMM_ENOSPC: no room left in the reserved address range."""


class NoDriver(Error):
    """CUVMM_ENODRIVER: no CUDA driver could be loaded."""


class NoDevice(Error):
    """CUVMM_ENODEV: no such device, or it lacks virtual memory management."""


class NotSupported(Error):
    """CUVMM_ENOTSUP: not supported on this device, driver or backend."""


class Busy(Error):
    """CUVMM_EBUSY: the object still has live allocations or pending work."""


class StateError(Error):
    """CUVMM_ESTATE: wrong state for this call (e.g. malloc on a sleeping pool)."""


class DriverError(Error):
    """CUVMM_EDRIVER: another driver failure; .driver_error is the CUresult."""

    def __init__(self, code, function=None, detail=None):
        self.driver_error = last_driver_error()
        super().__init__(code, function, detail)


class ClosedError(InvalidArgument):
    """An object was used after close() (code CUVMM_EINVAL, as the C API's NULL object)."""

    def __init__(self, what):
        super().__init__(ErrorCode.EINVAL, None, "%s is closed" % what)
        self.what = what

    def __reduce__(self):
        return (ClosedError, (self.what,))


_BY_CODE = {
    ErrorCode.EINVAL: InvalidArgument,
    ErrorCode.ENOMEM: OutOfMemory,
    ErrorCode.ENOSPC: NoSpace,
    ErrorCode.ENODRIVER: NoDriver,
    ErrorCode.ENODEV: NoDevice,
    ErrorCode.ENOTSUP: NotSupported,
    ErrorCode.EBUSY: Busy,
    ErrorCode.ESTATE: StateError,
    ErrorCode.EDRIVER: DriverError,
}


def check(rc, function):
    """Raise the Error for a negative return code of `function`; return rc otherwise."""
    if rc < 0:
        raise Error(rc, function)
    return rc
