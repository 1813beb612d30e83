"""The benchmark run of docs/performance.md: metrale and its peers on one GPU, in one session.

    python -m bench.run_all --stage metrale --out raw/     # metrale decode/prefill sweeps
    python -m bench.run_all --stage offline --out raw/     # nano-vllm offline throughput + Poisson latency
    python -m bench.run_all --stage peers --out raw/       # torch.compile loop, HF generate, ceilings
    python -m bench.run_all --stage report --out raw/ --docs docs/   # records JSON + table + plot

Stages write raw JSON so a stage can run in its own process (the peers need their own memory).
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

DECODE = {"smollm2-135m-shape": [1, 8, 32, 128, 256], "llama-3.2-1b-shape": [1, 32],
          "llama-3-8b-shape": [1, 8, 32, 128, 256]}
PREFILL = {"smollm2-135m-shape": 4096, "llama-3-8b-shape": 4096}
CONTEXT = 512
COMMAND = "python -m bench.run_all --stage {stage} --out raw/"
LEVERS: dict[str, str] = {}          # --lever name=value: applied to every metrale backend / engine


def _save(out: Path, name: str, data) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(data, indent=1))
    print(f"[run_all] wrote {out / name}.json", flush=True)


def stage_metrale(out: Path) -> None:
    from bench.decode_metrale import decode_tok_s, make_backend, prefill_tok_s
    results = {}
    for model, batches in DECODE.items():
        blocks = max(batches) * (-(-(CONTEXT + 64) // 16)) + 64 + (PREFILL.get(model, 0) // 16 + 1)
        t0 = time.perf_counter()
        config, backend, load_s = make_backend(model, max(batches), [f"cache.num_blocks={blocks}",
                                                                    *(f"levers.{k}={v}" for k, v in LEVERS.items())])
        r = {"load_s": load_s, "decode": [], "kv_tokens_fit_0.9": backend.kv_tokens_that_fit(0.9)}
        for b in batches:
            d = decode_tok_s(backend, b, CONTEXT)
            print(f"[metrale] {model} B={b}: {d['tok_s']:.0f} tok/s ({d['step_ms']:.3f} ms)", flush=True)
            r["decode"].append(d)
        if model in PREFILL:
            p = prefill_tok_s(backend, PREFILL[model])
            print(f"[metrale] {model} prefill {PREFILL[model]}: {p['tok_s']:.0f} tok/s {p['tflops']:.1f} TFLOP/s", flush=True)
            r["prefill"] = p
        r["memory"] = backend.memory_report()
        r["wall_s"] = time.perf_counter() - t0
        backend.close()
        results[model] = r
        _save(out, "metrale", results)


OFFLINE_MODELS = ("smollm2-135m-shape", "llama-3.2-1b-shape")
HF_OFFLINE = (32, 512, 256)          # the HF peer's subset: requests, longest prompt, longest output
QUICK = {"requests": 6, "max_input": 48, "max_output": 24, "num_blocks": 64, "poisson_n": 6}


def bandwidth_bound(step_log, weight_bytes: int, kv_bytes_per_token: int, copy_bytes_s: float | None,
                    generated_tokens: int, flops_per_token: float | None = None,
                    peak_flops: float | None = None) -> dict:
    """The KV+weight bandwidth bound of a run that did these forwards.

    step_log: one (tokens in the forward, KV tokens read) per forward, as Engine.step_log records
    them; KV tokens read = sum over the forward's segments of (first position + segment length),
    i.e. every segment reads the K/V of its whole context once. Each forward reads the weights
    once. bound_s = sum over forwards of (weight_bytes + kv_tokens * kv_bytes_per_token) / copy
    bandwidth, and bound_tok_s = generated_tokens / bound_s: the rate if every forward only
    streamed the bytes it must read at the measured device-copy rate (no compute, no launch gaps).
    With flops_per_token and peak_flops, roofline_s also counts compute: per forward the larger
    of its byte time and tokens * flops_per_token / peak_flops (prefill forwards are compute-bound).
    """
    steps = len(step_log)
    tokens = sum(int(t) for t, _ in step_log)
    kv_tokens = sum(int(k) for _, k in step_log)
    total = steps * weight_bytes + kv_tokens * kv_bytes_per_token
    out = {"forwards": steps, "batch_tokens": tokens, "kv_tokens_read": kv_tokens,
           "weight_bytes_read": steps * weight_bytes, "kv_bytes_read": kv_tokens * kv_bytes_per_token,
           "bytes_read": total, "copy_bytes_s": copy_bytes_s, "bound_s": None, "bound_tok_s": None}
    if copy_bytes_s:
        out["bound_s"] = total / copy_bytes_s
        out["bound_tok_s"] = generated_tokens / out["bound_s"] if total else None
        if flops_per_token and peak_flops:
            roof = sum(max((weight_bytes + int(k) * kv_bytes_per_token) / copy_bytes_s,
                           int(t) * flops_per_token / peak_flops) for t, k in step_log)
            out["roofline_s"] = roof
            out["roofline_tok_s"] = generated_tokens / roof if roof else None
    return out


def analytic_bound(requests, weight_bytes: int, kv_bytes_per_token: int, copy_bytes_s: float) -> float:
    """A schedule-free bound (tok/s): all requests resident at once, so the weights are read once
    per token of the longest output, and each generated token reads its own context once
    (prefill not counted)."""
    kv = sum(o * p + o * (o - 1) // 2 for p, o in requests) * kv_bytes_per_token
    return sum(o for _, o in requests) / ((max(o for _, o in requests) * weight_bytes + kv) / copy_bytes_s)


def _offline_bound(model: str, r: dict, copy_bytes_s: float | None, peak_tflops: float | None) -> dict:
    """bandwidth_bound of an offline.json entry (its step log), with bf16 weights and KV."""
    from bench.peers import kv_bytes_per_token, layer_params, lm_head_params, load_shape, weight_bytes
    shape = load_shape(model)
    b = bandwidth_bound(r["step_log"], weight_bytes(shape), kv_bytes_per_token(shape), copy_bytes_s,
                        r["output_tokens"], 2.0 * (layer_params(shape) + lm_head_params(shape)),
                        peak_tflops * 1e12 if peak_tflops else None)
    if copy_bytes_s and r.get("request_lengths"):
        b["analytic_bound_tok_s"] = analytic_bound(r["request_lengths"], weight_bytes(shape),
                                                   kv_bytes_per_token(shape), copy_bytes_s)
    return b


def stage_offline(out: Path, n_requests: int = 256, *, quick: bool = False, device: str = "cuda",
                  models=OFFLINE_MODELS, copy_bytes_s: float | None = None) -> dict:
    """nano-vllm offline throughput + Poisson latency per shape. quick: a few short requests
    (QUICK) on the given device with a small KV pool: a smoke test of the code paths (CPU)."""
    from bench.peers import nano_vllm_requests
    from metrale import Engine, SamplingParams
    results = {}
    for model in models:
        if quick:
            eng = Engine(model=model, device=device, scheduler={"max_num_seqs": 8, "max_num_batched_tokens": 64,
                                                                 "max_model_len": 256},
                         cache={"num_blocks": QUICK["num_blocks"]}, levers=dict(LEVERS))
            reqs = nano_vllm_requests(QUICK["requests"], QUICK["max_input"], QUICK["max_output"])
        else:
            eng = Engine(model=model, device=device, scheduler={"max_num_seqs": 256, "max_num_batched_tokens": 4096,
                                                                 "max_model_len": 4096},
                         cache={"gpu_memory_utilization": 0.5}, levers=dict(LEVERS))
            reqs = nano_vllm_requests(n_requests)
        rng = np.random.default_rng(0)
        prompts = [rng.integers(0, eng.model_config.vocab_size, p) for p, _ in reqs]
        params = [SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True) for _, o in reqs]
        eng.generate(prompts[:4], params[:4], use_tqdm=False)           # warm-up: compile kernels
        steps0 = eng.stats["steps"]
        eng.step_log = []                                               # (tokens, KV tokens read) per forward
        t0 = time.perf_counter()
        outs = eng.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        step_log, eng.step_log = eng.step_log, None
        gen = sum(len(o.token_ids) for o in outs)
        r = {"requests": len(reqs), "output_tokens": gen, "seconds": dt, "tok_s": gen / dt,
             "prompt_tokens": sum(p for p, _ in reqs), "steps": eng.stats["steps"] - steps0,
             "preemptions": eng.scheduler.num_preemptions, "memory": eng.memory_report(),
             "device": device, "quick": quick, "request_lengths": [list(x) for x in reqs],
             "step_log": [list(x) for x in step_log]}
        bound = _offline_bound(model, r, copy_bytes_s, None)
        msg = f"[offline] {model}: {gen} tokens in {dt:.1f} s = {gen / dt:.0f} tok/s, {bound['forwards']} forwards"
        if bound["bound_tok_s"]:
            msg += f"; bandwidth bound {bound['bound_tok_s']:.0f} tok/s ({gen / dt / bound['bound_tok_s']:.1%})"
        print(msg, flush=True)
        if quick:
            r["poisson"] = poisson_latency(eng, rate=50.0, n=QUICK["poisson_n"], prompt_len=16, output_len=4)
        else:
            r["poisson"] = poisson_latency(eng, rate=16.0, n=64, prompt_len=256, output_len=128)
            r["poisson_64"] = poisson_latency(eng, rate=64.0, n=128, prompt_len=256, output_len=128)
            for key in ("poisson", "poisson_64"):
                p = r[key]
                print(f"[poisson] {model} {p['rate_per_s']:g}/s: TTFT p50/p90/p99 " + " / ".join(
                    f"{v:.1f}" for v in p["ttft_ms"].values()) + " ms, ITL p99 "
                      f"{p['itl_ms']['p99']:.2f} ms, graphs during it {p['graphs']}", flush=True)
        results[model] = r
        if hasattr(eng.backend, "close"):
            eng.backend.close()
        _save(out, "offline", results)
    return results


def poisson_latency(eng, rate: float, n: int, prompt_len: int, output_len: int, seed: int = 1) -> dict:
    """Requests arrive as a Poisson process; TTFT and inter-token latency percentiles (ms)."""
    from metrale import SamplingParams
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, n))
    pending = list(range(n))
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    start: dict[str, float] = {}
    itl: list[float] = []
    counters = ("mixed_captures", "mixed_replays", "mixed_evictions", "mixed_eager_steps")
    before = eng.memory_report()
    t0 = time.perf_counter()
    done = 0
    while done < n:
        now = time.perf_counter() - t0
        while pending and arrivals[pending[0]] <= now:
            i = pending.pop(0)
            rid = eng.add_request(rng.integers(0, eng.model_config.vocab_size, prompt_len),
                                  SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True))
            start[rid] = t0 + arrivals[i]
        if not eng.has_unfinished():
            time.sleep(max(0.0, arrivals[pending[0]] - now) if pending else 0)
            continue
        for d in eng.step():
            t = time.perf_counter()
            if len(d.token_ids):
                if d.request_id not in first:
                    first[d.request_id] = t - start[d.request_id]
                else:
                    itl.append((t - last[d.request_id]) / len(d.token_ids))
                last[d.request_id] = t
            if d.finished:
                done += 1
    ttft = np.array(list(first.values())) * 1e3
    itl_ms = np.array(itl) * 1e3
    pct = lambda a: {f"p{q}": float(np.percentile(a, q)) for q in (50, 90, 99)}  # noqa: E731
    after = eng.memory_report()
    return {"rate_per_s": rate, "requests": n, "prompt_len": prompt_len, "output_len": output_len,
            "ttft_ms": pct(ttft), "itl_ms": pct(itl_ms), "ttft_worst_ms": sorted(ttft.tolist())[-4:],
            "graphs": {c: after.get(c, 0) - before.get(c, 0) for c in counters}}


def stage_peers(out: Path, only: list[str] | None = None) -> None:
    """only: job names ("torch_decode:llama-3-8b-shape:32", ...) or kinds ("torch_decode") to run."""
    from bench import peers
    old = _load(out / "peers.json") if only else {}
    res = {**old, "copy_bytes_s": peers.copy_bandwidth(), "matmul_tflops": peers.matmul_peak_tflops()}
    print(f"[peers] copy {res['copy_bytes_s'] / 1e12:.2f} TB/s, matmul {res['matmul_tflops']:.0f} TFLOP/s", flush=True)
    _save(out, "peers", res)
    jobs = [("torch_decode", "llama-3-8b-shape", 1), ("torch_decode", "llama-3-8b-shape", 32),
            ("torch_decode", "smollm2-135m-shape", 1), ("torch_prefill", "llama-3-8b-shape", 4096),
            ("hf_decode", "llama-3-8b-shape", 1), ("hf_offline", "smollm2-135m-shape", HF_OFFLINE[0]),
            ("hf_offline", "llama-3.2-1b-shape", HF_OFFLINE[0])]
    if only:
        jobs = [j for j in jobs if j[0] in only or f"{j[0]}:{j[1]}:{j[2]}" in only]
    for kind, model, n in jobs:
        shape = peers.load_shape(model)
        try:
            if kind == "torch_decode":
                r = peers.torch_compiled_decode(shape, n, CONTEXT, steps=32, reps=2)
            elif kind == "torch_prefill":
                r = peers.torch_compiled_prefill(shape, n, reps=3, compile=False)
            elif kind == "hf_decode":
                r = peers.hf_generate_decode(shape, n, CONTEXT, steps=16, reps=1)
            else:
                r = peers.hf_generate_offline(shape, peers.nano_vllm_requests(n, *HF_OFFLINE[1:]))
        except Exception as exc:  # a failed peer is recorded, not fatal
            r = {"error": f"{type(exc).__name__}: {exc}"}
        print(f"[peers] {kind} {model} {n}: {r}", flush=True)
        res[f"{kind}:{model}:{n}"] = r
        peers.release_torch_peers()
        peers.release_hf_models()
        _save(out, "peers", res)


def _load(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def offline_records(off: dict, peer: dict, copy_bytes_s: float | None, gpu: str) -> list[dict]:
    """Records of the offline stage: tok/s against the KV+weight bandwidth bound of the forwards
    the run did (ratio_to_limit) and against HF generate on its subset (ratio_to_peer)."""
    from bench.records import make_record
    recs = []
    peak = peer.get("matmul_tflops")
    for model, r in off.items():
        hf_off = peer.get(f"hf_offline:{model}:{HF_OFFLINE[0]}", {})
        extra = {k: r[k] for k in ("output_tokens", "seconds", "steps") if k in r}
        limit = None
        if r.get("step_log") is not None:
            b = _offline_bound(model, r, copy_bytes_s, peak)
            limit = b["bound_tok_s"]
            extra.update({k: v for k, v in b.items() if k != "copy_bytes_s"}, copy_bytes_s=copy_bytes_s,
                         limit_definition="generated tokens / sum over forwards of (weight bytes + KV bytes "
                                          "of every segment's context) / device copy bandwidth; bf16")
        if r.get("quick"):
            extra["quick"] = True
        recs.append(make_record("offline", f"{model} nano-vllm {r['requests']} req", r["tok_s"], "tok/s", limit,
                                hf_off.get("tok_s"),
                                f"HF generate, {HF_OFFLINE[0]} req (<={HF_OFFLINE[1]}/{HF_OFFLINE[2]})"
                                if hf_off.get("tok_s") else None,
                                gpu, COMMAND.format(stage="offline"), extra))
        for run in ("poisson", "poisson_64"):
            for key in ("ttft_ms", "itl_ms"):
                for q, v in r.get(run, {}).get(key, {}).items():
                    recs.append(make_record("latency", f"{model} Poisson {r[run]['rate_per_s']:g}/s {key[:-3]} {q}",
                                            v, "ms", None, None, None, gpu, COMMAND.format(stage="offline")))
    return recs


OFFLINE_BEGIN, OFFLINE_END = "<!-- offline-table:begin -->", "<!-- offline-table:end -->"
SHAPE_NAMES = {"smollm2-135m-shape": "SmolLM2-135M", "llama-3.2-1b-shape": "Llama-3.2-1B"}


def render_offline_table(recs: list[dict], models=OFFLINE_MODELS) -> str:
    """The offline table of docs/performance.md from the offline records; 'pending' where a
    figure was not measured."""
    by = {r["figure"].split(" ")[0]: r for r in recs if r["benchmark"] == "offline"}
    lines = [f"| shape | metrale | KV+weight bandwidth bound | of bound | HF `generate` ({HF_OFFLINE[0]} requests, "
             f"lengths <= {HF_OFFLINE[1]}/{HF_OFFLINE[2]}, left-padded batches) | metrale / HF |",
             "|---|---|---|---|---|---|"]
    for m in models:
        r = by.get(m)
        if r is None:
            lines.append(f"| {SHAPE_NAMES.get(m, m)} | pending | pending | pending | pending | pending |")
            continue
        e = r["extra"]
        met = f"{r['value']:,.0f} tok/s ({e.get('output_tokens', 0):,} tokens, {e.get('seconds', 0):.1f} s)"
        lim = f"{r['limit']:,.0f} tok/s" if r.get("limit") else "pending"
        of = f"{100 * r['ratio_to_limit']:.0f}%" if r.get("ratio_to_limit") else "pending"
        hf = f"{r['peer']:,.0f} tok/s" if r.get("peer") else "pending"
        vs = f"{r['ratio_to_peer']:.1f}x" if r.get("ratio_to_peer") else "pending"
        lines.append(f"| {SHAPE_NAMES.get(m, m)} | {met} | {lim} | {of} | {hf} | {vs} |")
    return "\n".join(lines) + "\n"


def update_performance_md(path: Path, table: str) -> bool:
    """Replace the table between the offline markers of docs/performance.md; False if absent."""
    if not path.exists():
        return False
    text = path.read_text()
    if OFFLINE_BEGIN not in text or OFFLINE_END not in text:
        return False
    head, rest = text.split(OFFLINE_BEGIN, 1)
    _, tail = rest.split(OFFLINE_END, 1)
    path.write_text(f"{head}{OFFLINE_BEGIN}\n{table}{OFFLINE_END}{tail}")
    return True


def stage_report(out: Path, docs: Path, copy_bytes_s: float | None = None) -> None:
    from bench.records import make_record, plot_records, render_markdown_table, write_records
    met = _load(out / "metrale.json")
    peer = _load(out / "peers.json")
    off = _load(out / "offline.json")
    quick = any(r.get("quick") for r in off.values())
    gpu = "CPU (quick smoke run)" if quick else "NVIDIA H200"
    offline_bw = copy_bytes_s or peer.get("copy_bytes_s")
    bw = peer.get("copy_bytes_s", 4.28e12)
    peak = peer.get("matmul_tflops", 732.0)
    recs = []
    for model, r in met.items():
        for d in r["decode"]:
            p = peer.get(f"torch_decode:{model}:{d['batch']}", {})
            limit = d["batch"] / (d["bytes_per_step"] / bw)
            recs.append(make_record("decode", f"{model} B={d['batch']} ctx={CONTEXT}", d["tok_s"], "tok/s",
                                    limit, p.get("tok_s"), "torch.compile(reduce-overhead)" if p.get("tok_s") else None,
                                    gpu, COMMAND.format(stage="metrale"),
                                    {"step_ms": d["step_ms"], "peer_peak_mem_gb": p.get("peak_mem_gb"),
                                     "kv_tokens_fit_0.9": r.get("kv_tokens_fit_0.9"),
                                     "device_used_bytes": r["memory"].get("device_used_bytes")}))
        if "prefill" in r:
            p = peer.get(f"torch_prefill:{model}:4096", {})
            recs.append(make_record("prefill", f"{model} 4096 tokens", r["prefill"]["tflops"], "TFLOP/s", peak,
                                    p.get("tflops"), "torch eager (cuBLAS, SDPA)" if p.get("tflops") else None, gpu,
                                    COMMAND.format(stage="metrale"), {"tok_s": r["prefill"]["tok_s"]}))
    hf = peer.get("hf_decode:llama-3-8b-shape:1", {})
    if hf.get("tok_s") and "llama-3-8b-shape" in met:
        m = next(d for d in met["llama-3-8b-shape"]["decode"] if d["batch"] == 1)
        recs.append(make_record("decode_vs_hf", "llama-3-8b-shape B=1", m["tok_s"], "tok/s", None, hf["tok_s"],
                                "HF transformers generate", gpu, COMMAND.format(stage="peers")))
    recs += offline_records(off, peer, offline_bw, gpu)
    docs.mkdir(parents=True, exist_ok=True)
    write_records(recs, str(docs / "bench"))
    (docs / "bench_table.md").write_text(render_markdown_table(recs))
    plot_records([r for r in recs if r["benchmark"] == "decode"], str(docs / "decode.png"))
    if off:
        table = render_offline_table(recs)
        if update_performance_md(docs / "performance.md", table):
            print(f"[report] offline table of {docs / 'performance.md'} regenerated", flush=True)
        print(table)
    print(render_markdown_table(recs))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", required=True)
    ap.add_argument("--out", default="raw")
    ap.add_argument("--docs", default="docs")
    ap.add_argument("--quick", action="store_true",
                    help="offline: a few short requests, SmolLM2 shape only, on --device (default cpu)")
    ap.add_argument("--device", default=None, help="offline stage device (default cuda; cpu with --quick)")
    ap.add_argument("--models", nargs="+", default=None, help="offline stage shapes")
    ap.add_argument("--copy-tb-s", type=float, default=None,
                    help="device copy bandwidth (TB/s, read + write) for the offline bound; "
                         "default: the peers stage's measurement (peers.json)")
    ap.add_argument("--lever", action="append", default=[], help="name=value, a lever for every metrale run")
    ap.add_argument("--peer-jobs", nargs="+", default=None, help="peers stage: only these jobs or kinds")
    args = ap.parse_args(argv)
    LEVERS.update(kv.split("=", 1) for kv in args.lever)
    out = Path(args.out)
    copy_bytes_s = args.copy_tb_s * 1e12 if args.copy_tb_s else None
    for stage in args.stage.split(","):
        if stage == "report":
            stage_report(out, Path(args.docs), copy_bytes_s)
        elif stage == "offline":
            models = args.models or (OFFLINE_MODELS[:1] if args.quick else OFFLINE_MODELS)
            stage_offline(out, quick=args.quick, device=args.device or ("cpu" if args.quick else "cuda"),
                          models=models, copy_bytes_s=copy_bytes_s or _load(out / "peers.json").get("copy_bytes_s"))
        elif stage == "peers":
            stage_peers(out, args.peer_jobs)
        else:
            {"metrale": stage_metrale}[stage](out)


if __name__ == "__main__":
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "4")
    main()
