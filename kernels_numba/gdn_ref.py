"""The Gated DeltaNet NumPy references, apart from the CUDA kernels of kernels_numba/gdn.py (which
re-exports them) so that the host side (metrale/models/hybrid.py, the NumPy backend's hybrid ops)
reads them without importing numba.cuda (~40 MB resident on a CPU-only process)."""
from __future__ import annotations

import numpy as np

L2_EPS = 1e-6


def softplus_ref(x):
    """torch.nn.functional.softplus (threshold 20)."""
    x = np.asarray(x)
    return np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20))))


def gdn_gates_ref(a, b, a_log, dt_bias):
    """(g, beta) from the raw a, b projections [L, nv]: g = log decay (<= 0), beta in (0, 1)."""
    g = -np.exp(a_log) * softplus_ref(a + dt_bias)
    return g, 1.0 / (1.0 + np.exp(-b))


def l2norm_ref(x, eps: float = L2_EPS):
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + eps)


def causal_conv1d_ref(x, weight, state):
    """x [L, C], weight [C, K], state [C, K-1] (the previous K-1 inputs, oldest first).
    Returns (silu(conv) [L, C], new state [C, K-1])."""
    K = weight.shape[1]
    full = np.concatenate([state.T, x], axis=0)                  # [K-1+L, C]
    L = x.shape[0]
    y = np.zeros_like(x)
    for j in range(K):
        y = y + full[j:j + L] * weight[:, j]
    return y / (1.0 + np.exp(-y)), np.ascontiguousarray(full[-(K - 1):].T) if K > 1 else state.copy()


def gated_delta_recurrent_ref(q, k, v, g, beta, state):
    """Token by token. q, k [L, H, dk] (normalised, q scaled), v [L, H, dv], g/beta [L, H],
    state [H, dk, dv]. Returns (o [L, H, dv], final state)."""
    S = np.array(state, copy=True)
    o = np.empty(v.shape, dtype=np.result_type(v, S))
    for t in range(q.shape[0]):
        S = S * np.exp(g[t])[:, None, None]
        kv = (S * k[t][:, :, None]).sum(axis=1)                   # S^T k  [H, dv]
        u = (v[t] - kv) * beta[t][:, None]
        S = S + k[t][:, :, None] * u[:, None, :]
        o[t] = (S * q[t][:, :, None]).sum(axis=1)
    return o, S


def gated_delta_chunked_ref(q, k, v, g, beta, state, chunk: int = 64):
    """The chunked (WY / UT transform) form of gated_delta_recurrent_ref: same arguments."""
    L, H, dk = q.shape
    S = np.array(state, copy=True)
    o = np.empty(v.shape, dtype=np.result_type(v, S))
    for c0 in range(0, L, chunk):
        qc, kc, vc = (x[c0:c0 + chunk].transpose(1, 0, 2) for x in (q, k, v))   # [H, n, d]
        bc = beta[c0:c0 + chunk].T                                                # [H, n]
        G = np.cumsum(g[c0:c0 + chunk].T, axis=1)                                 # [H, n]
        n = qc.shape[1]
        tri = np.tril(np.ones((n, n), dtype=bool))
        diff = np.where(tri, G[:, :, None] - G[:, None, :], -np.inf)             # G_t - G_s, s <= t
        decay = np.exp(diff)
        Lm = np.where(np.tril(tri, -1), bc[:, :, None] * (kc @ kc.transpose(0, 2, 1)) * decay, 0.0)
        T = np.zeros_like(Lm)                                                     # (I + L)^-1
        for r in range(n):
            T[:, r, r] = 1.0
            T[:, r, :r] = -np.einsum("hm,hmc->hc", Lm[:, r, :r], T[:, :r, :r])
        U = T @ (bc[:, :, None] * vc)
        W = T @ ((bc * np.exp(G))[:, :, None] * kc)
        U = U - W @ S
        inter = np.exp(G)[:, :, None] * (qc @ S)
        intra = ((qc @ kc.transpose(0, 2, 1)) * decay) @ U
        o[c0:c0 + n] = (inter + intra).transpose(1, 0, 2)
        gl = G[:, -1]
        S = np.exp(gl)[:, None, None] * S + (kc * np.exp(gl[:, None] - G)[:, :, None]).transpose(0, 2, 1) @ U
    return o, S


def rms_norm_gated_ref(x, z, weight, eps: float):
    """x, z [..., dv]: rmsnorm(x) * weight * silu(z) (Qwen3-Next's gated output norm)."""
    var = (x * x).mean(-1, keepdims=True)
    return x / np.sqrt(var + eps) * weight * (z / (1.0 + np.exp(-z)))


def gdn_segment_ref(x, b, a, conv_w, a_log, dt_bias, conv_state, ssm_state, nk: int, dk: int,
                    chunk: int | None = None):
    """One segment of one Gated DeltaNet layer from the pre-conv input x [L, conv_dim] and the raw
    gate projections b, a [L, nv]. Returns (o [L, nv, dv] before the gated norm, conv_state,
    ssm_state). chunk=None: recurrent form; else the chunked form with that chunk size."""
    nv, dv = ssm_state.shape[0], ssm_state.shape[2]
    L = x.shape[0]
    y, conv_state = causal_conv1d_ref(x, conv_w, conv_state)
    r = nv // nk
    q = np.repeat(l2norm_ref(y[:, :nk * dk].reshape(L, nk, dk)), r, axis=1) / np.sqrt(dk)
    k = np.repeat(l2norm_ref(y[:, nk * dk:2 * nk * dk].reshape(L, nk, dk)), r, axis=1)
    v = y[:, 2 * nk * dk:].reshape(L, nv, dv)
    g, beta = gdn_gates_ref(a, b, a_log, dt_bias)
    if chunk is None:
        o, ssm_state = gated_delta_recurrent_ref(q, k, v, g, beta, ssm_state)
    else:
        o, ssm_state = gated_delta_chunked_ref(q, k, v, g, beta, ssm_state, chunk)
    return o, conv_state, ssm_state


def state_norm_clamp_ref(ssm_state, bound: float):
    """ssm_state [nv, dk, dv] -> the same with each head's norm clamped to bound."""
    norm = np.sqrt((ssm_state * ssm_state).sum(axis=(-2, -1), keepdims=True))
    return ssm_state * np.where(norm > bound, bound / np.maximum(norm, 1e-30), 1.0)
