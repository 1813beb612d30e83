"""Write GGUF files that llama.cpp and metrale both load: the peer benchmark's models (issue 8).

    python -m bench.gguf_export export  --src smollm2-135m --out /tmp/smollm2-bf16.gguf
    python -m bench.gguf_export random  --shape llama-3-8b-shape --out /tmp/l8b.gguf --tokenizer tok.json.gz
    python -m bench.gguf_export tokenizer --src smollm2-135m --out tok.json.gz

`export` re-writes any model metrale loads (a preset, a .gguf, an HF directory) from its canonical
float32 weights: it undoes metrale's fusing (qkv -> attn_q/k/v, gate_up -> ffn_gate/ffn_up),
keeps Q/K in llama.cpp's permuted (adjacent-pair RoPE) layout, writes matrices as BF16 (or F32)
and 1-D tensors as F32, and copies the tokenizer and general.* metadata of the source GGUF.

`random` writes random BF16 weights of a conf/models/*-shape.yaml straight from bit patterns (no
float32 stage, one tensor at a time), so the 16 GB Llama-3-8B file is written at disk speed on the
GPU machine. llama.cpp needs a tokenizer as large as the embedding: the SmolLM2 GPT-2 vocabulary,
padded with unused "[PADn]" tokens to the shape's vocab size.

Invariant: tensor infos are written first (the GGUF layout), so every writer computes the full
tensor plan from the ModelConfig alone and then streams the data in exactly that order.
"""
from __future__ import annotations

import argparse
import gzip
import json
import time
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from metrale.models.config import ModelConfig

BF16, F32 = "bf16", "f32"
FILE_TYPE = {F32: 0, BF16: 32}        # llama_ftype: ALL_F32, MOSTLY_BF16
# metadata that describes the weights, rewritten here rather than copied
_OWN_KEYS = ("general.architecture", "general.file_type", "general.quantization_version", "general.alignment")


# ----------------------------------------------------------------------------------- tensor plan

def tensor_plan(config: ModelConfig, dtype: str = BF16) -> list[tuple[str, tuple[int, ...], str]]:
    """(gguf name, numpy shape [out, in], dtype) for every tensor, in file order."""
    d, f, q, kv, v = config.hidden_size, config.intermediate_size, config.q_size, config.kv_size, config.vocab_size
    mat = lambda name, *shape: (name, tuple(shape), dtype)  # noqa: E731
    vec = lambda name, n: (name, (n,), F32)  # noqa: E731
    plan = [mat("token_embd.weight", v, d)]
    for i in range(config.num_layers):
        p = f"blk.{i}."
        plan += [vec(p + "attn_norm.weight", d), mat(p + "attn_q.weight", q, d), mat(p + "attn_k.weight", kv, d),
                 mat(p + "attn_v.weight", kv, d)]
        if config.attention_bias:
            plan += [vec(p + "attn_q.bias", q), vec(p + "attn_k.bias", kv), vec(p + "attn_v.bias", kv)]
        if config.qk_norm:
            plan += [vec(p + "attn_q_norm.weight", config.head_dim), vec(p + "attn_k_norm.weight", config.head_dim)]
        plan += [mat(p + "attn_output.weight", d, q), vec(p + "ffn_norm.weight", d),
                 mat(p + "ffn_gate.weight", f, d), mat(p + "ffn_up.weight", f, d), mat(p + "ffn_down.weight", d, f)]
    plan.append(vec("output_norm.weight", d))
    if not config.tie_word_embeddings:
        plan.append(mat("output.weight", v, d))
    return plan


def _permute_rope(w: np.ndarray, heads: int) -> np.ndarray:
    """Hugging Face half-split rows -> llama.cpp adjacent-pair rows (convert_hf_to_gguf's permute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def to_gguf_tensors(name: str, a: np.ndarray, config: ModelConfig) -> list[tuple[str, np.ndarray]]:
    """One canonical (metrale) tensor -> the GGUF tensors it came from."""
    if name == "embed":
        return [("token_embd.weight", a)]
    if name == "final_norm":
        return [("output_norm.weight", a)]
    if name == "lm_head":
        return [("output.weight", a)]
    _, i, part = name.split(".")
    p = f"blk.{i}."
    q, kv = config.q_size, config.kv_size
    if part in ("qkv", "qkv_bias"):
        wq, wk, wv = a[:q], a[q:q + kv], a[q + kv:]
        if not config.rope_interleaved:
            wq, wk = _permute_rope(wq, config.num_heads), _permute_rope(wk, config.num_kv_heads)
        kind = "weight" if part == "qkv" else "bias"
        return [(p + f"attn_q.{kind}", wq), (p + f"attn_k.{kind}", wk), (p + f"attn_v.{kind}", wv)]
    if part == "gate_up":
        f = config.intermediate_size
        return [(p + "ffn_gate.weight", a[:f]), (p + "ffn_up.weight", a[f:])]
    simple = {"attn_norm": "attn_norm.weight", "o": "attn_output.weight", "mlp_norm": "ffn_norm.weight",
              "down": "ffn_down.weight", "q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight"}
    if part not in simple:
        raise ValueError(f"no GGUF name for tensor '{name}'")
    return [(p + simple[part], a)]


def bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns (uint16), round to nearest even (NaN stays NaN)."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    r = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(a)
    if nan.any():
        r[nan] = 0x7FC0
    return r


# ------------------------------------------------------------------------------------- metadata

def read_typed_fields(path: str | Path) -> dict[str, tuple]:
    """Every key/value of a GGUF as {key: (value, value type, array item type or None)}, so it can
    be written back with the same types."""
    import gguf
    reader = gguf.GGUFReader(str(path))
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        types = [int(t) for t in field.types]
        sub = types[-1] if types[0] == int(gguf.GGUFValueType.ARRAY) else None
        out[key] = (field.contents(), types[0], sub)
    return out


def tokenizer_fields(fields: dict[str, tuple]) -> dict[str, tuple]:
    """The tokenizer.* and general.* metadata worth copying into another GGUF."""
    return {k: v for k, v in fields.items()
            if (k.startswith("tokenizer.") or k.startswith("general.")) and k not in _OWN_KEYS}


def save_fields(fields: dict[str, tuple], path: str | Path) -> None:
    with gzip.open(path, "wt", encoding="utf-8") as f:
        json.dump({k: list(v) for k, v in fields.items()}, f, ensure_ascii=False)


def load_fields(path: str | Path) -> dict[str, tuple]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return {k: tuple(v) for k, v in json.load(f).items()}


def pad_vocab(fields: dict[str, tuple], vocab_size: int) -> dict[str, tuple]:
    """Pad the token list (and token types, scores) to vocab_size with unused "[PADn]" tokens, as
    llama.cpp's converter does for checkpoints whose embedding is larger than the vocabulary."""
    from gguf import TokenType
    fields = dict(fields)
    tokens = list(fields["tokenizer.ggml.tokens"][0])
    n = len(tokens)
    if vocab_size < n:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {n} tokens")
    extra = vocab_size - n
    if extra:
        fields["tokenizer.ggml.tokens"] = (tokens + [f"[PAD{i}]" for i in range(n, vocab_size)],
                                           *fields["tokenizer.ggml.tokens"][1:])
        if "tokenizer.ggml.token_type" in fields:
            tt = fields["tokenizer.ggml.token_type"]
            fields["tokenizer.ggml.token_type"] = (list(tt[0]) + [int(TokenType.UNUSED)] * extra, *tt[1:])
        if "tokenizer.ggml.scores" in fields:
            sc = fields["tokenizer.ggml.scores"]
            fields["tokenizer.ggml.scores"] = (list(sc[0]) + [-1000.0] * extra, *sc[1:])
    return fields


def _add_model_metadata(w, config: ModelConfig, dtype: str, fields: dict[str, tuple], name: str) -> None:
    import gguf
    a = config.architecture
    for key, (value, vtype, sub) in fields.items():
        if (name and key == "general.name") or (isinstance(value, list) and not value):
            continue    # gguf cannot write empty arrays
        w.add_key_value(key, value, gguf.GGUFValueType(vtype), None if sub is None else gguf.GGUFValueType(sub))
    if name:
        w.add_key_value("general.name", name, gguf.GGUFValueType.STRING)
    w.add_uint32(f"{a}.vocab_size", config.vocab_size)
    w.add_uint32(f"{a}.context_length", config.max_position)
    w.add_uint32(f"{a}.embedding_length", config.hidden_size)
    w.add_uint32(f"{a}.feed_forward_length", config.intermediate_size)
    w.add_uint32(f"{a}.block_count", config.num_layers)
    w.add_uint32(f"{a}.attention.head_count", config.num_heads)
    w.add_uint32(f"{a}.attention.head_count_kv", config.num_kv_heads)
    w.add_uint32(f"{a}.attention.key_length", config.head_dim)
    w.add_uint32(f"{a}.attention.value_length", config.head_dim)
    w.add_uint32(f"{a}.rope.dimension_count", config.head_dim)
    w.add_float32(f"{a}.rope.freq_base", float(config.rope_theta))
    _add_rope_scaling(w, config)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", float(config.rms_norm_eps))
    w.add_uint32("general.file_type", FILE_TYPE[dtype])
    w.add_uint32("general.quantization_version", 2)


def _add_rope_scaling(w, config: ModelConfig) -> None:
    """llama.cpp's rope.scaling.* keys for linear and yarn; other scalings are refused, not dropped."""
    import gguf
    a, s = config.architecture, (config.extra or {}).get("rope_scaling") or {}
    kind = s.get("rope_type", "default")
    if (config.extra or {}).get("rope_freq_factors") is not None or kind not in ("default", "linear", "yarn"):
        raise ValueError(f"GGUF export: rope scaling '{kind}' (or rope_freqs) is not exported; "
                         "supported: default, linear, yarn")
    if kind == "default":
        return
    w.add_string(f"{a}.rope.scaling.type", gguf.RopeScalingType(kind).value)
    w.add_float32(f"{a}.rope.scaling.factor", float(s["factor"]))
    if kind == "yarn":
        w.add_uint32(f"{a}.rope.scaling.original_context_length",
                     int(s.get("original_max_position_embeddings") or config.max_position))
        for key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if s.get(hf_key) is not None:
                w.add_float32(f"{a}.rope.scaling.{key}", float(s[hf_key]))
        if s.get("attention_factor") is not None or s.get("mscale") or s.get("truncate") is False:
            raise ValueError("GGUF export: yarn attention_factor / mscale / truncate are not exported")


def _check_tokenizer(config: ModelConfig, fields: dict[str, tuple]) -> None:
    tokens = fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError("llama.cpp needs a tokenizer: give tokenizer fields (tokenizer.ggml.*)")
    if len(tokens[0]) != config.vocab_size:
        raise ValueError(f"the tokenizer has {len(tokens[0])} tokens, the model {config.vocab_size}: pad_vocab first")


# --------------------------------------------------------------------------------------- writers

def write_gguf(path: str | Path, config: ModelConfig, tensors: Iterable[tuple[str, np.ndarray]],
               fields: dict[str, tuple], dtype: str = BF16, name: str = "") -> int:
    """Write a GGUF from a stream of GGUF-named tensors (float32 values, or uint16 bf16 bits for
    BF16 matrices). The stream may come in any order within a layer: tensors are held until their
    turn in the plan, so at most about one layer is buffered. Returns the bytes written."""
    import gguf
    _check_tokenizer(config, fields)
    plan = tensor_plan(config, dtype)
    w = gguf.GGUFWriter(str(path), config.architecture)
    _add_model_metadata(w, config, dtype, fields, name)
    raw = {BF16: gguf.GGMLQuantizationType.BF16, F32: gguf.GGMLQuantizationType.F32}
    for tname, shape, dt in plan:
        itemsize = 2 if dt == BF16 else 4
        w.add_tensor_info(tname, shape, np.dtype(np.uint16 if dt == BF16 else np.float32),
                          int(np.prod(shape)) * itemsize, raw_dtype=raw[dt])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    pending: dict[str, np.ndarray] = {}
    nxt = 0
    total = 0
    for tname, a in tensors:
        pending[tname] = a
        while nxt < len(plan) and plan[nxt][0] in pending:
            pname, shape, dt = plan[nxt]
            arr = pending.pop(pname)
            if tuple(arr.shape) != shape:
                raise ValueError(f"{pname}: shape {arr.shape}, the config says {shape}")
            if dt == BF16:
                arr = arr if arr.dtype == np.uint16 else bf16_bits(arr)
            else:
                arr = np.ascontiguousarray(arr, dtype=np.float32)
            w.write_tensor_data(np.ascontiguousarray(arr))
            total += arr.nbytes
            nxt += 1
    if nxt != len(plan) or pending:
        missing = [p[0] for p in plan[nxt:]][:5]
        raise ValueError(f"the weight stream ended early: missing {missing}, unused {list(pending)[:5]}")
    w.close()
    return total


def export_model(src: str, out: str | Path, dtype: str = BF16, fields: dict[str, tuple] | None = None) -> dict:
    """Re-write a model metrale can load (preset, .gguf or HF dir) as a GGUF llama.cpp loads."""
    from metrale.models.checkpoint import load_gguf, load_hf_dir, random_model_config, random_weights
    from metrale.models.registry import resolve_model
    t0 = time.perf_counter()
    source = resolve_model(src)
    if source.kind == "gguf":
        config, _, stream = load_gguf(source.path)
        meta = tokenizer_fields(read_typed_fields(source.path)) if fields is None else fields
        weights = stream()
    elif source.kind == "hf":
        config, _, stream = load_hf_dir(source.path)
        weights = stream()
        meta = fields
    else:
        config = random_model_config(source.preset, source.name)
        weights = random_weights(config)
        meta = fields
    if meta is None:
        raise ValueError(f"{src} has no GGUF tokenizer metadata: pass fields (see `tokenizer`)")
    meta = pad_vocab(meta, config.vocab_size)

    def gguf_stream() -> Iterator[tuple[str, np.ndarray]]:
        for name, a in weights:
            yield from to_gguf_tensors(name, a, config)

    n = write_gguf(out, config, gguf_stream(), meta, dtype, name=f"{config.name} {dtype}")
    return {"path": str(out), "bytes": n, "seconds": time.perf_counter() - t0, "vocab_size": config.vocab_size}


def _bf16_pool(rng: np.random.Generator, std: float, size: int) -> np.ndarray:
    return bf16_bits(rng.standard_normal(size, dtype=np.float32) * np.float32(std))


def random_bf16_tensors(config: ModelConfig, seed: int = 0, pool_size: int = (1 << 20) + 7
                        ) -> Iterator[tuple[str, np.ndarray]]:
    """Random weights as bf16 bits, N(0, 1/fan_in) (embeddings N(0, 0.5^2)), norms near 1. Each
    matrix is a pool of a million normal samples tiled from a random offset: memory-speed, and
    plenty random for a throughput benchmark."""
    rng = np.random.default_rng(seed)
    pools: dict[float, np.ndarray] = {}

    def fill(shape: tuple[int, ...], std: float) -> np.ndarray:
        pool = pools.setdefault(std, _bf16_pool(rng, std, pool_size))
        n = int(np.prod(shape))
        off = int(rng.integers(pool_size))
        reps = -(-(n + off) // pool_size)
        return np.tile(pool, reps)[off:off + n].reshape(shape)

    for name, shape, dt in tensor_plan(config, BF16):
        if dt == F32:
            norm = name.endswith("norm.weight")
            yield name, ((1.0 if norm else 0.0) + 0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
        else:
            fan_in = shape[1]
            yield name, fill(shape, 0.5 if name == "token_embd.weight" else 1.0 / np.sqrt(fan_in))


def write_random_gguf(out: str | Path, shape: str | ModelConfig, fields: dict[str, tuple], seed: int = 0) -> dict:
    """A random-weight BF16 GGUF of a conf/models/*-shape.yaml preset (or a ModelConfig)."""
    from metrale.models.checkpoint import random_model_config
    from metrale.models.registry import resolve_model
    t0 = time.perf_counter()
    if isinstance(shape, ModelConfig):
        config = shape
    else:
        source = resolve_model(shape)
        if source.kind != "random":
            raise ValueError(f"{shape} is not a random-weight shape preset")
        config = random_model_config(source.preset, source.name)
    # random weights have no RoPE layout of their own; the GGUF says llama.cpp's
    from dataclasses import replace
    config = replace(config, rope_interleaved=True)
    meta = pad_vocab(tokenizer_fields(fields), config.vocab_size)
    n = write_gguf(out, config, random_bf16_tensors(config, seed), meta, BF16, name=f"{config.name} random bf16")
    dt = time.perf_counter() - t0
    return {"path": str(out), "bytes": n, "seconds": dt, "GB_s": n / dt / 1e9, "vocab_size": config.vocab_size}


def source_fields(src: str) -> dict[str, tuple]:
    """Tokenizer metadata from a .gguf path, a preset that is a GGUF, or a saved .json.gz."""
    if str(src).endswith(".json.gz"):
        return load_fields(src)
    from metrale.models.registry import resolve_model
    source = resolve_model(src)
    if source.kind != "gguf":
        raise ValueError(f"{src} is not a GGUF: no tokenizer metadata to copy")
    return tokenizer_fields(read_typed_fields(source.path))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export", help="re-write a loadable model as BF16/F32 GGUF")
    e.add_argument("--src", default="smollm2-135m")
    e.add_argument("--out", required=True)
    e.add_argument("--dtype", choices=[BF16, F32], default=BF16)
    r = sub.add_parser("random", help="random BF16 GGUF of a shape preset")
    r.add_argument("--shape", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--tokenizer", default="smollm2-135m", help="GGUF / preset / .json.gz with tokenizer fields")
    r.add_argument("--seed", type=int, default=0)
    t = sub.add_parser("tokenizer", help="save a GGUF's tokenizer metadata as .json.gz")
    t.add_argument("--src", default="smollm2-135m")
    t.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.cmd == "export":
        print(json.dumps(export_model(args.src, args.out, args.dtype)))
    elif args.cmd == "random":
        print(json.dumps(write_random_gguf(args.out, args.shape, source_fields(args.tokenizer), args.seed)))
    else:
        save_fields(source_fields(args.src), args.out)
        print(json.dumps({"path": args.out, "bytes": Path(args.out).stat().st_size}))


if __name__ == "__main__":
    main()
