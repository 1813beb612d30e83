"""CUDA graphs of Numba kernel launches: capture once, replay for ~1 µs a kernel.

Owns: `CudaGraph` (capture a callable's launches on a `Stream`, instantiate, replay) and
`GraphCache` (one graph per padded batch size of a ladder, replay the smallest that fits).

Capture rules (what the captured callable `fn` must obey):
- It is run `warmup` times eagerly first, so every Numba kernel is compiled and its module
  loaded before capture; a launch signature not seen in warm-up compiles during capture and fails.
- Only Numba device arrays (e.g. from `DevicePool`) and scalars may be passed to kernels inside it:
  a host NumPy array makes Numba copy and synchronize, which breaks the capture.
- Everything it launches goes on the capturing stream (`stream.numba`); no synchronize, no
  `copy_to_host`, no `cuda.to_device`, no allocation (Numba cleanup is deferred during capture);
  no kernels built with `debug=True` (they read an error flag back to the host after each launch).
- Argument values are frozen into the graph: pointers and scalars are those of the capture run.
  Inputs that change between replays are written into the same device buffers (allocate them at
  the largest size, outside any arena that is reset, and slice views of them), and any per-step
  count a kernel needs must be read from device memory, not passed as a scalar.
- Its allocations from an `Arena` must be deterministic: reset the arena at the start of `fn`.
"""

from __future__ import annotations

import bisect
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from .errors import CudaError, check, cu, driver, ensure_context
from .stream import Stream

_MODES = {"global": "CU_STREAM_CAPTURE_MODE_GLOBAL",
          "thread_local": "CU_STREAM_CAPTURE_MODE_THREAD_LOCAL",
          "relaxed": "CU_STREAM_CAPTURE_MODE_RELAXED"}

_CAPTURE_HINT = ("the captured callable did something illegal during capture: only device arrays "
                 "and scalars may be passed to kernels, all launches on the capturing stream, "
                 "no synchronize/copies/allocation; see metrale/runtime/cuda/graph.py")


def _instantiate(graph: Any) -> Any:
    """`cuGraphInstantiate` across cuda-python versions: 12/13 take (graph, flags) and return the
    exec; 11 took (graph, log size) and returned (exec, error node, log)."""
    drv = driver()
    if hasattr(drv, "cuGraphInstantiateWithFlags"):  # 12.x: the flags form under its own name
        return cu("cuGraphInstantiateWithFlags", graph, 0)
    values = cu("cuGraphInstantiate", graph, 0)
    return values[0] if isinstance(values, tuple) else values


def _destroy_graph(graph: Any, exec_: Any) -> None:
    try:
        driver().cuGraphExecDestroy(exec_)
        driver().cuGraphDestroy(graph)
    except Exception:  # the context may already be gone at interpreter exit
        pass


class CudaGraph:
    """An instantiated CUDA graph bound to the stream it was captured on."""

    def __init__(self, graph: Any, exec_: Any, stream: Stream) -> None:
        self.graph, self.exec, self.stream = graph, exec_, stream
        self._launch = driver().cuGraphLaunch
        self._finalizer = weakref.finalize(self, _destroy_graph, graph, exec_)
        self._finalizer.atexit = False

    @classmethod
    def capture(cls, stream: Stream, fn: Callable[[], Any], *, warmup: int = 1,
                mode: str = "thread_local") -> CudaGraph:
        """Run `fn` `warmup` times eagerly, then capture its launches on `stream` into a graph.

        `fn` launches Numba kernels on `stream.numba` and obeys the capture rules (module doc).
        """
        if mode not in _MODES:
            raise ValueError(f"capture mode {mode!r}; valid: {list(_MODES)}")
        ctx = ensure_context()
        for _ in range(warmup):
            fn()
        stream.synchronize()
        ctx.deallocations.clear()  # free Numba's pending deallocations now, not during capture
        drv = driver()
        with ctx.defer_cleanup():
            cu("cuStreamBeginCapture", stream.handle, getattr(drv.CUstreamCaptureMode, _MODES[mode]))
            try:
                fn()
            except BaseException:
                result = drv.cuStreamEndCapture(stream.handle)  # leave the stream usable
                if int(result[0]) == 0 and int(result[1]):
                    drv.cuGraphDestroy(result[1])
                raise
            result = drv.cuStreamEndCapture(stream.handle)
        if int(result[0]) != 0:
            raise CudaError("cuStreamEndCapture", int(result[0]), _CAPTURE_HINT)
        graph = check("cuStreamEndCapture", result)
        try:
            exec_ = _instantiate(graph)
        except BaseException:
            drv.cuGraphDestroy(graph)
            raise
        self = cls(graph, exec_, stream)
        cu("cuGraphUpload", exec_, stream.handle)  # pay the first-launch setup now
        return self

    def replay(self, stream: Stream | None = None) -> None:
        """Launch the graph on its stream (or `stream`); asynchronous like a kernel launch."""
        err = self._launch(self.exec, (stream or self.stream).handle)
        if int(err[0] if isinstance(err, tuple) else err):
            check("cuGraphLaunch", err)

    def nodes(self) -> list[Any]:
        count = cu("cuGraphGetNodes", self.graph, 0)[1]
        return list(cu("cuGraphGetNodes", self.graph, count)[0]) if count else []

    @property
    def num_nodes(self) -> int:
        return int(cu("cuGraphGetNodes", self.graph, 0)[1])

    def node_types(self) -> Counter[str]:
        """Node kinds, e.g. {'CU_GRAPH_NODE_TYPE_KERNEL': 100}: a memcpy here means a host copy leaked in."""
        return Counter(cu("cuGraphNodeGetType", node).name for node in self.nodes())

    def close(self) -> None:
        self._finalizer()


def batch_ladder(max_batch: int, step: int = 0) -> list[int]:
    """Sizes to capture: powers of two up to `max_batch` (and `max_batch` itself); with `step`,
    powers of two below `step`, then multiples of `step` (vLLM's 1, 2, 4, 8, 16, 24, ...)."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    sizes, size = [], 1
    while size < max_batch and (not step or size < step):
        sizes.append(size)
        size *= 2
    if step:
        sizes.extend(range(step, max_batch, step))
    sizes.append(max_batch)
    return sorted(set(sizes))


def pick_size(sizes: Sequence[int], batch: int) -> int | None:
    """The smallest of the sorted `sizes` >= `batch`, or None when `batch` exceeds them all."""
    i = bisect.bisect_left(sizes, batch)
    return sizes[i] if i < len(sizes) else None


class GraphCache:
    """One `CudaGraph` per captured batch size; `replay(batch)` runs the smallest size >= batch.

    The caller pads its batch to the returned size (rows past `batch` hold padding whose results
    are ignored).
    """

    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self._graphs: dict[int, CudaGraph] = {}
        self._sizes: list[int] = []

    @property
    def sizes(self) -> list[int]:
        return list(self._sizes)

    def capture(self, size: int, fn: Callable[[], Any], *, warmup: int = 1,
                mode: str = "thread_local") -> CudaGraph:
        graph = CudaGraph.capture(self.stream, fn, warmup=warmup, mode=mode)
        if size in self._graphs:
            self._graphs[size].close()
        else:
            bisect.insort(self._sizes, size)
        self._graphs[size] = graph
        return graph

    def capture_all(self, sizes: Iterable[int], make_fn: Callable[[int], Callable[[], Any]], *,
                    warmup: int = 1, mode: str = "thread_local") -> None:
        """Capture `make_fn(size)` for every size, largest first."""
        for size in sorted(set(sizes), reverse=True):
            self.capture(size, make_fn(size), warmup=warmup, mode=mode)

    def lookup(self, batch: int) -> tuple[int, CudaGraph] | None:
        size = pick_size(self._sizes, batch)
        return None if size is None else (size, self._graphs[size])

    def replay(self, batch: int) -> int:
        """Replay the graph for `batch` and return the padded size it was captured for."""
        found = self.lookup(batch)
        if found is None:
            raise KeyError(f"no graph for batch {batch}; captured sizes: {self._sizes}")
        found[1].replay()
        return found[0]

    def __contains__(self, batch: int) -> bool:
        return pick_size(self._sizes, batch) is not None

    def __len__(self) -> int:
        return len(self._graphs)

    def close(self) -> None:
        for graph in self._graphs.values():
            graph.close()
        self._graphs.clear()
        self._sizes.clear()
