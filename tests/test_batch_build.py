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
    from metrale.runtime.batch import Segment, build_batch, build_decode_batch
    rng = np.random.default_rng(5)
    bs = 4
    tables = [list(rng.permutation(40)[:n]) for n in (1, 3, 7, 2)]
    positions = np.array([2, 9, 27, 4], np.int32)
    got = build_decode_batch(positions, tables, bs)
    want = build_batch([Segment(np.zeros(1, np.int32), int(p), np.asarray(t, np.int32)) for p, t in zip(positions, tables)], bs)
    for name in ("token_ids", "positions", "slot_mapping", "token_seq", "seq_query_start", "context_lens",
                 "block_tables", "logits_indices", "state_slots", "state_checkpoints"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    with pytest.raises(ValueError, match="segment 1 covers 13 positions but its block table has 3 blocks"):
        build_decode_batch(np.array([2, 12], np.int32), tables[:2], bs)
