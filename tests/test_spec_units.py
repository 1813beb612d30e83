"""Speculative decoding pieces on their own: drafters, acceptance rules, the adaptive gate."""
import numpy as np
import pytest

from metrale.sampling.params import SamplingParams
from metrale.scheduler.sequence import Sequence
from metrale.spec.drafter import Draft, NgramDrafter
from metrale.spec.gate import AdaptiveGate
from metrale.spec.verify import accept_greedy, accept_sampled


def seq(tokens):
    return Sequence(list(tokens), SamplingParams())


def test_ngram_proposes_what_followed_the_latest_match():
    d = NgramDrafter(max_n=3)
    [draft] = d.propose([seq([1, 2, 3, 4, 5, 9, 1, 2, 3])], [3])
    assert draft.tokens == [4, 5, 9]
    [draft] = d.propose([seq([7, 1, 2, 8, 8, 1, 2, 6, 0, 1, 2])], [2])
    assert draft.tokens == [6, 0]                      # the latest occurrence of [1, 2] wins


def test_ngram_without_a_match_proposes_nothing():
    [draft] = NgramDrafter().propose([seq([1, 2, 3, 4])], [4])
    assert draft.tokens == []


def test_draft_cut_at_low_confidence():
    d = Draft([1, 2, 3, 4], [0.9, 0.8, 0.2, 0.9])
    assert d.cut(4, 0.5).tokens == [1, 2]
    assert d.cut(1, 0.0).tokens == [1]


def test_accept_greedy():
    assert accept_greedy(np.array([5, 6, 7, 8]), [5, 6, 7]) == [5, 6, 7, 8]   # all + bonus
    assert accept_greedy(np.array([5, 9, 7, 8]), [5, 6, 7]) == [5, 9]         # correction
    assert accept_greedy(np.array([3]), []) == [3]


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


@pytest.mark.parametrize("one_hot", [True, False])
def test_rejection_sampling_preserves_the_target_distribution(one_hot):
    rng = np.random.default_rng(0)
    V = 6
    p = np.array([0.05, 0.4, 0.1, 0.2, 0.15, 0.1])          # target at the first draft position
    p2 = np.full(V, 1 / V)
    q = np.array([0.5, 0.1, 0.1, 0.1, 0.1, 0.1])             # a drafter that overrates token 0
    counts = np.zeros(V)
    n = 20000
    for _ in range(n):
        d = 0 if one_hot else int(rng.choice(V, p=q))
        out = accept_sampled([p, p2], [d], None if one_hot else [q], rng.random(1),
                             lambda j, probs: rng.choice(V, p=probs))
        counts[out[0]] += 1
    # 5 degrees of freedom: the 99.9% critical value is 20.52
    assert chi_square(counts, p) < 20.52, counts / n


def test_gate_suspends_and_reprobes_with_backoff():
    g = AdaptiveGate(4, verify_cost=0.3, probe_interval=5)
    g.begin_step(1)
    assert g.drafts_for("a") >= 1
    g.update("a", 4, 0)                  # nothing accepted: gain < 1 -> suspended for 5 steps
    assert g.drafts_for("a") == 0
    for _ in range(5):
        g.begin_step(1)
    assert g.drafts_for("a") >= 1        # probing again
    g.update("a", 4, 0)                  # the probe loses too: the pause doubles
    for _ in range(9):
        g.begin_step(1)
    assert g.drafts_for("a") == 0
    g.begin_step(1)
    assert g.drafts_for("a") >= 1
    g.update("a", 2, 2)                  # a winning probe keeps speculating
    assert g.drafts_for("a") >= 1


def test_gate_counts_the_drafters_own_cost():
    cheap, dear = AdaptiveGate(4, verify_cost=0.1), AdaptiveGate(4, verify_cost=0.1, draft_cost=0.4)
    for g in (cheap, dear):
        g.begin_step(1)
        g.drafts_for("a")
        g.update("a", 3, 1)              # 2 tokens for a 1 + 3 block
    assert cheap.drafts_for("a") >= 1 and dear.drafts_for("a") == 0
    assert not g.begin_step(10_000)      # the batch gate
