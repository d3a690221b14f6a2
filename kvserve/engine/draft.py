"""Draft-model proposers: a smaller model (or the target's first layers) drafts k tokens per
step on a paged KV cache of its own, carved from the same memory budget as the target's."""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from kvserve.cache.kv_cache import PagedKVCache
from kvserve.cache.kv_cache_manager import KVCacheManager
from kvserve.cache.kv_stats import KVCacheStats
from kvserve.config import EngineConfig, SpeculativeConfig
from kvserve.engine.loading import DraftModel
from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.request import Request
from kvserve.engine.sampling import SamplingParams, greedy_tokens
from kvserve.engine.spec_decode import NgramProposer, Proposal, Proposer, SpecDecoder
from kvserve.engine.step_plan import ScheduledChunk
from kvserve.model.llama import LlamaForCausalLM

logger = logging.getLogger("kvserve")


def shallow_exit(model: LlamaForCausalLM, num_layers: int) -> LlamaForCausalLM:
    """The target's first ``num_layers`` layers, its final norm and LM head, as a model of its
    own (Draft & Verify, LayerSkip's early exit): every weight is shared, none copied."""
    view = copy.copy(model)
    view._modules = dict(model._modules)  # so that replacing the layer list leaves the target's alone
    view.layers = nn.ModuleList(list(model.layers)[:num_layers])
    view.decoder_layers = model.decoder_layers[:num_layers]
    view.config = dataclasses.replace(model.config, num_layers=num_layers,
                                      layer_windows=model.config.layer_windows[:num_layers])
    return view


class DraftModelProposer(Proposer):
    """Greedy drafts from ``model``. Per request it keeps the tokens whose K/V its pool holds; at
    each proposal it keeps the longest prefix the request still has (rejected drafts are rolled
    back), computes the request's newer tokens (chunks of at most ``max_chunk_tokens`` tokens
    per forward pass) and then drafts one token per forward pass. A request the draft pool
    cannot hold drafts nothing this step (its draft state is dropped, the target is unaffected)."""

    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int, device: torch.device,
                 max_chunk_tokens: int, vocab_size: int) -> None:
        config = model.config
        self.model = model
        self.kv_cache = PagedKVCache(config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim,
                                     model.norm.dtype, device)
        self.kv = KVCacheManager(num_blocks, block_size)
        self.runner = ModelRunner(model, self.kv_cache, device, layer_windows=config.layer_windows or None)
        self.device = device
        self.max_chunk_tokens = max_chunk_tokens
        self.vocab_size = vocab_size  # drafts stay inside the target's vocabulary
        self.seqs: dict[str, Request] = {}  # the draft's copy of each request; num_computed_tokens: cached

    def _sync(self, request: Request, num_drafts: int) -> Request | None:
        """The draft's copy of ``request`` with its slots for the request's tokens and k - 1
        drafts, its cache cut back to the prefix it shares with the request; None if no room."""
        tokens = request.prompt_token_ids + request.output_token_ids
        seq = self.seqs.get(request.request_id)
        if seq is None:
            seq = self.seqs[request.request_id] = Request(request.request_id, [], SamplingParams(), -1)
        # what stays cached: the shared prefix, less at least the last token (its logits draft)
        cached = min(seq.num_computed_tokens, len(tokens) - 1)
        same = np.asarray(seq.prompt_token_ids[:cached]) == np.asarray(tokens[:cached])
        cached = cached if same.all() else int(np.argmin(same))
        if cached < seq.num_computed_tokens:
            self.kv.rollback(seq.request_id, cached)
        seq.prompt_token_ids, seq.num_computed_tokens = tokens, cached
        if not self.kv.allocate_slots(seq.request_id, len(tokens) + num_drafts - 1):
            self.free(request.request_id)
            return None
        return seq

    @torch.inference_mode()
    def propose(self, requests: list[Request], num_drafts: list[int]) -> list[Proposal]:
        seqs = [self._sync(r, k) for r, k in zip(requests, num_drafts, strict=True)]
        live = [(i, seq) for i, seq in enumerate(seqs) if seq is not None]
        drafts: list[list[int]] = [[] for _ in requests]
        # catch up on the request's tokens; the last piece of each gives its first draft
        pending = list(live)
        while pending:
            budget, chunks, finishing = self.max_chunk_tokens, [], []
            for i, seq in pending:
                n = min(seq.num_tokens - seq.num_computed_tokens, budget)
                if n == 0:
                    break
                chunks.append(ScheduledChunk(seq, n))
                budget -= n
                if seq.num_computed_tokens + n == seq.num_tokens:
                    finishing.append((i, seq))
            self._forward_and_draft(chunks, finishing, drafts)
            pending = [(i, seq) for i, seq in pending if seq.num_computed_tokens < seq.num_tokens]
        for step in range(1, max(num_drafts, default=0)):
            going = [(i, seq) for i, seq in live if num_drafts[i] > step]
            for i, seq in going:
                seq.prompt_token_ids.append(drafts[i][-1])
            self._forward_and_draft([ScheduledChunk(seq, 1) for _, seq in going], going, drafts)
        return [Proposal(tokens) for tokens in drafts]

    def _forward_and_draft(self, chunks: list[ScheduledChunk], finishing: list[tuple[int, Request]],
                           drafts: list[list[int]]) -> None:
        """One forward pass; each finishing sequence's last position drafts its next token."""
        self.kv_cache.prepare(self.kv.take_storage_work())
        for chunk in chunks:
            chunk.blocks = self.kv.blocks_of(chunk.request.request_id)
        ordered, hidden = self.runner.forward(chunks)
        for chunk in chunks:
            chunk.request.num_computed_tokens += chunk.num_tokens
        if not finishing:
            return
        ends = dict(zip((id(c.request) for c in ordered), np.cumsum([c.num_tokens for c in ordered]) - 1,
                        strict=True))
        rows = torch.tensor([int(ends[id(seq)]) for _, seq in finishing], device=self.device)
        tokens = greedy_tokens(self.model.compute_logits(hidden[rows])[:, : self.vocab_size]).tolist()
        for (i, _), token in zip(finishing, tokens, strict=True):
            drafts[i].append(int(token))

    def free(self, request_id: str) -> None:
        if self.seqs.pop(request_id, None) is not None:
            self.kv.forget(request_id)

    def kv_stats(self) -> KVCacheStats:
        return self.kv.stats()


def spec_decoder(config: EngineConfig, draft: DraftModel | None, draft_num_blocks: int, device: torch.device,
                 vocab_size: int, max_model_len: int,
                 lookahead_room: Callable[[Request], int | None]) -> SpecDecoder | None:
    """The engine's speculative decoder: ngram or a draft model's proposer (a layer-skip draft is
    a draft model too); None without speculative_config."""
    spec = config.speculative_config
    if spec is None:
        return None
    assert isinstance(spec, SpeculativeConfig)
    proposer: Proposer
    if draft is None:
        proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    else:
        proposer = DraftModelProposer(draft.model, draft_num_blocks, config.cache_config.block_size, device,
                                      config.scheduler_config.max_num_batched_tokens, vocab_size)
    logger.info("speculative decoding: %s, up to %d tokens per step, off above %s decoding requests",
                spec.method, spec.num_speculative_tokens, spec.disable_by_batch_size or "no limit of")
    return SpecDecoder(spec, proposer, max_model_len, draft.relative_cost if draft is not None else 0.0,
                       lookahead_room)
