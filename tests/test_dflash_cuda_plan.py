"""The DFlash drafter on the device, host side (metrale/spec/dflash_plan.py, dflash_cuda.py) on the
CPU: the block plan's scratch tables, slots and block copies by hand; the device passes' semantics
run by NumPy (`PlanModel`: the context K/V written eagerly at the forward's slots, each proposal's
blocks stored in scratch blocks and read through the plan's tables) inside the engine, where every
draft must equal the NumPy DFlashDrafter's fed the same layer rows; the tap and the gate's costs.
The kernels: tests/kernels_sim/test_dflash_cuda_sim.py (simulator), tests/gpu/test_dflash_cuda_gpu.py."""
from types import SimpleNamespace

import numpy as np

from fake_model import fake_engine, reference_continuation
from metrale import SamplingParams
from metrale.models.config import ModelConfig
from metrale.models.llama import llama_forward
from metrale.runtime.batch import Segment, build_batch
from metrale.spec.dflash import DFlashDrafter, DFlashModel, DFlashOps, random_tensors
from metrale.spec.dflash_cuda import DeviceLayerTap, DFlashCudaDrafter
from metrale.spec.dflash_plan import plan_blocks, scratch_blocks
from metrale.spec.drafter import Draft
from metrale.runtime.numpy_backend import NumpyOps

BS = 4
TINY = ModelConfig(architecture="llama", vocab_size=97, hidden_size=8, intermediate_size=12, num_layers=4,
                   num_heads=4, num_kv_heads=2, head_dim=4, rms_norm_eps=1e-6, rope_theta=100.0,
                   rope_interleaved=True, max_position=4096, name="tiny")


def seq(tokens, computed, table):
    toks = list(tokens)
    return SimpleNamespace(num_tokens=len(toks), num_computed_tokens=computed, block_table=list(table),
                           token_slice=lambda a, b: toks[a:b])


def test_block_plan_tables_slots_and_copies():
    L, E = 4, scratch_blocks(4, BS)
    assert E == 2 and scratch_blocks(5, BS) == 2 and scratch_blocks(6, BS) == 3
    a = seq(range(10, 20), 9, [7, 3, 5])          # start 9: block 2 at offset 1 (context 8 in it)
    b = seq(range(30, 38), 7, [2, 6])             # start 7: block 1 at offset 3
    c = seq(range(50, 59), 8, [4, 1])             # start 8: a block start, its table ends there
    d = seq(range(5), 3, [9, 9])                  # not decoding (two tokens to compute): no draft
    p = plan_blocks([a, b, c, d], [3, 1, 2, 3], length=L, block_size=BS, scratch_base=100, per_pass=2,
                    max_model_len=64)
    assert p.live == [0, 1, 2] and p.ks == [3, 1, 2] and p.batch == 3
    np.testing.assert_array_equal(p.token_ids.reshape(3, L)[:, 0], [19, 37, 58])
    assert not p.token_ids.reshape(3, L)[:, 1:].any()
    np.testing.assert_array_equal(p.positions.reshape(3, L), [[9, 10, 11, 12], [7, 8, 9, 10], [8, 9, 10, 11]])
    np.testing.assert_array_equal(p.attn_pos.reshape(3, L), [[12] * 4, [10] * 4, [11] * 4])
    assert [p.context(b) for b in range(3)] == [13, 11, 12]
    # tables: the blocks before start's block, then the row's scratch blocks (row 2 reuses row 0's: per_pass 2)
    np.testing.assert_array_equal(p.tables, [[7, 3, 100, 101], [2, 102, 103, 0], [4, 1, 100, 101]])
    np.testing.assert_array_equal(p.copy_src, [5, 6, -1])
    np.testing.assert_array_equal(p.copy_dst, [100, 102, -1])
    np.testing.assert_array_equal(p.slots.reshape(3, L), [[401, 402, 403, 404], [411, 412, 413, 414],
                                                          [400, 401, 402, 403]])
    # a block past max_model_len does not draft (its positions are outside the RoPE tables)
    assert plan_blocks([a], [3], length=L, block_size=BS, scratch_base=100, per_pass=2, max_model_len=12) is None
    assert plan_blocks([a, b], [0, 0], length=L, block_size=BS, scratch_base=100, per_pass=2, max_model_len=64) is None


# ---------------------------------------------------------------------------- the passes, run by NumPy
class _PlanOps(DFlashOps):
    """The device block pass's ops in NumPy: MASK rows as DFlashOps; K/V stored in the pool at the
    plan's (scratch) slots; every row attends to keys 0..attn_pos through its table, unmasked."""

    def __init__(self, model, batch, keys):
        super().__init__(model, batch)
        self.keys = keys

    def qkv_to_cache(self, qkv, layer, q_norm, k_norm):
        return NumpyOps.qkv_to_cache(self, qkv, layer, q_norm, k_norm)

    def attention(self, q, layer):
        bt, out = self.batch, np.empty_like(q)
        for s in range(bt.num_seqs):
            a, b = bt.seq_query_start[s], bt.seq_query_start[s + 1]
            k, v = self.cached_kv(layer, s, self.keys[s])
            out[a:b] = self.attend(q[a:b], k, v)
        return out.reshape(q.shape[0], self.cfg.q_size)


class PlanModel:
    """DFlashCudaModel's semantics on a NumPy DFlashModel whose pool has the scratch blocks."""

    def __init__(self, config, tensors, shared, *, length, per_pass, num_blocks, max_model_len=4096):
        self.length, self.per_pass, self.block_size, self.num_blocks = length, per_pass, BS, num_blocks
        self.target = SimpleNamespace(max_model_len=max_model_len)
        self.m = DFlashModel(config, {**tensors, **shared}, target_layers=(0, 2), num_layers=1, block_size=4,
                             num_blocks=num_blocks + per_pass * scratch_blocks(length, BS), pool_block_size=BS,
                             dtype=np.float64)
        self.parts = []

    def write_context(self, batch, rows):
        self.m.write_context(batch, rows)

    def draft(self, plan):
        L, out = self.length, []
        for a in range(0, plan.batch, self.per_pass):
            z = min(plan.batch, a + self.per_pass)
            k, v = self.m.kv.k, self.m.kv.v
            for src, dst in zip(plan.copy_src[a:z], plan.copy_dst[a:z]):
                if dst >= 0:
                    k[:, dst], v[:, dst] = k[:, src], v[:, src]
            segs = [Segment(plan.token_ids[b * L:(b + 1) * L], int(plan.positions[b * L]), plan.tables[b], "all")
                    for b in range(a, z)]
            batch = build_batch(segs, BS)
            np.testing.assert_array_equal(batch.slot_mapping, plan.slots[a * L:z * L])
            ops = _PlanOps(self.m, batch, [plan.context(b) for b in range(a, z)])
            x = np.asarray(llama_forward(ops, self.m.weights, self.m.config), np.float64).reshape(z - a, L, -1)[:, 1:]
            out.append(x)
            self.parts.append(z - a)
        logits = np.concatenate(out)
        ids = logits.argmax(-1)
        conf = 1.0 / np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)
        return ids, conf


def layer_rows(batch, layers=(0, 2)) -> list[np.ndarray]:
    """A deterministic residual row per (layer, position, token): what the fake target 'computes'."""
    i, p, t = np.arange(1, 9), batch.positions[:, None].astype(np.float64), batch.token_ids[:, None]
    return [np.sin(0.37 * (p + 1) * i * (j + 1) + 0.11 * t) * 2 for j in range(len(layers))]


class RowsTap:
    """The fake target, handing every forward's layer rows to both drafters' context sinks."""

    def __init__(self, backend, sinks):
        self.inner, self.sinks = backend, sinks

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward(self, batch, num_layers=None, return_hidden=False):
        out = self.inner.forward(batch, num_layers)
        for sink in self.sinks:
            sink(batch, layer_rows(batch))
        return out

    def forward_greedy(self, batch, num_layers=None):
        return np.argmax(self.forward(batch, num_layers), -1).astype(np.int32)

    def take_hidden(self):
        return None


class Twin:
    """The plan drafter and DFlashDrafter fed the same steps: their drafts must be equal."""
    name, needs_hidden, lookup_only = "dflash", True, False

    def __init__(self, device: DFlashCudaDrafter, host: DFlashDrafter):
        self.device, self.host = device, host
        self.compared = self.tokens = 0

    def observe(self, scheduled, emitted, hidden):
        pass

    def propose(self, seqs, ks):
        ks = [min(k, 1 + i % 4) for i, k in enumerate(ks)]       # mixed draft counts in one pass
        got, want = self.device.propose(seqs, ks), self.host.propose(seqs, ks)
        for g, h in zip(got, want):
            assert g.tokens == h.tokens, (g.tokens, h.tokens)
            np.testing.assert_allclose(g.confidences, h.confidences, rtol=1e-9)
            self.compared += bool(g.tokens)
            self.tokens += len(g.tokens)
        return got

    def release(self, seq):
        self.device.release(seq)
        self.host.release(seq)


def test_plans_draft_what_the_numpy_drafter_drafts_in_the_engine(rng):
    """Four sequences (prompts of 3, 11, 6 and 9 tokens: starts at every block offset), 4 drafts
    (blocks of 5 rows: two scratch blocks a row), per_pass 3 (the fourth sequence runs in a second
    part reusing the first row's scratch blocks), draft counts 1..4 side by side."""
    eng = fake_engine(num_blocks=128, block_size=BS, **{"spec.method": "ngram", "spec.num_drafts": 4,
                                                        "levers.spec_verify_cost": 0.0})
    f = random_tensors(TINY, target_layers=(0, 2), seed=3)
    r = np.random.default_rng(4)
    shared = {"embed": r.normal(size=(97, 8)), "final_norm": 1 + 0.1 * r.normal(size=8)}
    host = DFlashModel(TINY, {**f.tensors, **shared}, target_layers=(0, 2), num_layers=1, block_size=4,
                       num_blocks=128, pool_block_size=BS, dtype=np.float64)
    plan = PlanModel(TINY, f.tensors, shared, length=5, per_pass=3, num_blocks=128)
    twin = Twin(DFlashCudaDrafter(plan), DFlashDrafter(host, 4))
    eng.speculator.drafter = twin
    eng.backend = RowsTap(eng.backend, [host.store_rows, plan.write_context])
    prompts = [[int(t) for t in rng.integers(1, 96, int(n))] for n in (3, 11, 6, 9)]
    outs = eng.generate([np.array(p) for p in prompts], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert list(o.token_ids) == reference_continuation(p, 12)
    assert twin.compared > 15 and twin.tokens > twin.compared
    assert 3 in plan.parts and 1 in plan.parts            # a full part and the second part of a batch of 4
    eng.blocks.check_no_leaks([])


def test_device_tap_runs_the_context_pass_after_full_forwards():
    calls = []

    class Backend:
        def keep_layer_rows(self, rows):
            calls.append(("keep", rows))

        def forward_greedy(self, batch, num_layers=None):
            return np.zeros(1, np.int32)

        def forward_device(self, batch, num_layers=None):
            return "device logits"

    model = SimpleNamespace(taps="rows", write_context=lambda batch: calls.append(("context", batch.num_tokens)))
    tap = DeviceLayerTap(Backend(), model)
    assert calls == [("keep", "rows")]
    tap.forward_greedy(SimpleNamespace(num_tokens=3))
    tap.forward_greedy(SimpleNamespace(num_tokens=3), num_layers=2)     # a layer-prefix forward: no context
    assert tap.forward_device(SimpleNamespace(num_tokens=5)) == "device logits"
    assert calls[1:] == [("context", 3), ("context", 5)]
    assert tap.take_hidden() is None
    d = DFlashCudaDrafter(SimpleNamespace(length=5, block_size=BS, num_blocks=8, per_pass=2,
                                          target=SimpleNamespace(max_model_len=64)))
    assert d.tap(tap) is tap
    assert d.propose([seq(range(4), 0, [1])], [3]) == [Draft()]      # a prefill: nothing to draft


def test_the_gate_sees_a_device_drafter():
    from metrale.settings import compose
    from metrale.spec.speculator import CUDA_HOST_DRAFT_COST, gate_costs
    g = compose([]).spec.gate
    cuda = SimpleNamespace(name="cuda")
    d = DFlashCudaDrafter(SimpleNamespace(length=5), cost_per_draft=0.24)
    costs = gate_costs(g, cuda, d, "dflash")
    assert costs["draft_cost"] == 0.0 and costs["draft_fixed"] == 0.24
    assert d.on_device and "dflash" not in CUDA_HOST_DRAFT_COST
