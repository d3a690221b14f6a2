"""Paged attention: write new K/V into the block pool, read each sequence through its table.

The reference path gathers a sequence's slots (one index tensor per step, shared by all
layers) into a transient [batch, len, kv_heads, head_dim] view and runs SDPA with GQA.
Padded positions point at the zeroed null block and are masked out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class AttentionGroup:
    """Sequences that share one SDPA call: ``batch`` sequences of ``query_len`` tokens each,
    stored contiguously at [token_start, token_start + batch * query_len) of the flat batch."""

    token_start: int
    batch: int
    query_len: int
    gather_index: torch.Tensor  # [batch, kv_len] flat cache slots (0 = null block)
    mask: torch.Tensor  # [batch, 1, query_len, kv_len] True = attend


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V is written
    groups: list[AttentionGroup]


def build_gather_index(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int, kv_len: int
) -> torch.Tensor:
    """Flat slot of every position < seq_len through the block table; 0 beyond it."""
    positions = torch.arange(kv_len, device=block_tables.device)
    slots = block_tables[:, positions // block_size] * block_size + positions % block_size
    return torch.where(positions[None, :] < seq_lens[:, None], slots, torch.zeros_like(slots))


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """query [T, H, D], key/value [T, KVH, D]; caches [slots, KVH, D]. Returns [T, H, D]."""
    key_cache.index_copy_(0, meta.slot_mapping, key)
    value_cache.index_copy_(0, meta.slot_mapping, value)
    num_heads, head_dim = query.shape[1], query.shape[2]
    out = torch.empty_like(query)
    for group in meta.groups:
        end = group.token_start + group.batch * group.query_len
        q = query[group.token_start : end].view(group.batch, group.query_len, num_heads, head_dim)
        k = key_cache[group.gather_index]  # [B, L, KVH, D]
        v = value_cache[group.gather_index]
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=group.mask, scale=scale, enable_gqa=True,
        )
        out[group.token_start : end] = o.transpose(1, 2).reshape(-1, num_heads, head_dim)
    return out
