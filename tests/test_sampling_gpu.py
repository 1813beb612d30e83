"""Sampling kernels and the DevicePipeline on a real GPU: equal to the NumPy pipeline at vocabulary
sizes of real models, the right distribution, speed. Run: pytest -m gpu tests/test_sampling_gpu.py -s"""
import math

import numpy as np
import pytest
from numba import cuda

from kernels_numba import sampling as K

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda.is_available(), reason="needs a CUDA GPU")]


def batch(rng, R, V, n_adj=32):
    logits = (rng.standard_normal((R, V)) * 3).astype(np.float32)
    f = np.zeros((R, K.NF), np.float32)
    i = np.zeros((R, K.NI), np.int32)
    kind = np.arange(R) % 6
    temps = np.array([0.0, 1.0, 0.7, 1.0, 1.2, 0.9], np.float32)[kind]
    f[:, K.F_INV_TEMP] = np.where(temps > 0, np.float32(1) / np.maximum(temps, 1e-6), 0)
    f[:, K.F_TOP_P] = np.array([1, 1, 0.9, 1, 0.95, 1], np.float32)[kind]
    f[:, K.F_LOG_MIN_P] = np.array([-np.inf, -np.inf, -np.inf, -np.inf, -np.inf, math.log(0.05)], np.float32)[kind]
    f[:, K.F_REP] = np.array([1.2, 1, 1, 1.1, 1, 1], np.float32)[kind]
    i[:, K.I_TOP_K] = np.array([-1, -1, 50, 20, -1, -1])[kind]
    i[:, K.I_USE_MASK] = (kind == 3)
    i[:, K.I_NUM_LOGPROBS] = np.array([5, -1, 0, 20, -1, 1])[kind]
    i[:, K.I_SEED_LO] = rng.integers(-2**31, 2**31, R)
    i[:, K.I_SEED_HI] = rng.integers(-2**31, 2**31, R)
    i[:, K.I_STEP] = rng.integers(0, 1000, R)
    toks = np.concatenate([rng.choice(V, n_adj, replace=False) for _ in range(R)]).astype(np.int32)
    i[:, K.I_ADJ_START] = np.arange(R) * n_adj
    i[:, K.I_ADJ_END] = np.arange(R) * n_adj + n_adj
    rep = rng.integers(0, 2, toks.size).astype(np.int32)
    add = rng.standard_normal(toks.size).astype(np.float32)
    mask = rng.integers(0, 2**32, (R, -(-V // 32)), dtype=np.uint64).astype(np.uint32)
    return logits, mask, f, i, toks, rep, add


def run_device(logits, mask, f, i, toks, rep, add, repeat=1, parts=None, top_p=False):
    R = logits.shape[0]
    d = {k: cuda.to_device(v) for k, v in dict(mask=mask, f=f, i=i, toks=toks, rep=rep, add=add).items()}
    raw, lse = cuda.device_array(toks.size, np.float32), cuda.device_array(R, np.float32)
    top_ids, top_lps = cuda.device_array((R, K.MAX_TOP_LOGPROBS), np.int32), cuda.device_array((R, K.MAX_TOP_LOGPROBS), np.float32)
    out, lps = cuda.device_array(R, np.int32), cuda.device_array(R, np.float32)
    times = []
    for _ in range(repeat):
        x = cuda.to_device(logits)
        a, b = cuda.event(), cuda.event()
        a.record()
        K.prepare_rows(x, d["f"], d["i"], d["toks"], d["rep"], d["add"], raw, lse, top_ids, top_lps)
        K.sample_rows(x, d["mask"], d["f"], d["i"], d["toks"], raw, lse, out, lps, parts=parts, top_p=top_p)
        b.record()
        b.synchronize()
        times.append(cuda.event_elapsed_time(a, b) * 1000)
    return out.copy_to_host(), lps.copy_to_host(), top_ids.copy_to_host(), top_lps.copy_to_host(), float(np.median(times))


@pytest.mark.parametrize("V,R", [(128256, 1), (128256, 6), (49152, 12), (151936, 48)])
def test_split_rows_equal_one_block_rows_and_reference(V, R):
    """levers.sampling_split: temperature / min-p / masked rows (and with top_p=True top-p rows
    without top-k) drawn over spans of the row (up to 64 blocks a row at batch 1) give the tokens one
    block a row gives, and the reference's."""
    rng = np.random.default_rng(R)
    args = batch(rng, R, V)
    f, i = args[2], args[3]
    f[f[:, K.F_INV_TEMP] == 0, K.F_INV_TEMP] = 1.0          # no greedy rows: batch 1 is a sampled row
    split_rows = (f[:, K.F_TOP_P] >= 1) & ~((i[:, K.I_TOP_K] > 0) & (i[:, K.I_TOP_K] < V))
    assert split_rows.any() and K.split_chunks(R, V) >= 2
    whole = run_device(*args, repeat=5)
    want = K.sample_rows_ref(*args)[0]
    times = {}
    for top_p in (False, True):
        split = run_device(*args, parts=K.split_parts(R), repeat=5, top_p=top_p)
        np.testing.assert_array_equal(split[0], whole[0])
        np.testing.assert_allclose(split[1], whole[1], rtol=1e-6, atol=1e-6)
        assert (split[0] == want).sum() >= R - 1, (split[0], want)          # a float border case at most
        times[top_p] = split[4]
    print(f"\nV={V} R={R}: split {times[False]:.1f} us, with top-p rows {times[True]:.1f} us, "
          f"one block a row {whole[4]:.1f} us")


@pytest.mark.parametrize("V,R,p", [(128256, 1, 0.9), (128256, 1, 0.3), (151936, 8, 0.95), (49152, 32, 0.9)])
def test_split_top_p_rows_on_flat_and_peaked_rows(V, R, p):
    """Top-p rows without top-k from spans (three mass digits over the spans, one scan each) against
    one block a row and the reference, on flat rows (random logits: the kept set is most of the row)
    and peaked ones (a few tokens hold the mass); prints both times."""
    for peaked in (False, True):
        rng = np.random.default_rng(R + int(peaked))
        logits, mask, f, i, toks, rep, add = batch(rng, R, V, n_adj=1)
        if peaked:
            logits *= 4
        f[:, K.F_INV_TEMP] = 1 / 0.7
        f[:, K.F_TOP_P] = p
        f[:, K.F_LOG_MIN_P] = -np.inf
        i[:, K.I_TOP_K] = -1
        i[:, K.I_USE_MASK] = 0
        i[:, K.I_ADJ_START] = i[:, K.I_ADJ_END] = 0
        args = (logits, mask, f, i, toks, rep, add)
        assert K.top_p_split_rows(f, i, V)
        whole = run_device(*args, repeat=5)
        split = run_device(*args, parts=K.split_parts(R), repeat=5, top_p=True)
        np.testing.assert_array_equal(split[0], whole[0])
        want = K.sample_rows_ref(*args)[0]
        assert (split[0] == want).sum() >= R - 1, (split[0], want)
        print(f"\ntop-p {p} V={V} R={R} {'peaked' if peaked else 'flat'}: split {split[4]:.1f} us, "
              f"one block a row {whole[4]:.1f} us")


@pytest.mark.parametrize("V,R", [(49152, 48), (128256, 48), (151936, 64)])
def test_kernels_equal_reference_at_model_sizes(V, R):
    rng = np.random.default_rng(V)
    args = batch(rng, R, V)
    out, lps, top_ids, top_lps, _ = run_device(*args)
    want, want_lps, want_ids, want_top = K.sample_rows_ref(*args)
    same = out == want
    assert same.sum() >= len(out) - 1, (np.flatnonzero(~same), out[~same], want[~same])   # a border case at most
    ok = same & ~np.isnan(want_lps)
    np.testing.assert_allclose(lps[ok], want_lps[ok], rtol=1e-4, atol=1e-4)
    filled = want_ids >= 0                  # the kernel writes the first num_logprobs entries only
    np.testing.assert_array_equal(top_ids[filled], want_ids[filled])
    np.testing.assert_allclose(top_lps[filled], want_top[filled], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("ties", [False, True])
def test_radix_select_at_qwen_vocab(ties):
    """The radix-select thresholds at V = 151,936, R = 64: every row sampled (top-k, top-p, both, min-p,
    temperature only), equal to the reference; logits on a 1/4 grid put ties on every border. Two runs
    give the same tokens (the fixed-point mass histograms do not depend on the order of the atomics)."""
    V, R = 151936, 64
    rng = np.random.default_rng(7 + ties)
    logits, mask, f, i, toks, rep, add = batch(rng, R, V, n_adj=1)
    if ties:
        logits = np.round(logits * 4) / 4
    kind = np.arange(R) % 8
    f[:, K.F_INV_TEMP] = np.array([1, 1 / 0.7, 1, 1.25, 1, 2, 0.5, 1], np.float32)[kind]
    f[:, K.F_TOP_P] = np.array([1, 0.9, 0.5, 1, 0.95, 0.8, 0.99, 1], np.float32)[kind]
    f[:, K.F_LOG_MIN_P] = np.array([-np.inf] * 6 + [math.log(0.01), math.log(0.1)], np.float32)[kind]
    i[:, K.I_TOP_K] = np.array([50, -1, 40, 1000, 5, -1, 200, -1])[kind]
    i[:, K.I_USE_MASK] = kind % 3 == 0
    i[:, K.I_NUM_LOGPROBS] = -1
    toks, rep, add = np.zeros(1, np.int32), np.zeros(1, np.int32), np.zeros(1, np.float32)
    out, *_ = run_device(logits, mask, f, i, toks, rep, add)
    out2, *_ = run_device(logits, mask, f, i, toks, rep, add)
    np.testing.assert_array_equal(out, out2)
    want, *_ = K.sample_rows_ref(logits, mask, f, i, toks, rep, add)
    same = out == want
    assert same.sum() >= R - 1, (np.flatnonzero(~same), out[~same], want[~same])   # a border case at most


def test_device_distribution():
    x = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0], np.float32)
    R = 8192
    logits = np.tile(x, (R, 1))
    f = np.zeros((R, K.NF), np.float32)
    i = np.zeros((R, K.NI), np.int32)
    f[:, K.F_INV_TEMP], f[:, K.F_TOP_P], f[:, K.F_LOG_MIN_P], f[:, K.F_REP] = 1 / np.float32(0.8), 0.9, -np.inf, 1
    i[:, K.I_TOP_K], i[:, K.I_NUM_LOGPROBS], i[:, K.I_SEED_LO], i[:, K.I_STEP] = 6, -1, 99, np.arange(R)
    z = np.zeros(1, np.int32)
    out, *_ = run_device(logits, np.zeros((R, 1), np.uint32), f, i, z, z, np.zeros(1, np.float32))
    p = np.exp(x.astype(np.float64) / 0.8)
    p[6:] = 0
    p /= p.sum()
    order = np.argsort(-p)
    cum = np.cumsum(p[order])
    p[order[(cum - p[order]) >= 0.9]] = 0
    p /= p.sum()
    counts = np.bincount(out, minlength=8)
    assert (counts[p == 0] == 0).all()
    e = p[p > 0] * R
    stat = ((counts[p > 0] - e) ** 2 / e).sum()
    assert stat < {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515}[int((p > 0).sum()) - 1], (counts, e)


def test_speed_report():
    rng = np.random.default_rng(0)
    for V in (49152, 128256):
        for R in (1, 32, 256):
            args = batch(rng, R, V)
            *_, ms = run_device(*args, repeat=5)
            greedy = list(args)
            greedy[2] = args[2].copy()
            greedy[2][:, K.F_INV_TEMP] = 0
            greedy[3] = args[3].copy()
            greedy[3][:, K.I_NUM_LOGPROBS] = -1
            *_, ms_g = run_device(*greedy, repeat=5)
            print(f"V={V} R={R}: mixed rows {ms:.1f} us, greedy rows {ms_g:.1f} us")


def test_engine_device_pipeline_equals_numpy_pipeline():
    from metrale import Engine, SamplingParams
    from metrale.runtime.batch import Segment, build_batch
    eng = Engine(model="smollm2-135m-shape", device="cuda", cache={"num_blocks": 64})
    assert eng.sampler.device is not None
    params = [SamplingParams(max_tokens=8, temperature=t, top_p=tp, top_k=k, seed=s, logprobs=lp, presence_penalty=pp,
                             ignore_eos=True)
              for t, tp, k, s, lp, pp in [(0.0, 1, -1, 1, None, 0.5), (1.0, 0.9, -1, 2, 3, 0), (0.7, 1, 40, 3, None, 0),
                                          (1.0, 1, -1, 4, 0, 1.0)]]
    outs = eng.generate([[5, 6, 7, 8], [9, 10], [11], [12, 13, 14]], params, use_tqdm=False)
    assert all(len(o.token_ids) == 8 for o in outs)
    assert outs[1].logprobs is not None and len(outs[1].logprobs) == 8
    # the device pipeline and the NumPy pipeline on the same device logits
    from kernels_numba.sampling import sample_rows_ref
    from metrale.request import RequestState
    from metrale.scheduler.sequence import Sequence
    states = [RequestState(Sequence([5, 6, 7], p), eng.tokenizer, eng.eos_ids, 4096) for p in params]
    blocks = [np.array([j], np.int32) for j in range(4)]
    batch = build_batch([Segment(np.array([5, 6, 7], np.int32), 0, blocks[j]) for j in range(4)], eng.blocks.block_size)
    logits = eng.sampler.forward(eng.backend, batch, states)
    eng.backend.stream.synchronize()        # the forward is queued on the backend's own stream
    host = logits.copy_to_host()
    rows = eng.sampler.pack(states, None)
    got = eng.sampler.device.run(logits, np.zeros((4, 1), np.uint32), rows)
    want = sample_rows_ref(host, np.zeros((4, 1), np.uint32), rows.fparams, rows.iparams, rows.adj_token, rows.adj_rep,
                           rows.adj_add)
    np.testing.assert_array_equal(got[0], want[0])


@pytest.mark.parametrize("dist", ["peaked", "ties", "llm"])
def test_compaction_paths_at_qwen_vocab(dist):
    """V = 151,936: rows whose survivors fit COMPACT_CAP (top-k, top-k + top-p, top-p on a peaked row:
    one compaction pass, the filters and the draw in shared memory) and rows that do not (k > CAP,
    ties at the border, top-p on a flat row) equal the reference; two runs give the same tokens."""
    V, R = 151936, 48
    rng = np.random.default_rng({"peaked": 1, "ties": 2, "llm": 3}[dist])
    logits, mask, f, i, toks, rep, add = batch(rng, R, V, n_adj=1)
    if dist == "peaked":
        logits[np.arange(R), rng.integers(0, V, R)] += 25
    elif dist == "ties":
        logits = np.round(logits * 2) / 2
    else:                                   # a heavy head: a few hundred plausible tokens
        logits = (rng.standard_normal((R, V)) * 2 - 8).astype(np.float32)
        for r in range(R):
            logits[r, rng.choice(V, 300, replace=False)] += rng.exponential(4, 300).astype(np.float32)
    kind = np.arange(R) % 8
    f[:, K.F_INV_TEMP] = np.array([1, 1 / 0.7, 1, 1.25, 1, 2, 0.5, 1], np.float32)[kind]
    f[:, K.F_TOP_P] = np.array([0.9, 1, 0.5, 0.95, 1e-6, 0.8, 0.99, 0.9], np.float32)[kind]
    f[:, K.F_LOG_MIN_P] = np.array([-np.inf] * 7 + [math.log(0.05)], np.float32)[kind]
    i[:, K.I_TOP_K] = np.array([50, 1, -1, 3000, 20, K.COMPACT_CAP, -1, 40])[kind]
    i[:, K.I_USE_MASK] = kind % 3 == 1
    i[:, K.I_NUM_LOGPROBS] = -1
    toks, rep, add = np.zeros(1, np.int32), np.zeros(1, np.int32), np.zeros(1, np.float32)
    out, *_ = run_device(logits, mask, f, i, toks, rep, add)
    out2, *_ = run_device(logits, mask, f, i, toks, rep, add)
    np.testing.assert_array_equal(out, out2)
    want, *_ = K.sample_rows_ref(logits, mask, f, i, toks, rep, add)
    same = out == want
    assert same.sum() >= R - 1, (np.flatnonzero(~same), out[~same], want[~same])   # a border case at most


def test_captured_sampling_equals_eager_launches():
    """DevicePipeline's graphs (a layout without adjustments captured once, replayed) draw what its
    eager launches draw, step after step, and a layout with adjustments stays eager."""
    from metrale import Engine
    from metrale.sampling.device import DevicePipeline
    from metrale.sampling.sampler import PackedRows
    eng = Engine(model="smollm2-135m-shape", device="cuda", cache={"num_blocks": 64})
    V = eng.model_config.vocab_size
    rng = np.random.default_rng(3)
    R = 4
    logits = cuda.to_device((rng.standard_normal((R, V)) * 3).astype(np.float32))
    rows = PackedRows(R, -(-V // 32))
    rows.fparams[:, K.F_INV_TEMP] = [0.0, 1.0 / 0.7, 1.0, 1.0 / 0.9]
    rows.fparams[:, K.F_TOP_P] = [1.0, 0.9, 1.0, 0.95]
    rows.fparams[:, K.F_LOG_MIN_P] = -np.inf
    rows.fparams[:, K.F_REP] = 1.0
    rows.iparams[:, K.I_TOP_K] = [-1, -1, 40, -1]
    rows.iparams[:, K.I_NUM_LOGPROBS] = [-1, 2, -1, 0]
    rows.iparams[:, K.I_SEED_LO] = rng.integers(-2**31, 2**31, R)
    mask = np.zeros((R, 1), np.uint32)
    graphed, eager = DevicePipeline(eng.backend, V, graphs=True), DevicePipeline(eng.backend, V, graphs=False)
    for step in range(6):
        rows.iparams[:, K.I_STEP] = step
        a, b = graphed.run(logits, mask, rows), eager.run(logits, mask, rows)
        np.testing.assert_array_equal(a[0], b[0])           # tokens
        np.testing.assert_array_equal(a[1], b[1])           # their logprobs
        for r, n in enumerate(rows.iparams[:, K.I_NUM_LOGPROBS]):
            # top candidates: only the first n of a row are written
            np.testing.assert_array_equal(a[2][r, :max(n, 0)], b[2][r, :max(n, 0)])
            np.testing.assert_array_equal(a[3][r, :max(n, 0)], b[3][r, :max(n, 0)])
    assert graphed.graphs and any(lay.graph is not None for lay in graphed._layouts.values())
    rows.adj_token, rows.adj_rep = np.array([7], np.int32), np.array([0], np.int32)
    rows.adj_add = np.array([5.0], np.float32)
    rows.iparams[:, K.I_ADJ_START], rows.iparams[:, K.I_ADJ_END] = 0, 0
    rows.iparams[0, K.I_ADJ_END] = 1                   # row 0 gets a logit bias: eager, applied once
    fresh = cuda.to_device(logits.copy_to_host())
    got = graphed.run(fresh, mask, rows)
    want = eager.run(cuda.to_device(logits.copy_to_host()), mask, rows)
    np.testing.assert_array_equal(got[0], want[0])
    assert all(lay.graph is None for key, lay in graphed._layouts.items() if key[1] > 0)
