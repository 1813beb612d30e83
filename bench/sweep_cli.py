"""`python -m metrale bench=<kind> [-m] [key=a,b ...] [bench.<field>=v] [+sweep=<preset>]`: a lever
sweep from the command line, the way Hydra's multirun reads it. Every comma list of a setting is a
sweep axis (Hydra's BasicSweeper expands the grid); each point builds its engine from the
settings, is measured by bench/harness.py and written as one bench record. A preset
conf/sweep/<name>.yaml holds `bench:` (the kind), `spec:` (PointSpec fields) and `params:`
(setting -> "a,b"), the sweeps docs/performance.md reports.

    python -m metrale bench=decode -m levers.numpy_dtype=float32,float64 model=tiny-shape device=cpu
    python -m metrale bench=decode -m +sweep=decode_overlap model=smollm2-135m-shape device=cuda
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import yaml

from bench import harness

ROOT = Path(__file__).resolve().parents[1]


def _preset(name: str) -> dict:
    path = ROOT / "conf" / "sweep" / f"{name}.yaml"
    if not path.is_file():
        names = sorted(p.stem for p in (ROOT / "conf" / "sweep").glob("*.yaml"))
        raise SystemExit(f"metrale bench: error: unknown sweep preset '{name}'; valid: {', '.join(names)}")
    return yaml.safe_load(path.read_text()) or {}


def parse(argv: list[str]) -> tuple[str, harness.PointSpec, list[str], str]:
    """(kind, spec, engine overrides with sweep axes, output path) from the command line."""
    kind, spec_fields, overrides, out = None, {}, [], "outputs/bench"
    for arg in argv:
        if arg in ("-m", "--multirun"):
            continue
        key, _, value = arg.partition("=")
        if key == "bench":
            kind = value
        elif key == "+sweep":
            p = _preset(value)
            kind = kind or p.get("bench")
            spec_fields.update(p.get("spec") or {})
            overrides += [f"{k}={v}" for k, v in (p.get("params") or {}).items()]
        elif key == "bench.out":
            out = value
        elif key.startswith("bench."):
            spec_fields[key[len("bench."):]] = yaml.safe_load(value)
        else:
            overrides.append(arg)
    if kind not in harness.KINDS:
        raise SystemExit(f"metrale bench: error: bench={kind}: valid kinds: {', '.join(harness.KINDS)}")
    names = {f.name for f in dataclasses.fields(harness.PointSpec)}
    unknown = sorted(set(spec_fields) - names)
    if unknown:
        raise SystemExit(f"metrale bench: error: unknown bench.{unknown[0]}; valid: {', '.join(sorted(names - {'kind'}))}")
    return kind, harness.PointSpec(kind=kind, **spec_fields), overrides, out


def grid(overrides: list[str]) -> list[list[str]]:
    """Every point of the sweep: Hydra's own expansion of `key=a,b` axes."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    parsed = OverridesParser.create().parse_overrides(overrides)
    return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


def main(argv: list[str]) -> int:
    from bench.records import write_records
    from metrale import Engine
    from metrale.settings import ConfigError, compose
    kind, spec, overrides, out = parse(argv)
    try:
        jobs = grid(overrides)
    except Exception as exc:                      # Hydra's grammar errors
        print(f"metrale bench: error: {exc}".splitlines()[0], file=sys.stderr)
        return 2
    command = "python -m metrale " + " ".join(argv)
    axes = {o.split("=", 1)[0] for o in overrides if "," in o.split("=", 1)[-1]}
    records = []
    for i, job in enumerate(jobs):
        try:
            cfg = compose(job)
        except ConfigError as exc:
            print(f"metrale bench: error: bad setting: {exc}", file=sys.stderr)
            return 2
        settings = {k: v for k, v in (o.split("=", 1) for o in job) if k in axes}
        engine = Engine(cfg=cfg)
        rec = harness.record(kind, engine, spec, settings, command)
        records.append(rec)
        print(f"[{i + 1}/{len(jobs)}] {rec['figure']}: {rec['value']:,.1f} {rec['unit']}"
              + (f" ({rec['ratio_to_limit']:.0%} of the limit)" if rec["ratio_to_limit"] else ""), flush=True)
        del engine
    for path in write_records(records, out):
        print(f"wrote {path}")
    width = max(len(r["figure"]) for r in records)
    print(f"\n{'point':{width}s}  {'value':>12s}  unit   peak RSS MB")
    for r in records:
        print(f"{r['figure']:{width}s}  {r['value']:12,.1f}  {r['unit']:5s}  {r['extra']['peak_rss_mb']:8.0f}")
    return 0
