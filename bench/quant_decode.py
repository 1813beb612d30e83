"""Decode throughput of a quantized model through the CUDA backend: levers.weights=native (GGUF blocks
on the device, quant GEMV) against bf16 on the same shape, at the backend level (graph replays, no
scheduler), with the device weight bytes each holds.

    python -m bench.quant_decode --weights native --batch 1 8      # Llama-3-8B shape, random Q4_K
    python -m bench.quant_decode --weights bf16 --batch 1 8         # the same shape, random bf16
    python -m bench.quant_decode --fp8 --batch 1 8 32               # random FP8 e4m3 (= --weights fp8)

native: random Q4_K blocks for every matrix and Q6_K for the lm_head (Q4_K_M's types but for its
Q6_K halves of v / down), one block set per distinct shape shared by all layers (the weights are
read per layer all the same; generating 4 GB of random blocks once is what keeps start-up short).
bf16: the model preset's random bf16 weights, made on the device.
fp8: an FP8 e4m3 checkpoint as Qwen3-FP8 / DeepSeek-V3 ship them (qkv, o, gate_up, down as e4m3 bytes
in 128 x 128 blocks of random float32 scales, FP8Tensor; embeddings and lm_head bf16), uploaded with
levers.weights=native as DeviceFP8 (docs/quant.md, "FP8 checkpoints"): the FP8 GEMV up to 8 rows, the
bf16 scratch road above. One FP8Tensor per distinct shape, shared by the layers (each layer still
uploads and reads its own copy). One JSON line at the end."""
from __future__ import annotations

import argparse
import json
import time

import numpy as np


class _SharedPart:
    """A QuantizedPart whose repacked planes are computed once and shared by every layer using it."""

    def __init__(self, part):
        self.ggml_type, self.rows, self.cols, self.data = part.ggml_type, part.rows, part.cols, part.data
        self._planes = None

    def repack(self):
        if self._planes is None:
            from kernels_numba.quant_layout import repack
            self._planes = repack(int(self.ggml_type), self.data, self.cols)
        return self._planes


def random_quantized_items(config, body: str = "Q4_K", head: str = "Q6_K", seed: int = 0) -> list:
    """(name, weight) pairs of the dense family's canonical names: QuantizedTensor matrices of
    random blocks (types `body`, `head` for the lm_head), float32 norms."""
    import gguf

    from kernels_numba import quant_layout as L
    from metrale.models.quantized import QuantizedPart, QuantizedTensor
    rng = np.random.default_rng(seed)
    c, d = config, config.hidden_size
    cache: dict = {}

    def q(kind, rows, cols):
        key = (kind, rows, cols)
        if key not in cache:
            qt = gguf.GGMLQuantizationType[kind]
            part = QuantizedPart(qt, rows, cols, L.random_blocks(int(qt), rows, cols, rng, scale=cols ** -0.5 / 0.03))
            cache[key] = QuantizedTensor((_SharedPart(part),))
        return cache[key]

    norm = lambda: (1 + 0.05 * rng.standard_normal(d)).astype(np.float32)  # noqa: E731
    items = [("embed", q(body, c.vocab_size, d))]
    for i in range(c.num_layers):
        p = f"layers.{i}."
        items += [(p + "attn_norm", norm()), (p + "qkv", q(body, c.q_size + 2 * c.kv_size, d)),
                  (p + "o", q(body, d, c.q_size)), (p + "mlp_norm", norm()),
                  (p + "gate_up", q(body, 2 * c.intermediate_size, d)), (p + "down", q(body, d, c.intermediate_size))]
    items.append(("final_norm", norm()))
    if not c.tie_word_embeddings:
        items.append(("lm_head", q(head, c.vocab_size, d)))
    return items


def random_fp8_items(config, block: int = 128, seed: int = 0) -> list:
    """(name, weight) pairs of the dense family's canonical names: FP8Tensor matrices of random e4m3
    bytes (finite: sign, exponent 4..9 (2^-3..2^2), mantissa) and random [ceil(N/128), ceil(K/128)]
    scales ~ 1 / (2 sqrt(K)); embeddings and lm_head float32 (bf16 on the device; one array of random
    rows, tiled, for both); float32 norms."""
    from metrale.models.fp8 import FP8Tensor
    rng = np.random.default_rng(seed)
    c, d = config, config.hidden_size
    cache: dict = {}

    def q(rows, cols):
        if (rows, cols) not in cache:
            r = rng.integers(0, 256, (rows, cols), dtype=np.uint8)
            e = rng.integers(4, 10, (rows, cols), dtype=np.uint8)
            codes = (r & np.uint8(0x87)) | (e << np.uint8(3))        # never 0x7f / 0xff (NaN)
            S = rng.uniform(0.5, 1.5, (-(-rows // block), -(-cols // block))) / (2 * np.sqrt(cols))
            cache[(rows, cols)] = FP8Tensor(codes, S.astype(np.float32), block, block)
        return cache[(rows, cols)]

    norm = lambda: (1 + 0.05 * rng.standard_normal(d)).astype(np.float32)  # noqa: E731
    tile = rng.standard_normal((4096, d), dtype=np.float32) * 0.02
    table = np.tile(tile, (-(-c.vocab_size // 4096), 1))[:c.vocab_size]
    items = [("embed", table)]
    for i in range(c.num_layers):
        p = f"layers.{i}."
        items += [(p + "attn_norm", norm()), (p + "qkv", q(c.q_size + 2 * c.kv_size, d)),
                  (p + "o", q(d, c.q_size)), (p + "mlp_norm", norm()),
                  (p + "gate_up", q(2 * c.intermediate_size, d)), (p + "down", q(d, c.intermediate_size))]
    items.append(("final_norm", norm()))
    if not c.tie_word_embeddings:
        items.append(("lm_head", table))
    return items


def make_backend(model: str, weights: str, batches: list[int], overrides: list[str] = ()):
    """The backend with a decode graph for every batch timed (a batch padded to a larger graph would
    time that graph instead)."""
    max_batch = max(batches)
    from metrale.models.assemble import make_backend as build
    from metrale.models.checkpoint import random_model_config
    from metrale.models.quantized import QuantizedStream
    from metrale.models.registry import resolve_model
    from metrale.settings import compose
    lever = "native" if weights == "fp8" else weights
    cfg = compose(["device=cuda", f"levers.weights={lever}", f"scheduler.max_num_seqs={max(max_batch, 1)}",
                   "scheduler.max_num_batched_tokens=4096", "scheduler.max_model_len=4096",
                   f"levers.graph_batch_sizes=[{','.join(str(b) for b in sorted({1, *batches}))}]",
                   "levers.warm_mixed=false", *overrides])
    source = resolve_model(model)
    config = random_model_config(source.preset, source.name)
    t0 = time.perf_counter()
    stream = (QuantizedStream.of(random_quantized_items(config)) if weights == "native" else
              QuantizedStream.of(random_fp8_items(config)) if weights == "fp8" else None)
    t1 = time.perf_counter()
    backend = build("cuda", cfg, config, stream)
    return backend, t1 - t0, time.perf_counter() - t1


def main() -> None:
    from bench.decode_metrale import decode_tok_s
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3-8b-shape")
    ap.add_argument("--weights", choices=("native", "bf16", "fp8"), default="native",
                    help="native: random Q4_K / Q6_K blocks; fp8: random 128 x 128 block-scaled e4m3 (levers.weights=native)")
    ap.add_argument("--fp8", action="store_true", help="the same as --weights fp8")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--override", nargs="*", default=[])
    args = ap.parse_args()
    if args.fp8:
        args.weights = "fp8"
    backend, gen_s, load_s = make_backend(args.model, args.weights, args.batch, args.override)
    mem = backend.memory_report()
    print(f"{args.model} weights={args.weights}: blocks made in {gen_s:.1f} s, backend in {load_s:.1f} s; "
          f"device weights {mem['weights_bytes'] / 2**30:.2f} GiB ({mem['weights_native']} native matrices, "
          f"{mem.get('weights_fp8', 0)} FP8), "
          f"scratch {mem['quant_scratch_bytes'] / 2**20:.0f} MiB, kv tokens {mem['kv_pool_tokens']}", flush=True)
    results = []
    for b in args.batch:
        r = decode_tok_s(backend, b, args.context)
        r["bytes_per_step"] = mem["weights_bytes"] + r["bytes_per_step"] - backend.config.num_parameters() * 2
        results.append(r)
        print(f"decode weights={args.weights} B={b:3d} ctx={args.context}: {r['step_ms']:.3f} ms/step "
              f"{r['tok_s']:.0f} tok/s, {r['bytes_per_step'] / (r['step_ms'] / 1e3) / 1e12:.2f} TB/s of weights + KV",
              flush=True)
    print(json.dumps({"model": args.model, "weights": args.weights, "results": results, "memory": mem}))


if __name__ == "__main__":
    main()
