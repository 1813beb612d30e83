"""Tensor parallelism on the CUDA backend, what runs without a GPU or the simulator: the refusals
(one line each), the vocab padding, the device collectives' plumbing (NcclCollectives on a fake
nccl4py over host memory, StagedCollectives on thread ranks), the dense activation plan's shared
LM-head buffer. The forward itself: tests/kernels_sim/test_tp_cuda_sim.py (simulator),
tests/gpu/test_tp_cuda_gpu.py (two GPUs)."""
import ctypes
import sys
import threading
import types
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from metrale.models.config import ModelConfig
from metrale.parallel.collectives import NcclCollectives, StagedCollectives
from metrale.parallel.comm import run_ranks
from metrale.settings import compose

CFG = ModelConfig(architecture="llama", vocab_size=192, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=2, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=1000.0,
                  tie_word_embeddings=False, max_position=64, name="tiny-tp")


def test_the_unsplit_cuda_backend_refuses_tensor_parallel_settings():
    from metrale.runtime.cuda_backend import CudaBackend
    cfg = compose(["device=cuda", "parallel.tensor=2", "levers.gemm_library=numba"])
    with pytest.raises(ValueError, match=r"^parallel.tensor=2: this builds one unsplit CUDA backend; "
                                         r"tensor-parallel ranks are built by metrale.parallel.tp"):
        CudaBackend(CFG, None, cfg=cfg)                # refused before any device call


def test_too_few_gpus_is_one_line(monkeypatch):
    from metrale.parallel.tp_cuda import rank_devices
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(ValueError, match=r"^parallel.tensor=2 device=cuda needs 2 GPUs \(one a rank\), 1 visible$"):
        rank_devices(2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,6")
    assert rank_devices(2) == ["3", "5"]


def test_expert_parallel_on_cuda_is_still_refused(monkeypatch):
    from metrale.parallel import tp
    monkeypatch.setattr("metrale.runtime.select.cuda_available", lambda: True)
    cfg = compose(["model=tiny-shape", "device=cuda", "parallel.expert=2"])
    comm = SimpleNamespace(rank=0, world_size=2)
    with pytest.raises(ValueError, match=r"^parallel.expert > 1 runs on device=cpu only so far"):
        tp.load_rank(cfg, comm)


def test_vocab_slices_pad_to_gemm_rows():
    from metrale.runtime.cuda_tp import pad_vocab, padded_vocab
    assert [padded_vocab(n) for n in (0, 1, 64, 65, 64128)] == [64, 64, 64, 128, 64128]
    stream = [("embed", np.ones((3, 4), np.float32)), ("layers.0.o", np.ones((4, 4), np.float32)),
              ("lm_head", np.full((64, 4), 2.0, np.float32))]
    got = dict(pad_vocab(iter(stream), 64))
    assert got["embed"].shape == (64, 4) and got["embed"][3:].sum() == 0 and got["embed"][:3].sum() == 12
    assert got["layers.0.o"].shape == (4, 4) and got["lm_head"] is stream[2][1]


def test_dense_plan_shares_the_lm_head_buffer_with_an_equal_width():
    """A vocabulary (slice) as wide as the gate|up output (2F = 256 here) gets one buffer of the
    larger row count, not the LM head's rows only (the gate_up product of a long step would overrun it)."""
    from metrale.runtime.cuda_dense import DenseCuda
    b = SimpleNamespace(config=CFG, max_tokens=16, max_rows=4, max_model_len=64, use_blas=False)
    plan = DenseCuda(b).activation_plan()
    assert plan["out256"][0] == (16, 256) and plan["out192"][0] == (4, 192)
    b.config = replace(CFG, vocab_size=256)
    assert DenseCuda(b).activation_plan()["out256"][0] == (16, 256)


class HostArray:
    """A host array behind __cuda_array_interface__ (what the NCCL wrapper reads) and the
    copy_to_host / copy_to_device a device array has (what the staged collectives use)."""

    def __init__(self, a: np.ndarray):
        self.a = a
        self.size, self.shape = a.size, a.shape

    @property
    def __cuda_array_interface__(self):
        return {"data": (self.a.ctypes.data, False), "shape": self.a.shape, "typestr": self.a.dtype.str, "version": 3}

    def copy_to_host(self):
        return self.a.copy()

    def copy_to_device(self, host):
        self.a[...] = np.asarray(host).reshape(self.a.shape)

    def reshape(self, *shape):
        return HostArray(self.a.reshape(*shape))

    def __getitem__(self, key):
        return HostArray(self.a[key])


def _fake_nccl(world: int):
    """nccl.core and nccl.bindings.nccl stand-ins: all_reduce / all_gather between threads on host
    addresses (float32), each call a barrier round."""
    barrier = threading.Barrier(world, timeout=20)
    box: dict = {}
    log: list = []

    def floats(ptr, n):
        return np.ctypeslib.as_array((ctypes.c_float * n).from_address(ptr))

    def all_reduce(send, recv, count, dtype, op, comm, stream):
        assert dtype == 7 and op == 0
        box[comm.rank] = floats(send, count).copy()
        log.append(("all_reduce", comm.rank, count, stream))
        barrier.wait()
        floats(recv, count)[:] = sum(box[r] for r in range(world))
        barrier.wait()

    def all_gather(send, recv, count, dtype, comm, stream):
        box[comm.rank] = floats(send, count).copy()
        barrier.wait()
        floats(recv, count * world)[:] = np.concatenate([box[r] for r in range(world)])
        barrier.wait()

    class Communicator:
        def __init__(self, rank):
            self.rank, self.nranks, self._comm = rank, world, SimpleNamespace(rank=rank)
            self.aborted = False

        def abort(self):
            self.aborted = True

    core = types.SimpleNamespace(Communicator=Communicator, NcclRedOp=SimpleNamespace(SUM=0),
                                 NcclDataType=SimpleNamespace(FLOAT=7))
    raw = types.SimpleNamespace(all_reduce=all_reduce, all_gather=all_gather)
    return core, raw, log


def test_nccl_collectives_pass_pointers_counts_and_the_stream(monkeypatch):
    core, raw, log = _fake_nccl(2)
    pkg, bindings = types.ModuleType("nccl"), types.ModuleType("nccl.bindings")
    pkg.core, bindings.nccl = core, raw
    for name, mod in (("nccl", pkg), ("nccl.core", core), ("nccl.bindings", bindings), ("nccl.bindings.nccl", raw)):
        monkeypatch.setitem(sys.modules, name, mod)

    def fn(fake):
        c = NcclCollectives(core.Communicator(fake.rank))
        buf = HostArray(np.full((3, 4), fake.rank + 1.0, np.float32))
        c.all_reduce(buf, SimpleNamespace(ptr=77))
        pairs = HostArray(np.array([[fake.rank, 10 + fake.rank]], np.float32))
        got = HostArray(np.zeros((2, 1, 2), np.float32))
        c.all_gather(pairs, got, None)
        with pytest.raises(ValueError, match="recv holds 2 elements, 2 ranks x 2 needed"):
            c.all_gather(pairs, got[0], None)
        with pytest.raises(TypeError, match="float32 only"):
            c.all_reduce(HostArray(np.zeros(2, np.float64)), None)
        c.close()
        return buf.a, got.a, c.calls, c._comm.aborted
    out = run_ranks(2, fn)
    for buf, got, calls, aborted in out:
        assert (buf == 3.0).all() and got.reshape(2, 2).tolist() == [[0, 10], [1, 11]]
        assert aborted and calls == {"all_reduce": 1, "all_gather": 1}    # the refused calls issued nothing
    assert sorted(e[1:] for e in log) == [(0, 12, 77), (1, 12, 77)]        # count = elements, stream handle


def test_staged_collectives_on_thread_ranks():
    def fn(comm):
        c = StagedCollectives(comm)
        buf = HostArray(np.arange(6, dtype=np.float32) * (comm.rank + 1))
        c.all_reduce(buf, SimpleNamespace(synchronize=lambda: None))
        pairs = HostArray(np.array([[comm.rank * 2.0, comm.rank]], np.float32))
        got = HostArray(np.zeros((3, 1, 2), np.float32))
        c.all_gather(pairs, got, None)
        return buf.a, got.a, c.graph_safe
    for buf, got, safe in run_ranks(3, fn):
        assert buf.tolist() == (np.arange(6) * 6).tolist() and not safe
        assert got[:, 0].tolist() == [[0, 0], [2, 1], [4, 2]]


def test_a_mixed_capture_that_fails_on_one_rank_runs_eagerly_on_every_rank(monkeypatch):
    """NCCL: a collective is graph-captured on every rank or on none. A mixed bucket's capture with
    no warm-up that fails on rank 1 only must not leave rank 0 replaying its graph while rank 1
    runs the step eagerly: both drop the graph and run eagerly, and the bucket's next step is
    captured after a warm-up run on both."""
    from metrale.runtime import cuda_tp
    from metrale.runtime.cuda import CudaGraph
    from metrale.runtime.cuda_backend import Geometry
    g = Geometry(16, 2, 2, 0, 8, None, mixed=True)

    class Graph:
        def __init__(self, log):
            self.log = log

        def replay(self, stream=None):
            self.log.append("replay")

        def close(self):
            self.log.append("close")

    logs = {0: [], 1: []}

    def capture(stream, fn, *, warmup=1, mode="thread_local"):
        rank = stream
        logs[rank].append(f"capture{warmup}")
        if rank == 1 and warmup == 0:
            raise RuntimeError("a kernel compiled inside the capture")
        return Graph(logs[rank])
    monkeypatch.setattr(CudaGraph, "capture", staticmethod(capture))

    def fn(comm):
        b = object.__new__(cuda_tp.TpCudaBackend)
        b.tp, b.stream = SimpleNamespace(comm=comm, rank=comm.rank), comm.rank
        b.graphs, b._mixed_lru, b._mixed_seen, b._mixed_compiled = {}, {}, {g}, False
        b._mixed_capture_failed = set()
        b.mixed_stats = {"captures": 0, "replays": 0, "evictions": 0, "eager_steps": 0}
        b._run = lambda geometry: logs[comm.rank].append("eager")
        b._first_mixed_step(g)
        first = (sorted(b.graphs), sorted(b._mixed_capture_failed), list(logs[comm.rank]))
        b._first_mixed_step(g)                     # the bucket's next step: warm-up run, then capture
        return first, sorted(b.graphs) == [g], list(logs[comm.rank])
    out = run_ranks(2, fn)
    assert out[0][0][:2] == out[1][0][:2] == ([], [g])            # no graph kept, the bucket failed on both
    assert out[0][0][2] == ["capture0", "close", "eager"] and out[1][0][2] == ["capture0", "eager"]
    assert out[0][1] and out[1][1]
    assert out[0][2][-1] == out[1][2][-1] == "capture1"
