"""The Backend seam: every capability the engine, the scheduler loop, sampling and the drafters
use, declared here, so callers read members instead of probing with getattr/hasattr.

A backend owns the weights, the caches of its model family (metrale.models.families) and the
activation memory, and runs one ragged forward. The NumPy backend is both the CPU runtime and the
oracle of the CUDA backend. Backends (and test doubles) subclass this Protocol to inherit the
defaults below, which are the honest values for a backend that computes on the host at once.
"""
from __future__ import annotations

from typing import Any, Iterator, Protocol

import numpy as np

from metrale.models.config import ModelConfig
from metrale.models.families import Family
from metrale.runtime.batch import ForwardBatch


class Backend(Protocol):
    name: str                    # "cpu" | "cuda" (tests: "fake")
    config: ModelConfig
    family: Family               # config's model family (metrale.models.families)
    block_size: int
    num_blocks: int
    weights: dict                # canonical name -> array (host arrays on the CPU, device arrays on CUDA)
    dtype: np.dtype = np.dtype(np.float32)   # float dtype of the logits and hidden rows it returns
    states: Any = None           # hybrid models: the recurrent-state pool (cache.state_slots.StateStore)
    max_rows: int | None = None  # logits rows one step can return (None: no limit)
    max_tokens: int | None = None   # tokens one step can take (None: no limit)
    stream: Any = None           # CUDA: the stream its work is queued on (device sampling joins it)
    supports_overlap: bool = False   # launch_greedy can feed a step's ids to the next (levers.overlap)

    def forward(self, batch: ForwardBatch, num_layers: int | None = None, return_hidden: bool = False):
        """Logits [R, vocab] for the rows batch.logits_indices (float32; float64 with
        levers.numpy_dtype=float64). num_layers runs only the first layers (then the final norm
        and LM head): the self-speculative drafter. return_hidden: (logits, hidden rows before
        the final norm), for MTP heads."""

    def forward_greedy(self, batch: ForwardBatch, num_layers: int | None = None) -> np.ndarray:
        """Argmax token ids [R] int32 for the rows batch.logits_indices (argmax on the device)."""
        return np.argmax(self.forward(batch, num_layers), axis=-1).astype(np.int32)

    def forward_greedy_hidden(self, batch: ForwardBatch) -> tuple[np.ndarray, np.ndarray]:
        """forward_greedy plus the hidden rows before the final norm (an MTP drafter's input)."""
        logits, hidden = self.forward(batch, None, return_hidden=True)
        return np.argmax(logits, axis=-1).astype(np.int32), np.asarray(hidden)

    def forward_device(self, batch: ForwardBatch, num_layers: int | None = None):
        """The logits where the backend computed them (device memory on CUDA, valid until the next
        step); the host's own array here."""
        return self.forward(batch, num_layers)

    def hidden_rows(self, rows: int) -> np.ndarray:
        """The last forward's first `rows` hidden rows before the final norm, on the host."""
        raise NotImplementedError(f"{type(self).__name__} keeps no hidden rows")

    def launch_greedy(self, batch: ForwardBatch, prev=None, token_src: np.ndarray | None = None):
        """forward_greedy queued without waiting: returns a handle whose `tokens()` gives the ids.
        token_src[t] >= 0 feeds token t from row token_src[t] of `prev` (the step launched just
        before), so the host can queue step N+1 before it reads step N (Engine, levers.overlap)."""
        feed_tokens(batch, prev, token_src)
        return ReadyTokens(self.forward_greedy(batch))

    def launch_logits(self, batch: ForwardBatch, prev=None, token_src: np.ndarray | None = None):
        """forward_device with fed tokens (as launch_greedy's), queued without waiting: the logits a
        device sampling step reads next (metrale/overlap.py runs sampled rows ahead this way)."""
        feed_tokens(batch, prev, token_src)
        return self.forward_device(batch)

    feed_buffer = None   # the device array launch_greedy / launch_logits feed tokens from (CUDA: the argmax rows)

    def idle_step(self, num_layers: int | None = None) -> None:
        """An expert-parallel rank without tokens this step serves its experts to the others
        (every rank enters each MoE layer's collectives); nothing to do without expert parallelism."""

    def kv_tokens_that_fit(self, utilization: float = 0.9) -> int:
        """KV tokens the cache would hold at this memory utilization (the host: what it holds)."""
        return self.num_blocks * self.block_size

    def export_weights(self) -> Iterator[tuple[str, np.ndarray]]:
        """The weights as float host arrays under the canonical names (a NumPy twin's input); GGUF
        blocks kept as they are (levers.cpu_kernels=numba) dequantized."""
        from metrale.models.quantized import kept
        for name, a in self.weights.items():
            yield name, a.dequantize() if kept(a) else a

    def memory_report(self) -> dict:
        """Bytes used by weights, caches and activations; peak device memory where known."""
        return {}

    def close(self) -> None:
        """Free device memory (nothing to do on the host)."""


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
