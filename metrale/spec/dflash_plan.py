"""The DFlash drafter on the device, host side (no device): the metadata of a proposal's block pass
(metrale/spec/dflash_cuda.py runs it; tests/test_dflash_cuda_plan.py runs it with NumPy).

A block row must attend to the sequence's context [0, start) and to the whole block
[start, start + L) (non-causal), through the target's paged decode kernels, which read keys
0..attn_pos of a block table. The block's K/V does not go into the sequence's own blocks (start's
block may be a prefix-cache block other sequences read, and positions past the table have no
block): row b of a pass gets E = scratch_blocks(L, block_size) scratch blocks of the drafter's pool
(ids scratch_base + (b mod per_pass) * E ..). Its table is the sequence's blocks before start's
block, then its scratch blocks; the context part of start's block is copied into the first scratch
block before the pass (copy_src -> copy_dst), the block's K/V is stored at the scratch slots, and
every row of the block reads keys 0..start + L - 1 at RoPE positions start..start + L - 1. The
drafter's pool then only ever holds context K/V, written at the target's own slots."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def scratch_blocks(length: int, block_size: int) -> int:
    """Scratch blocks a block row needs: start's block (its context part copied) to the block's end."""
    return -(-(block_size - 1 + length) // block_size)


@dataclass
class BlockPlan:
    """One proposal: sequence b < B (index live[b] in propose's seqs, ks[b] drafts) is block rows
    b * L .. b * L + L - 1. Per token: token_ids (the last token, then MASK rows' 0), positions,
    slots (scratch slots), attn_pos (start + L - 1); per sequence: tables [B, W] and the block copy
    copy_src[b] -> copy_dst[b] (-1: start is at a block start, nothing to copy)."""
    live: list[int]
    ks: list[int]
    length: int
    token_ids: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    attn_pos: np.ndarray
    tables: np.ndarray
    copy_src: np.ndarray
    copy_dst: np.ndarray

    @property
    def batch(self) -> int:
        return len(self.live)

    def context(self, b: int) -> int:
        """Keys row b's block reads: its context and the block."""
        return int(self.attn_pos[b * self.length]) + 1


def drafting(seq, k: int, length: int, max_model_len: int) -> bool:
    """The sequence may draft: k > 0, decoding (all but its last token computed), and its block's
    positions inside the RoPE tables."""
    n = seq.num_tokens
    return k > 0 and seq.num_computed_tokens == n - 1 and n - 1 + length <= max_model_len


def plan_blocks(seqs, ks: list[int], *, length: int, block_size: int, scratch_base: int, per_pass: int,
                max_model_len: int) -> BlockPlan | None:
    """The block pass of seqs[i] with ks[i] drafts (module doc); None when no sequence drafts."""
    bs, L = block_size, length
    live = [i for i, k in enumerate(ks) if drafting(seqs[i], k, L, max_model_len)]
    if not live:
        return None
    B, E = len(live), scratch_blocks(L, bs)
    starts = [seqs[i].num_tokens - 1 for i in live]
    width = max(s // bs for s in starts) + E
    tokens = np.zeros(B * L, np.int32)
    positions = np.zeros(B * L, np.int32)
    slots = np.zeros(B * L, np.int32)
    attn = np.zeros(B * L, np.int32)
    tables = np.zeros((B, width), np.int32)
    copy_src = np.full(B, -1, np.int32)
    copy_dst = np.full(B, -1, np.int32)
    for b, (i, start) in enumerate(zip(live, starts)):
        seq, pb = seqs[i], start // bs
        scratch = scratch_base + (b % per_pass) * E + np.arange(E, dtype=np.int32)
        table = np.asarray(seq.block_table[:pb], np.int32)
        tables[b, :pb], tables[b, pb:pb + E] = table, scratch
        if start % bs:                        # context positions pb * bs .. start - 1 share start's block
            copy_src[b], copy_dst[b] = int(seq.block_table[pb]), scratch[0]
        rows = slice(b * L, (b + 1) * L)
        pos = np.arange(start, start + L, dtype=np.int32)
        tokens[b * L] = seq.token_slice(start, start + 1)[0]
        positions[rows] = pos
        slots[rows] = scratch[pos // bs - pb] * bs + pos % bs
        attn[rows] = start + L - 1
    return BlockPlan(live, [min(ks[i], L - 1) for i in live], L, tokens, positions, slots, attn, tables,
                     copy_src, copy_dst)
