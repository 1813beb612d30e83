"""Times the quantized GEMV (kernels_numba.quant_gemv) of every GGUF type on Llama-3-8B's linear
shapes, beside the engine's bf16 GEMV/GEMM (kernels_numba.gemm) and torch's bf16 matmul, same run.

  python -m bench.quant_kernels [--types Q4_K,Q6_K,...] [--rows 1,8,32] [--shapes qkv,o,...]
                                [--json docs/bench/quant_kernels.json] [--sweep] [--precompile N]

Rows 1..8: one GEMV launch (x quantized to q8 in the kernel, weights dequantized in registers);
above 8 the GEMV is not used (metrale.runtime.cuda.quant.quant_linear): the figure is the many-rows
path, dequantize to a bf16 scratch + the bf16 GEMM (gemm.linear), and `gemv x k` (k launches of 8
rows, each reading the weight again) beside it. GB/s counts the weight bytes a launch reads (the
file's bytes, which the repacked planes keep exactly) over its time; the fraction is of the H200's
4.8 TB/s (datasheet) and of the 4.25 TB/s copy ceiling measured here (docs/gemm.md). bf16 GB/s
counts its 2-byte weights the same way.

Method (bench/timing.py): weight copies rotate past 4x the 60 MB L2, a GPU sleep is queued first so
the 30 timed launches run back to back, each between two events; the median is reported. Planes
hold random bytes (timing does not depend on the values; tests/gpu/test_quant_gpu.py checks the
results). --precompile N compiles every kernel the run needs in N processes first (Numba's disk
cache, kernels_numba/jit.py, then serves them to this one). --sweep times the GEMV's geometry
variants (warps, split, unroll, pipe, persist) at T = 1 and prints the best per shape and type.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
HBM = 4.8e12          # bytes/s, datasheet
COPY = 4.25e12        # bytes/s, measured copy ceiling (docs/gemm.md)
ROTATE_BYTES = 240 << 20
ITERS, WARMUP = 30, 3


def _kernel_jobs(types, shapes, rows, fp8=False):
    """(qtype, one, cfg) of every GEMV kernel the run launches (FP8: its x-rows bucket for one)."""
    from kernels_numba import quant_fp8 as F
    from kernels_numba import quant_gemv as QG
    jobs = set()
    if fp8:
        for name in shapes:
            N, K = SHAPES[name]
            for T in rows:
                t = min(T, F.MAX_T)
                jobs.add(("FP8", F.x_rows_bucket(t), F.fp8_gemv_cfg(N, K, t)))
    for qt in types:
        for name in shapes:
            N, K = SHAPES[name]
            for T in rows:
                for t in ([T] if T <= QG.MAX_T else [min(QG.MAX_T, QG.max_rows(qt, K))]):
                    t = min(t, QG.max_rows(qt, K))
                    jobs.add((qt, t == 1, QG.gemv_cfg(qt, N, K, t)))
    return sorted(jobs, key=str)


def compile_jobs(jobs, hint: bool = True) -> float:
    """Compile (qtype, one, cfg) kernels in this process (into the disk cache); seconds taken.
    qtype "FP8": quant_fp8's GEMV of cfg."""
    from numba import types as nt

    from kernels_numba import quant_fp8 as F
    from kernels_numba import quant_gemv as QG
    F2 = nt.Array(nt.float32, 2, "C")
    U8 = nt.Array(nt.uint8, 2, "C")
    sig = (F2, U8, U8, U8, U8, F2, F2, F2, nt.int64, nt.int64)
    sig8 = (F2, U8, F2, F2, F2, F2, nt.int64, nt.int64, nt.int64, nt.int64)
    QG.STREAM_HINT["on"] = hint
    t0 = time.time()
    for qt, one, cfg in jobs:
        if qt == "FP8":
            F.kernel(one, *cfg, False, True).compile(sig8)
        else:
            QG.kernel(qt, one, *cfg, False, True).compile(sig)
    return time.time() - t0


def precompile(jobs, procs: int) -> None:
    """Compile jobs in `procs` spawned processes into the disk cache. The generated kernel modules
    are written here first, so no process rewrites one another has keyed its cache entries on."""
    import multiprocessing as mp

    from kernels_numba import quant_gemv as QG
    from kernels_numba import quant_fp8 as F
    jobs = list(jobs)
    for qt, one, cfg in jobs:
        if qt == "FP8":
            F.py_kernel(one, *cfg, False, True)
        else:
            QG.py_kernel(qt, one, *cfg, False, True)
    chunks = [jobs[i::procs] for i in range(procs) if jobs[i::procs]]
    t0 = time.time()
    with mp.get_context("spawn").Pool(len(chunks)) as pool:
        secs = pool.starmap(compile_jobs, [(c, QG.STREAM_HINT["on"]) for c in chunks])
    print(f"# precompiled {len(jobs)} kernels in {len(chunks)} processes: {time.time() - t0:.0f} s wall "
          f"({sum(secs):.0f} s of compiling)", flush=True)


def _rand_planes(qt, N, K, rng, copies):
    """`copies` sets of random plane bytes on the device in the repacked layout's shapes (the fp16
    scale bytes masked so the scales stay finite), and the bytes one set holds."""
    from numba import cuda

    from kernels_numba import quant_layout as L
    small = L.random_blocks(qt, 1, K, np.random.default_rng(0))
    widths = {k: v.shape[1] for k, v in L.repack(qt, small, K).items() if v is not None}
    filler = cuda.to_device(np.zeros((1, 16), np.uint8))
    host = {}
    for k, wd in widths.items():
        h = rng.integers(0, 256, (N, wd), dtype=np.uint8)
        if k == "dm" or (k == "sc" and qt in (L.Q4_K, L.Q5_K)):
            h &= 0x3B
        host[k] = h
    sets = []
    for i in range(copies):
        sets.append({k: (cuda.to_device(host[k]) if k in host else filler) for k in L.PLANES})
    return sets, sum(N * wd for wd in widths.values())


SHAPES["tiny"] = (64, 512)     # a dry run under the simulator (NUMBA_ENABLE_CUDASIM=1 ... --shapes tiny)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", default="Q4_0,Q4_1,Q5_0,Q5_1,Q8_0,Q4_K,Q5_K,Q6_K,FP8")
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--json", default=None)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--precompile", type=int, default=0,
                    help="compile the run's GEMV kernels in N processes first (disk cache)")
    ap.add_argument("--precompile-only", action="store_true",
                    help="with --precompile: compile (T = 1 and 8 for the shapes' K) and exit")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--hint", type=int, default=1, help="0: weight loads without the streaming hints")
    ap.add_argument("--mma-warps", default="8,8:1:4,8:2:2,4:2:4,16:1:2",
                    help="tensor-core GEMV (quant_mma) variants W[:tiles[:launch-bound blocks]]")
    args = ap.parse_args()
    from kernels_numba import quant_gemv as QG
    QG.STREAM_HINT["on"] = bool(args.hint)

    from kernels_numba import quant_layout as L
    names = {v: k for k, v in L.NAMES.items()}
    fp8 = "FP8" in args.types.split(",")
    types = [names[t] for t in args.types.split(",") if t != "FP8"]
    rows = [int(r) for r in args.rows.split(",")]
    shapes = args.shapes.split(",")
    if args.precompile:
        pre_rows = sorted(set(rows) | {1, 8}) if args.precompile_only else rows
        precompile(_kernel_jobs(types, shapes, pre_rows, fp8), args.precompile)
        if args.precompile_only:
            return

    from numba import cuda

    from bench.timing import time_launches
    from kernels_numba import gemm, quant_dequant, quant_gemv as QG
    from kernels_numba import quant_mma as QM
    torch = None
    if not args.no_torch:
        try:
            import torch
        except ImportError:
            pass
    gpu = torch.cuda.get_device_name() if torch is not None else str(getattr(cuda.get_current_device(), "name", "?"))
    print(f"# {gpu}  torch {getattr(torch, '__version__', None)}  streaming load hints {QG.STREAM_HINT['on']}", flush=True)
    records, t_start = [], time.time()

    def rec(figure, value, unit, limit=None, peer=None, peer_name=None, **extra):
        from bench.records import make_record
        records.append(make_record("quant_kernels", figure, value, unit, limit, peer, peer_name, gpu,
                                   "python -m bench.quant_kernels " + " ".join(sys.argv[1:]), extra))

    rng = np.random.default_rng(0)
    for name in shapes:
        N, K = SHAPES[name]
        xs = {T: cuda.to_device(rng.standard_normal((T, K)).astype(np.float32)) for T in rows}
        outs = {T: cuda.to_device(np.zeros((T, N), np.float32)) for T in rows}
        # bf16 beside it: the engine's kernels (gemm.linear: its T = 1 GEMV, skinny / tiled mma) and torch
        nrot_b = max(1, min(8, -(-ROTATE_BYTES // (2 * N * K))))
        hb = (rng.integers(0, 1 << 16, (N, K), dtype=np.uint16) & np.uint16(0x807F)) | np.uint16(0x3C00)   # +-[2^-7, 2^-6)
        wbs = [cuda.to_device(hb) for _ in range(nrot_b)]
        del hb
        bf16 = {}
        for T in rows:
            ms = time_launches(lambda i: gemm.linear(xs[T], wbs[i], outs[T]), nrot_b, ITERS, WARMUP)
            bf16[T] = ms
            tms = None
            if torch is not None:
                xt = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
                wt = [torch.as_tensor(w.view(np.int16), device="cuda").view(torch.bfloat16) for w in wbs]
                tms = time_launches(lambda i: torch.matmul(xt, wt[i].T), nrot_b, ITERS, WARMUP)
            gbs = 2 * N * K / (ms * 1e-3) / 1e9
            print(f"{name:8s} {N:6d}x{K:5d} T={T:3d} bf16 gemm.linear {ms * 1e3:8.1f} us {gbs:7.0f} GB/s"
                  + ("" if tms is None else f"   torch {tms * 1e3:8.1f} us {2 * N * K / (tms * 1e-3) / 1e9:7.0f} GB/s"),
                  flush=True)
            rec(f"{name} T={T} bf16 gemm.linear", gbs, "GB/s", HBM / 1e9, None if tms is None else
                2 * N * K / (tms * 1e-3) / 1e9, "torch bf16 matmul", us=ms * 1e3, N=N, K=K, T=T)
        del wbs
        for qt in types:
            bsize, bbytes = L.BLOCK[qt]
            nrot = max(1, min(16, -(-ROTATE_BYTES // (N * K // bsize * bbytes))))
            copies, nbytes = _rand_planes(qt, N, K, rng, nrot)
            for T in rows:
                x, out = xs[T], outs[T]
                if T <= QG.max_rows(qt, K):
                    launch = (lambda i, x=x, out=out, T=T: QG.gemv(x, copies[i], out, T, qtype=qt, residual=out))
                    ms = time_launches(launch, nrot, ITERS, WARMUP)
                    kind = "gemv " + str(QG.gemv_path(qt, N, K, T)[0])
                else:
                    step = min(QG.MAX_T, QG.max_rows(qt, K))
                    k = -(-T // step)

                    def launch(i, x=x, out=out, T=T, step=step):
                        for t0 in range(0, T, step):
                            t = min(step, T - t0)
                            QG.gemv(x[t0:t0 + t], copies[i], out[t0:t0 + t], t, qtype=qt, residual=out[t0:t0 + t])
                    ms_k = time_launches(launch, nrot, ITERS, WARMUP)
                    scratch = cuda.device_array((N, K), np.uint16)
                    ms_d = time_launches(lambda i: quant_dequant.dequant_bf16(copies[i], scratch, qt), nrot, ITERS, WARMUP)
                    ms = time_launches(lambda i, x=x, out=out: (quant_dequant.dequant_bf16(copies[i], scratch, qt),
                                                                 gemm.linear(x, scratch, out)), nrot, ITERS, WARMUP)
                    print(f"{name:8s} {N:6d}x{K:5d} T={T:3d} {L.NAMES[qt]:5s} gemv x {k}: {ms_k * 1e3:8.1f} us"
                          f"   dequant alone {ms_d * 1e3:7.1f} us", flush=True)
                    rec(f"{name} T={T} {L.NAMES[qt]} gemv x {k}", nbytes / (ms_k * 1e-3) / 1e9, "GB/s", HBM / 1e9,
                        us=ms_k * 1e3, N=N, K=K, T=T)
                    rec(f"{name} {L.NAMES[qt]} dequant to bf16", ms_d * 1e3, "us", None, us=ms_d * 1e3, N=N, K=K)
                    kind = "dequant+gemm"
                gbs = nbytes / (ms * 1e-3) / 1e9
                print(f"{name:8s} {N:6d}x{K:5d} T={T:3d} {L.NAMES[qt]:5s} {ms * 1e3:8.1f} us {gbs:7.0f} GB/s "
                      f"{gbs * 1e9 / HBM:5.0%} of 4.8 TB/s {gbs * 1e9 / COPY:5.0%} of copy   "
                      f"{bf16[T] / ms:4.2f}x bf16   {kind}", flush=True)
                rec(f"{name} T={T} {L.NAMES[qt]}", gbs, "GB/s", HBM / 1e9, 2 * N * K / (bf16[T] * 1e-3) / 1e9,
                    "bf16 gemm.linear (its bytes/s)", us=ms * 1e3, bytes=nbytes, N=N, K=K, T=T, kind=kind,
                    speedup_vs_bf16=bf16[T] / ms, copy_ceiling_fraction=gbs * 1e9 / COPY)
                if T <= QM.MAX_T and QM.supports(qt, K):
                    _mma(qt, name, N, K, T, x, out, copies, nrot, nbytes, ms, bf16[T], args.mma_warps, rec)
            if args.sweep and qt in (L.Q4_K, L.Q6_K, L.Q8_0, L.Q4_0):
                _sweep(qt, N, K, name, copies, nrot, nbytes, xs[1], outs[1], rec)
            del copies
        if fp8:
            _fp8(name, N, K, rows, xs, outs, bf16, rng, rec)
            if args.sweep:
                _fp8_sweep(name, N, K, rng, rec)
    hits = misses = 0
    from kernels_numba import quant_fp8
    for k in list(QG._KERNELS.values()) + list(quant_fp8._KERNELS.values()):
        hits += sum(getattr(k, "_cache_hits", {}).values())
        misses += sum(getattr(k, "_cache_misses", {}).values())
    print(f"# {time.time() - t_start:.0f} s; GEMV kernels from the disk cache: {hits}, compiled here: {misses}", flush=True)
    if args.json:
        from bench.records import write_records
        write_records(records, args.json)
        print("# wrote", args.json)


def _mma(qt, name, N, K, T, x, out, copies, nrot, nbytes, ms_dp4a, ms_bf16, warps, rec):
    """The tensor-core GEMV (kernels_numba.quant_mma): x quantized by its own launch, then the GEMV,
    for each block size; beside the dp4a GEMV's time (ms_dp4a) and bf16's."""
    from numba import cuda

    from bench.timing import time_launches
    from kernels_numba import quant_layout as L
    from kernels_numba import quant_mma as QM
    xq, xsc = QM.x_buffers(K)
    ms_q = time_launches(lambda i: QM.quantize_x(x, T, xq, xsc), 1, ITERS, WARMUP)
    for v in warps.split(","):       # W[:tiles[:blocks]]
        w, r, b = (list(map(int, v.split(":"))) + [QM.TILES, QM.BLOCKS])[:3]
        def launch(i, w=w, r=r, b=b):
            QM.quantize_x(x, T, xq, xsc)
            QM.gemv(xq, xsc, copies[i], out, T, qtype=qt, residual=out, warps=w, tiles=r, blocks=b)
        ms = time_launches(launch, nrot, ITERS, WARMUP)
        ms_g = time_launches(lambda i, w=w, r=r, b=b: QM.gemv(xq, xsc, copies[i], out, T, qtype=qt, residual=out,
                                                              warps=w, tiles=r, blocks=b), nrot, ITERS, WARMUP)
        gbs = nbytes / (ms * 1e-3) / 1e9
        gbs_g = nbytes / (ms_g * 1e-3) / 1e9
        print(f"{name:8s} {N:6d}x{K:5d} T={T:3d} {L.NAMES[qt]:5s} {ms * 1e3:8.1f} us {gbs:7.0f} GB/s "
              f"{gbs * 1e9 / HBM:5.0%} of 4.8 TB/s   mma {v:7s} (gemv alone {ms_g * 1e3:6.1f} us {gbs_g:5.0f} GB/s,"
              f" quantize {ms_q * 1e3:4.1f} us)  {ms_dp4a / ms:4.2f}x dp4a  {ms_bf16 / ms:4.2f}x bf16", flush=True)
        rec(f"{name} T={T} {L.NAMES[qt]} mma {v}", gbs, "GB/s", HBM / 1e9, None, None, us=ms * 1e3,
            gemv_us=ms_g * 1e3, quantize_us=ms_q * 1e3, N=N, K=K, T=T, speedup_vs_dp4a=ms_dp4a / ms,
            speedup_vs_bf16=ms_bf16 / ms)
    if qt != L.Q4_K:
        return
    # the fragment layout (quant_mma.repack_mq): random bytes of its planes' shapes
    rng = np.random.default_rng(1)
    tiles, nsb = -(-N // 16), K // 256
    mqs = [{"mq": cuda.to_device(rng.integers(0, 256, (tiles, nsb * 2048), dtype=np.uint8)),
            "ms": cuda.to_device(rng.integers(0, 256, (tiles, nsb * 256), dtype=np.uint8))} for _ in range(nrot)]
    for w in (4, 8, 16):
        def launch(i, w=w):
            QM.quantize_x(x, T, xq, xsc)
            QM.gemv_mq(xq, xsc, mqs[i], out, T, N, residual=out, warps=w)
        ms = time_launches(launch, nrot, ITERS, WARMUP)
        ms_g = time_launches(lambda i, w=w: QM.gemv_mq(xq, xsc, mqs[i], out, T, N, residual=out, warps=w),
                             nrot, ITERS, WARMUP)
        gbs, gbs_g = nbytes / (ms * 1e-3) / 1e9, nbytes / (ms_g * 1e-3) / 1e9
        print(f"{name:8s} {N:6d}x{K:5d} T={T:3d} {L.NAMES[qt]:5s} {ms * 1e3:8.1f} us {gbs:7.0f} GB/s "
              f"{gbs * 1e9 / HBM:5.0%} of 4.8 TB/s   mma-mq W={w:2d} (gemv alone {ms_g * 1e3:6.1f} us {gbs_g:5.0f} GB/s)"
              f"  {ms_dp4a / ms:4.2f}x dp4a  {ms_bf16 / ms:4.2f}x bf16", flush=True)
        rec(f"{name} T={T} {L.NAMES[qt]} mma-mq W={w}", gbs, "GB/s", HBM / 1e9, None, None, us=ms * 1e3,
            gemv_us=ms_g * 1e3, N=N, K=K, T=T, speedup_vs_dp4a=ms_dp4a / ms, speedup_vs_bf16=ms_bf16 / ms)
    if T == 8:
        img = cuda.device_array((N, K), np.uint16)
        ms_d = time_launches(lambda i: QM.dequant_mq_bf16(mqs[i], img, N), nrot, ITERS, WARMUP)
        print(f"{name:8s} {N:6d}x{K:5d} Q4_K fragment layout dequant to bf16 {ms_d * 1e3:7.1f} us", flush=True)


def _fp8_weights(N, K, rng):
    """Random finite e4m3 bytes [N, K] with 128 x 128 block scales, copies enough to rotate past
    L2: (device copies, device scales, bn, bk, bytes a copy, copies)."""
    from numba import cuda

    from kernels_numba import quant_fp8 as F
    q = rng.integers(0, 256, (N, K), dtype=np.uint8)
    q[(q & 0x7F) == 0x7F] = 0x30                 # no NaN codes
    S, bn, bk = F.scale_grid(rng.uniform(0.01, 0.02, (-(-N // 128), -(-K // 128))).astype(np.float32), N, K, (128, 128))
    nbytes = q.nbytes + S.nbytes
    nrot = max(1, min(16, -(-ROTATE_BYTES // nbytes)))
    return [cuda.to_device(q) for _ in range(nrot)], cuda.to_device(S), bn, bk, nbytes, nrot


def _fp8(name, N, K, rows, xs, outs, bf16, rng, rec):
    """FP8 e4m3 with 128 x 128 block scales (DeepSeek-V3 / Qwen3-FP8's layout): the FP8 GEMV for
    T <= 8, dequantize to bf16 + the bf16 GEMM above."""
    from numba import cuda

    from bench.timing import time_launches
    from kernels_numba import gemm, quant_fp8 as F
    dq, dS, bn, bk, nbytes, nrot = _fp8_weights(N, K, rng)
    for T in rows:
        x, out = xs[T], outs[T]
        if T <= F.MAX_T:
            ms = time_launches(lambda i: F.fp8_gemv(x, dq[i], dS, out, T, bn=bn, bk=bk, residual=out), nrot, ITERS, WARMUP)
            kind = "fp8 gemv " + str(F.fp8_gemv_cfg(N, K, T))
        else:
            scratch = cuda.device_array((N, K), np.uint16)
            ms = time_launches(lambda i: (F.dequant_bf16(dq[i], dS, scratch, bn=bn, bk=bk),
                                          gemm.linear(x, scratch, out)), nrot, ITERS, WARMUP)
            kind = "dequant+gemm"
        gbs = nbytes / (ms * 1e-3) / 1e9
        print(f"{name:8s} {N:6d}x{K:5d} T={T:3d} FP8   {ms * 1e3:8.1f} us {gbs:7.0f} GB/s "
              f"{gbs * 1e9 / HBM:5.0%} of 4.8 TB/s {gbs * 1e9 / COPY:5.0%} of copy   "
              f"{bf16[T] / ms:4.2f}x bf16   {kind}", flush=True)
        rec(f"{name} T={T} FP8", gbs, "GB/s", HBM / 1e9, 2 * N * K / (bf16[T] * 1e-3) / 1e9,
            "bf16 gemm.linear (its bytes/s)", us=ms * 1e3, bytes=nbytes, N=N, K=K, T=T, kind=kind,
            speedup_vs_bf16=bf16[T] / ms, copy_ceiling_fraction=gbs * 1e9 / COPY)


def _fp8_sweep(name, N, K, rng, rec):
    """The FP8 GEMV at one row for each (warps, rows a warp, chunks a lane) on block-scaled weights:
    the configuration fp8_gemv_cfg should pick for this shape."""
    from numba import cuda

    from bench.timing import time_launches
    from kernels_numba import quant_fp8 as F
    dq, dS, bn, bk, nbytes, nrot = _fp8_weights(N, K, rng)
    x = cuda.to_device(rng.standard_normal((1, K)).astype(np.float32))
    out = cuda.to_device(np.zeros((1, N), np.float32))
    res = []
    for warps in (4, 8):
        for rows, unroll in ((1, 1), (1, 2), (2, 1), (2, 2), (4, 1), (4, 2), (8, 1)):
            if (K // 16) % (32 * unroll):
                continue
            cfg = (warps, rows, unroll, True)
            try:
                ms = time_launches(lambda i: F.fp8_gemv(x, dq[i], dS, out, 1, bn=bn, bk=bk, cfg=cfg), nrot, ITERS, WARMUP)
            except Exception as exc:            # a configuration that does not fit the registers
                print(f"{name:8s} FP8 sweep {cfg}: {type(exc).__name__}: {str(exc)[:80]}", flush=True)
                continue
            gbs = nbytes / (ms * 1e-3) / 1e9
            res.append((ms, cfg))
            print(f"{name:8s} {N:6d}x{K:5d} T=  1 FP8 sweep W={warps} R={rows} U={unroll}: {ms * 1e3:7.1f} us {gbs:6.0f} GB/s",
                  flush=True)
            rec(f"{name} T=1 FP8 sweep W={warps} R={rows} U={unroll}", gbs, "GB/s", HBM / 1e9, us=ms * 1e3, N=N, K=K)
    if res:
        best = min(res)
        print(f"{name:8s} FP8 best {best[1]} {best[0] * 1e3:.1f} us; default {F.fp8_gemv_cfg(N, K, 1)}", flush=True)


def _sweep(qt, N, K, name, copies, nrot, nbytes, x, out, rec):
    from bench.timing import time_launches
    from kernels_numba import quant_gemv as QG
    from kernels_numba import quant_layout as L
    res = []
    for warps in (4, 8):
        for split in (1, 2, 4):
            for unroll in ((1,) if qt in L.KQUANTS else (1, 2, 4)):
                units = K // (256 if qt in L.KQUANTS else 32)
                if units % ((32 // split) * unroll):
                    continue
                for persist in (2, 4, 8):
                    path = QG.gemv_path(qt, N, K, 1, warps=warps, split=split, unroll=unroll, persist=persist)
                    ms = time_launches(lambda i: QG.gemv(x, copies[i], out, 1, qtype=qt, residual=out, path=path),
                                       nrot, ITERS, WARMUP)
                    res.append((ms, warps, split, unroll, persist))
    res.sort()
    for ms, warps, split, unroll, persist in res[:3]:
        gbs = nbytes / (ms * 1e-3) / 1e9
        print(f"  sweep {name} {L.NAMES[qt]} T=1 warps {warps} split {split} unroll {unroll} persist {persist}: "
              f"{ms * 1e3:.1f} us {gbs:.0f} GB/s", flush=True)
    ms, warps, split, unroll, persist = res[0]
    rec(f"sweep {name} {L.NAMES[qt]} T=1 best", nbytes / (ms * 1e-3) / 1e9, "GB/s", HBM / 1e9,
        warps=warps, split=split, unroll=unroll, persist=persist, us=ms * 1e3)


if __name__ == "__main__":
    main()
