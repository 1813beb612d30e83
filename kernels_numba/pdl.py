"""Programmatic dependent launch (PDL, sm_90+) for the kernels that opt in.

Inside a CUDA graph, consecutive kernels still pay ~1-2 us each: the next grid is launched only
after the previous one has drained and flushed, then its CTAs ramp up. With PDL the next grid is
launched early (when every CTA of the previous grid has called `grid_trigger()` or exited), its
CTAs sit at `griddepcontrol.wait` and start the moment the previous grid's memory is visible.

A kernel opts in by calling `ptx.grid_wait()` as its first statement (and `ptx.grid_trigger()` right
after it, so that its own successor may launch early; `ptx.grid_trigger_late()` after its main loop
for the `late` mode). Numba's launcher cannot set launch
attributes, so `enable(True)` wraps numba-cuda's `_Kernel.launch`: a kernel whose Python code
names `grid_wait` is launched through cuda.core with `programmatic_stream_serialization=True`;
every other kernel (and every kernel while PDL is off) goes through Numba's own launch. A kernel
without the wait must never get the attribute: it could read its predecessor's output early.

Stream capture turns the attribute into programmatic graph edges, so captured decode graphs keep
it. Under the simulator, or without cuda.core's PDL field, `enable` does nothing and says so.
"""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)

_state = {"on": False, "patched": False}
_OPTED_IN: dict[int, bool] = {}          # id(py_func) -> whether its code calls grid_wait


def opted_in(py_func) -> bool:
    """A kernel takes PDL iff its code names grid_wait (the convention: its first statement)."""
    key = id(py_func)
    hit = _OPTED_IN.get(key)
    if hit is None:
        hit = _OPTED_IN[key] = "grid_wait" in getattr(getattr(py_func, "__code__", None), "co_names", ())
    return hit


def supported() -> bool:
    """cuda.core can set the attribute, and the current device is sm_90 or newer."""
    from kernels_numba.ptx import SIM
    if SIM:
        return False
    try:
        from cuda.core import LaunchConfig
        LaunchConfig(grid=1, block=1, programmatic_stream_serialization=True)
        from numba import cuda
        return cuda.get_current_device().compute_capability >= (9, 0)
    except Exception as e:  # old cuda.core, no GPU
        log.info("programmatic dependent launch unavailable: %s", e)
        return False


def set_trigger(mode: str) -> None:
    """Which trigger kernels compiled from now on carry (Numba keeps the ones already compiled):
    `early` grid_trigger() right after the wait, `late` grid_trigger_late() after the main loop,
    `exit` none (the successor launches as the blocks exit). Measured on the H200 (graph replay,
    levers.pdl on): early triggers help Llama-3-8B (B=1 4.90 -> 4.77 ms, B=32 6.45 -> 6.37 ms) and
    cost SmolLM2-135M at B=1 (0.875 -> 0.998 ms: its kernels are a few microseconds; waiting blocks
    parked early only get in the way)."""
    from kernels_numba import ptx
    if mode not in ptx.TRIGGER_MODES:
        raise ValueError(f"PDL trigger mode must be one of {ptx.TRIGGER_MODES}, not '{mode}'")
    if hasattr(ptx, "TRIGGER"):
        ptx.TRIGGER["mode"] = mode


def enabled() -> bool:
    return _state["on"]


def enable(on: bool) -> bool:
    """Turn PDL launches on or off process-wide; returns whether they are on now."""
    if on and not supported():
        on = False
    if on and not _state["patched"]:
        _patch()
    _state["on"] = bool(on)
    return _state["on"]


def _patch() -> None:
    from cuda.core import LaunchConfig, launch
    from numba.cuda import dispatcher

    numba_launch = dispatcher._Kernel.launch

    def launch_maybe_pdl(self, args, griddim, blockdim, stream=0, sharedmem=0):
        if not (_state["on"] and not self.debug and opted_in(self.py_func)):
            return numba_launch(self, args, griddim, blockdim, stream, sharedmem)
        # numba-cuda 0.30's _Kernel.launch, non-debug path, with one more launch attribute
        retr, kernelargs = [], []
        for t, v in zip(self.argument_types, args):
            self._prepare_args(t, v, stream, retr, kernelargs)
        config = LaunchConfig(grid=griddim, block=blockdim, shmem_size=sharedmem,
                              is_cooperative=self.cooperative, programmatic_stream_serialization=True)
        launch(stream, config, self._codelibrary.get_cufunc().kernel, *kernelargs)
        for wb in retr:
            wb()

    numba_add_overload = dispatcher.CUDADispatcher.add_overload

    def add_overload_with_py_func(self, kernel, argtypes):
        if getattr(kernel, "py_func", None) is None:   # loaded from the disk cache: no py_func
            kernel.py_func = self.py_func
        return numba_add_overload(self, kernel, argtypes)

    dispatcher._Kernel.launch = launch_maybe_pdl
    dispatcher.CUDADispatcher.add_overload = add_overload_with_py_func
    _state["patched"] = True
