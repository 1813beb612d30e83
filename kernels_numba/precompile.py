"""Compile many kernels at once, in worker processes, into the on-disk kernel cache (jit.py).

Numba compiles one kernel at a time (a process-wide lock) and a start with an empty cache spends
most of its seconds there. `recording()` runs a forward's host code with every kernel launch
recorded instead of run, and returns the (kernel, argument types) pairs that are neither compiled
in this process nor in the disk cache; `compile_in_workers` compiles those pairs in parallel in
fresh Python processes (each with its own CUDA context), which write them to the disk cache. The
real warm-up after it then loads every kernel from the cache.

Workers are plain subprocesses fed pickled kernels on stdin (no multiprocessing spawn, which would
re-import the user's __main__). Everything here is best effort: a kernel a worker fails to
compile is compiled by the caller when it is first launched, as without this module.
"""
from __future__ import annotations

import json
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
    """Compile `jobs` into the disk cache with up to `workers` processes, largest kernels first;
    returns {jobs, workers, seconds, compiled, failed: [(kernel, error)]}."""
    started = time.perf_counter()
    blobs: queue.SimpleQueue = queue.SimpleQueue()
    # the attention and GEMV factories compile the longest: start them first
    order = sorted(jobs, key=lambda j: ("flash" not in _name(j[0]), "gemv" not in _name(j[0])))
    for d, argtypes in order:
        try:
            blobs.put((_name(d), pickle.dumps((d, argtypes))))
        except Exception:   # noqa: BLE001 - an unpicklable kernel compiles in the caller on first launch
            pass
    n = max(0, min(workers, blobs.qsize()))
    results: list[dict] = []
    lock = threading.Lock()

    def drive() -> None:
        proc = _start_worker()
        try:
            while True:
                try:
                    name, blob = blobs.get_nowait()
                except queue.Empty:
                    return
                proc.stdin.write(struct.pack("<I", len(blob)) + blob)
                proc.stdin.flush()
                line = proc.stdout.readline()
                out = json.loads(line) if line else {"error": "the worker exited"}
                with lock:
                    results.append({"kernel": name, **out})
                if not line:
                    return
        finally:
            proc.stdin.close()
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()

    threads = [threading.Thread(target=drive, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    return {"jobs": len(jobs), "workers": n, "seconds": round(time.perf_counter() - started, 3),
            "compiled": sum("error" not in r for r in results),
            "failed": [(r["kernel"], r["error"]) for r in results if "error" in r]}


def _start_worker() -> subprocess.Popen:
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in sys.path if p and os.path.isdir(p)])
    return subprocess.Popen([sys.executable, "-m", "kernels_numba.precompile"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, cwd=root)


def serve() -> None:
    """A worker: read length-prefixed pickled (dispatcher, argtypes) jobs from stdin, compile each
    into the disk cache, answer one JSON line per job."""
    src, out = sys.stdin.buffer, sys.stdout
    while True:
        head = src.read(4)
        if len(head) < 4:
            return
        blob = src.read(struct.unpack("<I", head)[0])
        t = time.perf_counter()
        try:
            dispatcher, argtypes = pickle.loads(blob)
            dispatcher.enable_caching()
            dispatcher.compile(argtypes)
            answer = {"seconds": round(time.perf_counter() - t, 3)}
        except Exception as exc:   # noqa: BLE001 - reported to the caller, which compiles it itself
            answer = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        out.write(json.dumps(answer) + "\n")
        out.flush()


if __name__ == "__main__":
    serve()
