"""Model families as values: what a backend asks about an architecture, registered once.

A family is its forward (written against `Ops`), the ops that forward adds to the common ones
(mixins composed onto the backend's Ops class), its weight layout (random host weights under the
canonical names; its CUDA part maps a checkpoint stream to the device layout and back), its cache
kinds, and what its forward allows. Backends look a config's family up here and ask it; they hold
no family code of their own. docs/architecture.md, "Adding a model family".
"""
from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Any, Callable

from metrale.models.config import ModelConfig

# The registered families, most specific first: the first whose `matches` accepts a config runs it.
REGISTERED = (
    "metrale.models.deepseek:FAMILY",     # DeepSeek-V2/V3: MLA + MoE
    "metrale.models.hybrid:FAMILY_MOE",   # Qwen3-Next style with MoE layers
    "metrale.models.hybrid:FAMILY",       # Qwen3-Next style: Gated DeltaNet + attention
    "metrale.models.moe:FAMILY",          # Qwen3-MoE: standard attention, MoE MLPs
    "metrale.models.gemma:FAMILY",        # Gemma 3: sandwich norms, local/global attention
    "metrale.models.llama:FAMILY",        # dense Llama / Qwen2 / Qwen3 / Mistral
)

# Cache kinds (each backend implements the ones it supports behind metrale.cache.kinds.CacheKind)
KV, LATENT, STATE = "kv", "latent", "state"


@dataclass(frozen=True)
class Family:
    name: str
    matches: Callable[[ModelConfig], bool]
    forward: Callable[..., Any]     # forward(ops, weights, config, num_layers=None, return_hidden=False)
    caches: tuple[str, ...]         # KV pages / LATENT pages (indexed by block tables), STATE slots
    random_weights: Callable[[ModelConfig, int], Any] | None = None   # host float weights, canonical names
    numpy_ops: tuple[type, ...] = ()   # mixins: the ops `forward` adds, composed onto the NumPy Ops class
    cuda: str = ""                  # "module:Class" of its CUDA part (runtime/cuda_<family>.py); "" = CPU only
    layer_prefix: bool = True       # a forward of the first layers is a valid draft (levers: spec.method=self)
    check_weights: Callable[[ModelConfig, dict, Any], None] | None = None   # (config, weights, ep) -> raise
    cuda_missing: str = ""          # without a CUDA part: what it lacks (named in the refusal)

    def cuda_part(self) -> type:
        if not self.cuda:
            missing = f" (no {self.cuda_missing} yet)" if self.cuda_missing else ""
            raise ValueError(f"the {self.name} model family runs on the NumPy backend only so far{missing}; "
                             "use device=cpu")
        return resolve(self.cuda)


def resolve(ref: str) -> Any:
    """The object `module:attr` names (imported on first use: the CPU path never imports CUDA parts)."""
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


@functools.cache
def families() -> tuple[Family, ...]:
    return tuple(resolve(ref) for ref in REGISTERED)


def family_for(config: ModelConfig) -> Family:
    """The family that runs config (the first registered whose predicate accepts it)."""
    for family in families():
        if family.matches(config):
            return family
    raise ValueError(f"{config.name or config.architecture}: no registered model family runs this config")


def family_named(name: str) -> Family:
    for family in families():
        if family.name == name:
            return family
    raise ValueError(f"no model family '{name}'; known: {', '.join(f.name for f in families())}")


@functools.cache
def compose_ops(base: type, mixins: tuple[type, ...]) -> type:
    """The Ops class `base` with a family's extra ops (mixins first in the MRO), one class per pair."""
    if not mixins:
        return base
    return type("".join(m.__name__ for m in mixins) + base.__name__, (*mixins, base), {})
