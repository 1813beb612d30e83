"""OpenAI's Responses API (POST /v1/responses), stateless, over the chat core of app.py.

Input items (messages with input_text / output_text parts, function_call, function_call_output),
`instructions`, function tools, `tool_choice`, `max_output_tokens` and `text.format` (structured
output) become an OpenAI chat body; the answer is a response object whose `output` holds reasoning,
message and function_call items, or the event stream (response.created, output items and parts
with their deltas, response.completed). `previous_response_id` and `store` need server state, which
this server does not keep: they are refused.
"""
from __future__ import annotations

import json
import math
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse

from metrale.server.protocol import ApiError, bad


def to_chat_body(body: dict) -> dict:
    if body.get("previous_response_id") is not None:
        raise bad("previous_response_id", "previous_response_id: this server keeps no responses; send the "
                                          "whole conversation in input")
    if body.get("background"):
        raise bad("background", "background: not supported")
    messages: list[dict] = []
    if isinstance(body.get("instructions"), str) and body["instructions"]:
        messages.append({"role": "system", "content": body["instructions"]})
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad("input", "input: expected a string or a non-empty array of input items")
    for i, item in enumerate(items):
        messages.extend(_item(item, f"input[{i}]"))
    chat: dict[str, Any] = {"messages": messages, "stream": bool(body.get("stream"))}
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    for key in ("temperature", "top_p"):
        if body.get(key) is not None:
            chat[key] = body[key]
    tools = body.get("tools")
    if tools:
        chat["tools"] = [_tool(t, i) for i, t in enumerate(tools if isinstance(tools, list) else [None])]
        chat["tool_choice"] = _tool_choice(body.get("tool_choice"))
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": fmt.get("name", "output"),
                                                                          "schema": fmt.get("schema")}}
    elif isinstance(fmt, dict) and fmt.get("type") == "json_object":
        chat["response_format"] = {"type": "json_object"}
    return chat


def _item(item: Any, where: str) -> list[dict]:
    if not isinstance(item, dict):
        raise bad("input", f"{where}: expected an object")
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise bad("input", f"{where}.role: must be user, assistant, system or developer")
        return [{"role": role, "content": _text(item.get("content"), where)}]
    if kind == "function_call":
        return [{"role": "assistant", "content": "",
                 "tool_calls": [{"id": item.get("call_id"), "type": "function",
                                 "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}]}]
    if kind == "function_call_output":
        out = item.get("output")
        return [{"role": "tool", "tool_call_id": item.get("call_id"),
                 "content": out if isinstance(out, str) else json.dumps(out)}]
    if kind == "reasoning":
        return []
    raise bad("input", f"{where}.type: {kind!r} is not supported (message, function_call, function_call_output)")


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if not isinstance(p, dict) or p.get("type") not in ("input_text", "output_text", "text"):
                kind = p.get("type") if isinstance(p, dict) else type(p).__name__
                raise bad("input", f"{where}.content: only text parts are supported, got {kind!r}")
            parts.append(str(p.get("text", "")))
        return "".join(parts)
    raise bad("input", f"{where}.content: expected a string or an array of text parts")


def _tool(t: Any, i: int) -> dict:
    if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("name"), str):
        raise bad("tools", f"tools[{i}]: only function tools with a name are supported")
    return {"type": "function", "function": {"name": t["name"], "description": t.get("description") or "",
                                             "parameters": t.get("parameters") or {"type": "object"}}}


def _tool_choice(choice: Any) -> Any:
    if choice is None or choice in ("auto", "none", "required"):
        return choice or "auto"
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad("tool_choice", "tool_choice: auto, none, required or {type: function, name}")


def output_items(out) -> list[dict]:
    """A ParsedChat -> Responses output items."""
    items: list[dict] = []
    if out.reasoning:
        items.append(_reasoning_item(out.reasoning))
    if out.content.strip() or not (out.tool_calls or out.reasoning):
        items.append(_message_item(out.content))
    items += [_call_item(t) for t in out.tool_calls]
    return items


def _reasoning_item(text: str, rid: str | None = None) -> dict:
    return {"type": "reasoning", "id": rid or f"rs_{uuid.uuid4().hex[:24]}", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def _message_item(text: str, mid: str | None = None, status: str = "completed") -> dict:
    return {"type": "message", "id": mid or f"msg_{uuid.uuid4().hex[:24]}", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []}


def _call_item(call) -> dict:
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex[:24]}", "call_id": call.id, "name": call.name,
            "arguments": call.arguments, "status": "completed"}


def _echo(value: Any) -> Any:
    """A request field as the response echoes it: JSON-safe (non-finite numbers become null)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _echo(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_echo(v) for v in value]
    return value


def response(resp_id: str, body: dict, model: str, output: list[dict], reason: str | None, usage: dict,
             status: str = "completed") -> dict:
    body = {k: _echo(body.get(k)) for k in ("instructions", "max_output_tokens", "temperature", "top_p",
                                             "tool_choice", "tools", "text")}
    incomplete = status == "completed" and reason == "length"
    return {"id": resp_id, "object": "response", "created_at": int(time.time()), "model": model,
            "status": "incomplete" if incomplete else status, "output": output, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "parallel_tool_calls": True, "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [],
            "text": body.get("text") or {"format": {"type": "text"}}, "store": False, "metadata": {},
            "usage": {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
                      "total_tokens": usage["total_tokens"], "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens_details": {"reasoning_tokens": 0}}}


async def responses(server, request: Request):
    """POST /v1/responses."""
    arrival = time.perf_counter()
    body = await server.read_json(request)
    chat = to_chat_body(body)
    resp_id = f"resp_{uuid.uuid4().hex}"
    cr = await server.start_chat(chat, resp_id, arrival)
    if chat["stream"]:
        from metrale.server.app import _SSE
        return _SSE(_events(server, cr, resp_id, body), cr.run)
    outs, reasons = await server.chat_outputs(cr, request)
    return JSONResponse(response(resp_id, body, server.model_name, output_items(outs[0]), reasons[0],
                                 cr.run.usage()))


async def _events(server, cr, resp_id: str, body: dict) -> AsyncIterator[str]:
    seq = 0

    def sse(kind: str, data: dict) -> str:
        nonlocal seq
        seq += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq - 1, **data}, ensure_ascii=False)}\n\n"

    usage0 = {"prompt_tokens": cr.run.usage()["prompt_tokens"], "completion_tokens": 0,
              "total_tokens": cr.run.usage()["prompt_tokens"]}
    shell = response(resp_id, body, server.model_name, [], None, usage0, status="in_progress")
    yield sse("response.created", {"response": shell})
    yield sse("response.in_progress", {"response": shell})
    output: list[dict] = []
    current: dict | None = None          # the message or reasoning item text is streaming into
    reason = None

    def close_current() -> list[str]:
        nonlocal current
        if current is None:
            return []
        i, item, current = len(output) - 1, current, None
        if item["type"] == "message":
            text = item["_text"]
            part = {"type": "output_text", "text": text, "annotations": []}
            done = _message_item(text, item["id"])
            output[i] = done
            return [sse("response.output_text.done", {"item_id": item["id"], "output_index": i, "content_index": 0,
                                                      "text": text}),
                    sse("response.content_part.done", {"item_id": item["id"], "output_index": i,
                                                       "content_index": 0, "part": part}),
                    sse("response.output_item.done", {"output_index": i, "item": done})]
        done = _reasoning_item(item["_text"], item["id"])
        output[i] = done
        return [sse("response.reasoning_text.done", {"item_id": item["id"], "output_index": i, "content_index": 0,
                                                     "text": item["_text"]}),
                sse("response.output_item.done", {"output_index": i, "item": done})]

    async for _, kind, value in server.chat_events(cr):
        if kind == "error":
            for e in close_current():
                yield e
            yield sse("response.failed", {"response": {**shell, "status": "failed",
                                                       "error": {"code": "server_error", "message": value}}})
            return
        if kind == "finish":
            reason = value
            continue
        if kind == "tool_call":
            for e in close_current():
                yield e
            item = _call_item(value)
            output.append(item)
            i = len(output) - 1
            yield sse("response.output_item.added", {"output_index": i, "item": {**item, "status": "in_progress"}})
            yield sse("response.function_call_arguments.delta", {"item_id": item["id"], "output_index": i,
                                                                 "delta": item["arguments"]})
            yield sse("response.function_call_arguments.done", {"item_id": item["id"], "output_index": i,
                                                                "arguments": item["arguments"]})
            yield sse("response.output_item.done", {"output_index": i, "item": item})
            continue
        want = "reasoning" if kind == "reasoning" else "message"
        if current is None or current["type"] != want:
            for e in close_current():
                yield e
            if want == "message":
                current = {**_message_item("", status="in_progress"), "_text": ""}
            else:
                current = {**_reasoning_item(""), "_text": ""}
            output.append(current)
            i = len(output) - 1
            added = {k: v for k, v in current.items() if k != "_text"}
            yield sse("response.output_item.added", {"output_index": i, "item": added})
            if want == "message":
                yield sse("response.content_part.added", {"item_id": current["id"], "output_index": i,
                                                          "content_index": 0,
                                                          "part": {"type": "output_text", "text": "", "annotations": []}})
        current["_text"] += value
        i = len(output) - 1
        event = "response.output_text.delta" if want == "message" else "response.reasoning_text.delta"
        yield sse(event, {"item_id": current["id"], "output_index": i, "content_index": 0, "delta": value})
    for e in close_current():
        yield e
    yield sse("response.completed", {"response": response(resp_id, body, server.model_name, output, reason,
                                                          cr.run.usage())})
