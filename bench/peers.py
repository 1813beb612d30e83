"""Peer engines on the same GPU: the numbers metrale is compared against.

  python -m bench.peers --shape llama-3-8b-shape --batch 1 32 [--hf] [--prefill 4096]
                        [--offline 256] [--ceilings] [--context 512] [--steps 64] [--json F]

Peers: a gpt-fast style Llama decoder in plain torch under torch.compile(mode="reduce-overhead")
(CUDA graphs; KV caches are module buffers so mutation does not skip the graphs), and Hugging
Face transformers' LlamaForCausalLM.generate. Both use bf16 random weights of a real shape built
on the device (conf/models/<name>.yaml). Ceilings: a torch device-to-device copy and an
8192^3 bf16 matmul. Every timing is the median of several runs after warm-up, between
synchronizes. torch and transformers exist on the GPU machine only: they are imported inside
functions, so this module imports anywhere.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import random
import statistics
import sys
import time
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
              "num_kv_heads", "head_dim", "rope_theta", "tie_word_embeddings")
RMS_EPS = 1e-5


# ---------------------------------------------------------------- shapes and arithmetic

def load_shape(name: str) -> dict:
    """conf/models/<name>.yaml as a dict (a path to a .yaml file works too)."""
    import yaml
    path = name if name.endswith(".yaml") else os.path.join(ROOT, "conf", "models", f"{name}.yaml")
    with open(path) as f:
        shape = yaml.safe_load(f)
    missing = [k for k in SHAPE_KEYS if k not in shape]
    if missing:
        raise ValueError(f"{path}: missing shape keys {missing}")
    return shape


def layer_params(shape: dict) -> int:
    """Matmul weights of the decoder layers (qkv, o, gate, up, down), all layers."""
    d, hd = shape["hidden_size"], shape["head_dim"]
    q, kv = shape["num_heads"] * hd, shape["num_kv_heads"] * hd
    per = d * (q + 2 * kv) + q * d + 3 * d * shape["intermediate_size"]
    return per * shape["num_layers"]


def lm_head_params(shape: dict) -> int:
    return shape["vocab_size"] * shape["hidden_size"]


def decode_bytes_per_step(shape: dict, batch: int, context: int) -> int:
    """bf16 bytes one greedy decode step must read: layer weights, LM head, the batch's KV."""
    kv = 2 * shape["num_layers"] * shape["num_kv_heads"] * shape["head_dim"] * context * batch
    return 2 * (layer_params(shape) + lm_head_params(shape) + kv)


def weight_bytes(shape: dict, dtype_bytes: int = 2) -> int:
    """Bytes of the matmul weights one forward reads (layers + LM head; norms and the embedding
    rows looked up are negligible)."""
    return dtype_bytes * (layer_params(shape) + lm_head_params(shape))


def kv_bytes_per_token(shape: dict, dtype_bytes: int = 2) -> int:
    """Bytes of K and V of one token over all layers."""
    return dtype_bytes * 2 * shape["num_layers"] * shape["num_kv_heads"] * shape["head_dim"]


def roofline_decode_tok_s(shape: dict, batch: int, context: int = 512,
                          bandwidth: float = 4.23e12) -> float:
    """Decode tok/s if every step only streamed its bytes at `bandwidth` (the HBM limit)."""
    return batch * bandwidth / decode_bytes_per_step(shape, batch, context)


def prefill_flops(shape: dict, tokens: int) -> float:
    """2*layer params*tokens + last-token LM head + causal attention (QK^T and PV, half used)."""
    attn = 2 * 2 * shape["num_layers"] * shape["num_heads"] * shape["head_dim"] * tokens ** 2 / 2
    return 2.0 * layer_params(shape) * tokens + 2.0 * lm_head_params(shape) + attn


def nano_vllm_requests(n: int = 256, max_input: int = 1024, max_output: int = 1024,
                       seed: int = 0) -> list[tuple[int, int]]:
    """nano-vllm's bench.py protocol: n requests, prompt and output lengths uniform in [100, max]."""
    rng = random.Random(seed)
    lo_in, lo_out = min(100, max_input), min(100, max_output)
    return [(rng.randint(lo_in, max_input), rng.randint(lo_out, max_output)) for _ in range(n)]


# ---------------------------------------------------------------- timing helpers

def _device() -> str:
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def _sync() -> None:
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _median_s(fn: Callable[[], Any], reps: int) -> float:
    times = []
    for _ in range(reps):
        _sync()
        t = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _reset_peak() -> None:
    import torch
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def _peak_gb() -> float:
    import torch
    return torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else float("nan")


def _free() -> None:
    import gc
    import torch
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- the gpt-fast style model

@functools.cache
def _llama_classes():
    """nn.Module classes of the compiled peer, defined on first use (torch imported here)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    def rms_norm(x, w):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + RMS_EPS)).to(x.dtype) * w

    def rope(x, cos, sin):                       # x [B, H, T, hd]; cos, sin [T, hd] float32
        h = x.shape[-1] // 2
        xf = x.float()
        rot = torch.cat((-xf[..., h:], xf[..., :h]), dim=-1)
        return (xf * cos + rot * sin).to(x.dtype)

    class KVCache(nn.Module):
        def __init__(self, batch, n_kv, length, head_dim, dtype, device):
            super().__init__()
            shape = (batch, n_kv, length, head_dim)
            for name in ("k", "v"):
                self.register_buffer(name, torch.randn(shape, dtype=dtype, device=device),
                                     persistent=False)

        def update(self, pos, k, v):             # pos [T]; k, v [B, KV, T, hd]
            self.k[:, :, pos] = k
            self.v[:, :, pos] = v
            return self.k, self.v

    class Attention(nn.Module):
        def __init__(self, s):
            super().__init__()
            self.h, self.kv, self.hd = s["num_heads"], s["num_kv_heads"], s["head_dim"]
            d = s["hidden_size"]
            self.wqkv = nn.Linear(d, (self.h + 2 * self.kv) * self.hd, bias=False)
            self.wo = nn.Linear(self.h * self.hd, d, bias=False)
            self.kv_cache = None

        def forward(self, x, cos, sin, pos):
            B, T, _ = x.shape
            h, kv, hd = self.h, self.kv, self.hd
            q, k, v = self.wqkv(x).split([h * hd, kv * hd, kv * hd], dim=-1)
            q = rope(q.view(B, T, h, hd).transpose(1, 2), cos, sin)
            k = rope(k.view(B, T, kv, hd).transpose(1, 2), cos, sin)
            v = v.view(B, T, kv, hd).transpose(1, 2)
            if T > 1:                            # prefill: causal flash attention, fresh K/V
                k = k.repeat_interleave(h // kv, dim=1)
                v = v.repeat_interleave(h // kv, dim=1)
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:                                # decode: grouped attention over the cache
                kc, vc = self.kv_cache.update(pos, k, v)
                qg = q.reshape(B, kv, h // kv, hd)
                s = (qg @ kc.transpose(-1, -2)).float() * (hd ** -0.5)
                seen = torch.arange(kc.shape[2], device=x.device) <= pos[-1]
                p = s.masked_fill(~seen, float("-inf")).softmax(-1).to(x.dtype)
                y = (p @ vc).view(B, h, 1, hd)
            return self.wo(y.transpose(1, 2).reshape(B, T, h * hd))

    class Block(nn.Module):
        def __init__(self, s):
            super().__init__()
            d, f = s["hidden_size"], s["intermediate_size"]
            self.attn = Attention(s)
            self.w13 = nn.Linear(d, 2 * f, bias=False)
            self.w2 = nn.Linear(f, d, bias=False)
            self.attn_norm = nn.Parameter(torch.ones(d))
            self.mlp_norm = nn.Parameter(torch.ones(d))

        def forward(self, x, cos, sin, pos):
            x = x + self.attn(rms_norm(x, self.attn_norm), cos, sin, pos)
            gate, up = self.w13(rms_norm(x, self.mlp_norm)).chunk(2, dim=-1)
            return x + self.w2(F.silu(gate) * up)

    class Transformer(nn.Module):
        def __init__(self, s, max_seq):
            super().__init__()
            self.s = s
            self.tok_embeddings = nn.Embedding(s["vocab_size"], s["hidden_size"])
            self.layers = nn.ModuleList(Block(s) for _ in range(s["num_layers"]))
            self.norm = nn.Parameter(torch.ones(s["hidden_size"]))
            self.output = nn.Linear(s["hidden_size"], s["vocab_size"], bias=False)
            if s["tie_word_embeddings"]:
                self.output.weight = self.tok_embeddings.weight
            self.set_rope(max_seq)

        def set_rope(self, max_seq):
            hd = self.s["head_dim"]
            inv = 1.0 / (float(self.s["rope_theta"]) ** (torch.arange(0, hd, 2).float() / hd))
            ang = torch.outer(torch.arange(max_seq).float(), inv)
            ang = torch.cat((ang, ang), dim=-1)
            self.register_buffer("cos", ang.cos(), persistent=False)
            self.register_buffer("sin", ang.sin(), persistent=False)

        def setup_caches(self, batch, length):
            w = self.output.weight
            for layer in self.layers:
                layer.attn.kv_cache = None
            for layer in self.layers:
                layer.attn.kv_cache = KVCache(batch, self.s["num_kv_heads"], length,
                                              self.s["head_dim"], w.dtype, w.device)

        def forward(self, idx, pos):             # idx [B, T]; pos [T] -> last-token logits [B, V]
            x = self.tok_embeddings(idx)
            cos, sin = self.cos[pos], self.sin[pos]
            for layer in self.layers:
                x = layer(x, cos, sin, pos)
            return self.output(rms_norm(x[:, -1], self.norm))

    return Transformer


def _decode_one(model, tok, pos):
    import torch
    return torch.argmax(model(tok, pos), dim=-1, keepdim=True)


def _prefill(model, idx, pos):
    return model(idx, pos)


class _TorchPeer:
    """One shape's model (weights built once); the compiled decode step specialises on
    (batch, cache length), a new pair compiles and records anew; prefill compiles per length."""

    def __init__(self, shape: dict, max_seq: int, compile: bool):
        import torch
        self.shape, self.max_seq, self.compile = dict(shape), max_seq, compile
        self.device = _device()
        prev = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)  # bf16 weights made on the device; rope fp32
        try:
            with torch.device(self.device), torch.no_grad():
                self.model = _llama_classes()(self.shape, max_seq).eval()
        finally:
            torch.set_default_dtype(prev)
        self.cache_key = None
        self.decode_step = (torch.compile(_decode_one, mode="reduce-overhead", fullgraph=True,
                                          dynamic=False) if compile else _decode_one)
        self.prefill_fn = (torch.compile(_prefill, fullgraph=True, dynamic=False)
                           if compile else _prefill)

    def setup(self, batch: int, length: int) -> None:
        """KV caches of `length` positions (random K/V) for `batch` rows."""
        length = -(-length // 16) * 16
        if (batch, length) != self.cache_key:
            self.model.setup_caches(batch, length)
            self.cache_key = (batch, length)
            _free()

    def decode(self, batch: int, context: int, steps: int):
        import torch
        dev = self.device
        tok = torch.randint(0, self.shape["vocab_size"], (batch, 1), device=dev)
        pos = torch.tensor([context], device=dev, dtype=torch.long)
        with torch.no_grad():
            for _ in range(steps):
                if self.compile:
                    torch.compiler.cudagraph_mark_step_begin()
                tok = self.decode_step(self.model, tok, pos).clone()
                pos += 1
        return tok


_PEER: dict[tuple, _TorchPeer] = {}


def _torch_peer(shape: dict, max_seq: int, compile: bool) -> _TorchPeer:
    """The cached model of this shape (one shape lives at a time; others are dropped)."""
    key = (tuple(shape[k] for k in SHAPE_KEYS), compile)
    peer = _PEER.get(key)
    if peer is None or peer.max_seq < max_seq:
        release_torch_peers()
        peer = _PEER[key] = _TorchPeer(shape, max(max_seq, 8192), compile)
    return peer


def release_torch_peers() -> None:
    """Drop compiled models and their CUDA graphs (frees device memory between shapes)."""
    _PEER.clear()
    try:
        import torch
        torch._dynamo.reset()
    except Exception:
        pass
    _free()


def torch_compiled_decode(shape: dict, batch: int, context: int = 512, steps: int = 64,
                          reps: int = 3, compile: bool = True) -> dict:
    """gpt-fast style greedy decode: `steps` tokens after `context` random cached positions."""
    peer = _torch_peer(shape, context + steps, compile)
    _reset_peak()
    peer.setup(batch, context + steps)
    t = time.perf_counter()
    peer.decode(batch, context, 3)               # compile + CUDA-graph warm-up and record
    _sync()
    compile_s = time.perf_counter() - t
    peer.decode(batch, context, steps)           # one warm run
    sec = _median_s(lambda: peer.decode(batch, context, steps), reps)
    return {"engine": "torch.compile", "batch": batch, "context": context, "steps": steps,
            "tok_s": batch * steps / sec, "step_ms": 1e3 * sec / steps,
            "peak_mem_gb": _peak_gb(), "compile_s": compile_s,
            "roofline_tok_s": roofline_decode_tok_s(shape, batch, context)}


def torch_compiled_prefill(shape: dict, tokens: int = 4096, reps: int = 5,
                           compile: bool = True) -> dict:
    """Batch-1 prefill of `tokens` random tokens (last-token logits), tok/s and TFLOP/s."""
    import torch
    peer = _torch_peer(shape, tokens + 1, compile)
    dev = peer.device
    idx = torch.randint(0, shape["vocab_size"], (1, tokens), device=dev)
    pos = torch.arange(tokens, device=dev)
    run = lambda: peer.prefill_fn(peer.model, idx, pos)  # noqa: E731
    _reset_peak()
    with torch.no_grad():
        t = time.perf_counter()
        run()
        _sync()
        compile_s = time.perf_counter() - t
        run()
        sec = _median_s(run, reps)
    flops = prefill_flops(shape, tokens)
    return {"engine": "torch.compile", "tokens": tokens, "tok_s": tokens / sec,
            "ms": 1e3 * sec, "tflops": flops / sec / 1e12, "flops": flops,
            "peak_mem_gb": _peak_gb(), "compile_s": compile_s}


# ---------------------------------------------------------------- Hugging Face transformers

_HF: dict[tuple, Any] = {}


def _hf_model(shape: dict):
    """LlamaForCausalLM of this shape, random bf16 weights initialised on the device (cached)."""
    key = tuple(shape[k] for k in SHAPE_KEYS)
    if key in _HF:
        return _HF[key]
    release_hf_models()
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
                      intermediate_size=shape["intermediate_size"],
                      num_hidden_layers=shape["num_layers"],
                      num_attention_heads=shape["num_heads"],
                      num_key_value_heads=shape["num_kv_heads"], head_dim=shape["head_dim"],
                      rope_theta=float(shape["rope_theta"]),
                      tie_word_embeddings=bool(shape["tie_word_embeddings"]),
                      max_position_embeddings=int(shape.get("max_position", 8192)),
                      rms_norm_eps=RMS_EPS, bos_token_id=None, eos_token_id=None,
                      pad_token_id=0)
    cfg._attn_implementation = "sdpa"
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(_device()):
            model = LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(prev)
    model.to(torch.bfloat16)
    gc = model.generation_config
    gc.eos_token_id, gc.bos_token_id, gc.pad_token_id = None, None, 0
    _HF[key] = model
    return model


def release_hf_models() -> None:
    _HF.clear()
    _free()


def _hf_generate(model, ids, mask, new: int, min_new: bool = True):
    import torch
    kw = dict(min_new_tokens=new) if min_new else {}
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                              do_sample=False, pad_token_id=0, **kw)


def hf_generate_decode(shape: dict, batch: int, context: int = 512, steps: int = 64,
                       reps: int = 2) -> dict:
    """HF generate's decode rate: the difference between `steps` and 1 new token removes the
    prefill; those `steps - 1` extra forwards are the decode steps counted."""
    import torch
    model = _hf_model(shape)
    dev = model.device
    ids = torch.randint(1, shape["vocab_size"], (batch, context), device=dev)
    mask = torch.ones_like(ids)
    _reset_peak()
    _hf_generate(model, ids, mask, 4)                                  # warm-up
    out = _hf_generate(model, ids, mask, steps)
    assert out.shape == (batch, context + steps), out.shape
    t_full = _median_s(lambda: _hf_generate(model, ids, mask, steps), reps)
    t_one = _median_s(lambda: _hf_generate(model, ids, mask, 1), reps)
    decode_s = max(t_full - t_one, 1e-9)
    return {"engine": "hf-generate", "batch": batch, "context": context, "steps": steps,
            "tok_s": batch * (steps - 1) / decode_s, "step_ms": 1e3 * decode_s / (steps - 1),
            "prefill_s": t_one, "peak_mem_gb": _peak_gb()}


def hf_generate_offline(shape: dict, requests: list[tuple[int, int]], chunk: int = 64) -> dict:
    """nano-vllm protocol with HF: left-padded batches of <= `chunk` prompts, each generating
    its chunk's longest output (EOS ignored); rate = requested output tokens / total time."""
    import torch
    model = _hf_model(shape)
    dev = model.device
    gen = torch.Generator(device="cpu").manual_seed(0)
    chunks = [requests[i:i + chunk] for i in range(0, len(requests), chunk)]
    batches = []
    for ch in chunks:
        width = max(p for p, _ in ch)
        ids = torch.zeros((len(ch), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, (p, _) in enumerate(ch):
            ids[r, width - p:] = torch.randint(1, shape["vocab_size"], (p,), generator=gen)
            mask[r, width - p:] = 1
        batches.append((ids.to(dev), mask.to(dev), max(o for _, o in ch)))
    _reset_peak()
    _hf_generate(model, batches[0][0][:, -16:], batches[0][1][:, -16:], 2)   # warm-up
    _sync()
    t = time.perf_counter()
    for ids, mask, new in batches:
        _hf_generate(model, ids, mask, new)
    _sync()
    sec = time.perf_counter() - t
    out = sum(o for _, o in requests)
    return {"engine": "hf-generate", "requests": len(requests), "output_tokens": out,
            "generated_tokens": sum(len(ch) * b[2] for ch, b in zip(chunks, batches)),
            "seconds": sec, "tok_s": out / sec, "peak_mem_gb": _peak_gb()}


# ---------------------------------------------------------------- ceilings

def _event_ms(fn: Callable[[], Any], iters: int, reps: int) -> float:
    """Median over `reps` of the mean ms of `iters` back-to-back launches between CUDA events."""
    import torch
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / iters)
    return statistics.median(out)


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Bytes/s (read + written) of a device-to-device copy through torch."""
    import torch
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    ms = _event_ms(lambda: dst.copy_(src), 10, 5)
    del src, dst
    _free()
    return 2 * nbytes / (ms * 1e-3)


def matmul_peak_tflops(n: int = 8192) -> float:
    """bf16 n^3 matmul on random data through torch (cuBLAS), TFLOP/s."""
    import torch
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    c = torch.empty_like(a)
    for _ in range(3):
        torch.matmul(a, b, out=c)
    ms = _event_ms(lambda: torch.matmul(a, b, out=c), 20, 5)
    del a, b, c
    _free()
    return 2 * n ** 3 / (ms * 1e-3) / 1e12


# ---------------------------------------------------------------- CLI

def _row(*cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _f(x, nd=1) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:,.{nd}f}"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.peers", description=__doc__.split("\n")[0])
    ap.add_argument("--shape", nargs="+", default=["llama-3-8b-shape"])
    ap.add_argument("--batch", nargs="+", type=int, default=[1])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-compiled", action="store_true", help="skip the torch.compile decode")
    ap.add_argument("--hf", action="store_true", help="also HF generate decode")
    ap.add_argument("--hf-steps", type=int, default=None, help="HF decode steps (default --steps)")
    ap.add_argument("--prefill", type=int, default=0, help="prefill tokens (0: skip)")
    ap.add_argument("--offline", type=int, default=0, help="nano-vllm requests for HF (0: skip)")
    ap.add_argument("--offline-max", type=int, default=1024, help="longest prompt and output")
    ap.add_argument("--ceilings", action="store_true", help="copy bandwidth and matmul peak")
    ap.add_argument("--json", default=None, help="write every result here")
    args = ap.parse_args(argv)

    results: dict[str, Any] = {"decode": [], "prefill": [], "offline": []}

    def save():
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)

    if args.ceilings:
        results["copy_bytes_s"] = copy_bandwidth()
        results["matmul_tflops"] = matmul_peak_tflops()
        print(f"copy bandwidth {results['copy_bytes_s'] / 1e12:.2f} TB/s, "
              f"bf16 matmul {results['matmul_tflops']:.0f} TFLOP/s", flush=True)
        save()
    print(_row("shape", "batch", "engine", "tok/s", "ms/step", "roofline tok/s", "peak GB",
               "compile s"), flush=True)
    print(_row(*["---"] * 8), flush=True)
    for name in args.shape:
        shape = load_shape(name)
        for b in args.batch:
            runs = []
            if not args.no_compiled:
                runs.append(lambda: torch_compiled_decode(shape, b, args.context, args.steps,
                                                          args.reps))
            if args.hf:
                runs.append(lambda: hf_generate_decode(shape, b, args.context,
                                                       args.hf_steps or args.steps,
                                                       max(2, args.reps - 1)))
            for run in runs:
                r = dict(run(), shape=name)
                results["decode"].append(r)
                print(_row(name, b, r["engine"], _f(r["tok_s"]), _f(r["step_ms"], 2),
                           _f(roofline_decode_tok_s(shape, b, args.context), 0),
                           _f(r["peak_mem_gb"], 1), _f(r.get("compile_s"), 1)), flush=True)
                save()
        if args.prefill:
            r = dict(torch_compiled_prefill(shape, args.prefill), shape=name)
            results["prefill"].append(r)
            print(f"{name} prefill {args.prefill} tokens: {r['tok_s']:,.0f} tok/s, "
                  f"{r['tflops']:.0f} TFLOP/s, {r['ms']:.1f} ms, compile {r['compile_s']:.1f} s",
                  flush=True)
            save()
        release_torch_peers()
        if args.offline:
            r = dict(hf_generate_offline(
                shape, nano_vllm_requests(args.offline, args.offline_max, args.offline_max)), shape=name)
            results["offline"].append(r)
            print(f"{name} HF offline {r['requests']} requests: {r['tok_s']:,.0f} tok/s "
                  f"({r['output_tokens']} tokens in {r['seconds']:.1f} s)", flush=True)
            save()
        release_hf_models()
    return results


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    main()
