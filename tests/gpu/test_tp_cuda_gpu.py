"""Tensor parallelism on two GPUs (metrale/runtime/cuda_tp.py, parallel/tp_cuda.py; run: pytest -m gpu
-s tests/gpu/test_tp_cuda_gpu.py; needs 2 GPUs, skips with fewer).

A small real-layout dense checkpoint (an HF directory of random weights: 4 heads / 2 KV heads of
64, hidden 256, intermediate 512, 3 layers, vocabulary 1000: slices of 500 ids padded to 512 device
rows, untied LM head) written to a temporary directory and read shard by shard:
- Engine(..., device="cuda", parallel={"tensor": 2}) (rank 1 spawned on the second GPU, the
  collectives over NCCL, CUDA graphs on: decode and mixed steps replay with the all-reduces inside)
  gives the TP=1 engine's greedy tokens for three prompts, with PDL on and off (a kernel launched
  right after an NCCL kernel must still wait for it);
- its leader holds captured graphs and half the KV heads' pages;
- python -m metrale ... parallel.tensor=2 device=cuda (two launched processes) prints TP=1's text.
Greedy equality can fail only at a near-tie of TP=1's logits (the partial sums add in another order).
"""
import json

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from metrale import Engine, SamplingParams  # noqa: E402

PROMPTS = [[5, 9, 33, 60, 2, 17, 41, 8, 11, 30, 3, 250, 999], [3, 14, 15], [40, 7, 7, 21, 50, 6, 610, 611]]


def _need_two_gpus() -> None:
    from numba import cuda
    if not cuda.is_available() or len(cuda.gpus) < 2:
        pytest.skip(f"tensor parallelism needs 2 GPUs, {len(cuda.gpus) if cuda.is_available() else 0} visible")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    _need_two_gpus()
    from safetensors.numpy import save_file
    path = tmp_path_factory.mktemp("tp_gpu") / "model"
    rng = np.random.default_rng(0)
    h, k, hd, d, f, v, layers = 4, 2, 64, 256, 512, 1000, 3
    m = lambda *s: (rng.standard_normal(s) / np.sqrt(s[-1])).astype(np.float32)  # noqa: E731
    n = lambda s: (1 + 0.1 * rng.standard_normal(s)).astype(np.float32)          # noqa: E731
    w = {"model.embed_tokens.weight": 3 * m(v, d), "model.norm.weight": n(d), "lm_head.weight": 2 * m(v, d)}
    for i in range(layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"], w[p + "post_attention_layernorm.weight"] = n(d), n(d)
        w[p + "self_attn.q_proj.weight"], w[p + "self_attn.o_proj.weight"] = m(h * hd, d), m(d, h * hd)
        w[p + "self_attn.k_proj.weight"], w[p + "self_attn.v_proj.weight"] = m(k * hd, d), m(k * hd, d)
        w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"] = m(f, d), m(f, d)
        w[p + "mlp.down_proj.weight"] = m(d, f)
    path.mkdir()
    (path / "config.json").write_text(json.dumps(dict(
        model_type="llama", hidden_size=d, intermediate_size=f, num_hidden_layers=layers, num_attention_heads=h,
        num_key_value_heads=k, head_dim=hd, vocab_size=v, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)))
    save_file(w, str(path / "model.safetensors"))
    from test_tp import write_word_tokenizer          # tests/ is on sys.path (its conftest)
    return write_word_tokenizer(path, v)


def _settings(path, world: int, **levers) -> dict:
    return dict(model=str(path), device="cuda", parallel={"tensor": world}, cache={"block_size": 16, "num_blocks": 64},
                scheduler={"max_num_seqs": 8, "max_num_batched_tokens": 16, "max_model_len": 256},
                levers={"graph_batch_sizes": [1, 2, 4, 8], **levers})


def _greedy(engine, tokens: int = 12) -> list[list[int]]:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    return [o.token_ids.tolist() for o in engine.generate(PROMPTS, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def single_tokens(ckpt):
    engine = Engine(**_settings(ckpt, 1))
    try:
        return _greedy(engine)
    finally:
        engine.backend.close()


@pytest.mark.parametrize("pdl", [True, False])
def test_two_gpus_give_one_gpus_greedy_tokens(ckpt, single_tokens, pdl):
    engine = Engine(**_settings(ckpt, 2, pdl=pdl))
    try:
        got = _greedy(engine)
        report = engine.backend.memory_report()
    finally:
        engine.backend.close()
    assert got == single_tokens
    assert report["tensor_parallel"] == 2 and report["graphs"] > 0
    assert all(not p.is_alive() for p in engine.backend.followers)


def test_cli_on_two_gpus_prints_one_gpus_text(ckpt, capsys):
    from metrale.__main__ import main
    args = [f"model={ckpt}", "device=cuda", "prompt=w5 w9 w33 w60", "max_tokens=6", "sampling.temperature=0",
            "sampling.ignore_eos=true", "chat=false", "cache.num_blocks=64", "scheduler.max_model_len=256",
            "levers.graph_batch_sizes=[1,2]"]
    assert main(args + ["parallel.tensor=1"]) == 0
    one = capsys.readouterr().out
    assert main(args + ["parallel.tensor=2"]) == 0
    got = capsys.readouterr()
    assert got.out == one and one.strip() and "on 2 GPU ranks" in got.err
