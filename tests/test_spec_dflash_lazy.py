"""DFlash's lazy context (metrale/spec/dflash.py): while the gate keeps a sequence from drafting, a
target forward only stores its layer rows (no projection, no drafter forward); when drafting
resumes, one batched pass projects the positions computed meanwhile, after which the context K/V of
every position the drafter reads equals a from-scratch computation, and the drafts are the ones an
eager drafter (projecting at every forward) makes. Greedy output stays plain greedy's. SmolLM2,
NumPy float64, a random drafter."""
import numpy as np
import pytest

from metrale import Engine, SamplingParams
from metrale.runtime.batch import Segment, build_batch
from metrale.spec.dflash import DFlashDrafter
from metrale.spec.mtp import HiddenTap, forward_with_layer_rows
from spec_helpers import ScheduledGate

PROMPTS = ["1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3,", "The cat sat on the mat. The cat sat on the", "Once"]
DRAFT_STEPS = {2, 3, 12, 13, 14, 15}      # engine steps that may draft; 4-11 are suspended


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def exact_plain():
    eng = Engine(model="smollm2-135m", device="cpu", levers={"numpy_dtype": "float64"})
    return eng, eng.generate(PROMPTS, greedy(16), use_tqdm=False)


class Recorded(DFlashDrafter):
    """The real drafter; after each proposal (its catch-up done) checks the context K/V of every
    position the proposal read against a from-scratch computation, and records the drafts."""

    def __init__(self, model, num_drafts, target, gate):
        super().__init__(model, num_drafts)
        self.target, self.gate, self.drafts, self.checked = target, gate, [], 0

    def propose(self, seqs, ks):
        drafts = super().propose(seqs, ks)
        m, c = self.model, self.model.config
        for s, k, d in zip(seqs, ks, drafts):
            if not k:
                continue
            n = s.num_tokens - 1
            batch = build_batch([Segment(np.asarray(s.token_ids[:n], np.int32), 0, np.asarray(s.block_table, np.int32),
                                         "none")], m.block_size)
            _, rows = forward_with_layer_rows(self.target, batch, m.target_layers)
            assert m.projected[batch.slot_mapping].all()
            for i, (kk, vv) in enumerate(m.context_kv(rows, np.arange(n))):
                np.testing.assert_allclose(m.kv.k[i].reshape(-1, c.num_kv_heads, c.head_dim)[batch.slot_mapping], kk,
                                           rtol=1e-9, atol=1e-9)
                np.testing.assert_allclose(m.kv.v[i].reshape(-1, c.num_kv_heads, c.head_dim)[batch.slot_mapping], vv,
                                           rtol=1e-9, atol=1e-9)
            self.checked += 1
            self.drafts.append((self.gate.step, tuple(s.prompt_token_ids), len(s.output_token_ids), tuple(d.tokens)))
        return drafts


def drafting_engine(plain_engine, eager: bool):
    from metrale.runtime.numpy_backend import NumpyBackend
    from metrale.settings import compose, to_overrides
    be = plain_engine.backend
    cfg = compose(to_overrides({"device": "cpu", "levers": {"numpy_dtype": "float64"},
                                "spec": {"method": "dflash", "num_drafts": 3, "dflash_head": "random"}}))
    backend = NumpyBackend(be.config, be.weights.items(), num_blocks=128, block_size=be.block_size, dtype="float64")
    eng = Engine(cfg=cfg, parts=(be.config, plain_engine.tokenizer, backend))
    assert isinstance(eng.backend, HiddenTap) and eng.backend.on_layers == eng.speculator.drafter.model.store_rows
    gate = eng.speculator.gate = ScheduledGate(3, DRAFT_STEPS)
    drafter = Recorded(eng.speculator.drafter.model, 3, eng.backend.inner, gate)
    eng.speculator.drafter = drafter
    if eager:
        eng.backend.on_layers = drafter.model.write_context
    return eng, drafter


def count_calls(obj, name: str, gate, log: list):
    fn = getattr(obj, name)

    def wrapped(*a, **kw):
        log.append(gate.step)
        return fn(*a, **kw)
    setattr(obj, name, wrapped)


def test_suspended_dflash_does_no_drafter_work_and_drafts_as_eager_after_resuming(exact_plain):
    plain_engine, plain = exact_plain
    lazy, drafter = drafting_engine(plain_engine, eager=False)
    m, gate = drafter.model, lazy.speculator.gate
    projections, block_forwards, stored = [], [], []
    count_calls(m, "_write", gate, projections)
    count_calls(m, "forward", gate, block_forwards)
    count_calls(m, "store_rows", gate, stored)
    lazy.backend.on_layers = m.store_rows         # the tap holds the bound method: rebind the counted one
    outs = lazy.generate(PROMPTS, greedy(16), use_tqdm=False)
    for a, b in zip(plain, outs):
        np.testing.assert_array_equal(a.token_ids, b.token_ids)

    suspended = set(range(4, 12))
    assert not suspended & set(projections) and not suspended & set(block_forwards)   # no drafter work
    assert suspended <= set(stored)                                # only the rows' copy
    assert set(block_forwards) == DRAFT_STEPS & set(block_forwards) and {12, 13} <= set(block_forwards)
    assert projections.count(12) == 1           # the positions computed while suspended: one batched pass
    assert projections.count(13) == 1 and projections.count(2) == 1
    assert drafter.checked >= 3 * 4 and lazy.speculator.stats()["verifies"] > 0

    # the same schedule with the eager context (projected at every forward): the very same drafts
    eager, eager_drafter = drafting_engine(plain_engine, eager=True)
    eager_outs = eager.generate(PROMPTS, greedy(16), use_tqdm=False)
    for a, b in zip(plain, eager_outs):
        np.testing.assert_array_equal(a.token_ids, b.token_ids)
    assert drafter.drafts == eager_drafter.drafts
    lazy.blocks.check_no_leaks([])


def test_prefix_cached_blocks_keep_their_rows(exact_plain):
    """A second run of the same prompts starts from prefix-cached blocks: their rows (and the
    projections made for the first run) serve the new sequences; the context still checks out."""
    plain_engine, plain = exact_plain
    eng, drafter = drafting_engine(plain_engine, eager=False)
    eng.generate(PROMPTS, greedy(16), use_tqdm=False)
    first = drafter.checked
    drafter.gate.step = 0
    outs = eng.generate(PROMPTS, greedy(16), use_tqdm=False)
    for a, b in zip(plain, outs):
        np.testing.assert_array_equal(a.token_ids, b.token_ids)
    assert drafter.checked > first
    eng.blocks.check_no_leaks([])


def test_layer_rows_are_the_residual_after_each_tapped_layer(exact_plain):
    """The tap's capture (a NumpyOps subclass hooking the op that ends a layer) against the target
    itself run for layer+1 layers: whatever op llama_forward ends a layer with, the rows must be
    that layer's output residual for every token."""
    from metrale.runtime.numpy_backend import NumpyBackend
    plain_engine, _ = exact_plain
    shared = plain_engine.backend                 # its own KV pool: the plain engine's prefix cache stays true
    be = NumpyBackend(shared.config, shared.weights.items(), num_blocks=8, block_size=shared.block_size, dtype="float64")
    ids = plain_engine.encode_prompt(PROMPTS[1], chat=False)
    batch = build_batch([Segment(np.asarray(ids, np.int32), 0, np.arange(4, dtype=np.int32), "all")], be.block_size)
    layers = (1, 14, 27)
    (logits, _), rows = forward_with_layer_rows(be, batch, layers)
    np.testing.assert_allclose(logits, be.forward(batch), rtol=1e-12, atol=1e-12)
    for layer, r in zip(layers, rows):
        _, hidden = be.forward(batch, num_layers=layer + 1, return_hidden=True)
        np.testing.assert_allclose(r, hidden, rtol=1e-12, atol=1e-12)
