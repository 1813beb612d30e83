"""compile_ptx with a launch bound, and ptxas's register count through nvJitLink (None without it)."""
import re

from numba import cuda


def registers_with_bound(kernel, sig, threads: int) -> tuple[str, int | None]:
    ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=(9, 0), launch_bounds=(threads,))
    try:
        from cuda.bindings import nvjitlink as J
    except ImportError:
        return ptx, None
    h = J.create(3, ["-arch=sm_90", "-verbose", "-Xptxas=-v"])
    try:
        data = ptx.encode()
        J.add_data(h, J.InputType.PTX, data, len(data), "k.ptx")
        J.complete(h)
        buf = bytearray(J.get_info_log_size(h))
        J.get_info_log(h, buf)
    finally:
        J.destroy(h)
    m = re.search(r"[Uu]sed (\d+) registers", buf.decode(errors="replace"))
    return ptx, int(m.group(1)) if m else None
