"""Autotune picks kept on disk, so a later start takes them without timing candidates again.

Pure Python (no CUDA): `CublasLt` (cublaslt.py) gives it a context (GPU, libraries, the tuning
setup) and a key per problem, and this module keeps, per key, the index of the picked candidate in
the heuristic's list, the length of that list and a fingerprint of the picked algorithm (its
configuration attributes). A later start queries the heuristic again (the same descriptors on the
same GPU and library return the same list) and takes the stored index only when the count and the
fingerprint at that index both match (`PickStore.resolve`); anything else is a miss and is timed
again, so a stale or foreign entry costs a re-tune, never a wrong algorithm.

One JSON file per context, named by the context's hash, in `cache_root()/cublaslt/` (beside the
kernel caches of kernels_numba/jit.py and cpu_cache.py): {"format", "context", "picks": {key:
{"index", "count", "algo"}}}. A file whose format or context differs, or that does not parse, is
ignored (and rewritten by the next pick). Writes hold an advisory lock on a sibling `.lock` file
while they read the file, merge their pick in and replace it (temp file + os.replace), so engine
processes starting together keep each other's picks. Delete the directory to forget every pick.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

log = logging.getLogger("metrale.cuda")

FORMAT = 1


def cache_root() -> Path:
    """metrale's cache directory ($XDG_CACHE_HOME/metrale, else ~/.cache/metrale), as kernels_numba's."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "metrale"


def default_dir() -> Path:
    return cache_root() / "cublaslt"


@dataclass(frozen=True)
class Pick:
    index: int                  # the picked candidate's place in the heuristic's list
    count: int                  # how many candidates that list held
    algo: tuple[int, ...]       # the picked algorithm's fingerprint

    def to_json(self) -> dict:
        return {"index": self.index, "count": self.count, "algo": list(self.algo)}

    @staticmethod
    def from_json(obj: Any) -> Pick | None:
        """The pick an entry of the file describes, or None if it is malformed."""
        try:
            index, count, algo = obj["index"], obj["count"], obj["algo"]
            if not all(type(v) is int for v in (index, count, *algo)) or not 0 <= index < count:
                return None
            return Pick(index, count, tuple(algo))
        except (KeyError, TypeError):
            return None


def _canonical(context: dict) -> str:
    return json.dumps(context, sort_keys=True, separators=(",", ":"))


class PickStore:
    """The picks of one context (a JSON-serializable dict: GPU, library versions, tuning setup)."""

    def __init__(self, context: dict, directory: str | os.PathLike | None = None) -> None:
        self.context = json.loads(_canonical(context))     # what the file holds, for the comparison
        digest = hashlib.sha256(_canonical(context).encode()).hexdigest()[:20]
        self.path = Path(directory if directory is not None else default_dir()) / f"{digest}.json"
        self._picks: dict[str, Pick] | None = None          # loaded on first use
        self.writable = True

    def _read(self) -> dict[str, Pick]:
        """The file's picks when it parses and belongs to this context, else none."""
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):       # missing, unreadable, not JSON (UnicodeDecodeError included)
            return {}
        if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("context") != self.context:
            return {}
        picks = data.get("picks")
        if not isinstance(picks, dict):
            return {}
        out = {}
        for key, entry in picks.items():
            pick = Pick.from_json(entry)
            if pick is not None:
                out[str(key)] = pick
        return out

    def picks(self) -> dict[str, Pick]:
        if self._picks is None:
            self._picks = self._read()
        return self._picks

    def get(self, key: str) -> Pick | None:
        return self.picks().get(key)

    def resolve(self, key: str, count: int, algo_of: Callable[[int], tuple[int, ...]]) -> int | None:
        """The stored index for `key` when the heuristic's list again holds `count` candidates and
        the one at that index has the stored fingerprint (algo_of(index)); None: tune again."""
        pick = self.get(key)
        if pick is None or pick.count != count or not 0 <= pick.index < count:
            return None
        try:
            if tuple(algo_of(pick.index)) != pick.algo:
                return None
        except Exception:  # an unreadable candidate: tune again
            return None
        return pick.index

    def put(self, key: str, pick: Pick) -> bool:
        """Keep `pick` for `key`: merged into the file's current picks under the lock and written
        atomically. False (and no more writes from this store) when the directory is not writable."""
        picks = self.picks()
        picks[key] = pick
        if not self.writable:
            return False
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with _locked(self.path.with_suffix(".lock")):
                merged = self._read()
                merged[key] = pick
                self._write(merged)
        except OSError as exc:
            log.debug("cuBLASLt picks not saved to %s: %s", self.path, exc)
            self.writable = False
            return False
        for k, p in merged.items():          # other processes' picks are taken too
            picks.setdefault(k, p)
        return True

    def _write(self, picks: dict[str, Pick]) -> None:
        data = {"format": FORMAT, "context": self.context,
                "picks": {k: p.to_json() for k, p in sorted(picks.items())}}
        fd, tmp = tempfile.mkstemp(prefix=self.path.name + ".", suffix=".tmp", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1)
            os.replace(tmp, self.path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive advisory lock on `path` (created if missing) for the block; without fcntl (not
    POSIX) no lock: a concurrent writer may then drop a pick, which is timed again next start."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)       # closing releases the lock
