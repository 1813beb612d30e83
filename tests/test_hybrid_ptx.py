"""The kernels of the CUDA hybrid wiring compile for sm_90 with the argument layouts the backend
passes: per-layer state views of the device pool ([ids, L, ...][:, layer], non-contiguous), the
projection's column slices, trail slices; plus sigmoid_mul, record_trail and the partial-RoPE
qkv_rope_store. No float64, no local memory, shared memory within 48 KB (ptx_util)."""
import pytest
from numba import cuda, types

from kernels_numba import gdn, qkv
from kernels_numba.bf16 import SIMULATOR

pytestmark = pytest.mark.skipif(SIMULATOR, reason="compile_ptx needs the real CUDA target")

F32, I32, BOOL = types.float32, types.int32, types.boolean
F32_1, I32_1, I32_1A = types.Array(F32, 1, "C"), types.Array(I32, 1, "C"), types.Array(I32, 1, "A")
F32_2, F32_2A = types.Array(F32, 2, "C"), types.Array(F32, 2, "A")
F32_3, F32_3A, F32_4A = types.Array(F32, 3, "C"), types.Array(F32, 3, "A"), types.Array(F32, 4, "A")
U16_4 = types.Array(types.uint16, 4, "C")
META = (I32_1, I32_1, I32_1)          # seq_query_start, state_slots, positions (the step's metadata)
META_A = (I32_1A, I32_1A, I32_1A)     # slices of the pool's metadata buffers (passes, replay ring)

from ptx_util import no_gpu_needed  # noqa: E402,F401  (autouse fixture)
from ptx_util import ptx_of as _checked_ptx  # noqa: E402


def ptx_of(kernel, sig) -> str:
    return _checked_ptx(kernel, sig, max_static_shared=48 * 1024)


@pytest.mark.parametrize("meta", [META, META_A])
def test_gdn_kernels_over_pool_views(meta):
    ptx_of(gdn._causal_conv1d_kernel, (F32_2A, F32_2, F32_3A, *meta, F32_2))
    ptx_of(gdn._gdn_recurrent_kernel, (F32_2, F32_2A, F32_1, F32_1, F32_4A, *meta, I32, F32_2))
    ptx_of(gdn._gdn_chunked_kernel, (F32_2, F32_2A, F32_1, F32_1, F32_4A, *meta, I32, I32, F32_2))
    ptx_of(gdn._state_norm_clamp_kernel, (F32_4A, meta[1], F32))


def test_replay_over_trail_rows():
    """Replay: conv over trail_x[layer, ckpt, :n] (C), recurrent over trail_ba[layer, ckpt, :n]."""
    ptx_of(gdn._causal_conv1d_kernel, (F32_2, F32_2, F32_3A, *META_A, F32_2))
    ptx_of(gdn._gdn_recurrent_kernel, (F32_2, F32_2, F32_1, F32_1, F32_4A, *META_A, I32, F32_2))


def test_sigmoid_mul_and_record_trail():
    ptx_of(gdn._sigmoid_mul_kernel, (F32_2, F32_2, F32_2))
    p = ptx_of(gdn._record_trail_kernel, (F32_2, I32_1, I32_1, I32, F32_3, F32_3))
    assert "st.global.f32" in p


def test_partial_rope_qkv_store():
    ptx_of(qkv._qkv_rope_store_kernel, (F32_2, I32_1, F32_2, F32_2, I32_1, F32_1, F32_1, BOOL, F32, BOOL,
                                        types.Array(F32, 3, "C"), U16_4, U16_4))
