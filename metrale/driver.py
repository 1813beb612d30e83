"""EngineLoop: the one thread that drives an engine for concurrent callers (the HTTP server,
and `Engine.stream` / `astream` / `generate` while it runs).

Callers never touch the engine. They send commands (add, abort, stop) through a thread-safe
queue; the loop thread applies them between steps, calls `engine.poll()` (one step) while any
request is unfinished, and hands each StreamDelta to the sink of the caller that owns the
request: an asyncio.Queue (delivered on its event loop with `call_soon_threadsafe`, one wake-up a
step) or a queue.SimpleQueue (a thread's). With no work it blocks on the command queue.
Invariants: every completion of a request the loop accepted (n of them; `index` tells them apart)
gets exactly one finished delta (its finish reason, 'abort', or 'error: <why>'), so no caller
waits forever; the loop thread is the only caller of the engine while it runs.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Iterator

import numpy as np

from metrale.outputs import StreamDelta
from metrale.metrics import Metrics, finish_label

_EMPTY = np.zeros(0, dtype=np.int32)

log = logging.getLogger("metrale")


class ServerDraining(RuntimeError):
    """The server is shutting down and takes no new requests."""


@dataclass
class _Live:
    """What the loop knows about one request it runs: its sink is an asyncio.Queue of `aloop`,
    or (aloop None) a thread's queue.SimpleQueue. `aloop` may be anything with
    `call_soon_threadsafe(fn, *args)`: a dispatch hands it all of a step's (sink, delta) pairs in
    one call (the engine process's outbox turns that call into one pipe message)."""
    aloop: asyncio.AbstractEventLoop | None
    sink: Any
    arrival: float
    open: set[int]                        # completions not finished yet (indexes)
    last_token: float | None = None


class EngineLoop:
    def __init__(self, engine, metrics: Metrics | None = None):
        self.engine = engine
        self.metrics = metrics or Metrics()
        self.accepting = True
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}
        self._thread: threading.Thread | None = None
        self._users, self._held_for_good = 0, False      # library callers (Engine._driven), the server

    # ------------------------------------------------------------ handler side (any thread)
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="metrale-engine-loop", daemon=True)
            self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_live(self) -> int:
        return len(self._live)

    async def add(self, request_id: str, prompt, params, sink: asyncio.Queue,
                  arrival: float | None = None, chat: bool = False) -> int:
        """Queues a request; returns its prompt length in tokens. Raises the engine's
        InvalidRequestError (the request was refused) or ServerDraining."""
        if not self.accepting or not self.alive:
            raise ServerDraining("the server is shutting down")
        aloop = asyncio.get_running_loop()
        done = aloop.create_future()
        live = _Live(aloop, sink, arrival if arrival is not None else time.perf_counter(),
                     set(range(params.n)))
        self._commands.put(("add", request_id, prompt, params, live, done, chat))
        try:
            return await done
        except asyncio.CancelledError:
            self.abort(request_id)
            raise

    def submit(self, request_id: str, prompt, params, sink: queue.SimpleQueue, chat: bool = False) -> int:
        """`add` for a thread: blocks until the loop took (or refused) the request; its deltas
        arrive in `sink`."""
        if not self.accepting or not self.alive:
            raise ServerDraining("the engine loop is not running")
        done: concurrent.futures.Future = concurrent.futures.Future()
        live = _Live(None, sink, time.perf_counter(), set(range(params.n)))
        self._commands.put(("add", request_id, prompt, params, live, done, chat))
        return done.result()

    def add_nowait(self, request_id: str, prompt, params, sink, done: concurrent.futures.Future, *,
                   aloop=None, arrival: float | None = None, chat: bool = False) -> None:
        """`add` for a caller that must not wait (the engine process's pipe reader): the prompt
        length, or the refusal, settles `done` (through `aloop` when given, as a delta would)."""
        live = _Live(aloop, sink, arrival if arrival is not None else time.perf_counter(),
                     set(range(params.n)))
        if not self.accepting or not self.alive:
            _resolve(aloop, done, exc=ServerDraining("the server is shutting down"))
            return
        self._commands.put(("add", request_id, prompt, params, live, done, chat))

    def call(self, fn: Callable[[Any], Any], done: concurrent.futures.Future) -> None:
        """Runs fn(engine) on the loop thread between steps; its result (or exception) settles
        `done` (the engine process's debug queries: block-manager state)."""
        if not self.alive:
            _settle(done, None, ServerDraining("the engine loop is not running"))
            return
        self._commands.put(("call", fn, done))

    def stream(self, request_id: str, prompt, params, chat: bool = False) -> Iterator[StreamDelta]:
        """One request's deltas, for a caller on any thread, until each of its completions ended;
        a caller that stops early aborts it (the abort applied before this returns)."""
        sink: queue.SimpleQueue = queue.SimpleQueue()
        self.submit(request_id, prompt, params, sink, chat)
        left = params.n
        try:
            while left:
                delta = sink.get()
                left -= delta.finished
                yield delta
        finally:
            if left:
                self.abort(request_id, wait=True)

    async def astream(self, request_id: str, prompt, params, chat: bool = False) -> AsyncIterator[StreamDelta]:
        """stream() for asyncio: the event loop never waits for a forward."""
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

    def abort(self, request_id: str, wait: bool = False) -> None:
        """Aborts a request if it still runs (no-op otherwise); its KV blocks are freed. wait:
        return once the loop has applied it (not from the loop thread)."""
        done: concurrent.futures.Future | None = concurrent.futures.Future() if wait and self.alive else None
        self._commands.put(("abort", request_id, done))
        if done is not None:
            done.result()

    async def drain(self, grace_s: float, cut_short: Callable[[], bool] = lambda: False) -> None:
        """Refuses new requests, lets in-flight ones run up to grace_s (or until cut_short()),
        aborts the rest, stops."""
        self.accepting = False
        deadline = time.monotonic() + grace_s
        while self._live and time.monotonic() < deadline and self.alive and not cut_short():
            await asyncio.sleep(0.02)
        self.stop()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30.0)

    def stop(self) -> None:
        """Aborts whatever still runs and ends the thread."""
        self.accepting = False
        self._commands.put(("stop",))

    def hold(self) -> None:
        """One more library caller uses the loop (Engine.stream / astream / generate)."""
        self._users += 1

    def release(self) -> bool:
        """One caller less; the last one (unless the server holds the loop) ends the thread without
        touching the engine's requests. True when the thread was asked to end (join() it)."""
        self._users -= 1
        if self._users or self._held_for_good:
            return False
        self.accepting = False
        self._commands.put(("quit",))
        return True

    def hold_for_good(self) -> None:
        """The server's hold: the thread runs until stop()."""
        self._held_for_good = True

    def join(self, timeout: float = 60.0) -> None:
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # ------------------------------------------------------------------------ loop thread
    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                idle = not engine.has_unfinished()
                if not self._apply(self._commands.get() if idle else None):
                    return
                while True:   # drain whatever else is queued before the next step
                    try:
                        cmd = self._commands.get_nowait()
                    except queue.Empty:
                        break
                    if not self._apply(cmd):
                        return
                if engine.has_unfinished():
                    self._step()
                self._update_gauges()
        except BaseException:   # never leave a handler waiting on a dead loop
            log.exception("engine loop crashed")
            self._finish_all("error: engine loop crashed")
            raise
        finally:
            self.accepting = False
            self._refuse_queued_adds()

    def _apply(self, cmd) -> bool:
        """Applies one command; False means stop."""
        if cmd is None:
            return True
        kind = cmd[0]
        if kind == "add":
            _, request_id, prompt, params, live, done, chat = cmd
            try:
                self.engine.add_request(prompt, params, request_id=request_id, chat=chat)
                n_prompt = len(self.engine.prompt_token_ids(request_id))
            except Exception as exc:   # InvalidRequestError (or a tokenizer failure): the handler decides
                _resolve(live.aloop, done, exc=exc)
                return True
            self._live[request_id] = live
            with self.metrics.lock:
                self.metrics.prompt_tokens += n_prompt
            _resolve(live.aloop, done, value=n_prompt)
        elif kind == "abort":
            self._dispatch(self.engine.abort_completions(cmd[1]))
            if cmd[2] is not None:
                _settle(cmd[2], None, None)
        elif kind == "call":
            try:
                value = cmd[1](self.engine)
            except Exception as exc:
                _settle(cmd[2], None, exc)
            else:
                _settle(cmd[2], value, None)
        elif kind == "stop":
            self._finish_all("abort")
            return False
        elif kind == "quit":          # the last library caller left; requests stay with the engine
            return False
        return True

    def _step(self) -> None:
        try:
            deltas = self.engine.poll()
        except Exception as exc:   # the step ends failed forwards itself; this is anything else
            log.exception("engine step failed")
            self._finish_all(f"error: {type(exc).__name__}: {exc}")
            return
        if deltas:
            self._dispatch(deltas)
        else:                # a prefill chunk, or nothing could be scheduled: do not spin hot
            time.sleep(0.0005)

    def _finish_all(self, reason: str) -> None:
        deltas = []
        for request_id in self.engine.request_ids():
            for delta in self.engine.abort_completions(request_id):
                delta.finish_reason = reason
                deltas.append(delta)
        self._dispatch(deltas)
        for request_id, live in list(self._live.items()):   # accepted but unknown to the engine: still answer
            self._dispatch([StreamDelta(request_id, "", _EMPTY, reason, i) for i in sorted(live.open)])

    def _dispatch(self, deltas: list[StreamDelta]) -> None:
        now = time.perf_counter()
        m = self.metrics
        batches: dict[asyncio.AbstractEventLoop, list] = {}   # one wake-up per event loop per step
        gaps: dict[float, int] = {}      # inter-token gap -> tokens: rows of one step mostly share it
        lives = self._live
        with m.lock:
            for delta in deltas:
                live = lives.get(delta.request_id)
                if live is None:
                    continue
                n = len(delta.token_ids)
                if n:
                    m.generation_tokens += n
                    if live.last_token is None:
                        m.ttft.observe(now - live.arrival)
                        if n > 1:
                            m.itl.observe(0.0, n - 1)
                    else:
                        gap = (now - live.last_token) / n
                        gaps[gap] = gaps.get(gap, 0) + n
                    live.last_token = now
                if delta.finished:
                    live.open.discard(delta.index)
                    if not live.open:
                        del self._live[delta.request_id]
                        m.finished[finish_label(delta.finish_reason)] += 1
                        m.latency.observe(now - live.arrival)
                batches.setdefault(live.aloop, []).append((live.sink, delta))
            for gap, n in gaps.items():
                m.itl.observe(gap, n)
        for aloop, items in batches.items():
            if aloop is None:
                _deliver(items)            # thread sinks: queue.SimpleQueue is thread-safe
            else:
                _call(aloop, _deliver, items)

    def _update_gauges(self) -> None:
        sched, blocks = self.engine.scheduler, self.engine.blocks
        with self.metrics.lock:
            self.metrics.waiting = len(sched.waiting)
            self.metrics.running = len(sched.running)
            self.metrics.kv_usage = 1.0 - blocks.num_free / blocks.num_blocks

    def _refuse_queued_adds(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                _resolve(cmd[4].aloop, cmd[5], exc=ServerDraining("the server is shutting down"))
            elif cmd[0] == "abort" and cmd[2] is not None:
                _settle(cmd[2], None, None)
            elif cmd[0] == "call":
                _settle(cmd[2], None, ServerDraining("the engine loop stopped"))


def _deliver(items: list[tuple[asyncio.Queue, StreamDelta]]) -> None:
    for sink, delta in items:
        sink.put_nowait(delta)


def _settle(fut, value, exc: BaseException | None) -> None:
    if not fut.done():
        fut.set_exception(exc) if exc is not None else fut.set_result(value)


def _resolve(aloop: asyncio.AbstractEventLoop | None, fut, *, value=None,
             exc: BaseException | None = None) -> None:
    """Settles a caller's future: on its own event loop, or (a thread's) here."""
    if aloop is None:
        _settle(fut, value, exc)
    else:
        _call(aloop, _settle, fut, value, exc)


def _call(aloop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        aloop.call_soon_threadsafe(fn, *args)
    except RuntimeError:   # that event loop is closed: nobody is waiting any more
        pass
