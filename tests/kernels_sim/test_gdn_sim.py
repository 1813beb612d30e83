"""Gated DeltaNet kernels (kernels_numba/gdn.py) under the CUDA simulator against their references,
on ragged batches mixing fresh segments (position 0), continued ones and skipped ones (slot -1)."""
import numpy as np
import pytest
from numba import cuda

from kernels_numba.gdn import (causal_conv1d, causal_conv1d_ref, gated_delta_recurrent_ref, gdn_chunked,
                               gdn_gates_ref, gdn_recurrent, l2norm_ref, rms_norm_gated, rms_norm_gated_ref,
                               state_norm_clamp, state_norm_clamp_ref)

TOL = dict(rtol=2e-4, atol=2e-4)


def ragged(lens, firsts):
    starts = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    positions = np.concatenate([np.arange(f, f + n) for f, n in zip(firsts, lens)]).astype(np.int32)
    return starts, positions


def dev(*arrays):
    return [cuda.to_device(np.ascontiguousarray(a)) for a in arrays]


@pytest.mark.parametrize("K", [2, 4])
def test_causal_conv1d(K):
    rng = np.random.default_rng(K)
    lens, firsts, slots = [5, 1, 3, 2], [0, 7, 2, 4], np.array([2, 0, 1, -1], np.int32)
    starts, positions = ragged(lens, firsts)
    T, C = starts[-1], 40
    proj = rng.standard_normal((T, C + 7)).astype(np.float32)        # conv input = a column slice
    w = rng.standard_normal((C, K)).astype(np.float32)
    state = rng.standard_normal((3, C, K - 1)).astype(np.float32)
    out = np.full((T, C), 9.0, np.float32)
    d_proj, d_w, d_state, d_out = dev(proj, w, state, out)
    causal_conv1d(d_proj[:, :C], d_w, d_state, *dev(starts, slots, positions), d_out)
    got, got_state = d_out.copy_to_host(), d_state.copy_to_host()
    for s, slot in enumerate(slots):
        a, b = starts[s], starts[s + 1]
        if slot < 0:
            assert (got[a:b] == 9.0).all()
            continue
        init = np.zeros((C, K - 1)) if firsts[s] == 0 else state[slot].astype(np.float64)
        y, st = causal_conv1d_ref(proj[a:b, :C].astype(np.float64), w.astype(np.float64), init)
        np.testing.assert_allclose(got[a:b], y, **TOL)
        np.testing.assert_allclose(got_state[slot], st, **TOL)


def gdn_inputs(rng, lens, firsts, nk, nv, dk, dv, num_slots=3):
    starts, positions = ragged(lens, firsts)
    T = starts[-1]
    qkv = rng.standard_normal((T, 2 * nk * dk + nv * dv)).astype(np.float32)
    proj_tail = rng.standard_normal((T, 3 + 2 * nv)).astype(np.float32)   # b | a at columns 3..
    a_log = np.log(rng.uniform(0.5, 4.0, nv)).astype(np.float32)
    dt_bias = rng.standard_normal(nv).astype(np.float32)
    state = rng.standard_normal((num_slots, nv, dk, dv)).astype(np.float32)
    return starts, positions, qkv, proj_tail, a_log, dt_bias, state


def core_ref(qkv, ba, a_log, dt_bias, state, nk, dk):
    """o [L, nv*dv], final state from post-conv rows (float64)."""
    x = qkv.astype(np.float64)
    nv, dv = state.shape[0], state.shape[2]
    L, r = x.shape[0], nv // nk
    q = np.repeat(l2norm_ref(x[:, :nk * dk].reshape(L, nk, dk)), r, axis=1) / np.sqrt(dk)
    k = np.repeat(l2norm_ref(x[:, nk * dk:2 * nk * dk].reshape(L, nk, dk)), r, axis=1)
    v = x[:, 2 * nk * dk:].reshape(L, nv, dv)
    g, beta = gdn_gates_ref(ba[:, nv:].astype(np.float64), ba[:, :nv].astype(np.float64), a_log.astype(np.float64),
                            dt_bias.astype(np.float64))
    o, st = gated_delta_recurrent_ref(q, k, v, g, beta, state.astype(np.float64))
    return o.reshape(L, -1), st


def check(got, got_state, inputs, lens, firsts, slots, nk, dk, done):
    starts, positions, qkv, tail, a_log, dt_bias, state = inputs
    for s, slot in enumerate(slots):
        a, b = starts[s], starts[s + 1]
        if not done(s):
            assert (got[a:b] == 9.0).all(), f"segment {s} should have been skipped"
            if slot >= 0:
                np.testing.assert_array_equal(got_state[slot], state[slot])
            continue
        init = np.zeros_like(state[slot]) if firsts[s] == 0 else state[slot]
        o, st = core_ref(qkv[a:b], tail[a:b, 3:], a_log, dt_bias, init, nk, dk)
        np.testing.assert_allclose(got[a:b], o, **TOL)
        np.testing.assert_allclose(got_state[slot], st, **TOL)


@pytest.mark.parametrize("nk,nv,dk,dv", [(1, 2, 8, 40), (2, 2, 16, 8)])
def test_gdn_recurrent(nk, nv, dk, dv):
    rng = np.random.default_rng(dv)
    lens, firsts, slots = [3, 1, 2, 2], [0, 5, 9, 0], np.array([1, 0, -1, 2], np.int32)
    inputs = gdn_inputs(rng, lens, firsts, nk, nv, dk, dv)
    starts, positions, qkv, tail, a_log, dt_bias, state = inputs
    out = np.full((starts[-1], nv * dv), 9.0, np.float32)
    d_tail, d_state, d_out = dev(tail, state, out)
    gdn_recurrent(*dev(qkv), d_tail[:, 3:], *dev(a_log, dt_bias), d_state, *dev(starts, slots, positions), d_out,
                  max_len=2)
    check(d_out.copy_to_host(), d_state.copy_to_host(), inputs, lens, firsts, slots, nk, dk,
          lambda s: slots[s] >= 0 and lens[s] <= 2)


@pytest.mark.parametrize("chunk", [4, 16])
def test_gdn_chunked_and_recurrent_share_a_batch(chunk):
    nk, nv, dk, dv = 1, 2, 8, 8
    rng = np.random.default_rng(chunk)
    lens, firsts, slots = [9, 1, 6, 2], [0, 5, 3, 0], np.array([1, 0, 2, -1], np.int32)
    inputs = gdn_inputs(rng, lens, firsts, nk, nv, dk, dv)
    starts, positions, qkv, tail, a_log, dt_bias, state = inputs
    out = np.full((starts[-1], nv * dv), 9.0, np.float32)
    d_qkv, d_tail, d_a, d_dt, d_state, d_out = dev(qkv, tail, a_log, dt_bias, state, out)
    meta = dev(starts, slots, positions)
    gdn_chunked(d_qkv, d_tail[:, 3:], d_a, d_dt, d_state, *meta, d_out, chunk=chunk, min_len=3)
    check(d_out.copy_to_host(), d_state.copy_to_host(), inputs, lens, firsts, slots, nk, dk,
          lambda s: slots[s] >= 0 and lens[s] >= 3)
    gdn_recurrent(d_qkv, d_tail[:, 3:], d_a, d_dt, d_state, *meta, d_out, max_len=2)
    inputs_done = (starts, positions, qkv, tail, a_log, dt_bias, state)
    check(d_out.copy_to_host(), d_state.copy_to_host(), inputs_done, lens, firsts, slots, nk, dk,
          lambda s: slots[s] >= 0)


def test_rms_norm_gated_and_state_clamp():
    rng = np.random.default_rng(5)
    T, nv, dv = 3, 2, 40
    x = rng.standard_normal((T, nv * dv)).astype(np.float32)
    proj = rng.standard_normal((T, 5 + nv * dv)).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(dv)).astype(np.float32)
    d_proj, d_out = dev(proj, np.zeros((T, nv * dv), np.float32))
    rms_norm_gated(*dev(x), d_proj[:, 5:], *dev(w), 1e-6, d_out)
    ref = rms_norm_gated_ref(x.reshape(T, nv, dv).astype(np.float64), proj[:, 5:].reshape(T, nv, dv), w, 1e-6)
    np.testing.assert_allclose(d_out.copy_to_host(), ref.reshape(T, -1), **TOL)

    state = rng.standard_normal((3, nv, 4, 6)).astype(np.float32)
    state[2, 1] *= 0.01
    d_state = cuda.to_device(state)
    state_norm_clamp(d_state, cuda.to_device(np.array([2, -1, 0], np.int32)), 1.0)
    got = d_state.copy_to_host()
    np.testing.assert_allclose(got[0], state_norm_clamp_ref(state[0], 1.0), **TOL)
    np.testing.assert_allclose(got[2], state_norm_clamp_ref(state[2], 1.0), **TOL)
    np.testing.assert_array_equal(got[1], state[1])
    np.testing.assert_array_equal(got[2, 1], state[2, 1])     # already inside the bound
