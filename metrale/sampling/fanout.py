"""n > 1 and best_of: one request becomes best_of (default n) independent sequences.

    children = expand(params)          # SamplingParams with n=1 and seeds derived from params.seed
    ... run each child as its own request (same prompt; the prefix cache shares the prompt's KV) ...
    outputs = select(child_outputs, params)   # the n best by cumulative logprob (all, in order, if best_of == n)

Child j's seed is derive_seed(seed, j) (Philox of (seed, j)), so a seeded request gives the same n
outputs whatever else runs. When best_of > n the children track their cumulative logprob
(logprobs=0 when the request asked for none; select() strips what was not asked for).
"""
from __future__ import annotations

import dataclasses
import secrets

from kernels_numba.philox import philox4x32_ref
from metrale.sampling.params import SamplingParams


def derive_seed(seed: int, j: int) -> int:
    s = int(seed) % (1 << 64)
    w = philox4x32_ref(j & 0xFFFFFFFF, j >> 32, 0x6E3D, 0, s & 0xFFFFFFFF, s >> 32)
    return int(w[0]) | (int(w[1]) << 32)


def expand(params: SamplingParams) -> list[SamplingParams]:
    k = params.best_of or params.n
    if k == 1:
        return [params]
    base = params.seed if params.seed is not None else secrets.randbits(64)
    rank = k > params.n
    logprobs = params.logprobs if params.logprobs is not None or not rank else 0
    return [dataclasses.replace(params, n=1, best_of=None, seed=derive_seed(base, j), logprobs=logprobs)
            for j in range(k)]


def select(outputs: list, params: SamplingParams) -> list:
    """The n outputs to return for `params` from its children's outputs (RequestOutput-like)."""
    if (params.best_of or params.n) <= params.n:
        return list(outputs)
    ranked = sorted(outputs, key=lambda o: -(o.cumulative_logprob if o.cumulative_logprob is not None else float("-inf")))
    best = ranked[:params.n]
    if params.logprobs is None:
        best = [dataclasses.replace(o, logprobs=None) for o in best]
    return best
