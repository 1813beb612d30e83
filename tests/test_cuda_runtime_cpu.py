"""metrale.runtime.cuda without a GPU: arena arithmetic, region layout, ladder, KV sizing, errors."""

import subprocess
import sys

import numpy as np
import pytest

from metrale.runtime.cuda import (ALIGN, Arena, CudaError, GraphCache, batch_ladder,
                                  check, kv_pool_bytes, pick_size, plan_regions)

FAKE_BASE = 0x7F00_0000_0040  # deliberately not 256-aligned


def test_import_touches_no_driver():
    code = ("import metrale.runtime.cuda; "
            "from metrale.runtime.cuda import errors; "
            "assert errors.driver.cache_info().currsize == 0")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_arena_aligns_every_allocation():
    arena = Arena("act", FAKE_BASE, 1 << 20)
    addrs = [arena.reserve(n) for n in (1, 3, 255, 256, 257, 0, 1000)]
    assert all(a % ALIGN == 0 for a in addrs)
    assert all(FAKE_BASE <= a < FAKE_BASE + (1 << 20) for a in addrs)
    assert addrs == sorted(addrs)
    assert addrs[1] - addrs[0] == ALIGN and addrs[4] - addrs[3] == 256 and addrs[5] - addrs[4] == 512


def test_arena_reset_replays_the_same_addresses():
    arena = Arena("act", FAKE_BASE, 1 << 20)
    sizes = [4096, 17, 300, 65536, 5]
    first = [arena.reserve(n) for n in sizes]
    peak = arena.peak
    arena.reset()
    assert arena.used == 0 and arena.peak == peak
    assert [arena.reserve(n) for n in sizes] == first


def test_arena_mark_release_and_peak():
    arena = Arena("act", 0, 4096)
    arena.reserve(1000)
    mark = arena.mark()
    a = arena.reserve(1000)
    arena.release(mark)
    assert arena.reserve(10) == a
    assert arena.used == 1024 + 10 and arena.peak == 2024
    with pytest.raises(ValueError):
        arena.release(5000)


def test_arena_out_of_memory_names_the_region():
    arena = Arena("kv", 0, 1024)
    arena.reserve(1000)
    with pytest.raises(MemoryError, match="'kv'"):
        arena.reserve(100)
    assert arena.used == 1000  # a failed request leaves the arena unchanged
    arena.reset()
    assert arena.reserve(1024) == 0


def test_arena_alloc_builds_arrays_through_make_array():
    made = []
    arena = Arena("w", 0, 1 << 16, make_array=lambda a, s, d: made.append((a, s, d)) or a)
    arena.alloc((3, 5), np.uint16)
    arena.alloc(7, "float32")
    assert made == [(0, (3, 5), np.dtype(np.uint16)), (256, (7,), np.dtype(np.float32))]
    assert arena.used == 256 + 28
    with pytest.raises(TypeError):
        Arena("x", 0, 10).alloc(1)


def test_plan_regions_rest_and_alignment():
    plan = plan_regions(10_000, {"weights": 1000, "activations": 300, "kv": None})
    assert plan["weights"] == (0, 1024)
    assert plan["activations"] == (1024, 512)
    off, size = plan["kv"]
    assert off == 1536 and size == 8448 and off + size <= 10_000
    assert all(o % ALIGN == 0 for o, _ in plan.values())
    with pytest.raises(ValueError, match="only one"):
        plan_regions(10_000, {"a": None, "b": None})
    with pytest.raises(ValueError, match="need"):
        plan_regions(1000, {"a": 2000})


def test_batch_ladder_and_pick():
    assert batch_ladder(32) == [1, 2, 4, 8, 16, 32]
    assert batch_ladder(48) == [1, 2, 4, 8, 16, 32, 48]
    assert batch_ladder(1) == [1]
    assert batch_ladder(40, step=8) == [1, 2, 4, 8, 16, 24, 32, 40]
    ladder = batch_ladder(64)
    assert [pick_size(ladder, b) for b in (1, 2, 3, 5, 8, 9, 33, 64)] == [1, 2, 4, 8, 8, 16, 64, 64]
    assert pick_size(ladder, 65) is None
    with pytest.raises(ValueError):
        batch_ladder(0)


def test_graph_cache_lookup_without_graphs():
    cache = GraphCache(stream=None)
    assert cache.lookup(1) is None and 1 not in cache
    with pytest.raises(KeyError, match="no graph for batch 3"):
        cache.replay(3)


def test_kv_pool_bytes_follows_gpu_memory_utilization():
    GiB = 1 << 30
    # 140 GiB device, 20 GiB in use (weights + context), 90%, 4 GiB still to come for activations
    assert kv_pool_bytes(120 * GiB, 140 * GiB, 0.9, 4 * GiB) == 126 * GiB - 20 * GiB - 4 * GiB
    assert kv_pool_bytes(free=10 * GiB, total=140 * GiB, utilization=0.5) == 0  # over budget: none
    assert kv_pool_bytes(1000, 1000, 1.0, 1) % ALIGN == 0
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError):
            kv_pool_bytes(1, 2, bad)
    with pytest.raises(ValueError):
        kv_pool_bytes(3, 2, 0.5)


def test_cuda_error_names_call_and_error():
    err = CudaError("cuMemAlloc", 2)
    assert "cuMemAlloc failed" in str(err) and "CUDA_ERROR_OUT_OF_MEMORY" in str(err) and "(2)" in str(err)
    assert err.call == "cuMemAlloc" and err.code == 2 and err.name == "CUDA_ERROR_OUT_OF_MEMORY"
    assert "[hint]" in str(CudaError("cuStreamEndCapture", 901, "hint"))
    assert "CUresult 987654" in str(CudaError("cuX", 987654))


def test_check_unpacks_results():
    assert check("cuA", (0,)) is None
    assert check("cuA", (0, 7)) == 7
    assert check("cuA", (0, 7, 8)) == (7, 8)
    assert check("cuA", 0) is None
    with pytest.raises(CudaError, match="cuStreamCreate failed: CUDA_ERROR_INVALID_VALUE"):
        check("cuStreamCreate", (1, None))


def test_gemm_library_lever_choices_without_a_gpu():
    from metrale.runtime.cuda_backend import CudaBackend
    from metrale.runtime.cuda.cublaslt import available

    assert CudaBackend._want_cublaslt("numba") is False
    with pytest.raises(ValueError, match="gemm_library must be auto, numba or cublaslt"):
        CudaBackend._want_cublaslt("cublas")
    if not available()[0]:           # this machine: no driver, so auto falls back and cublaslt says why
        assert CudaBackend._want_cublaslt("auto") is False
        with pytest.raises(RuntimeError, match="does not load"):
            CudaBackend._want_cublaslt("cublaslt")
