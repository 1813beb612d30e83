"""The gate's cost model (metrale/spec/gate.py): the CPU row model, drafter costs, priors, the probe
budget, the never-pays check and the caution (decisions on a lower bound of the acceptance).
Deterministic: no clock is read (measure=False)."""
import logging

import pytest

from metrale.spec.gate import AdaptiveGate
from metrale.spec.speculator import CPU_ROW_COST, CPU_STEP_FIXED, GATE_CAUTION, forward_share

ROW = dict(step_fixed=CPU_STEP_FIXED, row_cost=CPU_ROW_COST, measure=False)


def gate(**kw):
    return AdaptiveGate(4, **{**ROW, **kw})


def test_row_model_costs():
    g = gate()
    f, v = g.costs(1)      # 1 row -> 2 rows: a GEMM instead of a GEMV (measured ~2.6x a one-row step)
    assert f == pytest.approx(CPU_STEP_FIXED + CPU_ROW_COST - 1) and v == pytest.approx(CPU_ROW_COST)
    assert g.block_cost(1, 1) == pytest.approx(CPU_STEP_FIXED + 2 * CPU_ROW_COST)
    f8, v8 = g.costs(8)    # batch 8: a verify row adds row_cost to a step of step_fixed + 8 rows
    assert f8 == 0 and v8 == pytest.approx(0.8 / 3.25)
    # the per-token cost grows with the batch (the fixed part is shared by more rows)
    assert g.costs(2)[1] < g.costs(8)[1] < g.costs(32)[1] < 1


def test_cpu_batch_one_drafts_many_or_none():
    """At batch 1 the first verify row costs ~1.6 steps: n-gram at acceptance 0.8 drafts all 4 tokens
    to amortize it; a 1-token draft can never gain there, but it can at batch 8."""
    g = gate(prior_acceptance=0.8)
    g.begin_step(1)
    assert g.drafts_for("a", left=100) == 4
    assert not g.worth_verifying(1, 1) and not g.worth_verifying(0, 8)
    assert g.worth_verifying(2, 1) and g.worth_verifying(1, 8)


def test_the_prior_alone_is_a_probe_at_cpu_batch_one():
    """Session 3's one losing verify (repetitive task, B=1): n-gram's prior 0.8 gave a 4-token draft
    an expected gain of 1.14 >= min_gain 1.1 (knife-edge: 0.78 gives 1.096), so a draft resting on no
    evidence of its own was not budgeted, and when the copy diverged at the task's edit (1 of 4
    accepted) it lost ~1 step of a 32-token request. The gate now acts on alpha one standard
    deviation below the mean: the prior alone (2 pseudo-tokens) acts as 0.57, so at batch 1 that
    draft is a probe (worst loss 1.95 steps, over a 32-token request's budget of 0.32) while at
    batch 8 (a verify row costs 0.25 of a step) it still drafts; a sequence's own hits narrow the
    bound and batch 1 drafts all 4."""
    g = gate(prior_acceptance=0.8, min_gain=1.1, caution=GATE_CAUTION, probe_budget=0.01)
    g.begin_step(1)
    st = g._stats("a")
    assert st.alpha_low(GATE_CAUTION) == pytest.approx(0.8 - (0.16 / 3) ** 0.5)
    assert g.best_drafts(0.8)[1] == pytest.approx(1.14, abs=0.005) and g.best_drafts(0.78)[1] < 1.1
    assert g.drafts_for("a", left=32) == 0                     # a probe over its budget
    assert g.drafts_for("long", left=1000) == 4 and g.stats["long"].probing     # a long request may probe
    g.begin_step(8)
    assert g.drafts_for("b", left=32) == 2 and not g.stats["b"].probing
    g.begin_step(1)
    g.update("long", 4, 4)                                     # its own evidence: the copy holds
    assert g.stats["long"].alpha_low(GATE_CAUTION) > 0.8
    assert g.drafts_for("long", left=900) == 4 and not g.stats["long"].probing


def test_caution_narrows_with_evidence_and_suspends_on_the_mean():
    g = gate(prior_acceptance=0.8, min_gain=1.1, caution=GATE_CAUTION, probe_budget=None, probe_interval=4)
    g.begin_step(8)
    st = g._stats("a")
    gaps = []
    for _ in range(4):
        gaps.append(st.alpha - st.alpha_low(GATE_CAUTION))
        g.update("a", 3, 3)
    assert all(a > b for a, b in zip(gaps, gaps[1:])) and gaps[-1] < 0.1
    # mean gains, its lower bound does not: a probe, not a suspension
    st.hits, st.trials = 1.5, 3.0
    assert g.best_drafts(st.alpha)[1] >= 1.1 > g.best_drafts(st.alpha_low(GATE_CAUTION))[1]
    assert g.drafts_for("a") >= 1 and st.probing
    g.update("a", 1, 0)
    assert g.best_drafts(st.alpha)[1] < 1.1 and g.drafts_for("a") == 0        # the mean loses: suspended


def test_drafter_as_dear_as_the_target_never_speculates(caplog):
    g = gate(draft_cost=1.0, prior_acceptance=1.0)
    with caplog.at_level(logging.INFO, logger="metrale.spec"):
        for b in (1, 8, 1, 8):
            g.begin_step(b)
            assert not g.can_pay() and g.drafts_for("a", left=1000) == 0
    assert sum("speculation off at batch" in r.message for r in caplog.records) == 2   # once per batch size
    # with a cheap drafter the same gate may pay
    assert gate(draft_cost=0.1).can_pay(8)


def test_pessimistic_prior_probes_only_within_the_budget():
    """A self-drafter-like cost at batch 8 (c ~ 0.72 per token) with a pessimistic prior: a probe
    loses ~0.7 steps, so a 32-token request (budget 0.02 x 32 = 0.64 steps) never probes, and a long
    one probes while its losses stay within 2% of its tokens."""
    g = gate(draft_cost=forward_share_smollm2(10), prior_acceptance=0.3, probe_budget=0.02, probe_interval=4)
    g.begin_step(8)
    assert g.best_drafts(0.3)[1] < 1 and g.drafts_for("short", left=32) == 0
    probes, loss = 0, 0.0
    for step in range(1000):
        g.begin_step(8)
        k = g.drafts_for("long", left=1000 - step)
        if k:
            probes += 1
            loss += g.block_cost(k) - 1.0          # nothing accepted
            g.update("long", k, 0)
    assert 1 <= probes and loss <= 0.02 * 1000 + 1e-9
    assert g.stats["long"].probe_loss == pytest.approx(loss)


def test_optimistic_prior_stops_after_losses_and_resumes_on_hits():
    g = gate(prior_acceptance=0.8, probe_budget=None, probe_interval=4)
    g.begin_step(8)
    assert g.drafts_for("a") == 3                 # at batch 8 a fourth draft no longer pays
    for _ in range(3):                            # drafts keep failing: alpha falls, suspended
        g.update("a", 3, 0)
    assert g.stats["a"].alpha < 0.3 and g.drafts_for("a") == 0
    for _ in range(4):
        g.begin_step(8)
    k = g.drafts_for("a")
    assert k >= 1 and g.stats["a"].probing
    for _ in range(3):
        g.update("a", k, k)                       # the probe and what follows hit
    assert g.stats["a"].alpha > 0.6 and g.drafts_for("a") >= 2


def test_expected_accepted_is_geometric():
    assert AdaptiveGate.expected_accepted(0.5, 3) == pytest.approx(0.5 + 0.25 + 0.125)
    assert AdaptiveGate.expected_accepted(1.0, 4) == 4


def forward_share_smollm2(layers):
    from metrale.models.config import ModelConfig
    cfg = ModelConfig(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                      num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, tie_word_embeddings=True)
    return forward_share(cfg, layers)


def test_forward_share_counts_the_lm_head():
    """SmolLM2-135M: 10 of 30 layers + the LM head read ~47% of the weights a decode step reads (the
    measured self-draft token cost on CPU); one layer + head (MTP) ~24%."""
    assert forward_share_smollm2(10) == pytest.approx(0.47, abs=0.02)
    assert forward_share_smollm2(1) == pytest.approx(0.24, abs=0.02)


def test_verify_length_follows_the_drafts_confidence():
    """After drafting, the prefix with the best expected gain is verified, each token accepted with
    probability min(alpha, confidence): at CPU batch 1 only long n-gram matches are worth a verify,
    at batch 8 a short match still is, cut to its best prefix."""
    g = gate(prior_acceptance=0.8)
    g.begin_step(1)
    assert g.drafts_for("a", left=100) == 4
    assert g.verify_length("a", [1.0] * 4) == 4          # a 4-gram match
    assert g.verify_length("a", [0.25] * 4) == 0         # a 1-gram match: not worth the first row
    assert g.verify_length("a", [1.0]) == 0              # one token can never pay at batch 1
    g.begin_step(8)
    assert g.verify_length("a", [0.5] * 4) in (1, 2)
    assert g.verify_length("a", [1.0] * 4) == 3          # the fourth row no longer pays at alpha 0.8


def test_a_dear_drafts_rejected_by_its_confidence_counts_as_a_miss():
    g = gate(draft_cost=0.24, prior_acceptance=0.8, probe_budget=None)
    g.begin_step(8)
    assert g.drafts_for("a") >= 1 and not g.stats["a"].probing
    alpha = g.stats["a"].alpha
    assert g.verify_length("a", [0.01, 0.01]) == 0
    assert g.stats["a"].alpha < alpha
    for _ in range(3):
        g.verify_length("a", [0.01])
    assert g.drafts_for("a") == 0                       # suspended: it stops drafting to drop
    cheap = gate(prior_acceptance=0.8)                  # n-gram: a rejected match costs nothing
    cheap.begin_step(8)
    cheap.drafts_for("a")
    cheap.verify_length("a", [0.01])
    assert cheap.stats["a"].alpha == pytest.approx(0.8)


def test_min_gain_skips_near_break_even_verifies():
    """At batch 8 a 1-token draft at acceptance 0.3 is expected to gain 1.3 / 1.25 = 1.04: verified
    with no margin, not with min_gain 1.1 (the model's error is larger than that)."""
    for margin, expect in ((1.0, 1), (1.1, 0)):
        g = gate(prior_acceptance=0.8, min_gain=margin)
        g.begin_step(8)
        assert g.drafts_for("a") >= 1 and not g.stats["a"].probing
        st = g.stats["a"]
        st.hits, st.trials = 0.3, 1.0          # its evidence has fallen to 0.3 per token
        assert g.verify_length("a", [1.0]) == expect


def test_a_probe_in_the_uncertain_zone_respects_the_drafts_confidence():
    """Between the mean gaining and alpha_low gaining, a draft is a probe of the mean: its prefix is
    chosen at the mean alpha, so a 1-gram n-gram match (confidence 0.25) is not verified to test it
    (it was, before: the open-chat B=8 run verified three such probes); while even the mean loses, a
    probe is verified in full to measure alpha."""
    g = gate(prior_acceptance=0.8, min_gain=1.1, caution=GATE_CAUTION, probe_budget=None)
    g.begin_step(8)
    st = g._stats("a")
    st.hits, st.trials = 1.12, 2.4                       # after one missed 1-token draft: mean 0.47
    assert g.best_drafts(st.alpha)[1] >= 1.1 > g.best_drafts(st.alpha_low(GATE_CAUTION))[1]
    k = g.drafts_for("a")
    assert k >= 1 and st.probing
    assert g.verify_length("a", [0.25] * k) == 0
    assert g.verify_length("a", [1.0] * k) >= 1
    st.hits, st.trials = 0.3, 2.0                        # the mean loses: measure it
    st.suspended_until = 0
    assert g.drafts_for("a") >= 1 and st.probing
    assert g.verify_length("a", [0.25]) == 1
