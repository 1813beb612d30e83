"""The OpenAI-compatible server, end to end over loopback HTTP with the real `openai` client.

The real SmolLM2 engine (CPU) checks that answers through the server equal the engine's own;
the fake engine (tests/fake_model.py) carries the concurrency, error, disconnect and shutdown
tests, where its outputs are known exactly (`reference_continuation`).
"""
import asyncio
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from fake_model import FakeBackend, FakeTokenizer, fake_engine, reference_continuation
from metrale import Engine, SamplingParams
from metrale.server import ServerThread, create_app
from metrale.server.app import supports_structured_output
from metrale.settings import compose

ROOT = str(Path(__file__).resolve().parents[1])
PROMPTS = ["The capital of France is", "def add(a, b):", "1, 2, 3, 4,", "Once upon a time"]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def client(srv, key="unused", **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=60, **kw)


def fake_ids(text: str) -> list[int]:
    """Token ids back from the fake decoder's '<id>' text."""
    return [int(t) for t in re.findall(r"<(\d+)>", text)]


def wait_until(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def slow(engine, seconds=0.005):
    forward = engine.backend.forward
    engine.backend.forward = lambda *a, **k: (time.sleep(seconds), forward(*a, **k))[1]
    return engine


# ------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def smol(smollm2):
    """A server around the session's SmolLM2 engine, and the engine's own greedy answers."""
    expected = {
        "completion": smollm2.generate(PROMPTS, GREEDY, use_tqdm=False),
        "chat": smollm2.generate(["What is the capital of France?"], SamplingParams(max_tokens=12, temperature=0.0),
                                 chat=True, use_tqdm=False)[0],
    }
    with ServerThread(create_app(smollm2)) as srv:
        srv.expected, srv.engine = expected, smollm2
        yield srv
    assert not smollm2.has_unfinished()
    smollm2.blocks.check_no_leaks([])


@pytest.fixture(scope="module")
def fake():
    engine = fake_engine(num_blocks=2048, block_size=4)
    with ServerThread(create_app(engine)) as srv:
        srv.engine = engine
        yield srv


@pytest.fixture
def slow_fake():
    engine = slow(fake_engine(num_blocks=1024, block_size=4))
    srv = ServerThread(create_app(engine, compose(["server.shutdown_grace_s=0.5"]))).start()
    srv.engine = engine
    yield srv
    srv.stop()


# ----------------------------------------------------------------------- real model (CPU)
def test_completion_equals_engine_generate(smol):
    out = client(smol).completions.create(model="smollm2-135m", prompt=PROMPTS[0], max_tokens=8,
                                          temperature=0.0, extra_body={"ignore_eos": True})
    assert out.choices[0].text == smol.expected["completion"][0].text
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 8 and out.usage.prompt_tokens == 5


def test_concurrent_completions_batch_and_equal_engine(smol):
    async def main():
        c = openai.AsyncOpenAI(base_url=smol.url + "/v1", api_key="x", max_retries=0)
        return await asyncio.gather(*(c.completions.create(model="smollm2-135m", prompt=p, max_tokens=8,
                                                           temperature=0.0, extra_body={"ignore_eos": True})
                                      for p in PROMPTS))
    outs = asyncio.run(main())
    assert [o.choices[0].text for o in outs] == [e.text for e in smol.expected["completion"]]


def test_completion_stream_with_usage(smol):
    chunks = list(client(smol).completions.create(
        model="smollm2-135m", prompt=PROMPTS[1], max_tokens=8, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == smol.expected["completion"][1].text
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


def test_chat_and_chat_stream(smol):
    c = client(smol)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    out = c.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=12, temperature=0.0)
    msg = out.choices[0].message
    assert msg.role == "assistant" and msg.content == smol.expected["chat"].text and "Paris" in msg.content
    assert out.choices[0].finish_reason == "stop" and not msg.tool_calls
    parts = list(c.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=12, temperature=0.0,
                                           stream=True))
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts) == msg.content
    assert parts[-1].choices[0].finish_reason == "stop"


def test_structured_output_or_a_clear_400(smol):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    msgs = [{"role": "user", "content": "Which city is the capital of France? Answer in JSON."}]
    c = client(smol)
    if not supports_structured_output(smol.engine):
        with pytest.raises(openai.BadRequestError) as err:
            c.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=20, response_format=fmt)
        assert err.value.body["param"] == "response_format" and "not supported" in err.value.body["message"]
        return
    import jsonschema
    out = c.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=30, temperature=0.0,
                                    response_format=fmt)
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
    with pytest.raises(openai.BadRequestError) as err:
        c.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=5, response_format=bad_schema)
    assert err.value.body["param"] == "response_format" and "json_schema" in err.value.body["message"]
    out = c.completions.create(model="smollm2-135m", prompt="Is Paris in France? Answer:", max_tokens=5,
                               extra_body={"guided_choice": ["yes", "no"]})
    assert out.choices[0].text in ("yes", "no")


def test_tools_are_rendered_into_the_prompt(smollm2):
    server = create_app(smollm2).state.server      # not started: only the template is used
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                               "parameters": {"type": "object"}}}]
    prompt, spec, _ = server.render_chat([{"role": "user", "content": "Weather in Paris?"}], {"tools": tools})
    assert spec.parse and "<tools>" in prompt and "get_weather" in prompt and "<tool_call>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


# --------------------------------------------------------------------- fake engine: load
def test_64_concurrent_streams_all_finish_with_the_right_tokens(fake):
    prompts = [f"client {i} says hello" for i in range(64)]

    async def one(c, prompt):
        text, reasons = "", []
        stream = await c.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=24, stream=True)
        async for chunk in stream:
            text += chunk.choices[0].text
            reasons.append(chunk.choices[0].finish_reason)
        return text, reasons

    async def main():
        c = openai.AsyncOpenAI(base_url=fake.url + "/v1", api_key="x", max_retries=0, timeout=60)
        return await asyncio.gather(*(one(c, p) for p in prompts))
    outs = asyncio.run(main())
    tok = FakeTokenizer()
    for prompt, (text, reasons) in zip(prompts, outs):
        assert fake_ids(text) == reference_continuation(tok.encode(prompt), 24)
        # a stream that fell behind may get several steps, its finish included, in one chunk
        assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])
    assert wait_until(lambda: fake.engine.blocks.num_free == fake.engine.blocks.num_blocks)
    assert max(b.num_seqs for b in fake.engine.backend.batches) > 8     # they really were batched


def test_batch_of_prompts_in_one_completion(fake):
    out = client(fake).completions.create(model="smollm2-135m", prompt=["ab", [5, 6, 7]], max_tokens=3)
    assert [c.index for c in out.choices] == [0, 1]
    assert fake_ids(out.choices[1].text) == reference_continuation([5, 6, 7], 3)
    assert out.usage.prompt_tokens == 5 and out.usage.completion_tokens == 6


def test_echo_and_model_card(fake):
    out = client(fake).completions.create(model="smollm2-135m", prompt="ab", max_tokens=2, echo=True)
    assert out.choices[0].text.startswith("ab<") and len(fake_ids(out.choices[0].text)) == 2
    assert client(fake).models.retrieve("smollm2-135m").max_model_len == 4096
    assert httpx.get(fake.url + "/v1/models/gpt-9").status_code == 404


def test_engine_failure_ends_requests_with_an_error():
    engine = fake_engine()

    def broken(batch):
        raise RuntimeError("device on fire")
    engine.backend.forward = broken
    with ServerThread(create_app(engine)) as srv:
        r = httpx.post(srv.url + "/v1/completions", json=_cmpl(max_tokens=4))
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        assert "device on fire" in r.json()["error"]["message"]
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json=_chat(max_tokens=4, stream=True)) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert "device on fire" in json.loads(events[-2])["error"]["message"] and events[-1] == "[DONE]"
        assert not engine.has_unfinished() and engine.blocks.num_free == engine.blocks.num_blocks


def test_loadtest_runs_against_the_fake_engine(capsys):
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from bench.loadtest import main
    assert main(["--fake", "--clients", "8", "--requests", "24", "--duration", "5", "--max-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "24 requests (0 errors)" in out and "TTFT ms" in out and "ITL  ms" in out


def test_metrics(fake):
    client(fake).completions.create(model="smollm2-135m", prompt="metrics", max_tokens=4)
    text = httpx.get(fake.url + "/metrics").text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    assert values['metrale_requests_total{finish_reason="length"}'] >= 1
    assert values["metrale_generation_tokens_total"] >= 4 and values["metrale_prompt_tokens_total"] >= 7
    assert values["metrale_requests_waiting"] == 0 and values["metrale_requests_running"] == 0
    assert values["metrale_kv_cache_usage_ratio"] == 0.0
    ttft = values["metrale_time_to_first_token_seconds_count"]
    assert ttft >= 1 and values['metrale_time_to_first_token_seconds_bucket{le="+Inf"}'] == ttft
    assert values["metrale_inter_token_latency_seconds_count"] >= 3
    assert "# TYPE metrale_inter_token_latency_seconds histogram" in text


def test_models_and_health(fake):
    assert [m.id for m in client(fake).models.list()] == ["smollm2-135m"]
    assert httpx.get(fake.url + "/health").json() == {"status": "ok"}


# ------------------------------------------------------------------------- fake: errors
def _chat(**kw):
    return {"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}], **kw}


def _cmpl(**kw):
    return {"model": "smollm2-135m", "prompt": "hi", **kw}


@pytest.mark.parametrize("path, body, param, needle", [
    ("completions", b"{not json", None, "not valid JSON"),
    ("completions", b"[1, 2]", None, "JSON object"),
    ("completions", _cmpl(model=["a"]), "model", "expected a string"),
    ("completions", _cmpl(max_tokens="lots"), "max_tokens", "expected an integer"),
    ("completions", _cmpl(temperature="hot"), "temperature", "expected a number"),
    ("completions", _cmpl(stop=3), "stop", "string or an array"),
    ("completions", _cmpl(prompt={"a": 1}), "prompt", "expected a string"),
    ("completions", _cmpl(prompt=""), "prompt", "empty"),
    ("completions", _cmpl(temperature=-1), "temperature", "temperature: "),
    ("completions", _cmpl(top_p=1.5), "top_p", "top_p: "),
    ("completions", _cmpl(max_tokens=0), "max_tokens", "max_tokens: "),
    ("completions", _cmpl(presence_penalty=3), "presence_penalty", "presence_penalty: "),
    ("completions", _cmpl(logit_bias={"100000": 1}), "logit_bias", "logit_bias: "),
    ("completions", _cmpl(logit_bias={"the": 1}), "logit_bias", "token id"),
    ("completions", _cmpl(stop_token_ids=[5, 10**6]), "stop_token_ids", "stop_token_ids: "),
    ("completions", _cmpl(prompt="x" * 5000), "prompt", "4096"),
    ("completions", _cmpl(n=0), "n", "n/best_of: "),
    ("completions", _cmpl(logprobs=21), "logprobs", "logprobs: "),
    ("chat/completions", _chat(max_completion_tokens=-1), "max_completion_tokens", "max_tokens: "),
    ("chat/completions", _chat(messages="hi"), "messages", "non-empty array"),
    ("chat/completions", _chat(messages=[{"role": "wizard", "content": "x"}]), "messages", "role"),
    ("chat/completions", _chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "messages",
     "only text parts"),
    ("chat/completions", _chat(messages=[{"role": "user", "content": "x" * 5000}]), "messages", "4096"),
    ("chat/completions", _chat(response_format={"type": "yaml"}), "response_format", "type must be"),
    ("chat/completions", _chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": 5}}),
     "response_format", "schema"),
    ("chat/completions", _chat(tool_choice="required"), "tool_choice", "needs tools"),
    ("chat/completions", _chat(logprobs=True, top_logprobs=21), "top_logprobs", "logprobs: "),
    ("chat/completions", _chat(stream_options={"include_usage": True}), "stream_options", "stream=true"),
])
def test_bad_requests_get_openai_errors(fake, path, body, param, needle):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{fake.url}/v1/{path}", content=content, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["code"] is None
    assert needle in err["message"]
    assert not fake.engine.has_unfinished() or wait_until(lambda: not fake.engine.has_unfinished())


def test_openai_client_raises_bad_request(fake):
    with pytest.raises(openai.BadRequestError) as err:
        client(fake).chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": "x"}],
                                             temperature=-2)
    assert err.value.status_code == 400 and err.value.body["param"] == "temperature"


def test_body_over_limit_gets_413():
    engine = fake_engine()
    with ServerThread(create_app(engine, compose(["server.max_body_bytes=1000"]))) as srv:
        r = httpx.post(srv.url + "/v1/completions", json=_cmpl(prompt="x" * 2000))
        assert r.status_code == 413 and "max_body_bytes" in r.json()["error"]["message"]
        assert httpx.post(srv.url + "/v1/completions", json=_cmpl(max_tokens=2)).status_code == 200


def test_api_key():
    engine = fake_engine()
    with ServerThread(create_app(engine, compose(["server.api_key=sk-test"]))) as srv:
        with pytest.raises(openai.AuthenticationError):
            client(srv, key="wrong").completions.create(model="smollm2-135m", prompt="hi", max_tokens=2)
        r = httpx.get(srv.url + "/v1/models")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(srv.url + "/metrics").status_code == 401
        assert httpx.get(srv.url + "/health").status_code == 200
        out = client(srv, key="sk-test").completions.create(model="smollm2-135m", prompt="hi", max_tokens=2)
        assert out.choices[0].finish_reason == "length"


# -------------------------------------------------------- fake: disconnect and shutdown
def test_disconnect_mid_stream_aborts_and_frees_kv(slow_fake):
    engine = slow_fake.engine
    with httpx.stream("POST", slow_fake.url + "/v1/completions",
                      json=_cmpl(max_tokens=3000, stream=True)) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: {") for line in got)
        assert engine.blocks.num_free < engine.blocks.num_blocks
    assert wait_until(lambda: engine.blocks.num_free == engine.blocks.num_blocks and not engine.has_unfinished())
    engine.blocks.check_no_leaks([])
    assert 'metrale_requests_total{finish_reason="abort"} 1' in httpx.get(slow_fake.url + "/metrics").text


def test_disconnect_while_waiting_for_a_whole_response_aborts(slow_fake):
    engine = slow_fake.engine
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(slow_fake.url + "/v1/chat/completions", json=_chat(max_tokens=3000), timeout=0.3)
    assert wait_until(lambda: engine.blocks.num_free == engine.blocks.num_blocks and not engine.has_unfinished())


def test_graceful_shutdown_finishes_short_and_aborts_long(slow_fake):
    results = {}

    def stream(name, max_tokens):
        with httpx.stream("POST", slow_fake.url + "/v1/completions",
                          json=_cmpl(max_tokens=max_tokens, stream=True), timeout=30) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        results[name] = (json.loads(events[-2])["choices"][0]["finish_reason"], events[-1])

    threads = [threading.Thread(target=stream, args=("short", 40)), threading.Thread(target=stream, args=("long", 3000))]
    for t in threads:
        t.start()
    assert wait_until(lambda: slow_fake.engine.scheduler.running and len(slow_fake.engine.requests) == 2)
    slow_fake.stop()                                # drain: grace 0.5 s, then abort
    for t in threads:
        t.join(10)
    assert results == {"short": ("length", "[DONE]"), "long": ("abort", "[DONE]")}
    assert not slow_fake.thread.is_alive() and not slow_fake.engine.has_unfinished()
    with pytest.raises(httpx.ConnectError):
        httpx.get(slow_fake.url + "/health")


# ------------------------------------------------------ fake: reasoning and tool calls
SCRIPT = ["<think>", "Need the ", "weather.", "</think>", "\n\n", "<tool_", "call>\n", '{"name": "get_weather", ',
          '"arguments": {"city": ', '"Paris"}}', "\n</tool_call>", "<|im_end|>"]


class ScriptedTokenizer(FakeTokenizer):
    """Decodes whatever the fake model samples as the next piece of SCRIPT."""

    def incremental_decoder(self, prompt_ids=(), skip_special_tokens=True):
        pieces = iter(SCRIPT + [""] * 1000)
        return type("D", (), {"feed": lambda self, t: next(pieces), "flush": lambda self: ""})()


@pytest.fixture(scope="module")
def scripted():
    backend = FakeBackend(256, 4)
    engine = Engine(cfg=compose(["cache.block_size=4"]), parts=(backend.config, ScriptedTokenizer(), backend))
    with ServerThread(create_app(engine)) as srv:
        yield srv


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


def test_tool_call_and_reasoning(scripted):
    out = client(scripted).chat.completions.create(
        model="smollm2-135m", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS,
        stop=["<|im_end|>"], max_tokens=50)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert choice.message.reasoning_content == "Need the weather."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert call.id.startswith("call_") and call.type == "function"


def test_tool_call_and_reasoning_streamed(scripted):
    chunks = list(client(scripted).chat.completions.create(
        model="smollm2-135m", messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS,
        stop=["<|im_end|>"], max_tokens=50, stream=True))
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "Need the weather."
    assert "".join(d.content or "" for d in deltas) == ""
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    assert len(calls) == 1 and calls[0].index == 0 and json.loads(calls[0].function.arguments) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_without_tools_the_span_stays_content(scripted):
    out = client(scripted).chat.completions.create(
        model="smollm2-135m", messages=[{"role": "user", "content": "Weather?"}], stop=["<|im_end|>"], max_tokens=50)
    assert out.choices[0].finish_reason == "stop" and "<tool_call>" in out.choices[0].message.content


# ---------------------------------------------------------------------------------- CLI
def test_serve_cli_help_and_bad_setting(capsys):
    from metrale.__main__ import main
    assert main(["serve", "--help"]) == 0 and "server.api_key" in capsys.readouterr().out
    assert main(["serve", "server.port=70000"]) == 2 and "server.port" in capsys.readouterr().err
    assert main(["serve", "server.bogus=1"]) == 2 and "valid settings of server" in capsys.readouterr().err


def test_python_m_metrale_serve_starts_and_stops_on_sigterm():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "metrale", "serve", "device=cpu", f"server.port={port}",
                             "levers.cpu_kernels=numpy"],      # no CPU kernels to compile (seconds on 2 cores)
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"

        def up():
            try:
                return httpx.get(url + "/health").status_code == 200
            except httpx.TransportError:
                return proc.poll() is not None
        assert wait_until(up, 120) and proc.poll() is None, proc.stderr.read() if proc.poll() is not None else ""
        out = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "model": "smollm2-135m", "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 12, "temperature": 0}).json()
        assert "Paris" in out["choices"][0]["message"]["content"]
        children = _children(proc.pid)     # server.engine_process (the default): the engine process (and
        engines = [pid for pid in children if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(engines) == 1           # multiprocessing's resource tracker)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert wait_until(lambda: not any(Path(f"/proc/{pid}").exists() for pid in children), 10), "orphans"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = proc.stderr.read()
    assert "serving smollm2-135m" in err and "engine process" in err


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            pass
    return out


def test_templates_that_know_tools_get_them_as_tools():
    seen = {}

    class ToolTemplateTokenizer(FakeTokenizer):
        chat_template = "{% if tools %}{{ tools | tojson }}{% endif %}..."

        def apply_chat_template(self, messages, add_generation_prompt=True, tools=None, **kwargs):
            seen.update(messages=messages, tools=tools, kwargs=kwargs)
            return "rendered <think>\n"

    engine = fake_engine()
    engine.tokenizer = ToolTemplateTokenizer()
    server = create_app(engine).state.server          # not started: only the template is used
    msgs = [{"role": "user", "content": "hi"}, {"role": "tool", "content": "42"}]
    _, spec, in_think = server.render_chat(msgs, {"tools": TOOLS, "tool_choice": "required",
                                                  "chat_template_kwargs": {"enable_thinking": True}})
    assert seen["tools"] == TOOLS and seen["kwargs"] == {"enable_thinking": True}
    assert seen["messages"][0]["role"] == "system" and "must call" in seen["messages"][0]["content"]
    assert seen["messages"][-1] == {"role": "tool", "content": "42"}     # left for the template
    assert spec.require and in_think
