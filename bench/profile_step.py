"""Where a decode step's time goes: host phases, graph replay on the device, GPU time per op.

    python -m bench.profile_step --model llama-3-8b-shape --batch 1 32 [--context 512]
"""
from __future__ import annotations

import argparse
import time
from collections import defaultdict

import numpy as np
from numba import cuda

from bench.decode_metrale import make_backend
from metrale.runtime import cuda_backend as cb
from metrale.runtime.batch import Segment, build_batch


SPIN_NS = 2_000_000    # longer than a few Python launches (cuBLASLt plans are made before timing)


@cuda.jit
def _spin(ns):
    t = 0
    while t < ns:
        cuda.nanosleep(1000)
        t += 1000


def med(xs) -> float:
    return float(np.median(xs)) * 1e3


def profile(backend, batch: int, context: int = 512, reps: int = 30) -> None:
    bs = backend.block_size
    per_seq = -(-(context + 8) // bs)
    tables = [np.arange(i * per_seq, (i + 1) * per_seq, dtype=np.int32) for i in range(batch)]
    segs = [Segment(np.array([5], np.int32), context, tables[i]) for i in range(batch)]
    for _ in range(3):
        backend.forward_greedy(build_batch(segs, bs))
    t_build, t_upload, t_launch, t_sync, t_total = [], [], [], [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        b = build_batch(segs, bs)
        t1 = time.perf_counter()
        g, graphed = backend._geometry(b)
        backend.meta.upload(b, g, backend.stream)
        t2 = time.perf_counter()
        backend.graphs[g].replay()
        t3 = time.perf_counter()
        backend._fetch(backend.act["argmax"], backend._argmax_host[:batch])
        t4 = time.perf_counter()
        t_build.append(t1 - t0); t_upload.append(t2 - t1); t_launch.append(t3 - t2); t_sync.append(t4 - t3)
        t_total.append(t4 - t0)
    ev0, ev1 = cuda.event(), cuda.event()
    gpu = []
    for _ in range(reps):
        ev0.record(backend.stream.numba)
        backend.graphs[g].replay()
        ev1.record(backend.stream.numba)
        ev1.synchronize()
        gpu.append(cuda.event_elapsed_time(ev0, ev1) / 1e3)
    print(f"B={batch}: total {med(t_total):.3f} ms | build {med(t_build):.3f} upload {med(t_upload):.3f} "
          f"replay-launch {med(t_launch):.3f} copy+sync {med(t_sync):.3f} | graph on GPU {med(gpu):.3f} ms "
          f"({backend.graphs[g].num_nodes} nodes)")
    # GPU time per op, eager, with events around each op. A spin kernel queued before each op
    # keeps the GPU busy while Python launches it, so the events time the device work only
    # (without it an eager op's interval is mostly the ~50 us of its host-side launch).
    per_op = defaultdict(list)
    originals = {}
    spin_stream = backend.stream.numba
    for name in ("embed", "rms_norm", "linear", "linear_residual", "qkv_to_cache", "attention", "silu_mul", "logits_rows"):
        fn = getattr(cb.CudaOps, name)
        originals[name] = fn

        def wrapped(self, *args, _fn=fn, _name=name, **kw):
            a, z = cuda.event(), cuda.event()
            _spin[1, 1, spin_stream](SPIN_NS)
            a.record(self.s)
            out = _fn(self, *args, **kw)
            z.record(self.s)
            key = _name
            if _name in ("linear", "linear_residual"):
                key = f"{_name} N={args[1].shape[0]} K={args[1].shape[1]}"
            per_op[key].append((a, z))
            return out
        setattr(cb.CudaOps, name, wrapped)
    try:
        b = build_batch(segs, bs)
        g, _ = backend._geometry(b)
        backend.meta.upload(b, g, backend.stream)
        for _ in range(3):
            per_op.clear()
            backend._run(g)
        cuda.synchronize()
    finally:
        for name, fn in originals.items():
            setattr(cb.CudaOps, name, fn)
    c = backend.config
    rows = []
    for key, evs in per_op.items():
        ms = sum(cuda.event_elapsed_time(a, z) for a, z in evs)
        rows.append((ms, key, len(evs)))
    total = sum(r[0] for r in rows)
    for ms, key, n in sorted(rows, reverse=True):
        extra = ""
        if key.startswith("linear"):
            N, K = [int(x.split("=")[1]) for x in key.split()[1:]]
            extra = f"{N * K * 2 * n / (ms / 1e3) / 1e12:.2f} TB/s weights"
        print(f"  {key:38s} x{n:3d} {ms:8.3f} ms  {ms / n * 1e3:7.1f} us each  {extra}")
    print(f"  sum of op times {total:.3f} ms")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-shape")
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--override", nargs="*", default=[])
    ap.add_argument("--context", type=int, default=512, help="tokens of context of every row")
    args = ap.parse_args()
    _, backend, _ = make_backend(args.model, max(args.batch), args.override)
    for b in args.batch:
        profile(backend, b, args.context)


if __name__ == "__main__":
    main()
