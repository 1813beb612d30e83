"""prepare_rows / sample_rows with pending tokens (the loop a step ahead) under the simulator: a row
whose counts lack the previous step's token, counted by the kernel, gives the logits the NumPy
reference gives for the list made from the counts with that token in them (a listed token, a new
one, no pending token, the tool-call END token that empties the window; repetition, frequency and
presence in combination), the same token, and the right raw logprobs."""
import numpy as np

from kernels_numba import sampling as S

V = 200
END = 7                       # the rows' tool-call END token
# (repetition, frequency, presence) per row kind
PENALTIES = [(1.3, 0.0, 0.0), (1.0, 0.4, 0.0), (1.0, 0.0, 0.6), (1.2, 0.3, 0.5), (0.8, -0.5, 0.25), (1.5, 0.2, 0.3)]


def _list(counts: dict[int, int], window: set[int], bias: dict[int, float], rep: float):
    """A row's list from its counts, made here as the host makes it (SamplingState.adjustments)."""
    flag = int(rep != 1.0)
    entries = {t: [flag, 0, 0.0] for t in (window if flag else ())}
    for t, c in counts.items():
        entries[t] = [flag, c, 0.0]
    for t, b in bias.items():
        entries.setdefault(t, [0, 0, 0.0])[2] += b
    t = np.array(list(entries), np.int32)
    w = np.array([S.adj_word(e[0], e[1]) for e in entries.values()], np.int32)
    return t, w, np.array([e[2] for e in entries.values()], np.float32)


def _rows(rng, cases):
    """Per case (penalty kind, which pending token): the packed step with pending tokens, and the
    lists made from the counts after that token (the reference's input)."""
    R = len(cases)
    f = np.zeros((R, S.NF), np.float32)
    i = np.zeros((R, S.NI), np.int32)
    prev = rng.integers(0, V, R + 3).astype(np.int32)     # the previous step's tokens (more rows than this step)
    before, after = [], []
    for r, (kind, which) in enumerate(cases):
        rep, freq, pres = PENALTIES[kind]
        f[r, S.F_REP], f[r, S.F_FREQ], f[r, S.F_PRES] = rep, freq, pres
        f[r, S.F_INV_TEMP] = 0.0 if r % 2 == 0 else 1.0
        f[r, S.F_TOP_P], f[r, S.F_LOG_MIN_P] = 1.0, -np.inf
        i[r, S.I_SEED_LO], i[r, S.I_STEP] = 1000 + r, r
        i[r, S.I_NUM_LOGPROBS] = 3 if r % 3 == 0 or kind == 5 else -1
        i[r, S.I_WINDOW_END] = END + 1
        ids = rng.choice(np.arange(10, V), 12, replace=False)
        counts = {int(t): int(c) for t, c in zip(ids[:5], rng.integers(1, 4, 5))}
        window = {int(t) for t in ids[3:8]}
        bias = {int(ids[8]): 1.5, int(ids[0]): -0.75, END: 0.5}
        pt = {"counted": int(ids[1]), "counted_bias": int(ids[0]), "window": int(ids[6]), "bias": int(ids[8]),
              "new": int(ids[11]), "end": END, "none": None}[which]
        if pt is not None:
            src = (r * 5 + 1) % prev.size
            prev[src] = pt
            i[r, S.I_PENDING] = src + 1
        before.append(_list(counts, window, bias, rep))
        if pt == END:                      # the window restarts: bias alone
            counts, window = {}, set()
        elif pt is not None:
            counts[pt] = counts.get(pt, 0) + 1
        after.append(_list(counts, window, bias, rep))
    return f, i, prev, before, after


def _pack(i, lists):
    i = i.copy()
    n = np.cumsum([0] + [t.size for t, _, _ in lists])
    i[:, S.I_ADJ_START], i[:, S.I_ADJ_END] = n[:-1], n[1:]
    return i, *(np.concatenate([x[k] for x in lists]) for k in range(3))


CASES = [(k, w) for k, w in zip(range(6), ("counted", "new", "window", "bias", "end", "new"))] + \
        [(0, "new"), (1, "counted"), (2, "none"), (3, "end"), (4, "window"), (5, "counted"), (3, "new"), (1, "bias"),
         (3, "counted_bias"), (4, "counted_bias")]


def test_prepare_with_pending_tokens_matches_the_counts_after_them():
    rng = np.random.default_rng(11)
    f, i0, prev, before, after = _rows(rng, CASES)
    R = len(CASES)
    logits = (rng.standard_normal((R, V)) * 2).astype(np.float32)
    logits[:, :12] = np.abs(logits[:, :12]) + 0.5 * (np.arange(R) % 2 == 0)[:, None]     # positive and negative logits
    top = CASES.index((5, "new"))
    logits[top, prev[i0[top, S.I_PENDING] - 1]] = 40.0        # drawn even penalized: its raw logprob is the pending slot's
    i, tok, rep, add = _pack(i0, before)
    x = logits.copy()
    raw_saved, lse = np.zeros(tok.size, np.float32), np.zeros(R, np.float32)
    top_ids = np.full((R, S.MAX_TOP_LOGPROBS), -1, np.int32)
    top_lps = np.full((R, S.MAX_TOP_LOGPROBS), np.nan, np.float32)
    pending = (prev, np.full(R, -5, np.int32), np.zeros(R, np.float32))
    S.prepare_rows(x, f, i, tok, rep, add, raw_saved, lse, top_ids, top_lps, pending=pending)
    ia, *full = _pack(i0, after)
    ia[:, S.I_PENDING] = 0
    for r in range(R):
        a, b = ia[r, S.I_ADJ_START], ia[r, S.I_ADJ_END]
        want = S.apply_adjustments_ref(logits[r], f[r, S.F_REP], full[0][a:b], full[1][a:b], full[2][a:b],
                                       f[r, S.F_FREQ], f[r, S.F_PRES])
        np.testing.assert_array_equal(x[r], want, err_msg=str(CASES[r]))
    # the references agree: with the pending tokens as the kernel took them, and from the full counts
    want = S.sample_rows_ref(logits, np.zeros((R, 1), np.uint32), f, ia, *full)
    ref_pending = S.sample_rows_ref(logits, np.zeros((R, 1), np.uint32), f, i, tok, rep, add, prev)
    for a, b in zip(want, ref_pending):
        np.testing.assert_array_equal(a, b)
    out, lps = np.zeros(R, np.int32), np.zeros(R, np.float32)
    S.sample_rows(x, np.zeros((R, 1), np.uint32), f, i, tok, raw_saved, lse, out, lps, pending=pending)
    np.testing.assert_array_equal(out, want[0])
    np.testing.assert_allclose(lps, want[1], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(top_ids, want[2])
    np.testing.assert_allclose(top_lps, want[3], rtol=1e-5, atol=1e-5)
    assert out[top] == prev[i[top, S.I_PENDING] - 1] and pending[1][top] == out[top]
    assert lps[top] == np.float32(np.float32(40.0) - lse[top])


def test_no_pending_buffers_leave_rows_without_pending_tokens_alone():
    rng = np.random.default_rng(12)
    f, i0, prev, before, _ = _rows(rng, [(3, "none"), (1, "none")])
    i, tok, rep, add = _pack(i0, before)
    logits = (rng.standard_normal((2, V)) * 2).astype(np.float32)
    x = logits.copy()
    S.prepare_rows(x, f, i, tok, rep, add, np.zeros(tok.size, np.float32), np.zeros(2, np.float32),
                   np.zeros((2, S.MAX_TOP_LOGPROBS), np.int32), np.zeros((2, S.MAX_TOP_LOGPROBS), np.float32))
    for r in range(2):
        want = S.adjusted_row_ref(logits[r], f[r], i[r], tok, rep, add)
        np.testing.assert_array_equal(x[r], want)
