"""The engine in its own process (`python -m metrale serve`, server.engine_process=true; vLLM's
AsyncLLM / EngineCore split): the HTTP server and the engine loop no longer share a GIL.

    server process (this module's EngineProcess)         engine process (engine_child.py, spawned)
      HTTP handlers -> ProcessLoop.add/abort  --commands-->  reader thread -> EngineLoop commands
      event-loop reader: one message a step   <--events----  EngineLoop thread: Engine.poll(); each
      -> each request's asyncio.Queue                         dispatch of a step = one message

What crosses the pipes (pickled, length-prefixed frames): to the engine `("add", key, id,
prompt ids, SamplingParams, age s, chat)`, `("abort", id)`, `("call", id, "metrics" | "state")`,
`("stop",)`; back, once `("ready", EngineInfo)` (tokenizer, chat template, limits) or
`("failed", one line)`, then per step `("deltas", [(key, text, int32 bytes) or (key, text, int32
bytes, index, finish_reason, logprobs, stop_reason), ...])`, per add `("added", key, prompt
tokens)` or `("refused", key, kind, message)`, `("reply", id, ok, value)` and at the end
`("bye", why)`. The text of a request of token ids with one completion and no stop strings is
decoded here from its deltas' ids (SamplingParams.detokenize=False there); the engine decodes
the others' (RequestState, as in-process), whose delta text is ready to send.
Invariants: every request the server accepted ends with one finished delta per completion, from
the engine or, when the engine process dies, from here ('error: the engine process ...'); the
engine process exits when told to stop or when the server's end of the commands pipe closes.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.util
import itertools
import logging
import multiprocessing
import os
import pickle
import queue
import signal
import struct
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, AsyncIterator, Callable, Iterator

import numpy as np
from omegaconf import OmegaConf

from metrale.driver import ServerDraining
from metrale.engine import Engine
from metrale.options import server_options
from metrale.outputs import StreamDelta
from metrale.sampling.params import InvalidRequestError

log = logging.getLogger("metrale.server")

_EMPTY = np.zeros(0, dtype=np.int32)
_HEADER = struct.Struct("!I")
PIPE_BYTES = 1 << 20        # the events pipe's buffer (Linux F_SETPIPE_SZ): ~1,000 steps of 64 decode deltas
STOP_TIMEOUT_S = 30.0       # how long a stopped engine process may take to exit before it is killed


class EngineStartError(RuntimeError):
    """The engine process could not start (bad model path, bad setting, a crash while loading)."""


class EngineUnavailable(ServerDraining):
    """The engine process is not running: a request cannot be taken."""


@dataclass
class EngineInfo:
    """What the server needs of the engine, sent once by the engine process when it is ready."""
    model_config: Any              # metrale.models.config.ModelConfig
    tokenizer: Any                 # the engine's tokenizer (its chat template included)
    max_model_len: int
    max_num_seqs: int
    structured_output: bool        # SamplingParams.json_schema/regex/grammar/choice are enforced
    backend: str                   # "cpu" | "cuda" | ...
    load_seconds: float
    pid: int


def supports_structured_output(engine) -> bool:
    """Whether the engine enforces SamplingParams.json_schema/regex/grammar/choice: its own
    `supports_structured_output` flag if it has one, else whether the grammar module exists."""
    flag = getattr(engine, "supports_structured_output", None)
    if flag is not None:
        return bool(flag)
    return importlib.util.find_spec("metrale.sampling.grammar") is not None


def build_engine(cfg) -> Engine:
    """The engine process's default engine: Engine(cfg=cfg)."""
    return Engine(cfg=cfg)


# --------------------------------------------------------------------------------- framing
def _send(fd: int, obj: Any) -> None:
    _write_frame(fd, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _write_frame(fd: int, data: bytes) -> None:
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def _read_exactly(fd: int, n: int) -> bytes:
    chunks = []
    while n:
        chunk = os.read(fd, n)
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _recv(fd: int) -> Any:
    """One message (blocking); EOFError once the other end closed."""
    (size,) = _HEADER.unpack(_read_exactly(fd, _HEADER.size))
    return pickle.loads(_read_exactly(fd, size))


def _frames(buf: bytearray) -> list[bytes]:
    """Takes the whole frames off the front of buf."""
    out, at = [], 0
    while len(buf) - at >= _HEADER.size:
        (size,) = _HEADER.unpack_from(buf, at)
        if len(buf) - at - _HEADER.size < size:
            break
        out.append(bytes(buf[at + _HEADER.size:at + _HEADER.size + size]))
        at += _HEADER.size + size
    del buf[:at]
    return out


def _exit_text(code: int | None) -> str:
    if code is None:
        return "it closed its pipe"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


# ------------------------------------------------------------------------- server process
@dataclass
class _Remote:
    """A request the engine process runs for a caller here: its sink is an asyncio.Queue of
    `aloop`, or (aloop None) a thread's queue.SimpleQueue."""
    request_id: str
    aloop: asyncio.AbstractEventLoop | None
    sink: Any
    open: set[int]
    decoder: Any = None        # its text is decoded here from the ids (the engine sends none)

    def text(self, ids: np.ndarray, reason: str | None) -> str:
        """The text of a delta's ids, as the engine's RequestState would have made it: a stop
        token ends the request undecoded, and the decoder's held-back bytes close the last delta."""
        dec = self.decoder
        if reason == "stop" and len(ids):
            ids = ids[:-1]
        text = "".join([dec.feed(t) for t in ids.tolist()])
        return text + dec.flush() if reason is not None else text


def _decodes_here(prompt, params) -> bool:
    """Whether the server decodes a request's text from its ids (vLLM's front end does the same):
    one completion of token ids with no stop strings, which the engine would have to match in the
    text. The engine process then spends no host time on text (SamplingParams.detokenize=False)."""
    return (params.detokenize and isinstance(prompt, list) and params.n == 1 and not (params.best_of or 0) > 1
            and not params.stop_strings)


class EngineProcess:
    """The server's handle on the engine process; stands where create_app takes an Engine (the
    tokenizer, the limits, encode_prompt, driver()). `EngineProcess.start(cfg)` spawns it and
    returns once its engine is ready, or raises EngineStartError with the engine's one-line error."""

    def __init__(self, process, info: EngineInfo, commands_fd: int, events_fd: int, cfg):
        self.process, self.info, self.cfg = process, info, cfg
        self.tokenizer, self.model_config = info.tokenizer, info.model_config
        getattr(self.tokenizer, "token_bytes", lambda: None)()    # the decoders' byte table, built before any request
        self.max_model_len, self.max_num_seqs = info.max_model_len, info.max_num_seqs
        self.supports_structured_output = info.structured_output
        self.loop = ProcessLoop(self, commands_fd, events_fd)

    encode_prompt = Engine.encode_prompt     # the same checks and messages as in-process (reads tokenizer, model_config)

    @classmethod
    def start(cls, cfg, build: Callable = build_engine) -> "EngineProcess":
        """Spawns the engine process (build(cfg) makes its engine; a picklable top-level function)
        and waits for it to be ready."""
        from metrale.server.engine_child import child_main
        ctx = multiprocessing.get_context("spawn")
        cmd_r, cmd_w = os.pipe()
        ev_r, ev_w = os.pipe()
        # a daemonic process may not start processes: a tensor- or expert-parallel engine spawns its
        # ranks (close() and the pipes' end stop it either way)
        single = max(int(OmegaConf.select(cfg, f"parallel.{k}", default=1)) for k in ("tensor", "expert")) <= 1
        process = ctx.Process(target=child_main, name="metrale-engine", daemon=single,
                              args=(cfg, _FdHandle(cmd_r), _FdHandle(ev_w), build))
        try:
            process.start()
        finally:
            os.close(cmd_r)
            os.close(ev_w)
        try:
            first = _recv(ev_r)
        except EOFError:
            process.join(5)
            os.close(cmd_w)
            os.close(ev_r)
            raise EngineStartError(f"the engine process exited during start-up ({_exit_text(process.exitcode)})") from None
        except Exception as exc:        # its EngineInfo does not unpickle here (a module this process lacks)
            _end(process, cmd_w, ev_r)
            raise EngineStartError(f"the engine process's ready message does not load here: "
                                   f"{type(exc).__name__}: {exc}") from None
        except BaseException:           # Ctrl-C while loading: no orphan
            _end(process, cmd_w, ev_r)
            raise
        if first[0] != "ready":
            _end(process, cmd_w, ev_r)
            raise EngineStartError(first[1])
        return cls(process, first[1], cmd_w, ev_r, cfg)

    def driver(self) -> "ProcessLoop":
        return self.loop

    @property
    def pid(self) -> int:
        return self.process.pid

    def close(self) -> None:
        """Stops the engine process if it still runs (idempotent; the server's last word)."""
        self.loop.close()


class _FdHandle:
    """A file descriptor that travels to a spawned child (multiprocessing passes it at spawn)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        from multiprocessing.context import get_spawning_popen
        return _FdHandle, (get_spawning_popen().duplicate_for_child(self.fd),)


def _end(process, *fds: int) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    process.join(STOP_TIMEOUT_S if process.is_alive() else 0)
    if process.is_alive():
        process.kill()
        process.join(5)


class ProcessLoop:
    """EngineLoop's interface (add / submit / stream / astream / abort / drain / stop / alive /
    accepting) over the pipes. The events pipe is read on one asyncio event loop (the server's,
    attached by start() in the app's lifespan; else a thread of its own): no thread of this
    process waits for the GIL to hand a step's deltas over."""

    def __init__(self, owner: EngineProcess, commands_fd: int, events_fd: int):
        self.owner, self.process = owner, owner.process
        self.decode_here = server_options(owner.cfg).decode_in_server
        self.accepting = True
        self._cmd_fd, self._ev_fd = commands_fd, events_fd
        self._send_lock = threading.Lock()
        self._live: dict[int, _Remote] = {}
        self._keys_of: dict[str, int] = {}
        self._adds: dict[int, concurrent.futures.Future] = {}
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._next = itertools.count(1)
        self._buf = bytearray()
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._gone = threading.Event()          # the events pipe closed (the engine process ended)
        self._stopping = False
        self._last_word: str | None = None      # the engine process's own account of why it ended
        self.exit_reason: str | None = None     # why the engine process is gone, once it is

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Starts reading the engine's events on the running event loop (the app's lifespan), or
        outside one on a thread of its own."""
        if self._aloop is not None:
            return
        try:
            self._aloop = asyncio.get_running_loop()
        except RuntimeError:
            self._read_on_own_thread()
        else:
            self._attach()

    def _read_on_own_thread(self) -> None:
        """A caller came before start() (a library-style stream): the events get a loop of their own."""
        with self._send_lock:
            if self._aloop is None:
                self._aloop = asyncio.new_event_loop()
                threading.Thread(target=self._aloop.run_forever, name="metrale-engine-events", daemon=True).start()
                self._aloop.call_soon_threadsafe(self._attach)

    def _attach(self) -> None:
        os.set_blocking(self._ev_fd, False)
        self._aloop.add_reader(self._ev_fd, self._on_readable)
        self._on_readable()                    # anything sent before the reader was attached

    @property
    def alive(self) -> bool:
        return not self._gone.is_set() and self.process.is_alive()

    def hold_for_good(self) -> None:
        """The server holds the engine process for its lifetime (EngineLoop's interface)."""

    async def drain(self, grace_s: float, cut_short: Callable[[], bool] = lambda: False) -> None:
        """Refuses new requests, lets in-flight ones run up to grace_s (or until cut_short()),
        aborts the rest, stops the engine process and waits for it to exit."""
        self.accepting = False
        deadline = time.monotonic() + grace_s
        while self._live and time.monotonic() < deadline and self.alive and not cut_short():
            await asyncio.sleep(0.02)
        self.stop()
        await asyncio.to_thread(self._await_exit)

    def stop(self) -> None:
        """Aborts whatever still runs and asks the engine process to exit."""
        self.accepting = False
        if not self._stopping and not self._gone.is_set():
            self._stopping = True
            self._post(("stop",))

    def close(self) -> None:
        self.stop()
        self._await_exit()

    def _await_exit(self) -> None:
        """Waits for the engine process to end after stop(); kills it if it does not."""
        read = self._aloop is not None and not self._aloop.is_closed()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        if (read and not self._gone.wait(STOP_TIMEOUT_S)) or not _joined(self.process, deadline - time.monotonic()):
            log.warning("the engine process did not stop within %.0f s: killing it", STOP_TIMEOUT_S)
            self.process.kill()
            self.process.join(5)
        if not read:                  # nobody read the events (never started): settle here
            self._ended()

    # ------------------------------------------------------------------- requests
    async def add(self, request_id: str, prompt, params, sink: asyncio.Queue,
                  arrival: float | None = None, chat: bool = False) -> int:
        """Queues a request; returns its prompt length in tokens. Raises the engine's
        InvalidRequestError (refused), or ServerDraining / EngineUnavailable."""
        done = self._queue_add(request_id, prompt, params, asyncio.get_running_loop(), sink, arrival, chat)
        try:
            return await asyncio.wrap_future(done)
        except asyncio.CancelledError:
            self.abort(request_id)
            raise

    def submit(self, request_id: str, prompt, params, sink: queue.SimpleQueue, chat: bool = False) -> int:
        """`add` for a thread: blocks until the engine took (or refused) the request."""
        return self._queue_add(request_id, prompt, params, None, sink, None, chat).result()

    def stream(self, request_id: str, prompt, params, chat: bool = False) -> Iterator[StreamDelta]:
        sink: queue.SimpleQueue = queue.SimpleQueue()
        self.submit(request_id, prompt, params, sink, chat)
        yield from _until_finished(sink.get, params.n, lambda: self.abort(request_id))

    async def astream(self, request_id: str, prompt, params, chat: bool = False) -> AsyncIterator[StreamDelta]:
        sink: asyncio.Queue = asyncio.Queue()
        await self.add(request_id, prompt, params, sink, chat=chat)
        left = params.n
        try:
            while left:
                delta = await sink.get()
                left -= delta.finished
                yield delta
        finally:
            if left:
                self.abort(request_id)

    def _queue_add(self, request_id, prompt, params, aloop, sink, arrival, chat) -> concurrent.futures.Future:
        done: concurrent.futures.Future = concurrent.futures.Future()
        if not self.accepting or not self.alive:
            done.set_exception(self._refusal())
            return done
        if self._aloop is None:
            self._read_on_own_thread()
        key = next(self._next)
        remote = self._live[key] = _Remote(request_id, aloop, sink, set(range(params.n)))
        if self.decode_here and _decodes_here(prompt, params):
            remote.decoder = self.owner.tokenizer.incremental_decoder(prompt, params.skip_special_tokens)
            params = replace(params, detokenize=False)
        self._keys_of[request_id] = key
        self._adds[key] = done
        age = time.perf_counter() - arrival if arrival is not None else 0.0
        prompt = [int(t) for t in prompt] if isinstance(prompt, np.ndarray) else prompt
        self._post(("add", key, request_id, prompt, params, age, chat))
        if self._gone.is_set():        # it died meanwhile (a thread caller): _ended may have missed this one
            self._live.pop(key, None)
            _settle(self._adds.pop(key, None), None, self._refusal())
        return done

    def abort(self, request_id: str, wait: bool = False) -> None:
        """Aborts a request if it still runs (its finished delta comes back as the engine's);
        wait is accepted for EngineLoop's interface and ignored."""
        if request_id in self._keys_of and not self._gone.is_set():
            self._post(("abort", request_id))

    def _refusal(self) -> ServerDraining:
        if self.exit_reason is not None and not self._stopping:
            return EngineUnavailable(f"the engine process is not running ({self.exit_reason})")
        return ServerDraining("the server is shutting down")

    # ------------------------------------------------------------------- queries
    async def metrics_text(self) -> str:
        """The engine's /metrics text (its EngineLoop keeps the counters and histograms)."""
        return await self._query("metrics")

    async def engine_state(self) -> dict:
        """The engine's block manager and request counts, read between its steps (tests)."""
        return await self._query("state")

    async def _query(self, what: str, timeout: float = 30.0):
        if not self.alive:
            raise self._refusal() if self.exit_reason else EngineUnavailable("the engine process is not running")
        cid = next(self._next)
        done = self._calls[cid] = concurrent.futures.Future()
        self._post(("call", cid, what))
        if self._gone.is_set():
            _settle(self._calls.pop(cid, None), None, self._refusal())
        return await asyncio.wait_for(asyncio.wrap_future(done), timeout)

    # ------------------------------------------------------------- the two pipes
    def _post(self, cmd: tuple) -> None:
        with self._send_lock:
            if self._gone.is_set():           # its fd is closed (the number may be reused)
                return
            try:
                _send(self._cmd_fd, cmd)
            except OSError:        # the engine process is gone; its events pipe tells the reader
                pass

    def _on_readable(self) -> None:
        """Reads what the engine sent (every whole message now in the pipe), then delivers each
        event loop's and thread's deltas in one go."""
        try:
            while True:
                chunk = os.read(self._ev_fd, 1 << 20)
                if not chunk:
                    return self._ended()
                self._buf += chunk
                if len(chunk) < 1 << 20:
                    break
        except BlockingIOError:
            pass
        except OSError:
            return self._ended()
        batches: dict[Any, list] = {}
        for frame in _frames(self._buf):
            self._handle(pickle.loads(frame), batches)
        self._deliver(batches)

    def _handle(self, msg: tuple, batches: dict) -> None:
        kind = msg[0]
        if kind == "deltas":
            live = self._live
            for item in msg[1]:
                r = live.get(item[0])
                if r is None:
                    continue
                if len(item) == 3:
                    ids = np.frombuffer(item[2], np.int32)
                    delta = StreamDelta(r.request_id, item[1] if r.decoder is None else r.text(ids, None), ids)
                else:
                    _, text, ids, index, reason, lps, stop = item
                    ids = np.frombuffer(ids, np.int32)
                    if r.decoder is not None:
                        text = r.text(ids, reason)
                    delta = StreamDelta(r.request_id, text, ids, reason, index, lps, stop)
                    if reason is not None:
                        self._closed(item[0], r, index)
                batches.setdefault(r.aloop, []).append((r.sink, delta))
        elif kind == "added":
            _settle(self._adds.pop(msg[1], None), msg[2], None)
        elif kind == "refused":
            _, key, why, message = msg
            r = self._live.pop(key, None)
            if r is not None:
                self._keys_of.pop(r.request_id, None)
            exc = {"invalid": InvalidRequestError, "draining": ServerDraining}.get(why, RuntimeError)(message)
            _settle(self._adds.pop(key, None), None, exc)
        elif kind == "reply":
            _, cid, ok, value = msg
            _settle(self._calls.pop(cid, None), value if ok else None, None if ok else RuntimeError(value))
        elif kind == "bye" and msg[1] != "stopped":
            self._last_word = msg[1]

    def _closed(self, key: int, r: _Remote, index: int) -> None:
        r.open.discard(index)
        if not r.open:
            del self._live[key]
            if self._keys_of.get(r.request_id) == key:
                del self._keys_of[r.request_id]

    def _deliver(self, batches: dict) -> None:
        for aloop, items in batches.items():
            if aloop is None or aloop is self._aloop:
                _put_all(items)
            else:
                try:
                    aloop.call_soon_threadsafe(_put_all, items)
                except RuntimeError:        # that event loop is closed: nobody is waiting any more
                    pass

    def _ended(self) -> None:
        """The events pipe closed: the engine process is gone. Every request still here ends
        ('abort' after a stop, else an error naming the exit), every waiting add and query fails."""
        if self._gone.is_set():
            return
        if self._aloop is not None and not self._aloop.is_closed():
            try:
                self._aloop.remove_reader(self._ev_fd)
            except (RuntimeError, ValueError):
                pass
        self.accepting = False
        self.process.join(1.0)
        self.exit_reason = self._last_word or _exit_text(self.process.exitcode)
        reason = "abort" if self._stopping else f"error: the engine process died ({self.exit_reason})"
        if not self._stopping:
            log.error("the engine process died (%s); %d request(s) in flight end with an error",
                      self.exit_reason, len(self._live))
        batches: dict[Any, list] = {}
        for key, r in list(self._live.items()):
            for index in sorted(r.open):
                batches.setdefault(r.aloop, []).append((r.sink, StreamDelta(r.request_id, "", _EMPTY, reason, index)))
        self._live.clear()
        self._keys_of.clear()
        self._gone.set()
        for fut in list(self._adds.values()) + list(self._calls.values()):
            _settle(fut, None, self._refusal())
        self._adds.clear()
        self._calls.clear()
        self._deliver(batches)
        with self._send_lock:
            for fd in (self._ev_fd, self._cmd_fd):
                try:
                    os.close(fd)
                except OSError:
                    pass


def _until_finished(get: Callable[[], StreamDelta], n: int, abort: Callable[[], None]) -> Iterator[StreamDelta]:
    left = n
    try:
        while left:
            delta = get()
            left -= delta.finished
            yield delta
    finally:
        if left:
            abort()


def _put_all(items: list) -> None:
    for sink, delta in items:
        sink.put_nowait(delta)


def _settle(fut: concurrent.futures.Future | None, value, exc: BaseException | None) -> None:
    if fut is not None and not fut.done():
        fut.set_exception(exc) if exc is not None else fut.set_result(value)


def _joined(process, timeout: float) -> bool:
    process.join(max(timeout, 0.0))
    return not process.is_alive()
