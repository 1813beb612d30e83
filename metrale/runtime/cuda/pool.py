"""Device memory: one up-front block, carved into named regions of bump-allocated arrays.

Owns: the single `cuMemAlloc` of the process's engine memory (`DevicePool`), its split into
named regions (e.g. weights, kv, activations), each an `Arena`, and the KV sizing arithmetic.
Invariants: every sub-allocation starts on a 256-byte boundary and lies inside its region;
an `Arena` is pure address arithmetic, so after `reset()` the same sequence of requests yields
the same addresses (what CUDA graph replay relies on); nothing is freed one by one — a region
is reset as a whole, the block is freed by `DevicePool.close()` (arrays handed out dangle after).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import cu, driver, ensure_context

ALIGN = 256


def align_up(n: int, align: int = ALIGN) -> int:
    return -(-n // align) * align


def align_down(n: int, align: int = ALIGN) -> int:
    return n // align * align


@dataclass(frozen=True)
class RegionUsage:
    capacity: int
    used: int
    peak: int


class Arena:
    """Bump allocator over `[base, base + capacity)`.

    `reserve(nbytes)` returns an address; `alloc(shape, dtype)` wraps one in an array through
    `make_array(address, shape, dtype)` (a Numba device array in a `DevicePool`).
    """

    def __init__(self, name: str, base: int, capacity: int,
                 make_array: Callable[[int, tuple[int, ...], np.dtype], Any] | None = None) -> None:
        if capacity < 0:
            raise ValueError(f"arena {name!r}: negative capacity {capacity}")
        self.name, self.base, self.capacity = name, base, capacity
        self._make_array = make_array
        self._top = 0  # offset of the first free byte
        self._peak = 0

    @property
    def used(self) -> int:
        return self._top

    @property
    def peak(self) -> int:
        return self._peak

    @property
    def free(self) -> int:
        return self.capacity - self._top

    def usage(self) -> RegionUsage:
        return RegionUsage(self.capacity, self._top, self._peak)

    def reserve(self, nbytes: int) -> int:
        """Address of `nbytes` fresh bytes, 256-byte aligned (absolute, not just the offset)."""
        if nbytes < 0:
            raise ValueError(f"arena {self.name!r}: negative size {nbytes}")
        start = align_up(self.base + self._top) - self.base
        end = start + nbytes
        if end > self.capacity:
            raise MemoryError(f"arena {self.name!r} out of memory: {nbytes} B requested, "
                              f"{self.capacity - min(start, self.capacity)} B free of {self.capacity} B")
        self._top = end
        self._peak = max(self._peak, end)
        return self.base + start

    def alloc(self, shape: int | tuple[int, ...], dtype: Any = np.float32) -> Any:
        """A C-contiguous array of `shape` and `dtype` at the next aligned address."""
        if self._make_array is None:
            raise TypeError(f"arena {self.name!r} hands out addresses only (no make_array)")
        shape = (int(shape),) if np.isscalar(shape) else tuple(int(s) for s in shape)
        dtype = np.dtype(dtype)
        addr = self.reserve(math.prod(shape) * dtype.itemsize)
        return self._make_array(addr, shape, dtype)

    def upload(self, host: np.ndarray, stream: Any = 0) -> Any:
        """Allocate an array like `host` and copy `host` into it (on Numba `stream`, or synchronously)."""
        host = np.ascontiguousarray(host)
        arr = self.alloc(host.shape, host.dtype)
        arr.copy_to_device(host, stream=stream)
        return arr

    def mark(self) -> int:
        """The current top; `release(mark)` rewinds to it (scratch inside a step)."""
        return self._top

    def release(self, mark: int) -> None:
        if not 0 <= mark <= self._top:
            raise ValueError(f"arena {self.name!r}: bad mark {mark} (top {self._top})")
        self._top = mark

    def reset(self) -> None:
        """Forget every allocation; the next requests get the same addresses as the last time."""
        self._top = 0

    def __repr__(self) -> str:
        return (f"Arena({self.name!r}, base=0x{self.base:x}, used={self.used}, "
                f"peak={self.peak}, capacity={self.capacity})")


def plan_regions(total: int, regions: Mapping[str, int | None]) -> dict[str, tuple[int, int]]:
    """`{name: (offset, size)}` laying `regions` out in order, each start 256-aligned.

    Sizes are bytes (rounded up to 256); at most one region may be None: it gets the rest.
    """
    rest = [name for name, size in regions.items() if size is None]
    if len(rest) > 1:
        raise ValueError(f"only one region may take the rest, got {rest}")
    fixed = sum(align_up(int(s)) for s in regions.values() if s is not None)
    if fixed > total:
        raise ValueError(f"regions need {fixed} B, the pool has {total} B: "
                         + ", ".join(f"{n}={s}" for n, s in regions.items()))
    plan, offset = {}, 0
    for name, size in regions.items():
        size = align_down(total - fixed) if size is None else align_up(int(size))
        plan[name] = (offset, size)
        offset += size
    return plan


def kv_pool_bytes(free: int, total: int, utilization: float, reserved: int = 0) -> int:
    """Bytes left for the KV pool when the process may use `utilization * total` of the device.

    vLLM's gpu_memory_utilization: the budget is `utilization * total`, minus what is already in
    use (`total - free`: weights, contexts, other processes), minus `reserved` (what is still to
    be allocated: activations, graph memory, workspace). Rounded down to 256; never negative.
    """
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"utilization must be in (0, 1], got {utilization}")
    if not 0 <= free <= total:
        raise ValueError(f"free ({free}) must be within [0, total={total}]")
    budget = int(utilization * total) - (total - free) - int(reserved)
    return max(0, align_down(budget))


def free_device_memory() -> tuple[int, int]:
    """(free, total) bytes of the current device (`cuMemGetInfo` in Numba's context)."""
    ensure_context()
    free, total = cu("cuMemGetInfo")
    return int(free), int(total)


def _free_block(ptr: int) -> None:
    try:
        driver().cuMemFree(driver().CUdeviceptr(ptr))
    except Exception:  # the context may already be gone at interpreter exit
        pass


class DevicePool:
    """One `cuMemAlloc` of `nbytes`, split into named regions (`Arena`s) of Numba device arrays.

    >>> pool = DevicePool(8 << 30, {"weights": w_bytes, "activations": 256 << 20, "kv": None})
    >>> wq = pool["weights"].upload(host_wq)          # stays for the process
    >>> k = pool.alloc("kv", (L, blocks, bs, h, d), np.uint16)
    >>> pool["activations"].reset(); x = pool.alloc("activations", (T, H))   # per step
    """

    def __init__(self, nbytes: int, regions: Mapping[str, int | None]) -> None:
        self._ctx = ensure_context()
        plan = plan_regions(int(nbytes), regions)
        self.nbytes = int(nbytes)
        self.base = int(cu("cuMemAlloc", self.nbytes))
        self._finalizer = weakref.finalize(self, _free_block, self.base)
        self._finalizer.atexit = False
        self.regions = {name: Arena(name, self.base + off, size, self._make_array)
                        for name, (off, size) in plan.items()}

    def _make_array(self, addr: int, shape: tuple[int, ...], dtype: np.dtype) -> Any:
        from numba.cuda.cudadrv.devicearray import DeviceNDArray
        from numba.cuda.cudadrv.driver import MemoryPointer

        if not self._finalizer.alive:
            raise RuntimeError("DevicePool is closed")
        nbytes = math.prod(shape) * dtype.itemsize
        strides = tuple(math.prod(shape[i + 1:]) * dtype.itemsize for i in range(len(shape)))
        # owner=self: the arrays (and their slices) keep the pool alive; close() frees anyway.
        mem = MemoryPointer(self._ctx, driver().CUdeviceptr(addr), nbytes, owner=self)
        return DeviceNDArray(shape, strides, dtype, gpu_data=mem)

    def __getitem__(self, name: str) -> Arena:
        try:
            return self.regions[name]
        except KeyError:
            raise KeyError(f"no region {name!r}; regions: {list(self.regions)}") from None

    def alloc(self, region: str, shape: int | tuple[int, ...], dtype: Any = np.float32) -> Any:
        return self[region].alloc(shape, dtype)

    def usage(self) -> dict[str, RegionUsage]:
        """Bytes used now and at peak, per region."""
        return {name: arena.usage() for name, arena in self.regions.items()}

    @property
    def used(self) -> int:
        return sum(a.used for a in self.regions.values())

    @property
    def peak(self) -> int:
        """Sum of the regions' peaks (an upper bound of the block ever in use)."""
        return sum(a.peak for a in self.regions.values())

    def close(self) -> None:
        """Free the block. Arrays handed out must not be used afterwards."""
        self._finalizer()

    def __enter__(self) -> DevicePool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        parts = ", ".join(f"{n}={u.used}/{u.capacity} (peak {u.peak})" for n, u in self.usage().items())
        return f"DevicePool(0x{self.base:x}, {self.nbytes} B: {parts})"
