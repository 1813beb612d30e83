"""What the engine hands back: a finished RequestOutput, or a StreamDelta per step."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class StreamDelta:
    request_id: str
    text: str                      # new text since the last delta (stop strings never leak)
    token_ids: np.ndarray          # int32: new tokens since the last delta
    finish_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: np.ndarray
    text: str
    token_ids: np.ndarray
    finish_reason: str
    metrics: dict = field(default_factory=dict)
    logprobs: list[dict[int, float]] | None = None        # per generated token: {id: raw logprob} (sampled + top-k)
    cumulative_logprob: float | None = None               # sum of the sampled tokens' logprobs
    prompt_logprobs: list[dict[int, float] | None] | None = None   # per prompt token (the first is None)
