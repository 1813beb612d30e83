"""Benchmark records: the JSON files under docs/bench/ that docs/performance.md and its plots
are made from.

A record is one measured figure: {benchmark, figure, value, unit, limit, peer, peer_name,
ratio_to_limit, ratio_to_peer, gpu, date, command, extra}. Ratios are oriented so that bigger is
better for us: for rates (tok/s, TB/s, TFLOP/s, ...) ratio = value / other; for times (s, ms,
us, ns) ratio = other / value. So ratio_to_limit is the fraction of the limit reached and
ratio_to_peer is the speed-up over the peer, whatever the unit. One file per benchmark
(<dir>/<benchmark>.json) holding a JSON list of records.
"""
from __future__ import annotations

import datetime as _dt
import json
import math
import os
from collections import defaultdict
from typing import Iterable

KEYS = ("benchmark", "figure", "value", "unit", "limit", "peer", "peer_name", "ratio_to_limit",
        "ratio_to_peer", "gpu", "date", "command", "extra")
LOWER_IS_BETTER = {"s", "ms", "us", "µs", "ns", "sec", "seconds"}


def lower_is_better(unit: str) -> bool:
    return unit.strip().lower() in LOWER_IS_BETTER


def _ratio(value: float, other: float | None, unit: str) -> float | None:
    if other is None or not other or not value:
        return None
    return other / value if lower_is_better(unit) else value / other


def make_record(benchmark: str, figure: str, value: float, unit: str, limit: float | None,
                peer: float | None, peer_name: str | None, gpu: str, command: str,
                extra: dict | None = None) -> dict:
    """One figure with its limit and peer, ratios filled in and today's date (UTC, ISO 8601)."""
    if not benchmark or not figure:
        raise ValueError("a record needs a benchmark and a figure name")
    value = float(value)
    limit = None if limit is None else float(limit)
    peer = None if peer is None else float(peer)
    return {"benchmark": benchmark, "figure": figure, "value": value, "unit": unit,
            "limit": limit, "peer": peer, "peer_name": peer_name,
            "ratio_to_limit": _ratio(value, limit, unit), "ratio_to_peer": _ratio(value, peer, unit),
            "gpu": gpu, "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "command": command, "extra": dict(extra or {})}


def write_records(records: Iterable[dict], path: str, merge: bool = False) -> list[str]:
    """Write records as JSON lists. `path` ending in .json: all records into that file;
    otherwise a directory (made if missing) with one <benchmark>.json per benchmark.
    merge=True keeps a file's existing records whose figure is not being rewritten.
    Returns the paths written."""
    records = list(records)
    for r in records:
        missing = [k for k in KEYS if k not in r]
        if missing:
            raise ValueError(f"record {r.get('figure')!r} lacks {missing}")
    if path.endswith(".json"):
        groups = {path: records}
    else:
        os.makedirs(path, exist_ok=True)
        groups = defaultdict(list)
        for r in records:
            groups[os.path.join(path, f"{_file_name(r['benchmark'])}.json")].append(r)
    written = []
    for file, recs in groups.items():
        if merge and os.path.exists(file):
            new = {(r["benchmark"], r["figure"]) for r in recs}
            recs = [r for r in _read(file) if (r["benchmark"], r["figure"]) not in new] + recs
        d = os.path.dirname(file)
        if d:
            os.makedirs(d, exist_ok=True)
        tmp = file + ".tmp"
        with open(tmp, "w") as f:
            json.dump(recs, f, indent=1, ensure_ascii=False)
            f.write("\n")
        os.replace(tmp, file)
        written.append(file)
    return written


def _file_name(benchmark: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in benchmark)


def _read(file: str) -> list[dict]:
    with open(file) as f:
        data = json.load(f)
    return [data] if isinstance(data, dict) else list(data)


def load_records(dir: str) -> list[dict]:
    """Every record of every *.json under `dir` (files in name order), or of one .json file."""
    if os.path.isfile(dir):
        return _read(dir)
    if not os.path.isdir(dir):
        return []
    out: list[dict] = []
    for name in sorted(os.listdir(dir)):
        if name.endswith(".json"):
            out.extend(_read(os.path.join(dir, name)))
    return out


def _num(x: float | None) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    ax = abs(x)
    if ax >= 100:
        return f"{x:,.0f}"
    if ax >= 10:
        return f"{x:.1f}"
    return f"{x:.3g}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _times(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def render_markdown_table(records: Iterable[dict]) -> str:
    """A Markdown table: one row per record, grouped by benchmark in input order."""
    records = list(records)
    head = ["benchmark", "figure", "value", "unit", "limit", "of limit", "peer", "peer value",
            "vs peer", "GPU", "date"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    order: dict[str, list[dict]] = {}
    for r in records:
        order.setdefault(r["benchmark"], []).append(r)
    for bench, recs in order.items():
        for r in recs:
            cells = [bench, r["figure"], _num(r["value"]), r["unit"], _num(r.get("limit")),
                     _pct(r.get("ratio_to_limit")), r.get("peer_name") or "-",
                     _num(r.get("peer")), _times(r.get("ratio_to_peer")), r.get("gpu") or "-",
                     (r.get("date") or "-")[:10]]
            lines.append("| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def plot_records(records: Iterable[dict], path_png: str) -> str | None:
    """Bar chart per unit: our value, the peer and the limit for each figure, log scale.
    Returns the path written, or None where matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    records = [r for r in records if r.get("value")]
    if not records:
        return None
    units: dict[str, list[dict]] = {}
    for r in records:
        units.setdefault(r["unit"], []).append(r)
    fig, axes = plt.subplots(len(units), 1, squeeze=False,
                             figsize=(max(6.0, 1.1 * max(map(len, units.values())) + 2),
                                      3.6 * len(units)))
    w = 0.27
    for ax, (unit, recs) in zip(axes[:, 0], units.items()):
        xs = range(len(recs))
        series = [("metrale", [r["value"] for r in recs], "tab:blue"),
                  ("peer", [r.get("peer") or 0 for r in recs], "tab:orange"),
                  ("limit", [r.get("limit") or 0 for r in recs], "tab:gray")]
        for i, (label, vals, color) in enumerate(series):
            if any(vals):
                ax.bar([x + (i - 1) * w for x in xs], [v if v > 0 else float("nan") for v in vals],
                       w, label=label, color=color)
        ax.set_yscale("log")
        positive = [v for _, vals, _ in series for v in vals if v > 0]
        ax.set_ylim(min(positive) / 3, max(positive) * 2)
        ax.set_ylabel(unit)
        ax.set_xticks(list(xs))
        ax.set_xticklabels([f"{r['figure']}\n({r['peer_name']})" if r.get("peer_name")
                            else r["figure"] for r in recs], fontsize=7, rotation=20, ha="right")
        ax.grid(axis="y", which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    d = os.path.dirname(path_png)
    if d:
        os.makedirs(d, exist_ok=True)
    fig.savefig(path_png, dpi=110)
    plt.close(fig)
    return path_png
