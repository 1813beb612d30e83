"""The Q4_K tensor-core GEMV and its x quantization compile for sm_90 (compile_ptx, no GPU): one
int8 mma (m16n8k32, u8 x s8) per group of 32 values of 16 weight rows, 4-byte code loads, no local
memory, no float64, ptxas within 128 registers without spills (two blocks of 8 warps a
multiprocessor)."""
import re

import pytest
from numba import cuda, types

from kernels_numba import quant_mma as QM
from kernels_numba.ptx import SIM
from ptx_util import no_gpu_needed, sass_info  # noqa: F401

pytestmark = pytest.mark.skipif(SIM, reason="compile_ptx needs the real CUDA target")

F2 = types.Array(types.float32, 2, "C")
F1 = types.Array(types.float32, 1, "C")
U8 = types.Array(types.uint8, 2, "C")


def _body(ptx: str) -> str:
    body = ptx.split(".entry", 1)[1]
    assert ".local" not in body, "register arrays spilled to local memory"
    assert not re.search(r"\b(add|mul|fma|sub|div|setp\.\w+)\S*\.f64", body), "float64 arithmetic"
    return body


@pytest.mark.parametrize("bias,res", [(False, True), (True, False), (False, False)])
def test_gemv_compiles_to_one_mma_a_group(bias, res):
    sig = (U8, F2, U8, U8, F2, F1 if bias else F2, F2, types.int64, types.int64)
    ptx, _ = cuda.compile_ptx(QM.py_kernel(QM.WARPS, bias, res), sig, cc=(9, 0))
    body = _body(ptx)
    assert len(re.findall(r"mma\.sync\.aligned\.m16n8k32\.row\.col\.s32\.u8\.s8\.s32", body)) == 8
    assert len(re.findall(r"ld\.global\.nc\.u32", body)) == 16          # 8 groups x rows g, g + 8
    assert len(re.findall(r"ld\.global\.nc\.v2\.u32", body)) == 8       # x fragments
    info = sass_info(ptx)
    if info is not None:
        regs, spills = info
        assert spills == 0 and regs <= 128, f"ptxas: {regs} registers, {spills} bytes spilled"


def test_quantize_compiles():
    sig = (F2, types.int64, U8, F2)
    ptx, _ = cuda.compile_ptx(QM._quantize, sig, cc=(9, 0))
    _body(ptx)


def test_norm_quantize_compiles():
    sig = (F2, F1, types.float32, types.int64, U8, F2, F2)
    ptx, _ = cuda.compile_ptx(QM._norm_quantize, sig, cc=(9, 0))
    _body(ptx)


def test_silu_quantize_compiles():
    sig = (F2, types.int64, U8, F2, F2)
    ptx, _ = cuda.compile_ptx(QM._silu_quantize, sig, cc=(9, 0))
    _body(ptx)


def test_fragment_layout_gemv_compiles_to_wide_loads():
    sig = (U8, F2, U8, U8, F2, F2, F2, types.int64, types.int64, types.int64)
    ptx, _ = cuda.compile_ptx(QM.py_kernel(QM.WARPS, False, True, 0), sig, cc=(9, 0))
    body = _body(ptx)
    assert len(re.findall(r"mma\.sync\.aligned\.m16n8k32\.row\.col\.s32\.u8\.s8\.s32", body)) == 8
    assert len(re.findall(r"ld\.global\.nc\.v4\.u32", body)) == 10     # 4 code, 2 header, 4 x loads
    info = sass_info(ptx)
    if info is not None:
        regs, spills = info
        assert spills == 0 and regs <= 128, f"ptxas: {regs} registers, {spills} bytes spilled"


def test_fragment_dequant_compiles():
    sig = (U8, U8, types.Array(types.uint16, 2, "C"), types.int64, types.int64)
    ptx, _ = cuda.compile_ptx(QM._dequant_mq, sig, cc=(9, 0))
    _body(ptx)


def test_q6k_gemv_compiles_to_two_mmas_a_group():
    sig = (U8, F2, U8, U8, U8, U8, F2, F2, F2, types.int64, types.int64)
    ptx, _ = cuda.compile_ptx(QM.py_kernel(QM.WARPS, False, True, -1), sig, cc=(9, 0))
    body = _body(ptx)
    assert len(re.findall(r"mma\.sync\.aligned\.m16n8k32\.row\.col\.s32\.u8\.s8\.s32", body)) == 16
    info = sass_info(ptx)
    if info is not None:
        regs, spills = info
        assert spills == 0 and regs <= 168, f"ptxas: {regs} registers, {spills} bytes spilled"
