"""The scheduler always makes progress: every request ends, with a reason, in a bounded number of
steps, whatever the configuration (no_mix, max_num_seqs, pool and block size, max_model_len, token
budget), and every KV block comes back. A request that ends on its first token still leaves its
prompt's full blocks in the prefix cache."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from fake_model import fake_engine, reference_continuation
from metrale import SamplingParams
from metrale.sampling.params import InvalidRequestError


def greedy(max_tokens: int | None) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


def run_to_end(eng, max_steps: int) -> dict[str, str]:
    """Steps until nothing is left; the finish reason of every request that ended."""
    reasons: dict[str, str] = {}
    for _ in range(max_steps):
        if not eng.has_unfinished():
            return reasons
        for d in eng.poll():
            if d.finished:
                reasons[d.request_id] = d.finish_reason
    raise AssertionError(f"requests still running after {max_steps} steps: {eng.request_ids()}")


def test_no_mix_with_every_sequence_slot_taken_still_decodes():
    eng = fake_engine(**{"levers.no_mix": True, "scheduler.max_num_seqs": 2})
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
    ids = [eng.add_request(p, greedy(5)) for p in prompts]
    reasons = run_to_end(eng, 100)
    assert [reasons[i] for i in ids] == ["length"] * 3
    eng.blocks.check_no_leaks([])


def test_no_mix_generate_matches_the_reference():
    eng = fake_engine(**{"levers.no_mix": True, "scheduler.max_num_seqs": 2})
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11, 12, 13, 14]]
    outs = eng.generate([np.array(p) for p in prompts], greedy(6), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert list(o.token_ids) == reference_continuation(p, 6)


@pytest.mark.parametrize("others", [0, 2])
def test_unbounded_request_ends_with_length_at_the_pool_capacity(others):
    """max_tokens=None runs to the context, which is at most what the KV pool holds (8 x 4 tokens)."""
    eng = fake_engine(num_blocks=8, block_size=4)
    rid = eng.add_request([1, 2, 3, 4, 5], greedy(None))
    side = [eng.add_request([6 + j, 7, 8], greedy(4)) for j in range(others)]
    reasons = run_to_end(eng, 300)
    assert reasons[rid] == "length" and all(reasons[s] == "length" for s in side)
    eng.blocks.check_no_leaks([])
    out = fake_engine(num_blocks=8, block_size=4).generate([[1, 2, 3, 4, 5]], greedy(None), use_tqdm=False)[0]
    assert list(out.token_ids) == reference_continuation([1, 2, 3, 4, 5], 32 - 5)


# ------------------------------------------------------------------ the watchdog

@st.composite
def configurations(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    return {
        "block_size": block_size,
        "num_blocks": draw(st.integers(1, 24)),
        "levers.no_mix": draw(st.booleans()),
        "levers.prefix_caching": draw(st.booleans()),
        "levers.preempt_mode": draw(st.sampled_from(["recompute", "recompute", "abort"])),
        "scheduler.max_num_seqs": draw(st.integers(1, 5)),
        "scheduler.max_model_len": draw(st.sampled_from(["null", 6, 16, 40, 200])),
        "scheduler.max_num_batched_tokens": block_size * draw(st.integers(1, 6)) + draw(st.integers(0, 3)),
    }


requests = st.lists(st.tuples(st.lists(st.integers(1, 6), min_size=1, max_size=30),   # prompt (few ids: prefix hits)
                              st.one_of(st.none(), st.integers(1, 25)),               # max_tokens
                              st.integers(1, 2),                                      # n
                              st.integers(0, 6)),                                     # arrives at this step
                    min_size=1, max_size=7)


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configurations(), reqs=requests)
def test_watchdog_every_request_ends_and_no_block_leaks(cfg, reqs):
    cfg = dict(cfg)
    eng = fake_engine(num_blocks=cfg.pop("num_blocks"), block_size=cfg.pop("block_size"), **cfg)
    capacity = eng.blocks.num_blocks * eng.blocks.block_size
    context = min(eng.max_model_len, capacity)
    budget = sum(len(p) + (m or context) for p, m, n, _ in reqs) * 4 + 50   # steps: generous, but finite
    accepted: dict[str, tuple[list[int], int | None, int]] = {}
    reasons: dict[str, str] = {}
    pending = sorted(reqs, key=lambda r: r[3])
    for step in range(budget):
        while pending and pending[0][3] <= step:
            prompt, max_tokens, n, _ = pending.pop(0)
            try:
                rid = eng.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, n=n))
            except InvalidRequestError:
                continue
            accepted[rid] = (prompt, max_tokens, n)
        if not pending and not eng.has_unfinished():
            break
        for d in eng.poll():
            if d.finished:
                reasons.setdefault(d.request_id, d.finish_reason)
    else:
        raise AssertionError(f"not done after {budget} steps: {eng.request_ids()} of {cfg}")
    assert set(reasons) == set(accepted)
    eng.blocks.check_no_leaks([])
    assert eng.blocks.num_free == eng.blocks.num_blocks
    for rid, (prompt, max_tokens, n) in accepted.items():
        reason = reasons[rid]
        assert reason == "length" or reason.startswith("error: preempted"), (rid, reason)


# ------------------------------------------------------------------ nothing lost

@pytest.mark.parametrize("first", ["max_tokens=1", "stop token first"])
def test_a_request_that_ends_on_its_first_token_fills_the_prefix_cache(first):
    prompt = list(range(1, 14))                  # 13 tokens: 3 full blocks of 4
    eng = fake_engine(num_blocks=32, block_size=4)
    if first == "max_tokens=1":
        params = greedy(1)
    else:
        params = SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=reference_continuation(prompt, 1))
    out = eng.generate([prompt], params, use_tqdm=False)[0]
    assert len(out.token_ids) == 1 and out.finish_reason == ("length" if first == "max_tokens=1" else "stop")
    assert eng.blocks.cache_hits == 0
    again = eng.generate([prompt], greedy(3), use_tqdm=False)[0]
    assert eng.blocks.cache_hits == 12
    assert list(again.token_ids) == reference_continuation(prompt, 3)
    eng.blocks.check_no_leaks([])
