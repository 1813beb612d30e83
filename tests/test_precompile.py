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
