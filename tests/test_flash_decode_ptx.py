"""The real (non-simulator) flash decode kernel compiles for sm_90 with the instructions it exists
for: mma.sync m16n8k16 bf16 (S = Q K^T) and m16n8k8 tf32 (O += P V) in the exact count per step,
16-byte `ld.global.nc.v2.u64` K/V loads, cvt.rn.bf16x2 / cvt.rna.tf32, shfl.bfly, ex2.approx; no
float64 arithmetic, no local memory, static shared memory within 48 KB. Where nvJitLink is present
ptxas -v reports registers (printed) and no spills."""

import pytest
from numba import types

from kernels_numba import flash_decode as FD
from kernels_numba.ptx import SIM
from ptx_util import no_gpu_needed, ptx_of, sass_info  # noqa: F401

pytestmark = pytest.mark.skipif(SIM, reason="compile_ptx needs the real CUDA target")

MMA_BF16 = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
MMA_TF32 = "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32"
SIG = (types.Array(types.float32, 3, "A"), types.Array(types.uint64, 4, "C"),
       types.Array(types.uint64, 4, "C"), types.Array(types.int32, 2, "C"),
       types.Array(types.int32, 1, "C"), types.Array(types.int32, 1, "C"), types.float32, types.int32, types.int32,
       types.Array(types.float32, 3, "C"), types.Array(types.float32, 3, "C"))


@pytest.mark.parametrize("hd,g,bs,over", [(128, 4, 16, {}), (64, 3, 16, {}), (128, 8, 16, {}),
                                          (128, 4, 8, {}), (64, 4, 16, {"keys": 32})])
def test_flash_decode_ptx(hd, g, bs, over):
    cfg = FD.flash_decode_config(hd, g, bs, **over)
    smem = 4 * cfg.warps * g * (hd + 2)
    ptx = ptx_of(type("K", (), {"py_func": FD.py_kernel(cfg)}), SIG, max_static_shared=smem)
    nn = cfg.keys // 8
    assert ptx.count(MMA_BF16) == nn * hd // 16, ptx.count(MMA_BF16)  # S: 2 per 32-dim chunk
    assert ptx.count(MMA_TF32) == nn * hd // 8, ptx.count(MMA_TF32)   # P.V: one per 8 dims
    assert ptx.count("ld.global.nc.v2.u64") == nn * (hd // 32) * 2      # K and V of one step
    assert "cvt.rn.bf16x2.f32" in ptx and "cvt.rna.tf32.f32" in ptx
    assert "shfl.sync.bfly" in ptx and "ex2.approx.ftz.f32" in ptx
    assert ptx.count("bar.sync") == 1  # the final warp merge only
    info = sass_info(ptx)
    if info is not None:
        print(f"flash_decode hd={hd} G={g} bs={bs} {over}: {info[0]} registers, {info[1]} B spills")
        assert info[1] == 0, f"{cfg} spills ({info[0]} registers)"


def test_bf16_out_variant_and_merge_compile():
    """out_bf16: the same kernel storing bf16 bits into uint16 [T, Hq * hd] (16-bit stores), and the
    bf16 merge kernel; the float32 merge is unchanged."""
    from kernels_numba import attention as A
    cfg = FD.flash_decode_config(128, 4, 16, out_bf16=True)
    U16_2 = types.Array(types.uint16, 2, "C")
    sig = SIG[:9] + (U16_2, SIG[10])
    ptx = ptx_of(type("K", (), {"py_func": FD.py_kernel(cfg)}), sig, max_static_shared=4 * 4 * 4 * 130)
    assert "st.global.u16" in ptx and ptx.count(MMA_BF16) == 16
    merge = ptx_of(A._merge_partitions_bf16_kernel, (SIG[10], SIG[5], types.int32, types.int32, types.int32, types.int32, U16_2))
    assert "st.global.u16" in merge
