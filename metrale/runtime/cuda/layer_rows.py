"""Layer rows: the residual stream after chosen layers, for every token of a CUDA forward, kept in a
device buffer (a DFlash drafter's context: metrale/spec/dflash_cuda.py). Off unless a drafter asks
(CudaBackend.keep_layer_rows); then each tapped layer adds one row-copy launch to the forward.

The buffer is [max_tokens * n, hidden] float32 with token t's copy of tapped layer j at row
t * n + j, so that rows [a, a + T) of `matrix()` ([max_tokens, n * hidden]) are the T tokens'
concatenated layer rows, the input of the drafter's fc product."""
from __future__ import annotations

import numpy as np


class LayerRows:
    """The device buffer and the index arrays of its row copies (kernels_numba.mtp_head.copy_rows)."""

    def __init__(self, layers: tuple[int, ...], max_tokens: int, hidden: int):
        from numba import cuda
        self.layers = tuple(int(i) for i in layers)
        self.column = {layer: j for j, layer in enumerate(self.layers)}
        n = len(self.layers)
        self.max_tokens, self.hidden = int(max_tokens), int(hidden)
        self.buffer = cuda.to_device(np.zeros((self.max_tokens * n, self.hidden), np.float32))
        t = np.arange(self.max_tokens, dtype=np.int32)
        self.src = cuda.to_device(t)
        self.dst = cuda.to_device(np.stack([t * n + j for j in range(n)]).astype(np.int32))
        self._views: dict = {}

    @property
    def nbytes(self) -> int:
        return self.buffer.nbytes + self.src.nbytes + self.dst.nbytes

    def _view(self, key: tuple, make):
        v = self._views.get(key)
        if v is None:
            v = self._views[key] = make()
        return v

    def copy(self, residual, layer: int, tokens: int, stream) -> None:
        """The residual rows [0, tokens) after `layer` (one of self.layers) into the buffer."""
        from kernels_numba.mtp_head import copy_rows
        j = self.column[layer]
        copy_rows(residual, self._view(("src", tokens), lambda: self.src[:tokens]), self.buffer,
                  self._view(("dst", j, tokens), lambda: self.dst[j, :tokens]), stream=stream)

    def matrix(self, start: int, tokens: int):
        """Tokens [start, start + tokens) as [tokens, n * hidden] (layer j at columns j * hidden..)."""
        n = len(self.layers)
        return self._view(("matrix", start, tokens), lambda: self.buffer[start * n:(start + tokens) * n]
                          .reshape(tokens, n * self.hidden))


class LayerRowsOps:
    """CudaOps mixin: each dense layer of llama_forward ends with one mlp_residual; after the
    tapped ones, the residual rows of every token of the step go to the backend's LayerRows."""

    def __init__(self, backend, g):
        super().__init__(backend, g)
        self._layer = 0

    def mlp_residual(self, residual, norm_weight, gate_up, down):
        out = super().mlp_residual(residual, norm_weight, gate_up, down)
        rows = self.b.layer_rows
        if self._layer in rows.column:
            rows.copy(out, self._layer, self.g.tokens, self.s)
        self._layer += 1
        return out
