"""A hybrid (Gated DeltaNet + attention) model through the whole engine on the NumPy backend."""
import json

import numpy as np
import pytest

from metrale import Engine, SamplingParams
from test_gdn import qwen3_next_cfg, write_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers
    path = tmp_path_factory.mktemp("hybrid") / "m"
    write_model(path, qwen3_next_cfg())
    vocab = {f"w{i}": i for i in range(61)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "w1"}))
    return path


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_batched_chunked_equals_alone(model_dir):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, 61, int(n)) for n in (3, 19, 7, 26)]
    small_chunks = Engine(model=str(model_dir), device="cpu", cache={"block_size": 4},
                          scheduler={"max_num_batched_tokens": 8, "max_num_seqs": 4})
    together = small_chunks.generate(prompts, greedy(10), use_tqdm=False)
    alone_engine = Engine(model=str(model_dir), device="cpu", cache={"block_size": 4})
    for p, out in zip(prompts, together):
        alone = alone_engine.generate([p], greedy(10), use_tqdm=False)[0]
        np.testing.assert_array_equal(out.token_ids, alone.token_ids)
    assert small_chunks.blocks.prefix_caching and small_chunks.recurrent.snapshots is not None   # on, with snapshots
    small_chunks.recurrent.check_no_leaks([])
    small_chunks.blocks.check_no_leaks([])


def test_preemption_and_abort_free_state_slots(model_dir):
    rng = np.random.default_rng(1)
    eng = Engine(model=str(model_dir), device="cpu", cache={"block_size": 4, "num_blocks": 14},
                 scheduler={"max_num_seqs": 4})
    prompts = [rng.integers(2, 61, int(n)) for n in (9, 12, 10, 11)]
    ref = Engine(model=str(model_dir), device="cpu", cache={"block_size": 4})
    outs = eng.generate(prompts, greedy(12), use_tqdm=False)
    assert eng.scheduler.num_preemptions > 0
    for p, o in zip(prompts, outs):
        np.testing.assert_array_equal(o.token_ids, ref.generate([p], greedy(12), use_tqdm=False)[0].token_ids)
    rid = eng.add_request(prompts[0], greedy(30))
    eng.step()
    eng.abort(rid)
    eng.recurrent.slots.check_no_leaks([])
    eng.blocks.check_no_leaks([])


def test_layer_prefix_speculation_is_refused_clearly(model_dir):
    with pytest.raises(ValueError, match="hybrid"):
        Engine(model=str(model_dir), device="cpu", spec={"method": "self"})


def test_prefix_caching_can_be_turned_off(model_dir):
    eng = Engine(model=str(model_dir), device="cpu", levers={"state_snapshots": 0})
    assert not eng.blocks.prefix_caching and eng.recurrent.snapshots is None
