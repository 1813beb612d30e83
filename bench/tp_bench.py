"""Tensor parallelism, dense decode through Engine.generate: TP=N against TP=1 (issue 25's target:
Llama-3-8B shape on two GPUs, TP=2 >= 1.5x TP=1 at batch 1 and >= 1.6x at batch 32). One process
per rank (metrale.parallel.launch, one GPU each), results printed as each phase reports:
  single     TP=1 on the first GPU: decode tok/s at each batch (bench.harness.decode_tok_s: B prompts
             of --ctx tokens, generate(--steps) minus generate(1), greedy, EOS ignored)
  allreduce  (--allreduce, GPU) NCCL all-reduce of [T, hidden] float32 for T in the batches: eager
             (one call, stream synchronized, averaged) and inside one captured graph of 64 calls
             (a decode step's count at 32 layers), microseconds a call
  ready      each TP rank: its memory report (shards, KV pages, graphs)
  tp         rank 0: decode tok/s at each batch through its Engine over TpLeader (the others follow)
  equal      rank 0: the first greedy tokens at the smallest batch (dry run: TP=1's expected; GPU
             random presets draw each rank's shards on its device, so they are not TP=1's weights)

    python -m bench.tp_bench --dry-run                          # CPU: NumPy ranks as processes, tiny shape
    python -m bench.tp_bench --allreduce --out tp.json          # 2 GPUs (bench/device/tp_x2.sh)

The TP=1 engine runs the host a step ahead (levers.overlap); the TP leader does not (each greedy
step's ids are read before the next plan is broadcast): the ratio includes that.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time

import numpy as np

BS = 16


def _settings(args, world: int) -> list[str]:
    device = "cpu" if args.dry_run else "cuda"
    max_b = max(args.batches)
    ctx = args.ctx + args.steps + 16
    s = [f"model={args.model}", f"device={device}", f"parallel.tensor={world}", f"cache.block_size={BS}",
         f"scheduler.max_num_seqs={max_b}", f"scheduler.max_model_len={ctx}",
         f"cache.num_blocks={max_b * (-(-ctx // BS)) + 8}", f"seed={args.seed}"]
    if args.dry_run:
        s += ["levers.cpu_kernels=numpy", "levers.numpy_dtype=float32"]
    else:
        s += [f"levers.graph_batch_sizes=[{','.join(str(b) for b in sorted(set(args.batches)))}]",
              "levers.warm_mixed=false"]
    return s


def _rates(engine, args, report) -> None:
    """The first greedy tokens at the smallest batch, then decode tok/s at each batch."""
    from bench.harness import PointSpec, _params, decode_tok_s, prompts
    small = PointSpec(batch=min(args.batches), prompt_tokens=min(args.ctx, 64), tokens=4)
    outs = engine.generate(prompts(engine, small), _params(small, small.tokens), use_tqdm=False)
    report("equal_ids", ids=[o.token_ids.tolist() for o in outs])
    for b in args.batches:
        spec = PointSpec(batch=b, prompt_tokens=args.ctx, tokens=args.steps, reps=args.reps)
        t0 = time.perf_counter()
        rate = decode_tok_s(engine, spec, prompts(engine, spec))
        report("rate", batch=b, tok_s=rate, seconds=round(time.perf_counter() - t0, 1))


def _single(rank, world, uid, report, args):
    """TP=1 on this process's device (or the CPU)."""
    from metrale import Engine
    from metrale.settings import compose
    engine = Engine(cfg=compose(_settings(args, 1)))
    report("single_ready", memory=engine.backend.memory_report())
    _rates(engine, args, report)
    engine.backend.close()


def _allreduce(rank: int, world: int, uid: bytes, hidden: int, batches: list[int], report) -> None:
    """NCCL all-reduce latency on this rank's GPU: eager, then 64 calls captured in one graph."""
    from numba import cuda
    from metrale.parallel.collectives import NcclCollectives
    from metrale.runtime.cuda import CudaGraph, Stream
    cuda.select_device(0)
    coll = NcclCollectives.create(rank, world, uid)
    stream = Stream()
    for t in batches:
        buf = cuda.to_device(np.ones((t, hidden), np.float32))
        coll.all_reduce(buf, stream)
        stream.synchronize()
        t0 = time.perf_counter()
        for _ in range(100):
            coll.all_reduce(buf, stream)
        stream.synchronize()
        eager = (time.perf_counter() - t0) / 100 * 1e6
        graph = CudaGraph.capture(stream, lambda: [coll.all_reduce(buf, stream) for _ in range(64)], warmup=1)
        graph.replay()
        stream.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            graph.replay()
        stream.synchronize()
        captured = (time.perf_counter() - t0) / (20 * 64) * 1e6
        graph.close()
        report("allreduce", rows=t, bytes=t * hidden * 4, eager_us=round(eager, 2), graph_us=round(captured, 2))
    coll.close()


def _tp(rank, world, uid, report, args):
    from metrale.parallel.comm import QueueCommunicator
    from metrale.parallel.tp import tp_engine
    from metrale.settings import compose
    cfg = compose(_settings(args, world))
    if args.allreduce and not args.dry_run:
        from metrale.models.assemble import read_model
        from metrale.models.registry import resolve_model
        hidden = read_model(resolve_model(cfg.model))[0].hidden_size
        _allreduce(rank, world, args.probe_uid, hidden, args.batches, report)
    got = tp_engine(cfg, QueueCommunicator(rank, args.boxes), None if args.dry_run else uid)
    if rank:
        report("followed", steps=got)
        return
    report("ready", memory=got.backend.memory_report())
    try:
        _rates(got, args, report)
    finally:
        got.backend.close()


def _print(m: dict) -> None:
    body = {k: v for k, v in m.items() if k not in ("rank", "phase", "time", "traceback", "memory")}
    print(f"rank {m['rank']} {m['phase']}: {json.dumps(body)[:300]}", flush=True)
    if m["phase"] == "error":
        print(m.get("traceback", ""), file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    from metrale.parallel.launch import launch
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU: NumPy ranks as processes, tiny shape")
    ap.add_argument("--model", default=None, help="a preset or path (default llama-3-8b-shape; dry run tiny-shape)")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 32])
    ap.add_argument("--ctx", type=int, default=512, help="prompt tokens a sequence")
    ap.add_argument("--steps", type=int, default=64, help="greedy tokens a sequence in the timed generate")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--allreduce", action="store_true", help="GPU: time NCCL all-reduces of [T, hidden] first")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", default=None, help="records (JSON list) to this file")
    args = ap.parse_args(argv)
    args.model = args.model or ("tiny-shape" if args.dry_run else "llama-3-8b-shape")
    ctx = mp.get_context("spawn")
    args.boxes = [ctx.Queue() for _ in range(args.world)]
    kw = dict(timeout=args.timeout, on_message=_print, pin_devices=not args.dry_run)
    single = launch(1, _single, (args,), **kw)
    make_id = None
    if not args.dry_run:
        from metrale.parallel.nccl import nccl_unique_id
        make_id = nccl_unique_id
        args.probe_uid = nccl_unique_id() if args.allreduce else None   # a clique of its own for the probe
    tp = launch(args.world, _tp, (args,), make_id=make_id, **kw)
    problems = single.problems + tp.problems
    one = {m["batch"]: m for m in single.messages if m["phase"] == "rate"}
    many = {m["batch"]: m for m in tp.messages if m["phase"] == "rate" and m["rank"] == 0}
    same = (single.of("equal_ids").get(0) or {}).get("ids") == (tp.of("equal_ids").get(0) or {}).get("ids")
    probes = [{k: m[k] for k in ("rows", "bytes", "eager_us", "graph_us")} for m in tp.messages
              if m["phase"] == "allreduce" and m["rank"] == 0]
    records = []
    for b in args.batches:
        if b in one:
            peer = one[b]["tok_s"]
            value = many[b]["tok_s"] if b in many else None
            records.append({"figure": f"dense decode tok/s, TP={args.world}, batch {b}", "value": value,
                            "peer": peer, "speedup": None if value is None else value / peer,
                            "extra": {"ctx": args.ctx, "steps": args.steps, "model": args.model,
                                      "greedy_ids_equal": same if args.dry_run else None,
                                      "dry_run": args.dry_run, "allreduce": probes}})
    for r in records:
        print(json.dumps(r), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)
    if problems:
        print("\n".join(problems), file=sys.stderr)
    return 0 if not problems and (not args.dry_run or same) else 1


if __name__ == "__main__":
    raise SystemExit(main())
