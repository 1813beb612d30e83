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


def sliding_window_ngram(toks, k, max_n, min_n):
    """The drafter's definition written out: for n = max_n down to min_n, the latest earlier
    occurrence of the n-token suffix (ending before the last token) proposes what followed it."""
    L = len(toks)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        hits = [i for i in range(L - n) if toks[i:i + n] == toks[L - n:]]
        if hits:
            follow = toks[hits[-1] + n:hits[-1] + n + k]
            return follow, [n / max_n] * len(follow)
    return [], []


@pytest.mark.parametrize("max_n,min_n", [(4, 1), (3, 2), (1, 1), (6, 3)])
def test_ngram_matches_the_sliding_window_definition(max_n, min_n):
    r = np.random.default_rng(max_n * 10 + min_n)
    d = NgramDrafter(max_n, min_n)
    for trial in range(400):
        toks = r.integers(0, int(r.integers(2, 6)), size=int(r.integers(1, 40))).tolist()
        k = int(r.integers(1, 6))
        [draft] = d.propose([seq(toks)], [k])
        assert (draft.tokens, draft.confidences) == sliding_window_ngram(toks, k, max_n, min_n), toks


def test_ngram_index_grows_with_the_sequence():
    """The per-sequence n-gram index is extended by the tokens appended between calls (prompt and
    output), equals the sliding-window definition at every step, is rebuilt if the history is not
    an extension of what it saw, and is dropped by release."""
    r = np.random.default_rng(7)
    d = NgramDrafter(4, 1)
    s = seq(r.integers(0, 4, size=12).tolist())
    for step in range(60):
        k = int(r.integers(1, 5))
        [draft] = d.propose([s], [k])
        assert (draft.tokens, draft.confidences) == sliding_window_ngram(s.token_ids, k, 4, 1), step
        s.output_token_ids.extend(r.integers(0, 4, size=int(r.integers(1, 4))).tolist())
    assert len(d._index[s].toks) < s.num_tokens        # the last tokens are entered at the next call
    s2 = seq([5, 6, 5, 6, 7])
    d.propose([s2], [2])
    s2.prompt_token_ids[-1] = 5                         # not an extension: rebuilt, still correct
    s2.output_token_ids.append(6)
    [draft] = d.propose([s2], [3])
    assert (draft.tokens, draft.confidences) == sliding_window_ngram(s2.token_ids, 3, 4, 1)
    d.release(s2)
    assert s2 not in d._index


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
    g = AdaptiveGate(4, verify_cost=0.6, probe_interval=5)
    g.begin_step(1)
    assert g.drafts_for("a") >= 1        # the prior (0.8 per token) expects a gain
    g.update("a", 4, 0)                  # nothing accepted: expected gain < 1 -> suspended for 5 steps
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
    cheap, dear = AdaptiveGate(4, verify_cost=0.1), AdaptiveGate(4, verify_cost=0.1, draft_cost=0.8)
    for g in (cheap, dear):
        g.begin_step(1)
        g.drafts_for("a")
        g.update("a", 3, 1)              # 2 tokens for a 1 + 3 block
    assert cheap.drafts_for("a") >= 1 and dear.drafts_for("a") == 0
    assert not g.begin_step(10_000)      # the batch gate


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def measured_gate(**kw):
    """(gate, clock): a 2-draft gate on a fake clock with the engine's measured-gate margin (5%)
    and minimum (4 verify steps)."""
    clock = FakeClock()
    return AdaptiveGate(2, verify_cost=0.1, probe_interval=8, clock=clock, measure_margin=0.05,
                        measure_min_steps=4, **kw), clock


def run_steps(g, clock, n, batch, plain_s, spec_s, accepted_per_seq):
    """n steps of `batch` decoding sequences; a step with speculation verifies every sequence."""
    spec_steps = 0
    for _ in range(n):
        go = g.begin_step(batch)
        if go:
            spec_steps += 1
            for i in range(batch):
                g.update(f"s{i}", 2, accepted_per_seq)
        clock.t += spec_s if go else plain_s
    return spec_steps


def test_measured_gate_pauses_when_verify_steps_cost_more_than_they_yield():
    # per-token cost model says go (verify_cost 0.1, one of two drafts accepted), but each verify
    # step measures 3x a plain step for 1.5 tokens per sequence: speculation must pause
    clock = FakeClock()
    g = AdaptiveGate(2, verify_cost=0.1, probe_interval=8, clock=clock)
    spec = run_steps(g, clock, 200, 8, plain_s=0.01, spec_s=0.03, accepted_per_seq=1)
    assert spec < 200 * 0.1                     # a few probes only
    t = g.timing[8]
    assert t.rate_ratio() < 1 and t.plain_s == pytest.approx(0.01)
    # the loss bound: time spent against the all-plain time of the same tokens
    plain_time = 200 * 0.01
    assert clock.t <= 1.1 * plain_time


def test_measured_gate_keeps_speculating_when_it_pays():
    clock = FakeClock()
    g = AdaptiveGate(2, verify_cost=0.1, probe_interval=8, clock=clock)
    spec = run_steps(g, clock, 100, 8, plain_s=0.01, spec_s=0.012, accepted_per_seq=2)
    assert spec >= 95                           # one or two plain steps to calibrate
    assert g.timing[8].rate_ratio() > 2


def test_measured_gate_reprobes_after_the_pause():
    clock = FakeClock()
    g = AdaptiveGate(2, verify_cost=0.1, probe_interval=4, clock=clock)
    run_steps(g, clock, 40, 4, plain_s=0.01, spec_s=0.05, accepted_per_seq=0)
    assert g.timing[4].rate_ratio() < 1
    # speculation becomes cheap and good: after the pause, probes find it and it resumes
    spec = run_steps(g, clock, 200, 4, plain_s=0.01, spec_s=0.011, accepted_per_seq=2)
    assert spec > 100 and g.timing[4].rate_ratio() > 1



def test_measured_gate_margin_pauses_a_break_even_speculation():
    """With measure_margin 0.05 a speculation measured at ~1.03x of plain's rate pauses (after
    measure_min_steps verify steps), while one at 1.5x goes on; without a margin the 1.03x one goes on."""
    def spec_steps(margin, spec_s, accepted):
        clock = FakeClock()
        g = AdaptiveGate(2, verify_cost=0.1, probe_interval=8, clock=clock, measure_margin=margin,
                         measure_min_steps=4)
        return run_steps(g, clock, 200, 8, plain_s=0.01, spec_s=spec_s, accepted_per_seq=accepted), g
    # 1 + 1 tokens a sequence in 0.0194 s against 1 in 0.01 s: 1.03x
    n, g = spec_steps(0.05, 0.0194, 1)
    assert n < 60 and 1.0 < g.timing[8].rate_ratio() < 1.05
    n0, _ = spec_steps(0.0, 0.0194, 1)
    assert n0 > 180
    n2, g2 = spec_steps(0.05, 0.0133, 1)
    assert n2 > 180 and g2.timing[8].rate_ratio() > 1.45


def test_measured_row_cost_prices_draft_rows_at_what_the_batch_pays():
    """8 sequences verify 2 drafts each (16 rows) in steps 40% slower than plain ones: a row costs
    0.4 x 8 / 16 = 0.2 plain steps a sequence. A 1-token draft of confidence 0.25 (a 1-gram n-gram
    match) passes the 0.1 constant but not the measured price; a confident 2-token draft passes both."""
    g, clock = measured_gate(min_gain=1.1)                      # the engine's spec_min_gain
    assert g.measured_row_cost(8) == 0.0                      # nothing measured yet
    run_steps(g, clock, 40, 8, plain_s=0.01, spec_s=0.014, accepted_per_seq=2)
    assert g.measured_row_cost(8) == pytest.approx(0.2, rel=0.05)
    g.begin_step(8)
    g.stats["s0"].hits, g.stats["s0"].trials = 40.0, 41.0    # a well-measured, high acceptance
    assert g.verify_length("s0", [1.0, 1.0]) == 2
    assert g.verify_length("s0", [0.25]) == 0
    unmeasured = AdaptiveGate(2, verify_cost=0.1, measure=False, caution=0.0, min_gain=1.1)
    unmeasured._stats("s0").hits, unmeasured._stats("s0").trials = 40.0, 41.0
    assert unmeasured.verify_length("s0", [0.25]) == 1


def test_drafts_fit_the_backend_logits_rows():
    """With a backend that holds R logits rows a forward (CUDA: max_rows), the drafts of a step
    never need more than R rows in all: one per running sequence plus the drafts."""
    from metrale import Engine, SamplingParams
    eng = Engine(model="smollm2-135m-shape", device="cpu", cache={"num_blocks": 256},
                 spec={"method": "ngram", "num_drafts": 4}, levers={"cpu_kernels": "numpy"})
    eng.speculator.max_rows = 6            # uncapped, this run reaches 8 rows
    rows = []
    forward = eng.backend.forward
    eng.backend.forward = lambda batch, *a, **k: rows.append(len(batch.logits_indices)) or forward(batch, *a, **k)
    prompts = [np.array([5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]) for _ in range(4)]
    eng.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert eng.speculator.stats()["verifies"] > 0 and max(rows) <= 6


def test_draft_count_follows_the_expected_gain():
    """The draft count maximizes (1 + alpha + ... + alpha^k) / (1 + c k): every draft on a cheap
    verify (GPU) at the prior 0.8; a single draft when each drafted token costs most of a step, and
    every draft again once the sequence's acceptance is high."""
    cheap = AdaptiveGate(4, verify_cost=0.1)
    dear = AdaptiveGate(4, verify_cost=0.5, draft_cost=0.33)
    mid = AdaptiveGate(4, verify_cost=0.3, prior_acceptance=0.5)
    assert cheap.drafts_for("a") == 4 and dear.drafts_for("a") == 1 and mid.drafts_for("a") == 1
    assert dear.best_drafts(0.8)[1] < 1 < dear.best_drafts(1.0)[1]
    for g in (cheap, dear, mid):
        st = g.stats["a"]
        st.hits = st.trials = 10.0                  # long acceptances: more drafts pay for all
    assert cheap.drafts_for("a") == 4 and dear.drafts_for("a") == 4 and mid.drafts_for("a") == 4


def test_measured_gate_compares_against_plain_steps_without_its_own_host_work():
    """Plain steps of 10 ms of which 3 ms are the speculator's own host work (gate calls, shadows:
    add_host_time), verify steps of 16.5 ms for 2 tokens a sequence: 1.21x of the measured plain step
    but 0.85x of a run without a speculator (7 ms a token), so speculation pauses; without that host
    work reported it goes on."""
    def run(host_s):
        g, clock = measured_gate()
        spec = 0
        for _ in range(200):
            go = g.begin_step(8)
            if go:
                spec += 1
                for i in range(8):
                    g.update(f"s{i}", 2, 1)
                clock.t += 0.0165
            else:
                g.add_host_time(host_s)
                clock.t += 0.010
        return spec, g.timing[8]
    spec, t = run(0.003)
    assert t.plain_overhead_s == pytest.approx(0.003) and t.rate_ratio() == pytest.approx(2 / 0.0165 * 0.007, rel=0.02)
    assert spec < 60
    spec0, t0 = run(0.0)
    assert spec0 > 180 and t0.rate_ratio() > 1.2


def test_measured_gate_pauses_upkeep_that_rarely_verifies():
    """Steps with no verify at all but 3% of their time spent in the speculator (gate calls,
    shadows) and no verify after the first: g = 0 against h = 0.03 over each 32-step window, so the
    speculator pauses for the bucket, longer each time (no upkeep while paused);
    when drafts are accepted every other step (g = 0.5) it keeps going."""
    def run(verify_every):
        g, clock = measured_gate()
        go_steps = 0
        for step in range(256):
            go = g.begin_step(1)
            go_steps += go
            if go:
                g.add_host_time(0.0003)
                if step % verify_every == 0:
                    g.update("s0", 2, 1)
            clock.t += 0.0103 if go else 0.010
        return go_steps
    assert run(1000) <= 170               # never verifies after the first step: pauses of 8, 16, 32 .. steps
    assert run(2) > 240


@pytest.mark.parametrize("max_n", [1, 2, 4, 6])
def test_ngram_index_built_a_few_tokens_at_a_time_equals_one_build(max_n):
    """_NgramIndex.extend has two paths (a loop for a step's few tokens, zip over slices for a
    prompt): appending in random pieces gives the same tables as one call."""
    import random
    import metrale.spec.drafter as D
    rng = random.Random(max_n)
    for _ in range(50):
        toks = [rng.randrange(6) for _ in range(rng.randrange(1, 80))]
        pieces, whole = D._NgramIndex(max_n), D._NgramIndex(max_n)
        i = 0
        while i < len(toks):
            k = rng.randrange(1, 2 * D.SHORT_EXTEND)
            pieces.extend(toks[i:i + k])
            i += k
        whole.extend(toks)                    # > SHORT_EXTEND tokens: the zip path (or short: the loop)
        assert pieces.tables == whole.tables and pieces.toks == whole.toks
