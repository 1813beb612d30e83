"""Tokenizer: text <-> token ids, chat templates and streaming detokenization.

One `Tokenizer` class wraps a Hugging Face `tokenizers.Tokenizer` (Rust, fast); it is built either
from a GGUF file's metadata (`from_gguf`, `from_gguf_path`) or from a Hugging Face model directory
(`from_pretrained_dir`). Byte-level BPE (GGUF `tokenizer.ggml.model == "gpt2"`) and SentencePiece BPE
("llama": Gemma, Llama-2 style) vocabularies are built from GGUF; unigram ("t5") and others raise `ValueError`.

The pre-tokenizer for a GGUF follows llama.cpp's `tokenizer.ggml.pre` table (llama-vocab.cpp), which
is what the model's own `tokenizer.json` does. For "smollm" (and starcoder, refact, command-r,
codeshell, exaone, minerva) that is "split every digit, then the GPT-2 regex", i.e.
`Sequence[Digits(individual_digits=True), ByteLevel(add_prefix_space=False, use_regex=True)]`.
Note: transformers' own GGUF conversion (5.x) leaves "smollm" on the plain GPT-2 ByteLevel regex; the two
only differ on runs of 2+ spaces followed by a digit ("a  1"), where we match llama.cpp and SmolLM2's
tokenizer.json.

Chat templates are rendered like transformers does: a sandboxed jinja2 environment with
trim_blocks/lstrip_blocks, loopcontrols, a `{% generation %}` block (rendered as its body),
`raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII characters, and `bos_token`/`eos_token`
(plus any extra keyword arguments) as variables.

`IncrementalDecoder` turns a stream of token ids into a stream of text pieces without ever emitting half
of a multi-byte UTF-8 character (the vLLM detokenizer_utils algorithm: decode a short window of tokens
before and after the read offset; emit only the difference, and only when it does not end in U+FFFD).
"""
from __future__ import annotations

import functools
import json
import os
import warnings
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers.decoders import DecodeStream

__all__ = ["Tokenizer", "IncrementalDecoder", "read_gguf_fields", "bytes_to_unicode"]

# GGUF token types (llama.cpp's llama_token_type / gguf.TokenType)
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_UNUSED = 5
TOKEN_TYPE_BYTE = 6

# Token texts that llama.cpp treats as end-of-generation when present (llama-vocab.cpp, "special_eog_ids").
EOG_TOKEN_TEXTS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>",  # DeepSeek
)

# ---------------------------------------------------------------------------------------------
# Pre-tokenizers for byte-level BPE, keyed by GGUF `tokenizer.ggml.pre` (llama.cpp names)
# ---------------------------------------------------------------------------------------------

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_GPT2_PRE = frozenset({"default", "gpt2", "gpt-2", "mpt", "olmo", "jais", "trillion"})
_DIGITS_THEN_GPT2_PRE = frozenset(
    {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva", "minerva-7b"}
)
_SPLIT_PRE = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "dbrx", "smaug-bpe"),
        _LLAMA3_SPLIT,
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "megrez"), _QWEN2_SPLIT),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "minimax-m2"), _GPT4O_SPLIT),
}
# llama.cpp uses the whole pre-token directly when it is in the vocabulary for these (ignore_merges)
_IGNORE_MERGES_PRE = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "llama4"})


def _byte_level_pre_tokenizer(pre: str | None):
    """The HF pre-tokenizer equivalent to llama.cpp's regex list for `tokenizer.ggml.pre`."""
    key = (pre or "default").lower()
    if key in _DIGITS_THEN_GPT2_PRE:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if key in _SPLIT_PRE:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLIT_PRE[key]), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if key not in _GPT2_PRE:
        warnings.warn(
            f"GGUF tokenizer.ggml.pre={pre!r} is not known to metrale; falling back to the GPT-2 "
            "pre-tokenizer regex (token ids may differ from the reference tokenizer)",
            stacklevel=3,
        )
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


@functools.lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character map used by byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1))
    bs += list(range(ord("\xae"), ord("\xff") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


# ---------------------------------------------------------------------------------------------
# GGUF metadata
# ---------------------------------------------------------------------------------------------


def read_gguf_fields(reader: Any, skip_header: bool = False) -> dict[str, Any]:
    """Every key/value of a `gguf.GGUFReader` as Python values (str, int, float, bool, list).

    Strings are decoded as UTF-8; arrays become lists. Uses `ReaderField.contents()` (gguf >= 0.10),
    with a fallback for older readers. `skip_header` drops the synthetic `GGUF.*` entries
    (version, tensor_count, kv_count).
    """
    out: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if skip_header and name.startswith("GGUF."):
            continue
        if hasattr(field, "contents"):
            out[name] = field.contents()
        else:  # pragma: no cover - gguf < 0.10
            out[name] = _field_contents_fallback(field)
    return out


def _field_contents_fallback(field: Any) -> Any:  # pragma: no cover - gguf < 0.10
    from gguf import GGUFValueType

    types = list(field.types)
    if not types:
        return None
    if types[0] == GGUFValueType.ARRAY:
        if types[-1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        return [v for i in field.data for v in field.parts[i].tolist()]
    if types[0] == GGUFValueType.STRING:
        return bytes(field.parts[-1]).decode("utf-8")
    return field.parts[-1].tolist()[0]


# ---------------------------------------------------------------------------------------------
# Chat templates
# ---------------------------------------------------------------------------------------------


def _raise_exception(message: str):
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' override: jinja's built-in tojson escapes HTML characters and non-ASCII
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=32)
def _compile_chat_template(template: str):
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _GenerationBlock(Extension):
        """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker): renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def _select_chat_template(template: Any, tools: Any = None) -> str | None:
    """A tokenizer_config may hold one template or a list of named ones ({"name", "template"})."""
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, Mapping):
        named = dict(template)
    else:
        named = {t["name"]: t["template"] for t in template}
    if tools is not None and "tool_use" in named:
        return named["tool_use"]
    if "default" in named:
        return named["default"]
    return next(iter(named.values()), None)


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------


def _token_content(tok: Any) -> str | None:
    """tokenizer_config.json spells special tokens as a string or as an AddedToken dict."""
    if tok is None:
        return None
    if isinstance(tok, Mapping):
        return tok.get("content")
    return str(tok)


class Tokenizer:
    """Text <-> ids for one model; see the module docstring.

    Attributes: `vocab_size`, `bos_token`/`bos_token_id` (may be None), `eos_token`/`eos_token_id`,
    `eos_token_ids` (every id that ends generation: EOS first, then EOT/EOM and the end-of-turn tokens
    llama.cpp recognises, e.g. `<|im_end|>`, `<|endoftext|>`), `pad_token_id`, `chat_template`,
    `chat_stop_strings` (text that ends a chat reply: the transcript template of a pretrained model).
    """

    def __init__(
        self,
        hf_tokenizer: _HFTokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        extra_eos_token_ids: Iterable[int] = (),
        chat_template: Any = None,
        add_bos_token: bool = False,
        add_eos_token: bool = False,
        chat_stop_strings: Sequence[str] = (),
    ):
        self._tk = hf_tokenizer
        # text that ends a chat reply when no token does (a pretrained model's transcript template)
        self.chat_stop_strings: tuple[str, ...] = tuple(chat_stop_strings)
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.pad_token = pad_token
        self.bos_token_id = self._tk.token_to_id(bos_token) if bos_token is not None else None
        self.eos_token_id = self._tk.token_to_id(eos_token) if eos_token is not None else None
        self.pad_token_id = self._tk.token_to_id(pad_token) if pad_token is not None else None
        self.chat_template = chat_template
        self.add_bos_token = add_bos_token
        self.add_eos_token = add_eos_token

        eos: list[int] = []
        if self.eos_token_id is not None:
            eos.append(self.eos_token_id)
        eos.extend(int(i) for i in extra_eos_token_ids)
        special = self.special_token_ids
        for text in EOG_TOKEN_TEXTS:
            tid = self._tk.token_to_id(text)
            if tid is not None and tid in special:
                eos.append(tid)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos))

    # -- properties ---------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (model vocab plus added tokens)."""
        return self._tk.get_vocab_size(with_added_tokens=True)

    @property
    def backend(self) -> _HFTokenizer:
        """The wrapped `tokenizers.Tokenizer`."""
        return self._tk

    @functools.cached_property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of the added tokens marked special (skipped by `decode(skip_special_tokens=True)`)."""
        return frozenset(i for i, t in self._tk.get_added_tokens_decoder().items() if t.special)

    # -- encode / decode ----------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. Special tokens written in the text (`<|im_start|>`) map to their single id.

        `add_special_tokens` adds what the model's post-processor adds (BOS for Llama-style vocabularies,
        nothing for SmolLM2).
        """
        return self._tk.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_as_data(self, text: str) -> list[int]:
        """Token ids of `text` with special-token text (`<|im_start|>`) encoded as the plain characters
        it is made of, never as the control token: what a chat message's content must become."""
        return self._data_tokenizer.encode(text, add_special_tokens=False).ids

    @functools.cached_property
    def _data_tokenizer(self) -> _HFTokenizer:
        copy = _HFTokenizer.from_str(self._tk.to_str())
        copy.encode_special_tokens = True
        return copy

    @functools.cached_property
    def special_token_texts(self) -> tuple[str, ...]:
        """The text of every special token (what must not pass from content into a prompt as control)."""
        return tuple(t for t in (self._tk.id_to_token(i) for i in sorted(self.special_token_ids)) if t)

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]:
        return [e.ids for e in self._tk.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        if not isinstance(ids, list):
            ids = [int(i) for i in ids]
        return self._tk.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tk.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tk.id_to_token(int(token_id))

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str | None]:
        return [self._tk.id_to_token(int(i)) for i in ids]

    def incremental_decoder(self, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True):
        table = self.token_bytes(skip_special_tokens)
        if table is not None:
            return ByteLevelDecoder(self, prompt_ids, skip_special_tokens, table)
        return StreamDecoder(self, prompt_ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, skip_special_tokens: bool = True) -> list[bytes] | None:
        """Each id's bytes when the decoder is GPT-2's ByteLevel alone (decoding a sequence is then
        its tokens' bytes joined, read as UTF-8 with U+FFFD for what is not): added tokens are
        their text (special ones nothing when skipped). None for any other decoder."""
        tables = self._token_bytes
        if tables is None:
            return None
        return tables[bool(skip_special_tokens)]

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("_token_bytes", None)   # large: rebuilt where it is used, not sent along
        return state

    @functools.cached_property
    def _token_bytes(self) -> tuple[list[bytes], list[bytes]] | None:
        if type(self._tk.decoder) is not decoders.ByteLevel:
            return None
        to_byte = {c: b for b, c in _gpt2_byte_chars().items()}
        n = self._tk.get_vocab_size(with_added_tokens=True)
        kept = [b""] * n
        for token, tid in self._tk.get_vocab(with_added_tokens=False).items():
            if tid < n:
                try:
                    kept[tid] = bytes(to_byte[c] for c in token)
                except KeyError:          # not a byte-level vocabulary after all
                    return None
        skipped = list(kept)
        for tid, added in self._tk.get_added_tokens_decoder().items():
            if tid < n:
                kept[tid] = added.content.encode()
                skipped[tid] = b"" if added.special else kept[tid]
        return kept, skipped

    # -- chat ---------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        *,
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """Render `messages` with the model's Jinja chat template (as transformers does, tokenize=False).

        Extra keyword arguments become template variables (e.g. `enable_thinking=False`).
        """
        template = _select_chat_template(chat_template or self.chat_template, tools)
        if template is None:
            raise ValueError("this tokenizer has no chat template; pass chat_template=...")
        variables: dict[str, Any] = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            "pad_token": self.pad_token or "",
        }
        variables.update(kwargs)
        return _compile_chat_template(template).render(
            messages=messages,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )

    # -- constructors -------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, fields: Mapping[str, Any]) -> Tokenizer:
        """Build from GGUF metadata (`read_gguf_fields(reader)` or any dict with the same keys)."""
        model = fields.get("tokenizer.ggml.model")
        if model is None:
            raise ValueError("GGUF metadata has no tokenizer (tokenizer.ggml.model is missing)")
        if model not in ("gpt2", "llama"):
            kinds = {
                "t5": "unigram ('t5')",
                "bert": "WordPiece ('bert')",
                "rwkv": "RWKV",
                "plamo2": "PLaMo-2",
            }
            kind = kinds.get(model, repr(model))
            raise ValueError(
                f"GGUF tokenizer.ggml.model={model!r}: {kind} vocabularies are not supported yet; "
                "only byte-level BPE ('gpt2') and SentencePiece BPE ('llama') GGUF tokenizers can be built. "
                "Load the model from a Hugging Face directory (tokenizer.json) instead."
            )

        tokens: list[str] = list(fields["tokenizer.ggml.tokens"])
        n = len(tokens)
        token_types: Sequence[int] = fields.get("tokenizer.ggml.token_type") or [TOKEN_TYPE_NORMAL] * n
        merges_raw: Sequence[str] = fields.get("tokenizer.ggml.merges") or []
        pre = fields.get("tokenizer.ggml.pre")

        def tok_id(key: str) -> int | None:
            v = fields.get(f"tokenizer.ggml.{key}")
            if v is None or not (0 <= int(v) < n):
                return None
            return int(v)

        bos_id, eos_id = tok_id("bos_token_id"), tok_id("eos_token_id")
        unk_id, pad_id = tok_id("unknown_token_id"), tok_id("padding_token_id")
        eot_id, eom_id = tok_id("eot_token_id"), tok_id("eom_token_id")

        # Normal tokens are spelled in GPT-2's byte alphabet; a stray one that is not gets respelled so
        # that BPE can reach it. Control / user-defined tokens keep their raw text: they are matched
        # whole in the input as added tokens.
        alphabet = set(bytes_to_unicode().values())
        b2u = bytes_to_unicode()
        vocab: dict[str, int] = {}
        special: list[AddedToken] = []
        user_defined: list[AddedToken] = []
        special_ids = {i for i in (bos_id, eos_id, unk_id, pad_id, eot_id, eom_id) if i is not None}
        for i, (tok, tt) in enumerate(zip(tokens, token_types)):
            if tt == TOKEN_TYPE_CONTROL or (i in special_ids and tt != TOKEN_TYPE_USER_DEFINED):
                vocab[tok] = i
                special.append(AddedToken(tok, special=True, normalized=False))
            elif tt == TOKEN_TYPE_USER_DEFINED:
                vocab[tok] = i
                user_defined.append(AddedToken(tok, special=False, normalized=False))
            else:
                if not set(tok) <= alphabet:
                    tok = "".join(b2u[b] for b in tok.encode("utf-8"))
                vocab[tok] = i
        if model == "llama":
            tk, special, user_defined = _spm_tokenizer(fields, tokens, token_types, special_ids)
        else:
            merges = []
            for m in merges_raw:
                a, sep, b = m.partition(" ")
                if not sep:
                    raise ValueError(f"malformed GGUF merge {m!r}")
                merges.append((a, b))

            key = (pre or "default").lower()
            bpe = models.BPE(
                vocab=vocab,
                merges=merges,
                fuse_unk=False,
                byte_fallback=False,
                ignore_merges=key in _IGNORE_MERGES_PRE,
            )
            tk = _HFTokenizer(bpe)
            tk.normalizer = None
            tk.pre_tokenizer = _byte_level_pre_tokenizer(pre)
            tk.decoder = decoders.ByteLevel()
        if special:
            tk.add_special_tokens(special)
        if user_defined:
            tk.add_tokens(user_defined)

        add_bos = bool(fields.get("tokenizer.ggml.add_bos_token", False)) and bos_id is not None
        add_eos = bool(fields.get("tokenizer.ggml.add_eos_token", False)) and eos_id is not None
        if add_bos or add_eos:
            single = ([f"{tokens[bos_id]}:0"] if add_bos else []) + ["$A:0"] + (
                [f"{tokens[eos_id]}:0"] if add_eos else []
            )
            pair = single + (["$B:1"] if not add_eos else ["$B:1", f"{tokens[eos_id]}:1"])
            sp = []
            if add_bos:
                sp.append((tokens[bos_id], bos_id))
            if add_eos and eos_id != bos_id:
                sp.append((tokens[eos_id], eos_id))
            tk.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=sp)
        elif model == "gpt2":
            tk.post_processor = processors.ByteLevel(trim_offsets=False)

        template = fields.get("tokenizer.chat_template")
        if template is None and model == "llama" and "<start_of_turn>" in vocab:
            # Gemma GGUFs often ship without their template: an instruction-tuned one gets Gemma's turns;
            # a pretrained one (no general.finetune) never saw them and answers a plain transcript
            tuned = any(k in str(fields.get("general.finetune", "")).lower() for k in ("it", "instruct", "chat"))
            template = GEMMA_CHAT_TEMPLATE if tuned else TRANSCRIPT_CHAT_TEMPLATE
        chat_stops = TRANSCRIPT_STOPS if template is TRANSCRIPT_CHAT_TEMPLATE else ()
        return cls(
            tk,
            bos_token=tokens[bos_id] if bos_id is not None else None,
            eos_token=tokens[eos_id] if eos_id is not None else None,
            pad_token=tokens[pad_id] if pad_id is not None else None,
            extra_eos_token_ids=[i for i in (eot_id, eom_id) if i is not None],
            chat_template=template,
            chat_stop_strings=chat_stops,
            add_bos_token=add_bos,
            add_eos_token=add_eos,
        )

    @classmethod
    def from_gguf_path(cls, path: str | os.PathLike) -> Tokenizer:
        """Open a GGUF file and build its tokenizer (reads only metadata; tensors stay memory-mapped)."""
        from metrale.models.gguf_file import GGUFFile

        return cls.from_gguf(read_gguf_fields(GGUFFile(os.fspath(path)), skip_header=True))

    @classmethod
    def from_pretrained_dir(cls, path: str | os.PathLike) -> Tokenizer:
        """Build from a Hugging Face model directory: tokenizer.json (+ tokenizer_config.json,
        chat_template.jinja / chat_template.json, special_tokens_map.json, generation_config.json)."""
        path = os.fspath(path)

        def load_json(name: str) -> dict:
            p = os.path.join(path, name)
            if not os.path.exists(p):
                return {}
            with open(p, encoding="utf-8") as f:
                return json.load(f)

        tj = os.path.join(path, "tokenizer.json")
        if not os.path.exists(tj):
            raise FileNotFoundError(f"{tj} not found (only fast tokenizer.json directories are supported)")
        tk = _HFTokenizer.from_file(tj)
        cfg = load_json("tokenizer_config.json")
        smap = load_json("special_tokens_map.json")
        gen = load_json("generation_config.json")

        # added tokens that tokenizer_config knows but tokenizer.json does not
        present = {t.content for t in tk.get_added_tokens_decoder().values()}
        missing_special, missing_plain = [], []
        for _tid, spec in sorted(cfg.get("added_tokens_decoder", {}).items(), key=lambda kv: int(kv[0])):
            content = spec.get("content")
            if content is None or content in present:
                continue
            at = AddedToken(
                content,
                single_word=spec.get("single_word", False),
                lstrip=spec.get("lstrip", False),
                rstrip=spec.get("rstrip", False),
                normalized=spec.get("normalized", not spec.get("special", False)),
                special=spec.get("special", False),
            )
            (missing_special if at.special else missing_plain).append(at)
        if missing_special:
            tk.add_special_tokens(missing_special)
        if missing_plain:
            tk.add_tokens(missing_plain)

        def special_token(name: str) -> str | None:
            tok = _token_content(cfg.get(name))
            if tok is None:
                tok = _token_content(smap.get(name))
            return tok

        bos, eos, pad = special_token("bos_token"), special_token("eos_token"), special_token("pad_token")
        for tok in (bos, eos, pad):  # make sure they are matched whole and skipped in decode
            if tok is not None and tok not in present and tk.token_to_id(tok) is not None:
                tk.add_special_tokens([AddedToken(tok, special=True, normalized=False)])

        template: Any = cfg.get("chat_template")
        jinja_file = os.path.join(path, "chat_template.jinja")
        if os.path.exists(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                template = f.read()
        elif template is None:
            template = load_json("chat_template.json").get("chat_template")

        gen_eos = gen.get("eos_token_id")
        extra = [] if gen_eos is None else ([gen_eos] if isinstance(gen_eos, int) else list(gen_eos))
        return cls(
            tk,
            bos_token=bos,
            eos_token=eos,
            pad_token=pad,
            extra_eos_token_ids=extra,
            chat_template=template,
            add_bos_token=bool(cfg.get("add_bos_token", False)),
            add_eos_token=bool(cfg.get("add_eos_token", False)),
        )

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token!r}, eos={self.eos_token!r}, "
            f"eos_token_ids={self.eos_token_ids})"
        )


# ---------------------------------------------------------------------------------------------
# Streaming detokenization
# ---------------------------------------------------------------------------------------------

# vLLM: INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET; a few tokens of context before the read offset
# make decoders that strip a leading space (Metaspace) or merge bytes across tokens behave.
_PREFIX_WINDOW = 5


# Gemma's turn format (its HF chat template, text only); BOS comes from the tokenizer's post-processor
GEMMA_CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)


# A pretrained model's "chat": the conversation as a plain Q: / A: transcript, ending where the answer
# starts (Gemma 3 270M answered 4 of 4 probe questions this way, 2 of 4 as User: / Assistant:)
TRANSCRIPT_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{{ message['content'] | trim }}{{ '\\n\\n' }}"
    "{%- else -%}{{ ('Q: ' if message['role'] == 'user' else 'A: ') + (message['content'] | trim) + '\\n' }}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'A:' }}{%- endif -%}"
)
TRANSCRIPT_STOPS = ("\nQ:",)     # the model's next question: where its answer ends


def _spm_tokenizer(fields: Mapping[str, Any], tokens: list[str], token_types: Sequence[int], special_ids: set[int]):
    """(HF tokenizer, special, user-defined added tokens) of a SentencePiece BPE GGUF vocabulary
    (tokenizer.ggml.model == "llama"), as llama.cpp's SPM tokenizer reads it: spaces become U+2581
    (plus one in front with add_space_prefix, default true), no pre-splitting, the adjacent pair
    whose merged piece scores highest merges first (merges ranked by that score), characters
    outside the vocabulary fall back to the <0xXX> byte tokens."""
    scores = fields.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    vocab: dict[str, int] = {}
    special: list[AddedToken] = []
    user_defined: list[AddedToken] = []
    normal: dict[str, float] = {}
    for i, (tok, tt) in enumerate(zip(tokens, token_types)):
        if tok in vocab:                       # a duplicate piece text: the first id keeps it
            continue
        vocab[tok] = i
        if tt == TOKEN_TYPE_CONTROL or (i in special_ids and tt != TOKEN_TYPE_USER_DEFINED):
            special.append(AddedToken(tok, special=True, normalized=False))
        elif tt == TOKEN_TYPE_USER_DEFINED:
            user_defined.append(AddedToken(tok, special=False, normalized=False))
        elif tt == TOKEN_TYPE_NORMAL:
            normal[tok] = float(scores[i])
    ranked = []
    for tok, score in normal.items():
        for k in range(1, len(tok)):
            a, b = tok[:k], tok[k:]
            if a in normal and b in normal:
                ranked.append((-score, vocab[a], vocab[b], a, b))
    ranked.sort()
    bpe = models.BPE(vocab=vocab, merges=[(a, b) for *_, a, b in ranked], fuse_unk=False, byte_fallback=True,
                     unk_token=None)
    tk = _HFTokenizer(bpe)
    prefix = bool(fields.get("tokenizer.ggml.add_space_prefix", True))
    steps = ([normalizers.Prepend("\u2581")] if prefix else []) + [normalizers.Replace(" ", "\u2581")]
    tk.normalizer = normalizers.Sequence(steps)
    tk.pre_tokenizer = None
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    tk.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tk, special, user_defined


class IncrementalDecoder:
    """Feed token ids one at a time; get back only newly completed text.

        dec = tokenizer.incremental_decoder(prompt_ids)
        for tid in generated:
            piece = dec.feed(tid)      # "" while a multi-byte character is still incomplete
        tail = dec.flush()             # whatever is still held back (may contain U+FFFD)

    `text` is everything emitted so far. The prompt ids (optional) give the decoder left context and
    are never emitted themselves.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True):
        self._tok = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = [int(i) for i in prompt_ids]
        self.read_offset = len(self.ids)
        self.prefix_offset = max(self.read_offset - _PREFIX_WINDOW, 0)
        # a prompt that ends inside a multi-byte character: let the output complete (and emit) it
        while self.read_offset > self.prefix_offset and self._decode(self.prefix_offset, self.read_offset).endswith(
            "\ufffd"
        ):
            self.read_offset -= 1
        self.text = ""

    def _decode(self, start: int, stop: int | None = None) -> str:
        return self._tok.decode(self.ids[start:stop], skip_special_tokens=self.skip_special_tokens)

    def feed(self, token_id: int) -> str:
        """Append one token id; return the text it completes (possibly "")."""
        self.ids.append(int(token_id))
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        new_text = self._decode(self.prefix_offset)
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            piece = new_text[len(prefix_text):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self.text += piece
            return piece
        return ""

    def feed_many(self, token_ids: Iterable[int]) -> str:
        return "".join(self.feed(t) for t in token_ids)

    def feed_bulk(self, token_ids: Iterable[int]) -> str:
        """Append many ids with two decodes in all (feed_many does two per id); returns what they
        complete, holding back a trailing incomplete character as feed does."""
        start = len(self.ids)
        self.ids.extend(int(t) for t in token_ids)
        if len(self.ids) == start:
            return ""
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        new_text = self._decode(self.prefix_offset)
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            piece = new_text[len(prefix_text):]
            # keep the usual window: the last few ids as the next decode's left context
            self.read_offset = len(self.ids)
            self.prefix_offset = max(self.read_offset - _PREFIX_WINDOW, 0)
            self.text += piece
            return piece
        return ""

    __call__ = feed

    def flush(self) -> str:
        """Emit whatever is held back (an incomplete character decodes as U+FFFD) and reset the window."""
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        new_text = self._decode(self.prefix_offset)
        piece = new_text[len(prefix_text):] if len(new_text) > len(prefix_text) else ""
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += piece
        return piece


@functools.lru_cache(maxsize=1)
def _gpt2_byte_chars() -> dict[int, str]:
    """GPT-2's byte -> character map (ByteLevel's alphabet): printable Latin-1 bytes stand for
    themselves, the other 68 bytes for the characters from U+0100 on, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars, extra = dict(zip(keep, map(chr, keep))), 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


class ByteLevelDecoder(IncrementalDecoder):
    """IncrementalDecoder's contract for a ByteLevel tokenizer from its ids' bytes
    (Tokenizer.token_bytes): the window algorithm's pieces, since the emitted text always ends on
    a whole character: the bytes since the last piece, read as UTF-8, are the next piece once they
    are non-empty and do not end in U+FFFD (its cost beside DecodeStream's: docs/server.md)."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool,
                 table: list[bytes]):
        super().__init__(tokenizer, prompt_ids, skip_special_tokens)
        self._table = table
        self._pending = b"".join(self._bytes(i) for i in self.ids[self.read_offset:])   # a prompt's open character

    def _bytes(self, token_id: int) -> bytes:
        try:
            return self._table[token_id]
        except IndexError:                # an id past the tokenizer's (a padded embedding): no text
            return b""

    def feed(self, token_id: int) -> str:
        self._pending += self._bytes(token_id)
        piece = self._pending.decode("utf-8", "replace")
        if not piece or piece.endswith("\ufffd"):
            return ""
        self._pending = b""
        self.text += piece
        return piece

    def feed_bulk(self, token_ids: Iterable[int]) -> str:
        return "".join([self.feed(t) for t in token_ids])

    def flush(self) -> str:
        piece = self._pending.decode("utf-8", "replace")
        self._pending = b""
        self.text += piece
        return piece

    __call__ = feed


class StreamDecoder(IncrementalDecoder):
    """IncrementalDecoder's contract on `tokenizers.decoders.DecodeStream`: one Rust call per token
    (the same window algorithm) instead of two decodes and their Python slicing (~2-3 us a token
    less). The last few prompt ids are its left context; ids of a character the prompt leaves
    incomplete are stepped silently, so the output completes (and emits) it. `flush` decodes what
    is held back since the last emitted piece (IncrementalDecoder's offsets track it). DecodeStream
    refuses a window whose text does not extend the last one (a byte-fallback decoder turning a
    failed byte run into U+FFFD, emitted characters included); from there on the Python algorithm,
    which cuts by length, decodes (`_python`)."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True):
        super().__init__(tokenizer, prompt_ids, skip_special_tokens)
        self._hf, self._python = tokenizer._tk, False
        self._stream = DecodeStream(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=skip_special_tokens)
        try:
            for i in self.ids[self.read_offset:]:
                self._stream.step(self._hf, i)
        except Exception:
            self._python = True

    def feed(self, token_id: int) -> str:
        if self._python:
            return super().feed(token_id)
        token_id = int(token_id)
        try:
            piece = self._stream.step(self._hf, token_id)
        except Exception:                         # "Invalid prefix encountered while decoding stream"
            self._python = True
            return super().feed(token_id)
        self.ids.append(token_id)
        if piece is None:
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.text += piece
        return piece

    def feed_bulk(self, token_ids: Iterable[int]) -> str:
        return "".join([self.feed(t) for t in token_ids])

    def flush(self) -> str:
        piece = super().flush()
        self._stream, self._python = DecodeStream([], skip_special_tokens=self.skip_special_tokens), False   # an empty window, as flush leaves it
        return piece

    __call__ = feed


class ByteTokenizer:
    """Token id = byte value + 3 (0..2 reserved: pad, bos, eos). For random-weight models when
    no real tokenizer is at hand (benchmarks on machines without the embedded model)."""

    eos_token_ids = (2,)
    bos_token_id = 1
    vocab_size = 259
    chat_template = None
    chat_stop_strings: tuple[str, ...] = ()

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [b + 3 for b in text.encode("utf-8")]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return bytes(i - 3 for i in ids if 3 <= i < 259).decode("utf-8", errors="replace")

    def incremental_decoder(self, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True):
        return IncrementalDecoder(self, prompt_ids, skip_special_tokens)  # type: ignore[arg-type]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **_: Any) -> str:
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + ("assistant: " if add_generation_prompt else "")
