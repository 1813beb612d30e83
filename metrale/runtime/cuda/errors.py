"""Checked access to the CUDA driver API through cuda-python.

Owns: the lazy import of `cuda.bindings.driver` (nothing here touches the driver at import
time, so the package imports on a machine without a GPU), `CudaError`, and `cu(name, *args)`,
the one way this package calls the driver. Invariant: every driver call's CUresult is checked;
a failure raises `CudaError` naming the call, the error's name and its description.
"""

from __future__ import annotations

import functools
from typing import Any


@functools.cache
def driver() -> Any:
    """The cuda-python driver module (`cuda.bindings.driver`; `cuda.cuda` on old cuda-python)."""
    try:
        from cuda.bindings import driver as drv
    except ImportError:  # cuda-python < 12.6
        from cuda import cuda as drv
    return drv


def _describe(code: int) -> tuple[str, str]:
    """(name, description) of a CUresult; falls back gracefully when there is no driver."""
    try:
        err = driver().CUresult(code)
    except Exception:
        return f"CUresult {code}", ""
    name = err.name
    try:
        rc, msg = driver().cuGetErrorString(err)
        if int(rc) == 0 and msg:
            return name, msg.decode() if isinstance(msg, bytes) else str(msg)
    except Exception:  # no driver library: name only
        pass
    return name, ""


class CudaError(RuntimeError):
    """A CUDA driver call failed. `call` is the driver function, `code` the CUresult value."""

    def __init__(self, call: str, code: int, hint: str = "") -> None:
        self.call, self.code = call, int(code)
        self.name, self.description = _describe(self.code)
        msg = f"{call} failed: {self.name} ({self.code})"
        if self.description:
            msg += f": {self.description}"
        if hint:
            msg += f" [{hint}]"
        super().__init__(msg)


def check(call: str, result: Any) -> Any:
    """Check a cuda-python result `(err, *values)` (or a bare `err`); return the values.

    No values -> None, one value -> that value, several -> the tuple.
    """
    if isinstance(result, tuple):
        err, values = result[0], result[1:]
    else:
        err, values = result, ()
    if int(err) != 0:
        raise CudaError(call, int(err))
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def cu(name: str, *args: Any) -> Any:
    """Call driver function `name` with `args`, checked: `cu("cuMemAlloc", n)` -> CUdeviceptr."""
    return check(name, getattr(driver(), name)(*args))


def ensure_context() -> Any:
    """Make Numba's context (the device's primary context) current and return it.

    Everything in this package lives in Numba's context, so Numba kernels can use the memory,
    streams and graphs made here.
    """
    from numba import cuda

    return cuda.current_context()
