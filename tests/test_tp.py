"""Tensor parallelism on CPU (metrale/parallel/tp.py): ranks are threads joined by FakeCommunicator
(one test: processes through launch). TP=2 and TP=4 give TP=1's logits (float64, within 1e-10) and
its greedy and seeded tokens through the Engine (chunked prefill, decode, mixed steps), with KV
heads split or replicated (num_kv_heads < N); a rank reads and holds ~1/N of the weights; sizes
that do not split are refused naming the numbers."""
import json

import numpy as np
import pytest

from metrale import Engine, SamplingParams
from metrale.models.checkpoint import load_hf_dir
from metrale.parallel.comm import all_gather, all_reduce, run_ranks
from metrale.parallel.tp import (SliceReader, TensorParallel, TpLeader, TpNumpyBackend, TPRank,
                                 check_tensor_parallel, hf_shard_stream, launch_tp, tp_engine)
from metrale.runtime.batch import Segment, build_batch
from metrale.runtime.numpy_backend import NumpyBackend
from metrale.settings import compose

BS = 4
# llama: 4 KV heads (split at N = 2 and 4), a vocabulary N does not divide, untied LM head.
# qwen2: 2 KV heads (replicated at N = 4), q/k/v biases, tied embeddings. qwen3: 1 KV head
# (replicated at any N), per-head q/k norms.
SHAPES = {
    "llama": dict(model_type="llama", vocab_size=67, num_attention_heads=8, num_key_value_heads=4,
                  tie_word_embeddings=False),
    "qwen2": dict(model_type="qwen2", vocab_size=64, num_attention_heads=8, num_key_value_heads=2,
                  tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", vocab_size=64, num_attention_heads=4, num_key_value_heads=1,
                  tie_word_embeddings=False, head_dim=8),
}


def write_checkpoint(path, shape: dict, seed: int = 0, hidden=32, ffn=96, layers=2):
    """A random dense HF directory (config.json, model.safetensors, a word-level tokenizer)."""
    from safetensors.numpy import save_file
    rng = np.random.default_rng(seed)
    h, k, v = shape["num_attention_heads"], shape["num_key_value_heads"], shape["vocab_size"]
    hd = shape.get("head_dim", hidden // h)
    cfg = dict(hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers, rms_norm_eps=1e-5,
               rope_theta=10000.0, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, **shape)
    m = lambda *s: (rng.standard_normal(s) / np.sqrt(s[-1])).astype(np.float32)  # noqa: E731
    n = lambda d: (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)          # noqa: E731
    w = {"model.embed_tokens.weight": m(v, hidden) * 3, "model.norm.weight": n(hidden)}
    if not shape["tie_word_embeddings"]:
        w["lm_head.weight"] = m(v, hidden) * 2
    for i in range(layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"], w[p + "post_attention_layernorm.weight"] = n(hidden), n(hidden)
        for x, rows in (("q", h * hd), ("k", k * hd), ("v", k * hd)):
            w[p + f"self_attn.{x}_proj.weight"] = m(rows, hidden)
            if shape["model_type"] == "qwen2":
                w[p + f"self_attn.{x}_proj.bias"] = (0.1 * rng.standard_normal(rows)).astype(np.float32)
        if shape["model_type"] == "qwen3":
            w[p + "self_attn.q_norm.weight"], w[p + "self_attn.k_norm.weight"] = n(hd), n(hd)
        w[p + "self_attn.o_proj.weight"] = m(hidden, h * hd)
        w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"] = m(ffn, hidden), m(ffn, hidden)
        w[p + "mlp.down_proj.weight"] = m(hidden, ffn)
    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(w, str(path / "model.safetensors"))
    return write_word_tokenizer(path, v)


def write_word_tokenizer(path, vocab: int):
    """A word-level tokenizer (w0 .. w{vocab-1}, w1 BOS, w2 EOS) into an HF directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "w2", "bos_token": "w1"}))
    return path


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    return {name: write_checkpoint(root / name, shape, seed=i) for i, (name, shape) in enumerate(SHAPES.items())}


def single_backend(path, dtype="float64", num_blocks=32):
    config, _, stream = load_hf_dir(path)
    return NumpyBackend(config, stream(), num_blocks=num_blocks, block_size=BS, dtype=dtype)


def rank_backend(path, comm, dtype="float64", num_blocks=32):
    config, _, _ = load_hf_dir(path)
    tp = TensorParallel.of(config, comm)
    return TpNumpyBackend(tp, hf_shard_stream(SliceReader(path), config, tp), num_blocks=num_blocks,
                          block_size=BS, dtype=dtype)


def seg(ids, start, table, logits="last"):
    return Segment(np.array(ids, np.int32), start, np.array(table, np.int32), logits)


# step 1: two prefills (all rows / last row); step 2: a decode row, a prefill chunk without logits
# and another with them (a mixed step)
P1, P2, P3 = [5, 9, 33, 60, 2, 17, 41, 8, 11], [3, 14, 15, 9, 26], [40, 66 % 64, 7, 7, 21, 50]
STEPS = [[seg(P1, 0, [0, 1, 2]), seg(P2, 0, [3, 4], "last")],
         [seg([12], 9, [0, 1, 2]), seg(P3[:4], 0, [5, 6], "none"), seg(P2[:1] * 2, 5, [3, 4], "all")],
         [seg(P3[4:], 4, [5, 6], "all"), seg([1], 10, [0, 1, 2])]]


def test_all_reduce_and_all_gather_give_every_rank_the_same_bits():
    def fn(comm):
        x = np.random.default_rng(comm.rank).standard_normal((3, 5))
        g = all_gather(comm, np.full((comm.rank + 1, 2), comm.rank))
        return all_reduce(comm, x), [p.shape[0] for p in g]
    out = run_ranks(3, fn)
    want = sum(np.random.default_rng(r).standard_normal((3, 5)) for r in range(3))
    for got, counts in out:
        assert np.array_equal(got, out[0][0]) and counts == [1, 2, 3]
    np.testing.assert_allclose(out[0][0], want, rtol=1e-15)


@pytest.mark.parametrize("name,world", [("llama", 2), ("llama", 4), ("qwen2", 2), ("qwen2", 4), ("qwen3", 4)])
def test_logits_equal_single_rank(ckpts, name, world):
    """Prefill, decode and mixed steps: rank 0's gathered logits and greedy ids are TP=1's."""
    single = single_backend(ckpts[name])
    want = [single.forward(build_batch(s, BS)) for s in STEPS]

    def fn(comm):
        rank = TPRank(comm, rank_backend(ckpts[name], comm))
        if comm.rank:
            return rank.follow(), rank.backend.tp.reduces
        leader = TpLeader(rank)
        got = []
        for s in STEPS:
            got.append((leader.forward(build_batch(s, BS)), leader.forward_greedy(build_batch(s, BS))))
        leader.close()
        return got, rank.backend.tp.reduces
    out = run_ranks(world, fn)
    for (logits, ids), ref in zip(out[0][0], want):
        assert logits.shape == ref.shape
        np.testing.assert_allclose(logits, ref, rtol=0, atol=1e-10)
        assert ids.tolist() == np.argmax(ref, axis=-1).tolist()
    layers = single.config.num_layers
    assert all(o[0] == 2 * len(STEPS) for o in out[1:])                   # followers ran every step
    assert all(o[1] == 2 * len(STEPS) * (2 * layers + 1) for o in out)      # 2 all-reduces a layer + 1


def _settings(path, world, **extra):
    s = [f"model={path}", "device=cpu", f"parallel.tensor={world}", "levers.numpy_dtype=float64",
         "levers.cpu_kernels=numpy", f"cache.block_size={BS}", "cache.num_blocks=48",
         "scheduler.max_num_batched_tokens=8"]
    return s + [f"{k}={v}" for k, v in extra.items()]


PROMPTS = [[5, 9, 33, 60, 2, 17, 41, 8, 11, 30, 3], [3, 14, 15], [40, 7, 7, 21, 50, 6]]


def _tp_generate(path, world, params):
    """Engine outputs on `world` thread ranks, and the leader's step plans (segment lengths)."""
    cfg = compose(_settings(path, world))
    shapes = []

    def fn(comm):
        got = tp_engine(cfg, comm)
        if comm.rank:
            return got
        lead = got.backend.rank.lead
        got.backend.rank.lead = lambda mode, batch, n=None: (shapes.append(np.diff(batch.seq_query_start).tolist()),
                                                             lead(mode, batch, n))[1]
        try:
            return [o.token_ids.tolist() for o in got.generate(PROMPTS, params, use_tqdm=False)]
        finally:
            got.backend.close()
    return run_ranks(world, fn)[0], shapes


@pytest.mark.parametrize("name,world", [("llama", 2), ("llama", 4), ("qwen2", 4)])
def test_greedy_generation_equals_single_rank(ckpts, name, world):
    """16 greedy tokens per prompt through the Engine (the scheduler on rank 0, budget 8 tokens:
    chunked prefills beside decode rows)."""
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    want = [o.token_ids.tolist() for o in Engine(cfg=compose(_settings(ckpts[name], 1))).generate(
        PROMPTS, params, use_tqdm=False)]
    got, shapes = _tp_generate(ckpts[name], world, params)
    assert got == want and all(len(t) == 16 for t in got)
    assert any(1 in s and max(s) > 1 for s in shapes)            # a mixed step ran (decode + prefill chunk)


def test_seeded_sampling_equals_single_rank(ckpts):
    """Sampled rows read rank 0's gathered full logits (the LOGITS step mode)."""
    params = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)
    want = [o.token_ids.tolist() for o in Engine(cfg=compose(_settings(ckpts["llama"], 1))).generate(
        PROMPTS, params, use_tqdm=False)]
    assert _tp_generate(ckpts["llama"], 2, params)[0] == want


@pytest.mark.parametrize("world", [2, 4])
def test_a_rank_reads_and_holds_a_share_of_the_weights(ckpts, world):
    """Each rank's slices only: bytes read == bytes held ~= total/N (+ the replicated norms and a
    vocab row of rounding); no single read is a whole matrix; its KV cache is 1/N."""
    from safetensors.numpy import load_file
    path = ckpts["llama"]
    full = load_file(str(path / "model.safetensors"))
    total = sum(a.nbytes for a in full.values())
    replicated = sum(a.nbytes for k, a in full.items() if a.ndim == 1)
    single = single_backend(path, dtype="float32")
    config = single.config
    held = []
    for r in range(world):
        tp = TensorParallel(config, world, r)
        reader = SliceReader(path)
        b = TpNumpyBackend(tp, hf_shard_stream(reader, config, tp), num_blocks=32, block_size=BS, dtype="float32")
        nbytes = b.memory_report()["weights_bytes"]
        assert reader.bytes_read == nbytes
        assert abs(nbytes - ((total - replicated) / world + replicated)) <= 2 * 4 * config.hidden_size
        assert reader.largest_share <= 1 / world + 1 / config.vocab_size   # every matrix read is a slice
        assert b.memory_report()["kv_pool_bytes"] * world == single.memory_report()["kv_pool_bytes"]
        held.append(nbytes)
    assert sum(held) == total + (world - 1) * replicated


def test_refusals_name_the_numbers(ckpts):
    from dataclasses import replace
    config = load_hf_dir(ckpts["llama"])[0]                     # 8 heads, 4 KV heads, intermediate 96
    with pytest.raises(ValueError, match=r"^parallel.tensor=3 does not divide the 8 attention heads$"):
        check_tensor_parallel(config, 3)
    with pytest.raises(ValueError, match=r"parallel.tensor=2 neither divides the 3 KV heads nor is a multiple"):
        check_tensor_parallel(replace(config, num_heads=6, num_kv_heads=3), 2)
    with pytest.raises(ValueError, match=r"parallel.tensor=8 does not divide the intermediate size 100"):
        check_tensor_parallel(replace(config, intermediate_size=100), 8)
    check_tensor_parallel(config, 8)                            # 4 KV heads over 8 ranks: replicated
    with pytest.raises(ValueError, match="dense family only"):
        check_tensor_parallel(replace(config, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=8), 2)
    with pytest.raises(Exception, match="parallel.tensor: must be >= 1, got 0"):
        compose(["parallel.tensor=0"])
    with pytest.raises(ValueError, match="parallel.tensor=2 but 4 ranks"):
        run_ranks(4, lambda comm: tp_engine(compose(_settings(ckpts["llama"], 2)), comm))


def test_launch_runs_one_process_per_rank(ckpts):
    """launch_tp: two spawned ranks joined by QueueCommunicator, rank 0's Engine; TP=1's tokens."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    settings = _settings(ckpts["qwen2"], 2)
    want = [o.token_ids.tolist() for o in Engine(cfg=compose(_settings(ckpts["qwen2"], 1))).generate(
        PROMPTS[:2], params, use_tqdm=False)]
    out, report = launch_tp(settings, PROMPTS[:2], params, timeout=240)
    assert report.ok, report.problems
    assert out["token_ids"] == want
    assert report.of("followed")[1]["steps"] > 0


def test_engine_starts_its_own_ranks(ckpts):
    """Engine(cfg with parallel.tensor=2): rank 0 in this process, rank 1 spawned by it (it used to
    refuse); TP=1's tokens; close() ends the follower."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    want = [o.token_ids.tolist() for o in Engine(cfg=compose(_settings(ckpts["qwen2"], 1))).generate(
        PROMPTS[:2], params, use_tqdm=False)]
    eng = Engine(cfg=compose(_settings(ckpts["qwen2"], 2)))
    try:
        got = [o.token_ids.tolist() for o in eng.generate(PROMPTS[:2], params, use_tqdm=False)]
        assert eng.backend.memory_report()["tensor_parallel"] == 2
    finally:
        eng.backend.close()
    assert got == want
    assert len(eng.backend.followers) == 1 and not eng.backend.followers[0].is_alive()


def test_server_engine_process_starts_tensor_parallel_ranks(ckpts):
    """serve's engine process (EngineProcess) with parallel.tensor=2: not daemonic, so its engine
    can spawn rank 1; a greedy completion over HTTP equals TP=1's text; close() ends it."""
    import httpx
    from metrale.server import ServerThread, create_app
    from metrale.server.engine_process import EngineProcess
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    want = Engine(cfg=compose(_settings(ckpts["qwen2"], 1))).generate(PROMPTS[:1], params, use_tqdm=False)[0]
    cfg = compose(_settings(ckpts["qwen2"], 2))
    proc = EngineProcess.start(cfg)
    try:
        with ServerThread(create_app(proc, cfg)) as server:
            body = {"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
            got = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()
    finally:
        proc.close()
    assert got["choices"][0]["text"] == want.text and got["usage"]["completion_tokens"] == 6
    assert not proc.process.is_alive()


def test_tp_bench_dry_run(tmp_path):
    """bench/tp_bench.py's flow on CPU (TP=1 alone, then 2 spawned TP ranks): records written,
    both rates measured, the greedy ids equal."""
    from bench import tp_bench
    out = tmp_path / "tp.json"
    assert tp_bench.main(["--dry-run", "--batches", "1,2", "--ctx", "32", "--steps", "2", "--out", str(out)]) == 0
    records = json.loads(out.read_text())
    assert [r["figure"] for r in records] == ["dense decode tok/s, TP=2, batch 1", "dense decode tok/s, TP=2, batch 2"]
    assert all(r["value"] > 0 and r["peer"] > 0 and r["extra"]["greedy_ids_equal"] for r in records)


def test_cli_runs_tensor_parallel_ranks(ckpts, capsys):
    """python -m metrale ... parallel.tensor=2 spawns the two ranks (it used to refuse) and prints the
    text the one-rank CLI prints for the same greedy settings."""
    from metrale.__main__ import main
    args = ["prompt=hello there", "max_tokens=5", "sampling.temperature=0", "sampling.ignore_eos=true", "chat=false"]
    assert main(_settings(ckpts["qwen2"], 1) + args) == 0
    one = capsys.readouterr().out
    assert main(_settings(ckpts["qwen2"], 2) + args) == 0
    captured = capsys.readouterr()
    assert captured.out == one and one.strip()
    assert "on 2 CPU ranks" in captured.err
