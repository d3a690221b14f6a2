"""SnapKV (Li et al. 2024): after a prompt's prefill, keep per KV head the prompt tokens its last
``window`` queries attend to most, pooled so that neighbours of a strong token survive with it.

The scores come from the observation window's queries against the cached keys: a ``window`` x
prompt matrix per head, never the prompt's full attention matrix. The kept tokens are copied
into fresh private blocks (``SnapKVHook.compact``): every head keeps its own set, in one table.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kvserve.cache.kv_cache import PagedKVCache
from kvserve.cache.kv_cache_manager import KVCacheManager
from kvserve.config import ConfigError
from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.request import Request
from kvserve.engine.step_plan import ScheduledChunk

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


class SnapKVHook:
    """SnapKV as a step hook: after the step that completes a request's prefill, its prompt is
    scored and compacted once (again if it is preempted and recomputed). The hook owns each
    compressing request's kept fraction and whether its prompt was scored."""

    def __init__(self, runner: ModelRunner, kv_cache: PagedKVCache, kv_manager: KVCacheManager,
                 observation_window: int, per_layer: bool, refusal: str | None = None) -> None:
        """``refusal``: why this engine cannot compact a request's KV (None: it can)."""
        self.runner, self.kv_cache, self.kv = runner, kv_cache, kv_manager
        self.refusal = refusal
        self.observation_window = observation_window
        self.per_layer = per_layer  # one kept set per layer (kv_compression_per_layer), not per KV head
        self._ratios: dict[str, float] = {}  # each compressing request's kept fraction
        self._scored: set[str] = set()  # requests whose prompt was compressed (or kept whole)

    def add(self, request_id: str, ratio: float | None) -> None:
        if ratio is not None:
            self._ratios[request_id] = ratio

    def preempted(self, request: Request) -> None:
        if request.num_computed_tokens == 0:  # recomputed: its prefill is compressed again
            self._scored.discard(request.request_id)

    def after_step(self, requests: list[Request]) -> None:
        """``requests``: those that sampled this step; the ones whose prefill just completed are
        compressed once."""
        if not self._ratios:
            return
        for request in requests:
            ratio = self._ratios.get(request.request_id)
            if ratio is not None and not request.finished and request.request_id not in self._scored:
                self._scored.add(request.request_id)
                self.compress_prompt(request, ratio)

    def finish(self, request_id: str) -> None:
        self._ratios.pop(request_id, None)
        self._scored.discard(request_id)

    def compress_prompt(self, request: Request, ratio: float) -> bool:
        """Right after the request's prefill: recompute the last kv_observation_window tokens'
        queries (reading their K/V as cached, never rewriting them: the blocks may be published),
        score the prompt per KV head and keep ``ratio`` of it. False when nothing was dropped (a
        short prompt, a ratio of 1, or no pool room for the copy)."""
        length = request.num_computed_tokens
        window = min(self.observation_window, length)
        keep = max(window, math.ceil(length * ratio))
        if keep >= length:
            return False
        queries: dict[int, torch.Tensor] = {}
        self.runner.query_observer = lambda kv, q: queries.__setitem__(id(kv), q.detach().clone())
        request.num_computed_tokens = length - window
        try:
            self.runner.forward([ScheduledChunk(request, window, blocks=self.kv.blocks_of(request.request_id))])
        finally:
            self.runner.query_observer = None
            request.num_computed_tokens = length
        model = self.runner.model
        kv_heads = model.config.num_kv_heads
        tokens = self.kv_cache.read_tokens(self.kv.block_ids(request.request_id), length, self._tail_slot(request))
        index = [snapkv_keep(queries[id(kv)], cached[:kv_heads].transpose(0, 1), keep, layer.scale,
                             per_head=not self.per_layer)
                 for kv, cached, layer in zip(self.kv_cache.layers, tokens, model.decoder_layers, strict=True)]
        return self.compact(request, index)

    def _tail_slot(self, request: Request) -> int:
        """The request's tail slot, for formats that keep its partial last block there (else 0)."""
        return self.kv.tail_slot(request.request_id) if self.kv_cache.uses_tail else 0

    def compact(self, request: Request, index: list[torch.Tensor]) -> bool:
        """Keep only some of the request's cached tokens: in model layer l's storage, head h keeps
        tokens index[l][h] (sorted positions among those cached; every head as many). Queries
        and kept keys stay at their absolute rotary positions, so their distances are right
        without re-rotation. Quantized blocks are re-quantized with scales fitted to the kept
        tokens. False if the pool is short (nothing changes)."""
        if self.refusal is not None:
            raise ConfigError(f"compacting a request's KV: {self.refusal}")
        length = self.kv.num_tokens(request.request_id)
        moved = self.kv.compact(request.request_id, int(index[0].shape[1]))
        if moved is None:
            return False
        self.kv_cache.zero_new_blocks(self.kv.pool.max_block_id_used)
        self.kv_cache.gather_tokens(*moved, index, length, self._tail_slot(request))
        return True
