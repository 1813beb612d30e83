"""The paged cache kinds on the device (metrale.cache.kinds's interface): K/V pages and MLA latent
pages, bf16 bits (uint16) in the pool's "kv" region, zeroed once (graph padding rows read block 0,
which must hold finite values), with the wider views the attention kernels load through."""
from __future__ import annotations

import numpy as np
from numba.cuda.cudadrv.driver import device_memset

from metrale.cache.kinds import CacheKind


class DeviceKvPages(CacheKind):
    """k, v [kv layers, blocks, block_size, kv heads, head_dim]; k64 / v64 their uint64 views."""

    def __init__(self, k, v):
        self.k, self.v = k, v
        self.k64, self.v64 = k.view(np.uint64), v.view(np.uint64)

    @classmethod
    def block_bytes(cls, backend) -> int:
        c = backend.config
        return 2 * c.num_kv_layers * backend.block_size * c.kv_size * 2

    @classmethod
    def allocate(cls, backend, n: int) -> "DeviceKvPages":
        c = backend.config
        shape = (c.num_kv_layers, n, backend.block_size, c.num_kv_heads, c.head_dim)
        k, v = backend.pool.alloc("kv", shape, np.uint16), backend.pool.alloc("kv", shape, np.uint16)
        device_memset(k, 0, k.nbytes)
        device_memset(v, 0, v.nbytes)
        return cls(k, v)


class DeviceLatentPages(CacheKind):
    """latent [layers, blocks, block_size, kv_lora_rank + qk_rope_head_dim]; latent32 its uint32 view."""

    def __init__(self, latent):
        self.latent, self.latent32 = latent, latent.view(np.uint32)

    @classmethod
    def block_bytes(cls, backend) -> int:
        c = backend.config
        return c.num_layers * backend.block_size * c.latent_dim * 2

    @classmethod
    def allocate(cls, backend, n: int) -> "DeviceLatentPages":
        c = backend.config
        latent = backend.pool.alloc("kv", (c.num_layers, n, backend.block_size, c.latent_dim), np.uint16)
        device_memset(latent, 0, latent.nbytes)
        return cls(latent)
