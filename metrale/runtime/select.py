"""Backend selection: device=auto|cpu|cuda. auto picks CUDA when a GPU is present."""
from __future__ import annotations

import logging

log = logging.getLogger("metrale")


def cuda_available() -> bool:
    try:
        from numba import cuda
        return bool(cuda.is_available())
    except Exception:  # no driver, no toolkit: the CPU path must keep working
        return False


def resolve_device(device: str) -> str:
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, not '{device}'")
    if device == "auto":
        return "cuda" if cuda_available() else "cpu"
    if device == "cuda" and not cuda_available():
        raise RuntimeError("device=cuda but no usable CUDA GPU was found (numba.cuda.is_available() "
                           "is False); use device=cpu or device=auto")
    return device
