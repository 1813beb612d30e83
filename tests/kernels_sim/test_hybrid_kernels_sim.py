"""The CUDA hybrid wiring's kernels under the simulator: sigmoid_mul, record_trail, partial RoPE in
qkv_rope_store, the split passes of the device state pool (prefix-caching snapshots inside a
segment) and a rollback replay over recorded trail rows (metrale/runtime/cuda_hybrid.py)."""
import numpy as np
import pytest
from numba import cuda

from kernels_numba.bf16 import from_bf16_bits
from kernels_numba.gdn import (causal_conv1d, gdn_chunked, gdn_recurrent, gdn_segment_ref, record_trail,
                               record_trail_ref, sigmoid_mul, sigmoid_mul_ref)
from kernels_numba.qkv import qkv_rope_store, qkv_rope_store_ref
from metrale.models.rope import build_rope
from metrale.runtime.cuda.state_pool import pass_arrays, split_passes

TOL = dict(rtol=2e-4, atol=2e-4)


def dev(*arrays):
    return [cuda.to_device(np.ascontiguousarray(a)) for a in arrays]


def test_sigmoid_mul():
    rng = np.random.default_rng(0)
    x, g = rng.standard_normal((3, 200)).astype(np.float32), rng.standard_normal((3, 200)).astype(np.float32)
    out = cuda.to_device(np.zeros((3, 200), np.float32))
    sigmoid_mul(*dev(x, g), out)
    np.testing.assert_allclose(out.copy_to_host(), sigmoid_mul_ref(x, g), **TOL)


def test_record_trail():
    rng = np.random.default_rng(1)
    T, cd, nba, off = 9, 12, 6, 20
    proj = rng.standard_normal((T, off + nba)).astype(np.float32)
    starts = np.array([0, 1, 5, 9], np.int32)               # a decode row, two verify blocks of 4
    ids = np.array([-1, 2, 0], np.int32)
    tx, tb = np.full((3, 5, cd), 7.0, np.float32), np.full((3, 5, nba), 7.0, np.float32)
    d_tx, d_tb = dev(tx, tb)
    record_trail(*dev(proj, starts, ids), off, d_tx, d_tb)
    record_trail_ref(proj, starts, ids, off, tx, tb)
    np.testing.assert_array_equal(d_tx.copy_to_host(), tx)
    np.testing.assert_array_equal(d_tb.copy_to_host(), tb)


@pytest.mark.parametrize("interleaved", [False, True])
def test_partial_rope_qkv_store(interleaved):
    rng = np.random.default_rng(2)
    T, hq, hk, hd, rot = 3, 2, 1, 16, 8
    qkv = rng.standard_normal((T, (hq + 2 * hk) * hd)).astype(np.float32)
    positions, slots = np.array([0, 3, 7], np.int32), np.array([0, 5, 2], np.int32)
    cos, sin = build_rope(rot, 10000.0).tables(16)
    qn, kn = (1 + 0.1 * rng.standard_normal((2, hd))).astype(np.float32)
    kc, vc = np.zeros((2, 4, hk, hd), np.uint16), np.zeros((2, 4, hk, hd), np.uint16)
    q_ref = qkv_rope_store_ref(qkv, positions, cos, sin, slots, hq, hk, hd, kc, vc, interleaved=interleaved,
                               q_norm=qn, k_norm=kn)
    d_kc, d_vc = dev(np.zeros_like(kc), np.zeros_like(vc))
    d_q = cuda.to_device(np.zeros((T, hq, hd), np.float32))
    qkv_rope_store(*dev(qkv, positions, cos, sin, slots), d_q, d_kc, d_vc, interleaved=interleaved,
                   q_norm=cuda.to_device(qn), k_norm=cuda.to_device(kn))
    np.testing.assert_allclose(d_q.copy_to_host(), q_ref, **TOL)
    np.testing.assert_allclose(from_bf16_bits(d_kc.copy_to_host()), from_bf16_bits(kc), rtol=1e-2, atol=1e-2)
    assert (q_ref[..., rot:] != 0).all()        # the pass-through dims are the (normed) inputs
    if not interleaved:   # the reference of a partial rotation: rotate_half over the first rot dims only
        x = qkv[:, :hd].astype(np.float64)
        x = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * qn
        c, s = cos[positions].astype(np.float64), sin[positions].astype(np.float64)
        a, b = x[:, :rot // 2], x[:, rot // 2:rot]
        np.testing.assert_allclose(q_ref[:, 0], np.concatenate([a * c - b * s, a * s + b * c, x[:, rot:]], -1), 1e-9)


NK, NV, DK, DV, K = 1, 2, 8, 8, 4


def gdn_inputs(rng, T):
    cd = 2 * NK * DK + NV * DV
    x = rng.standard_normal((T, cd)).astype(np.float32)
    gate = rng.standard_normal((T, 2 * NV)).astype(np.float32)
    w = (0.5 * rng.standard_normal((cd, K))).astype(np.float32)
    a_log, dt = np.log(rng.uniform(0.5, 8, NV)).astype(np.float32), (0.5 * rng.standard_normal(NV)).astype(np.float32)
    return x, gate, w, a_log, dt


def run_passes(x, gate, w, a_log, dt, starts, positions, slots, conv, ssm, passes, chunk, stage=None):
    """What GdnCudaOps.gated_delta_net launches per pass (plus staging copies on the host)."""
    T = x.shape[0]
    d = dev(x, gate, w, a_log, dt, positions)
    d_conv, d_ssm = dev(conv, ssm)
    conv_out, o = dev(np.zeros((T, x.shape[1]), np.float32), np.zeros((T, NV * DV), np.float32))
    staged = {}
    for k, (sqs, sl) in enumerate(passes):
        d_sqs, d_sl = dev(sqs, sl)
        causal_conv1d(d[0], d[2], d_conv, d_sqs, d_sl, d[5], conv_out)
        gdn_recurrent(conv_out, d[1], d[3], d[4], d_ssm, d_sqs, d_sl, d[5], o, max_len=chunk - 1)
        gdn_chunked(conv_out, d[1], d[3], d[4], d_ssm, d_sqs, d_sl, d[5], o, chunk=4, min_len=chunk)
        for slot, key in (stage or {}).get(k, []):
            staged[key] = (d_conv.copy_to_host()[slot], d_ssm.copy_to_host()[slot])
    return o.copy_to_host(), d_conv.copy_to_host(), d_ssm.copy_to_host(), staged


def test_split_passes_equal_one_pass_and_stage_the_boundary_state():
    """Two prefill segments (one crossing two snapshot boundaries, one none) and a decode row: the
    split run equals the one-pass run, and the state staged at each boundary is the reference's."""
    rng = np.random.default_rng(3)
    every, chunk = 8, 6
    lens, firsts, slots = [19, 5, 1], [3, 0, 11], np.array([1, 0, 2], np.int32)
    starts = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    positions = np.concatenate([np.arange(f, f + n) for f, n in zip(firsts, lens)]).astype(np.int32)
    T = starts[-1]
    x, gate, w, a_log, dt = gdn_inputs(rng, T)
    conv0 = rng.standard_normal((3, x.shape[1], K - 1)).astype(np.float32)
    ssm0 = (0.3 * rng.standard_normal((3, NV, DK, DV))).astype(np.float32)
    pieces = split_passes(starts, positions, slots, np.full(3, -1, np.int32), every)
    assert pieces[0] == [(0, 5), (5, 13), (13, 19)] and len(pieces[1]) == 1 and len(pieces[2]) == 1
    passes = [pass_arrays(pieces, slots, k) for k in range(3)]
    stage = {0: [(1, 8)], 1: [(1, 16)]}
    o_split, conv_s, ssm_s, staged = run_passes(x, gate, w, a_log, dt, starts, positions, slots, conv0, ssm0,
                                                passes, chunk, stage)
    o_one, conv_1, ssm_1, _ = run_passes(x, gate, w, a_log, dt, starts, positions, slots, conv0, ssm0,
                                         [(starts, slots)], chunk)
    np.testing.assert_allclose(o_split, o_one, **TOL)
    np.testing.assert_allclose(ssm_s, ssm_1, **TOL)
    np.testing.assert_allclose(conv_s, conv_1, **TOL)
    for end in (8, 16):      # segment 0 starts at position 3 in slot 1
        n = end - 3
        _, conv_ref, ssm_ref = gdn_segment_ref(x[:n].astype(np.float64), gate[:n, :NV], gate[:n, NV:], w, a_log, dt,
                                               conv0[1], ssm0[1], NK, DK)
        np.testing.assert_allclose(staged[end][0], conv_ref, **TOL)
        np.testing.assert_allclose(staged[end][1], ssm_ref, **TOL)


def test_replay_of_recorded_rows_restores_the_state_after_j_tokens():
    """A verify block of 5 tokens records its raw rows; restoring the checkpoint and replaying the
    first j rows gives exactly the state a run of those j tokens gives (bit-identical)."""
    rng = np.random.default_rng(4)
    x, gate, w, a_log, dt = gdn_inputs(rng, 5)
    cd = x.shape[1]
    proj = np.concatenate([x, np.zeros((5, 3), np.float32), gate], axis=1)
    conv0 = rng.standard_normal((1, cd, K - 1)).astype(np.float32)
    ssm0 = (0.3 * rng.standard_normal((1, NV, DK, DV))).astype(np.float32)
    starts, positions, slots = np.array([0, 5], np.int32), np.arange(20, 25, dtype=np.int32), np.zeros(1, np.int32)
    tx, tb = dev(np.zeros((1, 8, cd), np.float32), np.zeros((1, 8, 2 * NV), np.float32))
    record_trail(*dev(proj, starts, np.zeros(1, np.int32)), cd + 3, tx, tb)
    trail_x, trail_b = tx.copy_to_host()[0], tb.copy_to_host()[0]
    for j in (1, 3, 5):
        st = np.array([0, j], np.int32)
        _, conv_r, ssm_r, _ = run_passes(trail_x[:j], trail_b[:j], w, a_log, dt, st, positions[:j], slots,
                                         conv0, ssm0, [(st, slots)], 64)
        _, conv_t, ssm_t, _ = run_passes(x[:j], gate[:j], w, a_log, dt, st, positions[:j], slots,
                                         conv0, ssm0, [(st, slots)], 64)
        np.testing.assert_array_equal(ssm_r, ssm_t)
        np.testing.assert_array_equal(conv_r, conv_t)
