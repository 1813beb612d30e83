"""The device MTP head under the simulator: its two glue kernels (kernels_numba/mtp_head.py) against
their references, and MtpCudaHead (metrale/spec/mtp_cuda.py: the target's CudaOps over the head's
one-layer model, the fused input, the K/V pass, the shifted-table window, the rounds fed on the
device, argmax / confidence / d2t) on a tiny dense model against the same plans run by the NumPy
head in float64 (tests/test_mtp_cuda_plan.py PlanHead) with the bf16 weights the device holds.
The target is a stand-in holding the buffers the head shares (the real backend needs the driver)."""
from types import SimpleNamespace

import numpy as np
import pytest
from numba import cuda

from kernels_numba import gemm
from kernels_numba.bf16 import SIMULATOR, bf16_round, to_bf16_bits
from kernels_numba.mtp_head import copy_rows, copy_rows_ref, draft_pick, draft_pick_ref
from metrale.models.config import ModelConfig
from metrale.models.rope import model_rope
from metrale.runtime.cuda_backend import CudaOps
from metrale.spec.mtp import MtpHead
from metrale.spec.mtp_cuda import DeviceRows, MtpCudaDrafter, MtpCudaHead, head_config

pytestmark = pytest.mark.skipif(not SIMULATOR, reason="run with NUMBA_ENABLE_CUDASIM=1")

BS, NB, MAX_LEN, N = 4, 16, 32, 4
CFG = ModelConfig(architecture="llama", vocab_size=128, hidden_size=64, intermediate_size=64, num_layers=2,
                  num_heads=2, num_kv_heads=1, head_dim=64, rms_norm_eps=1e-6, rope_theta=1000.0,
                  rope_interleaved=True, tie_word_embeddings=True, max_position=MAX_LEN, name="tiny-mtp")


@pytest.fixture(autouse=True)
def _sim_patches(monkeypatch):
    """CudaOps compares device pointers; simulator arrays wrap host arrays. Products of a few rows
    take the FMA GEMM: the mma GEMMs are slow here (test_gemm_sim has them)."""
    from metrale.runtime import cuda_backend
    monkeypatch.setattr(cuda_backend, "_ptr", lambda a: a._ary.__array_interface__["data"][0])
    monkeypatch.setattr(gemm, "FMA_MAX_T", 16)


def test_copy_rows():
    rng = np.random.default_rng(0)
    src = rng.standard_normal((5, 40)).astype(np.float32)
    dst = np.zeros((6, 40), np.float32)
    si, di = np.array([4, 0, 2], np.int32), np.array([1, -1, 5], np.int32)
    d_dst = cuda.to_device(dst)
    copy_rows(cuda.to_device(src), cuda.to_device(si), d_dst, cuda.to_device(di))
    np.testing.assert_array_equal(d_dst.copy_to_host(), copy_rows_ref(src, si, dst, di))


@pytest.mark.parametrize("with_d2t", [False, True])
def test_draft_pick(with_d2t):
    rng = np.random.default_rng(1)
    logits = (3 * rng.standard_normal((3, 100))).astype(np.float32)
    idx = np.argmax(logits, -1).astype(np.int32)
    d2t = np.sort(rng.choice(1000, 100, replace=False)).astype(np.int32) if with_d2t else None
    ids, conf = cuda.to_device(np.zeros(3, np.int32)), cuda.to_device(np.zeros(3, np.float32))
    wide = cuda.to_device(np.concatenate([logits, np.full((3, 28), 50.0, np.float32)], 1))   # columns past V unread
    draft_pick(wide[:, :100], cuda.to_device(idx), None if d2t is None else cuda.to_device(d2t), ids, conf)
    want_ids, want_conf = draft_pick_ref(logits, idx, d2t)
    np.testing.assert_array_equal(ids.copy_to_host(), want_ids)
    np.testing.assert_allclose(conf.copy_to_host(), want_conf, rtol=1e-5)


def head_tensors(seed: int) -> dict:
    r = np.random.default_rng(seed)
    c, D, F = CFG, CFG.hidden_size, CFG.intermediate_size
    norm = lambda: (1 + 0.1 * r.standard_normal(D)).astype(np.float32)  # noqa: E731
    mat = lambda n, k: (r.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)  # noqa: E731
    return {"enorm": norm(), "hnorm": norm(), "eh_proj": mat(D, 2 * D), "attn_norm": norm(), "mlp_norm": norm(),
            "qkv": mat(c.q_size + 2 * c.kv_size, D), "o": mat(D, c.q_size), "gate_up": mat(2 * F, D),
            "down": mat(D, F)}


class SimTarget:
    """The attributes of a CudaBackend the head reads, on simulator arrays."""
    name = "cuda"

    def __init__(self, embed: np.ndarray, final_norm: np.ndarray, fuse: bool):
        self.config, self.block_size, self.num_blocks = CFG, BS, NB
        self.max_rows = self.max_seqs = N
        self.max_model_len, self.max_blocks = MAX_LEN, MAX_LEN // BS
        self.stream = SimpleNamespace(numba=0, handle=0, synchronize=lambda: None)
        self.weights = {"embed": cuda.to_device(to_bf16_bits(embed)), "final_norm": cuda.to_device(final_norm)}
        self.act = {"rows": cuda.to_device(np.zeros((N, CFG.hidden_size), np.float32))}
        cos, sin = model_rope(CFG).tables(MAX_LEN)
        self.cos, self.sin = cuda.to_device(cos.astype(np.float32)), cuda.to_device(sin.astype(np.float32))
        self.ops_class, self.use_graphs, self.graph_sizes, self.blas = CudaOps, False, [], None
        self.fuse_decode, self.prefetch_o_proj, self.flash_decode = fuse, False, False
        self.prefill_min_tokens, self.skinny_max_t = 16, gemm.FMA_MAX_T

    def set_rows(self, rows: np.ndarray) -> DeviceRows:
        self.act["rows"][:len(rows)].copy_to_device(np.ascontiguousarray(rows, np.float32))
        return DeviceRows(self, len(rows))


def seq(rid, tokens, computed, table):
    toks = list(tokens)
    return SimpleNamespace(request_id=rid, token_ids=toks, num_tokens=len(toks), num_computed_tokens=computed,
                           block_table=list(table), token_slice=lambda a, b: toks[a:b])


def sched(s, n, draft=()):
    return SimpleNamespace(seq=s, num_tokens=n, draft=list(draft))


@pytest.mark.parametrize("fuse,with_d2t", [(True, True)])     # the default (fused one-row ops); one case: the simulator is slow
def test_device_head_matches_the_numpy_head(fuse, with_d2t):
    """Two sequences whose windows start mid-block (lo = 6 and 3, block size 4): their prefill rows,
    a proposal of 2 and 1 drafts, a verify block with one accepted draft beside a decode row, a
    proposal of 2 and 2; each round's logits and draft equal the NumPy head's on the same plans."""
    from test_mtp_cuda_plan import PlanHead          # tests/ (the conftest's directory) is on sys.path
    rng = np.random.default_rng(7)
    embed = bf16_round(rng.standard_normal((CFG.vocab_size, CFG.hidden_size)))
    final_norm = (1 + 0.1 * rng.standard_normal(CFG.hidden_size)).astype(np.float32)
    tensors = head_tensors(3)
    d2t = np.sort(rng.choice(CFG.vocab_size, 40, replace=False)).astype(np.int32) if with_d2t else None
    target = SimTarget(embed, final_norm, fuse)
    dev_head = MtpCudaHead(target, head_config(CFG), tensors, d2t=d2t, max_drafts=2)
    dev_head.logits_log = []
    device = MtpCudaDrafter(dev_head)
    # the NumPy head on the weights the device holds (bf16 matrices), float64
    host_w = {n: (bf16_round(a) if a.ndim == 2 else a).astype(np.float64) for n, a in tensors.items()}
    host_w.update(embed=embed.astype(np.float64), final_norm=final_norm.astype(np.float64))
    kw = {} if d2t is None else {"d2t": d2t}
    ref = PlanHead(MtpHead(head_config(CFG), host_w, num_blocks=NB, block_size=BS, dtype=np.float64, **kw), N)
    host = MtpCudaDrafter(ref)
    D = CFG.hidden_size
    checks = []

    def observe(scheduled, emitted, rows):
        rows = rows.astype(np.float32)
        device.observe(scheduled, emitted, target.set_rows(rows))
        host.observe(scheduled, emitted, rows)

    def propose(seqs, ks):
        dev_head.logits_log = []
        want, got = host.propose(seqs, ks), device.propose(seqs, ks)
        assert len(dev_head.logits_log) == len(ref.logits_log) == max(ks)
        for (j, lg), (_, lr) in zip(dev_head.logits_log, ref.logits_log):
            err = np.linalg.norm(lg - lr) / np.linalg.norm(lr)
            assert err < 2e-2, (j, err)
        for g, w in zip(got, want):
            assert len(g.tokens) == len(w.tokens)
            np.testing.assert_allclose(g.confidences, w.confidences, rtol=5e-2, atol=2e-3)
            checks.append((g.tokens, w.tokens))
        return got

    ta, tb = [3, 9, 5, 12, 1], [7, 2, 11]
    a = seq("a", rng.integers(0, 128, 7), 0, ta)
    b = seq("b", rng.integers(0, 128, 4), 0, tb)
    observe([sched(a, 7), sched(b, 4)], [[40], [41]], 2 * rng.standard_normal((2, D)))
    a = seq("a", list(a.token_ids) + [40], 7, ta)
    b = seq("b", list(b.token_ids) + [41], 4, tb)
    d1 = propose([a, b], [2, 1])
    # a verifies 1 + 2 rows (positions 7..9): its first draft accepted, then a correction; b decodes one
    emitted = [[d1[0].tokens[0], 55], [60]]
    observe([sched(seq("a", a.token_ids, 7, ta), 3, draft=d1[0].tokens), sched(seq("b", b.token_ids, 4, tb), 1)],
            emitted, 2 * rng.standard_normal((4, D)))
    a = seq("a", list(a.token_ids) + emitted[0], 9, ta)
    b = seq("b", list(b.token_ids) + emitted[1], 5, tb)
    propose([a, b], [2, 2])
    same = sum(g == w for g, w in checks)
    assert same == len(checks), checks
    if d2t is not None:
        assert all(t in set(d2t.tolist()) for g, _ in checks for t in g)
