"""Speculative decoding end to end: greedy speculative output equals greedy plain output."""
import numpy as np
import pytest

from fake_model import fake_engine, reference_continuation
from metrale import Engine, SamplingParams
from metrale.spec.drafter import Draft


class NoisyOracle:
    """Proposes the true continuation with some tokens corrupted: both accept and reject paths run."""
    name = "oracle"
    lookup_only = False

    def __init__(self, error_rate: float, seed: int = 0):
        self.error_rate, self.rng = error_rate, np.random.default_rng(seed)

    def propose(self, seqs, ks):
        out = []
        for s, k in zip(seqs, ks):
            truth = reference_continuation(s.token_ids, k)
            toks = [t if self.rng.random() > self.error_rate else (t % 96) + 1 for t in truth]
            out.append(Draft(toks, [1.0] * k))
        return out

    def release(self, seq):
        pass


# the default gate keeps dear drafters off on CPU (a draft model as dear as the target never pays:
# test_draft_model_as_dear_as_the_target_stays_off); tests of their mechanics pin the cost model.
# Float32 activations: their outputs are compared with the NumPy oracle (smollm2), which the 8-bit
# activation products (the default on AVX2 and VNNI CPUs) do not match token for token.
F32 = {"cpu_activations": "f32"}
FORCE = {"spec_verify_cost": 0.0, **F32}


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("error_rate", [0.0, 0.3, 1.0])
def test_fake_model_speculation_is_lossless(rng, error_rate):
    eng = fake_engine(num_blocks=128, block_size=4, **{"spec.method": "ngram", "spec.num_drafts": 3})
    eng.speculator.drafter = NoisyOracle(error_rate)
    prompts = [[int(t) for t in rng.integers(1, 96, int(n))] for n in (3, 17, 9, 30)]
    outs = eng.generate([np.array(p) for p in prompts], greedy(20), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert list(o.token_ids) == reference_continuation(p, 20)
    stats = eng.speculator.stats()
    assert stats["verifies"] > 0
    if error_rate == 0.0:
        assert stats["acceptance_rate"] == 1.0 and stats["tokens_per_verify"] > 2
    eng.blocks.check_no_leaks([])
    assert any(b.num_tokens > b.num_seqs and len(b.logits_indices) > b.num_seqs for b in eng.backend.batches)


def test_speculation_under_preemption_is_lossless(rng):
    eng = fake_engine(num_blocks=26, block_size=4, **{"spec.method": "ngram", "spec.num_drafts": 4})
    eng.speculator.drafter = NoisyOracle(0.2)
    prompts = [[int(t) for t in rng.integers(1, 96, int(n))] for n in (12, 20, 15, 18, 10)]
    outs = eng.generate([np.array(p) for p in prompts], greedy(24), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert list(o.token_ids) == reference_continuation(p, 24)
    eng.blocks.check_no_leaks([])


def test_sampled_speculation_runs_and_frees_blocks(rng):
    eng = fake_engine(num_blocks=128, block_size=4, **{"spec.method": "ngram"})
    eng.speculator.drafter = NoisyOracle(0.3)
    outs = eng.generate([np.array([5, 6, 7])] * 3,
                        SamplingParams(max_tokens=12, temperature=0.8, seed=3, ignore_eos=True), use_tqdm=False)
    # the fake model's rows are nearly one-hot: sampling follows the reference continuation
    for o in outs:
        assert list(o.token_ids) == reference_continuation([5, 6, 7], 12)
    eng.blocks.check_no_leaks([])


def test_unknown_method_is_a_clear_error():
    with pytest.raises(ValueError, match="spec.method"):
        fake_engine(**{"spec.method": "telepathy"})


REPETITIVE = ["1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3,", "The cat sat on the mat. The cat sat on the",
              "def f(x):\n    return x\n\ndef g(x):\n    return"]


@pytest.fixture(scope="module")
def exact_plain():
    eng = Engine(model="smollm2-135m", device="cpu", levers={"numpy_dtype": "float64"})
    return eng, eng.generate(REPETITIVE, greedy(12), use_tqdm=False)


def twin(plain_engine, spec: dict, levers: dict | None = None) -> Engine:
    """A speculative engine over the same loaded float64 weights (a fresh backend, its own KV pool)."""
    be = plain_engine.backend
    from metrale.settings import compose, to_overrides
    cfg = compose(to_overrides({"device": "cpu", "levers": {"numpy_dtype": "float64", **(levers or {})},
                                "spec": spec}))
    from metrale.runtime.numpy_backend import NumpyBackend
    backend = NumpyBackend(be.config, be.weights.items(), num_blocks=256, block_size=be.block_size, dtype="float64")
    return Engine(cfg=cfg, parts=(be.config, plain_engine.tokenizer, backend))


# n-gram speculates under the default (CPU row model) gate on these repetitive prompts; CPU
# self-drafting is kept off by it at 12 tokens, so its case pins the cost model
@pytest.mark.parametrize("method, extra, levers", [("ngram", {}, None), ("self", {"self_layers": 10}, FORCE)])
def test_smollm2_greedy_speculative_equals_plain(exact_plain, method, extra, levers):
    plain_engine, plain = exact_plain
    eng = twin(plain_engine, {"method": method, "num_drafts": 4, **extra}, levers)
    outs = eng.generate(REPETITIVE, greedy(12), use_tqdm=False)
    for a, b in zip(plain, outs):
        np.testing.assert_array_equal(a.token_ids, b.token_ids)
    assert eng.speculator.stats()["verifies"] > 0
    eng.blocks.check_no_leaks([])


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
CONTROL_PROMPTS = REPETITIVE + ["The cat sat on the mat. The dog sat on the log. The cat sat on the",
                                "1, 2, 3, 4, 1, 2, 3, 4, 1,",
                                'Ann as JSON: {"name": "Ann", "age": 31}\n'
                                'Bob as JSON: {"name": "Bob", "age": 42}\nCid as JSON: ']


def control_params(tokenizer) -> list[SamplingParams]:
    g = dict(max_tokens=10, temperature=0.0, ignore_eos=True)
    dog = tokenizer.encode(" dog")[-1]
    return [SamplingParams(**g, repetition_penalty=1.3),
            SamplingParams(**g, presence_penalty=0.6, frequency_penalty=0.4),
            SamplingParams(**g, logit_bias={dog: 4.0}, logprobs=3),
            SamplingParams(**{**g, "ignore_eos": False}, min_tokens=8, logprobs=2),
            SamplingParams(**g, repetition_penalty=1.1, presence_penalty=0.3, logit_bias={dog: -5.0}),
            SamplingParams(**{**g, "max_tokens": 16, "ignore_eos": False}, json_schema=PERSON, logprobs=1)]


@pytest.fixture(scope="module")
def controls_plain(exact_plain):
    plain_engine, _ = exact_plain
    return plain_engine.generate(CONTROL_PROMPTS, control_params(plain_engine.tokenizer), use_tqdm=False)


@pytest.mark.parametrize("drafter", ["ngram", "replay"])
def test_smollm2_controls_speculative_equals_plain(exact_plain, controls_plain, drafter):
    """Penalties, logit_bias, min_tokens, logprobs and a JSON schema: the speculative run gives the
    plain run's tokens, and the logprobs of the accepted tokens within 1e-6 (float64 NumPy)."""
    from test_spec_controls import Replay, assert_same
    plain_engine, _ = exact_plain
    eng = twin(plain_engine, {"method": "ngram", "num_drafts": 4})
    if drafter == "replay":
        record = {tuple(o.prompt_token_ids.tolist()): list(o.token_ids) for o in controls_plain}
        eng.speculator.drafter = Replay(record, eng.model_config.vocab_size, 0.3)
    outs = eng.generate(CONTROL_PROMPTS, control_params(plain_engine.tokenizer), use_tqdm=False)
    assert_same(controls_plain, outs)
    assert controls_plain[-1].text.startswith('{"name": "')
    stats = eng.speculator.stats()
    assert stats["accepted"] > 0
    eng.blocks.check_no_leaks([])


def test_draft_model_as_dear_as_the_target_stays_off(smollm2):
    eng = Engine(model="smollm2-135m", device="cpu", levers=F32, spec={"method": "draft", "num_drafts": 4,
                                                           "draft_model": "smollm2-135m"})
    calls = []
    forward = eng.speculator.drafter.backend.forward
    eng.speculator.drafter.backend.forward = lambda batch, *a, **k: calls.append(1) or forward(batch, *a, **k)
    prompts = ["Once upon a time", "The capital of France is"]
    outs = eng.generate(prompts, greedy(8), use_tqdm=False)
    for a, b in zip(outs, smollm2.generate(prompts, greedy(8), use_tqdm=False)):
        np.testing.assert_array_equal(a.token_ids, b.token_ids)
    assert eng.speculator.stats()["verifies"] == 0 and not calls      # not even a probe's draft


def test_draft_model_speculation_equals_plain(smollm2):
    """The draft model here is SmolLM2 itself (a second backend with its own KV pool): every
    greedy draft is accepted, and the output equals plain decoding."""
    eng = Engine(model="smollm2-135m", device="cpu", levers=FORCE, spec={"method": "draft", "num_drafts": 4,
                                                           "draft_model": "smollm2-135m"})
    prompts = ["Once upon a time", "The capital of France is"]
    outs = eng.generate(prompts, greedy(16), use_tqdm=False)
    plain = smollm2.generate(prompts, greedy(16), use_tqdm=False)
    for a, b in zip(outs, plain):
        np.testing.assert_array_equal(a.token_ids, b.token_ids)
    stats = eng.speculator.stats()
    assert stats["acceptance_rate"] == 1.0 and stats["tokens_per_verify"] > 1.5
    eng.blocks.check_no_leaks([])


def test_draft_model_with_another_vocabulary_is_refused(tmp_path):
    with pytest.raises(ValueError, match="vocabulary"):
        Engine(model="smollm2-135m", device="cpu", spec={"method": "draft", "draft_model": "llama-3.2-1b-shape"},
               cache={"num_blocks": 64})


def test_draft_model_catch_up_fits_the_backend_step_budget(smollm2):
    """A draft model catching up with prompts longer than its backend's step budget (max_tokens,
    as on the CUDA backend) feeds them in several forwards and still drafts exactly."""
    eng = Engine(model="smollm2-135m", device="cpu", levers=FORCE, spec={"method": "draft", "num_drafts": 3,
                                                           "draft_model": "smollm2-135m"})
    drafter = eng.speculator.drafter
    drafter.backend.max_tokens = 5            # the prompts below are 6-9 tokens each
    calls = []
    forward = drafter.backend.forward
    drafter.backend.forward = lambda batch, *a, **k: calls.append(batch.num_tokens) or forward(batch, *a, **k)
    prompts = ["Once upon a time there was", "The capital of France is a city"]
    outs = eng.generate(prompts, greedy(8), use_tqdm=False)
    plain = smollm2.generate(prompts, greedy(8), use_tqdm=False)
    for a, b in zip(outs, plain):
        np.testing.assert_array_equal(a.token_ids, b.token_ids)
    assert calls and max(calls) <= 5
    assert eng.speculator.stats()["acceptance_rate"] == 1.0


def test_draft_model_rounds_split_when_more_sequences_than_the_budget(smollm2):
    """More drafting sequences than the draft backend's step budget: each round's one-token
    forward is split too, and the drafts stay exact."""
    eng = Engine(model="smollm2-135m", device="cpu", levers=FORCE, spec={"method": "draft", "num_drafts": 2,
                                                           "draft_model": "smollm2-135m"})
    drafter = eng.speculator.drafter
    drafter.backend.max_tokens = 2
    prompts = ["Once upon a time", "The capital of France is", "1, 2, 3,"]
    outs = eng.generate(prompts, greedy(6), use_tqdm=False)
    plain = smollm2.generate(prompts, greedy(6), use_tqdm=False)
    for a, b in zip(outs, plain):
        np.testing.assert_array_equal(a.token_ids, b.token_ids)
    assert eng.speculator.stats()["acceptance_rate"] == 1.0

