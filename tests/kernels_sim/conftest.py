"""Simulator tests: run by tests/test_kernels_sim.py in a subprocess with NUMBA_ENABLE_CUDASIM=1.

The simulator runs each CUDA thread as a Python thread and polls them at every barrier; a short
GIL switch interval makes barrier-heavy kernels several times faster.
"""
import os
import sys

if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
    sys.setswitchinterval(1e-4)
