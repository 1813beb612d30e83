"""DFlash block drafter: the block forward against a direct NumPy computation (shapes, determinism,
batching, non-causality); the context pool holds exactly the accepted positions' K/V after verify
steps with accepted and rejected drafts; greedy DFlash speculation on SmolLM2 (NumPy float64)
equals plain greedy decoding with a random drafter and with the bundled trained one."""
import numpy as np
import pytest

from metrale import Engine, SamplingParams
from metrale.models.config import ModelConfig
from metrale.runtime.batch import Segment, build_batch
from metrale.spec.dflash import DEFAULT_DRAFTERS, DFlashDrafter, default_target_layers, random_drafter
from metrale.spec.mtp import HiddenTap, forward_with_layer_rows

TINY = ModelConfig(architecture="llama", vocab_size=97, hidden_size=8, intermediate_size=12, num_layers=4,
                   num_heads=4, num_kv_heads=2, head_dim=4, rms_norm_eps=1e-6, rope_theta=100.0,
                   rope_interleaved=True, name="tiny")


def tiny_model(seed: int = 0, num_layers: int = 2):
    r = np.random.default_rng(seed)
    shared = {"embed": r.normal(size=(97, 8)), "final_norm": 1 + 0.1 * r.normal(size=8)}
    m = random_drafter(TINY, shared, num_blocks=32, pool_block_size=4, num_layers=num_layers,
                       target_layers=(0, 2), seed=seed + 1, dtype=np.float64)
    m.weights["mask_embed"] = r.normal(size=8)
    return m


def reference_block(m, rows: list[np.ndarray], last: int, length: int) -> np.ndarray:
    """The drafter over one sequence, written out: context features of positions [0, n), the block
    [last, MASK...] at positions n.., every block row attending to all context and all the block."""
    c, w = m.config, m.weights
    H, KV, hd = c.num_heads, c.num_kv_heads, c.head_dim

    def norm(x, g):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + c.rms_norm_eps) * g

    def rope(x, pos):
        inv = 1.0 / c.rope_theta ** (np.arange(hd // 2) * 2.0 / hd)
        ang = pos[:, None, None] * inv
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = a * np.cos(ang) - b * np.sin(ang), a * np.sin(ang) + b * np.cos(ang)
        return out

    n = len(rows[0])
    ctx = norm(np.concatenate(rows, -1) @ w["fc"].T, w["hidden_norm"])
    x = np.concatenate([w["embed"][[last]], np.repeat(w["mask_embed"][None], length - 1, 0)])
    pos_c, pos_b = np.arange(n), np.arange(n, n + length)
    for i in range(m.num_layers):
        p = f"layers.{i}."
        W = w[p + "qkv"]
        y = norm(x, w[p + "attn_norm"]) @ W.T
        q = rope(y[:, :H * hd].reshape(-1, H, hd), pos_b)
        kb = rope(y[:, H * hd:(H + KV) * hd].reshape(-1, KV, hd), pos_b)
        vb = y[:, (H + KV) * hd:].reshape(-1, KV, hd)
        yc = ctx @ W[H * hd:].T
        kc = rope(yc[:, :KV * hd].reshape(-1, KV, hd), pos_c)
        vc = yc[:, KV * hd:].reshape(-1, KV, hd)
        k = np.repeat(np.concatenate([kc, kb]), H // KV, axis=1)
        v = np.repeat(np.concatenate([vc, vb]), H // KV, axis=1)
        s = np.einsum("thd,uhd->htu", q, k) / np.sqrt(hd)
        p_ = np.exp(s - s.max(-1, keepdims=True))
        x = x + np.einsum("htu,uhd->thd", p_ / p_.sum(-1, keepdims=True), v).reshape(length, H * hd) @ w[p + "o"].T
        g, u = np.split(norm(x, w[p + "mlp_norm"]) @ w[p + "gate_up"].T, 2, axis=-1)
        x = x + (g / (1 + np.exp(-g)) * u) @ w[p + "down"].T
    return norm(x, w["final_norm"]) @ w["embed"].T


def write_context(m, table, rows, start=0):
    n = len(rows[0])
    batch = build_batch([Segment(np.zeros(n, np.int32), start, table, "none")], m.block_size)
    m.write_context(batch, rows)


def test_block_forward_matches_direct_computation_batched_and_deterministic():
    m = tiny_model()
    r = np.random.default_rng(5)
    tables = [np.array([9, 3, 17, 4, 20], np.int32), np.array([12, 0, 30], np.int32)]
    ctx = [[r.normal(size=(11, 8)) * 3 for _ in range(2)], [r.normal(size=(6, 8)) * 3 for _ in range(2)]]
    for table, rows in zip(tables, ctx):                     # in two chunks, as a chunked prefill writes it
        write_context(m, table, [x[:4] for x in rows])
        write_context(m, table, [x[4:] for x in rows], start=4)
    lasts = [17, 42]
    batch = m.blocks(lasts, [11, 6], tables, 4)
    logits = m.forward(batch)
    assert logits.shape == (8, 97)
    for s in range(2):
        np.testing.assert_allclose(logits[4 * s:4 * s + 4], reference_block(m, ctx[s], lasts[s], 4), rtol=1e-9, atol=1e-9)
    np.testing.assert_array_equal(m.forward(m.blocks(lasts, [11, 6], tables, 4)), logits)   # deterministic
    alone = m.forward(m.blocks(lasts[1:], [6], tables[1:], 4))
    np.testing.assert_allclose(alone, logits[4:], rtol=1e-12, atol=1e-12)                 # batching changes nothing


def test_block_is_non_causal():
    """Draft 1 (row 1) sees the MASK rows after it: a longer block changes it (a causal drafter's
    row 1 would not move), and so does the MASK embedding."""
    m = tiny_model(seed=3)
    table = np.array([1, 2, 3, 4], np.int32)
    write_context(m, table, [np.random.default_rng(2).normal(size=(5, 8)) for _ in range(2)])
    short = m.forward(m.blocks([7], [5], [table], 2))
    long = m.forward(m.blocks([7], [5], [table], 5))
    assert not np.allclose(short[1], long[1])
    m.weights["mask_embed"] = m.weights["mask_embed"] + 1.0
    assert not np.allclose(m.forward(m.blocks([7], [5], [table], 5))[1], long[1])


def test_default_target_layers_spread_over_depth():
    assert default_target_layers(30) == (1, 14, 27)
    assert default_target_layers(4) == (1,)


# ---------------------------------------------------------------------------- SmolLM2 (NumPy float64)
PROMPTS = ["1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3,", "The cat sat on the mat. The cat sat on the",
           "def f(x):\n    return x\n\ndef g(x):\n    return x\n\ndef h(x):\n    return", "Once"]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def exact_plain():
    eng = Engine(model="smollm2-135m", device="cpu", levers={"numpy_dtype": "float64"})
    return eng, eng.generate(PROMPTS, greedy(10), use_tqdm=False)


def twin(plain_engine, spec: dict) -> Engine:
    from metrale.runtime.numpy_backend import NumpyBackend
    from metrale.settings import compose, to_overrides
    be = plain_engine.backend
    cfg = compose(to_overrides({"device": "cpu", "levers": {"numpy_dtype": "float64", "spec_verify_cost": 0.0},
                                "spec": spec}))
    backend = NumpyBackend(be.config, be.weights.items(), num_blocks=128, block_size=be.block_size, dtype="float64")
    return Engine(cfg=cfg, parts=(be.config, plain_engine.tokenizer, backend))


class CheckedDFlash(DFlashDrafter):
    """Runs the real drafter, then (oracle mode) proposes the plain continuation with some tokens
    corrupted, so verify steps accept some drafts and reject others; before every proposal the
    pool's context K/V of each sequence must equal a from-scratch computation over its accepted
    tokens."""

    def __init__(self, model, num_drafts, target, plain: dict | None):
        super().__init__(model, num_drafts)
        self.target, self.plain, self.checked, self.rng = target, plain, 0, np.random.default_rng(0)

    def propose(self, seqs, ks):
        m = self.model
        c = m.config
        for s in seqs:
            n = s.num_tokens - 1
            batch = build_batch([Segment(np.asarray(s.token_ids[:n], np.int32), 0, np.asarray(s.block_table, np.int32), "none")],
                                m.block_size)
            _, rows = forward_with_layer_rows(self.target, batch, m.target_layers)
            fresh = m.context_kv(rows, np.arange(n))
            slots = batch.slot_mapping
            for i, (k, v) in enumerate(fresh):
                np.testing.assert_allclose(m.kv.k[i].reshape(-1, c.num_kv_heads, c.head_dim)[slots], k, rtol=1e-9, atol=1e-9)
                np.testing.assert_allclose(m.kv.v[i].reshape(-1, c.num_kv_heads, c.head_dim)[slots], v, rtol=1e-9, atol=1e-9)
            self.checked += 1
        drafts = super().propose(seqs, ks)
        if self.plain is None:
            return drafts
        for s, d in zip(seqs, drafts):
            truth = self.plain[tuple(s.prompt_token_ids)][len(s.output_token_ids):][:len(d.tokens)]
            d.tokens = [t if self.rng.random() > 0.3 else (t + 1) % 49152 for t in truth]
            d.confidences = d.confidences[:len(d.tokens)]
        return drafts


@pytest.mark.parametrize("oracle", [False, True])
def test_smollm2_greedy_dflash_equals_plain_and_keeps_accepted_context(exact_plain, oracle):
    plain_engine, plain = exact_plain
    eng = twin(plain_engine, {"method": "dflash", "num_drafts": 3, "dflash_head": "random"})
    assert isinstance(eng.backend, HiddenTap) and eng.backend.layers == default_target_layers(30)
    truth = {tuple(plain_engine.encode_prompt(p, chat=False)): list(o.token_ids) for p, o in zip(PROMPTS, plain)}
    checked = CheckedDFlash(eng.speculator.drafter.model, 3, eng.backend.inner, truth if oracle else None)
    eng.speculator.drafter = checked
    eng.backend.on_layers = checked.model.write_context
    outs = eng.generate(PROMPTS, greedy(10), use_tqdm=False)
    for a, b in zip(plain, outs):
        np.testing.assert_array_equal(a.token_ids, b.token_ids)
    st = eng.speculator.stats()
    assert st["verifies"] > 0 and checked.checked > 5
    if oracle:
        assert 0 < st["accepted"] < st["proposed"]        # both commit and rollback happened
    eng.blocks.check_no_leaks([])


def test_dflash_refuses_a_non_numpy_backend():
    from fake_model import fake_engine
    with pytest.raises(ValueError, match="NumPy backend"):
        fake_engine(**{"spec.method": "dflash", "spec.dflash_head": "random"})


ASSET = DEFAULT_DRAFTERS["smollm2-135m-instruct"]


@pytest.mark.slow
@pytest.mark.skipif(not ASSET.is_file(), reason="no bundled DFlash drafter")
def test_smollm2_trained_dflash_accepts_and_equals_plain(exact_plain):
    assert ASSET.stat().st_size < 20e6
    plain_engine, plain = exact_plain
    eng = twin(plain_engine, {"method": "dflash", "num_drafts": 4})
    outs = eng.generate(PROMPTS, greedy(10), use_tqdm=False)
    for a, b in zip(plain, outs):
        np.testing.assert_array_equal(a.token_ids, b.token_ids)
    st = eng.speculator.stats()
    assert st["verifies"] > 0 and st["accepted"] > 0
    eng.blocks.check_no_leaks([])
