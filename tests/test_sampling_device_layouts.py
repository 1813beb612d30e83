"""DevicePipeline's layout cache on the CPU (NumPy arrays stand in for the device buffers, the
kernels and copies are stubbed): layouts with adjustments, whose list length changes nearly every
step of a penalized request, stay bounded; those without (the captured ones) are kept."""
import numpy as np

from kernels_numba import sampling as K
from metrale.sampling import device as D
from metrale.sampling.sampler import PackedRows


class _Stream:
    numba = 0
    handle = 0

    def synchronize(self):
        pass


class _Backend:
    stream = _Stream()
    max_rows = 8


class _Event:
    def __init__(self, timing=False):
        pass

    def record(self, stream):
        pass

    def synchronize(self):
        pass


def test_layouts_with_adjustments_stay_bounded(monkeypatch):
    monkeypatch.setattr(D.cuda, "device_array", lambda n, dt, **_: np.zeros(n, dt))
    monkeypatch.setattr(D.cuda, "pinned_array", lambda n, dt, **_: np.zeros(n, dt))
    monkeypatch.setattr(D.cuda, "to_device", lambda a, **_: np.array(a))
    monkeypatch.setattr(D, "Event", _Event)
    monkeypatch.setattr(D, "cu", lambda *a: None)
    monkeypatch.setattr(D, "_ptr", lambda a: a.__array_interface__["data"][0])
    monkeypatch.setattr(K, "prepare_rows", lambda *a, **k: None)
    monkeypatch.setattr(K, "sample_rows", lambda *a, **k: None)
    V = 100
    pipe = D.DevicePipeline(_Backend(), V, graphs=False)
    logits = np.zeros((2, V), np.float32)
    mask = np.zeros((2, 1), np.uint32)
    rows = PackedRows(2, -(-V // 32))
    pipe.launch(logits, mask, rows)                      # N = 0: kept
    for n in range(1, 3 * D.MAX_ADJ_LAYOUTS):           # a penalized row's list grows each step
        rows.adj_token = np.arange(n, dtype=np.int32)
        rows.adj_rep = np.zeros(n, np.int32)
        rows.adj_add = np.zeros(n, np.float32)
        rows.iparams[0, K.I_ADJ_END] = n
        pipe.launch(logits, mask, rows)
        assert len(pipe._layouts) <= D.MAX_ADJ_LAYOUTS + 1
    assert any(key[1] == 0 for key in pipe._layouts), "the layout without adjustments was dropped"
