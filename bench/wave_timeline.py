"""Where a served wave's time goes: bench.loadtest --timeline (each request's sent / first text /
end, client side) beside bench.serve_profile --serve-trace (each poll of the engine process), on
the one monotonic clock both read (time.perf_counter on Linux).

    python -m bench.wave_timeline TRACE.jsonl TIMELINE.json

For each wave (requests sent within 50 ms of each other, in send order) it prints how long the
engine took to see them (first poll with waiting requests after the first send), the polls that
admitted them and their time, the first tokens' arrival at the clients, and the engine's idle
time between the last poll of the wave before and this wave's admission.
"""
from __future__ import annotations

import json
import sys

import numpy as np


def waves(timeline: list[list], gap_s: float = 0.05) -> list[list[list]]:
    reqs = sorted((r for r in timeline if r[0] is not None), key=lambda r: r[0])
    out: list[list[list]] = []
    for r in reqs:
        if out and r[0] - out[-1][-1][0] < gap_s:
            out[-1].append(r)
        else:
            out.append([r])
    return out


def main(argv: list[str] | None = None) -> int:
    trace_path, timeline_path = (sys.argv[1:] if argv is None else argv)[:2]
    polls = [json.loads(line) for line in open(trace_path)]
    timeline = json.load(open(timeline_path))
    start = np.array([p["abs"] for p in polls])
    end = start + np.array([p["ms"] for p in polls]) / 1e3
    t0 = min(r[0] for r in timeline)
    ms = lambda t: (t - t0) * 1e3                                    # noqa: E731
    print(f"{len(polls)} polls, {len(timeline)} requests; times in ms from the first send")
    print(f"{'wave':>4} {'reqs':>4} {'sent':>8} {'..last':>8} {'engine saw':>10} {'admit polls':>11} {'admit ms':>8} "
          f"{'1st tok p50':>11} {'ends p50':>9} {'..last':>8} {'idle before':>11}")
    for i, w in enumerate(waves(timeline)):
        sent = [r[0] for r in w]
        k = int(np.searchsorted(start, sent[0]))
        admit = [j for j in range(k, len(polls)) if polls[j]["waiting"] > 0][:8]
        first_seen = start[admit[0]] if admit else float("nan")
        admit_ms = sum(polls[j]["ms"] for j in admit if polls[j]["waiting"] > 1)
        firsts = [r[1] for r in w if r[1] is not None]
        ends = [r[2] for r in w if r[2] is not None]
        busy_before = end[:k][end[:k] <= sent[0]]
        idle = (first_seen - busy_before.max()) * 1e3 if len(busy_before) else float("nan")
        print(f"{i:>4} {len(w):>4} {ms(sent[0]):>8.1f} {ms(sent[-1]):>8.1f} {ms(first_seen):>10.1f} "
              f"{len(admit):>11} {admit_ms:>8.1f} {ms(float(np.median(firsts))) if firsts else float('nan'):>11.1f} "
              f"{ms(float(np.median(ends))) if ends else float('nan'):>9.1f} {ms(max(ends)) if ends else float('nan'):>8.1f} "
              f"{idle:>11.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
