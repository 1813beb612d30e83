"""The real (non-simulator) path of the sampling kernels compiles for sm_90: Philox in 32/64-bit integer
ops, no float64 arithmetic, no local memory, warp-shuffle reductions.

compile_ptx of a kernel that calls `@cuda.jit(device=True)` helpers asks the current device for its
compute capability; without a GPU the test reports sm_90 by patching
numba.cuda.dispatcher.get_current_device (the same workaround as tests/test_kernels_ptx.py)."""
import re

import pytest
from numba import cuda, types

from kernels_numba.bf16 import SIMULATOR

pytestmark = pytest.mark.skipif(SIMULATOR, reason="compile_ptx needs the real CUDA target")

F32_1, I32_1 = types.Array(types.float32, 1, "C"), types.Array(types.int32, 1, "C")
F32_2, I32_2, U32_2 = (types.Array(types.float32, 2, "C"), types.Array(types.int32, 2, "C"),
                       types.Array(types.uint32, 2, "C"))


from ptx_util import no_gpu_needed, ptx_of  # noqa: E402,F401  (autouse fixture)


SAMPLE_SIG = (F32_2, U32_2, F32_2, I32_2, I32_1, F32_1, F32_1, I32_1, F32_1, F32_2, I32_2, types.int64, types.int64,
              I32_1, F32_1)
PREPARE_SIG = (F32_2, F32_2, I32_2, I32_1, I32_1, F32_1, F32_1, F32_1, I32_2, F32_2, I32_1, I32_1, F32_1)
U64_2, I64_2 = types.Array(types.uint64, 2, "C"), types.Array(types.int64, 2, "C")


def _body(kernel, sig):
    return ptx_of(kernel, sig).split(".entry", 1)[1]


@pytest.fixture(scope="module")
def sample_rows_ptx():
    """The sample kernel's PTX, compiled once for the three tests that read it (ptx_of's checks,
    48 KB of static shared memory at most; no_gpu_needed's patch, which is per test, held here)."""
    from ptx_util import _SM90
    import numba.cuda.dispatcher as dispatcher
    from kernels_numba import sampling as S
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dispatcher, "get_current_device", lambda: _SM90())
        return ptx_of(S._sample_rows_kernel, SAMPLE_SIG, max_static_shared=48 * 1024)


def test_prepare_rows_compiles():
    from kernels_numba import sampling as S
    body = _body(S._prepare_rows_kernel, PREPARE_SIG)
    assert "shfl.sync.bfly.b32" in body
    assert "lg2.approx" in body or "ex2.approx" in body     # libdevice exp/log


def test_sample_rows_compiles(sample_rows_ptx):
    body = sample_rows_ptx.split(".entry", 1)[1]
    assert "shfl.sync.bfly.b32" in body
    assert "mul.hi.u32" in body or "mul.wide.u32" in body or "mul.lo.s64" in body   # Philox products
    # radix select: integer histograms in shared memory (fixed-point masses: 64-bit atomics), warp scans
    assert re.search(r"atom\.shared\.add\.u32", body) or re.search(r"red\.shared\.add\.u32", body)
    assert re.search(r"(atom|red)\.shared\.add\.u64", body)
    assert "shfl.sync.up.b32" in body
    assert "mul.hi.u64" in body                               # the top-p target (umul64hi)
    assert "bar.sync" in body


def test_sample_rows_shared_memory_fits(sample_rows_ptx):
    """The histograms (2048 x (4 + 8) bytes) and the reduction scratch stay under the 48 KB of static
    shared memory a block may declare."""
    shared = sum(int(n) for n in re.findall(r"\.shared \.align \d+ \.b8 \S+\[(\d+)\]", sample_rows_ptx))
    assert 0 < shared <= 48 * 1024, f"{shared} bytes of static shared memory"


def test_sample_rows_compaction_buffer(sample_rows_ptx):
    """The compacted survivors live in static shared memory: one uint64 (key << 32 | id) per slot,
    COMPACT_CAP of them (a power of two and a multiple of the 1024 threads: the scan over the sorted
    list gives each thread COMPACT_CAP / 1024 slots), beside the 2048-bin histograms; the bitonic sort
    and the Philox draw of the survivors stay in registers (ptx_of: no local memory)."""
    from kernels_numba import sampling as S
    cap = S.COMPACT_CAP
    assert cap & (cap - 1) == 0 and cap % 1024 == 0 and cap <= S.RADIX_BINS
    ptx = sample_rows_ptx
    sizes = [int(n) for n in re.findall(r"\.shared \.align \d+ \.b8 \S+\[(\d+)\]", ptx)]
    assert sizes.count(cap * 8) >= 1 and S.RADIX_BINS * 8 in sizes and S.RADIX_BINS * 4 in sizes
    body = ptx.split(".entry", 1)[1]
    assert re.search(r"atom\.shared\.add\.u32", body)           # slot = atomic counter of the compaction


def test_row_kernels_fit_a_1024_thread_block():
    """Both row kernels launch 1024 threads: compiled with that launch bound they use at most 64
    registers a thread (without it sample_rows took 84 and failed to launch on the H200)."""
    from ptx_util import registers_with_bound
    from kernels_numba import sampling as S
    for k, sig in [(S._sample_rows_kernel, SAMPLE_SIG),
                   (S._prepare_rows_kernel, PREPARE_SIG)]:
        ptx, regs = registers_with_bound(k, sig, S.THREADS)
        assert ".maxntid 1024" in ptx
        assert regs is None or regs <= 64, regs


def test_split_kernels_compile():
    """The split rows' span kernels compile for sm_90 (ptx_of: no local memory, no float64):
    warp-shuffle reductions, Philox in integer products, top-p's mass digits in 64-bit shared and
    global atomics."""
    from kernels_numba import sampling as S
    mx = _body(S._split_max_kernel, (F32_2, U32_2, F32_2, I32_2, F32_2, types.int64, types.int64))
    assert "shfl.sync.bfly.b32" in mx and "bar.sync" in mx
    ms = _body(S._split_mass_kernel, (F32_2, U32_2, F32_2, I32_2, F32_2, U64_2, I64_2, types.int64, types.int64))
    assert "atom.shared.add.u64" in ms and ("atom.global.add.u64" in ms or "red.global.add.u64" in ms)
    fd = _body(S._split_find_kernel, (F32_2, I32_2, U64_2, I64_2, types.int64, types.int64))
    assert "shfl.sync.up.b32" in fd and "st.global.u64" in fd
    gb = _body(S._split_gumbel_kernel, (F32_2, U32_2, F32_2, I32_2, F32_2, F32_2, I32_2, I64_2, types.int64,
                                        types.int64))
    assert "mul.hi.u32" in gb or "mul.wide.u32" in gb or "mul.lo.s64" in gb     # Philox products
    assert "bar.sync" in gb and "st.global.u32" in gb                          # the span's winner id
