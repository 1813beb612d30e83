"""The model drafters read the same inputs on the CUDA backend as on the NumPy backend (run on a
GPU: pytest -m gpu tests/gpu/test_spec_drafters_gpu.py).

Why: on the H200 (session 4, docs/bench/raw/s4_spec/spec_64.txt) `self` and `mtp` accepted 0 of
96 probes at batch 32 on the repetitive task. A CUDA-path bug in what they read (the MTP head
fed hidden rows from the wrong buffer / row / after the final norm, stale rows after a graph
replay; the layer-prefix forward `forward(batch, num_layers)` with wrong positions or KV slots, or
a stale graph of another depth) would look like that. Here a CUDA engine and a NumPy engine with
the same (bf16) weights speculate greedily on the same prompts with the gate pinned to draft every
step (spec_verify_cost=0, measured gate off); each drafter's first-round logits are recorded per
token history, and every history both engines reached must give the same logits (bf16 tolerance)
and the same first draft token (unless the NumPy top-2 gap is within the tolerance).

The real SmolLM2 GGUF is used when present (METRALE_SMOLLM2_GGUF, default /tmp/mdl/smollm2.gguf,
as in test_cuda_backend_gpu.py), else random weights of its shape (the bundled MTP head fits
both). Skips without a GPU.
"""
import os

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

try:
    from numba import cuda
    HAVE_GPU = cuda.is_available()
except Exception:          # no numba / no driver
    HAVE_GPU = False
if not HAVE_GPU:
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from metrale import Engine, SamplingParams  # noqa: E402
from metrale.runtime.numpy_backend import NumpyBackend  # noqa: E402
from metrale.spec import assets  # noqa: E402

SMOL = os.environ.get("METRALE_SMOLLM2_GGUF", "/tmp/mdl/smollm2.gguf")
MODEL = SMOL if os.path.exists(SMOL) else "smollm2-135m-shape"
HEAD = str(assets.bundled("mtp")["smollm2-135m-instruct"])
LEVERS = {"spec_verify_cost": 0.0, "spec_measured_gate": "off", "prefix_caching": False}
REL_TOL = 3e-2        # bf16 weights and activations vs float32 NumPy, as in test_cuda_backend_gpu.py


def spec_cfg(method):
    spec = {"method": method, "num_drafts": 2}
    if method == "self":
        spec["self_layers"] = 10
    else:
        spec["mtp_head"] = HEAD
    return spec


@pytest.fixture(scope="module")
def engines():
    """{method: (cuda engine, numpy engine)}: one CUDA backend, its NumPy twin (the CUDA weights,
    exported), an engine per drafter on each."""
    plain = Engine(model=MODEL, device="cuda", cache={"num_blocks": 1024}, levers=LEVERS)
    be = plain.backend
    twin = NumpyBackend(be.config, be.export_weights(), num_blocks=1024, block_size=be.block_size)
    out = {}
    for method in ("self", "mtp"):
        cu = Engine(model=MODEL, device="cuda", cache={"num_blocks": 1024}, levers=LEVERS, spec=spec_cfg(method),
                    parts=(be.config, plain.tokenizer, be))
        np_eng = Engine(cfg=cu.cfg, parts=(be.config, plain.tokenizer, twin))
        out[method] = (cu, np_eng)
    return out


def record_device_head(drafter, log: dict):
    """record() for the MTP head on the device (metrale/spec/mtp_cuda.py): its first round's logits
    (head.logits_log; recorded proposals run eagerly)."""
    head, propose = drafter.head, drafter.propose
    head.logits_log = []

    def wrapped(seqs, ks):
        head.logits_log.clear()
        drafts = propose(seqs, ks)
        live = [i for i, k in enumerate(ks) if k > 0 and drafts[i].tokens]
        if live:
            rows = np.asarray(head.logits_log[0][1], dtype=np.float64)
            for row, i in enumerate(live):
                tok = drafts[i].tokens[0]
                log[tuple(seqs[i].token_ids)] = (tok if head.d2t is None else int(np.searchsorted(head.d2t, tok)),
                                                 rows[row])
        return drafts

    drafter.propose = wrapped
    return lambda: (setattr(head, "logits_log", None), setattr(drafter, "propose", propose))


def record(engine, log: dict):
    """Record, per drafter call, each drafting sequence's token history -> (first draft token, as
    its column of the logits row, the drafter's first-round logits row)."""
    drafter = engine.speculator.drafter
    if getattr(drafter, "on_device", False):          # the MTP head on the device (CUDA engines)
        return record_device_head(drafter, log)
    if drafter.name == "mtp":
        owner = drafter.head
    else:
        owner = drafter.backend.inner if hasattr(drafter.backend, "inner") else drafter.backend
    forward = owner.forward
    state = {"first": False}

    def capture(*a, **k):
        out = forward(*a, **k)
        if state["first"]:
            logits = out[0] if isinstance(out, tuple) else out
            state["logits"] = np.array(logits, dtype=np.float64)
            state["first"] = False
        return out

    owner.forward = capture
    propose = drafter.propose

    def wrapped(seqs, ks):
        state["first"], state["logits"] = True, None
        drafts = propose(seqs, ks)
        state["first"] = False
        live = [i for i, k in enumerate(ks) if k > 0 and drafts[i].tokens]
        if live:
            rows = state["logits"]
            assert rows is not None and len(rows) >= len(live)
            d2t = getattr(owner, "d2t", None)               # an MTP head's draft vocabulary: logits over d2t
            for row, i in enumerate(live):
                tok = drafts[i].tokens[0]
                log[tuple(seqs[i].token_ids)] = (tok if d2t is None else int(np.searchsorted(d2t, tok)), rows[row])
        return drafts

    drafter.propose = wrapped
    return lambda: (setattr(owner, "forward", forward), setattr(drafter, "propose", propose))


def prompts(batch):
    rng = np.random.default_rng(batch)
    if MODEL == SMOL:
        texts = ["Copy this paragraph exactly:\n\nThe committee met on Tuesday to review the budget for the "
                 "new library, and agreed to extend the opening hours on weekends.",
                 "Explain why the sky is blue.", "Write a haiku about autumn.", "How do I make a cup of tea?"]
        return [f"<|im_start|>user\n{t}<|im_end|>\n<|im_start|>assistant\n" for t in texts[:batch]]
    return [rng.integers(1, 49152, int(n)).tolist() for n in (23, 40, 9, 77)[:batch]]


@pytest.mark.parametrize("method", ["self", "mtp"])
@pytest.mark.parametrize("batch", [1, 4])
def test_drafter_reads_the_same_inputs_on_cuda_and_numpy(engines, method, batch):
    cu, np_eng = engines[method]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    logs = {}
    for name, eng in (("cuda", cu), ("numpy", np_eng)):
        logs[name] = {}
        undo = record(eng, logs[name])
        try:
            eng.generate(prompts(batch), params, use_tqdm=False)
        finally:
            undo()
    common = sorted(set(logs["cuda"]) & set(logs["numpy"]), key=len)
    assert logs["cuda"] and logs["numpy"], f"no drafts: cuda {len(logs['cuda'])}, numpy {len(logs['numpy'])}"
    assert len(common) >= batch, (f"{method} B={batch}: only {len(common)} token histories drafted on both "
                                  f"(cuda {len(logs['cuda'])}, numpy {len(logs['numpy'])})")
    bad = []
    for key in common:
        (tc, lc), (tn, ln) = logs["cuda"][key], logs["numpy"][key]
        err = float(np.linalg.norm(lc - ln) / np.linalg.norm(ln))
        gap = float(ln[tn] - ln[tc])                     # how much NumPy prefers its token over CUDA's
        tol = REL_TOL * float(np.abs(ln).max())
        if err > REL_TOL or (tc != tn and gap > tol):
            bad.append((len(key), tc, tn, round(err, 4), round(gap, 3)))
    assert not bad, f"{method} B={batch} (history length, cuda token, numpy token, rel err, gap): {bad}"
