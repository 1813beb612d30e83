"""The MTP head's draft vocabulary (EAGLE-3's d2t): tools/train_mtp.py's d2t (the most frequent
corpus tokens, sorted, unique, in range; written into head files with their other tensors kept);
the head's drafts over d2t (the full-vocabulary argmax whenever it lies in d2t, always a d2t id, the
chain fed target ids); d2t = every id changes nothing; greedy MTP on SmolLM2 with a d2t head still
equals plain decoding."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest

from fake_model import reference_continuation
from metrale import Engine, SamplingParams
from metrale.spec.mtp import DEFAULT_HEADS, MtpDrafter, MtpHead, load_head
from test_mtp import TINY, CheckedMtpDrafter, HiddenFakeBackend, fake_hidden, reference_head, tiny_weights
from test_train_mtp_gpu_path import _tiny_corpus, tm

safetensors = pytest.importorskip("safetensors")


def head_with(w: dict, num_blocks: int = 32, d2t=None) -> MtpHead:
    return MtpHead(TINY, w, num_blocks=num_blocks, block_size=4, dtype=np.float64, d2t=d2t)


# ---------------------------------------------------------------------------- the tool
def check_d2t(d2t: np.ndarray, vocab_size: int) -> None:
    assert d2t.dtype == np.int32 and d2t.ndim == 1 and len(d2t) > 0
    assert np.all(np.diff(d2t) > 0), "sorted, unique"
    assert d2t[0] >= 0 and d2t[-1] < vocab_size


def test_draft_vocab_takes_the_most_frequent_ids_not_the_first():
    counts = np.zeros(20, np.int64)
    counts[[17, 3, 12, 9]] = [50, 40, 40, 5]             # 3 and 12 tie: both in before 9
    d2t = tm.draft_vocab(counts, 3)
    check_d2t(d2t, 20)
    np.testing.assert_array_equal(d2t, [3, 12, 17])
    np.testing.assert_array_equal(tm.draft_vocab(counts, 6), [0, 1, 3, 9, 12, 17])   # then unseen ids, lowest first
    np.testing.assert_array_equal(tm.draft_vocab(counts, 99), np.arange(20))
    assert tm.coverage(d2t, [17, 17, 3, 9]) == 0.75
    secondary = np.zeros(20, np.int64)
    secondary[[12, 15, 19]] = [1, 7, 3]                  # among equal counts, the top-k mentions first
    np.testing.assert_array_equal(tm.draft_vocab(counts, 2, secondary), [12, 17])
    np.testing.assert_array_equal(tm.draft_vocab(counts, 7, secondary), [0, 3, 9, 12, 15, 17, 19])


def test_token_counts_of_a_corpus():
    z = {"tokens": np.array([5, 5, 2]), "prompt_tokens": np.array([1, 5]),
         "top_i": np.array([[2, 7, 9], [2, 9, 1], [4, 0, 5]])}
    counts, secondary = tm.token_counts(z, 10)
    np.testing.assert_array_equal(counts, [0, 1, 3, 0, 1, 3, 0, 0, 0, 0])      # tokens + prompts + top-1
    np.testing.assert_array_equal(secondary, [1, 1, 2, 0, 1, 1, 0, 1, 0, 2])
    counts, secondary = tm.token_counts({"tokens": z["tokens"]}, 10)
    np.testing.assert_array_equal(counts, [0, 0, 1, 0, 0, 2, 0, 0, 0, 0])
    assert not secondary.any()


def _tiny_head_file(path: Path, V: int = 64, D: int = 16) -> dict:
    from safetensors.numpy import save_file
    rng = np.random.default_rng(5)
    tensors = {n: rng.normal(size=shape).astype(np.float16) for n, shape in
               {"eh_proj": (D, 2 * D), "enorm": (D,), "qkv": (48, D), "down": (D, 32)}.items()}
    save_file(tensors, str(path), metadata={"format": "metrale-mtp", "vocab_size": str(V), "trained": "{}"})
    return tensors


def test_d2t_phase_adds_a_draft_vocabulary_and_keeps_the_rest(tmp_path):
    from safetensors import safe_open
    from safetensors.numpy import load_file
    _tiny_corpus(tmp_path / "corpus.npz")
    z = np.load(tmp_path / "corpus.npz")
    head, out = tmp_path / "head.safetensors", tmp_path / "head_d2t.safetensors"
    before = _tiny_head_file(head)
    args = argparse.Namespace(head=str(head), out=str(out), corpus=str(tmp_path / "corpus.npz"), draft_vocab=24)
    tm.add_d2t(args)
    got = load_file(str(out))
    check_d2t(got["d2t"], 64)
    assert len(got["d2t"]) == 24
    counts = np.bincount(z["tokens"], minlength=64) + np.bincount(z["prompt_tokens"], minlength=64)
    # every id left out is at most as frequent as every id kept
    assert counts[np.setdiff1d(np.arange(64), got["d2t"])].max() <= counts[got["d2t"]].min()
    for n, a in before.items():
        assert got[n].dtype == a.dtype and got[n].tobytes() == a.tobytes()
    with safe_open(str(out), framework="numpy") as f:
        meta = f.metadata()
    assert meta["format"] == "metrale-mtp" and meta["trained"] == "{}"
    figures = json.loads(meta["draft_vocab"])
    assert figures["size"] == 24 and figures["coverage"] == round(tm.coverage(got["d2t"], z["tokens"]), 4)
    # again, in place with --draft-vocab 0: removed
    tm.add_d2t(argparse.Namespace(head=str(out), out=None, corpus=str(tmp_path / "corpus.npz"), draft_vocab=0))
    assert set(load_file(str(out))) == set(before)


def test_train_writes_the_draft_vocabulary(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.numpy import load_file
    _tiny_corpus(tmp_path / "corpus.npz")
    z = np.load(tmp_path / "corpus.npz")
    args = argparse.Namespace(corpus=str(tmp_path / "corpus.npz"), out=str(tmp_path / "head.safetensors"),
                              log=str(tmp_path / "log.json"), device="cpu", threads=1, seed=0, batch=4, lr=1e-3,
                              chain_weight=0.5, train_minutes=0.002, eval_every=2, draft_vocab=16)
    tm.train(args)
    d2t = load_file(args.out)["d2t"]
    check_d2t(d2t, 64)
    teacher, _ = tm.teacher_topk(*(torch.from_numpy(z[n].astype(np.float32)) for n in ("hidden", "final_norm", "embed")),
                                 1e-5)
    np.testing.assert_array_equal(d2t, tm.draft_vocab(*tm.token_counts(z, 64, teacher.numpy()), 16))
    assert json.loads(Path(args.log).read_text())["draft_vocab"]["size"] == 16


def test_bundled_head_draft_vocabulary_if_any():
    from safetensors.numpy import load_file
    head = load_file(str(DEFAULT_HEADS["smollm2-135m-instruct"]))
    if "d2t" not in head:
        pytest.skip("the bundled head has no d2t")
    check_d2t(head["d2t"], 49152)
    assert len(head["d2t"]) == tm.DRAFT_VOCAB


# ---------------------------------------------------------------------------- the head
def test_head_rejects_a_bad_d2t():
    w = tiny_weights(TINY)
    for bad in (np.array([3, 3, 5]), np.array([5, 3]), np.array([0, 97]), np.array([-1, 4]), np.array([1.0, 2.0])):
        with pytest.raises(ValueError, match="d2t"):
            head_with(w, d2t=bad)


def test_head_logits_over_d2t_are_the_full_logits_rows():
    from metrale.runtime.batch import Segment, build_batch
    w = tiny_weights(TINY)
    d2t = np.sort(np.random.default_rng(2).choice(97, 40, replace=False)).astype(np.int32)
    full, sub, every = head_with(w), head_with(w, d2t=d2t), head_with(w, d2t=np.arange(97))
    r = np.random.default_rng(3)
    toks, hid = r.integers(0, 97, 9).astype(np.int32), r.normal(size=(9, 8)) * 3
    batch = build_batch([Segment(toks, 0, np.array([2, 5, 7], np.int32), "all")], 4)
    lf, rf = full.forward(batch, hid, np.array([0]))
    ls, rs = sub.forward(batch, hid, np.array([0]))
    le, re_ = every.forward(batch, hid, np.array([0]))
    assert ls.shape == (9, 40) and sub.draft_vocab_size == 40 and full.draft_vocab_size == 97
    np.testing.assert_allclose(ls, lf[:, d2t], rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(rs, rf)
    np.testing.assert_array_equal(le, lf)                   # d2t = every id: the same numbers
    np.testing.assert_array_equal(sub.target_ids(np.argmax(ls, -1)), d2t[np.argmax(lf[:, d2t], -1)])


class RecordingDrafter(CheckedMtpDrafter):
    """Checks each draft against the head run from scratch with the full vocabulary: the argmax
    over d2t (the full argmax when it lies in d2t), the chain fed the target ids drafted."""

    def __init__(self, head, w, d2t=None):
        super().__init__(head, w)
        self.d2t, self.drafts, self.inside = d2t, [], [0, 0]

    def propose(self, seqs, ks):
        drafts = MtpDrafter.propose(self, seqs, ks)
        for s, d in zip(seqs, drafts):
            if not d.tokens:
                continue
            self.drafts.append((tuple(s.prompt_token_ids), s.num_tokens, list(d.tokens)))
            toks, lo, n = s.token_ids, len(s.prompt_token_ids) - 1, s.num_tokens - 1
            hid = [fake_hidden(p, toks[p]) for p in range(lo, n)]
            feed = list(toks[lo + 1:n + 1])
            for tok in d.tokens:
                logits, rows = reference_head(self.w, TINY, np.array(hid), np.array(feed), np.arange(lo, lo + len(feed)))
                full = int(np.argmax(logits[-1]))
                if self.d2t is None:
                    assert tok == full
                else:
                    assert tok in self.d2t
                    assert tok == int(self.d2t[np.argmax(logits[-1][self.d2t])])
                    self.inside[full in self.d2t] += 1
                    if full in self.d2t:
                        assert tok == full
                hid.append(rows[-1])
                feed.append(tok)
            self.checked += 1
        return drafts


def _run_fake(d2t, rng_seed=0):
    from fake_model import fake_engine
    eng = fake_engine(num_blocks=256, block_size=4, **{"spec.method": "ngram", "spec.num_drafts": 3,
                                                       "levers.spec_verify_cost": 0.0})
    w = tiny_weights(TINY, seed=3)
    drafter = RecordingDrafter(head_with(w, num_blocks=256, d2t=d2t), w, d2t)
    eng.speculator.drafter = drafter
    eng.speculator.gate.drafts_for = lambda request_id, left=None: 3
    eng.backend = drafter.tap(HiddenFakeBackend(256, 4))
    rng = np.random.default_rng(rng_seed)
    prompts = [[int(t) for t in rng.integers(1, 96, int(n))] for n in (3, 11, 6)]
    outs = eng.generate([np.array(p) for p in prompts], SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert list(o.token_ids) == reference_continuation(p, 14)
    eng.blocks.check_no_leaks([])
    return drafter


def test_drafts_over_d2t_in_the_engine():
    d2t = np.arange(0, 97, 2, dtype=np.int32)                # the even ids
    d = _run_fake(d2t)
    assert d.checked > 10
    assert d.inside[True] > 0 and d.inside[False] > 0       # both cases met: the full argmax in and out of d2t


def test_d2t_of_every_id_drafts_what_no_d2t_drafts():
    plain, every = _run_fake(None), _run_fake(np.arange(97, dtype=np.int32))
    assert plain.checked > 10 and every.drafts == plain.drafts


# ---------------------------------------------------------------------------- SmolLM2
PROMPTS = ["The capital of France is", "def add(a, b):\n", "Once upon a time"]


@pytest.fixture(scope="module")
def d2t_head(tmp_path_factory):
    """The bundled head with a d2t of every third id (a subset that leaves out some of the greedy
    output's tokens)."""
    from safetensors.numpy import load_file, save_file
    from safetensors import safe_open
    src = DEFAULT_HEADS["smollm2-135m-instruct"]
    with safe_open(str(src), framework="numpy") as f:
        meta = f.metadata()
    tensors = {n: a for n, a in load_file(str(src)).items() if n != "d2t"}
    path = tmp_path_factory.mktemp("mtp") / "head.safetensors"
    d2t = np.arange(0, 49152, 3, dtype=np.int32)
    save_file({**tensors, "d2t": d2t}, str(path), metadata=meta)
    return path, d2t


def test_load_head_reads_d2t_and_the_lever_ignores_it(smollm2, d2t_head):
    path, d2t = d2t_head
    be = smollm2.backend
    head = load_head(path, smollm2.model_config, be.weights, num_blocks=4, block_size=16)
    np.testing.assert_array_equal(head.d2t, d2t)
    assert head.draft_lm_head.shape == (len(d2t), 576) and head.draft_lm_head.flags.c_contiguous
    np.testing.assert_array_equal(head.draft_lm_head, be.weights["embed"][d2t])
    assert load_head(path, smollm2.model_config, be.weights, num_blocks=4, block_size=16, draft_vocab=False).d2t is None


PARAMS = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def f64_engine(smollm2):
    from test_mtp import f64_spec_engines          # tests/ (the conftest's directory) is on sys.path
    return f64_spec_engines(smollm2)


@pytest.fixture(scope="module")
def plain(f64_engine):
    return f64_engine({"method": "none"}).generate(PROMPTS, PARAMS, use_tqdm=False)


@pytest.mark.parametrize("draft_vocab", [True, False])
def test_smollm2_greedy_mtp_with_d2t_equals_plain(f64_engine, plain, d2t_head, draft_vocab):
    path, d2t = d2t_head
    eng = f64_engine({"method": "mtp", "num_drafts": 3, "mtp_head": str(path), "mtp_draft_vocab": draft_vocab})
    drafter = eng.speculator.drafter
    assert (drafter.head.d2t is not None) == draft_vocab
    proposed = []
    propose = drafter.propose

    def spy(seqs, ks):
        drafts = propose(seqs, ks)
        proposed.extend(t for d in drafts for t in d.tokens)
        return drafts
    drafter.propose = spy
    outs = eng.generate(PROMPTS, PARAMS, use_tqdm=False)
    for a, b in zip(plain, outs):
        np.testing.assert_array_equal(a.token_ids, b.token_ids)
    out_ids = np.concatenate([o.token_ids for o in plain])
    assert np.isin(out_ids, d2t).any() and not np.isin(out_ids, d2t).all()    # the subset bites
    assert proposed and eng.speculator.stats()["verifies"] > 0
    if draft_vocab:
        assert np.isin(proposed, d2t).all()
    else:
        assert not np.isin(proposed, d2t).all()
    eng.blocks.check_no_leaks([])


def test_a_draft_vocabulary_makes_the_draft_cheaper_for_the_gate():
    """SmolLM2-135M: one block + the whole 49k-row LM head ~24% of a decode step's weights; with
    8192 rows ~6%. make_speculator gives the MTP drafter the share of its head's draft vocabulary."""
    from metrale.models.config import ModelConfig
    from metrale.spec.speculator import forward_share
    cfg = ModelConfig(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                      num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, tie_word_embeddings=True)
    assert forward_share(cfg, 1, 8192) == pytest.approx(0.06, abs=0.01)
    assert forward_share(cfg, 1, 49152) == forward_share(cfg, 1) == forward_share(cfg, 1, None)


def test_make_speculator_costs_the_draft_vocabulary(smollm2, d2t_head):
    from metrale.settings import compose, to_overrides
    from metrale.spec.speculator import forward_share
    path, d2t = d2t_head

    from metrale.runtime.numpy_backend import NumpyBackend
    be = smollm2.backend

    def drafter(draft_vocab):
        cfg = compose(to_overrides({"device": "cpu", "spec": {"method": "mtp", "mtp_head": str(path),
                                                              "mtp_draft_vocab": draft_vocab}, "cache": {"num_blocks": 8}}))
        twin = NumpyBackend(be.config, be.weights.items(), num_blocks=8, block_size=be.block_size)
        return Engine(cfg=cfg, parts=(be.config, smollm2.tokenizer, twin)).speculator.drafter

    cfg = smollm2.model_config
    assert drafter(True).cost_per_token == pytest.approx(forward_share(cfg, 1, len(d2t)))
    assert drafter(False).cost_per_token == pytest.approx(forward_share(cfg, 1))
    assert forward_share(cfg, 1, len(d2t)) < 0.5 * forward_share(cfg, 1)
