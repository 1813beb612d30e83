"""The block-quantized GEMM (kernels_numba/quant_gemm.py) compiles for sm_90 (compile_ptx, no GPU):
bf16 mma m16n8k16 on weights decoded by prmt + fma.rn.bf16x2, x staged by cp.async, the split-K
partials read past L1, no local memory, no float64, and ptxas keeps the largest variants (64 rows of
x, two 16-row tiles a warp) within the register file without spills."""
import re

import pytest
from numba import cuda, types

from kernels_numba import quant_gemm as QG
from kernels_numba.ptx import SIM
from ptx_util import no_gpu_needed, sass_info  # noqa: F401

pytestmark = pytest.mark.skipif(SIM, reason="compile_ptx needs the real CUDA target")

U16 = types.Array(types.uint16, 2, "C")
U8 = types.Array(types.uint8, 2, "C")
F2 = types.Array(types.float32, 2, "C")
F1 = types.Array(types.float32, 1, "C")
I1 = types.Array(types.int32, 1, "C")
I = types.int64


@pytest.mark.parametrize("kind,W,bias,res", [("q4k_mq", 4, False, True), ("q6k", 8, True, False)])
def test_gemm_compiles_to_bf16_mma_on_decoded_blocks(kind, W, bias, res):
    sig = (U16, U8, U8, U8, U8, F2, F1 if bias else F2, F2, F1, I1, I, I, I, I)
    ptx, _ = cuda.compile_ptx(QG.py_kernel(kind, W, 2, 8, bias, res), sig, cc=(9, 0))
    body = ptx.split(".entry", 1)[1]
    assert ".local" not in body, "register arrays spilled to local memory"
    assert not re.search(r"\b(add|mul|fma|sub|div|setp\.\w+)\S*\.f64", body), "float64 arithmetic"
    # a group pair of 2 tiles x 8 n-tiles x 2 groups x 2 k16 steps
    assert len(re.findall(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32", body)) == 64
    assert len(re.findall(r"fma\.rn\.bf16x2", body)) == 64          # 2 groups x 2 tiles x 2 steps x 4 pairs x 2
    assert re.search(r"prmt\.b32", body) and re.search(r"cp\.async\.ca\.shared\.global", body)
    assert re.search(r"cp\.async\.wait_group 1", body) and re.search(r"ld\.global\.cg\.f32", body)
    info = sass_info(ptx)
    if info is not None:
        regs, spills = info
        assert spills == 0 and regs <= 232, f"ptxas: {regs} registers, {spills} bytes spilled"
