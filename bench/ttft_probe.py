"""Where a served request's first token waits: one client, sequential streamed completions.

    python -m bench.ttft_probe --url http://127.0.0.1:8000 --model smollm2-135m-shape [--requests 20]

Per request (bench.loadtest's prompts and keep-alive client): the time to the response headers
(the server accepted it and the engine took it), to the first streamed token, and to the end;
then the engine's own time to first token (the server's /metrics histogram, measured from the
request's arrival at the engine loop to its first token) beside the client's, so the gap shows
whether the wait is in the engine or in the HTTP path.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import time
import urllib.request

from bench.loadtest import Connection, make_prompt


def _engine_ttft(url: str) -> tuple[float, int]:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    total = float(re.search(r"^metrale_time_to_first_token_seconds_sum(?:\{[^}]*\})? (\S+)$", text, re.M).group(1))
    count = int(float(re.search(r"^metrale_time_to_first_token_seconds_count(?:\{[^}]*\})? (\S+)$", text, re.M).group(1)))
    return total, count


async def _requests(args, n: int) -> list[tuple[float, float]]:
    conn = Connection(args.url, {})
    rows = []
    for i in range(n):
        body = {"model": args.model, "prompt": make_prompt(i, args.prompt_words), "max_tokens": args.max_tokens,
                "temperature": 0.0, "stream": True, "ignore_eos": True}
        t0 = time.perf_counter()
        first = None
        async for payload in conn.post_stream("/v1/completions", body):
            if first is None and payload != b"[DONE]":
                chunk = json.loads(payload)
                if chunk.get("choices"):        # a token's chunk (its text may be empty: a special token)
                    first = time.perf_counter()
        rows.append((first - t0 if first else float("nan"), time.perf_counter() - t0))
    conn.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--prompt-words", type=int, default=16)
    args = p.parse_args(argv)
    asyncio.run(_requests(args, 1))                    # warm: compiles, the first captures
    s0, c0 = _engine_ttft(args.url)
    rows = asyncio.run(_requests(args, args.requests))
    s1, c1 = _engine_ttft(args.url)
    ttft = [r[0] * 1e3 for r in rows]
    print(f"ttft_probe: {len(rows)} sequential requests, {args.prompt_words} words, {args.max_tokens} tokens: client TTFT "
          f"median {statistics.median(ttft):.1f} ms (min {min(ttft):.1f}, max {max(ttft):.1f}); whole request median "
          f"{statistics.median(r[1] * 1e3 for r in rows):.1f} ms; engine-side TTFT mean "
          f"{(s1 - s0) / max(c1 - c0, 1) * 1e3:.1f} ms over {c1 - c0} requests")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
