"""Paged attention: write new K/V into the block pool, read each sequence through its table.

Each attention group gathers its sequences' whole blocks through their block tables (one
index_select per layer for K and V together; the table tensor is built once per step and
shared by all layers) into a transient [2*kv_heads, batch, blocks*block_size, head_dim]
tensor. Padding entries point at the zeroed null block; positions at or past a sequence's
length are masked out.
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
    block_tables: torch.Tensor  # [batch, max_blocks] physical block ids (0 = null block)
    mask: torch.Tensor  # [batch, 1, query_len, max_blocks * block_size] True = attend


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V is written
    groups: list[AttentionGroup]


def _attend_kv_major(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [B, Lq, H, D]; k, v [KVH, B, L, D]; mask [B, 1, Lq, L]. GQA as batched matmuls with
    the G query heads of each KV head stacked as rows; softmax in float32."""
    batch, query_len, num_heads, head_dim = q.shape
    kv_heads, kv_len = k.shape[0], k.shape[2]
    group = num_heads // kv_heads
    qg = q.view(batch, query_len, kv_heads, group, head_dim).permute(2, 0, 3, 1, 4)
    qg = qg.reshape(kv_heads * batch, group * query_len, head_dim)
    scores = torch.bmm(qg, k.view(kv_heads * batch, kv_len, head_dim).transpose(1, 2))
    scores = scores.view(kv_heads, batch, group, query_len, kv_len).float().mul_(scale)
    scores.masked_fill_(~mask.view(1, batch, 1, query_len, kv_len), float("-inf"))
    probs = scores.softmax(-1).to(v.dtype).view(kv_heads * batch, group * query_len, kv_len)
    out = torch.bmm(probs, v.view(kv_heads * batch, kv_len, head_dim))
    return out.view(kv_heads, batch, group, query_len, head_dim).permute(1, 3, 0, 2, 4)


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """query [T, H, D], key/value [T, KVH, D]; kv_cache [2*KVH, slots, D] (K heads, then V).

    Writes the new K/V at the slot mapping, then every group reads its sequences' K/V back
    from the pool through their block tables. Returns [T, H, D]."""
    kv_heads = key.shape[1]
    kv_cache.index_copy_(1, meta.slot_mapping, torch.cat((key, value), dim=1).transpose(0, 1))
    num_heads, head_dim = query.shape[1], query.shape[2]
    out = torch.empty_like(query)
    for group in meta.groups:
        end = group.token_start + group.batch * group.query_len
        q = query[group.token_start : end].view(group.batch, group.query_len, num_heads, head_dim)
        kv_len = group.mask.shape[-1]
        blocks = kv_cache.view(2 * kv_heads, -1, kv_len // group.block_tables.shape[1] * head_dim)
        kv = blocks.index_select(1, group.block_tables.view(-1)).view(2 * kv_heads, group.batch, kv_len, head_dim)
        k, v = kv[:kv_heads], kv[kv_heads:]
        if group.query_len > 1 and query.dtype == torch.float32:
            # measured: the fused CPU kernel wins for float32 prefill, loses for decode and bf16
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(0, 1), v.transpose(0, 1),
                attn_mask=group.mask, scale=scale, enable_gqa=True,
            ).transpose(1, 2)
        else:
            o = _attend_kv_major(q, k, v, group.mask, scale)
        out[group.token_start : end] = o.reshape(-1, num_heads, head_dim)
    return out
