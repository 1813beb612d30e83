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
