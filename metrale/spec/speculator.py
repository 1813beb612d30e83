"""Speculator: the engine's one propose/verify path for every drafter and every k.

Before scheduling, eligible decoding sequences get a draft (`seq.draft_tokens`); the scheduler
turns each into a verify block of 1 + k tokens in the same ragged forward as everything else;
after the forward, `accept` turns the block's target rows into emitted tokens (greedy match or
rejection sampling) and the engine commits only the tokens whose K/V is right. Rejected drafts
leave K/V past the sequence's length: block tables are trimmed, the slots are overwritten later.
"""
from __future__ import annotations

import logging

import numpy as np

from metrale.scheduler.sequence import Sequence
from metrale.spec.drafter import Draft, NgramDrafter
from metrale.spec.gate import AdaptiveGate
from metrale.spec.verify import accept_greedy, accept_sampled

log = logging.getLogger("metrale.spec")

METHODS = ("none", "ngram", "self", "draft")


class Speculator:
    def __init__(self, drafter, *, num_drafts: int, gate: AdaptiveGate, min_confidence: float = 0.0):
        self.drafter, self.num_drafts, self.gate, self.min_confidence = drafter, num_drafts, gate, min_confidence
        self.proposed = self.accepted = self.verifies = 0
        self._rngs: dict[str, np.random.Generator] = {}

    def rng(self, state) -> np.random.Generator:
        """The request's own stream for acceptance tests (seeded requests stay reproducible)."""
        rid = state.seq.request_id
        if rid not in self._rngs:
            seed = state.params.seed
            self._rngs[rid] = np.random.Generator(np.random.Philox(None if seed is None else [int(seed) & (2**64 - 1), 0x5EC]))
        return self._rngs[rid]

    @staticmethod
    def eligible(state) -> bool:
        """Requests whose sampling depends only on the row's logits (no history-dependent
        controls): their verified rows are exactly the rows plain decoding would compute."""
        p = state.params
        return (p.repetition_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty
                and not p.logit_bias and not state.eos_masked and p.logprobs is None
                and p.json_schema is None and p.regex is None and p.grammar is None and not p.choice
                and not getattr(p, "require_tool_call", False))

    def propose(self, running: list[Sequence], states: dict, blocks) -> None:
        for seq in running:
            seq.draft_tokens = []
        decoding = [s for s in running if s.num_uncomputed == 1]
        if not self.gate.begin_step(len(decoding)):
            return
        seqs, ks = [], []
        for seq in decoding:
            state = states.get(seq.request_id)
            if state is None or not self.eligible(state):
                continue
            left = (state.params.max_tokens or 1 << 30) - len(seq.output_token_ids)
            k = min(self.gate.drafts_for(seq.request_id), left - 1, state.max_model_len - seq.num_tokens - 1)
            if k > 0 and blocks.grow(seq, seq.num_tokens + k):
                seqs.append(seq)
                ks.append(k)
        if not seqs:
            return
        for seq, k, draft in zip(seqs, ks, self.drafter.propose(seqs, ks)):
            kept = draft.cut(k, self.min_confidence)
            seq.draft_tokens, seq.draft_probs = kept.tokens, kept.probs

    def accept(self, seq: Sequence, state, rows, greedy_ids: np.ndarray | None, draft: list[int],
               filter_probs) -> list[int]:
        """Tokens to emit from a verify block. rows: the block's logits (None on the argmax path)."""
        if greedy_ids is not None:
            out = accept_greedy(greedy_ids, draft)
        elif state.params.greedy:
            out = accept_greedy(np.argmax(rows, axis=-1), draft)
        else:
            rng = self.rng(state)
            p_rows = [filter_probs(r) for r in rows]
            q = seq.draft_probs
            out = accept_sampled(p_rows, draft, q, rng.random(len(draft)),
                                 lambda j, probs: rng.choice(probs.size, p=probs))
        accepted = len(out) - 1
        self.proposed += len(draft)
        self.accepted += accepted
        self.verifies += 1
        self.gate.update(seq.request_id, len(draft), accepted)
        return out

    def committed(self, seq: Sequence, num_tokens_before: int, draft_len: int, accepted: int) -> None:
        if hasattr(self.drafter, "accepted"):
            self.drafter.accepted(seq, num_tokens_before, draft_len, accepted)

    def release(self, seq: Sequence) -> None:
        self._rngs.pop(seq.request_id, None)
        self.gate.release(seq.request_id)
        self.drafter.release(seq)

    def stats(self) -> dict:
        return {"proposed": self.proposed, "accepted": self.accepted, "verifies": self.verifies,
                "acceptance_rate": self.accepted / self.proposed if self.proposed else 0.0,
                "tokens_per_verify": (self.accepted + self.verifies) / self.verifies if self.verifies else 0.0}


def make_speculator(cfg, backend, model_config, load_draft_backend) -> Speculator | None:
    spec, lv = cfg.spec, cfg.levers
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
    else:
        from metrale.spec.model_drafter import ModelDrafter
        if not spec.draft_model:
            raise ValueError("spec.method=draft needs spec.draft_model=<preset or path>")
        drafter = ModelDrafter(load_draft_backend(spec.draft_model), name="draft")
    gate = AdaptiveGate(spec.num_drafts, verify_cost=lv.spec_verify_cost, probe_interval=lv.spec_probe_interval,
                        max_batch=lv.spec_max_batch, ema_decay=lv.spec_ema_decay)
    log.info("speculative decoding: %s, up to %d drafts", drafter.name, spec.num_drafts)
    return Speculator(drafter, num_drafts=spec.num_drafts, gate=gate, min_confidence=lv.spec_min_confidence)
