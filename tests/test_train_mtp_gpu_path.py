"""tools/train_mtp.py's GPU path on the CPU: collect-gpu's teacher-forced hidden rows (against a NumPy
forward of each whole sequence), its chunking over forward budgets and the KV pool, and (with torch)
the teacher's top-k and a short training run on a collect-gpu corpus."""
from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [("Write a haiku about snow.", True), ("The moon is", False), ("def add(a, b):\n", False)]


def _load_tool():
    spec = importlib.util.spec_from_file_location("train_mtp", ROOT / "tools" / "train_mtp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tm = _load_tool()


def _args(**kw) -> argparse.Namespace:
    base = dict(model="smollm2-135m", device="cpu", prompts=None, samples=1, max_tokens=6, temperature=0.7, seed=0)
    return argparse.Namespace(**{**base, **kw})


@pytest.fixture(scope="module")
def engine():
    """Its own engine (collect-gpu overwrites the KV blocks behind its block manager), on the NumPy
    oracle's float32 arithmetic so the reference below computes the same numbers."""
    from metrale import Engine
    return Engine(model="smollm2-135m", device="cpu", levers={"cpu_kernels": "numpy"})


@pytest.fixture(scope="module")
def reference(engine):
    """Hidden rows before the final norm of a whole stream, one segment with a row per token."""
    from metrale.runtime.batch import Segment, build_batch
    from metrale.runtime.numpy_backend import NumpyBackend
    be = engine.backend
    ref = NumpyBackend(be.config, be.weights.items(), num_blocks=64, block_size=16)

    def rows(stream: np.ndarray) -> np.ndarray:
        table = np.arange(-(-len(stream) // 16), dtype=np.int32)
        _, hidden = ref.forward(build_batch([Segment(stream, 0, table, "all")], 16), return_hidden=True)
        return np.asarray(hidden, np.float32)
    return rows


@pytest.fixture(scope="module")
def collected(engine, tmp_path_factory):
    """collect-gpu on three short prompts; the outputs generate() returned, seen through a spy."""
    seen = []
    generate = type(engine).generate

    def spy(self, *a, **kw):
        outs = generate(self, *a, **kw)
        seen.append(outs)
        return outs
    corpus = tmp_path_factory.mktemp("mtp") / "corpus.npz"
    mp = pytest.MonkeyPatch()
    mp.setattr(type(engine), "generate", spy)
    try:
        figures = tm.collect_gpu(_args(corpus=str(corpus)), prompts=PROMPTS, engine=engine)
    finally:
        mp.undo()
    assert len(seen) == 1, "one batched generate call"
    return figures, dict(np.load(corpus)), seen[0]


def test_collect_gpu_corpus_matches_the_generated_outputs(engine, collected):
    figures, z, outs = collected
    kept = [o for o in outs if len(o.token_ids) >= 4]
    assert len(kept) >= 2
    ids = [engine.encode_prompt(p, chat=chat) for p, chat in PROMPTS]
    assert [list(o.prompt_token_ids) for o in outs] == ids                 # samples=1: one request a prompt
    np.testing.assert_array_equal(z["lengths"], [len(o.token_ids) for o in kept])
    np.testing.assert_array_equal(z["tokens"], np.concatenate([o.token_ids for o in kept]))
    np.testing.assert_array_equal(z["prompt_lens"], [len(o.prompt_token_ids) for o in kept])
    np.testing.assert_array_equal(z["prompt_tokens"], np.concatenate([o.prompt_token_ids for o in kept]))
    assert z["hidden"].dtype == np.float16 and z["hidden"].shape == (z["lengths"].sum(), engine.model_config.hidden_size)
    assert "top_i" not in z and "top_v" not in z
    w, last = engine.backend.weights, engine.model_config.num_layers - 1
    np.testing.assert_array_equal(z["embed"], w["embed"])
    np.testing.assert_array_equal(z["final_norm"], w["final_norm"])
    for n in tm.LAST_LAYER:
        np.testing.assert_array_equal(z[f"last.{n}"], w[f"layers.{last}.{n}"])
    cfg = json.loads(str(z["config"]))
    assert cfg["hidden_size"] == engine.model_config.hidden_size and cfg["num_heads"] == engine.model_config.num_heads
    assert cfg["sequences"] == figures["sequences"] == len(kept) and cfg["rows"] == figures["rows"] == z["lengths"].sum()
    assert cfg["prompts"] == len(PROMPTS) and cfg["samples"] == 1 and cfg["max_tokens"] == 6


def test_collect_gpu_hidden_rows_are_the_teacher_forced_rows(collected, reference):
    _, z, _ = collected
    at = np.concatenate([[0], np.cumsum(z["lengths"])])
    p_at = np.concatenate([[0], np.cumsum(z["prompt_lens"])])
    for s, (n, plen) in enumerate(zip(z["lengths"], z["prompt_lens"])):
        out = z["tokens"][at[s]:at[s + 1]]
        stream = np.concatenate([z["prompt_tokens"][p_at[s]:p_at[s + 1]], out[:-1]]).astype(np.int32)
        want = reference(stream)[plen - 1:]                                  # rows P-1 .. P+n-2
        assert want.shape[0] == n
        np.testing.assert_allclose(z["hidden"][at[s]:at[s + 1]].astype(np.float32), want, rtol=2e-2, atol=2e-2)


def test_forced_hidden_in_small_chunks_and_pool_groups(engine, collected, reference):
    """Continuations split over several forwards (3 rows, 5 tokens a forward), prompts in chunks, and
    a pool of 3 blocks that holds only some sequences at once: the same rows."""
    _, z, _ = collected
    at = np.concatenate([[0], np.cumsum(z["lengths"])])
    p_at = np.concatenate([[0], np.cumsum(z["prompt_lens"])])
    streams = [np.concatenate([z["prompt_tokens"][p_at[s]:p_at[s + 1]], z["tokens"][at[s]:at[s + 1] - 1]]).astype(np.int32)
               for s in range(len(z["lengths"]))]
    plens = [int(p) for p in z["prompt_lens"]]
    assert len(list(tm.pool_groups([len(s) for s in streams], 16, 3))) >= 2     # not all at once
    got = tm.forced_hidden(engine.backend, streams, plens, max_tokens=5, max_rows=3, num_blocks=3)
    for stream, plen, rows in zip(streams, plens, got):
        np.testing.assert_allclose(rows.astype(np.float32), reference(stream)[plen - 1:], rtol=2e-2, atol=2e-2)


def test_pieces_cover_each_stream_once_within_budgets():
    for plen, length, max_tokens, max_rows in [(7, 12, 5, 3), (30, 31, 2048, 256), (3, 300, 2048, 256), (16, 40, 16, 8)]:
        pieces = tm.stream_pieces(0, plen, length, max_tokens, max_rows)
        assert [p.start for p in pieces] == [0] + [p.end for p in pieces[:-1]] and pieces[-1].end == length
        assert all(p.end - p.start <= max_tokens and p.rows <= max_rows for p in pieces)
        assert sum(p.rows for p in pieces if p.keep) == length - plen + 1        # rows P-1 .. length-1
        assert [p.end for p in pieces if p.mode == "last" and p.keep] == [plen]
        for batch in tm.pack(pieces * 3, max_tokens, max_rows):
            assert sum(p.end - p.start for p in batch) <= max_tokens and sum(p.rows for p in batch) <= max_rows
    assert list(tm.pool_groups([16, 17, 40, 1], 16, 4)) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError):
        list(tm.pool_groups([100], 16, 4))


# ---------------------------------------------------------------------------- torch
def test_teacher_topk_is_the_sorted_topk_of_the_final_logits():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    h, w, e = rng.normal(size=(50, 16)), rng.uniform(0.5, 1.5, 16), rng.normal(size=(100, 16))
    ids, vals = tm.teacher_topk(*(torch.from_numpy(x.astype(np.float32)) for x in (h, w, e)), 1e-5, chunk=16)
    logits = (h / np.sqrt((h * h).mean(-1, keepdims=True) + 1e-5) * w) @ e.T
    want = np.argsort(-logits, axis=-1)[:, :tm.TOPK]
    assert ids.dtype == torch.int64 and vals.dtype == torch.float32
    np.testing.assert_array_equal(ids.numpy(), want)
    np.testing.assert_allclose(vals.numpy(), np.take_along_axis(logits, want, -1), rtol=1e-4, atol=1e-4)


def _tiny_corpus(path: Path, sequences: int = 12) -> None:
    """A collect-gpu corpus of a random model (D 16, 2 heads, 1 KV head, 64 tokens): no top-k."""
    rng = np.random.default_rng(1)
    D, H, KV, hd, F, V = 16, 2, 1, 8, 32, 64
    lengths = rng.integers(5, 12, sequences).astype(np.int32)
    f32 = lambda *shape, s=0.3: (rng.normal(size=shape) * s).astype(np.float32)   # noqa: E731
    cfg = {"hidden_size": D, "vocab_size": V, "num_heads": H, "num_kv_heads": KV, "head_dim": hd,
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "rope_interleaved": False, "name": "tiny",
           "collect_seconds": 1.0, "prompts": 3, "samples": 4, "sequences": sequences, "rows": int(lengths.sum()),
           "temperature": 0.7, "max_tokens": 12, "device": "cpu"}
    np.savez(path, tokens=rng.integers(0, V, lengths.sum()).astype(np.int32), lengths=lengths,
             prompt_lens=rng.integers(3, 9, sequences).astype(np.int32), prompt_tokens=np.zeros(1, np.int32),
             hidden=f32(int(lengths.sum()), D, s=1.0).astype(np.float16), embed=f32(V, D), final_norm=np.ones(D, np.float32),
             **{"last.attn_norm": np.ones(D, np.float32), "last.qkv": f32((H + 2 * KV) * hd, D), "last.o": f32(D, H * hd),
                "last.mlp_norm": np.ones(D, np.float32), "last.gate_up": f32(2 * F, D), "last.down": f32(D, F)},
             config=json.dumps(cfg))


def test_train_on_a_collect_gpu_corpus(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    from safetensors.numpy import load_file
    _tiny_corpus(tmp_path / "corpus.npz")
    args = argparse.Namespace(corpus=str(tmp_path / "corpus.npz"), out=str(tmp_path / "head.safetensors"),
                              log=str(tmp_path / "log.json"), device="cpu", threads=1, seed=0, batch=4, lr=1e-3,
                              chain_weight=0.5, train_minutes=0.002, eval_every=2, draft_vocab=0)
    tm.train(args)
    head = load_file(args.out)
    assert head["eh_proj"].shape == (16, 32) and head["qkv"].dtype == np.float16
    assert "d2t" not in head                                  # --draft-vocab 0: none
    log = json.loads(Path(args.log).read_text())
    assert log["steps"] >= 4 and log["device"] == "cpu"
    assert set(log["eval_by_draft"]["after"]) == {"draft1", "draft2"}
    assert log["eval_by_draft"]["before"]["draft1"]["top1"] == log["eval_before"][1]
    assert log["collect"]["sequences"] == 12 and log["collect"]["samples"] == 4
