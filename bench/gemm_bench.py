"""Times kernels_numba.gemm against torch (cuBLAS) on Llama-3-8B and SmolLM2-135M linear shapes.

  python bench/gemm_bench.py [--variants auto|all] [--T 1,4,...] [--shapes llama,smol] [--json F]
  python bench/gemm_bench.py --fma-sweep [--json F] [--warps 4,8] [--rows 1,2,4] [--unroll 1,2]
                             [--smem 0,1] [--max-loads 4] [--prologues plain,rmsnorm,silu_mul]

--fma-sweep times every T = 1 GEMV variant (gemm.gemv_path: warps per block, rows per warp,
loads in flight, x through L1 or staged in shared memory) with each prologue on the Llama-3-8B
and SmolLM2-135M layer shapes, and prints the best per (shape, prologue) as a gemv_cfg table.

Method: weights rotate among enough buffers to exceed 4x the 60 MB L2; a GPU sleep is queued
first so that the 50 timed launches (after 3 warm-ups) queue up behind it and run back to back;
each launch sits between two events on the legacy default stream and the median interval is
reported. GB/s counts weights + x + out once each (ours: x, out float32; torch: bf16); TFLOP/s
is 2*T*N*K over the time. torch is imported here only (it exists on the GPU machine).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LLAMA = [("llama3-8b qkv", 6144, 4096), ("llama3-8b o", 4096, 4096),
         ("llama3-8b gate|up", 14336, 4096), ("llama3-8b down", 4096, 14336),
         ("llama3-8b lm_head", 128256, 4096)]
SMOL = [("smollm2 q|o", 576, 576), ("smollm2 kv", 192, 576), ("smollm2 gate|up", 1536, 576),
        ("smollm2 down", 576, 1536), ("smollm2 lm_head", 49152, 576)]
TS = [1, 4, 8, 16, 32, 64, 128, 256, 4096]
# T = 1 GEMV sweep: (name, N, K, prologue the engine fuses into it)
FMA_SHAPES = [("llama3-8b qkv", 6144, 4096, "rmsnorm"), ("llama3-8b o", 4096, 4096, "plain"),
              ("llama3-8b gate|up", 28672, 4096, "rmsnorm"), ("llama3-8b down", 4096, 14336, "silu_mul"),
              ("llama3-8b lm_head", 128256, 4096, "rmsnorm"),
              ("smollm2 qkv", 960, 576, "rmsnorm"), ("smollm2 o", 576, 576, "plain"),
              ("smollm2 gate|up", 3072, 576, "rmsnorm"), ("smollm2 down", 576, 1536, "silu_mul"),
              ("smollm2 lm_head", 49152, 576, "rmsnorm")]
ITERS, WARMUP = 50, 3
ROTATE_BYTES = 240 << 20
SLEEP_CYCLES = int(2e9 * ITERS * 250e-6)   # longer than enqueueing ITERS launches from Python


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="auto", choices=["auto", "all"])
    ap.add_argument("--T", default=",".join(map(str, TS)))
    ap.add_argument("--shapes", default="llama,smol")
    ap.add_argument("--json", default=None)
    ap.add_argument("--fma-sweep", action="store_true", help="sweep the T = 1 GEMV variants")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--rows", default="1,2,4")
    ap.add_argument("--unroll", default="1,2")
    ap.add_argument("--smem", default="0,1")
    ap.add_argument("--max-loads", type=int, default=4,
                    help="skip variants with rows * unroll above this (16-byte loads in flight a lane)")
    ap.add_argument("--prologues", default="plain,rmsnorm,silu_mul",
                    help="plain runs every variant on every shape; a fused prologue runs on the "
                         "shapes the engine fuses it into")
    args = ap.parse_args()

    import torch
    from numba import cuda

    from kernels_numba import gemm

    Ts = [int(t) for t in args.T.split(",")]
    shapes = (LLAMA if "llama" in args.shapes else []) + (SMOL if "smol" in args.shapes else [])
    dev = torch.device("cuda")
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)

    def time_launches(launch, n_rot):
        """median ms of one launch (bench/timing.py: spin-gated event timing)."""
        from bench.timing import time_launches as timed
        return timed(launch, n_rot, iters=ITERS, warmup=WARMUP)

    def time_torch(fn, n_rot):
        for i in range(WARMUP):
            fn(i % n_rot)
        torch.cuda.synchronize()
        evs = [torch.cuda.Event(enable_timing=True) for _ in range(ITERS + 1)]
        torch.cuda._sleep(SLEEP_CYCLES)
        evs[0].record()
        for i in range(ITERS):
            fn(i % n_rot)
            evs[i + 1].record()
        evs[-1].synchronize()
        return float(np.median([evs[i].elapsed_time(evs[i + 1]) for i in range(ITERS)]))

    # the copy ceiling, measured in the same run
    a = torch.empty(1 << 28, dtype=torch.float32, device=dev)
    b = torch.empty_like(a)
    ms = time_torch(lambda i: b.copy_(a), 1)
    copy_gbps = 2 * a.numel() * 4 / ms / 1e6
    print(f"# torch copy 1 GiB: {copy_gbps:.0f} GB/s (read + write)", flush=True)
    del a, b

    if args.fma_sweep:
        fma_sweep(args, torch, cuda, gemm, time_launches, time_torch, copy_gbps)
        return

    records = []
    for name, N, K in shapes:
        wbytes = N * K * 2
        n_rot = max(2, math.ceil(ROTATE_BYTES / wbytes))
        w_t = (torch.randn(n_rot, N, K, device=dev) / math.sqrt(K)).to(torch.bfloat16)
        w_nb = cuda.as_cuda_array(w_t.view(torch.int16)).view(np.uint16)
        ws = [w_nb[i] for i in range(n_rot)]
        for T in Ts:
            x_t = torch.randn(T, K, device=dev)
            x_bf = x_t.to(torch.bfloat16)
            out_t = torch.empty(T, N, device=dev)
            x_nb = cuda.as_cuda_array(x_t)
            out_nb = cuda.as_cuda_array(out_t)
            flops = 2 * T * N * K
            ours_bytes = wbytes + T * K * 4 + T * N * 4
            torch_bytes = wbytes + T * K * 2 + T * N * 2
            variants = [("auto", gemm.pick_path(T, N, K=K))]
            if args.variants == "all":
                if T == 1:
                    variants += [(f"fma_u{u}", gemm.fma_path(T, N, u)) for u in (2, 4, 8)]
                elif T <= 4:
                    variants += [("fma_u4", gemm.fma_path(T, N, 4))]
                cands = {16: [(1, 1, 4), (1, 2, 2), (1, 2, 4), (1, 4, 2)],
                         32: [(2, 1, 2), (2, 2, 2), (1, 2, 2), (2, 4, 1)],
                         64: [(4, 1, 1), (4, 2, 1), (4, 4, 1), (2, 2, 2)],
                         256: [(4, 2, 1), (4, 4, 1), (2, 2, 2)]}
                for tmax, cs in cands.items():
                    if T <= tmax:
                        variants += [(f"sk{mt}{nt}{u}", gemm.skinny_path(T, N, mt, nt, u))
                                     for mt, nt, u in cs]
                        break
                if T >= 64:
                    variants += [(f"tiled{bm}x{bn}", gemm.tiled_path(T, N, bm, bn))
                                 for bm, bn in ((64, 128), (128, 128))]
            row = {"shape": name, "N": N, "K": K, "T": T}
            for vname, path in variants:
                def launch(i, path=path):
                    gemm.linear(x_nb, ws[i], out_nb, None, 0, path=path)
                ms = time_launches(launch, n_rot)
                row[vname] = {"us": ms * 1e3, "GBps": ours_bytes / ms / 1e6,
                              "TFLOPs": flops / ms / 1e9, "path": f"{path[0]}{path[1]}"}
            w_list = [w_t[i] for i in range(n_rot)]
            ms = time_torch(lambda i: torch.matmul(x_bf, w_list[i].t()), n_rot)
            row["torch"] = {"us": ms * 1e3, "GBps": torch_bytes / ms / 1e6,
                            "TFLOPs": flops / ms / 1e9}
            records.append(row)
            best = min((v for v in row if isinstance(row[v], dict) and v != "torch"),
                       key=lambda v: row[v]["us"])
            cells = "  ".join(f"{v}={row[v]['us']:.1f}us/{row[v]['GBps']:.0f}GB/s/"
                              f"{row[v]['TFLOPs']:.1f}TF" for v in row if isinstance(row[v], dict))
            print(f"{name:18s} T={T:5d} best={best:14s} {cells}", flush=True)
            del x_t, x_bf, out_t, x_nb, out_nb
        del w_t, w_nb, ws
        torch.cuda.empty_cache()

    print("\n# compiled kernels: registers/thread, local bytes/thread, SASS counts")
    for key, k in gemm._KERNELS.items():
        info = ""
        try:
            info = f"regs={list(k.get_regs_per_thread().values())} " \
                   f"local={list(k.get_local_mem_per_thread().values())}"
            sass = "".join(k.inspect_sass().values())
            info += " " + " ".join(f"{op}={sass.count(op)}" for op in
                                   ("HMMA", "LDG.E.128", "LDG.E.CONSTANT.128", "LDS.128",
                                    "STS.128", "LDL", "STL"))
        except Exception as e:  # nvdisasm may be missing
            info += f" ({type(e).__name__}: {e})"[:200]
        print(f"{key}: {info}")

    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    print("\n# summary: auto vs torch (us, GB/s, TFLOP/s)")
    print(f"{'shape':18s} {'T':>5s} {'ours us':>8s} {'GB/s':>5s} {'TF/s':>6s} {'torch us':>8s} "
          f"{'GB/s':>5s} {'TF/s':>6s} {'t/ours':>6s} best-variant")
    for r in records:
        a, t = r["auto"], r["torch"]
        best = min((v for v in r if isinstance(r[v], dict) and v != "torch"),
                   key=lambda v: r[v]["us"])
        print(f"{r['shape']:18s} {r['T']:5d} {a['us']:8.1f} {a['GBps']:5.0f} {a['TFLOPs']:6.1f} "
              f"{t['us']:8.1f} {t['GBps']:5.0f} {t['TFLOPs']:6.1f} {t['us'] / a['us']:6.2f} "
              f"{best} {r[best]['us']:.1f}")


def fma_sweep(args, torch, cuda, gemm, time_launches, time_torch, copy_gbps) -> None:
    """Every T = 1 GEMV variant x prologue on FMA_SHAPES; GB/s counts w + x (+ norm_w) + out
    (+ out again when accumulating) once each."""
    import itertools
    import time

    dev = torch.device("cuda")
    warps = [int(v) for v in args.warps.split(",")]
    rows = [int(v) for v in args.rows.split(",")]
    unrolls = [int(v) for v in args.unroll.split(",")]
    smems = [bool(int(v)) for v in args.smem.split(",")]
    prologues = args.prologues.split(",")
    t0 = time.time()
    records, best = [], {}
    for name, N, K, fused in FMA_SHAPES:
        wbytes = N * K * 2
        n_rot = max(2, math.ceil(ROTATE_BYTES / wbytes))
        w_t = (torch.randn(n_rot, N, K, device=dev) / math.sqrt(K)).to(torch.bfloat16)
        w_nb = cuda.as_cuda_array(w_t.view(torch.int16)).view(np.uint16)
        ws = [w_nb[i] for i in range(n_rot)]
        nw_t = 1 + 0.1 * torch.randn(K, device=dev)
        out_t = torch.zeros(1, N, device=dev)
        out_nb, nw_nb = cuda.as_cuda_array(out_t), cuda.as_cuda_array(nw_t)
        for pro in prologues:
            if pro != "plain" and pro != fused:
                continue
            kx = 2 * K if pro == "silu_mul" else K
            x_t = torch.randn(1, kx, device=dev)
            x_nb = cuda.as_cuda_array(x_t)
            acc = pro == "silu_mul"           # the down product adds into the residual stream
            nbytes = wbytes + kx * 4 + N * 4 * (2 if acc else 1) + (K * 4 if pro == "rmsnorm" else 0)
            for W, R, U, sm in itertools.product(warps, rows, unrolls, smems):
                if N % (W * R) or (sm and K > gemm.GEMV_SMEM_MAX_K) or R * U > args.max_loads:
                    continue
                path = gemm.gemv_path(N, K, pro, warps=W, rows=R, unroll=U, smem=sm)

                def launch(i, path=path, pro=pro, acc=acc):
                    gemm.gemv(x_nb, ws[i], out_nb, prologue=pro,
                              norm_w=nw_nb if pro == "rmsnorm" else None, accumulate=acc,
                              stream=0, path=path)
                try:
                    ms = time_launches(launch, n_rot)
                except Exception as e:  # a variant that fails to compile or launch is reported
                    print(f"{name:18s} {pro:8s} w{W} r{R} u{U} {'smem' if sm else 'l1'}: "
                          f"{type(e).__name__}: {str(e)[:120]}", flush=True)
                    continue
                rec = {"shape": name, "N": N, "K": K, "prologue": pro, "warps": W, "rows": R,
                       "unroll": U, "smem": sm, "us": ms * 1e3, "GBps": nbytes / ms / 1e6,
                       "of_copy": nbytes / ms / 1e6 / copy_gbps}
                records.append(rec)
                key = (name, pro)
                if key not in best or rec["us"] < best[key]["us"]:
                    best[key] = rec
            b = best.get((name, pro))
            if b:
                print(f"{name:18s} {pro:8s} best w{b['warps']} r{b['rows']} u{b['unroll']} "
                      f"{'smem' if b['smem'] else 'l1  '} {b['us']:7.1f} us {b['GBps']:6.0f} GB/s "
                      f"({b['of_copy']:.0%} of copy)  [{time.time() - t0:.0f} s]", flush=True)
            del x_t, x_nb
        # torch reference for the plain product (cuBLAS GEMV)
        x_bf = torch.randn(1, K, device=dev).to(torch.bfloat16)
        w_list = [w_t[i] for i in range(n_rot)]
        ms = time_torch(lambda i: torch.matmul(x_bf, w_list[i].t()), n_rot)
        records.append({"shape": name, "N": N, "K": K, "prologue": "torch", "us": ms * 1e3,
                        "GBps": (wbytes + K * 2 + N * 2) / ms / 1e6})
        print(f"{name:18s} torch    {ms * 1e3:7.1f} us", flush=True)
        del w_t, w_nb, ws, w_list, out_t, out_nb, nw_t, nw_nb
        torch.cuda.empty_cache()

    print("\n# best per (shape, prologue); default gemv_cfg is w4 r1 u2 l1")
    for (name, pro), b in best.items():
        d = next((r for r in records if r["shape"] == name and r["prologue"] == pro and
                  (r["warps"], r["rows"], r["unroll"], r["smem"]) == (4, 1, 2, False)), None)
        gain = f"{d['us'] / b['us']:.2f}x vs default" if d else ""
        print(f"  {name:18s} N={b['N']:6d} K={b['K']:5d} {pro:8s} -> ({b['warps']}, {b['rows']}, "
              f"{b['unroll']}, {b['smem']})  {b['us']:.1f} us {b['GBps']:.0f} GB/s {gain}")
    print(f"# sweep took {time.time() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_GBps": copy_gbps, "records": records}, f, indent=1)


if __name__ == "__main__":
    main()
