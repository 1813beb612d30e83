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


# ---------------------------------------------------------------- radix-select thresholds


@cuda.jit
def _thresholds_kernel(logits, mask, fparams, iparams, out):
    """The sample kernel's thresholds of each row: out[r] = (top-k key, top-p key, max)."""
    cnt = cuda.shared.array(S.RADIX_BINS, np.uint32)
    wt = cuda.shared.array(S.RADIX_BINS, np.uint64)
    res = cuda.shared.array(8, np.int64)
    wsum = cuda.shared.array(64, np.int64)
    scratch = cuda.shared.array(S.SCRATCH, np.float32)
    r = cuda.blockIdx.x
    use_mask = iparams[r, S.I_USE_MASK] != 0
    inv_t = fparams[r, S.F_INV_TEMP]
    m = S.NEG_INF
    for i in range(cuda.threadIdx.x, logits.shape[1], cuda.blockDim.x):
        m = max(m, S._masked_x(logits, mask, r, i, use_mask))
    m = S.block_max(m, scratch)
    thr = S._KEY_NEG_INF
    k = iparams[r, S.I_TOP_K]
    if k > 0 and k < logits.shape[1]:
        thr = S._radix_select(logits, mask, r, use_mask, m, inv_t, thr, np.int64(k), np.float32(-1.0), False,
                              cnt, wt, res, wsum)[0]
    out[r, 0] = thr
    if fparams[r, S.F_TOP_P] < 1:
        thr = S._radix_select(logits, mask, r, use_mask, m, inv_t, thr, np.int64(0), fparams[r, S.F_TOP_P], False,
                              cnt, wt, res, wsum)[0]
    out[r, 1] = thr


def _rows(rng, V, specs, dist="normal"):
    """One row per spec (inv_temp, top_k, top_p, log_min_p, use_mask) over logits of a given shape."""
    R = len(specs)
    if dist == "normal":
        logits = (rng.standard_normal((R, V)) * 3).astype(np.float32)
    elif dist == "ties":                               # few distinct values: ties at every border
        logits = (rng.integers(-12, 4, (R, V)) * 0.5).astype(np.float32)
    elif dist == "peaked":                             # one dominant token per row
        logits = (rng.standard_normal((R, V))).astype(np.float32)
        logits[np.arange(R), rng.integers(0, V, R)] = 12.0
    else:
        raise ValueError(dist)
    f = np.zeros((R, S.NF), np.float32)
    i = np.zeros((R, S.NI), np.int32)
    for r, (inv_t, k, p, lmp, um) in enumerate(specs):
        f[r, :4] = inv_t, p, lmp, 1.0              # F_INV_TEMP, F_TOP_P, F_LOG_MIN_P, F_REP
        i[r, S.I_TOP_K], i[r, S.I_USE_MASK], i[r, S.I_NUM_LOGPROBS] = k, um, -1
    i[:, S.I_SEED_LO] = rng.integers(-2**31, 2**31, R)
    i[:, S.I_SEED_HI] = rng.integers(-2**31, 2**31, R)
    i[:, S.I_STEP] = rng.integers(0, 1000, R)
    W = -(-V // 32)
    mask = np.zeros((R, W), np.uint32)
    for r in range(R):                                 # masks of different densities
        dens = [0.5, 0.05, 0.9, 0.01][r % 4]
        bits = rng.random(W * 32) < dens
        bits[rng.integers(0, V)] = True
        mask[r] = np.packbits(bits, bitorder="little").view(np.uint32)
    return logits, mask, f, i


def _kept_ref(x, allowed, inv_t, k, p):
    """Bool sets of the reference's top-k and top-k + top-p survivors (finite z only)."""
    x = np.where(allowed, x, S.NEG_INF) if allowed is not None else x
    z = ((x - x.max()) * np.float32(inv_t)).astype(np.float32)
    keys = S.f32_key_ref(z)
    tk = S.top_k_key_ref(keys, k)
    tp = S.top_p_key_ref(z, keys, tk, p)
    fin = z > S.NEG_INF
    return keys, fin, (keys >= tk) & fin, (keys >= tp) & fin


SPECS = [(1.0, 50, 1.0, -np.inf, 0), (1.0, -1, 0.9, -np.inf, 0), (1 / 0.7, 40, 0.8, -np.inf, 1),
         (2.0, 1, 1.0, -np.inf, 0), (1.0, 1999, 0.95, -np.inf, 1), (0.5, 7, 0.3, -np.inf, 1),
         (1.0, 300, 0.999, -np.inf, 0), (1.0, -1, 0.05, -np.inf, 1), (1.0, 600, 0.5, -np.inf, 1),
         (1.0, 1, 0.9, -np.inf, 0), (1.0, 2, 0.5, -np.inf, 0), (0.25, 3, 0.7, -np.inf, 0)]


import pytest  # noqa: E402


@pytest.mark.parametrize("V,dist", [(300, "normal"), (2000, "normal"), (1000, "ties"), (777, "peaked")])
def test_radix_thresholds_keep_the_reference_sets(V, dist):
    rng = np.random.default_rng(V)
    logits, mask, f, i = _rows(rng, V, SPECS, dist)
    logits[0, :5] = -np.inf                           # banned tokens
    out = np.zeros((len(SPECS), 2), np.uint64)
    _thresholds_kernel[len(SPECS), S.THREADS](logits, mask, f, i, out)
    for r, (inv_t, k, p, _, um) in enumerate(SPECS):
        allowed = S.bitmask_allows_ref(mask[r], V) if um else None
        keys, fin, want_k, want_p = _kept_ref(logits[r], allowed, inv_t, k, p)
        got_k, got_p = (keys >= out[r, 0]) & fin, (keys >= out[r, 1]) & fin
        np.testing.assert_array_equal(got_k, want_k, err_msg=f"top-k row {r}")
        np.testing.assert_array_equal(got_p, want_p, err_msg=f"top-p row {r}")
        if 0 < k < fin.sum():
            assert got_k.sum() >= k                    # ties at the border kept
            assert got_k.sum() == k or dist == "ties"


def test_top_p_mass_units():
    assert S.top_p_units_ref(1 << 42, 0.5) == 1 << 41
    assert S.top_p_units_ref(1000, 1e-30) == 1                      # never 0: the max is always kept
    total = (1 << 42) * 151936
    assert S.top_p_units_ref(total, 0.9) == (total * int(np.float32(0.9) * 2.0**48)) >> 48
    assert abs(S.top_p_units_ref(total, 0.9) / total - 0.9) < 1e-7


@pytest.mark.parametrize("V,dist", [(1500, "normal"), (1200, "ties"), (512, "peaked")])
def test_pipeline_matches_reference_with_mixed_filters(V, dist):
    rng = np.random.default_rng(V + 7)
    specs = SPECS + [(0.0, -1, 1.0, -np.inf, 0), (0.0, 5, 0.5, -np.inf, 1),        # greedy rows
                     (1.0, -1, 1.0, math.log(0.05), 0), (1.3, 30, 0.9, math.log(0.1), 1),  # min-p
                     (1.0, -1, 1.0, -np.inf, 0)]                                     # temperature only
    logits, mask, f, i = _rows(rng, V, specs, dist)
    R = len(specs)
    logits[1, rng.integers(0, V, 20)] = -np.inf
    tok = np.zeros(1, np.int32)
    args = (logits, mask, f, i, tok, tok, np.zeros(1, np.float32))
    i[:, S.I_ADJ_START] = i[:, S.I_ADJ_END] = 0
    out, *_ = _run_kernels(*args)
    want, *_ = S.sample_rows_ref(*args)
    np.testing.assert_array_equal(out, want)
    # the same rows at other steps: other draws, still the reference's
    i[:, S.I_STEP] += 1
    out2, *_ = _run_kernels(*args)
    want2, *_ = S.sample_rows_ref(*args)
    np.testing.assert_array_equal(out2, want2)
    assert (out >= 0).all()


def test_radix_border_inside_a_bin():
    """Two keys one apart share a bin of the first two digits: top-k = 2 keeps the upper one, and the
    top-p pass over the survivors, which ends on a bin holding one survivor, must not widen back to
    that bin's lower edge."""
    V = 64
    specs = [(1.0, 2, 0.9, -np.inf, 0), (1.0, 2, 0.5, -np.inf, 0), (1.0, 3, 0.99, -np.inf, 0),
             (1.0, 2, 1.0, -np.inf, 0)]
    logits, mask, f, i = _rows(np.random.default_rng(3), V, specs)
    logits[:] = -np.abs(logits) - 6
    logits[:, 10], logits[:, 3] = np.float32(0.0), np.float32(-1.3)
    logits[:, 7] = np.nextafter(np.float32(-1.3), np.float32(-2.0))
    out = np.zeros((len(specs), 2), np.uint64)
    _thresholds_kernel[len(specs), S.THREADS](logits, mask, f, i, out)
    for r, (inv_t, k, p, _, _) in enumerate(specs):
        keys, fin, want_k, want_p = _kept_ref(logits[r], None, inv_t, k, p)
        np.testing.assert_array_equal((keys >= out[r, 0]) & fin, want_k)
        np.testing.assert_array_equal((keys >= out[r, 1]) & fin, want_p)
    assert (S.f32_key_ref(logits[0] - 0) >= out[0, 1]).nonzero()[0].tolist() == [3, 10]


# ---------------------------------------------------------------- compaction (COMPACT_CAP survivors)


def _record_paths(monkeypatch):
    """Per row: the _top_k_x mode, the compacted count n (None: no compaction pass) and whether the
    compacted list sampled the token. The simulator runs device functions as Python: wrap them."""
    paths = {}
    blocks = {}
    top_k_x, compact, list_sample = S._top_k_x, S._compact, S._list_sample

    def row():          # called inside a simulated thread: the kernel's cuda is the fake one
        return paths.setdefault(int(cuda.blockIdx.x), {"mode": None, "n": None, "list": False})

    @cuda.jit(device=True)
    def w_top_k_x(*a):
        out = top_k_x(*a)
        if cuda.threadIdx.x == 0:
            row()["mode"] = int(out[0])
        return out

    @cuda.jit(device=True)
    def w_compact(*a):
        n = compact(*a)
        if cuda.threadIdx.x == 0:
            row()["n"] = int(n)
        return n

    @cuda.jit(device=True)
    def w_list_sample(*a):
        if cuda.threadIdx.x == 0:
            row()["list"] = True
        return list_sample(*a)

    monkeypatch.setattr(S, "_top_k_x", w_top_k_x)
    monkeypatch.setattr(S, "_compact", w_compact)
    monkeypatch.setattr(S, "_list_sample", w_list_sample)
    return paths


def _pipeline(logits, mask, f, i):
    tok = np.zeros(1, np.int32)
    i[:, S.I_ADJ_START] = i[:, S.I_ADJ_END] = 0
    args = (logits, mask, f, i, tok, tok, np.zeros(1, np.float32))
    out, *_ = _run_kernels(*args)
    want, *_ = S.sample_rows_ref(*args)
    return out, want


CAP = S.COMPACT_CAP
COMPACT_SPECS = [
    (1.0, 7, 1.0, -np.inf, 0),             # 0 top-k <= CAP: compacted after the max pass (+ <= 2 digits)
    (1 / 0.7, 20, 0.8, -np.inf, 1),        # 1 top-k + top-p, masked
    (1.0, 1, 0.9, -np.inf, 0),             # 2 k = 1
    (1.0, 30, 1e-6, -np.inf, 0),           # 3 top_p tiny: the max only
    (2.0, CAP, 0.9, -np.inf, 0),           # 4 k = CAP
    (1.0, CAP + 40, 0.95, -np.inf, 0),     # 5 k > CAP: exact key(x) threshold, top-p radix (may compact)
    (1.0, -1, 0.3, -np.inf, 0),            # 6 top-p alone
    (0.5, -1, 0.9, -np.inf, 1),            # 7 top-p alone, masked
    (1.0, 25, 0.9, math.log(0.05), 0),     # 8 top-k + top-p + min-p in the list
    (1.0, -1, 1.0, math.log(0.1), 0),      # 9 min-p alone: max + Gumbel pass
    (1.3, 10, 1.0, -np.inf, 1),            # 10 top-k alone, masked
    (1.0, -1, 0.999, -np.inf, 0),          # 11 top-p alone near 1 on a flat row: fallback
]


@pytest.mark.parametrize("V,dist", [(1500, "normal"), (1200, "ties"), (900, "peaked")])
def test_compacted_rows_match_reference(monkeypatch, V, dist):
    """Every filtered row: the tokens equal the reference's at two steps, through the compacted
    list when its survivors fit COMPACT_CAP and through the passes over V when they do not."""
    paths = _record_paths(monkeypatch)
    rng = np.random.default_rng(V + 11)
    logits, mask, f, i = _rows(rng, V, COMPACT_SPECS, dist)
    logits[0, :5] = -np.inf                              # banned tokens
    logits[1, rng.integers(0, V, 30)] = -np.inf
    for step in range(2):
        i[:, S.I_STEP] += 1
        paths.clear()
        out, want = _pipeline(logits, mask, f, i)
        np.testing.assert_array_equal(out, want, err_msg=f"step {step}: {paths}")
        assert (out >= 0).all()
    p = paths
    assert 9 not in p                                                  # min-p alone: no compaction
    assert p[5]["mode"] == 2                                           # k > CAP: the exact threshold
    if dist == "normal":
        for r in (0, 1, 2, 3, 8, 10):
            assert p[r]["mode"] == 1 and p[r]["n"] <= CAP and p[r]["list"], (r, p[r])
        assert 11 not in p                                             # top-p on a flat row: fallback
    if dist == "peaked":
        for r in (0, 2, 3, 6, 7):                                      # top-p alone compacts too
            assert p[r]["list"] and p[r]["n"] <= CAP, (r, p[r])
    if dist == "ties":                                                 # 16 values, ~V/16 ties each
        assert any(p[r]["mode"] == 2 for r in (0, 8, 10))               # ties at the border > CAP


def test_compaction_overflow_from_rounding_ties_falls_back(monkeypatch):
    """x values that differ but round to the same z = x - m (m = 1000: ulp 6e-5): the key(x) candidates
    fit COMPACT_CAP, their z-ties do not; the row falls back to the exact radix thresholds, and the
    reference keeps every tie of the k-th z."""
    paths = _record_paths(monkeypatch)
    V = 400
    specs = [(1.0, 3, 1.0, -np.inf, 0), (1.0, 3, 0.9, -np.inf, 0), (1.0, 2, 1.0, -np.inf, 0)]
    logits, mask, f, i = _rows(np.random.default_rng(5), V, specs)
    logits[:] = np.float32(-60.0) + np.float32(0.25) * np.arange(V, dtype=np.float32) % 7
    logits[:, 5] = np.float32(1000.0)
    ties = np.arange(20, 20 + CAP + 6)
    logits[:, ties] = (np.arange(ties.size) * 1e-7).astype(np.float32)   # all z == -1000
    z = logits[0] - np.float32(1000.0)
    assert (z[ties] == np.float32(-1000.0)).all() and np.unique(logits[0, ties]).size == ties.size
    f[:, S.F_INV_TEMP] = 0.01                                       # z = -10 for the ties: sampled often
    out, want = _pipeline(logits, mask, f, i)
    np.testing.assert_array_equal(out, want)
    for r in range(3):
        assert paths[r]["mode"] == 1 and paths[r]["n"] == ties.size + 1 and not paths[r]["list"], paths[r]
    seen = set()
    for step in range(4):                                           # the ties beyond the top-k of x are kept (step 0: 70)
        i[:, S.I_STEP] = step
        out, want = _pipeline(logits, mask, f, i)
        np.testing.assert_array_equal(out, want)
        seen |= set(out.tolist())
    assert seen - {5, ties[-1], ties[-2], ties[-3]}


@pytest.mark.filterwarnings("ignore:overflow")
def test_compacted_border_ties_and_edges(monkeypatch):
    """Ties at the top-k and top-p borders inside the compacted list, a row whose k-th z is -inf
    (inv_temp overflow), and rows whose survivors are exactly COMPACT_CAP."""
    paths = _record_paths(monkeypatch)
    V = 512
    specs = [(1.0, 4, 1.0, -np.inf, 0), (1.0, 10, 0.6, -np.inf, 0), (1.0, -1, 0.5, -np.inf, 0),
             (1.0, CAP, 1.0, -np.inf, 0), (1.0, 3, 0.99, -np.inf, 0)]
    logits, mask, f, i = _rows(np.random.default_rng(9), V, specs)
    logits[:] = -20 - np.abs(logits)
    logits[0, [3, 9, 40, 41, 77]] = [5.0, 4.0, 4.0, 4.0, 3.0]       # k = 4 ends inside the 4.0 ties: 5 kept
    logits[1, :12] = [6, 5, 5, 5, 5, 4, 4, 3, 3, 3, 3, 3]           # k = 10 border on the 3s; top-p on the 5s
    logits[2, 100:104] = [2.0, 2.0, 1.0, 1.0]                       # top-p 0.5 border on a tie
    logits[3, :CAP] = np.linspace(0, 10, CAP, dtype=np.float32)     # exactly CAP candidates
    logits[4, :4] = [3e38, 2.9e38, -3e38, -3e38]                    # z of the 3rd is -inf at inv_temp 1e10
    f[4, S.F_INV_TEMP] = 1e10
    seen = [set() for _ in specs]
    for step in range(24):                                          # every kept tie drawn by step 17
        i[:, S.I_STEP] = step
        paths.clear()
        out, want = _pipeline(logits, mask, f, i)
        np.testing.assert_array_equal(out, want, err_msg=str(paths))
        for r, t in enumerate(out):
            seen[r].add(int(t))
    for r in (0, 1, 2, 3):
        assert paths[r]["list"], (r, paths[r])
    assert seen[0] == {3, 9, 40, 41}                                 # the 4.0 ties kept, 3.0 not
    assert seen[1] <= {0, 1, 2, 3, 4} and len(seen[1]) >= 3
    assert seen[2] <= {100, 101} and seen[2] == {100, 101}


def test_split_rows_match_reference():
    """Rows without top-k drawn from spans of a row (temperature / min-p rows; with top_p=True top-p
    rows too, through three span passes and scans of its mass digits) give the reference's tokens
    and logprobs, at any span count, beside rows that are not split (greedy, top-k) in the same
    launch; a row masked whole gives -1; the mass histograms are left cleared."""
    for seed, V in ((11, 301), (12, 300), (13, 257)):
        rng = np.random.default_rng(seed)
        logits, mask, f, i, tok, rep, add = _batch(rng, 6, V)
        mask[1] = 0
        i[1, S.I_USE_MASK] = 1 if seed == 13 else 0          # row 1 (temperature only) masked whole once
        args = (logits, mask, f, i, tok, rep, add)
        want, want_lps, _, _ = S.sample_rows_ref(*args)
        x0 = logits.copy()                                   # the prepare kernel once a batch (deterministic)
        raw0, lse0 = np.zeros(tok.size, np.float32), np.zeros(6, np.float32)
        top_ids = np.full((6, S.MAX_TOP_LOGPROBS), -1, np.int32)
        top_lps = np.full((6, S.MAX_TOP_LOGPROBS), np.nan, np.float32)
        S.prepare_rows(x0, f, i, tok, rep, add, raw0, lse0, top_ids, top_lps)
        for chunks, top_p in ((2, False), (3, True), (7, False), (7, True)):
            x, raw_saved, lse = x0.copy(), raw0.copy(), lse0.copy()
            out, lps = np.zeros(6, np.int32), np.zeros(6, np.float32)
            parts = tuple(np.full(a.shape, -7, a.dtype) for a in (np.zeros((6, S.MAX_CHUNKS), np.float32),
                                                                   np.zeros((6, S.MAX_CHUNKS), np.float32),
                                                                   np.zeros((6, S.MAX_CHUNKS), np.int32)))
            parts += (np.zeros((6, S.RADIX_BINS), np.uint64), np.zeros((6, 4), np.int64))
            S.sample_rows(x, mask, f, i, tok, raw_saved, lse, out, lps, parts=parts, chunks=chunks, top_p=top_p)
            np.testing.assert_array_equal(out, want, err_msg=f"seed {seed} V {V} chunks {chunks} top_p {top_p}")
            np.testing.assert_allclose(lps, want_lps, rtol=1e-5, atol=1e-5)
            split = [r for r in range(6) if f[r, S.F_INV_TEMP] != 0 and not 0 < i[r, S.I_TOP_K] < V
                     and (top_p or f[r, S.F_TOP_P] >= 1)]
            assert split == ([1, 4, 5] if top_p else [1, 5]), split
            assert S.top_p_split_rows(f, i, V)
            others = [r for r in range(6) if r not in split]
            assert (parts[2][split, :chunks] != -7).all() and (parts[2][:, chunks:] == -7).all()
            assert (parts[2][others] == -7).all()                    # rows not split leave theirs alone
            assert (parts[3] == 0).all()
            if top_p:                                                # row 4's threshold: the reference's kept set
                keys = S.f32_key_ref((x[4] - x[4].max()) * f[4, S.F_INV_TEMP])
                kept = keys >= np.uint64(parts[4][4, 2])
                p_sorted = np.sort(np.exp((x[4] - x[4].max()).astype(np.float64)))[::-1]
                n = int(np.searchsorted(np.cumsum(p_sorted) / p_sorted.sum(), f[4, S.F_TOP_P]) + 1)
                assert abs(int(kept.sum()) - n) <= 1, (kept.sum(), n)
        if seed == 13:
            assert want[1] == -1


def test_split_chunks_choice():
    assert S.split_chunks(1, 128256) == S.MAX_CHUNKS
    assert S.split_chunks(32, 128256) == 8
    assert S.split_chunks(256, 128256) < 2                   # a full step: one block a row
    assert S.split_chunks(1, 300) == 300 // 4 // S.SPLIT_THREADS
