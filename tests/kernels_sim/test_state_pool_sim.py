"""DeviceStatePool + GdnCudaOps.gated_delta_net under the simulator against HostStatePool (the
NumPy backend's pool): the same GDN outputs and states through prefill (split at snapshot
boundaries, with staging), decode, a checkpointed verify block, rollback with replay, and a
snapshot stored then resumed into another slot. Streams, events and driver copies are faked
(the simulator has no driver): copies are memmoves, so ordering is the host's."""
import ctypes
from types import SimpleNamespace

import numpy as np
import pytest
from numba import cuda

import metrale.runtime.cuda.state_pool as sp
from metrale.models.hybrid import HostStatePool, hybrid_model_config, random_hybrid_weights
from metrale.runtime.batch import Segment, build_batch
from metrale.models.families import compose_ops
from metrale.runtime.cuda_backend import CudaOps
from metrale.runtime.cuda_hybrid import GdnCudaOps

CFG = {"model_type": "metrale_hybrid", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
       "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
       "linear_num_key_heads": 1, "linear_num_value_heads": 2, "linear_key_head_dim": 8,
       "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4, "layer_types": ["linear_attention"] * 2}
TOL = dict(rtol=3e-4, atol=3e-4)


class FakeStream:
    handle, numba, ptr = 0, 0, 0

    def wait_event(self, event):
        pass

    def synchronize(self):
        pass


class FakeEvent:
    def __init__(self, timing=True):
        pass

    def record(self, stream):
        return self


class FakeArena:
    capacity = 1 << 30

    def __init__(self):
        self.used = 0

    def reset(self):
        self.used = 0

    def alloc(self, shape, dtype):
        a = np.zeros(shape, dtype)
        self.used += a.nbytes
        return cuda.to_device(a)


def host_ptr(a) -> int:
    return a._ary.__array_interface__["data"][0]


def fake_cu(name, dst, src, nbytes, stream):
    assert name in ("cuMemcpyDtoDAsync", "cuMemcpyHtoDAsync"), name
    ctypes.memmove(dst, src, nbytes)


@pytest.fixture
def pools(monkeypatch):
    monkeypatch.setattr(sp, "Stream", FakeStream)
    monkeypatch.setattr(sp, "Event", FakeEvent)
    monkeypatch.setattr(sp, "cu", fake_cu)
    monkeypatch.setattr(sp, "_ptr", host_ptr)
    config = hybrid_model_config(CFG)
    weights = {n: np.asarray(a, np.float32) for n, a in random_hybrid_weights(config, seed=1)}
    dev_weights = {n: cuda.to_device(a) for n, a in weights.items()}
    host = HostStatePool(config, weights, 3, 1, np.float32, chunk=8)
    host.reserve(num_checkpoints=1, max_trail=5, num_snapshots=2, snapshot_every=8)
    device = sp.DeviceStatePool(config, dev_weights, FakeArena(), FakeStream(), num_slots=3, max_seqs=4,
                                max_tokens=64, chunk=8)
    device.reserve(num_checkpoints=1, max_trail=5, num_snapshots=2, snapshot_every=8)
    return config, weights, dev_weights, host, device


def run_step(config, weights, dev_weights, host, device, segments, rng):
    """One forward's GDN layers on both pools with the same random projections; returns the
    outputs (host, device) per layer."""
    batch = build_batch(segments, 4)
    T, P = batch.num_tokens, config.linear_proj_size
    device.before_forward(batch, batch.num_seqs, graphed=False)
    act = {"gdn_conv": cuda.to_device(np.zeros((T, config.linear_conv_dim), np.float32)),
           "gdn_o": cuda.to_device(np.zeros((T, config.linear_value_dim), np.float32)),
           "gdn_out": cuda.to_device(np.zeros((T, config.linear_value_dim), np.float32))}
    ops = object.__new__(compose_ops(CudaOps, (GdnCudaOps,)))
    ops.b = SimpleNamespace(states=device, act=act,                 # CudaBackend.view, uncached
                            view=lambda name, n, shape=None: act[name][:n] if shape is None else act[name][:n].reshape(shape))
    ops.g = SimpleNamespace(tokens=T, seqs=batch.num_seqs, max_query_len=batch.max_query_len)
    ops.s, ops.cfg = 0, config
    ops.seq_query_start, ops.positions = cuda.to_device(batch.seq_query_start), cuda.to_device(batch.positions)
    outs = []
    for layer in range(config.num_state_layers):
        proj = rng.standard_normal((T, P)).astype(np.float32)
        w = [f"layers.{layer}.{n}" for n in ("lin_conv", "lin_a_log", "lin_dt_bias", "lin_norm")]
        want = host.gated_delta_net(batch, proj, layer, *(weights[n] for n in w), config.rms_norm_eps)
        got = ops.gated_delta_net(cuda.to_device(proj), layer, *(dev_weights[n] for n in w)).copy_to_host()
        outs.append((want, got))
    return outs


def assert_states_equal(host, device, ids):
    conv, ssm = device.conv.copy_to_host(), device.ssm.copy_to_host()
    for i in ids:
        np.testing.assert_allclose(conv[i], host.conv[:, i], **TOL)
        np.testing.assert_allclose(ssm[i], host.ssm[:, i], **TOL)
        assert device.tokens[i] == host.tokens[0, i]


def test_device_pool_follows_the_host_pool(pools):
    config, weights, dev_weights, host, device = pools
    rng_h = np.random.default_rng(0)
    table = [np.arange(8, dtype=np.int32) + 8 * i for i in range(3)]

    def step(segs):
        for want, got in run_step(config, weights, dev_weights, host, device, segs, rng_h):
            np.testing.assert_allclose(got, want, **TOL)

    # prefill: slot 0 from 0 (19 tokens, split at 8 and 16, chunked pieces), slot 1 (5 tokens)
    step([Segment(np.arange(19, dtype=np.int32), 0, table[0], state_slot=0),
          Segment(np.arange(5, dtype=np.int32), 0, table[1], state_slot=1)])
    staged_h, staged_d = host.take_staged(), device.take_staged()
    assert set(staged_h) == set(staged_d) == {(0, 8), (0, 16)}
    host.store_snapshot(staged_h[(0, 16)], host.snapshot_base)
    device.store_snapshot(staged_d[(0, 16)], device.snapshot_base)
    assert_states_equal(host, device, [0, 1, host.snapshot_base])
    # decode rows, then a verify block of 4 after a checkpoint, rolled back to 2 tokens
    step([Segment(np.array([1], np.int32), 19, table[0], state_slot=0),
          Segment(np.array([2], np.int32), 5, table[1], state_slot=1)])
    ck = host.num_slots
    host.copy_state(1, ck)
    device.copy_state(1, ck)
    step([Segment(np.array([3, 4, 5, 6], np.int32), 6, table[1], "all", state_slot=1, state_checkpoint=ck)])
    for pool in (host, device):
        pool.copy_state(ck, 1)
        pool.replay(1, ck, 2)
    assert_states_equal(host, device, [0, 1, ck])
    assert device.tokens[1] == 8
    # resume slot 2 from the snapshot at 16 and continue both it and slot 1
    for pool in (host, device):
        pool.copy_state(pool.snapshot_base, 2)
    step([Segment(np.arange(3, dtype=np.int32), 16, table[2], state_slot=2),
          Segment(np.array([7], np.int32), 8, table[1], state_slot=1)])
    assert_states_equal(host, device, [0, 1, 2])


def test_device_pool_refuses_a_gap(pools):
    config, weights, dev_weights, host, device = pools
    batch = build_batch([Segment(np.arange(3, dtype=np.int32), 4, np.arange(2, dtype=np.int32), state_slot=0)], 4)
    with pytest.raises(ValueError, match="holds 0 tokens"):
        device.before_forward(batch, 1, graphed=False)
