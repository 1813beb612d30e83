"""Structured output through llguidance: JSON schema, regex, Lark grammar or a choice list.

- `grammar_of(params)`: the llguidance grammar string of a request (None when unconstrained);
  `check_grammar(params)` compiles it without a tokenizer and raises InvalidRequestError with
  llguidance's message (SamplingParams.validate calls it, so add_request refuses bad grammars).
- `new_matcher(params, tokenizer, eos_ids)`: an LLMatcher for one request (the LLTokenizer is built
  once per tokenizer from its `tokenizers` JSON: ~0.4 s for a 49k vocabulary).
- `MaskWorker`: the token bitmasks of one step, computed on the CPU by llguidance's thread pool
  (which drops the GIL) in a Python thread, so that it overlaps the forward:
  `start(rows)` before the forward, `finish()` after it returns the packed uint32 [R, ceil(V/32)]
  bitmask (bit i of word i >> 5 = token i allowed).
"""
from __future__ import annotations

import copy
import functools
import json
import threading

import numpy as np

from metrale.sampling.params import InvalidRequestError, SamplingParams


# JSON is generated compact (json.dumps separators, no free whitespace): a small model at a high
# temperature otherwise wanders into whitespace until max_tokens. A schema's "x-guidance" overrides it.
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_of(params: SamplingParams) -> str | None:
    if not structured_field(params):
        return None
    import llguidance as llg

    if params.json_schema is not None:
        schema = params.json_schema
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise InvalidRequestError(f"json_schema: not valid JSON: {exc}") from None
        return llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
    if params.regex is not None:
        return llg.LLMatcher.grammar_from_regex(params.regex)
    if params.grammar is not None:
        return llg.LLMatcher.grammar_from_lark(params.grammar)
    if params.choice is not None:
        return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in params.choice))
    return None


def structured_field(params: SamplingParams) -> str:
    for name in ("json_schema", "regex", "grammar", "choice"):
        if getattr(params, name) is not None:
            return name
    return ""


@functools.lru_cache(maxsize=256)
def _validate(grammar: str) -> str:
    import llguidance as llg

    return llg.LLMatcher.validate_grammar(grammar)


def check_grammar(params: SamplingParams) -> None:
    try:
        grammar = grammar_of(params)
    except (ValueError, TypeError) as exc:
        if isinstance(exc, InvalidRequestError):
            raise
        raise InvalidRequestError(f"{structured_field(params)}: cannot be compiled: {exc}") from None
    if grammar is None:
        return
    err = _validate(grammar)
    if err:
        raise InvalidRequestError(f"{structured_field(params)}: cannot be compiled: {err.strip()}")


_LLTOKENIZERS: dict[int, tuple[object, object]] = {}
_LOCK = threading.Lock()


def ll_tokenizer(tokenizer, eos_ids):
    """The llguidance tokenizer of one of our tokenizers (cached; it keeps `tokenizer` alive)."""
    import llguidance as llg

    key = id(tokenizer)
    with _LOCK:
        hit = _LLTOKENIZERS.get(key)
        if hit is None or hit[0] is not tokenizer:
            backend = getattr(tokenizer, "backend", None)
            if backend is None or not hasattr(backend, "to_str"):
                raise InvalidRequestError("structured output: this model's tokenizer cannot be used with "
                                          "llguidance (it needs a `tokenizers` tokenizer)")
            llt = llg.LLTokenizer(backend.to_str(), n_vocab=int(tokenizer.vocab_size),
                                  eos_token=[int(i) for i in eos_ids] or None)
            hit = _LLTOKENIZERS[key] = (tokenizer, llt)
    return hit[1]


def new_matcher(params: SamplingParams, tokenizer, eos_ids):
    """An LLMatcher for this request, or None when it is unconstrained."""
    grammar = grammar_of(params)
    if grammar is None:
        return None
    import llguidance as llg
    matcher = llg.LLMatcher(ll_tokenizer(tokenizer, eos_ids), grammar, log_level=0)
    if matcher.is_error():
        raise InvalidRequestError(f"{structured_field(params)}: cannot be compiled: {matcher.get_error().strip()}")
    return matcher


class MaskWorker:
    """Computes a step's grammar bitmasks in a background thread (see the module docstring)."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.words = -(-vocab_size // 32)
        self._executor = None
        self._thread: threading.Thread | None = None
        self._result: np.ndarray | None = None
        self._error: BaseException | None = None

    def _compute(self, rows: list[tuple[int, object]], num_rows: int) -> None:
        try:
            import llguidance as llg

            if self._executor is None:
                self._executor = llg.LLExecutor()
            by_width: dict[int, list] = {}
            for r, m in rows:
                by_width.setdefault(m.tokenizer_words, []).append((m.matcher, r))
            out = np.zeros((num_rows, self.words), dtype=np.uint32)
            for width, pairs in by_width.items():
                buf = np.zeros((num_rows, width), dtype=np.int32)
                self._executor.unsafe_compute_mask_ptr(pairs, buf.ctypes.data, width * 4, num_rows)
                w = min(width, self.words)
                idx = [r for _, r in pairs]
                out[idx, :w] = buf[idx, :w].view(np.uint32)
            self._result = out
        except BaseException as exc:  # re-raised in finish()
            self._error = exc

    def start(self, rows: list[tuple[int, object]], num_rows: int) -> None:
        """rows: (row index, GrammarState) pairs whose mask this step needs."""
        self._result, self._error = None, None
        if not rows:
            self._thread = None
            return
        self._thread = threading.Thread(target=self._compute, args=(rows, num_rows), daemon=True)
        self._thread.start()

    def finish(self) -> np.ndarray | None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            raise self._error
        return self._result


class GrammarState:
    """One request's matcher and its mask width (llguidance's tokenizer vocabulary may be smaller
    than the model's; ids beyond it are never allowed)."""

    def __init__(self, matcher, tokenizer_vocab: int):
        self.matcher = matcher
        self.tokenizer_words = -(-tokenizer_vocab // 32)
        self.failed = False
        self._shared = False      # a fork's matcher is its parent's until it consumes a token

    def fork(self) -> "GrammarState":
        """A look-ahead copy that shares the matcher until its first consume (copy on write)."""
        g = copy.copy(self)
        g._shared = True
        return g

    @property
    def stopped(self) -> bool:
        return self.matcher.is_stopped()

    def consume(self, token: int) -> bool:
        if self._shared:
            self.matcher, self._shared = self.matcher.deep_copy(), False
        ok = self.matcher.consume_token(int(token))
        if not ok:
            self.failed = True
        return ok
