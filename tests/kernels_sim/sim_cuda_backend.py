"""The whole CudaBackend under the simulator: the driver-level pieces it calls (its stream and
events, the one cuMemAlloc pool, free memory, the async copies and memsets through `cu`) replaced
by host stand-ins, so its real __init__, memory plan, metadata upload, forward and fetches run on
simulator arrays. Simulator device arrays wrap host arrays, so a "device pointer" is the host
address of the array's data and the driver copies become ctypes.memmove. CUDA graphs, cuBLASLt,
PDL and the parallel compile stay off (the settings in SIM_LEVERS).

patch_products replaces the matrix products (gemm.linear, linear_residual, gemv with its
prologues and epilogues) by host float64 stand-ins with the same contracts: the simulator runs
every thread of a GEMM launch as a Python thread, which makes a whole forward far too slow for CI. Their kernels have their own simulator
tests (test_gemm_sim, test_gemv_fused_sim); every other kernel of a forward runs simulated.

Kernel launches of several threads (tensor-parallel ranks as threads) are serialized by one lock:
the simulator runs one kernel at a time (a module-level kernel context) and the patched block
pool (conftest.py) is shared by every launch of one block size; `kernel[grid, block]` sets fields
of the shared kernel object, so each configuration gets a copy."""
from __future__ import annotations

import copy
import ctypes
import threading

import numpy as np
from numba import cuda

from metrale.runtime.cuda.pool import Arena, plan_regions

SIM_LEVERS = ["levers.cuda_graphs=false", "levers.gemm_library=numba", "levers.compile_workers=0", "levers.pdl=false",
              "levers.decode_attention_kernel=fma", "levers.prefill_attention_kernel=fma", "levers.overlap=false",
              "levers.carry_norm_sums=false"]


def host_ptr(a) -> int:
    """The address a simulator array's data lives at (its stand-in device pointer)."""
    return a._ary.__array_interface__["data"][0]


class SimStream:
    handle = ptr = numba = 0

    def synchronize(self) -> None:
        pass

    def is_capturing(self) -> bool:
        return False


class SimEvent:
    def __init__(self, timing: bool = True) -> None:
        pass

    def record(self, stream) -> "SimEvent":
        return self

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class SimPool:
    """DevicePool's interface: named regions whose arrays are zeroed simulator arrays."""

    def __init__(self, nbytes: int, regions: dict) -> None:
        self.nbytes = int(nbytes)
        self.regions = {name: Arena(name, off, size, self._make) for name, (off, size) in plan_regions(self.nbytes, regions).items()}

    @staticmethod
    def _make(addr: int, shape: tuple, dtype) -> object:
        return cuda.to_device(np.zeros(shape, dtype))

    def __getitem__(self, name: str) -> Arena:
        return self.regions[name]

    def alloc(self, region: str, shape, dtype=np.float32):
        return self.regions[region].alloc(shape, dtype)

    def usage(self) -> dict:
        return {name: a.usage() for name, a in self.regions.items()}

    def close(self) -> None:
        pass


def sim_cu(name: str, *args) -> None:
    """The driver calls CudaBackend makes on its hot path, on host memory."""
    if name in ("cuMemcpyHtoDAsync", "cuMemcpyDtoHAsync", "cuMemcpyDtoDAsync"):
        dst, src, nbytes, _ = args
        ctypes.memmove(int(dst), int(src), int(nbytes))
    elif name == "cuMemsetD32Async":
        ptr, value, count, _ = args
        (ctypes.c_uint32 * int(count)).from_address(int(ptr))[:] = [int(value)] * int(count)
    else:
        raise NotImplementedError(f"the simulator harness has no {name}")


def sim_copy_rows(dst: int, src: int, pitch: int, width: int, rows: int, stream_handle) -> None:
    for r in range(rows):
        ctypes.memmove(dst + r * pitch, src + r * pitch, width)


def _host(a) -> np.ndarray:
    return a._ary if hasattr(a, "_ary") else np.asarray(a)


def _product(x, w, bias) -> np.ndarray:
    from kernels_numba.gemm import linear_ref
    return linear_ref(_host(x), _host(w), None if bias is None else _host(bias))


def host_linear(x, w, out, bias=None, stream=None, **_) -> None:
    _host(out)[...] = _product(x, w, bias)


def host_linear_residual(x, w, out, bias=None, stream=None, **_) -> None:
    o = _host(out)
    o[...] = o + _product(x, w, bias)


def host_gemv(x, w, out, *, prologue="plain", norm_w=None, eps=1e-6, bias=None, accumulate=False, stream=None,
              path=None, ss_in=None, ss_out=None, glu=False, rope=None, interleaved=False, prefetch=False) -> None:
    """gemm.gemv's contract on the host; the RoPE / K-V store epilogue through the real
    qkv_rope_store kernel on the product's row."""
    from kernels_numba import qkv
    from kernels_numba.gemm import gemv_ref
    assert ss_in is None and ss_out is None, "carried norm sums: not in the stand-in (levers.carry_norm_sums=false)"
    y = gemv_ref(_host(x), _host(w), prologue, None if norm_w is None else _host(norm_w), eps,
                 None if bias is None else _host(bias))
    o = _host(out)
    if glu:
        i = y.shape[1] // 2
        g = y[:, :i]
        o[...] = g / (1.0 + np.exp(-g)) * y[:, i:]
    elif rope is not None:
        positions, cos, sin, slots, k_cache, v_cache = rope
        hd = k_cache.shape[3]
        q = out.reshape(1, out.shape[1] // hd, hd)
        qkv.qkv_rope_store(cuda.to_device(y.astype(np.float32)), positions, cos, sin, slots, q, k_cache, v_cache,
                           interleaved=interleaved)
    else:
        o[...] = (o + y) if accumulate else y


def patch_products(monkeypatch) -> None:
    """gemm's products -> the host stand-ins above (for every caller in this process)."""
    from kernels_numba import gemm
    monkeypatch.setattr(gemm, "linear", host_linear)
    monkeypatch.setattr(gemm, "linear_residual", host_linear_residual)
    monkeypatch.setattr(gemm, "gemv", host_gemv)


_LAUNCH = threading.RLock()


def patch_backend(monkeypatch) -> None:
    """Route metrale.runtime.cuda_backend's driver calls to the stand-ins above, and serialize
    kernel launches across threads."""
    from numba.cuda.simulator import kernel as sim_kernel
    from metrale.runtime import cuda_backend as cb
    monkeypatch.setattr(cb, "_ptr", host_ptr)
    monkeypatch.setattr(cb, "Stream", SimStream)
    monkeypatch.setattr(cb, "Event", SimEvent)
    monkeypatch.setattr(cb, "DevicePool", SimPool)
    monkeypatch.setattr(cb, "free_device_memory", lambda: (8 << 30, 16 << 30))
    monkeypatch.setattr(cb, "cu", sim_cu)
    monkeypatch.setattr(cb, "copy_rows_htod", sim_copy_rows)
    from metrale.sampling import device as sampling_device      # the Engine's device sampling pipeline
    for name, value in (("Event", SimEvent), ("cu", sim_cu), ("_ptr", host_ptr)):
        if hasattr(sampling_device, name):
            monkeypatch.setattr(sampling_device, name, value)
    launch, configure = sim_kernel.FakeCUDAKernel.__call__, sim_kernel.FakeCUDAKernel.__getitem__

    def serialized(self, *args):
        if self._device:                     # a device function, called by a simulated thread
            return launch(self, *args)
        with _LAUNCH:
            return launch(self, *args)

    def configured(self, configuration):      # kernel[grid, block] sets fields: a copy per launch
        return configure(copy.copy(self), configuration)
    monkeypatch.setattr(sim_kernel.FakeCUDAKernel, "__call__", serialized)
    monkeypatch.setattr(sim_kernel.FakeCUDAKernel, "__getitem__", configured)
