"""Hybrid (Gated DeltaNet + attention) models on the CUDA backend against the NumPy backend and
against themselves (run on a GPU: pytest -m gpu tests/gpu/test_hybrid_gpu.py).

A tiny random Qwen3-Next-style model (qwen3_next: gated attention, partial RoPE, q/k norms;
layers GDN, attention, GDN, attention; GDN heads 2 k / 32 v, dk 32, dv 16, so every GEMM
dimension is a multiple of 64). The CUDA engine keeps bf16 weights and a bf16 KV cache, its NumPy
twin the same weights in float32: greedy runs agree token for token except at near-ties, which
`assert_same_up_to_ties` checks from the logits (a divergence must sit on a top-2 gap below 2% of
the logit range, never on a clear winner)."""
import json

import numpy as np
import pytest

from metrale import Engine, SamplingParams
from metrale.runtime.batch import Segment, build_batch
from metrale.runtime.numpy_backend import NumpyBackend
from spec_helpers import AlwaysGate, NoisyOracle

pytestmark = pytest.mark.gpu

VOCAB = 320          # a multiple of 64 that no other GEMM width shares (out{N} buffers are keyed by N)
CONFIG = {"model_type": "qwen3_next", "vocab_size": VOCAB, "hidden_size": 128, "intermediate_size": 256,
          "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64,
          "linear_num_key_heads": 2, "linear_num_value_heads": 32, "linear_key_head_dim": 32,
          "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "full_attention_interval": 2,
          "num_experts": 0, "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-6,
          "tie_word_embeddings": False, "max_position_embeddings": 1024}
TIE = 0.02           # a divergence is a tie when the top-2 gap is below this fraction of the logit range
LOGIT_REL = 3e-2     # CUDA (bf16 KV) vs NumPy (float32) logits on identical contexts


def write_model(path):
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    from metrale.models.hybrid import hybrid_model_config, random_hf_hybrid_tensors
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(CONFIG))
    save_file(random_hf_hybrid_tensors(hybrid_model_config(CONFIG), seed=0), str(path / "model.safetensors"))
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "w1"}))
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("hybrid_gpu") / "m")


def cuda_engine(model_dir, **kw) -> Engine:
    return Engine(model=str(model_dir), device="cuda", cache={"num_blocks": 1024, **kw.pop("cache", {})},
                  scheduler={"max_num_seqs": 16, **kw.pop("scheduler", {})},
                  levers={"graph_batch_sizes": [1, 2, 4, 8, 16], **kw.pop("levers", {})}, **kw)


def numpy_twin(engine: Engine) -> Engine:
    """A NumPy engine with the CUDA engine's own weights (bf16 matrices widened to float32)."""
    be = engine.backend
    twin = NumpyBackend(be.config, be.export_weights(), num_blocks=1024, block_size=be.block_size,
                        num_state_slots=int(engine.cfg.scheduler.max_num_seqs), num_state_checkpoints=0)
    return Engine(cfg=engine.cfg, parts=(be.config, engine.tokenizer, twin))


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def logits_of(backend, ids, slot: int = 0) -> np.ndarray:
    """Last-row logits of `ids` run from position 0 in state slot `slot` (call when the engine is idle)."""
    blocks = np.arange(-(-len(ids) // backend.block_size), dtype=np.int32) + 900
    seg = Segment(np.asarray(ids, np.int32), 0, blocks, "last", state_slot=slot)
    return backend.forward(build_batch([seg], backend.block_size))[-1]


def rel_err(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def assert_same_up_to_ties(prompts, outs_a, outs_b, backend) -> int:
    """Token lists equal, or their first divergence is a near-tie in `backend`'s logits there.
    Returns the number of sequences that diverged (at ties)."""
    diverged = 0
    for prompt, a, b in zip(prompts, outs_a, outs_b):
        a, b = np.asarray(a.token_ids), np.asarray(b.token_ids)
        if np.array_equal(a, b):
            continue
        j = int(np.argmax(a[:min(len(a), len(b))] != b[:min(len(a), len(b))]))
        logits = logits_of(backend, np.concatenate([prompt, a[:j]]))
        gap = abs(float(logits[a[j]] - logits[b[j]]))
        span = float(logits.max() - logits.min())
        assert gap < TIE * span, (f"prompt of {len(prompt)} tokens: outputs differ at token {j} "
                                  f"({a[j]} vs {b[j]}) where the logits gap is {gap:.4f} of a {span:.2f} range")
        diverged += 1
    return diverged


def assert_clean(eng: Engine) -> None:
    eng.blocks.check_no_leaks([])
    eng.recurrent.check_no_leaks([])


def prompts_of(lens, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, VOCAB, int(n)) for n in lens]


@pytest.fixture(scope="module")
def pair(model_dir):
    cu = cuda_engine(model_dir, levers={"prefix_caching": False})
    return cu, numpy_twin(cu)


def test_backend_and_pool_shapes(pair):
    cu, _ = pair
    be = cu.backend
    assert be.family.name == "hybrid" and be.states is not None and list(be.caches) == ["kv", "state"]
    c = be.config
    assert be.kv.k.shape[0] == c.num_kv_layers == 2
    assert be.cos.shape[1] == c.rotary_dim // 2 == 16
    assert be.weights["layers.0.lin_conv"].dtype == np.float32
    assert be.states.num_slots == 16 and be.states.bytes_per_state == c.state_bytes_per_slot(4)


@pytest.mark.parametrize("n", [1, 7, 63, 64, 100, 130])
def test_prefill_logits_match_numpy(pair, n):
    """Recurrent (< 64 tokens) and chunked (>= 64) GDN forms, attention with partial RoPE and gate."""
    cu, cpu = pair
    ids = np.random.default_rng(n).integers(0, VOCAB, n)
    a, b = logits_of(cu.backend, ids), logits_of(cpu.backend, ids)
    assert np.isfinite(a).all()
    assert rel_err(a, b) < LOGIT_REL, rel_err(a, b)


def test_greedy_mixed_batch_matches_numpy(pair):
    """A mixed batch (prefills of 5..140 tokens joining decodes), 32 greedy tokens each: decode
    steps replay CUDA graphs with the slots in device metadata."""
    cu, cpu = pair
    prompts = prompts_of((5, 40, 17, 90, 1, 140, 64, 33))
    a = cu.generate(prompts, greedy(32), use_tqdm=False)
    assert len(cu.backend.graphs) > 0, "decode steps did not run as CUDA graphs"
    b = cpu.generate(prompts, greedy(32), use_tqdm=False)
    assert all(len(o.token_ids) == 32 for o in a)
    assert assert_same_up_to_ties(prompts, a, b, cpu.backend) <= len(prompts) // 2   # each one proven a near-tie
    assert_clean(cu)
    assert_clean(cpu)


def test_chunked_prefill_equals_one_shot(model_dir, pair):
    cu, _ = pair
    ids = prompts_of((150,), seed=5)[0]
    one = logits_of(cu.backend, ids, slot=0)
    be, bs = cu.backend, cu.backend.block_size
    blocks = np.arange(-(-len(ids) // bs), dtype=np.int32) + 950
    for a in range(0, len(ids), 16):      # 16-token chunks continue slot 1
        seg = Segment(np.asarray(ids[a:a + 16], np.int32), a, blocks, "last", state_slot=1)
        last = be.forward(build_batch([seg], bs))[-1]
    assert rel_err(last, one) < 1e-2, rel_err(last, one)     # chunked vs recurrent GDN, flash vs decode attention
    chunked = cuda_engine(model_dir, levers={"prefix_caching": False}, scheduler={"max_num_batched_tokens": 16})
    prompts = prompts_of((70, 9, 45), seed=6)
    outs = chunked.generate(prompts, greedy(16), use_tqdm=False)
    assert_same_up_to_ties(prompts, outs, cu.generate(prompts, greedy(16), use_tqdm=False), cu.backend)
    assert_clean(chunked)


@pytest.mark.parametrize("method", ["ngram", "oracle"])
def test_speculative_equals_plain_with_rollback(model_dir, pair, method):
    """Verify blocks record their GDN inputs; partial acceptance restores the checkpoint (copied on
    the second stream) and replays the accepted rows. Same tokens as plain greedy decoding."""
    cu, _ = pair
    prompts = prompts_of((5, 19, 33, 12, 8), seed=1)
    prompts[3] = np.array([5, 6, 7, 8] * 3)        # repetitive: the n-gram drafter has something to say
    ref = cu.generate(prompts, greedy(24), use_tqdm=False)
    eng = cuda_engine(model_dir, levers={"prefix_caching": False}, spec={"method": "ngram", "num_drafts": 4})
    eng.speculator.gate = AlwaysGate(4)
    if method == "oracle":
        truth = {tuple(int(t) for t in p): [int(t) for t in o.token_ids] for p, o in zip(prompts, ref)}
        eng.speculator.drafter = NoisyOracle(truth, 0.25, VOCAB)
    outs = eng.generate(prompts, greedy(24), use_tqdm=False)
    assert_same_up_to_ties(prompts, outs, ref, cu.backend)
    st = eng.speculator.stats()
    assert st["verifies"] > 0 and st["proposed"] > st["accepted"]          # rollbacks happened
    if method == "oracle":
        assert st["accepted"] > st["verifies"]
    assert len(eng.backend.graphs) > 0
    assert_clean(eng)


def test_rollback_state_equals_a_run_of_the_accepted_tokens(model_dir):
    """Device state after checkpoint + 5-token verify block + rollback to 3 tokens == the state of
    a slot that ran the same 3 tokens (to GEMM rounding: the two runs' projections have 5 and 3 rows)."""
    eng = cuda_engine(model_dir, levers={"prefix_caching": False}, spec={"method": "ngram", "num_drafts": 4})
    be, st, bs = eng.backend, eng.backend.states, eng.backend.block_size
    ids = prompts_of((20,), seed=9)[0]
    block = np.array([3, 9, 27, 81, 243], np.int32)
    tables = [np.arange(4, dtype=np.int32) + 10 * (i + 1) for i in range(2)]
    for slot in (0, 1):
        be.forward(build_batch([Segment(ids.astype(np.int32), 0, tables[slot], "last", state_slot=slot)], bs))
    ckpt = st.num_slots
    st.copy_state(0, ckpt)                                   # async, on the copy stream
    be.forward(build_batch([Segment(block, 20, tables[0], "all", state_slot=0, state_checkpoint=ckpt)], bs))
    st.copy_state(ckpt, 0)
    st.replay(0, ckpt, 3)
    be.forward(build_batch([Segment(block[:3], 20, tables[1], "all", state_slot=1)], bs))
    be.stream.synchronize()
    assert st.tokens[0] == st.tokens[1] == 23
    for a in (st.conv, st.ssm):
        host = a.copy_to_host()
        np.testing.assert_allclose(host[0], host[1], rtol=1e-3, atol=1e-4)
        assert not np.array_equal(host[0], host[ckpt])


def first_forward_tokens(eng: Engine, prompt, n=8):
    eng.step_log = []
    out = eng.generate([prompt], greedy(n), use_tqdm=False)[0]
    first = eng.step_log[0][0]
    eng.step_log = None
    return first, out


@pytest.mark.parametrize("chunk", [2048, 16])
def test_prefix_resumes_from_snapshot(model_dir, pair, chunk):
    """chunk=2048: one-shot prefill, the state staged at 64 tokens by a split pass (eager);
    chunk=16: chunked prefill, a snapshot at each chunk end."""
    cu, _ = pair
    rng = np.random.default_rng(3)
    a = rng.integers(2, VOCAB, 90)
    b = np.concatenate([a[:70], rng.integers(2, VOCAB, 15)])
    eng = cuda_engine(model_dir, scheduler={"max_num_batched_tokens": chunk})
    eng.generate([a], greedy(8), use_tqdm=False)
    hits = eng.blocks.cache_hits
    tokens, out = first_forward_tokens(eng, b)
    resumed = eng.blocks.cache_hits - hits
    assert resumed == 64          # 70 shared tokens: the snapshot at 64
    assert tokens == (len(b) - resumed if chunk == 2048 else 16)
    cold = cu.generate([b], greedy(8), use_tqdm=False)[0]
    assert_same_up_to_ties([b], [out], [cold], cu.backend)
    assert eng.recurrent.snapshots.hits >= 1
    assert_clean(eng)
