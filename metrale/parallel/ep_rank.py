"""Rank 0 leads, the others follow: one StepPlan broadcast per step, every rank runs its share,
the sampled ids come back to rank 0 (only token ids travel; logits stay on their rank).

EPRank wraps one rank's Communicator and backend (an MoE family's, built with ExpertParallel).
Per step, every rank enters the same collectives in the same order: broadcast(plan), the MoE layers'
all-to-alls (through forward or idle_step), gather(token ids). ep_generate is a minimal greedy
leader (chunked prefill + decode, sequences dealt round-robin to ranks, attention data-parallel:
each rank's sequences live in its own latent cache) used by the tests and the two-GPU run.
"""
from __future__ import annotations

import numpy as np

from metrale.parallel.comm import Communicator, broadcast, gather
from metrale.parallel.plan import Command, StepPlan, decode_plan, encode_plan
from metrale.runtime.batch import Segment, build_batch


class EPRank:
    def __init__(self, comm: Communicator, backend):
        self.comm, self.backend = comm, backend
        self.steps = 0

    def execute(self, plan: StepPlan) -> np.ndarray:
        """This rank's part of a step: greedy token ids of its logits rows (int32)."""
        self.steps += 1
        layers = plan.num_layers or None
        segments = plan.work[self.comm.rank] if self.comm.rank < plan.world_size else []
        if not segments:
            self.backend.idle_step(layers)
            return np.zeros(0, np.int32)
        return self.backend.forward_greedy(build_batch(segments, self.backend.block_size), layers).astype(np.int32)

    def lead(self, plan: StepPlan) -> list[np.ndarray]:
        """Rank 0: broadcast the plan, run it, collect every rank's token ids (by rank)."""
        if plan.world_size != self.comm.world_size:
            raise ValueError(f"plan for {plan.world_size} ranks, the world has {self.comm.world_size}")
        broadcast(self.comm, encode_plan(plan))
        if plan.command == Command.STOP:
            return []
        return gather(self.comm, self.execute(plan))

    def stop(self) -> None:
        self.lead(StepPlan(self.steps, Command.STOP, [[] for _ in range(self.comm.world_size)]))

    def follow(self) -> int:
        """Ranks > 0: run plans until STOP; returns the number of steps run."""
        while True:
            plan = decode_plan(broadcast(self.comm, None))
            if plan.command == Command.STOP:
                return self.steps
            gather(self.comm, self.execute(plan))


def ep_generate(leader: EPRank, prompts: list[list[int]], max_new_tokens: int,
                chunk: int | None = None, stop: bool = True) -> list[list[int]]:
    """Greedy generation led by rank 0: prompt i runs on rank i % world in prefill chunks of
    `chunk` tokens (None = whole prompt), then one decode token per step."""
    world, bs = leader.comm.world_size, leader.backend.block_size
    next_block = [0] * world
    seqs = []
    for i, p in enumerate(prompts):
        rank = i % world
        nb = -(-(len(p) + max_new_tokens) // bs)
        seqs.append({"rank": rank, "prompt": list(p), "pos": 0, "out": [],
                     "table": np.arange(next_block[rank], next_block[rank] + nb, dtype=np.int32)})
        next_block[rank] += nb
    if max(next_block) > leader.backend.num_blocks:
        raise ValueError(f"the prompts need {max(next_block)} blocks on one rank, a rank has {leader.backend.num_blocks}")
    step = 0
    while any(len(s["out"]) < max_new_tokens for s in seqs):
        work: list[list[Segment]] = [[] for _ in range(world)]
        owners: list[list[dict]] = [[] for _ in range(world)]
        for s in seqs:
            if len(s["out"]) >= max_new_tokens:
                continue
            n_prompt = len(s["prompt"])
            if s["pos"] < n_prompt:
                n = min(chunk or n_prompt, n_prompt - s["pos"])
                ids = s["prompt"][s["pos"]:s["pos"] + n]
                seg = Segment(np.array(ids, np.int32), s["pos"], s["table"], "last" if s["pos"] + n == n_prompt else "none")
            else:
                seg = Segment(np.array(s["out"][-1:], np.int32), n_prompt + len(s["out"]) - 1, s["table"])
            work[s["rank"]].append(seg)
            owners[s["rank"]].append(s)
        results = leader.lead(StepPlan(step, Command.FORWARD, work))
        for rank in range(world):
            got = iter(results[rank].tolist())
            for s, seg in zip(owners[rank], work[rank]):
                s["pos"] += len(seg.token_ids) if s["pos"] < len(s["prompt"]) else 0
                if seg.logits != "none":
                    s["out"].append(next(got))
        step += 1
    if stop:
        leader.stop()
    return [s["out"] for s in seqs]
