"""Streamed responses that fall behind the engine: a stream's queued deltas leave as one event
with the same text, tokens and logprobs, and an error is never folded into another delta."""
import json
import re
import time

import httpx
import numpy as np

from fake_model import FakeTokenizer, fake_engine, reference_continuation
from metrale.outputs import StreamDelta
from metrale.server import ServerThread, create_app
from metrale.server.app import _coalesce


def _d(rid, text, ids, reason=None, index=0, lps=None):
    return StreamDelta(rid, text, np.asarray(ids, dtype=np.int32), reason, index, lps)


def test_coalesce_merges_each_choice_in_order():
    ready = [(0, _d("a", "x", [1], lps=[{1: -0.1}])), (1, _d("b", "p", [7])), (0, _d("a", "y", [2], lps=[{2: -0.2}])),
             (1, _d("b", "q", [8], "stop")), (0, _d("a", "z", [3], "length", lps=[{3: -0.3}]))]
    out = _coalesce(ready)
    assert [c for c, _ in out] == [0, 1]
    a, b = out[0][1], out[1][1]
    assert (a.text, a.token_ids.tolist(), a.finish_reason) == ("xyz", [1, 2, 3], "length")
    assert a.logprobs == [{1: -0.1}, {2: -0.2}, {3: -0.3}]
    assert (b.text, b.token_ids.tolist(), b.finish_reason, b.logprobs) == ("pq", [7, 8], "stop", None)


def test_coalesce_keeps_errors_apart():
    out = _coalesce([(0, _d("a", "x", [1])), (0, _d("a", "", [], "error: boom"))])
    assert [d.finish_reason for _, d in out] == [None, "error: boom"]


def test_a_stream_behind_the_engine_gets_all_its_text_in_fewer_events():
    """The engine loop runs ahead of a consumer that reads slowly: every token still arrives,
    in order, and the events number fewer than the tokens."""
    engine = fake_engine(num_blocks=256)
    prompt, n = "hello there", 48
    want = reference_continuation(FakeTokenizer().encode(prompt), n)
    with ServerThread(create_app(engine)) as srv:
        events = []
        body = {"prompt": prompt, "max_tokens": n, "temperature": 0.0, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=60) as c, c.stream("POST", srv.url + "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
                    if len(events) == 1:
                        time.sleep(0.3)      # fall behind: the engine finishes meanwhile
    text = "".join(e["choices"][0]["text"] for e in events)
    assert [int(t) for t in re.findall(r"<(\d+)>", text)] == want
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert len(events) < n


# ------------------------------------------------------------ the cost of a request is bounded first
import socket

import pytest

from metrale.server.serve import api_key


@pytest.fixture(scope="module")
def srv():
    engine = fake_engine(num_blocks=512, **{"server.read_timeout_s": 0.5, "server.header_timeout_s": 0.5,
                                            "scheduler.max_num_seqs": 8})
    with ServerThread(create_app(engine)) as s:
        s.engine = engine
        yield s


def _post(srv, body, path="/v1/completions"):
    return httpx.post(srv.url + path, json=body, timeout=30)


def test_unknown_model_is_404(srv):
    r = _post(srv, {"model": "gpt-9", "prompt": "hi"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_max_tokens_past_the_context_is_400(srv):
    r = _post(srv, {"prompt": "hi", "max_tokens": 10**6})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "max_tokens" and "maximum context length is 4096" in err["message"]


def test_huge_n_is_refused_before_any_work(srv):
    t0 = time.monotonic()
    r = _post(srv, {"prompt": ["a", "b", "c", "d"], "n": 100_000_000, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    assert "exceed scheduler.max_num_seqs (8)" in r.json()["error"]["message"]
    r = _post(srv, {"prompt": ["a", "b", "c"], "n": 3, "max_tokens": 2})      # 9 sequences > 8
    assert r.status_code == 400
    assert time.monotonic() - t0 < 5
    assert httpx.get(srv.url + "/health").status_code == 200


def test_deeply_nested_body_is_400(srv):
    deep = "[" * 100_000 + "]" * 100_000
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=30, headers={"Content-Type": "application/json"},
                   content=('{"messages": [{"role": "user", "content": "hi"}], "tools": ' + deep + '}').encode())
    assert r.status_code == 400 and "max_json_depth" in r.json()["error"]["message"]
    shallow_but_deep = {"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}
    node = shallow_but_deep["response_format"]["json_schema"]["schema"]
    for _ in range(100):
        node["items"] = {}
        node = node["items"]
    assert _post(srv, shallow_but_deep).status_code == 400


def test_client_chat_templates_are_off_by_default(srv):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "chat_template_kwargs": {"chat_template": "{% for i in range(10**9) %}x{% endfor %}"}}
    r = _post(srv, body, "/v1/chat/completions")
    assert r.status_code == 400 and "allow_client_chat_template" in r.json()["error"]["message"]


def test_a_half_sent_body_times_out_with_408(srv):
    with socket.create_connection((srv.host, srv.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"prompt\":")
        reply = s.recv(4096)
    assert reply.startswith(b"HTTP/1.1 408"), reply[:80]
    assert _post(srv, {"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_connections_that_never_finish_their_headers_are_closed(srv):
    for first in (b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"):     # silent, and slowloris
        with socket.create_connection((srv.host, srv.port), timeout=10) as s:
            if first:
                s.sendall(first)
            t0 = time.monotonic()
            assert s.recv(4096) == b""            # the server closed it
            assert time.monotonic() - t0 < 5
    assert _post(srv, {"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_openapi_schema_is_served(srv):
    r = httpx.get(srv.url + "/openapi.json")
    assert r.status_code == 200 and "/v1/chat/completions" in r.json()["paths"]


def test_api_key_sources(tmp_path):
    f = tmp_path / "key"
    f.write_text("sk-file\n")
    assert api_key("sk-cli", str(f), "sk-env") == "sk-cli"
    assert api_key(None, str(f), "sk-env") == "sk-file"
    assert api_key(None, None, "sk-env") == "sk-env"
    assert api_key(None, None, None) is None
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(OSError):
        api_key(None, str(tmp_path / "empty"), None)


def test_256_streams_half_disconnecting_leave_nothing_running():
    """256 concurrent streams, half of them hung up after their first chunk: every other one
    completes with its whole text, and at idle /metrics shows 0 running requests and 0 KV in use."""
    import asyncio
    from bench.loadtest import Connection

    engine = fake_engine(num_blocks=4096, **{"scheduler.max_num_seqs": 256})
    n_tok = 24

    async def one(url, i):
        conn = Connection(url, {})
        body = {"prompt": f"p{i:03d}", "max_tokens": n_tok, "temperature": 0.0, "ignore_eos": True, "stream": True}
        text = ""
        try:
            async for payload in conn.post_stream("/v1/completions", body):
                if payload == b"[DONE]":
                    break
                text += json.loads(payload)["choices"][0]["text"]
                if i % 2:
                    return None                  # hang up mid-stream
        finally:
            conn.close()
        return text

    with ServerThread(create_app(engine)) as s:
        async def main():
            return await asyncio.gather(*(one(s.url, i) for i in range(256)))
        texts = asyncio.run(main())
        for i, text in enumerate(texts):
            if i % 2 == 0:
                want = reference_continuation(FakeTokenizer().encode(f"p{i:03d}"), n_tok)
                assert [int(t) for t in re.findall(r"<(\d+)>", text)] == want, i
        deadline = time.monotonic() + 20
        while engine.has_unfinished() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)                          # a gauge update after the last step
        metrics = httpx.get(s.url + "/metrics").text
    assert not engine.has_unfinished()
    assert re.search(r"^metrale_requests_running 0$", metrics, re.M), metrics
    assert re.search(r"^metrale_kv_cache_usage_ratio 0(\.0)?$", metrics, re.M), metrics
    engine.blocks.check_no_leaks([])
