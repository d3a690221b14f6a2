"""StreamingLLM as a step hook: before each step, each running streaming request gives back its
blocks between the sinks and the window of its next token, and its sink keys are turned to their
new cache positions. The hook owns the one piece of state this takes: each request's sink keys
as first written."""

from __future__ import annotations

import torch

from kvserve.cache.kv_cache import PagedKVCache
from kvserve.cache.kv_cache_manager import KVCacheManager
from kvserve.engine.request import Request
from kvserve.engine.step_plan import ScheduledChunk
from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.rope import apply_rope, rope_at, rope_inv_freq


class StreamingHook:
    def __init__(self, model: LlamaForCausalLM, kv_cache: PagedKVCache, kv_manager: KVCacheManager,
                 device: torch.device) -> None:
        self.model, self.kv_cache, self.kv = model, kv_cache, kv_manager
        self.device = device
        self._sink_keys: dict[str, list[torch.Tensor]] = {}  # per request, per layer: its sinks' keys as written
        self._inv_freq: torch.Tensor | None = None

    def before_step(self, running: list[Request]) -> None:
        if self.kv.streams:
            for request in running:
                self.evict(request)

    def before_forward(self, chunks: list[ScheduledChunk]) -> None:
        """A streaming sequence may outgrow the model's rotary tables: extend them to the furthest
        absolute position this step computes."""
        if self.kv.streams:
            self.model.extend_rope(max(c.request.num_computed_tokens + c.num_tokens for c in chunks))

    def evict(self, request: Request) -> None:
        """Free the request's blocks between its sinks and the window of its next token, and turn
        its sink keys to their new cache positions (from the keys as first written, so that
        rounding never accumulates). The last sink block's spare slots then take the tokens just
        before the window from the last block freed (before anything can reuse it): their
        absolute positions are already right there, and the prompt's first tokens past the sinks
        would cost quality (measured against kvpress). The sink blocks are rewritten whole, once:
        a quantized block is re-quantized with scales fitted to its new keys and spare slots.
        Before a step computes the request."""
        eviction = self.kv.evict(request.request_id, request.num_computed_tokens)
        if eviction is None:
            return
        sinks = self.kv_cache.read_blocks(eviction.sink_block_ids)
        if eviction.first:
            self._sink_keys[request.request_id] = [self._rotated(blocks).clone() for blocks in sinks]
        if self._inv_freq is None:
            self._inv_freq = rope_inv_freq(self.model.config).to(self.device)
        cos, signed_sin = rope_at(torch.tensor([eviction.shift], device=self.device), self._inv_freq)
        donor = None if eviction.donor_block_id is None else self.kv_cache.read_blocks([eviction.donor_block_id])
        for layer, (blocks, keys) in enumerate(zip(sinks, self._sink_keys[request.request_id], strict=True)):
            self._rotated(blocks).copy_(apply_rope(keys, cos[0], signed_sin[0]))
            if donor is not None:
                blocks[-1, :, eviction.spare_from :] = donor[layer][0, :, eviction.spare_from :]
        self.kv_cache.write_blocks(eviction.sink_block_ids, sinks)

    def _rotated(self, blocks: torch.Tensor) -> torch.Tensor:
        """The view of read blocks that rotary turned: the keys [N, kv_heads, block_size, dim],
        or in MLA's latent blocks [N, 1, block_size, latent_dim] the rotary key after the latent."""
        mla = self.model.config.mla
        if mla is not None:
            return blocks[..., mla.kv_lora_rank :]
        return blocks[:, : self.model.config.num_kv_heads]

    def finish(self, request_id: str) -> None:
        self._sink_keys.pop(request_id, None)
