"""levers.mixed_graphs without a GPU: the bucket of a prefill/mixed step, the padding of its
metadata (MetaBuffers.upload on a host buffer), and what the padded layout means to attention."""
import numpy as np
import pytest

from metrale.runtime.batch import Segment, build_batch
from metrale.runtime.cuda.buckets import MAX_MIXED_GRAPHS, mixed_bucket, padding, pow2_at_least, token_ladder

BS = 16


def bucket(T, S, R, q, max_tokens=2048, max_seqs=256, pmt=64):
    return mixed_bucket(T, S, R, q, ladder=token_ladder(max_tokens), max_seqs=max_seqs, max_rows=max_seqs,
                        prefill_min_tokens=pmt)


def test_ladder_and_pow2():
    assert token_ladder(2048) == [64, 128, 256, 512, 1024, 2048]
    assert token_ladder(3000) == [64, 128, 256, 512, 1024, 2048, 3000]
    assert token_ladder(40) == [40]
    assert [pow2_at_least(n) for n in (0, 1, 2, 3, 64, 65)] == [1, 1, 2, 4, 64, 128]
    assert MAX_MIXED_GRAPHS >= 16


def test_buckets_of_typical_steps():
    assert bucket(512, 1, 1, 512) == (512, 1, 1, 512)            # one 512-token prefill: no padding
    assert bucket(300, 1, 1, 300) == (512, 2, 2, 512)            # one padding segment of 212 tokens
    # 30 decode rows + a 100-token chunk: 130 tokens -> 256, 126 padding tokens in one segment of <= 128
    assert bucket(130, 31, 31, 100) == (256, 32, 32, 128)
    # short query lengths still bucket to >= prefill_attention_min_tokens
    assert bucket(70, 1, 1, 70, pmt=64) == (128, 2, 2, 128)
    assert bucket(2000, 200, 200, 64)[:2] == (2048, 256)
    # verify blocks (logits for every row) need more rows than sequences
    assert bucket(200, 4, 100, 96) == (256, 8, 128, 128)


def test_steps_that_stay_eager():
    assert bucket(2049, 1, 1, 2049) is None                      # above the top bucket
    assert bucket(1100, 250, 250, 64) is None                    # padding segments would pass max_seqs
    assert bucket(10, 300, 10, 64) is None


def test_padding_with_one_token_segments_is_the_decode_padding():
    """seg_len 1 reproduces MetaBuffers.upload's padding of decode (and verify) graphs."""
    for T, S, size in [(3, 3, 4), (1, 1, 8), (7, 3, 8), (16, 16, 16)]:
        ar = np.arange(size * 3 + 2, dtype=np.int32)
        ts, sq, rows = padding(T, S, T, size, size, size, 1)
        np.testing.assert_array_equal(ts, ar[S:][:size - T])
        np.testing.assert_array_equal(sq, np.minimum(ar[T + 1:T + 1 + size - S], size))
        np.testing.assert_array_equal(rows, ar[T:][:size - T])


def test_padding_checks_room():
    with pytest.raises(ValueError):
        padding(10, 1, 1, 64, 2, 2, 16)       # 54 padding tokens in segments of 16 need 4 sequences


class FakeStream:
    handle = 0


def host_upload(batch, g):
    """The real MetaBuffers.upload, into a host buffer (the device copy is stubbed)."""
    from metrale.runtime import cuda_backend as cb
    m = cb.MetaBuffers.__new__(cb.MetaBuffers)
    max_tokens, max_seqs, max_blocks = 4096, 256, 64
    sizes = {"token_ids": max_tokens, "positions": max_tokens, "slot_mapping": max_tokens, "token_seq": max_tokens,
             "seq_query_start": max_seqs + 1, "context_lens": max_seqs, "logits_indices": max_seqs,
             "token_src": max_tokens}
    m.offsets, off = {}, 0
    for name in cb.MetaBuffers.FIELDS:
        m.offsets[name] = off
        off += -(-sizes[name] // 32) * 32
    m.table_offset, m.max_blocks = off, max_blocks
    m.hosts = [np.full(off + max_seqs * max_blocks, 12345, np.int32) for _ in range(2)]
    m.host = m.hosts[1]         # upload writes the other one first
    m.device = None
    orig_cu, orig_ptr, orig_rows = cb.cu, cb._ptr, cb.copy_rows_htod
    copies = []
    cb.cu, cb._ptr = (lambda *a: None), (lambda a: 0)
    cb.copy_rows_htod = lambda dst, src, pitch, width, rows, stream: copies.append((pitch, width, rows))
    try:
        m.upload(batch, g, FakeStream())
    finally:
        cb.cu, cb._ptr, cb.copy_rows_htod = orig_cu, orig_ptr, orig_rows
    assert copies == [(4 * max_blocks, 4 * max(1, batch.block_tables.shape[1]), g.seqs)]   # the columns used
    get = lambda name, n: m.host[m.offsets[name]:m.offsets[name] + n].copy()   # noqa: E731
    tables = m.host[m.table_offset:m.table_offset + g.seqs * max_blocks].reshape(g.seqs, max_blocks)
    return {"token_ids": get("token_ids", g.tokens), "positions": get("positions", g.tokens),
            "slot_mapping": get("slot_mapping", g.tokens), "token_seq": get("token_seq", g.tokens),
            "seq_query_start": get("seq_query_start", g.seqs + 1), "context_lens": get("context_lens", g.seqs),
            "logits_indices": get("logits_indices", g.rows), "tables": tables.copy()}


def mixed_batch(rng):
    """Decode rows, a chunk after 40 cached positions, a fresh prompt: prefill with decode."""
    segs, start = [], 0
    for pos, n, logits in [(20, 1, "last"), (40, 90, "last"), (0, 70, "last"), (7, 1, "last"), (3, 4, "all")]:
        nb = -(-(pos + n) // BS)
        segs.append(Segment(rng.integers(0, 1000, n).astype(np.int32), pos,
                            np.arange(start + 1, start + 1 + nb, dtype=np.int32), logits))
        start += nb
    return build_batch(segs, BS)


def _grown(b: tuple[int, int, int, int], grow: int) -> tuple[int, int, int, int]:
    """A bigger bucket of the same token size that holds b's steps (a captured one replayed by a
    step whose own bucket is b: CudaBackend._captured_holder)."""
    tb, sb, rb, qb = b
    return (tb, sb * grow, rb * grow, min(qb * grow, tb))


@pytest.mark.parametrize("grow", [1, 2])
def test_upload_pads_a_mixed_step_to_its_bucket(grow):
    from metrale.runtime.cuda.buckets import holds
    from metrale.runtime.cuda_backend import Geometry
    batch = mixed_batch(np.random.default_rng(0))
    T, S, R = batch.num_tokens, batch.num_seqs, len(batch.logits_indices)
    own = bucket(T, S, R, batch.max_query_len)
    assert (T, S, R, batch.max_query_len) == (166, 5, 8, 90) and own == (256, 8, 8, 128)
    tb, sb, rb, qb = _grown(own, grow)
    assert holds((tb, sb, rb, qb), own, T, S, R, batch.max_query_len)
    g = Geometry(tb, sb, rb, 0, qb, None, mixed=True)
    h = host_upload(batch, g)
    # the step itself, unchanged
    for name in ("token_ids", "positions", "slot_mapping", "token_seq", "logits_indices"):
        np.testing.assert_array_equal(h[name][:len(getattr(batch, name))], getattr(batch, name))
    np.testing.assert_array_equal(h["seq_query_start"][:S + 1], batch.seq_query_start)
    width = batch.block_tables.shape[1]          # the columns a step copies (no kernel reads past them)
    np.testing.assert_array_equal(h["tables"][:S, :width], batch.block_tables)
    # padding tokens: id 0, position 0, written nowhere, in padding segments of <= qb tokens
    assert (h["token_ids"][T:] == 0).all() and (h["positions"][T:] == 0).all() and (h["slot_mapping"][T:] == -1).all()
    sq = h["seq_query_start"]
    assert sq[0] == 0 and sq[-1] == tb and (np.diff(sq) >= 0).all()
    assert np.diff(sq).max() <= qb, "a segment longer than the attention grid covers"
    np.testing.assert_array_equal(h["token_seq"], np.repeat(np.arange(sb), np.diff(sq)))
    assert (h["tables"][S:, :width] == 0).all() and (h["context_lens"][S:] == 1).all()
    # padding logits rows read a valid token
    assert (h["logits_indices"] < tb).all() and (h["logits_indices"] >= 0).all()


def test_upload_of_decode_and_eager_geometries_unchanged():
    """Lever off: decode graphs pad one token a sequence; eager geometries add no padding."""
    from metrale.runtime.cuda_backend import Geometry
    rng = np.random.default_rng(1)
    segs = [Segment(np.array([5], np.int32), p, np.array([i + 1, i + 2], np.int32)) for i, p in enumerate((3, 17, 9))]
    batch = build_batch(segs, BS)
    h = host_upload(batch, Geometry(8, 8, 8, 512, 1))
    np.testing.assert_array_equal(h["token_seq"], np.arange(8))
    np.testing.assert_array_equal(h["seq_query_start"], np.arange(9))
    np.testing.assert_array_equal(h["logits_indices"], np.arange(8))
    assert (h["slot_mapping"][3:] == -1).all()
    batch = mixed_batch(rng)
    g = Geometry(batch.num_tokens, batch.num_seqs, len(batch.logits_indices), 130, batch.max_query_len)
    h = host_upload(batch, g)
    np.testing.assert_array_equal(h["seq_query_start"], batch.seq_query_start)
    np.testing.assert_array_equal(h["token_seq"], batch.token_seq)
    np.testing.assert_array_equal(h["logits_indices"], batch.logits_indices)


@pytest.mark.parametrize("grow", [1, 2])
def test_padded_attention_leaves_the_step_unchanged(grow):
    """The NumPy attention reference on the padded layout (its own bucket, or a bigger one that
    holds it): the step's rows are those of the unpadded step, padding rows are finite (they read
    block 0 at position 0)."""
    from kernels_numba.attention import attention_ref
    from kernels_numba.bf16 import to_bf16_bits
    from metrale.runtime.cuda_backend import Geometry
    rng = np.random.default_rng(2)
    batch = mixed_batch(rng)
    tb, sb, rb, qb = _grown(bucket(batch.num_tokens, batch.num_seqs, len(batch.logits_indices), batch.max_query_len), grow)
    h = host_upload(batch, Geometry(tb, sb, rb, 0, qb, None, mixed=True))
    hq, hk, hd, nb = 4, 2, 32, int(batch.block_tables.max()) + 2
    kc = to_bf16_bits(rng.standard_normal((nb, BS, hk, hd)))
    vc = to_bf16_bits(rng.standard_normal((nb, BS, hk, hd)))
    q = rng.standard_normal((tb, hq, hd)).astype(np.float32)
    T = batch.num_tokens
    want = attention_ref(q[:T], kc, vc, batch.block_tables, batch.token_seq, batch.positions, hd ** -0.5)
    got = attention_ref(q, kc, vc, h["tables"], h["token_seq"], h["positions"], hd ** -0.5)
    np.testing.assert_allclose(got[:T], want, rtol=1e-12, atol=1e-12)
    assert np.isfinite(got).all()


def test_warm_up_steps_cover_every_token_and_rows_bucket():
    """levers.warm_mixed: one warm-up step per (token bucket, rows bucket) pair, each of them a
    mixed-graph step (so the kernels its replay needs are compiled before serving)."""
    from metrale.runtime.cuda_backend import CudaBackend
    b = object.__new__(CudaBackend)
    b.graph_sizes, b.max_rows, b.max_seqs, b.block_size = [1, 2, 4, 8, 16, 32, 64, 128, 256], 256, 256, 16
    b.prefill_min_tokens, b.mixed_ladder = 64, token_ladder(2048)
    b.max_model_len, b.max_blocks = 4096, 256
    batches = b.warm_mixed_batches()
    tokens = {int(x.num_tokens) for x in batches}
    rows = {len(x.logits_indices) for x in batches}
    assert tokens == set(b.mixed_ladder) and rows == set(b.graph_sizes)
    for x in batches:
        assert x.max_query_len >= b.prefill_min_tokens
        got = mixed_bucket(x.num_tokens, x.num_seqs, len(x.logits_indices), x.max_query_len, ladder=b.mixed_ladder,
                           max_seqs=b.max_seqs, max_rows=b.max_rows, prefill_min_tokens=b.prefill_min_tokens)
        assert got is not None and got[0] == x.num_tokens


def test_warm_up_steps_respect_a_short_context():
    """max_model_len 64 (the window tests): no warm-up segment is longer than the context, and a
    context shorter than the prefill kernel's minimum warms nothing."""
    from metrale.runtime.cuda_backend import CudaBackend
    b = object.__new__(CudaBackend)
    b.graph_sizes, b.max_rows, b.max_seqs, b.block_size = [1, 2, 4, 8], 8, 8, 16
    b.prefill_min_tokens, b.mixed_ladder, b.max_model_len, b.max_blocks = 64, token_ladder(512), 64, 4
    batches = b.warm_mixed_batches()
    assert batches and all(int(x.max_query_len) <= 64 and x.block_tables.shape[1] <= 4 for x in batches)
    assert {int(x.num_tokens) for x in batches} <= set(b.mixed_ladder)
    b.max_seqs = b.max_rows = 64
    b.graph_sizes, b.mixed_ladder = [1, 2, 4, 8, 16, 32, 64], token_ladder(2048)
    batches = b.warm_mixed_batches()
    assert batches and all(int(x.max_query_len) <= 64 and x.block_tables.shape[1] <= 4 for x in batches)
    assert all(int(x.num_seqs) <= 64 for x in batches)
    b.max_model_len = 32
    assert b.warm_mixed_batches() == []


class _Graph:
    """CudaGraph.capture's stand-in: records the capture (fn not run: capture executes nothing)
    and counts replays; `fail` makes the capture raise, as a kernel compiling inside it does."""
    fail = False

    def __init__(self):
        self.replays = 0

    @classmethod
    def capture(cls, stream, fn, *, warmup=1, mode="thread_local"):
        if cls.fail and not warmup:
            raise RuntimeError("cuStreamEndCapture: a kernel compiled during capture")
        for _ in range(warmup):
            fn()
        graph = cls()
        graph.warmup = warmup
        return graph

    def replay(self):
        self.replays += 1

    def close(self):
        pass


def _backend_for_first_steps(monkeypatch, compiled: bool):
    from metrale.runtime import cuda_backend
    from metrale.runtime.cuda_backend import CudaBackend, Geometry
    monkeypatch.setattr(cuda_backend, "CudaGraph", _Graph)
    b = object.__new__(CudaBackend)
    b.stream, b.graphs, b._mixed_lru, b._mixed_seen = FakeStream(), {}, {}, set()
    b._mixed_compiled, b._mixed_capture_failed = compiled, set()
    b.mixed_stats = {"captures": 0, "replays": 0, "evictions": 0, "eager_steps": 0}
    b.eager_runs = []
    b._run = b.eager_runs.append
    return b, Geometry(1024, 64, 64, 0, 64, None, mixed=True)


def test_first_step_of_a_compiled_bucket_is_captured_and_replayed(monkeypatch):
    """warm_mixed compiled the kernels: a bucket's first step is captured and replayed (no eager
    step), its later steps replay the same graph."""
    b, g = _backend_for_first_steps(monkeypatch, compiled=True)
    b._first_mixed_step(g)
    assert b.eager_runs == [] and b.graphs[g].warmup == 0 and b.graphs[g].replays == 1
    assert b.mixed_stats == {"captures": 1, "replays": 0, "evictions": 0, "eager_steps": 0}


def test_first_step_runs_eagerly_until_its_kernels_are_compiled(monkeypatch):
    """Without warm_mixed, a bucket's first step runs eagerly (compiling its kernels), its second is
    captured with no warm-up and replayed."""
    b, g = _backend_for_first_steps(monkeypatch, compiled=False)
    b._first_mixed_step(g)
    assert b.eager_runs == [g] and g not in b.graphs and b.mixed_stats["eager_steps"] == 1
    b._first_mixed_step(g)
    assert b.eager_runs == [g] and b.graphs[g].warmup == 0 and b.graphs[g].replays == 1
    assert b.mixed_stats["captures"] == 1


def test_a_failed_capture_runs_the_step_eagerly(monkeypatch, caplog):
    """A capture with no warm-up that raises leaves no graph: the step runs eagerly, the failure is
    logged once, and the bucket's next step is captured after an eager warm-up run (which computes
    that step: no replay), as before the change."""
    b, g = _backend_for_first_steps(monkeypatch, compiled=True)
    monkeypatch.setattr(_Graph, "fail", True)
    with caplog.at_level("WARNING", logger="metrale"):
        b._first_mixed_step(g)
        assert b.eager_runs == [g] and not b.graphs and b.mixed_stats["eager_steps"] == 1
        b._first_mixed_step(g)
    assert b.eager_runs == [g, g] and b.graphs[g].warmup == 1 and b.graphs[g].replays == 0
    assert b.mixed_stats["captures"] == 1
    assert sum("capture with no warm-up run failed" in r.message for r in caplog.records) == 1


def test_holds_a_step_in_a_bucket_of_its_own_token_size():
    from metrale.runtime.cuda.buckets import holds
    own = bucket(1008, 63, 63, 20)                      # 63 prompts of 16 tokens: 16 padding tokens
    assert own == (1024, 64, 64, 64)
    assert holds((1024, 128, 128, 64), own, 1008, 63, 63, 20)     # more sequences and rows: padding
    assert holds((1024, 128, 128, 128), own, 1008, 63, 63, 20)    # a longer query length too
    assert not holds((2048, 128, 128, 64), own, 1008, 63, 63, 20)  # twice the tokens: not reused
    assert not holds((1024, 64, 64, 16), own, 1008, 63, 63, 20)    # queries longer than its tiles
    assert not holds((1024, 32, 64, 64), own, 1008, 63, 63, 20)    # too few sequences
    assert not holds((1024, 64, 32, 64), own, 1008, 63, 63, 20)    # too few logits rows
    # room for the padding segments: 700 tokens of 1024 leave 324 padding tokens = 6 segments of 64
    own = bucket(700, 50, 50, 20)
    assert holds((1024, 64, 64, 64), own, 700, 58, 58, 20)                # 58 + 6 = 64 sequences
    assert not holds((1024, 64, 64, 64), own, 700, 59, 59, 20)            # 59 + 6 > 64


def _backend_for_geometry():
    from types import SimpleNamespace
    from metrale.runtime.cuda_backend import CudaBackend
    b = object.__new__(CudaBackend)
    b.max_tokens, b.max_seqs, b.max_rows, b.max_model_len = 2048, 256, 256, 4096
    b.config, b.family = SimpleNamespace(num_layers=30), SimpleNamespace(layer_prefix=True)
    b.use_graphs = b.mixed_graphs = True
    b.prefill_min_tokens, b.graph_sizes, b.mixed_ladder = 64, [1, 2, 4, 8, 16, 32, 64, 128, 256], token_ladder(2048)
    b.mixed_stats = {"captures": 0, "replays": 0, "evictions": 0, "eager_steps": 0}
    b.graphs, b._mixed_lru = {}, {}
    return b


def _prompts(n: int, length: int, decode_rows: int = 0):
    rng = np.random.default_rng(n)
    segs = [Segment(rng.integers(0, 1000, length).astype(np.int32), 0,
                    np.arange(i * 4, i * 4 + 2, dtype=np.int32), "last") for i in range(n)]
    segs += [Segment(np.array([5], np.int32), 20, np.array([n * 4 + 2 * i, n * 4 + 2 * i + 1], np.int32))
             for i in range(decode_rows)]
    return build_batch(segs, BS)


def test_a_new_bucket_replays_a_captured_one_that_holds_it():
    """A wave of 63 prompts alone after waves of 63 prompts + 1 decode row (docs/performance.md's
    served-wave trace): its own bucket (1024 tokens, 64 seqs) was never captured, the wave's
    (1024, 128, 128, 64) was, so the step replays that graph instead of capturing its own."""
    b = _backend_for_geometry()
    with_decode = _prompts(63, 16, decode_rows=1)
    g_wave, graphed = b._geometry(with_decode)
    assert graphed and g_wave.mixed and (g_wave.tokens, g_wave.seqs) == (1024, 128)
    alone = _prompts(63, 16)
    g_own, _ = b._geometry(alone)
    assert (g_own.tokens, g_own.seqs, g_own.rows) == (1024, 64, 64)         # nothing captured yet
    b.graphs[g_wave] = object()
    b._mixed_lru[g_wave] = None
    assert b._geometry(alone)[0] == g_wave                                  # now: the captured one
    b.graphs[g_own] = object()
    assert b._geometry(alone)[0] == g_own                                   # its own, once captured
    twice = _prompts(40, 16)                                                # 640 tokens: its own bucket
    assert b._geometry(twice)[0].tokens == 1024 and b._geometry(_prompts(20, 16))[0].tokens == 512
