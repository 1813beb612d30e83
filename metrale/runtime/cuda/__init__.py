"""CUDA runtime for metrale: one device memory pool, streams/events and CUDA graphs (exported
here), and the device cache kinds (pages.py, state_pool.py: imported by the backend on use).

Built on cuda-python's driver API, shared with Numba (`numba.cuda`) kernels through Numba's
primary context and external streams. The pool, streams and graphs import nothing else from
metrale; nothing here touches a driver at import time (CPU-only machines import it fine).
"""

from .errors import CudaError, check, cu
from .graph import CudaGraph, GraphCache, batch_ladder, pick_size
from .pool import (ALIGN, Arena, DevicePool, RegionUsage, align_up, free_device_memory,
                   kv_pool_bytes, plan_regions)
from .stream import Event, Stream

__all__ = ["ALIGN", "Arena", "CudaError", "CudaGraph", "DevicePool", "Event", "GraphCache",
           "RegionUsage", "Stream", "align_up", "batch_ladder", "check", "cu",
           "free_device_memory", "kv_pool_bytes", "pick_size", "plan_regions"]
