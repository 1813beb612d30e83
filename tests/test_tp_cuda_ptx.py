"""The tensor-parallel kernels compile for sm_90 on the real (non-simulator) path: the vocab-slice
embedding, the (max, index) pack and the cross-rank pick, the row argmax over a column slice of
the LM head's buffer (a strided view: the slice's real columns), and the one-row GEMVs a rank > 0
runs over the residual without accumulating (o with its L2 prefetch, down with silu*mul). No
float64 arithmetic, no local memory. And the CUDA TP modules import without a GPU."""
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


@pytest.mark.parametrize("prologue,prefetch", [("plain", True), ("plain", False), ("silu_mul", False)])
def test_overwriting_residual_gemvs_compile(prologue, prefetch):
    from numba import cuda
    from kernels_numba import gemm
    cfg = (8, 2, 2, gemm.PROLOGUES[prologue], 0)
    u16_4 = types.Array(types.uint16, 4, "C")
    sig = (F32_2, U16_2, F32_2, F32_2, F32_2, types.float32, types.Array(types.float32, 1, "C"),
           types.Array(types.float32, 1, "C"), I32_1, F32_2, F32_2, I32_1, u16_4, u16_4)
    ptx, _ = cuda.compile_ptx(gemm.py_kernel("gemv", *cfg, False, False, False, False, 0, prefetch), sig, cc=(9, 0))
    assert ".local" not in ptx and ("prefetch.global.L2" in ptx) == prefetch


def test_modules_import_without_a_gpu():
    import metrale.parallel.tp_cuda as t
    import metrale.runtime.cuda_tp as m
    assert m.TpDenseCuda.ops == (m.TpCudaOps,) and not m.TpDenseCuda.carries_norm_sums
    assert callable(t.rank_collectives)
