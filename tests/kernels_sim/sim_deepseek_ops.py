"""MlaCudaOps (MLA + MoE as kernel launches) under the simulator against the NumPy backend
of the MLA family with the same bf16 weights: a ragged step (a prefill chunk after an earlier
chunk, a decode row), and the expert-parallel exchange with one rank (host communicator) against
the local experts inside the same step.
The real backend needs the driver; here a stand-in holds the same buffers (activation_plan)."""
from types import SimpleNamespace

import numpy as np
import pytest
from numba import cuda

from kernels_numba import gemm, mla
from kernels_numba.bf16 import bf16_round
from metrale.models import deepseek as DS
from metrale.models.deepseek import deepseek_forward
from metrale.models.checkpoint import deepseek_model_config
from metrale.models.families import compose_ops
from metrale.runtime.batch import Segment, build_batch
from metrale.runtime.cuda.pages import DeviceLatentPages
from metrale.runtime.cuda_backend import CudaBackend, CudaOps, Geometry
from metrale.runtime.cuda_deepseek import MlaCuda, MlaCudaOps, activation_plan, moe_workspace, prepare_weights
from metrale.runtime.numpy_backend import NumpyBackend

BS, NB, MAX_LEN = 4, 16, 32


@pytest.fixture(autouse=True)
def _sim_pointers(monkeypatch):
    """CudaOps compares device pointers; simulator arrays wrap host arrays."""
    from metrale.runtime import cuda_backend
    monkeypatch.setattr(cuda_backend, "_ptr", lambda a: a._ary.__array_interface__["data"][0])


class SimMeta:
    def __init__(self, batch, max_blocks: int):
        self.a = {name: cuda.to_device(np.ascontiguousarray(getattr(batch, name), np.int32))
                  for name in ("token_ids", "positions", "slot_mapping", "token_seq", "seq_query_start", "logits_indices")}
        self.a["token_src"] = cuda.to_device(np.full(batch.num_tokens, -1, np.int32))
        tables = np.zeros((batch.num_seqs, max_blocks), np.int32)
        tables[:, :batch.block_tables.shape[1]] = batch.block_tables
        self.t = cuda.to_device(tables)

    def view(self, name, n):
        return self.a[name][:n]

    def tables(self, seqs):
        return self.t[:seqs]


class SimBackend:
    """The attributes MlaCudaOps reads, on simulator arrays."""
    view = CudaBackend.view
    _cached = CudaBackend._cached
    overlap = False                  # the plain embedding (no tokens fed from a previous step)

    def __init__(self, config, host_weights: dict, ep=None):
        self.config, self.ep, self.block_size = config, ep, BS
        self._views = {}
        self.part = MlaCuda(self)            # routing, softmax scale, this rank's experts
        plan = activation_plan(config, 8, 8, MAX_LEN, self.part.num_local_experts, 0 if ep is None else ep.comm.world_size)
        self.act = {k: cuda.to_device(np.zeros(shape, dt)) for k, (shape, dt) in plan.items()}
        cos, sin = CudaBackend._rope_host_tables(SimpleNamespace(config=config, max_model_len=MAX_LEN))
        self.cos, self.sin = cuda.to_device(cos.astype(np.float32)), cuda.to_device(sin.astype(np.float32))
        self.attn_scratch = self.act["attn_scratch"]
        self.part.moe_ws = moe_workspace(self.act)
        self.kv = DeviceLatentPages(cuda.to_device(np.zeros((config.num_layers, NB, BS, config.latent_dim), np.uint16)))
        self.weights = {n: cuda.to_device(w) for n, w in prepare_weights(host_weights.items(), config)}
        self.stream = SimpleNamespace(numba=0, synchronize=lambda: None)
        self.skinny_max_t = gemm.FMA_MAX_T

    def blas_takes(self, rows, weight):
        return False

    def _fetch(self, array, host):
        host[...] = array.copy_to_host()
        return host

    def forward(self, batch):
        g = Geometry(batch.num_tokens, batch.num_seqs, len(batch.logits_indices), int(batch.context_lens.max()),
                     batch.max_query_len)
        self.meta = SimMeta(batch, MAX_LEN // BS)
        return deepseek_forward(compose_ops(CudaOps, (MlaCudaOps,))(self, g), self.weights, self.config).copy_to_host()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from metrale.models.checkpoint import load_deepseek_dir
    hf = DS.tiny_cuda_deepseek_hf_config(num_hidden_layers=1, first_k_dense_replace=0)   # one MLA + MoE layer
    path = DS.write_random_checkpoint(tmp_path_factory.mktemp("ds"), hf, seed=3)
    config, _, stream = load_deepseek_dir(path)
    weights = {n: (bf16_round(a) if a.ndim >= 2 else a) for n, a in stream()}   # what the device holds
    # noaux_tc's correction bias + 0.5 on experts 2, 3 and 6 (groups 1 and 3): every token of the
    # steps below picks two of those three (the weights are still the unbiased scores), so 3 of the
    # grouped GEMMs' 9 tiles run instead of 4 to 6 (each active tile costs seconds of simulation)
    hot = np.isin(np.arange(config.n_routed_experts), (2, 3, 6))
    weights["layers.0.router_bias"] = (weights["layers.0.router_bias"] + np.float32(0.5) * hot).astype(np.float32)
    return config, weights


def _steps(backend):
    """Chunk 1 of prompt A; then chunk 2 of A (reads chunk 1's latents) + a 3-token prompt B."""
    a = np.array([5, 9, 17, 3, 40, 77, 2], np.int32)
    b = np.array([11, 12, 13], np.int32)
    ta, tb = np.arange(0, 2, dtype=np.int32), np.arange(2, 3, dtype=np.int32)
    first = backend.forward(build_batch([Segment(a[:4], 0, ta, "all")], BS))
    second = backend.forward(build_batch([Segment(a[4:], 4, ta, "all"), Segment(b, 0, tb, "all")], BS))
    return np.concatenate([first, second])


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_deepseek_ops_match_numpy(model):
    config, weights = model
    want = _steps(NumpyBackend(config, weights, num_blocks=NB, block_size=BS))
    got = _steps(SimBackend(config, weights))
    assert np.isfinite(got).all()
    assert _rel(got, want) < 2e-2, _rel(got, want)


def test_expert_parallel_exchange_one_rank(model, monkeypatch):
    """The EP path (gather, all_to_all_v, local experts, un-permute) with a one-rank host
    communicator: inside the step, its residual update equals the local path's (moe.moe_experts on
    the same h, routing, weights and residual: the only op the two paths run differently; a local
    forward of its own cost a minute of simulation), and the step's logits match the NumPy backend's."""
    from kernels_numba import moe
    from metrale.parallel import ExpertParallel, run_ranks
    from metrale.runtime import cuda_moe
    config, weights = model
    batch = build_batch([Segment(np.array([5, 9, 17], np.int32), 0, np.arange(1, dtype=np.int32), "all")], BS)
    ep_experts, updates = cuda_moe.ep_experts, []

    def both_paths(b, h, ids, topk_w, gu, down, residual):
        local = cuda.to_device(residual.copy_to_host())
        moe.moe_experts(h, ids, topk_w, gu, down, local, b.part.moe_ws, accumulate=True, stream=b.stream.numba)
        before = residual.copy_to_host()
        ep_experts(b, h, ids, topk_w, gu, down, residual)
        updates.append((before, residual.copy_to_host(), local.copy_to_host()))

    monkeypatch.setattr(cuda_moe, "ep_experts", both_paths)
    got = run_ranks(1, lambda comm: SimBackend(config, weights, ep=ExpertParallel(comm, config.n_routed_experts)).forward(batch),
                    timeout=600)[0]
    assert len(updates) == 1                                 # the one MoE layer
    before, ep_out, local_out = updates[0]
    assert np.abs(local_out - before).max() > 1e-2           # the experts added something
    np.testing.assert_allclose(ep_out, local_out, rtol=1e-5, atol=1e-5)
    want = NumpyBackend(config, weights, num_blocks=NB, block_size=BS).forward(batch)
    assert np.isfinite(got).all()
    assert _rel(got, want) < 2e-2, _rel(got, want)


def test_head_linear_and_copy_heads():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((9, 3, 40)).astype(np.float32)     # 9 rows: two token blocks
    w = rng.standard_normal((3, 5, 24)).astype(np.float32)
    from kernels_numba.bf16 import to_bf16_bits
    wb = to_bf16_bits(w)
    dx = cuda.to_device(x)
    out = cuda.to_device(np.zeros((9, 3, 30), np.float32))
    mla.head_linear(dx[:, :, :24], cuda.to_device(wb), out[:, :, :5])
    mla.copy_heads(dx[:, :, 24:], out[:, :, 5:21])
    host = out.copy_to_host()
    np.testing.assert_allclose(host[:, :, :5], mla.head_linear_ref(x[:, :, :24], wb), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(host[:, :, 5:21], x[:, :, 24:])
    assert (host[:, :, 21:] == 0).all()
