"""Gated DeltaNet (Qwen3-Next linear attention): short causal conv, the gated delta rule, gated
RMSNorm, with their NumPy references.

Per token of one sequence and one value head h (k-head kh = h // (nv / nk)):
  q, k = l2norm(q), l2norm(k); q *= 1/sqrt(dk)            (after the conv + SiLU)
  g    = -exp(A_log[h]) * softplus(a + dt_bias[h]),  beta = sigmoid(b)
  S    = exp(g) * S;  u = beta * (v - S^T k);  S += k u^T;  o = S^T q       (S [dk, dv])
which is S_t = a_t S_{t-1} (I - b_t k_t k_t^T) + b_t v_t k_t^T written for S^T.
The chunked form (WY / UT transform, as flash-linear-attention's chunk_gated_delta_rule) gives
the same numbers up to rounding: inside a chunk with cumulative log decay G,
  T = (I + L)^-1,  L[t,s] = beta_t (k_t.k_s) exp(G_t - G_s) for s < t
  U = T (beta v) - T (beta exp(G) k) S0,   o_t = exp(G_t) S0^T q_t + sum_{s<=t} (q_t.k_s) exp(G_t-G_s) u_s
  S  = exp(G_C) S0 + sum_s exp(G_C - G_s) k_s u_s^T.

Device layouts (float32, one layer's slices):
  proj rows of the input projection: q (nk*dk) | k (nk*dk) | v (nv*dv) | z (nv*dv) | b (nv) | a (nv)
  x = proj[:, :conv_dim] (conv_dim = 2*nk*dk + nv*dv), conv weight [conv_dim, K] (2 <= K <= 4 on
  the device), conv_state [slots, conv_dim, K-1] (oldest input first), ssm_state [slots, nv, dk, dv].
  Ragged metadata as everywhere: seq_query_start [S+1], positions [T]; state_slots [S] (-1: skip
  the segment). A segment whose first position is 0 starts from a zero state (the slot is not
  read); otherwise from the slot. Every kernel leaves the slot holding the state after the
  segment's last token.
Kernels:
  causal_conv1d    grid (S, conv_dim/128), 128 threads, one channel a thread, sequential over the
                   segment's tokens with the K-1 history in registers.
  gdn_recurrent    grid (S, nv, dv/32), 32 threads: the [dk, 32] state tile lives in shared memory
                   for the whole segment (decode rows and verify blocks); one v column a thread,
                   so the delta rule needs no cross-thread reduction. dk <= 256.
  gdn_chunked      grid (S, nv), one thread per v column (dv <= 128, dk <= 128, chunk <= 16): the
                   chunked form with the C x C matrices in shared memory and the state read from /
                   written to the slot in global memory once per chunk. Correctness first: the
                   tensor-core version is the upgrade path.
  rms_norm_gated   grid (T, nv), 128 threads: rmsnorm(o) * w * silu(z) per head.
  state_norm_clamp grid (S, nv), 128 threads: scales a head's state down to Frobenius norm <= bound.
The recurrent kernel skips segments longer than max_len and the chunked one segments shorter
than min_len, so one step can launch both over the same metadata.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda
from kernels_numba.jit import kernel as cached_jit

from kernels_numba.bf16 import SIMULATOR, block_sum

MAX_DK = 256          # recurrent kernel: state tile rows
V_TILE = 32           # recurrent kernel: state tile columns (= threads)
CHUNK_MAX = 16        # chunked kernel: largest chunk
CHUNK_DIM = 128       # chunked kernel: largest dk and dv
SCRATCH = 1024 if SIMULATOR else 32
F32 = np.float32


# ----------------------------------------------------------------------------- references

from kernels_numba.gdn_ref import (  # noqa: E402,F401  (CUDA-free: gdn_ref.py)
    L2_EPS, causal_conv1d_ref, gated_delta_chunked_ref, gated_delta_recurrent_ref, gdn_gates_ref, gdn_segment_ref,
    l2norm_ref, rms_norm_gated_ref, softplus_ref, state_norm_clamp_ref)




# ----------------------------------------------------------------------------- kernels


@cached_jit
def _causal_conv1d_kernel(x, weight, conv_state, seq_query_start, state_slots, positions, out):
    s = cuda.blockIdx.x
    c = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    if c >= x.shape[1]:
        return
    a = seq_query_start[s]
    b = seq_query_start[s + 1]
    slot = state_slots[s]
    if slot < 0 or b <= a:
        return
    K = weight.shape[1]
    zero = F32(0.0)
    h1 = zero
    h2 = zero
    h3 = zero
    if positions[a] != 0:
        h1 = conv_state[slot, c, K - 2]
        if K >= 3:
            h2 = conv_state[slot, c, K - 3]
        if K >= 4:
            h3 = conv_state[slot, c, K - 4]
    w0 = weight[c, K - 1]
    w1 = weight[c, K - 2]
    w2 = weight[c, K - 3] if K >= 3 else zero
    w3 = weight[c, K - 4] if K >= 4 else zero
    for t in range(a, b):
        xt = x[t, c]
        acc = w3 * h3 + w2 * h2 + w1 * h1 + w0 * xt
        out[t, c] = acc / (F32(1.0) + math.exp(-acc))
        h3 = h2
        h2 = h1
        h1 = xt
    conv_state[slot, c, K - 2] = h1
    if K >= 3:
        conv_state[slot, c, K - 3] = h2
    if K >= 4:
        conv_state[slot, c, K - 4] = h3


def causal_conv1d(x, weight, conv_state, seq_query_start, state_slots, positions, out, stream=0) -> None:
    """out[T, C] = silu(causal depthwise conv of x[T, C] (any strides) continued from each
    segment's conv_state[slot]); conv_state[slot] is left holding the segment's last K-1 inputs."""
    K = weight.shape[1]
    if not 2 <= K <= 4:
        raise ValueError(f"causal_conv1d supports kernel sizes 2..4, not {K}")
    S, C = state_slots.shape[0], x.shape[1]
    _causal_conv1d_kernel[(S, (C + 127) // 128), 128, stream](
        x, weight, conv_state, seq_query_start, state_slots, positions, out)


@cached_jit
def _gdn_recurrent_kernel(qkv, gate_in, a_log, dt_bias, state, seq_query_start, state_slots, positions,
                          max_len, out):
    tile = cuda.shared.array((MAX_DK, V_TILE), np.float32)
    qs = cuda.shared.array(MAX_DK, np.float32)
    ks = cuda.shared.array(MAX_DK, np.float32)
    scratch = cuda.shared.array(SCRATCH, np.float32)
    s = cuda.blockIdx.x
    h = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    j = cuda.blockIdx.z * V_TILE + tid
    nv = state.shape[1]
    dk = state.shape[2]
    dv = state.shape[3]
    nk = (qkv.shape[1] - nv * dv) // (2 * dk)
    kh = h // (nv // nk)
    a = seq_query_start[s]
    b = seq_query_start[s + 1]
    slot = state_slots[s]
    if slot < 0 or b <= a or b - a > max_len:      # block-uniform exit
        return
    fresh = positions[a] == 0
    jv = j < dv
    for i in range(dk):
        tile[i, tid] = F32(0.0) if fresh or not jv else state[slot, h, i, j]
    neg_a = -math.exp(a_log[h])
    bias = dt_bias[h]
    qscale = F32(1.0) / math.sqrt(F32(dk))
    vofs = 2 * nk * dk + h * dv
    for t in range(a, b):
        cuda.syncthreads()                          # the previous token is done with qs / ks
        sq = F32(0.0)
        sk = F32(0.0)
        for i in range(tid, dk, nt):
            qv = qkv[t, kh * dk + i]
            kv = qkv[t, nk * dk + kh * dk + i]
            qs[i] = qv
            ks[i] = kv
            sq += qv * qv
            sk += kv * kv
        sq = block_sum(sq, scratch)
        sk = block_sum(sk, scratch)
        cuda.syncthreads()
        rq = qscale / math.sqrt(sq + F32(L2_EPS))
        rk = F32(1.0) / math.sqrt(sk + F32(L2_EPS))
        xa = gate_in[t, nv + h] + bias
        sp = xa if xa > F32(20.0) else math.log1p(math.exp(xa))
        decay = math.exp(neg_a * sp)
        beta = F32(1.0) / (F32(1.0) + math.exp(-gate_in[t, h]))
        if jv:
            kvm = F32(0.0)
            for i in range(dk):
                kvm += tile[i, tid] * ks[i]
            u = beta * (qkv[t, vofs + j] - decay * rk * kvm)
            uk = u * rk
            o = F32(0.0)
            for i in range(dk):
                sv = decay * tile[i, tid] + ks[i] * uk
                tile[i, tid] = sv
                o += sv * qs[i]
            out[t, h * dv + j] = o * rq
    if jv:
        for i in range(dk):
            state[slot, h, i, j] = tile[i, tid]


def gdn_recurrent(qkv, gate_in, a_log, dt_bias, ssm_state, seq_query_start, state_slots, positions, out,
                  max_len: int = 1 << 30, stream=0) -> None:
    """The gated delta rule token by token. qkv [T, conv_dim] (after conv + SiLU), gate_in [T, 2*nv]
    (b | a columns of the projection, any strides), ssm_state [slots, nv, dk, dv], out [T, nv*dv]
    (before the gated norm). Segments longer than max_len are left to gdn_chunked."""
    nv, dk, dv = ssm_state.shape[1:]
    if dk > MAX_DK:
        raise ValueError(f"gdn_recurrent supports key head dims up to {MAX_DK}, not {dk}")
    grid = (state_slots.shape[0], nv, (dv + V_TILE - 1) // V_TILE)
    _gdn_recurrent_kernel[grid, V_TILE, stream](qkv, gate_in, a_log, dt_bias, ssm_state, seq_query_start,
                                                state_slots, positions, np.int32(max_len), out)


@cached_jit
def _gdn_chunked_kernel(qkv, gate_in, a_log, dt_bias, state, seq_query_start, state_slots, positions,
                        min_len, chunk, out):
    qc = cuda.shared.array((CHUNK_MAX, CHUNK_DIM), np.float32)
    kc = cuda.shared.array((CHUNK_MAX, CHUNK_DIM), np.float32)
    wc = cuda.shared.array((CHUNK_MAX, CHUNK_DIM), np.float32)
    uc = cuda.shared.array((CHUNK_MAX, CHUNK_DIM), np.float32)
    oc = cuda.shared.array((CHUNK_MAX, CHUNK_DIM), np.float32)
    lm = cuda.shared.array((CHUNK_MAX, CHUNK_MAX), np.float32)
    tm = cuda.shared.array((CHUNK_MAX, CHUNK_MAX), np.float32)
    qk = cuda.shared.array((CHUNK_MAX, CHUNK_MAX), np.float32)
    gc = cuda.shared.array(CHUNK_MAX, np.float32)
    bt = cuda.shared.array(CHUNK_MAX, np.float32)
    s = cuda.blockIdx.x
    h = cuda.blockIdx.y
    j = cuda.threadIdx.x
    nt = cuda.blockDim.x
    nv = state.shape[1]
    dk = state.shape[2]
    dv = state.shape[3]
    nk = (qkv.shape[1] - nv * dv) // (2 * dk)
    kh = h // (nv // nk)
    a = seq_query_start[s]
    b = seq_query_start[s + 1]
    slot = state_slots[s]
    if slot < 0 or b <= a or b - a < min_len:      # block-uniform exit
        return
    jv = j < dv
    if positions[a] == 0 and jv:
        for i in range(dk):
            state[slot, h, i, j] = F32(0.0)
    neg_a = -math.exp(a_log[h])
    bias = dt_bias[h]
    qscale = F32(1.0) / math.sqrt(F32(dk))
    vofs = 2 * nk * dk + h * dv
    for c0 in range(a, b, chunk):
        n = min(chunk, b - c0)
        cuda.syncthreads()                          # the previous chunk is done with shared memory
        for e in range(j, n * dk, nt):
            r = e // dk
            i = e - r * dk
            qc[r, i] = qkv[c0 + r, kh * dk + i]
            kc[r, i] = qkv[c0 + r, nk * dk + kh * dk + i]
        if j < n:
            xa = gate_in[c0 + j, nv + h] + bias
            sp = xa if xa > F32(20.0) else math.log1p(math.exp(xa))
            gc[j] = neg_a * sp
            bt[j] = F32(1.0) / (F32(1.0) + math.exp(-gate_in[c0 + j, h]))
        cuda.syncthreads()
        if j < n:                                   # l2-normalise row j of q and k
            sq = F32(0.0)
            sk = F32(0.0)
            for i in range(dk):
                sq += qc[j, i] * qc[j, i]
                sk += kc[j, i] * kc[j, i]
            rq = qscale / math.sqrt(sq + F32(L2_EPS))
            rk = F32(1.0) / math.sqrt(sk + F32(L2_EPS))
            for i in range(dk):
                qc[j, i] *= rq
                kc[j, i] *= rk
        if j == 0:                                  # cumulative log decay
            acc = F32(0.0)
            for r in range(n):
                acc += gc[r]
                gc[r] = acc
        cuda.syncthreads()
        for e in range(j, n * n, nt):               # L (strictly lower) and the decayed q.k (lower)
            r = e // n
            c = e - r * n
            lv = F32(0.0)
            qv = F32(0.0)
            if c <= r:
                dkk = F32(0.0)
                dqk = F32(0.0)
                for i in range(dk):
                    dkk += kc[r, i] * kc[c, i]
                    dqk += qc[r, i] * kc[c, i]
                dec = math.exp(gc[r] - gc[c])
                qv = dqk * dec
                if c < r:
                    lv = bt[r] * dkk * dec
            lm[r, c] = lv
            qk[r, c] = qv
        cuda.syncthreads()
        for r in range(n):                          # T = (I + L)^-1 by forward substitution
            if j < r:
                acc = lm[r, j]
                for m in range(j + 1, r):
                    acc += lm[r, m] * tm[m, j]
                tm[r, j] = -acc
            elif j == r:
                tm[r, r] = F32(1.0)
            cuda.syncthreads()
        for e in range(j, n * dk, nt):              # W = T (beta exp(G) k)
            r = e // dk
            i = e - r * dk
            acc = F32(0.0)
            for c in range(r + 1):
                acc += tm[r, c] * bt[c] * math.exp(gc[c]) * kc[c, i]
            wc[r, i] = acc
        cuda.syncthreads()
        if jv:
            for r in range(n):                      # U = T (beta v), this thread's column
                acc = F32(0.0)
                for c in range(r + 1):
                    acc += tm[r, c] * bt[c] * qkv[c0 + c, vofs + j]
                uc[r, j] = acc
                oc[r, j] = F32(0.0)
            for i in range(dk):                     # one pass over the state column
                sv = state[slot, h, i, j]
                for r in range(n):
                    uc[r, j] -= wc[r, i] * sv
                    oc[r, j] += qc[r, i] * sv
            for r in range(n):
                acc = math.exp(gc[r]) * oc[r, j]
                for c in range(r + 1):
                    acc += qk[r, c] * uc[c, j]
                out[c0 + r, h * dv + j] = acc
            gl = gc[n - 1]
            el = math.exp(gl)
            for i in range(dk):
                acc = el * state[slot, h, i, j]
                for c in range(n):
                    acc += kc[c, i] * math.exp(gl - gc[c]) * uc[c, j]
                state[slot, h, i, j] = acc


def gdn_chunked(qkv, gate_in, a_log, dt_bias, ssm_state, seq_query_start, state_slots, positions, out,
                chunk: int = CHUNK_MAX, min_len: int = 0, stream=0) -> None:
    """The chunked gated delta rule (prefill); same arguments as gdn_recurrent. Segments shorter
    than min_len are left to gdn_recurrent."""
    nv, dk, dv = ssm_state.shape[1:]
    if dk > CHUNK_DIM or dv > CHUNK_DIM or not 1 <= chunk <= CHUNK_MAX:
        raise ValueError(f"gdn_chunked supports dk, dv <= {CHUNK_DIM} and chunk 1..{CHUNK_MAX}; "
                         f"got dk={dk}, dv={dv}, chunk={chunk}")
    threads = max(32, (dv + 31) // 32 * 32)
    _gdn_chunked_kernel[(state_slots.shape[0], nv), threads, stream](
        qkv, gate_in, a_log, dt_bias, ssm_state, seq_query_start, state_slots, positions,
        np.int32(min_len), np.int32(chunk), out)


@cached_jit
def _rms_norm_gated_kernel(x, z, weight, eps, out):
    scratch = cuda.shared.array(SCRATCH, np.float32)
    t = cuda.blockIdx.x
    base = cuda.blockIdx.y * weight.shape[0]
    dv = weight.shape[0]
    ss = F32(0.0)
    for i in range(cuda.threadIdx.x, dv, cuda.blockDim.x):
        ss += x[t, base + i] * x[t, base + i]
    ss = block_sum(ss, scratch)
    inv = F32(1.0) / math.sqrt(ss / F32(dv) + eps)
    for i in range(cuda.threadIdx.x, dv, cuda.blockDim.x):
        zz = z[t, base + i]
        out[t, base + i] = x[t, base + i] * inv * weight[i] * (zz / (F32(1.0) + math.exp(-zz)))


def rms_norm_gated(x, z, weight, eps: float, out, stream=0) -> None:
    """out[T, nv*dv] = rmsnorm(x) * weight * silu(z) per head; x, z [T, nv*dv] (z any strides)."""
    T, width = x.shape
    if T:
        _rms_norm_gated_kernel[(T, width // weight.shape[0]), 128, stream](x, z, weight, np.float32(eps), out)


@cached_jit
def _state_norm_clamp_kernel(state, state_slots, bound):
    scratch = cuda.shared.array(SCRATCH, np.float32)
    slot = state_slots[cuda.blockIdx.x]
    if slot < 0:
        return
    h = cuda.blockIdx.y
    dk = state.shape[2]
    dv = state.shape[3]
    ss = F32(0.0)
    for e in range(cuda.threadIdx.x, dk * dv, cuda.blockDim.x):
        v = state[slot, h, e // dv, e % dv]
        ss += v * v
    ss = block_sum(ss, scratch)
    if ss > bound * bound:
        scale = bound / math.sqrt(ss)
        for e in range(cuda.threadIdx.x, dk * dv, cuda.blockDim.x):
            state[slot, h, e // dv, e % dv] *= scale


def state_norm_clamp(ssm_state, state_slots, bound: float, stream=0) -> None:
    """Scale each head's state of each listed slot down to Frobenius norm <= bound."""
    _state_norm_clamp_kernel[(state_slots.shape[0], ssm_state.shape[1]), 128, stream](
        ssm_state, state_slots, np.float32(bound))





# ------------------------------------------------- hybrid attention layers and rollback trails


@cached_jit
def _sigmoid_mul_kernel(x, gate, out):
    t = cuda.blockIdx.x
    f = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    if f < out.shape[1]:
        out[t, f] = x[t, f] / (F32(1.0) + math.exp(-gate[t, f]))


def sigmoid_mul(x, gate, out, stream=0) -> None:
    """out[T, N] = x * sigmoid(gate): the output gate of Qwen3-Next's attention layers."""
    T, N = out.shape
    if T and N:
        _sigmoid_mul_kernel[(T, (N + 127) // 128), 128, stream](x, gate, out)


def sigmoid_mul_ref(x, gate):
    return np.asarray(x) / (1.0 + np.exp(-np.asarray(gate)))


@cached_jit
def _record_trail_kernel(proj, seq_query_start, trail_ids, gate_offset, trail_x, trail_ba):
    s = cuda.blockIdx.x
    ci = trail_ids[s]
    if ci < 0:
        return
    a = seq_query_start[s]
    n = seq_query_start[s + 1] - a
    if n > trail_x.shape[1]:           # the host refuses such blocks; never write past the trail
        return
    cd = trail_x.shape[2]
    width = cd + trail_ba.shape[2]
    for e in range(cuda.threadIdx.x, n * width, cuda.blockDim.x):
        r = e // width
        c = e - r * width
        if c < cd:
            trail_x[ci, r, c] = proj[a + r, c]
        else:
            trail_ba[ci, r, c - cd] = proj[a + r, gate_offset + c - cd]


def record_trail(proj, seq_query_start, trail_ids, gate_offset: int, trail_x, trail_ba, stream=0) -> None:
    """For every segment s with trail_ids[s] >= 0 (a verify block after a checkpoint), copy its
    raw GDN inputs into that checkpoint's trail: the pre-conv rows proj[:, :conv_dim] into
    trail_x[id, :n] [ids, max_trail, conv_dim] and the b | a columns proj[:, gate_offset:+2nv]
    into trail_ba[id, :n] [ids, max_trail, 2nv]. A rollback replays them (docs/hybrid.md)."""
    S = trail_ids.shape[0]
    if S:
        _record_trail_kernel[S, 256, stream](proj, seq_query_start, trail_ids, np.int32(gate_offset),
                                             trail_x, trail_ba)


def record_trail_ref(proj, seq_query_start, trail_ids, gate_offset: int, trail_x, trail_ba) -> None:
    cd, nba = trail_x.shape[2], trail_ba.shape[2]
    for s, ci in enumerate(trail_ids):
        a, b = int(seq_query_start[s]), int(seq_query_start[s + 1])
        if ci >= 0 and b - a <= trail_x.shape[1]:
            trail_x[ci, :b - a] = proj[a:b, :cd]
            trail_ba[ci, :b - a] = proj[a:b, gate_offset:gate_offset + nba]
