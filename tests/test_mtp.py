"""MTP head and drafter: the head's paged, windowed forward against a direct computation; the
drafter's incremental KV bookkeeping against a from-scratch recomputation inside the engine;
greedy MTP speculation on SmolLM2 with the bundled head equals plain greedy decoding."""
import dataclasses

import numpy as np
import pytest

from fake_model import FakeBackend, fake_engine, reference_continuation
from metrale import Engine, SamplingParams
from metrale.models.config import ModelConfig
from metrale.runtime.batch import Segment, build_batch
from metrale.spec.mtp import DEFAULT_HEADS, MtpDrafter, MtpHead, load_head

TINY = ModelConfig(architecture="llama", vocab_size=97, hidden_size=8, intermediate_size=12, num_layers=1,
                   num_heads=4, num_kv_heads=2, head_dim=4, rms_norm_eps=1e-6, rope_theta=100.0,
                   rope_interleaved=True, name="tiny")


def tiny_weights(c: ModelConfig, seed: int = 0) -> dict:
    r = np.random.default_rng(seed)
    D, F, V = c.hidden_size, c.intermediate_size, c.vocab_size
    return {"embed": r.normal(size=(V, D)), "final_norm": 1 + 0.1 * r.normal(size=D),
            "enorm": 1 + 0.1 * r.normal(size=D), "hnorm": 1 + 0.1 * r.normal(size=D),
            "eh_proj": r.normal(size=(D, 2 * D)) / np.sqrt(2 * D),
            "attn_norm": 1 + 0.1 * r.normal(size=D), "mlp_norm": 1 + 0.1 * r.normal(size=D),
            "qkv": r.normal(size=(c.q_size + 2 * c.kv_size, D)) / np.sqrt(D),
            "o": r.normal(size=(D, c.q_size)) / np.sqrt(c.q_size),
            "gate_up": r.normal(size=(2 * F, D)) / np.sqrt(D), "down": r.normal(size=(D, F)) / np.sqrt(F)}


def reference_head(w: dict, c: ModelConfig, hidden: np.ndarray, tokens: np.ndarray, positions: np.ndarray):
    """The head over one window, every row attending to the rows before it: plain float64 NumPy."""
    def norm(x, g):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + c.rms_norm_eps) * g

    def rope(x):                                    # adjacent pairs (GGUF layout)
        inv = 1.0 / c.rope_theta ** (np.arange(c.head_dim // 2) * 2.0 / c.head_dim)
        ang = positions[:, None, None] * inv
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = a * np.cos(ang) - b * np.sin(ang), a * np.sin(ang) + b * np.cos(ang)
        return out

    T, H, KV, hd = len(tokens), c.num_heads, c.num_kv_heads, c.head_dim
    x = np.concatenate([norm(w["embed"][tokens], w["enorm"]), norm(hidden, w["hnorm"])], -1) @ w["eh_proj"].T
    y = norm(x, w["attn_norm"]) @ w["qkv"].T
    q = rope(y[:, :H * hd].reshape(T, H, hd))
    k = np.repeat(rope(y[:, H * hd:(H + KV) * hd].reshape(T, KV, hd)), H // KV, axis=1)
    v = np.repeat(y[:, (H + KV) * hd:].reshape(T, KV, hd), H // KV, axis=1)
    s = np.einsum("thd,uhd->htu", q, k) / np.sqrt(hd) + np.triu(np.full((T, T), -np.inf), 1)
    p = np.exp(s - s.max(-1, keepdims=True))
    x = x + np.einsum("htu,uhd->thd", p / p.sum(-1, keepdims=True), v).reshape(T, H * hd) @ w["o"].T
    g, u = np.split(norm(x, w["mlp_norm"]) @ w["gate_up"].T, 2, axis=-1)
    x = x + (g / (1 + np.exp(-g)) * u) @ w["down"].T
    return norm(x, w["final_norm"]) @ w["embed"].T, x


def head_with(w: dict, c: ModelConfig = TINY, num_blocks: int = 32, block_size: int = 4) -> MtpHead:
    return MtpHead(c, w, num_blocks=num_blocks, block_size=block_size, dtype=np.float64)


def test_head_forward_matches_direct_computation():
    w = tiny_weights(TINY)
    head = head_with(w)
    r = np.random.default_rng(1)
    # two sequences in scattered blocks; A's window starts at position 5, B's at 2
    table_a, table_b = np.array([9, 3, 17, 4], np.int32), np.array([12, 0, 30], np.int32)
    toks_a, toks_b = r.integers(0, 97, 10), r.integers(0, 97, 8)
    hid_a, hid_b = r.normal(size=(10, 8)) * 3, r.normal(size=(8, 8)) * 3
    ref_a = reference_head(w, TINY, hid_a[5:], toks_a[5:], np.arange(5, 10))
    ref_b = reference_head(w, TINY, hid_b[2:], toks_b[2:], np.arange(2, 8))
    # round 1: A rows 5..7, B rows 2..6 (all rows out); round 2: A rows 8..9, B row 7, reading the cache
    for (a0, a1), (b0, b1) in (((5, 8), (2, 7)), ((8, 10), (7, 8))):
        segs = [Segment(toks_a[a0:a1].astype(np.int32), a0, table_a, "all"),
                Segment(toks_b[b0:b1].astype(np.int32), b0, table_b, "all")]
        logits, rows = head.forward(build_batch(segs, 4), np.concatenate([hid_a[a0:a1], hid_b[b0:b1]]), np.array([5, 2]))
        na = a1 - a0
        np.testing.assert_allclose(logits[:na], ref_a[0][a0 - 5:a1 - 5], rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(rows[:na], ref_a[1][a0 - 5:a1 - 5], rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(logits[na:], ref_b[0][b0 - 2:b1 - 2], rtol=1e-10, atol=1e-10)


# ---------------------------------------------------------------------------- the drafter in the engine
def fake_hidden(position: int, token: int) -> np.ndarray:
    return np.sin(0.37 * (position + 1) * np.arange(1, 9) + 0.11 * token) * 2


class HiddenFakeBackend(FakeBackend):
    """The fake model, with a deterministic hidden row per (position, token) for MTP heads."""

    def forward(self, batch, num_layers=None, return_hidden=False):
        logits = super().forward(batch)
        if not return_hidden:
            return logits
        t = batch.logits_indices
        return logits, np.stack([fake_hidden(int(p), int(x)) for p, x in zip(batch.positions[t], batch.token_ids[t])]) \
            if len(t) else np.zeros((0, 8))


class CheckedMtpDrafter(MtpDrafter):
    """Every draft must equal the head run from scratch over the sequence's whole window."""

    def __init__(self, head, w):
        super().__init__(head)
        self.w, self.checked = w, 0

    def propose(self, seqs, ks):
        drafts = super().propose(seqs, ks)
        for s, d in zip(seqs, drafts):
            if not d.tokens:
                continue
            toks, lo, n = s.token_ids, len(s.prompt_token_ids) - 1, s.num_tokens - 1
            hid = [fake_hidden(p, toks[p]) for p in range(lo, n)]
            feed = list(toks[lo + 1:n + 1])
            for j, tok in enumerate(d.tokens):
                logits, rows = reference_head(self.w, TINY, np.array(hid), np.array(feed), np.arange(lo, n + j))
                assert int(np.argmax(logits[-1])) == tok
                hid.append(rows[-1])
                feed.append(tok)
            self.checked += 1
        return drafts


def test_drafter_bookkeeping_in_the_engine_and_release(rng):
    eng = fake_engine(num_blocks=256, block_size=4, **{"spec.method": "ngram", "spec.num_drafts": 3,
                                                       "levers.spec_verify_cost": 0.0})
    backend = HiddenFakeBackend(256, 4)
    w = tiny_weights(TINY, seed=3)
    drafter = CheckedMtpDrafter(head_with(w, num_blocks=256), w)
    eng.speculator.drafter = drafter
    eng.backend = drafter.tap(backend)
    prompts = [[int(t) for t in rng.integers(1, 96, int(n))] for n in (3, 11, 6)]
    outs = eng.generate([np.array(p) for p in prompts], SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert list(o.token_ids) == reference_continuation(p, 14)
    assert drafter.checked > 10 and eng.speculator.stats()["verifies"] > 0
    assert drafter.tracks == {}                      # released with the requests
    eng.blocks.check_no_leaks([])


def test_note_restarts_the_window_after_a_gap():
    d = MtpDrafter(head_with(tiny_weights(TINY)))
    d.note("r", 4, np.ones((1, 8)))
    d.note("r", 5, np.ones((2, 8)))
    t = d.tracks["r"]
    assert (t.lo, t.pos, len(t.rows)) == (4, 4, 3)
    d.note("r", 9, np.ones((1, 8)))                  # a missed step: rows 7..8 never came
    t = d.tracks["r"]
    assert (t.lo, t.pos, len(t.rows)) == (9, 9, 1)


# ---------------------------------------------------------------------------- SmolLM2 with the bundled head
HEAD = DEFAULT_HEADS["smollm2-135m-instruct"]
PROMPTS = ["The capital of France is", "def add(a, b):\n", "Once upon a time"]


def test_bundled_head_is_small_and_checked(smollm2):
    assert HEAD.is_file() and HEAD.stat().st_size < 20e6
    cfg = smollm2.model_config
    with pytest.raises(ValueError, match="hidden"):
        load_head(HEAD, dataclasses.replace(cfg, hidden_size=64), {}, num_blocks=4, block_size=16)


def f64_spec_engines(smollm2):
    """engine(spec): an Engine over a float64 NumPy twin of SmolLM2 (exact greedy comparisons), every
    draft verified (spec_verify_cost 0)."""
    from metrale.runtime.numpy_backend import NumpyBackend
    from metrale.settings import compose, to_overrides
    be = smollm2.backend
    f64 = {n: a.astype(np.float64) for n, a in be.weights.items()}

    def engine(spec):
        cfg = compose(to_overrides({"device": "cpu", "levers": {"numpy_dtype": "float64", "spec_verify_cost": 0.0},
                                    "spec": spec, "cache": {"num_blocks": 64}}))
        twin = NumpyBackend(be.config, f64.items(), num_blocks=64, block_size=be.block_size, dtype="float64")
        return Engine(cfg=cfg, parts=(be.config, smollm2.tokenizer, twin))
    return engine


def test_smollm2_greedy_mtp_equals_plain(smollm2):
    engine = f64_spec_engines(smollm2)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    plain = engine({"method": "none"}).generate(PROMPTS, params, use_tqdm=False)
    eng = engine({"method": "mtp", "num_drafts": 3})
    outs = eng.generate(PROMPTS, params, use_tqdm=False)
    for a, b in zip(plain, outs):
        np.testing.assert_array_equal(a.token_ids, b.token_ids)
    stats = eng.speculator.stats()
    assert stats["verifies"] > 0 and stats["accepted"] > 0
    assert eng.speculator.drafter.tracks == {}
    eng.blocks.check_no_leaks([])


def test_hidden_tap_keeps_a_device_argmax_path():
    """A backend with forward_greedy_hidden (CUDA) serves greedy steps through it: the tap keeps
    the hidden rows without asking for [R, V] logits."""
    from metrale.spec.mtp import HiddenTap

    class DeviceArgmax:
        calls = []

        def forward(self, batch, num_layers=None, return_hidden=False):
            raise AssertionError("full logits requested on a greedy step")

        def forward_greedy_hidden(self, batch):
            self.calls.append(batch)
            return np.array([3, 1], np.int32), np.ones((2, 4), np.float32)

    tap = HiddenTap(DeviceArgmax())
    ids = tap.forward_greedy("batch")
    np.testing.assert_array_equal(ids, [3, 1])
    assert tap.take_hidden().shape == (2, 4) and DeviceArgmax.calls == ["batch"]
