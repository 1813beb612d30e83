"""flash_prefill_attention (mma.sync) on the real GPU at model sizes, against the FP32 FMA
prefill kernel (attention.prefill_attention) on every output and against the float64 reference
on sampled rows; prints both kernels' times (CUDA events; not asserted).
Run: pytest -m gpu tests/gpu/test_flash_prefill_gpu.py -s"""
import math

import numpy as np
import pytest
from numba import cuda

from kernels_numba import attention
from kernels_numba import flash_prefill as F
from kernels_numba.bf16 import bf16_round, to_bf16_bits

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cuda.is_available(), reason="needs a CUDA GPU")]

BS = 16
SMOL = dict(name="smollm2", hq=9, hk=3, hd=64)
LLAMA = dict(name="llama3-8b", hq=32, hk=8, hd=128)


def make_batch(rng, shape, segments):
    hq, hk, hd = shape["hq"], shape["hk"], shape["hd"]
    need = [(p + n + BS - 1) // BS for p, n in segments]
    nb = sum(need) + 4
    perm = rng.permutation(nb).astype(np.int32)
    tables = np.full((len(segments), max(need) + 2), -1, np.int32)
    k = 0
    for s, m in enumerate(need):
        tables[s, :m] = perm[k:k + m]
        k += m
    kc = to_bf16_bits(rng.standard_normal((nb, BS, hk, hd), dtype=np.float32))
    vc = to_bf16_bits(rng.standard_normal((nb, BS, hk, hd), dtype=np.float32))
    positions = np.concatenate([np.arange(p, p + n) for p, n in segments]).astype(np.int32)
    token_seq = np.concatenate([np.full(n, s) for s, (_, n) in enumerate(segments)]).astype(np.int32)
    starts = np.concatenate([[0], np.cumsum([n for _, n in segments])]).astype(np.int32)
    q = rng.standard_normal((positions.shape[0], hq, hd), dtype=np.float32)
    return q, kc, vc, tables, token_seq, starts, positions


def _time(fn, iters=10):
    fn()
    cuda.synchronize()
    a, b = cuda.event(), cuda.event()
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    b.synchronize()
    return cuda.event_elapsed_time(a, b) / iters


@pytest.mark.parametrize("over", [{}, {"block_k": 32, "v_early": True}, {"v_early": True}],
                         ids=["default", "bk32", "bk64-v-early"])
@pytest.mark.parametrize("shape", [SMOL, LLAMA], ids=lambda s: s["name"])
def test_flash_prefill_vs_fma_and_reference(shape, over):
    """Two prompts of 1000 and 3000 tokens and a 500-token chunk after 2048 cached positions."""
    if over and shape["hd"] == 64:
        pytest.skip("geometry variants are for head_dim 128")
    rng = np.random.default_rng(11)
    segments = [(0, 1000), (0, 3000), (2048, 500)]
    q, kc, vc, tables, token_seq, starts, positions = make_batch(rng, shape, segments)
    scale = 1.0 / math.sqrt(shape["hd"])
    qlen = max(n for _, n in segments)
    d = [cuda.to_device(a) for a in (q, kc.view(np.uint64), vc.view(np.uint64), tables, starts, positions)]
    d_fl = cuda.to_device(np.full_like(q, np.nan))
    d_fma = cuda.to_device(np.full_like(q, np.nan))
    cfg = F.flash_config(shape["hd"], **over)
    run_fl = lambda: F.flash_prefill_attention(*d, scale, d_fl, max_query_len=qlen, config=cfg)  # noqa: E731
    run_fma = lambda: attention.prefill_attention(*d, scale, d_fma, max_query_len=qlen)  # noqa: E731
    run_fl()
    run_fma()
    out, ref_fma = d_fl.copy_to_host(), d_fma.copy_to_host()
    assert np.isfinite(out).all()
    # vs the FP32 kernel on everything (bf16 q and P: a few 1e-3 relative)
    rel = np.linalg.norm(out - ref_fma) / np.linalg.norm(ref_fma)
    assert rel < 1e-2, rel
    assert np.abs(out - ref_fma).max() < 5e-2
    # vs float64 on sampled rows (segment starts/ends, tile edges)
    rows = np.unique(np.concatenate([[0, 1, 63, 64, 999, 1000, 1063, 1064, 3999, 4000, 4499],
                                     rng.integers(0, q.shape[0], 24)]))
    want = attention.attention_ref(bf16_round(q[rows]), kc, vc, tables, token_seq[rows], positions[rows], scale)
    assert np.abs(out[rows] - want).max() < 5e-2
    assert np.linalg.norm(out[rows] - want) / np.linalg.norm(want) < 1e-2
    flops = 4.0 * shape["hd"] * shape["hq"] * float((positions.astype(np.float64) + 1).sum())
    ms_fl, ms_fma = _time(run_fl), _time(run_fma)
    print(f"\n{shape['name']} {over or 'default'} T={q.shape[0]}: flash {ms_fl:.3f} ms "
          f"({flops / ms_fl / 1e9:.1f} TFLOP/s), fma {ms_fma:.3f} ms ({flops / ms_fma / 1e9:.1f} TFLOP/s), "
          f"x{ms_fma / ms_fl:.1f}")


def test_flash_prefill_on_a_stream_tiny_and_padded_tables():
    """A 1-token and a 5-token segment, -1 table padding, a non-default stream, max_query_len
    above the real longest segment (empty tiles return early)."""
    rng = np.random.default_rng(12)
    segments = [(0, 1), (300, 5)]
    q, kc, vc, tables, token_seq, starts, positions = make_batch(rng, LLAMA, segments)
    d_out = cuda.to_device(np.full_like(q, np.nan))
    s = cuda.stream()
    F.flash_prefill_attention(cuda.to_device(q), cuda.to_device(kc), cuda.to_device(vc), cuda.to_device(tables),
                              cuda.to_device(starts), cuda.to_device(positions), 0.1, d_out, max_query_len=200,
                              stream=s)
    s.synchronize()
    want = attention.attention_ref(bf16_round(q), kc, vc, tables, token_seq, positions, 0.1)
    np.testing.assert_allclose(d_out.copy_to_host(), want, atol=3e-2, rtol=0)
