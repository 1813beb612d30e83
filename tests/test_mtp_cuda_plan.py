"""The device MTP head's host side (metrale/spec/mtp_cuda.py) on the CPU: the planner's windows,
virtual slots, shifted tables and store rows; and its passes run by the NumPy head (`PlanHead`: the
device head's semantics, each pass a ForwardBatch of the plan's metadata) inside the engine, where
every draft must equal the NumPy MtpDrafter's fed the same hidden rows (and the head run from
scratch over the sequence's window). The kernels themselves: tests/kernels_sim/test_mtp_head_sim.py
(simulator) and tests/gpu/test_mtp_cuda_gpu.py (GPU)."""
import inspect
from types import SimpleNamespace

import numpy as np
import pytest

from fake_model import fake_engine, reference_continuation
from metrale import SamplingParams
from metrale.runtime.batch import ForwardBatch
from metrale.spec.drafter import Draft
from metrale.spec.mtp import HiddenTap, MtpDrafter, MtpHead
from metrale.spec.mtp_cuda import DeviceHiddenTap, DeviceRows, MtpCudaDrafter, MtpPlanner, virtual_slot
from test_mtp import TINY, HiddenFakeBackend, fake_hidden, reference_head, tiny_weights

BS = 4


def test_virtual_slot_puts_the_window_start_at_a_block_start():
    table = [9, 3, 17, 4]
    # lo = 5 (block 1, offset 1): position 5 -> virtual 4 = block table[1], offset 0
    assert virtual_slot(table, 5, 5, BS) == 3 * BS + 0
    assert virtual_slot(table, 8, 5, BS) == 3 * BS + 3
    assert virtual_slot(table, 9, 5, BS) == 17 * BS + 0
    # an aligned window is the identity mapping
    assert [virtual_slot(table, p, 4, BS) for p in (4, 7, 8)] == [3 * BS, 3 * BS + 3, 17 * BS]


def seq(rid, tokens, computed, table):
    return SimpleNamespace(request_id=rid, token_ids=list(tokens), num_tokens=len(tokens),
                           num_computed_tokens=computed, block_table=list(table),
                           token_slice=lambda a, b, t=list(tokens): t[a:b])


def sched(s, num_tokens, draft=()):
    return SimpleNamespace(seq=s, num_tokens=num_tokens, draft=list(draft))


def test_observe_and_draft_plans():
    p = MtpPlanner(BS, num_slots=4)
    a = seq("a", range(1, 7), 0, [5, 8])                 # a prompt of 6: its prefill samples token 7
    b = seq("b", range(1, 10), 7, [2, 6, 11])            # decoding: computes position 8 (token 9)
    plan = p.observe([sched(a, 6), sched(b, 2)], [[70], [90]], num_rows=2)
    # a: row 0 at position 5 (lo 5), fed token 70; b: 2 tokens scheduled, 1 sampled row at 8
    np.testing.assert_array_equal(plan.positions, [5, 8])
    np.testing.assert_array_equal(plan.token_ids, [70, 90])
    np.testing.assert_array_equal(plan.hidden_src, [0, 1])
    assert plan.slots[0] == virtual_slot([5, 8], 5, 5, BS) == 8 * BS + 0       # virtual 4: block 1
    assert plan.slots[1] == virtual_slot([2, 6, 11], 8, 8, BS) == 11 * BS + 0
    np.testing.assert_array_equal(plan.copy_src, [0, 1])
    assert sorted(plan.copy_dst) == [0, 1]
    ta = p.tracks["a"]
    assert (ta.lo, ta.next, ta.fresh) == (5, 6, True)
    # the sequences after the step: a holds 7 tokens (last 70), b 10 (last 90)
    a2 = seq("a", list(range(1, 7)) + [70], 6, [5, 8, 12])
    b2 = seq("b", list(range(1, 10)) + [90], 9, [2, 6, 11])
    assert p.ready(a2) and p.ready(b2)
    d = p.plan_drafts([a2, b2], [3, 1])
    assert d.live == [0, 1] and d.ks == [3, 1] and d.rounds == 3
    np.testing.assert_array_equal(d.token_ids, [70, 90])
    # b drafts 1: its padded rounds repeat its last real position (never past its table or the RoPE table)
    np.testing.assert_array_equal(d.positions, [[5, 8], [6, 8], [7, 8]])
    np.testing.assert_array_equal(d.attn_pos, [[0, 0], [1, 0], [2, 0]])
    assert d.slots[1, 0] == virtual_slot([5, 8, 12], 6, 5, BS) and (d.slots[1:, 1] == -1).all()
    # tables from each window's first block: a's lo 5 is in block 1, b's lo 8 in block 2
    np.testing.assert_array_equal(d.tables, [[8, 12], [11, 0]])
    np.testing.assert_array_equal(d.store_rows, [ta.slot, p.tracks["b"].slot])
    assert not p.ready(a2)                               # its rows are used: no second draft without new rows


def test_verify_block_rows_and_a_gap_restarts_the_window():
    p = MtpPlanner(BS, num_slots=2)
    s = seq("r", range(10), 0, [1, 2, 3])
    p.observe([sched(s, 10)], [[10]], 1)                 # prefill: row 9
    # a verify block of 1 + 3 at positions 10..13 with 2 drafts accepted: rows 10, 11, 12
    s = seq("r", range(11), 10, [1, 2, 3, 4])
    plan = p.observe([sched(s, 4, draft=[11, 12, 99])], [[11, 12, 13]], 4)
    np.testing.assert_array_equal(plan.positions, [10, 11, 12])
    np.testing.assert_array_equal(plan.token_ids, [11, 12, 13])
    np.testing.assert_array_equal(plan.copy_src, [2])
    t = p.tracks["r"]
    assert (t.lo, t.next) == (9, 13)
    # a step whose rows never came (positions 13..14): the next rows restart the window, same slot
    slot = t.slot
    s = seq("r", range(16), 15, [1, 2, 3, 4])
    plan = p.observe([sched(s, 1)], [[16]], 1)
    t = p.tracks["r"]
    assert (t.lo, t.next, t.slot) == (15, 16, slot)
    assert plan.slots[0] == virtual_slot([1, 2, 3, 4], 15, 15, BS) == 4 * BS


def test_slots_are_released_and_reused():
    p = MtpPlanner(BS, num_slots=2)
    for rid in ("a", "b"):
        p.observe([sched(seq(rid, range(3), 0, [1]), 3)], [[5]], 1)
    assert sorted(t.slot for t in p.tracks.values()) == [0, 1]
    p.release("a")
    p.observe([sched(seq("c", range(3), 0, [2]), 3)], [[5]], 1)
    assert p.tracks["c"].slot == 0 and set(p.tracks) == {"b", "c"}
    # every slot taken: the least recently observed track gives its slot up
    p.observe([sched(seq("d", range(3), 0, [3]), 3)], [[5]], 1)
    assert set(p.tracks) == {"c", "d"} and p.tracks["d"].slot == 1


def test_device_tap_hands_a_handle_not_rows():
    class Backend:
        act = {"rows": "device rows"}

        def forward_greedy(self, batch, num_layers=None):
            return np.zeros(len(batch.logits_indices), np.int32)

        def forward(self, batch, num_layers=None, return_hidden=False):
            raise AssertionError("no logits to the host")

        def hidden_rows(self, n):
            return np.ones((n, 8))

    tap = DeviceHiddenTap(Backend())
    batch = SimpleNamespace(logits_indices=np.arange(3))
    tap.forward_greedy(batch)
    h = tap.take_hidden()
    assert isinstance(h, DeviceRows) and len(h) == 3 and h.array == "device rows" and h.to_host().shape == (3, 8)
    assert tap.take_hidden() is None
    tap.forward_greedy(batch, num_layers=2)              # a layer-prefix forward keeps no rows
    assert tap.take_hidden() is None


# ---------------------------------------------------------------------------- the passes on the NumPy head
class PlanHead:
    """The device head's passes on the NumPy head: a pass is a ForwardBatch of the plan's metadata
    (slot_mapping: the virtual slots; block_tables: the shifted tables; context_lens: attn_pos + 1;
    positions: the real ones, for RoPE) run with window start 0, so the NumPy attention reads
    exactly what the device kernels read; the last-row store is an array."""

    def __init__(self, head: MtpHead, num_slots: int):
        self.head, self.block_size, self.num_slots = head, head.block_size, num_slots
        self.last = np.zeros((num_slots, head.config.hidden_size))
        self.rounds, self.logits_log = [], []       # rounds of each proposal; (round, logits) of the last one

    def batch(self, tokens, positions, slots, attn_pos, tables) -> ForwardBatch:
        n = len(tokens)
        ar = np.arange(n, dtype=np.int32)
        return ForwardBatch(np.asarray(tokens, np.int32), np.asarray(positions, np.int32), np.asarray(slots, np.int32),
                            ar, np.arange(n + 1, dtype=np.int32), np.asarray(attn_pos, np.int32) + 1,
                            np.asarray(tables, np.int32), ar.copy(), self.block_size)

    def observe(self, plan, hidden):
        hidden = np.asarray(hidden)
        T = plan.num_tokens
        self.head.forward(self.batch(plan.token_ids, plan.positions, plan.slots, np.zeros(T), np.zeros((T, 1))),
                          hidden[plan.hidden_src], np.zeros(T, np.int64))
        self.last[plan.copy_dst] = hidden[plan.copy_src]

    def draft(self, plan):
        B, R = plan.batch, plan.rounds
        ids, conf = np.zeros((R, B), np.int32), np.zeros((R, B))
        toks, hid = plan.token_ids, self.last[plan.store_rows]
        self.logits_log = []
        for j in range(R):
            logits, hid = self.head.forward(self.batch(toks, plan.positions[j], plan.slots[j], plan.attn_pos[j],
                                                       plan.tables), hid, np.zeros(B, np.int64))
            x = np.asarray(logits, np.float64)
            self.logits_log.append((j, x))
            idx = np.argmax(x, -1)
            p = np.exp(x - x.max(-1, keepdims=True))
            conf[j] = p[np.arange(B), idx] / p.sum(-1)
            ids[j] = getattr(self.head, "target_ids", lambda i: i)(idx)
            toks = ids[j]
        self.rounds.append(R)
        return ids, conf


class Twin:
    """The planner's drafter and MtpDrafter fed the same steps: their drafts must be equal."""
    name, needs_hidden, lookup_only = "mtp", True, False

    def __init__(self, device: MtpCudaDrafter, host: MtpDrafter, w):
        self.device, self.host, self.w = device, host, w
        self.compared = self.tokens = 0

    def tap(self, backend):
        return HiddenTap(backend)

    def observe(self, scheduled, emitted, hidden):
        self.device.observe(scheduled, emitted, hidden)
        self.host.observe(scheduled, emitted, hidden)

    def propose(self, seqs, ks):
        ks = [min(k, 1 + i % 3) for i, k in enumerate(ks)]       # mixed draft counts in one pass
        got, want = self.device.propose(seqs, ks), self.host.propose(seqs, ks)
        for s, g, h in zip(seqs, got, want):
            assert g.tokens == h.tokens, (s.request_id, g.tokens, h.tokens)
            np.testing.assert_allclose(g.confidences, h.confidences, rtol=1e-9)
            if g.tokens:
                self.compared += 1
                self.tokens += len(g.tokens)
        return got

    def release(self, seq):
        self.device.release(seq)
        self.host.release(seq)


def head_with(w, num_blocks=256, d2t=None):
    kw = {} if d2t is None else {"d2t": d2t}
    return MtpHead(TINY, w, num_blocks=num_blocks, block_size=BS, dtype=np.float64, **kw)


def run_twin(rng, d2t=None, max_tokens=14, num_drafts=3, verify_cost=0.0):
    eng = fake_engine(num_blocks=256, block_size=BS, **{"spec.method": "ngram", "spec.num_drafts": num_drafts,
                                                         "levers.spec_verify_cost": verify_cost})
    w = tiny_weights(TINY, seed=5)
    device = MtpCudaDrafter(PlanHead(head_with(w, d2t=d2t), num_slots=8))
    twin = Twin(device, MtpDrafter(head_with(w, d2t=d2t)), w)
    eng.speculator.drafter = twin
    eng.backend = twin.tap(HiddenFakeBackend(256, BS))
    prompts = [[int(t) for t in rng.integers(1, 96, int(n))] for n in (3, 11, 6, 9)]
    outs = eng.generate([np.array(p) for p in prompts], SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                        ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert list(o.token_ids) == reference_continuation(p, max_tokens)
    assert device.tracks == {} and twin.host.tracks == {}
    eng.blocks.check_no_leaks([])
    twin.engine = eng
    return twin, device


def test_plans_draft_what_the_numpy_head_drafts_in_the_engine(rng):
    twin, device = run_twin(rng)
    assert twin.compared > 20 and twin.tokens > twin.compared
    assert max(device.head.rounds) == 3 and min(device.head.rounds) >= 1
    # windows not aligned to blocks were exercised (prompts of 3, 11, 6 and 9 tokens: lo = 2, 10, 5, 8)


def test_shadow_proposals_draft_what_the_block_tables_hold(rng):
    """A pinned verify cost that loses: the gate shadows (Speculator._start_shadows proposes
    num_drafts without growing any block table). Both drafters cut a shadow's drafts to the K/V
    positions its table holds (mtp.drafts_that_fit; the NumPy head used to raise ValueError from
    build_batch there) and still draft the same tokens."""
    twin, _ = run_twin(rng, max_tokens=40, num_drafts=4, verify_cost=0.9)
    assert twin.engine.speculator.shadows > 0 and twin.compared > 20


def test_a_draft_chain_equals_the_head_run_from_scratch():
    """One sequence by hand: the prefill's row, then two drafts; the planner's passes give what the
    head over the whole window gives (reference_head, float64), the chain fed its own rows."""
    w = tiny_weights(TINY, seed=2)
    d = MtpCudaDrafter(PlanHead(head_with(w), num_slots=2))
    toks = [5, 17, 3, 40, 9, 22]
    s = seq("r", toks, 0, [7, 1])
    d.observe([sched(s, 6)], [[61]], np.stack([fake_hidden(p, t) for p, t in enumerate(toks)])[-1:])
    s2 = seq("r", toks + [61], 6, [7, 1, 3])
    draft = d.propose([s2], [2])[0]
    hid, feed = [fake_hidden(5, 22)], [61]
    for j, tok in enumerate(draft.tokens):
        logits, rows = reference_head(w, TINY, np.array(hid), np.array(feed), np.arange(5, 6 + j))
        assert int(np.argmax(logits[-1])) == tok
        hid.append(rows[-1])
        feed.append(tok)
    assert len(draft.tokens) == 2 and all(0 < c <= 1 for c in draft.confidences)


@pytest.mark.skipif("d2t" not in inspect.signature(MtpHead).parameters, reason="MtpHead without a draft vocabulary")
def test_plans_with_a_draft_vocabulary(rng):
    d2t = np.sort(rng.choice(TINY.vocab_size, 40, replace=False)).astype(np.int32)
    twin, _ = run_twin(rng, d2t=d2t)
    assert twin.compared > 20


def test_propose_without_rows_drafts_nothing():
    d = MtpCudaDrafter(PlanHead(head_with(tiny_weights(TINY)), num_slots=2))
    s = seq("r", range(5), 4, [1, 2])
    assert d.propose([s], [2]) == [Draft()]
    d.observe([sched(s, 1)], [[7]], None)                 # a step without hidden rows
    assert d.tracks == {}
