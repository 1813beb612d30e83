"""Every kernel of bf16/embedding/rmsnorm/rope/activation/kv_cache/attention/argmax on the real GPU
at model sizes (SmolLM2-135M: D=576, 9/3 heads, hd=64; Llama-3-8B: D=4096, 32/8 heads, hd=128;
contexts 512..8192) against the NumPy references.  Run: pytest -m gpu tests/gpu"""
import math

import ml_dtypes
import numpy as np
import pytest
from numba import cuda

from kernels_numba import activation, argmax, attention, embedding, kv_cache, rmsnorm, rope
from kernels_numba.bf16 import bf16_to_f32, f32_to_bf16, from_bf16_bits, to_bf16_bits
from metrale.models.rope import build_rope

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cuda.is_available(), reason="needs a CUDA GPU")]

SMOL = dict(name="smollm2", D=576, hq=9, hk=3, hd=64, F=1536, V=49152, theta=100000.0, scaling=None)
LLAMA = dict(name="llama3-8b", D=4096, hq=32, hk=8, hd=128, F=14336, V=128256, theta=500000.0,
             scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192})
SHAPES = [SMOL, LLAMA]
BS = 16  # KV block size of the engine


def ids(shape):
    return shape["name"]


def rnd(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)).astype(np.float32)


# ---------------------------------------------------------------- bf16


@cuda.jit
def _bf16_kernel(x, bits, back):
    i = cuda.grid(1)
    if i < x.shape[0]:
        bits[i] = f32_to_bf16(x[i])
        back[i] = bf16_to_f32(bits[i])


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_bf16_conversions_real_path():
    rng = np.random.default_rng(0)
    x = np.concatenate([
        np.ldexp(rnd(rng, 100000), rng.integers(-135, 125, 100000)),  # normals, subnormals, overflow to inf
        np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-40, 3.4e38, 1.00390625, 1.01171875], np.float32),
        (np.arange(1 << 16, dtype=np.uint32) << 16 | 0x8000).view(np.float32),  # exact ties
    ]).astype(np.float32)
    bits = cuda.device_array(x.shape, np.uint16)
    back = cuda.device_array(x.shape, np.float32)
    _bf16_kernel[(x.shape[0] + 255) // 256, 256](cuda.to_device(x), bits, back)
    bits, back = bits.copy_to_host(), back.copy_to_host()
    ok = ~np.isnan(x)
    np.testing.assert_array_equal(bits[ok], to_bf16_bits(x[ok]))
    assert np.isnan(from_bf16_bits(bits[~ok])).all()
    np.testing.assert_array_equal(back[ok], x[ok].astype(ml_dtypes.bfloat16).astype(np.float32))


# ---------------------------------------------------------------- small ops


@pytest.mark.parametrize("shape", SHAPES, ids=ids)
def test_embedding_gather(shape):
    rng = np.random.default_rng(1)
    table = to_bf16_bits(rnd(rng, shape["V"], shape["D"]))
    tok = rng.integers(0, shape["V"], 37).astype(np.int32)
    out = cuda.device_array((37, shape["D"]), np.float32)
    embedding.embedding_gather(cuda.to_device(table), cuda.to_device(tok), out)
    np.testing.assert_array_equal(out.copy_to_host(), embedding.embedding_gather_ref(table, tok))


@pytest.mark.parametrize("T", [1, 37, 512])
@pytest.mark.parametrize("shape", SHAPES, ids=ids)
def test_rms_norm_and_fused_add(shape, T):
    rng = np.random.default_rng(2)
    D = shape["D"]
    x, res = rnd(rng, T, D, scale=3.0), rnd(rng, T, D)
    w = (1 + 0.1 * rnd(rng, D)).astype(np.float32)
    out = cuda.device_array((T, D), np.float32)
    rmsnorm.rms_norm(cuda.to_device(x), cuda.to_device(w), 1e-5, out)
    np.testing.assert_allclose(out.copy_to_host(), rmsnorm.rms_norm_ref(x, w, 1e-5), rtol=1e-5, atol=1e-5)
    d_res = cuda.to_device(res)
    rmsnorm.add_rms_norm(cuda.to_device(x), d_res, cuda.to_device(w), 1e-5, out)
    want_out, want_res = rmsnorm.add_rms_norm_ref(x, res, w, 1e-5)
    np.testing.assert_array_equal(d_res.copy_to_host(), want_res)
    np.testing.assert_allclose(out.copy_to_host(), want_out, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", SHAPES, ids=ids)
def test_rms_norm_per_head_strided_view(shape):
    """Qwen3-style q/k norm on the q heads of a [T, Hq + 2 Hk, hd] QKV buffer, in place."""
    rng = np.random.default_rng(3)
    T, hq, hk, hd = 29, shape["hq"], shape["hk"], shape["hd"]
    buf = rnd(rng, T, hq + 2 * hk, hd, scale=2.0)
    w = (1 + 0.1 * rnd(rng, hd)).astype(np.float32)
    d_buf = cuda.to_device(buf)
    heads = d_buf[:, :hq, :]
    rmsnorm.rms_norm(heads, cuda.to_device(w), 1e-6, heads)
    got = d_buf.copy_to_host()
    np.testing.assert_allclose(got[:, :hq], rmsnorm.rms_norm_ref(buf[:, :hq], w, 1e-6), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[:, hq:], buf[:, hq:])


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("shape", SHAPES, ids=ids)
def test_rope(shape, interleaved):
    rng = np.random.default_rng(4)
    T, hq, hk, hd = 64, shape["hq"], shape["hk"], shape["hd"]
    cos, sin = build_rope(hd, shape["theta"], shape["scaling"], 8192).tables(8192)
    q, k = rnd(rng, T, hq, hd), rnd(rng, T, hk, hd)
    pos = np.sort(rng.integers(0, 8192, T)).astype(np.int32)
    pos[-1] = 8191
    q_ref, k_ref = rope.rope_ref(q, k, pos, cos, sin, interleaved)
    d_q, d_k = cuda.to_device(q), cuda.to_device(k)
    rope.rope_inplace(d_q, d_k, cuda.to_device(pos), cuda.to_device(cos), cuda.to_device(sin), interleaved)
    np.testing.assert_allclose(d_q.copy_to_host(), q_ref, rtol=1e-5, atol=2e-6)
    np.testing.assert_allclose(d_k.copy_to_host(), k_ref, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("T", [1, 300])
@pytest.mark.parametrize("shape", SHAPES, ids=ids)
def test_silu_mul(shape, T):
    rng = np.random.default_rng(5)
    gu = rnd(rng, T, 2 * shape["F"], scale=4.0)
    out = cuda.device_array((T, shape["F"]), np.float32)
    activation.silu_mul(cuda.to_device(gu), out)
    np.testing.assert_allclose(out.copy_to_host(), activation.silu_mul_ref(gu), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", SHAPES, ids=ids)
def test_store_kv(shape):
    rng = np.random.default_rng(6)
    T, hk, hd, nb = 200, shape["hk"], shape["hd"], 64
    k, v = rnd(rng, T, hk, hd), rnd(rng, T, hk, hd)
    slots = rng.permutation(nb * BS)[:T].astype(np.int32)
    slots[::17] = -1
    kc = rng.integers(0, 1 << 16, (nb, BS, hk, hd)).astype(np.uint16)
    vc = rng.integers(0, 1 << 16, (nb, BS, hk, hd)).astype(np.uint16)
    kc_ref, vc_ref = kc.copy(), vc.copy()
    kv_cache.store_kv_ref(k, v, slots, kc_ref, vc_ref)
    d_kc, d_vc = cuda.to_device(kc), cuda.to_device(vc)
    kv_cache.store_kv(cuda.to_device(k), cuda.to_device(v), cuda.to_device(slots), d_kc, d_vc)
    np.testing.assert_array_equal(d_kc.copy_to_host(), kc_ref)
    np.testing.assert_array_equal(d_vc.copy_to_host(), vc_ref)


@pytest.mark.parametrize("V", [49152, 128256])
def test_argmax_rows(V):
    rng = np.random.default_rng(7)
    logits = rnd(rng, 6, V, scale=5.0)
    logits[1, 1000] = logits[1, 90000 % V] = 1e4  # tie: lowest index
    logits[2, V - 1] = 1e4
    logits[3] = 0.0
    logits[4] = -np.inf
    out = cuda.device_array(6, np.int32)
    work = cuda.to_device(np.zeros(argmax.argmax_work_size(6), np.uint64))
    for _ in range(2):                    # the work array is left zero: a second launch agrees
        argmax.argmax_rows(cuda.to_device(logits), out, work)
        np.testing.assert_array_equal(out.copy_to_host(), argmax.argmax_rows_ref(logits))
    assert not work.copy_to_host().any()


# ---------------------------------------------------------------- attention


def make_batch(rng, shape, segments, q_scale=2.0):
    """segments: [(first_position, num_tokens)] -> host arrays of one ragged batch; the blocks of
    all segments are scattered over the cache."""
    hq, hk, hd = shape["hq"], shape["hk"], shape["hd"]
    need = [(p + n + BS - 1) // BS for p, n in segments]
    nb = sum(need) + 3
    perm = rng.permutation(nb).astype(np.int32)
    tables = np.full((len(segments), max(need)), -1, np.int32)
    at = 0
    for s, m in enumerate(need):
        tables[s, :m] = perm[at:at + m]
        at += m
    kc = to_bf16_bits(rnd(rng, nb, BS, hk, hd))
    vc = to_bf16_bits(rnd(rng, nb, BS, hk, hd))
    positions = np.concatenate([np.arange(p, p + n) for p, n in segments]).astype(np.int32)
    token_seq = np.concatenate([np.full(n, s) for s, (_, n) in enumerate(segments)]).astype(np.int32)
    starts = np.concatenate([[0], np.cumsum([n for _, n in segments])]).astype(np.int32)
    q = rnd(rng, positions.shape[0], hq, hd, scale=q_scale)
    return q, kc, vc, tables, token_seq, starts, positions


def check_rows(out, q, kc, vc, tables, token_seq, positions, scale, rows):
    want = attention.attention_ref(q[rows], kc, vc, tables, token_seq[rows], positions[rows], scale)
    np.testing.assert_allclose(out[rows], want, rtol=1e-3, atol=5e-5)


def run_paged(shape, q, kc, vc, tables, token_seq, positions, scale, max_context, with_scratch=True, **kw):
    T = q.shape[0]
    d_out = cuda.device_array(q.shape, np.float32)
    scratch = None
    if with_scratch:
        scratch = cuda.device_array(attention.paged_attention_scratch_shape(
            max(T, 1), shape["hq"], shape["hk"], shape["hd"], max_context), np.float32)
    stream = cuda.stream()
    attention.paged_attention(cuda.to_device(q), cuda.to_device(kc).view(np.uint64), cuda.to_device(vc),
                              cuda.to_device(tables), cuda.to_device(token_seq), cuda.to_device(positions),
                              scale, d_out, scratch=scratch, max_context=max_context, stream=stream, **kw)
    stream.synchronize()
    return d_out.copy_to_host()


@pytest.mark.parametrize("batch,ctx", [(1, 512), (1, 8192), (32, 4096), (128, 512), (8, 8192)])
@pytest.mark.parametrize("shape", SHAPES, ids=ids)
def test_paged_attention_decode(shape, batch, ctx):
    rng = np.random.default_rng(batch * 7 + ctx)
    lens = rng.integers(1, ctx + 1, batch)
    lens[0] = ctx
    q, kc, vc, tables, token_seq, _, positions = make_batch(rng, shape, [(int(n) - 1, 1) for n in lens])
    scale = 1.0 / math.sqrt(shape["hd"])
    out = run_paged(shape, q, kc, vc, tables, token_seq, positions, scale, max_context=ctx)
    rows = np.unique(np.concatenate([[0, batch - 1], rng.integers(0, batch, 6)]))
    check_rows(out, q, kc, vc, tables, token_seq, positions, scale, rows)
    # without scratch (no split-K) the result is the same
    out2 = run_paged(shape, q[rows], kc, vc, tables, token_seq[rows], positions[rows], scale, max_context=ctx,
                     with_scratch=False)
    np.testing.assert_allclose(out2, out[rows], rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("shape", SHAPES, ids=ids)
def test_mixed_ragged_batch_both_kernels(shape):
    """decode rows, a 300-token prefill chunk after 1000 cached positions, a fresh 77-token prompt
    and a 4-token verify block in one batch; paged_attention and prefill_attention agree with the
    reference."""
    rng = np.random.default_rng(8)
    segments = [(4000, 1), (1000, 300), (0, 77), (2500, 4), (17, 1)]
    q, kc, vc, tables, token_seq, starts, positions = make_batch(rng, shape, segments)
    scale = 1.0 / math.sqrt(shape["hd"])
    rows = np.unique(np.concatenate([[0, 1, 150, 300, 301, 377, 378, 381, 382], rng.integers(0, q.shape[0], 10)]))
    out = run_paged(shape, q, kc, vc, tables, token_seq, positions, scale, max_context=4096)
    check_rows(out, q, kc, vc, tables, token_seq, positions, scale, rows)
    d_out = cuda.device_array(q.shape, np.float32)
    attention.prefill_attention(cuda.to_device(q), cuda.to_device(kc), cuda.to_device(vc), cuda.to_device(tables),
                                cuda.to_device(starts), cuda.to_device(positions), scale, d_out, max_query_len=300)
    out_p = d_out.copy_to_host()
    check_rows(out_p, q, kc, vc, tables, token_seq, positions, scale, rows)
    np.testing.assert_allclose(out_p, out, rtol=1e-3, atol=5e-5)


@pytest.mark.parametrize("shape", SHAPES, ids=ids)
def test_prefill_attention_long(shape):
    """A 4096-token prompt and a 1000-token chunk starting at position 2048, checked on sampled rows."""
    rng = np.random.default_rng(9)
    segments = [(0, 4096), (2048, 1000)]
    q, kc, vc, tables, token_seq, starts, positions = make_batch(rng, shape, segments)
    scale = 1.0 / math.sqrt(shape["hd"])
    d_out = cuda.device_array(q.shape, np.float32)
    attention.prefill_attention(cuda.to_device(q), cuda.to_device(kc), cuda.to_device(vc), cuda.to_device(tables),
                                cuda.to_device(starts), cuda.to_device(positions), scale, d_out, max_query_len=4096)
    out = d_out.copy_to_host()
    rows = np.unique(np.concatenate([[0, 1, 31, 32, 4095, 4096, 5095], rng.integers(0, q.shape[0], 40)]))
    check_rows(out, q, kc, vc, tables, token_seq, positions, scale, rows)
    assert np.isfinite(out).all()
