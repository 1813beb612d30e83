"""Compile many kernels at once, in worker processes, for a start whose kernels are not in the
on-disk kernel cache (jit.py).

Numba compiles one kernel at a time (a process-wide lock) and a start with an empty cache spends
most of its seconds there. `recording()` runs a forward's host code with every kernel launch
recorded instead of run, and returns the (kernel, argument types) pairs that are neither compiled
in this process nor in the disk cache; `compile_in_workers` compiles those pairs in parallel in
fresh Python processes (each with its own CUDA context) and takes the compiled kernels back: they
join their dispatchers here and are saved to the disk cache by this process alone. The real
warm-up after it then launches them with no compile.

Workers are plain subprocesses fed pickled kernels on stdin (no multiprocessing spawn, which would
re-import the user's __main__). Everything here is best effort: a kernel a worker fails to
compile is compiled by the caller when it is first launched, as without this module.
"""
from __future__ import annotations

import os
import pickle
import queue
import struct
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

Job = tuple[object, tuple]   # (CUDADispatcher, argument types)


def available() -> bool:
    """Kernels compile for a real device and land in the disk cache (not the simulator, cache on)."""
    from kernels_numba import jit
    return jit.CACHE and os.environ.get("NUMBA_ENABLE_CUDASIM") != "1"


def marker(*key: object) -> Path:
    """A file in the kernel cache that says the kernels of `key` (a model and its levers) were
    compiled into it."""
    import hashlib
    from numba.cuda.core import config
    from kernels_numba import jit
    digest = hashlib.sha256(repr((jit.sources_hash(), key)).encode()).hexdigest()[:20]
    path = Path(config.CACHE_DIR) / "precompiled"
    path.mkdir(parents=True, exist_ok=True)
    return path / digest


def _in_disk_cache(dispatcher, argtypes: tuple) -> bool:
    """Load (dispatcher, argtypes) from the disk cache into the dispatcher if it is there."""
    can = dispatcher._can_compile
    dispatcher._can_compile = False
    try:
        dispatcher.compile(argtypes)
        return True
    except Exception:   # noqa: BLE001 - "Compilation disabled": not in the cache (or no device to key it)
        return False
    finally:
        dispatcher._can_compile = can


@contextmanager
def recording() -> Iterator[list[Job]]:
    """Kernel launches inside the block are recorded, not run; the yielded list holds, once the
    block ends, every distinct (dispatcher, argtypes) pair launched that was neither compiled in
    this process nor in the disk cache (those in the cache are loaded)."""
    from numba.cuda import dispatcher as numba_dispatcher
    cls = numba_dispatcher.CUDADispatcher
    seen: dict[tuple[int, tuple], Job] = {}

    def record(self, args, launch_config) -> None:
        if self.specialized:
            return
        argtypes = tuple(self.typeof_pyval(a) for a in args)
        if argtypes not in self.overloads:
            seen.setdefault((id(self), argtypes), (self, argtypes))

    pending: list[Job] = []
    original = cls.call
    cls.call = record
    try:
        yield pending
    finally:
        cls.call = original
    pending.extend(job for job in seen.values() if not _in_disk_cache(*job))


def _name(dispatcher) -> str:
    f = dispatcher.py_func
    return f"{f.__module__}.{f.__qualname__}"


def compile_in_workers(jobs: list[Job], workers: int, timeout_s: float = 300.0) -> dict:
    """Compile `jobs` with up to `workers` processes, largest kernels first. Each compiled kernel
    comes back pickled, joins its dispatcher's overloads here and is saved to the disk cache from
    this process only (the kernels of one factory share an index file, which concurrent writers
    would race on). Returns {jobs, workers, seconds, compiled, failed: [(kernel, error)]}."""
    started = time.perf_counter()
    todo: queue.SimpleQueue = queue.SimpleQueue()
    # the attention and GEMV factories compile the longest: start them first
    order = sorted(jobs, key=lambda j: ("flash" not in _name(j[0]), "gemv" not in _name(j[0])))
    for job in order:
        try:
            todo.put((job, pickle.dumps(job)))
        except Exception:   # noqa: BLE001 - an unpicklable kernel compiles in the caller on first launch
            pass
    n = max(0, min(workers, todo.qsize()))
    done: list[tuple[Job, object]] = []          # (job, compiled kernel)
    failed: list[tuple[str, str]] = []
    lock = threading.Lock()

    def drive() -> None:
        proc = _start_worker()
        try:
            while True:
                try:
                    job, blob = todo.get_nowait()
                except queue.Empty:
                    return
                try:
                    _write(proc.stdin, blob)
                    answer = pickle.loads(_read(proc.stdout))
                except Exception as exc:   # noqa: BLE001 - the worker died: its job compiles in the caller
                    with lock:
                        failed.append((_name(job[0]), f"the worker failed: {exc}"))
                    return
                with lock:
                    if answer.get("error"):
                        failed.append((_name(job[0]), answer["error"]))
                    else:
                        done.append((job, answer["kernel"]))
        finally:
            try:
                proc.stdin.close()
                proc.wait(timeout=timeout_s)
            except Exception:   # noqa: BLE001
                proc.kill()

    threads = [threading.Thread(target=drive, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    for (d, argtypes), kernel in done:
        _install(d, argtypes, kernel)
    return {"jobs": len(jobs), "workers": n, "seconds": round(time.perf_counter() - started, 3),
            "compiled": len(done), "failed": failed}


def _install(dispatcher, argtypes: tuple, kernel) -> None:
    """What Dispatcher.compile does with a kernel it compiled: keep it, and save it to the disk cache."""
    from numba.cuda.core.compiler_lock import global_compiler_lock
    with global_compiler_lock:
        if argtypes not in dispatcher.overloads:
            dispatcher.add_overload(kernel, argtypes)
            dispatcher._cache.save_overload(argtypes, kernel)


def _write(stream, blob: bytes) -> None:
    stream.write(struct.pack("<Q", len(blob)) + blob)
    stream.flush()


def _read(stream) -> bytes:
    head = stream.read(8)
    if len(head) < 8:
        raise EOFError("the worker exited")
    n = struct.unpack("<Q", head)[0]
    blob = stream.read(n)
    if len(blob) < n:
        raise EOFError("the worker exited mid-answer")
    return blob


def _start_worker() -> subprocess.Popen:
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in sys.path if p and os.path.isdir(p)])
    return subprocess.Popen([sys.executable, "-m", "kernels_numba.precompile"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, cwd=root)


def serve() -> None:
    """A worker: read pickled (dispatcher, argtypes) jobs from stdin, compile each (no disk cache
    here), answer each with the pickled kernel or the error; the protocol has stdout to itself."""
    src = sys.stdin.buffer
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)                     # anything else printed goes to stderr, not into the answers
    sys.stdout = sys.stderr
    while True:
        try:
            blob = _read(src)
        except EOFError:
            return
        t = time.perf_counter()
        try:
            dispatcher, argtypes = pickle.loads(blob)
            kernel = dispatcher.compile(argtypes)
            answer = {"kernel": kernel, "seconds": round(time.perf_counter() - t, 3)}
            data = pickle.dumps(answer)
        except Exception as exc:   # noqa: BLE001 - reported to the caller, which compiles it itself
            data = pickle.dumps({"error": f"{type(exc).__name__}: {exc}"[:300]})
        _write(out, data)


if __name__ == "__main__":
    serve()
