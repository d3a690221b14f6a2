"""SnapKV (Li et al. 2024): after a prompt's prefill, keep per KV head the prompt tokens its last
``window`` queries attend to most, pooled so that neighbours of a strong token survive with it.

The scores come from the observation window's queries against the cached keys: a ``window`` x
prompt matrix per head, never the prompt's full attention matrix. The kept tokens are copied
into fresh private blocks (``LLMEngine.compact``): every head keeps its own set, in one table.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

POOL_KERNEL = 5  # kvpress's SnapKVPress default


def snapkv_keep(queries: torch.Tensor, keys: torch.Tensor, keep: int, scale: float,
                kernel: int = POOL_KERNEL, per_head: bool = True) -> torch.Tensor:
    """Token indices [kv_heads, keep] (sorted) each KV head keeps of a prompt of L tokens.

    ``queries`` [w, heads, dim]: the prompt's last w tokens' rotated queries; ``keys`` [L,
    kv_heads, dim]. A head's score of prompt token j is the attention its group of query heads
    pays j from the window (causal: query i sees keys up to L - w + i), summed, then averaged
    over ``kernel`` neighbours; the window itself is always kept, and the top ``keep - w`` of the
    rest. ``keep`` >= w. ``per_head=False`` (kv_compression_per_layer): one set for the layer,
    by the scores summed over its KV heads (the layout the paper did not choose; on SmolLM2 it
    kept passkeys that per-head sets lost, at the same KL: benchmarks/kv_eviction.py
    --snapkv-heads)."""
    window, heads, dim = queries.shape
    length, kv_heads, _ = keys.shape
    if not window <= keep <= length:
        raise ValueError(f"keep={keep} must lie between the window ({window}) and the prompt ({length})")
    q = queries.float().view(window, kv_heads, heads // kv_heads, dim)
    logits = torch.einsum("wgqd,lgd->gqwl", q, keys.float()) * scale  # [kv_heads, group, w, L]
    query_pos = torch.arange(length - window, length, device=keys.device)
    logits.masked_fill_(torch.arange(length, device=keys.device)[None, :] > query_pos[:, None], float("-inf"))
    votes = logits.softmax(dim=-1).sum(dim=(1, 2))[:, : length - window]  # [kv_heads, L - w]
    if not per_head:
        votes = votes.sum(dim=0, keepdim=True).expand(kv_heads, -1)
    pooled = F.avg_pool1d(votes[:, None], kernel, stride=1, padding=kernel // 2, count_include_pad=False)[:, 0]
    top = pooled.topk(keep - window, dim=-1).indices
    tail = torch.arange(length - window, length, device=keys.device).expand(kv_heads, window)
    return torch.cat([top, tail], dim=1).sort(dim=-1).values
