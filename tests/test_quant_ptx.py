"""The quantized kernels compile for sm_90 (compile_ptx, no GPU) in the configurations the
launchers pick at real sizes (Llama-3-8B: K = 4096 and 14336): no local memory (every register
array of the generated GEMV is a scalar), no float64, ptxas (through nvJitLink) within its
register budget and without spills; the GEMV issues its 16-byte weight loads (the first step's
before `griddepcontrol.wait`), one dp4a per 4 weights per row of x, 16-byte shared loads of x."""
import re

import pytest
from numba import cuda, types

from kernels_numba import quant_dequant as QD
from kernels_numba import quant_gemv as QG
from kernels_numba import quant_layout as L
from kernels_numba.ptx import SIM
from ptx_util import no_gpu_needed, sass_info  # noqa: F401  (device functions compile for a stand-in sm_90)

pytestmark = pytest.mark.skipif(SIM, reason="compile_ptx needs the real CUDA target")

F2 = types.Array(types.float32, 2, "C")
F1 = types.Array(types.float32, 1, "C")
U8 = types.Array(types.uint8, 2, "C")
U16 = types.Array(types.uint16, 2, "C")
I1 = types.Array(types.int32, 1, "C")
MAX_REGS = 192      # dequantization kernels: no launch bounds
WLOAD = re.compile(r"ld\.global\.nc(\.L1::no_allocate\.L2::256B)?\.v4\.u32")   # 16-byte weight loads


def _checked(ptx: str, max_regs: int = MAX_REGS) -> tuple[str, tuple | None]:
    body = ptx.split(".entry", 1)[1]
    assert ".local" not in body, "register arrays spilled to local memory"
    assert not re.search(r"\b(add|mul|fma|sub|div|setp\.\w+|cvt\.rn\.f32)\S*\.f64", body), "float64 arithmetic"
    info = sass_info(ptx)
    if info is not None:
        regs, spills = info
        assert spills == 0 and regs <= max_regs, f"ptxas: {regs} registers, {spills} bytes spilled"
    return body, info


def _gemv_ptx(qt, cfg, one, bias=False, res=True):
    """PTX as the launcher compiles it (with its launch bounds); checked, with ptxas's figures."""
    sig = (F2, U8, U8, U8, U8, F2, F1 if bias else F2, F2, types.int64, types.int64)
    threads, blocks = QG.launch_bounds(qt, one, cfg[0])
    ptx, _ = cuda.compile_ptx(QG.py_kernel(qt, one, *cfg, bias, res), sig, cc=(9, 0),
                              launch_bounds=(threads, blocks))
    return _checked(ptx, min(255, 65536 // (threads * blocks)))    # the launch bound holds, no spills


def _loads_a_unit(qt):
    """16-byte weight loads a unit (one row, one step)."""
    return {L.Q8_0: 2, L.Q4_K: 5, L.Q5_K: 6, L.Q6_K: 7}.get(qt, 1)


# (type, K, T): each type at T = 1 in the configuration of the 4096-wide products; the down
# product's K for a K-quant (8 lanes a row), Q6_K and a legacy type (unroll 2); the T >= 2 kernel
# (one for T = 2..8: the rows of x are a run-time loop) for the Q4_K_M types and Q8_0, and at the
# down product's K, where 8 rows of x take ~150 KB of shared memory (8 warps a block, pipelined)
CASES = ([(qt, 4096, 1) for qt in L.TYPES] + [(L.Q4_K, 14336, 1), (L.Q6_K, 14336, 1), (L.Q4_0, 14336, 1)]
         + [(qt, 4096, 8) for qt in (L.Q4_K, L.Q6_K, L.Q8_0)] + [(L.Q6_K, 14336, 8), (L.Q8_0, 14336, 8)])


@pytest.mark.slow
@pytest.mark.parametrize("qt,K,T", CASES, ids=[f"{L.NAMES[c[0]]}-K{c[1]}-T{c[2]}" for c in CASES])
def test_gemv_ptx(qt, K, T):
    cfg = QG.gemv_cfg(qt, 4096, K, T)
    warps, rows, split, unroll, pipe = cfg
    body, info = _gemv_ptx(qt, cfg, T == 1, bias=(qt == L.Q8_0))
    groups = 4 if qt in L.KQUANTS else 1
    assert len(WLOAD.findall(body)) == rows * unroll * _loads_a_unit(qt)               # one load site
    assert body.count("ld.global.nc.v4.f32") == 4                                      # x staging, 4 deep
    per_row = 8 * groups * rows * unroll        # dp4a for one row of x (T > 1: a run-time loop,
    n = body.count("dp4a")                      # which the compiler may unroll a few times)
    assert n == per_row if T == 1 else (n % per_row == 0 and n <= 4 * per_row), (n, per_row)
    assert body.count("ld.shared.v4.u32") == 2 * groups * unroll * (n // per_row)
    lines = body.splitlines()
    wait = next(i for i, ln in enumerate(lines) if "griddepcontrol.wait" in ln)
    first = next(i for i, ln in enumerate(lines) if WLOAD.search(ln))
    assert first < wait, "the first weight loads go out before the PDL wait"
    assert "bar.sync" in body and body.count("shfl.sync.bfly") >= 6
    print(L.NAMES[qt], K, T, cfg, "ptxas (registers, spill bytes):", info)


@pytest.mark.parametrize("qt", L.TYPES, ids=[L.NAMES[t] for t in L.TYPES])
def test_dequant_ptx(qt):
    for gather, sig in ((False, (U8, U8, U8, U8, I1, U16, types.int64)), (True, (U8, U8, U8, U8, I1, F2, types.int64))):
        ptx, _ = cuda.compile_ptx(QD.py_kernel(qt, gather), sig, cc=(9, 0))
        body, _ = _checked(ptx)
        assert body.count("st.global.v4") == (8 if gather else 4) * (2 if gather else 1)
        assert "ld.global.nc.v4.u32" in body


def test_cfg_covers_rows_evenly():
    """The launch configuration leaves no lane idle on the Llama shapes' K (4096, 14336)."""
    for qt in L.TYPES:
        for K in (4096, 14336):
            warps, rows, split, unroll, pipe = QG.gemv_cfg(qt, 4096, K, 1)
            units = K // (128 if qt in L.KQUANTS else 32)
            assert units % ((32 // split) * unroll) == 0, (L.NAMES[qt], K)
    assert QG.max_rows(L.Q6_K, 14336) == 2 and QG.max_rows(L.Q4_K, 4096) == 8


@pytest.mark.slow
@pytest.mark.parametrize("tt", [1, 2, 8], ids=["T1", "T2", "T8"])
def test_fp8_gemv_ptx(tt):
    """FP8 GEMV: 16-byte weight loads (rows x unroll a step, one site), 4 x loads of 16 bytes a
    chunk and row of x, one cvt.rn.f16x2.e4m3x2 per 2 weights; within its launch bound, no spills."""
    from kernels_numba import quant_fp8 as F
    cfg = F.fp8_gemv_cfg(4096, 4096, tt)
    warps, rows, unroll, pipe = cfg
    sig = (F2, U8, F2, F2, F2, F2, types.int64, types.int64, types.int64, types.int64)
    threads, blocks = F.launch_bounds(tt, warps)
    ptx, _ = cuda.compile_ptx(F.py_kernel(tt, *cfg, False, True), sig, cc=(9, 0), launch_bounds=(threads, blocks))
    body, info = _checked(ptx, min(255, 65536 // (threads * blocks)))
    assert len(WLOAD.findall(body)) == rows * unroll and "L1::no_allocate" in body
    assert body.count("cvt.rn.f16x2.e4m3x2") == 8 * rows * unroll
    assert body.count("ld.global.nc.v4.f32") == 4 * unroll * tt
    assert "st.shared" not in body
    print("fp8", tt, cfg, "ptxas (registers, spill bytes):", info)


def test_fp8_dequant_ptx():
    from kernels_numba import quant_fp8 as F
    ptx, _ = cuda.compile_ptx(F._dequant_bf16_kernel.py_func, (U8, F2, U16, types.int64, types.int64, types.int64), cc=(9, 0))
    body, _ = _checked(ptx)
    assert body.count("st.global.v4.u32") == 2 and body.count("cvt.rn.f16x2.e4m3x2") == 8
