"""Numba GEMM kernels against cuBLASLt (nvmath-python) for the backend's many-row linear layers:
where does `levers.cublaslt_min_rows` belong?

    python -m bench.gemm_library_bench [--T 2,4,...] [--shapes llama,smol] [--out F.json]

Both sides run as the backend runs them: Numba = `gemm.linear` with the backend's dispatch
(gemv_max_rows 256); cuBLASLt = the fp32 -> bf16 cast of x plus the matmul. Each variant is
captured as one CUDA graph of REPS launches over weight copies that rotate past the 60 MB L2, so
launch overhead is the graph's (~1 us a node), as in decode; ms is the median replay / REPS.
Records: benchmark "gemm_library", one per (shape, T), value = cuBLASLt ms, peer = Numba ms
(ratio_to_peer > 1: cuBLASLt faster), limit = the weight-streaming time at the copy bandwidth.
"""
from __future__ import annotations

import argparse
import json

import numpy as np

from bench.gemm_bench import LLAMA, SMOL

REPS, REPLAYS = 10, 7
ROTATE_BYTES = 240 << 20
COPY_TB_S = 4.25


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", default="2,4,8,16,32,64,128,256,512,4096")
    ap.add_argument("--shapes", default="llama,smol")
    ap.add_argument("--copy-tb-s", type=float, default=COPY_TB_S)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from numba import cuda

    from bench.records import make_record
    from kernels_numba import gemm
    from kernels_numba.convert import x_to_bf16
    from kernels_numba.random_init import fill_normal_bf16
    from metrale.runtime.cuda import CudaGraph, Event, Stream
    from metrale.runtime.cuda.cublaslt import WORKSPACE_BYTES, CublasLt, available

    ok, why = available()
    print(f"# {why}", flush=True)
    if not ok:
        raise SystemExit(f"cuBLASLt unavailable: {why}")
    s = Stream()
    ws = cuda.device_array(WORKSPACE_BYTES, np.uint8)
    ptr = lambda a: a.__cuda_array_interface__["data"][0]  # noqa: E731
    blas = CublasLt(ptr(ws), WORKSPACE_BYTES)
    Ts = [int(t) for t in args.T.split(",")]
    shapes = (LLAMA if "llama" in args.shapes else []) + (SMOL if "smol" in args.shapes else [])
    gpu = cuda.get_current_device().name
    gpu = gpu.decode() if isinstance(gpu, bytes) else gpu
    records, rows = [], []

    def timed(fn) -> float:
        g = CudaGraph.capture(s, fn, warmup=1)
        times = []
        for _ in range(REPLAYS):
            a, b = Event(), Event()
            a.record(s)
            g.replay()
            b.record(s)
            b.synchronize()
            times.append(a.elapsed_ms(b) / REPS)
        g.close()
        return float(np.median(times))

    for name, N, K in shapes:
        n_rot = max(1, min(REPS, -(-ROTATE_BYTES // (N * K * 2))))
        ws_ = [cuda.device_array((N, K), np.uint16) for _ in range(n_rot)]
        for i, w in enumerate(ws_):
            fill_normal_bf16(w.reshape(N * K), i, K ** -0.5)
        for T in Ts:
            x = cuda.to_device(np.random.default_rng(T).standard_normal((T, K)).astype(np.float32))
            out = cuda.device_array((T, N), np.float32)
            xb = cuda.device_array(T * K, np.uint16)

            def numba_fn():
                for i in range(REPS):
                    gemm.linear(x, ws_[i % n_rot], out, stream=s.numba, skinny_max_t=256)

            def blas_fn():
                for i in range(REPS):
                    x_to_bf16(x, xb, stream=s.numba)
                    blas.linear(ptr(xb), ptr(ws_[i % n_rot]), ptr(out), T, N, K, stream=s.ptr)

            t_numba, t_blas = timed(numba_fn), timed(blas_fn)
            limit = N * K * 2 / (args.copy_tb_s * 1e12) * 1e3
            tflops = 2 * T * N * K / (t_blas * 1e-3) / 1e12
            rows.append((name, T, t_numba, t_blas))
            print(f"{name:20s} T={T:5d}  numba {t_numba * 1e3:9.1f} us  cublaslt {t_blas * 1e3:9.1f} us  "
                  f"({tflops:6.1f} TFLOP/s, {t_numba / t_blas:5.2f}x)", flush=True)
            records.append(make_record("gemm_library", f"{name} T={T}", t_blas, "ms", limit, t_numba,
                                       "numba gemm.linear", gpu, "python -m bench.gemm_library_bench",
                                       {"N": N, "K": K, "T": T, "cublaslt_tflops": tflops}))
        del ws_
    # the crossover per shape: the smallest T from which cuBLASLt wins at every larger T
    cross = {}
    for name, *_ in shapes:
        mine = [(T, tn, tb) for n, T, tn, tb in rows if n == name]
        first = next((T for i, (T, _, _) in enumerate(mine) if all(tb < tn for _, tn, tb in mine[i:])), None)
        cross[name] = first
    print("# cuBLASLt wins from T =", json.dumps(cross), flush=True)
    for r in records:
        r["extra"]["cublaslt_wins_from_T"] = cross[next(n for n, *_ in shapes if r["figure"].startswith(n + " T="))]
    blas.close()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
