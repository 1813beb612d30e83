"""Streams and events through cuda-python, usable by Numba kernel launches.

Owns: `Stream` (a cuda-python stream, non-blocking by default so work on the legacy default
stream never joins it, e.g. during graph capture) and `Event` (record / wait / time).
A Numba kernel runs on a `Stream` with `kernel[grid, block, stream.numba](...)`; `stream.numba`
is `numba.cuda.external_stream(handle)`, made once, and Numba never destroys it.
"""

from __future__ import annotations

import weakref
from typing import Any

from .errors import check, cu, driver, ensure_context


def _destroy(call: str, handle: Any) -> None:
    try:
        getattr(driver(), call)(handle)
    except Exception:  # the context may already be gone at interpreter exit
        pass


class Event:
    """A CUDA event. `timing=False` makes record/wait cheaper when no time is read."""

    def __init__(self, timing: bool = True) -> None:
        ensure_context()
        flags = driver().CUevent_flags
        flag = flags.CU_EVENT_DEFAULT if timing else flags.CU_EVENT_DISABLE_TIMING
        self.handle = cu("cuEventCreate", int(flag))
        self._finalizer = weakref.finalize(self, _destroy, "cuEventDestroy", self.handle)
        self._finalizer.atexit = False

    def record(self, stream: Stream) -> Event:
        cu("cuEventRecord", self.handle, stream.handle)
        return self

    def synchronize(self) -> None:
        cu("cuEventSynchronize", self.handle)

    def query(self) -> bool:
        """True when the work before the record has finished."""
        result = driver().cuEventQuery(self.handle)
        err = result[0] if isinstance(result, tuple) else result
        if err == driver().CUresult.CUDA_ERROR_NOT_READY:
            return False
        check("cuEventQuery", result)
        return True

    def elapsed_ms(self, end: Event) -> float:
        """Milliseconds from this event to `end` (both recorded, `end` complete)."""
        return float(cu("cuEventElapsedTime", self.handle, end.handle))

    def close(self) -> None:
        self._finalizer()


class Stream:
    """A CUDA stream created with cuda-python, shared with Numba as an external stream."""

    def __init__(self, non_blocking: bool = True, priority: int = 0) -> None:
        ensure_context()
        flags = driver().CUstream_flags
        flag = flags.CU_STREAM_NON_BLOCKING if non_blocking else flags.CU_STREAM_DEFAULT
        self.handle = cu("cuStreamCreateWithPriority", int(flag), int(priority))
        self._finalizer = weakref.finalize(self, _destroy, "cuStreamDestroy", self.handle)
        self._finalizer.atexit = False
        self._numba: Any = None

    @property
    def ptr(self) -> int:
        return int(self.handle)

    @property
    def numba(self) -> Any:
        """This stream as a Numba stream, for `kernel[grid, block, stream.numba](...)`."""
        if self._numba is None:
            from numba import cuda

            self._numba = cuda.external_stream(self.ptr)
        return self._numba

    def __cuda_stream__(self) -> tuple[int, int]:  # the CUDA stream protocol (cuda.core, CuPy)
        return (0, self.ptr)

    def record(self, event: Event | None = None) -> Event:
        """Record `event` (a new timing event if None) on this stream and return it."""
        return (event or Event()).record(self)

    def wait_event(self, event: Event) -> None:
        """Work queued on this stream after this call waits for `event`."""
        cu("cuStreamWaitEvent", self.handle, event.handle, 0)

    def wait_stream(self, other: Stream) -> None:
        """Work queued here from now on waits for all work queued on `other` so far."""
        self.wait_event(other.record(Event(timing=False)))

    def synchronize(self) -> None:
        cu("cuStreamSynchronize", self.handle)

    def is_capturing(self) -> bool:
        status = cu("cuStreamIsCapturing", self.handle)
        return status != driver().CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE

    def close(self) -> None:
        self._numba = None
        self._finalizer()

    def __repr__(self) -> str:
        return f"Stream(0x{self.ptr:x})"
