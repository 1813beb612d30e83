"""The fast CPU path end to end: the GGUF loader keeping weights quantized, CpuOps against NumpyOps
on the embedded SmolLM2 (Q4_1 + Q8_0), the lever that selects the path."""
import itertools

import numpy as np
import pytest

from metrale.models.quantized import QuantizedPart, QuantizedTensor


def write_tiny_gguf(path, rng, layers=2, hidden=64, ffn=128, heads=4, kv_heads=2, vocab=288,
                    low="q4_1", high="q8_0"):
    """A tiny llama GGUF mixing block types as Q4_K_M files do (`low` q/k/gate/up/o, `high` v/down,
    Q8_0 embeddings, f32 norms). The defaults are SmolLM2's two types, whose kernels the suite
    compiles anyway; the K-quant decoders are covered in test_cpu_quant.py."""
    import gguf
    from test_cpu_quant import random_rows
    T = gguf.GGMLQuantizationType
    from test_gguf_export import llama_header
    w = gguf.GGUFWriter(str(path), "llama")
    llama_header(w, hidden=hidden, ffn=ffn, layers=layers, heads=heads, kv_heads=kv_heads, vocab=vocab, context=256)
    hd = hidden // heads

    def add(name, kind, rows, cols):
        data = random_rows(kind, rows, cols, rng)
        w.add_tensor(name, data, raw_shape=(rows, data.shape[1]), raw_dtype=T[kind.upper()])

    add("token_embd.weight", "q8_0", vocab, hidden)
    for i in range(layers):
        p = f"blk.{i}."
        for n in ("attn_norm", "ffn_norm"):
            w.add_tensor(p + n + ".weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
        add(p + "attn_q.weight", low, heads * hd, hidden)
        add(p + "attn_k.weight", low, kv_heads * hd, hidden)
        add(p + "attn_v.weight", high, kv_heads * hd, hidden)
        add(p + "attn_output.weight", low, hidden, heads * hd)
        add(p + "ffn_gate.weight", low, ffn, hidden)
        add(p + "ffn_up.weight", low, ffn, hidden)
        add(p + "ffn_down.weight", high, hidden, ffn)
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("cpu") / "tiny-mixed.gguf", np.random.default_rng(7))


@pytest.mark.parametrize("low,high", [("q4_1", "q8_0"), ("q4_k", "q6_k")])
def test_load_gguf_keeps_block_matrices_quantized(low, high, tmp_path):
    from metrale.models.checkpoint import load_gguf
    path = write_tiny_gguf(tmp_path / "t.gguf", np.random.default_rng(1), hidden=256, ffn=256, low=low, high=high)
    config, _, quant = load_gguf(path, keep_quantized=True)
    _, _, dense = load_gguf(path)
    lo, hi = low.upper(), high.upper()
    kinds = {"embed": ["Q8_0"], "qkv": [lo, lo, hi], "gate_up": [lo, lo], "o": [lo], "down": [hi]}
    names = []
    for (name, q), (name2, d) in zip(quant(), dense(), strict=True):
        assert name == name2
        names.append(name)
        short = name.rsplit(".", 1)[-1]
        if short in kinds:
            assert isinstance(q, QuantizedTensor), name
            assert [p.ggml_type.name for p in q.parts] == kinds[short], name
            np.testing.assert_array_equal(q.dequantize(), d)
        else:
            assert isinstance(q, np.ndarray) and q.dtype == np.float32, name
            np.testing.assert_array_equal(q, d)
    assert "lm_head" not in names and config.tie_word_embeddings




def tiny_engines(path):
    from metrale import Engine
    levers = ({"cpu_kernels": "numba", "cpu_activations": "f32"}, {"cpu_kernels": "numba", "cpu_activations": "q8"},
              {"cpu_kernels": "numpy"})
    return [Engine(model=str(path), device="cpu", levers=lv) for lv in levers]


def test_fast_path_against_numpy_on_quantized_weights(tiny_gguf):
    """CpuOps on the file's blocks (Q4_1 and Q8_0 mixed in qkv) against NumpyOps on their float32
    expansion: logits of a prefill of two sequences and of decode steps, with float32 activations
    (summation order apart, the reference's arithmetic) and with 8-bit ones (the default with AVX2 or VNNI; a random
    model amplifies their rounding: only a loose agreement here; test_cpu_quant checks the kernels)."""
    from conftest import scratch_blocks, skip_without_q8
    from metrale.runtime.batch import Segment, build_batch
    from metrale.runtime.cpu_ops import CpuOps
    skip_without_q8()
    from metrale.runtime.numpy_backend import NumpyOps
    engines = tiny_engines(tiny_gguf)
    f32, q8, ref = engines
    assert issubclass(f32.backend.ops_class, CpuOps) and ref.backend.ops_class is NumpyOps
    assert (f32.backend.cpu_activations, q8.backend.cpu_activations) == ("f32", "q8")
    assert isinstance(q8.backend.weights["layers.0.qkv"], QuantizedTensor)
    assert isinstance(ref.backend.weights["layers.0.qkv"], np.ndarray)
    assert q8.backend.memory_report()["weights_bytes"] < ref.backend.memory_report()["weights_bytes"] / 4
    rng = np.random.default_rng(3)
    a, b = rng.integers(0, 258, 21).astype(np.int32), rng.integers(0, 258, 5).astype(np.int32)
    outs = []
    for eng in engines:
        with scratch_blocks(eng, 64) as blocks:
            bs = eng.backend.block_size
            steps = [build_batch([Segment(a, 0, blocks[:2], logits="all"), Segment(b, 0, blocks[2:3], logits="all")], bs)]
            steps += [build_batch([Segment(np.array([7 + i], np.int32), 21 + i, blocks[:2]),
                                   Segment(np.array([9 + i], np.int32), 5 + i, blocks[2:3])], bs) for i in range(3)]
            outs.append([eng.backend.forward(s) for s in steps])
    for got_f32, got_q8, want in zip(*outs):
        scale = np.abs(want).max()
        assert np.abs(got_f32 - want).max() <= 2e-4 * scale
        assert np.corrcoef(got_q8.ravel(), want.ravel())[0, 1] > 0.99


def test_cpu_engine_does_not_load_cuda():
    """A CPU-only engine imports no CUDA kernel module: numba.cuda (and libnvJitLink, mapped by the
    first cuda.jit definition) cost ~40 MB resident; the host reads the CUDA-free *_ref modules."""
    import subprocess
    import sys
    code = ("import sys; from metrale import Engine; "
            "e = Engine(model='tiny-shape', device='cpu', cache={'num_blocks': 8}); "
            "e.generate(['hi'], use_tqdm=False); "
            "print(sorted(m for m in sys.modules if m == 'numba.cuda' or m.startswith(('kernels_numba.sampling', "
            "'kernels_numba.moe', 'kernels_numba.gdn'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "['kernels_numba.gdn_ref', 'kernels_numba.moe_ref', 'kernels_numba.sampling_ref']"
