"""The tensor-parallel kernels compile for sm_90 on the real (non-simulator) path: the vocab-slice
embedding, the (max, index) pack and the cross-rank pick, and the row argmax over a column slice
of the LM head's buffer (a strided view: the slice's real columns). No float64 arithmetic, no
local memory. And the CUDA TP modules import without a GPU."""
import pytest
from numba import types

from kernels_numba.bf16 import SIMULATOR

pytestmark = pytest.mark.skipif(SIMULATOR, reason="compile_ptx needs the real CUDA target")

from ptx_util import no_gpu_needed, ptx_of  # noqa: E402,F401  (autouse fixture)

F32_2, F32_2A, F32_3 = types.Array(types.float32, 2, "C"), types.Array(types.float32, 2, "A"), types.Array(types.float32, 3, "C")
I32_1, U16_2, U64_1 = types.Array(types.int32, 1, "C"), types.Array(types.uint16, 2, "C"), types.Array(types.uint64, 1, "C")


def test_tp_kernels_compile():
    from kernels_numba import argmax, embedding, tp_pick
    ptx_of(embedding._embedding_slice_kernel, (U16_2, I32_1, types.int32, types.int32, F32_2))
    for logits in (F32_2, F32_2A):
        ptx_of(tp_pick._pack_pairs_kernel, (logits, I32_1, types.int32, types.int32, F32_2))
    ptx_of(tp_pick._pick_pairs_kernel, (F32_3, I32_1))
    ptx_of(argmax._argmax_rows_kernel, (F32_2A, I32_1, U64_1))


def test_modules_import_without_a_gpu():
    import metrale.parallel.tp_cuda as t
    import metrale.runtime.cuda_tp as m
    assert m.TpDenseCuda.ops == (m.TpCudaOps,) and not m.TpDenseCuda.carries_norm_sums
    assert callable(t.rank_collectives)
