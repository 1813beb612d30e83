"""Per-kernel device time of one decode step replayed as a CUDA graph, through Nsight Compute.

    ncu --profile-from-start off --graph-profiling node --metrics gpu__time_duration.sum,dram__bytes.sum \\
        --csv --log-file ncu.csv python -m bench.profile_graph --model llama-3-8b-shape --batch 32
    python -m bench.profile_graph --summarize ncu.csv

`--time-only` prints the device time of one step (back-to-back replays) and stops: the A/B of a
lever without host overhead (`--override levers.pdl=false`). The first command captures the step's
graph (warm-up and capture run outside the profiled range),
then replays it once between cuProfilerStart / cuProfilerStop, so ncu times each graph node (kernel
or cuBLASLt call) on its own. `--summarize` groups the CSV rows by kernel name: count, total and
mean microseconds, share of the step. (nsys is not on the GPU image; ncu is: /usr/local/cuda/bin.)
"""
from __future__ import annotations

import argparse
import csv
import re
from collections import defaultdict

import numpy as np


def replay_us(graph, stream, reps: int = 50) -> float:
    """Device time of one step: back-to-back replays (the host enqueues ahead), mean microseconds."""
    import time
    graph.replay()
    stream.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        graph.replay()
    stream.synchronize()
    return (time.perf_counter() - t0) / reps * 1e6


def profile(model: str, batches: list[int], context: int, overrides: list[str], time_only: bool = False) -> None:
    """For each batch size: capture its decode graph, time it, and (unless time_only) replay it once
    inside the profiler range."""
    from bench.decode_metrale import make_backend
    from metrale.runtime.batch import Segment, build_batch
    from metrale.runtime.cuda import cu

    _, backend, _ = make_backend(model, max(batches), overrides)
    bs = backend.block_size
    per_seq = -(-(context + 8) // bs)
    for batch in batches:
        tables = [np.arange(i * per_seq, (i + 1) * per_seq, dtype=np.int32) for i in range(batch)]
        segs = [Segment(np.array([5], np.int32), context, tables[i]) for i in range(batch)]
        b = build_batch(segs, bs)
        backend.forward_greedy(b)                      # captures the graph of this geometry if needed
        g, graphed = backend._geometry(b)
        assert graphed and g in backend.graphs, "this step does not run as a CUDA graph"
        backend.meta.upload(b, g, backend.stream)
        backend.stream.synchronize()
        us = replay_us(backend.graphs[g], backend.stream)
        print(f"replay: {model} B={batch} ctx={context} pdl={backend.pdl}: {us:.1f} us a step "
              f"({batch / us * 1e6:.0f} tok/s), {backend.graphs[g].num_nodes} nodes", flush=True)
        tuned = getattr(getattr(backend, "blas", None), "tuned", {})
        changed = {k: v for k, v in tuned.items() if v[0] != 0}
        if changed:
            saved = sum(v[2] - v[1] for v in changed.values())
            print(f"  cuBLASLt autotune: {len(changed)} of {len(tuned)} plans changed, "
                  f"{saved:.1f} us saved over one call of each: " + ", ".join(
                      f"T{k[0]}xN{k[1]}xK{k[2]} {v[2]:.1f}->{v[1]:.1f}" for k, v in sorted(changed.items())))
        if time_only:
            continue
        cu("cuProfilerStart")
        backend.graphs[g].replay()
        backend.stream.synchronize()
        cu("cuProfilerStop")
        print(f"profiled one replay: {model} B={batch} ctx={context}, {backend.graphs[g].num_nodes} nodes")


def summarize(path: str) -> None:
    """Group an ncu CSV by kernel name: count, total and mean time, share of the step and, when the
    log has dram__bytes.sum, the kernels' DRAM bandwidth (bytes over their own time)."""
    times, nbytes = defaultdict(list), defaultdict(float)
    with open(path, newline="") as f:
        lines = [ln for ln in f if ln.startswith('"')]          # ncu prints its own log lines first
    for r in csv.DictReader(lines):
        metric, unit = r.get("Metric Name"), r.get("Metric Unit", "")
        name = re.sub(r"\(.*", "", r["Kernel Name"])[:60]
        value = float(r["Metric Value"].replace(",", ""))
        if metric == "gpu__time_duration.sum":
            times[name].append(value * {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}[unit])
        elif metric == "dram__bytes.sum":
            nbytes[name] += value * {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9}[unit]
    total = sum(sum(v) for v in times.values())
    bw = bool(nbytes)
    print(f"{'kernel':60s} {'n':>4s} {'total us':>10s} {'mean us':>9s} {'share':>6s}" + (f" {'TB/s':>6s}" if bw else ""))
    for name, v in sorted(times.items(), key=lambda kv: -sum(kv[1])):
        extra = f" {nbytes[name] / (sum(v) * 1e-6) / 1e12:6.2f}" if bw else ""
        print(f"{name:60s} {len(v):4d} {sum(v):10.1f} {np.mean(v):9.2f} {sum(v) / total:6.1%}{extra}")
    extra = f" {sum(nbytes.values()) / (total * 1e-6) / 1e12:6.2f}" if bw else ""
    print(f"{'sum of kernel times':60s} {sum(len(v) for v in times.values()):4d} {total:10.1f}{' ' * 17}{extra}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3-8b-shape")
    ap.add_argument("--batch", type=int, nargs="+", default=[32])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--override", nargs="*", default=[])
    ap.add_argument("--summarize", default=None, help="an ncu --csv log to group by kernel")
    ap.add_argument("--time-only", action="store_true", help="time graph replays, no profiler range")
    args = ap.parse_args()
    if args.summarize:
        summarize(args.summarize)
    else:
        profile(args.model, args.batch, args.context, args.override, args.time_only)


if __name__ == "__main__":
    main()
