"""The Backend seam: everything device-specific behind one small interface.

A backend owns the weights, the paged KV pool and the activation memory, and runs one ragged
forward. The NumPy backend is both the CPU runtime and the oracle of the CUDA backend.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np

from metrale.models.config import ModelConfig
from metrale.runtime.batch import ForwardBatch


class Backend(Protocol):
    name: str
    config: ModelConfig
    block_size: int
    num_blocks: int
    supports_overlap: bool       # launch_greedy can feed a step's ids to the next (levers.overlap)

    def forward(self, batch: ForwardBatch, num_layers: int | None = None, return_hidden: bool = False):
        """Logits [R, vocab] for the rows batch.logits_indices (float32; float64 with
        levers.numpy_dtype=float64). num_layers runs only the first layers (then the final norm
        and LM head): the self-speculative drafter. return_hidden: (logits, hidden rows before
        the final norm), for MTP heads."""

    def forward_greedy(self, batch: ForwardBatch, num_layers: int | None = None) -> np.ndarray:
        """Argmax token ids [R] int32 for the rows batch.logits_indices (argmax on the device)."""

    def launch_greedy(self, batch: ForwardBatch, prev=None, token_src: np.ndarray | None = None):
        """forward_greedy queued without waiting: returns a handle whose `tokens()` gives the ids.
        token_src[t] >= 0 feeds token t from row token_src[t] of `prev` (the step launched just
        before), so the host can queue step N+1 before it reads step N (Engine, levers.overlap)."""

    def memory_report(self) -> dict:
        """Bytes used by weights, KV pool and activations; peak device memory where known."""


class ReadyTokens:
    """launch_greedy's handle for a backend that computes at once (NumPy, CPU)."""

    def __init__(self, tokens: np.ndarray) -> None:
        self._tokens = tokens

    def tokens(self) -> np.ndarray:
        return self._tokens


def feed_tokens(batch: ForwardBatch, prev, token_src: np.ndarray | None) -> None:
    """Writes the fed tokens into the batch on the host (what embedding_feed does on the device)."""
    if token_src is not None:
        fed = token_src >= 0
        batch.token_ids[fed] = prev.tokens()[token_src[fed]]
