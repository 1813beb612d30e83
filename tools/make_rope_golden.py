"""Writes tests/fixtures/rope_golden.json: Hugging Face transformers' own RoPE parameters (inverse
frequencies and the cos/sin attention factor) for every scaling type metrale implements, on a few
configs each, so that CI checks metrale/models/rope.py against transformers without torch.

Needs torch and transformers (tools/requirements-golden.txt), never the engine's environment:
    python tools/make_rope_golden.py [--out tests/fixtures/rope_golden.json]

'dynamic' is evaluated at seq_len = max_position_embeddings * factor: metrale fixes the NTK base
there (as vLLM does) since keys already in the cache cannot be re-rotated.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

# (name, config kind, head_dim, rope_parameters without rope_theta, theta, max_position_embeddings)
CASES = [
    ("default", "llama", 64, {"rope_type": "default"}, 10000.0, 2048),
    ("default_partial_quarter", "qwen3_next", 256, {"rope_type": "default", "partial_rotary_factor": 0.25}, 1e7, 4096),
    ("linear", "llama", 64, {"rope_type": "linear", "factor": 4.0}, 10000.0, 8192),
    ("linear_legacy_type_key", "llama", 128, {"type": "linear", "factor": 2.0}, 500000.0, 4096),
    ("dynamic", "llama", 64, {"rope_type": "dynamic", "factor": 2.0}, 10000.0, 2048),
    ("dynamic_partial", "llama", 128, {"rope_type": "dynamic", "factor": 4.0, "partial_rotary_factor": 0.5},
     1e6, 4096),
    ("llama3_1", "llama", 128, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192}, 500000.0, 131072),
    ("llama3_2", "llama", 64, {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, 500000.0, 131072),
    ("yarn_qwen", "llama", 128, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
     1e6, 131072),
    ("yarn_mscale_only", "llama", 64, {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 2048,
                                       "mscale": 0.707}, 10000.0, 16384),
    ("yarn_attention_factor_untruncated", "llama", 64,
     {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "attention_factor": 0.8,
      "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False}, 150000.0, 131072),
    ("yarn_deepseek_v3", "deepseek_v3", 64,
     {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
      "mscale": 1.0, "mscale_all_dim": 1.0}, 10000.0, 163840),
    ("yarn_deepseek_v2_lite", "deepseek_v3", 64,
     {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
      "mscale": 0.707, "mscale_all_dim": 0.707}, 10000.0, 163840),
    ("yarn_deepseek_unequal_mscales", "deepseek_v3", 32,
     {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1,
      "mscale": 1.0, "mscale_all_dim": 0.5}, 10000.0, 128),
]


def hf_config(kind: str, head_dim: int, params: dict, theta: float, max_position: int):
    from transformers import DeepseekV3Config, LlamaConfig, Qwen3NextConfig
    rope = {**params, "rope_theta": theta}
    if kind == "qwen3_next":          # partial RoPE: the first partial_rotary_factor * head_dim dims
        return Qwen3NextConfig(hidden_size=512, num_attention_heads=2, head_dim=head_dim,
                               max_position_embeddings=max_position, rope_parameters=rope)
    if kind == "deepseek_v3":         # its rotary dim is qk_rope_head_dim
        return DeepseekV3Config(hidden_size=256, num_attention_heads=2, qk_rope_head_dim=head_dim,
                                qk_nope_head_dim=32, v_head_dim=32, kv_lora_rank=32, q_lora_rank=None,
                                max_position_embeddings=max_position, rope_parameters=rope)
    return LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                       max_position_embeddings=max_position, rope_parameters=rope)


def hf_rope(config, kind: str) -> tuple[list[float], float]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRotaryEmbedding
    params = config.rope_parameters
    rope_type = params["rope_type"]
    if rope_type == "default":
        embedding = Qwen3NextRotaryEmbedding if kind == "qwen3_next" else LlamaRotaryEmbedding
        inv, factor = embedding.compute_default_rope_parameters(config)
    elif rope_type == "dynamic":
        seq_len = int(config.max_position_embeddings * params["factor"])
        inv, factor = ROPE_INIT_FUNCTIONS["dynamic"](config, seq_len=seq_len)
    else:
        inv, factor = ROPE_INIT_FUNCTIONS[rope_type](config)
    return [float(x) for x in inv.double().tolist()], float(factor)


def deepseek_softmax_scale(config) -> float:
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale
    return float(yarn_apply_mscale(config.rope_parameters, config.qk_head_dim ** -0.5))


def main() -> None:
    import transformers
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "tests/fixtures/rope_golden.json"))
    args = ap.parse_args()
    cases = {}
    for name, kind, head_dim, params, theta, max_position in CASES:
        config = hf_config(kind, head_dim, dict(params), theta, max_position)
        inv, factor = hf_rope(config, kind)
        partial = params.get("partial_rotary_factor", 1.0)
        scaling = {k: v for k, v in params.items() if k != "partial_rotary_factor"}
        case = {"kind": kind, "rotary_dim": int(head_dim * partial), "theta": theta, "max_position": max_position,
                "scaling": scaling, "inv_freq": inv, "attention_factor": factor}
        if kind == "deepseek_v3":
            case["softmax_scale"] = deepseek_softmax_scale(config)
            case["qk_nope_head_dim"] = 32
        cases[name] = case
    out = {"transformers": transformers.__version__, "note": "inverse frequencies are transformers' float32 values",
           "cases": cases}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {len(cases)} cases to {args.out} (transformers {transformers.__version__})")


if __name__ == "__main__":
    main()
