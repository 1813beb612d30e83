"""Where levers.weights=native parts from the exact weights: the tiny Q4_K_M-typed GGUF of
tests/gpu/test_quant_backend_gpu.py through Engine.generate under each of (weights, cuda_graphs,
overlap), each greedy token checked against a NumPy twin's teacher-forced logits (the blocks' exact
dequantization); prints the first step that leaves the twin's maximum by more than 5% of the row's rms.
--rows: one engine's error against the twin row by row (by position), repeatability, eager decode.

    python -m bench.quant_diag [--rows]          (GPU)
"""
from __future__ import annotations

import itertools
import sys
import tempfile
from pathlib import Path

import numpy as np

for _d in ("tests", "tests/gpu"):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / _d))

from metrale import Engine, SamplingParams                        # noqa: E402
from metrale.runtime.batch import Segment, build_batch            # noqa: E402
from metrale.runtime.numpy_backend import NumpyBackend            # noqa: E402
from test_quant_backend_gpu import ENGINE, LEVERS, TYPES          # noqa: E402
from test_quant_backend_gpu import prefill_logits as _logits      # noqa: E402
from test_quant_wiring import write_quant_gguf                    # noqa: E402


def _engine(path, **levers):
    return Engine(model=str(path), levers={**LEVERS, **levers}, **ENGINE)


def first_departure(tokens, prompt, twin, tol=0.05):
    ids = np.concatenate([prompt, tokens]).astype(np.int32)
    rows = _logits(twin, ids)[len(prompt) - 1:len(ids) - 1]
    for j, (t, row) in enumerate(zip(tokens, rows)):
        slack = tol * float(np.sqrt((row.astype(np.float64) ** 2).mean()))
        if row[t] < row.max() - slack:
            return j, float(row.max() - row[t]) / slack
    return None, 0.0


def levers_report(path) -> None:
    """Greedy departures from the twin under each (weights, cuda_graphs, overlap)."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 258, int(n)).astype(np.int32) for n in (30, 12)]
    p = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    twin = None
    for weights, graphs, overlap in itertools.product(["native", "bf16"], [False, True], [False, True]):
        eng = _engine(path, weights=weights, cuda_graphs=graphs, overlap=overlap)
        if twin is None:
            be = eng.backend
            twin = NumpyBackend(be.config, be.export_weights(), num_blocks=512, block_size=be.block_size)
        full = np.concatenate([prompts[0], rng.integers(0, 258, 24).astype(np.int32)])
        ref = _logits(twin, full)
        err = float(np.linalg.norm(_logits(eng.backend, full) - ref) / np.linalg.norm(ref))
        for batch in (1, 2):
            outs = eng.generate(prompts[:batch], p, use_tqdm=False)
            dep = [first_departure(np.asarray(o.token_ids), pr, twin) for o, pr in zip(outs, prompts)]
            print(f"quant_diag weights={weights} cuda_graphs={graphs} overlap={overlap} B={batch}: prefill rel err "
                  f"{err:.4f}; first departure (step, gap/slack) {dep}", flush=True)
        eng.backend.close()


def rows_report(path) -> None:
    """One engine: the same prefill three times (deterministic?), each row's error against the twin by
    position and prompt length, then a teacher-forced eager decode one token a step."""
    eng = _engine(path, weights="native")
    be = eng.backend
    twin = NumpyBackend(be.config, be.export_weights(), num_blocks=512, block_size=be.block_size)
    rng = np.random.default_rng(5)
    ids = rng.integers(0, 258, 100).astype(np.int32)
    for n in (20, 54, 64, 100):
        ref = _logits(twin, ids[:n])
        outs = [_logits(be, ids[:n]) for _ in range(3)]
        same = [float(np.abs(o - outs[0]).max()) for o in outs[1:]]
        per_row = np.linalg.norm(outs[0] - ref, axis=1) / np.linalg.norm(ref, axis=1)
        print(f"quant_diag rows n={n}: repeat max diff {same}; row rel err by position "
              f"{np.array2string(per_row, precision=3, max_line_width=400)}", flush=True)
    bs = be.block_size
    table = np.arange(1, 1 + -(-100 // bs), dtype=np.int32)
    ref = _logits(twin, ids[:60])
    errs = []
    be.forward(build_batch([Segment(ids[:10], 0, table, "last")], bs))
    for pos in range(10, 60):
        row = be.forward(build_batch([Segment(ids[pos:pos + 1], pos, table, "last")], bs))[0]
        errs.append(float(np.linalg.norm(row - ref[pos]) / np.linalg.norm(ref[pos])))
    print(f"quant_diag decode rel err by position 10..59: {np.array2string(np.array(errs), precision=3, max_line_width=400)}")
    be.close()


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    path = write_quant_gguf(Path(tempfile.mkdtemp()) / "tiny-q4km.gguf", seed=1, layer_types=TYPES)
    (rows_report if "--rows" in args else levers_report)(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
