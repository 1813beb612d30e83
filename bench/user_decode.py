"""What a user gets from `Engine.generate` decode, beside the same step's graph replay, in one run.

    python -m bench.user_decode --model smollm2-135m-shape --batch 1 32 [--tokens 256] [--json out.json]

For each batch B: B random prompts of 16 tokens, greedy, EOS ignored. Decode tok/s =
B x (tokens - 1) / (time of generate(max_tokens=tokens) - time of generate(max_tokens=1)), so
the prefill and first token drop out; measured with the loop a step ahead (levers.overlap) and
with the synchronous loop on the same engine, best of --reps. Graph replay: back-to-back replays
of the decode graph of that batch at the run's mean context (bench.profile_graph.replay_us).
Peak host RSS and device memory are reported beside the figures.
"""
from __future__ import annotations

import argparse
import json
import resource

import numpy as np


def user_tok_s(engine, batch: int, tokens: int, reps: int, **sampling) -> float:
    from bench.harness import PointSpec, decode_tok_s, prompts
    spec = PointSpec(batch=batch, prompt_tokens=16, tokens=tokens, reps=reps, **sampling)
    return decode_tok_s(engine, spec, prompts(engine, spec))


def replay_tok_s(engine, batch: int, context: int) -> float:
    from bench.profile_graph import replay_us
    from metrale.runtime.batch import Segment, build_batch
    backend = engine.backend
    bs = backend.block_size
    per_seq = -(-(context + 8) // bs)
    segs = [Segment(np.array([5], np.int32), context, np.arange(i * per_seq, (i + 1) * per_seq, dtype=np.int32))
            for i in range(batch)]
    b = build_batch(segs, bs)
    backend.forward_greedy(b)
    g, graphed = backend._geometry(b)
    assert graphed and g in backend.graphs, "this step does not run as a CUDA graph"
    backend.meta.upload(b, g, backend.stream)
    backend.stream.synchronize()
    return batch / replay_us(backend.graphs[g], backend.stream, reps=100) * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-shape")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--device", default="cuda")
    p.add_argument("--json")
    p.add_argument("--sampled", action="store_true",
                   help="also temperature 0.7 + top_p 0.9 (device-only rows) and a repetition penalty")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    from metrale import Engine
    from metrale.overlap import AheadLoop
    top = max(args.batch)
    engine = Engine(model=args.model, device=args.device, overrides=[
        f"scheduler.max_num_seqs={top}", f"levers.graph_batch_sizes=[{','.join(str(b) for b in sorted(set(args.batch)))}]",
        *args.overrides])
    out = []
    for batch in args.batch:
        ahead = engine.ahead if engine.ahead is not None else (
            AheadLoop(engine) if engine.backend.supports_overlap else None)   # a family without it: sync only
        engine.ahead = None
        sync = user_tok_s(engine, batch, args.tokens, args.reps)
        engine.ahead = ahead
        over = user_tok_s(engine, batch, args.tokens, args.reps) if ahead is not None else sync
        replay = replay_tok_s(engine, batch, 16 + args.tokens // 2) if engine.backend.name == "cuda" else float("nan")
        mem = engine.memory_report()
        r = {"model": args.model, "batch": batch, "tokens": args.tokens, "replay_tok_s": replay,
             "generate_sync_tok_s": sync, "generate_ahead_tok_s": over, "ahead_over_replay": over / replay,
             "sync_over_replay": sync / replay, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
             "device_used_gb": mem.get("device_used_bytes", 0) / 2**30}
        if args.sampled:
            r["sampled_tok_s"] = user_tok_s(engine, batch, args.tokens, args.reps, temperature=0.7, top_p=0.9)
            r["penalized_tok_s"] = user_tok_s(engine, batch, args.tokens, args.reps, temperature=0.7,
                                              repetition_penalty=1.1)
            print(f"user_decode {args.model} B={batch}: sampled (T 0.7, top_p 0.9) {r['sampled_tok_s']:,.0f} tok/s "
                  f"({r['sampled_tok_s'] / over:.3f} of greedy) | with a repetition penalty "
                  f"{r['penalized_tok_s']:,.0f} ({r['penalized_tok_s'] / over:.3f})", flush=True)
        out.append(r)
        print(f"user_decode {args.model} B={batch}: graph replay {replay:,.0f} tok/s | generate ahead {over:,.0f} "
              f"({r['ahead_over_replay']:.3f} of replay) | synchronous {sync:,.0f} ({r['sync_over_replay']:.3f}) | "
              f"peak RSS {r['peak_rss_mb']:.0f} MB, device {r['device_used_gb']:.1f} GB", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
