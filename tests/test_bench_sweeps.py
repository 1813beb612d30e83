"""The lever sweeps users run: the Levers schema gives each swept lever its values, and
`python -m metrale bench=<kind> -m <axes>` writes one bench record a point (tiny random model)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.sweep_cli import grid, parse
from bench.sweeps import SWEEPS, lever_values, points

ROOT = Path(__file__).resolve().parents[1]


def test_sweep_values_come_from_the_levers_schema():
    assert lever_values("overlap") == [False, True]
    assert lever_values("numpy_dtype") == ["float32", "float64"]
    assert lever_values("spec.gate.shadow") == [False, True]
    with pytest.raises(KeyError, match="not a lever"):
        lever_values("no_such_lever")
    with pytest.raises(ValueError, match="give them"):
        lever_values("gemv_max_rows")                  # a number: the sweep must name its values
    for kind, by_device in SWEEPS.items():
        for device in by_device:
            assert len(points(kind, device)) >= 2


def test_the_grid_is_hydras_expansion():
    jobs = grid(["levers.no_mix=true,false", "scheduler.max_num_seqs=4,8", "device=cpu"])
    assert len(jobs) == 4 and ["levers.no_mix=True", "scheduler.max_num_seqs=8", "device=cpu"] in jobs
    kind, spec, overrides, _ = parse(["bench=decode", "-m", "+sweep=cpu_dtype", "bench.batch=2"])
    assert kind == "decode" and spec.batch == 2 and spec.tokens == 24
    assert "levers.numpy_dtype=float32,float64" in overrides


def test_cli_sweep_writes_one_record_a_point(tmp_path):
    r = subprocess.run([sys.executable, "-m", "metrale", "bench=decode", "-m", "levers.numpy_dtype=float32,float64",
                        "model=tiny-shape", "device=cpu", "levers.cpu_kernels=numpy", "bench.tokens=8",
                        f"bench.out={tmp_path}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    recs = json.loads((tmp_path / "decode_sweep.json").read_text())
    assert sorted(rec["extra"]["settings"]["levers.numpy_dtype"] for rec in recs) == ["float32", "float64"]
    assert all(rec["value"] > 0 and rec["unit"] == "tok/s" and rec["extra"]["peak_rss_mb"] > 0 for rec in recs)


def test_cli_sweep_errors_are_one_line():
    r = subprocess.run([sys.executable, "-m", "metrale", "bench=nope"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0 and "valid kinds" in r.stderr and "Traceback" not in r.stderr
