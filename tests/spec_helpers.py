"""Deterministic stand-ins for speculation tests: a gate that always speculates and a drafter that
proposes the plain run's continuation with some tokens corrupted (shared by the NumPy and GPU
hybrid speculation tests)."""
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
