"""FP8 e4m3 safetensors checkpoints (metrale/models/fp8.py, checkpoint.load_hf_dir; docs/quant.md).

A tiny random Llama is written here as an HF directory in each published FP8 format: block-scaled
(`quant_method: fp8`, weight_block_size, `weight_scale_inv`; 128 x 128 blocks, partial at this size,
and 32 x 32 ones, whole), per channel (`fbgemm_fp8`, `weight_scale` [N, 1]; compressed-tensors
`channel`), per tensor (`fp8` without a block size, scalar `weight_scale`), with lm_head left bf16 as
the config's ignore list says. The files are written by this module's own safetensors writer
(`safetensors.numpy` has no float8 types) and every expected weight is dequantized here with
ml_dtypes, not through metrale. Checked: the float32 stream equals that dequantization; keep_fp8
streams FP8Tensor matrices that the QuantizedStream announces exactly and that dequantize to the
same values (members whose scale blocks do not line up regridded exactly); the CPU Engine decodes
the same greedy tokens as from a float32 checkpoint of the dequantized weights; DeepSeek-V3's own
block-scaled release through load_deepseek_dir; unknown methods and malformed tensors are refused
by name; the CUDA backend's weight upload (DeviceFP8 with native, bf16 bits with bf16; its device
arrays on the host) and its byte plan (an 8B shape: ~1 byte a weight)."""
import json
import struct

import ml_dtypes
import numpy as np
import pytest

E4M3 = ml_dtypes.float8_e4m3fn
HIDDEN, FFN, VOCAB, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 64, 96, 128, 2, 4, 2, 16
DTYPES = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(ml_dtypes.bfloat16): "BF16", np.dtype(E4M3): "F8_E4M3",
          np.dtype(ml_dtypes.float8_e5m2): "F8_E5M2"}

# format -> (quantization_config, scale name, block or "channel" / "tensor")
FORMATS = {
    "block128": ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                  "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]},
                 "weight_scale_inv", (128, 128)),
    "block32": ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32],
                 "ignored_layers": ["lm_head"]}, "weight_scale_inv", (32, 32)),
    "fbgemm": ({"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0, "modules_to_not_convert": ["lm_head"]},
               "weight_scale", "channel"),
    "tensor": ({"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]},
               "weight_scale", "tensor"),
    "ct_channel": ({"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
                    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                        "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
                        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}}},
                   "weight_scale", "channel"),
}
CFG = dict(model_type="llama", vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN,
           num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, rms_norm_eps=1e-5,
           rope_theta=10000.0, max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1,
           eos_token_id=2)
LINEAR = {"self_attn.q_proj": (HEADS * HEAD_DIM, HIDDEN), "self_attn.k_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
          "self_attn.v_proj": (KV_HEADS * HEAD_DIM, HIDDEN), "self_attn.o_proj": (HIDDEN, HEADS * HEAD_DIM),
          "mlp.gate_proj": (FFN, HIDDEN), "mlp.up_proj": (FFN, HIDDEN), "mlp.down_proj": (HIDDEN, FFN)}


# ----------------------------------------------------------------------------- writing checkpoints
def write_safetensors(path, tensors: dict) -> None:
    """The safetensors layout: u64 header length, JSON header (dtype, shape, data_offsets), bytes."""
    header, blobs, offset = {}, [], 0
    for name, a in tensors.items():
        a = np.ascontiguousarray(a)
        header[name] = {"dtype": DTYPES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        blobs.append(a.tobytes())
        offset += a.nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


def quantize(w: np.ndarray, kind) -> tuple[np.ndarray, np.ndarray]:
    """(e4m3 values, scale as the format stores it) of float32 w: absmax / 448 per block, channel or tensor."""
    n, k = w.shape
    if kind == "tensor":
        scale = np.float32(np.abs(w).max() / 448)
        return (w / scale).astype(E4M3), np.asarray(scale, np.float32)
    if kind == "channel":
        scale = (np.abs(w).max(1, keepdims=True) / 448).astype(np.float32)
        return (w / scale).astype(E4M3), scale
    bn, bk = kind
    grid = np.zeros((-(-n // bn), -(-k // bk)), np.float32)
    for i in range(grid.shape[0]):
        for j in range(grid.shape[1]):
            grid[i, j] = np.abs(w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]).max() / 448
    return (w / expand(grid, kind, n, k)).astype(E4M3), grid


def expand(scale, kind, n, k) -> np.ndarray:
    """float32 [n, k] of a stored scale: the test's own reading of the three formats."""
    s = np.asarray(scale, np.float32)
    if kind == "tensor":
        return np.full((n, k), s.reshape(()), np.float32)
    if kind == "channel":
        return np.repeat(s.reshape(n, 1), k, 1)
    bn, bk = kind
    return np.repeat(np.repeat(s, bn, 0), bk, 1)[:n, :k]


def dequant(q: np.ndarray, scale, kind) -> np.ndarray:
    return q.astype(np.float32) * expand(scale, kind, *q.shape)


def tiny_tensors(seed: int, fmt: str | None) -> tuple[dict, dict]:
    """(tensors of the HF directory, float32 of every HF weight as the model computes with it):
    fmt None: the float32 checkpoint; else its linear weights in that FP8 format."""
    rng = np.random.default_rng(seed)
    kind = FORMATS[fmt][2] if fmt else None
    dense = {"model.embed_tokens.weight": rng.standard_normal((VOCAB, HIDDEN)),
             "model.norm.weight": 1 + 0.1 * rng.standard_normal(HIDDEN),
             "lm_head.weight": rng.standard_normal((VOCAB, HIDDEN)) / 8}
    tensors, floats = {}, {}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        dense[p + "input_layernorm.weight"] = 1 + 0.1 * rng.standard_normal(HIDDEN)
        dense[p + "post_attention_layernorm.weight"] = 1 + 0.1 * rng.standard_normal(HIDDEN)
        for m, shape in LINEAR.items():
            w = (rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32)
            w *= np.exp(rng.uniform(-1, 1, (shape[0], 1))).astype(np.float32)     # channels of unlike ranges
            if kind is None:
                tensors[p + m + ".weight"] = floats[p + m + ".weight"] = w
                continue
            q, scale = quantize(w, kind)
            tensors[p + m + ".weight"], tensors[p + m + "." + FORMATS[fmt][1]] = q, scale
            tensors[p + m + ".input_scale"] = np.float32(0.02).reshape(())          # activation scale: not read
            floats[p + m + ".weight"] = dequant(q, scale, kind)
    for name, a in dense.items():
        a = a.astype(np.float32)
        if name == "lm_head.weight" and fmt:       # the ignored module: bf16 in the file
            a = a.astype(ml_dtypes.bfloat16)
        tensors[name], floats[name] = a, a.astype(np.float32)
    return tensors, floats


def write_dir(path, tensors: dict, quant: dict | None, cfg: dict = CFG, vocab: int = VOCAB) -> None:
    """An HF directory: config.json (with quant as its quantization_config), the tensors in two
    safetensors shards, a word-level tokenizer of `vocab` words."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({**cfg, **({"quantization_config": quant} if quant else {})}))
    names = sorted(tensors)
    write_safetensors(path / "model-00001-of-00002.safetensors", {n: tensors[n] for n in names[::2]})
    write_safetensors(path / "model-00002-of-00002.safetensors", {n: tensors[n] for n in names[1::2]})
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "w2", "bos_token": "w1"}))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """format -> (FP8 directory, float32 directory of the same dequantized weights, those floats)."""
    base, out = tmp_path_factory.mktemp("fp8"), {}
    for seed, fmt in enumerate(FORMATS):
        tensors, floats = tiny_tensors(seed, fmt)
        write_dir(base / fmt, tensors, FORMATS[fmt][0])
        write_dir(base / (fmt + "-f32"), floats, None)
        out[fmt] = (base / fmt, base / (fmt + "-f32"), floats)
    return out


def canonical(floats: dict) -> dict:
    """The canonical weights (checkpoint.py's names) of HF float32 tensors, stacked as the loader stacks them."""
    out = {"embed": floats["model.embed_tokens.weight"], "final_norm": floats["model.norm.weight"],
           "lm_head": floats["lm_head.weight"]}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out[f"layers.{i}.attn_norm"] = floats[p + "input_layernorm.weight"]
        out[f"layers.{i}.mlp_norm"] = floats[p + "post_attention_layernorm.weight"]
        out[f"layers.{i}.qkv"] = np.concatenate([floats[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
        out[f"layers.{i}.o"] = floats[p + "self_attn.o_proj.weight"]
        out[f"layers.{i}.gate_up"] = np.concatenate([floats[p + "mlp.gate_proj.weight"], floats[p + "mlp.up_proj.weight"]])
        out[f"layers.{i}.down"] = floats[p + "mlp.down_proj.weight"]
    return out


# ----------------------------------------------------------------------------- loading
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_loaded_weights_equal_an_independent_dequantization(ckpts, fmt):
    from metrale.models.checkpoint import load_hf_dir
    from metrale.models.quantized import QuantizedStream
    path, _, floats = ckpts[fmt]
    config, cfg, stream = load_hf_dir(path)
    assert not isinstance(stream, QuantizedStream) and cfg["quantization_config"] == FORMATS[fmt][0]
    got, want = dict(stream()), canonical(floats)
    assert set(got) == set(want)
    for name, w in want.items():
        assert got[name].dtype == np.float32
        np.testing.assert_array_equal(got[name], w, err_msg=name)


@pytest.mark.parametrize("fmt,grid", [("block128", (1, 128)), ("block32", (32, 32)), ("fbgemm", (1, 64)),
                                      ("tensor", (1, 64)), ("ct_channel", (1, 64))])
def test_keep_fp8_streams_announced_fp8_matrices(ckpts, fmt, grid):
    """keep_fp8: qkv / o / gate_up / down stream as FP8Tensor with the checkpoint's bytes, announced
    exactly (FP8_E4M3, rows, cols, scale values); embed, norms and the ignored lm_head as float32.
    qkv's scale grid: 32 x 32 blocks stack whole; 128-row blocks do not fit 64-row q, so its
    members go to one-row blocks of 128 columns; per tensor and per channel to per channel."""
    from metrale.models.checkpoint import load_hf_dir
    from metrale.models.fp8 import FP8_E4M3, FP8Tensor
    from metrale.models.quantized import QuantizedStream
    path, _, floats = ckpts[fmt]
    _, _, stream = load_hf_dir(path, keep_fp8=True)
    assert isinstance(stream, QuantizedStream)
    items = dict(stream())
    fp8 = {n: a for n, a in items.items() if isinstance(a, FP8Tensor)}
    assert set(fp8) == {f"layers.{i}.{m}" for i in range(LAYERS) for m in ("qkv", "o", "gate_up", "down")}
    assert stream.parts == {n: ((FP8_E4M3, *a.shape, a.S.size),) for n, a in fp8.items()}
    assert (fp8["layers.0.qkv"].bn, fp8["layers.0.qkv"].bk) == grid
    assert fp8["layers.1.down"].nbytes == HIDDEN * FFN + 4 * fp8["layers.1.down"].S.size
    want = canonical(floats)
    for name, a in items.items():
        np.testing.assert_array_equal(a.dequantize() if name in fp8 else a, want[name], err_msg=name)
    q = floats["model.layers.0.self_attn.o_proj.weight"]
    assert fp8["layers.0.o"].q.dtype == np.uint8 and fp8["layers.0.o"].shape == q.shape
    plain = load_hf_dir(ckpts[fmt][1], keep_fp8=True)[2]         # a float checkpoint: nothing kept
    assert not isinstance(plain, QuantizedStream)


def test_stack_regrids_members_it_cannot_concatenate():
    """FP8Tensor.stack of members whose scales do not line up (a per-tensor weight, a 32 x 128 block
    one of 48 rows, a per-channel one): one-row blocks of gcd(256, 128) columns, every value equal
    to its member's own dequantization."""
    from metrale.models.fp8 import FP8Tensor
    rng = np.random.default_rng(3)
    kinds = [("tensor", 16), ((32, 128), 48), ("channel", 8)]
    members = [quantize((rng.standard_normal((n, 256)) * rng.uniform(0.1, 3)).astype(np.float32), kind)
               for kind, n in kinds]
    t = FP8Tensor.stack([FP8Tensor.of(q, s, kind if isinstance(kind, tuple) else None)
                         for (q, s), (kind, _) in zip(members, kinds)])
    assert (t.bn, t.bk, t.S.shape, t.shape) == (1, 128, (72, 2), (72, 256))
    want = np.concatenate([dequant(q, s, kind) for (q, s), (kind, _) in zip(members, kinds)])
    np.testing.assert_array_equal(t.dequantize(), want)


@pytest.mark.parametrize("fmt", ["block128", "fbgemm"])
def test_cpu_engine_greedy_tokens_equal_the_dequantized_checkpoint(ckpts, fmt):
    """device=cpu dequantizes FP8 at load: the same greedy tokens, and the same logits, as a float32
    checkpoint holding the dequantized weights (Numba CPU kernels, the default CPU path)."""
    from metrale import Engine, SamplingParams
    path, f32, _ = ckpts[fmt]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [np.array([5, 17, 42, 9, 77, 3], np.int32), np.array([100, 64, 8], np.int32)]
    outs = []
    for p in (path, f32):
        eng = Engine(model=str(p), device="cpu", cache={"num_blocks": 32})
        assert all(isinstance(w, np.ndarray) for w in eng.backend.weights.values())
        outs.append([o.token_ids.tolist() for o in eng.generate(prompts, params, use_tqdm=False)])
    assert outs[0] == outs[1] and len(outs[0][0]) == 12
    assert len(set(outs[0][0])) > 1                        # not a degenerate constant stream


def test_numpy_backend_dequantizes_fp8_tensors(ckpts):
    """An FP8Tensor handed to the NumPy backend (a keep_fp8 stream) is dequantized into its dtype."""
    from metrale.models.checkpoint import load_hf_dir
    from metrale.runtime.numpy_backend import NumpyBackend
    path, _, floats = ckpts["block32"]
    config, _, stream = load_hf_dir(path, keep_fp8=True)
    be = NumpyBackend(config, stream(), num_blocks=4, block_size=8, dtype="float64")
    assert be.weights["layers.0.qkv"].dtype == np.float64
    np.testing.assert_array_equal(be.weights["layers.0.qkv"], canonical(floats)["layers.0.qkv"])


def test_deepseek_v3_block_scaled_checkpoint_dequantizes_at_load(tmp_path):
    """DeepSeek-V3's own format (fp8, weight_block_size, weight_scale_inv on every projection, the
    experts' included) through load_deepseek_dir: the stream equals that of a float32 checkpoint of
    the dequantized weights (the conformance fixture's, 16 x 16 blocks: partial ones at 24 and 40 rows)."""
    from pathlib import Path

    from safetensors.numpy import load_file

    from metrale.models.checkpoint import load_deepseek_dir
    src = Path(__file__).parent / "fixtures" / "conformance" / "deepseek_v3"
    cfg = json.loads((src / "config.json").read_text())
    fp8, floats = {}, {}
    for name, a in load_file(str(src / "model.safetensors")).items():
        a = a.astype(np.float32)
        if name.endswith("proj.weight") or name.endswith("proj_with_mqa.weight"):
            q, scale = quantize(a, (16, 16))
            fp8[name], fp8[name[:-len("weight")] + "weight_scale_inv"] = q, scale
            a = dequant(q, scale, (16, 16))
        else:
            fp8[name] = a
        floats[name] = a
    assert sum(n.endswith("weight_scale_inv") for n in fp8) == 40        # both layers' projections, the 8 experts' included
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [16, 16]}
    for name, tensors, q in (("fp8", fp8, quant), ("f32", floats, None)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({**cfg, **({"quantization_config": q} if q else {})}))
        write_safetensors(tmp_path / name / "model.safetensors", tensors)
    got = dict(load_deepseek_dir(tmp_path / "fp8")[2]())
    want = dict(load_deepseek_dir(tmp_path / "f32")[2]())
    assert set(got) == set(want) and "layers.1.experts_gate_up" in got
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_which_loads_keep_fp8():
    from metrale.models.assemble import _keeps_fp8
    from metrale.settings import compose
    assert _keeps_fp8(compose(["levers.weights=native"]), "cuda")
    assert not _keeps_fp8(compose(["levers.weights=bf16"]), "cuda")
    assert not _keeps_fp8(compose(["levers.weights=native"]), "cpu")


# ----------------------------------------------------------------------------- errors
@pytest.mark.parametrize("quant,match", [
    ({"quant_method": "awq", "bits": 4}, "quant_method 'awq' is not supported"),
    ({"quant_method": "gptq"}, "quant_method 'gptq' is not supported"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "fp8 format 'e5m2' is not supported"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {}},
     "compressed-tensors format 'pack-quantized' is not supported"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int", "strategy": "group"}}}},
     "int 4-bit weights are not supported"),
])
def test_unknown_methods_are_refused_by_name(tmp_path, quant, match):
    from metrale.models.checkpoint import load_hf_dir
    tensors, _ = tiny_tensors(0, None)
    write_dir(tmp_path / "m", tensors, quant)
    with pytest.raises(ValueError, match=match) as e:
        load_hf_dir(tmp_path / "m")
    assert "\n" not in str(e.value)


def test_malformed_fp8_tensors_are_refused(tmp_path):
    """Block scales of the wrong grid, an FP8 weight without its scale, e5m2 bytes: each a one-line
    error naming the tensor or the shapes."""
    from metrale.models.checkpoint import load_hf_dir
    tensors, _ = tiny_tensors(1, "block32")
    o = "model.layers.0.self_attn.o_proj."
    cases = {"bad_grid": ({o + "weight_scale_inv": np.ones((3, 2), np.float32)}, r"are \(2, 2\), got \(3, 2\)"),
             "no_scale": ({o + "weight_scale_inv": None}, "self_attn.o_proj.weight' has no scale"),
             "e5m2": ({o + "weight": tensors[o + "weight"].astype(ml_dtypes.float8_e5m2)}, "is F8_E5M2")}
    for name, (change, match) in cases.items():
        t = {k: v for k, v in {**tensors, **change}.items() if v is not None}
        write_dir(tmp_path / name, t, FORMATS["block32"][0])
        config, _, stream = load_hf_dir(tmp_path / name)
        with pytest.raises(ValueError, match=match):
            dict(stream())


# ----------------------------------------------------------------------------- device bytes
class _HostArena:
    """The weights region of a DevicePool on the host: what CudaBackend._load_weights uploads, and
    the bytes it takes (256-byte aligned allocations)."""

    def __init__(self):
        self.bytes = 0

    def upload(self, a, stream=0):
        a = np.ascontiguousarray(a)
        self.bytes += -(-a.nbytes // 256) * 256
        return a


@pytest.mark.parametrize("native", [True, False])
def test_cuda_backend_uploads_announced_fp8_matrices(ckpts, native):
    """CudaBackend._load_weights on a keep_fp8 stream (its device arrays on the host): native keeps
    each announced matrix as a DeviceFP8 of the checkpoint's bytes and scales, in at most the bytes
    the announcement plans, and export_weights' reading of it is the dequantized weight; bf16 uploads
    every matrix as the bf16 bits of that same dequantization."""
    from kernels_numba.bf16 import to_bf16_bits
    from metrale.models.checkpoint import load_hf_dir
    from metrale.runtime.cuda.quant import DeviceFP8, device_bytes_bound
    from metrale.runtime.cuda_backend import CudaBackend, _host_float
    from metrale.runtime.cuda_dense import DenseCuda
    path, _, floats = ckpts["block32"]
    config, _, stream = load_hf_dir(path, keep_fp8=True)
    b = object.__new__(CudaBackend)
    b.config, b.native, b.quant_mma_rows = config, native, 1
    b.quantized = dict(stream.parts) if native else {}
    b.part = DenseCuda(b)
    b.pool = {"weights": _HostArena()}
    weights, want = b._load_weights(stream(), 0), canonical(floats)
    fp8 = {n for n, w in weights.items() if isinstance(w, DeviceFP8)}
    assert fp8 == (set(stream.parts) if native else set())
    for name, w in want.items():
        if name in fp8:
            assert weights[name].q.dtype == np.uint8 and weights[name].nbytes < w.size * 2
            np.testing.assert_array_equal(_host_float(weights[name]), w, err_msg=name)
        elif w.ndim == 2:
            np.testing.assert_array_equal(weights[name], to_bf16_bits(w), err_msg=name)
    if native:
        fp8_bytes = sum(-(-weights[n].q.nbytes // 256) * 256 + -(-weights[n].S.nbytes // 256) * 256 for n in fp8)
        assert fp8_bytes <= sum(device_bytes_bound(stream.parts[n]) for n in fp8)


def test_device_bytes_of_fp8_matrices():
    """An 8B-shape model of 128 x 128 block-scaled FP8 matrices (lm_head bf16, as Qwen3-FP8 / DeepSeek
    ship them): the CUDA backend plans ~1 byte a matrix weight plus the scales, about half of bf16."""
    from metrale.models.fp8 import FP8_E4M3
    from metrale.runtime.cuda.quant import device_bytes_bound
    from test_quant_wiring import planning_backend_8b

    def part(n, k):
        return ((FP8_E4M3, n, k, -(-n // 128) * -(-k // 128)),)
    b, _ = planning_backend_8b(part)
    fp8_weights = sum(n * k for ps in b.quantized.values() for _, n, k, _ in ps)
    bf16 = b.part.weight_bytes()
    native = bf16 + b._quantized_bytes_delta()
    assert bf16 - native == pytest.approx(fp8_weights * (1 - 4 / 128 ** 2), rel=1e-3)   # 2 bytes -> 1 + scales
    assert device_bytes_bound(part(256, 512)) == 256 * 512 + 4 * 2 * 4 + 2 * 256
