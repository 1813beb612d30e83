"""The real (non-simulator) MLA kernels compile for sm_90: shuffles for the logit sums, no float64
arithmetic, no local memory (register arrays promoted), no spills where nvJitLink can tell."""
import re

import pytest
from numba import types

from kernels_numba import mla as M
from kernels_numba.bf16 import SIMULATOR
from ptx_util import no_gpu_needed, ptx_of  # noqa: F401

pytestmark = pytest.mark.skipif(SIMULATOR, reason="compile_ptx needs the real CUDA target")

F32, I32 = types.float32, types.int32
F32_2A, F32_3, F32_3A = types.Array(F32, 2, "A"), types.Array(F32, 3, "C"), types.Array(F32, 3, "A")
I32_1, I32_2 = types.Array(I32, 1, "C"), types.Array(I32, 2, "C")
U16_3, U32_3 = types.Array(types.uint16, 3, "C"), types.Array(types.uint32, 3, "C")


@pytest.mark.parametrize("dk,dv,heads", [(576, 512, 128), (96, 64, 4)])
def test_mla_decode_ptx(dk, dv, heads):
    from test_kernels_ptx import sass_info
    cfg = M.mla_config(dk, dv, heads)
    p = ptx_of(M._mla_kernel(cfg), (F32_3A, U32_3, I32_2, I32_1, I32_1, F32, I32, F32_3, F32_3))
    assert "shfl.sync.bfly.b32" in p and "bar.sync" in p and "ld.shared.f32" in p
    shared = sum(int(n) for n in re.findall(r"\.shared \.align \d+ \.b8 \w+\[(\d+)\]", p))
    assert 0 < shared <= 48 * 1024, f"{shared} bytes of static shared memory"
    info = sass_info(p)
    if info is not None:
        assert info[1] == 0, f"mla decode {cfg} spills ({info[0]} registers)"


def test_store_latent_ptx():
    ptx_of(M._store_latent_kernel, (F32_2A, F32_2A, I32_1, U16_3))


def test_head_linear_and_copy_heads_ptx():
    """The per-head products (q absorption, up-projection) on strided views: warp shuffles, no
    float64; copy_heads for q_pe into the tail of q_abs."""
    p = ptx_of(M._head_linear_kernel(M.HEAD_TOKENS, M.HEAD_WARPS), (F32_3A, U16_3, F32_3A))
    assert "shfl.sync.bfly.b32" in p and ".f64" not in p
    ptx_of(M._copy_heads_kernel, (F32_3A, F32_3A))
