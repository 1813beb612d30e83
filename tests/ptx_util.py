"""compile_ptx helpers for tests that prove the real (non-simulator) kernel path compiles.

Numba compiles `@cuda.jit(device=True)` helpers for the current device's compute capability;
without a GPU there is none, so `no_gpu_needed` reports sm_90 (the target compile_ptx is asked
for anyway). Use it as an autouse fixture: `from ptx_util import no_gpu_needed  # noqa: F401`.
"""
import re

import pytest
from numba import cuda


class _SM90:
    compute_capability = (9, 0)


@pytest.fixture(autouse=True)
def no_gpu_needed(monkeypatch):
    import numba.cuda.dispatcher as dispatcher

    monkeypatch.setattr(dispatcher, "get_current_device", lambda: _SM90())


def ptx_of(kernel, sig, max_static_shared: int | None = None) -> str:
    """PTX of a kernel for sm_90, checked for float64 arithmetic, local-memory spills and (when
    given) the static shared memory it declares."""
    try:
        ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=(9, 0))
    except Exception as e:  # pragma: no cover - depends on the installed toolkit
        if "NVVM" in str(e) or "nvvm" in str(e) or "NVRTC" in str(e):
            pytest.skip(f"NVVM unavailable: {e}")
        raise
    body = ptx.split(".entry", 1)[1]
    assert not re.search(r"\b(add|mul|fma|sub|div|setp\.\w+|cvt\.rn\.f32)\S*\.f64", body), "float64 arithmetic"
    assert ".local" not in body, "register arrays spilled to local memory"
    if max_static_shared is not None:
        shared = sum(int(n) for n in re.findall(r"\.shared \.align \d+ \.b8 \S+\[(\d+)\]", ptx))
        assert shared <= max_static_shared, f"{shared} bytes of static shared memory"
    return ptx


def sass_info(ptx: str):
    """ptxas -v through nvJitLink: (registers, spill bytes), or None when nvJitLink is missing."""
    try:
        from cuda.bindings import nvjitlink as J
    except ImportError:
        return None
    h = J.create(3, ["-arch=sm_90", "-verbose", "-Xptxas=-v"])
    try:
        data = ptx.encode()
        J.add_data(h, J.InputType.PTX, data, len(data), "k.ptx")
        J.complete(h)
        buf = bytearray(J.get_info_log_size(h))
        J.get_info_log(h, buf)
    finally:
        J.destroy(h)
    log = buf.decode(errors="replace")
    regs = int(re.search(r"[Uu]sed (\d+) registers", log).group(1))
    spills = sum(int(x) for x in re.findall(r"(\d+) bytes spill", log))
    return regs, spills


def registers_with_bound(kernel, sig, threads: int) -> tuple[str, int | None]:
    """compile_ptx with a launch bound of `threads`; (PTX, ptxas's register count or None)."""
    ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=(9, 0), launch_bounds=(threads,))
    info = sass_info(ptx)
    return ptx, None if info is None else info[0]
