"""One benchmark harness behind the pytest-benchmark suites (bench/test_*.py) and the Hydra
multirun entry (`python -m metrale bench=<kind> -m levers.<x>=a,b`).

A point is (kind, settings): `measure(kind, engine, spec)` runs it on an engine built from the
settings and returns a bench record (bench/records.py: value, unit, limit, ratio; extra: the
settings, peak host RSS and device memory). Kinds:
- decode: B prompts of P tokens, N greedy tokens, EOS ignored; tok/s of the decode phase
  (generate(N) minus generate(1): prefill and first token drop out);
- prefill: one prompt of P tokens, max_tokens=1; prompt tok/s;
- sampling: decode as above with the point's sampling (temperature / top_p / penalties);
- offline: nano-vllm's protocol scaled to `requests` requests; output tok/s;
- spec: decode of a repetitive prompt with the point's drafter (spec.method).
On CUDA the limit of decode is its bandwidth bound (weights + KV bytes a step over the copy rate).
"""
from __future__ import annotations

import dataclasses
import resource
import time
from typing import Any

import numpy as np

KINDS = ("decode", "prefill", "sampling", "offline", "spec")
COPY_BYTES_S = 4.25e12           # H200 device copy, measured (docs/performance.md)


@dataclasses.dataclass
class PointSpec:
    """What a point measures (the `bench` config group: conf/bench/<kind>.yaml)."""
    kind: str = "decode"
    batch: int = 1
    prompt_tokens: int = 16
    tokens: int = 32
    requests: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    reps: int = 1


def _params(spec: PointSpec, tokens: int):
    from metrale import SamplingParams
    return SamplingParams(max_tokens=tokens, temperature=spec.temperature, top_p=spec.top_p,
                          repetition_penalty=spec.repetition_penalty, seed=0, ignore_eos=True)


def prompts(engine, spec: PointSpec, batch: int | None = None, length: int | None = None) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    vocab = engine.model_config.vocab_size
    return [rng.integers(3, vocab, length or spec.prompt_tokens).astype(np.int32) for _ in range(batch or spec.batch)]


def _timed(engine, prompts, params) -> float:
    """Seconds of one generate; a request that ended with an error (or short) fails the point."""
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    want = params.max_tokens if params.ignore_eos else None
    for o in outs:
        if str(o.finish_reason).startswith("error") or (want is not None and len(o.token_ids) != want):
            raise RuntimeError(f"benchmark request {o.request_id} ended '{o.finish_reason}' after "
                               f"{len(o.token_ids)} tokens")
    return seconds


def decode_tok_s(engine, spec: PointSpec, batch_prompts) -> float:
    """Decode tok/s of generate(tokens) minus generate(1) (prefill and first token drop out), best of reps."""
    _timed(engine, batch_prompts, _params(spec, spec.tokens))        # warm: kernels, graphs
    best = 0.0
    for _ in range(max(spec.reps, 1)):
        full = _timed(engine, batch_prompts, _params(spec, spec.tokens))
        first = _timed(engine, batch_prompts, _params(spec, 1))
        best = max(best, len(batch_prompts) * (spec.tokens - 1) / max(full - first, 1e-9))
    return best


def _decode_limit(engine, spec: PointSpec) -> float | None:
    if engine.backend.name != "cuda":
        return None
    c = engine.model_config
    context = spec.prompt_tokens + spec.tokens // 2
    step_bytes = c.num_parameters() * 2 + spec.batch * context * c.kv_bytes_per_token(2)
    return spec.batch * COPY_BYTES_S / step_bytes


def measure(kind: str, engine, spec: PointSpec) -> tuple[float, str, float | None]:
    """(value, unit, limit) of one point on `engine`."""
    if kind in ("decode", "sampling"):
        return decode_tok_s(engine, spec, prompts(engine, spec)), "tok/s", _decode_limit(engine, spec)
    if kind == "spec":
        base = np.tile(np.arange(3, 3 + max(spec.prompt_tokens // 4, 2), dtype=np.int32), 4)
        return decode_tok_s(engine, spec, [base] * spec.batch), "tok/s", None
    if kind == "prefill":
        one = prompts(engine, spec, batch=1)
        _timed(engine, one, _params(spec, 1))
        t = min(_timed(engine, one, _params(spec, 1)) for _ in range(max(spec.reps, 1)))
        return spec.prompt_tokens / t, "tok/s", None
    if kind == "offline":
        from bench.peers import nano_vllm_requests
        reqs = nano_vllm_requests(spec.requests, spec.prompt_tokens, spec.tokens)
        rng = np.random.default_rng(0)
        vocab = engine.model_config.vocab_size
        ids = [rng.integers(3, vocab, n_in).astype(np.int32) for n_in, _ in reqs]
        params = [_params(spec, n_out) for _, n_out in reqs]
        engine.generate(ids[:2], params[:2], use_tqdm=False)
        t0 = time.perf_counter()
        engine.generate(ids, params, use_tqdm=False)
        return sum(n for _, n in reqs) / (time.perf_counter() - t0), "tok/s", None
    raise ValueError(f"bench kind {kind!r}; valid: {', '.join(KINDS)}")


def memory(engine) -> dict[str, float]:
    mem = engine.memory_report()
    return {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "device_used_gb": mem.get("device_used_bytes", 0) / 2**30}


def record(kind: str, engine, spec: PointSpec, settings: dict[str, Any], command: str) -> dict:
    """Measures a point and returns its bench record."""
    from bench.records import make_record
    value, unit, limit = measure(kind, engine, spec)
    gpu = "NVIDIA H200" if engine.backend.name == "cuda" else "CPU"
    name = " ".join(f"{k}={v}" for k, v in sorted(settings.items())) or "defaults"
    extra = {"settings": settings, "spec": dataclasses.asdict(spec), **memory(engine)}
    return make_record(f"{kind}_sweep", f"{engine.model_config.name} B={spec.batch} {name}", value, unit, limit,
                       None, None, gpu, command, extra)
