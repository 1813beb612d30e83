"""One bad request never hurts the requests batched with it.

Every SamplingParams field is range-checked by `validate` (an InvalidRequestError naming the field),
and a failure that still happens inside a step ends only the request that caused it: the step's
sequences are retried one by one and the others produce exactly the tokens of a run without it.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from fake_model import VOCAB, fake_engine, reference_continuation
from metrale import SamplingParams
from metrale.sampling.params import InvalidRequestError

GOOD_PROMPTS = [[1, 2, 3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17, 18]]


def good_params() -> list[SamplingParams]:
    return [SamplingParams(max_tokens=6, temperature=0.0),
            SamplingParams(max_tokens=6, temperature=0.8, seed=3, ignore_eos=True),
            SamplingParams(max_tokens=6, temperature=0.0, repetition_penalty=1.2)]


BAD = [
    (dict(top_k=2**31), "top_k"),
    (dict(top_k=True), "top_k"),
    (dict(top_k=2.5), "top_k"),
    (dict(temperature=1e300), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(temperature="hot"), "temperature"),
    (dict(repetition_penalty=1e-300), "repetition_penalty"),
    (dict(repetition_penalty=1e300), "repetition_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=float("nan")), "repetition_penalty"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(top_p=-0.1), "top_p"),
    (dict(min_p=float("nan")), "min_p"),
    (dict(min_p=-0.1), "min_p"),
    (dict(min_p="0.1"), "min_p"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(presence_penalty=float("nan")), "presence_penalty"),
    (dict(presence_penalty="1"), "presence_penalty"),
    (dict(frequency_penalty=-2.5), "frequency_penalty"),
    (dict(frequency_penalty=float("-inf")), "frequency_penalty"),
    (dict(n=0), "n/best_of"),
    (dict(n=-5), "n/best_of"),
    (dict(n=2.0), "n/best_of"),
    (dict(n=True), "n/best_of"),
    (dict(n=2, best_of=-1), "n/best_of"),
    (dict(best_of=10**9), "n/best_of"),
    (dict(n=10**9), "n/best_of"),
    (dict(seed=2**64), "seed"),
    (dict(seed=-2**63 - 1), "seed"),
    (dict(seed=10**100), "seed"),
    (dict(logit_bias={3: float("nan")}), "logit_bias"),
    (dict(logit_bias={3: float("inf")}), "logit_bias"),
    (dict(logit_bias={3: 101}), "logit_bias"),
    (dict(logit_bias={2**40: 1.0}), "logit_bias"),
    (dict(logit_bias={True: 1.0}), "logit_bias"),
    (dict(logit_bias={3: "x"}), "logit_bias"),
    (dict(logit_bias=[1, 2]), "logit_bias"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(max_tokens=True), "max_tokens"),
    (dict(max_tokens=2.0), "max_tokens"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=1.5), "min_tokens"),
    (dict(max_tokens=None, min_tokens=2**40), "min_tokens"),
    (dict(stop=["x"] * 65), "stop"),
    (dict(stop="y" * 10_000), "stop"),
    (dict(stop=[""]), "stop"),
    (dict(stop=[3]), "stop"),
    (dict(stop=5), "stop"),
    (dict(stop_token_ids=[VOCAB]), "stop_token_ids"),
    (dict(stop_token_ids=list(range(1, VOCAB)) * 20), "stop_token_ids"),
    (dict(stop_token_ids=7), "stop_token_ids"),
    (dict(logprobs=21), "logprobs"),
    (dict(logprobs=-1), "logprobs"),
    (dict(logprobs=1.0), "logprobs"),
    (dict(prompt_logprobs=10**6), "prompt_logprobs"),
    (dict(ignore_eos="yes"), "ignore_eos"),
    (dict(skip_special_tokens=None), "skip_special_tokens"),
    (dict(require_tool_call=1), "require_tool_call"),
    (dict(choice=["a"] * 0), "choice"),
    (dict(extra=[]), "extra"),
]


def _mixed(bad: dict) -> list[SamplingParams]:
    params = good_params()
    params.insert(1, SamplingParams(**{"max_tokens": 6, "temperature": 1.0, **bad}))
    return params


@pytest.mark.parametrize("kw, field", BAD, ids=[f"{f}-{i}" for i, (_, f) in enumerate(BAD)])
def test_out_of_range_field_is_refused_naming_it(kw, field):
    """Mixed into a batch of good requests: refused before any starts, never failing the step."""
    eng = fake_engine(num_blocks=64)
    prompts = GOOD_PROMPTS[:1] + [[20, 21, 22]] + GOOD_PROMPTS[1:]
    with pytest.raises(InvalidRequestError, match=rf"^{field}\b"):
        eng.generate(prompts, _mixed(kw), use_tqdm=False)
    assert not eng.requests and not eng.scheduler.has_work()
    eng.blocks.check_no_leaks([])


@pytest.mark.parametrize("kw", [dict(temperature=1e-300), dict(temperature=1e-7), dict(temperature=5e-324),
                                dict(top_p=1e-300), dict(top_k=10**6), dict(seed=-1), dict(seed=2**64 - 1),
                                dict(seed=-2**63), dict(repetition_penalty=0.01), dict(repetition_penalty=100.0),
                                dict(temperature=1e-3, top_k=2**31 - 1), dict(temperature=1e4)])
def test_edge_values_inside_the_range_run_beside_good_requests(kw):
    """Tiny temperatures are greedy (as vLLM's _SAMPLING_EPS); every value accepted runs to its end."""
    eng = fake_engine(num_blocks=64)
    prompts = GOOD_PROMPTS[:1] + [[20, 21, 22]] + GOOD_PROMPTS[1:]
    # ignore_eos: an unseeded draw at temperature 1e4 is near uniform and may hit EOS (then 'stop')
    outs = eng.generate(prompts, _mixed({**kw, "ignore_eos": True}), use_tqdm=False)
    assert [o.finish_reason for o in outs] == ["length"] * 4
    alone = fake_engine(num_blocks=64).generate(GOOD_PROMPTS, good_params(), use_tqdm=False)
    for o, a in zip([outs[0]] + outs[2:], alone):
        np.testing.assert_array_equal(o.token_ids, a.token_ids)
    eng.blocks.check_no_leaks([])


def test_tiny_temperature_is_greedy():
    assert SamplingParams(temperature=1e-300).greedy and SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=0.01).greedy
    eng = fake_engine()
    out = eng.generate([[5, 6, 7]], SamplingParams(max_tokens=5, temperature=1e-300), use_tqdm=False)[0]
    assert list(out.token_ids) == reference_continuation([5, 6, 7], 5)
    assert math.isfinite(out.metrics["latency"])


# ------------------------------------------------------------ failures inside a step

POISON = 95          # a token whose presence in a forward makes the poisoned backend raise
STEP_PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [7, 8, 9], [30, 31, 32, 33, 34], [40, 41, 42, 43, 44, 45, 46, 47]]


def step_params() -> list[SamplingParams]:
    return [SamplingParams(max_tokens=9, temperature=0.0),
            SamplingParams(max_tokens=7, temperature=0.9, seed=11, ignore_eos=True),
            SamplingParams(max_tokens=12, temperature=0.7, top_k=5, seed=5, logprobs=2),
            SamplingParams(max_tokens=10, temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5)]


def _engine(**settings):
    return fake_engine(num_blocks=96, block_size=4, **{"scheduler.max_num_batched_tokens": 8, **settings})


def _alone(**settings):
    return _engine(**settings).generate(STEP_PROMPTS, step_params(), use_tqdm=False)


def _with_bad(eng, bad_prompt, bad_params, at: int = 2):
    prompts, params = list(STEP_PROMPTS), step_params()
    prompts.insert(at, bad_prompt)
    params.insert(at, bad_params)
    outs = eng.generate(prompts, params, use_tqdm=False)
    return outs.pop(at), outs


def _assert_same(outs, alone):
    for o, a in zip(outs, alone):
        assert o.finish_reason == a.finish_reason
        np.testing.assert_array_equal(o.token_ids, a.token_ids)
        if a.logprobs is not None:
            assert o.logprobs == a.logprobs


def test_a_draw_that_overflows_ends_only_its_request():
    """top_k set past int32 after validation: the int32 overflow happens inside the step's draw."""
    eng = _engine()
    bad = SamplingParams(max_tokens=6, temperature=1.0)
    rid = eng.add_request([50, 51, 52], bad)
    bad.top_k = 2**31
    outs = eng.generate(STEP_PROMPTS, step_params(), use_tqdm=False)
    _assert_same(outs, _alone())
    assert not eng.is_running(rid) and eng.stats["steps"] > 0
    eng.blocks.check_no_leaks([])


class PoisonBackend:
    """Wraps a backend: a forward whose tokens include POISON raises."""

    def __init__(self, inner):
        self.inner = inner
        self.failures = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _check(self, batch):
        if (np.asarray(batch.token_ids) == POISON).any():
            self.failures += 1
            raise RuntimeError("poisoned forward")

    def forward(self, batch):
        self._check(batch)
        return self.inner.forward(batch)

    def forward_greedy(self, batch):
        self._check(batch)
        return self.inner.forward_greedy(batch)


@pytest.mark.parametrize("settings", [{}, {"levers.no_mix": True}, {"scheduler.max_num_batched_tokens": 64},
                                      {"spec.method": "ngram", "spec.num_drafts": 3}])
def test_a_failing_forward_ends_only_its_request(settings):
    eng = _engine(**settings)
    eng.backend = PoisonBackend(eng.backend)
    eng.sampler.device = None
    bad, outs = _with_bad(eng, [60, 61, POISON, 62, 63, 64], SamplingParams(max_tokens=5, temperature=0.0))
    assert bad.finish_reason == "error: RuntimeError: poisoned forward" and len(bad.token_ids) == 0
    assert eng.backend.failures > 0
    _assert_same(outs, _alone(**settings))
    eng.blocks.check_no_leaks([])


def test_a_request_that_turns_bad_mid_decode_ends_alone():
    """It emits POISON's neighbour only later: the forward fails once it is decoding beside others."""
    eng = _engine()
    eng.backend = PoisonBackend(eng.backend)
    prompt = [70, 71, 72]
    good = eng.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)[0]
    POISONED = int(good.token_ids[1])
    eng2 = _engine()
    eng2.backend = PoisonBackend(eng2.backend)
    eng2.backend._check = lambda batch: _raise_on(eng2.backend, batch, POISONED, len(prompt) + 1)
    bad, outs = _with_bad(eng2, prompt, SamplingParams(max_tokens=6, temperature=0.0), at=0)
    assert bad.finish_reason.startswith("error: RuntimeError") and list(bad.token_ids) == list(good.token_ids[:2])
    _assert_same(outs, _alone())
    eng2.blocks.check_no_leaks([])


def _raise_on(backend, batch, token: int, position: int) -> None:
    hit = (np.asarray(batch.token_ids) == token) & (np.asarray(batch.positions) == position)
    if hit.any():
        backend.failures += 1
        raise RuntimeError("poisoned forward")


def test_a_sampler_that_raises_for_one_request_spares_the_others():
    eng = _engine()
    draw = eng.sampler.draw

    def draw_or_raise(logits, states, masks=None):
        if any(st.params.extra.get("explode") for st in states):
            raise ValueError("attempt to get argmax of an empty sequence")
        return draw(logits, states, masks)

    eng.sampler.draw = draw_or_raise
    bad, outs = _with_bad(eng, [80, 81, 82, 83, 84], SamplingParams(max_tokens=5, temperature=0.5,
                                                                   extra={"explode": True}))
    assert bad.finish_reason == "error: ValueError: attempt to get argmax of an empty sequence"
    _assert_same(outs, _alone())
    eng.blocks.check_no_leaks([])


def test_a_stop_check_that_raises_ends_only_its_request():
    eng = _engine()
    rid = eng.add_request([90, 91, 92], SamplingParams(max_tokens=5, temperature=0.0))

    def broken(token):
        raise TypeError("TextInputSequence must be str")

    eng.requests[rid].append = broken
    outs = eng.generate(STEP_PROMPTS, step_params(), use_tqdm=False)
    _assert_same(outs, _alone())
    assert not eng.is_running(rid)
    eng.blocks.check_no_leaks([])
