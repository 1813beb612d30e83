"""Lossless acceptance of a verified draft.

Row j of the verify block holds the target's distribution for the token after draft[:j].
Greedy: accept while the target's argmax equals the draft; the first mismatch (or the row after
the last draft) gives one more token from the target. Sampling (Leviathan et al. 2023): accept
draft token d with probability min(1, p(d)/q(d)); on rejection draw from max(0, p - q)
renormalised; after all k accepted draw the bonus token from p. With a deterministic drafter
(q one-hot) this is "accept with probability p(d), else sample p with d removed".
Either way the output has exactly the target's distribution.

The engine applies accept_greedy to the tokens each row drew through the sampling pipeline (the
draw plain decoding makes at that step): for a one-hot q that IS the rule above, and a seeded
request gets plain decoding's output. accept_sampled serves drafters that give q (Draft.probs).
"""
from __future__ import annotations

import numpy as np


def accept_greedy(target_ids: np.ndarray, draft: list[int]) -> list[int]:
    """target_ids[j] = argmax of row j (len(draft) + 1 rows). Returns the tokens to emit."""
    out: list[int] = []
    for j, d in enumerate(draft):
        t = int(target_ids[j])
        out.append(t)
        if t != d:
            return out
    out.append(int(target_ids[len(draft)]))
    return out


def accept_sampled(p_rows: list[np.ndarray], draft: list[int], q_rows: list[np.ndarray] | None,
                   uniforms: np.ndarray, sample_from) -> list[int]:
    """p_rows[j]: target probabilities of row j (after every sampling control); q_rows[j]: the
    drafter's distribution for draft[j] (None = one-hot); uniforms[j] in [0, 1) decides row j;
    sample_from(j, probs) draws one token of row j from `probs` (the row's own random stream)."""
    out: list[int] = []
    for j, d in enumerate(draft):
        p = p_rows[j]
        q_d = 1.0 if q_rows is None else float(q_rows[j][d])
        if q_d > 0 and uniforms[j] < min(1.0, float(p[d]) / q_d):
            out.append(int(d))
            continue
        residual = p.copy() if q_rows is None else np.maximum(p - q_rows[j], 0.0)
        if q_rows is None:
            residual[d] = 0.0
        total = residual.sum()
        out.append(int(sample_from(j, residual / total if total > 0 else p)))
        return out
    out.append(int(sample_from(len(draft), p_rows[len(draft)])))
    return out
