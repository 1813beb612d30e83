"""Simulator tests: run by tests/test_kernels_sim.py in a subprocess with NUMBA_ENABLE_CUDASIM=1.

The simulator runs each CUDA thread as a Python thread and polls them at every barrier; a short
GIL switch interval makes barrier-heavy kernels several times faster.
"""
import os
import sys

if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
    sys.setswitchinterval(1e-4)

    # numba-cuda's simulator makes a shared array on first use with an unlocked get-then-set of its
    # per-block dict (kernelapi.FakeCUDAShared.array): with the short switch interval two threads of a
    # block can both miss and get different "shared" arrays, and a block reduction then reads
    # garbage (seen: test_bf16_sim's argmax, a GDN clamp, a sampling threshold, about 1 run in 5).
    # The same lookup under a lock:
    import threading
    import traceback

    import numpy as _np
    from numba.core import types as _types
    from numba.cuda.simulator import kernelapi as _kernelapi
    from numba.np import numpy_support as _numpy_support

    _shared_lock = threading.Lock()
    _unlocked_array = _kernelapi.FakeCUDAShared.array

    def _locked_shared_array(self, shape, dtype, alignment=None):
        if alignment is not None or shape == 0:
            return _unlocked_array(self, shape, dtype, alignment)
        if isinstance(dtype, _types.Type):
            dtype = _numpy_support.as_dtype(dtype)
        caller = traceback.extract_stack(sys._getframe())[-2][0:2]
        with _shared_lock:
            res = self._allocations.get(caller)
            if res is None:
                res = _np.empty(shape, dtype)
                self._allocations[caller] = res
        return res

    _kernelapi.FakeCUDAShared.array = _locked_shared_array
