"""End to end on the real SmolLM2 (NumPy backend): API, batching invariance, stops, streaming."""
import asyncio
import subprocess
import sys

import numpy as np
import pytest

from metrale import Engine, InvalidRequestError, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "def add(a, b):", "Once upon a time, in a land far"]


def test_generate_returns_text_and_int32_ids(smollm2):
    out = smollm2.generate(["Hello, my name is"], SamplingParams(max_tokens=5, temperature=0.0),
                           use_tqdm=False)[0]
    assert isinstance(out.text, str) and out.text
    assert out.token_ids.dtype == np.int32 and 1 <= len(out.token_ids) <= 5
    assert out.finish_reason in ("stop", "length")


def test_generate_from_token_id_array_equals_from_text(smollm2):
    ids = np.asarray(smollm2.tokenizer.encode(PROMPTS[0]), dtype=np.int64)
    a = smollm2.generate(ids, GREEDY, use_tqdm=False)[0]
    b = smollm2.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0]
    np.testing.assert_array_equal(a.token_ids, b.token_ids)
    assert a.text == b.text


def test_batched_equals_alone(smollm2):
    together = smollm2.generate(PROMPTS, GREEDY, use_tqdm=False)
    for prompt, out in zip(PROMPTS, together):
        alone = smollm2.generate([prompt], GREEDY, use_tqdm=False)[0]
        np.testing.assert_array_equal(out.token_ids, alone.token_ids)


def test_chat_answers_paris(smollm2):
    out = smollm2.generate(["What is the capital of France?"], SamplingParams(max_tokens=20, temperature=0.0),
                           chat=True, use_tqdm=False)[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"          # ended on <|im_end|>, which is not in the text
    assert "<|im_end|>" not in out.text


def test_max_tokens_gives_length(smollm2):
    out = smollm2.generate(["Count: one, two,"], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
                           use_tqdm=False)[0]
    assert len(out.token_ids) == 3 and out.finish_reason == "length"


def test_stop_string_truncates_and_never_leaks_into_stream(smollm2):
    full = smollm2.generate([PROMPTS[3]], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
                            use_tqdm=False)[0].text
    words = full.split()
    stop = " ".join(words[3:5])          # a stop string that spans tokens, in the middle of the text
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop])
    out = smollm2.generate([PROMPTS[3]], params, use_tqdm=False)[0]
    assert out.finish_reason == "stop"
    assert out.text == full[:full.index(stop)]
    streamed = "".join(d.text for d in smollm2.stream(PROMPTS[3], params))
    assert streamed == out.text and stop not in streamed


def test_stream_concatenation_equals_generate(smollm2):
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    deltas = list(smollm2.stream(PROMPTS[1], params))
    out = smollm2.generate([PROMPTS[1]], params, use_tqdm=False)[0]
    assert "".join(d.text for d in deltas) == out.text
    np.testing.assert_array_equal(np.concatenate([d.token_ids for d in deltas]), out.token_ids)
    assert deltas[-1].finish_reason == "length" and all(d.finish_reason is None for d in deltas[:-1])


def test_detokenize_false_gives_the_tokens_without_text(smollm2):
    """SamplingParams.detokenize=False (vLLM's field; the server's engine process uses it): the same
    tokens, no text in the output or the stream; stop strings, matched in the text, are refused."""
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    want = smollm2.generate([PROMPTS[1]], params, use_tqdm=False)[0]
    quiet = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, detokenize=False)
    out = smollm2.generate([PROMPTS[1]], quiet, use_tqdm=False)[0]
    np.testing.assert_array_equal(out.token_ids, want.token_ids)
    assert want.text and out.text == ""
    deltas = list(smollm2.stream(PROMPTS[1], quiet))
    assert all(d.text == "" for d in deltas)
    np.testing.assert_array_equal(np.concatenate([d.token_ids for d in deltas]), want.token_ids)
    with pytest.raises(InvalidRequestError, match="detokenize"):
        smollm2.add_request("hi", SamplingParams(stop=["x"], detokenize=False))


def test_async_stream(smollm2):
    async def collect():
        return [d async for d in smollm2.astream(PROMPTS[0], SamplingParams(max_tokens=4, temperature=0.0))]
    deltas = asyncio.run(collect())
    assert deltas[-1].finished


def test_seeded_sampling_is_reproducible(smollm2):
    p = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    a = smollm2.generate([PROMPTS[3]], p, use_tqdm=False)[0]
    b = smollm2.generate([PROMPTS[3], PROMPTS[0]], [p, GREEDY], use_tqdm=False)[0]
    np.testing.assert_array_equal(a.token_ids, b.token_ids)


@pytest.mark.parametrize("params, field", [
    (SamplingParams(max_tokens=0), "max_tokens"),
    (SamplingParams(temperature=-0.5), "temperature"),
    (SamplingParams(top_p=0.0), "top_p"),
    (SamplingParams(top_k=-3), "top_k"),
    (SamplingParams(logit_bias={10**7: 1.0}), "logit_bias"),
])
def test_invalid_params_are_refused_with_the_field(smollm2, params, field):
    with pytest.raises(InvalidRequestError, match=field):
        smollm2.add_request("hi", params)
    assert not smollm2.has_unfinished()


def test_empty_and_oversized_prompts_are_refused(smollm2):
    with pytest.raises(InvalidRequestError, match="empty"):
        smollm2.generate([""], use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="context"):
        smollm2.add_request(np.ones(smollm2.max_model_len + 5, dtype=np.int32), SamplingParams(max_tokens=1))
    with pytest.raises(InvalidRequestError, match="token ids"):
        smollm2.add_request(np.array([1, 2, 10**9]), SamplingParams(max_tokens=1))


def test_abort_ends_request_with_reason(smollm2):
    rid = smollm2.add_request(PROMPTS[0], SamplingParams(max_tokens=50, ignore_eos=True))
    smollm2.step()
    delta = smollm2.abort(rid)
    assert delta.finish_reason == "abort" and not smollm2.has_unfinished()
    smollm2.blocks.check_no_leaks([])


def test_cli_answers_paris_on_cpu():
    """The CLI on the embedded SmolLM2. float32 activations: the first token's top-2 margin is 0.08
    nats ("The" over "L"), inside the 8-bit road's logit error (docs/cpu.md), which answers in French."""
    out = subprocess.run([sys.executable, "-m", "metrale", "prompt=What is the capital of France?", "chat=true",
                          "max_tokens=20", "device=cpu", "levers.cpu_activations=f32"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
    assert "tok/s" in out.stderr and "loaded in" in out.stderr


def test_a_chat_transcript_template_ends_the_reply_at_the_next_turn():
    """A tokenizer whose chat template is a plain transcript (a pretrained model's) names the text of
    the next turn; chat requests stop there, and the caller's params are left as they were."""
    from fake_model import FakeTokenizer, fake_engine, reference_continuation
    e = fake_engine(num_blocks=64)
    prompt = [5, 6, 7]
    cont = reference_continuation(prompt, 12)
    stop_text = "".join(f"<{t}>" for t in cont[3:5])              # FakeTokenizer's text of tokens 3 and 4
    e.tokenizer = type("T", (FakeTokenizer,), {"chat_stop_strings": (stop_text,)})()
    e.encode_prompt = lambda p, chat=False, system=None: list(p)
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    out = e.generate([prompt], sp, chat=True, use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_text
    assert sp.stop is None
    plain = e.generate([prompt], sp, use_tqdm=False)[0]
    assert plain.finish_reason == "length" and len(plain.token_ids) == 12
