"""DevicePipeline's layout cache on the CPU (NumPy arrays stand in for the device buffers, the
kernels and copies are stubbed): layouts with adjustments, whose list length changes nearly every
step of a penalized request, stay bounded; those without (the captured ones) are kept; a step with
pending tokens runs eagerly, after the step whose tokens it reads."""
import pytest
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


def _stub_device(monkeypatch):
    monkeypatch.setattr(D.cuda, "device_array", lambda n, dt, **_: np.zeros(n, dt))
    monkeypatch.setattr(D.cuda, "pinned_array", lambda n, dt, **_: np.zeros(n, dt))
    monkeypatch.setattr(D.cuda, "to_device", lambda a, **_: np.array(a))
    monkeypatch.setattr(D, "Event", _Event)
    monkeypatch.setattr(D, "cu", lambda *a: None)
    monkeypatch.setattr(D, "_ptr", lambda a: a.__array_interface__["data"][0])
    monkeypatch.setattr(K, "prepare_rows", lambda *a, **k: None)
    monkeypatch.setattr(K, "sample_rows", lambda *a, **k: None)


def test_layouts_with_adjustments_stay_bounded(monkeypatch):
    _stub_device(monkeypatch)
    V = 100
    pipe = D.DevicePipeline(_Backend(), V, graphs=False)
    logits = np.zeros((2, V), np.float32)
    mask = np.zeros((2, 1), np.uint32)
    rows = PackedRows(2, -(-V // 32))
    pipe.launch(logits, mask, rows)                      # N = 0: kept
    for n in range(1, D.ADJ_SLOTS + 1):                 # a list growing by one entry a step keeps its layout
        rows.adj_token = np.arange(n, dtype=np.int32)
        rows.adj_rep = np.zeros(n, np.int32)
        rows.adj_add = np.zeros(n, np.float32)
        rows.iparams[0, K.I_ADJ_END] = n
        pipe.launch(logits, mask, rows)
    assert len(pipe._layouts) == 2
    monkeypatch.setattr(D, "ADJ_SLOTS", 1)             # a layout per length from here
    for n in range(1, 3 * D.MAX_ADJ_LAYOUTS):           # lengths of more layouts than are kept
        rows.adj_token = np.arange(n, dtype=np.int32)
        rows.adj_rep = np.zeros(n, np.int32)
        rows.adj_add = np.zeros(n, np.float32)
        rows.iparams[0, K.I_ADJ_END] = n
        pipe.launch(logits, mask, rows)
        assert len(pipe._layouts) <= D.MAX_ADJ_LAYOUTS + 1
    assert any(key[1] == 0 for key in pipe._layouts), "the layout without adjustments was dropped"


def test_pending_rows_run_eagerly_after_the_last_launch(monkeypatch):
    _stub_device(monkeypatch)
    captured, ran = [], []
    monkeypatch.setattr(D.CudaGraph, "capture", staticmethod(lambda stream, fn, warmup=1: captured.append(fn) or _Graph()))
    monkeypatch.setattr(K, "prepare_rows", lambda *a, pending=None, **k: ran.append(pending))
    V = 100
    pipe = D.DevicePipeline(_Backend(), V, graphs=True)
    logits = np.zeros((2, V), np.float32)
    mask = np.zeros((2, 1), np.uint32)
    first = pipe.launch(logits, mask, PackedRows(2, -(-V // 32)))
    assert len(captured) == 1                           # no adjustments, no pending token: a graph
    rows = PackedRows(2, -(-V // 32))
    rows.iparams[1, K.I_PENDING], rows.pending = 2, True  # N = 0, but row 1 counts the token of row 1 before
    with pytest.raises(RuntimeError):
        pipe.launch(logits, mask, rows)                 # which step's tokens? none said
    pipe.launch(logits, mask, rows, after=first)
    assert len(captured) == 1 and ran[-1] is pipe.pending       # eager, with the pending buffers
    with pytest.raises(RuntimeError):
        pipe.launch(logits, mask, rows, after=first)    # first is no longer the last launch


class _Graph:
    def replay(self):
        pass
