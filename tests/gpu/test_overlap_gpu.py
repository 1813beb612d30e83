"""The host a step ahead on the CUDA backend (levers.overlap): the fed embedding takes each row's
token from the last step's argmax on the device, and greedy ids equal the synchronous loop's."""
import numpy as np
import pytest

from metrale import Engine, SamplingParams

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def engine():
    return Engine(model="smollm2-135m-shape", device="cuda", cache={"num_blocks": 4096},
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
