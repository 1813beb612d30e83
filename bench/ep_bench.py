"""Expert parallelism on 2 GPUs (one process per GPU, NCCL through nccl4py): the tiny DeepSeek
model generated with EP=2 must give, on each rank, the tokens of a single-GPU run of that rank's
prompts (same steps, same batches: bit-equal expected); then MoE decode throughput of a
DeepSeek-V2-Lite-shaped model (random weights, cut to a few layers) at total batch 1 and 64 on one
GPU vs two (attention data-parallel: the batch split over the ranks; experts split 32 + 32).

    python -m bench.ep_bench --out docs/bench            # needs 2 GPUs and nccl4py
Each rank is a spawned process with CUDA_VISIBLE_DEVICES set to its GPU before CUDA starts; rank
0 makes the NCCL unique id and hands it to the other through a pipe.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path

BS = 16
PROMPTS = [[3, 17, 5, 60, 9, 9, 41], list(range(20, 57)), [7, 100, 2]]
NEW = 24
CHUNK = 5


def _cfg(graphs: bool, max_seqs: int = 64, max_len: int = 512):
    from metrale.settings import compose
    return compose([f"cache.block_size={BS}", "cache.num_blocks=2048", f"scheduler.max_model_len={max_len}",
                    f"scheduler.max_num_seqs={max_seqs}", "scheduler.max_num_batched_tokens=512", "device=cuda",
                    f"levers.cuda_graphs={str(graphs).lower()}"])


def _tiny_backend(path: str, ep=None):
    from metrale.models.loader import load_deepseek_dir
    from metrale.runtime.cuda_deepseek import DeepseekCudaBackend
    config, _, stream = load_deepseek_dir(Path(path), None if ep is None else ep.expert_range)
    return DeepseekCudaBackend(config, stream(), cfg=_cfg(graphs=False), ep=ep)


def _lite_config(layers: int):
    from metrale.models import deepseek as DS
    from metrale.models.loader import deepseek_model_config
    return deepseek_model_config(DS.v2_lite_hf_config(num_hidden_layers=layers))


def _decode_rate(leader_or_backend, batch: int, steps: int, ctx: int = 256) -> float:
    """tok/s of `steps` greedy decode steps of `batch` sequences at context ~ctx (prefilled first,
    one sequence chunk a step). An EPRank leader deals the sequences round-robin to the ranks (its
    plan; attention data-parallel); a bare backend runs them all (one GPU, decode graphs on)."""
    import numpy as np

    from metrale.parallel import Command, EPRank, StepPlan
    from metrale.runtime.batch import Segment, build_batch
    ep = isinstance(leader_or_backend, EPRank)
    be = leader_or_backend.backend if ep else leader_or_backend
    world = leader_or_backend.comm.world_size if ep else 1
    per = -(-(ctx + steps + 8) // BS)
    rng = np.random.default_rng(0)
    seqs = [{"rank": i % world, "table": np.arange(1 + (i // world) * per, 1 + (i // world + 1) * per, dtype=np.int32)}
            for i in range(batch)]

    def run(segments_of) -> None:
        work = [[] for _ in range(world)]
        for s in seqs:
            seg = segments_of(s)
            if seg is not None:
                work[s["rank"]].append(seg)
        if ep:
            leader_or_backend.lead(StepPlan(0, Command.FORWARD, work))
        else:
            be.forward_greedy(build_batch(work[0], BS))

    for i, target in enumerate(seqs):          # prefill: one sequence's chunk per step
        for a in range(0, ctx, 128):
            ids = rng.integers(0, be.config.vocab_size, min(128, ctx - a)).astype(np.int32)
            run(lambda s, a=a, ids=ids: Segment(ids, a, s["table"], "last") if s is target else None)
    pos = [ctx]

    def decode(s):
        return Segment(np.array([1], np.int32), pos[0], s["table"])

    for _ in range(3):                         # warm-up (graph capture on one GPU)
        run(decode)
        pos[0] += 1
    be.stream.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        run(decode)
        pos[0] += 1
    be.stream.synchronize()
    return batch * steps / (time.perf_counter() - t0)


def _rank_main(rank: int, world: int, uid_conn, results, ckpt: str, layers: int, batches: list[int],
               steps: int) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)     # before anything starts CUDA in this process
    result: dict = {"rank": rank}
    comm = None
    try:
        from numba import cuda

        from metrale.parallel import EPRank, ExpertParallel, Nccl4pyCommunicator, ep_generate, run_ranks
        from metrale.runtime.cuda_deepseek import DeepseekCudaBackend
        if rank == 0:
            uid = Nccl4pyCommunicator.new_unique_id()
            for _ in range(world - 1):
                uid_conn.send(uid)
        else:
            uid = uid_conn.recv()
        cuda.select_device(0)
        name = cuda.get_current_device().name
        result["gpu"] = name.decode() if isinstance(name, bytes) else str(name)
        comm = Nccl4pyCommunicator.create(rank, world, uid)
        # ---- correctness: EP over the ranks vs this GPU alone on this rank's prompts
        num_experts = json.loads((Path(ckpt) / "config.json").read_text())["n_routed_experts"]
        be = _tiny_backend(ckpt, ExpertParallel(comm, num_experts))
        comm.set_stream(be.stream)
        r = EPRank(comm, be)
        if rank == 0:
            result["ep_tokens"] = ep_generate(r, PROMPTS, NEW, chunk=CHUNK)
        else:
            r.follow()
        alone = _tiny_backend(ckpt)
        mine = PROMPTS[rank::world]
        result["single_tokens"] = run_ranks(1, lambda c: ep_generate(EPRank(c, alone), mine, NEW, chunk=CHUNK))[0]
        be.close()
        alone.close()
        # ---- throughput: V2-Lite-shaped MoE decode with the experts split over the ranks
        config = _lite_config(layers)
        lite = DeepseekCudaBackend(config, None, cfg=_cfg(graphs=False), ep=ExpertParallel(comm, config.n_routed_experts))
        comm.set_stream(lite.stream)
        r = EPRank(comm, lite)
        if rank == 0:
            result["ep_rates"] = {b: _decode_rate(r, b, steps) for b in batches}
            r.stop()
        else:
            r.follow()
        lite.close()
        if rank == 0:                               # one GPU, every expert, decode graphs on
            one = DeepseekCudaBackend(config, None, cfg=_cfg(graphs=True))
            result["single_rates"] = {b: _decode_rate(one, b, steps) for b in batches}
            one.close()
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        import traceback
        result["error"] = traceback.format_exc()
        print(f"rank {rank}: {e!r}", file=sys.stderr, flush=True)
    finally:
        results.put(result)
        if comm is not None:
            try:
                comm.close()
            except Exception:  # noqa: BLE001
                pass


def check_tokens(results: list[dict]) -> list[str]:
    """Problems: each rank's EP tokens (its prompts i = rank mod world) vs its single-GPU run."""
    world = len(results)
    ep = results[0].get("ep_tokens")
    if ep is None:
        return ["rank 0 produced no EP tokens"]
    problems = []
    for res in results:
        r = res["rank"]
        mine = ep[r::world]
        if mine != res.get("single_tokens"):
            problems.append(f"rank {r}: EP {mine} != single GPU {res.get('single_tokens')}")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="records directory (docs/bench) or .json file")
    ap.add_argument("--layers", type=int, default=4, help="V2-Lite-shaped layers (1 dense + MoE)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--timeout", type=float, default=540)
    args = ap.parse_args(argv)
    from metrale.models import deepseek as DS
    ckpt = DS.write_random_checkpoint(Path(tempfile.mkdtemp()) / "tiny", DS.tiny_cuda_deepseek_hf_config(), seed=5)
    batches = [int(b) for b in args.batches.split(",")]
    ctx = mp.get_context("spawn")
    uid_send, uid_recv = ctx.Pipe()
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, 2, uid_send if r == 0 else uid_recv, results, str(ckpt),
                                                  args.layers, batches, args.steps)) for r in range(2)]
    for p in procs:
        p.start()
    got = []
    deadline = time.time() + args.timeout
    import queue
    while len(got) < 2 and time.time() < deadline:
        try:
            got.append(results.get(timeout=5))
        except queue.Empty:
            if not any(p.is_alive() for p in procs):
                break
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
    got.sort(key=lambda r: r["rank"])
    for res in got:
        if "error" in res:
            print(f"rank {res['rank']} failed:\n{res['error']}")
    if len(got) < 2 or any("error" in r for r in got):
        print(f"FAILED: {len(got)} of 2 ranks reported")
        return 1
    problems = check_tokens(got)
    print("EP tokens:", got[0]["ep_tokens"])
    print("EP == single GPU:", "yes" if not problems else "NO\n" + "\n".join(problems))
    single, ep = got[0].get("single_rates", {}), got[0].get("ep_rates", {})
    for b in batches:
        print(f"V2-Lite-shaped ({args.layers} layers) decode, batch {b}: 1 GPU {single.get(b, 0):.1f} tok/s, "
              f"2 GPUs EP {ep.get(b, 0):.1f} tok/s")
    if args.out:
        from bench.records import make_record, write_records
        gpu = "2x " + got[0].get("gpu", "?")
        cmd = "python -m bench.ep_bench " + " ".join(argv if argv is not None else sys.argv[1:])
        recs = []
        for b in batches:
            extra = {"layers": args.layers, "steps": args.steps, "shape": "DeepSeek-V2-Lite (random weights)",
                     "ep_equals_single_gpu": not problems}
            recs.append(make_record("deepseek_ep", f"moe decode tok/s, EP=2, batch {b}", ep.get(b, 0), "tok/s",
                                    None, single.get(b), "1 GPU (same code, graphs on)", gpu, cmd, extra))
        print(write_records(recs, args.out, merge=True))
    return 0 if not problems else 2


if __name__ == "__main__":
    sys.exit(main())
