"""Which settings each benchmark sweeps, and their values, read from the config schema: a bool
sweeps False and True, an enumerated string its choices (metrale.config.CHOICES, 'auto' aside); a new
lever joins a sweep by being named in SWEEPS (a bare name is a lever: levers.<name>)."""
from __future__ import annotations

import dataclasses
import typing

from metrale.config import CHOICES, MetraleConfig

# kind -> device -> settings (dotted keys of metrale.config.MetraleConfig; bare names are levers)
SWEEPS: dict[str, dict[str, list[str]]] = {
    "decode": {"cpu": ["numpy_dtype"], "gpu": ["overlap", "cuda_graphs", "pdl", "decode_attention_kernel"]},
    "prefill": {"cpu": ["numpy_dtype"], "gpu": ["prefill_attention_kernel", "mixed_graphs", "gemm_library"]},
    "sampling": {"cpu": ["min_p_floor"], "gpu": ["min_p_floor"]},
    "offline": {"cpu": ["no_mix"], "gpu": ["overlap", "no_mix", "mixed_graphs"]},
    "spec": {"cpu": ["spec.gate.shadow"], "gpu": ["spec.gate.shadow"]},
}
def dotted(name: str) -> str:
    return name if "." in name else f"levers.{name}"


def lever_values(name: str) -> list:
    """The values a sweep of setting `name` (a lever's bare name, or a dotted key) takes."""
    key = dotted(name)
    node, kind = MetraleConfig, None
    for part in key.split("."):
        fields = {f.name: f for f in dataclasses.fields(node)} if dataclasses.is_dataclass(node) else {}
        if part not in fields:
            raise KeyError(f"{key} is not a lever or setting; valid here: {', '.join(sorted(fields))}")
        node = kind = typing.get_type_hints(node)[part]
    if kind is bool:
        return [False, True]
    if key in CHOICES:                  # the runtime's valid values; 'auto' resolves to one of them
        return [v for v in CHOICES[key] if v != "auto"]
    raise ValueError(f"{key} ({kind}) has no default sweep values: give them ({key}=a,b)")


def points(kind: str, device: str) -> list[tuple[str, object]]:
    """(dotted setting, value) of every point of a kind's sweep on a device."""
    return [(dotted(lever), v) for lever in SWEEPS[kind][device] for v in lever_values(lever)]
