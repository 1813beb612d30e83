"""The Numba CPU products on quantized weights (kernels_numba/cpu_quant.py) against the gguf
package's dequantization: every block type, decoded rows and dot products at 1 to 8 activation
rows; the parallel multi-part product on the types real files carry (Q4_1 + Q8_0 SmolLM2, a
Q4_K_M-style Q4_K + Q6_K stack, dense f32). Small shapes: each kernel compiles once per type."""
import gguf
import numpy as np
import pytest
from conftest import skip_without_q8
from numba import njit

from kernels_numba import cpu_quant as Q
from metrale.models.quantized import QuantizedPart, QuantizedTensor

GGML = {"q4_0": "Q4_0", "q4_1": "Q4_1", "q5_0": "Q5_0", "q5_1": "Q5_1", "q8_0": "Q8_0",
        "q4_k": "Q4_K", "q5_k": "Q5_K", "q6_k": "Q6_K"}


def random_rows(kind: str, rows: int, cols: int, rng) -> np.ndarray:
    """uint8 [rows, bytes]: gguf.quants.quantize where it supports the type; K-quants (which it
    cannot quantize) as random bytes with sane fp16 scales; dense kinds as their own bytes."""
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    if kind == "f32":
        return x.view(np.uint8).reshape(rows, -1)
    if kind == "f16":
        return x.astype(np.float16).view(np.uint8).reshape(rows, -1)
    if kind == "bf16":
        return gguf.quants.quantize(x, gguf.GGMLQuantizationType.BF16)
    if kind not in ("q4_k", "q5_k", "q6_k"):
        return gguf.quants.quantize(x, gguf.GGMLQuantizationType[GGML[kind]])
    block, nbytes = Q.KINDS[kind]
    raw = rng.integers(0, 256, (rows, cols // block, nbytes), dtype=np.uint8)
    scale = (rng.uniform(0.5, 2.0, (rows, cols // block, 1)) / 64).astype(np.float16).view(np.uint8)
    if kind == "q6_k":
        raw[..., 208:210] = scale
    else:
        raw[..., 0:2] = scale                      # d
        raw[..., 2:4] = scale                      # dmin
    return raw.reshape(rows, -1)


@njit
def _probe(w, x, rows_out, dots_out):
    """Every row decoded; x . W[r] one activation row a pass and two a pass (small to compile: the
    parallel product's other widths are the same code, test_matmul_parts_against_dequantize)."""
    xa, xs = x.ctypes.data, x.strides[0]
    for r in range(w.shape[0]):
        Q.row_decode(w, r, rows_out[r:].ctypes.data)
        for t in range(0, x.shape[0], 2):
            s2 = Q.row_dot(w, r, xa + t * xs, xs, 2)
            dots_out[1, t, r], dots_out[1, t + 1, r] = s2[0], s2[1]
            dots_out[0, t, r] = Q.row_dot(w, r, xa + t * xs, xs, 1)[0]
            dots_out[0, t + 1, r] = Q.row_dot(w, r, xa + (t + 1) * xs, xs, 1)[0]


@pytest.mark.parametrize("kind", sorted(Q.KINDS))
def test_decode_and_dot_every_kind(kind, rng):
    cols = 512 if Q.KINDS[kind][0] == 256 else 96
    data = random_rows(kind, 6, cols, rng)
    ref = Q.dequantize_ref(data, kind)
    x = rng.standard_normal((4, cols)).astype(np.float32)
    rows = np.empty((6, cols), np.float32)
    dots = np.empty((2, 4, 6), np.float32)
    _probe(Q.as_blocks(data, kind), x, rows, dots)
    np.testing.assert_array_equal(rows, ref)
    want = x.astype(np.float64) @ ref.astype(np.float64).T
    tol = 1e-5 * np.abs(x).sum(1, keepdims=True) * np.abs(ref).max()
    assert (np.abs(dots[0] - want) <= tol).all()
    np.testing.assert_array_equal(dots[0], dots[1])      # a token's product does not depend on its batch


@njit
def _probe_q8(w, x, xq, xs, dots_out):
    """quantize_q8, then x . W[r] by the integer kernel one activation row a pass and two a pass."""
    Q.quantize_q8(x, xq, xs, 0, x.shape[0])
    qa, qs, sa, ss = xq.ctypes.data, xq.strides[0], xs.ctypes.data, xs.strides[0]
    for r in range(w.shape[0]):
        for t in range(0, x.shape[0], 2):
            s2 = Q.row_dot_q8(w, r, qa + t * qs, qs, sa + t * ss, ss, 2)
            dots_out[1, t, r], dots_out[1, t + 1, r] = s2[0], s2[1]
            for i in (t, t + 1):
                dots_out[0, i, r] = Q.row_dot_q8(w, r, qa + i * qs, qs, sa + i * ss, ss, 1)[0]


@pytest.mark.parametrize("kind", Q.Q8_KINDS)
@pytest.mark.parametrize("blocks", [3, 4])
def test_q8_activations_every_kind(kind, blocks, rng):
    """The integer path against its exact arithmetic (gguf's W against x quantized as the kernel does)
    and, within the activation rounding, against the float product; rows of an odd and an even
    number of 32-column units (the kernel pairs them)."""
    skip_without_q8()
    cols = Q.KINDS[kind][0] * (blocks - 1 if Q.KINDS[kind][0] == 256 else blocks)
    data = random_rows(kind, 6, cols, rng)
    x = rng.standard_normal((4, cols)).astype(np.float32)
    xq, xs = np.empty(x.shape, np.int8), np.empty(Q.q8_scales_shape(4, cols), np.float32)
    dots = np.empty((2, 4, 6), np.float32)
    _probe_q8(Q.as_blocks(data, kind), x, xq, xs, dots)
    want_q, want_d = Q.quantize_q8_ref(x)
    np.testing.assert_array_equal(xq, want_q[:, Q.q8_order(cols)])      # pair order
    np.testing.assert_allclose(Q.q8_block_scales(xs, cols), want_d, rtol=1e-6)      # max / 127 (fast-math: * 1/127)
    ref = Q.dequantize_ref(data, kind)
    exact = Q.matmul_q8_ref(x, data, kind)
    tol = 1e-5 * np.abs(x).sum(1, keepdims=True) * np.abs(ref).max()
    assert (np.abs(dots[0] - exact) <= tol).all()
    np.testing.assert_array_equal(dots[0], dots[1])
    rounding = (np.abs(x).reshape(4, -1, 32).max(-1) / 127 / 2).repeat(32, 1)    # |x - dequantized xq| bound
    assert (np.abs(dots[0] - Q.matmul_ref(x, data, kind)) <= rounding @ np.abs(ref).T * 1.0001 + tol).all()


def tol_of(x, ref):
    return 1e-5 * np.abs(x).sum(1, keepdims=True) * np.abs(ref).max()


def quantized(parts: list[tuple[str, int]], cols: int, rng) -> QuantizedTensor:
    return QuantizedTensor(tuple(QuantizedPart(gguf.GGMLQuantizationType[GGML[k]], rows, cols,
                                               random_rows(k, rows, cols, rng)) for k, rows in parts))


# SmolLM2's qkv; a mixed stack as Q4_K_M files have (Q4_K q/k, Q6_K v) but in the two types SmolLM2
# uses, whose kernels the suite compiles anyway (the K-quant decoders: the test above)
@pytest.mark.parametrize("parts,cols", [([("q4_1", 40), ("q4_1", 24), ("q4_1", 24)], 64),
                                        ([("q4_1", 24), ("q4_1", 8), ("q8_0", 8), ("q4_1", 16), ("q8_0", 40)], 64)])
def test_matmul_parts_against_dequantize(parts, cols, rng):
    from metrale.runtime.cpu_ops import CpuMatrix, has_q8
    w = quantized(parts, cols, rng)
    m = CpuMatrix(w)
    q8_road = has_q8()
    ref = w.dequantize().astype(np.float64)
    for T in (1, 3, 13):
        x = rng.standard_normal((T, cols)).astype(np.float32)
        want = x @ ref.T
        got = m.matmul(x)
        q8 = np.concatenate([Q.matmul_q8_ref(x, p.data, p.ggml_type.name.lower()) for p in w.parts], axis=1)
        if q8_road:
            assert (np.abs(m.matmul(x, q8=True) - q8) <= tol_of(x, ref)).all()
        assert (np.abs(got - want) <= tol_of(x, ref)).all()
        res = rng.standard_normal(got.shape).astype(np.float32)
        np.testing.assert_allclose(m.matmul(x, residual=res), res + got, rtol=1e-6, atol=1e-6)
        norm = (1 + 0.1 * rng.standard_normal(cols)).astype(np.float32)
        xn = x / np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=-1, keepdims=True) + 1e-5) * norm
        assert (np.abs(m.matmul(x, norm=norm, eps=1e-5) - xn @ ref.T) <= tol_of(xn, ref)).all()
        if q8_road:
            got = m.matmul(x, norm=norm, eps=1e-5, residual=res, q8=True)    # the first kind's kernel norms
            step = np.abs(xn).reshape(T, -1, 32).max(-1).repeat(32, 1) / 127   # one int8 step of each xq
            assert (np.abs(got - res - xn @ ref.T) <= step @ np.abs(ref).T + tol_of(xn, ref)).all()
    ids = np.array([0, len(ref) - 1, 30, 30])
    np.testing.assert_array_equal(m.rows(ids), ref[ids].astype(np.float32))


def test_matmul_dense_f32(rng):
    from metrale.runtime.cpu_ops import CpuMatrix
    w = rng.standard_normal((37, 48)).astype(np.float32)
    x = rng.standard_normal((9, 48)).astype(np.float32)
    np.testing.assert_allclose(CpuMatrix(w).matmul(x), x @ w.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(CpuMatrix(w).rows(np.array([3, 36])), w[[3, 36]])


def test_as_blocks_refuses_rows_that_are_not_whole_blocks():
    with pytest.raises(ValueError, match="q4_1: rows of 20-byte blocks"):
        Q.as_blocks(np.zeros((2, 30), np.uint8), "q4_1")


@pytest.mark.parametrize("rows", [5, 32])
def test_q8_0_extreme_bytes_do_not_saturate(rows, rng):
    """Q8_0 weights at +-127 / -128 against activations at +-127 steps: offset to unsigned bytes
    (up to 255) their pair products would overflow AVX2's 16-bit pair sums; the row road and, at 32
    rows, the 16-row one."""
    skip_without_q8()
    from metrale.runtime.cpu_ops import CpuMatrix
    cols = 128
    q = rng.choice(np.array([127, -128, 127, 126], np.int8), (rows, cols // 32, 32))
    blocks = np.empty((rows, cols // 32, 34), np.uint8)
    blocks[..., :2] = np.full((rows, cols // 32, 1), 1 / 64, np.float16).view(np.uint8)
    blocks[..., 2:] = q.view(np.uint8)
    data = blocks.reshape(rows, -1)
    w = QuantizedTensor((QuantizedPart(gguf.GGMLQuantizationType.Q8_0, rows, cols, data),))
    x = np.repeat(rng.choice([-3.0, 3.0], (3, cols // 32)), 32, axis=1).astype(np.float32)
    want = Q.matmul_q8_ref(x, data, "q8_0")
    got = CpuMatrix(w).matmul(x, q8=True)
    assert (np.abs(got - want) <= tol_of(x, want)).all(), np.abs(got - want).max()
