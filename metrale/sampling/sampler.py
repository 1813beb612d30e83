"""Sampler: the engine's view of sampling. One step over a batch of rows with different parameters:

    sampler.plain_greedy(states)     every row greedy, unpenalized, unmasked -> backend.forward_greedy
    sampler.start_masks(states)      grammar bitmasks on the CPU, in a thread, while the device runs
    logits = sampler.forward(backend, batch)    device logits on CUDA, host logits otherwise
    masks = sampler.finish_masks()
    tokens = sampler.sample(logits, states, masks)
    drawn, packed = sampler.draw(logits, states, masks)   # the same pipeline, advancing no state

`sample` packs each row's parameters (kernels_numba/sampling.py: fparams/iparams, sparse
penalty/bias/ban lists, packed uint32 bitmask), runs the one pipeline (NumPy reference on the CPU,
the two kernels on CUDA), then advances every request's SamplingState (step, penalty window,
grammar matcher, think span, logprobs). Rows are RequestState-like objects: `.params`,
`.sampling` (SamplingState), `.eos_masked` (min_tokens not reached), `.stop_ids`.

`make_generator`, `filter_probs` and `sample_row` are the older per-row host helpers, kept for
callers outside the engine.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from typing import NamedTuple

import numpy as np

from kernels_numba import sampling_ref as K
from metrale.sampling.grammar import MaskWorker
from metrale.sampling.params import SamplingParams

log = logging.getLogger("metrale.sampling")


class PackedRows:
    """Host arrays of one step's rows, in the layout of kernels_numba/sampling.py."""

    def __init__(self, R: int, words: int):
        self.fparams = np.zeros((R, K.NF), np.float32)
        self.iparams = np.zeros((R, K.NI), np.int32)
        self.words = words
        self.mask: np.ndarray | None = None
        self.adj_token = self.adj_rep = np.zeros(0, np.int32)
        self.adj_add = np.zeros(0, np.float32)
        self.forced: list[int | None] = [None] * R
        self.pending = False        # a row counts a token of the previous step (iparams I_PENDING)

    def mask_rows(self) -> np.ndarray:
        if self.mask is None:
            self.mask = np.zeros((self.fparams.shape[0], self.words), np.uint32)
        return self.mask


def set_bit(mask_row: np.ndarray, token: int) -> None:
    mask_row[token >> 5] |= np.uint32(1 << (token & 31))


class Sampler:
    def __init__(self, backend, vocab_size: int, min_p_floor: float = 0.0):
        self.vocab_size = int(vocab_size)
        self.words = -(-self.vocab_size // 32)
        self.min_p_floor = float(min_p_floor)
        self.masks = MaskWorker(self.vocab_size)
        self.device = None
        if backend is not None and backend.name == "cuda":   # None: the host pipeline alone (tests)
            from metrale.sampling.device import DevicePipeline
            self.device = DevicePipeline(backend, self.vocab_size, graphs=backend.use_graphs,
                                         split=backend.sampling_split)
        self._warned_empty = False

    # ------------------------------------------------------------------ the step
    def plain_greedy(self, states) -> bool:
        return all(st.always_plain_greedy or st.sampling.plain_greedy(st.eos_masked) for st in states)

    def start_masks(self, states) -> None:
        rows = [(r, st.sampling.grammar) for r, st in enumerate(states)
                if st.sampling.forced_token() is None and st.sampling.grammar_active()]
        self.masks.start(rows, len(states))

    def finish_masks(self) -> np.ndarray | None:
        return self.masks.finish()

    def forward(self, backend, batch, states=()):
        """The logits of the sampling rows [R, V] (a device array on CUDA). Requests that asked for
        prompt_logprobs and whose prompt runs in this step get extra rows, consumed here."""
        extra = self._prompt_rows(batch, states, backend.max_rows)
        if extra:
            batch = dataclasses.replace(batch, logits_indices=np.concatenate(
                [batch.logits_indices] + [rows for _, rows, _ in extra]).astype(np.int32))
        logits = self.device.forward(backend, batch) if self.device is not None else backend.forward(batch)
        if extra:
            R = len(states)
            host = np.asarray(logits[R:].copy_to_host() if self.device is not None else logits[R:])
            off = 0
            for st, rows, first in extra:
                st.sampling.set_prompt_logprobs(host[off:off + rows.size], first)
                off += rows.size
            logits = logits[:R]
        return logits

    def _prompt_rows(self, batch, states, max_rows: int | None):
        """(state, token rows, first position) for the prompts whose logprobs this step can give."""
        out, total = [], len(states)
        for r, st in enumerate(states):
            ss = st.sampling
            if not ss.wants_prompt_logprobs or st.seq.output_token_ids:
                continue
            t = int(batch.logits_indices[r])
            seg = int(batch.token_seq[t])
            a = int(batch.seq_query_start[seg])
            first = int(batch.positions[a])
            rows = np.arange(a, t, dtype=np.int32)       # positions first .. len(prompt) - 2
            if max_rows is not None and total + rows.size > max_rows:
                log.warning("prompt_logprobs: %d prompt rows exceed the backend's %d logits rows; skipped",
                            rows.size, max_rows)
                ss.set_prompt_logprobs(np.zeros((0, self.vocab_size), np.float32), first)
                continue
            total += rows.size
            out.append((st, rows, first))
        return out

    def accept_greedy(self, states, tokens: np.ndarray) -> np.ndarray:
        for st, t in zip(states, tokens):
            st.sampling.accept(int(t))
        return tokens

    def pack(self, states, grammar_masks: np.ndarray | None, step_ahead: int = 0,
             src: np.ndarray | None = None) -> PackedRows:
        """The rows' sampling inputs; step_ahead 1 packs the step after the one whose token is not
        accepted yet (the loop ahead: the seeded draw counter one further), src[r] the row of that
        step holding row r's token, which its penalty counts lack (I_PENDING: the pipeline counts it)."""
        R = len(states)
        rows = PackedRows(R, self.words)
        f, i = rows.fparams, rows.iparams
        toks, reps, adds, start = [], [], [], 0
        for r, st in enumerate(states):
            p: SamplingParams = st.params
            ss = st.sampling
            f[r, K.F_INV_TEMP] = 0.0 if p.greedy else np.float32(1.0) / np.float32(p.temperature)
            f[r, K.F_TOP_P] = p.top_p
            min_p = max(p.min_p, self.min_p_floor)
            f[r, K.F_LOG_MIN_P] = math.log(min_p) if min_p > 0 else -np.inf
            f[r, K.F_REP] = p.repetition_penalty
            f[r, K.F_FREQ] = p.frequency_penalty
            f[r, K.F_PRES] = p.presence_penalty
            if ss.penalized:
                i[r, K.I_WINDOW_END] = ss.window_end() + 1
                if src is not None:
                    i[r, K.I_PENDING] = int(src[r]) + 1
                    rows.pending = True
            i[r, K.I_TOP_K] = p.top_k
            i[r, K.I_NUM_LOGPROBS] = min(int(p.logprobs), K.MAX_TOP_LOGPROBS) if ss.want_logprobs else -1
            i[r, K.I_SEED_LO] = np.uint32(ss.seed_lo).view(np.int32)
            i[r, K.I_SEED_HI] = np.uint32(ss.seed_hi).view(np.int32)
            i[r, K.I_STEP] = np.uint32((ss.step + step_ahead) & 0xFFFFFFFF).view(np.int32)
            forced = ss.forced_token()
            grammar_done = False
            if forced is not None:
                rows.forced[r] = forced
                row = rows.mask_rows()[r]
                set_bit(row, forced)
                i[r, K.I_USE_MASK] = 1
            elif ss.grammar_active():
                row = rows.mask_rows()[r]
                if grammar_masks is not None:
                    row[:] = grammar_masks[r]
                think = ss.special.think_start_token_id
                if think is not None and ss.step == 0 and not ss.in_think:     # a think span may open first
                    set_bit(row, think)
                i[r, K.I_USE_MASK] = 1
                grammar_done = ss.grammar.stopped
            banned = st.stop_ids if (st.eos_masked and forced is None and not grammar_done) else None
            t, rp, a = ss.adjustments(banned)
            toks.append(t)
            reps.append(rp)
            adds.append(a)
            i[r, K.I_ADJ_START] = start
            start += t.size
            i[r, K.I_ADJ_END] = start
        if start:
            rows.adj_token, rows.adj_rep, rows.adj_add = np.concatenate(toks), np.concatenate(reps), np.concatenate(adds)
        return rows

    def sample(self, logits, states, grammar_masks: np.ndarray | None = None) -> np.ndarray:
        drawn, _ = self.draw(logits, states, grammar_masks)
        for st, d in zip(states, drawn):
            st.sampling.accept(*d)
        return np.fromiter((d.token for d in drawn), dtype=np.int32, count=len(drawn))

    def draw(self, logits, states, grammar_masks: np.ndarray | None = None) -> tuple[list["Drawn"], PackedRows]:
        """The pipeline over the rows, advancing no state: each row's token with its logprobs (what
        `SamplingState.accept` takes), and the packed rows (for `row_distribution`)."""
        rows = self.pack(states, grammar_masks)
        return self.drawn(states, rows, self._launch(logits, rows, None).result()), rows

    def can_run_ahead(self, states) -> bool:
        """Every row's next tokens come from the device alone (metrale/overlap.py)."""
        return all(st.always_device_drawn or st.sampling.plain_greedy(st.eos_masked)
                   or st.sampling.device_only(st.eos_masked) for st in states)

    def launch_ahead(self, logits, states, step_ahead: int, feed=None, prev=None, src: np.ndarray | None = None):
        """The pipeline over device-only rows, queued without waiting; `ahead_drawn(handle)` gives
        their Drawn. feed: where the drawn tokens are copied on the device for the next step. prev:
        the handle (launch_ahead's) of the step launched just before, whose tokens (its rows src[r])
        the states have not accepted yet: penalized rows count them in the pipeline."""
        if src is not None and prev is None and any(st.sampling.penalized for st in states):
            raise ValueError("penalized rows a step ahead need the step before drawn by this sampler")
        rows = self.pack(states, None, step_ahead, src if prev is not None else None)
        return states, rows, self._launch(logits, rows, feed, prev[2] if prev is not None else None)

    def ahead_drawn(self, handle) -> list["Drawn"]:
        states, rows, pending = handle
        return self.drawn(states, rows, pending.result())

    def _launch(self, logits, rows: PackedRows, feed, after=None):
        """The pipeline over the packed rows; after: the launched step whose tokens pending rows count."""
        R = rows.fparams.shape[0]
        mask = rows.mask if rows.mask is not None else np.zeros((R, 1), np.uint32)
        if self.device is not None:
            return self.device.launch(logits, mask, rows, feed, after)
        pending = after.result()[0] if rows.pending else None
        out = K.sample_rows_ref(np.asarray(logits)[:R], mask, rows.fparams, rows.iparams, rows.adj_token,
                                rows.adj_rep, rows.adj_add, pending)
        return _Computed(out)

    def drawn(self, states, rows: PackedRows, outputs) -> list["Drawn"]:
        """Each row's Drawn from the pipeline's (tokens, logprobs, top ids, top logprobs)."""
        tokens, lps, top_ids, top_lps = outputs
        out = []
        for r, st in enumerate(states):
            ss = st.sampling
            tok = int(tokens[r])
            if tok < 0:    # every token was masked out (a grammar at odds with a ban): end the request
                tok = next(iter(ss.eos_ids), 0)
                if not self._warned_empty:
                    log.warning("request %s: no token allowed by its constraints; ending it with EOS",
                                getattr(getattr(st, "seq", None), "request_id", "?"))
                    self._warned_empty = True
            lp, top = None, None
            if ss.want_logprobs:
                lp = float(lps[r]) if not np.isnan(lps[r]) else None
                n = min(int(st.params.logprobs), K.MAX_TOP_LOGPROBS)
                top = {int(top_ids[r, j]): float(top_lps[r, j]) for j in range(n) if top_ids[r, j] >= 0}
            out.append(Drawn(tok, lp, top, rows.forced[r] is not None))
        return out

    def row_distribution(self, logits, rows: PackedRows, r: int) -> tuple[np.ndarray, np.ndarray]:
        """(probabilities, raw log-softmax) of row r, float64 [V] each: the distribution `draw`
        samples row r from (adjustments, mask, temperature, top-k / top-p / min-p; one-hot at the
        argmax when greedy) and the model's own logprobs. Host NumPy (rejection sampling)."""
        row = logits[r:r + 1]
        raw = np.asarray(row.copy_to_host() if hasattr(row, "copy_to_host") else row, dtype=np.float32)[0]
        f, i = rows.fparams[r], rows.iparams[r]
        x = K.adjusted_row_ref(raw, f, i, rows.adj_token, rows.adj_rep, rows.adj_add)
        if i[K.I_USE_MASK]:
            x = np.where(K.bitmask_allows_ref(rows.mask[r], x.size), x, K.NEG_INF)
        probs = filtered_probs_ref(x, float(f[K.F_INV_TEMP]), int(i[K.I_TOP_K]), float(f[K.F_TOP_P]),
                                   float(f[K.F_LOG_MIN_P]))
        lse = K.logprob_stats_ref(raw, 0)[0]
        return probs, (raw - lse).astype(np.float64)


class _Computed:
    """The host pipeline's outputs as a launched step's handle."""

    def __init__(self, outputs) -> None:
        self.outputs = outputs

    def result(self):
        return self.outputs


class Drawn(NamedTuple):
    """One row's outcome, in the order `SamplingState.accept` takes it."""
    token: int
    logprob: float | None = None
    top: dict[int, float] | None = None
    forced: bool = False


def filtered_probs_ref(x: np.ndarray, inv_temp: float, top_k: int, top_p: float, log_min_p: float) -> np.ndarray:
    """The distribution K.sample_row_ref draws from on adjusted, masked logits x (float64 [V]):
    softmax of z = (x - max) * inv_temp over the kept set (Gumbel-max samples exactly this);
    one-hot at the argmax when greedy; all zero when nothing is allowed."""
    x = np.asarray(x, dtype=np.float32)
    probs = np.zeros(x.size, np.float64)
    m = x.max()
    if m == K.NEG_INF or np.isnan(m):
        return probs
    if inv_temp == 0:
        probs[int(np.argmax(x))] = 1.0
        return probs
    z = ((x - m) * np.float32(inv_temp)).astype(np.float32)
    keys = K.f32_key_ref(z)
    thr = K.top_p_key_ref(z, keys, K.top_k_key_ref(keys, top_k), top_p)
    thr = max(thr, K.f32_key_ref(np.array([log_min_p], np.float32))[0])
    kept = np.flatnonzero((keys >= thr) & (z > K.NEG_INF))
    probs[kept] = np.exp(z[kept].astype(np.float64))
    return probs / probs.sum()


# ---------------------------------------------------------------------- older host helpers


def make_generator(seed: int | None) -> np.random.Generator:
    return np.random.Generator(np.random.Philox(seed))


def filter_probs(logits: np.ndarray, p: SamplingParams, min_p_floor: float = 0.0) -> np.ndarray:
    """Probabilities of one row after temperature and top-k / top-p / min-p filtering (float64)."""
    x = logits.astype(np.float64) / max(p.temperature, 1e-6)
    x -= x.max()
    if p.top_k > 0 and p.top_k < x.size:
        kth = np.partition(x, -p.top_k)[-p.top_k]
        x[x < kth] = -np.inf
    probs = np.exp(x)
    probs /= probs.sum()
    if p.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        cum = np.cumsum(probs[order])
        drop = order[(cum - probs[order]) >= p.top_p]  # keep the smallest prefix reaching top_p
        probs[drop] = 0.0
    min_p = max(p.min_p, min_p_floor)
    if min_p > 0.0:
        probs[probs < min_p * probs.max()] = 0.0
    return probs / probs.sum()


def sample_row(logits: np.ndarray, p: SamplingParams, rng: np.random.Generator,
               min_p_floor: float = 0.0) -> int:
    if p.greedy:
        return int(np.argmax(logits))
    probs = filter_probs(logits, p, min_p_floor)
    return int(rng.choice(probs.size, p=probs))
