"""RequestState: one request's sequence plus its detokenizer and stop logic.

Finish reasons: 'stop' (EOS, a stop token or a stop string), 'length' (max_tokens or the
context: max_model_len, or the whole KV pool where that is smaller, as Engine.context_len),
'abort', or 'error: <why>'. Text that could be the start of a stop string is held
back from the stream until it is known not to be one.
"""
from __future__ import annotations

import time

import numpy as np

from metrale.outputs import RequestOutput, StreamDelta
from metrale.sampling.params import SamplingParams
from metrale.sampling.state import SamplingState
from metrale.scheduler.sequence import Sequence


class RequestState:
    def __init__(self, seq: Sequence, tokenizer, eos_ids: tuple[int, ...], max_model_len: int,
                 text_at_end: bool = False):
        """text_at_end: nobody reads the text before the request ends (Engine.generate): without
        stop strings, tokens are detokenized once at the end instead of twice each as they come
        (~half the host time of a batch-32 decode step on a small model)."""
        self.seq = seq
        self.params: SamplingParams = seq.params
        # None with detokenize=False: no text at all (the server's engine process leaves it to the server)
        self.decoder = (tokenizer.incremental_decoder(seq.prompt_token_ids, self.params.skip_special_tokens)
                        if self.params.detokenize else None)
        self.stop_ids = set(self.params.stop_token_ids or ()) | (set() if self.params.ignore_eos else set(eos_ids))
        self.eos_ids = set(eos_ids)
        self.stops = self.params.stop_strings
        self.text_at_end = text_at_end and not self.stops and self.decoder is not None
        self.output_only = text_at_end      # its reader takes output() at the end, no step's delta
        self._undecoded: list[int] = []     # tokens appended but not yet fed to the decoder (text_at_end)
        self.holdback = max((len(s) for s in self.stops), default=1) - 1
        self.max_model_len = max_model_len
        self.sampling = SamplingState(self.params, seq.prompt_token_ids, tokenizer, eos_ids)  # seed, penalties, grammar, logprobs
        # the same answer at every step when nothing that changes with the tokens drawn (min_tokens,
        # a grammar, a forced tool call) enters it: the step loop then asks no per-row questions
        fixed = self.params.min_tokens == 0 and self.sampling.grammar is None and not self.params.require_tool_call
        self.always_plain_greedy = fixed and self.sampling.plain_greedy(False)
        self.always_device_drawn = fixed and (self.always_plain_greedy or self.sampling.device_only(False))
        self.text = ""          # all text decoded so far (stop string excluded once found)
        self.stop_reason: int | str | None = None   # as vLLM: the stop string or stop token id that ended it (EOS: None)
        self.emitted = 0        # characters of self.text already streamed
        self._scanned = 0       # characters of self.text already searched for stop strings
        self.tokens_emitted = 0
        self.t_arrival = time.perf_counter()
        self.t_first_token: float | None = None
        self.public_id = seq.request_id   # the id its deltas carry (a request with n > 1: the parent's)
        self.index = 0                    # which completion of that request
        self.group: str | None = None     # the id of the request with n > 1 it is a candidate of
        self.on_first_delta = None        # called once, at the first delta (n > 1: start the siblings)

    @property
    def eos_masked(self) -> bool:
        """min_tokens: EOS and stop tokens are masked until enough tokens were generated."""
        return len(self.seq.output_token_ids) < self.params.min_tokens

    def append(self, token: int) -> str | None:
        """Adds a sampled token; returns a finish reason or None."""
        if self.t_first_token is None:
            self.t_first_token = time.perf_counter()
        seq = self.seq
        seq.output_token_ids.append(token)
        n_out = len(seq.output_token_ids)
        if token in self.stop_ids and n_out > self.params.min_tokens:
            self.stop_reason = None if token in self.eos_ids else token
            return "stop"
        if self.text_at_end:
            self._undecoded.append(token)
        elif self.decoder is not None:
            self.text += self.decoder.feed(token)
        if self.stops:
            # the text up to _scanned holds no stop string, so one can only start in its last
            # holdback characters (not emitted: generate()'s requests take no delta, so emitted
            # stays 0 and each step would rescan the whole text)
            start = max(0, self._scanned - self.holdback)
            window = self.text[start:]
            hits = [(window.find(s), s) for s in self.stops if s in window]
            if hits:
                first, self.stop_reason = min(hits)
                self.text = self.text[:first + start]
                return "stop"
            self._scanned = len(self.text)
        if self.params.max_tokens is not None and n_out >= self.params.max_tokens:
            return "length"
        if seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _decode_pending(self) -> None:
        if self._undecoded:
            bulk = getattr(self.decoder, "feed_bulk", None)
            self.text += bulk(self._undecoded) if bulk is not None else "".join(self.decoder.feed(t) for t in self._undecoded)
            self._undecoded = []

    def delta(self, finish_reason: str | None) -> StreamDelta:
        if self.on_first_delta is not None:
            start, self.on_first_delta = self.on_first_delta, None
            start()
        if finish_reason is not None:
            self._decode_pending()
        if finish_reason is None:
            upto = max(self.emitted, len(self.text) - self.holdback)
        else:
            if self.decoder is not None and (finish_reason != "stop" or not self.stops):
                self.text += self.decoder.flush()
            upto = len(self.text)
        text = self.text[self.emitted:upto]
        self.emitted = upto
        first, last = self.tokens_emitted, len(self.seq.output_token_ids)
        toks = np.asarray(self.seq.output_token_ids[first:last], dtype=np.int32)   # the new ones only
        self.tokens_emitted = last
        lps = self.sampling.logprobs
        return StreamDelta(self.public_id, text, toks, finish_reason, self.index,
                           lps[first:last] if lps is not None else None,
                           self.stop_reason if finish_reason == "stop" else None)

    def output(self) -> RequestOutput:
        self._decode_pending()
        now = time.perf_counter()
        metrics = {"time_to_first_token": (self.t_first_token or now) - self.t_arrival,
                   "latency": now - self.t_arrival, "num_preemptions": self.seq.num_preemptions}
        fields = self.sampling.output_fields()
        if fields.get("logprobs") is not None:   # one entry per kept token (not those after a stop)
            fields["logprobs"] = fields["logprobs"][:len(self.seq.output_token_ids)]
        return RequestOutput(self.seq.request_id, self.seq.prompt,
                             np.asarray(self.seq.prompt_token_ids, dtype=np.int32), self.text,
                             self.seq.output_array(), self.seq.finish_reason or "abort", metrics,
                             index=self.index, stop_reason=self.stop_reason, **fields)
