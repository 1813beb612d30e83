"""Speculation under every sampling control, on fake models (fast): the speculative output equals the
plain output token for token (greedy, and sampled with the same seed), logprobs included; drafts
the request could not emit are cut before the forward; rejection sampling keeps the distribution."""
import numpy as np
import pytest

from fake_model import EOS, VOCAB, FakeBackend, FakeTokenizer, fake_config, next_token
from metrale import Engine, SamplingParams
from metrale.models.config import ModelConfig
from metrale.request import RequestState
from metrale.sampling.sampler import Sampler
from metrale.scheduler.sequence import Sequence
from metrale.settings import compose
from metrale.spec.drafter import Draft
from metrale.spec.speculator import Speculator, lookahead
from metrale.spec.gate import AdaptiveGate

TOOL_START, TOOL_END, THINK_START, THINK_END = 90, 91, 92, 93


class SoftBackend(FakeBackend):
    """FakeBackend (the context is read back through the paged KV), with a spread of logits per row:
    penalties, bias, temperature and masks change which token wins."""

    def __init__(self, num_blocks: int, block_size: int, vocab: int = VOCAB, eos_boost: float = 0.0):
        super().__init__(num_blocks, block_size)
        self.vocab, self.eos_boost = vocab, eos_boost
        self.config = fake_config() if vocab == VOCAB else ModelConfig(
            architecture="fake", vocab_size=vocab, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=1,
            num_kv_heads=1, head_dim=8, max_position=4096, eos_token_ids=(EOS,))

    def forward(self, batch) -> np.ndarray:
        self.batches.append(batch)
        keep = batch.slot_mapping >= 0
        self.kv[batch.slot_mapping[keep]] = batch.token_ids[keep]
        logits = np.empty((len(batch.logits_indices), self.vocab), dtype=np.float32)
        for r, t in enumerate(batch.logits_indices):
            s, pos = batch.token_seq[t], batch.positions[t]
            p = np.arange(pos + 1)
            ctx = self.kv[batch.block_tables[s, p // self.block_size] * self.block_size + p % self.block_size]
            assert (ctx >= 0).all(), "read a KV slot nobody wrote"
            h = next_token(ctx)
            row = np.random.default_rng([h, ctx.size]).normal(0.0, 1.5, self.vocab)
            row[h] += 2.5
            row[EOS] += self.eos_boost
            logits[r] = row
        return logits


class MarkerTokenizer(FakeTokenizer):
    """FakeTokenizer with single-token tool-call and think markers."""
    MARKERS = {"<tool_call>": TOOL_START, "</tool_call>": TOOL_END, "<think>": THINK_START, "</think>": THINK_END}

    def token_to_id(self, text):
        return self.MARKERS.get(text)


class Replay:
    """Proposes what the plain run generated next, some tokens replaced by random ones (EOS included)."""
    name = "replay"
    lookup_only = False

    def __init__(self, outputs: dict, vocab: int, error_rate: float, seed: int = 0, with_q: bool = False):
        self.outputs, self.vocab, self.error_rate = outputs, vocab, error_rate
        self.rng, self.with_q = np.random.default_rng(seed), with_q

    def propose(self, seqs, ks):
        out = []
        for s, k in zip(seqs, ks):
            truth = self.outputs[tuple(s.prompt_token_ids)][len(s.output_token_ids):][:k]
            toks = [int(t) if self.rng.random() >= self.error_rate else int(self.rng.integers(0, self.vocab))
                    for t in truth]
            q = None
            if self.with_q:            # a drafter that gives its distribution: mass 0.6 on its token
                q = []
                for t in toks:
                    row = np.full(self.vocab, 0.4 / (self.vocab - 1))
                    row[t] = 0.6
                    q.append(row)
            out.append(Draft(toks, [1.0] * len(toks), q))
        return out

    def release(self, seq):
        pass


def engine(spec: bool, *, vocab: int = VOCAB, tokenizer=None, eos_boost: float = 0.0, num_drafts: int = 4):
    # verify cost 0: the gate never pauses, so every draft is verified (these tests are about verification)
    settings = ["cache.block_size=4", "levers.spec_verify_cost=0.0"] + (
        ["spec.method=ngram", f"spec.num_drafts={num_drafts}"] if spec else [])
    backend = SoftBackend(128, 4, vocab, eos_boost)
    return Engine(cfg=compose(settings), parts=(backend.config, tokenizer or MarkerTokenizer(), backend))


def run_both(prompts, params, *, error_rate=0.3, drafter=None, with_q=False, **kw):
    plain = engine(False, **kw).generate([np.array(p) for p in prompts], params, use_tqdm=False)
    eng = engine(True, **kw)
    record = {tuple(p): list(o.token_ids) for p, o in zip(prompts, plain)}
    eng.speculator.drafter = drafter or Replay(record, eng.model_config.vocab_size, error_rate, with_q=with_q)
    spec = eng.generate([np.array(p) for p in prompts], params, use_tqdm=False)
    eng.blocks.check_no_leaks([])
    return plain, spec, eng


def assert_same(plain, spec):
    for a, b in zip(plain, spec):
        assert list(a.token_ids) == list(b.token_ids)
        assert a.finish_reason == b.finish_reason
        assert (a.logprobs is None) == (b.logprobs is None)
        if a.logprobs is not None:
            assert len(a.logprobs) == len(b.logprobs) == len(a.token_ids)
            for x, y in zip(a.logprobs, b.logprobs):
                assert x.keys() == y.keys()
                np.testing.assert_allclose([x[t] for t in x], [y[t] for t in x], atol=1e-6)
            assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, abs=1e-5)


CONTROLS = [dict(repetition_penalty=1.4),
            dict(presence_penalty=0.8, frequency_penalty=0.6),
            dict(logit_bias={7: 2.5, 11: 3.0, 23: -4.0}),
            dict(logprobs=3),
            dict(min_tokens=9, ignore_eos=False),
            dict(require_tool_call=True, repetition_penalty=1.3, logit_bias={TOOL_END: 2.0}),
            dict(require_tool_call=True, presence_penalty=0.5, logit_bias={THINK_END: 3.5}, logprobs=2),  # in a think span
            dict(repetition_penalty=1.2, frequency_penalty=0.3, logit_bias={5: 1.0}, min_tokens=5, logprobs=5,
                 ignore_eos=False)]


def prompts_for(rng, n):
    ps = [[int(t) for t in rng.integers(1, 90, int(m))] for m in rng.integers(3, 20, n)]
    ps[6] = ps[6] + [THINK_START]
    return ps


@pytest.mark.parametrize("error_rate", [0.0, 0.3, 1.0])
def test_greedy_controls_speculative_equals_plain(rng, error_rate):
    prompts = prompts_for(rng, len(CONTROLS))
    params = [SamplingParams(max_tokens=16, temperature=0.0, **{"ignore_eos": True, **c}) for c in CONTROLS]
    plain, spec, eng = run_both(prompts, params, error_rate=error_rate, eos_boost=2.0)
    assert_same(plain, spec)
    stats = eng.speculator.stats()
    assert stats["verifies"] > 0
    if error_rate == 0.0:
        assert stats["acceptance_rate"] > 0.9
    assert any(o.finish_reason == "stop" for o in plain)          # EOS does end some requests
    assert plain[5].token_ids[0] == TOOL_START                    # the forced first answer token
    think = list(plain[6].token_ids)                              # ... after the think span the prompt opened
    assert TOOL_START not in think[:think.index(THINK_END)] and think[think.index(THINK_END) + 1] == TOOL_START


def test_ngram_drafter_under_controls_equals_plain(rng):
    prompts = [p * 3 for p in prompts_for(rng, len(CONTROLS))]     # repetitive: n-gram drafts get accepted
    params = [SamplingParams(max_tokens=20, temperature=0.0, **{"ignore_eos": True, **c}) for c in CONTROLS]
    plain = engine(False, eos_boost=1.0).generate([np.array(p) for p in prompts], params, use_tqdm=False)
    eng = engine(True, eos_boost=1.0)
    spec = eng.generate([np.array(p) for p in prompts], params, use_tqdm=False)
    assert_same(plain, spec)
    assert eng.speculator.stats()["verifies"] > 0
    eng.blocks.check_no_leaks([])


@pytest.mark.parametrize("with_q", [False, True])
def test_seeded_sampling_is_reproducible_and_matches_plain(rng, with_q):
    prompts = prompts_for(rng, len(CONTROLS))
    params = [SamplingParams(max_tokens=16, temperature=1.3, top_k=30, top_p=0.9, seed=100 + i,
                              **{"ignore_eos": True, **c})
              for i, c in enumerate(CONTROLS)]
    plain, spec, eng = run_both(prompts, params, error_rate=0.2, eos_boost=1.0, with_q=with_q)
    assert eng.speculator.stats()["accepted"] > 0
    if not with_q:                 # one-hot drafts: each row draws what plain decoding draws at that step
        assert_same(plain, spec)
    _, again, _ = run_both(prompts, params, error_rate=0.2, eos_boost=1.0, with_q=with_q)
    for a, b in zip(spec, again):
        assert list(a.token_ids) == list(b.token_ids)


def test_min_tokens_cuts_drafts_at_masked_eos():
    eng = engine(True, eos_boost=6.0)

    class Eos:
        name = "eos"
        lookup_only = False

        def propose(self, seqs, ks):
            return [Draft([EOS] * k, [1.0] * k) for k in ks]

        def release(self, seq):
            pass

    eng.speculator.drafter = Eos()
    [out] = eng.generate([np.array([4, 5, 6])], SamplingParams(max_tokens=12, temperature=0.0, min_tokens=5,
                                                               ignore_eos=False), use_tqdm=False)
    assert len(out.token_ids) == 6 and out.token_ids[-1] == EOS and out.finish_reason == "stop"
    assert EOS not in list(out.token_ids[:5])
    # drafts of EOS were cut while EOS was banned; the first allowed one was verified and accepted
    assert eng.speculator.stats()["cut"] > 0 and eng.speculator.stats()["accepted"] >= 1
    eng.blocks.check_no_leaks([])


# ------------------------------------------------------------------ grammar (SmolLM2's tokenizer)

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "tags": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}},
          "required": ["name", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def smol_tokenizer():
    from metrale.models.assemble import _default_tokenizer
    tok = _default_tokenizer()
    if not hasattr(getattr(tok, "backend", None), "to_str"):
        pytest.skip("SmolLM2's tokenizer is not installed")
    return tok


@pytest.mark.parametrize("error_rate", [0.0, 0.5])
def test_grammar_speculation_equals_plain(rng, smol_tokenizer, error_rate):
    V = smol_tokenizer.vocab_size
    prompts = [[int(t) for t in rng.integers(100, 5000, int(n))] for n in (5, 9, 14)]
    params = [SamplingParams(max_tokens=24, temperature=0.0, json_schema=SCHEMA),
              SamplingParams(max_tokens=24, temperature=0.0, regex=r"[a-z]{2,6}(-[0-9]{1,3}){2,4}", logprobs=2),
              SamplingParams(max_tokens=24, temperature=1.0, seed=7, json_schema=SCHEMA, repetition_penalty=1.3)]
    plain, spec, eng = run_both(prompts, params, error_rate=error_rate, vocab=V, tokenizer=smol_tokenizer)
    assert_same(plain, spec)
    stats = eng.speculator.stats()
    assert stats["accepted"] > 0
    if error_rate:
        assert stats["cut"] > 0                      # grammar-violating drafts never reached the forward


def test_drafts_the_grammar_refuses_are_not_verified(smol_tokenizer):
    eng = engine(True, vocab=smol_tokenizer.vocab_size, tokenizer=smol_tokenizer)
    [bad] = smol_tokenizer.encode("\n")              # never valid in compact JSON, not even in a string

    class Bad:
        name = "bad"
        lookup_only = False

        def propose(self, seqs, ks):
            return [Draft([bad] * k, [1.0] * k) for k in ks]

        def release(self, seq):
            pass

    eng.speculator.drafter = Bad()
    [out] = eng.generate([np.array([300, 400, 500])], SamplingParams(max_tokens=20, temperature=0.0,
                                                                     json_schema=SCHEMA), use_tqdm=False)
    stats = eng.speculator.stats()
    assert stats["verifies"] == 0 and stats["cut"] > 0
    assert all(len(b.logits_indices) <= b.num_seqs for b in eng.backend.batches)   # no verify block was formed
    eng.blocks.check_no_leaks([])
    assert out.text


# ------------------------------------------------------------------ distribution (no engine)


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "drew a token of probability 0"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_rejection_sampling_with_penalties_preserves_the_distribution():
    """Rows 0 and 1 of a verify block for draft [d0, d1] under repetition / presence / frequency
    penalties: the first emitted token follows the penalized p0; given that d0 was accepted, the
    second follows p1, penalized with d0 in the history."""
    V, T = 6, 0.9
    raw = np.array([[0.5, 1.0, 0.2, 0.8, 0.0, 0.3],
                    [0.1, 0.9, 0.6, 0.2, 0.4, 0.0],
                    [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]], np.float32)
    prompt, first, draft = [1, 2], 3, [1, 3]
    kw = dict(temperature=T, repetition_penalty=1.5, presence_penalty=0.4, frequency_penalty=0.3, max_tokens=8)

    def penalized(row, output):
        x = row.astype(np.float64).copy()
        for t in set(prompt) | set(output):
            x[t] = x[t] / 1.5 if x[t] > 0 else x[t] * 1.5
        for t in set(output):
            x[t] -= 0.4 + 0.3 * output.count(t)
        p = np.exp((x - x.max()) / T)
        return p / p.sum()

    p0, p1 = penalized(raw[0], [first]), penalized(raw[1], [first, draft[0]])
    tok = FakeTokenizer()
    sampler = Sampler(None, V)
    spec = Speculator(None, num_drafts=2, gate=AdaptiveGate(2))
    n = 3000
    states = []
    for i in range(n):
        seq = Sequence(list(prompt), SamplingParams(seed=i, **kw))
        st = RequestState(seq, tok, (EOS,), 4096)
        st.sampling.accept(first)
        seq.output_token_ids.append(first)
        states.append(st)
    rows = [r for st in states for r in lookahead(st, draft)]
    assert len(rows) == 3 * n
    drawn, _ = sampler.draw(np.tile(raw, (n, 1)), rows)
    c0, c1 = np.zeros(V), np.zeros(V)
    for i, st in enumerate(states):
        seq = st.seq
        out = spec.accept(seq, rows[3 * i:3 * i + 3], drawn[3 * i:3 * i + 3], draft)
        c0[out[0].token] += 1
        if out[0].token == draft[0]:
            c1[out[1].token] += 1
    # 5 degrees of freedom: the 99.9% critical value is 20.52
    assert chi_square(c0, p0) < 20.52, (c0 / n, p0)
    assert c1.sum() > 300 and chi_square(c1, p1) < 20.52, (c1 / c1.sum(), p1)
