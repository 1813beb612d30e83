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
        config, backend, load_s = make_backend(model, max(batches), [f"cache.num_blocks={blocks}"])
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


def stage_offline(out: Path, n_requests: int = 256) -> None:
    from bench.peers import nano_vllm_requests
    from metrale import Engine, SamplingParams
    results = {}
    for model in ("smollm2-135m-shape", "llama-3.2-1b-shape"):
        eng = Engine(model=model, device="cuda", scheduler={"max_num_seqs": 256, "max_num_batched_tokens": 4096,
                                                             "max_model_len": 4096},
                     cache={"gpu_memory_utilization": 0.5})
        rng = np.random.default_rng(0)
        reqs = nano_vllm_requests(n_requests)
        prompts = [rng.integers(0, eng.model_config.vocab_size, p) for p, _ in reqs]
        params = [SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True) for _, o in reqs]
        eng.generate(prompts[:4], params[:4], use_tqdm=False)           # warm-up: compile kernels
        t0 = time.perf_counter()
        outs = eng.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        gen = sum(len(o.token_ids) for o in outs)
        r = {"requests": n_requests, "output_tokens": gen, "seconds": dt, "tok_s": gen / dt,
             "prompt_tokens": sum(p for p, _ in reqs), "steps": eng.stats["steps"],
             "preemptions": eng.scheduler.num_preemptions, "memory": eng.memory_report()}
        print(f"[offline] {model}: {gen} tokens in {dt:.1f} s = {gen / dt:.0f} tok/s", flush=True)
        r["poisson"] = poisson_latency(eng, rate=16.0, n=64, prompt_len=256, output_len=128)
        results[model] = r
        eng.backend.close()
        _save(out, "offline", results)


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
    return {"rate_per_s": rate, "requests": n, "prompt_len": prompt_len, "output_len": output_len,
            "ttft_ms": pct(ttft), "itl_ms": pct(itl_ms)}


def stage_peers(out: Path) -> None:
    from bench import peers
    res = {"copy_bytes_s": peers.copy_bandwidth(), "matmul_tflops": peers.matmul_peak_tflops()}
    print(f"[peers] copy {res['copy_bytes_s'] / 1e12:.2f} TB/s, matmul {res['matmul_tflops']:.0f} TFLOP/s", flush=True)
    _save(out, "peers", res)
    jobs = [("torch_decode", "llama-3-8b-shape", 1), ("torch_decode", "llama-3-8b-shape", 32),
            ("torch_decode", "smollm2-135m-shape", 1), ("torch_prefill", "llama-3-8b-shape", 4096),
            ("hf_decode", "llama-3-8b-shape", 1), ("hf_offline", "smollm2-135m-shape", 32)]
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
                r = peers.hf_generate_offline(shape, peers.nano_vllm_requests(n, 512, 256))
        except Exception as exc:  # a failed peer is recorded, not fatal
            r = {"error": f"{type(exc).__name__}: {exc}"}
        print(f"[peers] {kind} {model} {n}: {r}", flush=True)
        res[f"{kind}:{model}:{n}"] = r
        peers.release_torch_peers()
        peers.release_hf_models()
        _save(out, "peers", res)


def stage_report(out: Path, docs: Path) -> None:
    from bench.records import make_record, plot_records, render_markdown_table, write_records
    met = json.loads((out / "metrale.json").read_text())
    peer = json.loads((out / "peers.json").read_text()) if (out / "peers.json").exists() else {}
    off = json.loads((out / "offline.json").read_text()) if (out / "offline.json").exists() else {}
    gpu = "NVIDIA H200"
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
    if hf.get("tok_s"):
        m = next(d for d in met["llama-3-8b-shape"]["decode"] if d["batch"] == 1)
        recs.append(make_record("decode_vs_hf", "llama-3-8b-shape B=1", m["tok_s"], "tok/s", None, hf["tok_s"],
                                "HF transformers generate", gpu, COMMAND.format(stage="peers")))
    for model, r in off.items():
        hf_off = peer.get(f"hf_offline:{model}:32", {})
        recs.append(make_record("offline", f"{model} nano-vllm 256 req", r["tok_s"], "tok/s", None,
                                hf_off.get("tok_s"), "HF generate, 32 req (<=512/256)" if hf_off.get("tok_s") else None,
                                gpu, COMMAND.format(stage="offline"), {k: r[k] for k in ("output_tokens", "seconds", "steps")}))
        for key in ("ttft_ms", "itl_ms"):
            for q, v in r["poisson"][key].items():
                recs.append(make_record("latency", f"{model} Poisson 16/s {key[:-3]} {q}", v, "ms", None, None, None,
                                        gpu, COMMAND.format(stage="offline")))
    docs.mkdir(parents=True, exist_ok=True)
    write_records(recs, str(docs / "bench"))
    (docs / "bench_table.md").write_text(render_markdown_table(recs))
    plot_records([r for r in recs if r["benchmark"] == "decode"], str(docs / "decode.png"))
    print(render_markdown_table(recs))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", required=True)
    ap.add_argument("--out", default="raw")
    ap.add_argument("--docs", default="docs")
    args = ap.parse_args()
    out = Path(args.out)
    for stage in args.stage.split(","):
        if stage == "report":
            stage_report(out, Path(args.docs))
        else:
            {"metrale": stage_metrale, "offline": stage_offline, "peers": stage_peers}[stage](out)


if __name__ == "__main__":
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "4")
    main()
