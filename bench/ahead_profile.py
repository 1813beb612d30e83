"""Where the host's time goes in Engine.generate with the loop a step ahead, on the device.

    python -m bench.ahead_profile --model llama-3.2-1b-shape --batch 32 [--tokens 256] [--top 35]

One warm generate, then one timed without a profiler (host ms a step beside the decode graph's
replay), then one under cProfile: the top functions by own time. The time the host waits for the
device shows up in the synchronizing call (the copy of a step's ids); everything else is host
work that the device waits for once it exceeds the replay time.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3.2-1b-shape")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--top", type=int, default=35)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    from bench.harness import PointSpec, prompts
    from bench.user_decode import replay_tok_s
    from metrale import Engine, SamplingParams
    engine = Engine(model=args.model, device="cuda", overrides=[
        f"scheduler.max_num_seqs={args.batch}", f"levers.graph_batch_sizes=[{args.batch}]", *args.overrides])
    spec = PointSpec(batch=args.batch, prompt_tokens=16, tokens=args.tokens, reps=1)
    batch_prompts = prompts(engine, spec)
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    engine.generate(batch_prompts, params, use_tqdm=False)
    t0 = time.perf_counter()
    engine.generate(batch_prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    replay = replay_tok_s(engine, args.batch, 16 + args.tokens // 2)
    print(f"ahead_profile {args.model} B={args.batch}: {wall / args.tokens * 1e3:.3f} ms a step of generate "
          f"(prefill included), replay {args.batch / replay * 1e3:.3f} ms", flush=True)
    prof = cProfile.Profile()
    prof.enable()
    engine.generate(batch_prompts, params, use_tqdm=False)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.top)
    print(out.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
