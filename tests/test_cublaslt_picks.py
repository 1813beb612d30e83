"""cuBLASLt autotune picks on disk (metrale/runtime/cuda/tune_cache.py and CublasLt._pick), on the
CPU: the store's round trip, misses on another GPU or library, a corrupt file ignored, concurrent
writers merged, a changed heuristic list timed again; CublasLt's pick path with a fake heuristic
list and a fake timer (no GPU, no cuBLASLt)."""
import json
import multiprocessing
import os

import pytest

from metrale.runtime.cuda import tune_cache
from metrale.runtime.cuda.tune_cache import FORMAT, Pick, PickStore

CONTEXT = {"gpu": "NVIDIA H100 80GB HBM3", "cc": [9, 0], "sms": 132, "driver": 12080, "cublaslt": 120903,
           "cudart": 12080, "recipe": "r", "workspace": 1 << 25, "candidates": 8, "split_k": True}
KEY = "32x6144x4096 acc=1 bias=0"
FP = (21, 18, 7, 1, 0, 0, 0, 3, 2)


def _fingerprints(algos):
    """A fake heuristic list: algo_of(i) is the i-th candidate's fingerprint."""
    return lambda i: algos[i]


def test_round_trip(tmp_path):
    store = PickStore(CONTEXT, tmp_path)
    assert store.get(KEY) is None
    assert store.put(KEY, Pick(2, 5, FP))
    assert store.path.parent == tmp_path and store.path.suffix == ".json"
    data = json.loads(store.path.read_text())
    assert data["format"] == FORMAT and data["context"] == CONTEXT
    assert data["picks"][KEY] == {"index": 2, "count": 5, "algo": list(FP)}
    again = PickStore(dict(CONTEXT), tmp_path)          # a later start: reads the file
    assert again.path == store.path
    assert again.get(KEY) == Pick(2, 5, FP)
    algos = [(i,) * 9 for i in range(5)]
    algos[2] = FP
    assert again.resolve(KEY, 5, _fingerprints(algos)) == 2
    assert again.resolve("1x2x3 acc=0 bias=0", 5, _fingerprints(algos)) is None     # another product


@pytest.mark.parametrize("field,value", [("gpu", "NVIDIA H200"), ("cc", [8, 0]), ("cublaslt", 130000),
                                         ("driver", 13000), ("candidates", 4), ("split_k", False)])
def test_another_gpu_library_or_setup_misses(tmp_path, field, value):
    PickStore(CONTEXT, tmp_path).put(KEY, Pick(1, 4, FP))
    other = PickStore({**CONTEXT, field: value}, tmp_path)
    assert other.path != PickStore(CONTEXT, tmp_path).path
    assert other.get(KEY) is None
    assert other.resolve(KEY, 4, lambda i: FP) is None
    assert PickStore(CONTEXT, tmp_path).get(KEY) == Pick(1, 4, FP)       # its own file is untouched


def test_a_file_of_another_context_under_our_name_is_ignored(tmp_path):
    """The context inside the file is compared, not only its hash in the name."""
    store = PickStore(CONTEXT, tmp_path)
    store.put(KEY, Pick(1, 4, FP))
    data = json.loads(store.path.read_text())
    data["context"]["cublaslt"] += 1
    store.path.write_text(json.dumps(data))
    assert PickStore(CONTEXT, tmp_path).get(KEY) is None
    data["context"]["cublaslt"] -= 1
    data["format"] = FORMAT + 1
    store.path.write_text(json.dumps(data))
    assert PickStore(CONTEXT, tmp_path).get(KEY) is None


@pytest.mark.parametrize("garbage", [b"{not json", b"", b"\xff\xfe\x00binary", b"[1, 2, 3]",
                                     b'{"format": 1, "context": null, "picks": 7}'])
def test_a_corrupt_file_is_ignored_and_rewritten(tmp_path, garbage):
    store = PickStore(CONTEXT, tmp_path)
    store.path.parent.mkdir(parents=True, exist_ok=True)
    store.path.write_bytes(garbage)
    fresh = PickStore(CONTEXT, tmp_path)
    assert fresh.get(KEY) is None
    assert fresh.put(KEY, Pick(0, 3, FP))
    assert PickStore(CONTEXT, tmp_path).get(KEY) == Pick(0, 3, FP)
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".tmp"] == []       # no temp file left


def test_malformed_entries_are_dropped(tmp_path):
    store = PickStore(CONTEXT, tmp_path)
    store.put(KEY, Pick(1, 4, FP))
    data = json.loads(store.path.read_text())
    data["picks"].update({"a": {"index": 4, "count": 4, "algo": []}, "b": {"index": True, "count": 4, "algo": []},
                          "c": {"index": 0}, "d": [1, 2], "e": {"index": 0, "count": 2, "algo": ["x"]}})
    store.path.write_text(json.dumps(data))
    assert PickStore(CONTEXT, tmp_path).picks() == {KEY: Pick(1, 4, FP)}


def test_a_changed_heuristic_list_is_timed_again(tmp_path):
    """The stored index is taken only when the re-queried list has the same length and the
    candidate at that index the same fingerprint."""
    PickStore(CONTEXT, tmp_path).put(KEY, Pick(2, 5, FP))
    store = PickStore(CONTEXT, tmp_path)
    same = [(0,) * 9, (1,) * 9, FP, (3,) * 9, (4,) * 9]
    assert store.resolve(KEY, 5, _fingerprints(same)) == 2
    assert store.resolve(KEY, 4, _fingerprints(same[:4])) is None           # count differs
    assert store.resolve(KEY, 6, _fingerprints(same + [(5,) * 9])) is None
    moved = [FP, (1,) * 9, (2,) * 9, (3,) * 9, (4,) * 9]                       # same count, other order
    assert store.resolve(KEY, 5, _fingerprints(moved)) is None

    def unreadable(i):
        raise RuntimeError("CUBLAS_STATUS_INVALID_VALUE")

    assert store.resolve(KEY, 5, unreadable) is None


def test_an_unwritable_directory_is_not_an_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    store = PickStore(CONTEXT, blocker / "sub")           # a directory under a regular file
    assert store.put(KEY, Pick(0, 2, FP)) is False
    assert store.get(KEY) == Pick(0, 2, FP)               # kept for this process
    assert store.put("other", Pick(1, 2, FP)) is False    # and no further attempt raises


def test_default_directory_follows_xdg_cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    store = PickStore(CONTEXT)
    assert store.path.parent == tmp_path / "metrale" / "cublaslt"
    store.put(KEY, Pick(0, 2, FP))
    assert store.path.is_file()


def _writer(directory: str, tag: str, n: int, barrier) -> None:
    store = PickStore(CONTEXT, directory)
    barrier.wait()
    for i in range(n):
        store.put(f"{tag}{i}", Pick(i % 3, 3, (i,)))


def test_concurrent_writers_keep_each_others_picks(tmp_path):
    """Two processes writing at once: every pick of both is in the file at the end (read-merge-write
    under the lock; without it, a write between another's read and replace drops its picks)."""
    ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    n = 60
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), tag, n, barrier)) for tag in ("a", "b")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    picks = PickStore(CONTEXT, tmp_path).picks()
    assert set(picks) == {f"{t}{i}" for t in "ab" for i in range(n)}
    assert picks["b7"] == Pick(1, 3, (7,))
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".tmp"] == []


# CublasLt's pick path, with a fake heuristic list and a fake timer


class _Entry:
    def __init__(self, ptr, state=0, workspace_size=0):
        self.ptr, self.state, self.workspace_size = ptr, state, workspace_size


class _FakeBlas:
    """A CublasLt without a device: `algos` is the heuristic's list (fingerprints), `fastest` the
    index the timer picks; _fastest records each timing."""

    def __new__(cls, directory, algos, fastest, context=CONTEXT, tune_cache=None, finite=True):
        from metrale.runtime.cuda.cublaslt import CublasLt
        blas = CublasLt.__new__(CublasLt)
        blas.tuned, blas.reused, blas._store = {}, {}, None
        blas.tune_cache = directory if tune_cache is None else tune_cache
        blas.workspace_bytes = 1 << 25
        blas.timed = []
        blas._context = lambda: dict(context)
        blas._fingerprint = lambda ptr: algos[ptr - 1000]

        def timer(key, desc, layouts, result, count, tune_with):
            blas.timed.append(key)
            blas.tuned[key] = (fastest, 10.0 if finite else float("inf"), 12.0)
            return fastest

        blas._fastest = timer
        blas.result = [_Entry(1000 + i) for i in range(len(algos))]
        return blas


def _pick(blas, key=(32, 6144, 4096, True, False)):
    return blas._pick(key, 0, (0, 0, 0), blas.result, len(blas.result), (0, 0, 0, 0))


def test_cublaslt_second_start_times_nothing(tmp_path):
    algos = [(i, 7, 1) for i in range(6)]
    first = _FakeBlas(tmp_path, algos, fastest=3)
    assert _pick(first) == 3 and len(first.timed) == 1 and first.reused == {}
    second = _FakeBlas(tmp_path, algos, fastest=5)        # a timer that would pick otherwise
    assert _pick(second) == 3 and second.timed == []
    assert second.reused == {(32, 6144, 4096, True, False): 3}
    assert _pick(second, (64, 6144, 4096, True, False)) == 5 and len(second.timed) == 1    # a new product


def test_cublaslt_changed_list_or_device_is_timed_again(tmp_path):
    algos = [(i, 7, 1) for i in range(6)]
    _pick(_FakeBlas(tmp_path, algos, fastest=3))
    shorter = _FakeBlas(tmp_path, algos[:5], fastest=1)            # the library returns fewer now
    assert _pick(shorter) == 1 and len(shorter.timed) == 1
    after = _FakeBlas(tmp_path, algos[:5], fastest=4)
    assert _pick(after) == 1 and after.timed == []                  # the re-tuned pick replaced the entry
    other_gpu = _FakeBlas(tmp_path, algos[:5], fastest=2, context={**CONTEXT, "gpu": "NVIDIA H200"})
    assert _pick(other_gpu) == 2 and len(other_gpu.timed) == 1
    unusable = _FakeBlas(tmp_path, algos[:5], fastest=0)
    unusable.result[1].state = 1                                     # the stored candidate no longer runs
    assert _pick(unusable) == 0 and len(unusable.timed) == 1


def test_cublaslt_failed_timings_are_not_kept_and_off_keeps_nothing(tmp_path):
    algos = [(i,) for i in range(4)]
    failed = _FakeBlas(tmp_path, algos, fastest=0, finite=False)   # every candidate failed to run
    _pick(failed)
    again = _FakeBlas(tmp_path, algos, fastest=2)
    assert _pick(again) == 2 and len(again.timed) == 1
    off = _FakeBlas(tmp_path / "off", algos, fastest=1, tune_cache=False)
    _pick(off)
    assert not (tmp_path / "off").exists() and off._store is None


def test_cublaslt_without_a_device_description_times_as_before(tmp_path):
    blas = _FakeBlas(tmp_path, [(0,), (1,)], fastest=1)

    def no_context():
        raise RuntimeError("CUDA driver error 201")

    blas._context = no_context
    assert _pick(blas) == 1 and blas.tune_cache is False and os.listdir(tmp_path) == []


def test_the_lever_defaults_on():
    from metrale.settings import compose
    assert compose().levers.cublaslt_tune_cache is True
    assert compose(["levers.cublaslt_tune_cache=false"]).levers.cublaslt_tune_cache is False


def test_default_dir_is_beside_the_kernel_caches(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert tune_cache.default_dir() == tmp_path / "metrale" / "cublaslt"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert tune_cache.default_dir() == tune_cache.Path.home() / ".cache" / "metrale" / "cublaslt"
