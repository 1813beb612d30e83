"""Sequence: one request's tokens, KV blocks and progress. The scheduler and block manager
mutate it; the engine reads it to build outputs."""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

import numpy as np

from metrale.sampling.params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    prompt_token_ids: list[int]
    params: SamplingParams
    request_id: str = ""
    prompt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed_tokens: int = 0       # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)
    table_row: int = -1                # its row of BlockManager.table while it holds blocks
    block_hashes: list[int] = field(default_factory=list)  # hashes of the full blocks committed so far
    finish_reason: str | None = None
    num_preemptions: int = 0
    draft_tokens: list[int] = field(default_factory=list)   # proposed for the next verify step
    draft_probs: list | None = None                          # the drafter's distributions (or None: one-hot)
    arrival: int = field(default_factory=lambda: next(_ids))

    def __post_init__(self) -> None:
        if not self.request_id:
            self.request_id = f"req-{self.arrival}"

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, stop: int) -> list[int]:
        """token_ids[start:stop] without building token_ids (prompt + output, O(length) a call):
        the step loop asks for the few tokens of each sequence's chunk every step."""
        P = len(self.prompt_token_ids)
        if start >= P:
            return self.output_token_ids[start - P:stop - P]
        if stop <= P:
            return self.prompt_token_ids[start:stop]
        return self.prompt_token_ids[start:] + self.output_token_ids[:stop - P]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def output_array(self) -> np.ndarray:
        return np.asarray(self.output_token_ids, dtype=np.int32)
