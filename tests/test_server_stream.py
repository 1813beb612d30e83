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
