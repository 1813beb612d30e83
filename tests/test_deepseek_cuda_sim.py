"""MlaCudaOps under the CUDA simulator (tests/kernels_sim/sim_deepseek_ops.py) in
subprocesses: a few minutes of simulated kernels, so kept out of the kernels_sim directory run.
One subprocess per test function of that file (each found here), so pytest-xdist can run them on
different workers."""
import ast
from pathlib import Path

import pytest

from test_kernels_sim import run_under_simulator

SOURCE = Path(__file__).resolve().parent / "kernels_sim" / "sim_deepseek_ops.py"
TESTS = [n.name for n in ast.parse(SOURCE.read_text()).body
         if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("test")
         or isinstance(n, ast.ClassDef) and n.name.startswith("Test")]


def test_deepseek_simulator_tests_are_found():
    assert "test_deepseek_ops_match_numpy" in TESTS, TESTS


@pytest.mark.slow
@pytest.mark.parametrize("name", TESTS)
def test_deepseek_cuda_ops_under_simulator(name):
    run_under_simulator(f"tests/kernels_sim/sim_deepseek_ops.py::{name}", timeout=880)
