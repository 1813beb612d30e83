"""Sampling pipeline time per decode step (prepare_rows + sample_rows, kernels_numba/sampling.py) for
batch 1..256 and vocabularies of 49,152 (SmolLM2) and 151,936 (Qwen2.5), against the decode forward
of the same batch (bench.decode_metrale, random weights of the real shape): the target is sampling
under 5% of the step at batch 64 (issue 5).

  python -m bench.sampling_bench --out docs/bench/sampling.json          # H200: ~60 s
  python -m bench.sampling_bench --quick --out /tmp/sampling.json        # batch 1, 64, 256
  python -m bench.sampling_bench --device cpu --out /tmp/sampling.json   # NumPy reference, small sizes

Scenarios (every row of the batch alike, no mask, no penalties, no logprobs):
  greedy       temperature 0 (the engine's plain-greedy rows take forward_greedy's argmax instead)
  temperature  T = 0.8
  top_k+top_p  top_k = 50, top_p = 0.9, T = 0.8
  min_p        min_p = 0.05, T = 1.0
Logits are N(0, 3^2) (float32, on the device, written once; repeated launches leave them as they
are: no adjustments). GPU method: the kernel pair is launched WARMUP times, then ITERS times between
CUDA events on the default stream behind a GPU sleep (so Python launch cost is not in the figure);
the median interval is reported. The forward is decode_tok_s's median step (a CUDA-graph decode step
at context 512, greedy argmax, host sync included). Records: benchmark "sampling", figure
"sampling_ms B=<B> V=<V> <scenario>", unit ms, limit = 5% of that forward (None with --no-forward).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from numba import cuda  # noqa: E402

from kernels_numba import sampling as K  # noqa: E402

BATCHES = (1, 8, 32, 64, 128, 256)
QUICK_BATCHES = (1, 64, 256)
VOCABS = {49152: "smollm2-135m-shape", 151936: "qwen2.5-0.5b-shape"}
SCENARIOS = ("greedy", "temperature", "top_k+top_p", "min_p")
ITERS, WARMUP = 20, 3


def params(scenario: str, R: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Packed fparams [R, NF] / iparams [R, NI] of one scenario."""
    f = np.zeros((R, K.NF), np.float32)
    i = np.zeros((R, K.NI), np.int32)
    temp, top_k, top_p, min_p = {"greedy": (0.0, -1, 1.0, 0.0), "temperature": (0.8, -1, 1.0, 0.0),
                                 "top_k+top_p": (0.8, 50, 0.9, 0.0), "min_p": (1.0, -1, 1.0, 0.05)}[scenario]
    f[:, K.F_INV_TEMP] = 0.0 if temp == 0 else np.float32(1.0) / np.float32(temp)
    f[:, K.F_TOP_P] = top_p
    f[:, K.F_LOG_MIN_P] = math.log(min_p) if min_p > 0 else -np.inf
    f[:, K.F_REP] = 1.0
    i[:, K.I_TOP_K] = top_k
    i[:, K.I_NUM_LOGPROBS] = -1
    rng = np.random.default_rng(seed)
    i[:, K.I_SEED_LO] = rng.integers(-2**31, 2**31, R)
    i[:, K.I_SEED_HI] = rng.integers(-2**31, 2**31, R)
    i[:, K.I_STEP] = 7
    return f, i


def gpu_name(device: str) -> str:
    if device == "cuda":
        try:
            from numba import cuda
            name = cuda.get_current_device().name
            return name.decode() if isinstance(name, bytes) else str(name)
        except Exception:
            return "cuda"
    return f"CPU ({os.cpu_count()} cores)"


# ---------------------------------------------------------------- GPU


@cuda.jit
def spin(n):
    """A GPU sleep: the timed launches queue up behind it."""
    for _ in range(n):
        cuda.nanosleep(np.uint32(1000))


_M32 = np.uint64(0xFFFFFFFF)


@cuda.jit
def fill_logits(x, seed):
    """Roughly N(0, 3^2) logits from a hash, on the device (no host transfer of R x V floats)."""
    r, j = cuda.grid(2)
    if r < x.shape[0] and j < x.shape[1]:
        h = (np.uint64(r) * np.uint64(2654435761) + np.uint64(j) * np.uint64(40503) + np.uint64(seed)) & _M32
        h = h | np.uint64(1)
        acc = np.float32(0.0)
        for _ in range(4):                  # Irwin-Hall(4), scaled: close enough to a normal
            h = (h ^ (h << np.uint64(13))) & _M32
            h = h ^ (h >> np.uint64(17))
            h = (h ^ (h << np.uint64(5))) & _M32
            acc += np.float32(h) * np.float32(2.0 ** -32)
        x[r, j] = (acc - np.float32(2.0)) * np.float32(3.0 * math.sqrt(3.0))


def time_sampling_gpu(batches, vocabs, scenarios, iters=ITERS) -> dict:
    """{(V, B, scenario): median ms of prepare_rows + sample_rows}."""
    out = {}
    Rmax = max(batches)
    z1 = cuda.to_device(np.zeros(1, np.int32))
    zf = cuda.to_device(np.zeros(1, np.float32))
    raw = cuda.device_array(1, np.float32)
    lse = cuda.device_array(Rmax, np.float32)
    top_ids = cuda.device_array((Rmax, K.MAX_TOP_LOGPROBS), np.int32)
    top_lps = cuda.device_array((Rmax, K.MAX_TOP_LOGPROBS), np.float32)
    toks = cuda.device_array(Rmax, np.int32)
    lps = cuda.device_array(Rmax, np.float32)
    for V in vocabs:
        logits = cuda.device_array((Rmax, V), np.float32)
        fill_logits[((Rmax + 15) // 16, (V + 15) // 16), (16, 16)](logits, 12345)
        mask = cuda.to_device(np.zeros((Rmax, -(-V // 32)), np.uint32))
        for sc in scenarios:
            fh, ih = params(sc, Rmax)
            f, i = cuda.to_device(fh), cuda.to_device(ih)
            for B in batches:
                x, fb, ib, mb = logits[:B], f[:B], i[:B], mask[:B]
                lse_b, ids_b, lps_b, toks_b, lp_b = lse[:B], top_ids[:B], top_lps[:B], toks[:B], lps[:B]

                def launch():
                    K.prepare_rows(x, fb, ib, z1, z1, zf, raw, lse_b, ids_b, lps_b)
                    K.sample_rows(x, mb, fb, ib, z1, raw, lse_b, toks_b, lp_b)

                for _ in range(WARMUP):
                    launch()
                cuda.synchronize()
                evs = [cuda.event() for _ in range(iters + 1)]
                if not K.SIMULATOR:
                    spin[1, 1](5000)             # ~5 ms: the launches queue up behind it
                evs[0].record()
                for n in range(iters):
                    launch()
                    evs[n + 1].record()
                evs[-1].synchronize()
                ms = float(np.median([evs[n].elapsed_time(evs[n + 1]) for n in range(iters)]))
                out[(V, B, sc)] = ms
                got = toks_b.copy_to_host()
                note = "" if (got >= 0).all() else "  INVALID TOKENS"
                if B <= 8:                       # the same tokens as the NumPy pipeline (a sanity check)
                    want = K.sample_rows_ref(x.copy_to_host(), mb.copy_to_host(), fh[:B], ih[:B],
                                             np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.float32))[0]
                    note += f"  reference: {int((got == want).sum())}/{B} same tokens"
                print(f"  sampling V={V:6d} B={B:3d} {sc:12s} {ms * 1e3:9.1f} us{note}", flush=True)
        del logits, mask
    return out


def forward_ms_gpu(batches, vocabs, context: int, steps: int) -> dict:
    """{(V, B): decode step ms} through bench.decode_metrale on random weights of the model of V."""
    from bench.decode_metrale import decode_tok_s, make_backend
    out = {}
    for V in vocabs:
        model = VOCABS[V]
        per_seq = -(-(context + steps + 3 + 1) // 16)
        blocks = max(batches) * per_seq + 16
        t0 = time.perf_counter()
        try:
            config, backend, _ = make_backend(model, max(batches), [f"cache.num_blocks={blocks}", "cache.block_size=16"])
            print(f"  {model}: built in {time.perf_counter() - t0:.1f} s", flush=True)
            assert config.vocab_size == V, (model, config.vocab_size, V)
            for B in batches:
                r = decode_tok_s(backend, B, context, steps=steps, warmup=3)
                out[(V, B)] = r["step_ms"]
                print(f"  forward  V={V:6d} B={B:3d} {r['step_ms']:.3f} ms/step", flush=True)
        except Exception as e:          # the sampling figures still get written (without a limit)
            print(f"  forward of {model} failed: {type(e).__name__}: {e}", flush=True)
            continue
        del backend
        import gc
        gc.collect()
    return out


# ---------------------------------------------------------------- CPU (the NumPy reference)


def time_sampling_cpu(batches, vocabs, scenarios, iters=3) -> dict:
    """The CPU backend's sampler (sample_rows_ref): a smoke path that runs without a GPU."""
    out = {}
    rng = np.random.default_rng(0)
    z1, zf = np.zeros(0, np.int32), np.zeros(0, np.float32)
    for V in vocabs:
        logits = (rng.standard_normal((max(batches), V)) * 3).astype(np.float32)
        mask = np.zeros((max(batches), -(-V // 32)), np.uint32)
        for sc in scenarios:
            f, i = params(sc, max(batches))
            for B in batches:
                times = []
                for _ in range(iters):
                    t0 = time.perf_counter()
                    toks, *_ = K.sample_rows_ref(logits[:B], mask[:B], f[:B], i[:B], z1, z1, zf)
                    times.append((time.perf_counter() - t0) * 1e3)
                assert (toks >= 0).all()
                out[(V, B, sc)] = float(np.median(times))
                print(f"  sampling V={V:6d} B={B:3d} {sc:12s} {out[(V, B, sc)]:9.3f} ms", flush=True)
    return out


# ---------------------------------------------------------------- main


def records(samp: dict, fwd: dict, gpu: str, command: str) -> list[dict]:
    from bench.records import make_record
    recs = []
    for (V, B, sc), ms in samp.items():
        f = fwd.get((V, B))
        recs.append(make_record("sampling", f"sampling_ms B={B} V={V} {sc}", ms, "ms",
                                None if f is None else 0.05 * f, None, None, gpu, command,
                                extra={"batch": B, "vocab": V, "scenario": sc, "forward_ms": f,
                                       "model": VOCABS.get(V), "fraction_of_forward": None if not f else ms / f}))
    return recs


def table(samp: dict, fwd: dict) -> str:
    lines = [f"{'V':>7} {'B':>4} {'scenario':12} {'sampling ms':>11} {'forward ms':>10} {'% of fwd':>8}"]
    for (V, B, sc), ms in samp.items():
        f = fwd.get((V, B))
        pct = "-" if not f else f"{100 * ms / f:.1f}%"
        lines.append(f"{V:>7} {B:>4} {sc:12} {ms:11.4f} {('-' if f is None else f'{f:.3f}'):>10} {pct:>8}")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="JSON file for the records (bench/records.py format)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cuda: the kernels on the GPU; cpu: the NumPy reference at small sizes (smoke)")
    ap.add_argument("--quick", action="store_true", help=f"batches {QUICK_BATCHES} only")
    ap.add_argument("--batch", type=int, nargs="+", default=None, help=f"batch sizes (default {BATCHES})")
    ap.add_argument("--vocab", type=int, nargs="+", default=None,
                    help=f"vocabulary sizes (default {tuple(VOCABS)}; cpu: 1024 4096)")
    ap.add_argument("--scenario", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    ap.add_argument("--no-forward", action="store_true", help="skip the decode forward (no limit in the records)")
    ap.add_argument("--context", type=int, default=512, help="KV context of the forward's sequences")
    ap.add_argument("--steps", type=int, default=16, help="timed decode steps per batch size")
    ap.add_argument("--iters", type=int, default=ITERS, help="timed sampling launches per point")
    args = ap.parse_args(argv)
    command = "python -m bench.sampling_bench " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.device == "cpu":
        batches = args.batch or ((1, 8) if args.quick else (1, 8, 32))
        vocabs = args.vocab or (1024, 4096)
        samp = time_sampling_cpu(batches, vocabs, args.scenario)
        fwd = {}
    else:
        batches = args.batch or (QUICK_BATCHES if args.quick else BATCHES)
        vocabs = args.vocab or tuple(VOCABS)
        t0 = time.perf_counter()
        samp = time_sampling_gpu(batches, vocabs, args.scenario, args.iters)
        print(f"sampling timed in {time.perf_counter() - t0:.1f} s", flush=True)
        fwd = {} if args.no_forward else forward_ms_gpu(batches, [v for v in vocabs if v in VOCABS], args.context,
                                                         args.steps)
    print(table(samp, fwd))
    if args.out:
        from bench.records import write_records
        written = write_records(records(samp, fwd, gpu_name(args.device), command), args.out)
        print("wrote", ", ".join(written))


if __name__ == "__main__":
    main()
