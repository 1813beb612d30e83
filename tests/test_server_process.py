"""The server with its engine in a process of its own (server.engine_process, engine_process.py).

A tiny random Llama with metrale's byte tokenizer (a real forward, a real tokenizer class, built in
a second) runs behind one server in this process and one in a child process: their greedy answers
must be equal. The fake engine (tests/fake_model.py, slowed down) carries the kill and shutdown
tests, where requests must be in flight when the engine process goes away.
"""
import asyncio
import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import httpx
import pytest

from metrale import Engine
from metrale.server import ServerThread, create_app
from metrale.server.engine_process import EngineProcess, EngineStartError
from metrale.settings import compose

PROMPTS = ["The capital of France is", "def add(a, b):", "1, 2, 3, 4,"]
TINY = ["model=tiny-shape", "device=cpu", "cache.num_blocks=512", "scheduler.max_num_seqs=64",
        "levers.cpu_kernels=numpy"]        # the NumPy reference: no CPU kernels to compile in each process


def build_tiny(cfg):
    """tiny-shape with a 259-id vocabulary and ByteTokenizer (a random preset borrows SmolLM2's
    tokenizer otherwise, whose GGUF takes seconds to read); random weights of seed 0, so the same
    in both processes."""
    from metrale.models.assemble import make_backend
    from metrale.models.checkpoint import random_model_config
    from metrale.models.registry import resolve_model
    from metrale.models.tokenizer import ByteTokenizer
    source = resolve_model("tiny-shape")
    config = replace(random_model_config(source.preset, source.name), vocab_size=ByteTokenizer.vocab_size)
    return Engine(cfg=cfg, parts=(config, ByteTokenizer(), make_backend("cpu", cfg, config, None)))


def build_slow_fake(cfg):
    """The fake engine, 5 ms a forward: long requests stay in flight for seconds."""
    from fake_model import fake_engine
    engine = fake_engine(num_blocks=1024, block_size=4)
    forward = engine.backend.forward
    engine.backend.forward = lambda *a, **k: (time.sleep(0.005), forward(*a, **k))[1]
    return engine


def build_that_dies(cfg):
    os._exit(3)


def children_of(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                out.append(int(entry))
    return out


def events(r) -> list[str]:
    return [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


def streamed(url: str, path: str, body: dict) -> tuple[str, str | None, list[str]]:
    """(the text, the finish reason, the raw events) of a streamed completion or chat."""
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        raw = events(r)
    text, finish = "", None
    for e in raw[:-1]:
        choice = json.loads(e)["choices"][0]
        text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
        finish = choice.get("finish_reason") or finish
    assert raw[-1] == "[DONE]"
    return text, finish, raw


def query(proc: EngineProcess, what: str = "state"):
    coro = proc.loop.engine_state() if what == "state" else proc.loop.metrics_text()
    return asyncio.run(coro)


def wait_until(cond, timeout=20.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.fixture(scope="module")
def pair():
    """(in-process server, engine-process server, the EngineProcess) around the same tiny model."""
    cfg = compose(TINY)
    with ThreadPoolExecutor(1) as pool:
        started = pool.submit(EngineProcess.start, cfg, build_tiny)      # spawns while this process builds its own
        local = build_tiny(cfg)
        proc = started.result()
    with ServerThread(create_app(local, cfg)) as here, ServerThread(create_app(proc, cfg)) as there:
        yield here, there, proc
    assert not proc.process.is_alive() and proc.process.exitcode == 0


# --------------------------------------------------------------------- same answers
def test_answers_equal_the_in_process_server(pair):
    here, there, _ = pair
    for prompt in PROMPTS:
        body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        a = httpx.post(here.url + "/v1/completions", json=body, timeout=60).json()
        b = httpx.post(there.url + "/v1/completions", json=body, timeout=60).json()
        assert a["choices"][0]["text"] == b["choices"][0]["text"] and b["choices"][0]["finish_reason"] == "length"
        assert a["usage"] == b["usage"] and b["usage"]["completion_tokens"] == 12
        assert streamed(here.url, "/v1/completions", body)[:2] == streamed(there.url, "/v1/completions", body)[:2] \
            == (a["choices"][0]["text"], "length")
    chat = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 10,
            "temperature": 0, "ignore_eos": True}
    a = httpx.post(here.url + "/v1/chat/completions", json=chat, timeout=60).json()
    b = httpx.post(there.url + "/v1/chat/completions", json=chat, timeout=60).json()
    assert a["choices"][0]["message"] == b["choices"][0]["message"] and a["usage"] == b["usage"]
    assert streamed(there.url, "/v1/chat/completions", chat)[:2] == (a["choices"][0]["message"]["content"], "length")
    assert httpx.get(there.url + "/v1/models").json()["data"][0]["max_model_len"] == \
        httpx.get(here.url + "/v1/models").json()["data"][0]["max_model_len"]


def test_n_logprobs_and_tokenize_cross_the_pipe(pair):
    here, there, _ = pair
    body = {"prompt": "seeded", "max_tokens": 6, "n": 2, "seed": 7, "logprobs": 2, "temperature": 0.8}
    a = httpx.post(here.url + "/v1/completions", json=body, timeout=60).json()
    b = httpx.post(there.url + "/v1/completions", json=body, timeout=60).json()
    assert a["choices"] == b["choices"] and len(b["choices"]) == 2 and b["choices"][1]["logprobs"]["tokens"]
    for path, req in (("/tokenize", {"prompt": "hello"}), ("/detokenize", {"tokens": [75, 76, 77]})):
        assert httpx.post(here.url + path, json=req).json() == httpx.post(there.url + path, json=req).json()


def test_the_loop_interface_streams_to_threads_and_tasks(pair):
    """ProcessLoop.stream / astream (EngineLoop's interface) give the in-process engine's tokens."""
    from metrale import SamplingParams
    _, _, proc = pair
    ids = proc.tokenizer.encode("library")
    params = SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)
    want = build_tiny(compose(TINY)).generate([ids], params, use_tqdm=False)[0].token_ids.tolist()
    assert [int(t) for d in proc.loop.stream("lib-thread", ids, params) for t in d.token_ids] == want

    async def tokens():
        return [int(t) async for d in proc.loop.astream("lib-task", ids, params) for t in d.token_ids]
    assert asyncio.run(tokens()) == want


def test_refusals_come_back_as_400s(pair):
    _, there, _ = pair
    r = httpx.post(there.url + "/v1/completions", json={"prompt": [9999], "max_tokens": 2})
    assert r.status_code == 400 and "[0, 259)" in r.json()["error"]["message"]
    r = httpx.post(there.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "temperature": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"


def test_32_concurrent_streams_finish_with_their_tokens(pair):
    _, there, proc = pair

    async def one(client, i):
        body = {"prompt": f"stream {i}", "max_tokens": 8 + i, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        async with client.stream("POST", there.url + "/v1/completions", json=body) as r:
            raw = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
        chunks = [json.loads(e) for e in raw[:-1]]
        finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        return raw[-1], finish[-1], chunks[-1]["usage"]["completion_tokens"]

    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))
    assert asyncio.run(main()) == [("[DONE]", "length", 8 + i) for i in range(32)]
    state = query(proc)
    assert state["requests"] == 0 and state["num_free"] == state["num_blocks"] and state["leak"] is None


def test_disconnect_aborts_in_the_engine_and_frees_its_blocks(pair):
    """A client that leaves mid-stream: its request is aborted in the engine. On a loaded machine the
    tiny model may finish all 2,000 tokens before the client's query arrives; then it tries again
    (only a disconnect while the request runs tests the abort)."""
    _, there, proc = pair
    for _ in range(3):
        with httpx.stream("POST", there.url + "/v1/completions", timeout=60,
                          json={"prompt": "long", "max_tokens": 2000, "ignore_eos": True, "stream": True}) as r:
            lines = r.iter_lines()
            assert any(next(lines).startswith("data: {") for _ in range(4))
            running = query(proc)["requests"] == 1
        if running:
            break
        assert wait_until(lambda: query(proc)["requests"] == 0)
    assert running, "the 2,000-token request finished before each of 3 disconnects"
    assert wait_until(lambda: query(proc)["requests"] == 0)
    state = query(proc)
    assert state["num_free"] == state["num_blocks"] and state["leak"] is None
    assert 'metrale_requests_total{finish_reason="abort"} 1' in httpx.get(there.url + "/metrics").text


def test_metrics_come_from_the_engine_process(pair):
    _, there, _ = pair
    httpx.post(there.url + "/v1/completions", json={"prompt": "metrics", "max_tokens": 4, "ignore_eos": True})
    values = {}
    for line in httpx.get(there.url + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    assert values['metrale_requests_total{finish_reason="length"}'] >= 1
    assert values["metrale_generation_tokens_total"] >= 4 and values["metrale_prompt_tokens_total"] >= 7
    assert values["metrale_requests_running"] == 0 and values["metrale_kv_cache_usage_ratio"] == 0.0
    assert values["metrale_time_to_first_token_seconds_count"] >= 1
    assert httpx.get(there.url + "/health").json() == {"status": "ok"}


# ------------------------------------------------------------------ failure and shutdown
def test_killing_the_engine_process_ends_requests_with_an_error():
    proc = EngineProcess.start(compose([]), build_slow_fake)
    srv = ServerThread(create_app(proc, compose([]))).start()
    got = {}

    def stream():
        with httpx.stream("POST", srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3000, "stream": True},
                          timeout=30) as r:
            got["stream"] = events(r)

    def whole():
        got["whole"] = httpx.post(srv.url + "/v1/chat/completions", timeout=30,
                                  json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3000})
    threads = [threading.Thread(target=stream), threading.Thread(target=whole)]
    try:
        for t in threads:
            t.start()
        assert wait_until(lambda: query(proc)["running"] == 2)
        os.kill(proc.pid, signal.SIGKILL)
        for t in threads:
            t.join(20)
        assert json.loads(got["stream"][-2])["error"]["message"] == "the engine process died (killed by SIGKILL)"
        assert got["stream"][-1] == "[DONE]"
        assert got["whole"].status_code == 500 and "engine process died" in got["whole"].json()["error"]["message"]
        assert httpx.get(srv.url + "/health").status_code == 503
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503
        assert r.json()["error"]["message"] == "the engine process is not running (killed by SIGKILL)"
    finally:
        srv.stop()
    assert not srv.thread.is_alive()


def test_shutdown_aborts_in_flight_requests_and_stops_the_engine_process():
    proc = EngineProcess.start(compose([]), build_slow_fake)
    srv = ServerThread(create_app(proc, compose(["server.shutdown_grace_s=0.3"]))).start()
    got = {}

    def stream():
        with httpx.stream("POST", srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3000, "stream": True},
                          timeout=30) as r:
            got["events"] = events(r)
    t = threading.Thread(target=stream)
    t.start()
    assert wait_until(lambda: query(proc)["running"] == 1)
    srv.stop()
    t.join(10)
    assert json.loads(got["events"][-2])["choices"][0]["finish_reason"] == "abort" and got["events"][-1] == "[DONE]"
    assert not proc.process.is_alive() and proc.process.exitcode == 0
    assert proc.pid not in children_of(os.getpid())


def test_start_up_errors_are_the_in_process_one_liners():
    bad = compose(["model=/no/such/model.gguf", "device=cpu"])
    with pytest.raises(Exception) as here:
        Engine(cfg=bad)
    with ThreadPoolExecutor(2) as pool:
        missing = pool.submit(EngineProcess.start, bad)
        dies = pool.submit(EngineProcess.start, compose([]), build_that_dies)
        with pytest.raises(EngineStartError) as there:
            missing.result()
        with pytest.raises(EngineStartError) as died:
            dies.result()
    assert str(there.value) == str(here.value) and "no such path" in str(there.value)
    assert str(died.value) == "the engine process exited during start-up (exit code 3)"


def test_engine_child_reader_applies_every_queued_command_and_survives_a_bad_frame():
    """The engine process's command reader takes all the frames one read brings (64 adds written at
    once reach the engine loop in order), a frame that does not unpickle is logged and skipped, and
    the pipe closing stops the loop."""
    import os
    import pickle
    import threading

    from metrale.server.engine_child import _Outbox, _read_commands
    from metrale.server.engine_process import _HEADER

    class Loop:
        def __init__(self):
            self.added, self.stopped = [], False

        def add_nowait(self, request_id, *args, **kwargs):
            self.added.append(request_id)

        def stop(self):
            self.stopped = True

    def frame(data: bytes) -> bytes:
        return _HEADER.pack(len(data)) + data

    r, w = os.pipe()
    ev_r, ev_w = os.pipe()
    loop = Loop()
    reader = threading.Thread(target=_read_commands, args=(r, {"loop": loop}, _Outbox(ev_w)), daemon=True)
    reader.start()
    adds = [("add", k, f"req-{k}", [1, 2], None, 0.0, False) for k in range(64)]
    blob = b"".join(frame(pickle.dumps(c)) for c in adds[:32]) + frame(b"not a pickle") + \
        b"".join(frame(pickle.dumps(c)) for c in adds[32:])
    os.write(w, blob)
    os.close(w)
    reader.join(10)
    assert not reader.is_alive() and loop.stopped
    assert loop.added == [f"req-{k}" for k in range(64)]
    for fd in (r, ev_r, ev_w):
        os.close(fd)


# ------------------------------------------------------------ text decoded in the server process
def test_server_decoded_text_equals_the_engines(pair):
    """Plain requests of token ids leave the engine process without text (detokenize=False) and
    are decoded here from their ids: a stop token that ends one is not text, special tokens are
    kept when asked, and a request with stop strings is still decoded in the engine. Every
    answer equals the in-process server's, whole and streamed."""
    from metrale import SamplingParams
    here, there, proc = pair
    prompt = "The capital of France is"
    ids = build_tiny(compose(TINY)).generate([proc.tokenizer.encode(prompt)], SamplingParams(
        max_tokens=24, temperature=3.0, seed=11, ignore_eos=True), use_tqdm=False)[0].token_ids.tolist()
    j = next(j for j in range(3, len(ids)) if ids[j] not in ids[:j])      # a token first drawn at step j
    stop_text = proc.tokenizer.decode(ids[2:4])
    bodies = [{"stop_token_ids": [ids[j]]}, {"stop_token_ids": [ids[j]], "skip_special_tokens": False},
              {"skip_special_tokens": False}, {"stop": [stop_text]} if stop_text else {}]
    assert proc.loop.decode_here               # server.decode_in_server, on by default
    try:
        for decode_here, extra in [(True, e) for e in bodies] + [(False, bodies[0])]:
            proc.loop.decode_here = decode_here
            body = {"prompt": prompt, "max_tokens": 24, "temperature": 3.0, "seed": 11, "ignore_eos": True, **extra}
            a = httpx.post(here.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
            b = httpx.post(there.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
            assert (a["text"], a["finish_reason"]) == (b["text"], b["finish_reason"]), extra
            assert streamed(there.url, "/v1/completions", body)[:2] == (a["text"], a["finish_reason"]), extra
    finally:
        proc.loop.decode_here = True
    a = httpx.post(there.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 24, "temperature": 3.0,
                                                        "seed": 11, "stop_token_ids": [ids[j]]}, timeout=60).json()
    assert a["choices"][0]["finish_reason"] == "stop" and a["usage"]["completion_tokens"] == j + 1


def test_remote_text_is_the_request_states():
    """_Remote.text (the server's decoding of a delta's ids) against RequestState's own text for
    the same ids in deltas of 1-3 tokens, ending by length and by a stop token; and which requests
    the server decodes."""
    import numpy as np

    from metrale import SamplingParams
    from metrale.models.tokenizer import ByteTokenizer
    from metrale.request import RequestState
    from metrale.scheduler.sequence import Sequence
    from metrale.server.engine_process import _decodes_here, _Remote
    tok, rng = ByteTokenizer(), np.random.default_rng(0)
    for trial in range(40):
        prompt = [int(t) for t in rng.integers(3, 259, 5)]
        out = [int(t) for t in rng.integers(3, 259, 12)]
        stop = out[-1] if trial % 2 else None
        params = SamplingParams(max_tokens=12, stop_token_ids=[stop] if stop is not None else None, ignore_eos=True,
                                skip_special_tokens=bool(trial % 3))
        state = RequestState(Sequence(prompt, params), tok, (2,), 1000)
        remote = _Remote("r", None, None, {0}, tok.incremental_decoder(prompt, params.skip_special_tokens))
        want = got = ""
        i = 0
        while i < len(out):
            k = min(int(rng.integers(1, 4)), len(out) - i)
            reason = None
            for t in out[i:i + k]:
                reason = state.append(t) if reason is None else reason
            i += k
            if i == len(out) and reason is None:
                reason = "length"
            d = state.delta(reason)
            want += d.text
            got += remote.text(d.token_ids, reason)
        assert got == want and want == state.text, trial
    ok = SamplingParams()
    assert _decodes_here([1, 2], ok) and not _decodes_here("text", ok)
    assert not _decodes_here([1, 2], SamplingParams(stop=["x"])) and not _decodes_here([1, 2], SamplingParams(n=2))
    assert not _decodes_here([1, 2], SamplingParams(detokenize=False))
