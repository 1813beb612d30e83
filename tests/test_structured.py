"""Structured output through llguidance on SmolLM2 (NumPy backend): JSON schema, regex, Lark grammar,
choice; refusal of grammars that do not compile; EOS once the grammar is complete; grammar masks
off inside a think span."""
import json
import re
import types

import jsonschema
import numpy as np
import pytest

from metrale import SamplingParams
from metrale.sampling.params import InvalidRequestError
from metrale.sampling.sampler import Sampler
from metrale.sampling.state import SamplingState, SpecialTokens

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def test_200_json_schema_generations_parse_and_validate(smollm2):
    n = 200
    params = [SamplingParams(max_tokens=40, temperature=0.8, seed=i, json_schema=SCHEMA) for i in range(n)]
    outs = smollm2.generate([f"Person {i} as JSON:" for i in range(n)], params, use_tqdm=False)
    texts = []
    for o in outs:
        assert o.finish_reason == "stop", (o.text, o.finish_reason)
        jsonschema.validate(json.loads(o.text), SCHEMA)
        texts.append(o.text)
    assert len(set(texts)) > 10          # sampled, not one greedy answer


def test_regex_lark_and_choice(smollm2):
    eos = set(smollm2.eos_ids)
    specs = [dict(regex=r"[0-9]{3}-[a-z]{2,4}"),
             dict(grammar='start: "The answer is " NUM "."\nNUM: /[1-9][0-9]?/'),
             dict(choice=["yes", "no", "maybe"])]
    prompts = ["Code:", "What is 6 times 7?", "Is the sky blue?"]
    outs = smollm2.generate(prompts, [SamplingParams(max_tokens=20, temperature=0.0, **s) for s in specs], use_tqdm=False)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", outs[0].text), outs[0].text
    assert re.fullmatch(r"The answer is [1-9][0-9]?\.", outs[1].text), outs[1].text
    assert outs[2].text in ("yes", "no", "maybe")
    for o in outs:     # the grammar completes, then EOS is forced
        assert o.finish_reason == "stop" and int(o.token_ids[-1]) in eos


def test_grammar_errors_are_refused_with_the_reason(smollm2):
    with pytest.raises(InvalidRequestError, match=r"^grammar: cannot be compiled: .*unknown name"):
        smollm2.add_request("Hi", SamplingParams(grammar="start: foo"))
    with pytest.raises(InvalidRequestError, match=r"^regex: cannot be compiled"):
        smollm2.generate(["a", "b"], [SamplingParams(), SamplingParams(regex="[a-")], use_tqdm=False)
    assert not smollm2.requests


def _row(params, prompt, tokenizer, special):
    st = SamplingState(params, prompt, tokenizer, (2,))
    st.special = special
    return types.SimpleNamespace(params=params, sampling=st, eos_masked=False, stop_ids={2}, seq=None)


def test_think_span_lifts_the_grammar(smollm2):
    tok = smollm2.tokenizer
    think, end_think = tok.encode("<|im_start|>")[0], tok.encode("<|im_end|>")[0]   # stand-ins for <think>, </think>
    free = tok.encode(" hello")[0]
    special = SpecialTokens(None, None, think, end_think)
    row = _row(SamplingParams(temperature=0.0, choice=["yes", "no"], max_tokens=8), [5, 6], tok, special)
    sampler = Sampler(smollm2.backend, smollm2.model_config.vocab_size)
    V = smollm2.model_config.vocab_size

    def step(favourite):
        logits = np.zeros((1, V), np.float32)
        logits[0, favourite] = 50.0
        sampler.start_masks([row])
        masks = sampler.finish_masks()
        return int(sampler.sample(logits, [row], masks)[0])

    assert step(think) == think                  # the first token may open a think span
    assert step(free) == free                    # no grammar inside it
    assert step(end_think) == end_think
    got = step(free)                             # the grammar is back: " hello" is not allowed
    assert got != free and tok.decode([got]) in ("yes", "no", "y", "n", "ye")
