"""Host sampler (NumPy): temperature, top-k, top-p, min-p over rows with different parameters.

Each request owns a Philox generator seeded from its seed, so its samples do not depend on
which other requests share the batch.
"""
from __future__ import annotations

import numpy as np

from metrale.sampling.params import SamplingParams


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
