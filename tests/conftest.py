import os
from contextlib import contextmanager

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

collect_ignore = ["kernels_sim"]   # run in a subprocess with NUMBA_ENABLE_CUDASIM=1 (test_kernels_sim.py)


@pytest.fixture(scope="session")
def smollm2():
    """The real embedded model on the NumPy backend, loaded once per test session."""
    from metrale import Engine
    return Engine(model="smollm2-135m", device="cpu", levers={"cpu_kernels": "numpy"})   # the NumPy oracle


@contextmanager
def scratch_blocks(engine, num_tokens: int):
    """KV blocks for a test's direct `backend.forward` on a shared engine, taken from its block
    manager and given back after: writing blocks behind the manager's back corrupts its prefix
    cache (a later request whose prompt hits a cached block would read the test's K/V: the golden
    and chat tests failed that way after test_server.py had filled the cache)."""
    from metrale import SamplingParams
    from metrale.scheduler.sequence import Sequence
    holder = Sequence([0], SamplingParams())
    assert engine.blocks.grow(holder, num_tokens), "no free KV blocks for the test"
    try:
        yield np.array(holder.block_table, np.int32)
    finally:
        engine.blocks.release(holder)


def skip_without_q8() -> None:
    """The q8 CPU kernels need AVX2 or AVX-512 VNNI (their integer dot products)."""
    from metrale.runtime.cpu_ops import has_q8
    if not has_q8():
        pytest.skip("the q8 CPU kernels need AVX2 or AVX-512 VNNI")


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def pytest_collection_modifyitems(config, items):
    """Tests marked slow (the simulator subprocesses, minutes each) run first: under pytest-xdist
    they then start early on some worker while the others take the short tests, instead of one of
    them starting last and running alone. `-n auto --maxschedchunk 2` (README): load scheduling
    hands each worker tests two at a time in this order, so the slow ones spread over the workers
    and every worker runs its tests in the serial order (worksteal does not: a test that reads the
    session's SmolLM2 engine after another file's use of it can then see that use, as the golden
    and chat tests did after test_server's)."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)   # stable: order kept within each group
