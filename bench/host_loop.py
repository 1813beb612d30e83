"""Host time of the engine's own loop: Engine.generate on SmolLM2's shape with the backend's
forward replaced by a zero-cost stub (the next token is a function of the last), so what is timed is
the scheduler, batch building, sampling bookkeeping, detokenization and (with --spec) the
speculator. CPU, no GPU needed.

    python -m bench.host_loop --batch 32 --tokens 64 [--spec ngram] [--ahead] [--profile]

--ahead runs the loop a step ahead (levers.overlap, metrale/overlap.py) as the CUDA backend does:
decode steps are built by AheadLoop._launch and read a step late (the stub computes at once).
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=100, help="prompt tokens a request")
    ap.add_argument("--spec", default=None, help="ngram: every draft accepted (a cycle of 7 tokens)")
    ap.add_argument("--ahead", action="store_true", help="the loop a step ahead, as on CUDA")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    from metrale import Engine, SamplingParams
    kw = {}
    if args.spec:
        kw = dict(spec={"method": args.spec, "num_drafts": 4},
                  levers={"spec_verify_cost": 0.0, "spec_measured_gate": "off"})
    eng = Engine(model="smollm2-135m-shape", device="cpu", cache={"num_blocks": 8192}, **kw)
    V = eng.model_config.vocab_size

    def next_tokens(batch, num_layers=None):      # a cycle of 7: n-gram drafts hit after one turn
        t = np.asarray(batch.token_ids)[batch.logits_indices]
        return ((t - 5 + 1) % 7 + 5).astype(np.int32)
    eng.backend.forward_greedy = next_tokens
    if args.ahead:
        from metrale.overlap import AheadLoop
        from metrale.runtime.backend import ReadyTokens, feed_tokens

        def launch_greedy(batch, prev=None, token_src=None):
            feed_tokens(batch, prev, token_src)
            return ReadyTokens(next_tokens(batch))
        eng.backend.launch_greedy = launch_greedy
        eng.ahead = AheadLoop(eng)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(5, V - 5, args.prompt) for _ in range(args.batch)]
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    eng.generate(prompts, params, use_tqdm=False)                 # warm-up
    steps = eng.stats["steps"]
    t = time.perf_counter()
    eng.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t
    steps = eng.stats["steps"] - steps
    print(f"{args.batch} x {args.tokens} tokens{' spec ' + args.spec if args.spec else ''}"
          f"{' ahead (' + str(eng.ahead.steps_ahead) + ' steps queued ahead)' if args.ahead else ''}: {dt * 1e3:.1f} ms "
          f"host time, {steps} steps, {dt / steps * 1e3:.2f} ms a step")
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        eng.generate(prompts, params, use_tqdm=False)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
