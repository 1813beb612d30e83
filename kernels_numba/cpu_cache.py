"""Numba's on-disk cache for the CPU kernels (cpu_*.py here): one directory, keyed by the CPU
kernel sources alone. Import it before any @njit(cache=CACHE) in those modules.

Why not Numba's default or kernels_numba.jit's directory: Numba stamps a function's cache with a
hash of its own file only, and these kernels call across cpu_*.py (cpu_dense -> cpu_quant,
cpu_layers), so an edit of a callee's file would load stale code; jit.py keys its directory by
every kernel module, so any CUDA kernel edit (quant_*.py, ...) recompiled every CPU kernel (about
a minute on 2 cores), and it applied only when something had imported jit.py first. Here a locator
placed first in Numba's list claims the cpu_*.py files: their cache lives in
$XDG_CACHE_HOME/metrale/cpu-kernels/ (~/.cache/...), whichever checkout they come from, and each
index is stamped with a hash of all of cpu_*.py, so a change to any of them (and only to them)
starts afresh (two checkouts of different sources overwrite each other's entries: a recompile,
never stale code); Numba's index also keys the Numba and Python versions, the signature and the
CPU's name and features.
METRALE_KERNEL_CACHE=0 turns the cache off; NUMBA_CACHE_DIR, when set, is left to Numba.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

from numba.core import caching

CACHE = os.environ.get("METRALE_KERNEL_CACHE", "1") != "0"
_HERE = Path(__file__).resolve().parent


def _sources() -> list[Path]:
    return sorted(_HERE.glob("cpu_*.py"))


def sources_hash() -> str:
    h = hashlib.sha256()
    for path in _sources():
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "metrale" / "cpu-kernels"


class CpuKernelLocator(caching._CacheLocator):
    """Numba cache locator for functions defined in kernels_numba/cpu_*.py."""

    _stamp: str | None = None

    def __init__(self, py_func, py_file):
        self._py_file = py_file
        self._lineno = py_func.__code__.co_firstlineno
        self._cache_path = str(cache_dir())     # not keyed by the checkout's path: the stamp is the
                                                # sources' content, so a fresh clone (CI) finds it

    def get_cache_path(self):
        return self._cache_path

    def get_source_stamp(self):
        if CpuKernelLocator._stamp is None:
            CpuKernelLocator._stamp = sources_hash()
        return CpuKernelLocator._stamp

    def get_disambiguator(self):
        return str(self._lineno)

    @classmethod
    def from_function(cls, py_func, py_file):
        path = Path(py_file).resolve()
        if os.environ.get("NUMBA_CACHE_DIR") or path.parent != _HERE or not path.name.startswith("cpu_"):
            return None
        self = cls(py_func, py_file)
        try:
            self.ensure_cache_path()
        except OSError:
            return None                     # not writable: Numba's other locators decide
        return self


_IMPL = getattr(caching, "CacheImpl", None) or caching._CacheImpl    # older Numba: _CacheImpl
if CpuKernelLocator not in _IMPL._locator_classes:
    _IMPL._locator_classes.insert(0, CpuKernelLocator)
