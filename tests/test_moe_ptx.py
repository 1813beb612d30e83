"""The real (non-simulator) MoE kernels compile for sm_90: the grouped GEMM with mma.sync bf16,
16-byte loads and no local memory; routing entirely in registers; no float64 arithmetic."""
import pytest
from numba import types

from kernels_numba import moe as M
from kernels_numba.bf16 import SIMULATOR
from ptx_util import no_gpu_needed, ptx_of  # noqa: F401

pytestmark = pytest.mark.skipif(SIMULATOR, reason="compile_ptx needs the real CUDA target")

F32, I32 = types.float32, types.int32
F32_1, F32_2 = types.Array(F32, 1, "C"), types.Array(F32, 2, "C")
I32_1, I32_2 = types.Array(I32, 1, "C"), types.Array(I32, 2, "C")
U16_2 = types.Array(types.uint16, 2, "C")


@pytest.mark.parametrize("cfg", [
    M.RouteConfig(256, 8, "sigmoid", "noaux_tc", 8, 4, True, 2.5),         # DeepSeek-V3
    M.RouteConfig(160, 6, "softmax", "group_limited_greedy", 8, 3, False, 16.0),  # DeepSeek-V2
    M.RouteConfig(64, 6, "softmax", "greedy", 1, 1, False, 1.0)])           # V2-Lite
def test_route_ptx(cfg):
    p = ptx_of(M._route_kernel(cfg, cfg.method == "noaux_tc"), (F32_2, F32_1, F32, I32_2, F32_2))
    assert "ex2.approx" in p


def test_permute_ptx():
    count, scan, scatter = M._permute_kernels(256, 256)
    assert "atom.shared.add" in ptx_of(count, (I32_2, I32_2))
    ptx_of(scan, (I32_2, I32_2, I32_1, I32_1, I32_1, I32))
    ptx_of(scatter, (I32_2, I32_2, I32_1, I32_1))


@pytest.mark.parametrize("bn,gather", [(128, True), (64, False)])
def test_grouped_gemm_ptx(bn, gather):
    from test_kernels_ptx import sass_info
    k = M.grouped_kernel(bn, gather, jit=False)

    class _K:  # ptx_of wants .py_func
        py_func = k
    p = ptx_of(_K, (F32_2, I32_1, I32, U16_2, F32_2, I32_1, I32_1, I32_1))
    assert p.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == 2 * 2 * (bn // 32)
    assert "ld.global.nc.v4.u32" in p and "ld.global.nc.v4.f32" in p and "cvt.rn.bf16x2.f32" in p
    info = sass_info(p)
    if info is not None:
        assert info[1] == 0, f"grouped gemm bn={bn} spills ({info[0]} registers)"


def test_unpermute_ptx():
    from numba import types as t
    ptx_of(M._unpermute_kernel, (F32_2, I32_1, F32_2, F32_2, t.boolean))
