"""The physical KV storage: one preallocated tensor per layer for K and for V.

Layout per layer: [num_blocks * block_size, num_kv_heads, head_dim]; token slot
``block_id * block_size + offset`` holds one token. The pool is the only KV storage.
"""

from __future__ import annotations

import torch


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """2 (K and V) x layers x KV heads x head_dim x bytes per element."""
    return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def num_blocks_for_budget(budget_bytes: int, block_size: int, bytes_per_token: int) -> int:
    """How many whole blocks (the null block included) a byte budget buys."""
    return budget_bytes // (block_size * bytes_per_token)


class PagedKVCache:
    """Preallocated K/V tensors; block 0 (the null block) is zero-filled."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        num_slots = num_blocks * block_size
        # torch.empty: pages are only touched when a block is first written.
        storage = torch.empty((num_layers, 2, num_slots, num_kv_heads, head_dim), dtype=dtype, device=device)
        storage[:, :, :block_size].zero_()
        self.storage = storage
        self.key_caches = [storage[i, 0] for i in range(num_layers)]
        self.value_caches = [storage[i, 1] for i in range(num_layers)]

    @property
    def nbytes(self) -> int:
        return self.storage.numel() * self.storage.element_size()
