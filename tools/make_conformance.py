"""Writes tests/fixtures/conformance/: a tiny random checkpoint of every family and config variant
metrale loads (config.json + model.safetensors, saved by transformers itself, weights in float16)
and transformers' float32 eager logits for one fixed token sequence, so that CI compares metrale's
NumPy backend with transformers without torch (tests/test_conformance.py).

Needs torch and transformers (tools/requirements-golden.txt), never the engine's environment:
    python tools/make_conformance.py [--out tests/fixtures/conformance] [--only NAME ...]

Weights are drawn with O(1/sqrt(fan_in)) scales (transformers' 0.02 init gives near-uniform logits
that would hide errors), rounded to float16 (the stored precision), and the model runs in float32
with those exact values. Each checkpoint is reloaded with from_pretrained and must give the same
logits: the stored files, not the in-memory model, are the reference.
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

NUM_TOKENS = 24
VOCAB = 256
SEED = 20

BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
MLA = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
           v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1,
           max_position_embeddings=64, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
# Gemma 3: 3 layers, head_dim 32 != hidden / heads, window 8 (24 tokens), tied embeddings
GEMMA = dict(BASE, num_hidden_layers=3, head_dim=32, sliding_window=8, tie_word_embeddings=True, pad_token_id=0,
             hidden_activation="gelu_pytorch_tanh")
YARN_DS = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
           "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}

# name -> (transformers config class, its kwargs, what the variant exercises)
VARIANTS: dict[str, tuple[str, dict, str]] = {
    "llama_untied": ("LlamaConfig", dict(BASE, tie_word_embeddings=False), "GQA, separate LM head"),
    "llama_tied_llama3": ("LlamaConfig", dict(BASE, tie_word_embeddings=True, rope_parameters=LLAMA3),
                          "tied embeddings, llama3 RoPE scaling"),
    "qwen2_bias_yarn": ("Qwen2Config", dict(BASE, tie_word_embeddings=True, rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 16}),
        "q/k/v biases, YaRN RoPE"),
    "qwen2_sliding": ("Qwen2Config", dict(BASE, use_sliding_window=True, sliding_window=8, max_window_layers=1),
                      "use_sliding_window: window 8 on layers >= max_window_layers only"),
    "qwen3_qknorm": ("Qwen3Config", dict(BASE, head_dim=32, tie_word_embeddings=False, rope_parameters={
        "rope_type": "linear", "rope_theta": 1e6, "factor": 2.0}), "q/k RMSNorm, head_dim != hidden/heads, linear RoPE"),
    "mistral_sliding": ("MistralConfig", dict(BASE, sliding_window=8, tie_word_embeddings=False),
                        "sliding window 8 on every layer (24 tokens)"),
    "deepseek_v2_greedy": ("DeepseekV2Config", dict(MLA, q_lora_rank=None, n_shared_experts=1, topk_method="greedy",
                                                   norm_topk_prob=False, routed_scaling_factor=1.0),
                           "MLA without q_lora, softmax greedy routing, a shared expert"),
    "deepseek_v2_group": ("DeepseekV2Config", dict(MLA, q_lora_rank=24, n_shared_experts=2,
                                                  topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                                  routed_scaling_factor=1.5, rope_parameters=YARN_DS),
                          "MLA with q_lora, group_limited_greedy routing, YaRN with mscale"),
    "deepseek_v3": ("DeepseekV3Config", dict(MLA, q_lora_rank=24, n_shared_experts=1, n_group=4, topk_group=2,
                                            norm_topk_prob=True, routed_scaling_factor=2.5, rope_parameters=YARN_DS,
                                            scoring_func="sigmoid", topk_method="noaux_tc"),
                    "MLA, sigmoid noaux_tc routing with e_score_correction_bias (keys explicit)"),
    "deepseek_v3_defaults": ("DeepseekV3Config", dict(MLA, q_lora_rank=24, n_shared_experts=1, n_group=4,
                                                     topk_group=2), "no scoring_func / topk_method keys: "
                             "transformers' DeepseekV3 routing (sigmoid, noaux_tc) and its defaults"),
    "qwen3_next_dense": ("Qwen3NextConfig", dict(BASE, head_dim=32, layer_types=["linear_attention", "full_attention"],
                                                 linear_num_key_heads=2, linear_num_value_heads=4,
                                                 linear_key_head_dim=16, linear_value_head_dim=16,
                                                 linear_conv_kernel_dim=4, num_experts=0, mlp_only_layers=[0, 1],
                                                 tie_word_embeddings=False, rope_parameters={
                                                     "rope_type": "default", "rope_theta": 10000.0,
                                                     "partial_rotary_factor": 0.25}),
                         "hybrid: Gated DeltaNet + gated full attention, partial RoPE, dense MLPs"),
    "qwen3_moe": ("Qwen3MoeConfig", dict(BASE, head_dim=32, num_experts=8, num_experts_per_tok=2,
                                         moe_intermediate_size=32, mlp_only_layers=[0], norm_topk_prob=True,
                                         tie_word_embeddings=False),
                  "Qwen3-MoE: q/k norm attention, layer 0 dense (mlp_only_layers), layer 1 softmax top-2 of 8 "
                  "experts, norm_topk_prob"),
    "qwen3_moe_step": ("Qwen3MoeConfig", dict(BASE, num_hidden_layers=3, num_experts=8, num_experts_per_tok=3,
                                              moe_intermediate_size=32, decoder_sparse_step=2, norm_topk_prob=False,
                                              tie_word_embeddings=True),
                       "Qwen3-MoE: decoder_sparse_step 2 (layer 1 MoE, layers 0, 2 dense), top-3 without "
                       "renormalizing, tied embeddings"),
    "qwen3_next_moe": ("Qwen3NextConfig", dict(BASE, head_dim=32, layer_types=["linear_attention", "full_attention"],
                                               linear_num_key_heads=2, linear_num_value_heads=4,
                                               linear_key_head_dim=16, linear_value_head_dim=16,
                                               linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
                                               moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                               norm_topk_prob=True, mlp_only_layers=[0], tie_word_embeddings=False,
                                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                "partial_rotary_factor": 0.25}),
                       "hybrid with a MoE layer (layer 0 dense: mlp_only_layers): top-2 of 8 experts plus a "
                       "sigmoid-gated shared expert"),
    "gemma3": ("Gemma3TextConfig", dict(GEMMA, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                        query_pre_attn_scalar=24, final_logit_softcapping=30.0, rope_parameters={
                                            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                            "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                               "rope_theta": 1e6}}),
               "Gemma 3: sandwich norms (1 + w), q/k norm, window 8 on sliding layers, RoPE per layer type "
               "(local default, global linear), query_pre_attn_scalar != head_dim, scaled embeddings, "
               "GELU-tanh MLP, final logit softcapping"),
    "gemma3_legacy": ("Gemma3TextConfig", dict(GEMMA, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                               num_key_value_heads=1, head_dim=16, sliding_window_pattern=2,
                                               rope_theta=1e6, rope_local_base_freq=1000.0, query_pre_attn_scalar=16),
                      "Gemma 3 config of transformers 4 (rewritten after saving): rope_theta, rope_local_base_freq, "
                      "sliding_window_pattern instead of rope_parameters / layer_types"),
    "gemma3_swa6": ("Gemma3TextConfig", dict(GEMMA, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                                             num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                             query_pre_attn_scalar=16, rope_parameters={
                                                 "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                 "full_attention": {"rope_type": "default", "rope_theta": 1e6}}),
                    "Gemma 3 as llama.cpp's gemma3 GGUFs can say it (5 sliding layers then a global one, "
                    "query_pre_attn_scalar = head_dim): the source of the gemma3 GGUF fixtures"),
    "llama_q4k": ("LlamaConfig", dict(BASE, hidden_size=256, intermediate_size=256, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                      rope_parameters=LLAMA3),
                  "every matrix 256 wide (K-quant blocks): the source of the Q4_K GGUF fixture; its checkpoint "
                  "(2 MB) is not stored, only the GGUF and both references"),
    "qwen3_moe_gguf": ("Qwen3MoeConfig", dict(BASE, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                              num_key_value_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                              moe_intermediate_size=32, norm_topk_prob=True, tie_word_embeddings=True),
                       "Qwen3-MoE as llama.cpp's qwen3moe GGUF states it (every layer MoE, renormalized top-k): "
                       "the source of the qwen3moe GGUF fixture"),
}

# HF checkpoints that only feed GGUF fixtures (not stored; their logits are)
GGUF_ONLY = ("llama_q4k",)
# case -> llama.cpp types of its GGUF fixtures (F32 by convert_hf_to_gguf.py, the rest by llama-quantize --pure
# from that F32 file); F32 files are stored gzipped
GGUF_TYPES = {"llama_tied_llama3": ("F32", "Q8_0", "Q4_0"), "qwen3_qknorm": ("Q8_0",),
              "qwen2_bias_yarn": ("Q8_0",), "qwen3_moe_gguf": ("Q8_0",), "gemma3_swa6": ("F32", "Q8_0", "Q4_0"),
              "llama_q4k": ("Q4_K",)}

# keys transformers 5 writes that a config of an older version would not have: dropped so the
# stored config.json also checks that metrale's defaults for absent keys match transformers'
DROP_KEYS = {"deepseek_v3_defaults": ("scoring_func", "topk_method")}


def legacy_gemma3(cfg: dict) -> dict:
    """A Gemma 3 config.json as transformers 4 wrote it: rope_theta / rope_local_base_freq /
    rope_scaling at the top level and sliding_window_pattern instead of layer_types."""
    rope = cfg.pop("rope_parameters")
    cfg.pop("layer_types")
    cfg["rope_theta"] = rope["full_attention"]["rope_theta"]
    cfg["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
    cfg["rope_scaling"] = None
    cfg.pop("_sliding_window_pattern", None)
    cfg["sliding_window_pattern"] = 2
    return cfg


# name -> a rewrite of the saved config.json (checked by the reload: transformers must read it the same)
REWRITE = {"gemma3_legacy": legacy_gemma3}


def randomize(model, seed: int) -> None:
    """Weights with O(1) activations, rounded to float16 (what the checkpoint stores)."""
    import torch
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                # norms: around 1 (Qwen3-Next and Gemma 3 store w of x * (1 + w): around 0); biases, A_log,
                # dt: small
                module = type(model).__module__
                base = 0.0 if ("bias" in name or "qwen3_next" in module or "gemma3" in module
                               or "A_log" in name or "dt_bias" in name) else 1.0
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                fan_in = p.shape[-1] if "embed" not in name else 1
                scale = 0.5 if "embed" in name else fan_in ** -0.5
                p.copy_(scale * torch.randn(p.shape, generator=gen))
            p.copy_(p.half().float())
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_((0.05 * torch.randn(b.shape, generator=gen)).half().float())


def build(name: str, seed: int):
    import torch
    import transformers
    cls_name, kwargs, _ = VARIANTS[name]
    config = getattr(transformers, cls_name)(**kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    model.eval()
    randomize(model, seed)
    return model


def logits_of(model, ids: list[int]):
    import torch
    with torch.no_grad():
        return model(torch.tensor([ids]), use_cache=False).logits[0].float().numpy()


def save(model, name: str, path: Path) -> None:
    import torch
    if path.exists():
        shutil.rmtree(path)
    model.to(torch.float16).save_pretrained(str(path), safe_serialization=True)
    model.to(torch.float32)
    cfg_path = path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    for key in DROP_KEYS.get(name, ()):
        cfg.pop(key, None)
    if name in REWRITE:
        cfg = REWRITE[name](cfg)
    cfg_path.write_text(json.dumps(cfg, indent=1, sort_keys=True) + "\n")
    (path / "generation_config.json").unlink(missing_ok=True)


def reload_logits(path: Path, ids: list[int]):
    import torch
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                              attn_implementation="eager")
    model.eval()
    return logits_of(model, ids)


# ------------------------------------------------------------------------------- GGUF fixtures

# Runs llama.cpp's convert_hf_to_gguf.py with its own gguf-py; the conformance checkpoints have no
# tokenizer, so its vocabulary readers are replaced by a dummy one of vocab_size tokens (the tensors,
# names, permutations and metadata are the converter's own)
CONVERT = r"""
import sys
from pathlib import Path
lcpp, src, dst = sys.argv[1:4]
sys.path.insert(0, lcpp)
sys.path.insert(1, str(Path(lcpp) / "gguf-py"))
import conversion.base as base
def dummy_vocab(self, *args, **kwargs):
    n = int(self.hparams["vocab_size"])
    self.gguf_writer.add_tokenizer_model("gpt2")
    self.gguf_writer.add_tokenizer_pre("default")
    self.gguf_writer.add_token_list([f"<t{i}>" for i in range(n)])
    self.gguf_writer.add_token_types([1] * n)
    self.gguf_writer.add_token_merges([])
for name in ("set_vocab", "_set_vocab_sentencepiece", "_set_vocab_llama_hf", "_set_vocab_gpt2"):
    setattr(base.TextModel, name, dummy_vocab)
import conversion
for cls in list(vars(conversion).values()):
    if isinstance(cls, type) and issubclass(cls, base.TextModel) and "set_vocab" in vars(cls):
        cls.set_vocab = dummy_vocab
sys.argv = ["convert_hf_to_gguf.py", src, "--outfile", dst, "--outtype", "f32"]
import convert_hf_to_gguf
convert_hf_to_gguf.main()
"""


def gguf_files(lcpp: Path, hf_dir: Path, name: str, out: Path) -> dict[str, Path]:
    """type -> the GGUF llama.cpp makes of hf_dir (F32 by its converter, the others quantized from it)."""
    import subprocess
    import sys
    import tempfile
    tmp = Path(tempfile.mkdtemp())
    src = tmp / name
    shutil.copytree(hf_dir, src)
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    # Gemma's converter trims token_embd to the tokenizer.json's vocabulary: one of vocab_size entries
    (src / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {f"<t{i}>": i for i in range(vocab)}},
                                                    "added_tokens": []}))
    f32 = tmp / f"{name}.F32.gguf"
    subprocess.run([sys.executable, "-c", CONVERT, str(lcpp), str(src), str(f32)], check=True)
    files = {"F32": f32}
    quantize = lcpp / "build" / "bin" / "llama-quantize"
    for kind in GGUF_TYPES[name]:
        if kind != "F32":
            files[kind] = tmp / f"{name}.{kind}.gguf"
            subprocess.run([str(quantize), "--pure", str(f32), str(files[kind]), kind], check=True,
                           stdout=subprocess.DEVNULL)
    return {k: v for k, v in files.items() if k in GGUF_TYPES[name]}


def dequantized_logits(hf_dir: Path, gguf_path: Path, ids: list[int]):
    """transformers on the GGUF's dequantized tensors, mapped back to HF names by transformers' own GGUF
    reader (un-permuted Q/K, Gemma norms less 1), in the model of hf_dir's config.json (the GGUF's
    RoPE metadata is not what transformers reads: the source config is)."""
    import torch
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32,
                                                              attn_implementation="eager")
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict({k: torch.as_tensor(v, dtype=torch.float32)
                                                 for k, v in tensors.items()}, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise SystemExit(f"{gguf_path.name}: GGUF tensors do not fit the model: missing {missing}, "
                         f"unexpected {unexpected}")
    model.tie_weights()
    model.eval()
    return logits_of(model, ids)


def make_gguf_fixtures(lcpp: Path, out: Path, names: list[str], ids: list[int], manifest: dict, sources: dict) -> None:
    import gzip
    import numpy as np
    gdir = out / "gguf"
    gdir.mkdir(exist_ok=True)
    entries = manifest.setdefault("gguf", {})
    for name in names:
        hf_dir = sources[name]
        ref = np.load(hf_dir / "logits.npy")
        for kind, path in gguf_files(lcpp, hf_dir, name, out).items():
            deq = dequantized_logits(hf_dir, path, ids)
            stem = f"{name}.{kind}"
            if kind == "F32":
                (gdir / f"{stem}.gguf.gz").write_bytes(gzip.compress(path.read_bytes(), 9, mtime=0))
            else:
                shutil.copy(path, gdir / f"{stem}.gguf")
            np.save(gdir / f"{stem}.logits.npy", deq.astype(np.float32))
            err = float(np.abs(deq - ref).max() / np.abs(ref).max())
            entries[stem] = {"case": name, "type": kind, "file": f"{stem}.gguf" + (".gz" if kind == "F32" else ""),
                             "quantization_rel_err": err}
            print(f"{stem}: transformers on the dequantized GGUF vs the source checkpoint: rel err {err:.2e}")
        if name in GGUF_ONLY:
            shutil.copy(hf_dir / "logits.npy", gdir / f"{name}.logits.npy")


def main() -> None:
    import numpy as np
    import transformers
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "tests/fixtures/conformance"))
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--llama-cpp", default=None, help="a llama.cpp source tree (convert_hf_to_gguf.py, gguf-py, "
                    "conversion/) with build/bin/llama-quantize: also writes the GGUF fixtures")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ids = [int(i) for i in np.random.default_rng(SEED).integers(3, VOCAB, NUM_TOKENS)]
    manifest_path = out / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {"cases": {}}
    sources = {}
    for k, name in enumerate(VARIANTS):
        if args.only and name not in args.only:
            continue
        model = build(name, SEED + k)
        ref = logits_of(model, ids)
        path = out / name if name not in GGUF_ONLY else Path(__import__("tempfile").mkdtemp()) / name
        save(model, name, path)
        again = reload_logits(path, ids)
        diff = float(np.abs(again - ref).max())
        if diff > 1e-5 * float(np.abs(ref).max()):
            raise SystemExit(f"{name}: the saved checkpoint gives other logits (max diff {diff})")
        np.save(path / "logits.npy", ref.astype(np.float32))
        sources[name] = path
        if name not in GGUF_ONLY:
            manifest["cases"][name] = {"class": VARIANTS[name][0], "exercises": VARIANTS[name][2],
                                       "logits_abs_max": float(np.abs(ref).max())}
        print(f"{name}: logits |max| {np.abs(ref).max():.3f}, reload diff {diff:.2e}")
    if args.llama_cpp:
        make_gguf_fixtures(Path(args.llama_cpp), out, [n for n in GGUF_TYPES if n in sources], ids, manifest, sources)
    manifest.update({"transformers": transformers.__version__, "token_ids": ids,
                     "note": "transformers float32 eager logits [tokens, vocab] of token_ids, per case logits.npy"})
    manifest["cases"] = {k: manifest["cases"][k] for k in VARIANTS if k in manifest["cases"]}
    if "gguf" in manifest:
        manifest["gguf_note"] = ("gguf/<case>.<type>.gguf: llama.cpp's convert_hf_to_gguf.py (F32, stored gzipped) "
                                 "and llama-quantize --pure; <case>.<type>.logits.npy: transformers on the file's "
                                 "dequantized tensors in the source config's model")
    manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")


if __name__ == "__main__":
    main()
