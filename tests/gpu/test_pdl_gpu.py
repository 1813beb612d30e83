"""PDL trigger modes on the GPU (run on a GPU: pytest -m gpu). The trigger only decides when a
successor grid may be scheduled; griddepcontrol.wait still waits for the whole predecessor, so every
mode must give the same tokens. The mode is compiled into the kernels (process-wide), hence one
subprocess per mode."""
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

SCRIPT = """
import json, sys
import numpy as np
from metrale import Engine, SamplingParams
eng = Engine(model="smollm2-135m-shape", device="cuda", cache={"num_blocks": 256},
             levers={"pdl_trigger": sys.argv[1], "graph_batch_sizes": [1, 4]})
rng = np.random.default_rng(3)
prompts = [rng.integers(0, eng.model_config.vocab_size, n) for n in (40, 17, 29, 8)]
p = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
one = eng.generate(prompts[:1], p, use_tqdm=False)[0].token_ids
four = [o.token_ids for o in eng.generate(prompts, p, use_tqdm=False)]
print("TOKENS" + json.dumps([list(map(int, one))] + [list(map(int, t)) for t in four]))
"""


def _tokens(mode: str) -> list:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    r = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, env=env, timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("TOKENS"))
    return json.loads(line[len("TOKENS"):])


def test_every_trigger_mode_gives_the_same_greedy_tokens():
    ref = _tokens("exit")
    for mode in ("late", "early"):
        assert _tokens(mode) == ref, mode
