"""Gated DeltaNet and hybrid models on the NumPy backend: the recurrent and chunked forms agree,
a tiny Qwen3-Next-format checkpoint matches an independent transcription of the Hugging Face
modules, chunked prefill / decode / ragged batches equal one-shot prefill, and state slots,
checkpoints and rollback restore exactly without leaking."""
import json

import numpy as np
import pytest

from kernels_numba.gdn import (causal_conv1d_ref, gated_delta_chunked_ref, gated_delta_recurrent_ref,
                               l2norm_ref)
from metrale.cache.state_slots import StateSlots
from metrale.models.hybrid import hybrid_model_config, random_hf_hybrid_tensors
from metrale.models.checkpoint import load_hf_dir
from metrale.runtime.batch import Segment, build_batch
from metrale.runtime.numpy_backend import NumpyBackend

BS = 4


def qwen3_next_cfg(**over):
    cfg = {"model_type": "qwen3_next", "vocab_size": 61, "hidden_size": 32, "intermediate_size": 48,
           "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
           "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
           "linear_value_head_dim": 6, "linear_conv_kernel_dim": 4, "full_attention_interval": 2,
           "num_experts": 0, "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-6,
           "tie_word_embeddings": False, "max_position_embeddings": 256}
    cfg.update(over)
    return cfg


def write_model(path, cfg, seed=0):
    from safetensors.numpy import save_file
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    tensors = random_hf_hybrid_tensors(hybrid_model_config(cfg), seed)
    save_file(tensors, str(path / "model.safetensors"))
    return tensors


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3next")
    cfg = qwen3_next_cfg()
    tensors = write_model(path, cfg)
    return path, cfg, tensors


def backend_of(path, slots=4, ckpts=None, **kw):
    config, _, stream = load_hf_dir(path)
    return NumpyBackend(config, stream(), num_blocks=64, block_size=BS, dtype="float64",
                        num_state_slots=slots, num_state_checkpoints=ckpts, **kw)


def table(seq: int, n_tokens: int = 64):
    return np.arange(seq * 16, seq * 16 + -(-n_tokens // BS), dtype=np.int32)


def run(be, segs):
    return be.forward(build_batch(segs, BS))


# ------------------------------------------------------------------------------- the math


def random_gdn(rng, L, H, dk, dv):
    q = l2norm_ref(rng.standard_normal((L, H, dk))) / np.sqrt(dk)
    k = l2norm_ref(rng.standard_normal((L, H, dk)))
    return (q, k, rng.standard_normal((L, H, dv)), -rng.uniform(0.0, 2.0, (L, H)),
            rng.uniform(0.0, 1.0, (L, H)), rng.standard_normal((H, dk, dv)))


@pytest.mark.parametrize("chunk", [1, 3, 8, 64])
def test_chunked_equals_recurrent_float64(chunk):
    q, k, v, g, beta, s0 = random_gdn(np.random.default_rng(chunk), 37, 3, 8, 6)
    o1, s1 = gated_delta_recurrent_ref(q, k, v, g, beta, s0)
    o2, s2 = gated_delta_chunked_ref(q, k, v, g, beta, s0, chunk)
    np.testing.assert_allclose(o2, o1, rtol=0, atol=1e-12)
    np.testing.assert_allclose(s2, s1, rtol=0, atol=1e-12)


def test_recurrent_is_the_gated_delta_rule():
    """S_t = a_t S_{t-1} (I - b_t k_t k_t^T) + b_t v_t k_t^T (S as [dv, dk]), o_t = S_t q_t."""
    q, k, v, g, beta, s0 = random_gdn(np.random.default_rng(7), 9, 2, 5, 4)
    o, s = gated_delta_recurrent_ref(q, k, v, g, beta, s0)
    for h in range(2):
        S = s0[h].T
        for t in range(9):
            S = np.exp(g[t, h]) * S @ (np.eye(5) - beta[t, h] * np.outer(k[t, h], k[t, h])) \
                + beta[t, h] * np.outer(v[t, h], k[t, h])
            np.testing.assert_allclose(o[t, h], S @ q[t, h], atol=1e-12)
        np.testing.assert_allclose(s[h], S.T, atol=1e-12)


def test_conv_state_carries_across_splits():
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((11, 5)), rng.standard_normal((5, 4))
    y, st = causal_conv1d_ref(x, w, np.zeros((5, 3)))
    parts, st2 = [], np.zeros((5, 3))
    for a, b in [(0, 1), (1, 3), (3, 4), (4, 11)]:
        yy, st2 = causal_conv1d_ref(x[a:b], w, st2)
        parts.append(yy)
    np.testing.assert_allclose(np.concatenate(parts), y, atol=1e-14)
    np.testing.assert_allclose(st2, st, atol=0)


# ------------------------------------------------------- Hugging Face semantics, transcribed


def hf_reference_logits(cfg, t, ids):
    """Qwen3NextForCausalLM (dense MLP) on one sequence, written from the HF modules' semantics
    directly on the HF tensors: interleaved q/gate rows, grouped in_proj_qkvz / in_proj_ba, (1 + w)
    norms, partial RoPE, conv with zero history, the delta rule token by token."""
    eps, L = cfg["rms_norm_eps"], len(ids)
    nk, nv, dk, dv = (cfg[f"linear_{x}"] for x in ("num_key_heads", "num_value_heads", "key_head_dim",
                                                    "value_head_dim"))
    nh, nkv, hd, r = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], nv // nk

    def rms(x, w, one=1.0):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * (one + w)

    def silu(x):
        return x / (1 + np.exp(-x))

    x = t["model.embed_tokens.weight"][ids].astype(np.float64)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms(x, t[p + "input_layernorm.weight"])
        if (i + 1) % cfg["full_attention_interval"]:
            a = p + "linear_attn."
            qkvz = (h @ t[a + "in_proj_qkvz.weight"].T).reshape(L, nk, 2 * dk + 2 * r * dv)
            ba = (h @ t[a + "in_proj_ba.weight"].T).reshape(L, nk, 2 * r)
            q, k = qkvz[..., :dk], qkvz[..., dk:2 * dk]
            v, z = qkvz[..., 2 * dk:2 * dk + r * dv].reshape(L, nv, dv), qkvz[..., 2 * dk + r * dv:].reshape(L, nv, dv)
            b, aa = ba[..., :r].reshape(L, nv), ba[..., r:].reshape(L, nv)
            mixed = np.concatenate([q.reshape(L, -1), k.reshape(L, -1), v.reshape(L, -1)], axis=1)
            w = t[a + "conv1d.weight"][:, 0, :]
            K = w.shape[1]
            pad = np.concatenate([np.zeros((K - 1, mixed.shape[1])), mixed])
            mixed = silu(np.stack([(pad[s:s + K] * w.T).sum(0) for s in range(L)]))
            q = mixed[:, :nk * dk].reshape(L, nk, dk).repeat(r, axis=1)
            k = mixed[:, nk * dk:2 * nk * dk].reshape(L, nk, dk).repeat(r, axis=1)
            v = mixed[:, 2 * nk * dk:].reshape(L, nv, dv)
            beta = 1 / (1 + np.exp(-b))
            g = -np.exp(t[a + "A_log"]) * np.log1p(np.exp(aa + t[a + "dt_bias"]))
            q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) / np.sqrt(dk)
            k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
            S, core = np.zeros((nv, dk, dv)), np.zeros((L, nv, dv))
            for s in range(L):
                S = S * np.exp(g[s])[:, None, None]
                delta = (v[s] - (S * k[s][:, :, None]).sum(1)) * beta[s][:, None]
                S = S + k[s][:, :, None] * delta[:, None, :]
                core[s] = (S * q[s][:, :, None]).sum(1)
            core = rms(core, t[a + "norm.weight"], 0.0) * silu(z)
            out = core.reshape(L, -1) @ t[a + "out_proj.weight"].T
        else:
            s_ = p + "self_attn."
            qg = (h @ t[s_ + "q_proj.weight"].T).reshape(L, nh, 2 * hd)
            q, gate = qg[..., :hd], qg[..., hd:].reshape(L, -1)
            q = rms(q, t[s_ + "q_norm.weight"])
            k = rms((h @ t[s_ + "k_proj.weight"].T).reshape(L, nkv, hd), t[s_ + "k_norm.weight"])
            v = (h @ t[s_ + "v_proj.weight"].T).reshape(L, nkv, hd)
            rot = int(hd * cfg["partial_rotary_factor"])
            inv = 1.0 / cfg["rope_theta"] ** (np.arange(0, rot, 2) / rot)
            emb = np.concatenate([np.outer(np.arange(L), inv)] * 2, axis=1)[:, None, :]

            def rope(x):
                xr, xp = x[..., :rot], x[..., rot:]
                half = np.concatenate([-xr[..., rot // 2:], xr[..., :rot // 2]], axis=-1)
                return np.concatenate([xr * np.cos(emb) + half * np.sin(emb), xp], axis=-1)

            q, k = rope(q), rope(k)
            k, v = k.repeat(nh // nkv, axis=1), v.repeat(nh // nkv, axis=1)
            sc = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd) + np.triu(np.full((L, L), -np.inf), 1)
            pr = np.exp(sc - sc.max(-1, keepdims=True))
            pr /= pr.sum(-1, keepdims=True)
            att = np.einsum("hqk,khd->qhd", pr, v).reshape(L, -1)
            out = (att * (1 / (1 + np.exp(-gate)))) @ t[s_ + "o_proj.weight"].T
        x = x + out
        h = rms(x, t[p + "post_attention_layernorm.weight"])
        x = x + (silu(h @ t[p + "mlp.gate_proj.weight"].T) * (h @ t[p + "mlp.up_proj.weight"].T)) @ t[
            p + "mlp.down_proj.weight"].T
    return rms(x, t["model.norm.weight"]) @ t["lm_head.weight"].T


def prompt(n, seed=0):
    return np.random.default_rng(100 + seed).integers(0, 61, n).astype(np.int32)


def test_config_reading(tiny):
    path, cfg, _ = tiny
    config, _, _ = load_hf_dir(path)
    assert config.layer_types == ("linear_attention", "full_attention") * 2
    assert config.num_kv_layers == 2 and config.num_state_layers == 2 and config.kv_layer(3) == 1
    assert config.rotary_dim == 4 and config.attn_output_gate and config.qk_norm
    # MoE layers are read (the hybrid_moe family runs them; tests/test_conformance.py: qwen3_next_moe)
    moe = hybrid_model_config(qwen3_next_cfg(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                                             mlp_only_layers=[0]))
    assert [moe.is_moe_layer(i) for i in range(4)] == [False, True, True, True] and moe.norm_topk_prob
    c = hybrid_model_config(qwen3_next_cfg(layer_types=["full_attention"] * 4))
    assert not c.is_hybrid and c.num_kv_layers == 4


def test_one_shot_prefill_matches_hf_semantics(tiny):
    path, cfg, tensors = tiny
    ids = prompt(13)
    be = backend_of(path)
    got = run(be, [Segment(ids, 0, table(0), "all", state_slot=0)])
    ref = hf_reference_logits(cfg, {k: v.astype(np.float64) for k, v in tensors.items()}, ids)
    np.testing.assert_allclose(got, ref, rtol=1e-9, atol=1e-9)
    assert be.kv.k.shape[0] == 2 and be.memory_report()["state_pool_bytes"] > 0


def test_metrale_hybrid_format_loads(tmp_path):
    cfg = qwen3_next_cfg(model_type="metrale_hybrid", layer_types=["linear_attention", "full_attention",
                                                                    "linear_attention", "linear_attention"])
    del cfg["partial_rotary_factor"]
    write_model(tmp_path, cfg)
    be = backend_of(tmp_path)
    assert not be.config.attn_output_gate and be.config.rotary_dim == 0
    ids = prompt(9, 1)
    full = run(be, [Segment(ids, 0, table(0), "all", state_slot=0)])
    step = [run(be, [Segment(ids[:5], 0, table(1), "all", state_slot=1)])]
    step += [run(be, [Segment(ids[i:i + 1], i, table(1), "all", state_slot=1)]) for i in range(5, 9)]
    np.testing.assert_allclose(np.concatenate(step), full, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("chunk", [1, 3, 5, 8])
def test_chunked_prefill_equals_one_shot(tiny, chunk):
    path, _, _ = tiny
    ids = prompt(19, 2)
    be = backend_of(path)
    be.states.chunk = 4              # segments of >= 4 tokens take the chunked form
    full = run(be, [Segment(ids, 0, table(0), "all", state_slot=0)])
    parts = [run(be, [Segment(ids[a:a + chunk], a, table(1), "all", state_slot=1)])
             for a in range(0, len(ids), chunk)]
    np.testing.assert_allclose(np.concatenate(parts), full, rtol=1e-10, atol=1e-10)


def test_decode_after_prefill_equals_recompute_in_a_ragged_batch(tiny):
    path, _, _ = tiny
    a_ids, b_ids = prompt(10, 3), prompt(7, 4)
    be = backend_of(path)
    ref_a = run(be, [Segment(a_ids, 0, table(0), "all", state_slot=0)])
    ref_b = run(be, [Segment(b_ids, 0, table(1), "all", state_slot=1)])
    # A: prefill 6 while B prefills 4; then A decodes while B continues its prompt; then both decode
    o1 = run(be, [Segment(a_ids[:6], 0, table(2), "all", state_slot=2), Segment(b_ids[:4], 0, table(3), "all", state_slot=3)])
    o2 = run(be, [Segment(a_ids[6:7], 6, table(2), "all", state_slot=2), Segment(b_ids[4:6], 4, table(3), "all", state_slot=3)])
    o3 = run(be, [Segment(b_ids[6:7], 6, table(3), "last", state_slot=3), Segment(a_ids[7:], 7, table(2), "all", state_slot=2)])
    tol = dict(rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(np.concatenate([o1[:6], o2[:1], o3[1:]]), ref_a, **tol)
    np.testing.assert_allclose(np.concatenate([o1[6:], o2[1:], o3[:1]]), ref_b, **tol)


def test_segments_must_continue_their_slot(tiny):
    path, _, _ = tiny
    be = backend_of(path)
    ids = prompt(8, 5)
    run(be, [Segment(ids[:4], 0, table(0), state_slot=0)])
    with pytest.raises(ValueError, match="prefix caching"):
        run(be, [Segment(ids[5:], 5, table(0), state_slot=0)])     # skipped token 4
    with pytest.raises(ValueError, match="state slot"):
        run(be, [Segment(ids, 0, table(0))])                         # no slot at all


# ------------------------------------------------------------- slots, checkpoints, rollback


def test_slots_allocate_free_no_leaks():
    slots = StateSlots(3, 2)
    a, b, c, d = object(), object(), object(), object()
    assert [slots.allocate(x) for x in (a, b, c)] == [0, 1, 2]
    assert slots.allocate(d) is None and slots.allocate(a) == 0
    ck = slots.checkpoint(1)
    assert ck in (3, 4) and slots.checkpoint(1) is not None and slots.checkpoint(0) is None
    slots.check_no_leaks([a, b, c])
    slots.free(b)                      # preempted: its checkpoints go with it
    slots.check_no_leaks([a, c])
    assert slots.allocate(d) == 1 and slots.num_free == 0
    with pytest.raises(ValueError):
        slots.checkpoint(7)
    for x in (a, c, d):
        slots.free(x)
    slots.free(d)                      # twice: ignored
    slots.check_no_leaks([])


def state_of(be, slot):
    s = be.states
    return s.conv[:, slot].copy(), s.ssm[:, slot].copy(), s.tokens[:, slot].copy()


def test_checkpoint_restore_is_exact(tiny):
    path, _, _ = tiny
    be = backend_of(path, slots=2, ckpts=2)
    slots = StateSlots.for_store(be.states)
    seq = object()
    s = slots.allocate(seq)
    ids = prompt(12, 6)
    run(be, [Segment(ids[:8], 0, table(0), state_slot=s)])
    before = state_of(be, s)
    ck = slots.checkpoint(s)
    run(be, [Segment(ids[8:], 8, table(0), state_slot=s)])
    assert not np.array_equal(state_of(be, s)[1], before[1])
    slots.restore(s, ck)
    for x, y in zip(state_of(be, s), before):
        np.testing.assert_array_equal(x, y)
    slots.release(ck)
    slots.free(seq)
    slots.check_no_leaks([])


@pytest.mark.parametrize("accepted", [0, 1, 2, 4])
def test_partial_rollback_equals_plain_decode(tiny, accepted):
    """Verify block [last, d1..d4] with a checkpoint; keep 1 + accepted tokens; the state (and the
    next logits) equal those of a sequence that only ever saw the kept tokens."""
    path, _, _ = tiny
    be = backend_of(path, slots=2, ckpts=1)
    slots = StateSlots.for_store(be.states)
    ids = prompt(9, 7)
    draft = prompt(4, 8)
    keep = 1 + accepted
    a, b = slots.allocate("spec"), slots.allocate("plain")
    for s in (a, b):
        run(be, [Segment(ids[:8], 0, table(s), state_slot=s)])
    block = np.concatenate([ids[8:9], draft])
    ck = slots.checkpoint(a)
    run(be, [Segment(block, 8, table(a), "all", state_slot=a, state_checkpoint=ck)])
    after_block = state_of(be, a)
    slots.restore(a, ck, len(block))          # replaying every token is bit-exact
    for x, y in zip(state_of(be, a), after_block):
        np.testing.assert_array_equal(x, y)
    slots.rollback(a, ck, keep)
    run(be, [Segment(block[:keep], 8, table(b), "all", state_slot=b)])
    # equal up to the rounding of the projections (BLAS rounds a 5-row and a 2-row product differently)
    for x, y in zip(state_of(be, a), state_of(be, b)):
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-12)
    nxt = prompt(1, 9)
    la = run(be, [Segment(nxt, 8 + keep, table(a), state_slot=a)])
    lb = run(be, [Segment(nxt, 8 + keep, table(b), state_slot=b)])
    np.testing.assert_allclose(la, lb, rtol=0, atol=1e-12)
    slots.free("spec")
    slots.free("plain")
    slots.check_no_leaks([])


def test_state_norm_bound(tiny):
    path, _, _ = tiny
    ids = prompt(16, 10)
    free = backend_of(path)
    bounded = backend_of(path, state_norm_bound=0.5)
    run(free, [Segment(ids, 0, table(0), state_slot=0)])
    run(bounded, [Segment(ids, 0, table(0), state_slot=0)])
    norms = np.sqrt((free.states.ssm[:, 0] ** 2).sum(axis=(-2, -1)))
    assert norms.max() > 0.5, "the test needs a state above the bound"
    got = np.sqrt((bounded.states.ssm[:, 0] ** 2).sum(axis=(-2, -1)))
    assert got.max() <= 0.5 + 1e-12


def test_random_hybrid_weights_run_in_float32():
    from metrale.models.checkpoint import random_weights
    config = hybrid_model_config(qwen3_next_cfg())
    be = NumpyBackend(config, random_weights(config, 1), num_blocks=64, block_size=BS)
    out = run(be, [Segment(prompt(6), 0, table(0, 8), state_slot=0), Segment(prompt(3, 1), 0, table(1, 8), state_slot=1)])
    assert out.shape == (2, 61) and out.dtype == np.float32 and np.isfinite(out).all()


def greedy_by_recompute(be, ids, n):
    out = list(ids)
    for _ in range(n):
        logits = run(be, [Segment(np.array(out, np.int32), 0, table(2), state_slot=be.states.num_slots - 1)])
        out.append(int(np.argmax(logits[0])))
    return out[len(ids):]


def test_scheduler_driver_frees_slots_and_matches_recompute(tiny):
    """What the engine has to do (docs/hybrid.md): a slot per admitted sequence, prefix caching off,
    num_slots >= max_num_seqs, free on finish and on preemption; outputs equal full recompute."""
    from metrale.cache.block_manager import BlockManager
    from metrale.sampling.params import SamplingParams
    from metrale.scheduler.scheduler import Scheduler
    from metrale.scheduler.sequence import Sequence

    path, _, _ = tiny
    be = backend_of(path, slots=3, ckpts=0)
    blocks = BlockManager(num_blocks=6, block_size=BS, prefix_caching=False)
    sched = Scheduler(blocks, max_num_seqs=2, max_num_batched_tokens=8)
    slots = StateSlots(2, 0, be.states)            # slot 2 of the pool is left for the reference
    sched.preempt_listeners.append(slots.free)
    prompts = [prompt(n, 20 + i) for i, n in enumerate([11, 6, 9])]
    seqs = [Sequence([int(t) for t in p], SamplingParams(max_tokens=5, temperature=0.0)) for p in prompts]
    for s in seqs:
        sched.add(s)
    for _ in range(200):
        if not sched.has_work():
            break
        plan = sched.schedule()
        if not plan.scheduled:
            continue
        segs = []
        for item in plan.scheduled:
            seq, a = item.seq, item.seq.num_computed_tokens
            slot = slots.allocate(seq)
            assert slot is not None
            segs.append(Segment(np.array(seq.token_ids[a:a + item.num_tokens], np.int32), a,
                                np.array(seq.block_table, np.int32), "last" if item.needs_logits else "none",
                                state_slot=slot))
        logits, row = be.forward(build_batch(segs, BS)), 0
        for item in plan.scheduled:
            seq, sampled = item.seq, item.needs_logits
            seq.num_computed_tokens += item.num_tokens
            if sampled:
                seq.output_token_ids.append(int(np.argmax(logits[row])))
                row += 1
                if len(seq.output_token_ids) == 5:
                    sched.finish(seq, "length")
                    slots.free(seq)
        slots.check_no_leaks(sched.running)
    assert sched.num_preemptions > 0, "the pool is meant to force a preemption"
    slots.check_no_leaks([])
    for p, seq in zip(prompts, seqs):
        assert seq.output_token_ids == greedy_by_recompute(be, p, 5)
