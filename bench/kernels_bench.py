"""Times kernels_numba.attention on Llama-3-8B shapes (32 q heads, 8 kv heads, head_dim 128,
KV block 16): paged_attention decode at batch 1/32/128 x context 512/4096, and prefill_attention
on one 4096-token prompt.

  python bench/kernels_bench.py [--batches 1,32,128] [--contexts 512,4096] [--prefill 4096]
                                [--sweep] [--torch] [--flash-decode] [--json FILE]

Method: a GPU sleep is queued first so that the timed launches (after warm-up) queue up behind
it and run back to back; every launch sits between two CUDA events (numba `cuda.event()`) on the
default stream and the median of 50 intervals is reported, so Python launch cost is excluded.
Decode KV caches rotate among enough disjoint block sets to exceed 4x the L2. Decode GB/s counts
the K and V bytes read (every sequence at the full context); the copy ceiling (device-to-device
memcpy) is measured in the same run. Prefill TFLOP/s counts 4 * hd * Hq * sum(positions + 1)
(QK^T and PV, causal). --sweep also times other decode geometries (tpt, unroll, chunk);
--torch adds torch SDPA peers (bf16, contiguous KV) when torch is installed. --flash-decode also
times kernels_numba.flash_decode (tensor cores) on each decode shape, next to paged_attention
(with --sweep: its warps x keys geometries too).
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HQ, HK, HD, BS = 32, 8, 128, 16
ITERS, WARMUP = 50, 3
ROTATE_BYTES = 240 << 20
HBM_TBPS = 4.8  # H200 spec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--contexts", default="512,4096")
    ap.add_argument("--prefill", type=int, default=4096)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--torch", action="store_true")
    ap.add_argument("--flash-decode", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from numba import cuda

    from bench import timing
    from kernels_numba import attention as A
    from kernels_numba.random_init import fill_normal_bf16

    def time_launches(launch, n_rot=1):
        return timing.time_launches(launch, n_rot, ITERS, WARMUP)

    dev = cuda.get_current_device()
    gpu = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
    print(f"# {gpu}", flush=True)
    records = []

    def record(figure, value, unit, limit=None, peer=None, peer_name=None):
        from bench.records import make_record

        records.append(make_record("kernels_attention", figure, value, unit, limit, peer, peer_name, gpu,
                                   "python " + " ".join(sys.argv)))

    # copy ceiling
    src = cuda.device_array(1 << 28, np.float32)
    dst = cuda.device_array(1 << 28, np.float32)
    ms = time_launches(lambda i: dst.copy_to_device(src))
    ceiling = 2 * src.nbytes / ms / 1e9
    print(f"copy ceiling (D2D memcpy 1 GiB): {ceiling:.2f} TB/s", flush=True)
    del src, dst
    record("copy ceiling (D2D memcpy)", ceiling, "TB/s", HBM_TBPS)

    rng = np.random.default_rng(0)
    scale = 1.0 / math.sqrt(HD)

    def decode_setup(batch, ctx):
        blocks = batch * (-(-ctx // BS))
        kv_bytes = 2 * batch * ctx * HK * HD * 2
        n_rot = max(1, -(-4 * 60e6 // kv_bytes)) if kv_bytes < ROTATE_BYTES else 1
        n_rot = int(min(n_rot, 128))
        nb = blocks * n_rot
        kc = cuda.device_array((nb, BS, HK, HD), np.uint16)
        vc = cuda.device_array((nb, BS, HK, HD), np.uint16)
        fill_normal_bf16(kc.reshape(kc.size), 1, 1.0)
        fill_normal_bf16(vc.reshape(vc.size), 2, 1.0)
        perm = rng.permutation(nb).astype(np.int32).reshape(n_rot, batch, -1)
        tables = [cuda.to_device(np.ascontiguousarray(perm[r])) for r in range(n_rot)]
        q = cuda.to_device(rng.standard_normal((batch, HQ, HD), dtype=np.float32))
        pos = cuda.to_device(np.full(batch, ctx - 1, np.int32))
        tseq = cuda.to_device(np.arange(batch, dtype=np.int32))
        out = cuda.device_array((batch, HQ, HD), np.float32)
        scratch = cuda.device_array((batch * 16, HQ, HD + 2), np.float32)   # room for any forced split
        k64, v64 = kc.view(np.uint64), vc.view(np.uint64)
        return kv_bytes, n_rot, (q, k64, v64, tables, tseq, pos, out, scratch)

    for ctx in [int(c) for c in args.contexts.split(",")]:
        for batch in [int(b) for b in args.batches.split(",")]:
            kv_bytes, n_rot, (q, k64, v64, tables, tseq, pos, out, scratch) = decode_setup(batch, ctx)
            cfgs = [None]
            if args.sweep:          # forced split counts with the default geometry, then geometries
                cfgs += [("parts", n) for n in (1, 2, 4, 8, 16)]
                cfgs += [A.decode_config(HD, HQ // HK, tpt=t, unroll=u, chunk=c)
                         for t in (4, 8, 16, 32) if (HD // 8) % t == 0
                         for u in (1, 2, 4) for c in (64, 128, 256)]
            ours = None
            for cfg in cfgs:
                forced = cfg[1] if isinstance(cfg, tuple) else None
                geo = None if isinstance(cfg, tuple) else cfg
                if forced and batch * forced > scratch.shape[0]:
                    continue

                def launch(i, geo=geo, forced=forced):
                    A.paged_attention(q, k64, v64, tables[i], tseq, pos, scale, out, scratch=scratch,
                                      max_context=ctx, config=geo, partitions=forced)
                try:
                    ms = time_launches(launch, n_rot)
                except Exception as e:  # a sweep geometry may not fit (shared memory, registers)
                    print(f"  {cfg}: failed ({type(e).__name__}: {e})")
                    continue
                c = geo or A.decode_config(HD, HQ // HK)
                parts, part = A.decode_partitions(batch, HK, ctx, c, scratch.shape[0])
                parts = forced or parts
                tbps = kv_bytes / ms / 1e9
                tag = "" if geo is None else f" tpt={c.tpt} unroll={c.unroll} chunk={c.chunk}"
                print(f"decode  B={batch:<4d} ctx={ctx:<5d} parts={parts:<3d}{tag}: {ms * 1e3:8.1f} us  "
                      f"{tbps:5.2f} TB/s ({tbps / ceiling:4.0%} of copy)  KV {kv_bytes / 1e6:.0f} MB", flush=True)
                if cfg is None:
                    ours = tbps
            if args.flash_decode:
                from kernels_numba import flash_decode as FD

                fcfgs = [None]
                if args.sweep:
                    fcfgs += [FD.flash_decode_config(HD, HQ // HK, BS, warps=w, keys=k)
                              for w in (2, 4, 8) for k in (8, 16)]
                for fcfg in fcfgs:
                    def flaunch(i, fcfg=fcfg):
                        FD.flash_decode_attention(q, k64, v64, tables[i], tseq, pos, scale, out, scratch=scratch,
                                                  max_context=ctx, config=fcfg)
                    try:
                        ms = time_launches(flaunch, n_rot)
                    except Exception as e:
                        print(f"  flash_decode {fcfg}: failed ({type(e).__name__}: {e})")
                        continue
                    c = fcfg or FD.flash_decode_config(HD, HQ // HK, BS)
                    parts = FD.flash_decode_partitions(batch, HK, ctx, c, scratch.shape[0])[0]
                    tbps = kv_bytes / ms / 1e9
                    print(f"flash   B={batch:<4d} ctx={ctx:<5d} parts={parts:<3d} warps={c.warps} keys={c.keys}: "
                          f"{ms * 1e3:8.1f} us  {tbps:5.2f} TB/s ({tbps / ceiling:4.0%} of copy)", flush=True)
                    if fcfg is None:
                        record(f"flash_decode decode llama3-8b B={batch} ctx={ctx}", tbps, "TB/s", ceiling,
                               ours, "paged_attention (CUDA cores)" if ours else None)
            peer = torch_decode(batch, ctx) if args.torch else None
            if ours is not None:
                record(f"paged_attention decode llama3-8b B={batch} ctx={ctx}", ours, "TB/s", ceiling,
                       peer, "torch SDPA (contiguous bf16 KV)" if peer else None)
            del q, k64, v64, tables, out, scratch

    if args.prefill:
        n = args.prefill
        blocks = -(-n // BS)
        kc = cuda.device_array((blocks, BS, HK, HD), np.uint16)
        vc = cuda.device_array((blocks, BS, HK, HD), np.uint16)
        fill_normal_bf16(kc.reshape(kc.size), 3, 1.0)
        fill_normal_bf16(vc.reshape(vc.size), 4, 1.0)
        tables = cuda.to_device(rng.permutation(blocks).astype(np.int32).reshape(1, -1))
        starts = cuda.to_device(np.array([0, n], np.int32))
        pos = cuda.to_device(np.arange(n, dtype=np.int32))
        q = cuda.to_device(rng.standard_normal((n, HQ, HD), dtype=np.float32))
        out = cuda.device_array((n, HQ, HD), np.float32)
        flops = 4.0 * HD * HQ * n * (n + 1) / 2
        ms = time_launches(lambda i: A.prefill_attention(q, kc, vc, tables, starts, pos, scale, out, max_query_len=n))
        tf = flops / ms / 1e9
        print(f"prefill T={n}: {ms:8.2f} ms  {tf:6.2f} TFLOP/s (FP32 FMA)", flush=True)

        # the same prompt through paged_attention (one block per token and kv head)
        tseq = cuda.to_device(np.zeros(n, np.int32))
        ms2 = time_launches(lambda i: A.paged_attention(q, kc, vc, tables, tseq, pos, scale, out, max_context=n))
        print(f"prefill T={n} through paged_attention: {ms2:8.2f} ms  {flops / ms2 / 1e9:6.2f} TFLOP/s", flush=True)
        peer = torch_prefill(n) if args.torch else None
        record(f"prefill_attention llama3-8b T={n}", tf, "TFLOP/s", None, peer,
               "torch SDPA (bf16 tensor cores)" if peer else None)

    if args.json:
        from bench.records import write_records

        write_records(records, args.json)


def _torch_time(fn):
    import torch

    for _ in range(WARMUP):
        fn()
    torch.cuda.synchronize()
    evs = [torch.cuda.Event(enable_timing=True) for _ in range(ITERS + 1)]
    torch.cuda._sleep(int(2e9 * 0.02))
    evs[0].record()
    for i in range(ITERS):
        fn()
        evs[i + 1].record()
    evs[-1].synchronize()
    return float(np.median([evs[i].elapsed_time(evs[i + 1]) for i in range(ITERS)]))


def torch_decode(batch, ctx):
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return None
    q = torch.randn(batch, HQ, 1, HD, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, HK, ctx, HD, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    ms = _torch_time(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    tbps = 2 * k.numel() * 2 / ms / 1e9
    print(f"  torch SDPA decode B={batch} ctx={ctx} (contiguous bf16 KV): {ms * 1e3:8.1f} us  {tbps:5.2f} TB/s")
    return tbps


def torch_prefill(n):
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return None
    q = torch.randn(1, HQ, n, HD, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, HK, n, HD, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    ms = _torch_time(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    flops = 4.0 * HD * HQ * n * (n + 1) / 2
    print(f"  torch SDPA prefill T={n} (bf16, tensor cores): {ms:8.2f} ms  {flops / ms / 1e9:6.2f} TFLOP/s")
    return flops / ms / 1e9


if __name__ == "__main__":
    main()
