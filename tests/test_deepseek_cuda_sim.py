"""DeepseekCudaOps under the CUDA simulator (tests/kernels_sim/sim_deepseek_ops.py) in a
subprocess: a few minutes of simulated kernels, so kept out of the kernels_sim directory run."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_deepseek_cuda_ops_under_simulator():
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "tests/kernels_sim/sim_deepseek_ops.py"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=880)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
