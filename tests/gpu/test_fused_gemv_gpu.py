"""T = 1 GEMV with fused prologues (gemm.gemv) at model sizes, and the batch-1 decode graph they
shrink (run on a GPU: pytest -m gpu)."""
import functools

import numpy as np
import pytest

from kernels_numba import gemm
from kernels_numba.ptx import f32_to_bf16_bits

pytestmark = pytest.mark.gpu

from numba import cuda  # noqa: E402

# (N, K, prologue): Llama-3-8B qkv / o / down / lm_head; SmolLM2-135M qkv / down / lm_head
SHAPES = [(6144, 4096, "rmsnorm"), (4096, 4096, "plain"), (4096, 14336, "silu_mul"),
          (128256, 4096, "rmsnorm"), (960, 576, "rmsnorm"), (576, 1536, "silu_mul"),
          (49152, 576, "rmsnorm")]
# (warps, rows, unroll, smem): the default and the corners of the --fma-sweep grid
CFGS = [(4, 1, 2, False), (8, 4, 1, False), (4, 2, 2, True), (8, 2, 1, True), (4, 4, 1, True)]


@functools.lru_cache(maxsize=None)
def _weights(N, K):
    w = f32_to_bf16_bits(np.random.default_rng(N + K).standard_normal((N, K), np.float32)
                         / np.float32(np.sqrt(K)))
    return w, cuda.to_device(w)


@pytest.mark.parametrize("cfg", CFGS, ids=lambda c: "w%dr%du%d%s" % (c[0], c[1], c[2], "s" if c[3] else ""))
@pytest.mark.parametrize("N,K,prologue", SHAPES)
def test_gemv_prologue(N, K, prologue, cfg):
    w, d_w = _weights(N, K)
    rng = np.random.default_rng(N * 3 + K + sum(cfg))
    kx = 2 * K if prologue == "silu_mul" else K
    x = (2 * rng.standard_normal((1, kx))).astype(np.float32)
    nw = (1 + 0.1 * rng.standard_normal(K)).astype(np.float32)
    acc = prologue == "silu_mul"
    r = rng.standard_normal((1, N)).astype(np.float32)
    bias = rng.standard_normal(N).astype(np.float32) if prologue == "rmsnorm" and N < 8192 else None
    d_out = cuda.to_device(r if acc else np.full((1, N), np.nan, np.float32))
    gemm.gemv(cuda.to_device(x), d_w, d_out, prologue=prologue, norm_w=cuda.to_device(nw), eps=1e-5,
              bias=None if bias is None else cuda.to_device(bias), accumulate=acc,
              path=gemm.gemv_path(N, K, prologue, *cfg))
    out = d_out.copy_to_host()
    ref = gemm.gemv_ref(x, w, prologue, nw, 1e-5, bias, r if acc else None)
    assert np.isfinite(out).all(), "unwritten (NaN-poisoned) or non-finite output"
    err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert err < 1e-4, f"relative error {err:.2e}"


def test_linear_t1_default_path_and_stream():
    N, K = 4096, 4096
    w, d_w = _weights(N, K)
    x = np.random.default_rng(1).standard_normal((1, K)).astype(np.float32)
    d_out = cuda.to_device(np.full((1, N), np.nan, np.float32))
    s = cuda.stream()
    gemm.linear(cuda.to_device(x), d_w, d_out, stream=s)
    s.synchronize()
    ref = gemm.linear_ref(x, w)
    assert np.linalg.norm(d_out.copy_to_host() - ref) / np.linalg.norm(ref) < 1e-4


@pytest.fixture(scope="module")
def smol_pair():
    from metrale import Engine
    on = Engine(model="smollm2-135m-shape", device="cuda", cache={"num_blocks": 256})
    off = Engine(model="smollm2-135m-shape", device="cuda", cache={"num_blocks": 256},
                 levers={"fuse_decode": False})
    return on, off


def test_fused_decode_equals_unfused_and_shrinks_the_graph(smol_pair):
    """Same random weights (same seed) with fuse_decode on and off: the batch-1 greedy tokens and
    the one-row logits agree; the batch-1 graph has per layer norm+qkv+rope+store, attention (+ its
    split-K merge), o+res, norm+gate_up, silu+down+res; + embed, row gather, norm+lm_head, argmax."""
    from metrale import SamplingParams
    from metrale.runtime.batch import Segment, build_batch
    on, off = smol_pair
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, on.model_config.vocab_size, 40)
    p = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    a = on.generate([prompt], p, use_tqdm=False)[0]
    b = off.generate([prompt], p, use_tqdm=False)[0]
    np.testing.assert_array_equal(a.token_ids, b.token_ids)
    one = build_batch([Segment(np.asarray([7], np.int32), 0, np.asarray([1], np.int32), "all")],
                      on.backend.block_size)
    la, lb = on.backend.forward(one), off.backend.forward(one)
    assert np.linalg.norm(la - lb) / np.linalg.norm(lb) < 1e-4
    L = on.model_config.num_layers
    g1 = [g for g in on.backend.graphs if g.tokens == 1]
    assert g1, "batch-1 decode did not run as a CUDA graph"
    n_on = on.backend.graphs[g1[0]].num_nodes
    n_off = off.backend.graphs[[g for g in off.backend.graphs if g.tokens == 1][0]].num_nodes
    print(f"batch-1 graph nodes: fused {n_on}, unfused {n_off} ({L} layers)")
    # fusion removes per layer the two RMSNorm launches, the silu*mul launch and rope/store (the QKV
    # GEMV's epilogue), and the final norm; carried norm sums (on by default) add one memset node
    memset = int(on.backend.carry_norm_sums)
    assert n_off - n_on == 4 * L + 1 - memset, (n_on, n_off)


def test_glu_epilogue_one_row_equals_unfused_on_the_1b_shape():
    """Llama-3.2-1B shape (down input 8192 wide: silu*mul runs as the gate_up GEMV's epilogue at
    one row, with the carried norm sums): greedy tokens and one-row logits equal fuse_decode off;
    the batch-1 graph has one kernel a layer fewer than the silu*mul launch would need."""
    from metrale import Engine, SamplingParams
    from metrale.runtime.batch import Segment, build_batch
    on = Engine(model="llama-3.2-1b-shape", device="cuda", cache={"num_blocks": 128})
    off = Engine(model="llama-3.2-1b-shape", device="cuda", cache={"num_blocks": 128},
                 levers={"fuse_decode": False})
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, on.model_config.vocab_size, 24)
    p = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    np.testing.assert_array_equal(on.generate([prompt], p, use_tqdm=False)[0].token_ids,
                                  off.generate([prompt], p, use_tqdm=False)[0].token_ids)
    one = build_batch([Segment(np.asarray([7], np.int32), 0, np.asarray([1], np.int32), "all")],
                      on.backend.block_size)
    la, lb = on.backend.forward(one), off.backend.forward(one)
    assert np.linalg.norm(la - lb) / np.linalg.norm(lb) < 1e-3
    n_on = on.backend.graphs[[g for g in on.backend.graphs if g.tokens == 1][0]].num_nodes
    n_off = off.backend.graphs[[g for g in off.backend.graphs if g.tokens == 1][0]].num_nodes
    print(f"1B batch-1 graph nodes: fused {n_on}, unfused {n_off}")
    # per layer: two norms, the silu*mul launch and rope/store gone (norms carried, silu*mul in the
    # gate_up epilogue, rope/store in the QKV one), the final norm too; the carried sums' memset added
    L = on.model_config.num_layers
    assert n_off - n_on == 4 * L + 1 - int(on.backend.carry_norm_sums), (n_on, n_off)


def test_batch1_greedy_decode_is_reproducible(smol_pair):
    """The batch-1 graph (carried norm sums: integer atomics, gemm.SS_SCALE) gives the same greedy
    tokens and bit-identical logits run after run; with float atomics a 200-token decode drifted
    between identical runs on the H200 (session 5: spec_bench's 'same as plain' at 0/1 for
    requests that never speculated)."""
    from metrale import SamplingParams
    from metrale.runtime.batch import Segment, build_batch
    on, _ = smol_pair
    assert on.backend.carry_norm_sums
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, on.model_config.vocab_size, 30)
    p = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    runs = [on.generate([prompt], p, use_tqdm=False)[0].token_ids for _ in range(3)]
    for r in runs[1:]:
        np.testing.assert_array_equal(r, runs[0])
    one = build_batch([Segment(np.asarray([7], np.int32), 0, np.asarray([1], np.int32), "all")],
                      on.backend.block_size)
    logits = [on.backend.forward(one) for _ in range(4)]
    for lg in logits[1:]:
        np.testing.assert_array_equal(lg, logits[0])
