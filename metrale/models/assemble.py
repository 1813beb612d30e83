"""Assembling a model: config + tokenizer + a backend holding the weights, from a preset or a path (load_model)."""
from __future__ import annotations

import logging
import time

from metrale.models.config import ModelConfig
from metrale.models.families import family_for
from metrale.models.checkpoint import load_gguf, load_hf_dir, random_model_config
from metrale.models.registry import resolve_model
from metrale.models.tokenizer import Tokenizer
from metrale.runtime.select import backend_class, resolve_device

log = logging.getLogger("metrale")


def load_model(cfg) -> tuple[ModelConfig, Tokenizer, object]:
    from omegaconf import OmegaConf
    if max(int(OmegaConf.select(cfg, f"parallel.{k}", default=1)) for k in ("tensor", "expert")) > 1:
        from metrale.parallel.tp import local_leader       # rank 0 here, the others spawned
        return local_leader(cfg)
    source = resolve_model(cfg.model)
    t0 = time.perf_counter()
    device = resolve_device(cfg.device)
    config, tokenizer, weights = read_model(source, keep_quantized=_keeps_quantized(cfg, device),
                                            keep_fp8=_keeps_fp8(cfg, device))
    backend = make_backend(device, cfg, config, weights)
    log.info("loaded %s on %s in %.2f s", source.name, device, time.perf_counter() - t0)
    return config, tokenizer, backend


def _keeps_quantized(cfg, device: str) -> bool:
    """GGUF blocks stay quantized on the fast CPU path (levers.cpu_kernels=numba; a family it does
    not run expands them at load) and on CUDA with levers.weights=native; they expand to float32 /
    bf16 everywhere else."""
    if device == "cuda":
        return str(cfg.levers.weights) == "native"
    from metrale.runtime.cpu_ops import uses_cpu_kernels
    return device == "cpu" and uses_cpu_kernels(cfg)


def _keeps_fp8(cfg, device: str) -> bool:
    """FP8 safetensors weights stay in their bytes on CUDA with levers.weights=native; they are
    dequantized at load everywhere else (bf16 on CUDA, the NumPy backend's dtype on the CPU)."""
    return device == "cuda" and str(cfg.levers.weights) == "native"


def refuse_tokenizer_beyond_vocab(tokenizer_ids: int, config: ModelConfig) -> None:
    """A tokenizer that can produce ids the embedding and LM head do not have would fail (or read
    garbage) at the first such token: refuse it at load. Fewer tokenizer ids than rows is normal
    (padded vocabularies)."""
    if tokenizer_ids > config.vocab_size:
        raise ValueError(f"{config.name or config.architecture}: the tokenizer has {tokenizer_ids} ids (added tokens "
                         f"included) but the model's vocabulary has {config.vocab_size}: ids >= {config.vocab_size} "
                         f"have no embedding; resize the model's embeddings or use its own tokenizer")


def _default_tokenizer():
    """Random-weight presets still need text in and out: borrow the embedded model's tokenizer,
    or bytes when that package is not installed."""
    from metrale.models.checkpoint import _gguf_reader
    from metrale.models.registry import ModelNotFoundError
    from metrale.models.tokenizer import ByteTokenizer, read_gguf_fields
    try:
        path = resolve_model("smollm2-135m").path
    except ModelNotFoundError:
        return ByteTokenizer()
    return Tokenizer.from_gguf(read_gguf_fields(_gguf_reader(path)))


def read_model(source, keep_quantized: bool = False, keep_fp8: bool = False) -> tuple[ModelConfig, Tokenizer, object]:
    """(config, tokenizer, weights) of a resolved model: weights a zero-argument stream factory, or
    None for a random preset (each backend builds its own; the CUDA one on the device). keep_quantized:
    a GGUF file's blocks stream as they are; keep_fp8: an FP8 checkpoint's linear weights do."""
    if source.kind == "gguf":
        config, fields, weights = load_gguf(source.path, keep_quantized=keep_quantized)
        tokenizer = Tokenizer.from_gguf(fields)
    elif source.kind == "hf":
        config, _, weights = _load_hf(source.path, keep_fp8=keep_fp8)
        tokenizer = Tokenizer.from_pretrained_dir(source.path)
    else:
        return random_model_config(source.preset, source.name), _default_tokenizer(), None
    refuse_tokenizer_beyond_vocab(tokenizer.vocab_size, config)   # a random preset's borrowed ids are not its own
    return config, tokenizer, weights


def _load_hf(path, keep_fp8: bool = False):
    """An HF directory: the DeepSeek family (MLA/MoE) has its own reader (FP8 dequantized at load), the
    rest is Llama-like."""
    import json
    from metrale.models.checkpoint import is_deepseek_config, load_deepseek_dir
    if is_deepseek_config(json.loads((path / "config.json").read_text())):
        return load_deepseek_dir(path)
    return load_hf_dir(path, keep_fp8=keep_fp8)


def make_backend(device: str, cfg, config: ModelConfig, weights):
    """The device's backend class, given the config's family; weights: a zero-argument stream
    factory, or None for random weights of the config's shape."""
    return backend_class(device).from_config(cfg, config, weights, family_for(config))


def load_draft_backend(cfg, model: str, *, num_blocks: int, vocab_size: int):
    """The backend of a draft model: same device and block size as the target, and as many KV
    blocks, so the target's block tables index its cache too. Its vocabulary must be the target's
    (checked before any weight is loaded)."""
    from omegaconf import OmegaConf
    source = resolve_model(model)
    if source.kind == "gguf":
        config, _, weights = load_gguf(source.path, keep_quantized=_keeps_quantized(cfg, resolve_device(cfg.device)))
    elif source.kind == "hf":
        config, _, weights = _load_hf(source.path, keep_fp8=_keeps_fp8(cfg, resolve_device(cfg.device)))
    else:
        config, weights = random_model_config(source.preset, source.name), None
    if config.vocab_size != vocab_size:
        raise ValueError(f"the draft model's vocabulary ({config.vocab_size}) differs from the target's ({vocab_size})")
    draft_cfg = OmegaConf.merge(cfg, {"cache": {"num_blocks": num_blocks}})
    return make_backend(resolve_device(cfg.device), draft_cfg, config, weights)
