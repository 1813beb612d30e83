"""Programmatic dependent launch (kernels_numba/pdl.py): which kernels opt in, that each opted-in
kernel waits before anything else, and that the PTX carries the grid-dependency instructions.
The launch itself (and the decode graphs built with it) is checked on the H200 by the GPU suite,
which runs with levers.pdl on by default."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
from numba import types

from kernels_numba import pdl
from kernels_numba.bf16 import SIMULATOR
from ptx_util import no_gpu_needed  # noqa: F401  (autouse fixture: compile_ptx without a driver)

KERNELS = Path(__file__).resolve().parents[1] / "kernels_numba"
# every kernel of a dense decode / prefill step lives in these modules and must opt in
DECODE_PATH = ["activation", "argmax", "attention", "convert", "embedding", "flash_decode",
               "flash_prefill", "gemm", "kv_cache", "qkv", "rmsnorm", "rope", "sampling"]


def _calls(stmt: ast.stmt, name: str) -> bool:
    """stmt is a call of name (grid_trigger: or its early-mode variant, grid_trigger_early)."""
    names = (name, "grid_trigger_early") if name == "grid_trigger" else (name,)
    return (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)
            and isinstance(stmt.value.func, ast.Name) and stmt.value.func.id in names)


def _body_without_docstring(fn: ast.FunctionDef) -> list[ast.stmt]:
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    return body


def _own_nodes(fn: ast.FunctionDef):
    """fn's nodes, not those of functions defined inside it (a factory is not its kernel)."""
    todo = list(fn.body)
    while todo:
        n = todo.pop()
        yield n
        if not isinstance(n, (ast.FunctionDef, ast.Lambda)):
            todo.extend(ast.iter_child_nodes(n))


def _functions(path: Path):
    return [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef)]


# Kernels allowed statements before grid_wait(): they load only what no earlier kernel writes
# (weights), and these names, which earlier kernels do write, must not appear before the wait.
PRE_WAIT = {("gemm.py", "gemv"): {"x", "out", "ss_in", "ss_out", "pos"}}
# Kernels that trigger their successor before they wait (the split-K merge: the o_proj GEMV after it
# launches while the attention still runs and prefetches its weights); the trigger reads nothing.
TRIGGER_FIRST = {("attention.py", "_merge_partitions_kernel"), ("attention.py", "_merge_partitions_bf16_kernel")}


@pytest.mark.parametrize("path", sorted(KERNELS.glob("*.py")), ids=lambda p: p.name)
def test_grid_wait_comes_first(path):
    """A kernel launched with the PDL attribute may start while its predecessor still writes: the
    wait must precede every statement that reads what an earlier kernel wrote (grid_trigger right
    after it); only PRE_WAIT kernels have a preamble, and it names none of the written buffers."""
    for fn in _functions(path):
        calls_wait = any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "grid_wait"
                         for n in _own_nodes(fn))
        if not calls_wait or fn.name == "grid_wait":
            continue
        body = _body_without_docstring(fn)
        if (path.name, fn.name) in TRIGGER_FIRST:
            assert _calls(body[0], "grid_trigger") and _calls(body[1], "grid_wait"), f"{path.name}:{fn.name}"
            continue
        i = next(j for j, st in enumerate(body) if _calls(st, "grid_wait"))
        written = PRE_WAIT.get((path.name, fn.name))
        if written is None:
            assert i == 0, f"{path.name}:{fn.name}: grid_wait() is not the first statement"
        else:
            early = {n.id for st in body[:i] for n in ast.walk(st) if isinstance(n, ast.Name)}
            assert not early & written, f"{path.name}:{fn.name}: reads {early & written} before grid_wait()"
        assert _calls(body[i + 1], "grid_trigger"), f"{path.name}:{fn.name}: grid_trigger() must follow grid_wait()"


def _is_kernel(fn: ast.FunctionDef) -> bool:
    for d in fn.decorator_list:
        src = ast.unparse(d)
        if src in ("cuda.jit", "_row_kernel") or (src.startswith("cuda.jit(") and "device=True" not in src):
            return True
    return False


@pytest.mark.parametrize("module", DECODE_PATH)
def test_decode_path_kernels_opt_in(module):
    """Every decorated kernel of the decode-path modules opts in; one that did not would be launched
    the plain way (correct, but the graph edge before it keeps its full gap)."""
    for fn in _functions(KERNELS / f"{module}.py"):
        if _is_kernel(fn):
            first = _body_without_docstring(fn)[1 if (f"{module}.py", fn.name) in TRIGGER_FIRST else 0]
            assert _calls(first, "grid_wait"), f"{module}.{fn.name} does not opt in to PDL"


def test_opted_in_reads_the_code():
    from kernels_numba import gemm, rmsnorm

    assert pdl.opted_in(rmsnorm._rms_norm_2d.py_func)
    assert pdl.opted_in(gemm.py_kernel("gemv", 4, 1, 2, 0, 0, False, False))   # factory-made kernels too

    def plain(x):
        x[0] = 1.0
    assert not pdl.opted_in(plain)


def test_enable_without_a_gpu_stays_off():
    """No GPU here (or the simulator): enable() refuses, and the launcher is never wrapped."""
    assert pdl.enable(True) is False
    assert not pdl.enabled()


@pytest.mark.skipif(SIMULATOR, reason="compile_ptx needs the real CUDA target")
def test_ptx_has_the_wait_before_any_global_load():
    from ptx_util import ptx_of

    from kernels_numba import rmsnorm

    F32_1, F32_2A = types.Array(types.float32, 1, "C"), types.Array(types.float32, 2, "A")
    ptx = ptx_of(rmsnorm._rms_norm_2d, (F32_2A, F32_1, types.float32, F32_2A))
    lines = ptx.splitlines()
    wait = next(i for i, ln in enumerate(lines) if "griddepcontrol.wait" in ln)
    trigger = next(i for i, ln in enumerate(lines) if "griddepcontrol.launch_dependents" in ln)
    first_load = next(i for i, ln in enumerate(lines) if "ld.global" in ln)
    assert wait < trigger < first_load


@pytest.mark.skipif(SIMULATOR, reason="the trigger switch lives in the real-GPU path of ptx")
def test_pdl_trigger_lever_picks_by_model_size():
    from kernels_numba import ptx
    from metrale.runtime.cuda_backend import PDL_EARLY_MIN_BYTES, CudaBackend

    try:
        assert CudaBackend._pdl_trigger(None, "auto", PDL_EARLY_MIN_BYTES) == "early" == ptx.TRIGGER["mode"]
        assert CudaBackend._pdl_trigger(None, "auto", 270 << 20) == "late" == ptx.TRIGGER["mode"]
        assert CudaBackend._pdl_trigger(None, "auto", 2500 << 20) == "late"
        assert CudaBackend._pdl_trigger(None, "early", 0) == "early"
        assert CudaBackend._pdl_trigger(None, "late", 16 << 30) == "late" == ptx.TRIGGER["mode"]
        assert CudaBackend._pdl_trigger(None, "exit", 16 << 30) == "exit"
        with pytest.raises(ValueError, match="pdl_trigger"):
            CudaBackend._pdl_trigger(None, "sometimes", 0)
    finally:
        ptx.TRIGGER["mode"] = "early"


@pytest.mark.skipif(SIMULATOR, reason="compile_ptx needs the real CUDA target")
@pytest.mark.parametrize("mode", ["early", "late", "exit"])
def test_trigger_mode_compiles_its_own_trigger_only(mode):
    """early: grid_trigger() / grid_trigger_early() at the start; late: grid_trigger_late() where a
    kernel has one (after the stores it follows in the source), grid_trigger() elsewhere; exit: none."""
    from numba.cuda import compile_ptx
    from kernels_numba import ptx

    def with_late_site(x):              # a kernel with a late site: early or late, never both
        ptx.grid_wait()
        ptx.grid_trigger_early()
        x[0] = 1.0
        ptx.grid_trigger_late()
        x[1] = 2.0

    def without(x):                     # a kernel without one: triggers at its start in early and late
        ptx.grid_wait()
        ptx.grid_trigger()
        x[0] = 1.0
    try:
        pdl.set_trigger(mode)
        for k, expect in ((with_late_site, {"early": "before", "late": "after", "exit": None}[mode]),
                          (without, None if mode == "exit" else "before")):
            body, _ = compile_ptx(k, (types.float32[:],), cc=(9, 0))
            lines = body.splitlines()
            assert "griddepcontrol.wait" in body
            trig = [i for i, ln in enumerate(lines) if "griddepcontrol.launch_dependents" in ln]
            if expect is None:
                assert not trig, (k.__name__, mode)
            else:
                assert len(trig) == 1, (k.__name__, mode)
                first_store = next(i for i, ln in enumerate(lines) if "st.global" in ln)
                assert (trig[0] < first_store) == (expect == "before"), (k.__name__, mode)
    finally:
        ptx.TRIGGER["mode"] = "early"


def test_unknown_trigger_mode_is_refused():
    with pytest.raises(ValueError, match="trigger mode"):
        pdl.set_trigger("sometimes")
