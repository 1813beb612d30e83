"""cuBLASLt autotune picks on disk (levers.cublaslt_tune_cache, metrale/runtime/cuda/tune_cache.py)
on a real GPU. Each start is a fresh process with an empty picks directory at first: the first
start times the candidates and stores its picks; the second times nothing (its _fastest raises),
takes the same candidates from the disk and computes the same products; the engine's second start
of the 1B shape reuses every pick of the first and generates the same tokens."""
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from metrale.runtime.cuda.cublaslt import available  # noqa: E402

ok, why = available()
if not ok:
    pytest.skip(f"cuBLASLt unavailable: {why}", allow_module_level=True)

BLAS_CHILD = r"""
import json, sys
import numpy as np
from numba import cuda
from kernels_numba.convert import x_to_bf16
from kernels_numba.ptx import f32_to_bf16_bits
from metrale.runtime.cuda import Stream
from metrale.runtime.cuda.cublaslt import WORKSPACE_BYTES, CublasLt

picks_dir, out_path, forbid = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
ptr = lambda a: a.__cuda_array_interface__["data"][0]
ws = cuda.device_array(WORKSPACE_BYTES, np.uint8)
blas = CublasLt(ptr(ws), WORKSPACE_BYTES, autotune=8, tune_cache=picks_dir)
if forbid:
    def no_timing(*args):
        raise AssertionError("timed a product whose pick is on disk")
    blas._fastest = no_timing
s = Stream()
outs = {}
for T, N, K, mode in [(8, 6144, 4096, "plain"), (32, 6144, 4096, "accumulate"), (32, 4096, 4096, "bias"),
                      (64, 2048, 8192, "plain"), (128, 49152, 576, "plain")]:
    rng = np.random.default_rng(T + N + K)
    x = rng.standard_normal((T, K)).astype(np.float32)
    w = f32_to_bf16_bits(rng.standard_normal((N, K)).astype(np.float32) / np.float32(np.sqrt(K)))
    r0 = rng.standard_normal((T, N)).astype(np.float32) if mode == "accumulate" else np.zeros((T, N), np.float32)
    bias = cuda.to_device(rng.standard_normal(N).astype(np.float32)) if mode == "bias" else None
    dx, dw, dout = cuda.to_device(x), cuda.to_device(w), cuda.to_device(r0)
    xb = cuda.device_array(T * K, np.uint16)
    x_to_bf16(dx, xb, stream=s.numba)
    blas.linear(ptr(xb), ptr(dw), ptr(dout), T, N, K, bias_ptr=ptr(bias) if bias is not None else 0,
                accumulate=mode == "accumulate", stream=s.ptr)
    s.synchronize()
    outs[f"{T}x{N}x{K}_{mode}"] = dout.copy_to_host()
np.savez(out_path, **outs)
algos = {repr(k): list(blas._fingerprint(p.algo_ptr)) for k, p in blas.plans.items()}
print(json.dumps({"tuned": {repr(k): v[0] for k, v in blas.tuned.items()},
                  "reused": {repr(k): v for k, v in blas.reused.items()}, "algos": algos}))
blas.close()
"""


def _run(code: str, *args: str, env: dict | None = None) -> dict:
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=500,
                         env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_second_start_times_nothing_and_picks_the_same_algorithms():
    picks = tempfile.mkdtemp(prefix="metrale-picks-")
    work = tempfile.mkdtemp(prefix="metrale-picks-out-")
    first = _run(BLAS_CHILD, picks, os.path.join(work, "first.npz"), "0")
    print("first start:", json.dumps(first))
    assert len(first["tuned"]) >= 4 and first["reused"] == {}     # a product with one candidate is not timed
    files = [f for f in os.listdir(picks) if f.endswith(".json")]
    assert len(files) == 1
    with open(os.path.join(picks, files[0])) as f:
        stored = json.load(f)
    assert len(stored["picks"]) == len(first["tuned"]) and stored["context"]["gpu"]
    second = _run(BLAS_CHILD, picks, os.path.join(work, "second.npz"), "1")     # _fastest raises
    print("second start:", json.dumps(second))
    assert second["tuned"] == {}
    assert second["reused"] == first["tuned"]              # the same index of the same heuristic list
    assert second["algos"] == first["algos"]               # the same algorithms (configuration attributes)
    a, b = np.load(os.path.join(work, "first.npz")), np.load(os.path.join(work, "second.npz"))
    assert sorted(a.files) == sorted(b.files)
    for name in a.files:
        # the same algorithm on the same operands; a split-K pick's in-place reduction may sum in
        # another order, hence the tolerance
        np.testing.assert_allclose(b[name], a[name], rtol=1e-5, atol=1e-5, err_msg=name)
        print(name, "bitwise equal" if np.array_equal(a[name], b[name]) else "equal within 1e-5")


ENGINE_CHILD = r"""
import json, sys
from pathlib import Path
from metrale.runtime.cuda import tune_cache
tune_cache.default_dir = lambda: Path(sys.argv[1])     # a fresh picks directory; the kernel cache as it is
from metrale import Engine, SamplingParams
e = Engine(model="llama-3.2-1b-shape", device="cuda", cache={"num_blocks": 512},
           scheduler={"max_num_seqs": 8, "max_num_batched_tokens": 512})
blas = e.backend.blas
tuned = {repr(k): v[0] for k, v in blas.tuned.items()}
reused = {repr(k): v for k, v in blas.reused.items()}
out = e.generate([[5, 6, 7, 8, 9], [11, 12, 13]], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
                 use_tqdm=False)
print(json.dumps({"tuned": tuned, "reused": reused, "tokens": [o.token_ids.tolist() for o in out]}))
"""


def test_engine_second_start_reuses_every_pick():
    picks = tempfile.mkdtemp(prefix="metrale-picks-")
    first = _run(ENGINE_CHILD, picks)
    assert first["tuned"] and first["reused"] == {}
    second = _run(ENGINE_CHILD, picks)
    print(f"first start: {len(first['tuned'])} products timed; second: {len(second['tuned'])} timed, "
          f"{len(second['reused'])} from the disk")
    assert second["tuned"] == {}
    assert second["reused"] == first["tuned"]
    assert second["tokens"] == first["tokens"]
