"""RoPE in one place: the inverse frequencies and the cos/sin scale of every scaling, for every
backend, CUDA table builder and drafter.

The formulas are Hugging Face transformers' (modeling_rope_utils.ROPE_INIT_FUNCTIONS), evaluated
in float64: default, linear, dynamic, llama3 and yarn (with DeepSeek's mscale / mscale_all_dim,
attention_factor and truncate). A scaling dict may name its type under `rope_type` or the legacy
`type`. One deliberate difference: transformers recomputes the `dynamic` (NTK) base as a sequence
grows past max_position_embeddings, which would change the rotation of keys already in the cache;
like vLLM we fix the base once, at the length max_position * factor.

GGUF files of Llama-3.x store their llama3 scaling as per-frequency divisors (the rope_freqs.weight
tensor, llama.cpp's freq_factors): `freq_factors` divides the inverse frequencies.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from metrale.models.config import ModelConfig

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
DEFAULT_THETA = 10000.0


@dataclass(frozen=True, eq=False)
class Rope:
    """inv_freq: float64 [rotary_dim / 2]; attention_factor multiplies cos and sin (yarn's mscale)."""
    inv_freq: np.ndarray
    attention_factor: float = 1.0

    @property
    def rotary_dim(self) -> int:
        return 2 * self.inv_freq.shape[0]

    def cos_sin(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(cos, sin), float64 [len(positions), rotary_dim / 2]."""
        angles = np.asarray(positions).astype(np.float64)[:, None] * self.inv_freq[None, :]
        cos, sin = np.cos(angles), np.sin(angles)
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos, sin

    def tables(self, max_positions: int) -> tuple[np.ndarray, np.ndarray]:
        """(cos, sin), float32 [max_positions, rotary_dim / 2]: the CUDA kernels' tables."""
        cos, sin = self.cos_sin(np.arange(max_positions))
        return cos.astype(np.float32), sin.astype(np.float32)


# ---------------------------------------------------------------------------- scaling dicts

def rope_type(scaling: dict | None) -> str:
    """The scaling's type ("default" for none); `rope_type` wins over the legacy `type`."""
    if not scaling:
        return "default"
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def check_rope_scaling(scaling: dict | None, where: str = "") -> dict | None:
    """A copy of an HF rope_scaling dict with its type under `rope_type`, or None for plain RoPE.
    Raises a one-line ValueError for an unknown type or a missing factor."""
    kind = rope_type(scaling)
    prefix = f"{where}: " if where else ""
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"{prefix}rope_scaling type '{kind}' is not supported "
                         f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    if kind == "default":
        return None
    out = {k: v for k, v in scaling.items() if k != "type"}
    out["rope_type"] = kind
    if kind in ("linear", "dynamic", "llama3") and out.get("factor") is None:
        raise ValueError(f"{prefix}rope_scaling type '{kind}' needs a 'factor'")
    return out


def hf_rope_settings(cfg: dict, where: str = "") -> tuple[float, dict | None]:
    """(rope_theta, checked scaling) of a config.json in either layout: transformers 5 keeps them in a
    `rope_parameters` block (rope_theta, rope_type, factor, ...), older files at the top level
    (`rope_theta`, `rope_scaling`). Precedence as transformers': a legacy rope_scaling dict replaces
    the block, and the block's rope_theta wins over a top-level one."""
    block = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if block and not any(k in block for k in ("rope_type", "type", "rope_theta", "factor")):
        raise ValueError(f"{where or 'config'}: rope_parameters per layer type ({', '.join(block)}) are not supported")
    theta = block.get("rope_theta")
    if theta is None:
        theta = cfg.get("rope_theta")
    scaling = {k: v for k, v in block.items() if k not in ("rope_theta", "partial_rotary_factor")}
    return float(theta if theta is not None else DEFAULT_THETA), check_rope_scaling(scaling, where)


# ---------------------------------------------------------------------- inverse frequencies

def default_inv_freq(rotary_dim: int, theta: float) -> np.ndarray:
    """theta ** (-2i / rotary_dim), float64 [rotary_dim / 2]."""
    return 1.0 / (float(theta) ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim))


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature 0.1 * mscale * ln(factor) + 1 (1 when not stretching)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _llama3(inv: np.ndarray, s: dict, max_position: int) -> np.ndarray:
    factor = float(s["factor"])
    low, high = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    old_len = float(s.get("original_max_position_embeddings") or max_position)
    wavelen = 2.0 * math.pi / inv
    out = np.where(wavelen > old_len / low, inv / factor, inv)       # long waves: interpolate
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1.0 - smooth) * out / factor + smooth * out
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return np.where(medium, smoothed, out)


def _dynamic_ntk(rotary_dim: int, theta: float, factor: float) -> np.ndarray:
    # transformers' base at seq_len = max_position * factor: theta * (factor^2 - factor + 1)^(d/(d-2))
    seq_ratio = factor                                   # seq_len / max_position
    base = theta * ((factor * seq_ratio) - (factor - 1.0)) ** (rotary_dim / (rotary_dim - 2))
    return default_inv_freq(rotary_dim, base)


def _yarn(rotary_dim: int, theta: float, s: dict, max_position: int) -> tuple[np.ndarray, float]:
    orig = float(s.get("original_max_position_embeddings") or max_position)
    factor = s.get("factor")
    factor = float(factor) if factor is not None else max_position / orig
    attention_factor = s.get("attention_factor")
    mscale, mscale_all_dim = s.get("mscale"), s.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:                    # DeepSeek: ratio of the two temperatures
            attention_factor = yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(mscale_all_dim))
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast, beta_slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:     # the dim whose wave turns `rotations` times in orig
        return rotary_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001                                     # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(rotary_dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    extrapolate = 1.0 - ramp                              # 1: high frequencies keep theirs, 0: interpolate
    pos_freqs = float(theta) ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    inv = 1.0 / (factor * pos_freqs) * (1.0 - extrapolate) + 1.0 / pos_freqs * extrapolate
    return inv, float(attention_factor)


def build_rope(rotary_dim: int, theta: float, scaling: dict | None = None, max_position: int = 8192,
               freq_factors: np.ndarray | None = None) -> Rope:
    """RoPE of `rotary_dim` rotated dims with base theta, an HF rope_scaling dict (or None) and the
    model's max_position_embeddings (yarn's and llama3's default original length, dynamic's length)."""
    s = check_rope_scaling(scaling) or {}
    kind, attention_factor = rope_type(s), 1.0
    if kind == "default":
        inv = default_inv_freq(rotary_dim, theta)
    elif kind == "linear":
        inv = default_inv_freq(rotary_dim, theta) / float(s["factor"])
    elif kind == "dynamic":
        inv = _dynamic_ntk(rotary_dim, float(theta), float(s["factor"]))
    elif kind == "llama3":
        inv = _llama3(default_inv_freq(rotary_dim, theta), s, max_position)
    else:
        inv, attention_factor = _yarn(rotary_dim, float(theta), s, max_position)
    if freq_factors is not None:
        ff = np.asarray(freq_factors, np.float64).reshape(-1)
        if ff.shape != inv.shape:
            raise ValueError(f"rope_freqs has {ff.shape[0]} factors, the rotary dim {rotary_dim} needs {inv.shape[0]}")
        inv = inv / ff
    return Rope(inv, attention_factor)


def model_rotary_dim(config: "ModelConfig") -> int:
    """The dims a model rotates per head: MLA's qk_rope_head_dim, partial RoPE's rotary_dim, or head_dim."""
    if config.is_mla:
        return config.qk_rope_head_dim
    return config.rotary_dim or config.head_dim


def model_rope(config: "ModelConfig") -> Rope:
    extra = config.extra or {}
    return build_rope(model_rotary_dim(config), config.rope_theta, extra.get("rope_scaling"),
                      config.max_position, extra.get("rope_freq_factors"))
