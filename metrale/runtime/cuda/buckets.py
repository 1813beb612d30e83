"""Bucketed geometries of prefill and mixed steps (levers.mixed_graphs), and step padding.

Pure functions (no device, no Numba): the CUDA backend pads a step whose longest segment runs the
prefill attention kernel to a bucket and replays the CUDA graph captured for it.

A bucket is (tokens, seqs, rows, max_query_len):
- tokens: the next size of `token_ladder(max_tokens)` (powers of two from MIXED_MIN_TOKENS, and
  max_tokens itself);
- max_query_len: the next power of two >= the longest segment and >= prefill_attention_min_tokens
  (it sets the prefill attention grid, (Hq, tiles(max_query_len), seqs); kernels_numba/flash_prefill.py);
- seqs: the next power of two >= the step's sequences plus the padding segments that hold the
  padding tokens (each at most max_query_len tokens, so every padding row is inside the grid);
- rows (logits rows): the seq bucket, or the next power of two >= the rows when there are more
  (verify blocks with logits for every row).
The context length is not part of the key: the prefill attention path reads only positions and
block tables (Geometry.max_context is 0 for these graphs).

Padding (`padding`): tokens past the step's are padding segments of at most `seg_len` tokens,
token id 0, position 0, slot -1 (the K/V store skips them), block table row 0 (reads block 0,
which holds finite values: the pool is zeroed at start and blocks only ever hold real K/V);
segments past those are empty (start = end = tokens); padding logits rows read the last token.
With seg_len 1 this is exactly the decode-graph padding.
"""
from __future__ import annotations

import numpy as np

MIXED_MIN_TOKENS = 64        # smallest token bucket of a mixed graph
MAX_MIXED_GRAPHS = 64        # mixed graphs kept (LRU); past this the least recently used is destroyed


def pow2_at_least(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << (max(int(n), 1) - 1).bit_length()


def token_ladder(max_tokens: int, floor: int = MIXED_MIN_TOKENS) -> list[int]:
    """Token buckets: powers of two from `floor` below max_tokens, then max_tokens itself."""
    sizes, s = [], floor
    while s < max_tokens:
        sizes.append(s)
        s *= 2
    sizes.append(int(max_tokens))
    return sizes


def mixed_bucket(tokens: int, seqs: int, rows: int, max_query_len: int, *, ladder: list[int],
                 max_seqs: int, max_rows: int, prefill_min_tokens: int) -> tuple[int, int, int, int] | None:
    """(tokens, seqs, rows, max_query_len) of the bucket of a step, or None (run it eagerly): more
    tokens than the ladder's top, or more sequences (with padding segments) than max_seqs."""
    if tokens > ladder[-1] or seqs > max_seqs or rows > max_rows or max_query_len > tokens:
        return None
    tb = next(s for s in ladder if s >= tokens)
    qb = min(pow2_at_least(max(max_query_len, prefill_min_tokens)), tb)
    need = padded_seqs(tokens, seqs, tb, qb)
    if need > max_seqs:
        return None
    sb = min(pow2_at_least(need), max_seqs)
    rb = min(max(sb, pow2_at_least(rows)), max_rows)
    return tb, sb, rb, qb


def holds(bucket: tuple[int, int, int, int], own: tuple[int, int, int, int], tokens: int, seqs: int,
          rows: int, max_query_len: int) -> bool:
    """Whether a step of (tokens, seqs, rows, max_query_len), whose own bucket is `own`, can run
    padded in another bucket (tokens, seqs, rows, max_query_len): the same token bucket (a bigger
    one would multiply the step's products), a query length at least the step's, room for the
    step's rows and for its sequences plus the padding segments of that query length."""
    tb, sb, rb, qb = bucket
    return tb == own[0] and max_query_len <= qb and rows <= rb and padded_seqs(tokens, seqs, tb, qb) <= sb


def padded_seqs(tokens: int, seqs: int, g_tokens: int, seg_len: int) -> int:
    """A step's sequences plus the padding segments (at most seg_len tokens each) that fill it up
    to g_tokens."""
    return seqs + -(-(g_tokens - tokens) // seg_len)


def padding(tokens: int, seqs: int, rows: int, g_tokens: int, g_seqs: int, g_rows: int,
            seg_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The padding entries of token_seq [g_tokens - tokens], seq_query_start [g_seqs - seqs] (the
    entries after the step's seqs + 1) and logits_indices [g_rows - rows] of a step padded from
    (tokens, seqs, rows) to (g_tokens, g_seqs, g_rows), padding segments of at most seg_len tokens."""
    seg_len = max(int(seg_len), 1)
    pad_t = g_tokens - tokens
    token_seq = (seqs + np.arange(pad_t, dtype=np.int64) // seg_len).astype(np.int32)
    if pad_t and token_seq[-1] >= g_seqs:
        raise ValueError(f"{pad_t} padding tokens in segments of {seg_len} need more than "
                         f"{g_seqs - seqs} padding sequences")
    k = np.arange(1, g_seqs - seqs + 1, dtype=np.int64)
    seq_start = np.minimum(tokens + k * seg_len, g_tokens).astype(np.int32)
    logits = np.minimum(np.arange(tokens, tokens + g_rows - rows, dtype=np.int64),
                        max(g_tokens - 1, 0)).astype(np.int32)
    return token_seq, seq_start, logits
