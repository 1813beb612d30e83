"""The real (non-simulator) path of the sampling kernels compiles for sm_90: Philox in 32/64-bit integer
ops, no float64 arithmetic, no local memory, warp-shuffle reductions.

compile_ptx of a kernel that calls `@cuda.jit(device=True)` helpers asks the current device for its
compute capability; without a GPU the test reports sm_90 by patching
numba.cuda.dispatcher.get_current_device (the same workaround as tests/test_kernels_ptx.py)."""
import re

import pytest
from numba import cuda, types

from kernels_numba.bf16 import SIMULATOR

pytestmark = pytest.mark.skipif(SIMULATOR, reason="compile_ptx needs the real CUDA target")

F32_1, I32_1 = types.Array(types.float32, 1, "C"), types.Array(types.int32, 1, "C")
F32_2, I32_2, U32_2 = (types.Array(types.float32, 2, "C"), types.Array(types.int32, 2, "C"),
                       types.Array(types.uint32, 2, "C"))


class _SM90:
    compute_capability = (9, 0)


@pytest.fixture(autouse=True)
def no_gpu_needed(monkeypatch):
    import numba.cuda.dispatcher as dispatcher

    monkeypatch.setattr(dispatcher, "get_current_device", lambda: _SM90())


def ptx_of(kernel, sig):
    try:
        ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=(9, 0))
    except Exception as e:  # pragma: no cover - depends on the installed toolkit
        if "NVVM" in str(e) or "nvvm" in str(e) or "NVRTC" in str(e):
            pytest.skip(f"NVVM unavailable: {e}")
        raise
    body = ptx.split(".entry", 1)[1]
    assert not re.search(r"\b(add|mul|fma|sub|div|setp\.\w+|cvt\.rn\.f32)\S*\.f64", body), "float64 arithmetic"
    assert ".local" not in body, "register arrays spilled to local memory"
    return body


def test_prepare_rows_compiles():
    from kernels_numba import sampling as S
    body = ptx_of(S._prepare_rows_kernel, (F32_2, F32_2, I32_2, I32_1, I32_1, F32_1, F32_1, F32_1, I32_2, F32_2))
    assert "shfl.sync.bfly.b32" in body
    assert "lg2.approx" in body or "ex2.approx" in body     # libdevice exp/log


def test_sample_rows_compiles():
    from kernels_numba import sampling as S
    body = ptx_of(S._sample_rows_kernel, (F32_2, U32_2, F32_2, I32_2, I32_1, F32_1, F32_1, I32_1, F32_1))
    assert "shfl.sync.bfly.b32" in body
    assert "mul.hi.u32" in body or "mul.wide.u32" in body or "mul.lo.s64" in body   # Philox products
