"""Per-kernel device time of one decode step replayed as a CUDA graph, through Nsight Compute.

    ncu --profile-from-start off --graph-profiling node --metrics gpu__time_duration.sum \\
        --csv --log-file ncu.csv python -m bench.profile_graph --model llama-3-8b-shape --batch 32
    python -m bench.profile_graph --summarize ncu.csv

The first command captures the step's graph (warm-up and capture run outside the profiled range),
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


def profile(model: str, batch: int, context: int, overrides: list[str]) -> None:
    from bench.decode_metrale import make_backend
    from metrale.runtime.batch import Segment, build_batch
    from metrale.runtime.cuda import cu

    _, backend, _ = make_backend(model, batch, overrides)
    bs = backend.block_size
    per_seq = -(-(context + 8) // bs)
    tables = [np.arange(i * per_seq, (i + 1) * per_seq, dtype=np.int32) for i in range(batch)]
    segs = [Segment(np.array([5], np.int32), context, tables[i]) for i in range(batch)]
    b = build_batch(segs, bs)
    backend.forward_greedy(b)                      # captures the graph of this geometry if needed
    g, graphed = backend._geometry(b)
    assert graphed and g in backend.graphs, "this step does not run as a CUDA graph"
    backend._upload(b, g)
    backend.stream.synchronize()
    cu("cuProfilerStart")
    backend.graphs[g].replay()
    backend.stream.synchronize()
    cu("cuProfilerStop")
    print(f"profiled one replay: {model} B={batch} ctx={context}, {backend.graphs[g].num_nodes} nodes")


def summarize(path: str) -> None:
    rows = defaultdict(list)
    with open(path, newline="") as f:
        lines = [ln for ln in f if ln.startswith('"')]          # ncu prints its own log lines first
    for r in csv.DictReader(lines):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        name = re.sub(r"\(.*", "", r["Kernel Name"])[:60]
        scale = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3}.get(r.get("Metric Unit", "usecond"), 1.0)
        rows[name].append(float(r["Metric Value"].replace(",", "")) * scale)
    total = sum(sum(v) for v in rows.values())
    print(f"{'kernel':60s} {'n':>4s} {'total us':>10s} {'mean us':>9s} {'share':>6s}")
    for name, v in sorted(rows.items(), key=lambda kv: -sum(kv[1])):
        print(f"{name:60s} {len(v):4d} {sum(v):10.1f} {np.mean(v):9.2f} {sum(v) / total:6.1%}")
    print(f"{'sum of kernel times':60s} {sum(len(v) for v in rows.values()):4d} {total:10.1f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3-8b-shape")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--override", nargs="*", default=[])
    ap.add_argument("--summarize", default=None, help="an ncu --csv log to group by kernel")
    args = ap.parse_args()
    if args.summarize:
        summarize(args.summarize)
    else:
        profile(args.model, args.batch, args.context, args.override)


if __name__ == "__main__":
    main()
