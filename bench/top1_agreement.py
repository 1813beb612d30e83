"""How often an engine's greedy top-1 equals an independent float32 reference's, teacher-forced
along the reference (issue 22's SmolLM2 figure).

The reference is tests/fixtures/golden_smollm2.npz: HF transformers in float32 on the exact
dequantization of SmolLM2-135M-Instruct.Q4_1.gguf (tools/make_golden.py). Each golden prompt
is run with its 32-token greedy continuation where the fixture has one; at every position the
engine's argmax is compared with the reference's. `batch` runs each sequence as one forward (the
prefill road); `step` feeds one token a forward (the decode road).

    python -m bench.top1_agreement metrale --device cuda --levers '{"weights": "native"}' --mode step --out a.json
    python -m bench.top1_agreement llamacpp --bin .llamacpp/cpu/build/bin/metrale-top1 --ngl 0 --mode step --out b.json
    python -m bench.top1_agreement report a.json b.json
"""
from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "fixtures" / "golden_smollm2.npz"
NEAR_TIE = 0.05        # reference top-1 minus top-2 logit below this: a position either side may flip


@dataclass
class Sequence:
    name: str
    ids: np.ndarray        # int32 [n]: what is fed
    ref: np.ndarray        # int32 [n]: the reference's argmax after each fed token
    gap: np.ndarray        # float32 [n]: the reference's top-1 minus top-2 logit there


def golden_sequences(path: Path = GOLDEN) -> list[Sequence]:
    z = np.load(path)
    meta = json.loads(str(z["meta"]))
    out = []
    for p in meta["prompts"]:
        i = p["index"]
        ids, ref = z[f"p{i}_ids"], z[f"p{i}_top1"]
        top = z[f"p{i}_topk_logits"]
        gap = top[:, 0] - top[:, 1]
        if f"p{i}_greedy" in z:
            greedy, ggap = z[f"p{i}_greedy"], z[f"p{i}_greedy_gap"]
            if ref[-1] != greedy[0]:
                raise ValueError(f"golden prompt {i}: its last top-1 is not its first greedy token")
            ids = np.concatenate([ids, greedy[:-1]])
            ref = np.concatenate([ref, greedy[1:]])
            gap = np.concatenate([gap, ggap[1:]])
        out.append(Sequence(p["name"], ids.astype(np.int32), ref.astype(np.int32), gap.astype(np.float32)))
    return out


def metrale_top1(seqs: list[Sequence], model: str, device: str, levers: dict, mode: str) -> list[list[int]]:
    from metrale import Engine, SamplingParams
    from metrale.runtime.batch import Segment, build_batch
    from metrale.scheduler.sequence import Sequence as Held

    engine = Engine(model=model, device=device, levers=levers)
    backend = engine.backend
    tops = []
    for s in seqs:
        holder = Held([0], SamplingParams())
        if not engine.blocks.grow(holder, len(s.ids)):
            raise RuntimeError("no free KV blocks")
        blocks = np.array(holder.block_table, np.int32)
        try:
            if mode == "batch":
                seg = [Segment(s.ids, 0, blocks, logits="all")]
                rows = np.asarray(backend.forward(build_batch(seg, backend.block_size)))
                tops.append(np.argmax(rows, axis=-1).tolist())
            else:
                top = []
                for i in range(len(s.ids)):
                    seg = [Segment(s.ids[i:i + 1], i, blocks, logits="last")]
                    row = np.asarray(backend.forward(build_batch(seg, backend.block_size)))
                    top.append(int(np.argmax(row[-1])))
                tops.append(top)
        finally:
            engine.blocks.release(holder)
    return tops


def llamacpp_top1(seqs: list[Sequence], binary: str, gguf: str, ngl: int, mode: str,
                  libdirs: list[str] = ()) -> list[list[int]]:
    import os
    with tempfile.TemporaryDirectory() as d:
        src, dst = Path(d) / "seqs.txt", Path(d) / "top1.txt"
        src.write_text("".join(" ".join(map(str, s.ids.tolist())) + "\n" for s in seqs))
        env = dict(os.environ)
        if libdirs:
            env["LD_LIBRARY_PATH"] = ":".join([*libdirs, env.get("LD_LIBRARY_PATH", "")])
        r = subprocess.run([binary, gguf, str(src), str(dst), str(ngl), mode], capture_output=True, text=True, env=env)
        if r.returncode != 0:
            raise RuntimeError(f"metrale-top1 exited {r.returncode}: {r.stderr[-2000:]}")
        return [list(map(int, line.split())) for line in dst.read_text().splitlines()]


def agreement(seqs: list[Sequence], tops: list[list[int]]) -> dict:
    """Matches over all positions and over the positions whose reference margin is not a near tie."""
    all_hit = all_n = firm_hit = firm_n = 0
    misses = []
    for s, top in zip(seqs, tops):
        if len(top) != len(s.ids):
            raise ValueError(f"{s.name}: {len(top)} top-1 ids for {len(s.ids)} positions")
        hit = np.asarray(top) == s.ref
        firm = s.gap >= NEAR_TIE
        all_hit, all_n = all_hit + int(hit.sum()), all_n + len(hit)
        firm_hit, firm_n = firm_hit + int(hit[firm].sum()), firm_n + int(firm.sum())
        misses += [{"prompt": s.name, "pos": int(i), "ref": int(s.ref[i]), "got": int(top[i]),
                    "ref_gap": round(float(s.gap[i]), 4)} for i in np.flatnonzero(~hit)]
    return {"positions": all_n, "agree": all_hit, "rate": all_hit / all_n,
            "firm_positions": firm_n, "firm_agree": firm_hit, "firm_rate": firm_hit / max(firm_n, 1),
            "misses": misses}


def _smollm2_gguf() -> str:
    from metrale.models.registry import resolve_model
    return str(resolve_model("smollm2-135m").path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("metrale")
    m.add_argument("--model", default="smollm2-135m")
    m.add_argument("--device", default="cpu")
    m.add_argument("--levers", default="{}", help="JSON")
    l = sub.add_parser("llamacpp")  # noqa: E741
    l.add_argument("--bin", required=True, help="metrale-top1 (bench/llamacpp.py builds it)")
    l.add_argument("--gguf", default=None, help="default: the embedded SmolLM2 Q4_1 file")
    l.add_argument("--ngl", type=int, default=0)
    l.add_argument("--libdirs", nargs="*", default=[])
    for p in (m, l):
        p.add_argument("--mode", choices=("batch", "step"), default="step")
        p.add_argument("--label", default=None)
        p.add_argument("--out", required=True)
    r = sub.add_parser("report")
    r.add_argument("files", nargs="+")
    a = ap.parse_args()

    if a.cmd == "report":
        print("| engine | mode | agree / positions | rate | without near ties (gap < %.2f) |" % NEAR_TIE)
        print("|---|---|---|---|---|")
        for f in a.files:
            d = json.loads(Path(f).read_text())
            g = d["agreement"]
            print(f"| {d['label']} | {d['mode']} | {g['agree']} / {g['positions']} | {g['rate']:.3f} | "
                  f"{g['firm_agree']} / {g['firm_positions']} ({g['firm_rate']:.3f}) |")
        return
    seqs = golden_sequences()
    t0 = time.perf_counter()
    if a.cmd == "metrale":
        tops = metrale_top1(seqs, a.model, a.device, json.loads(a.levers), a.mode)
        label = a.label or f"metrale {a.device} {a.levers}"
    else:
        tops = llamacpp_top1(seqs, a.bin, a.gguf or _smollm2_gguf(), a.ngl, a.mode, a.libdirs)
        label = a.label or f"llama.cpp ngl={a.ngl}"
    g = agreement(seqs, tops)
    Path(a.out).write_text(json.dumps({"label": label, "mode": a.mode, "seconds": time.perf_counter() - t0,
                                       "agreement": g, "top1": tops}, indent=1))
    print(f"{label} ({a.mode}): {g['agree']} / {g['positions']} = {g['rate']:.3f}; "
          f"without near ties {g['firm_agree']} / {g['firm_positions']} = {g['firm_rate']:.3f}")
    for miss in g["misses"]:
        print("  miss", miss)


if __name__ == "__main__":
    main()
