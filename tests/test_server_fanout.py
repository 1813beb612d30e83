"""The server's n / best_of choices and logprobs, with the real `openai` client: answers equal the
engine's own (generate with the same SamplingParams), streamed and not. The fake model with a
spread distribution gives exact values; SmolLM2 checks real token texts."""
import json
import time

import httpx
import numpy as np
import openai
import pytest

from metrale import SamplingParams
from metrale.server import ServerThread, create_app
from test_fanout import spread_engine

PROMPT = "hello world"
MESSAGES = [{"role": "user", "content": "hi there"}]


def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)


def ids_of(tokens):
    return [tid(t) for t in tokens]


def tid(text: str) -> int:
    """A token id back from its text: the fake tokenizer decodes id N as "<N>"."""
    return int(text.removeprefix("token_id:").strip("<>"))


def params(**kw):
    return SamplingParams(**{"max_tokens": 5, "temperature": 1.0, "seed": 4, "ignore_eos": True, **kw})


IE = {"extra_body": {"ignore_eos": True}}


def wait_until(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return cond()


@pytest.fixture(scope="module")
def spread():
    ref = spread_engine()              # the expected answers: a twin engine, outside the server
    engine = spread_engine()
    with ServerThread(create_app(engine)) as srv:
        srv.ref, srv.engine = ref, engine
        yield srv
    engine.blocks.check_no_leaks([])


def test_completions_n_and_logprobs(spread):
    want = spread.ref.generate([PROMPT], params(n=2, logprobs=2), use_tqdm=False)[0]
    out = client(spread).completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=5, n=2, logprobs=2,
                                            seed=4, **IE)
    assert [c.index for c in out.choices] == [0, 1]
    for c, o in zip(out.choices, want.outputs):
        assert c.text == o.text and c.finish_reason == "length"
        lp = c.logprobs
        assert ids_of(lp.tokens) == o.token_ids.tolist()
        assert lp.token_logprobs == [e[t] for e, t in zip(o.logprobs, o.token_ids.tolist())]
        assert [{tid(k): v for k, v in d.items()} for d in lp.top_logprobs] == o.logprobs
        assert lp.text_offset == np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]).tolist()
    assert out.usage.completion_tokens == 10 and out.usage.prompt_tokens == len(PROMPT)

    chunks = list(client(spread).completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=5, n=2,
                                                    logprobs=2, seed=4, stream=True, **IE,
                                                    stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == 10
    for j, o in enumerate(want.outputs):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == j]
        assert "".join(c.text for c in mine) == o.text and mine[-1].finish_reason == "length"
        assert [t for c in mine for t in c.logprobs.token_logprobs] == out.choices[j].logprobs.token_logprobs
        assert [t for c in mine for t in c.logprobs.text_offset] == out.choices[j].logprobs.text_offset


def test_completions_best_of_and_several_prompts(spread):
    want = spread.ref.generate([PROMPT], params(n=1, best_of=3), use_tqdm=False)[0]
    out = client(spread).completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=5, best_of=3, seed=4, **IE)
    assert len(out.choices) == 1 and out.choices[0].text == want.text and out.choices[0].logprobs is None
    # two prompts x n=2: choice c is completion c % 2 of prompt c // 2
    prompts = [PROMPT, "other prompt"]
    want = spread.ref.generate(prompts, params(n=2), use_tqdm=False)
    out = client(spread).completions.create(model="smollm2-135m", prompt=prompts, max_tokens=5, n=2, seed=4,
                                            echo=True, **IE)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text for c in out.choices] == [p + o.text for p, w in zip(prompts, want) for o in w.outputs]
    assert out.usage.completion_tokens == 20


def test_chat_n_and_logprobs(spread):
    want = spread.ref.generate(["hi there"], params(n=2, logprobs=2), chat=True, use_tqdm=False)[0]
    out = client(spread).chat.completions.create(model="smollm2-135m", messages=MESSAGES, max_tokens=5, n=2,
                                                 logprobs=True, top_logprobs=2, seed=4, **IE)
    assert [c.index for c in out.choices] == [0, 1]
    for c, o in zip(out.choices, want.outputs):
        assert c.message.content == o.text
        items = c.logprobs.content
        assert ids_of([i.token for i in items]) == o.token_ids.tolist()
        assert [i.logprob for i in items] == [e[t] for e, t in zip(o.logprobs, o.token_ids.tolist())]
        for i, e in zip(items, o.logprobs):
            top = sorted(e.items(), key=lambda kv: -kv[1])[:2]
            assert [(tid(x.token), x.logprob) for x in i.top_logprobs] == top
            assert bytes(i.bytes).decode() == i.token
    assert out.usage.completion_tokens == 10

    chunks = list(client(spread).chat.completions.create(model="smollm2-135m", messages=MESSAGES, max_tokens=5,
                                                         n=2, logprobs=True, top_logprobs=2, seed=4, stream=True, **IE))
    for j, c in enumerate(out.choices):
        mine = [ch.choices[0] for ch in chunks if ch.choices[0].index == j]
        assert mine[0].delta.role == "assistant" and mine[-1].finish_reason == "length"
        assert "".join(m.delta.content or "" for m in mine) == c.message.content
        streamed = [i for m in mine if m.logprobs for i in m.logprobs.content]
        assert [(i.token, i.logprob) for i in streamed] == [(i.token, i.logprob) for i in c.logprobs.content]
    # logprobs without top_logprobs: the sampled token only
    out = client(spread).chat.completions.create(model="smollm2-135m", messages=MESSAGES, max_tokens=3,
                                                 logprobs=True, seed=4, **IE)
    assert len(out.choices[0].logprobs.content) == 3 and out.choices[0].logprobs.content[0].top_logprobs == []


@pytest.mark.parametrize("path, body, param, needle", [
    ("completions", {"prompt": "hi", "n": 0}, "n", "n/best_of"),
    ("completions", {"prompt": "hi", "n": 3, "best_of": 2}, "n", "n/best_of"),
    ("completions", {"prompt": "hi", "n": 100000}, "n", "max_num_seqs"),
    ("completions", {"prompt": "hi", "logprobs": 21}, "logprobs", "logprobs: "),
    ("chat/completions", {"messages": MESSAGES, "best_of": 2}, "best_of", "only /v1/completions"),
    ("chat/completions", {"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs", "needs logprobs"),
    ("chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 30}, "top_logprobs", "logprobs: "),
])
def test_bad_fanout_requests(spread, path, body, param, needle):
    r = httpx.post(f"{spread.url}/v1/{path}", json={"model": "smollm2-135m", **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"]


def test_disconnect_aborts_every_completion():
    engine = spread_engine()
    forward = engine.backend.forward
    engine.backend.forward = lambda batch, *a, **k: (time.sleep(0.003), forward(batch, *a, **k))[1]
    with ServerThread(create_app(engine)) as srv:
        with httpx.stream("POST", srv.url + "/v1/completions",
                          json={"prompt": PROMPT, "max_tokens": 300, "n": 3, "stream": True, "ignore_eos": True}) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(8)]
            assert any(line.startswith('data: {"id"') for line in got), got
        assert wait_until(lambda: not engine.has_unfinished())
        metrics = httpx.get(srv.url + "/metrics").text
    assert 'metrale_requests_total{finish_reason="abort"} 1' in metrics
    engine.blocks.check_no_leaks([])


# ------------------------------------------------------------------------------ SmolLM2
@pytest.fixture(scope="module")
def smol(smollm2):
    p = SamplingParams(max_tokens=4, temperature=1.0, seed=3, n=2, logprobs=2)
    expected = smollm2.generate(["What is the capital of France?"], p, chat=True, use_tqdm=False)[0]
    with ServerThread(create_app(smollm2)) as srv:
        srv.expected = expected
        yield srv
    assert not smollm2.has_unfinished()
    smollm2.blocks.check_no_leaks([])


def test_smollm2_chat_n_logprobs_equal_engine(smol, smollm2):
    kw = dict(model="smollm2-135m", messages=[{"role": "user", "content": "What is the capital of France?"}],
              max_tokens=4, n=2, logprobs=True, top_logprobs=2, seed=3)
    out = client(smol).chat.completions.create(**kw)
    chunks = list(client(smol).chat.completions.create(**kw, stream=True))
    for c, o in zip(out.choices, smol.expected.outputs):
        assert c.message.content == o.text
        items = c.logprobs.content
        # float32 logprobs of two runs batched differently (the second can reuse the first's cached
        # prefix): 2e-6 apart on an AMD EPYC box
        assert [i.logprob for i in items] == pytest.approx([e[t] for e, t in zip(o.logprobs, o.token_ids.tolist())],
                                                           rel=1e-4, abs=1e-5)
        special = smollm2.tokenizer.special_token_ids
        assert "".join(i.token for i, t in zip(items, o.token_ids.tolist()) if t not in special) == o.text
        assert all(len(i.top_logprobs) == 2 and i.top_logprobs[0].logprob >= i.logprob for i in items)
        streamed = [i for ch in chunks if ch.choices[0].index == c.index and ch.choices[0].logprobs
                    for i in ch.choices[0].logprobs.content]
        assert [(i.token, i.logprob) for i in streamed] == [(i.token, i.logprob) for i in items]
    assert out.usage.completion_tokens == sum(len(o.token_ids) for o in smol.expected.outputs)
    assert np.isfinite([i.logprob for c in out.choices for i in c.logprobs.content]).all()
    json.dumps(out.model_dump())
