"""levers.mixed_graphs on a GPU: prefill and mixed prefill+decode steps replayed from bucketed
CUDA graphs give the eager path's tokens and logits (pytest -m gpu -s prints a 512-token timing)."""
import time

import numpy as np
import pytest

from metrale import Engine, SamplingParams
from metrale.runtime.batch import Segment, build_batch

pytestmark = pytest.mark.gpu

MODEL = "smollm2-135m-shape"


def engine(mixed: bool) -> Engine:
    return Engine(model=MODEL, device="cuda", cache={"num_blocks": 1024},
                  scheduler={"max_model_len": 2048, "max_num_batched_tokens": 512, "max_num_seqs": 32},
                  levers={"mixed_graphs": mixed})


@pytest.fixture(scope="module")
def pair():
    on, off = engine(True), engine(False)
    assert on.backend.mixed_graphs and not off.backend.mixed_graphs
    return on, off


def rel_err(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def mixed_graph_count(backend) -> int:
    return sum(1 for g in backend.graphs if g.mixed)


def test_engine_mixed_workload_same_greedy_tokens(pair):
    """Prompts of different lengths, a 512-token step budget: chunked prefills share steps with
    decode rows; greedy tokens equal with the lever on and off (near-ties aside: the padded steps'
    cuBLASLt products have other row counts, so at most two of eight sequences may diverge)."""
    on, off = pair
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 49152, int(n)) for n in (700, 90, 300, 65, 1000, 130, 20, 450)]
    p = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    on.generate(prompts, p, use_tqdm=False)          # a bucket's first step is captured (warm_mixed compiled it)
    a = on.generate(prompts, p, use_tqdm=False)
    b = off.generate(prompts, p, use_tqdm=False)
    stats = on.backend.mixed_stats
    print(f"\nmixed graphs: {mixed_graph_count(on.backend)} kept, stats {stats}")
    assert mixed_graph_count(on.backend) > 0 and stats["captures"] > 0, "no prefill step replayed a graph"
    assert mixed_graph_count(off.backend) == 0
    diverged = [i for i, (x, y) in enumerate(zip(a, b)) if list(x.token_ids) != list(y.token_ids)]
    for i in diverged:
        print(f"sequence {i} diverged: on {list(a[i].token_ids)} off {list(b[i].token_ids)}")
    assert len(diverged) <= 2, diverged


def chunked_step_logits(backend, replays: int = 3):
    """One mixed step (decode rows + a 200-token chunk + a fresh 90-token prompt) after its
    contexts were prefilled, run `replays` times (the first captures its bucket, all replay)."""
    bs = backend.block_size
    rng = np.random.default_rng(7)
    ctx = [rng.integers(0, 49152, n).astype(np.int32) for n in (40, 377, 90, 9, 260)]
    chunk_at = {1: 177, 4: 60}                          # sequences whose step is a prefill chunk
    tables, start = [], 1
    for ids in ctx:
        n = -(-len(ids) // bs)
        tables.append(np.arange(start, start + n, dtype=np.int32))
        start += n
    segs = []
    for i, ids in enumerate(ctx):
        if i == 2:                                     # a fresh prompt: no cached context
            segs.append(Segment(ids, 0, tables[i], "last"))
            continue
        first = chunk_at.get(i, len(ids) - 1)
        backend.forward(build_batch([Segment(ids[:first], 0, tables[i], "last")], bs))
        segs.append(Segment(ids[first:], first, tables[i], "last"))
    batch = build_batch(segs, bs)
    out = [backend.forward(batch) for _ in range(replays)]
    return out, batch


def test_mixed_step_logits_close_and_replayed(pair):
    on, off = pair
    (a1, a2, a3), batch = chunked_step_logits(on.backend)
    (b1, _, _), _ = chunked_step_logits(off.backend)
    g, graphed = on.backend._geometry(batch)
    assert graphed and g.mixed and g in on.backend.graphs, g
    assert not off.backend._geometry(batch)[1]
    assert np.isfinite(a1).all() and np.isfinite(a2).all() and np.isfinite(a3).all()
    assert rel_err(a2, a1) < 1e-5, rel_err(a2, a1)        # replays repeat the first step's logits
    assert rel_err(a3, a1) < 1e-5, rel_err(a3, a1)        # and so does the replay
    assert rel_err(a1, b1) < 5e-3, rel_err(a1, b1)
    assert (np.argmax(a1, -1) == np.argmax(b1, -1)).all()


def test_forward_greedy_prefill_of_many_lengths(pair):
    """Single prefills of lengths across buckets: argmax ids equal, logits close; then a repeat of
    every length replays (no new capture)."""
    on, off = pair
    bs = on.backend.block_size
    batches = []
    for n in (64, 100, 255, 256, 257, 512):
        ids = np.random.default_rng(n).integers(0, 49152, n).astype(np.int32)
        table = np.arange(-(-n // bs), dtype=np.int32) + 1
        batch = build_batch([Segment(ids, 0, table, "all" if n <= 100 else "last")], bs)
        a, b = on.backend.forward(batch), off.backend.forward(batch)
        assert on.backend._geometry(batch)[0].mixed
        assert np.isfinite(a).all()
        assert rel_err(a, b) < 5e-3, (n, rel_err(a, b))
        assert (np.argmax(a, -1) == np.argmax(b, -1)).mean() > 0.95
        batches.append(batch)
    before = on.backend.mixed_stats["captures"]
    for batch in batches:
        on.backend.forward_greedy(batch)
    assert on.backend.mixed_stats["captures"] == before


def test_lru_bounds_the_mixed_graphs(pair, monkeypatch):
    from metrale.runtime import cuda_backend
    on, _ = pair
    monkeypatch.setattr(cuda_backend, "MAX_MIXED_GRAPHS", 2)
    bs = on.backend.block_size
    for n in (64, 128, 256, 512, 64):
        ids = np.random.default_rng(n).integers(0, 49152, n).astype(np.int32)
        batch = build_batch([Segment(ids, 0, np.arange(-(-n // bs), dtype=np.int32) + 1)], bs)
        on.backend.forward_greedy(batch)
        on.backend.forward_greedy(batch)                 # a replay
        assert mixed_graph_count(on.backend) <= 2
    assert on.backend.mixed_stats["evictions"] > 0


def test_prefill_512_timing_print(pair):
    """Print only: a 512-token prefill step, lever on vs off (no assertion on times)."""
    res = {}
    for name, eng in zip(("on", "off"), pair):
        be = eng.backend
        bs = be.block_size
        ids = np.random.default_rng(11).integers(0, 49152, 512).astype(np.int32)
        batch = build_batch([Segment(ids, 0, np.arange(512 // bs, dtype=np.int32) + 1)], bs)
        for _ in range(2):
            be.forward_greedy(batch)
        times = []
        for _ in range(10):
            t0 = time.perf_counter()
            be.forward_greedy(batch)
            times.append(time.perf_counter() - t0)
        res[name] = 1e3 * float(np.median(times))
    print(f"\n{MODEL} prefill 512: mixed_graphs on {res['on']:.2f} ms, off {res['off']:.2f} ms "
          f"({res['off'] / res['on']:.1f}x)")


def test_short_prefills_replay_the_decode_graphs(pair):
    """A prompt shorter than the prefill attention kernel's minimum, alone and beside decode rows,
    replays a decode-ladder graph (token-level kernels, logits of some rows) with the eager path's
    logits; before, every such step (most chat turns, a prefix-cache hit's short suffix) ran eagerly."""
    on, off = pair
    bs = on.backend.block_size
    rng = np.random.default_rng(11)
    short = rng.integers(0, 49152, 21).astype(np.int32)
    alone = build_batch([Segment(short, 0, np.array([1, 2], np.int32), "last")], bs)
    ctx = [rng.integers(0, 49152, n).astype(np.int32) for n in (30, 200)]
    segs = []
    for i, ids in enumerate(ctx):
        table = np.arange(3 + 20 * i, 3 + 20 * i + -(-len(ids) // bs) + 1, dtype=np.int32)
        for be in (on.backend, off.backend):
            be.forward(build_batch([Segment(ids[:-1], 0, table, "last")], bs))
        segs.append(Segment(ids[-1:], len(ids) - 1, table, "last"))
    segs.append(Segment(short[:13], 0, np.array([60, 61], np.int32), "last"))
    beside = build_batch(segs, bs)
    for batch in (alone, beside):
        g, graphed = on.backend._geometry(batch)
        assert graphed and not g.mixed and g.tokens >= batch.num_tokens, g
        assert not off.backend._geometry(batch)[1]
        graphs_before = len(on.backend.graphs)
        a, b = on.backend.forward(batch), off.backend.forward(batch)
        assert len(on.backend.graphs) == graphs_before, "a new capture: the ladder graph should have been there"
        assert a.shape == b.shape == (len(batch.logits_indices), 49152)
        assert rel_err(a, b) < 5e-3, rel_err(a, b)
        assert (np.argmax(a, -1) == np.argmax(b, -1)).all()
    p = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    x = on.generate([short, short[:5]], p, use_tqdm=False)
    y = off.generate([short, short[:5]], p, use_tqdm=False)
    assert [len(o.token_ids) for o in x] == [8, 8]
    assert [o.token_ids[0] for o in x] == [o.token_ids[0] for o in y]     # later ones may part at a near-tie


def test_many_short_prompts_take_a_mixed_bucket(pair):
    """Short prompts beyond the decode ladder (20 prompts of 20 tokens: 400 tokens > 256) take a
    mixed bucket (its query length the prefill kernel's minimum) instead of an eager step."""
    on, off = pair
    bs = on.backend.block_size
    rng = np.random.default_rng(12)
    segs = [Segment(rng.integers(0, 49152, 20).astype(np.int32), 0, np.array([2 * i + 1, 2 * i + 2], np.int32), "last")
            for i in range(20)]
    batch = build_batch(segs, bs)
    g, graphed = on.backend._geometry(batch)
    assert graphed and g.mixed and g.max_query_len >= on.backend.prefill_min_tokens, g
    a = [on.backend.forward(batch) for _ in range(3)]      # eager, capture, replay
    b = off.backend.forward(batch)
    assert g in on.backend.graphs
    for x in a[1:]:
        assert rel_err(x, a[0]) < 1e-5, rel_err(x, a[0])    # capture and replay compute the bucket's eager step
    # without the lever the 20-token queries take the token-level attention, the bucket the prefill
    # kernel over padded queries: other kernels and product shapes in bf16
    assert rel_err(a[0], b) < 2e-2, rel_err(a[0], b)
    assert (np.argmax(a[0], -1) == np.argmax(b, -1)).sum() >= len(segs) - 1
