"""A drafter the gate will never verify pays nothing (docs/spec.md, "The gate and its levers").

The H200 run of session 4 (docs/bench/raw/s4_spec/spec_64.txt) had `draft` at 0.92-0.93x of plain
decode at batch 32 with 0 verifies and 0 drafts dropped: the gate refused every draft, one sequence
at a time, every step (~4 us a sequence on this CPU, 137 us a step at batch 32). It now refuses the
whole batch once per step (AdaptiveGate.begin_step), and drafts_for asks verify_length's own rule
before letting a drafter work. Probes of pessimistic model drafters in 64-token requests at
batch 32 happen only within the probe budget; on CUDA the host-side drafters (self, mtp) cost
more than a decode step per draft token (measured), so they do not draft there at all.
"""
import dataclasses
from types import SimpleNamespace

import pytest

from fake_model import fake_engine
from metrale import SamplingParams
from metrale.runtime.backend import Backend
from metrale.spec.gate import AdaptiveGate
from metrale.spec.model_drafter import ModelDrafter
from metrale.spec.speculator import (CUDA_VERIFY_COST, GATE_CAUTION, PRIOR_ACCEPTANCE, Speculator,
                                     forward_share, gate_costs)
from metrale.spec.drafter import Draft
from test_spec_gate_costs import forward_share_smollm2


class CountingBackend(Backend):
    """A draft model's backend that counts its forwards (the fake model's own forward)."""

    def __init__(self, inner, name="fake"):
        self.inner, self.name, self.forwards = inner, name, 0
        self.block_size, self.config = inner.block_size, inner.config

    def forward(self, batch, num_layers=None, return_hidden=False):
        self.forwards += 1
        return self.inner.forward(batch)


def levers(eng):
    from metrale.options import GateOptions
    return GateOptions.of(eng.cfg)


def auto_gate(eng, drafter, method, device, **kw):
    """The gate make_speculator builds for `method` on a `device` backend (no clock: measure=False)."""
    lv = levers(eng)
    return AdaptiveGate(4, **gate_costs(lv, SimpleNamespace(name=device), drafter, method),
                        probe_budget=lv.probe_budget, min_gain=lv.min_gain, caution=GATE_CAUTION,
                        probe_interval=lv.probe_interval, max_batch=lv.max_batch,
                        ema_decay=lv.ema_decay, measure=False, **kw)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("batch", [1, 32])
def test_a_refused_draft_model_does_no_forward_at_all(device, batch):
    """A draft model as dear as the target (SmolLM2 drafting for itself): no draft count can gain at
    any batch size, so over whole 64-token requests the draft model runs no forward (no prompt
    catch-up, no drafting) and the gate does no per-sequence work."""
    eng = fake_engine(num_blocks=1024, block_size=4, **{"spec.method": "ngram", "spec.num_drafts": 4})
    draft_backend = CountingBackend(eng.backend, name=device)
    drafter = ModelDrafter(draft_backend, name="draft")
    drafter.cost_per_token = 1.0
    gate = auto_gate(eng, drafter, "draft", device)
    asked = []
    drafts_for = gate.drafts_for
    gate.drafts_for = lambda *a, **k: asked.append(a) or drafts_for(*a, **k)
    eng.speculator.drafter, eng.speculator.gate = drafter, gate
    prompts = [[(7 * i + j) % 90 + 1 for j in range(12 + i % 5)] for i in range(batch)]
    outs = eng.generate(prompts, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert all(len(o.token_ids) == 64 for o in outs)
    assert draft_backend.forwards == 0 and not drafter.computed      # not even a catch-up
    assert not asked                                                  # refused per step, not per sequence
    st = eng.speculator.stats()
    assert st["verifies"] == st["dropped"] == st["proposed"] == 0


def test_drafts_for_uses_the_rule_verify_length_applies():
    """Whatever drafts_for allows, verify_length verifies in full at full confidence; what it would
    drop is never drafted (before: CPU batch 1, an MTP-like probe drafted 1 token, then the 1-token
    draft was dropped as unable to pay the first verify row: the drafting was paid for nothing)."""
    row = dict(step_fixed=2.45, row_cost=0.1, measure=False)
    g = AdaptiveGate(4, draft_cost=0.24, prior_acceptance=0.3, caution=GATE_CAUTION, min_gain=1.1, **row)
    g.begin_step(1)
    st = g._stats("a")
    k_old = g.best_drafts(st.alpha_low(GATE_CAUTION))[0]
    assert k_old == 1 and not g.worth_verifying(1, 1)       # the old probe: drafted, then dropped
    assert g.drafts_for("a") in (0, 4)
    # a grid of gates, batches and acceptance states: drafted => verified in full at full confidence
    for costs in (row, dict(verify_cost=CUDA_VERIFY_COST, measure=False)):
        for d in (0.0, 0.24, 0.47):
            for prior in (0.3, 0.5, 0.8):
                g = AdaptiveGate(4, draft_cost=d, prior_acceptance=prior, caution=GATE_CAUTION, min_gain=1.1,
                                 **costs)
                for b in (1, 2, 8, 32):
                    g.begin_step(b)
                    for hits, trials in ((0.0, 2.0), (0.6, 2.0), (1.12, 2.4), (1.6, 2.0), (5.0, 5.5)):
                        rid = f"{d}-{prior}-{b}-{hits}-{trials}"
                        st = g._stats(rid)
                        st.hits, st.trials = hits, trials
                        k = g.drafts_for(rid)
                        if k:
                            assert g.verify_length(rid, [1.0] * k) == k, (costs, d, prior, b, hits, trials, k)


def test_batch_32_short_requests_never_probe_what_the_budget_cannot_afford():
    """B=32, 64-token requests, the CUDA verify cost: a pessimistic model drafter whose probe loses
    more than the budget (1% of 64 tokens = 0.64 steps) never drafts over the whole request; one
    whose probe loses 0.4 probes once per sequence (the second would overrun the budget)."""
    seen = {}
    for d, expect in ((0.7, 0), (0.3, 1)):
        g = AdaptiveGate(4, verify_cost=CUDA_VERIFY_COST, draft_cost=d, prior_acceptance=0.3, probe_budget=0.01,
                         min_gain=1.1, caution=GATE_CAUTION, measure=False)
        assert g.can_pay(32)                  # it could gain at full acceptance: only the budget stops it
        drafts = {f"r{i}": 0 for i in range(32)}
        for step in range(64):
            assert g.begin_step(32)
            for rid in drafts:
                k = g.drafts_for(rid, left=64 - step)
                if k:
                    assert g.block_cost(k) - 1.0 <= 0.01 * 64 + 1e-9
                    drafts[rid] += 1
                    g.update(rid, k, 0)       # the probe accepts nothing
        seen[d] = set(drafts.values())
        assert seen[d] == {expect}, (d, seen[d])


@pytest.mark.parametrize("method,layers", [("self", 10), ("mtp", 1)])
def test_host_side_model_drafters_do_not_draft_on_cuda(method, layers):
    """On CUDA self / mtp draft on the host (logits or the MTP block in NumPy): measured on the H200
    at 2-21 plain steps per draft token, so no batch size pays and no sequence probes; on the CPU
    (their weight share) they still may, and MTP's hidden-row tap follows that decision."""
    eng = fake_engine(num_blocks=64, block_size=4, **{"spec.method": "ngram", "spec.num_drafts": 4})
    drafter = SimpleNamespace(name=method, cost_per_token=forward_share_smollm2(layers), needs_hidden=method == "mtp",
                              propose=lambda seqs, ks: pytest.fail("drafted"), release=lambda s: None)
    cuda = auto_gate(eng, drafter, method, "cuda")
    assert not any(cuda.can_pay(b) for b in (1, 2, 8, 32, 64))
    for b in (1, 32):
        assert not cuda.begin_step(b)
    assert cuda.begin_step(0)                 # no decoding sequence: nothing to refuse
    cpu = auto_gate(eng, drafter, method, "cpu")
    assert cpu.can_pay(8)
    sp_cuda = Speculator(drafter, num_drafts=4, gate=cuda)
    sp_cpu = Speculator(drafter, num_drafts=4, gate=cpu)
    assert not sp_cuda.needs_hidden and sp_cpu.needs_hidden == (method == "mtp")
    # a pinned spec.gate.draft_cost is the setting that turns them back on
    forced = gate_costs(dataclasses.replace(levers(eng), draft_cost=0.3), SimpleNamespace(name="cuda"), drafter, method)
    assert forced["draft_cost"] == pytest.approx(0.3)
