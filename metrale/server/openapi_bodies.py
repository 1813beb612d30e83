"""Request-body schemas of the POST routes for /openapi.json (the handlers check bodies by hand,
protocol.py; these describe them for clients and for schemathesis). Permissive: unknown fields
are allowed, as the handlers ignore them."""
from __future__ import annotations

_NUM, _INT, _BOOL, _STR = {"type": "number"}, {"type": "integer"}, {"type": "boolean"}, {"type": "string"}
_STOP = {"oneOf": [_STR, {"type": "array", "items": _STR}]}
_SAMPLING = {"model": _STR, "max_tokens": _INT, "temperature": _NUM, "top_p": _NUM, "top_k": _INT, "min_p": _NUM,
             "n": _INT, "seed": _INT, "stop": _STOP, "stream": _BOOL, "presence_penalty": _NUM,
             "frequency_penalty": _NUM, "repetition_penalty": _NUM, "logit_bias": {"type": "object"},
             "ignore_eos": _BOOL, "min_tokens": _INT, "stop_token_ids": {"type": "array", "items": _INT}}
_MESSAGE = {"type": "object", "properties": {"role": _STR, "content": {"oneOf": [_STR, {"type": "array"}]}},
            "required": ["role"]}


def _obj(props: dict, required: list[str]) -> dict:
    return {"type": "object", "properties": props, "required": required}


BODIES: dict[str, dict] = {
    "/v1/completions": _obj({**_SAMPLING, "prompt": {"oneOf": [_STR, {"type": "array"}]}, "echo": _BOOL,
                             "logprobs": _INT, "best_of": _INT}, ["prompt"]),
    "/v1/chat/completions": _obj({**_SAMPLING, "messages": {"type": "array", "items": _MESSAGE}, "tools": {"type": "array"},
                                  "tool_choice": {}, "logprobs": _BOOL, "top_logprobs": _INT,
                                  "response_format": {"type": "object"}, "max_completion_tokens": _INT},
                                 ["messages"]),
    "/v1/messages": _obj({"model": _STR, "max_tokens": _INT, "messages": {"type": "array", "items": _MESSAGE},
                          "system": {}, "stop_sequences": {"type": "array", "items": _STR}, "temperature": _NUM,
                          "top_p": _NUM, "top_k": _INT, "stream": _BOOL, "tools": {"type": "array"},
                          "tool_choice": {"type": "object"}}, ["max_tokens", "messages"]),
    "/v1/responses": _obj({"model": _STR, "input": {"oneOf": [_STR, {"type": "array"}]}, "instructions": _STR,
                           "max_output_tokens": _INT, "temperature": _NUM, "top_p": _NUM, "stream": _BOOL,
                           "tools": {"type": "array"}, "tool_choice": {}, "text": {"type": "object"}}, ["input"]),
    "/tokenize": _obj({"prompt": _STR, "messages": {"type": "array", "items": _MESSAGE},
                       "add_special_tokens": _BOOL}, []),
    "/detokenize": _obj({"tokens": {"type": "array", "items": _INT}}, ["tokens"]),
}


def openapi_extra(path: str) -> dict:
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": BODIES[path]}}}}
