"""Per-component options: the composition root (Engine) turns the composed Hydra tree into these
once, and only they travel to the scheduler, the speculation gate and the recurrent states (the
backends read their own groups once, in their from_config). Frozen: a component cannot change
another's settings."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


def _values(cls, node) -> dict[str, Any]:
    return {f.name: node[f.name] for f in dataclasses.fields(cls)}


@dataclass(frozen=True)
class SchedulerOptions:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int | None
    no_mix: bool
    preempt_mode: str

    @classmethod
    def of(cls, cfg) -> "SchedulerOptions":
        s, lv = cfg.scheduler, cfg.levers
        return cls(int(s.max_num_seqs), int(s.max_num_batched_tokens), s.max_model_len, bool(lv.no_mix),
                   str(lv.preempt_mode))


@dataclass(frozen=True)
class GateOptions:
    """The speculation gate's settings (config.SpecGateConfig: spec.gate.*)."""
    min_confidence: float
    verify_cost: float
    step_fixed: float
    row_cost: float
    draft_cost: float
    prior_acceptance: float
    min_gain: float
    probe_budget: float
    probe_interval: int
    max_batch: int
    ema_decay: float
    measured: str
    measured_margin: float
    measured_min_steps: int
    shadow: bool

    @classmethod
    def of(cls, cfg) -> "GateOptions":
        return cls(**_values(cls, cfg.spec.gate))


@dataclass(frozen=True)
class SpecOptions:
    method: str
    num_drafts: int
    ngram_max_n: int
    ngram_min_n: int
    self_layers: int | None
    draft_model: str | None
    mtp_head: str | None
    mtp_draft_vocab: bool
    dflash_head: str | None
    gate: GateOptions

    @classmethod
    def of(cls, cfg) -> "SpecOptions":
        fields = {f.name for f in dataclasses.fields(cls)} - {"gate"}
        return cls(**{name: cfg.spec[name] for name in fields}, gate=GateOptions.of(cfg))


@dataclass(frozen=True)
class StateOptions:
    """Hybrid models' recurrent states (config.StateConfig: state.*)."""
    norm_bound: float
    snapshots: int

    @classmethod
    def of(cls, cfg) -> "StateOptions":
        return cls(float(cfg.state.norm_bound), max(int(cfg.state.snapshots), 0))


def server_options(cfg):
    """cfg.server as a plain config.ServerConfig: the HTTP handlers read it on every request, and
    an OmegaConf node's attribute reads are slow (docs/server.md, "Server CPU per request")."""
    from metrale.config import ServerConfig
    node = cfg.server
    return node if isinstance(node, ServerConfig) else ServerConfig(**_values(ServerConfig, node))
