"""embedding, rmsnorm, rope, silu_mul, store_kv and argmax under the simulator vs their references."""
import numpy as np
import pytest
from numba import cuda

from kernels_numba.activation import silu_mul, silu_mul_ref
from kernels_numba.argmax import argmax_rows, argmax_rows_ref
from kernels_numba.bf16 import to_bf16_bits
from kernels_numba.embedding import embedding_feed, embedding_feed_ref, embedding_gather, embedding_gather_ref
from kernels_numba.kv_cache import store_kv, store_kv_ref
from kernels_numba.rmsnorm import add_rms_norm, add_rms_norm_ref, rms_norm, rms_norm_ref
from kernels_numba.rope import rope_inplace, rope_ref
from metrale.models.rope import build_rope


def test_embedding_gather():
    rng = np.random.default_rng(0)
    table = to_bf16_bits(rng.standard_normal((50, 40)))
    ids = np.array([3, 49, 0, 3, -1, 50], np.int32)
    out = np.full((6, 40), np.nan, np.float32)
    embedding_gather(table, ids, out)
    np.testing.assert_array_equal(out, embedding_gather_ref(table, ids))


def test_rms_norm_rows_and_heads():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 72)).astype(np.float32) * 3
    w = (1 + 0.1 * rng.standard_normal(72)).astype(np.float32)
    out = np.zeros_like(x)
    rms_norm(x, w, 1e-6, out)
    np.testing.assert_allclose(out, rms_norm_ref(x, w, 1e-6), rtol=2e-6, atol=2e-6)
    # per-head view (Qwen3 q/k norm): the first 3 heads of a [T, 5, hd] buffer, in place
    buf = rng.standard_normal((2, 5, 16)).astype(np.float32)
    w3 = (1 + 0.1 * rng.standard_normal(16)).astype(np.float32)
    d_buf = cuda.to_device(buf)
    heads = d_buf[:, :3, :]
    rms_norm(heads, w3, 1e-6, heads)
    got = d_buf.copy_to_host()
    np.testing.assert_allclose(got[:, :3], rms_norm_ref(buf[:, :3], w3, 1e-6), rtol=2e-6, atol=2e-6)
    np.testing.assert_array_equal(got[:, 3:], buf[:, 3:])


def test_add_rms_norm():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 72)).astype(np.float32)
    res = rng.standard_normal((3, 72)).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(72)).astype(np.float32)
    want_out, want_res = add_rms_norm_ref(x, res, w, 1e-5)
    out = np.zeros_like(x)
    add_rms_norm(x, res, w, 1e-5, out)
    np.testing.assert_array_equal(res, want_res)
    np.testing.assert_allclose(out, want_out, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("interleaved", [True, False])
def test_rope(interleaved):
    rng = np.random.default_rng(3)
    T, hq, hk, hd = 3, 3, 1, 16
    cos, sin = build_rope(hd, 10000.0).tables(64)
    q = rng.standard_normal((T, hq, hd)).astype(np.float32)
    k = rng.standard_normal((T, hk, hd)).astype(np.float32)
    pos = np.array([0, 17, 63], np.int32)
    q_ref, k_ref = rope_ref(q, k, pos, cos, sin, interleaved)
    rope_inplace(q, k, pos, cos, sin, interleaved)
    np.testing.assert_allclose(q, q_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(k, k_ref, rtol=1e-5, atol=1e-5)


def test_silu_mul():
    rng = np.random.default_rng(4)
    gu = (rng.standard_normal((3, 2 * 40)) * 4).astype(np.float32)
    out = np.zeros((3, 40), np.float32)
    silu_mul(gu, out)
    np.testing.assert_allclose(out, silu_mul_ref(gu), rtol=1e-5, atol=1e-6)


def test_store_kv():
    rng = np.random.default_rng(5)
    T, hk, hd, nb, bs = 4, 2, 16, 3, 4
    k = rng.standard_normal((T, hk, hd)).astype(np.float32)
    v = rng.standard_normal((T, hk, hd)).astype(np.float32)
    slots = np.array([5, -1, 0, 11], np.int32)
    kc = np.full((nb, bs, hk, hd), 7, np.uint16)
    vc = np.full((nb, bs, hk, hd), 7, np.uint16)
    kc_ref, vc_ref = kc.copy(), vc.copy()
    store_kv_ref(k, v, slots, kc_ref, vc_ref)
    store_kv(k, v, slots, kc, vc)
    np.testing.assert_array_equal(kc, kc_ref)
    np.testing.assert_array_equal(vc, vc_ref)


def test_argmax_rows():
    """Several chunks a row (CHUNK = 64 in the simulator): a tie across chunks goes to the lowest
    index, an all -inf row, -0.0 against +0.0 (equal: the first), a winner in the last partial
    chunk; work is left zero and a second launch on it agrees (graph replay)."""
    from kernels_numba.argmax import argmax_work_size
    rng = np.random.default_rng(6)
    logits = rng.standard_normal((5, 300)).astype(np.float32)
    logits[1, 7] = logits[1, 250] = 99.0  # tie in different chunks -> lowest index
    logits[2] = -np.inf
    logits[3] = -1.0
    logits[3, 200], logits[3, 20] = 0.0, -0.0
    logits[4, 299] = 50.0                 # the last (partial) chunk
    work = np.zeros(argmax_work_size(5), np.uint64)
    for _ in range(2):
        out = np.full(5, -5, np.int32)
        argmax_rows(logits, out, work)
        np.testing.assert_array_equal(out, argmax_rows_ref(logits))
        assert not work.any()


def test_embedding_feed_takes_fed_tokens_from_the_previous_step():
    rng = np.random.default_rng(3)
    table = rng.integers(0, 2**15, size=(50, 16)).astype(np.uint16)
    ids = np.array([0, 7, 0, 3], dtype=np.int32)
    src = np.array([2, -1, 0, -1], dtype=np.int32)
    prev = np.array([11, 49, 5], dtype=np.int32)
    out = np.zeros((4, 16), np.float32)
    d_ids = ids.copy()
    embedding_feed(table, d_ids, src, prev, out)
    np.testing.assert_array_equal(out, embedding_feed_ref(table, ids, src, prev))
    np.testing.assert_array_equal(d_ids, [5, 7, 11, 3])
