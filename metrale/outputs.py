"""What the engine hands back: a finished RequestOutput, or a StreamDelta per step.

A request with n > 1 (or best_of > 1) runs one sequence per candidate. Its RequestOutput holds the
n returned completions in `outputs` (each a RequestOutput with its `index`) and mirrors the first
of them in its own text / token_ids / finish_reason / logprobs; for n == 1, `outputs == [itself]`.
Its StreamDeltas carry the request's id and the `index` of the completion they extend.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class StreamDelta:
    request_id: str
    text: str                      # new text since the last delta (stop strings never leak)
    token_ids: np.ndarray          # int32: new tokens since the last delta
    finish_reason: str | None = None   # set on the last delta of this completion
    index: int = 0                 # which completion of the request (0 .. n-1)
    logprobs: list[dict[int, float]] | None = None   # per new token: {id: logprob} (sampled + top-k), if asked
    stop_reason: int | str | None = None    # on a 'stop' finish: the stop string or stop token id (EOS: None)

    @property
    def finished(self) -> bool:
        """This completion ended (a request with n > 1 ends when all n have)."""
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
    index: int = 0                                        # position in the request's `outputs`
    stop_reason: int | str | None = None                  # the stop string or stop token id that ended it (EOS: None)
    # the n completions, in order (for n == 1: [self]); the fields above mirror outputs[0]
    outputs: list[RequestOutput] = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.outputs = [self]


def error_reason(exc: BaseException) -> str:
    """The finish reason of a request that a failure ended: 'error: <type>: <message>'."""
    return f"error: {type(exc).__name__}: {exc}"
