"""Where a sampled decode step's extra time goes, against greedy, on one engine.

    python -m bench.sampled_profile --model smollm2-135m-shape --batch 1 [--tokens 128] [--profile]

For each batch: decode tok/s of Engine.generate greedy and sampled (T 0.7, top-p 0.9; and T 0.7
alone), the host time of one DevicePipeline.launch (packing + two kernel launches + copies), the
device time of the two sampling kernels alone (CUDA events around back-to-back launches queued
behind a long GPU sleep, so the host's launch cost is hidden), and with --profile the top host
functions of a sampled generate (cProfile, tottime). The library's time to a first token
(generate(max_tokens=1) of a 16-token prompt) is printed too.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import numpy as np


def _pipeline_times(engine, rows: int, temperature: float, top_p: float, graphs: bool, split: bool = True,
                    iters: int = 50) -> tuple[float, float]:
    """(host us a launch, device us a launch) of the sampling pipeline over `rows` random rows."""
    from numba import cuda
    from kernels_numba import sampling as K
    from metrale.runtime.cuda import Event
    from metrale.sampling.device import DevicePipeline
    from metrale.sampling.sampler import PackedRows
    from bench.sampling_bench import fill_logits, spin
    backend = engine.backend
    V = engine.model_config.vocab_size
    logits = cuda.device_array((rows, V), np.float32)
    fill_logits[((rows + 15) // 16, (V + 15) // 16), (16, 16)](logits, 12345)
    pipe = DevicePipeline(backend, V, graphs=graphs, split=split)
    packed = PackedRows(rows, -(-V // 32))
    packed.fparams[:, K.F_INV_TEMP] = np.float32(1.0) / np.float32(temperature)
    packed.fparams[:, K.F_TOP_P] = top_p
    packed.fparams[:, K.F_LOG_MIN_P] = -np.inf
    packed.fparams[:, K.F_REP] = 1.0
    packed.iparams[:, K.I_TOP_K] = -1
    packed.iparams[:, K.I_NUM_LOGPROBS] = -1
    packed.iparams[:, K.I_SEED_LO] = np.arange(rows)
    mask = np.zeros((rows, 1), np.uint32)
    cuda.synchronize()
    for _ in range(3):
        pipe.launch(logits, mask, packed).result()
    t0 = time.perf_counter()
    for _ in range(iters):
        d = pipe.launch(logits, mask, packed)
    d.result()
    host_us = (time.perf_counter() - t0) / iters * 1e6
    s = backend.stream
    spin[1, 1, s.numba](100000)                   # ~100 ms: the launches below queue behind it
    start, end = Event(), Event()
    start.record(s)
    for _ in range(iters):
        d = pipe.launch(logits, mask, packed)
    end.record(s)
    end.synchronize()
    return host_us, start.elapsed_ms(end) * 1e3 / iters


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-shape")
    p.add_argument("--batch", type=int, nargs="+", default=[1])
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--device", default="cuda")
    p.add_argument("--profile", action="store_true")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    from bench.harness import PointSpec, _params, _timed, decode_tok_s, prompts
    from kernels_numba import sampling as K
    from metrale import Engine
    top = max(args.batch)
    engine = Engine(model=args.model, device=args.device, overrides=[
        f"scheduler.max_num_seqs={top}", f"levers.graph_batch_sizes=[{','.join(str(b) for b in sorted(set(args.batch)))}]",
        *args.overrides])
    one = prompts(engine, PointSpec(batch=1))
    _timed(engine, one, _params(PointSpec(), 1))
    ttft = min(_timed(engine, one, _params(PointSpec(), 1)) for _ in range(5))
    print(f"sampled_profile {args.model}: library generate(max_tokens=1), 16-token prompt: {ttft * 1e3:.2f} ms", flush=True)
    for batch in args.batch:
        cases = {"greedy": {}, "T0.7": {"temperature": 0.7}, "T0.7 top_p0.9": {"temperature": 0.7, "top_p": 0.9}}
        got = {}
        for name, sampling in cases.items():
            spec = PointSpec(batch=batch, prompt_tokens=16, tokens=args.tokens, reps=2, **sampling)
            got[name] = decode_tok_s(engine, spec, prompts(engine, spec))
        if engine.sampler.device is not None:           # the same sampled decode, sampling kernels eager
            engine.sampler.device.graphs = False
            spec = PointSpec(batch=batch, prompt_tokens=16, tokens=args.tokens, reps=2, temperature=0.7, top_p=0.9)
            got["T0.7 top_p0.9 eager sampling"] = decode_tok_s(engine, spec, prompts(engine, spec))
            engine.sampler.device.graphs = True
            dev, parts = engine.sampler.device, engine.sampler.device.parts   # the other levers.sampling_split
            dev.parts, dev._layouts = (None if parts is not None else K.split_parts(dev.max_rows)), {}
            spec = PointSpec(batch=batch, prompt_tokens=16, tokens=args.tokens, reps=2, temperature=0.7, top_p=0.9)
            got[f"T0.7 top_p0.9 sampling_split={dev.parts is not None}"] = decode_tok_s(engine, spec, prompts(engine, spec))
            dev.parts, dev._layouts = parts, {}
        line = " | ".join(f"{k} {v:,.0f} tok/s ({batch / v * 1e6:.0f} us/step)" for k, v in got.items())
        print(f"sampled_profile {args.model} B={batch}: {line}", flush=True)
        if args.device == "cuda":
            for t, tp, graphs, split in ((0.7, 1.0, True, True), (0.7, 1.0, True, False), (0.7, 1.0, False, True),
                                         (0.7, 0.9, True, True), (0.7, 0.9, True, False), (0.7, 0.9, False, True)):
                host, dev = _pipeline_times(engine, batch, t, tp, graphs, split)
                print(f"sampled_profile B={batch} T={t} top_p={tp} graphs={graphs} split={split}: DevicePipeline.launch "
                      f"host {host:.0f} us, on the device {dev:.0f} us", flush=True)
        if args.profile:
            spec = PointSpec(batch=batch, prompt_tokens=16, tokens=args.tokens, temperature=0.7, top_p=0.9)
            ps = prompts(engine, spec)
            for label, sp in (("sampled", spec), ("greedy", PointSpec(batch=batch, prompt_tokens=16, tokens=args.tokens))):
                prof = cProfile.Profile()
                prof.enable()
                t0 = time.perf_counter()
                engine.generate(ps, _params(sp, sp.tokens), use_tqdm=False)
                wall = time.perf_counter() - t0
                prof.disable()
                buf = io.StringIO()
                pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(22)
                print(f"--- cProfile {label} generate B={batch}, {sp.tokens} tokens, {wall * 1e3:.0f} ms wall "
                      f"({wall / sp.tokens * 1e6:.0f} us/step under the profiler)\n{buf.getvalue()}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
