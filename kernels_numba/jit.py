"""`cuda.jit` with Numba's on-disk cache, so a second start loads the compiled kernels instead of
compiling them again.

Numba keys a cached kernel on its own bytecode (and closure values), not on the device functions it
calls from other modules: the cache directory is therefore keyed by a hash of every module here,
so any kernel source change starts a fresh cache. METRALE_KERNEL_CACHE=0 turns the cache off;
NUMBA_CACHE_DIR, when set, is used as it is.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

from numba import cuda

CACHE = os.environ.get("METRALE_KERNEL_CACHE", "1") != "0"


def sources_hash() -> str:
    h = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    import numba_cuda
    h.update(numba_cuda.__version__.encode())
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "metrale" / "kernels" / sources_hash()


def _configure() -> None:
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":   # the simulator compiles nothing (and importing
        return                                          # the real target's config would break it)
    from numba.cuda.core import config
    if CACHE and not config.CACHE_DIR:
        config.CACHE_DIR = str(cache_dir())


_configure()


def kernel(func=None, **options):
    """cuda.jit for kernels (not device functions): cached on disk unless the cache is off."""
    if func is None:
        return lambda f: cuda.jit(f, cache=CACHE, **options)
    return cuda.jit(func, cache=CACHE, **options)
