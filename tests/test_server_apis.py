"""Anthropic's Messages API and OpenAI's Responses API, through the official `anthropic` and
`openai` clients against the fake engine (its text is '<id>' per token: tests/fake_model.py), plus
the request conversions and the tool-call shapes, and /tokenize, /detokenize."""
import asyncio
import json
import re

import anthropic
import httpx
import openai
import pytest

from fake_model import FakeTokenizer, fake_engine, reference_continuation
from metrale.server import ServerThread, create_app
from metrale.server import anthropic_api, responses_api
from metrale.server.parsing import ParsedChat, ToolCall


@pytest.fixture(scope="module")
def srv():
    engine = fake_engine(num_blocks=512)
    with ServerThread(create_app(engine)) as s:
        s.engine = engine
        yield s


def ids(text: str) -> list[int]:
    return [int(t) for t in re.findall(r"<(\d+)>", text)]


def want(prompt_text: str, n: int) -> list[int]:
    return reference_continuation(FakeTokenizer().encode(prompt_text), n)


def test_messages_with_the_anthropic_client(srv):
    client = anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0)
    msg = client.messages.create(model="smollm2-135m", max_tokens=6, system="sys",
                                 messages=[{"role": "user", "content": "hello"}])
    assert msg.type == "message" and msg.role == "assistant" and msg.stop_reason == "max_tokens"
    assert msg.content[0].type == "text" and ids(msg.content[0].text) == want("syshello", 6)
    assert msg.usage.output_tokens == 6 and msg.usage.input_tokens == len("syshello")


def test_messages_streaming_events_in_anthropic_order(srv):
    client = anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0)
    with client.messages.stream(model="smollm2-135m", max_tokens=5,
                                messages=[{"role": "user", "content": "abc"}]) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds.index("content_block_start") < kinds.index("content_block_delta") < kinds.index("content_block_stop")
    assert kinds.index("content_block_stop") < kinds.index("message_delta")
    assert ids(final.content[0].text) == want("abc", 5) and final.stop_reason == "max_tokens"


def test_messages_errors_have_anthropic_shape(srv):
    client = anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model="smollm2-135m", max_tokens=5, extra_body={"temperature": -3},
                               messages=[{"role": "user", "content": "x"}])
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "invalid_request_error"
    r = httpx.post(srv.url + "/v1/messages", json={"messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="nope", max_tokens=5, messages=[{"role": "user", "content": "x"}])


def test_messages_tool_history_converts():
    chat = anthropic_api.to_chat_body({
        "max_tokens": 8, "stop_sequences": ["END"], "top_k": 5,
        "tools": [{"name": "get_weather", "description": "d", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "tool", "name": "get_weather"},
        "messages": [{"role": "user", "content": "weather?"},
                     {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm"},
                                                       {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                        "input": {"city": "Paris"}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                   "content": [{"type": "text", "text": "sunny"}]}]}]})
    assert chat["stop"] == ["END"] and chat["top_k"] == 5
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["tools"][0]["function"]["parameters"] == {"type": "object"}
    call = chat["messages"][1]["tool_calls"][0]
    assert call["id"] == "toolu_1" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert chat["messages"][2] == {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"}


def test_tool_calls_become_tool_use_blocks():
    out = ParsedChat(content="", reasoning="think", tool_calls=[ToolCall("f", '{"a": 1}', id="call_x")])
    blocks = anthropic_api.content_blocks(out)
    assert [b["type"] for b in blocks] == ["thinking", "tool_use"]
    assert blocks[1] == {"type": "tool_use", "id": "toolu_x", "name": "f", "input": {"a": 1}}
    assert anthropic_api.stop_reason("stop", True) == "tool_use"
    items = responses_api.output_items(out)
    assert [i["type"] for i in items] == ["reasoning", "function_call"]
    assert items[1]["call_id"] == "call_x" and items[1]["arguments"] == '{"a": 1}'


class _FakeCore:
    """What the event streams need of the Server: a model name and chat_events."""
    model_name = "m"

    def __init__(self, events):
        self.events = events

    async def chat_events(self, cr):
        for e in self.events:
            yield e


class _Run:
    def usage(self):
        return {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}


def _collect(agen):
    async def go():
        return [x async for x in agen]
    return asyncio.run(go())


def _parse(sse: list[str]) -> list[dict]:
    return [json.loads(e.split("data: ", 1)[1]) for e in sse]


def test_streamed_tool_use_and_thinking_blocks():
    core = _FakeCore([(0, "reasoning", "hm"), (0, "content", "ok"), (0, "tool_call", ToolCall("f", '{"a":1}')),
                      (0, "finish", "stop")])
    events = _parse(_collect(anthropic_api._events(core, type("CR", (), {"run": _Run(), "stop_reasons": {}})(), "msg_1")))
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"]
    assert [e["index"] for e in events if e["type"] == "content_block_start"] == [0, 1, 2]
    assert events[-2]["delta"]["stop_reason"] == "tool_use" and events[-1]["type"] == "message_stop"
    r = _parse(_collect(responses_api._events(core, type("CR", (), {"run": _Run(), "stop_reasons": {}})(), "resp_1", {})))
    assert r[0]["type"] == "response.created" and r[-1]["type"] == "response.completed"
    assert [i["type"] for i in r[-1]["response"]["output"]] == ["reasoning", "message", "function_call"]
    assert [e["sequence_number"] for e in r] == list(range(len(r)))


def test_responses_with_the_openai_client(srv):
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    resp = client.responses.create(model="smollm2-135m", instructions="sys", input="hello", max_output_tokens=6)
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert ids(resp.output_text) == want("syshello", 6)
    assert resp.usage.output_tokens == 6
    items = [{"role": "user", "content": [{"type": "input_text", "text": "ab"}]},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "42"}]
    stream = client.responses.create(model="smollm2-135m", input=items, max_output_tokens=4, stream=True)
    kinds, text = [], ""
    for e in stream:
        kinds.append(e.type)
        if e.type == "response.output_text.delta":
            text += e.delta
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert len(ids(text)) == 4
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="smollm2-135m", input="x", previous_response_id="resp_1")


def test_tokenize_and_detokenize(srv):
    r = httpx.post(srv.url + "/tokenize", json={"prompt": "abc"}).json()
    assert r["tokens"] == FakeTokenizer().encode("abc") and r["count"] == 3
    bad = httpx.post(srv.url + "/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400


def test_stop_sequences_report_which_one_stopped(srv):
    """Anthropic's stop_reason 'stop_sequence' with the sequence, from the engine's stop_reason (as
    vLLM's: the stop string, or the stop token id; None for EOS)."""
    cont = want("abc", 6)
    stop = f"<{cont[2]}>"
    client = anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0)
    msg = client.messages.create(model="smollm2-135m", max_tokens=6, stop_sequences=[stop, "never"],
                                 messages=[{"role": "user", "content": "abc"}])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    assert ids(msg.content[0].text) == cont[:2]
    with client.messages.stream(model="smollm2-135m", max_tokens=6, stop_sequences=[stop],
                                messages=[{"role": "user", "content": "abc"}]) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop
    engine = srv.engine
    from metrale import SamplingParams
    out = engine.generate([FakeTokenizer().encode("abc")], SamplingParams(max_tokens=6, temperature=0.0,
                                                                         stop_token_ids=[cont[1]]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == cont[1]
