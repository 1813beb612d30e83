"""Chat output parsing (reasoning, Hermes tool calls) and request checking, without a server."""
import json
import random

import pytest

from metrale.server.parsing import ChatOutputParser, ParsedChat, inline_tools, parse_chat_output
from metrale.server.protocol import ApiError, chat_tools, engine_error, sampling_request

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'
TEXT = "<think>The user wants weather.\nUse the tool.</think>\n\nLet me check." + CALL + "\n" + \
    CALL.replace("Paris", "Lyon")


def pieces(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    out, i = [], 0
    while i < len(text):
        n = rng.randint(1, 7)
        out.append(text[i:i + n])
        i += n
    return out


@pytest.mark.parametrize("seed", range(6))
def test_streamed_in_any_pieces_equals_whole(seed):
    whole = parse_chat_output(TEXT, tools=True)
    parser, streamed = ChatOutputParser(tools=True), ParsedChat()
    for piece in pieces(TEXT, seed):
        streamed.add(parser.feed(piece))
    streamed.add(parser.finish())
    assert whole.reasoning == streamed.reasoning == "The user wants weather.\nUse the tool."
    assert whole.content == streamed.content == "Let me check."
    assert [json.loads(c.arguments)["city"] for c in streamed.tool_calls] == ["Paris", "Lyon"]
    assert [c.name for c in whole.tool_calls] == ["get_weather", "get_weather"]


def test_no_tools_leaves_tool_call_text_as_content():
    out = parse_chat_output("a" + CALL, tools=False)
    assert out.content == "a" + CALL and not out.tool_calls


def test_reasoning_off_keeps_think_tags_in_content():
    out = parse_chat_output("<think>x</think>y", reasoning=False)
    assert out.content == "<think>x</think>y" and out.reasoning == ""


def test_bad_json_in_tool_call_is_content_and_unclosed_spans_flush():
    out = parse_chat_output("x<tool_call>{not json}</tool_call>", tools=True)
    assert out.content == "x<tool_call>{not json}</tool_call>" and not out.tool_calls
    out = parse_chat_output('<tool_call>{"name": "f", "arguments": {"a"', tools=True)   # cut by max_tokens
    assert out.content.startswith("<tool_call>") and not out.tool_calls
    assert parse_chat_output("<think>never closed").reasoning == "never closed"


def test_prompt_that_opens_think_starts_in_reasoning():
    out = parse_chat_output("hidden</think>shown", in_reasoning=True)
    assert out.reasoning == "hidden" and out.content == "shown"


def test_partial_tag_is_held_back_until_decided():
    p = ChatOutputParser(tools=True)
    assert p.feed("Hello <") == [("content", "Hello ")]
    assert p.feed("b>") == [("content", "<b>")]
    assert p.feed("<tool_") == []
    assert p.feed("call>{\"name\": \"f\", \"arguments\": {}}</tool_call>")[0][1].arguments == "{}"


def test_inline_tools_for_templates_without_tools():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    msgs = inline_tools([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                         {"role": "assistant", "content": "",
                          "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]},
                         {"role": "tool", "content": "42"}], tools)
    assert msgs[0]["content"].startswith("Be brief.") and '"name": "f"' in msgs[0]["content"]
    assert msgs[2]["content"] == '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    assert msgs[3] == {"role": "user", "content": "<tool_response>\n42\n</tool_response>"}


def test_tool_choice_forms():
    tools = [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "g"}}]
    assert chat_tools({"tools": tools}).parse
    assert not chat_tools({"tools": tools, "tool_choice": "none"}).parse
    named = chat_tools({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "g"}}})
    assert [t["function"]["name"] for t in named.tools] == ["g"] and "g" in named.instruction
    for body, param in (({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "h"}}},
                         "tool_choice"),
                        ({"tool_choice": "required"}, "tool_choice"), ({"tools": [{"x": 1}]}, "tools")):
        with pytest.raises(ApiError) as err:
            chat_tools(body)
        assert err.value.param == param


def test_sampling_fields_map_to_params():
    req = sampling_request({"max_completion_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 5,
                            "min_p": 0.1, "repetition_penalty": 1.1, "presence_penalty": 0.2,
                            "frequency_penalty": 0.3, "logit_bias": {"3": 5}, "min_tokens": 2, "stop": "x",
                            "seed": 4, "ignore_eos": True, "stream": True,
                            "stream_options": {"include_usage": True},
                            "response_format": {"type": "json_object"}},
                           chat=True, default_max_tokens=None)
    p = req.params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (7, 0.5, 0.9, 5, 0.1)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.1, 0.2, 0.3)
    assert p.logit_bias == {3: 5.0} and p.min_tokens == 2 and p.stop == ["x"] and p.seed == 4
    assert p.ignore_eos and p.json_schema == {"type": "object"} and req.stream and req.include_usage
    assert req.renames == {"max_tokens": "max_completion_tokens"}


def test_engine_messages_map_to_request_fields():
    assert engine_error("max_tokens: must be >= 1", chat=True, renames={"max_tokens": "max_completion_tokens"}
                        ).param == "max_completion_tokens"
    assert engine_error("prompt: 9000 tokens do not fit", chat=True, renames={}).param == "messages"
    assert engine_error("prompt + max_tokens: exceed", chat=False, renames={}).param == "prompt"
    assert engine_error("logit_bias/stop_token_ids: bad", chat=False, renames={}).param == "logit_bias"
    assert engine_error("json_schema: invalid", chat=True, renames={}).param == "response_format"
