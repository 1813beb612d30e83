"""Where the host time of one eager step goes: cProfile around a prefill forward (after a warm-up
call that compiles everything), top functions by cumulative and by own time.

    python -m bench.host_profile --model smollm2-135m-shape --prefill 512
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-shape")
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--override", nargs="*", default=[])
    args = ap.parse_args()
    from bench.decode_metrale import make_backend
    from metrale.runtime.batch import Segment, build_batch
    _, backend, _ = make_backend(args.model, 1, args.override)
    bs = backend.block_size
    n = args.prefill
    ids = np.random.default_rng(1).integers(0, backend.config.vocab_size, n).astype(np.int32)
    table = np.arange(-(-n // bs), dtype=np.int32)

    def step():
        return backend.forward_greedy(build_batch([Segment(ids, 0, table, "last")], bs))
    step()
    t0 = time.perf_counter()
    step()
    print(f"prefill {n}: {(time.perf_counter() - t0) * 1e3:.1f} ms a step (after warm-up)")
    prof = cProfile.Profile()
    prof.enable()
    step()
    prof.disable()
    st = pstats.Stats(prof)
    st.sort_stats("cumulative").print_stats(args.top)
    st.sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
