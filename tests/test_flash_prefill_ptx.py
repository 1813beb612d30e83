"""The real (non-simulator) flash prefill kernel compiles for sm_90 at head_dim 64 and 128 with the
instructions it exists for: mma.sync m16n8k16 bf16 (the exact count per key tile), ldmatrix.trans
for V, 16-byte global / shared loads and stores, cvt to bf16x2, shfl.bfly, ex2.approx; no float64 arithmetic,
no local-memory spills, static shared memory within 48 KB."""
import pytest
from numba import types

from kernels_numba import flash_prefill as F
from kernels_numba.ptx import SIM
from ptx_util import no_gpu_needed, ptx_of  # noqa: F401

pytestmark = pytest.mark.skipif(SIM, reason="compile_ptx needs the real CUDA target")

MMA = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"


def _sig(q_layout="A"):
    return (types.Array(types.float32, 3, q_layout), types.Array(types.uint64, 4, "C"),
            types.Array(types.uint64, 4, "C"), types.Array(types.int32, 2, "C"),
            types.Array(types.int32, 1, "C"), types.Array(types.int32, 1, "C"), types.float32,
            types.int32, types.Array(types.float32, 3, "C"))


@pytest.mark.parametrize("hd,over", [(64, {}), (128, {}), (128, {"block_k": 32, "v_early": True})])
def test_flash_prefill_ptx(hd, over):
    cfg = F.flash_config(hd, **over)
    kp, vp = F._pitches(cfg)
    smem = 4 * cfg.block_k * (kp + vp)
    assert smem <= 48 * 1024
    ptx = ptx_of(type("K", (), {"py_func": F.py_kernel(cfg)}), _sig(), max_static_shared=smem)
    # S = Q K^T: 2 (hd/32) (BK/8); O += P V: 2 (BK/32) (hd/8) -- fully unrolled, once each
    want = 2 * (hd // 32) * (cfg.block_k // 8) + 2 * (cfg.block_k // 32) * (hd // 8)
    assert ptx.count(MMA) == want, (ptx.count(MMA), want)
    assert "ld.global.nc.v2.u64" in ptx
    assert "ld.shared.v4.u32" in ptx and "st.shared.v4.u32" in ptx
    assert "cvt.rn.bf16x2.f32" in ptx
    assert "shfl.sync.bfly" in ptx
    assert "ex2.approx.ftz.f32" in ptx
    assert ptx.count("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16") == (cfg.block_k // 32) * (hd // 8)
