"""Which levers each benchmark sweeps, and their values, read from the Levers schema: a bool
sweeps False and True, an enumerated string its choices (metrale.config.CHOICES, 'auto' aside); a new lever joins a sweep by being
named in SWEEPS."""
from __future__ import annotations

import dataclasses
import typing

from metrale.config import CHOICES, Levers

# kind -> device -> lever names (fields of metrale.config.Levers)
SWEEPS: dict[str, dict[str, list[str]]] = {
    "decode": {"cpu": ["numpy_dtype"], "gpu": ["overlap", "cuda_graphs", "pdl", "decode_attention_kernel"]},
    "prefill": {"cpu": ["numpy_dtype"], "gpu": ["prefill_attention_kernel", "mixed_graphs", "gemm_library"]},
    "sampling": {"cpu": ["min_p_floor"], "gpu": ["min_p_floor"]},
    "offline": {"cpu": ["no_mix"], "gpu": ["overlap", "no_mix", "mixed_graphs"]},
    "spec": {"cpu": ["spec_shadow"], "gpu": ["spec_shadow"]},
}
def lever_values(name: str) -> list:
    """The values a sweep of lever `name` takes."""
    fields = {f.name: f for f in dataclasses.fields(Levers)}
    if name not in fields:
        raise KeyError(f"levers.{name} is not a lever; valid: {', '.join(sorted(fields))}")
    kind = typing.get_type_hints(Levers)[name]
    if kind is bool:
        return [False, True]
    if f"levers.{name}" in CHOICES:     # the runtime's valid values; 'auto' resolves to one of them
        return [v for v in CHOICES[f"levers.{name}"] if v != "auto"]
    raise ValueError(f"levers.{name} ({kind}) has no default sweep values: give them (levers.{name}=a,b)")


def points(kind: str, device: str) -> list[tuple[str, object]]:
    """(lever, value) of every point of a kind's sweep on a device."""
    return [(lever, v) for lever in SWEEPS[kind][device] for v in lever_values(lever)]
