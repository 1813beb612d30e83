"""The CUDA backend's step metadata padded to a graph geometry, for verify-shaped steps (several
tokens per sequence) as well as decode steps (simulator arrays; the host-to-device copy stubbed)."""
import numpy as np
from numba import cuda

from metrale.runtime import cuda_backend as cb
from metrale.runtime.batch import Segment, build_batch


class _Pool:
    def alloc(self, region, n, dtype):
        return cuda.device_array(n, dtype)


def test_verify_steps_pad_to_the_graph_geometry(monkeypatch):
    monkeypatch.setattr(cb, "cu", lambda *a: None)
    monkeypatch.setattr(cb, "copy_rows_htod", lambda *a: None)
    monkeypatch.setattr(cb, "_ptr", lambda a: 0)          # the simulator has no device pointers
    meta = cb.MetaBuffers(_Pool(), 256, 256, 256, max_blocks=8)
    segs = [Segment(np.arange(4, dtype=np.int32), 20, np.array([2 * i, 2 * i + 1], np.int32), "all")
            for i in range(48)]                                   # 48 sequences x 4-token verify blocks
    batch = build_batch(segs, 16)
    g = cb.Geometry(256, 256, 256, 512, 1)
    meta.upload(batch, g, stream=type("S", (), {"handle": 0})())
    h, o = meta.host, meta.offsets
    starts = h[o["seq_query_start"]:o["seq_query_start"] + g.seqs + 1]
    assert (np.diff(starts) >= 0).all() and starts[-1] == g.tokens
    np.testing.assert_array_equal(starts[:49], np.arange(0, 193, 4))
    token_seq = h[o["token_seq"]:o["token_seq"] + g.tokens]
    np.testing.assert_array_equal(token_seq[:192], np.repeat(np.arange(48), 4))
    assert (token_seq[192:] >= 48).all() and (token_seq[192:] < g.seqs).all()
    slots = h[o["slot_mapping"]:o["slot_mapping"] + g.tokens]
    assert (slots[192:] == -1).all()                             # padding writes nowhere


def test_a_step_copies_only_the_table_columns_it_uses(monkeypatch):
    """A decode step of 3 sequences (2 and 3 blocks) in a 4-sequence geometry of a model whose
    tables have 512 columns: the fields in one copy, then 4 rows x 3 columns of the table grid
    (pitch 512), padding rows reading block 0."""
    copies, rows = [], []
    monkeypatch.setattr(cb, "cu", lambda name, *a: copies.append((name, a[2])))
    monkeypatch.setattr(cb, "copy_rows_htod", lambda dst, src, pitch, width, n, stream: rows.append((pitch, width, n)))
    monkeypatch.setattr(cb, "_ptr", lambda a: 0)
    meta = cb.MetaBuffers(_Pool(), 64, 8, 8, max_blocks=512)
    tables = [np.array([5, 6], np.int32), np.array([7, 8, 9], np.int32), np.array([1, 2], np.int32)]
    batch = build_batch([Segment(np.array([3], np.int32), 20 + i, t, "last") for i, t in enumerate(tables)], 16)
    meta.upload(batch, cb.Geometry(4, 4, 4, 64, 1), stream=type("S", (), {"handle": 0})())
    assert copies == [("cuMemcpyHtoDAsync", 4 * meta.table_offset)]
    assert rows == [(4 * 512, 4 * 3, 4)]
    t = meta.table_offset
    grid = meta.host[t:t + 4 * 512].reshape(4, 512)
    np.testing.assert_array_equal(grid[:3, :3], batch.block_tables)
    assert (grid[3, :3] == 0).all()
