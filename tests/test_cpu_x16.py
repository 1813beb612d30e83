"""The 16-rows-a-vpdpbusd products on regrouped legacy blocks (kernels_numba/cpu_x16.py) against the
exact arithmetic of 8-bit activations on gguf's dequantization (cpu_quant.matmul_q8_ref)."""
import numpy as np
import pytest

from kernels_numba import cpu_quant as Q
from kernels_numba import cpu_x16 as X
from test_cpu_quant import random_rows

from metrale.runtime.cpu_ops import has_q8

# every product here is an integer dot product (AVX-512 VNNI or AVX2)
pytestmark = pytest.mark.skipif(not has_q8(), reason="the x16 kernels need AVX2 or AVX-512 VNNI")


def product(parts: list[np.ndarray], kind: str, x: np.ndarray, residual=None, norm=None) -> np.ndarray:
    T, K = x.shape
    blocks = [X.repack_x16(p, kind) for p in parts]
    rows = [p.shape[0] for p in parts]
    cols = np.zeros(Q.MAX_PARTS, np.int64)
    cols[:len(rows)] = np.cumsum([0] + rows[:-1])
    y = np.full((T, sum(rows)), np.nan, np.float32)
    res = np.zeros((0, 0), np.float32) if residual is None else residual
    nw = np.zeros(0, np.float32) if norm is None else norm
    X.matmul_x16_into(Q.pad_parts(blocks), len(blocks), cols, x, nw, 1e-5, np.empty_like(x),
                      np.empty(x.shape, np.int8), np.empty(X.scales_shape(T, K), np.float32), res, y)
    return y


@pytest.mark.parametrize("kind", X.X16_KINDS)
@pytest.mark.parametrize("cols", [96, 128])
def test_products_equal_their_exact_arithmetic(kind, cols, rng):
    parts = [random_rows(kind, 32, cols, rng), random_rows(kind, 16, cols, rng)]
    data = np.concatenate(parts)
    for T in (1, 3, 8, 11):
        x = rng.standard_normal((T, cols)).astype(np.float32)
        got = product(parts, kind, x)
        exact = Q.matmul_q8_ref(x, data, kind)
        tol = 1e-5 * np.abs(x).sum(1, keepdims=True) * np.abs(Q.dequantize_ref(data, kind)).max()
        assert (np.abs(got - exact) <= tol).all(), (kind, T, np.abs(got - exact).max())
        if T > 1:                                   # a token's product does not depend on its batch
            np.testing.assert_array_equal(got[1:2], product(parts, kind, x[1:2]))


def test_residual_and_norm(rng):
    kind, cols = "q4_1", 128
    data = random_rows(kind, 48, cols, rng)
    x = rng.standard_normal((5, cols)).astype(np.float32)
    res = rng.standard_normal((5, 48)).astype(np.float32)
    norm = rng.uniform(0.5, 1.5, cols).astype(np.float32)
    normed = x / np.sqrt((x.astype(np.float64) ** 2).mean(1, keepdims=True) + 1e-5) * norm
    got = product([data], kind, x, residual=res, norm=norm)
    want = res + Q.matmul_q8_ref(normed.astype(np.float32), data, kind)
    tol = 1e-4 * np.abs(normed).sum(1, keepdims=True) * np.abs(Q.dequantize_ref(data, kind)).max()
    assert (np.abs(got - want) <= tol).all()


def test_repack_keeps_the_bytes_and_refuses_ragged_groups(rng):
    data = random_rows("q4_1", 32, 64, rng)
    packed = X.repack_x16(data, "q4_1")
    assert packed.nbytes == data.nbytes and not packed.flags.writeable
    assert sorted(packed.view(np.uint8).ravel().tolist()) == sorted(data.ravel().tolist())
    with pytest.raises(ValueError, match="multiple of 16"):
        X.repack_x16(random_rows("q4_1", 24, 64, rng), "q4_1")
    assert not X.repackable("q4_k", 32) and not X.repackable("q8_0", 24) and X.repackable("q8_0", 48)
