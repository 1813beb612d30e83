"""Timing of single kernel launches on the legacy default stream: a GPU sleep is queued first so
that the timed launches queue up behind it and run back to back (Python's launch cost hidden);
each launch sits between two CUDA events; the median interval is the figure."""
from __future__ import annotations

import numpy as np
from numba import cuda


@cuda.jit
def _spin(n):
    for _ in range(n):
        cuda.nanosleep(np.uint32(1000))


def time_launches(launch, n_rot: int = 1, iters: int = 50, warmup: int = 3) -> float:
    """Median ms of one launch(i) (i: rotation index in [0, n_rot), e.g. which weight copy)."""
    for i in range(warmup):
        launch(i % n_rot)
    cuda.synchronize()
    evs = [cuda.event() for _ in range(iters + 1)]
    _spin[1, 1](20000)  # ~20 ms, longer than enqueueing the launches from Python
    evs[0].record(0)
    for i in range(iters):
        launch(i % n_rot)
        evs[i + 1].record(0)
    evs[-1].synchronize()
    return float(np.median([cuda.event_elapsed_time(evs[i], evs[i + 1]) for i in range(iters)]))
