"""The fused dense layer on the CPU (kernels_numba/cpu_dense.py, through CpuOps' norm_qkv_to_cache,
attention_linear_residual and mlp_residual) against the unfused composition of the same CpuOps
(NumpyOps' definitions of those three calls over CpuOps' products and layer kernels): q, the K/V
written to the cache, and both residual outputs, on the f32 and q8 roads, with and without the qkv
bias and the per-head norms, a windowed layer, at decode batches of 1 and 3 rows and a mixed batch
of a 40-token prefill chunk with a decode row (the parallel norm / RoPE / silu / attention kernels).
Weights are Q4_1 and Q8_0 (SmolLM2's kinds: the suite compiles their products anyway)."""
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import skip_without_q8

from metrale.runtime.batch import Segment, build_batch
from metrale.runtime.cpu_ops import CpuOps
from metrale.runtime.numpy_backend import NumpyOps
from test_cpu_quant import quantized

D, HQ, HK, HD, FFN, BS, BLOCKS = 64, 4, 2, 16, 96, 4, 48


class _Backend:
    """What CpuOps reads of a NumpyBackend: config, kv, rope_for, the CPU levers."""

    def __init__(self, config, kv, cpu_activations):
        self.config, self.kv, self.cpu_activations, self.cpu_threads = config, kv, cpu_activations, 0

    def rope_for(self, batch):
        inv = 1.0 / 10000 ** (np.arange(0, HD, 2) / HD)
        ang = batch.positions[:, None] * inv[None, :]
        return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def _config(window):
    return SimpleNamespace(num_heads=HQ, num_kv_heads=HK, head_dim=HD, q_size=HQ * HD, kv_size=HK * HD,
                           rms_norm_eps=1e-5, rope_interleaved=True, layer_window=lambda layer: window)


def _batch(shape, rng):
    """(new tokens, context) per sequence -> a ForwardBatch over disjoint random blocks."""
    perm, used, segs = rng.permutation(BLOCKS).astype(np.int32), 0, []
    for n, ctx in shape:
        need = -(-ctx // BS)
        segs.append(Segment(np.zeros(n, np.int32), ctx - n, perm[used:used + need]))
        used += need
    return build_batch(segs, BS)


BATCHES = {"decode1": [(1, 23)], "decode3": [(1, 9), (1, 30), (1, 2)], "mixed": [(40, 40), (1, 13)]}


@pytest.mark.parametrize("road", ["f32", "q8"])
@pytest.mark.parametrize("extras,window", [(False, 0), (True, 0), (False, 6)])
@pytest.mark.parametrize("shape", sorted(BATCHES))
def test_fused_layer_equals_its_composition(road, extras, window, shape, rng):
    if road == "q8":
        skip_without_q8()
    batch = _batch(BATCHES[shape], rng)
    T = batch.num_tokens
    vec = lambda n: (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)  # noqa: E731
    qkv = quantized([("q4_1", (HQ + 2 * HK) * HD)], D, rng)
    o, gate_up, down = quantized([("q4_1", D)], HQ * HD, rng), quantized([("q4_1", 2 * FFN)], D, rng), \
        quantized([("q8_0", D)], FFN, rng)
    bias = rng.standard_normal((HQ + 2 * HK) * HD).astype(np.float32) if extras else None
    q_norm, k_norm = (vec(HD), vec(HD)) if extras else (None, None)
    attn_norm, mlp_norm = vec(D), vec(D)
    x = rng.standard_normal((T, D)).astype(np.float32)
    cache = rng.standard_normal((2, 1, BLOCKS, BS, HK, HD)).astype(np.float32)    # K and V of one layer
    outs = []
    for fused in (True, False):
        kv = SimpleNamespace(k=cache[0].copy(), v=cache[1].copy())
        ops = CpuOps(_Backend(_config(window), kv, road), batch)
        ops.fused_layer = fused
        assert (ops._one_group(qkv) is not None) == fused
        compose = CpuOps if fused else NumpyOps                  # NumpyOps': the composition over CpuOps' kernels
        q = compose.norm_qkv_to_cache(ops, x, attn_norm, qkv, bias, 0, q_norm, k_norm)
        r = compose.attention_linear_residual(ops, q, 0, o, x)
        y = compose.mlp_residual(ops, r, mlp_norm, gate_up, down)
        outs.append((q, kv.k, kv.v, r, y))
    names = ("q", "k cache", "v cache", "attention residual", "mlp residual")
    for name, got, want in zip(names, *outs):
        assert got.shape == want.shape and got.dtype == np.float32, name
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=name)
    assert not np.array_equal(outs[0][1], cache[0])               # the batch's K rows were written


def test_fused_layer_falls_back_for_matrices_of_several_kinds(rng):
    """A qkv of Q4_1 q/k and Q8_0 v (two kind groups) takes the composition: the same result."""
    batch = _batch(BATCHES["decode3"], rng)
    qkv = quantized([("q4_1", (HQ + HK) * HD), ("q8_0", HK * HD)], D, rng)
    x, norm = rng.standard_normal((batch.num_tokens, D)).astype(np.float32), np.ones(D, np.float32)
    kv = SimpleNamespace(k=np.zeros((BLOCKS, BS, HK, HD), np.float32), v=np.zeros((BLOCKS, BS, HK, HD), np.float32))
    ops = CpuOps(_Backend(_config(0), kv, "f32"), batch)
    assert ops._one_group(qkv) is None
    got = ops.norm_qkv_to_cache(x, norm, qkv, None, 0, None, None)
    np.testing.assert_array_equal(got, NumpyOps.norm_qkv_to_cache(ops, x, norm, qkv, None, 0, None, None))


def test_cpu_kernels_cache_under_one_stamp_of_all_cpu_sources():
    """Every disk-cached CPU kernel is located by cpu_cache's locator (not jit.py's directory, keyed
    by every kernel module, nor Numba's per-file stamp, blind to cpu_dense's callees elsewhere)."""
    from numba.core.registry import CPUDispatcher

    from kernels_numba import cpu_cache, cpu_dense, cpu_layers, cpu_quant
    if not cpu_cache.CACHE:
        pytest.skip("METRALE_KERNEL_CACHE=0")
    cached = [f for mod in (cpu_quant, cpu_layers, cpu_dense) for f in vars(mod).values()
              if isinstance(f, CPUDispatcher) and f._cache.__class__.__name__ == "FunctionCache"]
    assert len(cached) >= 15
    for f in cached:
        loc = f._cache._impl.locator
        assert isinstance(loc, cpu_cache.CpuKernelLocator), f
        assert loc.get_source_stamp() == cpu_cache.sources_hash()
        assert loc.get_cache_path().startswith(str(cpu_cache.cache_dir()))
    assert {p.name for p in cpu_cache._sources()} >= {"cpu_quant.py", "cpu_layers.py", "cpu_dense.py", "cpu_cache.py"}
