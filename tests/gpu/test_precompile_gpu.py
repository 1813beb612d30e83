"""levers.compile_workers on the GPU: a start with an empty kernel cache compiles the warm-up's
kernels in worker processes, so the engine's own warm-up compiles none of them (it loads them from
the disk cache); a second start skips the recording run (its marker); greedy tokens equal a start
that compiled everything in-process (compile_workers=0). Each start is a fresh process."""
import json
import os
import subprocess
import sys
import tempfile

import pytest

pytestmark = pytest.mark.gpu

CHILD = r"""
import json, sys
from numba.cuda import dispatcher
compiled = []
_compile = dispatcher.CUDADispatcher.compile
def counted(self, sig):
    n, hits = len(self.overloads), sum(self._cache_hits.values())
    k = _compile(self, sig)
    if len(self.overloads) > n and sum(self._cache_hits.values()) == hits:
        compiled.append(self.py_func.__qualname__)     # compiled here, not loaded from the disk cache
    return k
dispatcher.CUDADispatcher.compile = counted
from metrale import Engine, SamplingParams
e = Engine(model="smollm2-135m-shape", device="cuda", cache={"num_blocks": 512},
           scheduler={"max_num_seqs": 8, "max_num_batched_tokens": 512},
           levers={"graph_batch_sizes": [1, 2, 4, 8], "compile_workers": int(sys.argv[1])})
at_ready = list(compiled)
out = e.generate([[5, 6, 7, 8, 9], [11, 12, 13]], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
                 use_tqdm=False)
print(json.dumps({"stats": e.backend.compile_stats, "compiled_at_ready": at_ready,
                  "tokens": [o.token_ids.tolist() for o in out]}))
"""


def _start(cache: str, workers: int) -> dict:
    env = {**os.environ, "XDG_CACHE_HOME": cache}
    env.pop("NUMBA_CACHE_DIR", None)
    out = subprocess.run([sys.executable, "-c", CHILD, str(workers)], env=env, capture_output=True, text=True,
                         timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_workers_fill_the_cache_and_the_warm_up_compiles_nothing():
    cache = tempfile.mkdtemp(prefix="metrale-precompile-")
    first = _start(cache, 4)
    stats = first["stats"]
    print("first start:", json.dumps(stats))
    assert stats["pending"] > 5 and stats["workers"] == 4
    assert stats["compiled"] == stats["pending"] and stats["failed"] == []
    again = _start(cache, 4)
    assert again["stats"] is None                   # the marker: no recording run
    assert again["compiled_at_ready"] == []         # everything from the disk cache
    inline = _start(tempfile.mkdtemp(prefix="metrale-precompile-"), 0)
    assert inline["stats"] is None
    # what the first start compiled itself is only what ran before the recording (the random weights'
    # fill): the warm-up's kernels all came from the workers
    print("compiled in-process, first start:", first["compiled_at_ready"])
    assert set(first["compiled_at_ready"]) <= set(inline["compiled_at_ready"])
    assert len(inline["compiled_at_ready"]) - len(first["compiled_at_ready"]) == stats["pending"]
    assert not any("gemv" in k or "flash" in k for k in first["compiled_at_ready"])
    assert first["tokens"] == again["tokens"] == inline["tokens"]
