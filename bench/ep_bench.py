"""Expert parallelism on 2 GPUs (one process per GPU, NCCL through nccl4py), in phases whose
results are printed as they arrive:
  ready   each rank: its GPU, the libnccl nccl4py loaded, a smoke exchange checked (device rows
          and host ids through all_to_all_v)
  tokens  the tiny DeepSeek model generated with EP over the ranks must give, on each rank, the
          tokens of a run of that rank's prompts on its GPU alone (same steps, same batches:
          bit-equal expected)
  rates   MoE decode tok/s of a DeepSeek-V2-Lite-shaped model (random weights, cut to a few
          layers) at each batch, EP over the ranks (attention data-parallel: the batch split
          over the ranks; experts split 32 + 32), then on rank 0's GPU alone (decode graphs on)

    python -m bench.ep_bench --out docs/bench                # needs 2 GPUs and nccl4py
    python -m bench.ep_bench --dry-run                        # the same flow on CPU: processes,
                                                              # QueueCommunicator, NumPy backend
Processes: metrale.parallel.launch (spawned, CUDA_VISIBLE_DEVICES = rank, NCCL unique id made on
rank 0 and piped to the others; a failing or silent rank ends the run within seconds, its
traceback printed). --raw keeps every message as JSON, rewritten as each arrives.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

BS = 16
PROMPTS = [[3, 17, 5, 60, 9, 9, 41], list(range(20, 57)), [7, 100, 2]]
NEW = 24
CHUNK = 5


def _cfg(graphs: bool, max_seqs: int = 64, max_len: int = 512):
    from metrale.settings import compose
    return compose([f"cache.block_size={BS}", "cache.num_blocks=2048", f"scheduler.max_model_len={max_len}",
                    f"scheduler.max_num_seqs={max_seqs}", "scheduler.max_num_batched_tokens=512", "device=cuda",
                    f"levers.cuda_graphs={str(graphs).lower()}"])


def _lite_config(layers: int):
    from metrale.models import deepseek as DS
    from metrale.models.checkpoint import deepseek_model_config
    return deepseek_model_config(DS.v2_lite_hf_config(num_hidden_layers=layers))


class CudaSide:
    """This rank's GPU (launch made it device 0) and an NCCL communicator over the ranks."""

    def __init__(self, rank: int, world: int, uid: bytes, ckpt: str, layers: int):
        from numba import cuda

        from metrale.parallel import Nccl4pyCommunicator, nccl_info
        cuda.select_device(0)                       # NCCL joins the device current here
        name = cuda.get_current_device().name
        self.gpu = name.decode() if isinstance(name, bytes) else str(name)
        self.info = {"gpu": self.gpu, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"), **nccl_info()}
        self.ckpt, self.layers = ckpt, layers
        self.lite_experts = _lite_config(layers).n_routed_experts
        self.comm = Nccl4pyCommunicator.create(rank, world, uid)

    def tiny(self, ep=None):
        from metrale.models.checkpoint import load_deepseek_dir
        from metrale.runtime.cuda_backend import CudaBackend
        config, _, stream = load_deepseek_dir(Path(self.ckpt), None if ep is None else ep.expert_range)
        return CudaBackend(config, stream(), cfg=_cfg(graphs=False), ep=ep)

    def lite(self, ep=None):
        from metrale.runtime.cuda_backend import CudaBackend
        return CudaBackend(_lite_config(self.layers), None, cfg=_cfg(graphs=ep is None), ep=ep)

    def bind(self, be) -> None:
        self.comm.set_stream(None if be is None else be.stream)

    def sync(self, be) -> None:
        be.stream.synchronize()

    def free(self, be) -> None:
        be.close()

    def to_device(self, a: np.ndarray):
        from numba import cuda
        return cuda.to_device(a)

    def to_host(self, a) -> np.ndarray:
        return a.copy_to_host()

    def close(self) -> None:
        self.comm.close()


class CpuSide:
    """--dry-run: the ranks as CPU processes, a QueueCommunicator, the NumPy DeepSeek backend
    (the tiny model stands in for the V2-Lite shape)."""

    def __init__(self, rank: int, world: int, uid, ckpt: str, layers: int, boxes):
        from metrale.parallel import QueueCommunicator
        self.gpu = "cpu (dry run)"
        self.info = {"gpu": self.gpu}
        self.ckpt = ckpt
        self.lite_experts = json.loads((Path(ckpt) / "config.json").read_text())["n_routed_experts"]
        self.comm = QueueCommunicator(rank, boxes, timeout=60.0)

    def tiny(self, ep=None):
        from metrale.models import deepseek as DS
        return DS.load_deepseek_backend(Path(self.ckpt), num_blocks=512, block_size=BS, dtype="float64", ep=ep)

    lite = tiny

    def bind(self, be) -> None:
        pass

    sync = free = bind

    def to_device(self, a: np.ndarray) -> np.ndarray:
        return a

    to_host = to_device

    def close(self) -> None:
        pass


def _smoke(side, rank: int, world: int) -> None:
    """all_to_all_v of known rows (device buffers) and ids (host, counts given) between the ranks."""
    counts = [rank + d + 1 for d in range(world)]
    rows = np.concatenate([np.full((n, 3), 100 * rank + d, np.float32) for d, n in enumerate(counts)])
    got, got_counts = side.comm.all_to_all_v(side.to_device(rows), counts)
    got = side.to_host(got)
    want_counts = [s + rank + 1 for s in range(world)]
    want = np.concatenate([np.full((n, 3), 100 * s + rank, np.float32) for s, n in enumerate(want_counts)])
    ids, _ = side.comm.all_to_all_v(np.arange(sum(counts), dtype=np.int32), counts, want_counts)
    if list(got_counts) != want_counts or not np.array_equal(got, want) or ids.shape != (sum(want_counts),):
        raise RuntimeError(f"rank {rank}: smoke exchange wrong: counts {list(got_counts)} (want {want_counts}), "
                           f"rows {got[:, 0].tolist()} (want {want[:, 0].tolist()}), ids {ids.tolist()}")


def _barrier(comm) -> None:
    comm.all_to_all_v(np.zeros((comm.world_size, 1), np.int32), np.ones(comm.world_size, np.int64))


def _decode_rate(side, leader_or_backend, batch: int, steps: int, ctx: int) -> float:
    """tok/s of `steps` greedy decode steps of `batch` sequences at context ~ctx (prefilled first,
    one sequence chunk a step). An EPRank leader deals the sequences round-robin to the ranks (its
    plan; attention data-parallel); a bare backend runs them all (one GPU, decode graphs on)."""
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

    for target in seqs:                        # prefill: one sequence's chunk per step
        for a in range(0, ctx, 128):
            ids = rng.integers(0, be.config.vocab_size, min(128, ctx - a)).astype(np.int32)
            run(lambda s, a=a, ids=ids: Segment(ids, a, s["table"], "last") if s is target else None)
    pos = [ctx]

    def decode(s):
        return Segment(np.array([1], np.int32), pos[0], s["table"])

    for _ in range(3):                         # warm-up (graph capture on one GPU)
        run(decode)
        pos[0] += 1
    side.sync(be)
    t0 = time.perf_counter()
    for _ in range(steps):
        run(decode)
        pos[0] += 1
    side.sync(be)
    return batch * steps / (time.perf_counter() - t0)


def rank_main(rank: int, world: int, uid, report, side_name: str, ckpt: str, layers: int, batches: list[int],
              steps: int, ctx: int, boxes) -> None:
    """One rank of the run (launch's target): the phases of the module docstring, each reported."""
    from metrale.parallel import EPRank, ExpertParallel, FakeWorld, ep_generate
    t0 = time.time()
    side = CudaSide(rank, world, uid, ckpt, layers) if side_name == "cuda" else CpuSide(rank, world, uid, ckpt, layers, boxes)
    _smoke(side, rank, world)
    report("ready", seconds=round(time.time() - t0, 1), **side.info)
    # ---- correctness: EP over the ranks vs this rank's prompts on its device alone
    num_experts = json.loads((Path(ckpt) / "config.json").read_text())["n_routed_experts"]
    be = side.tiny(ExpertParallel(side.comm, num_experts))
    side.bind(be)
    r = EPRank(side.comm, be)
    if rank == 0:
        ep_tokens = ep_generate(r, PROMPTS, NEW, chunk=CHUNK)
    else:
        ep_tokens = None
        r.follow()
    side.bind(None)
    side.free(be)
    alone = side.tiny()
    mine = PROMPTS[rank::world]
    alone_comm = FakeWorld(1).communicators()[0]    # in this thread: its CUDA context is current here
    single = ep_generate(EPRank(alone_comm, alone), mine, NEW, chunk=CHUNK)
    side.free(alone)
    report("tokens", ep_tokens=ep_tokens, single_tokens=single, seconds=round(time.time() - t0, 1))
    # ---- throughput: the experts split over the ranks, then rank 0's device alone
    lite = side.lite(ExpertParallel(side.comm, side.lite_experts))
    side.bind(lite)
    r = EPRank(side.comm, lite)
    if rank == 0:
        for b in batches:
            report("ep_rate", batch=b, rate=_decode_rate(side, r, b, steps, ctx))
        r.stop()
    else:
        r.follow()
    side.bind(None)
    side.free(lite)
    if rank == 0:
        one = side.lite()
        for b in batches:
            report("single_rate", batch=b, rate=_decode_rate(side, one, b, steps, ctx))
        side.free(one)
    _barrier(side.comm)                         # together into the communicator's teardown
    report("closed", **_teardown(side.close, 30.0))


def _teardown(close, seconds: float) -> dict:
    """close() (NCCL's destroy waits for the peers) on a thread given `seconds`: the results are
    in, so a hung teardown is reported, not waited for (the rank then leaves with os._exit)."""
    got: dict = {}

    def body() -> None:
        try:
            close()
        except Exception as e:  # noqa: BLE001 - reported
            got["error"] = repr(e)

    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(seconds)
    return {"ok": not t.is_alive() and "error" not in got, **got, **({"hung": seconds} if t.is_alive() else {})}


def check_tokens(tokens: dict[int, dict], world: int) -> list[str]:
    """Problems: each rank's EP tokens (its prompts i = rank mod world) vs its single-device run."""
    ep = tokens.get(0, {}).get("ep_tokens")
    if ep is None:
        return ["rank 0 produced no EP tokens"]
    problems = []
    for r in range(world):
        mine = ep[r::world]
        got = tokens.get(r, {}).get("single_tokens")
        if mine != got:
            problems.append(f"rank {r}: EP {mine} != alone {got}")
    return problems


class _Printer:
    """Prints each message as it arrives (elapsed seconds first) and keeps them in --raw."""

    def __init__(self, world: int, raw: str | None):
        self.world, self.raw, self.t0 = world, raw, time.time()
        self.messages: list[dict] = []
        self.tokens: dict[int, dict] = {}
        self.token_problems: list[str] | None = None

    def __call__(self, m: dict) -> None:
        self.messages.append(m)
        at, r, phase = f"[{m['time'] - self.t0:6.1f} s] rank {m['rank']}", m["rank"], m["phase"]
        if phase == "ready":
            info = {k: v for k, v in m.items() if k not in ("rank", "phase", "time")}
            print(f"{at} ready (smoke exchange ok): {info}")
        elif phase == "tokens":
            self.tokens[r] = m
            print(f"{at} tokens after {m['seconds']} s: alone {m['single_tokens']}")
            if len(self.tokens) == self.world:
                self.token_problems = check_tokens(self.tokens, self.world)
                print("EP tokens:", self.tokens[0]["ep_tokens"])
                print("EP == single GPU:", "yes" if not self.token_problems else "NO\n" + "\n".join(self.token_problems))
        elif phase in ("ep_rate", "single_rate"):
            print(f"{at} {'EP over the ranks' if phase == 'ep_rate' else 'one device'}, batch {m['batch']}: "
                  f"{m['rate']:.1f} tok/s")
        elif phase == "closed":
            print(f"{at} communicator closed: {'ok' if m['ok'] else m}")
        elif phase == "error":
            print(f"{at} FAILED: {m['error']}\n{m['traceback']}")
        else:
            print(f"{at} {phase}")
        sys.stdout.flush()
        if self.raw:
            d = os.path.dirname(self.raw)
            if d:
                os.makedirs(d, exist_ok=True)
            with open(self.raw + ".tmp", "w") as f:
                json.dump(self.messages, f, indent=1, default=str)
            os.replace(self.raw + ".tmp", self.raw)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="records directory (docs/bench) or .json file")
    ap.add_argument("--raw", default=None, help="every rank message as JSON (rewritten as they arrive)")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4, help="V2-Lite-shaped layers (1 dense + MoE)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--ctx", type=int, default=256, help="context of the throughput sequences")
    ap.add_argument("--timeout", type=float, default=300, help="whole run, seconds")
    ap.add_argument("--stall", type=float, default=150, help="seconds without a message from any rank")
    ap.add_argument("--first", type=float, default=100, help="seconds for each rank's ready (NCCL joined)")
    ap.add_argument("--dry-run", action="store_true", help="CPU processes, QueueCommunicator, NumPy backend")
    args = ap.parse_args(argv)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")          # never NVLink multicast on shared hosts
    from metrale.models import deepseek as DS
    from metrale.parallel import launch, nccl_unique_id
    ckpt = DS.write_random_checkpoint(Path(tempfile.mkdtemp()) / "tiny", DS.tiny_cuda_deepseek_hf_config(), seed=5)
    batches = [int(b) for b in args.batches.split(",")]
    side = "cpu" if args.dry_run else "cuda"
    boxes = [mp.get_context("spawn").Queue() for _ in range(args.world)] if args.dry_run else None
    printer = _Printer(args.world, args.raw)
    print(f"ep_bench: {args.world} ranks ({side}), batches {batches}, {args.layers} layers, {args.steps} steps, "
          f"ctx {args.ctx}, timeout {args.timeout:.0f} s", flush=True)
    report = launch(args.world, rank_main, (side, str(ckpt), args.layers, batches, args.steps, args.ctx, boxes),
                    make_id=None if args.dry_run else nccl_unique_id, pin_devices=not args.dry_run,
                    timeout=args.timeout, stall=args.stall, first=args.first, on_message=printer)
    ep = {m["batch"]: m["rate"] for m in printer.messages if m["phase"] == "ep_rate"}
    single = {m["batch"]: m["rate"] for m in printer.messages if m["phase"] == "single_rate"}
    for b in batches:
        print(f"V2-Lite-shaped ({args.layers} layers) decode, batch {b}: 1 device "
              f"{single.get(b, float('nan')):.1f} tok/s, {args.world} ranks EP {ep.get(b, float('nan')):.1f} tok/s")
    if args.out and ep:
        from bench.records import make_record, write_records
        ready = report.of("ready").get(0, {})
        gpu = f"{args.world}x {ready.get('gpu', '?')}"
        cmd = "python -m bench.ep_bench " + " ".join(argv if argv is not None else sys.argv[1:])
        extra = {"layers": args.layers, "steps": args.steps, "ctx": args.ctx, "shape": "DeepSeek-V2-Lite (random weights)",
                 "ep_equals_single_gpu": printer.token_problems == [], "libnccl": ready.get("libnccl")}
        recs = [make_record("deepseek_ep", f"moe decode tok/s, EP={args.world}, batch {b}", ep[b], "tok/s",
                            None, single.get(b), "1 GPU (same code, graphs on)", gpu, cmd, extra) for b in batches if b in ep]
        print(write_records(recs, args.out, merge=True))
    if not report.ok:
        print("FAILED:\n  " + "\n  ".join(report.problems))
        return 1
    if printer.token_problems is None:
        print("FAILED: no token comparison")
        return 1
    return 0 if not printer.token_problems else 2


if __name__ == "__main__":
    sys.exit(main())
