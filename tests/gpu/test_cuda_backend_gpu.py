"""The CUDA backend end to end against the NumPy backend (run on a GPU: pytest -m gpu)."""
import os

import numpy as np
import pytest

from metrale import Engine, SamplingParams
from metrale.runtime.batch import Segment, build_batch
from metrale.runtime.numpy_backend import NumpyBackend

pytestmark = pytest.mark.gpu


def numpy_twin(engine: Engine) -> Engine:
    """A NumPy engine with the CUDA engine's own (bf16) weights."""
    be = engine.backend
    twin = NumpyBackend(be.config, be.export_weights(), num_blocks=512, block_size=be.block_size)
    return Engine(cfg=engine.cfg, parts=(be.config, engine.tokenizer, twin))


def prefill_logits(backend, ids):
    blocks = np.arange(-(-len(ids) // backend.block_size), dtype=np.int32) + 1
    return backend.forward(build_batch([Segment(np.asarray(ids, np.int32), 0, blocks, "all")], backend.block_size))


def rel_err(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def random_pair():
    eng = Engine(model="smollm2-135m-shape", device="cuda", cache={"num_blocks": 2048})
    return eng, numpy_twin(eng)


@pytest.mark.parametrize("n", [1, 7, 16, 17, 100])
def test_prefill_logits_match_numpy(random_pair, n):
    cu, cpu = random_pair
    ids = np.random.default_rng(n).integers(0, cu.model_config.vocab_size, n)
    a, b = prefill_logits(cu.backend, ids), prefill_logits(cpu.backend, ids)
    assert np.isfinite(a).all()
    assert rel_err(a, b) < 2e-2, rel_err(a, b)


def test_ragged_decode_graphs_match_numpy(random_pair):
    cu, cpu = random_pair
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 49152, int(n)) for n in (5, 40, 17, 90)]
    p = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs_cu = cu.generate(prompts, p, use_tqdm=False)
    assert len(cu.backend.graphs) > 0, "decode steps did not run as CUDA graphs"
    # compare the logits of one decode step on identical contexts (greedy paths may diverge at ties)
    for prompt, out in zip(prompts, outs_cu):
        ctx = np.concatenate([prompt, out.token_ids[:-1]])
        a, b = prefill_logits(cu.backend, ctx)[-1], prefill_logits(cpu.backend, ctx)[-1]
        assert rel_err(a, b) < 2e-2


SMOL = os.environ.get("METRALE_SMOLLM2_GGUF", "/tmp/mdl/smollm2.gguf")


@pytest.mark.skipif(not os.path.exists(SMOL), reason=f"real SmolLM2 GGUF not at {SMOL}")
def test_real_smollm2_greedy_64_tokens_equal_numpy():
    cu = Engine(model=SMOL, device="cuda", cache={"num_blocks": 1024})
    cpu = numpy_twin(cu)
    prompt = "<|im_start|>user\nWrite a short story about a robot who learns to paint.<|im_end|>\n<|im_start|>assistant\n"
    p = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    a = cu.generate([prompt], p, use_tqdm=False)[0]
    b = cpu.generate([prompt], p, use_tqdm=False)[0]
    print("cuda:", repr(a.text))
    np.testing.assert_array_equal(a.token_ids, b.token_ids)
    ids = cu.tokenizer.encode(prompt, add_special_tokens=True)
    la, lb = prefill_logits(cu.backend, ids), prefill_logits(cpu.backend, ids)
    assert rel_err(la, lb) < 1e-2
    assert (np.argmax(la, -1) == np.argmax(lb, -1)).mean() > 0.95


@pytest.fixture(scope="module")
def random_1b_pair():
    """Llama-3.2-1B shape: its 2048x2048+ matrices go to cuBLASLt from 2 rows (when it loads)."""
    eng = Engine(model="llama-3.2-1b-shape", device="cuda", cache={"num_blocks": 512},
                 scheduler={"max_model_len": 2048})
    return eng, numpy_twin(eng)


@pytest.mark.parametrize("n", [2, 33, 100])
def test_1b_shape_prefill_matches_numpy(random_1b_pair, n):
    cu, cpu = random_1b_pair
    ids = np.random.default_rng(n).integers(0, cu.model_config.vocab_size, n)
    a, b = prefill_logits(cu.backend, ids), prefill_logits(cpu.backend, ids)
    assert np.isfinite(a).all()
    assert rel_err(a, b) < 2e-2, rel_err(a, b)


def decode_step_logits(backend, contexts):
    """Prefill each context but its last token into its own blocks, then one decode step of all
    the last tokens together (the decode attention path; a CUDA graph on the CUDA backend)."""
    bs, segs, start = backend.block_size, [], 1
    for ids in contexts:
        n = -(-len(ids) // bs)
        blocks = np.arange(start, start + n, dtype=np.int32)
        start += n
        backend.forward(build_batch([Segment(np.asarray(ids[:-1], np.int32), 0, blocks, "last")], bs))
        segs.append(Segment(np.asarray(ids[-1:], np.int32), len(ids) - 1, blocks))
    return backend.forward(build_batch(segs, bs))


@pytest.mark.parametrize("model", ["smollm2-135m-shape", "llama-3.2-1b-shape"])
def test_tensor_core_decode_attention_end_to_end(model):
    """levers.decode_attention_kernel=mma: a ragged decode step (flash_decode) gives NumPy's logits."""
    cu = Engine(model=model, device="cuda", cache={"num_blocks": 1024}, scheduler={"max_model_len": 2048},
                levers={"decode_attention_kernel": "mma"})
    cpu = numpy_twin(cu)
    rng = np.random.default_rng(3)
    contexts = [rng.integers(0, cu.model_config.vocab_size, int(n)) for n in (5, 300, 17, 700)]
    a, b = decode_step_logits(cu.backend, contexts), decode_step_logits(cpu.backend, contexts)
    assert len(cu.backend.graphs) > 0, "the decode step did not run as a CUDA graph"
    assert rel_err(a, b) < 2e-2, rel_err(a, b)


def test_verify_blocks_replay_decode_graphs(random_pair):
    """Verify-shaped steps (a few tokens per sequence, logits for every row, mixed with a decode
    row) pad to a ladder size and replay a decode graph; their logits equal NumPy's."""
    cu, cpu = random_pair
    rng = np.random.default_rng(5)
    contexts = [rng.integers(0, 49152, int(n)) for n in (40, 9, 130)]
    q = [5, 1, 4]                                     # tokens per sequence in the step

    def step(backend):
        bs, segs, start = backend.block_size, [], 1
        for ids, k in zip(contexts, q):
            n = -(-len(ids) // bs)
            blocks = np.arange(start, start + n, dtype=np.int32)
            start += n
            backend.forward(build_batch([Segment(np.asarray(ids[:-k], np.int32), 0, blocks, "last")], bs))
            segs.append(Segment(np.asarray(ids[-k:], np.int32), len(ids) - k, blocks, "all"))
        return backend.forward(build_batch(segs, bs))

    a, b = step(cu.backend), step(cpu.backend)
    assert a.shape == (sum(q), 49152)
    assert any(g.tokens == 16 for g in cu.backend.graphs), "the verify step did not replay a decode graph"
    assert rel_err(a, b) < 2e-2, rel_err(a, b)
