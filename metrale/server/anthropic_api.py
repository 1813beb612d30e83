"""Anthropic's Messages API (POST /v1/messages) over the chat core of app.py.

A Messages body becomes an OpenAI chat body (system, text / tool_use / tool_result blocks, tools
with input_schema, tool_choice, stop_sequences, top_k); the answer comes back as content blocks
(thinking, text, tool_use) with Anthropic's stop reasons, usage and error shape, or as its
event stream: message_start, then per block content_block_start / content_block_delta /
content_block_stop, then message_delta and message_stop.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse

from metrale.server.protocol import ApiError, bad

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
                503: "overloaded_error"}
_STOP = {"stop": "end_turn", "length": "max_tokens", "abort": "end_turn"}


def error_response(exc: ApiError) -> JSONResponse:
    kind = _ERROR_TYPES.get(exc.status, "api_error")
    return JSONResponse({"type": "error", "error": {"type": kind, "message": exc.message}}, exc.status)


def to_chat_body(body: dict) -> dict:
    """A Messages request -> the equivalent OpenAI chat request body."""
    if not isinstance(body.get("max_tokens"), int) or isinstance(body.get("max_tokens"), bool):
        raise bad("max_tokens", "max_tokens: is required (an integer)")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "messages: expected a non-empty array of messages")
    out: list[dict] = []
    system = _system_text(body.get("system"))
    if system:
        out.append({"role": "system", "content": system})
    for i, m in enumerate(msgs):
        out.extend(_message(m, f"messages[{i}]"))
    chat: dict[str, Any] = {"messages": out, "max_tokens": body["max_tokens"], "stream": bool(body.get("stream"))}
    for key in ("temperature", "top_p", "top_k"):
        if body.get(key) is not None:
            chat[key] = body[key]
    if body.get("stop_sequences") is not None:
        chat["stop"] = body["stop_sequences"]
    tools = body.get("tools")
    if tools:
        chat["tools"] = [_tool(t, i) for i, t in enumerate(tools if isinstance(tools, list) else [None])]
        chat["tool_choice"] = _tool_choice(body.get("tool_choice"))
    return chat


def _system_text(system: Any) -> str:
    if system is None or isinstance(system, str):
        return system or ""
    if isinstance(system, list) and all(isinstance(b, dict) and b.get("type") == "text" for b in system):
        return "\n".join(str(b.get("text", "")) for b in system)
    raise bad("system", "system: expected a string or an array of text blocks")


def _message(m: Any, where: str) -> list[dict]:
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
        raise bad("messages", f"{where}.role: must be user or assistant")
    content = m.get("content")
    if isinstance(content, str):
        return [{"role": m["role"], "content": content}]
    if not isinstance(content, list):
        raise bad("messages", f"{where}.content: expected a string or an array of content blocks")
    text, calls, results = [], [], []
    for b in content:
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            text.append(b["text"])
        elif kind == "tool_use" and m["role"] == "assistant":
            calls.append({"id": b.get("id"), "type": "function",
                          "function": {"name": b.get("name"), "arguments": json.dumps(b.get("input") or {})}})
        elif kind == "tool_result" and m["role"] == "user":
            results.append({"role": "tool", "tool_call_id": b.get("tool_use_id"),
                            "content": _system_text(b.get("content")) if not isinstance(b.get("content"), str)
                            else b["content"]})
        elif kind in ("thinking", "redacted_thinking") and m["role"] == "assistant":
            continue                       # earlier reasoning is not fed back to the model
        else:
            raise bad("messages", f"{where}.content: block type {kind!r} is not supported here")
    msg = {"role": m["role"], "content": "".join(text)}
    if calls:
        msg["tool_calls"] = calls
    return results + ([msg] if text or calls or not results else [])


def _tool(t: Any, i: int) -> dict:
    if not isinstance(t, dict) or not isinstance(t.get("name"), str):
        raise bad("tools", f"tools[{i}]: each tool needs a name")
    return {"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                             "parameters": t.get("input_schema") or {"type": "object"}}}


def _tool_choice(choice: Any) -> Any:
    kind = choice.get("type") if isinstance(choice, dict) else None
    if choice is None or kind == "auto":
        return "auto"
    if kind == "any":
        return "required"
    if kind == "none":
        return "none"
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad("tool_choice", "tool_choice: type must be auto, any, tool (with a name) or none")


def stop_reason(reason: str | None, has_calls: bool, stop: int | str | None = None) -> str:
    if has_calls and reason == "stop":
        return "tool_use"
    if reason == "stop" and isinstance(stop, str):
        return "stop_sequence"
    return _STOP.get(reason or "stop", "end_turn")


def _stop_sequence(cr) -> str | None:
    stop = cr.stop_reasons.get(0)
    return stop if isinstance(stop, str) else None


def content_blocks(out) -> list[dict]:
    """A ParsedChat -> Anthropic content blocks."""
    blocks: list[dict] = []
    if out.reasoning:
        blocks.append({"type": "thinking", "thinking": out.reasoning, "signature": ""})
    if out.content.strip() or not (out.tool_calls or out.reasoning):
        blocks.append({"type": "text", "text": out.content})
    blocks += [{"type": "tool_use", "id": _tool_id(t.id), "name": t.name, "input": _arguments(t.arguments)}
               for t in out.tool_calls]
    return blocks


def _tool_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return {"_raw": text}


def message(msg_id: str, model: str, blocks: list[dict], reason: str | None, usage: dict,
            stop_sequence: str | None = None) -> dict:
    return {"id": msg_id, "type": "message", "role": "assistant", "model": model, "content": blocks,
            "stop_reason": reason, "stop_sequence": stop_sequence,
            "usage": {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"]}}


async def messages(server, request: Request):
    """POST /v1/messages."""
    arrival = time.perf_counter()
    try:
        body = await server.read_json(request)
        chat = to_chat_body(body)
        msg_id = f"msg_{uuid.uuid4().hex[:24]}"
        cr = await server.start_chat(chat, msg_id, arrival)
        if cr.req.params.n != 1:
            raise bad("n", "n: the Messages API returns one answer")
        if chat["stream"]:
            from metrale.server.app import _SSE
            return _SSE(_events(server, cr, msg_id), cr.run)
        outs, reasons = await server.chat_outputs(cr, request)
    except ApiError as exc:
        return error_response(exc)
    out = outs[0]
    return JSONResponse(message(msg_id, server.model_name, content_blocks(out),
                                stop_reason(reasons[0], bool(out.tool_calls), cr.stop_reasons.get(0)), cr.run.usage(),
                                _stop_sequence(cr)))


def _sse(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


async def _events(server, cr, msg_id: str) -> AsyncIterator[str]:
    usage = cr.run.usage()
    yield _sse("message_start", {"message": {**message(msg_id, server.model_name, [], None, usage),
                                             "usage": {"input_tokens": usage["prompt_tokens"], "output_tokens": 0}}})
    yield _sse("ping", {})
    index, open_kind, calls, reason = -1, None, 0, None

    def start(kind: str, block: dict) -> str:
        nonlocal index, open_kind
        index, open_kind = index + 1, kind
        return _sse("content_block_start", {"index": index, "content_block": block})

    def stop() -> str:
        nonlocal open_kind
        open_kind = None
        return _sse("content_block_stop", {"index": index})

    async for _, kind, value in server.chat_events(cr):
        if kind == "error":
            if open_kind:
                yield stop()
            yield _sse("error", {"error": {"type": "api_error", "message": value}})
            return
        if kind == "finish":
            reason = value
            continue
        if kind == "tool_call":
            if open_kind:
                yield stop()
            yield start("tool_use", {"type": "tool_use", "id": _tool_id(value.id), "name": value.name, "input": {}})
            yield _sse("content_block_delta", {"index": index, "delta": {"type": "input_json_delta",
                                                                         "partial_json": value.arguments}})
            yield stop()
            calls += 1
            continue
        block = "thinking" if kind == "reasoning" else "text"
        if open_kind != block:
            if open_kind:
                yield stop()
            yield start(block, {"type": "thinking", "thinking": "", "signature": ""} if block == "thinking"
                        else {"type": "text", "text": ""})
        delta = {"type": "thinking_delta", "thinking": value} if block == "thinking" else {"type": "text_delta",
                                                                                           "text": value}
        yield _sse("content_block_delta", {"index": index, "delta": delta})
    if open_kind:
        yield stop()
    yield _sse("message_delta", {"delta": {"stop_reason": stop_reason(reason, calls > 0, cr.stop_reasons.get(0)),
                                           "stop_sequence": _stop_sequence(cr)},
                                 "usage": {"output_tokens": cr.run.usage()["completion_tokens"]}})
    yield _sse("message_stop", {})
