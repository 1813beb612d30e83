"""levers.weights (native | bf16) without a GPU: the lever and its preset, what load_gguf announces
(QuantizedStream), which road each op of a quantized model takes (QuantOps over a recording stand-in
of CudaOps), the many-rows scratch plan and its row chunks, and the memory accounting (a Q4_K
8B-shape model's device weights ~ its file size). write_quant_gguf is the tiny mixed-type model the
GPU test (tests/gpu/test_quant_backend_gpu.py) runs."""
from types import SimpleNamespace

import numpy as np
import pytest

from kernels_numba import quant_layout as L

# one llama GGUF mixing every block type the kernels cover, row-stacked qkv / gate_up of two types,
# a dense F16 matrix among quantized ones, untied Q6_K output (CUDA sizes: multiples of 64)
LAYER_TYPES = [
    {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q5_K",
     "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q6_K"},
    {"attn_q": "Q4_0", "attn_k": "Q4_0", "attn_v": "Q8_0", "attn_output": "F16",
     "ffn_gate": "Q5_0", "ffn_up": "Q5_1", "ffn_down": "Q4_1"},
]


def _kquant_std(qtype: int) -> float:
    """The std of random_blocks' dequantized values at scale 1 (gguf's own dequantization)."""
    import gguf
    blocks = L.random_blocks(qtype, 64, 1024, np.random.default_rng(0))
    return float(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(qtype)).std())


KQUANT_STD = {q: _kquant_std(q) for q in (L.Q4_K, L.Q5_K, L.Q6_K)}


def write_quant_gguf(path, seed=0, hidden=256, ffn=512, heads=4, kv_heads=2, vocab=512, embed="Q8_0",
                     output="Q6_K", layer_types=LAYER_TYPES):
    """A tiny llama GGUF of the given block types (random blocks of weight-like scale; legacy types
    quantized from Gaussian weights by gguf itself) with a byte tokenizer; returns path."""
    import gguf
    from test_gguf_export import llama_header
    rng = np.random.default_rng(seed)
    T = gguf.GGMLQuantizationType
    w = gguf.GGUFWriter(str(path), "llama")
    llama_header(w, hidden=hidden, ffn=ffn, layers=len(layer_types), heads=heads, kv_heads=kv_heads, vocab=vocab,
                 context=1024)
    hd = hidden // heads

    def add(name, kind, rows, cols, std=None):
        std = std if std is not None else cols ** -0.5
        x = (std * rng.standard_normal((rows, cols))).astype(np.float32)
        if kind == "F16":
            w.add_tensor(name, x.astype(np.float16))
            return
        qt = int(T[kind])
        if qt in L.KQUANTS:     # gguf cannot quantize K-quants: random blocks, values of about std
            data = L.random_blocks(qt, rows, cols, rng, scale=std / KQUANT_STD[qt])
        else:
            data = gguf.quants.quantize(x, T[kind])
        w.add_tensor(name, data, raw_shape=(rows, data.shape[1]), raw_dtype=T[kind])

    add("token_embd.weight", embed, vocab, hidden, std=1.0)
    sizes = {"attn_q": (heads * hd, hidden), "attn_k": (kv_heads * hd, hidden), "attn_v": (kv_heads * hd, hidden),
             "attn_output": (hidden, heads * hd), "ffn_gate": (ffn, hidden), "ffn_up": (ffn, hidden),
             "ffn_down": (hidden, ffn)}
    for i, types in enumerate(layer_types):
        p = f"blk.{i}."
        for n in ("attn_norm", "ffn_norm"):
            w.add_tensor(p + n + ".weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
        for n, kind in types.items():
            add(p + n + ".weight", kind, *sizes[n])
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    if output is not None:
        add("output.weight", output, vocab, hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_quant_gguf(tmp_path_factory.mktemp("quant") / "tiny-quant.gguf")


# ----------------------------------------------------------------------------- the lever
def test_lever_values_default_and_bisect_preset():
    from metrale.settings import ConfigError, compose
    assert compose([]).levers.weights == "bf16"             # native once its GPU tests have run
    assert compose(["levers.weights=native"]).levers.weights == "native"
    assert compose(["+lever=bisect"]).levers.weights == "bf16"
    with pytest.raises(ConfigError, match="^levers.weights: 'int4' is not one of native, bf16$"):
        compose(["levers.weights=int4"])


def test_which_loads_keep_blocks():
    from metrale.models.assemble import _keeps_quantized
    from metrale.settings import compose
    assert _keeps_quantized(compose(["levers.weights=native"]), "cuda")
    assert not _keeps_quantized(compose([]), "cuda")
    assert _keeps_quantized(compose(["levers.weights=bf16"]), "cpu")       # the CPU path: levers.cpu_kernels
    assert not _keeps_quantized(compose(["levers.cpu_kernels=numpy"]), "cpu")


def test_load_gguf_announces_exactly_what_streams_quantized(tiny):
    from metrale.models.checkpoint import load_gguf
    from metrale.models.quantized import QuantizedStream, QuantizedTensor
    config, _, stream = load_gguf(tiny, keep_quantized=True)
    assert isinstance(stream, QuantizedStream)
    got = {n: tuple((int(p.ggml_type), p.rows, p.cols) for p in a.parts)
           for n, a in stream() if isinstance(a, QuantizedTensor)}
    assert got == stream.parts
    assert "layers.1.o" not in got                      # F16: dense, bf16 on the device
    assert [L.NAMES[t] for t, _, _ in got["layers.0.qkv"]] == ["Q4_K", "Q4_K", "Q6_K"]
    assert stream.shapes["layers.0.qkv"] == (512, 256) and stream.shapes["lm_head"] == (512, 256)
    assert set(got) == {"embed", "lm_head", "layers.0.qkv", "layers.0.o", "layers.0.gate_up", "layers.0.down",
                        "layers.1.qkv", "layers.1.gate_up", "layers.1.down"}
    _, _, plain = load_gguf(tiny)
    assert not isinstance(plain, QuantizedStream)


# ----------------------------------------------------------------------------- roads
class _Recorder:
    """Stands in for CudaOps below QuantOps: records which bf16 op ran on which weight."""

    def __init__(self, rows):
        self.calls, self.g, self.s = [], SimpleNamespace(tokens=rows), 0
        self.token_ids, self.token_src = "ids", "src"
        self._resid_ss = "stale"

    def _buf(self, name, n=None):
        return name

    def rms_norm(self, x, w):
        self.calls.append(("rms_norm",))
        return x

    def silu_mul(self, gu):
        self.calls.append(("silu_mul",))
        return SimpleNamespace(shape=(gu.shape[0], gu.shape[1] // 2))

    def attention(self, q, layer):
        self.calls.append(("attention",))
        return q

    def qkv_to_cache(self, out, layer, qn, kn):
        self.calls.append(("qkv_to_cache",))
        return "q"


def _bf16_op(name):
    def op(self, *args, **kw):
        self.calls.append((name, next(a.tag for a in args if hasattr(a, "tag"))))
        return args[-1] if name.endswith("residual") else SimpleNamespace(shape=(self.g.tokens, 64))
    return op


for _name in ("embed", "linear", "linear_residual", "norm_linear", "norm_qkv_to_cache", "attention_linear_residual",
              "silu_mul_linear_residual", "mlp_residual"):
    setattr(_Recorder, _name, _bf16_op(_name))


def _fake_dq(n, k):
    from metrale.runtime.cuda.quant import DevicePart, DeviceQuantized
    return DeviceQuantized((DevicePart(L.Q4_K, n, k, 0, {}, n * k // 2),))


@pytest.fixture
def roads(monkeypatch):
    """(make ops of `rows` with a scratch of `scratch` elements, the log of quant calls)."""
    from metrale.models.families import compose_ops
    from metrale.runtime.cuda import quant as Q
    log = []
    monkeypatch.setattr(Q, "quant_linear", lambda x, dq, out, rows, s, residual=None, bias=None, scratch=None, mma_rows=0:
                        log.append(("quant_linear", dq.shape, rows, residual is not None)))
    monkeypatch.setattr(Q, "dequantize_into", lambda dq, view, s: log.append(("dequantize", dq.shape)))
    monkeypatch.setattr(Q, "quant_embedding", lambda ids, dq, out, s: log.append(("quant_embedding", ids)))
    monkeypatch.setattr(Q.quant_dequant, "feed_ids", lambda ids, src, prev, stream: log.append(("feed_ids",)))
    cls = compose_ops(_Recorder, (Q.QuantOps,))

    def make(rows, scratch=1 << 20, overlap=False):
        ops = cls(rows)
        ops.b = SimpleNamespace(quant_scratch=SimpleNamespace(size=scratch), overlap=overlap, quant_mma_rows=0, act={"argmax": "prev"},
                                view=lambda name, n: SimpleNamespace(shape=(n, int(name[3:]))),
                                quant_scratch_view=lambda n, k: SimpleNamespace(tag=f"scratch{n}x{k}"))
        return ops
    return make, log


def _x(rows, k=256):
    return SimpleNamespace(shape=(rows, k))


@pytest.mark.parametrize("rows", [1, 8])
def test_few_rows_take_the_quant_gemv(roads, rows):
    make, log = roads
    ops = make(rows)
    w = _fake_dq(512, 256)
    ops.norm_linear(_x(rows), "nw", w)
    ops.linear_residual(_x(rows), _fake_dq(256, 256), "res")
    ops.mlp_residual(_x(rows), "nw", _fake_dq(1024, 256), _fake_dq(256, 512))
    ops.attention_linear_residual(_x(rows), 0, _fake_dq(256, 256), "res")
    ops.norm_qkv_to_cache(_x(rows), "nw", w, None, 0, None, None)
    assert [c for c in log if c[0] != "quant_linear"] == []
    assert [c[1] for c in log] == [(512, 256), (256, 256), (1024, 256), (256, 512), (256, 256), (512, 256)]
    assert [c[3] for c in log] == [False, True, False, True, True, False]       # residual GEMVs
    assert ops.calls == [("rms_norm",), ("rms_norm",), ("silu_mul",), ("attention",), ("rms_norm",),
                         ("qkv_to_cache",)]
    assert ops._resid_ss is None                   # no carried norm sums after a quant residual GEMV


def test_many_rows_take_the_bf16_road_on_the_scratch(roads):
    make, log = roads
    ops = make(9)
    ops.norm_linear(_x(9), "nw", _fake_dq(512, 256))
    ops.mlp_residual(_x(9), "nw", _fake_dq(1024, 256), _fake_dq(256, 512))
    ops.attention_linear_residual(_x(9), 0, _fake_dq(256, 256), "res")
    assert log == [("dequantize", (512, 256)), ("dequantize", (1024, 256)), ("dequantize", (256, 512)),
                   ("dequantize", (256, 256))]
    assert ops.calls == [("norm_linear", "scratch512x256"), ("norm_linear", "scratch1024x256"),
                         ("silu_mul_linear_residual", "scratch256x512"), ("attention_linear_residual", "scratch256x256")]


def test_a_weight_larger_than_the_scratch_takes_the_chunks(roads):
    make, log = roads
    ops = make(9, scratch=64 * 256)
    ops.norm_linear(_x(9), "nw", _fake_dq(512, 256))           # an lm_head of 512 rows: 8 chunks
    assert log == [("quant_linear", (512, 256), 9, False)] and ops.calls == [("rms_norm",)]


def test_bf16_weights_pass_through_and_embedding_feeds(roads):
    make, log = roads
    ops = make(1, overlap=True)
    plain = SimpleNamespace(tag="bf16", shape=(512, 256))
    ops.norm_linear(_x(1), "nw", plain)
    ops.embed(plain)
    assert log == [] and ops.calls == [("norm_linear", "bf16"), ("embed", "bf16")]
    assert ops.embed(_fake_dq(512, 256)) == "residual"
    assert log == [("feed_ids",), ("quant_embedding", "ids")]


# ----------------------------------------------------------------------------- scratch, chunks, bytes
def test_scratch_plan():
    from metrale.runtime.cuda.quant import SCRATCH_MAX_ELEMS, plan_scratch
    shapes = {"embed": (128256, 4096), "lm_head": (128256, 4096), "layers.0.qkv": (6144, 4096),
              "layers.0.gate_up": (28672, 4096), "layers.0.down": (4096, 14336)}
    assert plan_scratch(shapes, 8, 8) == 0                            # decode-only buffers: no scratch
    assert plan_scratch(shapes, 4096, 8) == 28672 * 4096              # prefill: the largest layer matrix
    assert plan_scratch(shapes, 4096, 256) == SCRATCH_MAX_ELEMS       # lm_head too: capped, chunked
    assert plan_scratch({"lm_head": (512, 256)}, 1, 16, cap=1024) == 64 * 256     # at least 64 rows


def _host_dq(parts):
    """A DeviceQuantized whose planes are host arrays (row slicing is the same) and its reference."""
    from metrale.runtime.cuda.quant import DevicePart, DeviceQuantized
    rng, out, row0, ref = np.random.default_rng(3), [], 0, []
    filler = np.zeros((1, 16), np.uint8)
    for qt, rows, cols in parts:
        data = L.random_blocks(qt, rows, cols, rng)
        planes = {k: (filler if v is None else v) for k, v in L.repack(qt, data, cols).items()}
        out.append(DevicePart(qt, rows, cols, row0, planes, data.nbytes))
        ref.append(L.gguf_dequantize(qt, data))
        row0 += rows
    return DeviceQuantized(tuple(out)), np.concatenate(ref)


def test_row_chunks_cut_across_parts():
    from metrale.runtime.cuda.quant import row_chunks
    dq, ref = _host_dq([(L.Q4_K, 96, 256), (L.Q6_K, 64, 256), (L.Q8_0, 32, 256)])
    assert row_chunks(dq, dq.shape[0] * 256) == ((0, dq),)
    chunks = row_chunks(dq, 64 * 256 + 100)
    assert [n0 for n0, _ in chunks] == [0, 64, 128] and row_chunks(dq, 64 * 256 + 100) is chunks     # cached
    assert [[(L.NAMES[p.qtype], p.row0, p.rows) for p in c.parts] for _, c in chunks] == [
        [("Q4_K", 0, 64)], [("Q4_K", 0, 32), ("Q6_K", 32, 32)], [("Q6_K", 0, 32), ("Q8_0", 32, 32)]]
    for n0, c in chunks:
        got = np.concatenate([L.dequant_planes(p.qtype, p.planes, 256) for p in c.parts])
        np.testing.assert_array_equal(got, ref[n0:n0 + c.shape[0]])
    with pytest.raises(ValueError, match="fewer than 64 rows"):
        row_chunks(dq, 63 * 256)


def test_unsupported_type_is_one_line():
    from metrale.runtime.cuda.quant import device_bytes_bound
    with pytest.raises(ValueError) as e:
        device_bytes_bound([(10, 64, 256)])                 # Q2_K
    assert "Q2_K" in str(e.value) and "levers.weights=bf16" in str(e.value) and "\n" not in str(e.value)


def planning_backend_8b(part, extra=None):
    """A CudaBackend's memory planning for Llama-3-8B without a device (only what
    _quantized_bytes_delta and weight_bytes read): every layer's linear matrix announced as
    part(rows, cols), plus `extra(config)`'s announced parts (embed, lm_head). Returns (backend, parts)."""
    from metrale.models.checkpoint import random_model_config
    from metrale.models.registry import resolve_model
    from metrale.runtime.cuda_backend import CudaBackend
    from metrale.runtime.cuda_dense import DenseCuda
    s = resolve_model("llama-3-8b-shape")
    c = random_model_config(s.preset, s.name)
    b = object.__new__(CudaBackend)
    b.config = c
    b.part = DenseCuda(b)
    d, f, qkv = c.hidden_size, c.intermediate_size, c.q_size + 2 * c.kv_size
    parts = dict(extra(c) if extra is not None else {})
    for i in range(c.num_layers):
        parts.update({f"layers.{i}.qkv": part(qkv, d), f"layers.{i}.o": part(d, c.q_size),
                      f"layers.{i}.gate_up": part(2 * f, d), f"layers.{i}.down": part(d, f)})
    b.quantized = parts
    return b, parts


def _q4k_8b_backend(native=True):
    """Llama-3-8B of Q4_K matrices (lm_head Q6_K, as Q4_K_M): the planning backend and the file's bytes."""
    b, parts = planning_backend_8b(lambda n, k: ((L.Q4_K, n, k),), lambda c: {
        "embed": ((L.Q4_K, c.vocab_size, c.hidden_size),), "lm_head": ((L.Q6_K, c.vocab_size, c.hidden_size),)})
    if not native:
        b.quantized = {}
    file_bytes = sum(rows * cols // 256 * L.BLOCK[qt][1] for ps in parts.values() for qt, rows, cols in ps)
    return b, file_bytes


def test_device_weight_bytes_follow_the_blocks():
    b, file_bytes = _q4k_8b_backend()
    native = b.part.weight_bytes() + b._quantized_bytes_delta()
    bf16 = b.part.weight_bytes()
    assert 1.0 <= native / file_bytes < 1.01           # the file's bytes, norms and alignment
    assert bf16 / native > 3.4
    assert _q4k_8b_backend(native=False)[0]._quantized_bytes_delta() == 0


def test_a_family_without_a_quantized_road_is_refused():
    from metrale.runtime.cuda_backend import CudaBackend
    b = object.__new__(CudaBackend)
    b.quantized = {"embed": ((L.Q8_0, 64, 64),)}
    b.part = SimpleNamespace(quantized_weights=False)
    b.family = SimpleNamespace(name="mla")
    with pytest.raises(ValueError, match="the mla family's CUDA part has no quantized road; use levers.weights=bf16"):
        b._init_quantized()


def test_the_tiny_gguf_runs_on_the_numpy_backend(tiny):
    """The GPU test's model file is valid: it loads (blocks dequantized) and decodes."""
    from metrale import Engine, SamplingParams
    eng = Engine(model=str(tiny), device="cpu", levers={"cpu_kernels": "numpy"}, cache={"num_blocks": 64})
    out = eng.generate([np.arange(5, 20, dtype=np.int32)], SamplingParams(max_tokens=4, temperature=0.0,
                                                                          ignore_eos=True), use_tqdm=False)
    assert len(out[0].token_ids) == 4 and eng.backend.config.vocab_size == 512


def test_bf16_weights_plan_the_activation_bytes_as_before():
    """levers.weights=bf16 (no scratch) adds nothing to the activation bytes: the KV pool is sized
    exactly as before the native road existed; a scratch adds its bytes and one alignment."""
    import math
    b, _ = _q4k_8b_backend(native=False)
    b.max_tokens, b.max_seqs, b.max_rows, b.max_blocks, b.max_model_len, b.use_blas = 512, 64, 64, 256, 4096, False
    b.quant_scratch_elems = 0
    old = sum(math.prod(shape) * np.dtype(dt).itemsize + 256 for shape, dt in b.part.activation_plan().values())
    old += 4 * (8 * 512 + 4 * 64 + 64 + 64 * 256) + 4096
    assert b._activation_bytes() == old
    b.quant_scratch_elems = 1000
    assert b._activation_bytes() == old + 2000 + 256


@pytest.mark.parametrize("rows,mma_rows,want", [
    (1, 2, ["mq", "dp4a"]), (1, 1, ["mq", "dp4a"]), (2, 1, ["mq", "mma"]), (2, 2, ["mq", "mma"]),
    (2, 0, ["mq", "dp4a"]), (12, 1, ["mq", "mma"])])
def test_which_kernel_each_part_takes(monkeypatch, rows, mma_rows, want):
    """A Q4_K part in the fragment layout over a Q6_K part on planes: the fragments always on their
    tensor-core kernel; the planes on theirs from max(mma_rows, PLANES_MMA_MIN_ROWS) rows, at one row
    on the dp4a GEMV (faster there), and past 8 rows on the n-tile kernels when mma_rows > 0."""
    from metrale.runtime.cuda import quant as Q
    calls = []
    monkeypatch.setattr(Q.quant_mma, "x_buffers", lambda k: (None, None))
    monkeypatch.setattr(Q.quant_mma, "quantize_x", lambda *a, **k: calls.append("quantize"))
    monkeypatch.setattr(Q.quant_mma, "gemv_mq", lambda *a, **k: calls.append("mq"))
    monkeypatch.setattr(Q.quant_mma, "gemv", lambda *a, **k: calls.append("mma"))
    monkeypatch.setattr(Q, "_gemv_part", lambda *a, **k: calls.append("dp4a"))
    K = 256
    dq = Q.DeviceQuantized((Q.DevicePart(L.Q4_K, 16, K, 0, {"mq": None, "ms": None}, 0),
                            Q.DevicePart(L.Q6_K, 16, K, 16, {}, 0)))
    x, out = np.zeros((rows, K), np.float32), np.zeros((rows, 32), np.float32)
    Q.quant_linear(x, dq, out, rows, mma_rows=mma_rows)
    assert calls == ["quantize"] + want
