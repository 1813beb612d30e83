"""ForwardBatch: one ragged step. Prefill chunks, decode tokens and verify blocks are all segments.

Invariants: segments are contiguous in the flat token array in segment order; within a segment
positions are consecutive; context_lens[s] = positions[last token of s] + 1; every token's K/V
goes to slot_mapping[t] before attention reads the cache.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Segment:
    token_ids: np.ndarray      # int32 [n] tokens to run
    start_pos: int             # position of token_ids[0]
    block_table: np.ndarray    # int32 [num_blocks of the sequence]
    logits: str = "last"       # "last" | "all" | "none": which of this segment's rows need logits
    state_slot: int = -1       # hybrid models: the sequence's state slot (cache/state_slots.py)
    state_checkpoint: int = -1 # hybrid models: a checkpoint taken before this verify block, which
                               # records the block's inputs for a partial rollback (docs/hybrid.md)


@dataclass
class ForwardBatch:
    token_ids: np.ndarray        # int32 [T]
    positions: np.ndarray        # int32 [T]
    slot_mapping: np.ndarray     # int32 [T]
    token_seq: np.ndarray        # int32 [T] segment index of each token
    seq_query_start: np.ndarray  # int32 [S+1]
    context_lens: np.ndarray     # int32 [S]
    block_tables: np.ndarray     # int32 [S, max_blocks] (padded with 0)
    logits_indices: np.ndarray   # int32 [R]
    block_size: int
    state_slots: np.ndarray | None = None        # int32 [S] (-1: none); hybrid models
    state_checkpoints: np.ndarray | None = None  # int32 [S] (-1: none); hybrid models

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.context_lens.shape[0])

    @property
    def is_decode_only(self) -> bool:
        return self.num_tokens == self.num_seqs

    @property
    def max_query_len(self) -> int:
        return int(np.diff(self.seq_query_start).max()) if self.num_seqs else 0


def build_batch(segments: list[Segment], block_size: int) -> ForwardBatch:
    if not segments:
        raise ValueError("a forward batch needs at least one segment")
    lens = np.array([len(s.token_ids) for s in segments], dtype=np.int32)
    if (lens <= 0).any():
        raise ValueError("every segment needs at least one token")
    starts = np.zeros(len(segments) + 1, dtype=np.int32)
    np.cumsum(lens, out=starts[1:])
    S, T = len(segments), int(starts[-1])
    token_ids = np.concatenate([np.asarray(s.token_ids, dtype=np.int32) for s in segments])
    start_pos = np.fromiter((s.start_pos for s in segments), dtype=np.int32, count=S)
    # vectorized over segments (this runs every step; per-segment aranges cost ~4 us each)
    positions = (np.arange(T, dtype=np.int32) - np.repeat(starts[:-1] - start_pos, lens)).astype(np.int32)
    token_seq = np.repeat(np.arange(S, dtype=np.int32), lens)
    max_blocks = max(len(s.block_table) for s in segments)
    tables = np.zeros((len(segments), max(max_blocks, 1)), dtype=np.int32)
    for i, s in enumerate(segments):
        tables[i, :len(s.block_table)] = s.block_table
        need = -(-(s.start_pos + lens[i]) // block_size)
        if len(s.block_table) < need:
            raise ValueError(f"segment {i} covers {s.start_pos + lens[i]} positions "
                             f"but its block table has {len(s.block_table)} blocks of {block_size}")
    slot_mapping = tables[token_seq, positions // block_size] * block_size + positions % block_size
    modes = [s.logits for s in segments]
    if all(m == "last" for m in modes):
        logits_indices = starts[1:] - 1
    else:
        want = np.zeros(T, dtype=bool)
        for m, a, b in zip(modes, starts[:-1], starts[1:]):
            if m == "last":
                want[b - 1] = True
            elif m == "all":
                want[a:b] = True
        logits_indices = np.flatnonzero(want)
    context_lens = start_pos + lens
    state_slots = np.array([s.state_slot for s in segments], dtype=np.int32)
    state_checkpoints = np.array([s.state_checkpoint for s in segments], dtype=np.int32)
    return ForwardBatch(token_ids, positions, slot_mapping.astype(np.int32), token_seq, starts,
                        context_lens, tables, logits_indices.astype(np.int32), block_size,
                        state_slots, state_checkpoints)


def build_decode_batch(positions: np.ndarray, tables: np.ndarray, block_size: int) -> ForwardBatch:
    """build_batch of one-token segments at `positions` (their token ids left 0: fed on the device,
    or written by the caller) over `tables` [S, blocks] int32 (0-padded: BlockManager.tables_of):
    the decode step, vectorized (no Segment objects, no per-row arrays)."""
    S = len(positions)
    if S == 0:
        raise ValueError("a forward batch needs at least one segment")
    positions = np.asarray(positions, dtype=np.int32)
    need = positions // block_size
    if (need >= tables.shape[1]).any():
        i = int(np.flatnonzero(need >= tables.shape[1])[0])
        raise ValueError(f"segment {i} covers {int(positions[i]) + 1} positions "
                         f"but its block table has {tables.shape[1]} blocks of {block_size}")
    rows = np.arange(S, dtype=np.int32)
    slot_mapping = (tables[rows, need] * block_size + positions % block_size).astype(np.int32)
    none = np.full(S, -1, dtype=np.int32)
    return ForwardBatch(np.zeros(S, np.int32), positions, slot_mapping, rows, np.arange(S + 1, dtype=np.int32),
                        positions + 1, tables, rows.copy(), block_size, none, none.copy())
