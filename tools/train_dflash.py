"""Self-distillation of a DFlash block drafter for SmolLM2-135M-Instruct (metrale/spec/dflash.py
describes the drafter).

Phases
  collect  (metrale's venv, NumPy backend, float32): the model continues a few hundred prompts (the
           MTP recipe's prompts, tools/train_mtp.py) GREEDILY, so every continuation token is the
           target's argmax given the tokens before it: exactly what greedy verification accepts. Every
           forward also captures the residual stream after the drafter's target layers for every
           token (metrale.spec.mtp.forward_with_layer_rows: the engine's own tap). Writes an .npz
           corpus with the target weights the drafter shares or starts from.
  train    (.venv-train: torch CPU): blocks [x_s, MASK x (B-1)] at random starts s in the continuation,
           context = the projected layer features of positions < s, cross-entropy of rows 1..B-1 on the
           target's greedy tokens x_{s+1..s+B-1} (weights decaying along the block: acceptance is a
           prefix). Several blocks per sequence share one forward (a mask: context before the block's
           start + the block itself). The layer starts as the target's last layer, fc as identity on
           the deepest tapped layer, hidden_norm as the last layer's attn_norm (so the context K/V
           start near the last layer's own K/V). Time-boxed; writes fp16 safetensors + a JSON log.
  measure  (metrale's venv): greedy acceptance of dflash next to mtp and n-gram on the MTP recipe's
           held-out prompts.
  all      collect, then train under .venv-train.

    .venv/bin/python tools/train_dflash.py all
    .venv/bin/python tools/train_dflash.py measure
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_mtp import measure_acceptance, training_prompts  # noqa: E402

OUT = ROOT / "metrale" / "assets" / "dflash" / "smollm2-135m-instruct.safetensors"
CORPUS = Path("/tmp/dflash_corpus.npz")
LAYER = ("attn_norm", "qkv", "o", "mlp_norm", "gate_up", "down")


# ---------------------------------------------------------------------------- collect
def collect(args) -> None:
    sys.path.insert(0, str(ROOT))
    from metrale import Engine
    from metrale.runtime.batch import Segment, build_batch
    from metrale.runtime.numpy_backend import NumpyBackend
    from metrale.spec.dflash import default_target_layers
    from metrale.spec.mtp import forward_with_layer_rows

    t0 = time.time()
    eng = Engine(model="smollm2-135m", device="cpu")
    cfg = eng.model_config
    layers = default_target_layers(cfg.num_layers)
    prompts = training_prompts(args.prompts, seed=args.seed)
    ids = [list(eng.encode_prompt(p, chat=chat)) for p, chat in prompts]
    S, M, bs = len(ids), args.max_tokens, 16
    per_seq = -(-(max(map(len, ids)) + M + 1) // bs)
    be = NumpyBackend(cfg, eng.backend.weights.items(), num_blocks=S * per_seq, block_size=bs)
    tables = [np.arange(i * per_seq, (i + 1) * per_seq, dtype=np.int32) for i in range(S)]
    eos = set(eng.eos_ids)
    toks = [list(p) for p in ids]
    feats: list[list[np.ndarray]] = [[] for _ in range(S)]
    live = list(range(S))

    def step(part: list[int], feed: dict) -> None:
        batch = build_batch([Segment(np.asarray(feed[i][0], np.int32), feed[i][1], tables[i]) for i in part], bs)
        (logits, _), rows = forward_with_layer_rows(be, batch, layers)
        f = np.stack(rows, axis=1).astype(np.float16)                      # [T, n layers, D]
        for r, i in enumerate(part):
            a, b = batch.seq_query_start[r], batch.seq_query_start[r + 1]
            feats[i].append(f[a:b])
            toks[i].append(int(np.argmax(logits[r])))

    for a in range(0, S, 8):                                               # prefill: every prompt position
        part = list(range(a, min(S, a + 8)))
        step(part, {i: (ids[i], 0) for i in part})
    print(f"prefill of {S} prompts: {time.time() - t0:.0f} s", flush=True)
    for t in range(1, M):
        live = [i for i in live if toks[i][-1] not in eos]
        if not live or time.time() - t0 > args.collect_minutes * 60:
            break
        step(live, {i: ([toks[i][-1]], len(toks[i]) - 1) for i in live})
        if t % 16 == 0:
            print(f"step {t}: {len(live)} live, {time.time() - t0:.0f} s", flush=True)
    # a sequence's last token has no features (never fed): drop it
    keep = [i for i in range(S) if len(toks[i]) - len(ids[i]) >= 6]
    seqs = [np.asarray(toks[i][:-1], np.int32) for i in keep]
    w = be.weights
    last = cfg.num_layers - 1
    np.savez(args.corpus,
             tokens=np.concatenate(seqs), lengths=np.array([len(s) for s in seqs], np.int32),
             prompt_lens=np.array([len(ids[i]) for i in keep], np.int32),
             feats=np.concatenate([np.concatenate(feats[i]) for i in keep]),
             embed=w["embed"], final_norm=w["final_norm"],
             **{f"last.{n}": w[f"layers.{last}.{n}"] for n in LAYER},
             config=json.dumps({"hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
                                "intermediate_size": cfg.intermediate_size,
                                "num_heads": cfg.num_heads, "num_kv_heads": cfg.num_kv_heads,
                                "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps,
                                "rope_theta": cfg.rope_theta, "rope_interleaved": cfg.rope_interleaved,
                                "target_layers": list(layers), "name": cfg.name,
                                "collect_seconds": time.time() - t0, "prompts": S, "max_tokens": M}))
    gen = sum(len(s) - int(len(ids[i])) for s, i in zip(seqs, keep))
    print(f"collected {len(keep)} sequences, {sum(map(len, seqs))} positions ({gen} generated) "
          f"in {time.time() - t0:.0f} s -> {args.corpus}", flush=True)


# ---------------------------------------------------------------------------- train (torch)
def train(args) -> None:
    import torch
    import torch.nn.functional as F
    from safetensors.torch import save_file

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t0 = time.time()
    z = np.load(args.corpus)
    cfg = json.loads(str(z["config"]))
    D, H, KV, hd, eps = cfg["hidden_size"], cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"], cfg["rms_norm_eps"]
    nL = len(cfg["target_layers"])
    B = args.block
    lengths, plens = z["lengths"], z["prompt_lens"]
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    tokens = torch.from_numpy(z["tokens"]).long()
    feats = torch.from_numpy(z["feats"].reshape(len(tokens), nL * D))          # fp16, widened per batch
    embed = torch.from_numpy(z["embed"])                                       # frozen: embedding and tied LM head
    final_norm = torch.from_numpy(z["final_norm"])
    shortlist = torch.unique(tokens)                                           # training logits over these
    short_of = torch.full((cfg["vocab_size"],), -1, dtype=torch.long)
    short_of[shortlist] = torch.arange(len(shortlist))
    embed_short = embed[shortlist].to(torch.bfloat16)
    embed_bf16 = embed.to(torch.bfloat16)

    fc = torch.zeros(D, nL * D)
    fc[:, (nL - 1) * D:] = torch.eye(D)                                        # the deepest tapped layer
    params = {"fc": fc, "hidden_norm": torch.from_numpy(z["last.attn_norm"]).clone(),
              "mask_embed": embed.mean(0).clone(),
              **{f"layers.0.{n}": torch.from_numpy(z[f"last.{n}"]).clone() for n in LAYER}}
    if args.init:                                      # start from (or, with --train-minutes 0, evaluate) a file
        from safetensors.torch import load_file
        params.update(load_file(args.init))
    params = {n: torch.nn.Parameter(p.float()) for n, p in params.items()}
    half = hd // 2
    inv_freq = 1.0 / (cfg["rope_theta"] ** (torch.arange(half, dtype=torch.float64) * 2.0 / hd))
    pos_w = torch.tensor([args.decay ** j for j in range(B - 1)])

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    def rope(x, pos):                                       # x [b, T, heads, hd], pos [b, T]
        ang = pos.double()[..., None] * inv_freq
        c, s = ang.cos().float()[:, :, None, :], ang.sin().float()[:, :, None, :]
        if cfg["rope_interleaved"]:
            a, b = x[..., 0::2], x[..., 1::2]
            return torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(-2)
        a, b = x[..., :half], x[..., half:]
        return torch.cat([a * c - b * s, a * s + b * c], dim=-1)

    def forward(f, ctx_pos, ctx_valid, blk_tok, blk_pos, starts):
        """f [b, T, nL*D] features; blocks [b, N, B] (token of row 0, positions, start s);
        returns the hidden rows [b, N, B, D] after the drafter layer."""
        b, N = blk_tok.shape[:2]
        T = f.shape[1]
        c = rms(f @ params["fc"].T, params["hidden_norm"])
        x = embed[blk_tok]                                                       # [b, N, B, D]
        x = torch.cat([x[:, :, :1], params["mask_embed"].expand(b, N, B - 1, D)], 2).reshape(b, N * B, D)
        p = "layers.0."
        W = params[p + "qkv"]
        y = rms(x, params[p + "attn_norm"]) @ W.T
        q = rope(y[..., :H * hd].reshape(b, N * B, H, hd), blk_pos.reshape(b, N * B))
        kb = rope(y[..., H * hd:(H + KV) * hd].reshape(b, N * B, KV, hd), blk_pos.reshape(b, N * B))
        vb = y[..., (H + KV) * hd:].reshape(b, N * B, KV, hd)
        kvc = c @ W[H * hd:].T
        kc = rope(kvc[..., :KV * hd].reshape(b, T, KV, hd), ctx_pos)
        vc = kvc[..., KV * hd:].reshape(b, T, KV, hd)
        k = torch.cat([kc, kb], 1).repeat_interleave(H // KV, dim=2)
        v = torch.cat([vc, vb], 1).repeat_interleave(H // KV, dim=2)
        # row (n, j) sees context positions < starts[n] and its own block
        m_ctx = (ctx_pos[:, None, :] < starts.repeat_interleave(B, 1)[:, :, None]) & ctx_valid[:, None, :]
        blk_id = torch.arange(N).repeat_interleave(B)
        m_blk = (blk_id[:, None] == blk_id[None, :]).expand(b, N * B, N * B)
        mask = torch.cat([m_ctx, m_blk], -1)[:, None]                            # [b, 1, NB, T + NB]
        s = torch.einsum("bqhd,bkhd->bhqk", q, k) / hd ** 0.5
        att = torch.einsum("bhqk,bkhd->bqhd", s.masked_fill(~mask, float("-inf")).softmax(-1), v)
        x = x + att.reshape(b, N * B, H * hd) @ params[p + "o"].T
        g, u = (rms(x, params[p + "mlp_norm"]) @ params[p + "gate_up"].T).chunk(2, dim=-1)
        x = x + (F.silu(g) * u) @ params[p + "down"].T
        return x.reshape(b, N, B, D)

    def make_batch(seq_ids, rng, n_blocks):
        T = int(max(lengths[s] for s in seq_ids))
        b = len(seq_ids)
        f = torch.zeros(b, T, nL * D)
        ctx_pos = torch.arange(T).expand(b, T).clone()
        valid = torch.zeros(b, T, dtype=torch.bool)
        blk_tok = torch.zeros(b, n_blocks, B, dtype=torch.long)
        starts = torch.zeros(b, n_blocks, dtype=torch.long)
        labels = torch.zeros(b, n_blocks, B - 1, dtype=torch.long)
        lmask = torch.zeros(b, n_blocks, B - 1)
        for r, s in enumerate(seq_ids):
            a, n, P = int(offsets[s]), int(lengths[s]), int(plens[s])
            f[r, :n] = feats[a:a + n].float()
            valid[r, :n] = True
            lo, hi = P - 1, n - 2                      # block starts: x_{s+1} generated, at least one label
            st = rng.integers(lo, hi + 1, n_blocks) if rng is not None else \
                np.linspace(lo, hi, n_blocks).round().astype(int)
            for j, s0 in enumerate(st):
                s0 = int(s0)
                blk_tok[r, j, 0] = tokens[a + s0]
                starts[r, j] = s0
                m = min(B - 1, n - 1 - s0)
                labels[r, j, :m] = tokens[a + s0 + 1:a + s0 + 1 + m]
                lmask[r, j, :m] = 1.0
        blk_pos = starts[..., None] + torch.arange(B)
        return (f, ctx_pos, valid, blk_tok, blk_pos, starts), labels, lmask

    def loss_of(out, labels, lmask, short=True):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = rms(out[:, :, 1:], final_norm).to(torch.bfloat16)
            logits = h @ (embed_short if short else embed_bf16).T
        logp = logits.float().log_softmax(-1)
        tgt = short_of[labels].clamp(min=0) if short else labels      # padded labels: masked out
        ce = -logp.gather(-1, tgt[..., None])[..., 0]
        hit = (logp.argmax(-1) == tgt).float() * lmask
        w = lmask * pos_w
        return (ce * w).sum() / w.sum().clamp(min=1), hit

    rng = np.random.default_rng(args.seed)
    order = rng.permutation(len(lengths))
    n_eval = min(max(8, len(order) // 10), len(order) // 2)
    eval_ids, train_ids = order[:n_eval].tolist(), order[n_eval:].tolist()

    def evaluate():
        """Full vocabulary on held-out sequences: CE, top-1 per block position, and the mean
        accepted length (leading correct drafts) of a block."""
        with torch.no_grad():
            ce, hits, acc_len, nblk, npos = 0.0, torch.zeros(B - 1), 0.0, 0, torch.zeros(B - 1)
            for a in range(0, len(eval_ids), args.batch):
                inp, labels, lmask = make_batch(eval_ids[a:a + args.batch], None, args.eval_blocks)
                l, hit = loss_of(forward(*inp), labels, lmask, short=False)
                ce += float(l)
                hits += hit.sum((0, 1))
                npos += lmask.sum((0, 1))
                full = lmask[..., -1] > 0                      # blocks with every label present
                acc_len += float(hit.cumprod(-1).sum(-1)[full].sum())
                nblk += int(full.sum())
            top1 = (hits / npos.clamp(min=1)).tolist()
            return {"ce": round(ce / -(-len(eval_ids) // args.batch), 4), "top1": [round(x, 4) for x in top1],
                    "accepted_per_block": round(acc_len / max(nblk, 1), 4)}

    if args.train_minutes <= 0:
        print(json.dumps({"eval_ids": eval_ids, "eval": evaluate()}), flush=True)
        return
    opt = torch.optim.AdamW(params.values(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.98))
    curve, step, budget = [], 0, args.train_minutes * 60
    best = (-1.0, 0, None)
    ev0 = evaluate()
    print(f"eval before training: {ev0}", flush=True)
    total_steps = None
    t_train = time.time()
    while True:
        rng.shuffle(train_ids)
        for a in range(0, max(1, len(train_ids) - args.batch + 1), args.batch):
            inp, labels, lmask = make_batch(train_ids[a:a + args.batch], rng, args.blocks)
            frac = 0.0 if total_steps is None else step / total_steps
            lr = args.lr * min(1.0, (step + 1) / 10) * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * min(frac, 1.0))))
            for g in opt.param_groups:
                g["lr"] = lr
            loss, hit = loss_of(forward(*inp), labels, lmask)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params.values(), 1.0)
            opt.step()
            step += 1
            elapsed = time.time() - t_train
            if total_steps is None and step == 3:
                total_steps = max(4, int(budget / (elapsed / 3) * 0.9))
                print(f"{elapsed / 3:.2f} s/step -> {total_steps} steps", flush=True)
            top1 = (hit.sum((0, 1)) / lmask.sum((0, 1)).clamp(min=1)).tolist()
            curve.append({"step": step, "t": round(elapsed, 1), "lr": float(lr), "loss": round(loss.item(), 4),
                          "top1": [round(x, 3) for x in top1]})
            if step % args.eval_every == 0:
                ev = evaluate()
                curve[-1]["eval"] = ev
                if ev["accepted_per_block"] > best[0]:
                    best = (ev["accepted_per_block"], step, {n: p.detach().clone() for n, p in params.items()})
                print(json.dumps(curve[-1]), flush=True)
            if total_steps is not None and (step >= total_steps or elapsed > budget):
                break
        else:
            continue
        break
    final = evaluate()
    print(f"eval after {step} steps: {final}", flush=True)
    kept = step
    if best[2] is not None and best[0] > final["accepted_per_block"]:
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(best[2][n])
        final, kept = evaluate(), best[1]
        print(f"kept the checkpoint of step {kept}: {final}", flush=True)
    meta = {"format": "metrale-dflash", "target": cfg["name"], "hidden_size": str(D), "vocab_size": str(cfg["vocab_size"]),
            "intermediate_size": str(cfg["intermediate_size"]), "num_layers": "1", "block_size": str(B),
            "target_layers": json.dumps(cfg["target_layers"]),
            "rope_interleaved": "true" if cfg["rope_interleaved"] else "false",
            "trained": json.dumps({"steps": step, "kept_step": kept, "seconds": round(time.time() - t0), "eval": final,
                                   "positions": int(lengths.sum()), "sequences": len(lengths),
                                   "shortlist": len(shortlist)})}
    out = {n: p.detach().to(torch.float16).contiguous() for n, p in params.items()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    save_file(out, str(args.out), metadata=meta)
    gen = int(sum(lengths[i] - plens[i] for i in range(len(lengths))))
    Path(args.log).write_text(json.dumps({"eval_before": ev0, "eval_after": final, "steps": step, "kept_step": kept,
                                          "train_seconds": round(time.time() - t_train), "total_seconds": round(time.time() - t0),
                                          "data": {"sequences": len(lengths), "positions": int(lengths.sum()), "generated": gen,
                                                   "collect_seconds": round(cfg["collect_seconds"]), "prompts": cfg["prompts"],
                                                   "max_tokens": cfg["max_tokens"], "shortlist": len(shortlist)},
                                          "curve": curve}, indent=0))
    print(f"wrote {args.out} ({Path(args.out).stat().st_size / 1e6:.1f} MB) in {time.time() - t0:.0f} s", flush=True)


# ---------------------------------------------------------------------------- measure
def measure(args) -> None:
    measure_acceptance([("ngram", 3), ("mtp", 1), ("mtp", 3), ("dflash", 3), ("dflash", 4)], args.max_tokens, args.log)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("phase", choices=["all", "collect", "train", "measure"])
    ap.add_argument("--corpus", default=str(CORPUS))
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--log", default=None)
    ap.add_argument("--prompts", type=int, default=320)
    ap.add_argument("--max-tokens", type=int, default=112)
    ap.add_argument("--collect-minutes", type=float, default=9.0)
    ap.add_argument("--train-minutes", type=float, default=12.0)
    ap.add_argument("--block", type=int, default=5, help="block size B: last token + B-1 drafts")
    ap.add_argument("--blocks", type=int, default=12, help="training blocks per sequence per step")
    ap.add_argument("--eval-blocks", type=int, default=16)
    ap.add_argument("--decay", type=float, default=0.8, help="loss weight of block row j+1 relative to row j")
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--init", default=None, help="train: start from this drafter file")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train-python", default=str(ROOT / ".venv-train" / "bin" / "python"))
    args = ap.parse_args()
    if args.phase in ("all", "collect"):
        collect(args)
    if args.phase == "all":
        subprocess.run([args.train_python, __file__, "train"] + sys.argv[2:], check=True)
    elif args.phase == "train":
        args.log = args.log or "/tmp/dflash_train_log.json"
        train(args)
    elif args.phase == "measure":
        args.log = args.log or "/tmp/dflash_measure.json"
        args.max_tokens = 64 if args.max_tokens == 112 else args.max_tokens
        measure(args)


if __name__ == "__main__":
    main()
