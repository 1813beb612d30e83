"""metrale decode/prefill throughput driven at the backend level (no scheduler in the timing).

    python -m bench.decode_metrale --model llama-3-8b-shape --batch 1 32 --context 512

Decode: B sequences with `context` tokens of KV each (already in the cache), greedy steps
through the same path the engine uses (CUDA graphs for decode-only steps).
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from metrale.runtime.batch import Segment, build_batch


def make_backend(model: str, max_batch: int, overrides: list[str] = ()):
    from metrale.models.assemble import load_model
    from metrale.settings import compose
    cfg = compose([f"model={model}", "device=cuda", f"scheduler.max_num_seqs={max(max_batch, 1)}",
                   "scheduler.max_num_batched_tokens=4096", "scheduler.max_model_len=8192", *overrides])
    t0 = time.perf_counter()
    config, tok, backend = load_model(cfg)
    return config, backend, time.perf_counter() - t0


def decode_tok_s(backend, batch: int, context: int = 512, steps: int = 32, warmup: int = 3) -> dict:
    bs = backend.block_size
    per_seq = -(-(context + steps + warmup + 1) // bs)
    if batch * per_seq > backend.num_blocks:
        raise ValueError("KV pool too small for this benchmark")
    tables = [np.arange(i * per_seq, (i + 1) * per_seq, dtype=np.int32) for i in range(batch)]
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, backend.config.vocab_size, batch).astype(np.int32)

    def step(pos: int):
        segs = [Segment(np.array([tokens[i]], np.int32), pos, tables[i]) for i in range(batch)]
        return backend.forward_greedy(build_batch(segs, bs))

    for w in range(warmup):
        step(context + w)
    times = []
    pos = context + warmup
    for s in range(steps):
        t0 = time.perf_counter()
        step(pos + s)
        times.append(time.perf_counter() - t0)
    med = float(np.median(times))
    c = backend.config
    weight_bytes = c.num_parameters() * 2
    kv_bytes = batch * (context + warmup + steps // 2) * c.kv_bytes_per_token(2)
    return {"batch": batch, "context": context, "step_ms": med * 1e3, "tok_s": batch / med,
            "bytes_per_step": weight_bytes + kv_bytes}


def prefill_tok_s(backend, tokens: int = 4096, reps: int = 3) -> dict:
    bs = backend.block_size
    table = np.arange(-(-tokens // bs), dtype=np.int32)
    ids = np.random.default_rng(1).integers(0, backend.config.vocab_size, tokens).astype(np.int32)
    chunk = backend.max_tokens
    def run():
        for a in range(0, tokens, chunk):
            b = min(tokens, a + chunk)
            backend.forward_greedy(build_batch([Segment(ids[a:b], a, table, "last")], bs))
    run()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    med = float(np.median(times))
    c = backend.config
    flops = 2 * c.num_parameters() * tokens + 2 * 2 * c.num_layers * c.num_heads * c.head_dim * tokens * tokens / 2
    return {"tokens": tokens, "seconds": med, "tok_s": tokens / med, "tflops": flops / med / 1e12}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-shape")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--prefill", type=int, default=0)
    ap.add_argument("--override", nargs="*", default=[])
    args = ap.parse_args()
    config, backend, load_s = make_backend(args.model, max(args.batch), args.override)
    print(f"{args.model}: loaded in {load_s:.1f} s, kv tokens {backend.num_blocks * backend.block_size}")
    results = []
    for b in args.batch:
        r = decode_tok_s(backend, b, args.context)
        results.append(r)
        print(f"decode B={b:4d} ctx={args.context}: {r['step_ms']:.3f} ms/step {r['tok_s']:.0f} tok/s "
              f"{r['bytes_per_step'] / (r['step_ms'] / 1e3) / 1e12:.2f} TB/s effective")
    if args.prefill:
        r = prefill_tok_s(backend, args.prefill)
        results.append(r)
        print(f"prefill {args.prefill}: {r['tok_s']:.0f} tok/s, {r['tflops']:.1f} TFLOP/s")
    print(json.dumps({"model": args.model, "results": results, "memory": backend.memory_report()}))


if __name__ == "__main__":
    main()
