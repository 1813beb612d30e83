"""The stand-in CudaBackend that QuantOps + CudaOps run on under the simulator (test_quant_ops_sim,
test_fp8_ops_sim): the activation buffers, the quant scratch and the flags those ops read."""
from types import SimpleNamespace

import numpy as np
from numba import cuda

EPS = 1e-5


class StandinBackend:
    """What CudaOps and QuantOps read of a CudaBackend, for T rows of K inputs and N outputs."""

    def __init__(self, T: int, N: int, K: int, scratch_elems: int, overlap: bool = False, mma_rows: int = 0,
                 ffn: int = 64):
        self.fuse_decode, self.carry_norm_sums, self.overlap = True, False, overlap
        self.quant_mma_rows = mma_rows
        self.skinny_max_t = 1            # rows > 1: gemm.linear's FMA path (FMA_MAX_T raised by the tests)
        z = lambda *s: cuda.to_device(np.zeros(s, np.float32))  # noqa: E731
        self.act = {"h": z(T, K), "rows": z(T, K), "residual": z(T, K), "act": z(T, ffn), f"out{N}": z(T, N),
                    "argmax": cuda.to_device(np.array([7, 3, 1], np.int32))}
        self.quant_scratch = cuda.device_array(scratch_elems, np.uint16)

    def blas_takes(self, rows, weight):
        return False

    def view(self, name, n, shape=None):
        v = self.act[name][:n]
        return v if shape is None else v.reshape(shape)

    def quant_scratch_view(self, n, k):
        return self.quant_scratch[:n * k].reshape(n, k)


def quant_ops(T: int, N: int, K: int, scratch_elems: int, overlap: bool = False, token_ids=None, token_src=None,
              mma_rows: int = 0, ffn: int = 64):
    """CudaOps with QuantOps composed in front, on a StandinBackend."""
    from metrale.models.families import compose_ops
    from metrale.runtime.cuda.quant import QuantOps
    from metrale.runtime.cuda_backend import CudaOps
    ops = object.__new__(compose_ops(CudaOps, (QuantOps,)))
    ops.b, ops.s = StandinBackend(T, N, K, scratch_elems, overlap, mma_rows, ffn), 0
    ops.cfg = SimpleNamespace(rms_norm_eps=EPS)
    ops.g = SimpleNamespace(tokens=T)
    ops._ss_used, ops._resid_ss, ops.rows_ptr = 0, None, -1
    if token_ids is not None:
        ops.token_ids, ops.token_src = cuda.to_device(token_ids), cuda.to_device(token_src)
    return ops
