"""metrale.runtime.cuda on a real GPU: pool arrays in kernels, streams/events, graph capture + replay."""

import time

import numpy as np
import pytest
from numba import cuda

from metrale.runtime.cuda import (ALIGN, CudaError, CudaGraph, DevicePool, Event, GraphCache, Stream,
                                  batch_ladder, free_device_memory)

pytestmark = pytest.mark.gpu

N_KERNELS = 100
N = 4096
BLOCK = 128


@cuda.jit
def axpb(x, y, a, b):
    i = cuda.grid(1)
    if i < x.size:
        y[i] = a * x[i] + b


@cuda.jit
def fill_index(m):
    i, j = cuda.grid(2)
    if i < m.shape[0] and j < m.shape[1]:
        m[i, j] = i * m.shape[1] + j


@cuda.jit
def spin_then_write(out, iters, value):
    acc = 0.0
    for k in range(iters):
        acc = acc * 0.5 + 1.0
    i = cuda.grid(1)
    if i < out.size:
        out[i] = value + acc * 0.0


def addr(arr) -> int:
    return arr.__cuda_array_interface__["data"][0]


@pytest.fixture(scope="module")
def pool():
    with DevicePool(64 << 20, {"weights": 8 << 20, "activations": 8 << 20, "kv": None}) as p:
        yield p


@pytest.fixture(scope="module")
def stream():
    s = Stream()
    yield s
    s.close()


def coeffs(k):
    return 1.0 + 0.01 * (k % 3), 0.001 * k


def chain(x, bufs, n, stream):
    """N_KERNELS dependent launches: x -> bufs[0] -> bufs[1] -> bufs[0] ... over the first n items."""
    grid = (n + BLOCK - 1) // BLOCK
    src, views = (x, bufs) if n == x.size else (x[:n], [b[:n] for b in bufs])
    for k in range(N_KERNELS):
        dst = views[k % 2]
        a, b = coeffs(k)
        axpb[grid, BLOCK, stream.numba](src, dst, a, b)
        src = dst
    return src


def chain_ref(x):
    y = x.astype(np.float64)
    for k in range(N_KERNELS):
        a, b = coeffs(k)
        y = a * y + b
    return y


def test_free_device_memory():
    free, total = free_device_memory()
    assert 0 < free <= total


def test_pool_arrays_work_in_kernels(pool, stream):
    host = np.arange(1000, dtype=np.float32)
    w = pool["weights"].upload(host)
    y = pool.alloc("activations", 1000, np.float32)
    m = pool.alloc("kv", (33, 70), np.int32)
    for arr, region in ((w, "weights"), (y, "activations"), (m, "kv")):
        a = pool[region]
        assert addr(arr) % ALIGN == 0 and a.base <= addr(arr) < a.base + a.capacity
    assert m.strides == (280, 4) and m.shape == (33, 70) and m.dtype == np.int32
    axpb[(1000 + 127) // 128, 128, stream.numba](w, y, 2.0, 1.0)
    fill_index[(5, 3), (8, 32), stream.numba](m)
    stream.synchronize()
    np.testing.assert_allclose(y.copy_to_host(), 2 * host + 1)
    np.testing.assert_array_equal(m.copy_to_host(), np.arange(33 * 70).reshape(33, 70))
    # a slice of a pool array is a view of the same memory
    axpb[1, 128, stream.numba](w[10:20], y[:10], 1.0, 0.0)
    stream.synchronize()
    np.testing.assert_array_equal(y.copy_to_host()[:10], host[10:20])
    # reset: the same requests get the same addresses
    act = pool["activations"]
    act.reset()
    first = [addr(act.alloc(s, np.float32)) for s in (100, 7, 5000)]
    act.reset()
    assert [addr(act.alloc(s, np.float32)) for s in (100, 7, 5000)] == first
    usage = pool.usage()
    assert usage["weights"].used == 4000 and usage["activations"].peak >= 4096
    print("\npool:", pool)


def test_events_order_streams(pool, stream):
    other = Stream()
    out = pool.alloc("activations", N, np.float32)
    res = pool.alloc("activations", N, np.float32)
    spin_then_write[N // BLOCK, BLOCK, other.numba](out, 1, 0.0)  # warm-up compile
    other.synchronize()
    start = other.record()
    spin_then_write[N // BLOCK, BLOCK, other.numba](out, 200_000, 3.0)
    done = other.record()
    stream.wait_event(done)
    axpb[N // BLOCK, BLOCK, stream.numba](out, res, 2.0, 0.0)
    stream.synchronize()
    assert done.query()
    np.testing.assert_array_equal(res.copy_to_host(), np.full(N, 6.0, np.float32))
    ms = start.elapsed_ms(done)
    assert ms > 0
    print(f"\nspin kernel on the other stream: {ms:.3f} ms")
    other.close()


@pytest.mark.parametrize("mode", ["thread_local", "relaxed"])
def test_graph_replay_matches_eager_with_new_inputs(pool, stream, mode):
    x = pool.alloc("activations", N, np.float32)
    bufs = [pool.alloc("activations", N, np.float32) for _ in range(2)]
    rng = np.random.default_rng(0)
    x.copy_to_device(rng.standard_normal(N).astype(np.float32), stream=stream.numba)
    out = chain(x, bufs, N, stream)  # the last buffer written (bufs[1]); same every run
    graph = CudaGraph.capture(stream, lambda: chain(x, bufs, N, stream), warmup=1, mode=mode)
    assert graph.node_types() == {"CU_GRAPH_NODE_TYPE_KERNEL": N_KERNELS}
    for trial in range(3):
        host = rng.standard_normal(N).astype(np.float32)
        x.copy_to_device(host, stream=stream.numba)
        chain(x, bufs, N, stream)
        eager = out.copy_to_host(stream=stream.numba)
        stream.synchronize()
        bufs[0].copy_to_device(np.zeros(N, np.float32), stream=stream.numba)
        bufs[1].copy_to_device(np.zeros(N, np.float32), stream=stream.numba)
        x.copy_to_device(host, stream=stream.numba)
        graph.replay()
        replayed = out.copy_to_host(stream=stream.numba)
        stream.synchronize()
        np.testing.assert_array_equal(replayed, eager)
        np.testing.assert_allclose(replayed, chain_ref(host), rtol=1e-5, atol=1e-5)
    graph.close()


def test_graph_cache_pads_to_ladder(pool, stream):
    x = pool.alloc("activations", N, np.float32)
    bufs = [pool.alloc("activations", N, np.float32) for _ in range(2)]
    out = bufs[(N_KERNELS - 1) % 2]
    rows = 128  # items per batch row
    cache = GraphCache(stream)
    cache.capture_all(batch_ladder(8), lambda size: (lambda: chain(x, bufs, size * rows, stream)))
    assert cache.sizes == [1, 2, 4, 8]
    host = np.random.default_rng(1).standard_normal(N).astype(np.float32)
    x.copy_to_device(host, stream=stream.numba)
    bufs[1].copy_to_device(np.zeros(N, np.float32), stream=stream.numba)
    assert cache.replay(3) == 4
    got = out.copy_to_host(stream=stream.numba)
    stream.synchronize()
    np.testing.assert_allclose(got[:4 * rows], chain_ref(host[:4 * rows]), rtol=1e-5, atol=1e-5)
    assert not got[4 * rows:].any()  # the size-4 graph touched only its rows
    with pytest.raises(KeyError):
        cache.replay(9)
    cache.close()


def test_illegal_work_during_capture_raises_and_leaves_stream_usable(pool, stream):
    x = pool.alloc("activations", N, np.float32)
    y = pool.alloc("activations", N, np.float32)

    def syncs():
        axpb[N // BLOCK, BLOCK, stream.numba](x, y, 1.0, 0.0)
        stream.synchronize()

    with pytest.raises(CudaError, match="cuStreamSynchronize"):
        CudaGraph.capture(stream, syncs, warmup=1)
    assert not stream.is_capturing()
    host = np.ones(N, np.float32)

    def passes_host_array():
        axpb[N // BLOCK, BLOCK, stream.numba](host, y, 1.0, 0.0)

    with pytest.raises(Exception) as info:
        CudaGraph.capture(stream, passes_host_array, warmup=1)
    print(f"\nhost array in capture -> {type(info.value).__name__}: {info.value}")
    assert not stream.is_capturing()
    x.copy_to_device(host, stream=stream.numba)
    axpb[N // BLOCK, BLOCK, stream.numba](x, y, 2.0, 0.0)
    got = y.copy_to_host(stream=stream.numba)
    stream.synchronize()
    np.testing.assert_array_equal(got, 2 * host)
    with pytest.raises(CudaError, match="cuStreamEndCapture failed"):
        from metrale.runtime.cuda import cu
        cu("cuStreamEndCapture", stream.handle)


def test_timing_eager_vs_replay(pool, stream):
    x = pool.alloc("activations", N, np.float32)
    bufs = [pool.alloc("activations", N, np.float32) for _ in range(2)]
    graph = CudaGraph.capture(stream, lambda: chain(x, bufs, N, stream), warmup=2)
    reps = 30
    stream.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        chain(x, bufs, N, stream)
    t_launch = time.perf_counter() - t0
    stream.synchronize()
    t_eager = time.perf_counter() - t0
    for _ in range(5):
        graph.replay()
    stream.synchronize()
    reps_g = 300
    t0 = time.perf_counter()
    for _ in range(reps_g):
        graph.replay()
    t_glaunch = time.perf_counter() - t0
    stream.synchronize()
    t_replay = time.perf_counter() - t0
    start, end = Event(), Event()
    start.record(stream)
    graph.replay()
    end.record(stream)
    end.synchronize()
    gpu_ms = start.elapsed_ms(end)
    eager_us = t_eager / (reps * N_KERNELS) * 1e6
    replay_us = t_replay / (reps_g * N_KERNELS) * 1e6
    print(f"\neager: {eager_us:.2f} us/kernel wall ({t_launch / (reps * N_KERNELS) * 1e6:.2f} us host launch)"
          f"\nreplay: {replay_us:.2f} us/kernel wall ({t_glaunch / reps_g * 1e6:.1f} us host per "
          f"cuGraphLaunch of {N_KERNELS} kernels; one replay {gpu_ms * 1e3 / N_KERNELS:.2f} us/kernel on the GPU)"
          f"\nspeed-up {eager_us / replay_us:.1f}x")
    assert replay_us < eager_us / 2
    graph.close()
