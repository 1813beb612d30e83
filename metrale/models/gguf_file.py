"""A fast GGUF reader with the interface metrale uses of `gguf.GGUFReader`.

gguf's reader builds a NumPy view per array element while it opens a file: a 262,144-token
vocabulary (Gemma 3) takes it ~30 s. This one parses the metadata with struct from one read of the
header (string arrays in a plain loop, numeric arrays as one np.frombuffer) and maps the tensor
data like gguf does: `fields[name].contents()`, and `tensors` whose name, tensor_type, shape (GGUF
dims, innermost first), n_elements, n_bytes, data_offset and data (a memory-mapped array: typed for
F32 / F16 / F64 / integer tensors, uint8 [..., bytes per row] for block types) are gguf's.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

GGUF_MAGIC = 0x46554747          # "GGUF" little-endian
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NP = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32, 7: np.bool_,
       10: np.uint64, 11: np.int64, 12: np.float64}
STRING, ARRAY = 8, 9


@dataclass(frozen=True)
class Field:
    name: str
    value: Any

    def contents(self) -> Any:
        return self.value


@dataclass(frozen=True)
class Tensor:
    name: str
    tensor_type: Any                 # gguf.GGMLQuantizationType
    shape: np.ndarray                # GGUF dims (ne0 first), as gguf's ReaderTensor.shape
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


class GGUFFile:
    """GGUF v2/v3 (little-endian) metadata and memory-mapped tensors."""

    def __init__(self, path: str | Path):
        import gguf
        with open(path, "rb") as f:
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf = self._mm
        magic, version = struct.unpack_from("<II", buf, 0)
        if magic != GGUF_MAGIC:
            raise ValueError(f"not a GGUF file (magic {magic:#x})")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2, 3)")
        n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
        self._pos = 24
        self.fields: dict[str, Field] = {"GGUF.version": Field("GGUF.version", version),
                                         "GGUF.tensor_count": Field("GGUF.tensor_count", n_tensors),
                                         "GGUF.kv_count": Field("GGUF.kv_count", n_kv)}
        for _ in range(n_kv):
            key = self._string()
            (kind,) = self._unpack("<I")
            self.fields[key] = Field(key, self._value(kind))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            (n_dims,) = self._unpack("<I")
            dims = np.array(self._unpack(f"<{n_dims}Q"), dtype=np.uint64)
            kind, offset = self._unpack("<IQ")
            infos.append((name, dims, kind, offset))
        align = int(self.fields.get("general.alignment", Field("", 32)).value)
        start = -(-self._pos // align) * align
        data = np.memmap(path, dtype=np.uint8, mode="r")
        self.tensors: list[Tensor] = []
        seen = set()
        for name, dims, kind, offset in infos:
            if name in seen:
                raise ValueError(f"duplicated tensor {name}")
            seen.add(name)
            qtype = gguf.GGMLQuantizationType(kind)
            n = int(np.prod(dims)) if len(dims) else 1
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            n_bytes = n * type_size // block
            np_dims = tuple(int(d) for d in reversed(dims.tolist()))
            raw = data[start + offset:start + offset + n_bytes]
            typed = {gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16,
                     gguf.GGMLQuantizationType.F64: np.float64, gguf.GGMLQuantizationType.I8: np.int8,
                     gguf.GGMLQuantizationType.I16: np.int16, gguf.GGMLQuantizationType.I32: np.int32,
                     gguf.GGMLQuantizationType.I64: np.int64}.get(qtype)
            if typed is not None:
                arr = raw.view(typed).reshape(np_dims)
            else:
                arr = raw.reshape(gguf.quant_shape_to_byte_shape(np_dims, qtype))
            self.tensors.append(Tensor(name, qtype, dims, n, n_bytes, start + offset, arr))

    def _unpack(self, fmt: str) -> tuple:
        out = struct.unpack_from(fmt, self._mm, self._pos)
        self._pos += struct.calcsize(fmt)
        return out

    def _string(self) -> str:
        (n,) = struct.unpack_from("<Q", self._mm, self._pos)
        s = self._mm[self._pos + 8:self._pos + 8 + n].decode("utf-8", errors="replace")
        self._pos += 8 + n
        return s

    def _value(self, kind: int) -> Any:
        if kind == STRING:
            return self._string()
        if kind == ARRAY:
            elem, count = self._unpack("<IQ")
            if elem == STRING:
                mm, pos, out = self._mm, self._pos, []
                for _ in range(count):
                    (n,) = struct.unpack_from("<Q", mm, pos)
                    out.append(mm[pos + 8:pos + 8 + n].decode("utf-8", errors="replace"))
                    pos += 8 + n
                self._pos = pos
                return out
            if elem == ARRAY:
                return [self._value(ARRAY) for _ in range(count)]
            dt = np.dtype(_NP[elem]).newbyteorder("<")
            arr = np.frombuffer(self._mm, dtype=dt, count=count, offset=self._pos)
            self._pos += count * dt.itemsize
            return arr.tolist()
        if kind not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {kind}")
        (v,) = self._unpack(_SCALARS[kind])
        return v
