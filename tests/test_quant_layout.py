"""The host side of the quantized kernels (kernels_numba.quant_layout), no GPU: the repack into
planes keeps every byte and decodes exactly to gguf's dequantization for every type; the q8
activation quantization matches its definition; bad shapes are refused; QuantizedPart.repack."""
import gguf
import numpy as np
import pytest

from kernels_numba import quant_layout as L


@pytest.mark.parametrize("qt", L.TYPES, ids=[L.NAMES[t] for t in L.TYPES])
@pytest.mark.parametrize("rows,cols", [(3, 256), (5, 4096), (2, 14336)])
def test_repack_decodes_to_gguf(qt, rows, cols):
    rng = np.random.default_rng(qt + cols)
    data = L.random_blocks(qt, rows, cols, rng)
    planes = L.repack(qt, data, cols)
    assert L.plane_bytes(planes) == data.nbytes
    for name, p in planes.items():
        if p is not None:
            assert p.dtype == np.uint8 and p.flags.c_contiguous and p.shape[0] == rows, name
    assert planes["qs"].shape[1] % 16 == 0                     # 16-byte rows for ld.global.v4
    assert np.array_equal(L.dequant_planes(qt, planes, cols), L.gguf_dequantize(qt, data))


def test_repack_of_gguf_quantized_floats():
    """Blocks from gguf's own quantizer (not random bytes) for the types it can write."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((4, 512)).astype(np.float32)
    for qt in (L.Q4_0, L.Q4_1, L.Q5_0, L.Q5_1, L.Q8_0):
        data = gguf.quants.quantize(w, gguf.GGMLQuantizationType(qt))
        assert np.array_equal(L.dequant_planes(qt, L.repack(qt, data, 512), 512), L.gguf_dequantize(qt, data))


def test_q8_quantize():
    rng = np.random.default_rng(2)
    x = (3 * rng.standard_normal((3, 128))).astype(np.float32)
    x[1, 32:64] = 0.0                                            # an all-zero group
    q, d8 = L.q8_quantize(x)
    assert q.dtype == np.int8 and d8.shape == (3, 4) and d8[1, 1] == 0 and not q[1, 32:64].any()
    g = x.reshape(3, 4, 32)
    assert np.array_equal(np.abs(q.reshape(3, 4, 32)).max(-1)[d8 > 0], np.full((d8 > 0).sum(), 127))
    err = np.abs(L.q8_dequantize(q, d8) - x).reshape(3, 4, 32)
    assert (err <= 0.5 * d8[..., None] * (1 + 1e-6)).all()       # round to nearest
    assert np.allclose(L.gemv_ref(x, np.eye(128, dtype=np.float32)), L.q8_dequantize(q, d8))
    assert np.abs(g).max() > 0


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="multiple of 256"):
        L.repack(L.Q4_K, np.zeros((2, 144), np.uint8), 576)
    with pytest.raises(ValueError, match="uint8"):
        L.repack(L.Q4_0, np.zeros((2, 17), np.uint8), 32)
    with pytest.raises(ValueError, match="is not one of"):
        L.check_shape(1, 2, 32)


def test_quantized_part_repack():
    from metrale.models.quantized import QuantizedPart
    rng = np.random.default_rng(3)
    data = L.random_blocks(L.Q6_K, 4, 512, rng)
    part = QuantizedPart(gguf.GGMLQuantizationType.Q6_K, 4, 512, data)
    planes = part.repack()
    assert np.array_equal(L.dequant_planes(L.Q6_K, planes, 512), part.dequantize())
