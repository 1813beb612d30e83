"""Expert parallelism on CPU: ranks are threads joined by FakeCommunicator. The EP MoE layer and
the whole tiny DeepSeek model (rank 0 leading with step plans) equal the single-rank results for
2 and 4 ranks; the plan message round-trips; Nccl4pyCommunicator's logic runs on a fake nccl.core."""
import contextlib
import queue
import sys
import threading
import types

import numpy as np
import pytest

from kernels_numba import moe as M
from metrale.models import deepseek as DS
from metrale.parallel import (Command, EPRank, ExpertParallel, StepPlan, broadcast, decode_plan,
                              encode_plan, ep_generate, gather, run_ranks)
from metrale.runtime.batch import Segment


def test_fake_all_to_all_v_broadcast_gather():
    def fn(comm):
        r, n = comm.rank, comm.world_size
        send = np.array([[10 * r + d, d] for d in range(n) for _ in range(d + 1)], np.int64)
        recv, counts = comm.all_to_all_v(send, [d + 1 for d in range(n)])
        assert counts.tolist() == [r + 1] * n
        assert recv[:, 0].tolist() == [10 * s + r for s in range(n) for _ in range(r + 1)]
        b = broadcast(comm, np.arange(5) * 7 if r == 0 else None)
        g = gather(comm, np.full((r, 2), r, np.float32))
        return b.tolist(), None if g is None else [x.shape[0] for x in g]
    out = run_ranks(3, fn)
    assert all(o[0] == [0, 7, 14, 21, 28] for o in out)
    assert out[0][1] == [0, 1, 2] and out[1][1] is None


def test_a_failing_rank_does_not_hang_the_others():
    def fn(comm):
        if comm.rank == 1:
            raise KeyError("boom")
        comm.all_to_all_v(np.zeros((2, 1)), [1, 1])
    with pytest.raises(KeyError, match="boom"):
        run_ranks(2, fn, timeout=10)


def _moe_weights(rng, e, d, f):
    return rng.standard_normal((e, 2 * f, d)) / np.sqrt(d), rng.standard_normal((e, d, f)) / np.sqrt(f)


@pytest.mark.parametrize("world", [2, 4])
def test_ep_layer_equals_single_rank(world):
    """Tokens split unevenly over ranks (one rank has none); experts split evenly; V3 routing."""
    rng = np.random.default_rng(world)
    t, d, f, e = 13, 16, 8, 8
    cfg = M.RouteConfig(e, 3, "sigmoid", "noaux_tc", n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)
    x = rng.standard_normal((t, d))
    ids, w = M.route_ref(rng.standard_normal((t, e)), cfg, 0.1 * rng.standard_normal(e))
    gu, dn = _moe_weights(rng, e, d, f)
    want = DS.local_experts(x, ids, w, gu, dn)
    cuts = np.array([0, 5, 5, 9, 13] if world == 4 else [0, 0, 13])

    def fn(comm):
        ep = ExpertParallel(comm, e)
        lo, hi = ep.expert_range
        a, b = cuts[comm.rank], cuts[comm.rank + 1]
        return ep.dispatch_combine(x[a:b], ids[a:b], w[a:b], lambda rows, local: DS.expert_mlp(rows, local, gu[lo:hi], dn[lo:hi]))
    got = np.concatenate(run_ranks(world, fn))
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)


def test_plan_round_trip_and_errors():
    plan = StepPlan(7, Command.FORWARD, [
        [Segment(np.array([1, 2, 3], np.int32), 0, np.array([4, 5], np.int32), "none"),
         Segment(np.array([9], np.int32), 12, np.array([0, 1, 2, 3], np.int32))],
        [],
        [Segment(np.array([6, 6], np.int32), 3, np.array([7], np.int32), "all")]], num_layers=2)
    words = encode_plan(plan)
    assert words.dtype == np.dtype("<i4") and words.size == 7 + 3 * 5 + 6 + 7
    back = decode_plan(words)
    assert (back.step, back.command, back.num_layers, back.world_size) == (7, Command.FORWARD, 2, 3)
    for a, b in zip(sum(plan.work, []), sum(back.work, [])):
        assert a.token_ids.tolist() == b.token_ids.tolist() and a.block_table.tolist() == b.block_table.tolist()
        assert (a.start_pos, a.logits) == (b.start_pos, b.logits)
    assert [len(w) for w in back.work] == [2, 0, 1]
    with pytest.raises(ValueError, match="magic"):
        decode_plan(words[1:])
    with pytest.raises(ValueError, match="header describes"):
        decode_plan(words[:-1])
    stop = decode_plan(encode_plan(StepPlan(8, Command.STOP, [[], []])))
    assert stop.command == Command.STOP and stop.work == [[], []]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return DS.write_random_checkpoint(tmp_path_factory.mktemp("dsv3ep"), DS.tiny_deepseek_hf_config(), seed=5)


PROMPTS = [[3, 17, 5, 60, 2, 9, 9, 41, 7], [11, 12, 13, 14, 15], [40, 2, 40, 2, 40, 2, 33]]


@pytest.mark.parametrize("world", [2, 4])
def test_ep_model_generation_equals_single_rank(ckpt, world):
    """Rank 0 schedules (chunked prefill + decode, sequences dealt to ranks), every rank runs its
    attention and all ranks the expert-parallel MoE; with 4 ranks and 3 prompts rank 3 idles."""
    single = DS.load_deepseek_backend(ckpt, num_blocks=32, block_size=4, dtype="float64")
    want = [DS.greedy_generate(single, p, 5, first_block=8 * i) for i, p in enumerate(PROMPTS)]

    def fn(comm):
        ep = ExpertParallel(comm, 8)
        backend = DS.load_deepseek_backend(ckpt, num_blocks=32, block_size=4, dtype="float64", ep=ep)
        assert backend.weights["layers.1.experts_gate_up"].shape[0] == 8 // world
        rank = EPRank(comm, backend)
        return ep_generate(rank, PROMPTS, 5, chunk=4) if comm.rank == 0 else rank.follow()
    out = run_ranks(world, fn)
    assert out[0] == want
    assert all(steps == out[1] for steps in out[1:])      # followers ran every step


# ------------------------------------------------------------------ Nccl4pyCommunicator, faked

def _fake_nccl(world):
    """A stand-in for nccl.core: send/recv between threads through queues, deferred to the end
    of a group like NCCL's (sends first, then the receives block until matched)."""
    boxes = {(s, d): queue.Queue() for s in range(world) for d in range(world)}
    local = threading.local()

    class Communicator:
        def __init__(self, rank):
            self.rank, self.nranks = rank, world

        def send(self, buf, peer, stream=None):
            op = lambda: boxes[(self.rank, peer)].put(np.array(buf, copy=True))  # noqa: E731
            local.ops.append((0, op)) if getattr(local, "ops", None) is not None else op()

        def recv(self, buf, peer, stream=None):
            def op():
                got = boxes[(peer, self.rank)].get(timeout=10)
                assert got.nbytes == buf.nbytes, "NCCL would hang: sizes differ"
                buf[...] = got.view(buf.dtype).reshape(buf.shape)
            local.ops.append((1, op)) if getattr(local, "ops", None) is not None else op()

        def destroy(self):
            pass

    @contextlib.contextmanager
    def group():
        local.ops = []
        try:
            yield
        finally:
            ops, local.ops = local.ops, None
            for _, op in sorted(ops, key=lambda o: o[0]):
                op()

    core = types.SimpleNamespace(Communicator=Communicator, group=group)
    return core


def test_nccl4py_wrapper_logic_on_a_fake_nccl(monkeypatch):
    from metrale.parallel.nccl import Nccl4pyCommunicator
    core = _fake_nccl(3)
    pkg = types.ModuleType("nccl")
    pkg.core = core
    monkeypatch.setitem(sys.modules, "nccl", pkg)
    monkeypatch.setitem(sys.modules, "nccl.core", core)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((12, 16))
    ids, w = M.route_ref(rng.standard_normal((12, 6)), M.RouteConfig(6, 2))
    gu, dn = _moe_weights(rng, 6, 16, 8)
    want = DS.local_experts(x, ids, w, gu, dn)

    def fn(fake):
        comm = Nccl4pyCommunicator(core.Communicator(fake.rank), device=False)
        ep = ExpertParallel(comm, 6)
        lo, hi = ep.expert_range
        a, b = 4 * comm.rank, 4 * comm.rank + 4
        b16, counts = comm.all_to_all_v(np.full((3 * comm.rank, 5), comm.rank, np.uint16), [comm.rank] * 3)
        assert b16.dtype == np.uint16 and counts.tolist() == [0, 1, 2] and b16[:, 0].tolist() == [1, 2, 2]
        return ep.dispatch_combine(x[a:b], ids[a:b], w[a:b], lambda rows, local: DS.expert_mlp(rows, local, gu[lo:hi], dn[lo:hi]))
    got = np.concatenate(run_ranks(3, fn))
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)
