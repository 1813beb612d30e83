"""The device MTP head's glue kernels (kernels_numba/mtp_head.py) compile for sm_90 on the real
(non-simulator) path: no float64 arithmetic, no local memory; the confidence sum is a warp-shuffle
block reduction. And metrale.spec.mtp_cuda imports without a GPU."""
import pytest
from numba import types

from kernels_numba.bf16 import SIMULATOR

pytestmark = pytest.mark.skipif(SIMULATOR, reason="compile_ptx needs the real CUDA target")

from ptx_util import no_gpu_needed, ptx_of  # noqa: E402,F401  (autouse fixture)

F32_1, I32_1 = types.Array(types.float32, 1, "C"), types.Array(types.int32, 1, "C")
F32_2, F32_2A = types.Array(types.float32, 2, "C"), types.Array(types.float32, 2, "A")


def test_mtp_head_kernels_compile():
    from kernels_numba import mtp_head
    ptx_of(mtp_head._copy_rows_kernel, (F32_2, I32_1, F32_2, I32_1))
    for logits in (F32_2, F32_2A):          # the whole row, or a draft vocabulary's column slice
        p = ptx_of(mtp_head._draft_pick_kernel, (logits, I32_1, I32_1, types.boolean, I32_1, F32_1))
        assert "shfl.sync.bfly.b32" in p and "ex2.approx" in p


def test_module_imports_without_a_gpu():
    import metrale.spec.mtp_cuda as m
    assert m.MtpCudaDrafter.on_device and m.MtpCudaDrafter.needs_hidden
