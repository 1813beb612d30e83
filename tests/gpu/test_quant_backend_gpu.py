"""levers.weights=native through CudaBackend and Engine on the GPU (pytest -m gpu): a tiny llama GGUF
of Q4_K_M's types (Q4_K q/k/o/gate/up over Q6_K v/down/output, Q8_0 embeddings, one F16 matrix;
tests/test_quant_wiring.py's write_quant_gguf) run native against levers.weights=bf16 and against
a NumPy twin holding the blocks' exact float32 dequantization: prefill logits (the bf16 road: the
scratch image and the bf16 GEMMs / cuBLASLt, and the chunks road with a small scratch), greedy
decode through the graph ladder (B = 1, 2: the quant GEMV; B = 16: the bf16 road inside a graph),
Engine.generate end to end (the host a step ahead: fed ids into the quantized embedding), and the
memory report (device weights ~ the file's blocks). Greedy tokens are compared where it is fair:
each native token must be within a tolerance of the twin's teacher-forced maximum (bf16 activations
and q8 GEMV inputs move these logits by ~3% on both roads: a near tie may go either way)."""
import os

import numpy as np
import pytest

from metrale import Engine, SamplingParams
from metrale.runtime.batch import Segment, build_batch
from metrale.runtime.numpy_backend import NumpyBackend

pytestmark = pytest.mark.gpu

TYPES = [{"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K",
          "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q6_K"}] * 2
TYPES = [TYPES[0], {**TYPES[1], "attn_output": "F16"}]
# few graph sizes and no mixed-step warm-up: every quant GEMV variant compiles once (5-10 s each)
ENGINE = dict(device="cuda", cache={"num_blocks": 256}, scheduler={"max_model_len": 1024, "max_num_seqs": 128})
# METRALE_TEST_QUANT_MMA_ROWS=1 runs the module with the Q4_K matrices in the tensor-core GEMV's layout
LEVERS = {"graph_batch_sizes": [1, 2, 16], "warm_mixed": False,
          "quant_mma_rows": int(os.environ.get("METRALE_TEST_QUANT_MMA_ROWS", "2"))}


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    from test_quant_wiring import write_quant_gguf
    return write_quant_gguf(tmp_path_factory.mktemp("qgpu") / "tiny-q4km.gguf", seed=1, layer_types=TYPES)


def _engine(path, weights, **levers):
    return Engine(model=str(path), levers={**LEVERS, "weights": weights, **levers}, **ENGINE)


@pytest.fixture(scope="module")
def native(gguf_path):
    return _engine(gguf_path, "native")


@pytest.fixture(scope="module")
def bf16(gguf_path):
    return _engine(gguf_path, "bf16")


@pytest.fixture(scope="module")
def twin(native):
    """The NumPy backend on the native engine's weights (the blocks' exact dequantization)."""
    be = native.backend
    return NumpyBackend(be.config, be.export_weights(), num_blocks=512, block_size=be.block_size)


def prefill_logits(backend, ids):
    blocks = np.arange(-(-len(ids) // backend.block_size), dtype=np.int32) + 1
    return backend.forward(build_batch([Segment(np.asarray(ids, np.int32), 0, blocks, "all")], backend.block_size))


def rel_err(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


IDS = np.random.default_rng(3).integers(0, 258, 100).astype(np.int32)     # > prefill_attention_min_tokens


def test_memory_report_follows_the_blocks(native, bf16, gguf_path):
    n, b = native.memory_report(), bf16.memory_report()
    assert n["weights_native"] == 9 and b["weights_native"] == 0        # embed, lm_head, qkv/gate_up/down x2, o of layer 0
    assert n["weights_bytes"] < 0.5 * b["weights_bytes"], (n["weights_bytes"], b["weights_bytes"])
    assert n["weights_bytes"] < gguf_path.stat().st_size * 1.2
    assert n["quant_scratch_bytes"] > 0 and n["kv_pool_tokens"] == b["kv_pool_tokens"]
    assert type(native.backend.weights["layers.0.qkv"]).__name__ == "DeviceQuantized"
    assert type(native.backend.weights["layers.1.o"]).__name__ != "DeviceQuantized"       # F16 -> bf16


def test_prefill_logits_native_bf16_and_numpy(native, bf16, twin):
    got, ref, lo = prefill_logits(native.backend, IDS), prefill_logits(twin, IDS), prefill_logits(bf16.backend, IDS)
    assert np.isfinite(got).all()
    e_native, e_bf16 = rel_err(got, ref), rel_err(lo, ref)
    print(f"\nprefill logits rel err against the exact weights: native {e_native:.4f}, bf16 road {e_bf16:.4f}")
    # bf16 activations through the layers cost a few percent either way; the native kernels (exact
    # blocks, q8 activations in the GEMVs) add no more than the bf16 road's rounding of the weights
    assert e_bf16 < 5e-2 and e_native < 5e-2, (e_native, e_bf16)
    assert e_native < 1.25 * e_bf16 + 5e-3, (e_native, e_bf16)
    agree = (got.argmax(-1) == ref.argmax(-1)).mean()
    assert agree > 0.9, agree


def test_chunks_road_with_a_small_scratch(gguf_path, native, twin, monkeypatch):
    """A scratch of 64 rows of the widest K: every many-rows product is cut into row chunks."""
    from metrale.runtime.cuda import quant
    monkeypatch.setattr(quant, "SCRATCH_MAX_ELEMS", 1)
    eng = _engine(gguf_path, "native", cuda_graphs=False)
    try:
        assert eng.memory_report()["quant_scratch_bytes"] == 2 * 64 * 512
        got, ref = prefill_logits(eng.backend, IDS), prefill_logits(twin, IDS)
        whole = prefill_logits(native.backend, IDS)
        assert rel_err(got, whole) < 1e-3, rel_err(got, whole)         # the chunks compute the one-scratch road's products
        assert rel_err(got, ref) < 5e-2, rel_err(got, ref)
    finally:
        eng.backend.close()


def _near_greedy(tokens, prompt, twin, tol=0.25):
    """Each token within tol x rms(logits) of the twin's teacher-forced maximum; the fraction exactly equal."""
    ids = np.concatenate([prompt, tokens]).astype(np.int32)
    logits = prefill_logits(twin, ids)[len(prompt) - 1:len(ids) - 1]
    exact = 0
    for j, t in enumerate(tokens):
        row = logits[j]
        slack = tol * float(np.sqrt((row.astype(np.float64) ** 2).mean()))
        assert row[t] >= row.max() - slack, (j, t, int(row.argmax()), float(row.max() - row[t]), slack)
        exact += int(t == row.argmax())
    return exact / len(tokens)


@pytest.mark.parametrize("batch", [1, 2, 16])
def test_generate_greedy_native(native, twin, batch):
    """Engine.generate (decode graphs of that batch size; the host a step ahead) near the twin's greedy."""
    rng = np.random.default_rng(batch)
    prompts = [rng.integers(0, 258, int(n)).astype(np.int32) for n in rng.integers(5, 40, batch)]
    p = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outs = native.generate(prompts, p, use_tqdm=False)
    exact = [_near_greedy(np.asarray(o.token_ids), pr, twin) for o, pr in zip(outs, prompts)]
    assert all(len(o.token_ids) == 24 for o in outs)
    assert np.mean(exact) > 0.8, exact


def test_native_and_bf16_generate_alike(native, bf16, twin):
    """The same prompt through both levers: both near the exact weights' greedy."""
    prompt = IDS[:30]
    p = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    a = np.asarray(native.generate([prompt], p, use_tqdm=False)[0].token_ids)
    b = np.asarray(bf16.generate([prompt], p, use_tqdm=False)[0].token_ids)
    assert _near_greedy(a, prompt, twin) > 0.8 and _near_greedy(b, prompt, twin) > 0.8


SMOL = "/tmp/mdl/smollm2.gguf"


@pytest.mark.skipif(not __import__("os").path.exists(SMOL), reason=f"real SmolLM2 GGUF not at {SMOL}")
def test_real_smollm2_native_against_its_exact_weights():
    """The embedded SmolLM2 (Q4_1 / Q8_0 blocks) native: teacher-forced top-1 and logits against the
    NumPy backend on the blocks' exact dequantization (the figure is printed for docs/quant.md)."""
    eng = Engine(model=SMOL, device="cuda", cache={"num_blocks": 256}, levers={"weights": "native"})
    try:
        be = eng.backend
        assert eng.memory_report()["weights_native"] > 0
        cpu = NumpyBackend(be.config, be.export_weights(), num_blocks=64, block_size=be.block_size)
        text = "<|im_start|>user\nWrite a short story about a robot who learns to paint.<|im_end|>\n<|im_start|>assistant\n"
        ids = eng.tokenizer.encode(text, add_special_tokens=True)
        a, b = prefill_logits(be, ids), prefill_logits(cpu, ids)
        agree = float((a.argmax(-1) == b.argmax(-1)).mean())
        print(f"smollm2 native: top-1 {agree:.3f} of {len(ids)}, rel err {rel_err(a, b):.4f}, "
              f"weights {eng.memory_report()['weights_bytes'] / 2**20:.1f} MiB")
        assert rel_err(a, b) < 3e-2 and agree > 0.9
    finally:
        eng.backend.close()
