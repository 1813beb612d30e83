"""Drafters that run a model: self-speculative (the target's first layers and its LM head, sharing
the target's KV cache) and a separate small draft model (its own backend and KV pool, indexed by
the target's block tables, so it needs no block manager of its own).

Each round is one batched forward over all drafting sequences: the first round also catches the
drafter's cache up with the tokens it has not seen (the whole prompt, for a draft model), later
rounds feed the previous draft token. Drafting is greedy; the confidence of a token is its
softmax probability under the drafter.
"""
from __future__ import annotations

import numpy as np

from metrale.runtime.batch import Segment, build_batch
from metrale.scheduler.sequence import Sequence
from metrale.spec.drafter import Draft


class ModelDrafter:
    lookup_only = False

    def __init__(self, backend, *, num_layers: int | None = None, shares_target_cache: bool = False,
                 name: str = "draft"):
        self.backend, self.num_layers, self.shared = backend, num_layers, shares_target_cache
        self.name = name
        self.cost_per_token = 0.0      # the drafter's forward per draft token, in target decode steps
        self.computed: dict[str, int] = {}    # tokens of each sequence in the drafter's own cache

    def _seen(self, seq: Sequence) -> int:
        if self.shared:                        # the target's first layers wrote these already
            return seq.num_computed_tokens
        return min(self.computed.get(seq.request_id, 0), seq.num_tokens - 1)

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        drafts = [Draft() for _ in seqs]
        live = [i for i, k in enumerate(ks) if k > 0]
        feed = {i: seqs[i].token_ids[self._seen(seqs[i]):] for i in live}
        start = {i: self._seen(seqs[i]) for i in live}
        bs = self.backend.block_size
        for r in range(max((ks[i] for i in live), default=0)):
            live = [i for i in live if len(drafts[i].tokens) < ks[i]]
            if not live:
                break
            segs = [Segment(np.asarray(feed[i], np.int32), start[i], np.asarray(seqs[i].block_table, np.int32))
                    for i in live]
            segs = self._catch_up(segs)
            logits = self._last_rows(segs)
            for row, i in enumerate(live):
                x = logits[row] - logits[row].max()
                p = np.exp(x)
                p /= p.sum()
                tok = int(np.argmax(p))
                drafts[i].tokens.append(tok)
                drafts[i].confidences.append(float(p[tok]))
                start[i] += len(feed[i])
                feed[i] = [tok]
        for i, s in enumerate(seqs):
            if ks[i] > 0 and not self.shared:
                self.computed[s.request_id] = start[i]     # inputs fed so far (drafts included)
        return drafts

    def _catch_up(self, segs: list[Segment]) -> list[Segment]:
        """When the round's tokens exceed the backend's step budget (a draft model catching up with
        32 prompts at once), feed all but each segment's last token in forwards that fit, and
        return the one-token segments left for the round's own forward."""
        budget = self.backend.max_tokens
        if not budget or sum(len(s.token_ids) for s in segs) <= budget:
            return segs
        bs, batch, used, rest = self.backend.block_size, [], 0, []
        for s in segs:
            head = s.token_ids[:-1]
            for a in range(0, len(head), budget):
                piece = head[a:a + budget]
                if used + len(piece) > budget:
                    self.backend.forward(build_batch(batch, bs), self.num_layers)
                    batch, used = [], 0
                batch.append(Segment(piece, s.start_pos + a, s.block_table))
                used += len(piece)
            rest.append(Segment(s.token_ids[-1:], s.start_pos + len(head), s.block_table))
        if batch:
            self.backend.forward(build_batch(batch, bs), self.num_layers)
        return rest

    def _last_rows(self, segs: list[Segment]) -> np.ndarray:
        """The last row's logits of every segment, in forwards that fit the backend's step budget."""
        budget = self.backend.max_tokens or 1 << 30
        bs, out, batch, used = self.backend.block_size, [], [], 0
        for s in segs + [None]:
            if batch and (s is None or used + len(s.token_ids) > budget):
                out.append(np.asarray(self.backend.forward(build_batch(batch, bs), self.num_layers), dtype=np.float64))
                batch, used = [], 0
            if s is not None:
                batch.append(s)
                used += len(s.token_ids)
        return np.concatenate(out) if len(out) > 1 else out[0]

    def accepted(self, seq: Sequence, num_tokens_before: int, draft_len: int, accepted: int) -> None:
        """After verify: the drafter's cache is valid up to the last draft it fed that was accepted."""
        if not self.shared and seq.request_id in self.computed:
            self.computed[seq.request_id] = num_tokens_before + min(accepted, max(draft_len - 1, 0))

    def release(self, seq: Sequence) -> None:
        self.computed.pop(seq.request_id, None)
