"""Where the time to first token goes under Poisson arrivals: the percentiles of bench.run_all's
Poisson stage, with the kernel compiles (Numba dispatcher compiles that missed every cache) and
graph captures that happened while serving, counted and timed.

    python -m bench.poisson_stalls --model smollm2-135m-shape [--rate 16] [--n 64] [overrides...]
"""
from __future__ import annotations

import argparse
import json
import time


def instrument() -> dict:
    """Wraps Numba's CUDA compile and metrale's graph capture to count and time them."""
    from numba.cuda import dispatcher
    from metrale.runtime.cuda import graph
    stats = {"compiles": 0, "compile_s": 0.0, "captures": 0, "capture_s": 0.0}
    compile_ = dispatcher.CUDADispatcher.compile

    def timed_compile(self, sig):
        before = sum(self._cache_misses.values())
        t = time.perf_counter()
        out = compile_(self, sig)
        if sum(self._cache_misses.values()) > before:
            stats["compiles"] += 1
            stats["compile_s"] += time.perf_counter() - t
        return out

    capture = graph.CudaGraph.capture.__func__

    def timed_capture(cls, *a, **k):
        t = time.perf_counter()
        out = capture(cls, *a, **k)
        stats["captures"] += 1
        stats["capture_s"] += time.perf_counter() - t
        return out

    dispatcher.CUDADispatcher.compile = timed_compile
    graph.CudaGraph.capture = classmethod(timed_capture)
    return stats


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-shape")
    ap.add_argument("--rate", type=float, default=16.0)
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--output", type=int, default=128)
    ap.add_argument("--json")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    stats = instrument()
    from metrale import Engine
    from bench.run_all import poisson_latency
    t0 = time.perf_counter()
    eng = Engine(model=a.model, device="cuda", overrides=a.overrides)
    start = {"ready_s": time.perf_counter() - t0, **stats}
    for k in ("compiles", "compile_s", "captures", "capture_s"):
        stats[k] = 0 if k in ("compiles", "captures") else 0.0
    r = poisson_latency(eng, rate=a.rate, n=a.n, prompt_len=a.prompt, output_len=a.output)
    r.update(model=a.model, overrides=a.overrides, startup=start, serving=dict(stats))
    t, i = r["ttft_ms"], r["itl_ms"]
    print(f"poisson {a.model} {a.rate:g}/s {' '.join(a.overrides)}: TTFT p50/p90/p99 {t['p50']:.1f}/{t['p90']:.1f}/"
          f"{t['p99']:.1f} ms, ITL p50/p99 {i['p50']:.2f}/{i['p99']:.2f} ms | while serving: {stats['compiles']} "
          f"compiles {stats['compile_s']:.2f} s, {stats['captures']} captures {stats['capture_s']:.2f} s | start-up "
          f"{start['ready_s']:.1f} s ({start['compiles']} compiles {start['compile_s']:.1f} s, {start['captures']} "
          f"captures {start['capture_s']:.1f} s)", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
