"""Decode throughput of a hybrid (Gated DeltaNet + attention) model on the CUDA backend, with its
bandwidth bound, as bench/records.py records.

    PYTHONPATH=/tmp/site:$PWD python -m bench.hybrid_bench --model qwen3-next-1b-shape --batch 1 32 \
        --out docs/bench

B sequences decode greedily from `context` (512) tokens, through the engine's path (CUDA graphs
for decode steps). The KV of the context is whatever the cache holds and the recurrent states
are zeros marked as holding `context` tokens: the bytes a step moves do not depend on the
values. Bound per step: weights (bf16, read once) + KV of the attention layers (bf16, B x
context) + recurrent state (f32 conv + SSM of every GDN layer, read and written: 2 x B x
state_bytes_per_slot), over 4.25 TB/s (the H200's measured copy rate).
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from bench.records import make_record, write_records
from metrale.runtime.batch import Segment, build_batch

COPY_BYTES_S = 4.25e12


def make_backend(model: str, max_batch: int, overrides: list[str] = ()):
    from metrale.models.assemble import load_model
    from metrale.settings import compose
    cfg = compose([f"model={model}", "device=cuda", f"scheduler.max_num_seqs={max(max_batch, 1)}",
                   "scheduler.max_num_batched_tokens=4096", "scheduler.max_model_len=8192",
                   "levers.prefix_caching=false", *overrides])
    t0 = time.perf_counter()
    config, _, backend = load_model(cfg)
    return config, backend, time.perf_counter() - t0


def step_bytes(config, batch: int, context: int) -> dict:
    weights = config.num_parameters() * 2
    kv = batch * context * config.kv_bytes_per_token(2)
    state = 2 * batch * config.state_bytes_per_slot(4)
    return {"weight_bytes": weights, "kv_bytes": kv, "state_bytes": state, "bytes_per_step": weights + kv + state}


def decode(backend, batch: int, context: int = 512, steps: int = 32, warmup: int = 3) -> dict:
    bs, states = backend.block_size, backend.states
    per_seq = -(-(context + steps + warmup + 1) // bs)
    if batch * per_seq > backend.num_blocks or batch > states.num_slots:
        raise ValueError("KV pool or state slots too small for this benchmark")
    tables = [np.arange(i * per_seq, (i + 1) * per_seq, dtype=np.int32) for i in range(batch)]
    tokens = np.random.default_rng(0).integers(0, backend.config.vocab_size, batch).astype(np.int32)
    states.tokens[:batch] = context          # zero states standing for `context` prefilled tokens

    def step(pos: int):
        segs = [Segment(np.array([tokens[i]], np.int32), pos, tables[i], state_slot=i) for i in range(batch)]
        return backend.forward_greedy(build_batch(segs, bs))

    for w in range(warmup):
        step(context + w)
    times = []
    for s in range(steps):
        t0 = time.perf_counter()
        step(context + warmup + s)
        times.append(time.perf_counter() - t0)
    med = float(np.median(times))
    b = step_bytes(backend.config, batch, context + warmup + steps // 2)
    return {"batch": batch, "context": context, "step_ms": med * 1e3, "tok_s": batch / med,
            "limit_tok_s": batch * COPY_BYTES_S / b["bytes_per_step"], **b}


def gpu_name() -> str:
    from numba import cuda
    name = cuda.get_current_device().name
    return name.decode() if isinstance(name, bytes) else str(name)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-next-1b-shape")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--out", default="", help="write records here (a directory, or a .json file)")
    ap.add_argument("--override", nargs="*", default=[])
    args = ap.parse_args()
    config, backend, load_s = make_backend(args.model, max(args.batch), args.override)
    print(f"{args.model}: {config.num_parameters() / 1e9:.2f} B parameters, {config.num_state_layers} GDN + "
          f"{config.num_kv_layers} attention layers, state {config.state_bytes_per_slot(4) / 2**20:.1f} MiB a "
          f"sequence; loaded in {load_s:.1f} s")
    gpu, command = gpu_name(), "python -m bench.hybrid_bench " + " ".join(sys.argv[1:])
    records = []
    for b in args.batch:
        r = decode(backend, b, args.context, args.steps)
        print(f"decode B={b:3d} ctx={args.context}: {r['step_ms']:.3f} ms/step {r['tok_s']:.0f} tok/s, bound "
              f"{r['limit_tok_s']:.0f} tok/s ({r['tok_s'] / r['limit_tok_s']:.0%}); bytes/step: weights "
              f"{r['weight_bytes'] / 1e9:.2f} GB, KV {r['kv_bytes'] / 1e6:.1f} MB, state {r['state_bytes'] / 1e6:.1f} MB")
        records.append(make_record("hybrid_decode", f"{args.model} decode B={b} ctx={args.context}", r["tok_s"],
                                   "tok/s", r["limit_tok_s"], None, None, gpu, command,
                                   extra={k: v for k, v in r.items() if k != "tok_s"}))
    if args.out:
        print("wrote", write_records(records, args.out, merge=True))


if __name__ == "__main__":
    main()
