"""Bundled drafter files (MTP heads, DFlash drafters): where they are and how they are read."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from metrale.models.config import ModelConfig

ASSETS = Path(__file__).resolve().parents[1] / "assets"


def bundled(kind: str) -> dict[str, Path]:
    """{model name prefix: file} of the drafters shipped in metrale/assets/<kind>/."""
    return {"smollm2-135m-instruct": ASSETS / kind / "smollm2-135m-instruct.safetensors"}


def read_safetensors(path: str | Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(tensors, metadata) of a drafter file: floating tensors as float32, integer ones (an MTP
    head's d2t) as stored."""
    from safetensors import safe_open
    with safe_open(str(path), framework="numpy") as f:
        meta = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors = {k: a if np.issubdtype(a.dtype, np.integer) else np.asarray(a, dtype=np.float32)
               for k, a in tensors.items()}
    return tensors, meta


def resolve(kind: str, name: str | None, model_config: ModelConfig, *, lever: str, method: str) -> Path:
    """The file `name` names (a path, or a file under metrale/assets[/<kind>]); without a name the
    bundled drafter of the target model, else an error naming the lever to set."""
    if name:
        p = Path(name)
        for candidate in (p, ASSETS / p, ASSETS / kind / p, ASSETS / kind / f"{name}.safetensors"):
            if candidate.is_file():
                return candidate
        raise FileNotFoundError(f"{lever}: no {kind} drafter file at '{name}'")
    model = model_config.name.lower()
    defaults = bundled(kind)
    for key, path in defaults.items():
        if model.startswith(key) and path.is_file():
            return path
    raise ValueError(f"spec.method={method} needs {lever}=<path to a .safetensors file> "
                     f"(bundled: {', '.join(defaults)})")
