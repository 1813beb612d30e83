"""A deterministic fake model that reads its context through the paged KV cache.

Its "KV" is the token id stored at each slot. The next token is a hash of every context token
read back through the block table, so any paging, slot-mapping, prefix-reuse or preemption bug
changes the output; `reference_continuation` computes the right answer from the plain list.
"""
from __future__ import annotations

import numpy as np

from metrale.models.config import ModelConfig
from metrale.runtime.backend import Backend, ReadyTokens, feed_tokens
from metrale.settings import compose

VOCAB = 97
EOS = 0


def next_token(context: list[int] | np.ndarray) -> int:
    ctx = np.asarray(context, dtype=np.int64)
    weights = np.arange(1, ctx.size + 1, dtype=np.int64) % 13 + 1
    return int((ctx * weights).sum() * 31 + ctx.size) % (VOCAB - 1) + 1   # never EOS


def reference_continuation(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq[len(prompt):]


class FakeBackend(Backend):
    """A test double of the Backend seam (its defaults: no state pool, no step limits)."""
    name = "fake"

    def __init__(self, num_blocks: int, block_size: int):
        self.config = fake_config()
        self.num_blocks, self.block_size = num_blocks, block_size
        self.kv = np.full(num_blocks * block_size, -1, dtype=np.int64)
        self.batches = []   # the ForwardBatches seen, for assertions

    def forward(self, batch, num_layers=None, return_hidden=False) -> np.ndarray:
        self.batches.append(batch)
        keep = batch.slot_mapping >= 0
        self.kv[batch.slot_mapping[keep]] = batch.token_ids[keep]
        logits = np.full((len(batch.logits_indices), VOCAB), -10.0, dtype=np.float32)
        for r, t in enumerate(batch.logits_indices):
            s, pos = batch.token_seq[t], batch.positions[t]
            p = np.arange(pos + 1)
            slots = batch.block_tables[s, p // self.block_size] * self.block_size + p % self.block_size
            ctx = self.kv[slots]
            assert (ctx >= 0).all(), "read a KV slot nobody wrote"
            logits[r, next_token(ctx)] = 10.0
        return logits

    def forward_greedy(self, batch, num_layers=None) -> np.ndarray:
        return np.argmax(self.forward(batch), axis=-1).astype(np.int32)

    supports_overlap = True

    def launch_greedy(self, batch, prev=None, token_src=None):
        feed_tokens(batch, prev, token_src)
        return ReadyTokens(self.forward_greedy(batch))

    def memory_report(self) -> dict:
        return {}


class FakeTokenizer:
    eos_token_ids = (EOS,)
    vocab_size = VOCAB
    chat_stop_strings: tuple[str, ...] = ()

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) % (VOCAB - 1) + 1 for c in text]

    def incremental_decoder(self, prompt_ids=(), skip_special_tokens=True):
        return _Decoder()

    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(f"<{int(t)}>" for t in ids)

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return "".join(m["content"] for m in messages)


class _Decoder:
    def feed(self, token_id: int) -> str:
        return f"<{token_id}>"

    def flush(self) -> str:
        return ""


def fake_config() -> ModelConfig:
    return ModelConfig(architecture="fake", vocab_size=VOCAB, hidden_size=8, intermediate_size=8, num_layers=1,
                       num_heads=1, num_kv_heads=1, head_dim=8, max_position=4096, eos_token_ids=(EOS,))


def fake_engine(num_blocks: int = 64, block_size: int = 4, **settings):
    from metrale import Engine
    overrides = [f"cache.block_size={block_size}"] + [f"{k}={v}" for k, v in settings.items()]
    backend = FakeBackend(num_blocks, block_size)
    return Engine(cfg=compose(overrides), parts=(backend.config, FakeTokenizer(), backend))
