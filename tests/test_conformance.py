"""Conformance with Hugging Face transformers: every family and config variant metrale loads, as a
tiny random checkpoint saved by transformers (tests/fixtures/conformance/, made by
tools/make_conformance.py), gives transformers' float32 eager logits on metrale's NumPy backend,
in one prefill and in chunked prefill + one-token decode steps through the paged cache.
No torch here: the reference logits are stored beside each checkpoint."""
import json
from pathlib import Path

import numpy as np
import pytest

from metrale.models.assemble import _load_hf
from metrale.runtime.batch import Segment, build_batch

FIXTURES = Path(__file__).parent / "fixtures" / "conformance"
MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())
IDS = np.array(MANIFEST["token_ids"], np.int32)
CASES = sorted(MANIFEST["cases"])
BLOCK = 4


def backend_of(name: str, dtype: str = "float64"):
    config, _, stream = _load_hf(FIXTURES / name)
    blocks = -(-len(IDS) // BLOCK)
    from metrale.runtime.numpy_backend import NumpyBackend
    hybrid = dict(num_state_slots=1, num_state_checkpoints=0) if config.is_hybrid else {}
    return NumpyBackend(config, stream(), num_blocks=blocks, block_size=BLOCK, dtype=dtype, **hybrid)


def reference(name: str) -> np.ndarray:
    return np.load(FIXTURES / name / "logits.npy").astype(np.float64)


def run(backend, pieces: list[tuple[int, int]]) -> np.ndarray:
    """Logits of every token, running IDS[a:b] for each (a, b) in turn through the cache."""
    table = np.arange(backend.num_blocks, dtype=np.int32)
    slot = 0 if backend.config.is_hybrid else -1
    out = [backend.forward(build_batch([Segment(IDS[a:b], a, table, "all", state_slot=slot)], BLOCK))
           for a, b in pieces]
    return np.concatenate(out).astype(np.float64)


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(got - ref).max() / np.abs(ref).max())


def test_the_fixtures_cover_every_family():
    archs = {json.loads((FIXTURES / n / "config.json").read_text())["model_type"] for n in CASES}
    assert archs == {"llama", "qwen2", "qwen3", "mistral", "deepseek_v2", "deepseek_v3", "qwen3_next", "gemma3_text",
                     "qwen3_moe"}


@pytest.mark.parametrize("name", CASES)
def test_prefill_logits_match_transformers(name):
    got = run(backend_of(name), [(0, len(IDS))])
    assert rel_err(got, reference(name)) < 1e-5


@pytest.mark.parametrize("name", CASES)
def test_chunked_prefill_and_decode_match_transformers(name):
    """A 5-token chunk, a 7-token chunk, then one token a step: the cache path (and, for MLA,
    the absorbed decode form) gives the same logits."""
    pieces = [(0, 5), (5, 12)] + [(p, p + 1) for p in range(12, len(IDS))]
    got = run(backend_of(name), pieces)
    assert rel_err(got, reference(name)) < 1e-5


@pytest.mark.parametrize("name", CASES)
def test_float32_backend_is_close(name):
    got = run(backend_of(name, "float32"), [(0, len(IDS))])
    assert rel_err(got, reference(name)) < 2e-4


# ------------------------------------------------------------------ what the variants must read

def config_of(name: str):
    return _load_hf(FIXTURES / name)[0]


def test_mistral_window_is_read():
    c = config_of("mistral_sliding")
    assert c.sliding_window == 8 and [c.layer_window(i) for i in range(c.num_layers)] == [8, 8]


def test_qwen2_window_only_past_max_window_layers():
    c = config_of("qwen2_sliding")
    assert [c.layer_window(i) for i in range(c.num_layers)] == [0, 8]


def test_window_matters_in_these_fixtures():
    """Without the window the same checkpoint gives other logits past position 8 (so the
    conformance test above can fail)."""
    from dataclasses import replace
    from metrale.runtime.numpy_backend import NumpyBackend
    config, _, stream = _load_hf(FIXTURES / "mistral_sliding")
    be = NumpyBackend(replace(config, sliding_window=0), stream(), num_blocks=6, block_size=BLOCK, dtype="float64")
    got = run(be, [(0, len(IDS))])
    ref = reference("mistral_sliding")
    assert rel_err(got[:8], ref[:8]) < 1e-5 and rel_err(got[8:], ref[8:]) > 1e-2


def test_deepseek_v3_without_routing_keys_routes_as_transformers():
    c = config_of("deepseek_v3_defaults")
    assert (c.scoring_func, c.topk_method, c.n_group, c.topk_group) == ("sigmoid", "noaux_tc", 4, 2)
    assert c.norm_topk_prob and c.routed_scaling_factor == 2.5


# ------------------------------------------------------------------------------------ Gemma 3

def test_gemma3_configs_are_read():
    c = config_of("gemma3")
    assert c.architecture == "gemma3" and c.sliding_layers == (True, False, True) and c.sliding_window == 8
    assert (c.rope_theta, c.extra["rope_scaling"]["rope_type"], c.local_rope_theta) == (1e6, "linear", 1e4)
    assert (c.query_pre_attn_scalar, c.final_logit_softcapping, c.embed_scale) == (24.0, 30.0, 8.0)
    legacy = config_of("gemma3_legacy")      # rope_theta / rope_local_base_freq / sliding_window_pattern
    assert legacy.sliding_layers == (True, False, True) and legacy.extra["rope_scaling"] is None
    assert (legacy.rope_theta, legacy.local_rope_theta, legacy.final_logit_softcapping) == (1e6, 1e3, 0.0)


@pytest.mark.parametrize("change", [dict(local_rope_theta=0.0), dict(query_pre_attn_scalar=0.0),
                                    dict(final_logit_softcapping=0.0), dict(sliding_window=0),
                                    dict(embed_scale=1.0)], ids=lambda d: next(iter(d)))
def test_each_gemma3_feature_matters(change):
    """Dropping any one Gemma 3 feature gives other logits, so the conformance tests above fail
    without it (the sandwich norms and 1 + w norms fail them outright)."""
    from dataclasses import replace
    from metrale.runtime.numpy_backend import NumpyBackend
    config, _, stream = _load_hf(FIXTURES / "gemma3")
    be = NumpyBackend(replace(config, **change), stream(), num_blocks=6, block_size=BLOCK, dtype="float64")
    assert rel_err(run(be, [(0, len(IDS))]), reference("gemma3")) > 1e-2


# ---------------------------------------------------------------------------------------- MoE

def test_qwen_moe_layers_and_routing_are_read():
    c = config_of("qwen3_moe")           # transformers 5 writes num_local_experts, not num_experts
    assert (c.n_routed_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (8, 2, 32)
    assert [c.is_moe_layer(i) for i in range(2)] == [False, True] and c.norm_topk_prob   # mlp_only_layers=[0]
    step = config_of("qwen3_moe_step")   # decoder_sparse_step=2
    assert [step.is_moe_layer(i) for i in range(3)] == [False, True, False] and not step.norm_topk_prob
    nxt = config_of("qwen3_next_moe")
    assert nxt.shared_expert_gate and nxt.shared_intermediate_size == 48 and nxt.is_hybrid


@pytest.mark.parametrize("name, change", [("qwen3_moe", dict(norm_topk_prob=False)),
                                          ("qwen3_moe_step", dict(norm_topk_prob=True)),
                                          ("qwen3_moe", dict(moe_layers=(True, True)))], ids=str)
def test_each_moe_setting_matters(name, change):
    """Routing without (or with) renormalization or the wrong layers gives other logits."""
    from dataclasses import replace
    from metrale.runtime.numpy_backend import NumpyBackend
    config, _, stream = _load_hf(FIXTURES / name)
    weights = dict(stream())
    if change.get("moe_layers"):         # layer 0's dense MLP replaced by layer 1's experts
        weights.update({k.replace("layers.1.", "layers.0."): v for k, v in weights.items() if "layers.1." in k
                        and ("expert" in k or "router" in k)})
    be = NumpyBackend(replace(config, **change), weights, num_blocks=6, block_size=BLOCK, dtype="float64")
    assert rel_err(run(be, [(0, len(IDS))]), reference(name)) > 1e-2


def test_shared_expert_gate_matters():
    from metrale.runtime.numpy_backend import NumpyBackend
    config, _, stream = _load_hf(FIXTURES / "qwen3_next_moe")
    weights = {k: v for k, v in stream() if not k.endswith("shared_gate")}
    be = NumpyBackend(config, weights, num_blocks=6, block_size=BLOCK, dtype="float64", num_state_slots=1,
                      num_state_checkpoints=0)
    assert rel_err(run(be, [(0, len(IDS))]), reference("qwen3_next_moe")) > 1e-2


def test_a_family_without_a_cuda_part_is_refused_naming_what_is_missing():
    from dataclasses import replace
    from metrale.models.families import family_for
    f = replace(family_for(config_of("qwen3_next_moe")), cuda="", cuda_missing="kernels for X")
    with pytest.raises(ValueError, match="NumPy backend only so far \\(no kernels for X yet\\); use device=cpu"):
        f.cuda_part()


# ----------------------------------------------------------------------------- GGUF conversions

GGUF = MANIFEST.get("gguf", {})          # stem -> {case, type, file, quantization_rel_err}


def gguf_backend(stem: str, tmp_path) -> "object":
    import gzip
    from metrale.models.checkpoint import load_gguf
    from metrale.runtime.numpy_backend import NumpyBackend
    path = FIXTURES / "gguf" / GGUF[stem]["file"]
    if path.suffix == ".gz":                 # F32 files are stored gzipped
        path = tmp_path / path.stem
        path.write_bytes(gzip.decompress((FIXTURES / "gguf" / GGUF[stem]["file"]).read_bytes()))
    config, _, stream = load_gguf(path)
    return NumpyBackend(config, stream(), num_blocks=-(-len(IDS) // BLOCK), block_size=BLOCK, dtype="float64")


def source_logits(case: str) -> np.ndarray:
    src = FIXTURES / case / "logits.npy"
    return np.load(src if src.exists() else FIXTURES / "gguf" / f"{case}.logits.npy").astype(np.float64)


def test_gguf_fixtures_cover_the_types_and_architectures():
    assert {e["type"] for e in GGUF.values()} == {"F32", "Q8_0", "Q4_0", "Q4_K"}
    archs = set()
    for stem in GGUF:
        import gguf
        path = FIXTURES / "gguf" / GGUF[stem]["file"]
        if path.suffix != ".gz":
            archs.add(str(gguf.GGUFReader(str(path)).fields["general.architecture"].contents()))
    assert archs == {"llama", "qwen2", "qwen3", "qwen3moe", "gemma3"}


@pytest.mark.parametrize("stem", sorted(GGUF))
def test_gguf_conversion_matches_transformers(stem, tmp_path):
    """llama.cpp's conversion read by metrale's GGUF loader: the logits of transformers on the file's
    dequantized tensors to float precision, and the source checkpoint's within what quantization
    alone moves them (transformers' own distance, plus float noise)."""
    entry = GGUF[stem]
    got = run(gguf_backend(stem, tmp_path), [(0, 5), (5, 12)] + [(p, p + 1) for p in range(12, len(IDS))])
    deq = np.load(FIXTURES / "gguf" / f"{stem}.logits.npy").astype(np.float64)
    assert rel_err(got, deq) < 1e-5
    assert rel_err(got, source_logits(entry["case"])) <= 1.05 * entry["quantization_rel_err"] + 1e-5


def test_gemma3_gguf_config_as_llama_cpp_reads_it(tmp_path):
    be = gguf_backend("gemma3_swa6.Q8_0", tmp_path)
    c = be.config
    assert c.architecture == "gemma3" and c.sliding_layers == (True,) * 5 + (False,) and c.sliding_window == 8
    assert (c.rope_theta, c.local_rope_theta, c.query_pre_attn_scalar, c.rope_interleaved) == (1e6, 1e4, 16.0, False)
    assert be.family.name == "gemma3"
