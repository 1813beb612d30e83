"""Speculative decoding and prefix caching on a hybrid (Gated DeltaNet + attention) model, NumPy
backend, float64: greedy speculative output equals greedy plain output with rollback of the
recurrent state (ngram, a dense draft model, a noisy oracle), and a prompt that shares a prefix
resumes from a recurrent-state snapshot to the same tokens (docs/hybrid.md)."""
import json

import numpy as np
import pytest

from metrale import Engine, SamplingParams
from spec_helpers import AlwaysGate, NoisyOracle
from test_gdn import qwen3_next_cfg, write_model

VOCAB = 61


def write_tokenizer(path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "w1"}))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hybrid_spec") / "m"
    write_model(path, qwen3_next_cfg())
    write_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def dense_draft_dir(tmp_path_factory):
    """A dense draft model of the same vocabulary: metrale_hybrid with attention layers only."""
    path = tmp_path_factory.mktemp("hybrid_spec") / "draft"
    write_model(path, qwen3_next_cfg(model_type="metrale_hybrid", num_hidden_layers=1,
                                     layer_types=["full_attention"]), seed=7)
    write_tokenizer(path)
    return path


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def engine(model_dir, **kw) -> Engine:
    levers = {"numpy_dtype": "float64", **kw.pop("levers", {})}
    return Engine(model=str(model_dir), device="cpu", cache={"block_size": 4, **kw.pop("cache", {})},
                  levers=levers, **kw)


PROMPT_LENS = (5, 19, 33, 12, 8)


@pytest.fixture(scope="module")
def plain(model_dir):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, VOCAB, int(n)) for n in PROMPT_LENS]
    prompts[3] = np.array([5, 6, 7, 8] * 3)       # repetitive: the n-gram drafter has something to say
    outs = engine(model_dir, levers={"prefix_caching": False}).generate(prompts, greedy(20), use_tqdm=False)
    return prompts, outs


def assert_clean(eng: Engine) -> None:
    eng.blocks.check_no_leaks([])
    eng.recurrent.check_no_leaks([])


@pytest.mark.parametrize("method", ["ngram", "draft", "oracle"])
def test_greedy_speculative_equals_plain(model_dir, dense_draft_dir, plain, method):
    prompts, ref = plain
    spec = {"method": "draft", "draft_model": str(dense_draft_dir)} if method == "draft" else {"method": "ngram"}
    eng = engine(model_dir, spec={**spec, "num_drafts": 4}, scheduler={"max_num_batched_tokens": 16})
    eng.speculator.gate = AlwaysGate(4)
    if method == "oracle":
        truth = {tuple(int(t) for t in p): [int(t) for t in o.token_ids] for p, o in zip(prompts, ref)}
        eng.speculator.drafter = NoisyOracle(truth, 0.25, VOCAB)
    outs = eng.generate(prompts, greedy(20), use_tqdm=False)
    for a, b in zip(ref, outs):
        np.testing.assert_array_equal(a.token_ids, b.token_ids)
    st = eng.speculator.stats()
    assert st["verifies"] > 0 and st["proposed"] > st["accepted"]     # rollbacks happened
    if method == "oracle":
        assert st["accepted"] > st["verifies"]                         # and long acceptances too
    assert_clean(eng)


def test_seeded_sampled_speculation_equals_plain(model_dir, plain):
    """Sampled rows: a seeded request gives plain decoding's tokens (rejections roll the state back)."""
    prompts, _ = plain
    params = SamplingParams(max_tokens=14, temperature=0.9, top_k=8, seed=11, ignore_eos=True)
    ref = engine(model_dir).generate(prompts, params, use_tqdm=False)
    eng = engine(model_dir, spec={"method": "ngram", "num_drafts": 3})
    eng.speculator.gate = AlwaysGate(3)
    truth = {tuple(int(t) for t in p): [int(t) for t in o.token_ids] for p, o in zip(prompts, ref)}
    eng.speculator.drafter = NoisyOracle(truth, 0.3, VOCAB, seed=2)
    for a, b in zip(ref, eng.generate(prompts, params, use_tqdm=False)):
        np.testing.assert_array_equal(a.token_ids, b.token_ids)
    st = eng.speculator.stats()
    assert st["proposed"] > st["accepted"] > 0
    assert_clean(eng)


def test_speculation_under_preemption(model_dir, plain):
    prompts, ref = plain
    eng = engine(model_dir, spec={"method": "ngram", "num_drafts": 3}, cache={"num_blocks": 24},
                 scheduler={"max_num_seqs": 5})
    eng.speculator.gate = AlwaysGate(3)
    truth = {tuple(int(t) for t in p): [int(t) for t in o.token_ids] for p, o in zip(prompts, ref)}
    eng.speculator.drafter = NoisyOracle(truth, 0.3, VOCAB, seed=1)
    outs = eng.generate(prompts, greedy(20), use_tqdm=False)
    assert eng.scheduler.num_preemptions > 0
    for a, b in zip(ref, outs):
        np.testing.assert_array_equal(a.token_ids, b.token_ids)
    assert_clean(eng)


def first_forward_tokens(eng: Engine, prompt, n=8):
    eng.step_log = []
    out = eng.generate([prompt], greedy(n), use_tqdm=False)[0]
    first = eng.step_log[0][0]
    eng.step_log = None
    return first, out


@pytest.mark.parametrize("chunk", [2048, 16])
def test_prefix_resumes_from_snapshot(model_dir, chunk):
    """chunk=2048: one-shot prefill, snapshots staged every 64 tokens inside the segment;
    chunk=16: chunked prefill, a snapshot at each chunk end (a block boundary)."""
    rng = np.random.default_rng(3)
    a = rng.integers(2, VOCAB, 90)
    b = np.concatenate([a[:70], rng.integers(2, VOCAB, 15)])
    eng = engine(model_dir, scheduler={"max_num_batched_tokens": chunk})
    cold = engine(model_dir, levers={"prefix_caching": False})
    eng.generate([a], greedy(8), use_tqdm=False)
    hits = eng.blocks.cache_hits
    tokens, out = first_forward_tokens(eng, b)
    resumed = eng.blocks.cache_hits - hits
    assert resumed == 64          # 70 shared tokens: the snapshot at 64 (68 tokens of KV match)
    assert tokens == (len(b) - resumed if chunk == 2048 else 16)
    np.testing.assert_array_equal(out.token_ids, cold.generate([b], greedy(8), use_tqdm=False)[0].token_ids)
    assert eng.recurrent.snapshots.hits >= 1
    assert_clean(eng)


def test_snapshot_lru_is_bounded_and_prompts_stay_exact(model_dir):
    rng = np.random.default_rng(4)
    base = rng.integers(2, VOCAB, 40)
    prompts = [np.concatenate([base, rng.integers(2, VOCAB, int(n))]) for n in (30, 3, 45, 9)]
    eng = engine(model_dir, levers={"state_snapshots": 3}, scheduler={"max_num_batched_tokens": 8})
    cold = engine(model_dir, levers={"prefix_caching": False})
    for p in prompts:
        out = eng.generate([p], greedy(6), use_tqdm=False)[0]
        np.testing.assert_array_equal(out.token_ids, cold.generate([p], greedy(6), use_tqdm=False)[0].token_ids)
    assert len(eng.recurrent.snapshots) == 3 and eng.recurrent.snapshots.evicted > 0 and eng.blocks.cache_hits > 0
    assert_clean(eng)


def test_spec_with_prefix_caching_and_n_gt_1(model_dir):
    """Siblings of an n > 1 request resume from the first one's snapshots, and speculate."""
    rng = np.random.default_rng(5)
    p = rng.integers(2, VOCAB, 37)
    eng = engine(model_dir, spec={"method": "ngram", "num_drafts": 3}, scheduler={"max_num_batched_tokens": 8})
    eng.speculator.gate = AlwaysGate(3)
    out = eng.generate([p], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, n=3), use_tqdm=False)[0]
    cold = engine(model_dir, levers={"prefix_caching": False}).generate([p], greedy(10), use_tqdm=False)[0]
    for o in out.outputs:
        np.testing.assert_array_equal(o.token_ids, cold.token_ids)
    assert eng.blocks.cache_hits >= 2 * 32
    assert_clean(eng)


@pytest.mark.parametrize("spec, match", [({"method": "self"}, "layer-prefix"),
                                         ({"method": "mtp"}, "MTP heads")])
def test_unsupported_drafters_are_refused(model_dir, spec, match):
    with pytest.raises(ValueError, match=match):
        engine(model_dir, spec=spec)


def test_hybrid_draft_model_is_refused(model_dir):
    with pytest.raises(ValueError, match="hybrid .*draft model"):
        engine(model_dir, spec={"method": "draft", "draft_model": str(model_dir)})
