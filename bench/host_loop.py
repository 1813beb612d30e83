"""Host time of the engine's own loop: Engine.generate on SmolLM2's shape with the backend's
forward replaced by a zero-cost stub (the next token is a function of the last), so what is timed is
the scheduler, batch building, sampling bookkeeping, detokenization and (with --spec) the
speculator. CPU, no GPU needed.

    python -m bench.host_loop --batch 32 --tokens 64 [--spec ngram] [--ahead] [--served] [--profile]

--ahead runs the loop a step ahead (levers.overlap, metrale/overlap.py) as the CUDA backend does:
decode steps are built by AheadLoop._launch and read a step late (the stub computes at once).
--served steps the engine as the server's engine process does (metrale/server/engine_child.py):
the EngineLoop's step and dispatch, every request streamed (a delta a step; its text decoded by the
server process, as EngineProcess leaves it for plain requests), each step's deltas packed into one
message written to a pipe that a thread drains.
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
    ap.add_argument("--served", action="store_true", help="the engine process's loop: streamed deltas, one message a step")
    ap.add_argument("--engine-text", action="store_true",
                    help="with --served: the engine decodes every request's text (before the server process did)")
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
    run = served_runner(eng, args.engine_text) if args.served else (lambda ps, p: eng.generate(ps, p, use_tqdm=False))
    run(prompts, params)                                           # warm-up
    steps = eng.stats["steps"]
    t, cpu = time.perf_counter(), time.process_time()
    run(prompts, params)
    dt, cpu = time.perf_counter() - t, time.process_time() - cpu
    steps = eng.stats["steps"] - steps
    print(f"{args.batch} x {args.tokens} tokens{' spec ' + args.spec if args.spec else ''}{' served' if args.served else ''}"
          f"{' ahead (' + str(eng.ahead.steps_ahead) + ' steps queued ahead)' if args.ahead else ''}: {dt * 1e3:.1f} ms "
          f"host time, {steps} steps, {dt / steps * 1e3:.2f} ms a step ({cpu / steps * 1e3:.2f} ms of CPU)")
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        run(prompts, params)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def served_runner(eng, engine_text: bool = False):
    """run(prompts, params) through the engine process's loop, on this thread: adds as its command
    reader applies them, then EngineLoop steps (poll, dispatch to the outbox) until all end."""
    import concurrent.futures
    import os
    import threading

    from dataclasses import replace

    from metrale.driver import EngineLoop, _Live
    from metrale.server.engine_child import _Outbox, _Sink
    from metrale.server.engine_process import _decodes_here
    r, w = os.pipe()

    def drain() -> None:                # the server's reader side: frames are read and dropped
        while os.read(r, 1 << 20):
            pass
    threading.Thread(target=drain, daemon=True).start()
    out, loop = _Outbox(w), EngineLoop(eng)
    counter = iter(range(1 << 30))

    def run(prompts, params) -> None:
        for p in prompts:
            key = next(counter)
            live = _Live(out, _Sink(key, out), time.perf_counter(), {0})
            ids = [int(t) for t in p]
            sent = params if engine_text or not _decodes_here(ids, params) else replace(params, detokenize=False)
            loop._apply(("add", f"s{key}", ids, sent, live, concurrent.futures.Future(), False))
        while eng.has_unfinished():
            loop._step()
    return run


if __name__ == "__main__":
    main()
