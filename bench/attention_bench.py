"""Prefill attention kernels on the Llama-3-8B shape (32 q heads, 8 kv heads, head_dim 128, KV
block 16): the FP32 FMA kernel (attention.prefill_attention) and the mma.sync flash kernel
(flash_prefill.flash_prefill_attention, each of its geometries) on one causal prompt.

  python bench/attention_bench.py [--tokens 4096] [--smol] [--json FILE_OR_DIR]

Method (as bench/kernels_bench.py): a GPU sleep is queued first so that the timed launches queue
behind it and run back to back; each launch sits between two CUDA events and the median of 30
intervals is reported. TFLOP/s counts 4 * hd * Hq * sum(positions + 1) (QK^T and PV, causal).
The limit in the JSON record is the dense bf16 matrix rate measured in docs/gemm.md (~800
TFLOP/s); the peer of the flash record is the FMA kernel. --smol adds SmolLM2-135M (9/3 heads,
hd 64).
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BS = 16
ITERS, WARMUP = 30, 2
BF16_PEAK_TFLOPS = 800.0  # dense bf16 matrix rate measured on the H200 (docs/gemm.md)
SHAPES = {"llama3-8b": (32, 8, 128), "smollm2-135m": (9, 3, 64)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--smol", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from numba import cuda

    from bench import timing
    from bench.records import make_record, write_records
    from kernels_numba import attention as A
    from kernels_numba import flash_prefill as F
    from kernels_numba.random_init import fill_normal_bf16

    def time_launches(launch):
        return timing.time_launches(lambda _: launch(), 1, ITERS, WARMUP)

    dev = cuda.get_current_device()
    gpu = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
    print(f"# {gpu}", flush=True)
    cmd = "python " + " ".join(sys.argv)
    records = []
    rng = np.random.default_rng(0)
    n = args.tokens
    for name in ["llama3-8b"] + (["smollm2-135m"] if args.smol else []):
        hq, hk, hd = SHAPES[name]
        blocks = -(-n // BS)
        kc = cuda.device_array((blocks, BS, hk, hd), np.uint16)
        vc = cuda.device_array((blocks, BS, hk, hd), np.uint16)
        fill_normal_bf16(kc.reshape(kc.size), 3, 1.0)
        fill_normal_bf16(vc.reshape(vc.size), 4, 1.0)
        k64, v64 = kc.view(np.uint64), vc.view(np.uint64)
        tables = cuda.to_device(rng.permutation(blocks).astype(np.int32).reshape(1, -1))
        starts = cuda.to_device(np.array([0, n], np.int32))
        pos = cuda.to_device(np.arange(n, dtype=np.int32))
        q = cuda.to_device(rng.standard_normal((n, hq, hd), dtype=np.float32))
        out = cuda.device_array((n, hq, hd), np.float32)
        scale = 1.0 / math.sqrt(hd)
        flops = 4.0 * hd * hq * n * (n + 1) / 2

        ms = time_launches(lambda: A.prefill_attention(q, k64, v64, tables, starts, pos, scale, out,
                                                       max_query_len=n))
        fma_tf = flops / ms / 1e9
        print(f"{name} T={n} prefill_attention (FP32 FMA): {ms:8.3f} ms {fma_tf:7.1f} TFLOP/s", flush=True)
        records.append(make_record("attention_prefill", f"prefill_attention fma {name} T={n}", fma_tf,
                                   "TFLOP/s", BF16_PEAK_TFLOPS, None, None, gpu, cmd, {"ms": ms}))
        variants = [{}]
        if hd == 128:
            variants += [{"v_early": True}, {"block_k": 32, "v_early": True}, {"block_k": 32, "v_early": False}]
        best = None
        for over in variants:
            cfg = F.flash_config(hd, **over)
            ms = time_launches(lambda cfg=cfg: F.flash_prefill_attention(q, k64, v64, tables, starts, pos, scale,
                                                                         out, max_query_len=n, config=cfg))
            tf = flops / ms / 1e9
            label = ",".join(f"{k}={v}" for k, v in over.items()) or "default"
            print(f"{name} T={n} flash_prefill ({label}; bk={cfg.block_k} v_early={cfg.v_early}): "
                  f"{ms:8.3f} ms {tf:7.1f} TFLOP/s  x{tf / fma_tf:.1f} vs FMA  "
                  f"{100 * tf / BF16_PEAK_TFLOPS:.0f}% of bf16 peak", flush=True)
            if best is None or tf > best[0]:
                best = (tf, label, ms)
            if not over:
                records.append(make_record("attention_prefill", f"flash_prefill {name} T={n}", tf, "TFLOP/s",
                                           BF16_PEAK_TFLOPS, fma_tf, "FP32 FMA prefill_attention", gpu, cmd,
                                           {"ms": ms, "block_k": cfg.block_k, "v_early": cfg.v_early}))
        print(f"{name}: best flash geometry {best[1]} ({best[0]:.1f} TFLOP/s)", flush=True)
        del kc, vc, q, out

    if args.json:
        print("wrote", write_records(records, args.json))


if __name__ == "__main__":
    main()
