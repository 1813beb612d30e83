"""Peak host memory of a process tree (Linux /proc, no psutil): a thread samples the summed RSS of
a root process and all its descendants (a local Ray cluster: the driver, GCS, raylet, workers,
replica actors) and the host's used memory (MemTotal - MemAvailable), keeping the peaks.

    with TreeMemory() as mem:          # this process's tree, sampled every 0.1 s
        ...
    mem.summary()                      # {"peak_tree_rss_mb": ..., "peak_host_used_mb": ..., ...}
    peak_rss_mb(pid)                   # one process's own high-water mark (VmHWM)
"""
from __future__ import annotations

import os
import threading
from pathlib import Path

PROC = Path("/proc")


def _status_kb(pid: int, key: str) -> int:
    """A `key:` line of /proc/<pid>/status in kB (0 if the process is gone or has none)."""
    try:
        for line in (PROC / str(pid) / "status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process now."""
    out = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            out[int(entry.name)] = int(stat[stat.rindex(")") + 2:].split()[1])   # after "(comm) state"
        except (OSError, ValueError, IndexError):
            continue
    return out


def tree(root: int) -> list[int]:
    """root and every descendant of it."""
    children: dict[int, list[int]] = {}
    for pid, ppid in _parents().items():
        children.setdefault(ppid, []).append(pid)
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def host_used_mb() -> float:
    info = {}
    for line in (PROC / "meminfo").read_text().splitlines():
        key, _, rest = line.partition(":")
        info[key] = int(rest.split()[0])
    return (info["MemTotal"] - info["MemAvailable"]) / 1024


def peak_rss_mb(pid: int) -> float:
    """One process's peak resident set (VmHWM) so far."""
    return _status_kb(pid, "VmHWM") / 1024


class TreeMemory:
    """Samples a process tree's summed RSS and the host's used memory every `period_s` until closed."""

    def __init__(self, root: int | None = None, period_s: float = 0.1):
        self.root, self.period_s = root or os.getpid(), period_s
        self.base_host_mb = host_used_mb()
        self.peak_tree_mb = self.peak_host_mb = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tree-memory", daemon=True)

    def sample(self) -> None:
        rss = sum(_status_kb(pid, "VmRSS") for pid in tree(self.root)) / 1024
        self.peak_tree_mb = max(self.peak_tree_mb, rss)
        self.peak_host_mb = max(self.peak_host_mb, host_used_mb())

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.sample()

    def __enter__(self) -> "TreeMemory":
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sample()

    def summary(self) -> dict:
        """Peaks in MB: the tree's summed RSS (shared pages count once per process), the host's used
        memory, and that less what was used when sampling began."""
        return {"peak_tree_rss_mb": round(self.peak_tree_mb, 1), "peak_host_used_mb": round(self.peak_host_mb, 1),
                "peak_host_added_mb": round(self.peak_host_mb - self.base_host_mb, 1)}
