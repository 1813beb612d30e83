"""kernels_numba/precompile.py on a machine without a GPU: the recording run finds each distinct
(kernel, argument types) pair without launching it, and the worker protocol reports a kernel it
could not compile (no device here) instead of hanging or raising."""
import numpy as np
from numba import cuda

from kernels_numba import precompile


@cuda.jit
def _toy(x, n):
    i = cuda.grid(1)
    if i < x.size:
        x[i] = n


def test_recording_finds_each_signature_once_and_runs_nothing():
    a = np.zeros(8, np.float32)
    with precompile.recording() as pending:
        _toy[1, 32](a, 3)
        _toy[1, 32](a, 4)                       # same types: one job
        _toy[1, 32](np.zeros(8, np.int32), 4)   # another signature
        _toy[1, 32](a, 2.5)                     # a float scalar: another
    assert not a.any()                          # nothing ran
    assert len(pending) == 3
    assert {str(t) for _, t in pending} == {str(t) for t in [
        (cuda.dispatcher.CUDADispatcher.typeof_pyval(_toy, a), cuda.dispatcher.CUDADispatcher.typeof_pyval(_toy, 3)),
        (cuda.dispatcher.CUDADispatcher.typeof_pyval(_toy, np.zeros(8, np.int32)),
         cuda.dispatcher.CUDADispatcher.typeof_pyval(_toy, 3)),
        (cuda.dispatcher.CUDADispatcher.typeof_pyval(_toy, a), cuda.dispatcher.CUDADispatcher.typeof_pyval(_toy, 2.5))]}
    assert "record" not in cuda.dispatcher.CUDADispatcher.call.__qualname__


def test_workers_report_what_they_could_not_compile():
    with precompile.recording() as pending:
        _toy[1, 32](np.zeros(8, np.float32), 1)
        _toy[1, 32](np.zeros(8, np.int32), 1)
    stats = precompile.compile_in_workers(pending, workers=2, timeout_s=120)
    assert stats["jobs"] == 2 and stats["workers"] == 2
    assert stats["compiled"] + len(stats["failed"]) == 2
    if not cuda.is_available():
        assert stats["compiled"] == 0
        assert all(name.endswith("_toy") and err for name, err in stats["failed"])


def test_marker_depends_on_the_key():
    assert precompile.marker("model-a", 1) != precompile.marker("model-b", 1)
    assert precompile.marker("model-a", 1) == precompile.marker("model-a", 1)


class _Fake:
    """The attributes CudaBackend._precompile reads, around a forward that launches _toy."""

    def __init__(self, run=None):
        from types import SimpleNamespace
        self.part = SimpleNamespace(parallel_compile=True)
        self.quantized = {}
        self.config, self.cfg = "model-a", SimpleNamespace(levers="levers-a")
        self.max_tokens = self.max_seqs = self.max_rows = 8
        self.max_model_len, self.block_size = 64, 16
        self.meta = SimpleNamespace(upload=lambda batch, g, stream: None)
        self.stream = SimpleNamespace(synchronize=lambda: None)
        self._run = run or (lambda g: _toy[1, 32](np.zeros(4, np.float32), g))
        self.compile_stats = None

    def _warmup_batches(self, warm_mixed):
        return [1, 2, 3] if warm_mixed else [1]

    def _geometry(self, batch):
        return batch, True


def _precompile(fake, workers=4, warm_mixed=True):
    from metrale.runtime.cuda_backend import CudaBackend
    CudaBackend._precompile(fake, workers, warm_mixed)


def test_backend_compiles_once_then_its_marker_skips_the_recording(tmp_path, monkeypatch):
    from numba.cuda.core import config
    monkeypatch.setattr(config, "CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(precompile, "available", lambda: True)
    calls = []

    def workers(jobs, n):
        calls.append((len(jobs), n))
        return {"jobs": len(jobs), "workers": n, "seconds": 0.0, "compiled": len(jobs), "failed": []}

    monkeypatch.setattr(precompile, "compile_in_workers", workers)
    fake = _Fake()
    _precompile(fake)
    assert calls == [(1, 4)]                   # three steps, one (kernel, types) pair
    assert fake.compile_stats["pending"] == 1 and fake.compile_stats["compiled"] == 1
    again = _Fake()
    _precompile(again)
    assert calls == [(1, 4)] and again.compile_stats is None     # the marker: no recording run
    other = _Fake()
    other.config = "model-b"                   # another model: its own marker
    _precompile(other)
    assert calls == [(1, 4), (1, 4)]
    off = _Fake()
    off.config = "model-c"
    _precompile(off, workers=0)                # levers.compile_workers=0: nothing
    assert len(calls) == 2 and off.compile_stats is None


def test_backend_keeps_no_marker_after_a_failure_and_survives_a_failed_recording(tmp_path, monkeypatch):
    from numba.cuda.core import config
    monkeypatch.setattr(config, "CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(precompile, "available", lambda: True)
    monkeypatch.setattr(precompile, "compile_in_workers", lambda jobs, n: {
        "jobs": len(jobs), "workers": n, "seconds": 0.0, "compiled": 0, "failed": [("k", "boom")]})
    fake = _Fake()
    _precompile(fake)
    assert fake.compile_stats["failed"] == [("k", "boom")]
    again = _Fake()
    _precompile(again)
    assert again.compile_stats is not None      # no marker: the next start records again

    def broken(g):
        raise RuntimeError("a host read of device data")

    bad = _Fake(run=broken)
    bad.config = "model-z"
    _precompile(bad)                            # falls back to in-process compiles, no exception
    assert bad.compile_stats is None
    assert "record" not in cuda.dispatcher.CUDADispatcher.call.__qualname__
