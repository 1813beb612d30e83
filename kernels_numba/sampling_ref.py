"""The host sampler's NumPy references and the parameter layout they share with the device sampler
(kernels_numba/sampling.py re-exports all of it): fparams / iparams columns, the Philox uniforms, the
float keys, the fixed-point top-p mass, and a row's whole draw (sample_row_ref). Apart from the CUDA
kernels so that the host side (metrale/sampling/sampler.py, the speculator) reads them without
importing numba.cuda (~40 MB resident on a CPU-only process)."""
from __future__ import annotations

import numpy as np

from kernels_numba.philox import M32 as _M32, S32 as _S32, philox4x32_ref  # noqa: F401

NEG_INF = np.float32(-np.inf)

MAX_TOP_LOGPROBS = 20
# fparams columns
F_INV_TEMP, F_TOP_P, F_LOG_MIN_P, F_REP, F_FREQ, F_PRES = range(6)
NF = 6
# iparams columns (I_PENDING, I_WINDOW_END: 0 = none, else the value + 1, so zeroed rows have neither)
(I_TOP_K, I_USE_MASK, I_NUM_LOGPROBS, I_SEED_LO, I_SEED_HI, I_STEP, I_ADJ_START, I_ADJ_END, I_PENDING,
 I_WINDOW_END) = range(10)
NI = 10
_S9 = np.uint64(9)
_ONE64 = np.uint64(1)
_TWO_M24 = np.float32(2.0 ** -24)
_KEY_TOP = np.uint64(0x80000000)          # key of +0.0: z <= 0 always (z = (x - max) * inv_temp)
MASS_SCALE_BITS = 42                       # fixed-point mass: exp(z) in (0, 1] -> integer units of 2^-42
_MASS_SCALE = np.float32(2.0 ** MASS_SCALE_BITS)
_P_SCALE = np.float32(2.0 ** 48)


def uniforms_ref(indices: np.ndarray, step: int, seed_lo: int, seed_hi: int) -> np.ndarray:
    """The float32 uniforms of vocabulary ids `indices` at `step` for key (seed_lo, seed_hi)."""
    idx = np.asarray(indices, dtype=np.int64)
    groups = (idx // 4).astype(np.uint64)
    z = np.zeros_like(groups)
    words = np.stack(philox4x32_ref(groups, np.full_like(z, np.uint64(step) & _M32), z, z,
                                    np.uint64(seed_lo) & _M32, np.uint64(seed_hi) & _M32), axis=1)
    x = words[np.arange(idx.size), idx % 4]
    return (((x >> _S9) << _ONE64) | _ONE64).astype(np.float32) * _TWO_M24

def gumbel_ref(u: np.ndarray) -> np.ndarray:
    return -np.log(-np.log(u.astype(np.float32)))

def f32_key_ref(x) -> np.ndarray:
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return np.where(b & _KEY_TOP, b ^ _M32, b | _KEY_TOP)

def _key1(x) -> np.uint64:
    return f32_key_ref(np.array([x], dtype=np.float32))[0]

def mass_units_ref(z) -> np.ndarray:
    """Fixed-point mass of float32 z (<= 0): trunc(float32(exp(z)) * 2^42) as uint64 (exp in float64
    here, float32 libdevice on the device: they may differ by an ulp of exp, i.e. ~2^-24 relative)."""
    e = np.exp(np.asarray(z, dtype=np.float64)).astype(np.float32)
    return (e * _MASS_SCALE).astype(np.uint64)

def top_p_units_ref(total: int, top_p: float) -> int:
    """The top-p target in mass units: floor(total * floor(top_p * 2^48) / 2^48), at least 1."""
    p = int(np.float32(top_p) * _P_SCALE)
    return max((int(total) * p) >> 48, 1)

def bitmask_allows_ref(mask_row: np.ndarray, V: int) -> np.ndarray:
    """Bool [V]: bit i of the packed uint32 row."""
    bits = np.unpackbits(np.ascontiguousarray(mask_row, dtype=np.uint32).view(np.uint8), bitorder="little")
    return bits[:V].astype(bool)

def adj_word(rep_flag: bool, count: int) -> int:
    """An adj_rep entry: bit 0 the repetition flag (the token is in the penalty window), the bits
    above it the token's count among the window's generated tokens (frequency / presence)."""
    return int(count) << 1 | int(bool(rep_flag))

def with_pending_ref(tokens, reps, adds, rep: float, pending: int, window_end: int = -1):
    """A row's list (tokens, reps, adds) after one more token `pending` (>= 0) in the window: its count
    + 1 and its repetition flag set (a new entry when it had none); the tool-call END token
    `window_end` instead empties the window (every entry's flag and count cleared: bias and bans stay)."""
    t = np.asarray(tokens, dtype=np.int64)
    w = np.array(reps, dtype=np.int64)
    a = np.asarray(adds, dtype=np.float32)
    if pending == window_end:
        return t, np.zeros_like(w), a
    flag = int(np.float32(rep) != 1)
    hit = np.flatnonzero(t == pending)
    if hit.size:
        w[hit] = (((w[hit] >> 1) + 1) << 1) | flag
        return t, w, a
    return np.append(t, pending), np.append(w, adj_word(flag, 1)), np.append(a, np.float32(0.0))

def apply_adjustments_ref(row: np.ndarray, rep: float, tokens, reps, adds, freq: float = 0.0, pres: float = 0.0,
                          pending: int = -1, window_end: int = -1) -> np.ndarray:
    """Penalties and bias of one row (a new float32 array): per entry, the repetition penalty where
    its flag is set, then + adds - (freq * count + pres) where its count > 0 (reps: adj_word).
    pending >= 0: a token drawn after the counts were made (with_pending_ref)."""
    x = np.array(row, dtype=np.float32)
    if pending >= 0:
        tokens, reps, adds = with_pending_ref(tokens, reps, adds, rep, pending, window_end)
    t = np.asarray(tokens, dtype=np.int64)
    if t.size:
        w = np.asarray(reps, dtype=np.int64)
        v = x[t]
        rp = np.float32(rep)
        pen = np.where(v > 0, v / rp, v * rp).astype(np.float32)
        v = np.where(w & 1 != 0, pen, v)
        c = (w >> 1).astype(np.float32)
        a = np.asarray(adds, dtype=np.float32)
        a = np.where(c > 0, (-(np.float32(freq) * c) - np.float32(pres)) + a, a).astype(np.float32)
        x[t] = v + a
    return x

def pending_token_ref(p: np.ndarray, pending) -> int:
    """Row p's (iparams) pending token: the previous step's token it has not counted yet, or -1."""
    src = int(p[I_PENDING]) - 1
    if src < 0 or pending is None or src >= len(pending):
        return -1
    return int(pending[src])

def adjusted_row_ref(raw: np.ndarray, f: np.ndarray, p: np.ndarray, adj_token, adj_rep, adj_add, pending=None):
    """Row (fparams f, iparams p) after its adjustments: its slice of the lists, and its pending
    token from `pending` (the previous step's tokens) where it has one."""
    a, b = int(p[I_ADJ_START]), int(p[I_ADJ_END])
    return apply_adjustments_ref(raw, f[F_REP], adj_token[a:b], adj_rep[a:b], adj_add[a:b], f[F_FREQ], f[F_PRES],
                                 pending_token_ref(p, pending), int(p[I_WINDOW_END]) - 1)

def top_k_key_ref(keys: np.ndarray, k: int) -> np.uint64:
    """The k-th largest key (the top-k threshold), 0 when top-k is off."""
    if k <= 0 or k >= keys.size:
        return np.uint64(0)
    return np.partition(keys, keys.size - k)[keys.size - k]

def top_p_key_ref(z: np.ndarray, keys: np.ndarray, thr: np.uint64, top_p: float) -> np.uint64:
    """The largest key t >= thr with mass(z >= t) >= top_p * mass(z >= thr)."""
    if top_p >= 1.0:
        return thr
    sel = keys >= thr
    zs = np.sort(z[sel])[::-1]
    cum = np.cumsum(np.exp(zs.astype(np.float64)))
    j = int(np.searchsorted(cum, np.float64(np.float32(top_p)) * cum[-1], side="left"))
    return _key1(zs[min(j, zs.size - 1)])

def sample_row_ref(x: np.ndarray, allowed: np.ndarray | None, inv_temp: float, top_k: int, top_p: float,
                   log_min_p: float, seed_lo: int, seed_hi: int, step: int) -> int:
    """One row of sample_rows on adjusted logits x (float32 [V]); allowed: bool [V] or None."""
    x = np.asarray(x, dtype=np.float32)
    if allowed is not None:
        x = np.where(allowed, x, NEG_INF)
    m = x.max()
    if m == NEG_INF or np.isnan(m):
        return -1
    if inv_temp == 0:
        return int(np.argmax(x))
    z = ((x - m) * np.float32(inv_temp)).astype(np.float32)
    keys = f32_key_ref(z)
    thr = top_k_key_ref(keys, top_k)
    thr = top_p_key_ref(z, keys, thr, top_p)
    thr = max(thr, _key1(log_min_p))
    kept = np.flatnonzero((keys >= thr) & (z > NEG_INF))
    v = z[kept] + gumbel_ref(uniforms_ref(kept, step, seed_lo, seed_hi))
    return int(kept[np.argmax(v)])

def logprob_stats_ref(row: np.ndarray, n: int) -> tuple[np.float32, np.ndarray, np.ndarray]:
    """(logsumexp, top-n ids, their logprobs) of a raw row; ties to the lower id."""
    x = np.asarray(row, dtype=np.float32)
    m = x.max()
    lse = np.float32(m + np.log(np.exp((x - m).astype(np.float64)).sum()))
    n = min(n, x.size)
    if n > 0:
        cand = np.flatnonzero(x >= np.partition(x, x.size - n)[x.size - n])    # ties at the border included
        ids = cand[np.lexsort((cand, -x[cand]))][:n]
    else:
        ids = np.zeros(0, np.int64)
    return lse, ids.astype(np.int32), (x[ids] - lse).astype(np.float32)

def sample_rows_ref(logits, mask, fparams, iparams, adj_token, adj_rep, adj_add, pending=None):
    """The whole pipeline (prepare_rows + sample_rows) without touching `logits`; pending: the
    previous step's tokens, which rows with I_PENDING read (adjusted_row_ref).
    Returns tokens int32 [R], logprobs float32 [R] (NaN: not asked), top_ids int32 [R, 20] (-1 pad),
    top_lps float32 [R, 20] (NaN pad)."""
    logits = np.asarray(logits, dtype=np.float32)
    R, V = logits.shape
    tokens = np.full(R, -1, np.int32)
    lps = np.full(R, np.nan, np.float32)
    top_ids = np.full((R, MAX_TOP_LOGPROBS), -1, np.int32)
    top_lps = np.full((R, MAX_TOP_LOGPROBS), np.nan, np.float32)
    for r in range(R):
        f, p = fparams[r], iparams[r]
        raw = logits[r]
        x = adjusted_row_ref(raw, f, p, adj_token, adj_rep, adj_add, pending)
        allowed = bitmask_allows_ref(mask[r], V) if p[I_USE_MASK] else None
        tok = sample_row_ref(x, allowed, f[F_INV_TEMP], int(p[I_TOP_K]), float(f[F_TOP_P]), f[F_LOG_MIN_P],
                             int(np.uint32(p[I_SEED_LO])), int(np.uint32(p[I_SEED_HI])), int(np.uint32(p[I_STEP])))
        tokens[r] = tok
        n = int(p[I_NUM_LOGPROBS])
        if n >= 0:
            lse, ids, vals = logprob_stats_ref(raw, min(n, MAX_TOP_LOGPROBS))
            top_ids[r, :ids.size] = ids
            top_lps[r, :ids.size] = vals
            if tok >= 0:
                lps[r] = raw[tok] - lse
    return tokens, lps, top_ids, top_lps
