"""Engine behaviour: on-demand allocation, immediate reclaim, continuous batching, stats."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.engine import LLMEngine


@pytest.fixture()
def engine(tiny_model_factory: Callable[..., Path]) -> LLMEngine:
    llm = LLM(str(tiny_model_factory("llama")), block_size=4, kv_cache_memory="1MiB", max_model_len=256,
              max_num_seqs=3, max_num_batched_tokens=16)
    return llm.engine


def test_blocks_grow_on_demand_and_return_on_finish(engine: LLMEngine) -> None:
    req = engine.add_request([1] * 10, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))
    engine.step()  # prefill of 10 tokens (budget 16): 3 blocks
    assert engine.kv_manager.block_ids(req.request_id).__len__() == 3
    stats = engine.kv_stats()
    assert (stats.live_tokens, stats.allocated_slots, stats.tail_waste) == (10, 12, 2)
    assert stats.utilization == pytest.approx(10 / 12)
    engine.step()
    engine.step()  # 11 + 12 tokens: still 3 blocks
    assert engine.kv_stats().blocks_used == 3
    engine.step()  # token 13 needs a 4th block
    assert engine.kv_stats().blocks_used == 4
    while engine.has_unfinished_requests():
        engine.step()
    assert req.finished and len(req.output_token_ids) == 7
    stats = engine.kv_stats()
    assert stats.blocks_used == 0 and stats.blocks_free == stats.num_blocks
    assert stats.peak_blocks_used == 4 and stats.peak_live_tokens == 16


def test_abort_frees_immediately(engine: LLMEngine) -> None:
    req = engine.add_request([1] * 12, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.kv_stats().blocks_used == 3
    engine.abort_request(req.request_id)
    assert engine.kv_stats().blocks_used == 0 and req.finish_reason == "abort"
    assert not engine.has_unfinished_requests()


def test_continuous_batching_limits_and_chunked_prefill(engine: LLMEngine) -> None:
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    first = engine.add_request([2] * 40, params)
    engine.step()  # 16-token budget: first chunk of a 40-token prompt
    assert first.num_computed_tokens == 16 and not first.output_token_ids
    late = [engine.add_request([3] * 4, params) for _ in range(4)]  # join between steps
    scheduled = engine.scheduler.schedule()
    chunks = scheduled.chunks
    assert scheduled.num_scheduled_tokens <= 16 and not scheduled.preempted
    assert len(engine.scheduler.running) <= 3  # max_num_seqs
    engine.runner.execute(chunks)
    for c in chunks:
        c.request.num_computed_tokens += c.num_tokens
    while engine.has_unfinished_requests():
        engine.step()
        assert engine.num_running <= 3
    assert all(len(r.output_token_ids) == 5 for r in [first, *late])
    assert engine.kv_stats().peak_num_requests == 3


def test_batched_equals_alone(tiny_model_factory: Callable[..., Path]) -> None:
    llm = LLM(str(tiny_model_factory("qwen3")), kv_cache_memory="4MiB", max_num_batched_tokens=32)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [[5] * 3, list(range(1, 70)), [9, 8, 7, 6]]
    together = [o.token_ids for o in llm.generate(prompts, params)]
    alone = [llm.generate([p], params)[0].token_ids for p in prompts]
    assert together == alone


def test_uninitialised_pool_memory_is_never_read(tiny_model_factory: Callable[..., Path]) -> None:
    """Fill every block but the null block with NaN (what fresh torch.empty memory may hold):
    blocks are zeroed on first use, so gathered tails and padding stay finite."""
    path = str(tiny_model_factory("llama"))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[4] * 3, list(range(1, 40)), [7, 7]]
    clean = [o.token_ids for o in LLM(path, block_size=16, kv_cache_memory="1MiB").generate(prompts, params)]
    llm = LLM(path, block_size=16, kv_cache_memory="1MiB")
    cache = llm.engine.kv_cache
    for layer in cache.layers:
        layer.data[1:].fill_(float("nan"))
    assert [o.token_ids for o in llm.generate(prompts, params)] == clean
    assert cache.zeroed_up_to == llm.engine.kv_manager.pool.max_block_id_used > 0
