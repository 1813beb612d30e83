"""Aggregate offline throughput of 1 vs N engine replicas on Ray Serve (issue 25 target: 2 replicas
>= 1.8x one). Every request is sent at once through the ingress's RayLoop (the router, the Ray
streaming calls and the replicas; no HTTP), and output tokens / wall time is the figure, with
peak host memory: the summed RSS of this process's tree (the local Ray cluster: GCS, raylet,
workers, replicas; bench/hostmem.py) and each replica's own peak RSS.

    python -m bench.ray_replicas                                # CPU: fake engine, 20 ms a step
    python -m bench.ray_replicas --step-ms 20 --requests 128 --max-tokens 64 --max-num-seqs 16
    python -m bench.ray_replicas --real model=tiny-shape device=cpu levers.cpu_threads=1   # real engine, CPU
    python -m bench.ray_replicas --real device=cuda model=smollm2-135m   # the real engine, one GPU a replica

The fake engine (tests/fake_model.py) sleeps --step-ms in each forward, so one replica's steps
take at least that long whatever else the machine runs: the ratio measures what the replicas and
the ingress add, not how loaded the box is. Its scheduler takes --max-num-seqs rows a step, so one
replica is step-bound when --requests exceeds it. --real builds Engine(cfg) from the key=value
settings (as `python -m metrale serve`); with device=cuda each replica reserves one GPU.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from functools import partial
from pathlib import Path

from bench.hostmem import TreeMemory, peak_rss_mb

ROOT = Path(__file__).resolve().parents[1]


def fake_stepped(num_blocks: int, step_ms: float, max_num_seqs: int, cfg=None):
    """The fake engine with `max_num_seqs` rows a step, each forward sleeping step_ms (runs on the replica)."""
    if str(ROOT / "tests") not in sys.path:
        sys.path.insert(0, str(ROOT / "tests"))
    from fake_model import fake_engine
    engine = fake_engine(num_blocks=num_blocks, block_size=4, **{"scheduler.max_num_seqs": max_num_seqs})
    forward = engine.backend.forward
    engine.backend.forward = lambda *a, **k: (time.sleep(step_ms / 1e3), forward(*a, **k))[1]
    return engine


async def _offline(rs, prompts: list, max_tokens: int) -> dict:
    """Every prompt at once through the RayLoop; (output tokens, wall s, per-replica counts)."""
    from metrale import SamplingParams
    loop = rs.loop
    loop.start()
    before = [r.served for r in rs.replicas]

    async def one(k: int, prompt) -> int:
        sink: asyncio.Queue = asyncio.Queue()
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        await loop.add(f"bench-{time.monotonic_ns()}-{k}", prompt, params, sink)
        tokens = 0
        while True:
            d = await sink.get()
            tokens += len(d.token_ids)
            if d.finished:
                if d.finish_reason.startswith("error"):
                    raise RuntimeError(d.finish_reason)
                return tokens

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(k, p) for k, p in enumerate(prompts)))
    wall = time.perf_counter() - t0
    return {"tokens": sum(counts), "wall_s": wall, "tok_per_s": sum(counts) / wall,
            "per_replica": [r.served - b for r, b in zip(rs.replicas, before)]}


def run(n: int, args, overrides: list[str], build) -> dict:
    from ray import serve
    from metrale.server.replicas import ReplicaSet
    from metrale.settings import compose
    cfg = compose(overrides + [f"server.replicas={n}", f"server.replica_cpus={args.replica_cpus}",
                               "server.engine_process=false"])
    t0 = time.perf_counter()
    mem = TreeMemory().__enter__()          # this process's tree: the local cluster and its replicas
    rs = ReplicaSet.start(cfg, build)
    up = time.perf_counter() - t0
    try:
        vocab = rs.model_config.vocab_size
        # distinct prompts (no shared prefix): the router spreads them by load
        prompts = [[1 + (k * 7 + j * 13) % (vocab - 1) for j in range(args.prompt_tokens)]
                   for k in range(args.requests)]
        async def both() -> dict:
            await _offline(rs, prompts[:max(2, n * 2)], 4)                  # warm-up
            return await _offline(rs, prompts, args.max_tokens)
        out = asyncio.run(both())
        out["replica_peak_rss_mb"] = [round(peak_rss_mb(r.pid), 1) for r in rs.replicas]
    finally:
        mem.__exit__(None, None, None)
        rs.close()
        for i in range(n):
            serve.delete(f"metrale-engine-{i}")         # their CPUs / GPUs for the next run
    out.update(replicas=n, start_s=up, **mem.summary())
    print(f"[ray_replicas] {n} replica(s): {out['tok_per_s']:.0f} tok/s ({out['tokens']} tokens in "
          f"{out['wall_s']:.2f} s; requests per replica {out['per_replica']}; up in {up:.1f} s; peak RSS: "
          f"process tree {out['peak_tree_rss_mb']:.0f} MB, replicas {out['replica_peak_rss_mb']} MB, host used "
          f"+{out['peak_host_added_mb']:.0f} MB)", file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", default="1,2", help="replica counts to compare (the first is the baseline)")
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=24)
    p.add_argument("--step-ms", type=float, default=20.0, help="fake engine: sleep per forward")
    p.add_argument("--max-num-seqs", type=int, default=16, help="fake engine: rows a step")
    p.add_argument("--replica-cpus", type=float, default=0.5, help="Ray CPUs reserved per replica")
    p.add_argument("--real", action="store_true", help="the real engine from the key=value settings")
    p.add_argument("--json", help="write the results here")
    args, overrides = p.parse_known_args(argv)
    import ray
    counts = [int(x) for x in args.replicas.split(",")]
    if args.real:
        build = None
    else:
        if str(ROOT / "tests") not in sys.path:       # the fake tokenizer comes back from the replicas
            sys.path.insert(0, str(ROOT / "tests"))
        from bench.ray_replicas import fake_stepped   # by reference, not __main__'s copy
        need = max(counts) * (-(-(args.prompt_tokens + args.max_tokens + 8) // 4)) * args.max_num_seqs
        build = partial(fake_stepped, max(1024, 2 * need), args.step_ms, args.max_num_seqs)
    path = os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])
    ray.init(num_cpus=max(2, int(max(counts) * args.replica_cpus + 1)), include_dashboard=False,
             _node_ip_address="127.0.0.1", logging_level="WARNING", log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path, "OPENBLAS_NUM_THREADS": "1"}})
    try:
        results = [run(n, args, overrides, build) for n in counts]
    finally:
        from ray import serve
        serve.shutdown()
        ray.shutdown()
    base = results[0]["tok_per_s"]
    for r in results:
        r["ratio"] = r["tok_per_s"] / base
    setup = {k: v for k, v in vars(args).items() if k != "json"} | {"overrides": overrides}
    print(json.dumps({"setup": setup, "results": results}, indent=1))
    print(" | ".join(f"{r['replicas']} replica(s): {r['tok_per_s']:.0f} tok/s ({r['ratio']:.2f}x), peak tree RSS "
                     f"{r['peak_tree_rss_mb']:.0f} MB" for r in results))
    if args.json:
        Path(args.json).write_text(json.dumps({"setup": setup, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
