"""Engine replicas on Ray Serve (issue 25 item 2; docs/server.md, "Replicas on Ray Serve"): N
engines, each on its own Ray Serve replica with its own devices (or CPU), behind one
OpenAI-compatible ingress.

    python -m metrale serve server.replicas=2        # uvicorn here (serve.py, create_app) + 2 Ray
                                                     # Serve apps metrale-engine-0/1 (one replica each)
    serve run metrale.server.replicas:build_app server.replicas=2 model=...   # all on Ray Serve:
                                                     # the app "metrale" (MetraleIngress + the engines)

    ingress (create_app around a ReplicaSet)              engine replica i (EngineReplica deployment)
      HTTP handlers: check, tokenize, render (app.py)       an Engine (or EngineProcess) and its loop
      RayLoop.add -> PrefixRouter picks replica i           generate(): ("added", n) | ("refused", ..),
        -> handle_i.generate (a Ray streaming call) ---->     then per step ("deltas", [tuples]) until
        <- StreamDeltas into the request's queue <--------    every completion finished
      RayLoop.abort -> handle_i.abort                       abort(), metrics(), ping(), check_health()

Routing: the prompt's token ids are cut into blocks of the engine's block size (the prefix cache's
granularity); a request whose leading blocks a replica served recently goes there (its KV blocks
are likely still cached) unless that replica has `imbalance` more requests in flight than the
least loaded; otherwise, and for prompts under one block, the least loaded (ties: round robin).
Failures: a replica that dies (its actor killed, its engine loop crashed: check_health fails) is
restarted by Ray Serve; its in-flight requests end at once with 'error: engine replica i died
(...)' (a 500, or in a stream an error event before [DONE]); while it is down, requests go to the
others, and with none up they get 503. Ray is imported lazily: nothing here loads it until a
replica set starts, and the engine never needs it (`pip install 'metrale[ray]'`).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import sys
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from metrale.driver import ServerDraining
from metrale.outputs import StreamDelta
from metrale.sampling.params import InvalidRequestError

log = logging.getLogger("metrale.server")

_EMPTY = np.zeros(0, dtype=np.int32)
PROBE_S = 1.0             # how often the ingress pings each replica (a down one: until it is back)
PING_TIMEOUT_S = 5.0
ABORT_WAIT_S = 10.0       # an aborted request whose stream has not ended by then is cut here
MAX_ONGOING = 100_000     # Serve's per-replica cap on calls in flight; the engine's scheduler queues


class RayUnavailable(RuntimeError):
    """Ray (Serve) is not installed or the replicas could not start."""


def import_ray():
    """(ray, ray.serve), or RayUnavailable saying how to install them."""
    try:
        import ray
        from ray import serve
    except ImportError as exc:
        raise RayUnavailable(f"server.replicas needs Ray Serve ({exc}): pip install 'metrale[ray]'") from None
    return ray, serve


# ------------------------------------------------------------------------------ routing
class PrefixRouter:
    """Picks the replica for a prompt (token ids): prefix-sticky, else least loaded.

    Blocks are chained hashes of the first `max_blocks` full blocks of `block_tokens` ids; the
    table maps each block hash to the replica that last served a prompt starting with it (LRU,
    `capacity` entries). The deepest hit wins while its replica is up and within `imbalance`
    requests of the least loaded one."""

    def __init__(self, n: int, block_tokens: int = 16, max_blocks: int = 32, capacity: int = 65536,
                 imbalance: int = 8):
        self.n, self.block_tokens, self.max_blocks = n, max(1, block_tokens), max_blocks
        self.capacity, self.imbalance = capacity, imbalance
        self.table: OrderedDict[int, int] = OrderedDict()
        self._turn = itertools.count()

    def block_hashes(self, ids: Sequence[int]) -> list[int]:
        out, h, b = [], 0, self.block_tokens
        for k in range(min(len(ids) // b, self.max_blocks)):
            h = hash((h, tuple(int(t) for t in ids[k * b:(k + 1) * b])))
            out.append(h)
        return out

    def choose(self, ids: Sequence[int], load: Sequence[int], up: Sequence[bool]) -> tuple[int, int]:
        """(replica, blocks of the prompt it was chosen for: 0 = by load); records the prompt's blocks."""
        live = [i for i in range(self.n) if up[i]]
        if not live:
            raise LookupError("no replica is up")
        hashes = self.block_hashes(ids)
        least = min(load[i] for i in live)
        pick, matched = None, 0
        for depth in range(len(hashes), 0, -1):
            owner = self.table.get(hashes[depth - 1])
            if owner is not None and owner < self.n and up[owner] and load[owner] - least <= self.imbalance:
                pick, matched = owner, depth
                break
        if pick is None:
            ties = [i for i in live if load[i] == least]
            pick = ties[next(self._turn) % len(ties)]
        for h in hashes:
            self.table[h] = pick
            self.table.move_to_end(h)
        while len(self.table) > self.capacity:
            self.table.popitem(last=False)
        return pick, matched


# ------------------------------------------------------------------------ replica side
def _wire(d: StreamDelta) -> tuple:
    return (d.text, np.ascontiguousarray(d.token_ids, dtype=np.int32).tobytes(), d.index, d.finish_reason,
            d.logprobs, d.stop_reason)


class _SessionOut:
    """A session's deltas not yet yielded (filled on the replica's event loop, one wake-up a step)."""

    def __init__(self):
        self.items: list = []
        self.ready = asyncio.Event()
        self.live: set[str] = set()           # its requests not finished yet


class _SessionSink:
    """A request's sink (the engine loop calls put_nowait on the replica's event loop)."""
    __slots__ = ("out", "rid", "left")

    def __init__(self, out: _SessionOut, rid: str, n: int):
        self.out, self.rid, self.left = out, rid, n

    def put_nowait(self, d: StreamDelta) -> None:
        out = self.out
        out.items.append((self.rid, _wire(d)))
        out.ready.set()
        if d.finished:
            self.left -= 1
            if not self.left:
                out.live.discard(self.rid)


class EngineReplica:
    """One engine on a Ray Serve replica (the deployment class; `engine_deployment` decorates it).
    build(cfg) makes the engine (default Engine(cfg=cfg)); with server.engine_process it runs in
    a process of its own under this replica (EngineProcess), else in this actor's process."""

    async def __init__(self, cfg, build: Callable | None = None, index: int = 0):
        from metrale.server.engine_process import EngineProcess, build_engine
        build = build or build_engine
        self.cfg, self.index, self.started = cfg, index, time.time()
        level = str(cfg.log_level).upper()
        logging.getLogger("metrale").setLevel(getattr(logging, level, logging.WARNING))
        if cfg.server.engine_process:
            self.engine = await asyncio.to_thread(EngineProcess.start, cfg, build)
            self.max_num_seqs = self.engine.max_num_seqs
            self.block_size, self.backend = cfg.cache.block_size, self.engine.info.backend
        else:
            self.engine = await asyncio.to_thread(build, cfg)
            self.max_num_seqs = self.engine.scheduler.max_num_seqs
            self.block_size, self.backend = self.engine.blocks.block_size, self.engine.backend.name
        self.loop = self.engine.driver()
        self.loop.hold_for_good()
        self.loop.start()                  # an EngineProcess's events are read on this replica's event loop
        self.sessions: dict[str, _SessionOut] = {}

    def info(self) -> dict:
        """What the ingress needs: the tokenizer and limits (as EngineInfo), and who this is."""
        from metrale.server.engine_process import supports_structured_output
        e = self.engine
        return {"index": self.index, "model_config": e.model_config, "tokenizer": e.tokenizer,
                "max_model_len": e.max_model_len, "max_num_seqs": self.max_num_seqs,
                "structured_output": supports_structured_output(e), "backend": self.backend,
                "block_size": self.block_size, **self.ping()}

    def ping(self) -> dict:
        import ray
        return {"pid": os.getpid(), "actor": ray.get_runtime_context().get_actor_name(), "started": self.started,
                "alive": self.loop.alive}

    # The ingress's road: one session stream per ingress carries every delta of its requests,
    # one item per engine step (a Ray streaming item per step, not per request and step).
    def _out(self, sid: str) -> "_SessionOut":
        out = self.sessions.get(sid)
        if out is None:
            out = self.sessions[sid] = _SessionOut()
        return out

    async def session(self, sid: str):
        """Yields [(request id, wire tuple), ...] per engine step for the requests added with `sid`;
        when the caller cancels it (or goes away), those requests are aborted."""
        out = self._out(sid)
        try:
            while True:
                await out.ready.wait()
                out.ready.clear()
                items, out.items = out.items, []
                if items:
                    yield items
        finally:
            self.sessions.pop(sid, None)
            for rid in list(out.live):
                self.loop.abort(rid)

    async def add(self, sid: str, request_id: str, prompt: list[int], params, age: float = 0.0,
                  chat: bool = False) -> tuple:
        """("added", prompt tokens) or ("refused", "invalid" | "draining", message); the request's
        deltas go out through session `sid`."""
        out = self._out(sid)
        out.live.add(request_id)
        try:
            n = await self.loop.add(request_id, prompt, params, _SessionSink(out, request_id, params.n),
                                    time.perf_counter() - age, chat)
        except InvalidRequestError as exc:
            out.live.discard(request_id)
            return ("refused", "invalid", str(exc))
        except ServerDraining as exc:
            out.live.discard(request_id)
            return ("refused", "draining", str(exc))
        return ("added", n)

    async def generate(self, request_id: str, prompt: list[int], params, age: float = 0.0, chat: bool = False):
        """One request on its own stream, for callers of the deployment handle: ("added", prompt
        tokens) or ("refused", kind, message), then ("deltas", [wire tuples]) per engine step until
        every completion finished. A caller that cancels the stream aborts the request."""
        sink: asyncio.Queue = asyncio.Queue()
        try:
            n = await self.loop.add(request_id, prompt, params, sink, time.perf_counter() - age, chat)
        except InvalidRequestError as exc:
            yield ("refused", "invalid", str(exc))
            return
        except ServerDraining as exc:
            yield ("refused", "draining", str(exc))
            return
        yield ("added", n)
        left = set(range(params.n))
        try:
            while left:
                batch = [await sink.get()]
                while not sink.empty():
                    batch.append(sink.get_nowait())
                for d in batch:
                    if d.finished:
                        left.discard(d.index)
                yield ("deltas", [_wire(d) for d in batch])
        finally:
            if left:
                self.loop.abort(request_id)

    def abort(self, request_id: str) -> None:
        self.loop.abort(request_id)

    async def metrics(self) -> str:
        loop = self.loop
        return await loop.metrics_text() if hasattr(loop, "metrics_text") else loop.metrics.render()

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine loop (or engine process) ended is restarted."""
        if not self.loop.alive:
            raise RuntimeError(f"engine replica {self.index}: the engine loop is not running")

    def __del__(self):
        loop = getattr(self, "loop", None)
        if loop is not None and loop.alive:
            loop.stop()


def engine_deployment(cfg, build: Callable | None, index: int):
    """The bound Serve deployment of engine replica `index` (one replica, restarted on failure)."""
    _, serve = import_ray()
    s = cfg.server
    gpus = s.replica_gpus if s.replica_gpus is not None else (1 if str(cfg.device) == "cuda" else 0)
    dep = serve.deployment(EngineReplica).options(
        name=f"metrale-engine-{index}", num_replicas=1, max_ongoing_requests=MAX_ONGOING,
        health_check_period_s=1.0, health_check_timeout_s=30.0, graceful_shutdown_timeout_s=5.0,
        ray_actor_options={"num_cpus": s.replica_cpus, "num_gpus": gpus}, logging_config=_serve_logging(cfg))
    return dep.bind(cfg, build, index)


def _serve_logging(cfg) -> dict:
    """Serve's replica logs at metrale's log_level, without its per-call access lines (a ping a second)."""
    level = str(cfg.log_level).upper()
    return {"log_level": level if level in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL") else "WARNING",
            "enable_access_log": level == "DEBUG"}


# ------------------------------------------------------------------------ ingress side
@dataclass
class Replica:
    """The ingress's view of one engine replica."""
    index: int
    handle: Any                              # its DeploymentHandle
    up: bool = True
    in_flight: int = 0
    served: int = 0                          # requests routed to it
    prefix_hits: int = 0                     # of those, routed by a prefix it held
    restarts: int = 0                        # times it was seen to come back (a new pid or actor)
    pid: int | None = None
    actor: str | None = None
    down_why: str | None = None
    sid: str | None = None                   # this ingress's session on it
    session: Any = None                      # the session's stream (DeploymentResponseGenerator)
    reader: asyncio.Task | None = None       # the task reading it


@dataclass
class _Call:
    request_id: str
    replica: Replica
    sink: Any
    open: set[int]
    aborted_at: float | None = None


class ReplicaSet:
    """Stands where create_app takes an Engine (app.py: tokenizer, limits, encode_prompt, driver()),
    for engines on Ray Serve replicas: `ReplicaSet(handles, infos, cfg)`; `start(cfg, build)`
    launches them (python -m metrale serve server.replicas=N)."""
    is_remote = True                         # app.Server: limits and /metrics come from elsewhere

    def __init__(self, handles: Sequence[Any], infos: Sequence[dict], cfg, owned: Callable[[], None] | None = None):
        first = infos[0]
        self.cfg = cfg
        self.tokenizer, self.model_config = first["tokenizer"], first["model_config"]
        self.max_model_len, self.max_num_seqs = first["max_model_len"], first["max_num_seqs"]
        self.supports_structured_output = first["structured_output"]
        self.backend, self.block_size = first["backend"], first["block_size"]
        self.replicas = [Replica(i, h, pid=info["pid"], actor=info["actor"]) for i, (h, info) in
                         enumerate(zip(handles, infos))]
        self.router = PrefixRouter(len(handles), block_tokens=self.block_size)
        self.loop = RayLoop(self)
        self._owned = owned                  # undoes start(): deletes the apps, shuts Ray down

    from metrale.engine import Engine as _Engine
    encode_prompt = _Engine.encode_prompt    # the same checks and messages as in-process
    del _Engine

    @classmethod
    async def connect(cls, handles: Sequence[Any], cfg) -> "ReplicaSet":
        """From handles to running engine deployments (the ingress deployment's constructor)."""
        infos = await asyncio.gather(*(h.info.remote() for h in handles))
        return cls(handles, infos, cfg)

    @classmethod
    def start(cls, cfg, build: Callable | None = None) -> "ReplicaSet":
        """Starts (or joins, server.ray_address) a Ray cluster and one Serve app per engine replica
        (metrale-engine-0 .. N-1, no HTTP of their own), waits until every engine is ready."""
        ray, serve = import_ray()
        n = int(cfg.server.replicas)
        started_ray = False
        if not ray.is_initialized():
            kwargs: dict[str, Any] = {"include_dashboard": False, "logging_level": logging.WARNING}
            if cfg.server.ray_address:
                kwargs["address"] = cfg.server.ray_address
            ray.init(**kwargs)
            started_ray = True
        names = [f"metrale-engine-{i}" for i in range(n)]

        def undo() -> None:
            if started_ray:                  # ours: Serve and Ray go, the apps with them
                serve.shutdown()
                ray.shutdown()
                return
            for name in names:               # a cluster we joined: only our apps (not waiting for them)
                try:
                    serve.delete(name, _blocking=False)
                except Exception:            # already gone, or Serve itself is down
                    pass
        try:
            serve.start(proxy_location="Disabled")          # the HTTP ingress is this process's uvicorn
            targets = [serve.RunTarget(engine_deployment(cfg, build, i), name=name, route_prefix=None)
                       for i, name in enumerate(names)]
            handles = serve.run_many(targets)
            infos = [h.info.remote().result() for h in handles]
        except Exception as exc:
            undo()
            raise RayUnavailable(f"the engine replicas did not start: {_last_line(exc)}") from None
        return cls(handles, infos, cfg, owned=undo)

    def driver(self) -> "RayLoop":
        return self.loop

    def close(self) -> None:
        """Stops routing and, if start() launched them, removes the engine apps (and Ray)."""
        self.loop.accepting = False
        owned, self._owned = self._owned, None
        if owned is not None:
            owned()

    # --------------------------------------------------------------- routing
    def route(self, ids: Sequence[int]) -> tuple[Replica, int]:
        reps = self.replicas
        try:
            i, matched = self.router.choose(ids, [r.in_flight for r in reps], [r.up for r in reps])
        except LookupError:
            why = "; ".join(f"replica {r.index}: {r.down_why}" for r in reps if r.down_why)
            raise EngineUnavailable(f"no engine replica is running ({why or 'all are down'}); "
                                    f"Ray Serve restarts them") from None
        return reps[i], matched

    def mark_down(self, rep: Replica, why: str) -> None:
        if rep.up:
            log.error("engine replica %d is down (%s); Ray Serve restarts it", rep.index, why)
        rep.up, rep.down_why = False, why


class EngineUnavailable(ServerDraining):
    """No engine replica can take the request (a 503 with this message)."""


def _last_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else text


def _died(exc: BaseException) -> bool:
    """Whether a call failed because its replica's actor is gone (not a bug of the call)."""
    try:
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
    except ImportError:          # pragma: no cover
        return False
    return isinstance(exc, (RayActorError, ActorDiedError, ActorUnavailableError))


class RayLoop:
    """EngineLoop's interface (add / abort / drain / stop / alive / accepting / metrics_text) over
    the replicas' handles. Per replica one session stream (EngineReplica.session) brings every
    delta of this ingress's requests there, one Ray item per engine step; an add is one call to
    the replica the router picks (its deltas then arrive on the session). A session that fails
    (the replica died) ends each of its requests with an error naming the replica."""

    def __init__(self, rs: ReplicaSet):
        self.rs = rs
        self.accepting = True
        self._live: dict[str, _Call] = {}
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._probe: asyncio.Task | None = None
        self._stopped = False
        self._pending: set = set()              # fire-and-forget calls (aborts), kept until answered
        self._ids = itertools.count()
        self._me = f"{os.getpid()}-{id(self):x}"
        self.recent: deque[tuple[str, int]] = deque(maxlen=4096)   # (request id, replica): tests, debugging

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Opens the sessions and starts the probes on the running event loop (the app's lifespan)."""
        if self._aloop is None:
            self._aloop = asyncio.get_running_loop()
            for rep in self.rs.replicas:
                self._open(rep)
            self._probe = self._aloop.create_task(self._probe_replicas())

    @property
    def alive(self) -> bool:
        return not self._stopped and any(r.up for r in self.rs.replicas)

    @property
    def num_live(self) -> int:
        return len(self._live)

    def hold_for_good(self) -> None:
        """EngineLoop's interface: the ingress holds the replicas for its lifetime."""

    async def drain(self, grace_s: float, cut_short: Callable[[], bool] = lambda: False) -> None:
        """Refuses new requests, lets in-flight ones run up to grace_s, aborts the rest and waits
        (bounded) for them to end; the replicas keep running (Ray Serve owns them)."""
        self.accepting = False
        deadline = time.monotonic() + grace_s
        while self._live and time.monotonic() < deadline and not cut_short():
            await asyncio.sleep(0.02)
        self.stop()
        deadline = time.monotonic() + ABORT_WAIT_S
        while self._live and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for call in list(self._live.values()):
            self._finish(call, "abort")
        self._stopped = True
        if self._probe is not None:
            self._probe.cancel()
        for rep in self.rs.replicas:
            if rep.session is not None:
                rep.session.cancel()

    def stop(self) -> None:
        """Aborts whatever still runs (each ends with finish reason 'abort')."""
        self.accepting = False
        for rid in list(self._live):
            self.abort(rid)

    # ------------------------------------------------------------ sessions
    def _open(self, rep: Replica) -> None:
        """(Re)opens the replica's session stream and its reader task."""
        rep.sid = f"{self._me}-{next(self._ids)}"
        rep.session = rep.handle.options(stream=True).session.remote(rep.sid)
        rep.reader = self._aloop.create_task(self._read(rep, rep.session))

    async def _read(self, rep: Replica, gen) -> None:
        live = self._live
        try:
            async for items in gen:
                for rid, (text, ids, index, finish, lps, stop) in items:
                    call = live.get(rid)
                    if call is None:
                        continue
                    if finish is not None:
                        call.open.discard(index)
                    call.sink.put_nowait(StreamDelta(rid, text, np.frombuffer(ids, np.int32), finish, index, lps, stop))
                    if not call.open:
                        self._release(call)
            why = "its session stream ended"
        except asyncio.CancelledError:
            return
        except Exception as exc:
            why = _last_line(exc)
        if self._stopped:
            return
        self.rs.mark_down(rep, why)
        reason = (f"error: engine replica {rep.index} died ({why}); the request was lost with it "
                  f"and Ray Serve restarts the replica")
        for call in [c for c in live.values() if c.replica is rep]:
            self._finish(call, reason)

    # ------------------------------------------------------------- requests
    async def add(self, request_id: str, prompt, params, sink: asyncio.Queue,
                  arrival: float | None = None, chat: bool = False) -> int:
        """Sends a request to its replica; returns its prompt length in tokens. Raises the engine's
        InvalidRequestError (refused), ServerDraining, or EngineUnavailable (no replica up; one
        that dies before taking the request makes the next one up try)."""
        if not self.accepting or self._stopped:
            raise ServerDraining("the server is shutting down")
        if self._aloop is None:
            self.start()
        ids = [int(t) for t in prompt] if not isinstance(prompt, str) else prompt
        age = time.perf_counter() - arrival if arrival is not None else 0.0
        for attempt in range(len(self.rs.replicas)):
            rep, matched = self.rs.route(ids if not isinstance(ids, str) else [])
            if rep.reader is None or rep.reader.done():
                self._open(rep)
            call = _Call(request_id, rep, sink, set(range(params.n)))
            rep.in_flight += 1
            rep.served += 1
            rep.prefix_hits += matched > 0
            self._live[request_id] = call
            self.recent.append((request_id, rep.index))
            try:
                answer = await rep.handle.add.remote(rep.sid, request_id, ids, params, age, chat)
            except asyncio.CancelledError:
                self.abort(request_id)
                raise
            except Exception as exc:
                self._release(call)
                if not _died(exc):
                    raise EngineUnavailable(f"engine replica {rep.index} failed: {_last_line(exc)}") from None
                self.rs.mark_down(rep, _last_line(exc))
                continue                          # another replica, if one is up
            if answer[0] == "refused":
                self._release(call)
                _, kind, message = answer
                raise (InvalidRequestError if kind == "invalid" else ServerDraining)(message)
            return int(answer[1])
        raise EngineUnavailable("the engine replicas died before taking the request; Ray Serve restarts them")

    def _release(self, call: _Call) -> None:
        if self._live.get(call.request_id) is call:
            del self._live[call.request_id]
            call.replica.in_flight -= 1

    def _finish(self, call: _Call, reason: str) -> None:
        """Ends the request here: a finished delta per open completion."""
        for index in sorted(call.open):
            call.sink.put_nowait(StreamDelta(call.request_id, "", _EMPTY, reason, index))
        call.open.clear()
        self._release(call)

    def abort(self, request_id: str, wait: bool = False) -> None:
        """Asks the request's replica to abort it (its 'abort' delta comes back on the session);
        one that has not ended ABORT_WAIT_S later is ended here."""
        call = self._live.get(request_id)
        if call is None or call.aborted_at is not None:
            return
        call.aborted_at = time.monotonic()
        if call.replica.up:
            resp = call.replica.handle.abort.remote(request_id)
            self._pending.add(resp)
            fut = asyncio.ensure_future(_quietly(resp))
            fut.add_done_callback(lambda _f, resp=resp: self._pending.discard(resp))
        self._aloop.call_later(ABORT_WAIT_S if call.replica.up else 0, self._cut, call)

    def _cut(self, call: _Call) -> None:
        if self._live.get(call.request_id) is call:
            self._finish(call, "abort")

    # -------------------------------------------------------------- metrics
    async def metrics_text(self) -> str:
        """Every up replica's Prometheus text with a replica="i" label, and the ingress's gauges."""
        reps = [r for r in self.rs.replicas if r.up]
        texts = await asyncio.gather(*(asyncio.wait_for(_result(r.handle.metrics.remote()), PING_TIMEOUT_S)
                                       for r in reps), return_exceptions=True)
        out, seen = [], set()
        for r, text in zip(reps, texts):
            if isinstance(text, BaseException):
                continue
            for line in text.splitlines():
                if line.startswith("#"):
                    if line not in seen:
                        seen.add(line)
                        out.append(line)
                elif line.strip():
                    out.append(_labelled(line, f'replica="{r.index}"'))
        for name, kind, value in (("metrale_replica_up", "gauge", lambda r: int(r.up)),
                                  ("metrale_replica_in_flight", "gauge", lambda r: r.in_flight),
                                  ("metrale_replica_requests_total", "counter", lambda r: r.served),
                                  ("metrale_replica_prefix_routed_total", "counter", lambda r: r.prefix_hits),
                                  ("metrale_replica_restarts_total", "counter", lambda r: r.restarts)):
            out.append(f"# TYPE {name} {kind}")
            out += [f'{name}{{replica="{r.index}"}} {value(r)}' for r in self.rs.replicas]
        return "\n".join(out) + "\n"

    # --------------------------------------------------------------- health
    async def _probe_replicas(self) -> None:
        """Pings every replica each PROBE_S: a down one is up again (with a new session) once a
        restarted replica answers; one that does not answer is down (no new requests go there)."""
        while not self._stopped:
            await asyncio.sleep(PROBE_S)
            await asyncio.gather(*(self._ping(r) for r in self.rs.replicas), return_exceptions=True)

    async def _ping(self, rep: Replica) -> None:
        try:
            info = await asyncio.wait_for(_result(rep.handle.ping.remote()), PING_TIMEOUT_S)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.rs.mark_down(rep, _last_line(exc) if not isinstance(exc, asyncio.TimeoutError)
                              else f"no answer within {PING_TIMEOUT_S:.0f} s")
            return
        if not info["alive"]:
            self.rs.mark_down(rep, "its engine loop is not running")
            return
        if (info["pid"], info["actor"]) != (rep.pid, rep.actor):
            rep.restarts += 1
            rep.pid, rep.actor = info["pid"], info["actor"]
        if not rep.up:
            log.warning("engine replica %d is up again (pid %s)", rep.index, rep.pid)
        if rep.reader is None or rep.reader.done():
            self._open(rep)
        rep.up, rep.down_why = True, None


async def _result(resp):
    return await resp


async def _quietly(resp) -> None:
    try:
        await resp
    except Exception:
        pass


def _labelled(line: str, label: str) -> str:
    """A Prometheus sample line with one more label."""
    name, _, rest = line.partition(" ")
    if name.endswith("}"):
        return f"{name[:-1]},{label}}} {rest}"
    return f"{name}{{{label}}} {rest}"


# ------------------------------------------------------------------- Ray Serve app
class MetraleIngress:
    """The ingress deployment of `build_app` (serve run / serve.run): metrale's FastAPI app
    (create_app) around a ReplicaSet of the engine deployments bound to it."""

    async def __init__(self, cfg, engines: list):
        self._cfg = cfg
        self._rs = await ReplicaSet.connect(engines, cfg)

    def __serve_build_asgi_app__(self):
        from metrale.server.app import create_app
        return create_app(self._rs, self._cfg)


def build_app(args: dict | list | None = None, build: Callable | None = None):
    """The Ray Serve application "metrale": MetraleIngress (HTTP, no CPU reserved) + N engine
    deployments. `args`: settings as a dict (`serve run metrale.server.replicas:build_app
    model=... server.replicas=2` passes them so), a list of key=value, or a composed config."""
    _, serve = import_ray()
    from metrale.settings import compose
    if isinstance(args, dict):
        cfg = compose([f"{k}={v}" for k, v in args.items()])
    elif args is None or isinstance(args, list):
        cfg = compose(list(args or []))
    else:
        cfg = args
    n = max(1, int(cfg.server.replicas))
    ingress = serve.deployment(serve.ingress()(MetraleIngress)).options(
        name="metrale-ingress", max_ongoing_requests=MAX_ONGOING, ray_actor_options={"num_cpus": 0},
        logging_config=_serve_logging(cfg))
    return ingress.bind(cfg, [engine_deployment(cfg, build, i) for i in range(n)])


# ------------------------------------------------------------------ the CLI's path
def serve_replicas(cfg, build: Callable | None = None) -> int:
    """`python -m metrale serve server.replicas=N`: the replicas on Ray Serve, metrale's HTTP
    server (serve.py's uvicorn, drain and timeouts) in this process as their ingress."""
    import uvicorn
    from metrale.server.app import create_app
    from metrale.server.serve import MetraleServer, _fail, _uvicorn_level, http_protocol
    s = cfg.server
    t0 = time.perf_counter()
    try:
        rs = ReplicaSet.start(cfg, build)
    except RayUnavailable as exc:
        return _fail(str(exc))
    try:
        app = create_app(rs, cfg)
        print(f"[metrale] serving {app.state.server.model_name} ({rs.model_config.name} on {len(rs.replicas)} "
              f"Ray Serve replica(s), {rs.backend}, ready in {time.perf_counter() - t0:.1f} s) at "
              f"http://{s.host}:{s.port}/v1{' (API key required)' if s.api_key else ''}", file=sys.stderr)
        level = str(cfg.log_level).upper()
        config = uvicorn.Config(app, host=s.host, port=s.port, log_level=_uvicorn_level(level),
                                access_log=s.access_log, lifespan="on", timeout_graceful_shutdown=5,
                                http=http_protocol(s.header_timeout_s))
        MetraleServer(config, app.state.engine_loop, s.shutdown_grace_s).run()
    finally:
        rs.close()
    return 0
