"""KV tier 1 (host memory): prefix blocks the pool evicts are demoted instead of lost and
promoted back on a hit, in their stored format; outputs never change."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve import LLM, SamplingParams
from kvserve.cache.block_pool import KVCacheBlock
from kvserve.cache.kv_cache_manager import KVCacheManager
from kvserve.cache.kv_tiers import TierIndex


def documents(num_docs: int, length: int, questions: int) -> list[list[int]]:
    """Document-QA prompts: each document asked ``questions`` times, documents interleaved so the
    pool has evicted a document before it is asked again."""
    docs = [[(7 * d + 13 * i) % 250 + 3 for i in range(length)] for d in range(num_docs)]
    return [docs[d] + [200 + q, 201 + q] for q in range(questions) for d in range(num_docs)]


@pytest.mark.parametrize("kv_dtype,block_size", [("fp32", 16), ("fp32", 64), ("bf16", 16), ("int4", 16),
                                                 ("int4", 64)])
def test_tier_outputs_equal_no_tier_with_a_working_set_five_times_the_pool(
        kv_dtype: str, block_size: int, tiny_model_factory: Callable[..., Path]) -> None:
    path = str(tiny_model_factory("llama"))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    common = dict(kv_cache_dtype=kv_dtype, block_size=block_size, max_model_len=320, max_num_seqs=2)
    budget = _pool_bytes(path, common, tokens=320)
    base = LLM(path, **common, kv_cache_memory=budget)
    num_docs = -(-5 * base.engine.kv_manager.capacity_tokens // 256)  # the documents are 5x the pool
    prompts = documents(num_docs, length=256, questions=2)
    tiered = LLM(path, **common, kv_cache_memory=budget, kv_offload_memory="64MiB")
    expected = [o.token_ids for o in _one_by_one(base, prompts, params)]
    outputs = _one_by_one(tiered, prompts, params)
    assert [o.token_ids for o in outputs] == expected
    tier = tiered.kv_stats().tiers[0]
    assert tier.hits > 0 and tier.blocks_in >= tier.blocks_out
    cached = sum(o.num_cached_tokens for o in outputs[num_docs:])  # the second round reads its documents back
    assert cached >= num_docs * (256 // block_size - 1) * block_size
    assert sum(o.num_cached_tokens for o in _one_by_one(base, prompts, params)[num_docs:]) < cached


def _pool_bytes(path: str, common: dict, tokens: int) -> int:
    """A pool that holds about ``tokens`` tokens (plus a tail run for int4)."""
    probe = LLM(path, **common, kv_cache_memory="8MiB").engine
    tail = probe.tail_blocks
    blocks = max(2 * tail, -(-tokens // probe.config.block_size) + 1 + tail)
    return blocks * probe.kv_block_bytes


def _one_by_one(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list:
    return [llm.generate([p], params)[0] for p in prompts]


@given(ops=st.lists(st.tuples(st.sampled_from(["submit", "finish"]), st.integers(0, 9), st.integers(1, 80)),
                    max_size=60),
       num_blocks=st.integers(6, 30), tier_blocks=st.integers(1, 12))
@settings(max_examples=200, deadline=None)
def test_tier_bookkeeping_never_loses_duplicates_or_mislabels(ops: list[tuple[str, int, int]], num_blocks: int,
                                                               tier_blocks: int) -> None:
    """Random submits (with prefix lookups through both tiers) and finishes: a key is in the pool
    or the tier, never both; tier slots are unique and within capacity; every promotion reads a
    slot last written with the same key; after draining, every byte is accounted."""
    tier = TierIndex("cpu", tier_blocks, 100)
    kv = KVCacheManager(num_blocks, 4, enable_prefix_caching=True, host_tier=tier)
    content: dict[int, bytes] = {}  # tier slot -> key whose bytes it holds (after the moves ran)
    pool_content: dict[int, bytes] = {}  # pool block -> key whose bytes it holds
    for op, rid, length in ops:
        request_id = f"r{rid}"
        if op == "finish" or request_id in kv.block_tables:
            kv.free(request_id)
            kv.forget(request_id)
            continue
        tokens = (lambda doc: lambda a, b: [doc * 1000 + i for i in range(a, b)])(rid % 3)
        cached = kv.find_cached_prefix(request_id, length, tokens)
        if kv.allocate_slots(request_id, length, tokens, cached):
            moves = kv.take_tier_moves()
            assert moves is not None
            for block, slot in moves.demotions:
                content[slot] = pool_content[block]
            for slot, block in moves.promotions:
                pool_content[block] = content[slot]
            read = {b.block_id for b in cached if isinstance(b, KVCacheBlock)} | {b for _, b in moves.promotions}
            for block in kv.block_tables[request_id]:
                if block.block_hash is None:
                    continue
                if block.block_id in read:  # a hit: the bytes there must be its key's
                    assert pool_content[block.block_id] == block.block_hash
                else:  # computed by this step
                    pool_content[block.block_id] = block.block_hash
        assert not set(kv.pool.cached_blocks) & set(tier.slots), "a key in two tiers"
        assert len(set(tier.slots.values())) == len(tier.slots) <= tier_blocks
        for key, slot in tier.slots.items():  # a slot holds its key's bytes once this step's moves ran
            assert content.get(slot) == key
    for rid in list(kv.block_tables):
        kv.free(rid)
    stats = tier.stats()
    assert stats.blocks == len(tier.slots) and stats.used_bytes == 100 * stats.blocks
    assert stats.blocks_in - stats.blocks_out - stats.evictions == stats.blocks
