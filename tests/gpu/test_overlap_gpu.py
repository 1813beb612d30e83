"""The host a step ahead on the CUDA backend (levers.overlap): the fed embedding takes each row's
token from the last step's argmax on the device, and greedy ids equal the synchronous loop's; penalized
rows, ahead with their pending token counted by the device pipeline, give the synchronous loop's
tokens too. Dense (SmolLM2 shape) and Gemma 3 (270M shape: scaled embedding, softcap) families."""
import numpy as np
import pytest

from metrale import Engine, SamplingParams

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=["smollm2-135m-shape", "gemma3-270m-shape"])
def engine(request):
    return Engine(model=request.param, device="cuda", cache={"num_blocks": 4096},
                  scheduler={"max_num_seqs": 32}, levers={"graph_batch_sizes": [1, 2, 4, 8, 16, 32]})


@pytest.mark.parametrize("batch", [1, 8, 32])
def test_greedy_ids_equal_the_synchronous_loop(engine, batch):
    rng = np.random.default_rng(batch)
    prompts = [rng.integers(3, 200, int(rng.integers(4, 40))).astype(np.int32) for _ in range(batch)]
    params = [SamplingParams(max_tokens=int(rng.integers(8, 64)), temperature=0.0, ignore_eos=True)
              for _ in range(batch)]
    ahead = engine.ahead
    assert ahead is not None and engine.backend.overlap
    try:
        engine.ahead = None
        want = [o.token_ids.tolist() for o in engine.generate(prompts, params, use_tqdm=False)]
    finally:
        engine.ahead = ahead
    before = ahead.steps_ahead
    got = [o.token_ids.tolist() for o in engine.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert ahead.steps_ahead > before
    engine.blocks.check_no_leaks([])


PENALTIES = [dict(repetition_penalty=1.3), dict(frequency_penalty=0.6), dict(presence_penalty=0.8),
             dict(repetition_penalty=1.2, frequency_penalty=0.4, presence_penalty=0.4, logit_bias={17: 2.0})]


@pytest.mark.parametrize("batch", [1, 2, 8])
def test_penalized_rows_ahead_equal_the_synchronous_loop(engine, batch):
    rng = np.random.default_rng(100 + batch)
    prompts = [rng.integers(3, 200, int(rng.integers(4, 40))).astype(np.int32) for _ in range(batch)]
    params = [SamplingParams(max_tokens=48, ignore_eos=True, temperature=0.0 if i % 2 == 0 else 1.0, top_k=50,
                             seed=i, **PENALTIES[i % len(PENALTIES)]) for i in range(batch)]
    ahead = engine.ahead
    try:
        engine.ahead = None
        want = [o.token_ids.tolist() for o in engine.generate(prompts, params, use_tqdm=False)]
    finally:
        engine.ahead = ahead
    before = ahead.steps_ahead
    got = [o.token_ids.tolist() for o in engine.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert ahead.steps_ahead - before >= 40
    engine.blocks.check_no_leaks([])
