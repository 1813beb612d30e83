"""The real (non-simulator) path of the Gated DeltaNet kernels compiles for sm_90: no float64
arithmetic, no local-memory arrays, warp shuffles in the block reductions, static shared memory
within the 48 KB a block gets without opting in."""
import re

import pytest
from numba import cuda, types

from kernels_numba import gdn
from kernels_numba.bf16 import SIMULATOR

pytestmark = pytest.mark.skipif(SIMULATOR, reason="compile_ptx needs the real CUDA target")

F32, I32 = types.float32, types.int32
F32_1, I32_1 = types.Array(F32, 1, "C"), types.Array(I32, 1, "C")
F32_2, F32_2A, F32_3, F32_4 = (types.Array(F32, 2, "C"), types.Array(F32, 2, "A"), types.Array(F32, 3, "C"),
                               types.Array(F32, 4, "C"))
META = (I32_1, I32_1, I32_1)   # seq_query_start, state_slots, positions


from ptx_util import no_gpu_needed  # noqa: E402,F401  (autouse fixture)
from ptx_util import ptx_of as _checked_ptx  # noqa: E402


def ptx_of(kernel, sig) -> str:
    return _checked_ptx(kernel, sig, max_static_shared=48 * 1024)


def test_conv_and_norm_kernels():
    ptx_of(gdn._causal_conv1d_kernel, (F32_2A, F32_2, F32_3, *META, F32_2))
    assert "shfl.sync.bfly.b32" in ptx_of(gdn._rms_norm_gated_kernel, (F32_2, F32_2A, F32_1, F32, F32_2))
    assert "shfl.sync.bfly.b32" in ptx_of(gdn._state_norm_clamp_kernel, (F32_4, I32_1, F32))


def test_recurrent_kernel():
    p = ptx_of(gdn._gdn_recurrent_kernel, (F32_2, F32_2A, F32_1, F32_1, F32_4, *META, I32, F32_2))
    assert "shfl.sync.bfly.b32" in p and "ld.shared.f32" in p


def test_chunked_kernel():
    p = ptx_of(gdn._gdn_chunked_kernel, (F32_2, F32_2A, F32_1, F32_1, F32_4, *META, I32, I32, F32_2))
    assert "bar.sync" in p and "ex2.approx" in p
