"""Compose the configuration the same way for the CLI and the library (Hydra compose API).

Overrides are checked against the schema first, so an unknown key or lever gets a message that
names the valid ones instead of a Hydra traceback; the composed values are then checked against
their ranges and choices (metrale/config.py: CHOICES, MINIMUMS), one line naming the setting.
"""
from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from metrale.config import MetraleConfig, invalid_setting, register_configs

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


class ConfigError(ValueError):
    """A setting the user gave that does not fit the schema; the message says which and why."""


# Settings that moved to their component's group, by their old names: still accepted, rewritten
# before anything else reads them (docs/levers.md, "Renamed").
_GATE = ("min_confidence", "verify_cost", "step_fixed", "row_cost", "draft_cost", "prior_acceptance", "min_gain",
         "probe_budget", "probe_interval", "max_batch", "ema_decay", "measured_margin", "measured_min_steps", "shadow")
RENAMED: dict[str, str] = {**{f"levers.spec_{n}": f"spec.gate.{n}" for n in _GATE},
                           "levers.spec_measured_gate": "spec.gate.measured",
                           "levers.state_norm_bound": "state.norm_bound", "levers.state_snapshots": "state.snapshots"}


def renamed(overrides: list[str]) -> list[str]:
    """The overrides with every old setting name replaced by its new one."""
    out = []
    for item in overrides:
        key, eq, value = item.partition("=")
        bare = key.lstrip("+~")
        new = RENAMED.get(bare)
        out.append(key[:len(key) - len(bare)] + new + eq + value if new else item)
    return out


def _fields(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _check_key(dotted: str) -> None:
    node: Any = MetraleConfig
    parts = dotted.split(".")
    for depth, part in enumerate(parts):
        if not dataclasses.is_dataclass(node):
            return  # inside a free-form dict (extra.*) or a list: anything goes
        fields = _fields(node)
        if part not in fields:
            where = ".".join(parts[:depth])
            what = {"levers": "lever"}.get(where, "setting")
            label = f"{where}.{part}" if where else part
            raise ConfigError(f"unknown {what} '{label}'; valid {what}s"
                              f"{' of ' + where if where and what == 'setting' else ''}: "
                              f"{', '.join(sorted(fields))}")
        node = fields[part]


def lever_presets() -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / "lever").glob("*.yaml"))


def check_overrides(overrides: list[str]) -> None:
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"'{item}' is not a key=value override (example: max_tokens=32)")
        key, value = item.split("=", 1)
        key = key.lstrip("+~")
        if key == "lever":
            if value not in lever_presets():
                raise ConfigError(f"unknown lever preset '{value}'; presets in conf/lever/: "
                                  f"{', '.join(lever_presets())}")
            continue
        _check_key(key)


def compose(overrides: list[str] | None = None) -> DictConfig:
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    overrides = renamed(list(overrides or []))
    check_overrides(overrides)
    register_configs()
    if not CONF_DIR.is_dir():
        raise ConfigError(f"config directory {CONF_DIR} is missing: install metrale from its source "
                          f"tree (pip install -e .)")
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            cfg = hydra_compose(config_name="config", overrides=overrides)
    except (HydraException, OmegaConfBaseException) as exc:
        raise ConfigError(_explain(exc)) from None
    why = invalid_setting(cfg)
    if why is not None:
        raise ConfigError(why)
    return cfg


def _explain(exc: Exception) -> str:
    cause = exc
    while cause.__cause__ is not None:
        cause = cause.__cause__
    skip = ("full_key", "object_type", "reference_type")
    msg = " ".join(ln.strip() for ln in str(cause).splitlines() if ln.strip() and not ln.strip().startswith(skip))
    full_key = getattr(cause, "full_key", None)
    return f"{full_key}: {msg}" if full_key else msg


def to_overrides(settings: dict[str, Any], prefix: str = "") -> list[str]:
    """Flatten {"levers": {"no_mix": True}} into ["levers.no_mix=true"] (values as YAML)."""
    out: list[str] = []
    for key, value in settings.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and key != "extra":
            out += to_overrides(value, dotted + ".")
        else:
            out.append(f"{dotted}={_yaml_value(value)}")
    return out


def _yaml_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_yaml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_yaml_value(v)}" for k, v in value.items()) + "}"
    text = str(value).replace("\\", "\\\\").replace("'", "\\'")
    return f"'{text}'"


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg)
