"""The OpenAI-compatible HTTP API: `create_app(engine, cfg)` builds a FastAPI app around an Engine
(its loop thread in this process) or an EngineProcess (the engine in a process of its own:
engine_process.py; `python -m metrale serve` runs that way unless server.engine_process=false).

Routes: POST /v1/completions, POST /v1/chat/completions, POST /v1/messages (Anthropic,
anthropic_api.py), POST /v1/responses (OpenAI Responses, responses_api.py), POST /tokenize,
POST /detokenize, GET /v1/models, GET /health, GET /metrics, GET /openapi.json. Handlers check
the body (protocol.py), submit requests to the EngineLoop and turn the StreamDeltas they get back
into responses or SSE events. A request whose client goes
away is aborted (its KV blocks are freed). The app holds no engine state of its own.
"""
from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from metrale.options import server_options
from metrale.outputs import StreamDelta
from metrale.sampling.params import InvalidRequestError
from metrale.server.logprobs import CompletionLogprobs, TokenText, chat_content
from metrale.server import anthropic_api, responses_api
from metrale.server.openapi_bodies import openapi_extra
from metrale.server.chat_input import encode_masked, mask_special_text
from metrale.driver import EngineLoop, ServerDraining
from metrale.server.engine_process import EngineProcess, supports_structured_output
from metrale.server.parsing import (ChatOutputParser, ParsedChat, inline_tools, template_knows_tools,
                                    with_system_text)
from metrale.server.protocol import (ApiError, ApiRequest, Fields, bad, chat_messages,
                                     chat_tools, completion_prompts, engine_error, json_depth_exceeds,
                                     sampling_request, structured_param)

log = logging.getLogger("metrale.server")

DISCONNECT_POLL_S = 0.25   # how often a handler waiting for a whole response checks its client
# Prompts up to this many characters (or token ids) in all are encoded, and conversations rendered,
# on the event loop; longer ones on a worker thread, whose hop and GIL hand-overs would otherwise
# hold a burst of requests until the last is encoded (docs/server.md, "Admission").
INLINE_PREP_CHARS = 4096


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


class _Auth:
    """ASGI middleware: every route but /health needs `Authorization: Bearer <key>`."""

    def __init__(self, app, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health":
            headers = dict(scope.get("headers") or ())
            given = headers.get(b"authorization", b"")
            if b"x-api-key" in headers:                  # Anthropic clients send the key this way
                given = b"Bearer " + headers[b"x-api-key"]
            if not secrets.compare_digest(given, self.expected):
                err = ApiError(401, "invalid or missing API key (send Authorization: Bearer <key>)",
                               None, code="invalid_api_key")
                await JSONResponse(err.body(), 401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


class ClientGone(Exception):
    """The client closed the connection before its response was ready."""


class Run:
    """The engine requests behind one HTTP request (one per prompt, each with n completions),
    sharing one queue. Choice c is completion c % n of prompt c // n."""

    def __init__(self, loop: EngineLoop, request_id: str, count: int, n: int = 1):
        self.loop, self.n = loop, n
        self.ids = [request_id if count == 1 else f"{request_id}-{i}" for i in range(count)]
        self.index = {rid: i for i, rid in enumerate(self.ids)}
        self.sink: asyncio.Queue[StreamDelta] = asyncio.Queue()
        self.unfinished: set[str] = set()
        self.open: dict[str, set[int]] = {rid: set(range(n)) for rid in self.ids}
        self.prompt_tokens = [0] * count
        self.completion_tokens = 0           # every returned choice's tokens
        self.checked = time.monotonic()     # when the client's connection was last checked

    @property
    def num_choices(self) -> int:
        return len(self.ids) * self.n

    async def start(self, prompts: list, req: ApiRequest, *, chat: bool, arrival: float) -> None:
        for i, (rid, prompt) in enumerate(zip(self.ids, prompts)):
            params = replace(req.params)     # one object per engine request
            try:
                self.unfinished.add(rid)
                self.prompt_tokens[i] = await self.loop.add(rid, prompt, params, self.sink, arrival)
            except InvalidRequestError as exc:
                self.unfinished.discard(rid)
                self.close()
                raise engine_error(str(exc), chat=chat, renames=req.renames) from None
            except ServerDraining as exc:        # shutting down, or the engine process is gone
                self.unfinished.discard(rid)
                self.close()
                raise ApiError(503, str(exc), None, "service_unavailable") from None
            except BaseException:
                self.close()
                raise

    async def next(self, request: Request | None = None) -> tuple[int, StreamDelta]:
        """(choice index, the next delta of any of the requests); with `request`, a client gone
        away aborts them."""
        if request is not None and time.monotonic() - self.checked > DISCONNECT_POLL_S:
            self.checked = time.monotonic()
            if await request.is_disconnected():
                raise ClientGone()
        if request is None or not self.sink.empty():
            delta = await self.sink.get()
        else:
            getter = asyncio.ensure_future(self.sink.get())
            try:
                while True:
                    done, _ = await asyncio.wait({getter}, timeout=DISCONNECT_POLL_S)
                    if done:
                        delta = getter.result()
                        break
                    self.checked = time.monotonic()
                    if await request.is_disconnected():
                        raise ClientGone()
            finally:
                getter.cancel()
        return self._account(delta)

    async def next_batch(self) -> list[tuple[int, StreamDelta]]:
        """The next delta and every other one already queued, each choice's consecutive deltas
        merged into one: a stream that falls a few steps behind catches up in one event each."""
        ready = [self._account(await self.sink.get())]
        while not self.sink.empty():
            ready.append(self._account(self.sink.get_nowait()))
        return _coalesce(ready)

    def _account(self, delta: StreamDelta) -> tuple[int, StreamDelta]:
        rid = delta.request_id
        self.completion_tokens += len(delta.token_ids)
        if delta.finished:
            self.open[rid].discard(delta.index)
            if not self.open[rid]:
                self.unfinished.discard(rid)
        return self.index[rid] * self.n + delta.index, delta

    def usage(self) -> dict:
        p, c = sum(self.prompt_tokens), self.completion_tokens
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def close(self) -> None:
        for rid in self.unfinished:
            self.loop.abort(rid)
        self.unfinished.clear()


def _coalesce(ready: list[tuple[int, StreamDelta]]) -> list[tuple[int, StreamDelta]]:
    """Merges each choice's consecutive deltas (text, tokens, logprobs; the last finish reason)
    in the order choices first appear; an error delta is never merged into another."""
    out: list[tuple[int, StreamDelta]] = []
    last: dict[int, int] = {}              # choice -> its delta in `out` that later ones join
    for c, d in ready:
        at = last.get(c)
        if at is None or _error_reason(d.finish_reason):
            last[c] = len(out)
            out.append((c, d))
            continue
        prev = out[at][1]
        lps = None if prev.logprobs is None and d.logprobs is None else (prev.logprobs or []) + (d.logprobs or [])
        out[at] = (c, StreamDelta(d.request_id, prev.text + d.text,
                                  np.concatenate([prev.token_ids, d.token_ids]), d.finish_reason, d.index, lps,
                                  d.stop_reason))
    return out


@dataclass
class ChatRun:
    """A started chat request: its engine requests, settings and one output parser a choice."""
    run: Run
    req: ApiRequest
    parsers: list[ChatOutputParser]
    stop_reasons: dict[int, int | str | None] = field(default_factory=dict)   # choice -> what stopped it


class _SSE(StreamingResponse):
    """An event stream that aborts its engine requests however it ends (disconnect included)."""

    def __init__(self, body: AsyncIterator[str], run: Run):
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.run = run

    async def __call__(self, scope, receive, send):
        # One plain task watches for the client's disconnect and aborts the engine requests; their
        # 'abort' deltas then end the body. (Starlette spawns an anyio task group per stream for it
        # under uvicorn's ASGI 2.3: docs/server.md, "Server CPU per request".)
        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            self.run.close()
        watcher = asyncio.ensure_future(watch())
        try:
            await self.stream_response(send)
        finally:
            watcher.cancel()
            self.run.close()


async def _inline_or_thread(size: int, fn, *args):
    """fn(*args) here when `size` (characters of input) is small, else on a worker thread."""
    if size <= INLINE_PREP_CHARS:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


def _event(obj: Any) -> str:
    return f"data: {dumps(obj)}\n\n"


def _error_reason(reason: str | None) -> bool:
    return reason is not None and reason.startswith("error")


def _server_error(reason: str) -> ApiError:
    return ApiError(500, reason.removeprefix("error: "), None, "server_error")


class Server:
    """What the routes share: the engine loop, settings and model names. `engine` is an Engine
    or an EngineProcess (the same tokenizer, limits, encode_prompt and driver())."""

    def __init__(self, engine, cfg):
        self.engine, self.cfg, self.scfg = engine, cfg, server_options(cfg)
        self.remote = isinstance(engine, EngineProcess) or getattr(engine, "is_remote", False) is True   # replicas.py
        self.loop = engine.driver()          # the engine's loop thread (shared with library callers), or the pipes to it
        self.loop.hold_for_good()
        self.model_name = self.scfg.served_model_name or str(cfg.model)
        self.aliases = {self.model_name, str(cfg.model), getattr(engine.model_config, "name", "") or self.model_name}
        self.created = int(time.time())
        self.token_text = TokenText(engine.tokenizer)

    # -------------------------------------------------------------------------- helpers
    async def read_json(self, request: Request) -> dict:
        raw = await self.read_body(request)
        try:
            body = json.loads(raw)
        except RecursionError:
            raise bad(None, f"request body nests deeper than server.max_json_depth ({self.scfg.max_json_depth})") from None
        except ValueError as exc:
            raise bad(None, f"request body is not valid JSON: {exc}") from None
        if json_depth_exceeds(body, self.scfg.max_json_depth):
            raise bad(None, f"request body nests deeper than server.max_json_depth ({self.scfg.max_json_depth})")
        if not isinstance(body, dict):
            raise bad(None, "request body must be a JSON object")
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise bad("model", f"model: expected a string, got {json.dumps(model)[:60]}")
        if model is not None and model not in self.aliases:
            raise ApiError(404, f"The model '{model}' does not exist; available: {self.model_name}", "model",
                           code="model_not_found")
        return body

    async def read_body(self, request: Request) -> bytes:
        """The raw body, within server.max_body_bytes and server.read_timeout_s (a client that
        stops sending mid-body gets 408, not a connection held forever)."""
        try:
            return await asyncio.wait_for(self._read_limited(request), self.scfg.read_timeout_s)
        except asyncio.TimeoutError:
            raise ApiError(408, f"the request body did not arrive within server.read_timeout_s "
                                f"({self.scfg.read_timeout_s} s)", None) from None

    async def _read_limited(self, request: Request) -> bytes:
        limit = self.scfg.max_body_bytes
        too_big = ApiError(413, f"request body is larger than server.max_body_bytes ({limit} bytes)", None)
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise too_big
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_big
            chunks.append(chunk)
        return b"".join(chunks)

    def check_structured(self, req: ApiRequest) -> None:
        param = structured_param(req.params)
        if param is not None and not supports_structured_output(self.engine):
            raise bad(param, f"{param}: structured output (json_schema, regex, grammar, choice) is not "
                             f"supported by this engine yet")

    def render_chat(self, messages: list[dict], body: dict) -> tuple[str | list[int], Any, bool]:
        """Messages -> the prompt (text, or ids when content holds special-token text: chat_input.py),
        the tool spec, and whether the prompt leaves the model inside <think>."""
        tok = self.engine.tokenizer
        spec = chat_tools(body)
        originals: list[str] = []
        specials = getattr(tok, "special_token_texts", ())
        if specials:
            messages = mask_special_text(messages, specials, originals)
            spec.tools = mask_special_text(spec.tools, specials, originals)
        text = self._render(tok, messages, spec, body)
        in_think = text.rstrip().endswith("<think>")
        if not originals:
            return self.chat_prompt(text), spec, in_think
        bos = getattr(tok, "bos_token", None)
        head = [] if bos and text.startswith(bos) else tok.encode("", add_special_tokens=True)
        ids = encode_masked(text, originals, tok.encode, tok.encode_as_data)
        if ids is None:
            raise bad("messages", "messages: this chat template does not keep message text apart from its markup, "
                                  "so text holding special tokens cannot be sent as content")
        return head + ids, spec, in_think

    def _render(self, tok, messages: list[dict], spec, body: dict) -> str:
        kwargs = Fields(body).dict("chat_template_kwargs") or {}
        kwargs = {k: v for k, v in kwargs.items() if k not in ("messages", "tools", "add_generation_prompt")}
        if (body.get("chat_template") is not None or "chat_template" in kwargs) and not self.scfg.allow_client_chat_template:
            raise bad("chat_template", "chat_template: templates sent by clients are off on this server "
                                       "(server.allow_client_chat_template=false)")
        if body.get("chat_template") is not None:
            kwargs["chat_template"] = Fields(body).str("chat_template")
        try:
            if spec.tools is not None and template_knows_tools(tok):
                text = tok.apply_chat_template(with_system_text(messages, spec.instruction),
                                               add_generation_prompt=True, tools=spec.tools, **kwargs)
            else:
                text = tok.apply_chat_template(inline_tools(messages, spec.tools, spec.instruction),
                                               add_generation_prompt=True, **kwargs)
        except Exception as exc:   # jinja's TemplateError, raise_exception(...), missing fields
            raise bad("messages", f"messages: the chat template refused them: {exc}") from None
        return text

    async def admit(self, prompts: list, req: ApiRequest, *, chat: bool) -> list[list[int]]:
        """Checks a request's whole cost before any work: sequences against the scheduler, the
        sampling fields, each prompt (tokenized on a worker thread: neither the HTTP loop nor the
        engine loop waits for it) and prompt + max_tokens against the context. Returns the prompts'
        token ids."""
        params, engine = req.params, self.engine
        k = params.best_of or params.n
        limit = engine.max_num_seqs if self.remote else engine.scheduler.max_num_seqs
        if k * len(prompts) > limit:
            what = "best_of" if params.best_of else "n"
            raise bad(what, f"{what}: {len(prompts)} prompt(s) x {k} = {k * len(prompts)} sequences exceed "
                            f"scheduler.max_num_seqs ({limit})")
        try:
            params.validate(engine.model_config.vocab_size)
            ids = await _inline_or_thread(sum(map(len, prompts)), lambda: [engine.encode_prompt(p) for p in prompts])
        except InvalidRequestError as exc:
            raise engine_error(str(exc), chat=chat, renames=req.renames) from None
        for prompt_ids in ids:
            if len(prompt_ids) >= engine.max_model_len:
                raise bad("messages" if chat else "prompt", f"{'messages' if chat else 'prompt'}: {len(prompt_ids)} "
                          f"tokens do not fit the context of {engine.max_model_len} tokens")
        if params.max_tokens is not None:
            for prompt_ids in ids:
                total = len(prompt_ids) + params.max_tokens
                if total > engine.max_model_len:
                    raise bad(req.renames.get("max_tokens", "max_tokens"),
                              f"This model's maximum context length is {engine.max_model_len} tokens. However, you "
                              f"requested {total} tokens ({len(prompt_ids)} in the prompt, {params.max_tokens} in "
                              f"the completion). Please reduce the prompt or the completion length.")
        return ids

    def chat_prompt(self, text: str) -> str | list[int]:
        """The rendered conversation as the engine takes it: token ids when the template wrote a
        BOS that encoding would add again (Llama 3), else the text."""
        tok = self.engine.tokenizer
        bos = getattr(tok, "bos_token", None)
        if bos and text.startswith(bos) and tok.encode("", add_special_tokens=True):
            return tok.encode(text, add_special_tokens=False)
        return text

    # ---------------------------------------------------------------------- completions
    async def completions(self, request: Request):
        arrival = time.perf_counter()
        body = await self.read_json(request)
        prompts = completion_prompts(body)
        req = sampling_request(body, chat=False, default_max_tokens=16)
        self.check_structured(req)
        echo = Fields(body).bool("echo", False)
        if body.get("suffix"):
            raise bad("suffix", "suffix: not supported")
        rid = f"cmpl-{uuid.uuid4().hex}"
        n = req.params.n
        ids = await self.admit(prompts, req, chat=False)
        run = Run(self.loop, rid, len(prompts), n)
        await run.start(ids, req, chat=False, arrival=arrival)
        echoes = [self._prompt_text(p) if echo else "" for p in prompts]
        echoes = [echoes[c // n] for c in range(run.num_choices)]           # per choice
        lps = [CompletionLogprobs(self.token_text, len(e)) if req.params.logprobs is not None else None
               for e in echoes]
        head = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": self.model_name}
        if req.stream:
            return _SSE(self._completion_events(run, head, echoes, lps, req.include_usage), run)
        texts, reasons = list(echoes), [None] * run.num_choices
        try:
            while run.unfinished:
                c, delta = await run.next(request)
                texts[c] += delta.text
                reasons[c] = delta.finish_reason or reasons[c]
                if lps[c] is not None:
                    lps[c].add(delta.token_ids, delta.logprobs or [])
        finally:
            run.close()
        for reason in reasons:
            if _error_reason(reason):
                raise _server_error(reason)
        choices = [{"index": c, "text": t, "logprobs": lp.body() if lp is not None else None, "finish_reason": r}
                   for c, (t, r, lp) in enumerate(zip(texts, reasons, lps))]
        return JSONResponse({**head, "choices": choices, "usage": run.usage()})

    def _prompt_text(self, prompt) -> str:
        if isinstance(prompt, str):
            return prompt
        decode = getattr(self.engine.tokenizer, "decode", None)
        return decode(prompt) if decode else ""

    async def _completion_events(self, run: Run, head: dict, echoes: list[str], lps: list,
                                 include_usage: bool) -> AsyncIterator[str]:
        extra = {"usage": None} if include_usage else {}

        def chunk(c: int, text: str, finish: str | None = None) -> str:
            lp = lps[c].take() if lps[c] is not None else None
            return _event({**head, "choices": [{"index": c, "text": text, "logprobs": lp,
                                                "finish_reason": finish}], **extra})

        for c, text in enumerate(echoes):
            if text:
                yield chunk(c, text)
        while run.unfinished:
            for c, delta in await run.next_batch():
                if _error_reason(delta.finish_reason):
                    yield _event(_server_error(delta.finish_reason).body())
                    continue
                if lps[c] is not None:        # held-back text: its tokens go with the next chunk
                    lps[c].add(delta.token_ids, delta.logprobs or [])
                if delta.text or delta.finished:
                    yield chunk(c, delta.text, delta.finish_reason)
        if include_usage:
            yield _event({**head, "choices": [], "usage": run.usage()})
        yield "data: [DONE]\n\n"

    # ----------------------------------------------------------------------------- chat
    async def start_chat(self, body: dict, rid: str, arrival: float) -> "ChatRun":
        """A chat-shaped request (OpenAI chat body; the Anthropic and Responses routes convert
        theirs to one) checked, rendered, admitted and started."""
        messages = chat_messages(body)
        req = sampling_request(body, chat=True, default_max_tokens=None)
        self.check_structured(req)
        size = len(repr(messages)) + len(repr(body.get("tools") or ""))
        prompt, spec, in_think = await _inline_or_thread(size, self.render_chat, messages, body)
        if spec.require and hasattr(req.params, "require_tool_call"):
            req.params.require_tool_call = True      # the engine forces the tool-call start token
        ids = await self.admit([prompt], req, chat=True)
        run = Run(self.loop, rid, 1, req.params.n)
        await run.start(ids, req, chat=True, arrival=arrival)
        parsers = [ChatOutputParser(reasoning=self.scfg.parse_reasoning, tools=spec.parse, in_reasoning=in_think)
                   for _ in range(run.num_choices)]
        return ChatRun(run, req, parsers)

    async def chat_outputs(self, cr: "ChatRun", request: Request) -> tuple[list[ParsedChat], list[str | None]]:
        """Every choice's whole answer (content, reasoning, tool calls) and finish reason; an
        engine error is a 500."""
        outs = [ParsedChat() for _ in cr.parsers]
        reasons: list[str | None] = [None] * cr.run.num_choices
        try:
            while cr.run.unfinished:
                c, delta = await cr.run.next(request)
                outs[c].add(cr.parsers[c].feed(delta.text))
                reasons[c] = delta.finish_reason or reasons[c]
                if delta.finished:
                    cr.stop_reasons[c] = delta.stop_reason
        finally:
            cr.run.close()
        for reason in reasons:
            if _error_reason(reason):
                raise _server_error(reason)
        for out, parser in zip(outs, cr.parsers):
            out.add(parser.finish())
        return outs, reasons

    async def chat_events(self, cr: "ChatRun") -> AsyncIterator[tuple[int, str, Any]]:
        """(choice, kind, value) as the answer streams: kinds 'reasoning' / 'content' (text),
        'tool_call' (a ToolCall), 'finish' (the reason), 'error' (a message; nothing follows)."""
        while cr.run.unfinished:
            for c, delta in await cr.run.next_batch():
                if _error_reason(delta.finish_reason):
                    yield c, "error", delta.finish_reason.removeprefix("error: ")
                    return
                parser = cr.parsers[c]
                for kind, value in parser.feed(delta.text) + (parser.finish() if delta.finished else []):
                    yield c, kind, value
                if delta.finished:
                    cr.stop_reasons[c] = delta.stop_reason
                    yield c, "finish", delta.finish_reason

    async def chat(self, request: Request):
        arrival = time.perf_counter()
        body = await self.read_json(request)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        cr = await self.start_chat(body, rid, arrival)
        run, req, parsers = cr.run, cr.req, cr.parsers
        top = req.params.logprobs                    # None: no logprobs asked
        head = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": self.model_name}
        if req.stream:
            return _SSE(self._chat_events(run, {**head, "object": "chat.completion.chunk"}, parsers, top,
                                          req.include_usage), run)
        outs = [ParsedChat() for _ in parsers]
        reasons: list[str | None] = [None] * run.num_choices
        items: list[list] = [[] for _ in parsers]
        try:
            while run.unfinished:
                c, delta = await run.next(request)
                outs[c].add(parsers[c].feed(delta.text))
                reasons[c] = delta.finish_reason or reasons[c]
                if top is not None:
                    items[c] += chat_content(delta.token_ids, delta.logprobs or [], top, self.token_text)
        finally:
            run.close()
        for reason in reasons:
            if _error_reason(reason):
                raise _server_error(reason)
        choices = []
        for c, (out, parser, reason) in enumerate(zip(outs, parsers, reasons)):
            out.add(parser.finish())
            message: dict[str, Any] = {"role": "assistant", "content": out.content}
            if out.reasoning:
                message["reasoning_content"] = out.reasoning
            if out.tool_calls:
                message["tool_calls"] = [t.to_openai() for t in out.tool_calls]
                message["content"] = out.content.strip() or None
            choices.append({"index": c, "message": message,
                            "logprobs": {"content": items[c], "refusal": None} if top is not None else None,
                            "finish_reason": "tool_calls" if out.tool_calls and reason == "stop" else reason})
        return JSONResponse({**head, "choices": choices, "usage": run.usage()})

    async def _chat_events(self, run: Run, head: dict, parsers: list[ChatOutputParser], top: int | None,
                           include_usage: bool) -> AsyncIterator[str]:
        extra = {"usage": None} if include_usage else {}
        pending: list[list] = [[] for _ in parsers]     # logprobs of tokens whose text is not sent yet

        def chunk(c: int, delta: dict, finish: str | None = None) -> str:
            lp = None
            if top is not None and (pending[c] or finish is not None):
                lp, pending[c] = {"content": pending[c], "refusal": None}, []
            return _event({**head, "choices": [{"index": c, "delta": delta, "logprobs": lp,
                                                "finish_reason": finish}], **extra})

        for c in range(len(parsers)):
            yield chunk(c, {"role": "assistant", "content": ""})
        n_calls = [0] * len(parsers)
        failed = False
        while run.unfinished and not failed:
            for c, delta in await run.next_batch():
                if _error_reason(delta.finish_reason):
                    yield _event(_server_error(delta.finish_reason).body())
                    failed = True
                    break
                if top is not None:
                    pending[c] += chat_content(delta.token_ids, delta.logprobs or [], top, self.token_text)
                events = parsers[c].feed(delta.text) + (parsers[c].finish() if delta.finished else [])
                for kind, value in events:
                    if kind == "tool_call":
                        yield chunk(c, {"tool_calls": [value.to_openai(n_calls[c])]})
                        n_calls[c] += 1
                    else:
                        yield chunk(c, {"reasoning_content" if kind == "reasoning" else "content": value})
                if delta.finished:
                    reason = delta.finish_reason
                    yield chunk(c, {}, "tool_calls" if n_calls[c] and reason == "stop" else reason)
        if include_usage:
            yield _event({**head, "choices": [], "usage": run.usage()})
        yield "data: [DONE]\n\n"

    # ---------------------------------------------------------------------------- other
    async def tokenize(self, request: Request) -> dict:
        """vLLM's /tokenize: a prompt (or chat messages, rendered) -> its token ids."""
        body = await self.read_json(request)
        if body.get("messages") is not None:
            prompt, _, _ = await asyncio.to_thread(self.render_chat, chat_messages(body), body)
        else:
            prompt = Fields(body).str("prompt")
            if prompt is None:
                raise bad("prompt", "prompt: is required (or messages)")
        if isinstance(prompt, str):
            special = Fields(body).bool("add_special_tokens", True)
            ids = await asyncio.to_thread(self.engine.tokenizer.encode, prompt, special)
        else:
            ids = prompt
        return {"tokens": list(ids), "count": len(ids), "max_model_len": self.engine.max_model_len}

    async def detokenize(self, request: Request) -> dict:
        body = await self.read_json(request)
        ids = Fields(body).int_list("tokens")
        if ids is None:
            raise bad("tokens", "tokens: is required (an array of token ids)")
        vocab = self.engine.model_config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise bad("tokens", f"tokens: ids must lie in [0, {vocab})")
        return {"prompt": await asyncio.to_thread(self.engine.tokenizer.decode, ids, False)}

    async def metrics_text(self) -> str:
        """The Prometheus text: the engine loop's metrics (in the engine process: asked over the pipe)."""
        return await self.loop.metrics_text() if self.remote else self.loop.metrics.render()

    def models(self) -> dict:
        card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "metrale",
                "root": str(self.cfg.model), "max_model_len": self.engine.max_model_len}
        return {"object": "list", "data": [card]}


# The routes whose handlers return a Response and that carry the engine's load: served by
# _EnginePosts past FastAPI's routing and middleware (docs/server.md, "Server CPU per request").
ENGINE_POSTS = ("/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses")


async def _error_response(_request: Request | None, exc: Exception) -> Response:
    """How any route answers an exception its handler raised (the app's exception handlers)."""
    if isinstance(exc, ApiError):
        return JSONResponse(exc.body(), exc.status)
    if isinstance(exc, ClientGone):
        return Response(status_code=499)     # nobody reads it; the engine requests are aborted
    if isinstance(exc, StarletteHTTPException):
        err = ApiError(exc.status_code, str(exc.detail), None,
                       "not_found_error" if exc.status_code == 404 else "invalid_request_error")
        return JSONResponse(err.body(), exc.status_code, headers=getattr(exc, "headers", None))
    log.exception("request failed", exc_info=exc)
    return JSONResponse(ApiError(500, f"{type(exc).__name__}: {exc}", None, "server_error").body(), 500)


class _EnginePosts:
    """ASGI middleware: a POST to one of `routes` goes straight to its handler, its exceptions
    answered by _error_response; anything else goes on to the app."""

    def __init__(self, app, routes: dict):
        self.app, self.routes = app, routes

    async def __call__(self, scope, receive, send):
        handle = self.routes.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if handle is None:
            return await self.app(scope, receive, send)
        request = Request(scope, receive)
        try:
            response = await handle(request)
        except Exception as exc:  # noqa: BLE001 - answered as the app's exception handlers answer
            response = await _error_response(request, exc)
        await response(scope, receive, send)


def _post_route(handle):
    """A POST route that hands the raw request to `handle` (bodies are checked by hand: protocol.py)."""
    async def route(request: Request):
        return await handle(request)
    return route


def create_app(engine, cfg=None) -> FastAPI:
    """The FastAPI app serving `engine`; settings from cfg.server (default: the engine's config).
    The engine loop starts with the app's lifespan and drains when it ends."""
    cfg = cfg if cfg is not None else engine.cfg
    server = Server(engine, cfg)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        server.loop.start()
        try:
            yield
        finally:
            await server.loop.drain(0.0)

    app = FastAPI(title="metrale", version="0.1.0", lifespan=lifespan, openapi_url="/openapi.json",
                  docs_url=None, redoc_url=None)
    app.state.server = server
    app.state.engine_loop = server.loop

    for kind in (ApiError, ClientGone, StarletteHTTPException, Exception):
        app.add_exception_handler(kind, _error_response)

    posts = {"/v1/completions": server.completions, "/v1/chat/completions": server.chat,
             "/v1/messages": lambda r: anthropic_api.messages(server, r),
             "/v1/responses": lambda r: responses_api.responses(server, r),
             "/tokenize": server.tokenize, "/detokenize": server.detokenize}
    for path, handle in posts.items():
        app.add_api_route(path, _post_route(handle), methods=["POST"], name=path.strip("/").replace("/", "_"),
                          openapi_extra=openapi_extra(path))
    app.add_middleware(_EnginePosts, routes={path: posts[path] for path in ENGINE_POSTS})

    @app.get("/v1/models")
    async def models():
        return server.models()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id not in server.aliases:
            raise ApiError(404, f"model '{model_id}' is not served here", "model", "not_found_error")
        return server.models()["data"][0]

    @app.get("/health")
    async def health():
        if not server.loop.alive or not server.loop.accepting:
            return JSONResponse({"status": "unavailable"}, 503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        try:
            text = await server.metrics_text()
        except (ServerDraining, asyncio.TimeoutError) as exc:
            raise ApiError(503, str(exc) or "the engine did not answer", None, "service_unavailable") from None
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    if cfg.server.api_key:
        app.add_middleware(_Auth, key=str(cfg.server.api_key))
    return app
