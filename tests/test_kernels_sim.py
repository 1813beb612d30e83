"""Runs tests/kernels_sim/ in a subprocess with NUMBA_ENABLE_CUDASIM=1 (the flag is process-wide,
so the simulator cannot share this process with the real-target tests)."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_kernels_under_simulator():
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "tests/kernels_sim"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=850)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
