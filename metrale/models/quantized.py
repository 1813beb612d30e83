"""Weights kept in a GGUF file's own block layout: the host-side value both quantized paths
(the Numba CPU kernels and the CUDA kernels) read, and its float32 reference (gguf's dequantize)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from metrale.models.fp8 import FP8_E4M3, FP8Tensor

# The block types Q4_K_M, Q5_K_M, Q6_K and Q8_0 files hold, and the legacy 4/5-bit ones.
BLOCK_TYPES = tuple(GGMLQuantizationType[n] for n in
                    ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"))


@dataclass(frozen=True)
class QuantizedPart:
    """Rows [rows, cols] of one block type: data is uint8 [rows, bytes_per_row], the file's bytes."""
    ggml_type: GGMLQuantizationType
    rows: int
    cols: int
    data: np.ndarray

    def __post_init__(self) -> None:
        block, nbytes = GGML_QUANT_SIZES[self.ggml_type]
        if self.cols % block:
            raise ValueError(f"{self.ggml_type.name}: {self.cols} columns is not a multiple of its {block}-wide blocks")
        want = (self.rows, self.cols // block * nbytes)
        if self.data.dtype != np.uint8 or self.data.shape != want:
            raise ValueError(f"{self.ggml_type.name}: data must be uint8 {want}, got {self.data.dtype} {self.data.shape}")

    def dequantize(self) -> np.ndarray:
        import gguf
        return np.ascontiguousarray(gguf.quants.dequantize(self.data, self.ggml_type), dtype=np.float32)

    def repack(self) -> dict:
        """The planes the CUDA kernels read (kernels_numba.quant_layout.repack): uint8 arrays
        'qs', 'qh', 'sc', 'dm' (None where the type has no such plane), as many bytes as data."""
        from kernels_numba.quant_layout import repack
        return repack(int(self.ggml_type), self.data, self.cols)


@dataclass(frozen=True)
class QuantizedTensor:
    """A weight matrix [rows, cols] as row-stacked parts (the fused qkv of a Q4_K_M file is Q4_K q
    and k above Q6_K v). A product with it computes each part's output rows from that part."""
    parts: tuple[QuantizedPart, ...]

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.rows for p in self.parts), self.parts[0].cols

    @property
    def nbytes(self) -> int:
        return sum(p.data.nbytes for p in self.parts)

    def dequantize(self) -> np.ndarray:
        return np.concatenate([p.dequantize() for p in self.parts])

    @staticmethod
    def stack(tensors: list["QuantizedTensor"]) -> "QuantizedTensor":
        cols = {t.shape[1] for t in tensors}
        if len(cols) != 1:
            raise ValueError(f"row-stacked tensors need one column count, got {sorted(cols)}")
        return QuantizedTensor(tuple(p for t in tensors for p in t.parts))


def from_gguf_tensor(tensor) -> QuantizedTensor:
    """A gguf.ReaderTensor of a block type as a QuantizedTensor (its bytes stay in the file's memory map)."""
    kind = GGMLQuantizationType(int(tensor.tensor_type))
    if kind not in BLOCK_TYPES:
        raise ValueError(f"{tensor.name}: {kind.name} is not a block-quantized type ({', '.join(t.name for t in BLOCK_TYPES)})")
    cols, rows = int(tensor.shape[0]), int(np.prod(tensor.shape[1:]))
    data = np.asarray(tensor.data).view(np.uint8).reshape(rows, -1)
    return QuantizedTensor((QuantizedPart(kind, rows, cols, data),))


def kept(a) -> bool:
    """A weight a loader kept in its checkpoint's encoding: GGUF blocks or FP8 e4m3 bytes."""
    return isinstance(a, (QuantizedTensor, FP8Tensor))


class QuantizedStream:
    """A weight-stream factory (calling it streams (name, array) pairs) that says up front which
    matrices stream as QuantizedTensor or FP8Tensor: `parts[name]` = their parts' (ggml type id, rows,
    cols), or for FP8 one part (FP8_E4M3, rows, cols, scale values). load_gguf(keep_quantized=True)
    and load_hf_dir(keep_fp8=True) return one, read from the headers; the CUDA backend sizes its weight
    region, the KV pool and the many-rows scratch from it before any weight streams."""

    def __init__(self, stream, parts: dict[str, tuple[tuple, ...]]) -> None:
        self._stream, self.parts = stream, dict(parts)

    def __call__(self):
        return self._stream()

    @property
    def shapes(self) -> dict[str, tuple[int, int]]:
        return {name: (sum(p[1] for p in ps), ps[0][2]) for name, ps in self.parts.items()}

    @classmethod
    def of(cls, items: list) -> "QuantizedStream":
        """A stream of an in-memory list of pairs (tests, benchmarks)."""
        parts = {n: tuple((int(p.ggml_type), p.rows, p.cols) for p in a.parts)
                 for n, a in items if isinstance(a, QuantizedTensor)}
        parts.update({n: ((FP8_E4M3, *a.shape, int(a.S.size)),) for n, a in items if isinstance(a, FP8Tensor)})
        return cls(lambda: iter(items), parts)
