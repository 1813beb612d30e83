"""Expert-parallel MoE: experts split evenly over ranks (rank r owns experts r*E/R .. (r+1)*E/R),
token rows dispatched to the ranks of their experts and the outputs combined back.

dispatch_combine(x, topk_ids, topk_weights, expert_fn), per MoE layer, on every rank (a rank
without tokens passes empty arrays: it still serves its experts):
  1. slots s = t*K + k sorted (stably) by destination rank = topk_ids // (E/R)
  2. all_to_all_v of the slots' token rows, then of their metadata (global expert id, int32)
     with the same counts
  3. expert_fn(received rows, local expert ids) -> unweighted outputs, in received order
  4. all_to_all_v of the outputs back with the counts reversed: each rank gets its slots' rows
     in the order it sent them; un-permute and sum with the routing weights in k order
Routing (and the shared experts) stay with the token's rank; only rows and ids travel.

reduce_local(x, topk_ids, topk_weights, expert_fn) is the replicated-token form (parallel.expert=N
through the Engine: every rank runs the step's whole batch): each rank sums its own experts'
weighted outputs over all tokens and one all_reduce adds the ranks' sums (in rank order, so every
rank gets the same bits); nothing is dispatched.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from metrale.parallel.comm import Communicator, all_reduce


def combine_slots(y_slots: np.ndarray, topk_weights: np.ndarray) -> np.ndarray:
    """out[t] = sum_k w[t, k] * y[t*K + k] (summed in k order)."""
    t, k = topk_weights.shape
    return np.einsum("tk,tkd->td", topk_weights, y_slots.reshape(t, k, -1))


class ExpertParallel:
    def __init__(self, comm: Communicator, num_experts: int, replicated: bool = False):
        """replicated: every rank holds every token (MoE layers reduce_local); else each rank its own
        tokens (dispatch_combine)."""
        if num_experts % comm.world_size:
            raise ValueError(f"{num_experts} experts do not split evenly over {comm.world_size} ranks")
        self.comm, self.replicated = comm, replicated
        self.reduces = 0                      # all-reduces run (reduce_local; tests count them)
        self.num_experts = num_experts
        self.num_local = num_experts // comm.world_size
        self.expert_range = (comm.rank * self.num_local, (comm.rank + 1) * self.num_local)

    def owner(self, expert_ids: np.ndarray) -> np.ndarray:
        return np.asarray(expert_ids) // self.num_local

    def dispatch_combine(self, x: np.ndarray, topk_ids: np.ndarray, topk_weights: np.ndarray,
                         expert_fn: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> np.ndarray:
        """Routed MoE output [T, D] of this rank's tokens x [T, D] (see the module docstring)."""
        t, k = topk_ids.shape
        flat = np.asarray(topk_ids, np.int32).reshape(-1)
        dest = self.owner(flat)
        order = np.argsort(dest, kind="stable")
        counts = np.bincount(dest, minlength=self.comm.world_size).astype(np.int64)
        rows, recv_counts = self.comm.all_to_all_v(np.ascontiguousarray(x[order // k]), counts)
        ids, _ = self.comm.all_to_all_v(flat[order], counts, recv_counts)
        y = np.ascontiguousarray(expert_fn(rows, ids - self.expert_range[0]), dtype=x.dtype)
        back, _ = self.comm.all_to_all_v(y, recv_counts, counts)
        y_slots = np.empty_like(back)
        y_slots[order] = back
        return combine_slots(y_slots, np.asarray(topk_weights, x.dtype)) if t else np.zeros((0, x.shape[1]), x.dtype)

    def reduce_local(self, x: np.ndarray, topk_ids: np.ndarray, topk_weights: np.ndarray,
                     expert_fn: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> np.ndarray:
        """Routed MoE output [T, D] when every rank holds the same tokens x (see the module docstring)."""
        lo, hi = self.expert_range
        ids = np.asarray(topk_ids)
        t, k = np.nonzero((ids >= lo) & (ids < hi))
        y = expert_fn(np.ascontiguousarray(x[t]), (ids[t, k] - lo).astype(np.int32))
        part = np.zeros_like(x)
        np.add.at(part, t, y * np.asarray(topk_weights, x.dtype)[t, k, None])
        self.reduces += 1
        return all_reduce(self.comm, part)
