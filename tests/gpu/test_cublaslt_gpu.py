"""cuBLASLt (nvmath-python) linear layers on a real GPU: against the float64 reference, with bias
and accumulate, inside a CUDA graph, and the backend's many-row path against the Numba kernels."""
import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from numba import cuda  # noqa: E402

from kernels_numba.convert import x_to_bf16  # noqa: E402
from kernels_numba.ptx import bf16_bits_to_f32, f32_to_bf16_bits  # noqa: E402
from metrale.runtime.cuda import CudaGraph, Stream  # noqa: E402
from metrale.runtime.cuda.cublaslt import WORKSPACE_BYTES, CublasLt, available  # noqa: E402

ok, why = available()
if not ok:
    pytest.skip(f"cuBLASLt unavailable: {why}", allow_module_level=True)


def _ptr(a):
    return a.__cuda_array_interface__["data"][0]


@pytest.fixture(scope="module")
def blas():
    ws = cuda.device_array(WORKSPACE_BYTES, np.uint8)
    b = CublasLt(_ptr(ws), WORKSPACE_BYTES)
    yield b
    b.close()


def _linear_error(blas, T, N, K, mode, seed) -> float:
    """One blas.linear call (plain / bias / accumulate) on random operands: its relative error
    against the float64 reference of the bf16-rounded inputs."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, K)).astype(np.float32)
    w = f32_to_bf16_bits(rng.standard_normal((N, K)).astype(np.float32) / np.float32(np.sqrt(K)))
    bias = rng.standard_normal(N).astype(np.float32) if mode == "bias" else None
    r0 = rng.standard_normal((T, N)).astype(np.float32) if mode == "accumulate" else np.zeros((T, N), np.float32)
    s = Stream()
    dx, dw, dout = cuda.to_device(x), cuda.to_device(w), cuda.to_device(r0)
    xb = cuda.device_array(T * K, np.uint16)
    x_to_bf16(dx, xb, stream=s.numba)
    db = cuda.to_device(bias) if bias is not None else None
    blas.linear(_ptr(xb), _ptr(dw), _ptr(dout), T, N, K, bias_ptr=_ptr(db) if db is not None else 0,
                accumulate=mode == "accumulate", stream=s.ptr)
    s.synchronize()
    xr = bf16_bits_to_f32(f32_to_bf16_bits(x)).astype(np.float64)
    ref = xr @ bf16_bits_to_f32(w).astype(np.float64).T + (0 if bias is None else bias) + r0
    out = dout.copy_to_host()
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


@pytest.mark.parametrize("T,N,K", [(64, 4096, 4096), (4096, 6144, 4096), (100, 576, 1536), (1, 192, 576)])
@pytest.mark.parametrize("mode", ["plain", "bias", "accumulate"])
def test_linear_matches_reference(blas, T, N, K, mode):
    err = _linear_error(blas, T, N, K, mode, T + N + K)
    assert err < 1e-4, f"relative error {err:.2e}"


def test_linear_replays_in_a_graph(blas):
    T, N, K = 128, 1024, 2048
    rng = np.random.default_rng(1)
    x = rng.standard_normal((T, K)).astype(np.float32)
    w = f32_to_bf16_bits(rng.standard_normal((N, K)).astype(np.float32) / 40)
    s = Stream()
    dx, dw, dout = cuda.to_device(x), cuda.to_device(w), cuda.device_array((T, N), np.float32)
    xb = cuda.device_array(T * K, np.uint16)

    def step():
        x_to_bf16(dx, xb, stream=s.numba)
        blas.linear(_ptr(xb), _ptr(dw), _ptr(dout), T, N, K, stream=s.ptr)

    g = CudaGraph.capture(s, step, warmup=1)
    x2 = rng.standard_normal((T, K)).astype(np.float32)
    dx.copy_to_device(x2)
    g.replay()
    s.synchronize()
    ref = bf16_bits_to_f32(f32_to_bf16_bits(x2)).astype(np.float64) @ bf16_bits_to_f32(w).astype(np.float64).T
    out = dout.copy_to_host()
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-4
    g.close()


@pytest.mark.parametrize("mode", ["accumulate", "bias"])
def test_autotuned_plans_leave_the_output_alone(mode):
    """Autotune times candidates on the call's operands into a scratch buffer: the first call's
    result (accumulate: out += x @ w.T) is the reference's, and the chosen candidate is no slower
    than the heuristic's first (the same timings chose it)."""
    ws = cuda.device_array(WORKSPACE_BYTES, np.uint8)
    blas = CublasLt(_ptr(ws), WORKSPACE_BYTES, autotune=8)
    T, N, K = 32, 6144, 4096
    assert _linear_error(blas, T, N, K, mode, 7) < 1e-4
    (key, (pick, best_us, first_us)), = blas.tuned.items()
    assert key == (T, N, K, mode == "accumulate", mode == "bias")
    assert best_us <= first_us
    print(f"autotune {key}: candidate {pick} {best_us:.1f} us, heuristic's first {first_us:.1f} us")
    blas.close()


def test_autotune_without_split_k():
    """split_k=False: the kept algorithm is a one-kernel one (SPLITK_NUM 1) whenever the heuristic
    offered one, and the product is still right."""
    ws = cuda.device_array(WORKSPACE_BYTES, np.uint8)
    blas = CublasLt(_ptr(ws), WORKSPACE_BYTES, autotune=8, split_k=False)
    T, N, K = 32, 4096, 4096
    assert _linear_error(blas, T, N, K, "accumulate", 3) < 1e-4
    (key, (pick, best_us, _)), = blas.tuned.items()
    p = blas.plans[key]
    print(f"no split-K autotune {key}: candidate {pick} {best_us:.1f} us, split {blas._split_k_num(p.algo_ptr)}")
    assert blas._split_k_num(p.algo_ptr) == 1 or best_us == float("inf")
    blas.close()
