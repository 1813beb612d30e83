"""Property-based fuzzing of every POST route (hypothesis): malformed, mistyped and out-of-range
bodies never get a 5xx, never a traceback, always an error body of the route's shape, and the
server still answers a normal request correctly afterwards."""
import json
import os

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fake_model import fake_engine
from metrale.server import ServerThread, create_app

ROUTES = ["/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses", "/tokenize", "/detokenize"]
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "max_output_tokens", "temperature",
          "top_p", "top_k", "min_p", "n", "best_of", "stop", "stop_sequences", "stop_token_ids", "seed", "logprobs",
          "top_logprobs", "logit_bias", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
          "stream", "stream_options", "echo", "tools", "tool_choice", "response_format", "guided_json",
          "guided_regex", "guided_choice", "system", "input", "instructions", "text", "tokens", "ignore_eos",
          "chat_template_kwargs", "skip_special_tokens"]

scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
                    st.sampled_from(["", "user", "assistant", "function", "json_schema", "auto", "text", "x" * 300]))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.sampled_from(["role", "content", "type",
                                                                                        "text", "name", "schema",
                                                                                        "json_schema", "function"]),
                                                                       inner, max_size=4)), max_leaves=12)
# a well-formed body of each route with one or two fields replaced: the values reach the engine
BASE = {"/v1/completions": {"prompt": "hi", "max_tokens": 2},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        "/v1/messages": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        "/v1/responses": {"input": "hi", "max_output_tokens": 2},
        "/tokenize": {"prompt": "hi"}, "/detokenize": {"tokens": [1, 2]}}
changes = st.dictionaries(st.sampled_from(FIELDS), values, min_size=1, max_size=2)


@pytest.fixture(scope="module")
def srv():
    engine = fake_engine(num_blocks=512, **{"scheduler.max_num_seqs": 16})
    with ServerThread(create_app(engine)) as s:
        with httpx.Client(base_url=s.url, timeout=30) as c:
            s.http = c
            yield s


def _check(r: httpx.Response, route: str) -> None:
    assert r.status_code < 500, (route, r.status_code, r.text[:300])
    assert "Traceback" not in r.text
    if r.status_code >= 400:
        err = r.json()
        if route == "/v1/messages":
            assert err["type"] == "error" and err["error"]["message"]
        else:
            assert err["error"]["message"] and err["error"]["type"]


EXAMPLES = int(os.environ.get("METRALE_FUZZ_EXAMPLES", "300"))   # docs/server.md's run: 2000


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(route=st.sampled_from(ROUTES), change=changes, stream=st.booleans())
def test_fuzzed_bodies_never_5xx(srv, route, change, stream):
    body = {**BASE[route], **change, **({"stream": True} if stream else {})}
    _check(srv.http.post(route, content=json.dumps(body).encode(),       # NaN / Infinity as Python writes them
                         headers={"Content-Type": "application/json"}), route)


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(route=st.sampled_from(ROUTES), raw=st.binary(max_size=200))
def test_raw_garbage_never_5xx(srv, route, raw):
    _check(srv.http.post(route, content=raw, headers={"Content-Type": "application/json"}), route)


def test_still_correct_after_fuzzing(srv):
    r = srv.http.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    assert srv.http.get("/health").status_code == 200
