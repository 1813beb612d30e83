"""pytest-benchmark: the real SmolLM2 (Q4_1) decoding on the CPU, the fast path against the NumPy
reference (levers.cpu_kernels), through the one harness (bench/harness.py).

    pytest bench/test_cpu_decode.py --benchmark-only              # a minute or two on 2 cores
    pytest bench/test_cpu_decode.py --benchmark-only --bench-records docs/bench

The llama.cpp comparison, prefill of 512 and peak RSS of fresh processes: bench/cpu_decode.py.
"""
from __future__ import annotations

import pytest

from bench import harness
from bench.conftest import RECORDS

_ENGINES: dict = {}


def engine_for(kernels: str):
    if kernels not in _ENGINES:
        from metrale import Engine
        _ENGINES.clear()                      # one engine alive at a time
        _ENGINES[kernels] = Engine(overrides=["model=smollm2-135m", "device=cpu", "scheduler.max_num_seqs=8",
                                              f"levers.cpu_kernels={kernels}"])
    return _ENGINES[kernels]


@pytest.mark.parametrize("kernels, batch", [("numba", 1), ("numba", 8), ("numpy", 1), ("numpy", 8)])
def test_cpu_decode(benchmark, kernels, batch):
    engine = engine_for(kernels)
    spec = harness.PointSpec(kind="decode", batch=batch, prompt_tokens=64, tokens=33)
    settings = {"levers.cpu_kernels": kernels}
    out = {}
    benchmark.group = f"cpu-decode-B{batch}"
    benchmark.pedantic(lambda: out.update(r=harness.record("decode", engine, spec, settings,
                                                           "pytest bench/test_cpu_decode.py")), rounds=1, iterations=1)
    r = out["r"]
    RECORDS.append({**r, "test": f"cpu-decode-B{batch}-{kernels}"})
    benchmark.extra_info.update({"value": r["value"], "unit": r["unit"], "peak_rss_mb": r["extra"]["peak_rss_mb"]})
    assert r["value"] > 0
