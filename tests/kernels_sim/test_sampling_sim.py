"""kernels_numba/sampling.py under the simulator vs its NumPy references: Philox, float keys, the
penalty/bias/logprob prepare kernel and the sample kernel (greedy, temperature, top-k/p, min-p, masks)."""
import math

import numpy as np
from numba import cuda

from kernels_numba import sampling as S


@cuda.jit
def _philox_kernel(counters, key, out):
    i = cuda.grid(1)
    if i < counters.shape[0]:
        w = S.philox4x32(np.uint64(counters[i, 0]), np.uint64(counters[i, 1]), np.uint64(counters[i, 2]),
                         np.uint64(counters[i, 3]), np.uint64(key[0]), np.uint64(key[1]))
        for j in range(4):
            out[i, j] = w[j]


@cuda.jit
def _key_kernel(x, out):
    i = cuda.grid(1)
    if i < x.shape[0]:
        out[i] = S.f32_key(x[i])


def test_philox_and_keys_match_reference():
    rng = np.random.default_rng(0)
    ctr = rng.integers(0, 2**32, (8, 4), dtype=np.uint64)
    key = np.array([0xA4093822, 0x299F31D0], np.uint64)
    out = np.zeros((8, 4), np.uint64)
    _philox_kernel[1, 32](ctr, key, out)
    want = np.stack(S.philox4x32_ref(*ctr.T, key[0], key[1]), axis=1)
    np.testing.assert_array_equal(out, want)
    x = np.array([-np.inf, -3.5, -0.0, 0.0, 1e-30, 2.0, np.inf, -1e-30], np.float32)
    keys = np.zeros(8, np.uint64)
    _key_kernel[1, 32](x, keys)
    np.testing.assert_array_equal(keys, S.f32_key_ref(x))
    assert (np.diff(S.f32_key_ref(np.sort(x)).astype(np.int64)) >= 0).all()


def _batch(rng, R, V):
    logits = (rng.standard_normal((R, V)) * 2).astype(np.float32)
    f = np.zeros((R, S.NF), np.float32)
    i = np.zeros((R, S.NI), np.int32)
    f[:, S.F_INV_TEMP] = [0.0, 1.0, 1 / 0.7, 2.0, 1.0, 1.0]
    f[:, S.F_TOP_P] = [1.0, 1.0, 0.8, 1.0, 0.5, 1.0]
    f[:, S.F_LOG_MIN_P] = [-np.inf, -np.inf, -np.inf, -np.inf, -np.inf, math.log(0.2)]
    f[:, S.F_REP] = [1.3, 1.0, 1.0, 1.0, 2.0, 1.0]
    i[:, S.I_TOP_K] = [-1, -1, 20, 7, -1, -1]
    i[:, S.I_USE_MASK] = [0, 0, 0, 1, 0, 1]
    i[:, S.I_NUM_LOGPROBS] = [3, -1, 0, 5, -1, 20]
    i[:, S.I_SEED_LO] = rng.integers(-2**31, 2**31, R)
    i[:, S.I_SEED_HI] = rng.integers(-2**31, 2**31, R)
    i[:, S.I_STEP] = np.arange(R) * 3
    toks, reps, adds, starts = [], [], [], [0]
    for r in range(R):
        t = rng.choice(V, size=4 + r, replace=False)
        toks += list(t)
        reps += list(rng.integers(0, 2, t.size))
        adds += list(rng.standard_normal(t.size).astype(np.float32))
        starts.append(len(toks))
    adds[0] = -np.inf
    i[:, S.I_ADJ_START], i[:, S.I_ADJ_END] = starts[:-1], starts[1:]
    mask = rng.integers(0, 2**32, (R, -(-V // 32)), dtype=np.uint64).astype(np.uint32)
    return (logits, mask, f, i, np.array(toks, np.int32), np.array(reps, np.int32), np.array(adds, np.float32))


def _run_kernels(logits, mask, f, i, tok, rep, add):
    R, N = logits.shape[0], tok.size
    x = logits.copy()
    raw_saved, lse = np.zeros(N, np.float32), np.zeros(R, np.float32)
    top_ids = np.full((R, S.MAX_TOP_LOGPROBS), -1, np.int32)
    top_lps = np.full((R, S.MAX_TOP_LOGPROBS), np.nan, np.float32)
    S.prepare_rows(x, f, i, tok, rep, add, raw_saved, lse, top_ids, top_lps)
    for r in range(R):                   # the prepare kernel alone = the adjustment reference
        a, b = i[r, S.I_ADJ_START], i[r, S.I_ADJ_END]
        np.testing.assert_allclose(x[r], S.apply_adjustments_ref(logits[r], f[r, S.F_REP], tok[a:b], rep[a:b], add[a:b]),
                                   rtol=1e-6)
    out, lps = np.zeros(R, np.int32), np.zeros(R, np.float32)
    S.sample_rows(x, mask, f, i, tok, raw_saved, lse, out, lps)
    return out, lps, top_ids, top_lps


def test_pipeline_matches_reference():
    rng = np.random.default_rng(1)
    args = _batch(rng, 6, 300)
    out, lps, top_ids, top_lps = _run_kernels(*args)
    want, want_lps, want_ids, want_top = S.sample_rows_ref(*args)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_allclose(lps, want_lps, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(top_ids, want_ids)
    np.testing.assert_allclose(top_lps, want_top, rtol=1e-5, atol=1e-5)


def test_seeds_steps_and_empty_rows():
    rng = np.random.default_rng(2)
    logits, mask, f, i, tok, rep, add = _batch(rng, 6, 300)
    f[:, S.F_INV_TEMP] = 1.0
    i[:, S.I_USE_MASK] = 0
    i[:, S.I_ADJ_END] = i[:, S.I_ADJ_START]        # no adjustments
    logits[:] = logits[0]                           # same row, different seeds/steps: different draws
    i[2, S.I_USE_MASK] = 1
    mask[2] = 0                                     # nothing allowed: -1
    out, *_ = _run_kernels(logits, mask, f, i, tok, rep, add)
    want, *_ = S.sample_rows_ref(logits, mask, f, i, tok, rep, add)
    np.testing.assert_array_equal(out, want)
    assert out[2] == -1
    assert len(set(out.tolist())) >= 3
