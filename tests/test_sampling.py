"""The sampling pipeline on the CPU: filters against independent float64 formulas, chi-square
distribution tests, seeds across batch compositions, penalties (and their tool-call window),
logit_bias, min_tokens, logprobs, prompt_logprobs, the first-token policies, n > 1 helpers and
parameter validation."""
import math

import numpy as np
import pytest

from kernels_numba import sampling as K
from metrale import SamplingParams
from metrale.sampling.fanout import derive_seed, expand, select
from metrale.sampling.params import InvalidRequestError
from metrale.sampling.sampler import Sampler
from metrale.sampling.state import SamplingState, SpecialTokens
from tests.fake_model import EOS, VOCAB, FakeBackend, FakeTokenizer, fake_engine, next_token

# ---------------------------------------------------------------------- fixed-logits draws

X = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0], np.float32)
# chi-square critical values at p = 0.001 by degrees of freedom (tables; scipy is not installed)
CHI2_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322}


def draws(x, n, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0, seed=(12345, 678)):
    inv = 0.0 if temperature == 0 else float(np.float32(1) / np.float32(temperature))
    log_min_p = math.log(min_p) if min_p > 0 else -np.inf
    return np.array([K.sample_row_ref(x, None, inv, top_k, top_p, log_min_p, seed[0], seed[1], s) for s in range(n)])


def expected(x, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0):
    """Independent float64 formula: temperature, top-k, top-p over the top-k survivors, min-p."""
    z = x.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    order = np.argsort(-p, kind="stable")
    keep = np.ones(x.size, bool)
    if 0 < top_k < x.size:
        keep[order[top_k:]] = False
    q = np.where(keep, p, 0) / np.where(keep, p, 0).sum()
    cum = np.cumsum(q[order])
    drop = order[(cum - q[order]) >= top_p - 1e-12]
    keep[drop] = False
    keep &= p >= min_p * p.max()
    p = np.where(keep, p, 0)
    return p / p.sum()


def chi2(counts, probs):
    """Chi-square statistic over the kept tokens, bins with expected count < 5 merged; (stat, df)."""
    n = counts.sum()
    kept = probs > 0
    e, o = probs[kept] * n, counts[kept].astype(np.float64)
    small = e < 5
    if small.any():
        e = np.append(e[~small], e[small].sum())
        o = np.append(o[~small], o[small].sum())
    return float(((o - e) ** 2 / e).sum()), e.size - 1


@pytest.mark.parametrize("kw", [dict(temperature=0.7), dict(temperature=1.0, top_k=3), dict(temperature=1.0, top_p=0.8),
                                dict(temperature=1.0, min_p=0.2), dict(temperature=1.3, top_k=5, top_p=0.9)],
                         ids=["temperature", "top_k", "top_p", "min_p", "combined"])
def test_distribution_matches_formula(kw):
    n = 4000
    got = draws(X, n, **kw)
    probs = expected(X, **kw)
    counts = np.bincount(got, minlength=X.size)
    assert (counts[probs == 0] == 0).all(), "a filtered-out token was sampled"
    stat, df = chi2(counts, probs)
    assert df >= 1 and stat < CHI2_999[df], (stat, df, counts, probs * n)


def test_filters_keep_the_reference_sets():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(500) * 2).astype(np.float32)
    z = (x - x.max()).astype(np.float32)
    keys = K.f32_key_ref(z)
    for k in (1, 7, 100):
        assert (keys >= K.top_k_key_ref(keys, k)).sum() == k
    for top_p in (0.1, 0.5, 0.9, 0.99):
        t = K.top_p_key_ref(z, keys, np.uint64(0), top_p)
        kept = keys >= t
        p = np.exp(z.astype(np.float64))
        p /= p.sum()
        assert p[kept].sum() >= top_p - 1e-6
        assert p[kept].sum() - p[kept].min() < top_p + 1e-6       # minimal: without the smallest it falls short


def test_greedy_ties_and_all_masked():
    x = np.array([1.0, 3.0, 3.0, -1.0], np.float32)
    assert K.sample_row_ref(x, None, 0.0, -1, 1.0, -np.inf, 0, 0, 0) == 1
    assert K.sample_row_ref(x, np.array([True, False, True, True]), 0.0, -1, 1.0, -np.inf, 0, 0, 0) == 2
    assert K.sample_row_ref(x, np.zeros(4, bool), 1.0, -1, 1.0, -np.inf, 0, 0, 0) == -1


def test_philox_known_answers():
    """Random123's kat_vectors for philox4x32_10."""
    got = K.philox4x32_ref(0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344, 0xA4093822, 0x299F31D0)
    assert [int(w) for w in got] == [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]
    got = K.philox4x32_ref(0, 0, 0, 0, 0, 0)
    assert [int(w) for w in got] == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    u = K.uniforms_ref(np.arange(100000), 3, 1, 2)
    assert 0 < u.min() and u.max() < 1 and abs(u.mean() - 0.5) < 0.005


def test_penalties_and_bias_reference():
    row = np.array([2.0, -2.0, 1.0, 0.5, -1.0], np.float32)
    got = K.apply_adjustments_ref(row, 2.0, [0, 1, 3], [1, 1, 0], [-0.5, 0.0, 1.0])
    np.testing.assert_allclose(got, [2.0 / 2 - 0.5, -2.0 * 2, 1.0, 1.5, -1.0])


# ---------------------------------------------------------------------- engine level (fake model)


class SpreadBackend(FakeBackend):
    """The fake model with a spread distribution: logit = -0.4 * circular distance to next_token."""

    def forward(self, batch, num_layers=None, return_hidden=False):
        peak = np.argmax(super().forward(batch), axis=-1)
        d = np.abs(np.arange(VOCAB)[None, :] - peak[:, None])
        return (-0.4 * np.minimum(d, VOCAB - d)).astype(np.float32)


def spread_logits(ctx):
    d = np.abs(np.arange(VOCAB) - next_token(ctx))
    return (-0.4 * np.minimum(d, VOCAB - d)).astype(np.float32)


class SpecialTokenizer(FakeTokenizer):
    """FakeTokenizer with tool-call and think markers."""
    ids = {"<tool_call>": 90, "</tool_call>": 91, "<think>": 92, "</think>": 93}

    def token_to_id(self, text):
        return self.ids.get(text)


def spread_engine(tokenizer=None, **settings):
    from metrale import Engine
    from metrale.settings import compose
    backend = SpreadBackend(256, 4)
    cfg = compose(["cache.block_size=4"] + [f"{k}={v}" for k, v in settings.items()])
    return Engine(cfg=cfg, parts=(backend.config, tokenizer or FakeTokenizer(), backend))


def ids(engine, prompts, params):
    return [o.token_ids.tolist() for o in engine.generate(prompts, params, use_tqdm=False)]


def test_seed_gives_same_tokens_whatever_the_batch():
    eng = spread_engine()
    p = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=7, ignore_eos=True)
    alone = ids(eng, [[5, 6, 7]], [p])[0]
    others = [SamplingParams(max_tokens=12, temperature=0.8, seed=s, ignore_eos=True, presence_penalty=0.5)
              for s in range(4)] + [SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)]
    prompts = [[1, 2], [9, 9, 9, 9, 9], [3], [4, 4], [8]]
    mixed = ids(eng, prompts[:2] + [[5, 6, 7]] + prompts[2:], others[:2] + [p] + others[2:])
    assert mixed[2] == alone
    twice = ids(eng, [[5, 6, 7], [1], [5, 6, 7]], [p, others[0], p])
    assert twice[0] == twice[2] == alone
    other_seed = ids(eng, [[5, 6, 7]], [SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=8, ignore_eos=True)])
    assert other_seed[0] != alone
    greedy_ref = [next_token([5, 6, 7])]
    assert len(set(alone)) > 3 and alone != greedy_ref * 12


def test_greedy_penalties_bias_and_min_tokens_follow_the_reference():
    eng = spread_engine()
    p = SamplingParams(max_tokens=10, temperature=0.0, repetition_penalty=1.5, presence_penalty=0.3,
                       frequency_penalty=0.2, logit_bias={7: 0.6, 40: -3.0}, min_tokens=4)
    prompt = [3, 7, 11]
    got = ids(eng, [prompt], [p])[0]
    ctx, counts = list(prompt), {}
    for step in range(10):
        x = spread_logits(ctx).astype(np.float32)
        for t in set(prompt) | set(counts):
            x[t] = x[t] / np.float32(1.5) if x[t] > 0 else x[t] * np.float32(1.5)
        for t, c in counts.items():
            x[t] -= np.float32(0.2) * c + np.float32(0.3)
        x[7] += np.float32(0.6)
        x[40] -= np.float32(3.0)
        if step < 4:
            x[EOS] = -np.inf
        t = int(np.argmax(x))
        ctx.append(t)
        counts[t] = counts.get(t, 0) + 1
        if t == EOS:
            break
    assert got == ctx[len(prompt):]


def test_greedy_fast_path_only_when_plain():
    eng = spread_engine()
    calls = {"greedy": 0}
    orig = eng.backend.forward_greedy

    def counting(batch):
        calls["greedy"] += 1
        return orig(batch)
    eng.backend.forward_greedy = counting
    ids(eng, [[1, 2, 3]], [SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)])
    assert calls["greedy"] == 4
    ids(eng, [[1, 2, 3]], [SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logit_bias={3: 1.0})])
    assert calls["greedy"] == 4


def test_logprobs_and_prompt_logprobs():
    eng = spread_engine()
    prompt = [5, 6, 7, 8]
    out = eng.generate([prompt], [SamplingParams(max_tokens=5, temperature=0.9, seed=3, logprobs=3, prompt_logprobs=2,
                                                 ignore_eos=True)], use_tqdm=False)[0]
    ctx = list(prompt)
    total = 0.0
    for t, entry in zip(out.token_ids.tolist(), out.logprobs):
        x = spread_logits(ctx).astype(np.float64)
        lp = x - (x.max() + np.log(np.exp(x - x.max()).sum()))
        top = np.argsort(-lp, kind="stable")[:3]
        assert set(entry) == set(top.tolist()) | {t}
        for k, v in entry.items():
            assert v == pytest.approx(lp[k], abs=1e-5)
        total += lp[t]
        ctx.append(t)
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-4)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for q in range(1, len(prompt)):
        x = spread_logits(prompt[:q]).astype(np.float64)
        lp = x - (x.max() + np.log(np.exp(x - x.max()).sum()))
        assert out.prompt_logprobs[q][prompt[q]] == pytest.approx(lp[prompt[q]], abs=1e-5)
        assert len(out.prompt_logprobs[q]) in (2, 3)


def test_require_tool_call_and_think_span():
    eng = spread_engine(SpecialTokenizer())
    p = SamplingParams(max_tokens=3, temperature=0.0, require_tool_call=True, ignore_eos=True)
    assert ids(eng, [[1, 2]], [p])[0][0] == 90
    # a prompt that opens a think span: the first token is free; the first after </think> is forced
    p = SamplingParams(max_tokens=4, temperature=0.0, require_tool_call=True, ignore_eos=True, logit_bias={93: 100.0})
    got = ids(eng, [[1, 92]], [p])[0]
    assert got[:3] == [93, 90, 93]


def test_tool_call_end_resets_penalty_window():
    tok = SpecialTokenizer()
    st = SamplingState(SamplingParams(repetition_penalty=1.2, presence_penalty=0.5), [5, 6, 91, 7, 8, 7], tok, (EOS,))
    assert st.special == SpecialTokens(90, 91, 92, 93)
    t, rep, add = st.adjustments(None)
    assert sorted(t.tolist()) == [7, 8] and rep.all() and not add.any()
    for x in (9, 9, 91, 10):
        st.accept(x)
    t, rep, add = st.adjustments({EOS})
    assert dict(zip(t.tolist(), add.tolist())) == {10: 0.0, EOS: -np.inf}
    assert rep.tolist() == [K.adj_word(1, 1), 0]          # 10: in the window, counted once
    row = np.full(VOCAB, 2.0, np.float32)
    x = K.apply_adjustments_ref(row, 1.2, t, rep, add, 0.0, 0.5)
    assert x[10] == np.float32(np.float32(2.0) / np.float32(1.2)) - np.float32(0.5) and x[EOS] == -np.inf
    assert (np.delete(x, [10, EOS]) == 2.0).all()


class _Row:
    """What the sampler reads of a RequestState."""

    def __init__(self, sampling: SamplingState):
        self.params, self.sampling, self.eos_masked, self.stop_ids = sampling.params, sampling, False, {EOS}


PENDING_PARAMS = [dict(repetition_penalty=1.3), dict(frequency_penalty=0.4), dict(presence_penalty=0.6),
                  dict(repetition_penalty=0.9, frequency_penalty=-0.3, presence_penalty=0.7, logit_bias={12: 1.0, 40: -2.0, 91: 0.5}),
                  dict(repetition_penalty=1.2, presence_penalty=0.2, temperature=1.0, seed=3, logit_bias={60: 0.25})]
# a token counted twice, counted once with a bias, in the prompt's window only, with a bias only, new,
# the tool-call END token (the window restarts), a think marker
PENDING_TOKENS = [13, 40, 7, 60, 50, 91, 92]


def test_pending_token_reference_equals_the_state_after_it():
    """A penalized row packed a step ahead (its counts lack the previous step's token, which the
    pipeline counts: I_PENDING) gives the adjusted logits and the token of the row packed from the
    state that accepted that token."""
    tok = SpecialTokenizer()
    rng = np.random.default_rng(4)
    ahead, after, want_pending = [], [], []
    for kw in PENDING_PARAMS:
        p = SamplingParams(**{"temperature": 0.0, **kw})
        for t in PENDING_TOKENS:
            st = SamplingState(p, [5, 6, 91, 7, 8, 7, 30], tok, (EOS,))
            for x in (12, 13, 13, 40, 8):
                st.accept(x)
            full = st.fork()
            full.accept(t)
            ahead.append(_Row(st))
            after.append(_Row(full))
            want_pending.append(t)
    R = len(ahead)
    src = rng.permutation(R + 2)[:R].astype(np.int32)          # each row's row in the previous step
    prev = rng.integers(0, VOCAB, R + 2).astype(np.int32)
    prev[src] = want_pending
    sampler = Sampler(None, VOCAB)
    a = sampler.pack(ahead, None, step_ahead=1, src=src)
    b = sampler.pack(after, None)
    assert a.pending and (a.iparams[:, K.I_PENDING] == src + 1).all() and not b.pending
    np.testing.assert_array_equal(a.iparams[:, K.I_STEP], b.iparams[:, K.I_STEP])
    logits = (rng.standard_normal((R, VOCAB)) * 2).astype(np.float32)
    for r in range(R):
        x = K.adjusted_row_ref(logits[r], a.fparams[r], a.iparams[r], a.adj_token, a.adj_rep, a.adj_add, prev)
        y = K.adjusted_row_ref(logits[r], b.fparams[r], b.iparams[r], b.adj_token, b.adj_rep, b.adj_add)
        np.testing.assert_array_equal(x, y, err_msg=f"row {r}")
        stale = K.adjusted_row_ref(logits[r], a.fparams[r], a.iparams[r], a.adj_token, a.adj_rep, a.adj_add)
        p, t = after[r].params, want_pending[r]
        # the pending token matters, but where a token already penalized gets no frequency term
        same = p.frequency_penalty == 0 and (t in (13, 40) or (t == 7 and p.presence_penalty == 0))
        assert np.array_equal(stale, y) == same, f"row {r}"
    mask = np.zeros((R, 1), np.uint32)
    got = K.sample_rows_ref(logits, mask, a.fparams, a.iparams, a.adj_token, a.adj_rep, a.adj_add, prev)
    want = K.sample_rows_ref(logits, mask, b.fparams, b.iparams, b.adj_token, b.adj_rep, b.adj_add)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_n_best_of_helpers():
    p = SamplingParams(n=2, best_of=4, seed=5)
    kids = expand(p)
    assert len(kids) == 4 and all(k.n == 1 and k.logprobs == 0 for k in kids)
    assert len({k.seed for k in kids}) == 4 and [k.seed for k in expand(p)] == [k.seed for k in kids]
    assert derive_seed(5, 0) != derive_seed(6, 0)
    eng = spread_engine()
    kids = [SamplingParams(**{**k.__dict__, "max_tokens": 6, "temperature": 1.0, "ignore_eos": True}) for k in kids]
    outs = eng.generate([[4, 5]] * 4, kids, use_tqdm=False)
    best = select(outs, p)
    assert len(best) == 2 and best[0].cumulative_logprob >= best[1].cumulative_logprob
    assert best[0].cumulative_logprob == max(o.cumulative_logprob for o in outs) and best[0].logprobs is None
    assert len({tuple(o.token_ids) for o in outs}) > 1


@pytest.mark.parametrize("kw, field", [
    (dict(temperature=-0.5), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=0), "top_k"), (dict(top_k=-2), "top_k"),
    (dict(min_p=1.5), "min_p"), (dict(logit_bias={VOCAB: 1.0}), "logit_bias"), (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={"a": 1.0}), "logit_bias"), (dict(logit_bias={3: 1e9}), "logit_bias"),
    (dict(logprobs=21), "logprobs"), (dict(prompt_logprobs=-1), "prompt_logprobs"), (dict(seed=1.5), "seed"),
    (dict(n=3, best_of=2), "n/best_of"), (dict(regex="(a"), "regex"), (dict(grammar="start: foo"), "grammar"),
    (dict(json_schema={"type": "foo"}), "json_schema"), (dict(json_schema="{not json"), "json_schema"),
    (dict(choice=[]), "choice"), (dict(regex="a", choice=["a"]), "regex/choice"),
])
def test_invalid_params_are_refused_at_add_request(kw, field):
    eng = fake_engine()
    with pytest.raises(InvalidRequestError, match=f"^{field}"):
        eng.add_request([1, 2, 3], SamplingParams(max_tokens=4, **kw))
    assert not eng.requests
