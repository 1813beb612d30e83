"""The CPU path against llama.cpp on the same GGUF, in one run (issue 23): decode tok/s at batch 1
and 8, prefill of 512 tokens, peak RSS; metrale's fast path (levers.cpu_kernels=numba), its NumPy
reference (numpy) and llama.cpp's CPU build (llama-bench, llama-batched-bench).

    python -m bench.cpu_decode --llamacpp /work/lcpp/build-cpu/bin          # SmolLM2 Q4_1, 2 threads
    python -m bench.cpu_decode --skip numpy --out docs/bench                  # records to docs/bench/cpu_decode.json

Every configuration runs in a fresh process (its peak RSS is its own; Numba's disk cache is warm
after the first). What is compared (llama.cpp's tool -> metrale's equivalent, bench.decode_metrale):
  llama-bench -n 128                 decode at batch 1                 -> 32 greedy steps at context 64
  llama-bench -p 512                 prompt processing                  -> one 512-token prefill
  llama-batched-bench -npp 128 -ntg 128 -npl 8: S_TG (aggregate decode) -> 8 sequences at context 192
and `python -m metrale` (the README's command: 64 tokens of the default prompt) for its peak RSS and
tok/s. The rounds alternate metrale and llama.cpp so that a noisy machine hurts both alike; each
figure is the median over rounds.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = "cpu_decode"


def measure(model: str, kernels: str, threads: int, steps: int, prefill: int) -> dict:
    """In this process: load, decode at batch 1 and 8, prefill; peak RSS at the end."""
    import resource
    from bench.decode_metrale import decode_tok_s, prefill_tok_s
    from metrale.models.assemble import load_model
    from metrale.settings import compose
    kernels, _, activations = kernels.partition("_")          # numba_q8: levers.cpu_activations=q8
    cfg = compose([f"model={model}", "device=cpu", f"levers.cpu_kernels={kernels}", f"levers.cpu_threads={threads}",
                   f"levers.cpu_activations={activations or 'f32'}",
                   "scheduler.max_num_seqs=8", f"scheduler.max_num_batched_tokens={prefill}", "cache.num_blocks=192"])
    t0 = time.perf_counter()
    _, _, backend = load_model(cfg)
    load_s = time.perf_counter() - t0
    backend.max_tokens = prefill
    out = {"kernels": kernels, "activations": activations or "f32", "threads": threads, "load_s": load_s,
           "weights_bytes": backend.memory_report()["weights_bytes"]}
    out["decode_b1"] = decode_tok_s(backend, 1, 64, steps=steps)
    out["decode_b8"] = decode_tok_s(backend, 8, 192, steps=max(4, steps // 4))
    out["prefill"] = prefill_tok_s(backend, prefill, reps=2)
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def ab_fused(model: str, threads: int, rounds: int, steps: int, prefill: int, activations: str) -> dict:
    """CpuOps.fused_layer on and off in one process, interleaved step by step (decode) or pass by
    pass (prefill), which goes first alternating, so that a shared machine's load hits both alike:
    per variant the median step time over `steps` decode steps at batch 1 and 8 (context 64..95
    cycled) and over `rounds` prefills of `prefill` tokens; ratio = unfused time / fused time."""
    import numpy as np
    from metrale.models.assemble import load_model
    from metrale.runtime.batch import Segment, build_batch
    from metrale.runtime.cpu_ops import CpuOps
    from metrale.settings import compose
    cfg = compose([f"model={model}", "device=cpu", "levers.cpu_kernels=numba", f"levers.cpu_threads={threads}",
                   f"levers.cpu_activations={activations}", "scheduler.max_num_seqs=8",
                   f"scheduler.max_num_batched_tokens={prefill}", "cache.num_blocks=192"])
    _, _, backend = load_model(cfg)
    backend.max_tokens = prefill
    bs, vocab = backend.block_size, backend.config.vocab_size
    ids = np.random.default_rng(0).integers(0, vocab, prefill).astype(np.int32)

    def decode(batch):
        per = -(-128 // bs)
        tables = [np.arange(i * per, (i + 1) * per, dtype=np.int32) for i in range(batch)]
        return lambda s: backend.forward_greedy(build_batch(
            [Segment(ids[i:i + 1], 64 + s % 32, tables[i]) for i in range(batch)], bs))

    table = np.arange(-(-prefill // bs), dtype=np.int32)
    cases = {"decode_b1": (decode(1), steps, 1), "decode_b8": (decode(8), max(8, steps // 4), 8),
             "prefill": (lambda s: backend.forward_greedy(build_batch([Segment(ids, 0, table, "last")], bs)), rounds,
                         prefill)}
    out: dict = {"activations": activations, "threads": threads}
    for name, (step, n, tokens) in cases.items():
        times = {True: [], False: []}
        for s in range(-2, n):                    # two untimed steps of each (the first compiles the fused calls)
            for fused in ((True, False) if s % 2 else (False, True)):
                CpuOps.fused_layer = fused
                t0 = time.perf_counter()
                step(s)
                if s >= 0:
                    times[fused].append(time.perf_counter() - t0)
        on, off = np.array(times[True]), np.array(times[False])
        out[name] = {"steps": n, "fused_tok_s": tokens / float(np.median(on)),
                     "unfused_tok_s": tokens / float(np.median(off)),
                     "ratio": float(np.median(off) / np.median(on)),
                     "paired_ratio_median": float(np.median(off / on)),
                     "fused_ms": float(np.median(on) * 1e3), "unfused_ms": float(np.median(off) * 1e3)}
        print(f"[cpu_decode] ab {name}: " + json.dumps(out[name]), file=sys.stderr, flush=True)
    CpuOps.fused_layer = True
    return out


def run_child(args: list[str], timeout: float = 1800) -> dict:
    p = subprocess.run([sys.executable, "-m", "bench.cpu_decode", *args], capture_output=True, text=True,
                       timeout=timeout, cwd=ROOT)
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode or not line:
        return {"error": (p.stdout + p.stderr)[-2000:]}
    return json.loads(line[-1])


def cli_rss(model: str, kernels: str, threads: int) -> dict:
    """`python -m metrale` (64 tokens of the default prompt): its tok/s line and peak RSS."""
    code = ("import resource, subprocess, sys; p = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
            "print(p.stdout + p.stderr); print('RSS_KB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    cmd = [sys.executable, "-c", code, sys.executable, "-m", "metrale", f"model={model}", "device=cpu",
           f"levers.cpu_kernels={kernels}", f"levers.cpu_threads={threads}"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=ROOT)
    rate = re.search(r"\(([\d.]+) tok/s\)", p.stdout)
    rss = re.search(r"RSS_KB (\d+)", p.stdout)
    return {"tok_s": float(rate.group(1)) if rate else None, "peak_rss_mb": int(rss.group(1)) / 1024 if rss else None,
            "command": f"python -m metrale model={model} device=cpu levers.cpu_kernels={kernels}"}


def llamacpp(bin_dir: Path, gguf: Path, threads: int, prefill: int) -> dict:
    """llama-bench (decode at batch 1, prefill) and llama-batched-bench (batch 8), each with weight
    repacking on (llama.cpp's default: its CPU "extra buffer" layouts, AMX / VNNI where the CPU has
    them) and off. A figure takes the faster setting that ran; `<figure>_by_repack` keeps both
    (a setting that crashed, as repacking did on prompts on an AMX Xeon, has None and its exit status)."""
    from bench.llamacpp import _run, parse_batched_bench, parse_llama_bench
    out: dict = {"threads": threads}
    for repack in (1, 0):
        for key, args in (("decode_b1", ["-p", "0", "-n", "128"]), ("prefill", ["-p", str(prefill), "-n", "0"])):
            cmd = [str(bin_dir / "llama-bench"), "-m", str(gguf), *args, "-t", str(threads), "-r", "3",
                   "--repack", str(repack), "-o", "json"]
            rc, so, se = _run(cmd, 900)
            rows = parse_llama_bench(so) or [] if rc == 0 else []
            fig = {"tok_s": float(rows[0]["avg_ts"]), "stddev": float(rows[0].get("stddev_ts", 0.0))} if rows else \
                {"tok_s": None, "rc": rc, "command": " ".join(cmd[1:])}
            out.setdefault(f"{key}_by_repack", {})[repack] = fig
        cmd = [str(bin_dir / "llama-batched-bench"), "-m", str(gguf), "-c", str(8 * (128 + 128 + 16)), "-b", "2048",
               "-ub", "512", "-npp", "128", "-ntg", "128", "-npl", "8", "-t", str(threads), "--output-format", "jsonl",
               *([] if repack else ["--no-repack"])]
        rc, so, se = _run(cmd, 900)
        rows = parse_batched_bench(so + "\n" + se) if rc == 0 else []
        out.setdefault("decode_b8_by_repack", {})[repack] = {"tok_s": float(rows[-1]["speed_tg"])} if rows else \
            {"tok_s": None, "rc": rc, "command": " ".join(cmd[1:])}
    for key in ("decode_b1", "prefill", "decode_b8"):
        ran = {r: f for r, f in out[f"{key}_by_repack"].items() if f["tok_s"] is not None}
        if ran:
            best = max(ran, key=lambda r: ran[r]["tok_s"])
            out[key] = {**ran[best], "repack": best}
    return out


def _median(values):
    values = sorted(v for v in values if v is not None)
    return values[len(values) // 2] if values else None


def summary(rounds: list[dict]) -> dict:
    """Medians over rounds of every tok/s figure, per runner."""
    out: dict = {}
    for runner in ("numba", "numba_q8", "numpy", "llamacpp"):
        got = [r[runner] for r in rounds if runner in r and "error" not in r[runner]]
        if not got:
            continue
        fig = {k: _median([g.get(k, {}).get("tok_s") for g in got]) for k in ("decode_b1", "decode_b8", "prefill")}
        if runner != "llamacpp":
            fig["peak_rss_mb"] = _median([g.get("peak_rss_mb") for g in got])
            fig["weights_bytes"] = got[0]["weights_bytes"]
        out[runner] = fig
    for runner in ("numba", "numpy"):
        got = [r.get(f"cli_{runner}") for r in rounds if r.get(f"cli_{runner}")]
        if got:
            out.setdefault(runner, {})["cli_tok_s"] = _median([g["tok_s"] for g in got])
            out[runner]["cli_peak_rss_mb"] = _median([g["peak_rss_mb"] for g in got])
    return out


def records(s: dict, machine: str, command: str) -> list[dict]:
    from bench.records import make_record
    peer = s.get("llamacpp", {})
    recs = []
    names = {"decode_b1": "decode batch 1", "decode_b8": "decode batch 8 (aggregate)", "prefill": "prefill 512"}
    for runner, label in (("numba", "fast path"), ("numba_q8", "fast path, 8-bit activations"),
                          ("numpy", "NumPy reference")):
        fig = s.get(runner)
        if not fig:
            continue
        for key, name in names.items():
            if fig.get(key):
                recs.append(make_record(BENCH, f"SmolLM2 Q4_1 {name}, {label}", fig[key], "tok/s", None,
                                        peer.get(key), "llama.cpp CPU", machine, command))
        if fig.get("cli_peak_rss_mb"):
            recs.append(make_record(BENCH, f"python -m metrale peak RSS, {label}", fig["cli_peak_rss_mb"], "MB",
                                    400.0 if runner == "numba" else None, None, None, machine, command))
    return recs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--llamacpp", default="", help="directory of llama-bench and llama-batched-bench")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--skip", nargs="*", default=[], choices=["numba", "numba_q8", "numpy", "llamacpp", "cli"])
    ap.add_argument("--out", default="", help="write bench records (bench/records.py) to this directory")
    ap.add_argument("--raw", default="", help="write the rounds and the summary as JSON here")
    ap.add_argument("--ab-fused", action="store_true",
                    help="only the fused layer against its composition (CpuOps.fused_layer), in one process")
    ap.add_argument("--activations", default="f32", choices=["f32", "q8"], help="with --ab-fused")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.ab_fused:
        s = ab_fused(a.model, a.threads, a.rounds, a.steps, a.prefill, a.activations)
        s["load_avg"] = os.getloadavg()
        print(json.dumps(s, indent=1))
        if a.raw:
            Path(a.raw).write_text(json.dumps(s, indent=1))
        return
    if a.child:
        print(json.dumps(measure(a.model, a.child, a.threads, a.steps, a.prefill)))
        return
    from metrale.models.registry import resolve_model
    gguf = resolve_model(a.model).path
    common = ["--model", a.model, "--threads", str(a.threads), "--steps", str(a.steps), "--prefill", str(a.prefill)]
    rounds = []
    for i in range(a.rounds):
        r: dict = {"round": i}
        for runner in ("numba", "llamacpp", "numba_q8", "numpy"):
            if runner in a.skip or (runner == "llamacpp" and not a.llamacpp):
                continue
            t0 = time.perf_counter()
            r[runner] = llamacpp(Path(a.llamacpp), gguf, a.threads, a.prefill) if runner == "llamacpp" else \
                run_child([*common, "--child", runner])
            print(f"[cpu_decode] round {i} {runner}: {time.perf_counter() - t0:.0f} s {json.dumps(r[runner])[:400]}",
                  file=sys.stderr, flush=True)
        if "cli" not in a.skip:
            for runner in ("numba", "numpy"):
                if runner not in a.skip:
                    r[f"cli_{runner}"] = cli_rss(a.model, runner, a.threads)
        rounds.append(r)
    s = summary(rounds)
    s["load_avg"] = os.getloadavg()
    print(json.dumps(s, indent=1))
    if a.raw:
        Path(a.raw).write_text(json.dumps({"rounds": rounds, "summary": s}, indent=1))
    if a.out:
        from bench.records import write_records
        machine = f"CPU, {os.cpu_count()} cores"
        cmd = "python -m bench.cpu_decode " + " ".join(sys.argv[1:])
        for path in write_records(records(s, machine, cmd), a.out, merge=True):
            print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
