"""The sampling pipeline over a batch of logits rows with different parameters: device kernels and
their NumPy references (the references are also the CPU backend's sampler).

Per row r of logits [R, V] (float32), two kernels, one 1024-thread block per row:

  prepare_rows  1. if the row wants logprobs (num_logprobs >= 0): lse[r] = logsumexp(raw row) and the
                   top-n raw logprobs (n <= 20; ties to the lower id);
                2. sparse adjustments, in place: for each entry e of the row's list
                   (adj_token, adj_rep, adj_add): x = logits[r, t]; raw_saved[e] = x;
                   if bit 0 of adj_rep: x = x / rep if x > 0 else x * rep;  x += adj_add, and with
                   c = adj_rep >> 1 > 0 (the token's count): x -= frequency * c + presence.
                   (adj_add = logit_bias, or -inf to ban a token: min_tokens.) Token ids of a row's
                   list are distinct. A row with a pending token t (I_PENDING: the previous step's
                   drawn token, which the host had not counted when it packed the row; the loop a
                   step ahead) counts it first: its entry's c + 1 and repetition flag set, or a new
                   entry (c = 1, adj_add 0) when t is not listed; the tool-call END token
                   (I_WINDOW_END) instead empties the penalty window: no entry's flag or count
                   applies this step (bias and bans do). sampling_ref.with_pending_ref.
  sample_rows   x_i = adjusted logit, -inf where the row's packed bitmask bit i is 0 (use_mask);
                m = max x. Greedy rows (inv_temp == 0): argmax x. Others: z_i = (x_i - m) * inv_temp;
                keep z_i >= max(top-k threshold, top-p threshold, log_min_p); sample by Gumbel-max:
                argmax over kept i of z_i - log(-log(u_i)), u_i = uniform(Philox4x32-10,
                key = seed, counter = (i // 4, step, 0, 0), lane i % 4). Ties go to the lower id; a
                row with nothing left gives -1. The sampled token's raw logprob is raw - lse.

Thresholds work on the order-preserving uint32 key of float32 (so a threshold is an exact value of
the row): top-k keeps keys >= the k-th largest key; top-p keeps keys >= the largest key t with
mass(z >= t) >= top_p * mass(z >= top-k threshold) (mass = sum of exp(z)), i.e. the smallest set of
most likely tokens whose probability reaches top_p, ties at the border kept. The references sort. The
device finds both by radix select over the key, most significant digit first (`_radix_select`): the
keys of z <= 0 lie in [key(-inf), key(+0)], so d = key - key(-inf) has 31 bits, cut in digits of 11,
10 and 10 bits. One pass over the row builds a shared-memory histogram of the current digit of the
elements still in play (z > -inf, key >= the lower bound, higher digits equal to the prefix chosen so
far): counts for top-k, masses for top-p; a block scan from the top bin picks the bin holding the
border, and the next pass refines inside it. Masses are fixed-point integers (exp(z) in units of
2^-42, uint64 shared atomics: integer sums do not depend on the order of the atomics, so the result
is deterministic and reproducible) and the top-p target is floor(total * floor(top_p * 2^48) / 2^48)
in the same units (at least 1, so the max is always kept). A selection stops early when the chosen
bin holds one element, or (top-k) exactly the elements still needed: the bin's lower edge (never
below the lower bound) keeps the same set as the exact key.

Top-k is searched on the raw logits first: z is non-decreasing in x (inv_temp > 0), so the k-th largest
z is z(k-th largest x) (order statistics commute with a monotone map), and the first digit of key(x)
(11 of 32 bits: digits 11, 11, 10) is counted in the max pass, before m is known (`_top_k_x`).
**Compaction**: as soon as the elements at or above the chosen bin's lower edge number at most
COMPACT_CAP (2048; 64 in the simulator), one pass gathers the row's elements with key(z) >= key(z(edge))
into shared memory as (key(z) << 32 | id) (`_compact`; z(edge) <= z_k, so every survivor is there), and
top-k (the k-th largest key of the bitonic-sorted list), top-p (the same fixed-point masses and scan as
the radix passes, over the sorted list), min-p and the Gumbel-max draw (Philox of the survivors' ids
only, the same uniforms) run on that list (`_list_sample`): no further pass over V. Top-p alone
compacts the same way when the elements at or above a mass digit's bin fit (top-p's target was set
over the whole row by the first mass pass). Otherwise (k > COMPACT_CAP, ties at the border beyond
the cap, top-p on a flat row) the radix passes run to the exact key and the last pass draws over V;
a compaction that overflows (float rounding of x - m tying more z to the edge than the count of
key(x) said) falls back to the exact radix thresholds over the row. Both paths give the same token.

Passes over the row (each one load per element; V / 1024 loads per thread):
  greedy row            1   (argmax; its value is the max m every sampled row needs)
  temperature only      2   (argmax, Gumbel-max)
  min-p alone           2   (a key compare in the last pass)
  top-k (k <= CAP) [+ top-p, min-p]
                        2..4 (max + first-digit counts, 0..2 more digits until the candidates fit,
                        1 compaction; usually 2: a quarter-binade bin around the k-th logit holds few
                        elements) -- was up to 8
  top-p alone           3..5 (max, 1..3 mass passes, compaction or the Gumbel pass)
  k > CAP or ties       up to 1 + 2 + 3 + 1 = 7 (max + counts, 2 more digits, top-p 1..3, Gumbel)
  overflow fallback     the above plus the z-space radix passes (rare)
Expected at V = 151,936 on an H200 (from the measured 0.044 ms greedy / 0.131 ms temperature rows and
0.299 ms for 8 passes): top-k 50 + top-p 0.9 ~0.10-0.13 ms per step at batch 64 (was 0.299), i.e.
~4% of the 3.05 ms decode step (unmeasured). top-k <= 0 or >= V / top-p >= 1 skip their passes.
Static shared memory: histograms 2048 x (4 + 8) bytes + the list COMPACT_CAP x 8 bytes = ~41 KB.
One 1024-thread block per row: at V = 151,936 a pass is ~150 loads per thread, and the rows of a step run side by side (one block per SM: 132 rows per
wave on an H200); a row of 600 KB stays in L2 between passes. Elements with z = -inf (masked,
banned) are skipped by the histograms: they never count (top-k with k > the finite elements keeps
them all, as the reference, whose k-th key is then key(-inf), does). The references and the device
draw the same Philox uniforms, so CPU and GPU sample the same token except where float rounding of
the logits, of exp (libdevice float32 vs float64) or of a mass sum sits exactly on a decision
border.

Parameters per row (host-packed): fparams float32 [R, NF] (F_* columns), iparams int32 [R, NI]
(I_* columns); mask uint32 [R, ceil(V/32)] (bit i of word i >> 5); adjustment lists int32/float32
[N] with the row's slice iparams[r, I_ADJ_START:I_ADJ_END]. Launchers take device (or host) arrays
and allocate nothing, so they can be captured in a CUDA graph.
"""

from __future__ import annotations

import math
import struct

import numpy as np
from numba import cuda
from kernels_numba.jit import kernel as cached_jit

from kernels_numba.ptx import grid_trigger, grid_wait
from kernels_numba.bf16 import (FULL_MASK, NEG_INF, SIMULATOR, _argmax_better, block_argmax, block_max, block_sum,
                                device_function)

THREADS = 32 if SIMULATOR else 1024
# A 1024-thread block may use at most 64 registers a thread: say so to the compiler, or a kernel
# that wants more (sample_rows: 84 on sm_90) fails to launch with LAUNCH_OUT_OF_RESOURCES
# (seen on the H200); with the bound it spills ~300 bytes a thread to L1-cached local memory.
_row_kernel = cached_jit if SIMULATOR else cached_jit(launch_bounds=(THREADS,))
SCRATCH = 1024 if SIMULATOR else 32
# Most survivors a filtered row gathers into shared memory (a power of two, a multiple of THREADS);
# small in the simulator so that its tests reach both the compacted path and the fallback.
COMPACT_CAP = 64 if SIMULATOR else 2048


from kernels_numba.sampling_ref import (  # noqa: E402,F401  (NumPy references, CUDA-free: sampling_ref.py)
    F_FREQ, F_INV_TEMP, F_LOG_MIN_P, F_PRES, F_REP, F_TOP_P, I_ADJ_END, I_ADJ_START, I_NUM_LOGPROBS, I_PENDING,
    I_SEED_HI, I_SEED_LO, I_STEP, I_TOP_K, I_USE_MASK, I_WINDOW_END, MASS_SCALE_BITS, MAX_TOP_LOGPROBS,
    NF, NI, _KEY_TOP, _MASS_SCALE, _ONE64, _P_SCALE, _S9,
    _TWO_M24, _key1, adj_word, adjusted_row_ref, apply_adjustments_ref, bitmask_allows_ref, f32_key_ref, gumbel_ref,
    logprob_stats_ref, mass_units_ref, pending_token_ref, sample_row_ref, sample_rows_ref, top_k_key_ref,
    top_p_key_ref, top_p_units_ref, uniforms_ref, with_pending_ref)
from kernels_numba.philox import M32 as _M32, S32 as _S32, PHILOX_M0 as _PHILOX_M0, PHILOX_M1 as _PHILOX_M1  # noqa: E402
from kernels_numba.philox import PHILOX_W0 as _PHILOX_W0, PHILOX_W1 as _PHILOX_W1, philox4x32_ref  # noqa: E402,F401


# ---------------------------------------------------------------- Philox4x32-10


@device_function
def philox4x32(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 (Salmon et al. 2011). Words are uint64 holding 32-bit values (Numba would widen
    uint32 arithmetic anyway, and the simulator must not overflow numpy scalars)."""
    for _ in range(10):
        p0 = _PHILOX_M0 * c0
        p1 = _PHILOX_M1 * c2
        n0 = (p1 >> _S32) ^ c1 ^ k0
        n2 = (p0 >> _S32) ^ c3 ^ k1
        c1 = p1 & _M32
        c3 = p0 & _M32
        c0 = n0
        c2 = n2
        k0 = (k0 + _PHILOX_W0) & _M32
        k1 = (k1 + _PHILOX_W1) & _M32
    return c0, c1, c2, c3


@device_function
def _lane_word(w0, w1, w2, w3, lane):
    """Word `lane` (0-3) of a Philox output: the one an id's uniform comes from (id % 4)."""
    if lane == 1:
        return w1
    if lane == 2:
        return w2
    if lane == 3:
        return w3
    return w0


@device_function
def _uniform(x):
    """uint32 -> float32 in (0, 1): odd multiples of 2^-24 (exact in float32, never 0 or 1)."""
    return np.float32(((x >> _S9) << _ONE64) | _ONE64) * _TWO_M24


# ---------------------------------------------------------------- float keys

if SIMULATOR:

    @cuda.jit(device=True)
    def f32_key(x):
        b = struct.unpack("<I", struct.pack("<f", float(x)))[0]
        return np.uint64(b ^ 0xFFFFFFFF if b & 0x80000000 else b | 0x80000000)

else:
    from numba.cuda import libdevice

    @device_function
    def f32_key(x):
        """Order-preserving uint32 key of a float32 (as uint64): a < b <=> key(a) < key(b)."""
        b = np.uint64(np.uint32(libdevice.float_as_int(x)))
        if b & _KEY_TOP:
            return b ^ _M32
        return b | _KEY_TOP


if SIMULATOR:

    @cuda.jit(device=True)
    def f32_of_key(key):
        k = int(key)
        b = k & 0x7FFFFFFF if k & 0x80000000 else k ^ 0xFFFFFFFF
        return np.float32(struct.unpack("<f", struct.pack("<I", b))[0])

else:

    @device_function
    def f32_of_key(key):
        """The float32 whose f32_key is `key` (uint64 holding 32 bits)."""
        if key & _KEY_TOP:
            b = key & np.uint64(0x7FFFFFFF)
        else:
            b = key ^ _M32
        return libdevice.int_as_float(np.int32(np.uint32(b)))


# ---------------------------------------------------------------- device helpers


@device_function
def _masked_x(logits, mask, r, i, use_mask):
    x = logits[r, i]
    if use_mask:
        if (np.uint32(mask[r, i >> 5]) >> np.uint32(i & 31)) & np.uint32(1) == 0:
            x = NEG_INF
    return x


# ---------------------------------------------------------------- radix select over the float key
#
# The keys the thresholds are searched among lie in [key(-inf), key(+0.0)] = [0x007FFFFF, 0x80000000]
# (z <= 0), so d = key - key(-inf) fits in 31 bits: three digits of 11, 10 and 10 bits, from the top.
# Elements with z = -inf are never kept and never counted (see _radix_select).

_KEY_NEG_INF = np.uint64(0x007FFFFF)      # key of -inf
RADIX_BINS = 2048                          # bins of the widest digit (shared histograms)
_LEVEL_SHIFT = (20, 10, 0)
_LEVEL_BITS = (11, 10, 10)
_S48 = np.uint64(48)
_S16 = np.uint64(16)


if SIMULATOR:

    @cuda.jit(device=True)
    def _top_p_units(total, top_p):
        return np.int64(top_p_units_ref(int(total), float(top_p)))

    @cuda.jit(device=True)
    def _find_bin(weights, counts, nb, target, top_p, res, wsum):
        """Scan the bins from the top: the bin b with above(b) < target <= above(b) + weights[b], where
        above(b) = sum of weights[b' > b]. With top_p >= 0 the target is first set to
        top_p_units(sum of all weights). Returns (b or -1 when the weights do not reach the target,
        above(b), counts[b], target, sum of counts[b' > b]). Deterministic: integer sums."""
        cuda.syncthreads()
        if cuda.threadIdx.x == 0:
            if top_p >= 0:
                total = 0
                for b in range(nb):
                    total += int(weights[b])
                target = top_p_units_ref(total, float(top_p))
            res[0], res[1], res[2], res[3], res[4] = -1, 0, 0, target, 0
            c = 0
            cc = 0
            for p in range(nb):
                b = nb - 1 - p
                h = int(weights[b])
                if c < target <= c + h:
                    res[0], res[1], res[2], res[4] = b, c, int(counts[b]), cc
                    break
                c += h
                cc += int(counts[b])
        cuda.syncthreads()
        out = np.int64(res[0]), np.int64(res[1]), np.int64(res[2]), np.int64(res[3]), np.int64(res[4])
        cuda.syncthreads()
        return out

else:

    @device_function
    def _top_p_units(total, top_p):
        p = np.int64(top_p * _P_SCALE)
        hi = np.uint64(libdevice.umul64hi(total, p))
        lo = np.uint64(total) * np.uint64(p)
        t = np.int64((hi << _S16) | (lo >> _S48))
        if t < 1:
            t = np.int64(1)
        return t

    @device_function
    def _find_bin(weights, counts, nb, target, top_p, res, wsum):
        """See the simulator version. One 1024-thread block: each thread owns nb / 1024 consecutive bins
        (from the top), warp-shuffle inclusive scans (weights and counts), warp totals through shared
        memory (wsum: 64 entries)."""
        tid = cuda.threadIdx.x
        lane = tid & 31
        warp = tid >> 5
        per = nb // cuda.blockDim.x
        s = np.int64(0)
        sc = np.int64(0)
        for j in range(per):
            b = nb - 1 - (tid * per + j)
            s += np.int64(weights[b])
            sc += np.int64(counts[b])
        incl = s
        inclc = sc
        off = 1
        while off < 32:
            o = cuda.shfl_up_sync(FULL_MASK, incl, off)
            oc = cuda.shfl_up_sync(FULL_MASK, inclc, off)
            if lane >= off:
                incl += o
                inclc += oc
            off <<= 1
        if tid == 0:
            res[0] = np.int64(-1)
            res[1] = np.int64(0)
            res[2] = np.int64(0)
            res[4] = np.int64(0)
        if lane == 31:
            wsum[warp] = incl
            wsum[32 + warp] = inclc
        cuda.syncthreads()
        c = incl - s
        cc = inclc - sc
        for w in range(warp):
            c += wsum[w]
            cc += wsum[32 + w]
        if top_p >= np.float32(0.0):
            total = np.int64(0)
            for w in range(cuda.blockDim.x >> 5):
                total += wsum[w]
            target = _top_p_units(total, top_p)
        for j in range(per):
            b = nb - 1 - (tid * per + j)
            h = np.int64(weights[b])
            if c < target and c + h >= target:
                res[0] = np.int64(b)
                res[1] = c
                res[2] = np.int64(counts[b])
                res[4] = cc
            c += h
            cc += np.int64(counts[b])
        cuda.syncthreads()
        out0 = res[0]
        out1 = res[1]
        out2 = res[2]
        out4 = res[4]
        cuda.syncthreads()
        return out0, out1, out2, target, out4


@device_function
def _radix_select(logits, mask, r, use_mask, m, inv_t, lo_key, target, top_p, allow_compact, cnt, wt, res, wsum):
    """Over the row's elements with z > -inf and key(z) >= lo_key, with weight w = 1 (top_p < 0: top-k,
    `target` = k) or w = mass units of exp(z) (top_p >= 0: top-p, target = top_p * their total mass):
    the largest key t with W(key >= t) >= target, found digit by digit (3 passes over the row at most;
    shared histograms cnt uint32 / wt uint64 [RADIX_BINS]). Returns (t, clo, t0), t0 = the target of
    the first digit (for top-p: top_p_units(total mass)).
    t is lo_key when the weights do not reach the target (top-k with k > the finite elements) and may be
    a smaller key than the exact one when the row has no element between them (a bin holding one
    element, or exactly the k still needed): {key >= t} is the same set of kept elements.
    With allow_compact, the search stops as soon as the elements with key >= the chosen bin's lower edge
    number at most COMPACT_CAP: it then returns (lo_key, that edge, t0) and the border lies among those
    elements (clo = 0 otherwise)."""
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    V = logits.shape[1]
    by_mass = top_p >= np.float32(0.0)
    prefix = np.uint64(0)
    zero = np.uint64(0)
    t0 = np.int64(target)
    n_above = np.int64(0)
    for level in range(3):
        shift = np.uint64(_LEVEL_SHIFT[level])
        nbits = np.uint64(_LEVEL_BITS[level])
        hi_shift = shift + nbits
        nb = 1 << _LEVEL_BITS[level]
        dmask = np.uint64(nb - 1)
        for b in range(tid, nb, nt):
            cnt[b] = np.uint32(0)
            wt[b] = np.uint64(0)
        cuda.syncthreads()
        for i in range(tid, V, nt):
            z = (_masked_x(logits, mask, r, i, use_mask) - m) * inv_t
            if z > NEG_INF:
                key = f32_key(z)
                if key >= lo_key:
                    d = key - _KEY_NEG_INF
                    if level == 0 or (d >> hi_shift) == prefix:
                        b = np.int32((d >> shift) & dmask)
                        cuda.atomic.add(cnt, b, np.uint32(1))
                        if by_mass:
                            cuda.atomic.add(wt, b, np.uint64(np.float32(math.exp(z)) * _MASS_SCALE))
        cuda.syncthreads()                      # every atomic of the pass lands before the scan
        if by_mass:
            b, above, c, target, above_c = _find_bin(wt, cnt, nb, target,
                                                     top_p if level == 0 else np.float32(-1.0), res, wsum)
        else:
            b, above, c, target, above_c = _find_bin(cnt, cnt, nb, target, np.float32(-1.0), res, wsum)
        if level == 0:
            t0 = target
        if b < 0:
            return lo_key, zero, t0
        target -= above
        n_above += above_c
        prefix = (prefix << nbits) | np.uint64(b)
        t = (prefix << shift) + _KEY_NEG_INF
        if t < lo_key:
            t = lo_key
        if allow_compact and n_above + c <= COMPACT_CAP:
            return lo_key, t, t0
        if c == 1 or (not by_mass and c == target):
            return t, zero, t0
    return prefix + _KEY_NEG_INF, zero, t0


# Top-k on the raw logits x: the digits of the full 32-bit key of x (11, 11, 10 bits). z = (x - m) * inv_t
# is non-decreasing in x, so the k-th largest z is z(k-th largest x) (order statistics commute with a
# monotone map) and the first digit's histogram can be built in the max pass, before m is known.
_X_SHIFT = (21, 10, 0)
_X_BITS = (11, 11, 10)
_KEY_MIN_FINITE = np.uint64(0x00800000)   # key of -FLT_MAX: the lowest key of a finite float


@device_function
def _top_k_x(logits, mask, r, use_mask, k, cnt, res, wsum):
    """Top-k over the keys of the finite x of the row; cnt holds the first digit's counts (the max pass
    built them). Returns (mode, key): mode 0: fewer than k finite elements (top-k keeps them all);
    1: the elements with key(x) >= key number at most COMPACT_CAP and hold the k largest (a lower
    edge: a bin's, at most 2 more counting passes); 2: key is the exact key of the k-th largest x
    (the candidates exceed COMPACT_CAP: k > COMPACT_CAP, or ties)."""
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    V = logits.shape[1]
    target = np.int64(k)
    n_above = np.int64(0)
    prefix = np.uint64(0)
    for level in range(3):
        shift = np.uint64(_X_SHIFT[level])
        nbits = np.uint64(_X_BITS[level])
        hi_shift = shift + nbits
        nb = 1 << _X_BITS[level]
        dmask = np.uint64(nb - 1)
        if level > 0:
            for b in range(tid, nb, nt):
                cnt[b] = np.uint32(0)
            cuda.syncthreads()
            for i in range(tid, V, nt):
                x = _masked_x(logits, mask, r, i, use_mask)
                if x > NEG_INF:
                    key = f32_key(x)
                    if (key >> hi_shift) == prefix:
                        cuda.atomic.add(cnt, np.int32((key >> shift) & dmask), np.uint32(1))
        cuda.syncthreads()
        b, above, c, _t, _ac = _find_bin(cnt, cnt, nb, target, np.float32(-1.0), res, wsum)
        if b < 0:
            return 0, np.uint64(0)
        target -= above
        n_above += above
        prefix = (prefix << nbits) | np.uint64(b)
        if n_above + c <= COMPACT_CAP:
            return 1, prefix << shift
    return 2, prefix


@device_function
def _compact(logits, mask, r, use_mask, m, inv_t, clo, buf, ncnt):
    """One pass: the elements with z > -inf and key(z) >= clo into buf as (key(z) << 32) | i (slot order
    is that of the atomics; the list is sorted afterwards). Returns their number (those beyond
    COMPACT_CAP are counted, not stored)."""
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    V = logits.shape[1]
    if tid == 0:
        ncnt[0] = np.int32(0)
    cuda.syncthreads()
    for i in range(tid, V, nt):
        z = (_masked_x(logits, mask, r, i, use_mask) - m) * inv_t
        if z > NEG_INF:
            key = f32_key(z)
            if key >= clo:
                s = cuda.atomic.add(ncnt, 0, np.int32(1))
                if s < COMPACT_CAP:
                    buf[s] = (key << _S32) | np.uint64(i)
    cuda.syncthreads()
    n = np.int64(ncnt[0])
    cuda.syncthreads()
    return n


@device_function
def _list_sample(buf, n, thr, k_list, p_list, p_target, kmin, k0, k1, step, cnt, wt, res, wsum, scratch,
                 iscratch):
    """Filters and the Gumbel-max draw over the n (<= COMPACT_CAP) compacted survivors, no pass over V:
    bitonic sort of buf[0:P] (P = the power of two >= n, zero padded: ascending, the largest key last),
    top-k = the k_list-th largest key (k_list > 0), top-p over the elements with key >= thr by the same
    fixed-point masses and scan as the radix passes (p_list >= 0: target = top_p_units(their mass);
    else p_target >= 0: that target, computed over the whole row), min-p, then Gumbel-max with the
    Philox uniforms of the survivors' ids. Returns the block's (value, token)."""
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    P = np.int64(2)
    while P < n:
        P <<= 1
    for s in range(n + tid, P, nt):
        buf[s] = np.uint64(0)
    cuda.syncthreads()
    size = np.int64(2)
    while size <= P:
        stride = size >> 1
        while stride > 0:
            for t in range(tid, P >> 1, nt):
                i = 2 * t - (t & (stride - 1))
                j = i + stride
                a = buf[i]
                c = buf[j]
                if (a > c) == ((i & size) == 0):
                    buf[i] = c
                    buf[j] = a
            cuda.syncthreads()
            stride >>= 1
        size <<= 1
    if k_list > 0 and k_list <= n:
        thr = buf[P - k_list] >> _S32
    if p_list >= np.float32(0.0) or p_target >= 0:
        for b in range(tid, COMPACT_CAP, nt):
            j = COMPACT_CAP - 1 - b               # rank from the top
            w = np.uint64(0)
            c1 = np.uint32(0)
            if j < n:
                key = buf[P - 1 - j] >> _S32
                if key >= thr:
                    w = np.uint64(np.float32(math.exp(f32_of_key(key))) * _MASS_SCALE)
                    c1 = np.uint32(1)
            wt[b] = w
            cnt[b] = c1
        cuda.syncthreads()
        b, _a, _c, _t, _ac = _find_bin(wt, cnt, COMPACT_CAP, p_target, p_list, res, wsum)
        if b >= 0:
            thr = buf[P - COMPACT_CAP + b] >> _S32
    if kmin > thr:
        thr = kmin
    zero = np.uint64(0)
    bv = NEG_INF
    bi = np.int32(-1)
    for s in range(tid, n, nt):
        e = buf[P - 1 - s]
        key = e >> _S32
        if key >= thr:
            i = np.int32(e & _M32)
            w0, w1, w2, w3 = philox4x32(np.uint64(i >> 2), step, zero, zero, k0, k1)
            lane = i & 3
            v = f32_of_key(key) - math.log(-math.log(_uniform(_lane_word(w0, w1, w2, w3, lane))))
            if bi < 0 or v > bv or (v == bv and i < bi):
                bv = v
                bi = i
    return block_argmax(bv, bi, scratch, iscratch)

# ---------------------------------------------------------------- kernels


@device_function
def _adjusted(x, w, rep, freq, pres, a):
    """Logit x after one entry: the repetition penalty if bit 0 of w is set, then + a and, for a
    count c = w >> 1 > 0, - (freq * c + pres) (sampling_ref.apply_adjustments_ref)."""
    if w & 1:
        if x > 0:
            x = x / rep
        else:
            x = x * rep
    c = w >> 1
    if c > 0:
        a = (-(freq * np.float32(c)) - pres) + a
    return x + a


@_row_kernel
def _prepare_rows_kernel(logits, fparams, iparams, adj_token, adj_rep, adj_add, raw_saved, lse, top_ids, top_lps,
                         pend_src, pend_tok, pend_raw):
    grid_wait()      # PDL: first, before any read of what an earlier kernel wrote
    grid_trigger()
    scratch = cuda.shared.array(SCRATCH, np.float32)
    iscratch = cuda.shared.array(SCRATCH, np.int32)
    hit = cuda.shared.array(1, np.int32)
    r = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    V = logits.shape[1]
    nlp = iparams[r, I_NUM_LOGPROBS]
    if nlp >= 0:
        m = NEG_INF
        for i in range(tid, V, nt):
            m = max(m, logits[r, i])
        m = block_max(m, scratch)
        s = np.float32(0.0)
        for i in range(tid, V, nt):
            s += math.exp(logits[r, i] - m)
        s = block_sum(s, scratch)
        l = m + math.log(s)
        if tid == 0:
            lse[r] = l
        pv = np.float32(np.inf)
        pi = np.int32(-1)
        for j in range(min(nlp, top_ids.shape[1])):
            bv = NEG_INF
            bi = np.int32(-1)
            for i in range(tid, V, nt):
                v = logits[r, i]
                if v < pv or (v == pv and i > pi):          # strictly after the previous pick
                    if bi < 0 or v > bv:
                        bv = v
                        bi = np.int32(i)
            bv, bi = block_argmax(bv, bi, scratch, iscratch)
            if tid == 0:
                top_ids[r, j] = bi
                top_lps[r, j] = bv - l
            pv = bv
            pi = bi
        cuda.syncthreads()      # every read of the raw row is done before the row is adjusted
    rep = fparams[r, F_REP]
    freq = fparams[r, F_FREQ]
    pres = fparams[r, F_PRES]
    ps = iparams[r, I_PENDING]
    has = ps > 0 and ps <= pend_src.shape[0] and r < pend_tok.shape[0]
    pt = np.int32(-1)                   # the pending token: drawn by the previous step, not in the counts
    if has:
        pt = np.int32(pend_src[ps - 1])
        if pt >= V:
            pt = np.int32(-1)
    reset = pt >= 0 and pt == iparams[r, I_WINDOW_END] - 1     # the tool-call END token: the window restarts
    if reset:
        pt = np.int32(-1)
    if pt >= 0:
        if tid == 0:
            hit[0] = 0
        cuda.syncthreads()
    flag = np.int32(1) if rep != np.float32(1.0) else np.int32(0)
    for e in range(iparams[r, I_ADJ_START] + tid, iparams[r, I_ADJ_END], nt):
        t = adj_token[e]
        x = logits[r, t]
        raw_saved[e] = x
        w = adj_rep[e]
        if reset:
            w = 0
        elif t == pt:                   # one more occurrence of a listed token
            hit[0] = 1
            w = (((w >> 1) + 1) << 1) | flag
        logits[r, t] = _adjusted(x, w, rep, freq, pres, adj_add[e])
    if has:
        if pt >= 0:
            cuda.syncthreads()          # every entry is done: hit says whether pt was listed
        if tid == 0:
            miss = pt >= 0 and hit[0] == 0
            pend_tok[r] = pt if miss else np.int32(-1)
            if miss:                    # a new entry: count 1 (its raw logit kept for the logprob)
                x = logits[r, pt]
                pend_raw[r] = x
                logits[r, pt] = _adjusted(x, np.int32(2) | flag, rep, freq, pres, np.float32(0.0))


@device_function
def _gumbel_groups(logits, mask, r, use_mask, m, inv_t, thr, k0, k1, step, g_first, g_end, g_stride):
    """This thread's Gumbel-max (value, id; ties to the lower id) over the kept ids (z > -inf, key(z)
    >= thr) of Philox groups g_first, g_first + g_stride, ... < g_end: z = (x - m) * inv_temp."""
    V = logits.shape[1]
    zero = np.uint64(0)
    bv = NEG_INF
    bi = np.int32(-1)
    for g in range(g_first, g_end, g_stride):
        w0, w1, w2, w3 = philox4x32(np.uint64(g), step, zero, zero, k0, k1)
        for lane in range(4):
            i = 4 * g + lane
            if i < V:
                z = (_masked_x(logits, mask, r, i, use_mask) - m) * inv_t
                if z > NEG_INF and f32_key(z) >= thr:
                    v = z - math.log(-math.log(_uniform(_lane_word(w0, w1, w2, w3, lane))))
                    if bi < 0 or v > bv:
                        bv = v
                        bi = np.int32(i)
    return bv, bi


# ---------------------------------------------------------------- split rows (temperature / min-p / top-p)
#
# A row of a small batch is one block on one SM, its passes (max, Gumbel-max with Philox and two logs
# an element, top-p's mass digits) latency-bound there (docs/levers.md, sampling_split). Rows without
# top-k are cut into `chunks` contiguous spans of Philox groups, one block each: the spans' maxima,
# then (top-p rows, with `top_p` on) the three mass digits of the top-p threshold, each a span pass
# into a row histogram in global memory and a one-block scan of it (`_split_mass_kernel`,
# `_split_find_kernel`: the exact key, where the one-block path may stop at a bin's edge holding the
# same set), then each span's Gumbel-max over the kept ids with the row's max (the same z as one
# block computes, so the same token), combined by the row kernel (ties to the lower id).

SPLIT_THREADS = 32 if SIMULATOR else 256
MAX_CHUNKS = 64
_split_kernel = cached_jit if SIMULATOR else cached_jit(launch_bounds=(SPLIT_THREADS,))
SPLIT_TEMPERATURE = 1       # _split_kind: temperature / min-p / mask only
SPLIT_TOP_P = 2             # top-p without top-k (split only when the launch runs the mass digits)
_ST_PREFIX, _ST_TARGET, _ST_THR = 0, 1, 2      # a top-p row's search state (int64 [R, 4])


@device_function
def _split_kind(fparams, iparams, r, V, top_p_on):
    """How row r is drawn from split spans: 0 (one block: greedy, top-k, or top-p when the launch
    does not split top-p rows), SPLIT_TEMPERATURE or SPLIT_TOP_P."""
    k = iparams[r, I_TOP_K]
    if fparams[r, F_INV_TEMP] == 0 or (k > 0 and k < V):
        return 0
    if fparams[r, F_TOP_P] >= np.float32(1.0):
        return SPLIT_TEMPERATURE
    return SPLIT_TOP_P if top_p_on != 0 else 0


@device_function
def _span(c, chunks, V):
    """Philox groups [g0, g1) of span c."""
    G = (V + 3) // 4
    per = (G + chunks - 1) // chunks
    return min(G, c * per), min(G, (c + 1) * per)


@device_function
def _row_max(part_max, r, chunks):
    m = NEG_INF
    for j in range(chunks):
        m = max(m, part_max[r, j])
    return m


@_split_kernel
def _split_max_kernel(logits, mask, fparams, iparams, part_max, chunks, top_p_on):
    grid_wait()
    grid_trigger()
    scratch = cuda.shared.array(SCRATCH, np.float32)
    r = cuda.blockIdx.x
    c = cuda.blockIdx.y
    V = logits.shape[1]
    if _split_kind(fparams, iparams, r, V, top_p_on) == 0:
        return
    use_mask = iparams[r, I_USE_MASK] != 0
    g0, g1 = _span(c, chunks, V)
    m = NEG_INF
    for i in range(4 * g0 + cuda.threadIdx.x, min(V, 4 * g1), cuda.blockDim.x):
        m = max(m, _masked_x(logits, mask, r, i, use_mask))
    m = block_max(m, scratch)
    if cuda.threadIdx.x == 0:
        part_max[r, c] = m


@_split_kernel
def _split_mass_kernel(logits, mask, fparams, iparams, part_max, hist, state, chunks, level):
    """Top-p rows, digit `level` (11, 10, 10 bits of d = key(z) - key(-inf)): the masses of the span's
    elements whose higher digits equal the row's prefix, summed into the row's histogram hist[r]
    (uint64 mass units; the find kernel reads and clears it)."""
    grid_wait()
    grid_trigger()
    wt = cuda.shared.array(RADIX_BINS, np.uint64)
    r = cuda.blockIdx.x
    c = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    V = logits.shape[1]
    if _split_kind(fparams, iparams, r, V, 1) != SPLIT_TOP_P:
        return
    m = _row_max(part_max, r, chunks)
    if m == NEG_INF:
        return
    shift = np.uint64(_LEVEL_SHIFT[0])
    nbits = np.uint64(_LEVEL_BITS[0])
    if level == 1:
        shift = np.uint64(_LEVEL_SHIFT[1])
        nbits = np.uint64(_LEVEL_BITS[1])
    elif level == 2:
        shift = np.uint64(_LEVEL_SHIFT[2])
        nbits = np.uint64(_LEVEL_BITS[2])
    hi_shift = shift + nbits
    nb = np.int64(1) << np.int64(nbits)
    dmask = np.uint64(nb - 1)
    prefix = np.uint64(state[r, _ST_PREFIX])
    for b in range(tid, nb, nt):
        wt[b] = np.uint64(0)
    cuda.syncthreads()
    use_mask = iparams[r, I_USE_MASK] != 0
    inv_t = fparams[r, F_INV_TEMP]
    g0, g1 = _span(c, chunks, V)
    for i in range(4 * g0 + tid, min(V, 4 * g1), nt):
        z = (_masked_x(logits, mask, r, i, use_mask) - m) * inv_t
        if z > NEG_INF:
            d = f32_key(z) - _KEY_NEG_INF
            if level == 0 or (d >> hi_shift) == prefix:
                cuda.atomic.add(wt, np.int32((d >> shift) & dmask), np.uint64(np.float32(math.exp(z)) * _MASS_SCALE))
    cuda.syncthreads()
    for b in range(tid, nb, nt):
        w = wt[b]
        if w != 0:
            cuda.atomic.add(hist, (r, b), w)


@_row_kernel
def _split_find_kernel(fparams, iparams, hist, state, V, level):
    """Top-p rows, digit `level`: the bin of hist[r] holding the border (level 0: the target is
    top_p_units of the row's total mass), appended to the row's prefix; after the last digit the
    row's threshold key. Clears hist[r] for the next digit."""
    grid_wait()
    grid_trigger()
    res = cuda.shared.array(8, np.int64)
    wsum = cuda.shared.array(64, np.int64)
    r = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    if _split_kind(fparams, iparams, r, V, 1) != SPLIT_TOP_P:
        return
    nbits = _LEVEL_BITS[0]
    if level > 0:
        nbits = _LEVEL_BITS[1]
    nb = 1 << nbits
    h = hist[r]
    top_p = np.float32(-1.0)
    target = np.int64(0)
    prefix = np.uint64(0)
    if level == 0:
        top_p = max(fparams[r, F_TOP_P], np.float32(0.0))
    else:
        target = state[r, _ST_TARGET]
        prefix = np.uint64(state[r, _ST_PREFIX])
    b, above, _c, target, _ac = _find_bin(h, h, nb, target, top_p, res, wsum)
    if tid == 0:
        if b < 0:                               # no mass: the row has no finite element
            state[r, _ST_THR] = np.int64(_KEY_NEG_INF)
            state[r, _ST_PREFIX] = np.int64(0)
        else:
            prefix = (prefix << np.uint64(nbits)) | np.uint64(b)
            state[r, _ST_PREFIX] = np.int64(prefix)
            state[r, _ST_TARGET] = target - above
            state[r, _ST_THR] = np.int64(prefix + _KEY_NEG_INF)     # the exact key after the last digit
    for j in range(tid, nb, cuda.blockDim.x):
        h[j] = np.uint64(0)


@_split_kernel
def _split_gumbel_kernel(logits, mask, fparams, iparams, part_max, part_v, part_i, state, chunks, top_p_on):
    grid_wait()
    grid_trigger()
    scratch = cuda.shared.array(SCRATCH, np.float32)
    iscratch = cuda.shared.array(SCRATCH, np.int32)
    r = cuda.blockIdx.x
    c = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    V = logits.shape[1]
    kind = _split_kind(fparams, iparams, r, V, top_p_on)
    if kind == 0:
        return
    m = _row_max(part_max, r, chunks)
    use_mask = iparams[r, I_USE_MASK] != 0
    inv_t = fparams[r, F_INV_TEMP]
    thr = _KEY_NEG_INF
    if kind == SPLIT_TOP_P:
        thr = np.uint64(state[r, _ST_THR])
    kmin = f32_key(fparams[r, F_LOG_MIN_P])
    if kmin > thr:
        thr = kmin
    k0 = np.uint64(np.uint32(iparams[r, I_SEED_LO]))
    k1 = np.uint64(np.uint32(iparams[r, I_SEED_HI]))
    step = np.uint64(np.uint32(iparams[r, I_STEP]))
    bv = NEG_INF
    bi = np.int32(-1)
    if m > NEG_INF:
        g0, g1 = _span(c, chunks, V)
        bv, bi = _gumbel_groups(logits, mask, r, use_mask, m, inv_t, thr, k0, k1, step, g0 + tid, g1, cuda.blockDim.x)
    bv, bi = block_argmax(bv, bi, scratch, iscratch)
    if tid == 0:
        part_v[r, c] = bv
        part_i[r, c] = bi


def split_chunks(rows: int, V: int) -> int:
    """Spans a row of a step of `rows` rows is cut into (< 2: rows are not split): about two blocks
    an SM of an H200 over the step, each span at least a group of four ids a thread."""
    return max(0, min(MAX_CHUNKS, 264 // max(rows, 1), ((V + 3) // 4) // SPLIT_THREADS))


@_row_kernel
def _sample_rows_kernel(logits, mask, fparams, iparams, adj_token, raw_saved, lse, out_tokens, out_lps,
                        part_v, part_i, chunks, top_p_on, pend_tok, pend_raw):
    grid_wait()      # PDL: first, before any read of what an earlier kernel wrote
    grid_trigger()
    scratch = cuda.shared.array(SCRATCH, np.float32)
    iscratch = cuda.shared.array(SCRATCH, np.int32)
    cnt = cuda.shared.array(RADIX_BINS, np.uint32)
    wt = cuda.shared.array(RADIX_BINS, np.uint64)
    buf = cuda.shared.array(COMPACT_CAP, np.uint64)
    res = cuda.shared.array(8, np.int64)
    wsum = cuda.shared.array(64, np.int64)
    ncnt = cuda.shared.array(1, np.int32)
    r = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    V = logits.shape[1]
    use_mask = iparams[r, I_USE_MASK] != 0
    inv_t = fparams[r, F_INV_TEMP]
    k = iparams[r, I_TOP_K]
    if chunks > 1 and _split_kind(fparams, iparams, r, V, top_p_on) != 0:    # drawn by the spans: combine them
        if tid == 0:
            bv = NEG_INF
            bi = np.int32(-1)
            for c in range(chunks):
                if _argmax_better(part_v[r, c], part_i[r, c], bv, bi):
                    bv = part_v[r, c]
                    bi = part_i[r, c]
            _write_draw(logits, iparams, adj_token, raw_saved, lse, out_tokens, out_lps, r, bi, pend_tok, pend_raw)
        return
    top_k_on = inv_t != 0 and k > 0 and k < V
    if top_k_on:                                # the first digit of top-k's key(x) histogram: in pass 1
        for b in range(tid, RADIX_BINS, nt):
            cnt[b] = np.uint32(0)
        cuda.syncthreads()

    # pass 1: the (masked) argmax, ties to the lower id; its value is the max m
    bv = NEG_INF
    bi = np.int32(-1)
    for i in range(tid, V, nt):
        v = _masked_x(logits, mask, r, i, use_mask)
        if v > NEG_INF:
            if bi < 0 or v > bv:
                bv = v
                bi = np.int32(i)
            if top_k_on:
                cuda.atomic.add(cnt, np.int32(f32_key(v) >> np.uint64(_X_SHIFT[0])), np.uint32(1))
    bv, bi = block_argmax(bv, bi, scratch, iscratch)
    m = bv
    if bi >= 0 and inv_t != 0:                  # sampled row (greedy rows and empty rows are done)
        thr = _KEY_NEG_INF                      # lower bound of the kept keys of z
        clo = np.uint64(0)                      # > 0: compact the elements with key(z) >= clo
        k_list = np.int64(0)                    # top-k left to the compacted list
        if top_k_on:                            # 0..2 more counting passes over key(x)
            mode, xkey = _top_k_x(logits, mask, r, use_mask, k, cnt, res, wsum)
            if mode == 1:
                if xkey < _KEY_MIN_FINITE:
                    xkey = _KEY_MIN_FINITE
                clo = f32_key((f32_of_key(xkey) - m) * inv_t)
                k_list = np.int64(k)
            elif mode == 2:
                thr = f32_key((f32_of_key(xkey) - m) * inv_t)
        top_p = fparams[r, F_TOP_P]
        p_on = top_p < np.float32(1.0)
        p_list = np.float32(-1.0)
        p_target = np.int64(-1)
        if p_on:
            if clo > 0:
                p_list = max(top_p, np.float32(0.0))
            else:                               # top-p over the top-k survivors: <= 3 mass passes
                thr, clo, p_target = _radix_select(logits, mask, r, use_mask, m, inv_t, thr, np.int64(0),
                                                   max(top_p, np.float32(0.0)), True, cnt, wt, res, wsum)
        kmin = f32_key(fparams[r, F_LOG_MIN_P])
        k0 = np.uint64(np.uint32(iparams[r, I_SEED_LO]))
        k1 = np.uint64(np.uint32(iparams[r, I_SEED_HI]))
        step = np.uint64(np.uint32(iparams[r, I_STEP]))
        n = np.int64(0)
        if clo > 0:                             # one compaction pass
            n = _compact(logits, mask, r, use_mask, m, inv_t, clo, buf, ncnt)
            if n > COMPACT_CAP:                 # float rounding of z tied more elements to the edge: the
                clo = np.uint64(0)              # exact thresholds over the row (rare)
                p_target = np.int64(-1)
                if k_list > 0:
                    thr = _radix_select(logits, mask, r, use_mask, m, inv_t, thr, k_list, np.float32(-1.0),
                                        False, cnt, wt, res, wsum)[0]
                if p_on:
                    thr = _radix_select(logits, mask, r, use_mask, m, inv_t, thr, np.int64(0),
                                        max(top_p, np.float32(0.0)), False, cnt, wt, res, wsum)[0]
        if clo > 0:
            bv, bi = _list_sample(buf, n, thr, k_list, p_list, p_target, kmin, k0, k1, step, cnt, wt, res, wsum,
                                  scratch, iscratch)
        else:
            if kmin > thr:
                thr = kmin
            # last pass: Gumbel-max over the kept elements
            bv, bi = _gumbel_groups(logits, mask, r, use_mask, m, inv_t, thr, k0, k1, step, tid, (V + 3) // 4, nt)
            bv, bi = block_argmax(bv, bi, scratch, iscratch)
    if tid == 0:
        _write_draw(logits, iparams, adj_token, raw_saved, lse, out_tokens, out_lps, r, bi, pend_tok, pend_raw)


@device_function
def _write_draw(logits, iparams, adj_token, raw_saved, lse, out_tokens, out_lps, r, bi, pend_tok, pend_raw):
    """Row r's token and (if asked for) its raw logprob."""
    out_tokens[r] = bi
    lp = np.float32(np.nan)
    if iparams[r, I_NUM_LOGPROBS] >= 0 and bi >= 0:
        raw = logits[r, bi]
        for e in range(iparams[r, I_ADJ_START], iparams[r, I_ADJ_END]):
            if adj_token[e] == bi:
                raw = raw_saved[e]
        if iparams[r, I_PENDING] > 0 and r < pend_tok.shape[0] and pend_tok[r] == bi:     # the pending token's new entry
            raw = pend_raw[r]
        lp = raw - lse[r]
    out_lps[r] = lp


# ---------------------------------------------------------------- launchers


def prepare_rows(logits, fparams, iparams, adj_token, adj_rep, adj_add, raw_saved, lse, top_ids, top_lps,
                 pending=None, stream=0) -> None:
    """Logprob statistics of the raw rows, then penalties / bias in place (see the module docstring).
    logits float32 [R, V] (modified); fparams float32 [R, NF]; iparams int32 [R, NI]; adj_token /
    adj_rep int32 [N]; adj_add float32 [N]; raw_saved float32 [N] (out); lse float32 [R] (out);
    top_ids int32 / top_lps float32 [R, MAX_TOP_LOGPROBS] (out). pending: (the previous step's
    tokens int32, pend_tok int32 [R] (out), pend_raw float32 [R] (out)), needed when a row has
    I_PENDING (pending_buffers; sample_rows takes the same)."""
    if logits.shape[0] == 0:
        return
    src, tok, raw = pending if pending is not None else _no_pending()
    _prepare_rows_kernel[logits.shape[0], THREADS, stream](logits, fparams, iparams, adj_token, adj_rep, adj_add,
                                                            raw_saved, lse, top_ids, top_lps, src, tok, raw)


def sample_rows(logits, mask, fparams, iparams, adj_token, raw_saved, lse, out_tokens, out_lps, parts=None,
                chunks: int | None = None, top_p: bool = False, pending=None, stream=0) -> None:
    """Mask, temperature, top-k / top-p / min-p, Gumbel-max sampling (argmax for greedy rows) and the
    sampled token's raw logprob. mask uint32 [R, ceil(V/32)]; out_tokens int32 [R]; out_lps float32 [R]
    (NaN where the row asked for no logprobs). parts: split_parts' span partials and top-p search
    buffers (None: every row in one block); chunks: the spans a row is cut into (default
    split_chunks); top_p: top-p rows without top-k are split too (three more span passes and scans;
    the caller knows whether the step has such rows); pending: prepare_rows' (a pending token's raw
    logprob)."""
    R, V = logits.shape
    if R == 0:
        return
    if chunks is None:
        chunks = split_chunks(R, V)
    p_on = int(bool(top_p))
    if parts is None or chunks < 2:
        chunks, p_on = 0, 0
        part_v, part_i = _no_parts()
    else:
        part_max, part_v, part_i, hist, state = parts
        _split_max_kernel[(R, chunks), SPLIT_THREADS, stream](logits, mask, fparams, iparams, part_max, chunks, p_on)
        if p_on:
            for level in range(3):
                _split_mass_kernel[(R, chunks), SPLIT_THREADS, stream](logits, mask, fparams, iparams, part_max,
                                                                       hist, state, chunks, level)
                _split_find_kernel[R, THREADS, stream](fparams, iparams, hist, state, V, level)
        _split_gumbel_kernel[(R, chunks), SPLIT_THREADS, stream](logits, mask, fparams, iparams, part_max, part_v,
                                                                 part_i, state, chunks, p_on)
    _, pend_tok, pend_raw = pending if pending is not None else _no_pending()
    _sample_rows_kernel[R, THREADS, stream](logits, mask, fparams, iparams, adj_token, raw_saved, lse,
                                            out_tokens, out_lps, part_v, part_i, chunks, p_on, pend_tok, pend_raw)


_NO_PARTS: list = []


def _no_parts():
    """1 x 1 placeholders for the partials' arguments of an unsplit launch (made once: no allocation
    inside a graph capture after the first call)."""
    if not _NO_PARTS:
        _NO_PARTS.extend([cuda.device_array((1, 1), np.float32), cuda.device_array((1, 1), np.int32)])
    return _NO_PARTS[0], _NO_PARTS[1]


_NO_PENDING: list = []


def _no_pending():
    """1-element placeholders for the pending arguments of a step without pending rows (made once)."""
    if not _NO_PENDING:
        _NO_PENDING.extend([cuda.to_device(np.full(1, -1, np.int32)), cuda.device_array(1, np.int32),
                            cuda.device_array(1, np.float32)])
    return tuple(_NO_PENDING)


def pending_buffers(tokens, rows: int):
    """prepare_rows' / sample_rows' `pending` for steps up to `rows` rows whose pending tokens are
    read from `tokens` (device int32: the previous step's drawn tokens)."""
    return tokens, cuda.device_array(rows, np.int32), cuda.device_array(rows, np.float32)


def split_parts(rows: int):
    """Device buffers of sample_rows' split rows for steps up to `rows` rows: span maxima, values and
    ids [rows, MAX_CHUNKS], top-p's mass histograms [rows, RADIX_BINS] (zero: each scan clears the
    one it read) and search state [rows, 4]."""
    return (cuda.device_array((rows, MAX_CHUNKS), np.float32), cuda.device_array((rows, MAX_CHUNKS), np.float32),
            cuda.device_array((rows, MAX_CHUNKS), np.int32), cuda.to_device(np.zeros((rows, RADIX_BINS), np.uint64)),
            cuda.to_device(np.zeros((rows, 4), np.int64)))


def top_p_split_rows(fparams: np.ndarray, iparams: np.ndarray, V: int) -> bool:
    """Has the step a sampled top-p row without top-k (sample_rows' `top_p`)?"""
    k = iparams[:, I_TOP_K]
    return bool(np.any((fparams[:, F_INV_TEMP] != 0) & (fparams[:, F_TOP_P] < 1) & ~((k > 0) & (k < V))))


# ---------------------------------------------------------------- NumPy references


