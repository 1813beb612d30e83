"""Speculative decoding: acceptance length and speedup over plain decode, per drafter.

    python -m bench.spec_bench --device cpu --batch 1 8 --max-tokens 64 [--methods ngram self mtp]

Two tasks: a repetitive one (reproduce a given text with a small edit: drafts from the prompt
hit often) and open-ended chat (drafts rarely hit: the gate must keep the loss small).
Greedy, EOS ignored, the same requests for every method; speedup = plain time / method time.
"""
from __future__ import annotations

import argparse
import json
import time

from metrale import Engine, SamplingParams

PASSAGE = ("The committee met on Tuesday to review the budget for the new library. After a long "
           "discussion, the members agreed to increase the funds for children's books, to extend the "
           "opening hours on weekends, and to hire two more librarians before the end of the year.")
TASKS = {
    "repetitive": [f"Rewrite the following text, replacing 'Tuesday' with 'Friday' and changing nothing else:\n\n{PASSAGE}",
                   f"Copy this paragraph exactly:\n\n{PASSAGE}"],
    "open_chat": ["What are three good habits for staying healthy?", "Tell me a short story about a dragon.",
                  "Explain why the sky is blue.", "Give me some tips for learning a new language."],
}


def run(method: str, device: str, prompts: list[str], max_tokens: int, extra: dict) -> dict:
    spec = {"method": method, "num_drafts": 4, **extra}
    eng = Engine(model="smollm2-135m", device=device, spec=spec)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    eng.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0), chat=True, use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = eng.generate(prompts, params, chat=True, use_tqdm=False)
    dt = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    stats = eng.speculator.stats() if eng.speculator else {}
    return {"method": method, "seconds": dt, "tok_s": tokens / dt, "tokens": tokens,
            "tokens_per_verify": stats.get("tokens_per_verify"), "acceptance_rate": stats.get("acceptance_rate"),
            "token_ids": [o.token_ids.tolist() for o in outs]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--methods", nargs="+", default=["ngram", "self"])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    extra = {"self": {"self_layers": 10}}
    results = []
    for task, base in TASKS.items():
        for batch in args.batch:
            prompts = (base * batch)[:batch]
            plain = run("none", args.device, prompts, args.max_tokens, {})
            for method in args.methods:
                r = run(method, args.device, prompts, args.max_tokens, extra.get(method, {}))
                r["speedup"] = plain["seconds"] / r["seconds"]
                r["same_tokens_as_plain"] = r["token_ids"] == plain["token_ids"]
                r.update(task=task, batch=batch, plain_tok_s=plain["tok_s"])
                results.append(r)
                print(f"{task:10s} B={batch:3d} {method:6s} {r['tok_s']:7.1f} tok/s (plain {plain['tok_s']:7.1f}) "
                      f"speedup {r['speedup']:.2f}x  tokens/verify {r['tokens_per_verify'] or 0:.2f}  "
                      f"acceptance {r['acceptance_rate'] or 0:.2f}  lossless {r['same_tokens_as_plain']}", flush=True)
    if args.json:
        for r in results:
            r.pop("token_ids", None)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
