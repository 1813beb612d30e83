"""The engine process's side of server.engine_process (engine_process.py has the server's side and
the wire format): build the engine, say ready (or why not), then a reader thread feeds the pipe's
commands to the engine's own EngineLoop (metrale/driver.py) while its loop thread steps; every
dispatch of that loop (a step's deltas, an add's answer) leaves as one message.
"""
from __future__ import annotations

import concurrent.futures
import logging
import os
import pickle
import signal
import sys
import threading
import time
from typing import Any, Callable

import numpy as np

from metrale.driver import ServerDraining
from metrale.outputs import StreamDelta
from metrale.sampling.params import InvalidRequestError
from metrale.server.engine_process import PIPE_BYTES, EngineInfo, _FdHandle, _frames, _write_frame, supports_structured_output

log = logging.getLogger("metrale.server")
READ_BYTES = 1 << 20          # one read takes every command the pipe holds
GIL_SWITCH_S = 0.001


class _Outbox:
    """Stands where the engine loop puts a caller's event loop (driver._Live.aloop): each
    call_soon_threadsafe is one dispatch (a step's deltas, an add's answer), which leaves as
    one message on the events pipe. A closed pipe (the server is gone) drops what is sent."""

    def __init__(self, fd: int):
        self.fd, self.lock, self.pending, self.closed = fd, threading.Lock(), [], False

    def call_soon_threadsafe(self, fn, *args) -> None:
        fn(*args)
        if self.pending:
            items, self.pending = self.pending, []
            self.send(("deltas", items))

    def send(self, msg: tuple) -> None:
        self.send_pickled(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))

    def send_pickled(self, data: bytes) -> None:
        with self.lock:
            if self.closed:
                return
            try:
                _write_frame(self.fd, data)
            except OSError:
                self.closed = True


class _Sink:
    """One request's sink in the engine process: its deltas become compact tuples of the step's message."""
    __slots__ = ("key", "out")

    def __init__(self, key: int, out: _Outbox):
        self.key, self.out = key, out

    def put_nowait(self, d: StreamDelta) -> None:
        ids = np.asarray(d.token_ids, dtype=np.int32).tobytes()
        if d.finish_reason is None and d.index == 0 and d.logprobs is None:
            self.out.pending.append((self.key, d.text, ids))
        else:
            self.out.pending.append((self.key, d.text, ids, d.index, d.finish_reason, d.logprobs, d.stop_reason))


def child_main(cfg, commands: _FdHandle, events: _FdHandle, build: Callable) -> None:
    """The engine process: build the engine, say ready (or why not), run its loop until told to
    stop or until the server's end of the commands pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)       # Ctrl-C reaches the process group: the server drains
    # the command reader asks for the GIL only when a command came; a busy engine loop then hands
    # it over within 1 ms instead of the default 5 (the wait is a new request's admission delay)
    sys.setswitchinterval(GIL_SWITCH_S)
    level = str(cfg.log_level).upper()
    logging.basicConfig(level=getattr(logging, level, logging.WARNING), format="%(levelname)s %(name)s: %(message)s")
    out = _Outbox(events.fd)
    try:
        import fcntl
        fcntl.fcntl(events.fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), PIPE_BYTES)
    except (ImportError, OSError):
        pass
    holder: dict[str, Any] = {}
    reader = threading.Thread(target=_read_commands, args=(commands.fd, holder, out), name="metrale-commands",
                              daemon=True)
    reader.start()                  # before loading: a server that dies meanwhile ends this process
    try:
        engine = build(cfg)
    except Exception as exc:
        out.send(("failed", _one_line(exc)))
        return
    loop = engine.driver()          # the engine's loop thread, as in-process
    loop.hold_for_good()
    holder["loop"] = loop
    try:
        ready = pickle.dumps(("ready", _info(engine)), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:        # a tokenizer that does not pickle
        out.send(("failed", f"the engine's tokenizer and limits do not pickle: {type(exc).__name__}: {exc}"))
        return
    out.send_pickled(ready)
    while loop.alive:
        loop.join(3600)
    out.send(("bye", "stopped" if holder.get("stopped") else "its engine loop crashed"))


def _info(engine) -> EngineInfo:
    return EngineInfo(engine.model_config, engine.tokenizer, engine.max_model_len, engine.scheduler.max_num_seqs,
                      supports_structured_output(engine), engine.backend.name, engine.load_seconds, os.getpid())


def _one_line(exc: Exception) -> str:
    """The message the in-process server prints for the same start-up failure."""
    from metrale.models.registry import ModelNotFoundError
    if isinstance(exc, (ModelNotFoundError, ValueError, RuntimeError)):
        return str(exc)
    log.error("the engine failed to start", exc_info=exc)
    return f"{type(exc).__name__}: {exc}"


def _read_commands(fd: int, holder: dict, out: _Outbox) -> None:
    """The engine process's reader: commands from the pipe into the engine loop's queue. It reads
    whatever the pipe holds and applies every whole command in it at once: each read gives up the
    GIL, and getting it back from a busy engine loop takes up to a switch interval (5 ms), so one
    read per command made 64 arriving requests wait for each other."""
    buf = bytearray()
    while True:
        try:
            chunk = os.read(fd, READ_BYTES)
        except OSError:
            chunk = b""
        if not chunk:                   # the server process is gone: stop (or, still loading, exit now)
            loop = holder.get("loop")
            if loop is None:
                os._exit(0)
            holder["stopped"] = True
            loop.stop()
            return
        buf += chunk
        for frame in _frames(buf):
            _apply_frame(frame, holder, out)


def _apply_frame(frame: bytes, holder: dict, out: _Outbox) -> None:
    cmd = None
    try:
        cmd = pickle.loads(frame)
        _apply(cmd, holder, out)
    except Exception as exc:   # a bad command must not end the reader, nor leave its caller waiting
        kind = cmd[0] if isinstance(cmd, tuple) and cmd else None
        log.exception("engine process: command %r failed", kind)
        why = f"{type(exc).__name__}: {exc}"
        if kind == "add":
            out.send(("refused", cmd[1], "error", why))
        elif kind == "call":
            out.send(("reply", cmd[1], False, why))


def _apply(cmd: tuple, holder: dict, out: _Outbox) -> None:
    """One command from the server, handed to the engine loop (or, metrics, answered here)."""
    loop, kind = holder["loop"], cmd[0]
    if kind == "add":
        _, key, request_id, prompt, params, age, chat = cmd
        done: concurrent.futures.Future = concurrent.futures.Future()
        done.add_done_callback(lambda fut, key=key: _answer_add(out, key, fut))
        loop.add_nowait(request_id, prompt, params, _Sink(key, out), done, aloop=out,
                        arrival=time.perf_counter() - age, chat=chat)
    elif kind == "abort":
        loop.abort(cmd[1])
    elif kind == "call":
        _answer_call(out, loop, cmd[1], cmd[2])
    elif kind == "stop":
        holder["stopped"] = True
        loop.stop()


def _answer_add(out: _Outbox, key: int, fut: concurrent.futures.Future) -> None:
    exc = fut.exception()
    if exc is None:
        out.send(("added", key, fut.result()))
    else:
        why = "invalid" if isinstance(exc, InvalidRequestError) else "draining" if isinstance(exc, ServerDraining) else "error"
        out.send(("refused", key, why, str(exc) if why != "error" else f"{type(exc).__name__}: {exc}"))


def _answer_call(out: _Outbox, loop, cid: int, what: str) -> None:
    if what == "metrics":               # Metrics has its own lock: answered from this thread
        out.send(("reply", cid, True, loop.metrics.render()))
        return
    done: concurrent.futures.Future = concurrent.futures.Future()

    def reply(fut):
        exc = fut.exception()
        out.send(("reply", cid, exc is None, fut.result() if exc is None else f"{type(exc).__name__}: {exc}"))
    done.add_done_callback(reply)
    if what == "state":
        loop.call(_engine_state, done)
    else:
        done.set_exception(ValueError(f"unknown query {what!r}"))


def _engine_state(engine) -> dict:
    """The block manager and request counts (tests and debugging: ProcessLoop.engine_state)."""
    blocks, sched = engine.blocks, engine.scheduler
    leak = None
    try:
        blocks.check_no_leaks(list(sched.running) + list(sched.waiting))
    except AssertionError as exc:
        leak = str(exc) or "block reference counts do not match"
    return {"num_free": blocks.num_free, "num_blocks": blocks.num_blocks, "requests": len(engine.requests),
            "running": len(sched.running), "waiting": len(sched.waiting), "leak": leak}
