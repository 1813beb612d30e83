"""OpenAI request bodies -> prompts and SamplingParams; OpenAI-style errors.

Types and shapes are checked here, with the offending field named in `param`; value ranges are
the engine's to judge (`SamplingParams.validate` and `Engine.add_request` raise
InvalidRequestError messages that start with the field name, mapped back by `engine_error`).
Unknown fields are ignored, as vLLM does.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from metrale.sampling.params import SamplingParams


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str | None, message: str) -> ApiError:
    return ApiError(400, message, param)


def json_depth_exceeds(value: Any, limit: int) -> bool:
    """Whether a parsed JSON value nests more than `limit` arrays/objects deep (iterative: a deep
    body cannot overflow the stack here)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (dict, list)):
            if depth > limit:
                return True
            stack.extend((c, depth + 1) for c in (v.values() if isinstance(v, dict) else v))
    return False


# ---------------------------------------------------------------------------- field checks
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _type_name(v: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null",
            int: "integer", float: "number"}.get(type(v), type(v).__name__)


class Fields:
    """Typed access to a JSON object; a wrong type is a 400 naming the field."""

    def __init__(self, body: dict, prefix: str = ""):
        self.body, self.prefix = body, prefix

    def _wrong(self, name: str, want: str) -> ApiError:
        v = self.body[name]
        return bad(self.prefix + name, f"{self.prefix + name}: expected {want}, got {_type_name(v)} {json.dumps(v)[:60]}")

    def int(self, name: str, default: int | None = None) -> int | None:
        v = self.body.get(name)
        if v is None:
            return default
        if _is_int(v):
            return v
        if isinstance(v, float) and v.is_integer():
            return int(v)
        raise self._wrong(name, "an integer")

    def num(self, name: str, default: float | None = None) -> float | None:
        v = self.body.get(name)
        if v is None:
            return default
        if not _is_num(v):
            raise self._wrong(name, "a number")
        return float(v)

    def bool(self, name: str, default: bool | None = False) -> bool | None:
        v = self.body.get(name)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise self._wrong(name, "a boolean")
        return v

    def str(self, name: str, default: str | None = None) -> str | None:
        v = self.body.get(name)
        if v is None:
            return default
        if not isinstance(v, str):
            raise self._wrong(name, "a string")
        return v

    def dict(self, name: str) -> dict | None:
        v = self.body.get(name)
        if v is None:
            return None
        if not isinstance(v, dict):
            raise self._wrong(name, "an object")
        return v

    def list(self, name: str) -> list | None:
        v = self.body.get(name)
        if v is None:
            return None
        if not isinstance(v, list):
            raise self._wrong(name, "an array")
        return v

    def str_list(self, name: str) -> list[str] | None:
        v = self.body.get(name)
        if v is None:
            return None
        if isinstance(v, str):
            return [v]
        if isinstance(v, list) and all(isinstance(s, str) for s in v):
            return list(v)
        raise self._wrong(name, "a string or an array of strings")

    def int_list(self, name: str) -> list[int] | None:
        v = self.body.get(name)
        if v is None:
            return None
        if isinstance(v, list) and all(_is_int(t) for t in v):
            return list(v)
        raise self._wrong(name, "an array of integers")


# --------------------------------------------------------------------------- the request
@dataclass
class ApiRequest:
    """What both endpoints share once the body is checked."""
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    renames: dict[str, str] = field(default_factory=dict)   # engine field -> request field, for errors


STRUCTURED_KEYS = ("json_schema", "regex", "grammar", "choice")


def sampling_request(body: dict, *, chat: bool, default_max_tokens: int | None) -> ApiRequest:
    f = Fields(body)
    renames: dict[str, str] = {}
    max_tokens = f.int("max_tokens")
    if chat and body.get("max_completion_tokens") is not None:
        max_tokens = f.int("max_completion_tokens")
        renames["max_tokens"] = "max_completion_tokens"
    if max_tokens is None:
        max_tokens = default_max_tokens

    n = f.int("n", 1)
    best_of = f.int("best_of")
    if best_of is not None and chat:
        raise bad("best_of", "best_of: only /v1/completions takes best_of")

    logprobs = None
    if chat:
        top = f.int("top_logprobs")
        if f.bool("logprobs", False):
            logprobs = top or 0
            if top is not None:
                renames["logprobs"] = "top_logprobs"
        elif top is not None:
            raise bad("top_logprobs", "top_logprobs: needs logprobs=true")
    else:
        logprobs = f.int("logprobs")
    if f.bool("echo", False) and chat:
        raise bad("echo", "echo: only /v1/completions takes echo")

    logit_bias = None
    raw_bias = f.dict("logit_bias")
    if raw_bias:          # JSON keys are strings; ranges are the engine's to check
        logit_bias = {}
        for key, value in raw_bias.items():
            if not (key.strip().lstrip("-").isdigit() and _is_num(value)):
                raise bad("logit_bias", f"logit_bias: expected {{\"token id\": number}}, got {key!r}: {value!r}")
            logit_bias[int(key)] = float(value)

    params = SamplingParams(
        max_tokens=max_tokens, temperature=f.num("temperature", 1.0), top_p=f.num("top_p", 1.0),
        top_k=f.int("top_k", -1), min_p=f.num("min_p", 0.0),
        repetition_penalty=f.num("repetition_penalty", 1.0),
        presence_penalty=f.num("presence_penalty", 0.0), frequency_penalty=f.num("frequency_penalty", 0.0),
        logit_bias=logit_bias, min_tokens=f.int("min_tokens", 0), stop=f.str_list("stop"),
        stop_token_ids=f.int_list("stop_token_ids"), ignore_eos=f.bool("ignore_eos", False), seed=f.int("seed"),
        n=n, best_of=best_of, logprobs=logprobs, skip_special_tokens=f.bool("skip_special_tokens", True),
    )
    _structured(body, f, params)

    stream = f.bool("stream", False)
    options = f.dict("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise bad("stream_options", "stream_options: only allowed with stream=true")
        include_usage = Fields(options, "stream_options.").bool("include_usage", False)
    return ApiRequest(params, stream, include_usage, renames)


def _structured(body: dict, f: Fields, params: SamplingParams) -> None:
    """response_format (OpenAI) and guided_* (vLLM) -> json_schema / regex / grammar / choice."""
    fmt = f.dict("response_format")
    if fmt is not None:
        kind = fmt.get("type")
        if kind == "json_object":
            params.json_schema = {"type": "object"}
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict):
                raise bad("response_format", "response_format: type json_schema needs a json_schema object")
            schema = spec.get("schema", spec.get("json_schema"))
            if not isinstance(schema, (dict, bool)):
                raise bad("response_format", "response_format: json_schema.schema must be a JSON schema object")
            params.json_schema = schema
        elif kind != "text":
            raise bad("response_format", f"response_format: type must be text, json_object or json_schema, "
                                         f"got {kind!r}")
    guided = f.dict("guided_json") if isinstance(body.get("guided_json"), dict) else f.str("guided_json")
    if guided is not None:
        params.json_schema = guided
    params.regex = f.str("guided_regex") or params.regex
    params.grammar = f.str("guided_grammar") or params.grammar
    params.choice = f.str_list("guided_choice") or params.choice


def structured_param(params: SamplingParams) -> str | None:
    """The request field of the structured-output constraint, if any."""
    if params.json_schema is not None:
        return "response_format"
    for key in ("regex", "grammar", "choice"):
        if getattr(params, key) is not None:
            return f"guided_{key}"
    return None


# ------------------------------------------------------------------------------- prompts
def completion_prompts(body: dict) -> list[str | list[int]]:
    p = body.get("prompt")
    if p is None:
        raise bad("prompt", "prompt: is required")
    if isinstance(p, str):
        return [p]
    if isinstance(p, list) and p:
        if all(_is_int(t) for t in p):
            return [list(p)]
        if all(isinstance(s, str) or (isinstance(s, list) and s and all(_is_int(t) for t in s)) for s in p):
            return [s if isinstance(s, str) else list(s) for s in p]
    if isinstance(p, list) and not p:
        raise bad("prompt", "prompt: is empty")
    raise bad("prompt", f"prompt: expected a string, an array of strings, an array of token ids or an array "
                        f"of arrays of token ids, got {_type_name(p)}")


ROLES = ("system", "developer", "user", "assistant", "tool")


def chat_messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "messages: expected a non-empty array of messages"
                  if msgs is not None else "messages: is required")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad("messages", f"{where}: expected an object, got {_type_name(m)}")
        role = m.get("role")
        if role not in ROLES:
            raise bad("messages", f"{where}.role: must be one of {', '.join(ROLES)}, got {role!r}")
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role,
                               "content": _content_text(m.get("content"), where, role)}
        if role == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = _history_tool_calls(m["tool_calls"], where)
        if role == "tool" and m.get("tool_call_id") is not None:
            msg["tool_call_id"] = m["tool_call_id"]
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    return out


def _content_text(content: Any, where: str, role: str) -> str:
    if content is None:
        if role in ("assistant", "tool"):
            return ""
        raise bad("messages", f"{where}.content: is required")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else _type_name(part)
                raise bad("messages", f"{where}.content: only text parts are supported, got {kind!r}")
            texts.append(part["text"])
        return "".join(texts)
    raise bad("messages", f"{where}.content: expected a string or an array of text parts, got {_type_name(content)}")


def _history_tool_calls(calls: Any, where: str) -> list[dict]:
    if not isinstance(calls, list):
        raise bad("messages", f"{where}.tool_calls: expected an array")
    out = []
    for c in calls:
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad("messages", f"{where}.tool_calls: each call needs function.name")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args)      # templates render arguments with tojson
            except ValueError:
                pass
        out.append({"id": c.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


@dataclass
class ToolSpec:
    tools: list[dict] | None = None          # what the template sees (None: no tools)
    parse: bool = False                      # parse <tool_call> spans from the output
    instruction: str | None = None           # a system line for tool_choice required / named
    require: bool = False                    # tool_choice required / named: the answer must be a call


def chat_tools(body: dict) -> ToolSpec:
    f = Fields(body)
    tools = f.list("tools")
    choice = body.get("tool_choice")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise bad("tool_choice", "tool_choice: needs tools")
        return ToolSpec()
    names = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str):
            raise bad("tools", f"tools[{i}]: expected {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise bad("tools", f"tools[{i}].function.parameters: expected a JSON schema object")
        names.append(fn["name"])
    if choice in (None, "auto"):
        return ToolSpec(tools, True)
    if choice == "none":
        return ToolSpec()
    if choice == "required":
        return ToolSpec(tools, True, "You must call at least one of the tools.", True)
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise bad("tool_choice", f"tool_choice: no tool named {name!r} in tools")
        chosen = [t for t in tools if t["function"]["name"] == name]
        return ToolSpec(chosen, True, f"You must call the tool {name}.", True)
    raise bad("tool_choice", "tool_choice: expected none, auto, required or "
                             "{\"type\": \"function\", \"function\": {\"name\": ...}}")


def engine_error(message: str, *, chat: bool, renames: dict[str, str]) -> ApiError:
    """InvalidRequestError('<field>: why') -> 400 with param = the request's field."""
    head = message.split(":", 1)[0].strip()
    name = head.split("/")[0].split(" ")[0]
    if name == "prompt" and chat:
        name = "messages"
    elif name in STRUCTURED_KEYS:
        name = "response_format" if name == "json_schema" else f"guided_{name}"
    name = renames.get(name, name)
    if not name.replace("_", "").isalnum():
        name = None
    return bad(name, message)
