"""The physical KV storage: one preallocated tensor per layer for K and for V.

Layout per layer: [2 * num_kv_heads, num_blocks * block_size, head_dim] — K heads then V
heads, each head's slots contiguous — so one index_select of whole blocks gathers a batch's
K and V already in the [heads, batch, len, head_dim] order that batched matmuls want.
Blocks are zeroed when first handed out (see zero_new_blocks), so the unwritten tail of a
gathered block is zeros, never uninitialised memory that could hold NaN bit patterns. Token slot
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
        storage = torch.empty((num_layers, 2 * num_kv_heads, num_slots, head_dim), dtype=dtype, device=device)
        storage[:, :, :block_size].zero_()
        self.storage = storage
        self.zeroed_up_to = 0  # blocks 0..zeroed_up_to have been zero-filled
        self.layer_caches = list(storage.unbind(0))

    def zero_new_blocks(self, max_block_id: int) -> None:
        """Zero blocks up to ``max_block_id`` on first use. The pool hands out never-used blocks
        in id order, so this touches each block once and pages stay lazily committed."""
        if max_block_id > self.zeroed_up_to:
            bs = self.block_size
            self.storage[:, :, (self.zeroed_up_to + 1) * bs : (max_block_id + 1) * bs].zero_()
            self.zeroed_up_to = max_block_id

    @property
    def nbytes(self) -> int:
        return self.storage.numel() * self.storage.element_size()
