"""Shadow drafts: a free drafter (n-gram) that the gate would not verify for is compared with what
the sequence emits instead of being probed (metrale/spec/gate.py, module doc)."""
import numpy as np
import pytest

from fake_model import fake_engine, reference_continuation
from metrale import SamplingParams
from metrale.spec.gate import AdaptiveGate
from test_spec_engine import NoisyOracle

# the CPU row model of speculator.gate_costs (a verify at batch 1 costs ~2.5 plain steps)
CPU = dict(step_fixed=2.45, row_cost=0.1, verify_cost=0.1, prior_acceptance=0.8, caution=1.0, min_gain=1.1,
           measure=False)


def _gate(**kw) -> AdaptiveGate:
    g = AdaptiveGate(4, **{**CPU, **kw})
    g.begin_step(1)
    return g


def test_a_free_drafter_shadows_where_it_would_probe():
    probing = _gate(probe_budget=None)
    assert probing.drafts_for("a", left=100) > 0 and probing.stats["a"].probing
    shadowing = _gate(probe_budget=None, shadow=True)
    assert shadowing.shadow and shadowing.drafts_for("a", left=100) == 0


def test_shadow_evidence_turns_verifies_on_and_off():
    g = _gate(shadow=True)
    assert g.drafts_for("a") == 0
    g.observe_shadow("a", 4, 4)                     # the sequence emitted the whole draft
    k = g.drafts_for("a")
    assert k > 0 and not g.stats["a"].probing       # a verify expected to gain, not a probe
    for _ in range(3):
        g.observe_shadow("a", 4, 0)                 # then it stopped following the draft
    assert g.drafts_for("a") == 0
    st = g.stats["a"]
    assert st.shadows == 4 and st.shadow_accepted == 4 and st.verifies == 0 and st.probe_loss == 0


def test_shadow_evidence_resumes_a_suspended_sequence():
    g = _gate(shadow=True)
    g.observe_shadow("a", 4, 4)
    g.update("a", 4, 0)                             # a verify that lost: suspended (dear drafters wait)
    st = g.stats["a"]
    assert st.suspended_until > g.step
    for _ in range(3):
        g.observe_shadow("a", 4, 4)
    assert g.step < st.suspended_until and g.drafts_for("a") > 0


def test_missed_shadows_back_off_and_a_hit_resets():
    g = _gate(shadow=True)
    waits = []
    for _ in range(6):
        assert g.wants_shadow("a")
        g.observe_shadow("a", 4, 0)
        w = 0
        while not g.wants_shadow("a"):
            g.begin_step(1)
            w += 1
        waits.append(w)
    assert waits == [1, 2, 4, 8, 16, 16]
    g.observe_shadow("a", 4, 2)                     # a (partial) hit: the next shadow may start at once
    assert g.wants_shadow("a")
    g.observe_shadow("a", 4, 0)
    g.begin_step(1)
    assert g.wants_shadow("a")                      # back to a one-step wait


def test_dear_drafters_do_not_shadow():
    assert not AdaptiveGate(4, draft_cost=0.3, shadow=True).shadow
    assert not AdaptiveGate(4, draft_fixed=0.6, shadow=True).shadow


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("shadow", [True, False])
def test_a_drafter_that_is_always_wrong_is_never_verified_with_shadows(rng, shadow):
    # unbudgeted probes: without shadows the gate probes a wrong drafter; with them it never verifies
    eng = fake_engine(num_blocks=64, block_size=4, **{"spec.method": "ngram", "spec.num_drafts": 3,
                                                      "levers.spec_probe_budget": -1,
                                                      "levers.spec_shadow": str(shadow).lower()})
    eng.speculator.drafter = NoisyOracle(1.0)
    prompt = [int(t) for t in rng.integers(1, 96, 9)]
    out = eng.generate([np.array(prompt)], greedy(40), use_tqdm=False)[0]
    assert list(out.token_ids) == reference_continuation(prompt, 40)
    stats = eng.speculator.stats()
    if shadow:
        # misses space the shadows out (1, 2, 4, 8, 16 steps): ~6 lookups in 40 tokens, not 40
        assert stats["verifies"] == 0 and 4 <= stats["shadows"] <= 8 and stats["shadow_tokens_per_draft"] == 0
    else:
        assert stats["verifies"] > 0 and stats["shadows"] == 0
    eng.blocks.check_no_leaks([])


def test_a_drafter_that_is_right_is_verified_after_its_shadows(rng):
    eng = fake_engine(num_blocks=64, block_size=4, **{"spec.method": "ngram", "spec.num_drafts": 3})
    eng.speculator.drafter = NoisyOracle(0.0)
    prompt = [int(t) for t in rng.integers(1, 96, 9)]
    out = eng.generate([np.array(prompt)], greedy(40), use_tqdm=False)[0]
    assert list(out.token_ids) == reference_continuation(prompt, 40)
    stats = eng.speculator.stats()
    assert 1 <= stats["shadows"] <= 3 and stats["shadow_tokens_per_draft"] == 3
    assert stats["verifies"] > 0 and stats["acceptance_rate"] == 1.0
    eng.blocks.check_no_leaks([])
