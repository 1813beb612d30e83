"""pytest-benchmark suites: every benchmark kind at each value of the levers that matter for it
(bench/sweeps.py), through the one harness (bench/harness.py).

    pytest bench/ --benchmark-only -k cpu                       # tiny random model on the CPU, < 1 min
    pytest bench/ --benchmark-only -m gpu -k gpu                # SmolLM2 shape on a GPU
    pytest bench/ --benchmark-only -k cpu --benchmark-save=base  # then --benchmark-compare, --benchmark-histogram

Each test's `extra_info` carries the figure (tok/s), its limit and ratio where known, and peak host
and device memory; the timing table compares the lever values of a kind (one group per kind and
device).
"""
from __future__ import annotations

import pytest

from bench import harness
from bench.conftest import RECORDS
from bench.sweeps import points

MODELS = {"cpu": "tiny-shape", "gpu": "smollm2-135m-shape"}
SPECS = {"decode": dict(batch=4, tokens=24), "prefill": dict(prompt_tokens=256),
         "sampling": dict(batch=1, tokens=24, temperature=0.7, top_p=0.9),
         "offline": dict(requests=12, prompt_tokens=64, tokens=32), "spec": dict(batch=1, tokens=32)}
_ENGINES: dict = {}


def engine_for(device: str, settings: dict):
    key = (device, tuple(sorted(settings.items())))
    if key not in _ENGINES:
        from metrale import Engine
        _ENGINES.clear()                      # one engine alive at a time: memory stays flat
        overrides = [f"model={MODELS[device]}", f"device={'cuda' if device == 'gpu' else 'cpu'}",
                     "scheduler.max_num_seqs=16"] + [f"{k}={v}" for k, v in settings.items()]
        _ENGINES[key] = Engine(overrides=overrides)
    return _ENGINES[key]


def _cases():
    for kind in harness.KINDS:
        for device in ("cpu", "gpu"):
            for lever, value in points(kind, device):
                marks = [pytest.mark.gpu] if device == "gpu" else []
                yield pytest.param(kind, device, lever, value, marks=marks, id=f"{device}-{kind}-{lever.removeprefix('levers.')}={value}")


@pytest.mark.parametrize("kind, device, lever, value", list(_cases()))
def test_sweep(benchmark, kind, device, lever, value):
    settings = {lever: value}
    if kind == "spec":
        settings["spec.method"] = "ngram"
    engine = engine_for(device, settings)
    spec = harness.PointSpec(kind=kind, **SPECS[kind])
    out = {}
    benchmark.group = f"{kind}-{device}"
    benchmark.pedantic(lambda: out.update(r=harness.record(kind, engine, spec, settings, "pytest bench/")),
                       rounds=1, iterations=1)
    r = out["r"]
    RECORDS.append({**r, "test": f"{device}-{kind}-{lever.removeprefix('levers.')}={value}"})
    benchmark.extra_info.update({"value": r["value"], "unit": r["unit"], "limit": r["limit"],
                                 "ratio_to_limit": r["ratio_to_limit"], **{k: r["extra"][k] for k in
                                                                           ("peak_rss_mb", "device_used_gb")}})
    assert r["value"] > 0
