"""Runs tests/kernels_sim/ in subprocesses with NUMBA_ENABLE_CUDASIM=1 (the flag is process-wide,
so the simulator cannot share this process with the real-target tests).

One subprocess per file, so pytest-xdist can spread the files over its workers; every test file in
the directory is found here, so a new one runs without an edit. The files of a few seconds'
simulation (LIGHT) share one subprocess: a subprocess's start-up (~3 s of imports) was most of
their cost."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SIM = ROOT / "tests" / "kernels_sim"
FILES = sorted({p.name for pattern in ("test_*.py", "*_test.py") for p in SIM.glob(pattern)})
LIGHT = {"test_attention_nosplit_sim.py", "test_attention_sim.py", "test_bf16_sim.py", "test_convert_sim.py",
         "test_gdn_sim.py", "test_gemma_ops_sim.py", "test_hybrid_kernels_sim.py", "test_meta_sim.py", "test_mla_sim.py",
         "test_qkv_sim.py", "test_small_ops_sim.py"}
GROUPS = [[f] for f in FILES if f not in LIGHT] + [g for g in [[f for f in FILES if f in LIGHT]] if g]
# pytest plugins no simulator test uses: loading them (hypothesis through schemathesis, hydra's
# plugin) took half of a subprocess's start-up
NO_PLUGINS = [a for p in ("schemathesis", "hypothesispytest", "hydra_pytest", "benchmark", "anyio")
              for a in ("-p", f"no:{p}")]


def run_under_simulator(*targets: str, timeout: float = 850):
    """pytest -q -x on `targets` (paths or node ids relative to the repository root) in a
    subprocess with the simulator on; fails with the tail of its output."""
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", *NO_PLUGINS, *targets], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]


def test_simulator_files_are_found():
    assert len(FILES) >= 10 and "test_gemm_sim.py" in FILES, FILES
    assert sorted(f for g in GROUPS for f in g) == FILES


@pytest.mark.slow
@pytest.mark.parametrize("names", GROUPS, ids=[g[0] if len(g) == 1 else "light_files" for g in GROUPS])
def test_kernels_under_simulator(names):
    run_under_simulator(*(f"tests/kernels_sim/{n}" for n in names))
