"""The step plan: what rank 0 (the scheduler) tells every rank to run in one step.

Rank 0 schedules; each step it broadcasts one StepPlan, every rank runs its part (its own
segments through attention on its own KV cache, all ranks together through the expert-parallel
MoE layers) and sends its sampled token ids back to rank 0. A rank with no segments still runs
the step (idle: it serves its experts). STOP ends the followers' loop.

Wire format: one little-endian int32 array.
  [0] MAGIC  [1] VERSION  [2] step  [3] command  [4] world_size  [5] num_layers (0 = all)
  [6] S = number of segments
  then S records of 5 words: rank, start_pos, num_tokens, num_blocks, logits (0 none, 1 last, 2 all)
  then the token ids of the S segments back to back (sum of num_tokens words)
  then their block tables back to back (sum of num_blocks words)
Segments of one rank appear in that rank's batch order.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

from metrale.runtime.batch import Segment

MAGIC = 0x4D45504C     # "MEPL"
VERSION = 1
HEADER = 7
RECORD = 5
_LOGITS = {"none": 0, "last": 1, "all": 2}
_LOGITS_NAME = {v: k for k, v in _LOGITS.items()}


class Command(IntEnum):
    FORWARD = 1
    STOP = 2


@dataclass
class StepPlan:
    step: int
    command: Command
    work: list[list[Segment]] = field(default_factory=list)   # per rank
    num_layers: int = 0                                        # 0 = every layer

    @property
    def world_size(self) -> int:
        return len(self.work)


def encode_plan(plan: StepPlan) -> np.ndarray:
    records, tokens, tables = [], [], []
    for rank, segments in enumerate(plan.work):
        for s in segments:
            ids = np.asarray(s.token_ids, np.int32).reshape(-1)
            table = np.asarray(s.block_table, np.int32).reshape(-1)
            records.append([rank, s.start_pos, ids.size, table.size, _LOGITS[s.logits]])
            tokens.append(ids)
            tables.append(table)
    head = [MAGIC, VERSION, plan.step, int(plan.command), plan.world_size, plan.num_layers, len(records)]
    parts = [np.array(head, np.int32), np.array(records, np.int32).reshape(-1)] + tokens + tables
    return np.concatenate(parts).astype("<i4")


def decode_plan(words: np.ndarray) -> StepPlan:
    w = np.asarray(words, np.int32).reshape(-1)
    if w.size < HEADER or w[0] != MAGIC:
        raise ValueError("not a step plan (bad magic or too short)")
    if w[1] != VERSION:
        raise ValueError(f"step plan version {w[1]}, this build reads {VERSION}")
    step, command, world, num_layers, n = (int(x) for x in w[2:HEADER])
    rec = w[HEADER:HEADER + RECORD * n].reshape(n, RECORD)
    need = HEADER + RECORD * n + int(rec[:, 2].sum()) + int(rec[:, 3].sum())
    if w.size != need:
        raise ValueError(f"step plan of {w.size} words, its header describes {need}")
    work: list[list[Segment]] = [[] for _ in range(world)]
    tok = HEADER + RECORD * n
    tab = tok + int(rec[:, 2].sum())
    for rank, start, ntok, nblk, logits in rec:
        if not 0 <= rank < world or logits not in _LOGITS_NAME:
            raise ValueError(f"step plan segment with rank {rank} of {world}, logits code {logits}")
        work[rank].append(Segment(w[tok:tok + ntok].copy(), int(start), w[tab:tab + nblk].copy(),
                                  _LOGITS_NAME[int(logits)]))
        tok += ntok
        tab += nblk
    return StepPlan(step, Command(command), work, num_layers)
