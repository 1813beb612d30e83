"""bench.top1_agreement: the teacher-forced sequences it builds from the golden fixture and its count."""
import numpy as np
import pytest

from bench.top1_agreement import NEAR_TIE, agreement, golden_sequences


@pytest.fixture(scope="module")
def seqs():
    return golden_sequences()


def test_sequences_follow_the_greedy_continuations(seqs):
    z = np.load("tests/fixtures/golden_smollm2.npz")
    s0 = seqs[0]
    n = len(z["p0_ids"])
    assert len(s0.ids) == len(s0.ref) == len(s0.gap) == n + 31
    np.testing.assert_array_equal(s0.ids[n:], z["p0_greedy"][:-1])       # the reference's own tokens are fed
    np.testing.assert_array_equal(s0.ref[n - 1:], z["p0_greedy"])          # and predicted one position earlier
    assert len(seqs[2].ids) == len(z["p2_ids"])                             # no continuation in the fixture
    assert all((s.gap >= 0).all() for s in seqs)


def test_agreement_counts_misses_and_near_ties(seqs):
    tops = [s.ref.tolist() for s in seqs]
    g = agreement(seqs, tops)
    assert g["agree"] == g["positions"] == sum(len(s.ids) for s in seqs) and not g["misses"]
    firm = int(np.argmax(seqs[1].gap))
    tops[1][firm] = tops[1][firm] + 1
    g = agreement(seqs, tops)
    assert g["agree"] == g["positions"] - 1 and g["firm_agree"] == g["firm_positions"] - 1
    assert g["misses"][0]["pos"] == firm and g["misses"][0]["ref_gap"] >= NEAR_TIE
    with pytest.raises(ValueError, match="positions"):
        agreement(seqs, [t[:-1] for t in tops])
