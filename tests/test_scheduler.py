"""Scheduler, paged KV and prefix cache against the fake model (fast, deterministic)."""
import gc
import tracemalloc

import numpy as np
import pytest

from fake_model import fake_engine, reference_continuation
from metrale import SamplingParams


def params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def random_prompt(rng, lo=1, hi=40) -> list[int]:
    return [int(t) for t in rng.integers(1, 96, size=int(rng.integers(lo, hi)))]


def test_outputs_equal_reference_under_batching(rng):
    eng = fake_engine(num_blocks=256, block_size=4)
    prompts = [random_prompt(rng) for _ in range(12)]
    outs = eng.generate([np.array(p) for p in prompts], params(9), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert list(o.token_ids) == reference_continuation(p, 9)
        assert o.finish_reason == "length"
    eng.blocks.check_no_leaks([])


def test_budget_seq_limit_and_block_aligned_chunks(rng):
    eng = fake_engine(num_blocks=512, block_size=4, **{"scheduler.max_num_batched_tokens": 10,
                                                       "scheduler.max_num_seqs": 3})
    prompts = [random_prompt(rng, 10, 60) for _ in range(6)]
    outs = eng.generate([np.array(p) for p in prompts], params(5), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert list(o.token_ids) == reference_continuation(p, 5)
    for batch in eng.backend.batches:
        assert batch.num_tokens <= 10 and batch.num_seqs <= 3
        for s in range(batch.num_seqs):
            a, b = batch.seq_query_start[s], batch.seq_query_start[s + 1]
            last_pos = batch.positions[b - 1]
            is_final = s in batch.token_seq[batch.logits_indices]
            if not is_final:       # an intermediate prefill chunk ends on a block boundary
                assert (last_pos + 1) % 4 == 0, (a, b, last_pos)


def test_long_prompt_does_not_stall_running_decodes(rng):
    eng = fake_engine(num_blocks=512, block_size=4, **{"scheduler.max_num_batched_tokens": 16})
    short = eng.add_request(np.array([5, 6, 7]), params(30))
    eng.step()                                                   # short one is decoding now
    eng.add_request(np.array(random_prompt(rng, 150, 151)), params(2))
    for _ in range(6):                                           # long prompt is being chunked
        deltas = {d.request_id: d for d in eng.step()}
        assert short in deltas and len(deltas[short].token_ids) == 1
    batch = eng.backend.batches[-1]
    assert batch.num_seqs == 2 and batch.num_tokens == 1 + 12    # decode row + a block-aligned chunk, fused


def test_no_mix_lever_splits_prefill_and_decode(rng):
    eng = fake_engine(num_blocks=512, block_size=4, **{"levers.no_mix": "true"})
    prompts = [random_prompt(rng, 5, 30) for _ in range(5)]
    rids = []
    for p in prompts[:2]:
        rids.append(eng.add_request(np.array(p), params(6)))
    eng.step()
    for p in prompts[2:]:
        rids.append(eng.add_request(np.array(p), params(6)))
    while eng.has_unfinished():
        eng.step()
    for batch in eng.backend.batches:
        lens = np.diff(batch.seq_query_start)
        context_before = batch.context_lens - lens
        decode = (lens == 1) & (context_before > 0)
        assert decode.all() or not decode.any(), "a step mixed decode rows with prefill"


def test_prefix_cache_reuses_blocks_and_skips_compute(rng):
    eng = fake_engine(num_blocks=256, block_size=4)
    shared = random_prompt(rng, 33, 34)
    first = eng.generate(np.array(shared + [11, 12]), params(4), use_tqdm=False)[0]
    n_before = sum(b.num_tokens for b in eng.backend.batches)
    second = eng.generate(np.array(shared + [13, 14, 15]), params(4), use_tqdm=False)[0]
    computed = sum(b.num_tokens for b in eng.backend.batches) - n_before
    assert list(first.token_ids) == reference_continuation(shared + [11, 12], 4)
    assert list(second.token_ids) == reference_continuation(shared + [13, 14, 15], 4)
    # 33 shared tokens = 8 full blocks reused; only the rest of the prompt plus decodes computed
    assert computed == (36 - 32) + 3, computed
    assert eng.blocks.cache_hits >= 32
    eng.blocks.check_no_leaks([])


def test_prefix_caching_lever_off_recomputes(rng):
    eng = fake_engine(num_blocks=256, block_size=4, **{"levers.prefix_caching": "false"})
    shared = random_prompt(rng, 33, 34)
    eng.generate(np.array(shared), params(2), use_tqdm=False)
    eng.generate(np.array(shared), params(2), use_tqdm=False)
    assert eng.blocks.cache_hits == 0


def test_preemption_recompute_loses_nothing(rng):
    eng = fake_engine(num_blocks=24, block_size=4)            # 96 tokens of KV for 6 x ~40
    prompts = [random_prompt(rng, 10, 25) for _ in range(6)]
    outs = eng.generate([np.array(p) for p in prompts], params(20), use_tqdm=False)
    assert eng.scheduler.num_preemptions > 0
    for p, o in zip(prompts, outs):
        assert list(o.token_ids) == reference_continuation(p, 20)
    eng.blocks.check_no_leaks([])


def test_preemption_abort_mode_ends_with_error(rng):
    eng = fake_engine(num_blocks=24, block_size=4, **{"levers.preempt_mode": "abort"})
    prompts = [random_prompt(rng, 10, 25) for _ in range(6)]
    outs = eng.generate([np.array(p) for p in prompts], params(20), use_tqdm=False)
    reasons = [o.finish_reason for o in outs]
    assert "error: preempted: KV cache exhausted" in reasons
    for p, o in zip(prompts, outs):
        if o.finish_reason == "length":
            assert list(o.token_ids) == reference_continuation(p, 20)
    eng.blocks.check_no_leaks([])


def test_request_larger_than_cache_is_rejected_up_front():
    from metrale import InvalidRequestError
    eng = fake_engine(num_blocks=8, block_size=4)
    with pytest.raises(InvalidRequestError, match="exceed the whole KV cache"):
        eng.add_request(np.arange(1, 20), params(20))
    assert not eng.has_unfinished()


def test_stress_random_aborts_every_request_finishes(rng):
    eng = fake_engine(num_blocks=20, block_size=4, **{"scheduler.max_num_batched_tokens": 24})
    finished: dict[str, str] = {}
    live: list[str] = []
    for i in range(50):
        live.append(eng.add_request(np.array(random_prompt(rng, 1, 30)), params(int(rng.integers(1, 40)))))
        for d in eng.step():
            if d.finished:
                finished[d.request_id] = d.finish_reason
        if rng.random() < 0.2:
            victim = live[int(rng.integers(len(live)))]
            if victim not in finished:
                finished[victim] = eng.abort(victim).finish_reason
    while eng.has_unfinished():
        for d in eng.step():
            if d.finished:
                finished[d.request_id] = d.finish_reason
    assert set(finished) == set(live)
    assert all(r in ("length", "abort") for r in finished.values())
    eng.blocks.check_no_leaks([])
    assert eng.blocks.num_free == eng.blocks.num_blocks


def test_host_memory_does_not_grow_over_1000_requests(rng):
    eng = fake_engine(num_blocks=64, block_size=4)
    eng.backend.batches = None      # stop recording batches

    def run(n: int) -> None:
        for _ in range(n):
            eng.add_request(np.array(random_prompt(rng, 1, 20)), params(3))
            while eng.has_unfinished():
                eng.step()

    eng.backend.forward = _no_record(eng.backend)
    run(100)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    run(1000)
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert after - before < 200_000, f"host memory grew by {after - before} bytes over 1000 requests"


def _no_record(backend):
    original = type(backend).forward

    def forward(batch):
        backend.batches = []
        return original(backend, batch)
    return forward
