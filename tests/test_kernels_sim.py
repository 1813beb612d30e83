"""Runs tests/kernels_sim/ in subprocesses with NUMBA_ENABLE_CUDASIM=1 (the flag is process-wide,
so the simulator cannot share this process with the real-target tests).

One subprocess per file (about 1.3 s of start-up each), so pytest-xdist can spread the files over
its workers; every test file in the directory is found here, so a new one runs without an edit."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SIM = ROOT / "tests" / "kernels_sim"
FILES = sorted({p.name for pattern in ("test_*.py", "*_test.py") for p in SIM.glob(pattern)})


def run_under_simulator(target: str, timeout: float = 850):
    """pytest -q -x on `target` (a path or node id relative to the repository root) in a
    subprocess with the simulator on; fails with the tail of its output."""
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", target], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]


def test_simulator_files_are_found():
    assert len(FILES) >= 10 and "test_gemm_sim.py" in FILES, FILES


@pytest.mark.slow
@pytest.mark.parametrize("name", FILES)
def test_kernels_under_simulator(name):
    run_under_simulator(f"tests/kernels_sim/{name}")
