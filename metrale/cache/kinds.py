"""Cache kinds: the per-sequence model state a backend keeps for a family, one small class each.

A family names its kinds (metrale.models.families: KV, LATENT, STATE); each backend maps a name to
its class (the host ones here and HostStatePool in models/hybrid.py; the device ones in
runtime/cuda/pages.py and runtime/cuda/state_pool.py). One interface for all:
  block_bytes(backend)    bytes per KV block (a paged kind, indexed by the block tables), else 0
  fixed_bytes(backend)    bytes that do not scale with the blocks (a slot kind's pool), else 0
  allocate(backend, n)    an instance for n blocks (paged) or n sequence slots
  memory()                its memory report entries
plus the arrays the backend's Ops read (k / v, latent, the state pool's own).
"""
from __future__ import annotations

import numpy as np


class CacheKind:
    paged = True      # indexed by the block tables (sized in KV blocks); False: by a sequence's state slot

    @classmethod
    def block_bytes(cls, backend) -> int:
        return 0

    @classmethod
    def fixed_bytes(cls, backend) -> int:
        return 0

    @classmethod
    def allocate(cls, backend, n: int) -> "CacheKind":
        raise NotImplementedError

    def before_forward(self, batch, seqs: int, graphed: bool) -> None:
        """Per-step metadata a kind uploads before the forward (the CUDA state pool's slots)."""

    def memory(self) -> dict:
        return {}


class HostKvPages(CacheKind):
    """K and V of the attention layers: [kv layers, blocks, block_size, kv heads, head_dim] each.
    np.zeros: the OS maps pages on first write, so RSS grows with the tokens used."""

    def __init__(self, layers: int, num_blocks: int, block_size: int, heads: int, head_dim: int, dtype):
        shape = (layers, num_blocks, block_size, heads, head_dim)
        self.k, self.v = np.zeros(shape, dtype), np.zeros(shape, dtype)

    @classmethod
    def block_bytes(cls, backend) -> int:
        c = backend.config
        return 2 * c.num_kv_layers * backend.block_size * c.kv_size * backend.dtype.itemsize

    @classmethod
    def allocate(cls, backend, n: int) -> "HostKvPages":
        c = backend.config
        return cls(c.num_kv_layers, n, backend.block_size, c.num_kv_heads, c.head_dim, backend.dtype)

    def memory(self) -> dict:
        return {"kv_pool_bytes": self.k.nbytes + self.v.nbytes}


class HostLatentPages(CacheKind):
    """MLA's compressed KV + shared RoPE key per token: [layers, blocks, block_size, latent_dim]."""

    def __init__(self, layers: int, num_blocks: int, block_size: int, latent_dim: int, dtype):
        self.latent = np.zeros((layers, num_blocks, block_size, latent_dim), dtype)

    @classmethod
    def block_bytes(cls, backend) -> int:
        c = backend.config
        return c.num_layers * backend.block_size * c.latent_dim * backend.dtype.itemsize

    @classmethod
    def allocate(cls, backend, n: int) -> "HostLatentPages":
        c = backend.config
        return cls(c.num_layers, n, backend.block_size, c.latent_dim, backend.dtype)

    def memory(self) -> dict:
        return {"kv_pool_bytes": self.latent.nbytes}
