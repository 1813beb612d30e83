"""Engine start-up as a user meets it: a fresh process per start, first with an empty kernel cache,
then again with the cache the first start left (kernels_numba/jit.py).

    python -m bench.startup --model llama-3.2-1b-shape --device cuda [--runs 2] [--json out.json]

Each start reports: seconds from process start to `Engine(...)` returning (ready), and to the
first generated token (ttft), and the peak RSS of the process.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, resource, sys, time
t0 = float(sys.argv[1])
from metrale import Engine, SamplingParams
e = Engine(model=sys.argv[2], device=sys.argv[3], levers=json.loads(sys.argv[4]))
ready = time.time() - t0
e.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), use_tqdm=False)
first = time.time() - t0
print(json.dumps({"ready_s": ready, "ttft_s": first, "load_s": e.load_seconds,
                  "compile": getattr(e.backend, "compile_stats", None),
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def run_child(child: str, args: list[str], env: dict) -> dict:
    """A fresh Python running `child` with argv [process start time, *args]; its last line's JSON."""
    t0 = time.time()
    out = subprocess.run([sys.executable, "-c", child, repr(t0), *args], env=env,
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"start failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def start_once(model: str, device: str, env: dict, levers: str = "{}") -> dict:
    return run_child(CHILD, [model, device, levers], env)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.2-1b-shape")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--levers", default="{}", help='JSON of levers, e.g. \'{"compile_workers": 0}\'')
    ap.add_argument("--json")
    a = ap.parse_args()
    cache = tempfile.mkdtemp(prefix="metrale-cache-")
    env = {**os.environ, "XDG_CACHE_HOME": cache}
    env.pop("NUMBA_CACHE_DIR", None)
    rows = []
    for i in range(a.runs):
        r = start_once(a.model, a.device, env, a.levers)
        r["start"] = "first" if i == 0 else "again"
        rows.append(r)
        print(f"startup {a.model} {a.device} {r['start']}: ready {r['ready_s']:.1f} s, first token "
              f"{r['ttft_s']:.1f} s (load {r['load_s']:.1f} s), peak RSS {r['peak_rss_mb']:.0f} MB, levers {a.levers}, "
              f"compile {r.get('compile')}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": a.model, "device": a.device, "runs": rows}, f, indent=1)


if __name__ == "__main__":
    main()
