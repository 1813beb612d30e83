"""The T = 1 GEMV with fused prologues (kernels_numba.gemm.gemv) compiles for sm_90: 16-byte weight
loads (U x R in flight per lane), x fetched once per chunk for R rows, the prologue's own
instructions (block reduction for rmsnorm, exp for silu_mul, shared staging), and no local
memory."""
import pytest
from numba import cuda, types

from kernels_numba import gemm
from kernels_numba.ptx import SIM
from ptx_util import no_gpu_needed  # noqa: F401  (device functions compile for a stand-in sm_90)

pytestmark = pytest.mark.skipif(SIM, reason="compile_ptx needs the real CUDA target")

F32_2 = types.Array(types.float32, 2, "C")
U16_2 = types.Array(types.uint16, 2, "C")
F32_1 = types.Array(types.float32, 1, "C")
U64_1 = types.Array(types.uint64, 1, "C")


I32_1 = types.Array(types.int32, 1, "C")
U16_4 = types.Array(types.uint16, 4, "C")
ROPE_SIG = (I32_1, F32_2, F32_2, I32_1, U16_4, U16_4)     # positions, cos, sin, slots, k/v caches


def _ptx(cfg, bias, acc, sq=False, glu=False, rope=0, pf=False):
    ss = U64_1 if sq or cfg[3] == gemm.PROLOGUES["rmsnorm_ss"] else F32_1       # carried sums: uint64 fixed point
    sig = (F32_2, U16_2, F32_2, F32_1 if bias else F32_2, F32_2, types.float32, ss, ss) + ROPE_SIG
    ptx, _ = cuda.compile_ptx(gemm.py_kernel("gemv", *cfg, bias, acc, sq, glu, rope, pf), sig, cc=(9, 0))
    assert ".local" not in ptx, f"gemv{cfg}: register arrays spilled to local memory"
    return ptx


@pytest.mark.parametrize("prologue,warps,rows,unroll,ks,bias,acc", [
    ("plain", 4, 1, 2, 0, False, False),
    ("plain", 8, 4, 1, 0, True, True),
    ("rmsnorm", 4, 2, 2, 0, False, False),
    ("rmsnorm", 8, 4, 1, 1, True, False),
    ("silu_mul", 4, 4, 1, 0, False, True),
    ("silu_mul", 4, 2, 2, 1, False, True),
])
def test_gemv_ptx(prologue, warps, rows, unroll, ks, bias, acc):
    p = gemm.PROLOGUES[prologue]
    ptx = _ptx((warps, rows, unroll, p, ks), bias, acc)
    assert ptx.count("ld.global.nc.v4.u32") == 2 * unroll * rows      # prologue + steady state
    per_chunk = {0: 2, 1: 4, 2: 4}[p]                                  # x (+ norm_w / up) loads
    if ks:
        assert "ld.global.nc.v4.f32" not in ptx
        assert ptx.count("ld.shared.f32") >= 8 * unroll
        assert "bar.sync" in ptx
    else:
        assert ptx.count("ld.global.nc.v4.f32") == per_chunk * unroll
    assert ptx.count("shfl.sync.bfly") == 5 * rows + (5 if p == 1 else 0)
    assert ("ex2.approx" in ptx) == (p == 2)
    assert ("sqrt" in ptx) == (p == 1)


def test_pick_path_t1_is_gemv():
    kind, cfg, grid, block = gemm.pick_path(1, 4096, K=4096)
    assert kind == "gemv" and cfg[3] == 0
    assert grid * cfg[0] * cfg[1] == 4096 and block == 32 * cfg[0]


@pytest.mark.parametrize("rows,ks,acc", [(2, 0, False), (1, 1, True)])
def test_gemv_rmsnorm_ss_and_sumsq_ptx(rows, ks, acc):
    """rmsnorm_ss reads the sum of squares (no block reduction, no barrier before the loop: the
    only shuffles are the per-row warp sums); the sumsq epilogue adds one atomic per block."""
    p = gemm.PROLOGUES["rmsnorm_ss"]
    ptx = _ptx((8, rows, 1, p, ks), False, acc, sq=True)
    assert ptx.count("shfl.sync.bfly") == 5 * rows
    assert "sqrt" in ptx
    assert ptx.count("atom.global.add.u64") + ptx.count("red.global.add.u64") == 1   # integer: order-free
    assert "atom.global.add.f32" not in ptx and "red.global.add.f32" not in ptx
    plain = _ptx((8, rows, 1, gemm.PROLOGUES["plain"], 0), False, acc, sq=False)
    assert "atom.global" not in plain and "red.global" not in plain


@pytest.mark.parametrize("prologue", ["plain", "rmsnorm_ss"])
def test_gemv_glu_ptx(prologue):
    """glu: the gate and up rows stream like two rows (same 16-byte loads), the epilogue has the
    silu's exp and one store a warp, no atomics."""
    ptx = _ptx((8, 2, 2, gemm.PROLOGUES[prologue], 0), False, False, glu=True)
    assert ptx.count("ld.global.nc.v4.u32") == 2 * 2 * 2
    assert "ex2.approx" in ptx and ptx.count("shfl.sync.bfly") == 10
    assert "atom.global" not in ptx and "red.global" not in ptx


@pytest.mark.parametrize("rope,bias", [(1, False), (2, True)])
def test_gemv_rope_ptx(rope, bias):
    """rope: a rotation pair a warp (two rows streamed like any two), the epilogue reads cos/sin
    and stores q (float32) or k / v (16-bit) once a warp; no atomics."""
    ptx = _ptx((8, 2, 2, gemm.PROLOGUES["rmsnorm_ss"], 0), bias, False, rope=rope)
    assert ptx.count("ld.global.nc.v4.u32") == 2 * 2 * 2
    assert "st.global.u16" in ptx and "st.global.f32" in ptx
    assert "atom.global" not in ptx and "red.global" not in ptx


@pytest.mark.parametrize("sq", [False, True])
def test_gemv_prefetch_before_the_wait(sq):
    """prefetch: `prefetch.global.L2` of the block's rows, all of it before `griddepcontrol.wait`;
    the product after the wait is unchanged (same 16-byte loads); without it, no prefetch."""
    cfg = (8, 2, 2, gemm.PROLOGUES["plain"], 0)
    ptx = _ptx(cfg, False, True, sq=sq, pf=True)
    lines = ptx.splitlines()
    wait = next(i for i, ln in enumerate(lines) if "griddepcontrol.wait" in ln)
    pf = [i for i, ln in enumerate(lines) if "prefetch.global.L2" in ln]
    assert pf and max(pf) < wait, (pf, wait)
    assert ptx.count("ld.global.nc.v4.u32") == 2 * 2 * 2
    assert "prefetch.global" not in _ptx(cfg, False, True, sq=sq)
