"""The NumPy backend against an independent implementation (HF transformers, tools/make_golden.py)."""
import json
from pathlib import Path

import numpy as np
import pytest

from metrale import SamplingParams
from metrale.runtime.batch import Segment, build_batch

from conftest import scratch_blocks

FIXTURE = Path(__file__).parent / "fixtures" / "golden_smollm2.npz"


@pytest.fixture(scope="module")
def golden():
    z = np.load(FIXTURE)
    return z, json.loads(str(z["meta"]))


def prompt_logits(engine, ids: np.ndarray) -> np.ndarray:
    backend = engine.backend
    with scratch_blocks(engine, len(ids)) as blocks:
        return backend.forward(build_batch([Segment(ids, 0, blocks, logits="all")], backend.block_size))


@pytest.mark.parametrize("p", range(4))
def test_logits_match_transformers(smollm2, golden, p):
    z, meta = golden
    ids = z[f"p{p}_ids"]
    logits = prompt_logits(smollm2, ids)
    assert logits.shape == (len(ids), meta["vocab_size"])
    # top-1 equal at every position
    np.testing.assert_array_equal(np.argmax(logits, axis=-1), z[f"p{p}_top1"])
    # logits close: the golden top-20 and a fixed random sample of 512 vocab ids
    top = np.take_along_axis(logits, z[f"p{p}_topk_ids"], axis=-1)
    np.testing.assert_allclose(top, z[f"p{p}_topk_logits"], atol=2e-3, rtol=1e-3)
    sample = logits[:, z["vocab_sample_ids"]]
    np.testing.assert_allclose(sample, z[f"p{p}_sample_logits"], atol=2e-3, rtol=1e-3)
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    np.testing.assert_allclose(lse, z[f"p{p}_logsumexp"], atol=2e-3)


@pytest.mark.parametrize("p", [0, 1])
def test_greedy_continuation_32_tokens(smollm2, golden, p):
    z, _ = golden
    out = smollm2.generate(z[f"p{p}_ids"], SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True),
                           use_tqdm=False)[0]
    np.testing.assert_array_equal(out.token_ids, z[f"p{p}_greedy"])
    assert out.finish_reason == "length"
