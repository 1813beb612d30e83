"""FP8 e4m3 safetensors checkpoints (docs/quant.md, "FP8 checkpoints"): their quantization_config,
their tensors read as bytes, and the host value a loader keeps them in (FP8Tensor).

Formats read (a linear weight `<m>.weight` float8_e4m3fn [N, K], torch Linear's [out, in]):
  quant_method "fp8" with weight_block_size [bn, bk]   `<m>.weight_scale_inv` float32 [ceil(N/bn), ceil(K/bk)]
                                                       (Qwen3-FP8, DeepSeek-V3; it multiplies, despite its name)
  quant_method "fp8" without weight_block_size         `<m>.weight_scale` per tensor (AutoFP8 / vLLM)
  quant_method "fbgemm_fp8"                            `<m>.weight_scale` [N, 1] (Meta's Llama-3.1-*-FP8)
  quant_method "compressed-tensors", float 8-bit weights  `<m>.weight_scale` of the group's strategy:
                                                       tensor, channel [N, 1] or block (block_structure)
w = e4m3(q) * scale over the scale's block. Which matrices are FP8 is read from the file (a tensor's
dtype): the modules a config leaves unconverted (ignored_layers, modules_to_not_convert, ignore) are
stored in bf16 and read as such. Activation scales (input_scale) are not read: the kernels take
float32 activations (weight-only FP8).
"""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["FP8_E4M3", "Fp8Scheme", "fp8_scheme", "FP8Tensor", "member_grid", "stacked_grid",
           "SafetensorsBytes", "SCALE_SUFFIXES"]

FP8_E4M3 = "F8_E4M3"          # safetensors' dtype name; the type a QuantizedStream announces FP8 weights with
SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale")    # the names a weight's scale takes, in lookup order
CT_FORMATS = ("float-quantized", "naive-quantized")      # compressed-tensors formats that store e4m3 bytes


@dataclass(frozen=True)
class Fp8Scheme:
    """What a config.json's quantization_config says of its FP8 weights."""
    method: str
    block: tuple[int, int] | None          # weight_block_size / block_structure; None: per tensor or channel
    ignored: tuple[str, ...] = ()          # modules stored unquantized (informative: the dtype decides)


def fp8_scheme(cfg: dict) -> Fp8Scheme | None:
    """The FP8 scheme of a config.json, None without a quantization_config; a ValueError naming the
    method for anything else than an FP8 e4m3 weight format."""
    q = cfg.get("quantization_config")
    if not q:
        return None
    method = str(q.get("quant_method", ""))
    if method == "fp8":
        if str(q.get("fmt", "e4m3")) != "e4m3":
            raise ValueError(f"quantization_config: fp8 format '{q.get('fmt')}' is not supported (e4m3 only)")
        ignored = q.get("ignored_layers") or q.get("modules_to_not_convert") or ()
        return Fp8Scheme(method, _block(q.get("weight_block_size")), tuple(ignored))
    if method == "fbgemm_fp8":
        return Fp8Scheme(method, None, tuple(q.get("modules_to_not_convert") or ()))
    if method == "compressed-tensors":
        return _compressed_tensors(q)
    raise ValueError(f"quantization_config.quant_method '{method}' is not supported: metrale reads FP8 e4m3 "
                     "checkpoints (fp8, fbgemm_fp8, compressed-tensors with 8-bit float weights) and GGUF files")


def _block(size) -> tuple[int, int] | None:
    if size is None:
        return None
    if len(size) != 2:
        raise ValueError(f"quantization_config: weight_block_size must be [rows, cols], got {size}")
    return int(size[0]), int(size[1])


def _compressed_tensors(q: dict) -> Fp8Scheme:
    """compressed-tensors: every config group's weights float, 8 bits, one strategy of tensor, channel
    or block (with its block_structure)."""
    fmt = str(q.get("format", ""))
    if fmt not in CT_FORMATS:
        raise ValueError(f"compressed-tensors format '{fmt}' is not supported (FP8 weights: {', '.join(CT_FORMATS)})")
    blocks = set()
    for name, group in (q.get("config_groups") or {}).items():
        w = group.get("weights") or {}
        if str(w.get("type")) != "float" or int(w.get("num_bits", 0)) != 8:
            raise ValueError(f"compressed-tensors group {name}: {w.get('type')} {w.get('num_bits')}-bit weights are "
                             "not supported (8-bit float only)")
        strategy = str(w.get("strategy"))
        if strategy not in ("tensor", "channel", "block"):
            raise ValueError(f"compressed-tensors group {name}: weight strategy '{strategy}' is not supported "
                             "(tensor, channel, block)")
        blocks.add(_block(w.get("block_structure")) if strategy == "block" else None)
    if len(blocks) > 1:
        raise ValueError(f"compressed-tensors: config groups with different weight blocks {sorted(map(str, blocks))}")
    return Fp8Scheme("compressed-tensors", next(iter(blocks), None), tuple(q.get("ignore") or ()))


# ----------------------------------------------------------------------------- scales as a block grid
def member_grid(rows: int, cols: int, scale_shape: tuple[int, ...], block: tuple[int, int] | None
                ) -> tuple[int, int]:
    """(bn, bk): the block a scale of this shape covers in a [rows, cols] weight: one value per
    tensor (rows, cols), per output channel (1, cols), or the grid of `block`."""
    if block is not None:
        want = (-(-rows // block[0]), -(-cols // block[1]))
        if tuple(scale_shape) != want:
            raise ValueError(f"fp8 block scales of a [{rows}, {cols}] weight in {block[0]} x {block[1]} blocks "
                             f"are {want}, got {tuple(scale_shape)}")
        return block
    size = math.prod(scale_shape)
    if size == 1:
        return rows, cols
    if size == rows:
        return 1, cols
    raise ValueError(f"fp8 scale of shape {tuple(scale_shape)} for a [{rows}, {cols}] weight: "
                     "its quantization_config needs a weight block size")


def stacked_grid(members: list[tuple[int, int, int]]) -> tuple[int, int]:
    """(bn, bk) of row-stacked weights of (rows, bn, bk): their common block when every member but the
    last fills whole blocks of rows, else row blocks (1, g) with g the gcd of their column blocks."""
    bns, bks = {bn for _, bn, _ in members}, {bk for _, _, bk in members}
    if len(bns) == 1 and len(bks) == 1 and all(rows % next(iter(bns)) == 0 for rows, _, _ in members[:-1]):
        return next(iter(bns)), next(iter(bks))
    return 1, math.gcd(*bks)


@dataclass(frozen=True)
class FP8Tensor:
    """A weight kept in its checkpoint's e4m3 bytes: q uint8 [N, K], S float32 [ceil(N / bn),
    ceil(K / bk)], w[n, k] = e4m3(q[n, k]) S[n // bn, k // bk] (per tensor: bn, bk = N, K)."""
    q: np.ndarray
    S: np.ndarray
    bn: int
    bk: int

    def __post_init__(self) -> None:
        n, k = self.q.shape
        want = (-(-n // self.bn), -(-k // self.bk))
        if self.q.dtype != np.uint8 or self.S.shape != want:
            raise ValueError(f"FP8Tensor: q uint8 [{n}, {k}] and scales {want} in {self.bn} x {self.bk} blocks, "
                             f"got {self.q.dtype} and {self.S.shape}")

    @classmethod
    def of(cls, q: np.ndarray, scale: np.ndarray, block: tuple[int, int] | None) -> "FP8Tensor":
        """From a checkpoint's weight bytes (or float8_e4m3fn values) and its scale as stored."""
        q = np.asarray(q).view(np.uint8)
        scale = np.asarray(scale, np.float32)
        bn, bk = member_grid(*q.shape, scale.shape, block)
        return cls(q, np.ascontiguousarray(scale.reshape(-(-q.shape[0] // bn), -(-q.shape[1] // bk))), bn, bk)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    @property
    def nbytes(self) -> int:
        return int(self.q.size + 4 * self.S.size)

    def scales(self, bn: int, bk: int) -> np.ndarray:
        """S on a finer grid (bn divides self.bn or is 1; bk divides self.bk)."""
        n, k = self.shape
        rows = np.arange(-(-n // bn)) * bn // self.bn
        cols = np.arange(-(-k // bk)) * bk // self.bk
        return self.S[rows[:, None], cols[None, :]]

    def dequantize(self) -> np.ndarray:
        import ml_dtypes
        n, k = self.shape
        w = np.ascontiguousarray(self.q).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
        return w * self.S[(np.arange(n) // self.bn)[:, None], (np.arange(k) // self.bk)[None, :]]

    @staticmethod
    def stack(tensors: list["FP8Tensor"]) -> "FP8Tensor":
        """Row-stacked weights (the fused qkv, gate_up) as one, on stacked_grid's blocks."""
        cols = {t.shape[1] for t in tensors}
        if len(cols) != 1:
            raise ValueError(f"row-stacked FP8 tensors need one column count, got {sorted(cols)}")
        bn, bk = stacked_grid([(t.shape[0], t.bn, t.bk) for t in tensors])
        S = np.concatenate([t.S if (t.bn, t.bk) == (bn, bk) else t.scales(bn, bk) for t in tensors])
        return FP8Tensor(np.concatenate([t.q for t in tensors]), np.ascontiguousarray(S, np.float32), bn, bk)


# ----------------------------------------------------------------------------- reading the bytes
class SafetensorsBytes:
    """Raw tensors of safetensors files (the `safetensors` package's NumPy API has no float8 types):
    headers parsed once, each file memory-mapped once, a tensor a uint8 view of its bytes."""

    def __init__(self) -> None:
        self._headers: dict[Path, tuple[dict, int]] = {}
        self._maps: dict[Path, np.ndarray] = {}

    def header(self, file: Path) -> dict:
        return self._header(file)[0]

    def _header(self, file: Path) -> tuple[dict, int]:
        got = self._headers.get(file)
        if got is None:
            with open(file, "rb") as f:
                n = struct.unpack("<Q", f.read(8))[0]
                got = self._headers[file] = (json.loads(f.read(n)), 8 + n)
        return got

    def get(self, file: Path, key: str) -> np.ndarray:
        """uint8 [shape] of tensor `key` (one byte per element: F8 dtypes)."""
        header, base = self._header(file)
        meta = header[key]
        start, end = meta["data_offsets"]
        if file not in self._maps:
            self._maps[file] = np.memmap(file, np.uint8, "r")
        flat = self._maps[file][base + start:base + end]
        if flat.size != math.prod(meta["shape"]):
            raise ValueError(f"{file}: tensor '{key}' of {meta['dtype']} is not one byte an element")
        return flat.reshape(meta["shape"])
