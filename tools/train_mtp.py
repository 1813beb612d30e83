"""Self-distillation of an MTP head for SmolLM2-135M-Instruct (metrale/spec/mtp.py describes the head).

Phases
  collect      (metrale's venv, NumPy backend, float32): the model continues a few hundred prompts
               written here (sampling, temperature 0.7, bounded length); every step keeps the target's
               hidden row (before the final norm) and the top-k of its logits. Writes an .npz corpus with
               the target weights the head shares or starts from.
  collect-gpu  (metrale's environment, any backend; the GPU machine: CUDA): every prompt written here,
               --samples continuations each (distinct seeds), in one batched Engine.generate; then the
               hidden rows of each continuation, teacher-forced through the engine's backend. The corpus
               keeps no top-k: train computes it from the hidden rows and the stored weights.
  train        (torch; .venv-train: torch 2.13.0 CPU, or --device cuda): the head at position p reads
               h_p and embed(x_{p+1}) and is trained by KL to the target's distribution at p+1 (the token
               after next), its attention window starting at the first continuation row as in the
               engine; a second, chained term feeds the head's own output as the hidden of position p+1
               (what draft 2 sees). The block starts as the target's last layer, eh_proj as identity on
               the hidden half. Time-boxed; writes the head as fp16 safetensors and a JSON log (loss
               curve, held-out evaluation per draft before and after, collection figures) and, unless
               --draft-vocab 0, the draft vocabulary `d2t` (int32, ascending): the --draft-vocab (8192)
               most frequent tokens of the corpus's continuations and prompts.
  measure      (metrale's venv): greedy acceptance of mtp (k = 1..3) next to n-gram on held-out prompts,
               per draft position; --draft-vocab 0 measures the head without its draft vocabulary.
  d2t          (metrale's venv): add (or replace) the draft vocabulary of an existing head file (--head,
               default the bundled one; written to --out if given, else in place) from a corpus: the
               --draft-vocab most frequent tokens of its continuations and prompts. The other tensors
               are kept byte for byte.
  all          collect, then train under .venv-train.
  gpu          collect-gpu, then train --device cuda, each a process of this interpreter (torch and
               metrale in one environment); training takes what is left of --gpu-minutes.

    python3.11 -m venv .venv-train && .venv-train/bin/pip install torch==2.13.0 "numpy<2.5" safetensors
    .venv/bin/python tools/train_mtp.py all          # OpenBLAS on 1 thread: faster here than 2
    .venv/bin/python tools/train_mtp.py measure
    .venv/bin/python tools/train_mtp.py d2t --corpus /tmp/mtp_corpus.npz     # d2t into the bundled head

  On a GPU machine (torch with CUDA beside metrale and numba-cuda):
    python tools/train_mtp.py gpu --model /tmp/mdl/smollm2.gguf --out /tmp/mtp_head.safetensors
    python tools/train_mtp.py collect-gpu --model /tmp/mdl/smollm2.gguf --corpus /tmp/mtp_corpus.npz
    python tools/train_mtp.py train --device cuda --corpus /tmp/mtp_corpus.npz --out /tmp/mtp_head.safetensors
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator, NamedTuple

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
HEAD_OUT = ROOT / "metrale" / "assets" / "mtp" / "smollm2-135m-instruct.safetensors"
CORPUS = Path("/tmp/mtp_corpus.npz")
TOPK = 32
TRAIN_LOG = "/tmp/mtp_train_log.json"
DRAFT_VOCAB = 8192       # EAGLE-3's draft vocabulary size

TOPICS = ["the ocean", "volcanoes", "the moon", "honey bees", "the Roman Empire", "photosynthesis", "chess",
          "the internet", "coffee", "bicycles", "rain forests", "the human heart", "electricity", "trains",
          "ancient Egypt", "black holes", "gardening", "the piano", "mountains", "dinosaurs", "vaccines",
          "the French Revolution", "recycling", "deserts", "airplanes", "friendship", "the printing press",
          "glaciers", "cats", "dogs", "the stock market", "earthquakes", "bread baking", "the solar system",
          "democracy", "snow", "libraries", "robots", "the immune system", "music theory", "rivers",
          "the Olympic Games", "electric cars", "sleep", "climate change", "mathematics", "birds",
          "the Great Wall of China", "computers", "soccer"]
TEMPLATES = [  # (text, chat)
    ("Write a short paragraph about {t}.", True), ("Explain {t} to a ten-year-old.", True),
    ("Give me three interesting facts about {t}.", True), ("What is the most important thing to know about {t}?", True),
    ("Write a haiku about {t}.", True), ("Summarize the history of {t} in a few sentences.", True),
    ("Here is a short essay about {t}.\n\n", False), ("The most surprising thing about {t} is", False),
    ("Q: Why does {t} matter?\nA:", False), ("Chapter 1\n\nThe story of {t} begins", False),
]
CODE = ["def fibonacci(n):\n", "def is_prime(n):\n    \"\"\"Return True if n is prime.\"\"\"\n",
        "# Python: read a CSV file and print the average of a column\nimport csv\n",
        "def reverse_string(s):\n", "class Stack:\n    def __init__(self):\n",
        "def binary_search(items, target):\n", "// JavaScript: debounce a function\nfunction debounce(fn, ms) {\n",
        "SELECT name, COUNT(*) FROM orders\n", "def merge_sort(xs):\n", "def count_words(text):\n"]
EVAL_PROMPTS = [  # held out: none of the templates above
    ("How do tides work?", True), ("Write a limerick about a lazy cat.", True),
    ("List the planets of the solar system in order.", True),
    ("What are the health benefits of walking every day?", True),
    ("def factorial(n):\n", False), ("The city of Paris is famous for", False),
    ("1, 2, 3, 4, 5,", False), ("Once upon a time, in a small village,", False),
]


def training_prompts(n: int, seed: int = 0) -> list[tuple[str, bool]]:
    prompts = [(tpl.format(t=t), chat) for t in TOPICS for tpl, chat in TEMPLATES] + [(c, False) for c in CODE]
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(prompts))
    return [prompts[i] for i in order[:n]]


NUM_PROMPTS = len(TOPICS) * len(TEMPLATES) + len(CODE)   # every training prompt (collect-gpu's default)
LAST_LAYER = ("attn_norm", "qkv", "o", "mlp_norm", "gate_up", "down")   # the head's block starts as these


# ---------------------------------------------------------------------------- collect
def corpus_config(cfg, **figures) -> str:
    """The target's shape for train, and how the corpus was made."""
    return json.dumps({"hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size, "num_heads": cfg.num_heads,
                       "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps,
                       "rope_theta": cfg.rope_theta, "rope_interleaved": cfg.rope_interleaved, "name": cfg.name,
                       **figures})


def collect(args) -> None:
    sys.path.insert(0, str(ROOT))
    from metrale import Engine
    from metrale.runtime.batch import Segment, build_batch
    from metrale.runtime.numpy_backend import NumpyBackend

    t0 = time.time()
    eng = Engine(model="smollm2-135m", device="cpu")
    cfg = eng.model_config
    prompts = training_prompts(args.prompts)
    ids = [eng.encode_prompt(p, chat=chat) for p, chat in prompts]
    S, M, bs = len(ids), args.max_tokens, 16
    per_seq = -(-(max(map(len, ids)) + M + 1) // bs)
    be = NumpyBackend(cfg, eng.backend.weights.items(), num_blocks=S * per_seq, block_size=bs)
    tables = [np.arange(i * per_seq, (i + 1) * per_seq, dtype=np.int32) for i in range(S)]
    rng = np.random.default_rng(args.seed)
    eos = set(eng.eos_ids)
    hidden = [[] for _ in range(S)]
    top_i = [[] for _ in range(S)]
    top_v = [[] for _ in range(S)]
    out = [[] for _ in range(S)]
    live = list(range(S))
    feed = {i: (ids[i], 0) for i in live}

    def step(rows_of: list[int], chunk: int = 32) -> None:
        for a in range(0, len(rows_of), chunk):
            part = rows_of[a:a + chunk]
            batch = build_batch([Segment(np.asarray(feed[i][0], np.int32), feed[i][1], tables[i]) for i in part], bs)
            logits, h = be.forward(batch, return_hidden=True)
            for r, i in enumerate(part):
                x = logits[r].astype(np.float64)
                k = np.argpartition(-x, TOPK)[:TOPK]
                k = k[np.argsort(-x[k])]
                hidden[i].append(h[r].astype(np.float16))
                top_i[i].append(k.astype(np.int32))
                top_v[i].append(x[k].astype(np.float32))
                z = x / args.temperature
                p = np.exp(z - z.max())
                out[i].append(int(rng.choice(p.size, p=p / p.sum())))

    step(live, chunk=8)                                   # prefill: the last prompt row of each sequence
    print(f"prefill of {S} prompts: {time.time() - t0:.0f} s", flush=True)
    for t in range(1, M):
        live = [i for i in live if out[i][-1] not in eos]
        if not live or time.time() - t0 > args.collect_minutes * 60:
            break
        feed = {i: ([out[i][-1]], len(ids[i]) + len(out[i]) - 1) for i in live}
        step(live, chunk=len(live))
        if t % 16 == 0:
            print(f"step {t}: {len(live)} live, {time.time() - t0:.0f} s", flush=True)
    keep = [i for i in range(S) if len(out[i]) >= 4]
    w = be.weights
    last = cfg.num_layers - 1
    np.savez(args.corpus,
             tokens=np.concatenate([np.asarray(out[i], np.int32) for i in keep]),
             lengths=np.array([len(out[i]) for i in keep], np.int32),
             prompt_lens=np.array([len(ids[i]) for i in keep], np.int32),
             prompt_tokens=np.concatenate([np.asarray(ids[i], np.int32) for i in keep]),
             hidden=np.concatenate([np.stack(hidden[i]) for i in keep]),
             top_i=np.concatenate([np.stack(top_i[i]) for i in keep]),
             top_v=np.concatenate([np.stack(top_v[i]) for i in keep]),
             embed=w["embed"], final_norm=w["final_norm"],
             **{f"last.{n}": w[f"layers.{last}.{n}"] for n in LAST_LAYER},
             config=corpus_config(cfg, collect_seconds=time.time() - t0, prompts=S,
                                  temperature=args.temperature, max_tokens=M))
    total = sum(len(out[i]) for i in keep)
    print(f"collected {total} rows from {len(keep)} sequences in {time.time() - t0:.0f} s -> {args.corpus}", flush=True)


# ---------------------------------------------------------------------------- collect-gpu
class Piece(NamedTuple):
    """A chunk [start, end) of one sequence's teacher-forced stream P + O[:-1], run as one segment."""
    seq: int
    start: int
    end: int
    mode: str        # "last": a prompt chunk (one row); "all": a chunk of O[:-1] (a row per token)
    keep: bool       # its rows are wanted: every "all" chunk, and the prompt chunk ending at P

    @property
    def rows(self) -> int:
        return 1 if self.mode == "last" else self.end - self.start


def stream_pieces(seq: int, plen: int, length: int, max_tokens: int, max_rows: int) -> list[Piece]:
    """The prompt in chunks of max_tokens (the last one's row sits at position P-1, the row that
    predicted O[0]), then O[:-1] in chunks that fit both a forward's tokens and its logits rows."""
    pieces = [Piece(seq, a, min(a + max_tokens, plen), "last", a + max_tokens >= plen)
              for a in range(0, plen, max_tokens)]
    step = min(max_tokens, max_rows)
    return pieces + [Piece(seq, a, min(a + step, length), "all", True) for a in range(plen, length, step)]


def pack(pieces: list[Piece], max_tokens: int, max_rows: int) -> Iterator[list[Piece]]:
    """Consecutive pieces, as many a forward as its token and row budgets take (one segment a row at least)."""
    batch: list[Piece] = []
    tokens = rows = 0
    for p in pieces:
        if batch and (tokens + p.end - p.start > max_tokens or rows + p.rows > max_rows):
            yield batch
            batch, tokens, rows = [], 0, 0
        batch.append(p)
        tokens, rows = tokens + p.end - p.start, rows + p.rows
    if batch:
        yield batch


def pool_groups(lengths: list[int], block_size: int, num_blocks: int) -> Iterator[list[int]]:
    """Consecutive sequences whose KV blocks fit the pool together."""
    group: list[int] = []
    used = 0
    for i, n in enumerate(lengths):
        need = -(-n // block_size)
        if need > num_blocks:
            raise ValueError(f"sequence {i}: {n} tokens do not fit the KV pool ({num_blocks} x {block_size})")
        if used + need > num_blocks:
            yield group
            group, used = [], 0
        group.append(i)
        used += need
    if group:
        yield group


def forced_hidden(backend, streams: list[np.ndarray], plens: list[int], *, max_tokens: int | None = None,
                  max_rows: int | None = None, num_blocks: int | None = None,
                  progress: Callable[[int, int], None] | None = None) -> list[np.ndarray]:
    """Per stream (P + O[:-1], int32) its hidden rows before the final norm at positions P-1 .. end-1,
    float16: row j predicted O[j]. Runs the backend directly over blocks 0.. of its KV pool (the
    engine must be idle: this overwrites whatever its blocks held, prefix-cached prompts too).
    A sequence's pieces run in order, one per round; each round packs many sequences a forward."""
    from metrale.runtime.batch import Segment, build_batch

    bs = backend.block_size
    max_tokens = max_tokens or backend.max_tokens or 2048
    max_rows = max_rows or backend.max_rows or 256
    rows: list[list[np.ndarray]] = [[] for _ in streams]
    done = 0
    for group in pool_groups([len(s) for s in streams], bs, num_blocks or backend.num_blocks):
        first = np.cumsum([0] + [-(-len(streams[i]) // bs) for i in group])
        tables = {i: np.arange(first[k], first[k + 1], dtype=np.int32) for k, i in enumerate(group)}
        plan = {i: stream_pieces(i, plens[i], len(streams[i]), max_tokens, max_rows) for i in group}
        for r in range(max(len(p) for p in plan.values())):
            for pieces in pack([plan[i][r] for i in group if r < len(plan[i])], max_tokens, max_rows):
                segs = [Segment(streams[p.seq][p.start:p.end], p.start, tables[p.seq], p.mode) for p in pieces]
                batch = build_batch(segs, bs)
                backend.forward_device(batch)       # the logits stay where they were computed
                h = backend.hidden_rows(len(batch.logits_indices)).astype(np.float16)
                at = np.cumsum([0] + [p.rows for p in pieces])
                for k, p in enumerate(pieces):
                    if p.keep:
                        rows[p.seq].append(h[at[k]:at[k + 1]])
        done += len(group)
        if progress is not None:
            progress(done, sum(len(streams[i]) - plens[i] + 1 for i in group))
    return [np.concatenate(r) for r in rows]


def collect_gpu(args, prompts: list[tuple[str, bool]] | None = None, engine=None) -> dict:
    """Sampled continuations of every prompt (--samples each) in one generate call, then their hidden
    rows teacher-forced through the engine's backend. Writes the corpus (no top-k: train derives it
    from the hidden rows); returns the collection figures. prompts / engine: tests pass their own."""
    sys.path.insert(0, str(ROOT))
    from metrale import Engine, SamplingParams

    t0 = time.time()
    eng = engine or Engine(model=args.model, device=args.device)
    cfg = eng.model_config
    prompts = training_prompts(args.prompts) if prompts is None else prompts
    ids = [np.asarray(eng.encode_prompt(p, chat=chat), np.int32) for p, chat in prompts]
    jobs = [i for _ in range(args.samples) for i in range(len(ids))]       # prompt of each request
    params = [SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, detokenize=False,
                             seed=args.seed * len(jobs) + k) for k in range(len(jobs))]
    t_load = time.time() - t0
    print(f"engine on {eng.backend.name} in {t_load:.0f} s; generating {len(jobs)} continuations "
          f"({len(ids)} prompts x {args.samples})", flush=True)
    outs = eng.generate([ids[i] for i in jobs], params, use_tqdm=False)
    keep = [k for k, o in enumerate(outs) if len(o.token_ids) >= 4]
    plens = [len(ids[jobs[k]]) for k in keep]
    out_ids = [np.asarray(outs[k].token_ids, np.int32) for k in keep]
    t_gen = time.time() - t0 - t_load
    print(f"generated {sum(map(len, out_ids))} tokens, {len(keep)} sequences kept, in {t_gen:.0f} s", flush=True)

    streams = [np.concatenate([ids[jobs[k]], o[:-1]]) for k, o in zip(keep, out_ids)]
    rows_done = 0

    def progress(seqs: int, rows: int) -> None:
        nonlocal rows_done
        rows_done += rows
        print(f"teacher-forced {seqs}/{len(streams)} sequences, {rows_done} rows, {time.time() - t0:.0f} s", flush=True)

    hidden = forced_hidden(eng.backend, streams, plens, progress=progress)
    t_forced = time.time() - t0 - t_load - t_gen
    last = f"layers.{cfg.num_layers - 1}."
    wanted = {"embed", "final_norm", *(last + n for n in LAST_LAYER)}
    w = {n: np.asarray(a, np.float32) for n, a in eng.backend.export_weights() if n in wanted}
    figures = {"collect_seconds": round(time.time() - t0, 1), "load_seconds": round(t_load, 1),
               "generate_seconds": round(t_gen, 1), "forced_seconds": round(t_forced, 1),
               "prompts": len(ids), "samples": args.samples, "sequences": len(keep),
               "rows": int(sum(map(len, hidden))), "temperature": args.temperature, "max_tokens": args.max_tokens,
               "device": eng.backend.name}
    np.savez(args.corpus,
             tokens=np.concatenate(out_ids), lengths=np.array([len(o) for o in out_ids], np.int32),
             prompt_lens=np.array(plens, np.int32), prompt_tokens=np.concatenate([ids[jobs[k]] for k in keep]),
             hidden=np.concatenate(hidden), embed=w["embed"], final_norm=w["final_norm"],
             **{f"last.{n}": w[last + n] for n in LAST_LAYER}, config=corpus_config(cfg, **figures))
    print(f"collected {figures['rows']} rows from {len(keep)} sequences in {time.time() - t0:.0f} s -> {args.corpus}",
          flush=True)
    return figures


# ---------------------------------------------------------------------------- draft vocabulary
def token_counts(corpus, vocab_size: int, top_i: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(counts, secondary) of each target id in a corpus (an .npz path or its loaded arrays). counts:
    its continuation tokens (what the head predicts), its prompt tokens if it kept them and, with
    the teacher's top-k ids (`top_i`, else the corpus's own if it has them), each row's top-1.
    secondary: how often an id is in a row's top-k, the order among ids of equal counts (the rarer
    ids a small corpus never sampled)."""
    z = np.load(corpus) if isinstance(corpus, (str, Path)) else corpus
    names = getattr(z, "files", z)

    def count(ids) -> np.ndarray:
        return np.bincount(np.asarray(ids).ravel(), minlength=vocab_size)[:vocab_size].astype(np.int64)

    counts = count(z["tokens"])
    if "prompt_tokens" in names:
        counts += count(z["prompt_tokens"])
    top_i = z["top_i"] if top_i is None and "top_i" in names else top_i
    secondary = np.zeros(vocab_size, np.int64)
    if top_i is not None:
        counts += count(top_i[:, 0])
        secondary = count(top_i)
    return counts, secondary


def draft_vocab(counts: np.ndarray, n: int, secondary: np.ndarray | None = None) -> np.ndarray:
    """EAGLE-3's d2t: the n most frequent ids by `counts`, ties by `secondary`, then the lower id
    (BPE ids come roughly in merge order), ascending, int32."""
    n = min(int(n), len(counts))
    secondary = np.zeros_like(counts) if secondary is None else secondary
    order = np.lexsort((np.arange(len(counts)), -np.asarray(secondary), -np.asarray(counts)))
    return np.sort(order[:n]).astype(np.int32)


def coverage(d2t: np.ndarray, tokens: np.ndarray) -> float:
    """The share of `tokens` inside the draft vocabulary."""
    tokens = np.asarray(tokens).ravel()
    return float(np.isin(tokens, d2t).mean()) if len(tokens) else 0.0


def corpus_draft_vocab(corpus, vocab_size: int, n: int, top_i: np.ndarray | None = None) -> tuple[np.ndarray, dict]:
    """(d2t, figures): the draft vocabulary of a corpus (token_counts) and its coverage of the
    corpus's continuation tokens."""
    z = np.load(corpus) if isinstance(corpus, (str, Path)) else corpus
    names = getattr(z, "files", z)
    counts, secondary = token_counts(z, vocab_size, top_i)
    d2t = draft_vocab(counts, n, secondary)
    figures = {"size": int(len(d2t)), "corpus_tokens": int(len(z["tokens"])), "seen": int((counts > 0).sum()),
               "prompts_counted": "prompt_tokens" in names, "top_k_counted": bool(secondary.any()),
               "coverage": round(coverage(d2t, z["tokens"]), 4)}
    return d2t, figures


def add_d2t(args) -> None:
    """Write the draft vocabulary of --corpus into the head file --head (to --out, else in place):
    every other tensor byte for byte, the metadata kept with `draft_vocab` added."""
    from safetensors.numpy import load_file, save_file
    from safetensors import safe_open

    head = Path(args.head or HEAD_OUT)
    out = Path(args.out or head)
    with safe_open(str(head), framework="numpy") as f:
        meta = dict(f.metadata() or {})
    tensors = load_file(str(head))
    vocab = int(meta.get("vocab_size") or json.loads(str(np.load(args.corpus)["config"]))["vocab_size"])
    tensors.pop("d2t", None)
    if args.draft_vocab:
        d2t, figures = corpus_draft_vocab(args.corpus, vocab, args.draft_vocab)
        tensors["d2t"] = d2t
        meta["draft_vocab"] = json.dumps({**figures, "corpus": Path(args.corpus).name})
        print(f"d2t: {len(d2t)} of {vocab} ids cover {100 * figures['coverage']:.1f}% of the corpus's "
              f"{figures['corpus_tokens']} continuation tokens", flush=True)
    else:
        meta.pop("draft_vocab", None)
        print("d2t removed", flush=True)
    before = {n: a.tobytes() for n, a in tensors.items() if n != "d2t"}
    mode = (out if out.exists() else head).stat().st_mode
    save_file(tensors, str(out), metadata=meta)
    out.chmod(mode & 0o777)
    after = load_file(str(out))
    assert all(after[n].tobytes() == b for n, b in before.items()), "a tensor changed"
    print(f"wrote {out} ({out.stat().st_size / 1e6:.2f} MB)", flush=True)


# ---------------------------------------------------------------------------- train (torch)
COLLECT_KEYS = ("collect_seconds", "prompts", "temperature", "max_tokens", "samples", "sequences", "rows",
                "load_seconds", "generate_seconds", "forced_seconds", "device")


def teacher_topk(hidden, final_norm, embed, eps: float, chunk: int = 4096):
    """The target's top-k logits (ids int64, values float32, descending) of each hidden row, computed
    where the rows are: rms_norm(hidden, final_norm) @ embed.T in float32, chunk rows at a time."""
    import torch
    ids, vals = [], []
    for a in range(0, hidden.shape[0], chunk):
        x = hidden[a:a + chunk].float()
        logits = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * final_norm) @ embed.T
        v, i = torch.topk(logits, TOPK, dim=-1, sorted=True)
        ids.append(i)
        vals.append(v)
    return torch.cat(ids).long(), torch.cat(vals).float()


def by_draft(ev: list[float]) -> dict:
    """[ce1, top1_1, ce2, top1_2] as {draft1: {ce, top1}, draft2: {ce, top1}}."""
    return {f"draft{d + 1}": {"ce": ev[2 * d], "top1": ev[2 * d + 1]} for d in range(2)}


def train(args) -> None:
    import torch
    import torch.nn.functional as F
    from safetensors.torch import save_file

    dev = torch.device(args.device)
    if dev.type == "cpu":
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t0 = time.time()
    z = np.load(args.corpus)
    cfg = json.loads(str(z["config"]))
    D, H, KV, hd, eps = cfg["hidden_size"], cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"], cfg["rms_norm_eps"]
    lengths, plens = z["lengths"], z["prompt_lens"]
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    tokens = torch.from_numpy(z["tokens"]).long().to(dev)
    hidden = torch.from_numpy(z["hidden"].astype(np.float32)).to(dev)
    embed = torch.from_numpy(z["embed"]).to(dev)            # frozen: input embedding and tied LM head
    final_norm = torch.from_numpy(z["final_norm"]).to(dev)
    if "top_i" in z.files:                                  # collect stored the teacher's top-k
        top_i, top_v = torch.from_numpy(z["top_i"]).long().to(dev), torch.from_numpy(z["top_v"]).to(dev)
    else:                                                   # collect-gpu: computed here from the hidden rows
        top_i, top_v = teacher_topk(hidden, final_norm, embed, eps)
        print(f"teacher top-{TOPK} of {len(top_i)} rows on {dev}: {time.time() - t0:.0f} s", flush=True)
    if len(lengths) <= max(8, len(lengths) // 10):
        raise SystemExit(f"{args.corpus}: {len(lengths)} sequences leave none to train on after the held-out set")
    # training logits over a shortlist: every token in any row's top-k (the eval uses the full vocabulary)
    shortlist = torch.unique(top_i)
    short_i = torch.searchsorted(shortlist, top_i)
    embed_short = embed[shortlist].to(torch.bfloat16)
    embed_bf16 = embed.to(torch.bfloat16)

    rms_h = float(hidden.pow(2).mean(-1).sqrt().median())
    eh = torch.zeros(D, 2 * D, device=dev)
    eh[:, D:] = torch.eye(D, device=dev)
    params = {"enorm": torch.ones(D, device=dev), "hnorm": torch.full((D,), rms_h, device=dev), "eh_proj": eh,
              **{n: torch.from_numpy(z[f"last.{n}"]).to(dev).clone() for n in LAST_LAYER}}
    params = {n: torch.nn.Parameter(p.float()) for n, p in params.items()}
    half = hd // 2
    inv_freq = 1.0 / (cfg["rope_theta"] ** (torch.arange(half, dtype=torch.float64, device=dev) * 2.0 / hd))

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    def rope(x, pos):                                       # x [B, T, heads, hd]; GGUF rows: adjacent pairs
        ang = pos.double()[..., None] * inv_freq
        c, s = ang.cos().float()[:, :, None, :], ang.sin().float()[:, :, None, :]
        if cfg["rope_interleaved"]:
            a, b = x[..., 0::2], x[..., 1::2]
            return torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(-2)
        a, b = x[..., :half], x[..., half:]
        return torch.cat([a * c - b * s, a * s + b * c], dim=-1)

    def qkv(x, pos):
        B, T, _ = x.shape
        y = rms(x, params["attn_norm"]) @ params["qkv"].T
        q = rope(y[..., :H * hd].reshape(B, T, H, hd), pos)
        k = rope(y[..., H * hd:(H + KV) * hd].reshape(B, T, KV, hd), pos)
        v = y[..., (H + KV) * hd:].reshape(B, T, KV, hd)
        return q, k.repeat_interleave(H // KV, dim=2), v.repeat_interleave(H // KV, dim=2)

    def finish(x, att):                                     # o projection + MLP, both residual
        x = x + att @ params["o"].T
        gu = rms(x, params["mlp_norm"]) @ params["gate_up"].T
        g, u = gu.chunk(2, dim=-1)
        return x + (F.silu(g) * u) @ params["down"].T

    def mtp_input(h, tok):
        e = rms(embed[tok], params["enorm"])
        return torch.cat([e, rms(h, params["hnorm"])], -1) @ params["eh_proj"].T

    def forward(h, x_next, x_next2, pos, valid):
        """Step 1 at rows r (input h_r, x_{r+1}); step 2 at rows r + 1 (input: step 1's output at r,
        x_{r+2}), attending to step 1's K/V at rows <= r and to itself. Returns both outputs."""
        B, T, _ = h.shape
        x1 = mtp_input(h, x_next)
        q1, k1, v1 = qkv(x1, pos)
        causal = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
        mask = causal[None, None] & valid[:, None, None, :]
        s1 = torch.einsum("bqhd,bkhd->bhqk", q1, k1) / hd ** 0.5
        a1 = torch.einsum("bhqk,bkhd->bqhd", s1.masked_fill(~mask, float("-inf")).softmax(-1), v1)
        o1 = finish(x1, a1.reshape(B, T, H * hd))
        # chained: row r+1 of step 2 reads o1[r]; shift by one (row 0 of step 2 is unused)
        x2 = mtp_input(torch.cat([o1[:, :1], o1[:, :-1]], 1), x_next2)
        q2, k2, v2 = qkv(x2, pos)                          # row r+1 sits at position pos[r+1]
        s_prev = torch.einsum("bqhd,bkhd->bhqk", q2, k1) / hd ** 0.5
        prev = torch.ones(T, T, dtype=torch.bool, device=dev).tril(-1)   # step-1 keys strictly before the query row
        s_prev = s_prev.masked_fill(~(prev[None, None] & valid[:, None, None, :]), float("-inf"))
        s_self = (q2 * k2).sum(-1).transpose(1, 2)[..., None] / hd ** 0.5    # [B, H, T, 1]
        p = torch.cat([s_prev, s_self], -1).softmax(-1)
        a2 = torch.einsum("bhqk,bkhd->bqhd", p[..., :T], v1) + p[..., T:].transpose(1, 2) * v2
        o2 = finish(x2, a2.reshape(B, T, H * hd))
        return o1, o2

    def soft_ce(o, ti, tv, m, head=None):
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            logits = rms(o, final_norm).to(torch.bfloat16) @ (embed_bf16 if head is None else head).T
        logp = logits.float().log_softmax(-1)
        tgt = tv.softmax(-1)
        ce = -(tgt * logp.gather(-1, ti)).sum(-1)
        agree = (logp.argmax(-1) == ti[..., 0]).float()
        return (ce * m).sum() / m.sum().clamp(min=1), (agree * m).sum() / m.sum().clamp(min=1)

    def make_batch(seq_ids, top_i=top_i):
        """The sequences padded to the longest: row t of a sequence of n rows is corpus row a + t
        (position P-1+t). Step 1 at rows 0..n-2 reads h and x_{p+1} (the token sampled from that row)
        and is trained to the target's top-k of row t + 1; step 2 at rows 1..n-2 has the same token
        and target. Index arrays are made on the host, then one gather a tensor on the device."""
        s = np.asarray(seq_ids)
        n, t = lengths[s].astype(np.int64), np.arange(int(lengths[s].max()) - 1)
        m1 = t[None, :] < (n - 1)[:, None]
        m2 = m1 & (t[None, :] >= 1)
        row = np.where(m1, offsets[s][:, None] + t[None, :], 0)    # padding reads row 0, masked below
        pos = (plens[s].astype(np.int64) - 1)[:, None] + t[None, :]
        row, m1, m2, pos = (torch.from_numpy(x).to(dev) for x in (row, m1, m2, pos))
        nxt = torch.where(m1, row + 1, 0)
        k1, k2 = m1[..., None], m2[..., None]
        h = torch.where(k1, hidden[row], 0.0)
        xn, xn2 = tokens[row] * m1, tokens[row] * m2
        t1 = (top_i[nxt] * k1, torch.where(k1, top_v[nxt], 0.0), m1.float())
        t2 = (top_i[nxt] * k2, torch.where(k2, top_v[nxt], 0.0), m2.float())
        return h, xn, xn2, pos, m1, t1, t2

    rng = np.random.default_rng(args.seed)
    order = rng.permutation(len(lengths))
    n_eval = max(8, len(order) // 10)
    eval_ids, train_ids = order[:n_eval].tolist(), order[n_eval:].tolist()

    def evaluate():
        with torch.no_grad():
            tot = np.zeros(4)
            for a in range(0, len(eval_ids), args.batch):
                h, xn, xn2, pos, valid, t1, t2 = make_batch(eval_ids[a:a + args.batch])
                o1, o2 = forward(h, xn, xn2, pos, valid)
                tot += [float(v) for v in (*soft_ce(o1, *t1), *soft_ce(o2, *t2))]
            return (tot / -(-len(eval_ids) // args.batch)).round(4).tolist()

    opt = torch.optim.AdamW(params.values(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.98))
    steps_per_epoch = -(-len(train_ids) // args.batch)
    # time per step over 3 measured steps sets the schedule's length; on a GPU the first steps
    # (kernel selection, allocator growth) are slower, so those are not measured
    warm = 0 if dev.type == "cpu" else 5
    curve, step, budget = [], 0, args.train_minutes * 60
    best = (-1.0, 0, None)
    log0 = {"eval_step0": evaluate()}
    print(f"eval before training [ce1, top1_1, ce2, top1_2]: {log0['eval_step0']}", flush=True)
    total_steps = None
    t_train = t_warm = time.time()
    while True:
        for a in range(0, len(train_ids), args.batch):
            if a == 0:
                rng.shuffle(train_ids)
            h, xn, xn2, pos, valid, t1, t2 = make_batch(train_ids[a:a + args.batch], short_i)
            frac = 0.0 if total_steps is None else step / total_steps
            lr = args.lr * min(1.0, (step + 1) / 10) * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * min(frac, 1.0))))
            for g in opt.param_groups:
                g["lr"] = lr
            o1, o2 = forward(h, xn, xn2, pos, valid)
            l1, acc1 = soft_ce(o1, *t1, head=embed_short)
            l2, acc2 = soft_ce(o2, *t2, head=embed_short)
            loss = l1 + args.chain_weight * l2
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params.values(), 1.0)
            opt.step()
            step += 1
            elapsed = time.time() - t_train
            if step == warm:
                t_warm = time.time()
            if total_steps is None and step == warm + 3:
                per_step = (elapsed - (t_warm - t_train)) / 3
                total_steps = max(4, int((budget - (t_warm - t_train)) / per_step * 0.92) + warm)
                print(f"{per_step:.{1 if per_step >= 0.1 else 3}f} s/step -> {total_steps} steps "
                      f"({total_steps / steps_per_epoch:.1f} epochs)", flush=True)
            curve.append({"step": step, "t": round(elapsed, 1), "lr": float(lr), "loss1": round(l1.item(), 4),
                          "top1_1": round(acc1.item(), 4), "loss2": round(l2.item(), 4), "top1_2": round(acc2.item(), 4)})
            if step % args.eval_every == 0:
                ev = evaluate()
                curve[-1]["eval"] = ev
                score = ev[1] + 0.5 * ev[3]
                if score > best[0]:                      # keep the best held-out checkpoint
                    best = (score, step, {n: p.detach().clone() for n, p in params.items()})
                print(json.dumps(curve[-1]), flush=True)
            if total_steps is not None and (step >= total_steps or elapsed > budget):
                break
        else:
            continue
        break
    final = evaluate()
    print(f"eval after {step} steps [ce1, top1_1, ce2, top1_2]: {final}", flush=True)
    if best[2] is not None and best[0] > final[1] + 0.5 * final[3]:
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(best[2][n])
        final = evaluate()
        print(f"kept the checkpoint of step {best[1]}: {final}", flush=True)
    meta = {"format": "metrale-mtp", "target": cfg["name"], "hidden_size": str(D), "vocab_size": str(cfg["vocab_size"]),
            "rope_interleaved": "true" if cfg["rope_interleaved"] else "false",
            "trained": json.dumps({"steps": step, "kept_step": best[1] if best[0] > -1 else step, "seconds": round(time.time() - t0), "eval": final,
                                   "rows": int(lengths.sum()), "sequences": len(lengths), "shortlist": len(shortlist)})}
    out = {n: p.detach().to(torch.float16).cpu().contiguous() for n, p in params.items()}
    if args.draft_vocab:
        d2t, vocab_figures = corpus_draft_vocab(z, cfg["vocab_size"], args.draft_vocab, top_i.cpu().numpy())
        out["d2t"] = torch.from_numpy(d2t)
        meta["draft_vocab"] = json.dumps({**vocab_figures, "corpus": Path(args.corpus).name})
        print(f"d2t: {len(d2t)} ids cover {100 * vocab_figures['coverage']:.1f}% of the corpus's continuation tokens",
              flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    save_file(out, str(args.out), metadata=meta)
    Path(args.log).parent.mkdir(parents=True, exist_ok=True)
    Path(args.log).write_text(json.dumps({"eval_before": log0["eval_step0"], "eval_after": final, "steps": step,
                                          "train_seconds": round(time.time() - t_train), "total_seconds": round(time.time() - t0),
                                          "collect": {k: cfg[k] for k in COLLECT_KEYS if k in cfg},
                                          "eval_by_draft": {"before": by_draft(log0["eval_step0"]), "after": by_draft(final)},
                                          "device": str(dev), "batch": args.batch, "rows": int(lengths.sum()),
                                          "sequences": len(lengths), "curve": curve,
                                          "draft_vocab": json.loads(meta.get("draft_vocab", "null"))}, indent=0))
    print(f"wrote {args.out} ({Path(args.out).stat().st_size / 1e6:.1f} MB) in {time.time() - t0:.0f} s", flush=True)


# ---------------------------------------------------------------------------- measure
def measure(args) -> None:
    methods = ("mtp",) if args.mtp_only else ("ngram", "mtp")
    measure_acceptance([(m, k) for m in methods for k in (1, 2, 3)], args.max_tokens, args.log, args.head,
                       draft_vocab=args.draft_vocab != 0)


def measure_acceptance(runs: list[tuple[str, int]], max_tokens: int, log: str, head: str | None = None,
                       draft_vocab: bool = True) -> None:
    """Greedy speculation with exactly k drafts a step for each (method, k) on EVAL_PROMPTS,
    against plain decoding: acceptance (overall and of each draft position: the share of verifies
    with that many drafts that accepted at least that many), tokens per verify and per target
    forward, equality. draft_vocab False: the MTP head without its d2t."""
    sys.path.insert(0, str(ROOT))
    from metrale import Engine, SamplingParams
    from metrale.runtime.numpy_backend import NumpyBackend
    from metrale.settings import compose, to_overrides

    base = Engine(model="smollm2-135m", device="cpu")
    prompts = [base.encode_prompt(p, chat=chat) for p, chat in EVAL_PROMPTS]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    be = base.backend

    def engine(spec: dict) -> Engine:
        """An engine on a NumPy twin of the target (plain decoding too: the default CPU backend's
        kernels round differently, and greedy equality is checked against the same arithmetic)."""
        cfg = compose(to_overrides({"device": "cpu", "spec": spec}))
        twin = NumpyBackend(be.config, be.weights.items(), num_blocks=be.num_blocks, block_size=be.block_size)
        return Engine(cfg=cfg, parts=(be.config, base.tokenizer, twin))

    plain = engine({"method": "none"}).generate([np.array(p) for p in prompts], params, use_tqdm=False)
    rows, vocab = [], None
    for method, k in runs:
        spec = {"method": method, "num_drafts": k, **({"mtp_head": head} if head and method == "mtp" else {}),
                **({"mtp_draft_vocab": draft_vocab} if method == "mtp" else {})}
        eng = engine(spec)
        gate = eng.speculator.gate
        gate.drafts_for = lambda request_id, left=None, k=k: k          # exactly k drafts every step,
        gate.verify_length = lambda request_id, confidences, batch=None: len(confidences)   # all verified
        verified: list[tuple[int, int]] = []                            # (proposed, accepted) of each verify

        def update(request_id, proposed, accepted, inner=gate.update):
            verified.append((proposed, accepted))
            return inner(request_id, proposed, accepted)
        gate.update = update
        if method == "mtp" and vocab is None:
            d2t = eng.speculator.drafter.head.d2t
            decoded_ids = np.concatenate([np.asarray(o.token_ids[1:]) for o in plain])
            vocab = {"size": None if d2t is None else len(d2t),
                     "coverage_of_plain_output": None if d2t is None else round(coverage(d2t, decoded_ids), 4)}
            print(json.dumps({"draft_vocab": vocab}), flush=True)
        t = time.time()
        outs = eng.generate([np.array(p) for p in prompts], params, use_tqdm=False)
        secs = time.time() - t
        same = all(np.array_equal(a.token_ids, b.token_ids) for a, b in zip(outs, plain))
        st = eng.speculator.stats()
        decoded = sum(len(o.token_ids) for o in outs) - len(outs)      # the first token comes from the prefill
        rows.append({"method": method, "k": k, "acceptance": round(st["acceptance_rate"], 3),
                     "tokens_per_verify": round(st["tokens_per_verify"], 2),
                     "by_position": [round(sum(a >= j for p, a in verified if p >= j) /
                                           max(1, sum(p >= j for p, _ in verified)), 3) for j in range(1, k + 1)],
                     "tokens_per_forward": round(decoded / (decoded - st["accepted"]), 2), "verifies": st["verifies"],
                     "proposed": st["proposed"], "same_as_plain": same, "seconds": round(secs, 1)})
        print(json.dumps(rows[-1]), flush=True)
    Path(log).write_text(json.dumps({"prompts": EVAL_PROMPTS, "max_tokens": max_tokens, "head": head,
                                     "draft_vocab": vocab if draft_vocab else "off", "rows": rows}, indent=1))


# ---------------------------------------------------------------------------- gpu
GPU_SLACK_MINUTES = 1.5   # torch start, the teacher's top-k, the evaluations and the save, beside training


def run_gpu(args) -> None:
    """collect-gpu, then train on the device, each a process of this interpreter: the engine (Numba
    CUDA) and torch each take the GPU, and the engine's KV pool is freed before training starts.
    Training gets what is left of --gpu-minutes unless --train-minutes is given."""
    t0 = time.time()
    log = args.log or str(Path(args.out).with_suffix(".log.json"))
    rest = sys.argv[2:]                                     # every option given, to both phases

    def phase(name: str, *extra: str) -> None:
        subprocess.run([sys.executable, str(Path(__file__).resolve()), name, *rest, *extra], check=True)

    phase("collect-gpu")
    minutes = args.train_minutes or max(1.0, args.gpu_minutes - (time.time() - t0) / 60 - GPU_SLACK_MINUTES)
    phase("train", "--device", args.device, "--log", log, "--train-minutes", f"{minutes:.2f}")
    print(f"gpu: {time.time() - t0:.0f} s; head {args.out}, log {log}", flush=True)


def resolve_defaults(args) -> None:
    """Defaults that depend on the phase or the training device (None: not given)."""
    gpu_collect = args.phase in ("collect-gpu", "gpu")
    args.device = args.device or ("cuda" if gpu_collect else "cpu")
    if args.prompts is None:
        args.prompts = NUM_PROMPTS if gpu_collect else 320
    if args.max_tokens is None:
        args.max_tokens = 256 if gpu_collect else 64 if args.phase == "measure" else 128
    on_cpu = args.device == "cpu"
    args.batch = args.batch or (16 if on_cpu else 64)
    args.eval_every = args.eval_every or (10 if on_cpu else 50)
    if args.train_minutes is None and args.phase != "gpu":      # gpu: what is left of --gpu-minutes
        args.train_minutes = 8.0
    if args.draft_vocab is None and args.phase != "measure":   # measure: the head file's, if it has one
        args.draft_vocab = DRAFT_VOCAB
    if args.out is None and args.phase != "d2t":               # d2t: in place, unless --out
        args.out = str(HEAD_OUT)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("phase", choices=["all", "collect", "train", "measure", "collect-gpu", "gpu", "d2t"])
    ap.add_argument("--corpus", default=str(CORPUS))
    ap.add_argument("--out", default=None, help="the head file written (default the bundled one; d2t: --head)")
    ap.add_argument("--log", default=None)
    ap.add_argument("--model", default="smollm2-135m", help="collect-gpu: a preset or a .gguf path")
    ap.add_argument("--device", default=None, help="collect-gpu: the engine's (default cuda); train: torch's (default cpu)")
    ap.add_argument("--prompts", type=int, default=None, help=f"default 320; collect-gpu: all {NUM_PROMPTS}")
    ap.add_argument("--samples", type=int, default=4, help="collect-gpu: continuations per prompt")
    ap.add_argument("--max-tokens", type=int, default=None, help="default 128; collect-gpu 256; measure 64")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--collect-minutes", type=float, default=14.0)
    ap.add_argument("--train-minutes", type=float, default=None, help="default 8; gpu: what --gpu-minutes leaves")
    ap.add_argument("--gpu-minutes", type=float, default=9.0, help="gpu: collection and training together")
    ap.add_argument("--eval-every", type=int, default=None, help="default 10 steps; 50 on a GPU")
    ap.add_argument("--batch", type=int, default=None, help="sequences a step: default 16; 64 on a GPU")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--chain-weight", type=float, default=0.5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--head", default=None, help="measure, d2t: this head file instead of the bundled one")
    ap.add_argument("--draft-vocab", type=int, default=None,
                    help=f"train, d2t: the draft vocabulary's size (default {DRAFT_VOCAB}; 0: none); "
                         "measure: 0 runs the head without its d2t")
    ap.add_argument("--mtp-only", action="store_true", help="measure: skip the n-gram rows")
    ap.add_argument("--train-python", default=str(ROOT / ".venv-train" / "bin" / "python"))
    args = ap.parse_args()
    resolve_defaults(args)
    if args.phase in ("all", "collect"):
        collect(args)
    if args.phase == "all":
        cmd = [args.train_python, __file__, "train"] + [a for a in sys.argv[2:]]
        subprocess.run(cmd, check=True)
    elif args.phase == "collect-gpu":
        collect_gpu(args)
    elif args.phase == "gpu":
        run_gpu(args)
    elif args.phase == "train":
        args.log = args.log or TRAIN_LOG
        train(args)
    elif args.phase == "measure":
        args.log = args.log or "/tmp/mtp_measure.json"
        measure(args)
    elif args.phase == "d2t":
        add_d2t(args)


if __name__ == "__main__":
    main()
