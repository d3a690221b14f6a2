"""Turns a scheduled step into tensors, runs the model and samples.

Batch layout: decodes and verify chunks first (through the decode kernel one call for all of
them, one query per token), then prefill chunks of equal length together, each group one padded
attention call. Logits are computed only for the last token of chunks that complete their
sequence (and at each draft of a verify chunk).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from kvserve.cache.kv_cache import PagedKVCache
from kvserve.cache.kv_layer import KVWriteIndex, LayerKV, TailPlan
from kvserve.engine.sampling import SampleResult, TokenHistory, sample, token_logprobs
from kvserve.engine.spec_decode import verify
from kvserve.engine.step_plan import ScheduledChunk
from kvserve.model.attention import (
    AttentionGroup,
    AttentionMetadata,
    Cascade,
    attention_bias,
    kv_write_rows,
    use_decode_kernel,
    use_prefill_kernel,
)
from kvserve.model.llama import LlamaForCausalLM


def one_query_per_token(chunk: ScheduledChunk) -> bool:
    """A decode, or a verify chunk (its last real token and its drafts): attention for each of
    its tokens is a decode query over the sequence up to that token."""
    return chunk.num_tokens == 1 or bool(chunk.draft_token_ids)


# When a decode batch reads a prefix all its sequences share once for all of them (cascade):
# at least CASCADE_MIN_BATCH queries, and shared tokens x queries >= CASCADE_MIN_READS. Measured
# (benchmarks/cascade_kernel.py: bf16, 9/3 heads of 64, 2 threads): below these the extra work
# costs more than the reads saved (12 x 256: 0.78x; 24 x 512: 1.19x; 32 x 992: 1.56x).
CASCADE_MIN_BATCH = 12
PROMPT_LOGPROBS_ROWS = 256  # prompt positions per LM-head call (256 x a 49k vocabulary: 48 MiB of logits)
CASCADE_MIN_READS = 12288


def _windowed(chunks: list[ScheduledChunk], window: int) -> bool:
    """A sliding ``window`` cuts into some chunk's sequence (else it masks nothing)."""
    return bool(window) and max(c.request.num_computed_tokens + c.num_tokens for c in chunks) > window


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: PagedKVCache, device: torch.device,
                 layer_groups: list[int] | None = None, layer_windows: list[int] | None = None,
                 cascade: bool = True) -> None:
        """Runs chunks whose block tables the scheduler set (ScheduledChunk.blocks), on
        ``kv_cache``'s storage, prepared for the step by the caller (PagedKVCache.prepare).
        ``layer_groups[i]``: the KV cache group (kv_groups) of layer i (one group by default);
        ``layer_windows[i]``: its sliding window (0: full attention), which its group's spec
        equals unless every layer shares one full-attention group (then only masks apply it).
        ``cascade``: decode batches read a prefix all their sequences share once (Cascade)."""
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.block_size = kv_cache.block_size
        self.dtype = kv_cache.model_dtype
        self.layer_groups = layer_groups or [0] * model.config.num_layers
        self.num_kv_groups = max(self.layer_groups) + 1
        self.layer_windows = layer_windows or [0] * model.config.num_layers
        # MLA's latent pool is read by paged_latent_attention with masks, never by the kernels
        self.latent = model.config.mla is not None
        self.decode_kernel = use_decode_kernel(device) and not self.latent
        pools_as_is = all(layer.holds_as_is(self.dtype) for layer in kv_cache.storage)
        self.prefill_kernel = use_prefill_kernel(device.type, model.config.head_dim, self.dtype,
                                                 pools_as_is) and not self.latent
        self.cascade = cascade and self.decode_kernel and self.prefill_kernel
        # sees every layer's new K (after rotary) and V before they are cached (calibration)
        self.kv_observer: Callable[[LayerKV, torch.Tensor, torch.Tensor], None] | None = None
        self.query_observer: Callable[[LayerKV, torch.Tensor], None] | None = None
        self.eos_token_ids: frozenset[int] = frozenset()  # set by the engine (min_tokens masks them)

    def _groups(self, buckets: list[list[ScheduledChunk]], kv_group: int, window: int) -> list[AttentionGroup]:
        """The attention calls of one step for layers of ``kv_group`` and ``window``: ``buckets``
        are the chunks in batch order, decodes and verify chunks first. Through the decode kernel
        those all make one call of one query per token, each over its own prefix (the prefill
        kernel's widened copy of every sequence would cost more than a few drafts' attention);
        otherwise each bucket is a call of its own."""
        groups, token_start = [], 0
        queries = list(itertools.takewhile(lambda b: one_query_per_token(b[0]), buckets))
        merged = [c for bucket in queries for c in bucket]
        if merged and self.decode_kernel and not _windowed(merged, window):
            groups.append(self._per_token_group(merged, kv_group))
            token_start, buckets = groups[0].batch, buckets[len(queries) :]
        for bucket in buckets:
            groups.append(self._group(bucket, token_start, kv_group, window))
            token_start += bucket[0].num_tokens * len(bucket)
        return groups

    def _per_token_group(self, chunks: list[ScheduledChunk], kv_group: int) -> AttentionGroup:
        """One decode-kernel call for the leading ``chunks`` of the batch, one query per token:
        query i of a chunk of n sees the keys up to its own position (seq_len - n + 1 + i)."""
        counts = torch.tensor([c.num_tokens for c in chunks], device=self.device)
        tables = [c.kv.groups[kv_group].block_ids for c in chunks]
        width = max(len(ids) for ids in tables)
        block_tables = torch.tensor([ids + [0] * (width - len(ids)) for ids in tables], device=self.device)
        seen = [c.cache_len - c.num_tokens + 1 + i for c in chunks for i in range(c.num_tokens)]
        tail_slots = None
        if self.kv_cache.uses_tail:
            tail_slots = torch.tensor([c.kv.groups[kv_group].tail_slot for c in chunks],
                                      device=self.device).repeat_interleave(counts)
        block_tables = block_tables.repeat_interleave(counts, dim=0)
        lens = torch.tensor(seen, device=self.device)
        cascade = self._cascade(block_tables, lens, min(seen) - 1) if self.cascade and len(seen) >= CASCADE_MIN_BATCH \
            else None
        return AttentionGroup(0, len(seen), 1, block_tables, True, None, lens, False, None, tail_slots, cascade)

    def _cascade(self, block_tables: torch.Tensor, lens: torch.Tensor, before_queries: int,
                 queries: int = 1) -> Cascade | None:
        """The leading blocks every table shares, as a Cascade, where reading them once for all
        the group's queries pays (CASCADE_MIN_READS). They end by ``before_queries``, the
        earliest query's position: each query sees them all, and keys of its own past them."""
        same = (block_tables == block_tables[:1]).all(dim=0)
        shared = min(int(same.int().cumprod(0).sum()), before_queries // self.block_size)
        if shared == 0 or shared * self.block_size * len(lens) * queries < CASCADE_MIN_READS:
            return None
        return Cascade(block_tables[:1, :shared], torch.tensor([shared * self.block_size], device=self.device),
                       block_tables[:, shared:].contiguous(), lens - shared * self.block_size)

    def _group(self, chunks: list[ScheduledChunk], token_start: int, kv_group: int, window: int) -> AttentionGroup:
        """One attention call for chunks of equal query length, over ``kv_group``'s tables, for
        layers with this sliding ``window`` (0: none). Tables are read from their first live
        block on, and keys out of the window are masked (the kernels take no window: such calls
        use the torch path)."""
        query_len = chunks[0].num_tokens
        seq_lens = [c.cache_len for c in chunks]
        windowed = _windowed(chunks, window)
        # a window that cuts into the sequences reads each table from its first live block; else
        # every key is in every query's window: the whole table, plain causal attention
        tables = [c.kv.groups[kv_group] for c in chunks]
        live = [(table.num_released, table.block_ids[table.num_released :]) if windowed else (0, table.block_ids)
                for table in tables]
        width = max(len(ids) for _, ids in live)
        block_tables = torch.tensor([ids + [0] * (width - len(ids)) for _, ids in live], device=self.device)
        lens = torch.tensor(seq_lens, device=self.device)
        fresh = query_len > 1 and all(c.request.num_computed_tokens == 0 for c in chunks) and not windowed
        tail_slots = None
        if self.kv_cache.uses_tail:
            tail_slots = torch.tensor([table.tail_slot for table in tables], device=self.device)
        if not windowed and (self.decode_kernel if query_len == 1 else self.prefill_kernel):
            # prefill chunks over one cached prefix (each chunk's own keys transposed once, not the prefix's)
            cascade = None
            if self.cascade and query_len > 1 and len(chunks) > 1:
                cascade = self._cascade(block_tables, lens, min(seq_lens) - query_len, query_len)
            return AttentionGroup(token_start, len(chunks), query_len, block_tables, True, None, lens, fresh, None,
                                  tail_slots, cascade)
        kv_len = width * self.block_size
        # Query i of a chunk sits at position (seq_len - query_len + i) and sees keys <= it (and,
        # in a window, keys > it - window); the table starts at block ``first`` of the sequence.
        first = torch.tensor([first for first, _ in live], device=self.device)
        key_pos = (first[:, None] * self.block_size + torch.arange(kv_len, device=self.device)[None, :])[:, None, :]
        query_pos = lens[:, None] - query_len + torch.arange(query_len, device=self.device)[None, :]
        mask = key_pos <= query_pos[:, :, None]
        if windowed:
            mask &= key_pos > query_pos[:, :, None] - window
        mask = mask.unsqueeze(1)
        if windowed:  # gather finds a sequence's tail block by its length, counted from the table's start
            lens = lens - first * self.block_size
        bias = None
        if query_len == 1 and not self.latent:
            # measured on CPU: batched matmuls win for decode, SDPA's flash kernel for prefill
            cfg = self.model.config
            bias = attention_bias(mask, cfg.num_heads, cfg.num_kv_heads, self.dtype)
        return AttentionGroup(token_start, len(chunks), query_len, block_tables, False, mask, lens, fresh, bias,
                              tail_slots)

    def _tail_plan(self, chunks: list[ScheduledChunk], kv_group: int) -> TailPlan:
        """Moves for pools with tail slots (see TailPlan): a block is quantized in the step that
        fills it; tokens of a sequence's partial last block live in its tail slot until then."""
        bs = self.block_size
        lists: dict[str, list[int]] = {name: [] for name in TailPlan._fields}
        token = 0
        one_block = True  # every chunk within one block: the fused op writes all tokens to the tails
        for chunk in chunks:
            end = chunk.cache_len  # cache positions: eviction or compaction moved tokens up
            start = end - chunk.num_tokens
            slot, table = chunk.kv.groups[kv_group].tail_slot, chunk.kv.groups[kv_group].block_ids
            first_new = start // bs
            one_block = one_block and (end - 1) // bs == first_new
            if one_block:
                lists["token_rows"] += range(slot * bs + start % bs, slot * bs + (end - 1) % bs + 1)
                if end % bs == 0:
                    lists["fill_rows"] += range(slot * bs, slot * bs + bs)
            if start % bs:  # continue the partial block held in the tail slot
                stop = min(end, (first_new + 1) * bs)
                lists["pre_tokens"] += range(token, token + stop - start)
                lists["pre_rows"] += range(slot * bs + start % bs, slot * bs + stop - (first_new * bs))
                if stop == (first_new + 1) * bs:  # it filled: quantize it from the tail slot
                    row = len(lists["block_ids"]) * bs
                    lists["block_ids"].append(table[first_new])
                    lists["stage_tail_rows"] += range(slot * bs, slot * bs + bs)
                    lists["stage_from_tail"] += range(row, row + bs)
                first_new += 1
            for j in range(first_new, end // bs):  # blocks filled entirely by this chunk
                row = len(lists["block_ids"]) * bs
                lists["block_ids"].append(table[j])
                lists["stage_tokens"] += range(token + j * bs - start, token + (j + 1) * bs - start)
                lists["stage_token_rows"] += range(row, row + bs)
            last = end // bs
            if end % bs and last >= first_new:  # a new partial last block: into the tail slot
                lists["post_tokens"] += range(token + last * bs - start, token + end - start)
                lists["post_rows"] += range(slot * bs, slot * bs + end % bs)
            token += chunk.num_tokens
        if not one_block:
            lists["token_rows"], lists["fill_rows"] = [], []
        return TailPlan(*(torch.tensor(lists[name], dtype=torch.long, device=self.device)
                          for name in TailPlan._fields))

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> list[tuple[ScheduledChunk, SampleResult]]:
        """Run one step. Returns each chunk that sampled (in batch order) with its tokens: one, or
        for a chunk carrying drafts, the accepted drafts and the target's next token (verify)."""
        ordered, hidden = self.forward(chunks)
        self._record_prompt_logprobs(ordered, hidden)
        logit_rows: list[int] = []
        sampled: list[ScheduledChunk] = []
        row = 0
        for chunk in ordered:
            row += chunk.num_tokens
            if chunk.completes_sequence:  # the last real token, then every draft
                logit_rows += range(row - 1 - len(chunk.draft_token_ids), row)
                sampled.append(chunk)
        if not sampled:
            return []
        logits = self.model.compute_logits(hidden[torch.tensor(logit_rows, device=self.device)])
        history = None
        if any(c.request.params.logit_bias or c.request.params.penalized or c.request.params.min_tokens
               for c in sampled):
            history = [TokenHistory(c.request.prompt_token_ids, c.request.output_token_ids,
                                    c.request.params.stop_ids(self.eos_token_ids)) for c in sampled]
        plain = [i for i, c in enumerate(sampled) if not c.draft_token_ids]
        starts = list(itertools.accumulate((len(c.draft_token_ids) + 1 for c in sampled), initial=0))
        results: list[SampleResult | None] = [None] * len(sampled)
        if plain:
            rows = [starts[i] for i in plain]
            batch = sample(logits[rows] if len(rows) < len(logit_rows) else logits,
                           [sampled[i].request.params for i in plain], [sampled[i].request.generator for i in plain],
                           None if history is None else [history[i] for i in plain],
                           [sampled[i].request.grammar for i in plain])
            for j, i in enumerate(plain):
                results[i] = SampleResult(batch.token_ids[j : j + 1],
                                          None if batch.logprobs is None else batch.logprobs[j : j + 1],
                                          None if batch.top_logprobs is None else batch.top_logprobs[j : j + 1])
        for i, chunk in enumerate(sampled):
            if chunk.draft_token_ids:
                request = chunk.request
                results[i] = verify(logits[starts[i] : starts[i + 1]], chunk.draft_token_ids,
                                    request.params, request.generator, None if history is None else history[i],
                                    request.grammar)
        return [(chunk, result) for chunk, result in zip(sampled, results, strict=True) if result is not None]

    def _record_prompt_logprobs(self, ordered: list[ScheduledChunk], hidden: torch.Tensor) -> None:
        """For requests that ask (params.prompt_logprobs): each prompt token's log-probability
        given the ones before it, from the hidden states of this step's prefill chunk. Positions
        a recompute (after preemption) runs again were recorded already and are skipped."""
        row = 0
        for chunk in ordered:
            request, n = chunk.request, chunk.request.params.prompt_logprobs
            start = request.num_computed_tokens
            first = max(start, len(request.prompt_logprobs))
            last = min(start + chunk.num_tokens, request.num_prompt_tokens - 1)  # position p scores token p + 1
            row += chunk.num_tokens
            if n is None:
                continue
            for at in range(first, last, PROMPT_LOGPROBS_ROWS):
                end = min(at + PROMPT_LOGPROBS_ROWS, last)
                base = row - chunk.num_tokens - start  # the chunk's first row, less its first position
                logits = self.model.compute_logits(hidden[base + at : base + end])
                chosen, top = token_logprobs(logits, request.prompt_token_ids[at + 1 : end + 1], [n] * (end - at))
                request.prompt_logprobs += chosen
                request.prompt_top_logprobs += top

    @torch.inference_mode()
    def forward(self, chunks: list[ScheduledChunk]) -> tuple[list[ScheduledChunk], torch.Tensor]:
        """Write the chunks' K/V and return (chunks in batch order, final hidden state of every
        token in that order). The caller advances num_computed_tokens."""
        # decodes and verify chunks first, then prefill chunks by length (verify chunks apart from
        # prefill chunks of their length)
        by_len: dict[tuple[bool, int], list[ScheduledChunk]] = {}
        for chunk in chunks:
            by_len.setdefault((not one_query_per_token(chunk), chunk.num_tokens), []).append(chunk)
        buckets = [by_len[key] for key in sorted(by_len)]
        ordered = [c for bucket in buckets for c in bucket]
        input_ids: list[int] = []
        positions: list[int] = []
        for chunk in ordered:
            request = chunk.request
            start, end = request.num_computed_tokens, request.num_computed_tokens + chunk.num_tokens
            input_ids += request.token_ids(start, end - len(chunk.draft_token_ids)) + chunk.draft_token_ids
            positions += range(start, end)
        writes = [self._write_index(ordered, group) for group in range(self.num_kv_groups)]
        metas: dict[tuple[int, int], AttentionMetadata] = {}
        for group, window in zip(self.layer_groups, self.layer_windows, strict=True):
            if (group, window) not in metas:
                slot_mapping, write = writes[group]
                metas[group, window] = AttentionMetadata(slot_mapping, write, self._groups(buckets, group, window),
                                                         fused_rope_write=self.decode_kernel,
                                                         kv_observer=self.kv_observer,
                                                         query_observer=self.query_observer)
        hidden = self.model(
            torch.tensor(input_ids, device=self.device),
            torch.tensor(positions, device=self.device),
            self.kv_cache.layers,
            [metas[key] for key in zip(self.layer_groups, self.layer_windows, strict=True)],
        )
        return ordered, hidden

    def _write_index(self, ordered: list[ScheduledChunk], kv_group: int) -> tuple[torch.Tensor, KVWriteIndex]:
        """(slot mapping, write index): where this step's tokens go in one KV cache group's
        tables (shared by the group's layers)."""
        slots: list[int] = []
        for chunk in ordered:
            start = chunk.request.num_computed_tokens
            slots += chunk.kv.slots(start, start + chunk.num_tokens, self.block_size, kv_group)
        slot_mapping = torch.tensor(slots, device=self.device)
        kv_heads = self.model.config.num_kv_heads
        write = KVWriteIndex(
            kv_write_rows(slot_mapping, self.block_size, self.kv_cache.rows_per_token),
            kv_write_rows(slot_mapping, self.block_size, kv_heads) if self.kv_cache.uses_value_scales else None,
            self._tail_plan(ordered, kv_group) if self.kv_cache.uses_tail else None)
        return slot_mapping, write
