"""Prefix caching: same tokens as caching off and as transformers, hits where prefixes are
shared, LRU eviction under pressure, and the pool's invariants under random interleavings."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve import LLM, SamplingParams
from kvserve.cache.kv_cache_manager import KVCacheManager
from kvserve.cache.kv_groups import FULL_ATTENTION, KVCacheSpec
from kvserve.engine.loading import LoadedModel
from kvserve.quant.reference import reference_greedy
from tests.conftest import first_divergence_is_near_tie

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def shared_prefix_prompts(block_size: int, vocab: int = 250) -> list[list[int]]:
    """Prompts sharing prefixes of 0 tokens, part of a block, exactly one block, and many blocks."""
    rng = random.Random(block_size)
    base = [rng.randrange(1, vocab) for _ in range(4 * block_size + 40)]

    def tail(n: int) -> list[int]:
        return [rng.randrange(1, vocab) for _ in range(n)]

    return [
        tail(30),  # nothing shared
        base[: max(1, block_size // 2)] + tail(9),  # part of a block
        base[:block_size] + tail(7),  # exactly one block
        base[: 3 * block_size + 5] + tail(11),  # many blocks
        base[: 4 * block_size + 40],  # the whole base...
        base[: 4 * block_size + 40],  # ...twice: all but the last token can come from the cache
    ]


@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_caching_on_equals_off_and_transformers(block_size: int, tiny_model_factory: Callable[..., Path]) -> None:
    import transformers

    path = tiny_model_factory("llama")
    prompts = shared_prefix_prompts(block_size)
    results = {}
    for caching in (False, True):
        llm = LLM(str(path), block_size=block_size, kv_cache_memory="16MiB", enable_prefix_caching=caching)
        first = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        second = [o.token_ids for o in llm.generate(prompts, GREEDY)]  # now everything shared is cached
        assert first == second
        results[caching] = first
        stats = llm.kv_stats()
        assert stats.blocks_used == 0 and stats.live_tokens == 0
        if caching:
            cache = stats.prefix_cache
            assert cache.enabled and cache.hits > 0 and cache.cached_blocks > 0
            total = sum(len(p) for p in prompts)
            assert cache.queries == 2 * total
            assert cache.hits >= total - len(prompts) * block_size  # round two: all but each last block
        else:
            assert stats.prefix_cache.hits == 0 and stats.blocks_cached == 0
    assert results[True] == results[False]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    for prompt, ours in zip(prompts, results[True], strict=True):
        ref, ref_logprobs = reference_greedy(hf, prompt, GREEDY.max_tokens)
        ok, why = first_divergence_is_near_tie(ours, ref, ref_logprobs)
        assert ok, why


@pytest.mark.slow
def test_real_model_shared_system_prompt_matches_transformers(smollm: LoadedModel, hf_smollm: Any) -> None:
    system = ("You are a careful assistant for a hardware store. Answer in one short sentence, "
              "mention the aisle number when you know it, and never invent prices. ") * 3
    questions = ["Where are the hammers?", "Do you sell paint?", "What time do you open?", "Is there parking?"]
    prompts = [list(smollm.tokenizer.encode(system + q)) for q in questions]
    llm = LLM(loaded=smollm, block_size=16, kv_cache_memory="64MiB")
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    shared = len(smollm.tokenizer.encode(system))
    assert sum(o.num_cached_tokens for o in outs) >= (len(prompts) - 1) * (shared // 16 - 1) * 16
    for prompt, out in zip(prompts, outs, strict=True):
        ref, ref_logprobs = reference_greedy(hf_smollm, prompt, 12)
        ok, why = first_divergence_is_near_tie(out.token_ids, ref, ref_logprobs)
        assert ok, why


def test_lru_eviction_under_pressure_and_recompute_after_preemption(tiny_model_factory: Callable[..., Path]) -> None:
    path = str(tiny_model_factory("llama"))
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 250) for _ in range(60)] for _ in range(12)]
    # 64 blocks of 4 tokens: far fewer than the 12 prompts' blocks, so cached blocks get evicted
    llm = LLM(path, block_size=4, kv_cache_memory=f"{65 * 4 * 512}B", max_model_len=128)
    ref = LLM(path, block_size=4, kv_cache_memory="8MiB", enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref.generate(prompts, params)]
    stats = llm.kv_stats()
    assert stats.prefix_cache.evictions > 0 and stats.num_preemptions > 0
    assert stats.blocks_used == 0 and stats.prefix_cache.evictable_blocks == stats.blocks_cached
    # a preempted request's blocks keep their keys: its recompute finds them
    assert any(o.num_preemptions > 0 and o.num_cached_tokens > 0 for o in outs)


def test_lpm_admits_the_longest_cached_prefix_first_without_starving(
        tiny_model_factory: Callable[..., Path]) -> None:
    path = str(tiny_model_factory("llama"))
    shared = list(range(1, 65))
    llm = LLM(path, block_size=16, kv_cache_memory="8MiB", max_num_seqs=1, scheduling_policy="lpm")
    llm.generate([[*shared, 99]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    cold = engine.add_request(list(range(100, 130)), params).request_id  # arrives first, nothing cached
    warm = [engine.add_request([*shared, 200 + i], params).request_id for i in range(12)]
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order[0] == warm[0]  # the cached prefix goes ahead of the earlier arrival
    assert order.index(cold) <= engine.scheduler.max_skips + 1  # ...but the cold one is not starved
    assert set(order) == {cold, *warm}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["submit", "grow", "finish", "preempt"]), st.integers(0, 9),
                          st.integers(1, 40)), min_size=1, max_size=60),
       st.sampled_from([1, 4, 8]), st.sampled_from([0, 3, 9]))
def test_invariants_under_random_interleavings(ops: list[tuple[str, int, int]], block_size: int,
                                               window: int) -> None:
    """Simulate the engine's use of the manager, writing token ids as the 'K/V' of each slot:
    a block is only ever written by a request that holds it alone; every cache hit finds exactly
    the tokens the request expects; ref counts equal table membership; after drain all is free."""
    groups = [FULL_ATTENTION] + ([KVCacheSpec(window)] * 2 if window else [])  # with window: hybrid
    manager = KVCacheManager(num_blocks=24 * len(groups), block_size=block_size, enable_prefix_caching=True,
                             groups=groups)
    contents: dict[int, list[int | None]] = {}
    prefixes = [[7] * 20, [7] * 12 + [8] * 8, [9] * 20]  # requests share (parts of) these
    tokens: dict[str, list[int]] = {}
    computed: dict[str, int] = {}
    counter = 0

    def write(rid: str, start: int, end: int) -> None:
        for table in manager.requests[rid].tables:
            for pos in range(start, end):
                block = table[pos // block_size]
                assert block.ref_cnt == 1, "a shared block would be overwritten"
                contents.setdefault(block.block_id, [None] * block_size)[pos % block_size] = tokens[rid][pos]

    def check() -> None:
        holders: dict[int, int] = {}
        for record in manager.holders().values():
            for table in record.live_tables():
                for block in table:
                    holders[block.block_id] = holders.get(block.block_id, 0) + 1
        for block in manager.pool.blocks[1:]:
            assert block.ref_cnt == holders.get(block.block_id, 0) >= 0
            assert (block.prev_free is not None) == (block.ref_cnt == 0)
        for key, block in manager.pool.cached_blocks.items():
            assert block.block_hash == key

    for op, which, size in ops:
        live = sorted(manager.holders())
        if op == "submit" or not live:
            rid = f"r{counter}"
            counter += 1
            tokens[rid] = prefixes[which % 3][: size % 21] + [100 + counter] * (1 + size % 5)
            reader = (lambda r: lambda s, e: tokens[r][s:e])(rid)
            hits = manager.find_cached_prefix(rid, len(tokens[rid]), reader)
            for group in hits.blocks:  # what the cache gives back is what this prompt needs
                assert len(group) == hits.num_blocks
                for i, block in enumerate(group):
                    if block is not None:
                        assert contents[block.block_id] == tokens[rid][i * block_size : (i + 1) * block_size]
            start = hits.num_blocks * block_size
            if manager.allocate_slots(rid, len(tokens[rid]), reader, hits):
                write(rid, start, len(tokens[rid]))
                computed[rid] = len(tokens[rid])
        else:
            rid = live[which % len(live)]
            if op == "grow":
                tokens[rid].append(50 + size)
                reader = (lambda r: lambda s, e: tokens[r][s:e])(rid)
                if manager.allocate_slots(rid, len(tokens[rid]), reader):
                    write(rid, computed[rid], len(tokens[rid]))
                    computed[rid] = len(tokens[rid])
                else:
                    tokens[rid].pop()
            else:  # finish or preempt: blocks go back, published ones stay cached
                manager.free(rid)
                if op == "finish":
                    manager.forget(rid)
        check()
    for rid in list(manager.holders()):
        manager.free(rid)
    check()
    assert manager.pool.num_free_blocks == manager.pool.num_usable_blocks
    assert manager.stats().live_tokens == 0
