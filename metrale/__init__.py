"""metrale: an LLM inference engine in Python (Numba CUDA kernels, cuda-python graphs, Hydra levers)."""
import os as _os

# Decode-sized matmuls on few cores run 10-30x slower with OpenBLAS threading than without
# (measured: a 3072x576 GEMV took 8 ms with 2 threads, 0.3 ms with 1). Only a default: a value
# the user set wins, and it has no effect if NumPy was imported first.
_os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from metrale.engine import Engine  # noqa: E402
from metrale.outputs import RequestOutput, StreamDelta  # noqa: E402
from metrale.sampling.params import InvalidRequestError, SamplingParams  # noqa: E402

__all__ = ["Engine", "SamplingParams", "RequestOutput", "StreamDelta", "InvalidRequestError"]
__version__ = "0.1.0"
