"""What a decode step's kernels cost inside a CUDA graph, without the rest of the model.

    python -m bench.decode_floor --out docs/bench/raw/decode_floor.json

Three measurements, each a graph replayed back to back (host cost hidden), so the figures are
the device time a decode graph pays:
1. **node floor**: a chain of N tiny dependent kernels (one block, read one value, write one),
   with and without programmatic dependent launch: the per-kernel cost nothing can go under
   while a step is a chain of kernels (SmolLM2-135M's B=1 step: 214 of them).
2. **grid barrier**: one cooperative kernel (132 x 256 threads) doing N grid-wide syncs: the
   per-barrier cost a persistent (one-kernel) decode step would pay instead of a launch.
3. **decode attention sweep**: flash_decode (+ its split-K merge) on L layers of separate KV
   caches (no L2 reuse between layers, as in a real step), for batch, context, partitions,
   warps and keys; microseconds a layer and TB/s of K/V read.
"""
from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np
from numba import cuda

from kernels_numba import flash_decode
from kernels_numba.ptx import grid_trigger, grid_wait


@cuda.jit
def _tiny_pdl(buf, i):
    grid_wait()
    grid_trigger()
    if cuda.threadIdx.x == 0:
        buf[i + 1] = buf[i] + np.float32(1.0)


@cuda.jit
def _tiny(buf, i):
    if cuda.threadIdx.x == 0:
        buf[i + 1] = buf[i] + np.float32(1.0)


@cuda.jit
def _barriers(buf, n):
    g = cuda.cg.this_grid()
    for i in range(n):
        if cuda.threadIdx.x == 0 and cuda.blockIdx.x == 0:
            buf[i + 1] = buf[i] + np.float32(1.0)
        g.sync()


def _graph_us(stream, fn, reps: int = 20) -> float:
    """Capture fn's launches on stream, replay reps times back to back: mean microseconds a replay."""
    from metrale.runtime.cuda.graph import CudaGraph
    graph = CudaGraph.capture(stream, fn, warmup=1)
    graph.replay()
    stream.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        graph.replay()
    stream.synchronize()
    us = (time.perf_counter() - t0) / reps * 1e6
    graph.close()
    return us


def node_floor(stream, n: int = 200) -> dict:
    from kernels_numba import pdl
    buf = cuda.to_device(np.zeros(n + 1, np.float32))
    out = {}
    for name, kernel, use_pdl in (("plain", _tiny, False), ("pdl", _tiny_pdl, True)):
        pdl.enable(use_pdl)
        us = _graph_us(stream, lambda: [kernel[1, 32, stream.numba](buf, np.int32(i)) for i in range(n)])
        out[name] = us / n
        print(f"[floor] chain of {n} one-block kernels, {name}: {us / n:.2f} us a kernel", flush=True)
    pdl.enable(True)
    return out


def grid_barrier(stream, n: int = 1000, blocks: int = 132, threads: int = 256) -> float:
    buf = cuda.to_device(np.zeros(n + 1, np.float32))
    _barriers[blocks, threads, stream.numba](buf, np.int32(n))      # compile + warm
    stream.synchronize()
    reps = 5
    t0 = time.perf_counter()
    for _ in range(reps):
        _barriers[blocks, threads, stream.numba](buf, np.int32(n))
    stream.synchronize()
    us = (time.perf_counter() - t0) / reps * 1e6 / n
    assert float(buf.copy_to_host()[n]) == float(n), "grid barrier kernel did not run"
    print(f"[barrier] {blocks}x{threads} cooperative kernel: {us:.2f} us a grid sync", flush=True)
    return us


def attention_sweep(stream, shapes, layers: int, variants) -> list[dict]:
    rows = []
    for (name, hq, hk, hd, batch, ctx) in shapes:
        bs = 16
        per_seq = -(-(ctx + 1) // bs)
        nblk = batch * per_seq
        rng = np.random.default_rng(0)
        kc = [cuda.to_device(rng.integers(0x3C00, 0x3F00, (nblk, bs, hk, hd), dtype=np.uint16)) for _ in range(layers)]
        vc = [cuda.to_device(rng.integers(0x3C00, 0x3F00, (nblk, bs, hk, hd), dtype=np.uint16)) for _ in range(layers)]
        tables = cuda.to_device(np.arange(nblk, dtype=np.int32).reshape(batch, per_seq))
        token_seq = cuda.to_device(np.arange(batch, dtype=np.int32))
        positions = cuda.to_device(np.full(batch, ctx - 1, np.int32))
        q = cuda.to_device(rng.standard_normal((batch, hq, hd)).astype(np.float32))
        out = cuda.device_array((batch, hq, hd), np.float32)
        scratch = cuda.device_array((batch * 64, hq, hd + 2), np.float32)   # room for 64 partitions a row
        kv_bytes = 2 * batch * ctx * hk * hd * 2
        scale = 1.0 / math.sqrt(hd)
        for (parts, warps, keys) in variants:
            try:
                cfg = flash_decode.flash_decode_config(hd, hq // hk, bs, warps=warps, keys=keys)
            except ValueError:
                continue
            auto = flash_decode.flash_decode_partitions(batch, hk, ctx, cfg, scratch.shape[0])[0]

            def step():
                for layer in range(layers):
                    flash_decode.flash_decode_attention(q, kc[layer], vc[layer], tables, token_seq, positions, scale,
                                                        out, scratch=scratch, max_context=ctx, partitions=parts,
                                                        config=cfg, stream=stream.numba)
            us = _graph_us(stream, step) / layers
            tbs = kv_bytes / us / 1e6
            used = auto if parts is None else max(1, parts)
            rows.append(dict(shape=name, batch=batch, context=ctx, partitions=used, auto=parts is None, warps=warps,
                             keys=keys, us_per_layer=round(us, 2), tb_s=round(tbs, 3)))
            print(f"[attn] {name} B={batch} ctx={ctx} parts={used}{'(auto)' if parts is None else ''} "
                  f"warps={warps} keys={keys}: {us:.1f} us a layer, {tbs:.2f} TB/s", flush=True)
        del kc, vc
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--quick", action="store_true", help="fewer attention variants")
    ap.add_argument("--split", action="store_true",
                    help="only the split heuristic (auto vs 1-4 partitions) over more batches and contexts")
    ap.add_argument("--no-floor", action="store_true", help="skip the node-floor and barrier probes")
    ap.add_argument("--offline", action="store_true",
                    help="offline serving's decode shapes (SmolLM2 / 1B heads, 136-256 rows, 1,024 keys): "
                         "splits, warps and keys")
    args = ap.parse_args()
    from metrale.runtime.cuda.stream import Stream
    from kernels_numba import pdl
    pdl.enable(True)
    stream = Stream()
    record = {}
    for key, fn in (() if args.no_floor else (("node_floor", node_floor), ("grid_barrier_us", grid_barrier))):
        try:
            record[key] = fn(stream)
        except Exception as e:       # one failed probe must not lose the others
            print(f"[{key}] failed: {e!r}"[:400], flush=True)
    shapes = [("llama-3-8b", 32, 8, 128, 32, 512), ("llama-3-8b", 32, 8, 128, 1, 512),
              ("llama-3-8b", 32, 8, 128, 128, 512), ("smollm2-135m", 9, 3, 64, 1, 512)]
    variants = [(None, 4, 16), (1, 4, 16), (2, 4, 16), (4, 4, 16), (8, 4, 16), (None, 8, 16), (1, 8, 16),
                (None, 2, 16), (None, 4, 32), (1, 4, 32), (None, 4, 8)]
    if args.quick:
        variants = variants[:3]
    if args.split:
        shapes = [("llama-3-8b", 32, 8, 128, b, c) for (b, c) in ((8, 512), (16, 512), (32, 2048), (32, 4096),
                                                                   (64, 512), (4, 4096))]
        shapes.append(("smollm2-135m", 9, 3, 64, 32, 512))
        variants = [(None, 4, 16), (1, 4, 16), (2, 4, 16), (3, 4, 16), (4, 4, 16)]
    if args.offline:      # run_all's offline decode shapes (docs/performance.md, "What an offline forward is made of")
        shapes = [("smollm2-135m", 9, 3, 64, 136, 1024), ("smollm2-135m", 9, 3, 64, 256, 1024),
                  ("llama-3.2-1b", 32, 8, 64, 136, 1024)]
        variants = [(None, 4, 16), (2, 4, 16), (4, 4, 16), (None, 8, 16), (None, 4, 32), (2, 4, 32), (None, 8, 32)]
    record["attention"] = attention_sweep(stream, shapes, args.layers, variants)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
