"""KV cache groups (kv_groups): sliding-window layers keep only their window's blocks, full
layers keep every block, and the tokens equal transformers'. A tiny random Gemma 3 (window 8,
one KV head of dim 256) covers block sizes, chunked prefill, prefix hits, preemption and the
quantized pools; the real Gemma 3 270M covers prompts three times its 512-token window."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvserve import LLM, SamplingParams
from kvserve.cache.kv_cache_manager import KVCacheManager
from kvserve.cache.kv_groups import FULL_ATTENTION, KVCacheSpec, group_layers
from kvserve.engine.loading import LoadedModel
from kvserve.plan.planner import plan
from kvserve.plan.spec import ModelSpec
from kvserve.quant.reference import load_reference, reference_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def test_groups_split_layers_like_vllm() -> None:
    """Gemma 3 270M: 15 sliding layers in five groups of three, the three full layers in one;
    every layer in exactly one group, at one storage slot."""
    specs = [KVCacheSpec(512) if (i + 1) % 6 else FULL_ATTENTION for i in range(18)]
    groups = group_layers(specs)
    assert [g.spec for g in groups] == [FULL_ATTENTION] + [KVCacheSpec(512)] * 5
    assert groups[0].layers == (5, 11, 17) and groups[1].layers == (0, 1, 2) and groups[2].layers == (3, 4, 6)
    assert sorted(layer for g in groups for layer in g.layers) == list(range(18))


def test_sliding_group_memory_stays_at_the_window() -> None:
    """Decoding one token at a time to 4k and 32k tokens: a sliding group never holds more than
    cdiv(window - 1, block_size) + 1 blocks, a full group holds them all, and the peak is the
    planner's bytes per sequence to the byte (kvserve plan sizes what the engine allocates)."""
    spec = ModelSpec.from_hf_config({"num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1,
                                     "head_dim": 256, "hidden_size": 640, "sliding_window": 512,
                                     "sliding_window_pattern": 6, "vocab_size": 262144}, name="gemma-3-270m")
    groups = group_layers([KVCacheSpec(512) if (i + 1) % 6 else FULL_ATTENTION for i in range(18)])
    for context in (4096, 32768):
        kv = KVCacheManager(6 * 2100 + 1, 16, groups=[g.spec for g in groups])
        peak = 0
        for length in range(1, context + 1):
            assert kv.allocate_slots("r", length)
            peak = max(peak, kv.pool.num_used_blocks)
        stats = kv.stats()
        assert stats.groups[0].blocks_used == context // 16
        assert all(g.blocks_used <= 33 for g in stats.groups[1:])
        pool_block = 3 * 2 * 16 * 256 * 2  # three layers' K and V of one head, bf16
        report = plan(spec, context=context, device_memory="80GB", kv_dtype="bf16")
        assert report.kv_bytes_per_sequence == peak * pool_block == (context // 16 + 5 * 33) * pool_block


# ---------------------------------------------------------------- tiny random Gemma 3


@pytest.fixture(scope="module")
def tiny_gemma(tiny_model_factory: Callable[..., Path]) -> tuple[Path, list[list[int]], list[list[int]]]:
    """The model, prompts (two share a 24-token prefix; all longer than the window) and
    transformers' greedy tokens for them."""
    path = tiny_model_factory("gemma3_text")
    rng = random.Random(0)
    shared = [rng.randrange(3, 256) for _ in range(24)]
    prompts = [shared + [rng.randrange(3, 256) for _ in range(16)], [rng.randrange(3, 256) for _ in range(33)],
               shared + [rng.randrange(3, 256) for _ in range(33)]]
    hf = load_reference(path)
    return path, prompts, [reference_greedy(hf, p, GREEDY.max_tokens)[0] for p in prompts]


@pytest.mark.parametrize("block_size", [4, 16])
def test_tiny_gemma_matches_transformers(tiny_gemma: tuple[Path, list[list[int]], list[list[int]]],
                                         block_size: int) -> None:
    """A mixed batch in 16-token chunks, a pool too small for all of it (preemption), then the
    same prompts again (prefix hits): always transformers' tokens, and sliding groups hold no
    block wholly out of their window."""
    path, prompts, want = tiny_gemma
    pool_block = 2 * 2 * block_size * 256 * 4  # two layers per group, K and V, one head of 256, fp32
    llm = LLM(model=str(path), dtype="float32", block_size=block_size, max_num_batched_tokens=16,
              kv_cache_memory=pool_block * {4: 32, 16: 16}[block_size], enable_prefix_caching=True,
              scheduler_reserve_full_isl=False)  # admitted on a chunk: preempted mid-prefill too
    assert [g.spec.sliding_window for g in llm.engine.kv_groups] == [0, 8, 8]
    kv = llm.engine.kv_manager
    released = 0
    requests = [llm.engine.add_request(p, GREEDY) for p in prompts]
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
        for record in kv.holders().values():
            for spec, table, first in zip(kv.groups, record.tables, record.num_released, strict=True):
                assert len(table) - first <= spec.blocks_held(record.num_tokens, block_size, 16)
                released = max(released, first)
    assert [r.output_token_ids for r in requests] == want
    assert released * block_size >= 24 and llm.engine.num_preemptions > 0
    for prompt, tokens in zip(prompts, want, strict=True):  # each twice in a row: the second from the cache
        assert [o.token_ids for o in llm.generate([prompt, prompt], GREEDY)] == [tokens, tokens]
    assert llm.engine.kv_stats().prefix_cache.hits > 0


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "int8", "int4"])
def test_tiny_gemma_quantized_pools_match_one_table(tiny_gemma: tuple[Path, list[list[int]], list[list[int]]],
                                                    kv_dtype: str) -> None:
    """Quantized pools with groups (each group's own tail slots, blocks shared by storage slot)
    give the very tokens of one table for every layer (--disable-hybrid-kv-cache-manager),
    under swap preemption into tier 1."""
    path, prompts, _ = tiny_gemma
    outputs = []
    for disable in (False, True):
        llm = LLM(model=str(path), dtype="float32", block_size=4, max_num_batched_tokens=16,
                  kv_cache_dtype=kv_dtype, kv_cache_memory="1MiB", kv_offload_memory="8MiB",
                  preemption_mode="swap", disable_hybrid_kv_cache_manager=disable)
        outputs.append([o.token_ids for o in llm.generate(prompts, GREEDY)])
        assert len(llm.engine.kv_groups) == (1 if disable else 3)
    assert outputs[0] == outputs[1]


# ---------------------------------------------------------------- the real Gemma 3 270M


def long_prompts(tokenizer: Any) -> list[list[int]]:
    """Two prompts of 1,500+ tokens sharing their first ~1,000, and a short one."""
    rng = random.Random(1)
    words = ["river", "stone", "garden", "light", "morning", "window", "paper", "music", "city", "forest",
             "quiet", "market", "engine", "letter", "bridge", "winter", "orange", "signal", "harbor", "story"]

    def text(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n))

    shared = text(900)
    first = tokenizer.encode("Notes: " + shared + " " + text(700) + " Summary:")
    second = tokenizer.encode("Notes: " + shared + " " + text(650) + " In short,")
    short = tokenizer.encode("The three primary colours are")
    assert min(len(first), len(second)) > 1500
    return [first, second, short]


def test_gemma3_long_prompts_match_transformers(gemma: LoadedModel) -> None:
    """Prompts three times the window, in one mixed batch with chunked prefill and a pool that
    forces preemption, then again from the prefix cache, then one alone: transformers' tokens
    (fp32, same GGUF), while the sliding layers really dropped their early blocks."""
    prompts = long_prompts(gemma.tokenizer)
    hf = load_reference(gemma.path)
    want = [reference_greedy(hf, p, 8)[0] for p in prompts]
    del hf
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    pool_block = 3 * 2 * 16 * 256 * 4
    llm = LLM(model="gemma-3-270m", loaded=gemma, max_num_batched_tokens=512, kv_cache_memory=pool_block * 560,
              scheduler_reserve_full_isl=False)  # admitted on a chunk: preempted mid-prefill too
    kv = llm.engine.kv_manager
    dropped = 0
    for _ in range(2):
        requests = [llm.engine.add_request(p, params) for p in prompts]
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
            dropped = max([dropped, *(min(r.num_released[1:]) for r in kv.holders().values())])
        assert [r.output_token_ids for r in requests] == want
    stats = llm.engine.kv_stats()
    assert dropped * 16 > 900  # every sliding group released more than 900 tokens' blocks of a sequence
    assert llm.engine.num_preemptions > 0 and stats.prefix_cache.hits > 500
    alone = LLM(model="gemma-3-270m", loaded=gemma, enable_prefix_caching=False, max_num_batched_tokens=512,
                kv_cache_memory=pool_block * 560)
    assert alone.generate([prompts[1]], params)[0].token_ids == want[1]  # a single request, nothing cached
