"""The real (non-simulator) gemm kernels compile for sm_90 with the instructions they exist for:
16-byte non-coherent global loads, mma.sync bf16, 16-byte shared accesses, cvt to bf16x2, and no
local-memory traffic (register arrays fully promoted)."""
import pytest
from numba import cuda, types

from kernels_numba import gemm
from kernels_numba.ptx import SIM

pytestmark = pytest.mark.skipif(SIM, reason="compile_ptx needs the real CUDA target")

F32_2 = types.Array(types.float32, 2, "C")
U16_2 = types.Array(types.uint16, 2, "C")
F32_1 = types.Array(types.float32, 1, "C")


def _ptx(kind, *cfg):
    ptx, _ = cuda.compile_ptx(gemm.py_kernel(kind, *cfg), (F32_2, U16_2, F32_2, F32_1), cc=(9, 0))
    assert ".local" not in ptx, f"{kind}{cfg}: register arrays spilled to local memory"
    return ptx


@pytest.mark.parametrize("T,u,bias,acc", [(1, 4, False, False), (4, 2, True, True)])
def test_fma_ptx(T, u, bias, acc):
    ptx = _ptx("fma", T, gemm.FMA_WARPS, u, bias, acc)
    assert ptx.count("ld.global.nc.v4.u32") == 2 * u        # prologue + steady state
    assert "ld.global.nc.v4.f32" in ptx
    assert ptx.count("shfl.sync.bfly") == 5 * T


@pytest.mark.parametrize("mt,nt,u,bias,acc", [(1, 1, 4, False, False), (1, 2, 2, True, True),
                                              (4, 2, 1, False, True)])
def test_skinny_ptx(mt, nt, u, bias, acc):
    ptx = _ptx("skinny", mt, nt, gemm.SKINNY_WARPS, u, bias, acc)
    assert ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == 2 * mt * nt * u
    assert ptx.count("ld.global.nc.v4.u32") == 2 * nt * u   # prologue + steady state
    assert ptx.count("ld.global.nc.v4.f32") == 4 * mt * u
    assert "cvt.rn.bf16x2.f32" in ptx


@pytest.mark.parametrize("bm,bn,bias,acc", [(128, 128, False, False), (64, 64, True, True)])
def test_tiled_ptx(bm, bn, bias, acc):
    ptx = _ptx("tiled", bm, bn, bias, acc)
    mt, nt = bm // 32, bn // 32
    assert ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == 2 * mt * nt
    assert ptx.count("ld.shared.v4.u32") == 2 * mt + nt
    assert "st.shared.v4.u32" in ptx and "ld.global.nc.v4.u32" in ptx
    assert "ld.global.nc.v4.f32" in ptx and "cvt.rn.bf16x2.f32" in ptx
