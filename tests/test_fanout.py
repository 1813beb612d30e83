"""n > 1 and best_of in the engine: children `f"{id}-{j}"` with derived seeds, one RequestOutput per
prompt with `outputs`, stream deltas with `index` and logprobs, abort of the whole request, the
prompt computed once and shared through the prefix cache. On the fake model with a spread
distribution (exact, fast) and on SmolLM2 (short generations)."""
import numpy as np
import pytest

from fake_model import VOCAB, FakeBackend, FakeTokenizer
from metrale import Engine, InvalidRequestError, SamplingParams
from metrale.sampling import fanout
from metrale.settings import compose

PROMPT = list(range(1, 12))          # 11 tokens: two full blocks of 4 to share


class SpreadBackend(FakeBackend):
    """The fake model with a spread distribution: logit = -0.4 * circular distance to its token."""

    def forward(self, batch, *args, **kwargs):
        peak = np.argmax(super().forward(batch), axis=-1)
        d = np.abs(np.arange(VOCAB)[None, :] - peak[:, None])
        return (-0.4 * np.minimum(d, VOCAB - d)).astype(np.float32)


def spread_engine(*overrides):
    backend = SpreadBackend(256, 4)
    return Engine(cfg=compose(["cache.block_size=4", *overrides]), parts=(backend.config, FakeTokenizer(), backend))


def toks(outputs):
    return [o.token_ids.tolist() for o in outputs]


def sampled(p, **kw):
    return SamplingParams(**{"max_tokens": 6, "temperature": 1.0, "ignore_eos": True, **kw, **p})


def test_n_gives_n_outputs_equal_to_their_children_alone():
    eng = spread_engine()
    p = sampled({}, n=3, seed=11)
    out = eng.generate([PROMPT], p, use_tqdm=False)[0]
    assert len(out.outputs) == 3 and [o.index for o in out.outputs] == [0, 1, 2]
    assert [o.request_id for o in out.outputs] == [f"{out.request_id}-{j}" for j in range(3)]
    assert len({tuple(t) for t in toks(out.outputs)}) == 3
    # the top level mirrors the first completion
    assert out.text == out.outputs[0].text and out.token_ids.tolist() == out.outputs[0].token_ids.tolist()
    assert out.metrics["num_generated_tokens"] == 18
    # each completion is its child request (seed derive_seed(11, j)) run on its own, in any batch
    alone = [eng.generate([PROMPT], child, use_tqdm=False)[0] for child in fanout.expand(p)]
    assert toks(out.outputs) == toks(alone)
    again = eng.generate([[7, 7], PROMPT], [sampled({}, seed=1), p], use_tqdm=False)[1]
    assert toks(again.outputs) == toks(out.outputs)
    assert not eng.has_unfinished()
    eng.blocks.check_no_leaks([])


def test_n_1_outputs_is_itself():
    eng = spread_engine()
    out = eng.generate([PROMPT], sampled({}, seed=2), use_tqdm=False)[0]
    assert out.outputs == [out] and out.outputs[0] is out and out.index == 0


def test_prompt_is_computed_once_and_shared():
    eng = spread_engine()
    hits = eng.blocks.cache_hits
    rid = eng.add_request(PROMPT, sampled({}, n=3, seed=5))
    assert len(eng.scheduler.waiting) == 1                 # the siblings wait for the leader's prompt
    eng.poll()
    assert len(eng.backend.batches[-1].token_ids) == len(PROMPT)
    assert len(eng.scheduler.waiting) == 2
    eng.poll()
    assert eng.blocks.cache_hits - hits == 2 * 8           # two siblings x two full blocks of 4
    while eng.is_running(rid):
        eng.poll()
    eng.blocks.check_no_leaks([])
    # a prompt without a full block to share: all children start at once
    eng.add_request([3, 4], sampled({}, n=3, seed=5))
    assert len(eng.scheduler.waiting) == 3
    eng.generate([[5]], sampled({}), use_tqdm=False)
    assert not eng.has_unfinished()


def _spy_select(monkeypatch):
    seen = []
    real = fanout.select

    def spy(outputs, params):
        seen.append(list(outputs))
        return real(outputs, params)
    monkeypatch.setattr(fanout, "select", spy)
    return seen


def check_best(out, candidates, n):
    cum = sorted((c.cumulative_logprob for c in candidates), reverse=True)
    assert [o.cumulative_logprob for o in out.outputs] == cum[:n]
    by_cum = {c.cumulative_logprob: c.token_ids.tolist() for c in candidates}
    assert toks(out.outputs) == [by_cum[c] for c in cum[:n]]


def test_best_of_returns_the_n_highest_cumulative_logprobs(monkeypatch):
    eng = spread_engine()
    seen = _spy_select(monkeypatch)
    p = sampled({}, n=2, best_of=4, seed=3)
    out = eng.generate([PROMPT], p, use_tqdm=False)[0]
    (candidates,) = seen
    assert len(candidates) == 4 and len(out.outputs) == 2 and [o.index for o in out.outputs] == [0, 1]
    check_best(out, candidates, 2)
    assert out.logprobs is None and all(o.logprobs is None for o in out.outputs)   # not asked for
    assert out.cumulative_logprob == out.outputs[0].cumulative_logprob
    assert out.metrics["num_generated_tokens"] == 24
    # the candidates are the children run alone (with logprobs=0 to rank them)
    alone = eng.generate([PROMPT] * 4, fanout.expand(p), use_tqdm=False)
    assert sorted(toks(alone)) == sorted(toks(candidates))
    for a in alone:
        total = sum(a.logprobs[i][t] for i, t in enumerate(a.token_ids.tolist()))
        assert a.cumulative_logprob == pytest.approx(total)


def test_stream_deltas_carry_index_and_logprobs():
    eng = spread_engine()
    p = sampled({}, n=2, seed=9, logprobs=2, max_tokens=5)
    deltas = list(eng.stream(PROMPT, p))
    out = eng.generate([PROMPT], p, use_tqdm=False)[0]
    assert {d.index for d in deltas} == {0, 1} and len({d.request_id for d in deltas}) == 1
    for j, o in enumerate(out.outputs):
        mine = [d for d in deltas if d.index == j]
        assert [d.finish_reason for d in mine] == [None] * (len(mine) - 1) + ["length"]
        assert np.concatenate([d.token_ids for d in mine]).tolist() == o.token_ids.tolist()
        assert "".join(d.text for d in mine) == o.text
        assert [lp for d in mine for lp in d.logprobs] == o.logprobs
        assert all(len(d.logprobs) == len(d.token_ids) for d in mine)
        assert all(t in e and len(e) in (2, 3) for t, e in zip(o.token_ids.tolist(), o.logprobs))
    # n == 1 deltas carry logprobs too; without logprobs asked they carry None
    one = list(eng.stream(PROMPT, sampled({}, seed=4, logprobs=0, max_tokens=3)))
    assert [len(d.logprobs) for d in one] == [len(d.token_ids) for d in one] and one[0].index == 0
    assert all(d.logprobs is None for d in eng.stream(PROMPT, sampled({}, seed=4, max_tokens=3)))


def test_stream_with_best_of_gives_the_selected_whole_at_the_end(monkeypatch):
    eng = spread_engine()
    seen = _spy_select(monkeypatch)
    p = sampled({}, n=2, best_of=3, seed=8, logprobs=1)
    deltas = list(eng.stream(PROMPT, p))
    assert [d.index for d in deltas] == [0, 1] and all(d.finish_reason == "length" for d in deltas)
    cum = sorted((c.cumulative_logprob for c in seen[0]), reverse=True)
    assert [sum(e[t] for e, t in zip(d.logprobs, d.token_ids.tolist())) for d in deltas] == pytest.approx(cum[:2])


def test_abort_of_the_request_aborts_every_child():
    eng = spread_engine()
    rid = eng.add_request(PROMPT, sampled({}, n=3, seed=1, max_tokens=50))
    eng.poll()
    eng.poll()
    assert len(eng.requests) == 3 and eng.request_ids() == [rid]
    deltas = eng.abort_completions(rid)
    assert sorted(d.index for d in deltas) == [0, 1, 2] and {d.finish_reason for d in deltas} == {"abort"}
    assert not eng.has_unfinished() and not eng.is_running(rid)
    eng.blocks.check_no_leaks([])
    # before any step (siblings still waiting for the leader), and through abort()
    rid = eng.add_request(PROMPT, sampled({}, n=3, seed=1), request_id="mine")
    assert rid == "mine" and eng.abort("mine").finish_reason == "abort"
    assert not eng.has_unfinished() and eng.abort("mine") is None
    # best_of: the best candidates so far, whole
    rid = eng.add_request(PROMPT, sampled({}, n=1, best_of=3, seed=1, max_tokens=50))
    for _ in range(4):
        eng.poll()
    (d,) = eng.abort_completions(rid)
    assert d.finish_reason == "abort" and d.index == 0 and len(d.token_ids) >= 2
    assert not eng.has_unfinished() and not eng.groups.hidden
    eng.blocks.check_no_leaks([])


def test_ids_and_limits_are_checked():
    eng = spread_engine("scheduler.max_num_seqs=8")
    eng.add_request(PROMPT, sampled({}, n=2), request_id="x")
    with pytest.raises(InvalidRequestError, match="^request_id"):
        eng.add_request(PROMPT, sampled({}), request_id="x-1")
    with pytest.raises(InvalidRequestError, match="^request_id"):
        eng.add_request(PROMPT, sampled({}, n=2), request_id="x")
    with pytest.raises(InvalidRequestError, match="^n/best_of"):
        eng.add_request(PROMPT, sampled({}, n=2, best_of=9))
    with pytest.raises(InvalidRequestError, match="^n/best_of"):
        eng.add_request(PROMPT, sampled({}, n=3, best_of=2))
    eng.abort("x")
    assert not eng.has_unfinished()


# ------------------------------------------------------------------------------ SmolLM2
SMOL_PROMPT = "Once upon a time, in a land far away, there lived a"


def test_smollm2_n_is_seeded_and_reproducible(smollm2):
    p = SamplingParams(max_tokens=5, temperature=1.0, top_k=50, seed=21, n=3, ignore_eos=True)
    a = smollm2.generate([SMOL_PROMPT], p, use_tqdm=False)[0]
    b = smollm2.generate([SMOL_PROMPT], p, use_tqdm=False)[0]
    assert len(a.outputs) == 3 and all(len(o.token_ids) == 5 for o in a.outputs)
    assert toks(a.outputs) == toks(b.outputs) and [o.text for o in a.outputs] == [o.text for o in b.outputs]
    assert len({tuple(t) for t in toks(a.outputs)}) > 1
    smollm2.blocks.check_no_leaks([])


def test_smollm2_best_of_and_streamed_logprobs(smollm2, monkeypatch):
    seen = _spy_select(monkeypatch)
    p = SamplingParams(max_tokens=4, temperature=1.0, seed=5, n=2, best_of=4, logprobs=3, ignore_eos=True)
    out = smollm2.generate([SMOL_PROMPT], p, use_tqdm=False)[0]
    check_best(out, seen[0], 2)
    for o in out.outputs:
        assert o.cumulative_logprob == pytest.approx(sum(e[t] for e, t in zip(o.logprobs, o.token_ids.tolist())),
                                                     abs=1e-4)
    q = SamplingParams(max_tokens=4, temperature=1.0, seed=5, n=2, logprobs=3, ignore_eos=True)
    deltas = list(smollm2.stream(SMOL_PROMPT, q))
    ref = smollm2.generate([SMOL_PROMPT], q, use_tqdm=False)[0]
    for j, o in enumerate(ref.outputs):
        mine = [d for d in deltas if d.index == j]
        assert np.concatenate([d.token_ids for d in mine]).tolist() == o.token_ids.tolist()
        assert [lp for d in mine for lp in d.logprobs] == o.logprobs
    smollm2.blocks.check_no_leaks([])


@pytest.mark.gpu
def test_n_and_logprobs_on_cuda():
    """The device pipeline (CudaBackend.forward_device): n children, seeded, streamed logprobs."""
    eng = Engine(model="smollm2-135m-shape", device="cuda", cache={"num_blocks": 64})
    p = SamplingParams(max_tokens=6, temperature=1.0, seed=3, n=2, best_of=3, logprobs=2, ignore_eos=True)
    a, b = (eng.generate([list(range(5, 40))], p, use_tqdm=False)[0] for _ in range(2))
    assert len(a.outputs) == 2 and toks(a.outputs) == toks(b.outputs)
    assert a.outputs[0].cumulative_logprob >= a.outputs[1].cumulative_logprob
    q = SamplingParams(max_tokens=6, temperature=1.0, seed=3, n=2, logprobs=2, ignore_eos=True)
    deltas = list(eng.stream(list(range(5, 40)), q))
    ref = eng.generate([list(range(5, 40))], q, use_tqdm=False)[0]
    for j, o in enumerate(ref.outputs):
        mine = [d for d in deltas if d.index == j]
        assert np.concatenate([d.token_ids for d in mine]).tolist() == o.token_ids.tolist()
        assert [lp for d in mine for lp in d.logprobs] == o.logprobs
    eng.blocks.check_no_leaks([])
