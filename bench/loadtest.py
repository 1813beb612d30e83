"""Bounded load test of the OpenAI-compatible server: N concurrent streaming clients for T seconds
(or M requests in all), reporting throughput and TTFT / inter-token latency percentiles.

    python -m bench.loadtest --fake                              # in-process server, fake engine: seconds
    python -m bench.loadtest --clients 64 --duration 30 device=cuda model=llama-3.2-1b-shape
    python -m bench.loadtest --url http://127.0.0.1:8000 --model smollm2-135m --requests 200
    python -m bench.loadtest --library --clients 64 --requests 128 device=cuda   # Engine.generate, no HTTP

Without --url the server runs in this process on a loopback port (key=value arguments are
engine settings, as for `python -m metrale serve`), its engine in the same process or, with
--engine-process, in one of its own (as `python -m metrale serve` runs it). Each client sends
streaming completions back to back; TTFT is measured to the first chunk with text, ITL between
text chunks (a chunk holding k tokens counts as k gaps of 1/k of its wait). --library runs the
same prompts through Engine.generate in batches of --clients instead (the figure the served one
is held to). --records writes bench JSON records, --json the summary.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("the quick brown fox jumps over a lazy dog while seven wise owls count stars above "
         "quiet hills and rivers").split()


@dataclass
class Stats:
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    latency: list[float] = field(default_factory=list)
    tokens: int = 0
    chunks: int = 0                # streamed events that carried text
    done: int = 0
    errors: list[str] = field(default_factory=list)
    timeline: list[list] = field(default_factory=list)     # per request: sent, first text, end (perf_counter)


def make_prompt(i: int, words: int) -> str:
    return " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(words)) + f" #{i}"


class Connection:
    """A minimal HTTP/1.1 keep-alive client for streamed POSTs: httpx costs more CPU per chunk than
    the server does, and the load generator must not be what is measured."""

    def __init__(self, base_url: str, headers: dict[str, str]):
        u = urlsplit(base_url)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80
        self.prefix = u.path.rstrip("/")
        self.headers = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self.reader = self.writer = None

    async def post_stream(self, path: str, body: dict):
        """Yields the `data:` payloads of an event stream; raises RuntimeError on a non-200."""
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        data = json.dumps(body).encode()
        self.writer.write(f"POST {self.prefix}{path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                          f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
                          f"{self.headers}\r\n".encode() + data)
        status = int((await self.reader.readline()).split()[1])
        headers = {}
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            key, _, value = line.decode().partition(":")
            headers[key.strip().lower()] = value.strip()
        if headers.get("transfer-encoding") != "chunked":
            payload = await self.reader.readexactly(int(headers.get("content-length", 0)))
            if headers.get("connection") == "close":
                self.close()
            raise RuntimeError(f"{status}: {payload[:200]!r}")
        buf = b""
        while size := int((await self.reader.readline()).strip() or b"0", 16):
            buf += (await self.reader.readexactly(size + 2))[:-2]
            *events, buf = buf.split(b"\n\n")
            for event in events:
                if event.startswith(b"data: "):
                    yield event[6:]
        await self.reader.readline()
        if status != 200:
            raise RuntimeError(f"{status}: {buf[:200]!r}")

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


async def one_request(conn: Connection, body: dict, stats: Stats) -> None:
    t0 = time.perf_counter()
    stats.timeline.append(times := [t0, None, None])      # sent, first text, end
    last, first, usage = None, None, None
    try:
        async for payload in conn.post_stream("/v1/completions", body):
            if payload == b"[DONE]":
                continue
            chunk = json.loads(payload)
            if "error" in chunk:
                stats.errors.append(chunk["error"]["message"])
                continue
            if chunk.get("usage"):
                usage = chunk["usage"]
            if not chunk["choices"] or not chunk["choices"][0].get("text"):
                continue
            now = time.perf_counter()
            stats.chunks += 1
            if first is None:
                first = times[1] = now
                stats.ttft.append(now - t0)
            else:
                stats.itl.append(now - last)
            last = now
    except (OSError, RuntimeError, ValueError, asyncio.IncompleteReadError) as exc:
        conn.close()
        stats.errors.append(f"{type(exc).__name__}: {exc}")
        return
    times[2] = time.perf_counter()
    stats.latency.append(times[2] - t0)
    stats.tokens += usage["completion_tokens"] if usage else 0
    stats.done += 1


async def run_load(base_url: str, model: str, *, clients: int, duration: float, requests: int | None,
                   max_tokens: int, prompt_words: int, api_key: str | None) -> tuple[Stats, float]:
    stats = Stats()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.perf_counter() + duration
    issued = 0

    async def client() -> None:
        nonlocal issued
        conn = Connection(base_url, headers)
        try:
            while time.perf_counter() < deadline and (requests is None or issued < requests):
                i = issued
                issued += 1
                body = {"model": model, "prompt": make_prompt(i, prompt_words), "max_tokens": max_tokens,
                        "temperature": 0.0, "ignore_eos": True, "stream": True,
                        "stream_options": {"include_usage": True}}
                await one_request(conn, body, stats)
        finally:
            conn.close()

    t0 = time.perf_counter()
    await asyncio.wait_for(asyncio.gather(*(client() for _ in range(clients))), timeout=duration + 120)
    return stats, time.perf_counter() - t0


def cpu_seconds(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) so far of a process and of each of its children (Linux /proc)."""
    def read(p: int) -> tuple[int, float] | None:
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            return None
        return int(fields[1]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (got := read(int(entry))) is not None and (int(entry) == pid or got[0] == pid):
            out[int(entry)] = got[1]
    return out


def thread_cpu(pids) -> dict[str, float]:
    """CPU seconds so far of every thread of these processes, keyed "pid/tid name" (Linux /proc):
    which thread of the server or the engine process spends what."""
    out = {}
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    head, rest = f.read().rsplit(")", 1)
            except OSError:
                continue
            fields = rest.split()
            name = head.split("(", 1)[1]
            out[f"{pid}/{tid} {name}"] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def cpu_report(pid: int, before: dict[int, float], after: dict[int, float], stats: Stats,
               wall: float) -> tuple[str, dict]:
    """Per output token, the CPU the server process and its children (the engine process) spent
    (and the server's per streamed chunk): a line and the figures."""
    parts, figures = [], {}
    for p, t in sorted(after.items(), key=lambda kv: kv[0] != pid):
        used = t - before.get(p, 0.0)
        if p != pid and used < 0.05 * wall:          # multiprocessing's resource tracker, idle
            continue
        per = used / max(stats.tokens, 1) * 1e6
        if p == pid:
            figures["server_cpu_us_per_chunk"] = used / max(stats.chunks, 1) * 1e6
            parts.append(f"server {per:.1f} us/token, {figures['server_cpu_us_per_chunk']:.1f} us/chunk "
                         f"({used / wall:.0%} of a core)")
        else:
            parts.append(f"engine process {p} {per:.1f} us/token ({used / wall:.0%} of a core)")
        key = "server_cpu_us_per_token" if p == pid else "engine_cpu_us_per_token"
        figures[key] = figures.get(key, 0.0) + per
    return "CPU: " + ", ".join(parts), figures


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def summarize(stats: Stats, wall: float) -> dict:
    return {"requests": stats.done, "errors": len(stats.errors), "wall_s": wall,
            "req_per_s": stats.done / wall, "out_tok_per_s": stats.tokens / wall,
            "tokens_per_chunk": stats.tokens / stats.chunks if stats.chunks else float("nan"),
            **{f"ttft_p{q}_ms": pct(stats.ttft, q) * 1e3 for q in (50, 90, 99)},
            **{f"itl_p{q}_ms": pct(stats.itl, q) * 1e3 for q in (50, 90, 99)},
            **{f"latency_p{q}_s": pct(stats.latency, q) for q in (50, 99)}}


def fake_engine_for(num_blocks: int, step_ms: float, cfg=None):
    """The fake engine (tests/fake_model.py), each forward sleeping step_ms (picklable through
    functools.partial: the engine process builds it)."""
    if str(ROOT / "tests") not in sys.path:
        sys.path.insert(0, str(ROOT / "tests"))
    from fake_model import fake_engine
    engine = fake_engine(num_blocks=num_blocks, block_size=4)
    if step_ms:
        forward = engine.backend.forward
        engine.backend.forward = lambda *a, **k: (time.sleep(step_ms / 1e3), forward(*a, **k))[1]
    return engine


def make_engine(args, overrides: list[str]):
    """(engine, or EngineProcess with --engine-process, unless --library)."""
    from functools import partial
    from metrale.settings import compose
    cfg = compose(overrides)
    if args.fake:
        if str(ROOT / "tests") not in sys.path:      # its tokenizer comes back from the engine process
            sys.path.insert(0, str(ROOT / "tests"))
        per_request = -(-(args.prompt_words * 8 + args.max_tokens + 8) // 4)
        build = partial(fake_engine_for, max(1024, args.clients * per_request + 64), args.fake_step_ms)
    else:
        from metrale.server.engine_process import build_engine as build
    if args.engine_process and not args.library:
        from metrale.server.engine_process import EngineProcess
        return EngineProcess.start(cfg, build)
    return build(cfg)


def start_local(args, overrides: list[str]):
    """A server on a loopback port (fake or real engine; in this process or, with
    --engine-process, in its own)."""
    from metrale.server import ServerThread, create_app
    app = create_app(make_engine(args, overrides))
    return ServerThread(app, port=args.listen or 0, loop=args.uvicorn_loop).start(), app.state.server.model_name


def run_library(engine, *, clients: int, requests: int, max_tokens: int, prompt_words: int) -> tuple[Stats, float]:
    """The load's prompts through Engine.generate, `clients` at a time (after one warm-up batch)."""
    from metrale.sampling.params import SamplingParams
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine.generate([make_prompt(-1 - i, prompt_words) for i in range(clients)], params, use_tqdm=False)
    stats = Stats()
    t0 = time.perf_counter()
    for start in range(0, requests, clients):
        batch = [make_prompt(i, prompt_words) for i in range(start, min(start + clients, requests))]
        t = time.perf_counter()
        outs = engine.generate(batch, params, use_tqdm=False)
        stats.latency += [time.perf_counter() - t] * len(outs)
        stats.tokens += sum(len(o.token_ids) for o in outs)
        stats.done += len(outs)
    return stats, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="engine settings key=value (in-process server only)")
    p.add_argument("--fake", action="store_true", help="in-process server around the fake engine (tests/fake_model.py)")
    p.add_argument("--fake-step-ms", type=float, default=0.0, help="sleep this long in each fake forward")
    p.add_argument("--uvicorn-loop", default="auto", help="the in-process server's event loop: auto|asyncio|uvloop")
    p.add_argument("--listen", type=int, help="only serve (fake or real engine) on this port until interrupted; "
                   "another process's --url drives it, so client and server do not share a GIL")
    p.add_argument("--engine-process", action="store_true",
                   help="the local server's engine in a process of its own (server.engine_process)")
    p.add_argument("--library", action="store_true",
                   help="no server: the same prompts through Engine.generate, --clients at a time")
    p.add_argument("--url", help="an already running server (default: start one in this process)")
    p.add_argument("--model", help="model id to send (default: the in-process server's)")
    p.add_argument("--api-key")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--duration", type=float, default=3.0, help="seconds to keep sending (upper bound)")
    p.add_argument("--requests", type=int, help="stop after this many requests in all")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-words", type=int, default=16)
    p.add_argument("--records", help="write bench records (a .json file or a directory)")
    p.add_argument("--json", help="write the summary (tok/s, TTFT / ITL percentiles) to this JSON file")
    p.add_argument("--timeline", help="write each request's (sent, first text, end) time.perf_counter() values "
                   "to this JSON file (bench.serve_profile --serve-trace's clock)")
    p.add_argument("--trace", help="with --library: each Engine.poll recorded as JSON lines (bench.serve_profile's "
                   "--serve-trace records: its length, queues, tokens, time waiting for the device)")
    p.add_argument("--server-pid", type=int, help="with --url: report the CPU that server process and its "
                   "children (the engine process) spent per output token")
    args = p.parse_args(argv)
    if args.url and (args.fake or args.overrides or args.library):
        p.error("--url talks to a running server; --fake, --library and settings start an engine here")
    if args.library:
        engine = make_engine(args, args.overrides)
        polls: list = []
        if args.trace:
            from bench.serve_profile import instrument
            instrument(engine, [], trace=polls)
        stats, wall = run_library(engine, clients=args.clients, requests=args.requests or args.clients * 2,
                                  max_tokens=args.max_tokens, prompt_words=args.prompt_words)
        if args.trace:
            from bench.serve_profile import write_trace
            write_trace(polls, args.trace)
        return report(args, argv, stats, wall, "Engine.generate")
    srv = None
    if args.listen:
        srv, model = start_local(args, args.overrides)
        print(f"serving {model} at {srv.url}", flush=True)
        try:
            while srv.thread.is_alive():
                time.sleep(0.5)
        except KeyboardInterrupt:
            pass
        srv.stop()
        return 0
    if args.url:
        base, model = args.url, args.model or "default"
    else:
        srv, model = start_local(args, args.overrides)
        base, model = srv.url, args.model or model
    pid = args.server_pid or (os.getpid() if srv is not None else None)
    before, cpu = cpu_seconds(pid) if pid else {}, {}
    threads_before = thread_cpu(before) if pid else {}
    try:
        stats, wall = asyncio.run(run_load(base, model, clients=args.clients, duration=args.duration,
                                           requests=args.requests, max_tokens=args.max_tokens,
                                           prompt_words=args.prompt_words, api_key=args.api_key))
        if pid:
            after = cpu_seconds(pid)
            line, cpu = cpu_report(pid, before, after, stats, wall)
            used = {k: round(v - threads_before.get(k, 0.0), 3) for k, v in thread_cpu(after).items()}
            cpu["thread_cpu_s"] = {k: v for k, v in sorted(used.items(), key=lambda kv: -kv[1]) if v > 0}
            print(line + (" (the client's share included: same process)" if srv is not None else ""))
    finally:
        if srv is not None:
            srv.stop()
    return report(args, argv, stats, wall, "clients", cpu)


def report(args, argv, stats: Stats, wall: float, what: str, cpu: dict | None = None) -> int:
    s = {**summarize(stats, wall), **(cpu or {})}
    by = f"{args.clients} clients" if what == "clients" else f"{what}, batches of {args.clients}"
    print(f"{s['requests']} requests ({s['errors']} errors) from {by} in {wall:.2f} s: "
          f"{s['req_per_s']:.1f} req/s, {s['out_tok_per_s']:.0f} output tok/s"
          + (f", {s['tokens_per_chunk']:.2f} tokens a chunk" if stats.chunks else ""))
    print(f"TTFT ms  p50 {s['ttft_p50_ms']:8.2f}  p90 {s['ttft_p90_ms']:8.2f}  p99 {s['ttft_p99_ms']:8.2f}")
    print(f"ITL  ms  p50 {s['itl_p50_ms']:8.2f}  p90 {s['itl_p90_ms']:8.2f}  p99 {s['itl_p99_ms']:8.2f}")
    print(f"latency  p50 {s['latency_p50_s']:8.3f} s  p99 {s['latency_p99_s']:8.3f} s")
    for err in stats.errors[:3]:
        print(f"error: {err}", file=sys.stderr)
    if args.records:
        from bench.records import make_record, write_records
        command = "python -m bench.loadtest " + " ".join(argv if argv is not None else sys.argv[1:])
        extra = {"clients": args.clients, "max_tokens": args.max_tokens, "fake": args.fake, "library": args.library,
                 "engine_process": args.engine_process, **s}
        recs = [make_record("server_loadtest", name, s[key], unit, None, None, None, "", command, extra)
                for name, key, unit in (("output throughput", "out_tok_per_s", "tok/s"),
                                        ("TTFT p50", "ttft_p50_ms", "ms"), ("ITL p50", "itl_p50_ms", "ms"))]
        write_records(recs, args.records)
    if args.timeline:
        Path(args.timeline).write_text(json.dumps(stats.timeline))
    if args.json:
        Path(args.json).write_text(json.dumps({"clients": args.clients, "max_tokens": args.max_tokens,
                                               "library": args.library, **s}, indent=1))
    return 0 if stats.done and not stats.errors else 1


if __name__ == "__main__":
    sys.exit(main())
