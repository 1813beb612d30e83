"""Tensor parallelism, dense decode: TP=N against TP=1 (issue 25's target: Llama-3-8B shape on two
H200s, TP=2 >= 1.5x TP=1 at batch 1 and >= 1.6x at batch 32). One process per rank
(metrale.parallel.launch), results printed as each phase reports:
  single   TP=1: rank 0's device alone, decode tok/s at each batch (bench.decode_metrale.decode_tok_s)
  ready    each TP rank: device, communicator, shard sizes
  allreduce (--allreduce, GPU) latency of an all-reduce of [T, hidden] float32 for T in the batches
  tp       rank 0: decode tok/s at each batch through TpLeader (the other ranks follow)
  equal    rank 0: greedy ids of one decode step at the smallest batch, TP=N vs TP=1 (dry run: bit-equal
           ids expected; GPU: compared, not asserted, since bf16 sums differ in order)

    python -m bench.tp_bench --dry-run                          # CPU: NumPy ranks as processes, tiny shape
    python -m bench.tp_bench --out docs/bench/tp.json           # 2 GPUs: needs the CUDA TP backend

SKELETON on GPU: the CUDA side of tensor parallelism is not built yet (docs/parallel.md, "The
CUDA side"). `_cuda_tp_backend` and `_nccl_all_reduce` say where it plugs in; until then the GPU
run measures TP=1 and reports the TP phases as missing instead of failing.
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
    model = args.model
    max_b = max(args.batches)
    s = [f"model={model}", f"device={device}", f"parallel.tensor={world}", f"cache.block_size={BS}",
         f"scheduler.max_num_seqs={max_b}", f"scheduler.max_model_len={args.ctx + 64}",
         f"cache.num_blocks={max_b * (-(-(args.ctx + 64) // BS)) + 8}", f"seed={args.seed}"]
    if args.dry_run:
        s += ["levers.cpu_kernels=numpy", "levers.numpy_dtype=float32"]
    else:
        s += [f"levers.graph_batch_sizes=[{','.join(str(b) for b in sorted(set(args.batches)))}]",
              "levers.warm_mixed=false"]
    return s


def _one_step_ids(backend, batch: int, ctx: int) -> list[int]:
    """Greedy ids of a prefill of `ctx` tokens for `batch` sequences, then one decode step."""
    from metrale.runtime.batch import Segment, build_batch
    per = -(-(ctx + 2) // BS)
    rng = np.random.default_rng(1)
    tables = [np.arange(i * per, (i + 1) * per, dtype=np.int32) for i in range(batch)]
    prompts = [rng.integers(0, backend.config.vocab_size, ctx).astype(np.int32) for _ in range(batch)]
    first = backend.forward_greedy(build_batch([Segment(p, 0, t) for p, t in zip(prompts, tables)], BS))
    segs = [Segment(np.array([first[i]], np.int32), ctx, tables[i]) for i in range(batch)]
    return backend.forward_greedy(build_batch(segs, BS)).tolist()


# ------------------------------------------------------------------------------ the CUDA hooks

def _cuda_tp_backend(cfg, comm):
    """The rank's CUDA backend on TensorParallel.local_config with hf_shard_stream weights and a
    TP CudaOps mixin (docs/parallel.md). Not built yet."""
    raise NotImplementedError("the CUDA tensor-parallel backend (docs/parallel.md, 'The CUDA side')")


def _nccl_all_reduce(comm, buf, stream) -> None:
    """ncclAllReduce(sum) in place on the backend's stream, no host sync. Not in Nccl4pyCommunicator yet."""
    raise NotImplementedError("Nccl4pyCommunicator.all_reduce (docs/parallel.md, 'Communicator')")


# ------------------------------------------------------------------------------ rank targets

def _single(rank, world, uid, report, args):
    """TP=1 on this process's device (or the CPU)."""
    from bench.decode_metrale import decode_tok_s
    from metrale.models.assemble import make_backend
    from metrale.models.checkpoint import random_model_config, random_weights
    from metrale.models.registry import resolve_model
    from metrale.settings import compose
    cfg = compose(_settings(args, 1))
    source = resolve_model(cfg.model)
    config = random_model_config(source.preset, source.name)
    if args.dry_run:
        from metrale.runtime.numpy_backend import NumpyBackend
        backend = NumpyBackend(config, random_weights(config, args.seed), num_blocks=int(cfg.cache.num_blocks),
                               block_size=BS, dtype="float32")
    else:
        backend = make_backend("cuda", cfg, config, None)
    report("single_ready", memory=backend.memory_report())
    report("equal_ids", ids=_one_step_ids(backend, min(args.batches), min(args.ctx, 64)))
    for b in args.batches:
        report("single_rate", **decode_tok_s(backend, b, args.ctx, steps=args.steps))


def _tp(rank, world, uid, report, args):
    from bench.decode_metrale import decode_tok_s
    from metrale.parallel.tp import TpLeader, TPRank, load_rank
    from metrale.settings import compose
    cfg = compose(_settings(args, world))
    if args.dry_run:
        from metrale.parallel.comm import QueueCommunicator
        comm = QueueCommunicator(rank, args.boxes)
        _, _, tp_rank = load_rank(cfg, comm)
    else:
        from numba import cuda
        from metrale.parallel import Nccl4pyCommunicator
        cuda.select_device(0)
        comm = Nccl4pyCommunicator.create(rank, world, uid)
        report("ready", device=cuda.get_current_device().name.decode())
        if args.allreduce:
            try:
                for t in args.batches:
                    buf = cuda.device_array((t, 4096), np.float32)
                    _nccl_all_reduce(comm, buf, 0)
                    cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(100):
                        _nccl_all_reduce(comm, buf, 0)
                    cuda.synchronize()
                    report("allreduce", rows=t, us=(time.perf_counter() - t0) / 100 * 1e6)
            except NotImplementedError as e:
                report("allreduce_missing", why=str(e))
        try:
            tp_rank = TPRank(comm, _cuda_tp_backend(cfg, comm))
        except NotImplementedError as e:
            report("tp_missing", why=str(e))
            return
    report("ready", memory=tp_rank.backend.memory_report())
    if rank:
        report("followed", steps=tp_rank.follow())
        return
    leader = TpLeader(tp_rank)
    try:
        report("equal_ids", ids=_one_step_ids(leader, min(args.batches), min(args.ctx, 64)))
        for b in args.batches:
            report("tp_rate", **decode_tok_s(leader, b, args.ctx, steps=args.steps))
    finally:
        leader.close()


def _print(m: dict) -> None:
    body = {k: v for k, v in m.items() if k not in ("rank", "phase", "time", "traceback", "memory")}
    print(f"rank {m['rank']} {m['phase']}: {json.dumps(body)[:300]}", flush=True)
    if m["phase"] == "error":
        print(m.get("traceback", ""), file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    from metrale.parallel.launch import launch
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU: NumPy ranks as processes, tiny shape")
    ap.add_argument("--model", default=None, help="a random preset (default llama-3-8b-shape; dry run tiny-shape)")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 32])
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--allreduce", action="store_true", help="GPU: time NCCL all-reduces of [T, 4096]")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", default=None, help="records (JSON list) to this file")
    args = ap.parse_args(argv)
    args.model = args.model or ("tiny-shape" if args.dry_run else "llama-3-8b-shape")
    args.boxes = [mp.get_context("spawn").Queue() for _ in range(args.world)] if args.dry_run else None
    kw = dict(timeout=args.timeout, on_message=_print, pin_devices=not args.dry_run)
    single = launch(1, _single, (args,), **kw)
    from metrale.parallel.nccl import nccl_unique_id
    tp = launch(args.world, _tp, (args,), make_id=None if args.dry_run else nccl_unique_id, **kw)
    problems = single.problems + tp.problems
    one = {m["batch"]: m for m in single.messages if m["phase"] == "single_rate"}
    many = {m["batch"]: m for m in tp.messages if m["phase"] == "tp_rate" and m["rank"] == 0}
    same = (single.of("equal_ids").get(0) or {}).get("ids") == (tp.of("equal_ids").get(0) or {}).get("ids")
    records = []
    for b in args.batches:
        if b in one:
            peer = one[b]["tok_s"]
            value = many[b]["tok_s"] if b in many else None
            records.append({"figure": f"dense decode tok/s, TP={args.world}, batch {b}", "value": value,
                            "peer": peer, "speedup": None if value is None else value / peer,
                            "extra": {"ctx": args.ctx, "model": args.model, "greedy_ids_equal": same,
                                      "dry_run": args.dry_run, "tp_missing": bool(tp.of("tp_missing"))}})
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
