"""Where a start's seconds go: every kernel compile or disk-cache load (kernel, seconds), the
start's phases, and the top of a cProfile, for a fresh process with an empty kernel cache and
again with the cache it left.

    python -m bench.startup_profile --model llama-3.2-1b-shape --device cuda [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile

from bench.startup import run_child

CHILD = r"""
import cProfile, io, json, pstats, sys, time
t0 = float(sys.argv[1])
from numba.cuda import dispatcher
compiles = []
_compile = dispatcher.CUDADispatcher.compile
def timed(self, sig):
    known, hits = len(self.overloads), sum(self._cache_hits.values())
    t = time.perf_counter()
    k = _compile(self, sig)
    if len(self.overloads) != known:
        hit = sum(self._cache_hits.values()) > hits
        compiles.append((self.py_func.__module__ + "." + self.py_func.__qualname__,
                         round(time.perf_counter() - t, 3), "cache" if hit else "compile"))
    return k
dispatcher.CUDADispatcher.compile = timed
prof = cProfile.Profile()
prof.enable()
t_import = time.time()
from metrale import Engine, SamplingParams
imported = time.time() - t0
e = Engine(model=sys.argv[2], device=sys.argv[3])
ready = time.time() - t0
e.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), use_tqdm=False)
first = time.time() - t0
prof.disable()
s = io.StringIO()
pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(45)
by_kernel = {}
for name, sec, how in compiles:
    n, t = by_kernel.get((name, how), (0, 0.0))
    by_kernel[(name, how)] = (n + 1, t + sec)
print(json.dumps({"imported_s": imported, "ready_s": ready, "ttft_s": first, "load_s": e.load_seconds,
                  "compile_s": sum(c[1] for c in compiles if c[2] == "compile"),
                  "cache_load_s": sum(c[1] for c in compiles if c[2] == "cache"),
                  "kernels": sorted(([k[0], k[1], n, round(t, 3)] for k, (n, t) in by_kernel.items()),
                                    key=lambda r: -r[3]),
                  "profile": s.getvalue()}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.2-1b-shape")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json")
    ap.add_argument("--profile-lines", type=int, default=60)
    a = ap.parse_args()
    env = {**os.environ, "XDG_CACHE_HOME": tempfile.mkdtemp(prefix="metrale-cache-")}
    env.pop("NUMBA_CACHE_DIR", None)
    runs = []
    for start in ("first", "again"):
        r = run_child(CHILD, [a.model, a.device], env)
        r["start"] = start
        runs.append(r)
        print(f"{start}: imported {r['imported_s']:.1f} s, ready {r['ready_s']:.1f} s, first token {r['ttft_s']:.1f} s, "
              f"load {r['load_s']:.1f} s; kernels compiled {r['compile_s']:.1f} s, loaded from cache "
              f"{r['cache_load_s']:.1f} s ({len(r['kernels'])} kernel/how pairs)")
        for name, how, n, sec in r["kernels"][:25]:
            print(f"   {sec:7.3f} s  {n:3d} x {how:7s} {name}")
        print("\n".join(r["profile"].splitlines()[:a.profile_lines]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": a.model, "device": a.device, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
