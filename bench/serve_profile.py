"""Where a served step's time goes: the library's stream() beside the HTTP server on one engine.

    python -m bench.serve_profile device=cuda model=smollm2-135m-shape [--tokens 256] [--clients 1 64]

Runs, on one engine: `Engine.stream` in the main thread and in a worker thread, then the
in-process server with N streaming clients, timing every `Engine.poll` of the engine loop and
the gaps between them; with --profile, cProfile of the polls (top functions printed).

    python -m bench.serve_profile --serve OUT.txt serve device=cuda ...

runs `python -m metrale serve ...` itself (uvicorn in the main thread, as users run it) with the
loop thread's polls timed and profiled; the report is written to OUT.txt when the server stops.
--serve-trace instead of --serve: no profiler; every poll recorded in OUT.txt.jsonl (its time,
the queues before it, the loop ahead, its deltas, the mixed-graph counters).
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import os
import pstats
import sys
import threading
import time

import numpy as np

from metrale.sampling.params import SamplingParams


def _params(tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)


def library_stream(engine, tokens: int) -> float:
    t0 = time.perf_counter()
    n = sum(len(d.token_ids) for d in engine.stream("the quick brown fox", _params(tokens)))
    return n / (time.perf_counter() - t0)


def in_thread(fn, *args):
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("v", fn(*args)))
    t.start()
    t.join()
    return box["v"]


def instrument(engine, log: list, prof: cProfile.Profile | None = None, trace: list | None = None) -> None:
    """Times every engine.poll (and profiles it with `prof`) on whatever thread calls it; with
    `trace`, one record a poll: its start and end, the queue lengths before it, whether a step was
    in flight (the loop ahead), the deltas it gave and the backend's mixed-graph counters after it."""
    poll = engine.poll
    stats = getattr(engine.backend, "mixed_stats", None)
    waited = _time_device_waits() if trace is not None else None

    def timed():
        t0 = time.perf_counter()
        before = (len(engine.scheduler.waiting), len(engine.scheduler.running),
                  engine.ahead is not None and engine.ahead.inflight is not None) if trace is not None else None
        if prof is not None:
            prof.enable()
        deltas = []
        try:
            deltas = poll()
            return deltas
        finally:
            if prof is not None:
                prof.disable()
            t1 = time.perf_counter()
            log.append((t0, t1))
            if trace is not None:
                extra = dict(stats) if stats is not None else {}
                if waited is not None:
                    extra["wait_ms"] = round(waited[0] * 1e3, 3)
                    waited[0] = 0.0
                trace.append((t0, t1, *before, len(deltas), sum(len(d.token_ids) for d in deltas), extra))
    engine.poll = timed


def _time_device_waits() -> list[float]:
    """Sums the time the host spends waiting for a launched greedy step's ids (the CUDA backend's
    PendingTokens.tokens) into the returned cell: a poll's wait against its length says whether the
    loop waits for the device or the device for the loop."""
    from metrale.runtime import cuda_backend
    cell = [0.0]
    tokens = cuda_backend.PendingTokens.tokens

    def timed(self):
        t = time.perf_counter()
        try:
            return tokens(self)
        finally:
            cell[0] += time.perf_counter() - t
    cuda_backend.PendingTokens.tokens = timed
    return cell


def served(engine, clients: int, tokens: int, profile: bool) -> dict:
    from bench.loadtest import run_load
    from metrale.server import ServerThread, create_app
    app = create_app(engine)
    log: list = []
    prof = cProfile.Profile() if profile else None
    instrument(engine, log, prof)
    srv = ServerThread(app).start()
    try:
        stats, wall = asyncio.run(run_load(srv.url, app.state.server.model_name, clients=clients,
                                           duration=2.0, requests=clients, max_tokens=tokens,
                                           prompt_words=4, api_key=None))
    finally:
        srv.stop()
        engine.poll = type(engine).poll.__get__(engine)
    return {"clients": clients, "tok_s": stats.tokens / wall,
            "itl_ms_p50": float(np.median(stats.itl)) * 1e3 if stats.itl else 0.0, "errors": len(stats.errors),
            "report": report(log, prof)}


def write_trace(trace: list, path: str) -> None:
    """The poll trace as JSON lines (times in ms from the first poll; `abs`: time.perf_counter(), the
    system's monotonic clock on Linux, comparable with bench.loadtest --timeline's)."""
    import json
    t_first = trace[0][0] if trace else 0.0
    with open(path, "w") as f:
        for t0, t1, waiting, running, ahead, n, tokens, mixed in trace:
            f.write(json.dumps({"abs": t0, "t": round((t0 - t_first) * 1e3, 3), "ms": round((t1 - t0) * 1e3, 3), "waiting": waiting,
                                "running": running, "ahead": ahead, "deltas": n, "tokens": tokens, **mixed}) + "\n")


def report(log: list, prof: cProfile.Profile | None) -> str:
    polls = np.array([b - a for a, b in log]) * 1e3
    gaps = np.array([log[i + 1][0] - log[i][1] for i in range(len(log) - 1)]) * 1e3
    lines = [f"{len(log)} polls; poll ms p50 {np.median(polls) if len(polls) else 0:.3f} p90 "
             f"{np.percentile(polls, 90) if len(polls) else 0:.3f}; gap ms p50 {np.median(gaps) if len(gaps) else 0:.3f} "
             f"p90 {np.percentile(gaps, 90) if len(gaps) else 0:.3f}"]
    if prof is not None:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
        lines.append(s.getvalue())
    return "\n".join(lines)


def serve_profiled(out_path: str, argv: list[str], trace: bool = False) -> int:
    """`python -m metrale serve argv` with the engine loop's polls timed and profiled (in the
    engine process when server.engine_process is on: the engine is built there); with `trace`,
    not profiled: each poll recorded (instrument's trace) into out_path + ".jsonl"."""
    from functools import partial
    from metrale.server.serve import main as serve_main
    return serve_main(argv, build=partial(profiled_engine, out_path, trace))


def profiled_engine(out_path: str, trace: bool, cfg):
    """Engine(cfg=cfg) whose loop thread times (and profiles, or traces) its polls, the report
    written to out_path when the loop ends."""
    from metrale import driver as loop_mod
    from metrale.engine import Engine
    log: list = []
    steps: list | None = [] if trace else None
    prof = None if trace else cProfile.Profile()
    run = loop_mod.EngineLoop._run

    def profiled(self):
        instrument(self.engine, log, trace=steps)
        if prof is not None:
            prof.enable()
        try:
            run(self)
        finally:
            if prof is not None:
                prof.disable()
            with open(out_path, "w") as f:
                f.write(report(log, prof))
            if steps is not None:
                write_trace(steps, out_path + ".jsonl")
    loop_mod.EngineLoop._run = profiled
    if os.environ.get("BENCH_SWITCH_INTERVAL"):     # an A/B of the engine process's GIL switch interval
        sys.setswitchinterval(float(os.environ["BENCH_SWITCH_INTERVAL"]))
    return Engine(cfg=cfg)


def main(argv: list[str] | None = None) -> int:
    import sys
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["--serve"], ["--serve-trace"]):
        return serve_profiled(argv[1], argv[3:] if argv[2:3] == ["serve"] else argv[2:], trace=argv[0] == "--serve-trace")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("overrides", nargs="*")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--clients", type=int, nargs="+", default=[1, 64])
    p.add_argument("--profile", action="store_true")
    args = p.parse_args(argv)
    from metrale.engine import Engine
    engine = Engine(overrides=args.overrides)
    library_stream(engine, 16)                       # warm-up
    print(f"library stream, main thread:   {library_stream(engine, args.tokens):8.1f} tok/s")
    print(f"library stream, worker thread: {in_thread(library_stream, engine, args.tokens):8.1f} tok/s")
    for clients in args.clients:
        r = served(engine, clients, args.tokens, args.profile and clients == args.clients[0])
        print(f"served, {clients} clients: {r['tok_s']:8.1f} tok/s, ITL p50 {r['itl_ms_p50']:.3f} ms, "
              f"errors {r['errors']}; {r['report']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
