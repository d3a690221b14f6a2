"""Engine behaviour: on-demand allocation, immediate reclaim, continuous batching, stats."""

from __future__ import annotations

import logging
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
    engine.kv_cache.prepare(scheduled.storage)
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


def _pool_llm(tiny_model_factory: Callable[..., Path], num_blocks: int, reserve: bool) -> LLM:
    block_bytes = 4 * 2 * 2 * 2 * 16 * 4  # 4 tokens, K and V, 2 layers, 2 KV heads of 16, fp32
    llm = LLM(str(tiny_model_factory("llama")), block_size=4, kv_cache_memory=block_bytes * (num_blocks + 1),
              max_num_seqs=8, max_num_batched_tokens=16, scheduler_reserve_full_isl=reserve)
    assert llm.engine.num_blocks - 1 == num_blocks
    return llm


def _run_counting_prefill_preemptions(llm: LLM, prompts: list[list[int]], params: SamplingParams
                                      ) -> tuple[list[list[int]], int]:
    """Outputs, and how many requests were preempted before their prompt was all computed."""
    requests = [llm.engine.add_request(p, params) for p in prompts]
    mid_prefill = 0
    while llm.engine.has_unfinished_requests():
        prefilling = {r.request_id for r in requests if 0 < r.num_computed_tokens < len(r.prompt_token_ids)}
        llm.engine.step()
        mid_prefill += sum(1 for r in requests if r.request_id in prefilling and r.num_computed_tokens == 0)
    return [r.output_token_ids for r in requests], mid_prefill


def test_admission_control_reserves_whole_prompts(tiny_model_factory: Callable[..., Path]) -> None:
    """Five 40-token prompts (10 blocks each) in 16-token chunks, a 20-block pool: admitted on
    their first chunk they overcommit the pool and are preempted mid-prefill; with admission
    control (the default) a prompt starts only when it can finish, so nobody is, and the tokens
    are the same."""
    prompts = [[7 + i] * 39 + [i] for i in range(5)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    eager, eager_mid = _run_counting_prefill_preemptions(_pool_llm(tiny_model_factory, 20, False), prompts, params)
    llm = _pool_llm(tiny_model_factory, 20, True)
    reserved, reserved_mid = _run_counting_prefill_preemptions(llm, prompts, params)
    assert eager_mid > 0 and reserved_mid == 0 and llm.engine.num_preemptions == 0
    assert reserved == eager


def test_admission_control_still_preempts_on_decode_growth(tiny_model_factory: Callable[..., Path]) -> None:
    """Prompts fit when admitted, but their outputs outgrow a 12-block pool: the newest is
    preempted (loss-free) and the tokens equal those of a pool big enough for all."""
    prompts = [[3 + i] * 6 for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    llm = _pool_llm(tiny_model_factory, 12, True)
    tight = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    roomy = [o.token_ids for o in _pool_llm(tiny_model_factory, 64, True).generate(prompts, params, use_tqdm=False)]
    assert llm.engine.num_preemptions > 0 and tight == roomy


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_emulated_16_bit_matmuls_are_announced(dtype: str, tiny_model_factory: Callable[..., Path],
                                              caplog: pytest.LogCaptureFixture) -> None:
    """A 16-bit model on a CPU whose torch has no native matmul for it (an AVX2 CPU) is several
    times slower than float32: the engine says so at start-up, and only then."""
    import logging

    import torch

    native = {"bfloat16": torch.ops.mkldnn._is_mkldnn_bf16_supported,
              "float16": torch.ops.mkldnn._is_mkldnn_fp16_supported}.get(dtype, lambda: True)()
    logger = logging.getLogger("kvserve")  # once an LLM is built it does not propagate to caplog's root
    logger.addHandler(caplog.handler)
    try:
        LLM(str(tiny_model_factory("llama")), dtype=dtype, kv_cache_memory="1MiB", max_model_len=64)
    finally:
        logger.removeHandler(caplog.handler)
    # one record, maybe seen twice (caplog's handler is on the root logger too, until kvserve stops propagating)
    warned = list({id(r): r.message for r in caplog.records if "no native" in r.message}.values())
    assert len(warned) == (0 if native else 1)
    if warned:
        assert dtype in warned[0] and "--dtype float32" in warned[0]


def test_the_cpu_pool_takes_no_more_than_its_requests_can_fill(tiny_model_factory: Callable[..., Path]) -> None:
    """Unsized on CPU, the pool is what max_num_seqs sequences of max_model_len fill (capped at
    4 GiB), not 0.9 of the host's RAM; the start-up line says so. An explicit
    gpu_memory_utilization still takes its fraction of RAM."""
    path = str(tiny_model_factory("llama"))
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("kvserve").addHandler(handler)
    try:
        llm = LLM(path, block_size=16, max_model_len=256, max_num_seqs=4)
    finally:
        logging.getLogger("kvserve").removeHandler(handler)
    assert llm.engine.kv_stats().num_blocks == 4 * 256 // 16 + 1  # + the spare block; the null block apart
    start_up = "\n".join(r.getMessage() for r in records)
    assert "from the CPU default" in start_up and "max_num_seqs=4 sequences of max_model_len=256" in start_up
    fraction = LLM(path, block_size=16, max_model_len=256, max_num_seqs=4, gpu_memory_utilization=0.05)
    assert fraction.engine.kv_stats().num_blocks > 4 * 256 // 16 + 1
