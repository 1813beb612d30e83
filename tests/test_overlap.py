"""The host a step ahead (levers.overlap): the same greedy tokens as the synchronous loop, for
every request, through arrivals, finishes, stop tokens, aborts and preemption; no KV block leaks;
and the loop really runs ahead."""
import numpy as np
import pytest

from fake_model import EOS, VOCAB, FakeBackend, FakeTokenizer, fake_engine, reference_continuation
from metrale import Engine, SamplingParams
from metrale.overlap import AheadLoop
from metrale.settings import compose
from metrale.spec.drafter import Draft


def _params(i: int, mode: str, max_tokens: int, stop) -> SamplingParams:
    """greedy: every request; sampled: greedy, seeded top-p sampling and penalized sampling (all
    device-only rows, ahead; the penalized ones count their pending token on the device) in turn;
    penalized: a penalty mix on every request, greedy or seeded."""
    if mode == "penalized":
        kw = PENALIZED[i % len(PENALIZED)]
        return SamplingParams(max_tokens=max_tokens, temperature=0.0 if i % 2 else 1.1, seed=i, stop_token_ids=stop, **kw)
    if mode == "greedy" or i % 3 == 0:
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_token_ids=stop)
    if i % 3 == 1:
        return SamplingParams(max_tokens=max_tokens, temperature=0.9, top_p=0.9, seed=i, stop_token_ids=stop)
    return SamplingParams(max_tokens=max_tokens, temperature=0.7, presence_penalty=0.5, seed=i, stop_token_ids=stop)


def _run(overlap: bool, seed: int, num_blocks: int = 256, mode: str = "greedy"):
    """A random workload stepped by hand: requests arrive between steps, a few are aborted."""
    rng = np.random.default_rng(seed)
    if mode == "penalized":
        e = _noisy_engine(overlap, ToolTokenizer(), num_blocks)
    else:
        e = fake_engine(num_blocks=num_blocks, **{"levers.overlap": overlap, "scheduler.max_num_seqs": 8})
    prompts = [[int(t) for t in rng.integers(1, 60, rng.integers(2, 12))] for _ in range(12)]
    lens = [int(x) for x in rng.integers(1, 40, len(prompts))]
    stop = {i: [int(rng.integers(1, 60))] for i in range(len(prompts)) if i % 3 == 0}
    abort_at = {int(rng.integers(0, len(prompts))): int(rng.integers(1, 30))}
    outs, pending, step = {}, list(range(len(prompts))), 0
    while pending or e.has_unfinished():
        if pending and (step % 3 == 0 or not e.has_unfinished()):
            i = pending.pop(0)
            sp = _params(i, mode, lens[i], stop.get(i))
            e.add_request(prompts[i], sp, request_id=f"r{i}")
        for i, at in abort_at.items():
            if step == at and e.is_running(f"r{i}"):
                e.abort(f"r{i}")
        for d in e.poll():
            o = outs.setdefault(d.request_id, [[], None])
            o[0] += [int(t) for t in d.token_ids]
            o[1] = d.finish_reason or o[1]
        step += 1
        assert step < 5000
    e.blocks.check_no_leaks([])
    return outs, e, {f"r{i}" for i in abort_at}


def _same(ahead, sync, aborted):
    """Equal outputs; an aborted request's tokens (cut when the abort came, which the loop ahead
    reaches a step later in tokens) need only agree as far as both got."""
    assert ahead.keys() == sync.keys()
    for rid in sync:
        if rid in aborted:
            a, b = ahead[rid][0], sync[rid][0]
            assert a[:len(b)] == b[:len(a)]
        else:
            assert ahead[rid] == sync[rid], rid


@pytest.mark.parametrize("seed", range(6))
def test_same_tokens_as_the_synchronous_loop(seed):
    sync, _, aborted = _run(False, seed)
    ahead, e, _ = _run(True, seed)
    _same(ahead, sync, aborted)
    assert e.ahead.steps_ahead > 0


@pytest.mark.parametrize("seed", range(3))
def test_sampled_rows_same_tokens_as_the_synchronous_loop(seed):
    """Seeded sampling: the rows drawn ahead on the device pipeline (their draw counter one step
    further, penalized rows counting their pending token) give the synchronous loop's tokens."""
    sync, _, aborted = _run(False, seed, mode="sampled")
    ahead, e, _ = _run(True, seed, mode="sampled")
    _same(ahead, sync, aborted)
    assert e.ahead.steps_ahead > 0


def test_only_device_sampled_rows_run_ahead():
    e = fake_engine(num_blocks=64, **{"levers.overlap": True})
    for sp in (SamplingParams(max_tokens=12, temperature=0.8, top_k=20, seed=3),
               SamplingParams(max_tokens=12, temperature=0.8, repetition_penalty=1.2, seed=3)):
        e.ahead.steps_ahead = 0
        e.generate([[5, 6, 7]], sp)
        assert e.ahead.steps_ahead > 0
    e.ahead.steps_ahead = 0
    e.generate([[5, 6, 7]], SamplingParams(max_tokens=12, temperature=0.8, logprobs=2, seed=3))
    e.generate([[5, 6, 7]], SamplingParams(max_tokens=12, temperature=0.8, presence_penalty=0.5, min_tokens=12, seed=3))
    assert e.ahead.steps_ahead == 0


def test_preemption_under_a_small_pool_is_the_same():
    sync, e_sync, aborted = _run(False, 7, num_blocks=24)
    ahead, e, _ = _run(True, 7, num_blocks=24)
    _same(ahead, sync, aborted)
    assert e.scheduler.num_preemptions > 0 and e.ahead.steps_ahead > 0


def test_the_extra_token_of_a_finished_row_is_never_emitted():
    e = fake_engine(num_blocks=64, **{"levers.overlap": True})
    out = e.generate([[5, 6, 7]], SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 9 and out.finish_reason == "length"
    eos = e.generate([[5, 6, 7]], SamplingParams(max_tokens=50, temperature=0.0, stop_token_ids=[int(out.token_ids[3])]))[0]
    assert list(eos.token_ids) == list(out.token_ids[:4]) and eos.finish_reason == "stop"


def test_real_model_greedy_equal(smollm2):
    """The real SmolLM2 on the NumPy backend: the same ids with the loop ahead and without."""
    prompts = ["The capital of France is", "def add(a, b):", "1, 2, 3,"]
    sp = SamplingParams(max_tokens=12, temperature=0.0)
    assert smollm2.ahead is None                   # the NumPy backend computes at once: no gain, off
    want = [o.token_ids.tolist() for o in smollm2.generate(prompts, sp)]
    smollm2.ahead = AheadLoop(smollm2)
    try:
        got = [o.token_ids.tolist() for o in smollm2.generate(prompts, sp)]
        assert smollm2.ahead.steps_ahead > 0
    finally:
        smollm2.ahead = None
    assert got == want


# ---------------------------------------------------------------------- penalized rows ahead


class NoisyBackend(FakeBackend):
    """The fake model with every logit spread (noise seeded by the context's next token and the
    position), so that penalties change which token is drawn."""

    def forward(self, batch, num_layers=None, return_hidden=False):
        peak = np.argmax(super().forward(batch), axis=-1)
        pos = batch.positions[batch.logits_indices]
        out = np.stack([np.random.default_rng(int(p) * 4099 + int(q)).standard_normal(VOCAB) for p, q in zip(peak, pos)])
        out[np.arange(peak.size), peak] += 2.0
        return out.astype(np.float32)


class ToolTokenizer(FakeTokenizer):
    """FakeTokenizer with tool-call markers: 91 (END) empties the penalty window."""
    ids = {"<tool_call>": 90, "</tool_call>": 91}

    def token_to_id(self, text):
        return self.ids.get(text)


def _noisy_engine(overlap: bool, tokenizer, num_blocks: int = 256):
    backend = NoisyBackend(num_blocks, 4)
    cfg = compose(["cache.block_size=4", f"levers.overlap={overlap}", "scheduler.max_num_seqs=8"])
    return Engine(cfg=cfg, parts=(backend.config, tokenizer, backend))


PENALIZED = [dict(repetition_penalty=1.5), dict(frequency_penalty=0.7), dict(presence_penalty=1.2),
             dict(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.5, logit_bias={91: 1.5, 4: 0.5}),
             dict(repetition_penalty=0.8, frequency_penalty=-0.2, presence_penalty=0.4)]


def _penalized_params(max_tokens: int) -> list[SamplingParams]:
    """Each penalty mix greedy and seeded-sampled, beside an unpenalized greedy and top-p row."""
    out = [SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
           SamplingParams(max_tokens=max_tokens, temperature=1.0, top_p=0.9, seed=1, ignore_eos=True)]
    for j, kw in enumerate(PENALIZED):
        out.append(SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw))
        out.append(SamplingParams(max_tokens=max_tokens, temperature=1.2, seed=10 + j, top_k=40, ignore_eos=True, **kw))
    return out


@pytest.mark.parametrize("tokenizer", [FakeTokenizer, ToolTokenizer], ids=["plain", "tool_call_end"])
def test_penalized_rows_ahead_same_tokens(tokenizer):
    """Penalized greedy and seeded rows run ahead (their counts one token short, the pending token
    counted by the pipeline) and give the synchronous loop's tokens; with a tool-call END token drawn
    now and then, the window restarts at the same step in both."""
    params = _penalized_params(40)
    prompts = [[int(t) for t in np.random.default_rng(i).integers(1, 90, 3 + i % 5)] for i in range(len(params))]
    got = {}
    for overlap in (False, True):
        e = _noisy_engine(overlap, tokenizer())
        got[overlap] = [o.token_ids.tolist() for o in e.generate(prompts, params, use_tqdm=False)]
        if overlap:
            assert e.ahead.steps_ahead > 30
    assert got[True] == got[False]
    plain = _noisy_engine(False, tokenizer()).generate(
        prompts, [SamplingParams(**{**p.__dict__, "repetition_penalty": 1.0, "frequency_penalty": 0.0,
                                    "presence_penalty": 0.0}) for p in params], use_tqdm=False)
    assert sum(a != o.token_ids.tolist() for a, o in zip(got[False][2:], plain[2:])) >= len(PENALIZED)   # penalties bite
    if tokenizer is ToolTokenizer:
        assert sum(91 in ids for ids in got[True][2:]) >= 2          # the window did restart


@pytest.mark.parametrize("seed", range(3))
def test_penalized_rows_through_arrivals_and_aborts(seed):
    sync, _, aborted = _run(False, seed, mode="penalized")
    ahead, e, _ = _run(True, seed, mode="penalized")
    _same(ahead, sync, aborted)
    assert e.ahead.steps_ahead > 0


# ---------------------------------------------------------------------- speculation beside the loop ahead


class EveryEighthOracle:
    """A lookup-only drafter with drafts at every eighth position only: the true continuation with
    some tokens corrupted (both accept and reject run), nothing elsewhere (those steps run ahead)."""
    name = "every_eighth"
    lookup_only = True

    def __init__(self, error_rate: float, seed: int = 0):
        self.error_rate, self.rng, self.asked = error_rate, np.random.default_rng(seed), 0

    def propose(self, seqs, ks):
        out = []
        for s, k in zip(seqs, ks):
            self.asked += 1
            if s.num_tokens % 8:
                out.append(Draft())
                continue
            truth = reference_continuation(s.token_ids, k)
            toks = [t if self.rng.random() > self.error_rate else t % (VOCAB - 1) + 1 for t in truth]
            out.append(Draft(toks, [1.0] * k))
        return out

    def release(self, seq):
        pass


@pytest.mark.parametrize("error_rate", [0.0, 0.4])
@pytest.mark.parametrize("num_blocks", [256, 40])
def test_speculation_beside_the_loop_ahead(error_rate, num_blocks):
    """Steps with no draft run ahead, a draft sends the loop back to a verify step: the tokens are
    plain decoding's (greedy and seeded sampled rows), through arrivals, preemption and finishes;
    both kinds of step really ran and no block leaks."""
    rng = np.random.default_rng(11)
    prompts = [[int(t) for t in rng.integers(1, 90, int(n))] for n in rng.integers(2, 14, 5)]
    params = [SamplingParams(max_tokens=int(n), temperature=0.0 if i % 2 else 0.9, seed=i, ignore_eos=True)
              for i, n in enumerate(rng.integers(20, 60, len(prompts)))]
    e = fake_engine(num_blocks=num_blocks, **{"levers.overlap": True, "scheduler.max_num_seqs": 8,
                                              "spec.method": "ngram", "spec.num_drafts": 3,
                                              "spec.gate.verify_cost": 0.0})
    e.speculator.drafter = EveryEighthOracle(error_rate)
    outs = e.generate(prompts, params, use_tqdm=False)
    for p, sp, o in zip(prompts, params, outs):
        assert list(o.token_ids) == reference_continuation(p, sp.max_tokens)
    st = e.speculator.stats()
    assert e.ahead.steps_ahead > 10 and st["verifies"] >= 3
    assert (st["accepted"] > 0) == (error_rate < 1.0)
    e.blocks.check_no_leaks([])


def test_ngram_speculation_runs_ahead_between_drafts():
    """The n-gram drafter on a periodic prompt: verify steps while its matches hold, steps ahead
    where it has none (a prompt with no repeat), the same tokens as plain decoding."""
    prompts = [[1, 2, 3, 4, 5] * 6, [int(t) for t in np.random.default_rng(3).permutation(np.arange(1, 90))[:20]]]
    sp = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    e = fake_engine(num_blocks=128, **{"levers.overlap": True, "spec.method": "ngram", "spec.num_drafts": 3,
                                       "spec.gate.verify_cost": 0.0})
    outs = e.generate(prompts, sp, use_tqdm=False)
    assert [list(o.token_ids) for o in outs] == [reference_continuation(p, 30) for p in prompts]
    assert e.ahead.steps_ahead > 0 and e.speculator.stats()["verifies"] > 0


class HiddenReadingOracle(EveryEighthOracle):
    """Stands for MTP: a drafter that reads each step's hidden rows (which steps ahead keep none of)."""
    name = "hidden_reader"
    needs_hidden = True
    lookup_only = False

    def __init__(self):
        super().__init__(0.0)
        self.observed = 0

    def tap(self, backend):
        return backend

    def observe(self, sampled, emitted, hidden):
        self.observed += 1


def test_a_drafter_reading_hidden_rows_keeps_every_step_synchronous():
    e = fake_engine(num_blocks=128, **{"levers.overlap": True, "spec.method": "ngram", "spec.num_drafts": 3,
                                       "spec.gate.verify_cost": 0.0})
    e.speculator.drafter = HiddenReadingOracle()
    e.runner.backend.take_hidden = lambda: None          # what HiddenTap adds to a backend
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    outs = e.generate(prompts, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert [list(o.token_ids) for o in outs] == [reference_continuation(p, 30) for p in prompts]
    assert e.ahead.steps_ahead == 0 and e.speculator.stats()["verifies"] > 0
    assert e.speculator.drafter.observed == e.stats["steps"]        # the drafter saw every step
