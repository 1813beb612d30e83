"""Speculator: the engine's one propose/verify path for every drafter, every k and every request.

Before scheduling, decoding sequences get a draft (`seq.draft_tokens`); the scheduler turns each
into a verify block of 1 + k tokens in the same ragged forward as everything else.

Row j of a block is processed exactly as plain decoding would process it after draft[:j] were
accepted: `lookahead` builds, per row, the request as of that position (a `SamplingState.fork`
advanced by the earlier drafts: penalty window, grammar matcher, think span, forced first token,
step counter; min_tokens from the output length there), and the rows go through the sampler's one
pipeline (`Sampler.draw`). The same walk cuts a draft at its first token that the request could not
emit (a refused forced token, a grammar violation, an EOS masked by min_tokens) and after a token
that would end it, so such tokens never reach the forward.

Acceptance (`accept`): each row's drawn token is what plain decoding would have drawn at that
position (same seed, same step, same logits row), so the block emits its drawn tokens while they
match the draft, plus the first that does not (or the bonus row). For greedy rows this is the greedy
match; for sampled rows with a one-hot drafter it is rejection sampling: the draft token is kept
with probability p(d), otherwise a token of p with d removed. Either way the output is the one plain
decoding gives with the same seed. Drafters that give their distribution q use
`verify.accept_sampled` on the rows' processed probabilities, with the request's Philox key.
The engine then advances the real SamplingState by the emitted tokens only, one at a time.
Rejected drafts leave K/V past the sequence's length: block tables are trimmed, the slots are
overwritten later.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from kernels_numba import sampling_ref as K
from metrale.options import GateOptions, SpecOptions
from metrale.sampling.params import SamplingParams
from metrale.sampling.sampler import Drawn
from metrale.sampling.state import SamplingState
from metrale.scheduler.sequence import Sequence
from metrale.spec.drafter import NgramDrafter
from metrale.spec.gate import AdaptiveGate
from metrale.spec.verify import accept_greedy, accept_sampled

log = logging.getLogger("metrale.spec")

METHODS = ("none", "ngram", "self", "draft", "mtp", "dflash")

_ACCEPT_DRAW, _RESIDUAL_DRAW = 0x5EC0, 0x5EC1     # Philox counter word 2 (the pipeline's Gumbel draws use 0)


@dataclass
class RowView:
    """One verify row: the request as plain decoding would see it after the block's earlier drafts
    (the RequestState-like shape the sampler takes)."""
    seq: Sequence
    params: SamplingParams
    sampling: SamplingState
    stop_ids: set[int]
    eos_masked: bool
    always_plain_greedy: bool = False    # the sampler then asks sampling.plain_greedy(eos_masked)
    always_device_drawn: bool = False


def lookahead(state, draft: list[int]) -> list:
    """The rows of a verify block for `draft`: [state, state after draft[:1], ...]. Stops before the
    first draft token the request could not emit at its position and after one that ends it, so
    len(result) - 1 is how much of the draft is worth verifying."""
    rows = [state]
    n_out = len(state.seq.output_token_ids)
    # A plain greedy request (argmax of raw logits: no penalties, bias, logprobs, grammar or forced
    # tool call) reads nothing from its rows' sampling states but plain_greedy, which accepting a
    # token cannot change: its rows share the state instead of forking it (a fork + accept per
    # draft token was ~8 us each, per sequence and step on the host)
    shared = (state.sampling.grammar is None and not state.params.require_tool_call
              and state.sampling.plain_greedy(False))
    for j, d in enumerate(draft):
        cur = rows[-1]
        ss = cur.sampling
        forced = None if shared else ss.forced_token()
        if forced is not None and d != forced:
            break
        grammar_done = forced is None and ss.grammar_active() and ss.grammar.stopped
        if d in cur.stop_ids and cur.eos_masked and forced is None and not grammar_done:
            break                                   # banned until min_tokens
        if shared:
            rows.append(RowView(state.seq, state.params, ss, state.stop_ids, n_out + j + 1 < state.params.min_tokens))
            if d in cur.stop_ids and not cur.eos_masked:
                break
            continue
        nxt = ss.fork()
        nxt.accept(d, forced=forced is not None)
        if nxt.grammar is not None and nxt.grammar.failed and not ss.grammar.failed:
            break                                   # the grammar refuses it
        rows.append(RowView(state.seq, state.params, nxt, state.stop_ids, n_out + j + 1 < state.params.min_tokens))
        if d in cur.stop_ids and not cur.eos_masked:
            break                                   # the request would end with d
    return rows


def philox_uniform(ss: SamplingState, draw: int) -> float:
    """A uniform in (0, 1) of the request's key at its step: reproducible per seed, independent of
    the pipeline's Gumbel draws."""
    w = K.philox4x32_ref(np.uint64(0), np.uint64(ss.step & 0xFFFFFFFF), np.uint64(draw), np.uint64(0),
                         ss.seed_lo, ss.seed_hi)[0]
    return (float(w) + 0.5) / 2.0 ** 32


class Speculator:
    def __init__(self, drafter, *, num_drafts: int, gate: AdaptiveGate, min_confidence: float = 0.0,
                 max_rows: int | None = None):
        self.drafter, self.num_drafts, self.gate, self.min_confidence = drafter, num_drafts, gate, min_confidence
        self.max_rows = max_rows          # logits rows a forward can hold (CUDA buffers): drafts fit in it
        self.proposed = self.accepted = self.verifies = self.cut = self.dropped = 0
        self._rows: dict[str, list] = {}                       # this step's verify rows per request
        self._pending: dict[str, tuple[Sequence, int, int]] = {}   # proposed, not yet verified
        self._shadow: dict[str, tuple[Sequence, int, list[int]]] = {}   # (seq, first index, tokens): gate.shadow
        self.shadows = self.shadow_accepted = 0

    def propose(self, running: list[Sequence], states: dict, blocks) -> None:
        clock = getattr(self.gate, "clock", None) if getattr(self.gate, "measure", False) else None
        t0 = clock() if clock else 0.0
        self._propose(running, states, blocks)
        if clock:                                   # the measured gate's view of its own cost
            self.gate.add_host_time(clock() - t0)

    def _propose(self, running: list[Sequence], states: dict, blocks) -> None:
        for seq in running:
            seq.draft_tokens, seq.draft_probs = [], None
        decoding = [s for s in running if s.num_uncomputed == 1]
        if not self._begin(len(decoding)):
            return
        seqs, ks, shadowed = [], [], []
        budgeted = isinstance(self.gate, AdaptiveGate)
        spare = (self.max_rows - len(running)) if self.max_rows else 1 << 30   # rows left for drafts
        for seq, want, left, k in self._sized(decoding, states, pending=0):
            k = min(k, spare)
            if k > 0 and blocks.grow(seq, seq.num_tokens + k):
                seqs.append(seq)
                ks.append(k)
                spare -= k
                self._shadow.pop(seq.request_id, None)
            elif self._wants_shadow(seq, want, left):
                shadowed.append(seq)
        if shadowed:
            self._start_shadows(shadowed)
        if not seqs:
            return
        for seq, k, draft in zip(seqs, ks, self.drafter.propose(seqs, ks)):
            kept = draft.cut(k, self.min_confidence)
            rows = lookahead(states[seq.request_id], kept.tokens)
            n = len(rows) - 1
            self.cut += len(kept.tokens) - n
            if n and budgeted:                # the prefix expected to gain (confidences, CPU batch 1)
                keep = self.gate.verify_length(seq.request_id, kept.confidences[:n])
                self.dropped += n - keep
                n = keep
            self._pending[seq.request_id] = (seq, seq.num_tokens, k)
            if n:
                seq.draft_tokens = kept.tokens[:n]
                seq.draft_probs = None if kept.probs is None else kept.probs[:n]
                self._rows[seq.request_id] = rows
            if n < k:
                blocks.trim(seq)

    @property
    def runs_ahead(self) -> bool:
        """Whether steps may run ahead beside this speculator (lets_ahead then decides each one):
        not with a drafter that reads every step's hidden rows (the steps ahead keep none), nor
        with the duck-typed gates of tests, which have no step clock."""
        return isinstance(self.gate, AdaptiveGate) and not self.needs_hidden

    def lets_ahead(self, seqs: list[Sequence], states: dict) -> bool:
        """In place of propose for a step the engine queues ahead (its sequences' last token still
        on the device): whether that step may run with no draft. The gate's step clock, shadows and
        host time advance as in propose; a sequence the gate would draft for and whose drafter has
        a draft now (a lookup-only drafter is asked; any other would spend a forward) sends the
        engine back to a synchronous step, which proposes with that token known."""
        clock = self.gate.clock if self.gate.measure else None
        t0 = clock() if clock else 0.0
        ok = self._nothing_to_draft(seqs, states)
        if clock:
            self.gate.add_host_time(clock() - t0)
        return ok

    def _nothing_to_draft(self, seqs: list[Sequence], states: dict) -> bool:
        if not self._begin(len(seqs)):
            return True
        wanting, ks, shadowed = [], [], []
        for seq, want, left, k in self._sized(seqs, states, pending=1):
            if k > 0:
                wanting.append(seq)
                ks.append(k)
            elif self._wants_shadow(seq, want, left):
                shadowed.append(seq)
        if shadowed:
            self._start_shadows(shadowed)
        if not wanting:
            return True
        if not self.drafter.lookup_only:
            return False
        return not any(d.cut(k, self.min_confidence).tokens for d, k in zip(self.drafter.propose(wanting, ks), ks))

    def _begin(self, num_decoding: int) -> bool:
        """A step's prologue: last step's unverified drafts commit with none accepted, shadows resolve
        against what the sequences emitted, and the gate opens the step (False: no drafts in it)."""
        for seq, before, k in self._pending.values():
            self.committed(seq, before, k, 0)
        self._pending.clear()
        self._rows.clear()
        if self._shadow:
            self._resolve_shadows()
        return self.gate.begin_step(num_decoding)

    def _sized(self, seqs: list[Sequence], states: dict, *, pending: int):
        """(seq, want, left, k) per sequence with a request state: the drafts the gate wants, the
        tokens left to max_tokens and the drafts that fit; `pending` tokens are still on the device."""
        budgeted = isinstance(self.gate, AdaptiveGate)      # gates of tests may be duck-typed
        for seq in seqs:
            state = states.get(seq.request_id)
            if state is None:
                continue
            left = (state.params.max_tokens or 1 << 30) - len(seq.output_token_ids) - pending
            want = self.gate.drafts_for(seq.request_id, left=left) if budgeted else self.gate.drafts_for(seq.request_id)
            yield seq, want, left, min(want, left - 1, state.max_model_len - seq.num_tokens - 1 - pending)

    def _wants_shadow(self, seq: Sequence, want: int, left: int) -> bool:
        """A free draft the gate keeps to compare with what the sequence emits (no verify)."""
        return (isinstance(self.gate, AdaptiveGate) and self.gate.shadow and want == 0 and left > 1
                and seq.request_id not in self._shadow and self.gate.wants_shadow(seq.request_id))

    def _start_shadows(self, seqs: list[Sequence]) -> None:
        """Free drafts the gate does not verify: kept to compare with what each sequence emits
        (gate.observe_shadow), the evidence a probe would have bought."""
        for seq, draft in zip(seqs, self.drafter.propose(seqs, [self.num_drafts] * len(seqs))):
            toks = draft.cut(self.num_drafts, self.min_confidence).tokens
            if toks:
                self._shadow[seq.request_id] = (seq, seq.num_tokens, toks)

    def _resolve_shadows(self) -> None:
        """A shadow resolves at its first token the sequence did not emit, or once all matched."""
        done = []
        for rid, (seq, start, toks) in self._shadow.items():
            avail = min(seq.num_tokens - start, len(toks))
            if avail <= 0:
                continue
            got = seq.token_slice(start, start + avail)
            m = 0
            while m < avail and got[m] == toks[m]:
                m += 1
            if m < avail or avail == len(toks):
                self.gate.observe_shadow(rid, len(toks), m)
                self.shadows += 1
                self.shadow_accepted += m
                done.append(rid)
        for rid in done:
            del self._shadow[rid]

    def rows(self, sampling: list, states: list) -> list:
        """One row per logits row of the step: verify blocks expand to their look-ahead rows."""
        out = []
        for s, st in zip(sampling, states):
            out.extend(self._rows[s.seq.request_id][:1 + len(s.draft)] if s.draft else [st])
        return out

    def accept_blocks(self, sampling: list, rows: list, drawn: list[Drawn], distribution=None) -> list[list[Drawn]]:
        """The tokens each sampling row emits (Drawn, not yet accepted by its SamplingState).
        distribution(r) -> (probs, raw logprobs) of logits row r (None on the argmax path)."""
        out, r = [], 0
        for s in sampling:
            n = 1 + len(s.draft)
            block = drawn[r:r + n]
            if s.draft:
                dist = None if distribution is None else (lambda j, r=r: distribution(r + j))
                block = self.accept(s.seq, rows[r:r + n], block, s.draft, dist)
            out.append(block)
            r += n
        return out

    def accept(self, seq: Sequence, rows: list, block: list[Drawn], draft: list[int], distribution=None) -> list[Drawn]:
        """Tokens to emit from a verify block whose row j drew block[j] (see the module docstring)."""
        self._pending.pop(seq.request_id, None)
        q = seq.draft_probs
        if q is None or rows[0].params.greedy or distribution is None:
            out = block[:len(accept_greedy(np.asarray([d.token for d in block]), draft))]
        else:
            out = self._accept_with_q(rows, block, draft, q, distribution)
        accepted = len(out) - 1
        self.proposed += len(draft)
        self.accepted += accepted
        self.verifies += 1
        self.gate.update(seq.request_id, len(draft), accepted)
        return out

    @staticmethod
    def _accept_with_q(rows, block: list[Drawn], draft: list[int], q, distribution) -> list[Drawn]:
        dists = [distribution(j) for j in range(len(block))]
        states = [row.sampling for row in rows]
        uniforms = np.array([philox_uniform(states[j], _ACCEPT_DRAW) for j in range(len(draft))])

        def sample_from(j: int, probs: np.ndarray) -> int:
            if j == len(draft):                  # the bonus row: its pipeline draw is a sample of p
                return block[j].token
            cum = np.cumsum(probs)
            return int(min(np.searchsorted(cum, philox_uniform(states[j], _RESIDUAL_DRAW) * cum[-1], side="right"),
                           probs.size - 1))

        tokens = accept_sampled([p for p, _ in dists], draft, q, uniforms, sample_from)
        out = []
        for j, t in enumerate(tokens):
            d = block[j]
            if t != d.token:
                d = d._replace(token=t, logprob=None if d.logprob is None else float(dists[j][1][t]))
            out.append(d)
        return out

    def committed(self, seq: Sequence, num_tokens_before: int, draft_len: int, accepted: int) -> None:
        if hasattr(self.drafter, "accepted"):
            self.drafter.accepted(seq, num_tokens_before, draft_len, accepted)

    def release(self, seq: Sequence) -> None:
        self._rows.pop(seq.request_id, None)
        self._pending.pop(seq.request_id, None)
        self._shadow.pop(seq.request_id, None)
        self.gate.release(seq.request_id)
        self.drafter.release(seq)

    @property
    def needs_hidden(self) -> bool:
        """The drafter reads the target's hidden rows (MTP heads), and the gate may let it draft at
        some batch size: a drafter the cost model keeps off everywhere costs no tap either."""
        cached = self.__dict__.get("_needs_hidden")
        if cached is not None and cached[0] is self.drafter:
            return cached[1]
        need = getattr(self.drafter, "needs_hidden", False)
        if need and isinstance(self.gate, AdaptiveGate):
            need = any(self.gate.can_pay(b) for b in range(1, self.gate.max_batch + 1))
        self._needs_hidden = (self.drafter, need)
        return need

    def stats(self) -> dict:
        return {"proposed": self.proposed, "accepted": self.accepted, "verifies": self.verifies,
                "cut": self.cut, "dropped": self.dropped,
                "acceptance_rate": self.accepted / self.proposed if self.proposed else 0.0,
                "tokens_per_verify": (self.accepted + self.verifies) / self.verifies if self.verifies else 0.0,
                "shadows": self.shadows,
                "shadow_tokens_per_draft": self.shadow_accepted / self.shadows if self.shadows else 0.0}


def make_speculator(spec: SpecOptions, backend, model_config, load_draft_backend) -> Speculator | None:
    g = spec.gate
    if spec.method not in METHODS:
        raise ValueError(f"spec.method must be one of {', '.join(METHODS)}, not '{spec.method}'")
    if spec.method == "none":
        return None
    if spec.num_drafts < 1:
        raise ValueError(f"spec.num_drafts must be >= 1, got {spec.num_drafts}")
    if spec.method == "ngram":
        drafter = NgramDrafter(spec.ngram_max_n, spec.ngram_min_n)
    elif spec.method == "self":
        from metrale.spec.model_drafter import ModelDrafter
        layers = spec.self_layers or max(1, model_config.num_layers // 3)
        if not 1 <= layers < model_config.num_layers:
            raise ValueError(f"spec.self_layers must be in [1, {model_config.num_layers}), got {layers}")
        drafter = ModelDrafter(backend, num_layers=layers, shares_target_cache=True, name="self")
        drafter.cost_per_token = forward_share(model_config, layers)
    elif spec.method == "mtp":
        from metrale.spec.mtp_cuda import mtp_drafter     # the head on the device with a CUDA target (else MtpDrafter)
        drafter = mtp_drafter(spec, backend, model_config)
        # one decoder block + the LM head (the rows of its draft vocabulary)
        drafter.cost_per_token = forward_share(model_config, 1, getattr(drafter.head, "draft_vocab_size", None))
    elif spec.method == "dflash":
        from metrale.spec.dflash_cuda import dflash_drafter    # the drafter on the device with a CUDA target
        drafter = dflash_drafter(spec, backend, model_config)
        if not getattr(drafter, "on_device", False):            # the device drafter's cost: its weight share
            drafter.cost_per_draft = DFLASH_COST_PER_DRAFT
    else:
        from metrale.spec.model_drafter import ModelDrafter
        if not spec.draft_model:
            raise ValueError("spec.method=draft needs spec.draft_model=<preset or path>")
        draft_backend = load_draft_backend(spec.draft_model)
        if draft_backend.states is not None:
            raise ValueError("spec.draft_model: a hybrid (Gated DeltaNet) draft model is not supported: its "
                             "own recurrent states would need slots and rollback in the drafter; use a dense "
                             "draft model of the same vocabulary (docs/hybrid.md)")
        drafter = ModelDrafter(draft_backend, name="draft")
        drafter.cost_per_token = min(1.0, drafter.backend.config.num_parameters() / model_config.num_parameters())
    gate = AdaptiveGate(spec.num_drafts, **gate_costs(g, backend, drafter, spec.method),
                        probe_budget=g.probe_budget if g.probe_budget >= 0 else None,
                        min_gain=g.min_gain if g.verify_cost < 0 else 1.0,
                        caution=GATE_CAUTION if g.verify_cost < 0 else 0.0,
                        probe_interval=g.probe_interval, max_batch=g.max_batch,
                        ema_decay=g.ema_decay, measure=_measured_gate(g.measured, backend),
                        measure_margin=g.measured_margin, measure_min_steps=g.measured_min_steps,
                        shadow=g.shadow)
    log.info("speculative decoding: %s, up to %d drafts", drafter.name, spec.num_drafts)
    return Speculator(drafter, num_drafts=spec.num_drafts, gate=gate, min_confidence=g.min_confidence,
                      max_rows=backend.max_rows)


# The gate's cost model, in one-row decode steps (the measurements behind these: docs/spec.md).
# CPU: a forward of M >= 2 rows costs CPU_STEP_FIXED + CPU_ROW_COST * M; CUDA: a verify row costs little
CPU_STEP_FIXED, CPU_ROW_COST = 2.45, 0.1
CUDA_VERIFY_COST = 0.1
# prior per-token acceptance: n-gram drafts come from a match (optimistic); model drafters are
# pessimistic until a sequence's own verifies say otherwise; a pinned spec.gate.verify_cost keeps the
# optimistic prior of the constant model for every drafter
PRIOR_ACCEPTANCE = {"ngram": 0.8, "self": 0.3, "mtp": 0.3, "dflash": 0.3, "draft": 0.5}
# the gate drafts when the gain pays at one standard deviation below a sequence's acceptance
# estimate (its Beta posterior); a pinned spec.gate.verify_cost (tests) acts on the mean
GATE_CAUTION = 1.0
DFLASH_COST_PER_DRAFT = 0.6     # one DFlash forward over [last, MASK x k] per proposal (CPU)
# CUDA: a host-side drafter's draft token on top of its weight share (`self` softmaxes [R, V] logits
# on the host, the MTP head is a NumPy block): more than a decode step, so neither gains on CUDA
# until its drafting moves to the device (spec.gate.draft_cost overrides); docs/spec.md, "CUDA drafter costs"
CUDA_HOST_DRAFT_COST = {"self": 2.0, "mtp": 4.0}


def forward_share(model_config, layers: int, head_rows: int | None = None) -> float:
    """The cost of running `layers` decoder layers + the LM head (its first `head_rows` rows' worth:
    an MTP head's draft vocabulary), as a share of the target's forward (weights read per row:
    decode is weight-bound)."""
    head = model_config.vocab_size * model_config.hidden_size
    total = model_config.num_parameters()
    per_layer = max(0.0, (total - head) / model_config.num_layers)
    rows = model_config.vocab_size if head_rows is None else min(head_rows, model_config.vocab_size)
    return min(1.0, (layers * per_layer + rows * model_config.hidden_size) / (model_config.num_layers * per_layer + head))


def gate_costs(g: GateOptions, backend, drafter, method: str) -> dict:
    """AdaptiveGate's cost model from spec.gate (-1: auto): the CPU row model (step_fixed,
    row_cost) or CUDA's constant verify cost, plus the drafter's own costs (draft_cost
    overrides its per-token cost) and its prior; or a pinned verify_cost: the whole cost of a
    draft token at every batch size (no row model, no drafter cost unless draft_cost is set),
    with the optimistic prior 0.8 (tests pin 0 to speculate on every step that can). On CUDA the
    host-side drafters (self, mtp) add CUDA_HOST_DRAFT_COST per draft token."""
    pinned = g.verify_cost >= 0
    cpu = backend.name != "cuda"
    step_fixed = g.step_fixed if g.step_fixed >= 0 else (CPU_STEP_FIXED if cpu and not pinned else 0.0)
    row_cost = g.row_cost if g.row_cost >= 0 else CPU_ROW_COST
    verify_cost = g.verify_cost if pinned else (CUDA_VERIFY_COST if not cpu else row_cost)
    prior = g.prior_acceptance if g.prior_acceptance >= 0 else (
        0.8 if pinned else PRIOR_ACCEPTANCE.get(method, 0.5))
    # a pinned verify_cost is the whole cost of a draft token (verify and drafting)
    auto_draft = 0.0 if pinned else getattr(drafter, "cost_per_token", 0.0)
    if not pinned and not cpu and not getattr(drafter, "on_device", False):    # mtp_cuda drafts on the device
        auto_draft += CUDA_HOST_DRAFT_COST.get(method, 0.0)
    draft_cost = g.draft_cost if g.draft_cost >= 0 else auto_draft
    draft_fixed = 0.0 if pinned else getattr(drafter, "cost_per_draft", 0.0)
    return dict(verify_cost=verify_cost, step_fixed=step_fixed, row_cost=row_cost, prior_acceptance=prior,
                draft_cost=draft_cost, draft_fixed=draft_fixed)


def _measured_gate(choice: str, backend) -> bool:
    """spec.gate.measured: auto times steps on CUDA backends only, where a verify step and a
    graph-replayed decode step cost very differently; on CPU the cost model (spec.gate.verify_cost)
    decides, which keeps speculation deterministic for a given input."""
    if choice not in ("auto", "on", "off"):
        raise ValueError(f"spec.gate.measured must be auto, on or off, not '{choice}'")
    return choice == "on" or (choice == "auto" and backend.name == "cuda")
