"""build_batch (vectorized over segments) against the per-segment definition of its fields."""
import numpy as np
import pytest

from metrale.runtime.batch import Segment, build_batch


def reference(segments, bs):
    token_ids, positions, token_seq, rows, slots = [], [], [], [], []
    t = 0
    for i, s in enumerate(segments):
        n = len(s.token_ids)
        for j in range(n):
            p = s.start_pos + j
            token_ids.append(int(s.token_ids[j]))
            positions.append(p)
            token_seq.append(i)
            slots.append(int(s.block_table[p // bs]) * bs + p % bs)
            if s.logits == "all" or (s.logits == "last" and j == n - 1):
                rows.append(t)
            t += 1
    return token_ids, positions, token_seq, rows, slots


@pytest.mark.parametrize("seed", range(5))
def test_build_batch_matches_the_definition(seed):
    rng = np.random.default_rng(seed)
    bs = 4
    segments = []
    for _ in range(int(rng.integers(1, 9))):
        n, start = int(rng.integers(1, 7)), int(rng.integers(0, 20))
        table = rng.permutation(64)[: -(-(start + n) // bs) + int(rng.integers(0, 2))].astype(np.int32)
        mode = ["last", "all", "none"][int(rng.integers(0, 3))] if seed else "last"
        segments.append(Segment(rng.integers(0, 100, n).astype(np.int32), start, table, mode))
    b = build_batch(segments, bs)
    ids, pos, tseq, rows, slots = reference(segments, bs)
    assert b.token_ids.tolist() == ids and b.positions.tolist() == pos and b.token_seq.tolist() == tseq
    assert b.logits_indices.tolist() == rows and b.slot_mapping.tolist() == slots
    assert b.context_lens.tolist() == [s.start_pos + len(s.token_ids) for s in segments]
    assert all(a.dtype == np.int32 for a in (b.token_ids, b.positions, b.token_seq, b.logits_indices,
                                            b.slot_mapping, b.context_lens, b.seq_query_start))
    with pytest.raises(ValueError, match="block table"):
        build_batch([Segment(np.zeros(5, np.int32), 0, np.zeros(1, np.int32))], bs)


def test_decode_batch_equals_build_batch_of_one_token_segments():
    from metrale.cache.block_manager import BlockManager
    from metrale.runtime.batch import Segment, build_batch, build_decode_batch
    from metrale.sampling.params import SamplingParams
    from metrale.scheduler.sequence import Sequence
    bs = 4
    blocks = BlockManager(64, bs, prefix_caching=False)
    seqs = [Sequence(list(range(1, n + 1)), SamplingParams()) for n in (3, 9, 27, 5)]
    for s in seqs:
        assert blocks.grow(s, s.num_tokens + 1)
    blocks.release(seqs[1])                                   # a freed row, reused by the next sequence
    assert blocks.grow(seqs[1], 10)
    blocks.check_no_leaks(seqs)
    positions = np.array([s.num_tokens for s in seqs], np.int32)
    got = build_decode_batch(positions, blocks.tables_of(seqs), bs)
    want = build_batch([Segment(np.zeros(1, np.int32), int(p), np.asarray(s.block_table, np.int32))
                        for p, s in zip(positions, seqs)], bs)
    for name in ("token_ids", "positions", "slot_mapping", "token_seq", "seq_query_start", "context_lens",
                 "block_tables", "logits_indices", "state_slots", "state_checkpoints"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    with pytest.raises(ValueError, match="segment 1 covers 13 positions but its block table has 3 blocks"):
        build_decode_batch(np.array([2, 12], np.int32), blocks.tables_of([seqs[0], seqs[1]]), bs)


def test_the_table_rows_follow_every_allocation():
    """BlockManager.table mirrors each sequence's block list through prefix reuse, growth past the
    table's width, trims and releases (check_no_leaks compares them), with rows reused."""
    from metrale.cache.block_manager import BlockManager
    from metrale.sampling.params import SamplingParams
    from metrale.scheduler.sequence import Sequence
    rng = np.random.default_rng(9)
    blocks = BlockManager(400, 2)
    live = []
    for step in range(300):
        op = rng.integers(0, 4)
        if op == 0 or not live:
            s = Sequence([int(t) for t in rng.integers(1, 5, int(rng.integers(1, 40)))], SamplingParams())
            blocks.allocate_prefix(s)
            if blocks.grow(s, s.num_tokens):
                s.num_computed_tokens = s.num_tokens
                blocks.commit_full_blocks(s)
                live.append(s)
            else:
                blocks.release(s)
        elif op == 1:
            s = live[int(rng.integers(len(live)))]
            s.output_token_ids += [1] * int(rng.integers(1, 30))      # grows past 16 blocks: the table widens
            if not blocks.grow(s, s.num_tokens):
                blocks.release(s)
                live.remove(s)
        elif op == 2:
            s = live[int(rng.integers(len(live)))]
            blocks.grow(s, s.num_tokens + 5)
            blocks.trim(s)
        else:
            s = live.pop(int(rng.integers(len(live))))
            blocks.release(s)
        blocks.check_no_leaks(live)
    assert blocks.table.shape[1] > 16 and len(live) > 0
    np.testing.assert_array_equal(blocks.tables_of(live)[0, :len(live[0].block_table)], live[0].block_table)
