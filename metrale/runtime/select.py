"""Backend selection: device=auto|cpu|cuda (auto picks CUDA when a GPU is present), one backend class per device."""
from __future__ import annotations

from metrale.models.families import resolve

BACKENDS = {"cpu": "metrale.runtime.numpy_backend:NumpyBackend", "cuda": "metrale.runtime.cuda_backend:CudaBackend"}


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


def backend_class(device: str) -> type:
    """The backend class of a resolved device (imported on use: the CPU path never imports CUDA)."""
    return resolve(BACKENDS[device])
