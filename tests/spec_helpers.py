"""Deterministic stand-ins for speculation tests: a gate that always speculates, one that speculates
on given steps only, and a drafter that proposes the plain run's continuation with some tokens
corrupted (shared by the NumPy and GPU hybrid speculation tests and the DFlash lazy-context test)."""
import numpy as np

from metrale.spec.drafter import Draft


class AlwaysGate:
    """Speculate every step with every draft (the adaptive gate times steps: not deterministic)."""
    def __init__(self, k):
        self.k = k

    def begin_step(self, n):
        return True

    def drafts_for(self, request_id):
        return self.k

    def update(self, request_id, proposed, accepted):
        pass

    def release(self, request_id):
        pass


class NoisyOracle:
    """Proposes the plain run's continuation with some tokens corrupted (to (t + 1) % vocab):
    every acceptance length runs."""
    name = "oracle"
    lookup_only = False

    def __init__(self, truth: dict, error_rate: float, vocab: int, seed: int = 0):
        self.truth, self.error_rate, self.vocab = truth, error_rate, vocab
        self.rng = np.random.default_rng(seed)

    def propose(self, seqs, ks):
        out = []
        for s, k in zip(seqs, ks):
            cont = self.truth[tuple(s.prompt_token_ids)][len(s.output_token_ids):][:k]
            toks = [t if self.rng.random() > self.error_rate else (t + 1) % self.vocab for t in cont]
            out.append(Draft(toks, [1.0] * len(toks)))
        return out

    def release(self, seq):
        pass


class ScheduledGate:
    """Speculate with k drafts only on the engine steps in `steps` (counted from 1 by begin_step):
    a deterministic stand-in for the adaptive gate's suspensions."""
    def __init__(self, k, steps):
        self.k, self.steps, self.step = k, set(steps), 0

    def begin_step(self, n):
        self.step += 1
        return self.step in self.steps

    def drafts_for(self, request_id):
        return self.k

    def update(self, request_id, proposed, accepted):
        pass

    def release(self, request_id):
        pass
