"""Server metrics in the Prometheus text format (hand-written; no prometheus_client dependency).

The engine loop thread writes (counters, gauges, histograms); /metrics reads a snapshot under
the same lock. Names follow Prometheus conventions: `_total` counters, `_seconds` histograms.
"""
from __future__ import annotations

import threading
from bisect import bisect_left
from collections import Counter

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class Histogram:
    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]):
        self.name, self.help, self.buckets = name, help_text, buckets
        self.counts = [0] * (len(buckets) + 1)      # last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect_left(self.buckets, value)] += times
        self.sum += value * times
        self.count += times

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, n in zip(self.buckets, self.counts):
            cumulative += n
            lines.append(f'{self.name}_bucket{{le="{bound}"}} {cumulative}')
        lines.append(f'{self.name}_bucket{{le="+Inf"}} {self.count}')
        lines += [f"{self.name}_sum {self.sum:.6f}", f"{self.name}_count {self.count}"]
        return lines


def finish_label(reason: str) -> str:
    return "error" if reason.startswith("error") else reason


class Metrics:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.finished: Counter[str] = Counter()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.waiting = 0
        self.running = 0
        self.kv_usage = 0.0
        self.ttft = Histogram("metrale_time_to_first_token_seconds",
                              "Time from request arrival to its first generated token.", TTFT_BUCKETS)
        self.itl = Histogram("metrale_inter_token_latency_seconds",
                             "Time between consecutive generated tokens of a request.", ITL_BUCKETS)
        self.latency = Histogram("metrale_request_latency_seconds",
                                 "Time from request arrival to its last token.", LATENCY_BUCKETS)

    def render(self) -> str:
        with self.lock:
            lines = ["# HELP metrale_requests_total Finished requests by finish reason.",
                     "# TYPE metrale_requests_total counter"]
            for reason in sorted(set(self.finished) | {"stop", "length", "abort"}):
                lines.append(f'metrale_requests_total{{finish_reason="{reason}"}} {self.finished[reason]}')
            for name, kind, value, help_text in (
                ("metrale_prompt_tokens_total", "counter", self.prompt_tokens, "Prompt tokens of admitted requests."),
                ("metrale_generation_tokens_total", "counter", self.generation_tokens, "Generated tokens."),
                ("metrale_requests_waiting", "gauge", self.waiting, "Requests queued for admission."),
                ("metrale_requests_running", "gauge", self.running, "Requests being computed."),
                ("metrale_kv_cache_usage_ratio", "gauge", round(self.kv_usage, 6),
                 "Fraction of KV cache blocks in use (1 - free/total)."),
            ):
                lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value}"]
            for hist in (self.ttft, self.itl, self.latency):
                lines += hist.render()
        return "\n".join(lines) + "\n"
