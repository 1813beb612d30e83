"""The tiny DeepSeek-style model (MLA + MoE, random weights written as config.json + safetensors)
through the NumPy forward: config reading, naive/absorbed/auto attention agree, chunked prefill
gives the one-shot logits and the same greedy tokens, ragged batches equal separate runs."""
import json

import numpy as np
import pytest

from metrale.models import deepseek as DS
from metrale.models.checkpoint import deepseek_model_config, is_deepseek_config, load_deepseek_dir
from metrale.runtime.batch import Segment, build_batch
from metrale.runtime.numpy_backend import NumpyBackend

BS = 4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return DS.write_random_checkpoint(tmp_path_factory.mktemp("dsv3"), DS.tiny_deepseek_hf_config(), seed=11)


def _backend(path, **kw):
    kw.setdefault("dtype", "float64")
    return DS.load_deepseek_backend(path, num_blocks=24, block_size=BS, **kw)


def _logits(backend, prompt, chunk):
    table = np.arange(-(-len(prompt) // BS), dtype=np.int32)
    rows = []
    for a in range(0, len(prompt), chunk):
        piece = np.array(prompt[a:a + chunk], np.int32)
        rows.append(backend.forward(build_batch([Segment(piece, a, table, "all")], BS)))
    return np.concatenate(rows)


def test_config_reader(ckpt):
    raw = json.loads((ckpt / "config.json").read_text())
    assert is_deepseek_config(raw) and not is_deepseek_config({"model_type": "llama"})
    c = deepseek_model_config(raw)
    assert c.is_mla and c.is_moe and c.latent_dim == 40 and c.head_dim == 24 and c.num_kv_heads == 1
    assert [c.is_moe_layer(i) for i in range(3)] == [False, True, True]
    assert c.kv_bytes_per_token(2) == 3 * 40 * 2
    assert (c.scoring_func, c.topk_method, c.n_group, c.topk_group, c.routed_scaling_factor) == ("sigmoid", "noaux_tc", 4, 2, 2.5)
    v2 = deepseek_model_config({**raw, "model_type": "deepseek_v2", "norm_topk_prob": True})
    assert v2.routed_scaling_factor == 1.0       # V2 scaled only when it did not normalise
    _, _, stream = load_deepseek_dir(ckpt)
    assert sum(a.size for _, a in stream()) == c.num_parameters()
    with pytest.raises(ValueError, match="not a DeepSeek config"):
        deepseek_model_config({"model_type": "llama"})


def test_expert_range_loads_a_slice(ckpt):
    full = dict(load_deepseek_dir(ckpt)[2]())
    part = dict(load_deepseek_dir(ckpt, (2, 4))[2]())
    assert part["layers.1.experts_gate_up"].shape[0] == 2
    np.testing.assert_array_equal(part["layers.2.experts_down"], full["layers.2.experts_down"][2:4])
    with pytest.raises(ValueError, match="outside"):
        load_deepseek_dir(ckpt, (6, 10))


def test_attention_forms_agree(ckpt):
    prompt = [3, 17, 5, 60, 2, 9, 9, 41, 7, 12, 30]
    ref = _logits(_backend(ckpt, mla_mode="naive"), prompt, len(prompt))
    for mode in ("absorbed", "auto"):
        np.testing.assert_allclose(_logits(_backend(ckpt, mla_mode=mode), prompt, len(prompt)), ref, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("chunk", [1, 3, 5])
def test_chunked_prefill_equals_one_shot(ckpt, chunk):
    prompt = [3, 17, 5, 60, 2, 9, 9, 41, 7, 12, 30, 88, 1]
    be = _backend(ckpt)
    ref = _logits(be, prompt, len(prompt))
    np.testing.assert_allclose(_logits(_backend(ckpt), prompt, chunk), ref, rtol=1e-9, atol=1e-10)
    one = DS.greedy_generate(be, prompt, 6)
    assert DS.greedy_generate(_backend(ckpt), prompt, 6, chunk=chunk) == one


def test_float32_backend_matches_float64(ckpt):
    prompt = [3, 17, 5, 60, 2, 9]
    a = _logits(_backend(ckpt, dtype="float32"), prompt, 4)
    b = _logits(_backend(ckpt), prompt, 4)
    assert a.dtype == np.float32
    np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-4)


def test_ragged_batch_equals_separate_runs(ckpt):
    """A prefill chunk with earlier context and a decode row of another sequence in one batch."""
    p1, p2 = [4, 8, 15, 16, 23, 42, 7], [11, 12, 13, 14, 15]
    sep = _backend(ckpt)
    want1 = _logits(sep, p1, 7)[-1]
    want2 = _logits(_backend(ckpt), p2, 5)[-1]
    be = _backend(ckpt)
    t1, t2 = np.arange(0, 2, dtype=np.int32), np.arange(2, 4, dtype=np.int32)
    be.forward(build_batch([Segment(np.array(p1[:3], np.int32), 0, t1), Segment(np.array(p2[:4], np.int32), 0, t2)], BS))
    out = be.forward(build_batch([Segment(np.array(p1[3:], np.int32), 3, t1), Segment(np.array(p2[4:], np.int32), 4, t2)], BS))
    np.testing.assert_allclose(out, np.stack([want1, want2]), rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("overrides", [
    {"q_lora_rank": None},                                                         # q_proj directly
    {"model_type": "deepseek_v2", "scoring_func": "softmax", "topk_method": "group_limited_greedy",
     "norm_topk_prob": False, "routed_scaling_factor": 16.0, "rope_scaling": None},  # V2 routing, plain RoPE
    {"n_group": 1, "topk_group": 1, "topk_method": "greedy", "scoring_func": "softmax", "n_shared_experts": 0,
     "first_k_dense_replace": 0, "moe_layer_freq": 2}])                             # V2-Lite-like
def test_variants_run_and_chunk(tmp_path, overrides):
    path = DS.write_random_checkpoint(tmp_path, DS.tiny_deepseek_hf_config(**overrides), seed=2)
    prompt = [5, 6, 7, 8, 9, 10, 11]
    np.testing.assert_allclose(_logits(_backend(path), prompt, 3), _logits(_backend(path), prompt, 7), rtol=1e-9, atol=1e-10)


def test_yarn_rope(ckpt):
    from metrale.models.rope import model_rope
    c = deepseek_model_config(json.loads((ckpt / "config.json").read_text()))
    rope, scale = model_rope(c), DS.deepseek_softmax_scale(c)
    plain = 1.0 / 10000.0 ** (np.arange(0, 8, 2) / 8)
    inv = rope.inv_freq
    assert inv[0] == plain[0] and np.isclose(inv[-1], plain[-1] / 4.0)    # extrapolated / interpolated
    assert rope.attention_factor == 1.0                                    # mscale == mscale_all_dim
    assert np.isclose(scale, 24 ** -0.5 * (0.1 * np.log(4.0) + 1.0) ** 2)


def test_backend_refuses_wrong_expert_count(ckpt):
    config, _, stream = load_deepseek_dir(ckpt, (0, 4))
    with pytest.raises(ValueError, match="4 experts loaded, this rank needs 8"):
        NumpyBackend(config, stream(), num_blocks=4, block_size=BS)


def test_engine_runs_the_deepseek_backend(ckpt):
    """The engine's scheduler (token budget forcing chunked prefill, batching of two requests,
    prefix caching) drives the NumPy backend of the MLA family unchanged: same greedy tokens as one-shot runs."""
    from metrale import Engine, SamplingParams
    from metrale.settings import compose
    from fake_model import FakeTokenizer
    backend = _backend(ckpt)
    cfg = compose([f"cache.block_size={BS}", "scheduler.max_num_batched_tokens=5"])
    engine = Engine(cfg=cfg, parts=(backend.config, FakeTokenizer(), backend))
    prompts = [[3, 17, 5, 60, 2, 9, 9, 41, 7, 12, 30], [3, 17, 5, 60, 2, 9, 9, 41, 50]]
    outs = engine.generate(prompts, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.token_ids.tolist() == DS.greedy_generate(_backend(ckpt), p, 5)


def test_engine_loads_a_deepseek_directory_by_path(ckpt):
    """model=<directory> picks the DeepSeek reader and backend from config.json (models/assemble.py)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from metrale import Engine, SamplingParams
    vocab_size = json.loads((ckpt / "config.json").read_text())["vocab_size"]
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(ckpt / "tokenizer.json"))
    engine = Engine(model=str(ckpt), device="cpu", cache={"block_size": BS}, levers={"numpy_dtype": "float64"})
    assert type(engine.backend).__name__ == "NumpyBackend" and engine.backend.family.name == "mla"
    prompt = [3, 17, 5, 60, 2, 9]
    out = engine.generate(np.array(prompt), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                          use_tqdm=False)[0]
    assert out.token_ids.tolist() == DS.greedy_generate(_backend(ckpt), prompt, 4)
