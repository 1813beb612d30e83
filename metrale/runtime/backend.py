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

    def forward(self, batch: ForwardBatch, num_layers: int | None = None, return_hidden: bool = False):
        """Logits [R, vocab] for the rows batch.logits_indices (float32; float64 with
        levers.numpy_dtype=float64). num_layers runs only the first layers (then the final norm
        and LM head): the self-speculative drafter. return_hidden: (logits, hidden rows before
        the final norm), for MTP heads."""

    def forward_greedy(self, batch: ForwardBatch, num_layers: int | None = None) -> np.ndarray:
        """Argmax token ids [R] int32 for the rows batch.logits_indices (argmax on the device)."""

    def memory_report(self) -> dict:
        """Bytes used by weights, KV pool and activations; peak device memory where known."""
