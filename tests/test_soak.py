"""Issue 19's "nothing lost": 1,000 requests through the loop a step ahead (and the synchronous
loop), arriving between steps, with random aborts, stop tokens, shared prefixes (the prefix
cache), a pool small enough to preempt, sampled and penalized rows and bad requests among them.
Every request ends with a finish reason (or a clear refusal at add), and afterwards no KV block is
held: the reference counts equal those of no live sequence."""
import numpy as np
import pytest

from fake_model import fake_engine
from metrale import SamplingParams
from metrale.sampling.params import InvalidRequestError

REQUESTS = 1000


def _params(rng, i: int) -> SamplingParams:
    kind = i % 4
    n = int(rng.integers(1, 24))
    stop = [int(rng.integers(1, 60))] if rng.random() < 0.3 else None
    if kind == 0:
        return SamplingParams(max_tokens=n, temperature=0.0, stop_token_ids=stop)
    if kind == 1:
        return SamplingParams(max_tokens=n, temperature=0.9, top_p=0.9, seed=i, stop_token_ids=stop)
    if kind == 2:
        return SamplingParams(max_tokens=n, temperature=0.7, presence_penalty=0.5, seed=i, stop_token_ids=stop)
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("overlap", [True, False])
def test_a_thousand_requests_with_aborts_leak_nothing(overlap):
    rng = np.random.default_rng(19)
    e = fake_engine(num_blocks=48, **{"levers.overlap": overlap, "scheduler.max_num_seqs": 12})
    prefixes = [[int(t) for t in rng.integers(1, 60, 9)] for _ in range(5)]   # two blocks and a bit: cached
    added, refused, finished, tokens, wanted = set(), 0, {}, {}, {}
    next_i, step, aborts = 0, 0, 0
    while next_i < REQUESTS or e.has_unfinished():
        for _ in range(int(rng.integers(0, 4)) if next_i < REQUESTS else 0):
            i, next_i = next_i, next_i + 1
            prompt = [int(t) for t in rng.integers(1, 60, int(rng.integers(1, 14)))]
            if rng.random() < 0.4:
                prompt = prefixes[i % len(prefixes)] + prompt
            if i % 97 == 0:
                prompt = [10**6]                                   # outside the vocabulary: refused
            sp = _params(rng, i)
            try:
                e.add_request(prompt, sp, request_id=f"r{i}")
            except InvalidRequestError as exc:
                assert "vocab" in str(exc) or "token" in str(exc), exc
                refused += 1
                continue
            added.add(f"r{i}")
            wanted[f"r{i}"] = sp
        if added and rng.random() < 0.08:                          # abort a random live request
            rid = f"r{int(rng.integers(0, next_i))}"
            if rid in added and rid not in finished and e.is_running(rid):
                d = e.abort(rid)                                   # the abort's own finish delta
                assert d is not None and d.finish_reason == "abort" and rid not in finished
                finished[rid] = "abort"
                aborts += 1
        for d in e.poll():
            tokens.setdefault(d.request_id, []).extend(int(t) for t in d.token_ids)
            if d.finish_reason is not None:
                assert d.request_id not in finished, f"{d.request_id} finished twice"
                finished[d.request_id] = d.finish_reason
        step += 1
        assert step < 40_000, "the loop stopped making progress"
    assert refused == len(range(0, REQUESTS, 97))
    assert set(finished) == added, f"{len(added - set(finished))} requests never ended"
    reasons = set(finished.values())
    assert reasons <= {"stop", "length", "abort"}, reasons
    assert aborts > 20 and "abort" in reasons and "stop" in reasons
    assert e.scheduler.num_preemptions > 0                         # the pool was small enough to preempt
    for rid, reason in finished.items():            # what each request got agrees with how it ended
        got, sp = len(tokens.get(rid, [])), wanted[rid]
        assert got <= sp.max_tokens and (reason != "length" or got == sp.max_tokens), (rid, reason, got)
        if sp.ignore_eos and reason != "abort":
            assert reason == "length", (rid, reason)
    e.blocks.check_no_leaks([])
    assert len(e.blocks.free) == e.blocks.num_blocks
