"""KV eviction: StreamingLLM's attention sinks + recent window in the paged cache."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.cache.kv_retention import StreamingWindow
from kvserve.cache.kv_stats import KVCacheStats
from kvserve.config import ConfigError, EngineConfig
from kvserve.engine.engine import LLMEngine
from tests.test_cache_invariants import check_manager


def prompt(n: int, seed: int = 0) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(256) for _ in range(n)]


def streaming_engine(model: Path, window: int, sinks: int = 4, block_size: int = 8, **kwargs: Any) -> LLMEngine:
    return LLMEngine(EngineConfig.from_settings(model=str(model), dtype="float32", block_size=block_size,
                                  kv_cache_memory=kwargs.pop("kv_cache_memory", "4MiB"), kv_eviction="streaming",
                                  kv_sink_tokens=sinks, kv_window=window, **kwargs))


def run_checked(engine: LLMEngine, prompts: list[list[int]], max_tokens: int,
                on_step: Callable[[LLMEngine], None] | None = None) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.add_request(p, params).request_id for p in prompts]
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out.token_ids
        check_manager(engine.kv_manager)
        if on_step is not None:
            on_step(engine)
    assert engine.kv_manager.pool.num_used_blocks == 0, "blocks leaked"
    return [outputs[i] for i in ids]


def hf_streaming_greedy(model: Any, prompt_ids: list[int], max_new_tokens: int, sinks: int, window: int,
                        block_size: int) -> list[int]:
    """The same policy through HF's own model, cache and rotary code: before each decode step,
    for the new token at absolute position p, the window starts at the block holding position
    (p - window + 1); keep the first ``sinks`` tokens and, from the window's start less the
    sink blocks' spare slots, every token on. Queries and those keys keep absolute positions;
    the sink keys are turned by the evicted count from their keys as first computed."""
    from transformers import DynamicCache
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    sink_len = -(-sinks // block_size) * block_size
    cache = DynamicCache()
    tokens: list[int] = []
    originals: list[torch.Tensor] | None = None
    shift = 0
    inputs = torch.tensor([prompt_ids])
    positions = torch.arange(len(prompt_ids))[None]
    with torch.no_grad():
        for _ in range(max_new_tokens):
            p = int(positions[0, -1])  # the query's absolute position
            window_start = (p - window + 1) // block_size * block_size
            if positions.shape[1] == 1 and window_start - sink_len > shift:
                layers = cache.layers
                if originals is None:
                    originals = [layer.keys[:, :, :sinks].clone() for layer in layers]
                keep_from = window_start - (sink_len - sinks)  # absolute; at cache index keep_from - shift
                cut = keep_from - shift
                shift = window_start - sink_len
                cos, sin = model.model.rotary_emb(originals[0], torch.tensor([[shift] * sinks]))
                for layer, original in zip(layers, originals, strict=True):
                    turned, _ = apply_rotary_pos_emb(original, original, cos, sin)
                    layer.keys = torch.cat([turned, layer.keys[:, :, cut:]], dim=2)
                    layer.values = torch.cat([layer.values[:, :, :sinks], layer.values[:, :, cut:]], dim=2)
            length = cache.get_seq_length()
            out = model(input_ids=inputs, position_ids=positions, cache=cache, use_cache=True,
                        cache_position=torch.arange(length, length + inputs.shape[1]))
            token = int(out.logits[0, -1].argmax())
            tokens.append(token)
            inputs = torch.tensor([[token]])
            positions = torch.tensor([[p + 1]])
    return tokens


def test_window_longer_than_the_sequence_changes_nothing(tiny_model_factory: Callable[..., Path]) -> None:
    model = tiny_model_factory("llama")
    prompts = [prompt(20, seed) for seed in range(3)]
    plain = LLM(str(model), dtype="float32", block_size=8, kv_cache_memory="4MiB", enable_prefix_caching=False)
    expected = [o.token_ids for o in plain.generate(prompts, SamplingParams(temperature=0.0, max_tokens=40,
                                                                              ignore_eos=True))]
    engine = streaming_engine(model, window=64)
    assert run_checked(engine, prompts, 40) == expected
    assert engine.kv_manager.requests == {} and engine.kv_stats().evicted_tokens == 0


@pytest.mark.parametrize("block_size,sinks,window", [(8, 4, 32), (16, 16, 24), (1, 4, 20), (16, 4, 24)])
def test_streaming_matches_hf_with_the_same_policy(tiny_model_factory: Callable[..., Path], block_size: int,
                                                   sinks: int, window: int) -> None:
    """Evicting blocks and turning the sinks' keys gives HF transformers' tokens when its own
    cache is cut the same way (fp32, 120 tokens: many evictions, the longest sequence 3x the
    window)."""
    import transformers

    model = tiny_model_factory("llama")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    prompts = [prompt(18, seed) for seed in range(2)]
    expected = [hf_streaming_greedy(hf, p, 120, sinks, window, block_size) for p in prompts]
    engine = streaming_engine(model, window=window, sinks=sinks, block_size=block_size)
    assert run_checked(engine, prompts, 120) == expected
    # and without turning the sinks the tokens differ: the test sees the rotation
    assert expected != [hf_streaming_greedy(hf, p, 120, sinks, 10**9, block_size) for p in prompts]


def test_streaming_memory_is_bounded_whatever_max_tokens(tiny_model_factory: Callable[..., Path]) -> None:
    """600 tokens past a 20-token prompt (the tiny model's context is 512) with a 32-token
    window: from the first eviction on, each request holds a constant number of blocks."""
    model = tiny_model_factory("llama")
    engine = streaming_engine(model, window=32, sinks=4, block_size=8)
    window = StreamingWindow(4, 32)
    bound = window.blocks_held(8)
    held: list[int] = []
    late: list[KVCacheStats] = []

    def record(engine: LLMEngine) -> None:
        holders = engine.kv_manager.holders()
        assert all(len(r.tables[0]) <= bound for r in holders.values()), "a table outgrew the window"
        if len(holders) == 2:
            held.append(engine.kv_manager.pool.num_used_blocks)
            if len(held) == 500:  # ~520 tokens each: the pool holds their sinks and windows only
                late.append(engine.kv_stats())

    outputs = run_checked(engine, [prompt(20, 1), prompt(20, 2)], 600, record)
    assert [len(o) for o in outputs] == [600, 600]
    steady = held[len(held) // 4 :]
    assert max(steady) <= 2 * bound and max(steady) - min(steady) <= 2  # one block each, as blocks fill
    stats = engine.kv_stats()  # each request kept at most its sinks and window of its 620 tokens
    assert stats.evicted_tokens >= 2 * (620 - bound * 8) and stats.evicted_tokens_now == 0
    assert late[0].logical_tokens <= 2 * bound * 8 and late[0].evicted_tokens_now >= 2 * (500 - bound * 8)
    assert late[0].kept_ratio == late[0].logical_tokens / (late[0].logical_tokens + late[0].evicted_tokens_now) < 0.2
    assert late[0].evicted_bytes_now == late[0].evicted_tokens_now * engine.kv_bytes_per_token > 0


@pytest.mark.parametrize("kv_eviction,kv_dtype", [("streaming", "fp8"), ("streaming", "int8"), ("streaming", "int4"),
                                                   ("snapkv", "int8")])
def test_eviction_in_quantized_pools_costs_no_more_than_quantization(tiny_model_factory: Callable[..., Path],
                                                                     kv_eviction: str, kv_dtype: str) -> None:
    """Teacher-forced through 300 tokens in chunks of 12 (blocks of 8: chunks end inside blocks,
    whose partial last block waits in a tail slot at a position eviction moved): evicting in a
    quantized pool stays as close to the same eviction in a float pool as the quantized pool is
    to the float one without eviction, while eviction itself changes the predictions far more.
    (SnapKV only in int8: coarser formats change which tokens score highest, a real difference.)"""
    from kvserve.quant.evaluate import next_token_logprobs

    model = tiny_model_factory("llama")
    tokens = prompt(300, 5)

    def logprobs(kv_dtype: str, kv_eviction: str) -> torch.Tensor:
        engine = LLMEngine(EngineConfig.from_settings(
                model=str(model), dtype="float32", block_size=8, kv_cache_memory="4MiB",
                kv_cache_dtype=kv_dtype, kv_eviction=kv_eviction, kv_window=48,
                kv_compression_ratio=0.5, max_num_batched_tokens=12,
                enable_prefix_caching=False))
        return next_token_logprobs(engine, tokens, 12)

    def kl(reference: torch.Tensor, other: torch.Tensor) -> float:
        return float((reference.exp() * (reference - other)).sum(-1).mean())

    full, evicted = logprobs("auto", "none"), logprobs("auto", kv_eviction)
    quantization = kl(full, logprobs(kv_dtype, "none"))
    both = kl(evicted, logprobs(kv_dtype, kv_eviction))
    assert both <= 1.5 * quantization + 2e-3
    assert kl(full, evicted) > 3 * both


def test_streaming_refuses_what_it_cannot_do_yet(tiny_model_factory: Callable[..., Path]) -> None:
    model = tiny_model_factory("llama")
    with pytest.raises(ConfigError, match="kv_eviction must be one of"):
        EngineConfig.from_settings(model=str(model), kv_eviction="snapkv2")
    with pytest.raises(ConfigError, match="kv_compression_ratio must be in"):
        EngineConfig.from_settings(model=str(model), kv_eviction="snapkv", kv_compression_ratio=0.0)
    with pytest.raises(ConfigError, match="kv_window must be an integer >= 1"):
        EngineConfig.from_settings(model=str(model), kv_eviction="streaming", kv_window=0)
    with pytest.raises(ConfigError, match="fewer than the 8 one streaming request needs"):
        streaming_engine(model, window=32, max_num_batched_tokens=16, kv_cache_memory="16KiB")
    with pytest.raises(ConfigError, match="method layer_skip keeps a draft cache of the whole sequence"):
        streaming_engine(model, window=32, speculative_config={"method": "layer_skip", "num_draft_layers": 1})
    gemma, mla = tiny_model_factory("gemma3_text"), tiny_model_factory("deepseek_v2")
    for refused in (gemma, mla):  # SnapKV keeps a set per KV head: MLA's latent has none
        with pytest.raises(ConfigError, match="kv_eviction=snapkv: MLA and sliding-window models are not supported"):
            LLMEngine(EngineConfig.from_settings(
                    model=str(refused), dtype="float32", kv_cache_memory="4MiB", kv_eviction="snapkv"))
    streaming_engine(mla, window=32)  # MLA streams: its latent's rotary key is turned
    streaming_engine(gemma, window=32, max_num_batched_tokens=16)  # and sliding-window models: their full group


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_eviction_composes_with_ngram_speculation(tiny_model_factory: Callable[..., Path], kv_dtype: str) -> None:
    """StreamingLLM and SnapKV under ngram speculation: the greedy tokens of each without
    speculation, and their log-probabilities (a streaming request's drafts stay within its
    eviction period, so every query attends to what it attends to one token a step; int8 adds
    per-block tails, whose drafts stop before a block's last slot), while drafts stand, with
    every invariant held each step. The model's attention is weak enough that its greedy output
    loops (drafts stand) and strong enough that one query seeing a block it should not changes
    the tokens (checked: without the streaming bound on drafts they differ)."""
    model = tiny_model_factory("llama", o_proj_scale=0.01)
    prompts = [[7, 8, 9, 10, 11, 12] * 4, prompt(20, 3) * 2]
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "draft_token_cost": 0.0}
    params = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True, logprobs=0)
    for kwargs in ({"kv_eviction": "streaming", "kv_sink_tokens": 4, "kv_window": 32},
                   {"kv_eviction": "snapkv", "kv_compression_ratio": 0.5, "kv_observation_window": 8}):
        runs = []
        for spec in (None, ngram):
            engine = LLMEngine(EngineConfig.from_settings(
                    model=str(model), dtype="float32", block_size=8, kv_cache_memory="4MiB",
                    kv_cache_dtype=kv_dtype, speculative_config=spec, **kwargs))
            ids = [engine.add_request(p, params).request_id for p in prompts]
            final = {}
            while engine.has_unfinished_requests():
                final.update((out.request_id, out) for out in engine.step())
                check_manager(engine.kv_manager)
            runs.append([final[i] for i in ids])
            assert engine.kv_stats().evicted_tokens > 0, "nothing was evicted: the test would not see the composition"
        plain, speculated = runs
        assert [o.token_ids for o in plain] == [o.token_ids for o in speculated], kwargs["kv_eviction"]
        for a, b in zip(plain, speculated, strict=True):
            torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=2e-5, rtol=0)
        stats = engine.kv_stats().spec_decode
        assert stats is not None and stats.num_accepted_tokens > 20


def test_streaming_lookahead_stays_within_one_eviction_period() -> None:
    """Streaming.lookahead_room: a chunk starting at query q may run r positions further, and
    no further, without a query past q being due an eviction that q's is not."""
    from kvserve.cache.kv_retention import Streaming

    for block_size, sinks, window in ((1, 4, 20), (8, 4, 32), (16, 16, 24), (4, 0, 9)):
        policy = Streaming(StreamingWindow(sinks, window))
        evicted = 0
        for q in range(400):
            evicted += policy.blocks_to_evict(q, evicted, block_size) * block_size  # what the hook does at q
            room = policy.lookahead_room(q, evicted, block_size)
            assert all(policy.blocks_to_evict(q + j, evicted, block_size) == 0 for j in range(room + 1))
            assert policy.blocks_to_evict(q + room + 1, evicted, block_size) > 0


@pytest.mark.parametrize("mode", ["swap", "recompute"])
@pytest.mark.parametrize("kv_dtype,memory", [("auto", "60KiB"), ("int8", "24KiB")])
def test_streaming_under_preemption(tiny_model_factory: Callable[..., Path], mode: str, kv_dtype: str,
                                    memory: str) -> None:
    """Three streaming requests in a pool of 15 blocks (int8: 17, with a tail run of 4 each) where
    each holds up to 6 while decoding (a sink block, a 32-token window and the block being
    filled): requests are preempted and come back. Swapped ones keep their evicted state (and
    their tail slot) and give the tokens of an unpreempted run; recomputed ones evict afresh
    (each completes; nothing leaks)."""
    model = tiny_model_factory("llama")
    prompts = [prompt(20, seed) for seed in range(3)]
    roomy = streaming_engine(model, window=32, max_num_batched_tokens=16, kv_cache_dtype=kv_dtype)
    expected = run_checked(roomy, prompts, 150)
    assert roomy.num_preemptions == 0
    tight = streaming_engine(model, window=32, max_num_batched_tokens=16, kv_cache_memory=memory,
                             kv_cache_dtype=kv_dtype, preemption_mode=mode,
                             kv_offload_memory="1MiB" if mode == "swap" else None)
    outputs = run_checked(tight, prompts, 150)
    assert tight.num_preemptions > 0
    if mode == "swap":
        assert outputs == expected and tight.kv_stats().swaps_in > 0
    else:
        assert [len(o) for o in outputs] == [150] * 3


def test_per_request_streaming_beside_full_requests(tiny_model_factory: Callable[..., Path]) -> None:
    """On an engine that keeps every block by default (prefix caching on), a request asking for
    streaming gets exactly what an all-streaming engine gives it, while the others are untouched
    and the streaming request neither publishes nor reuses cached blocks."""
    model = tiny_model_factory("llama")
    prompts = [prompt(20, seed) for seed in range(3)]
    greedy = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
    plain = LLM(str(model), dtype="float32", block_size=8, kv_cache_memory="4MiB")
    expected_plain = [o.token_ids for o in plain.generate(prompts, greedy)]
    expected_stream = run_checked(streaming_engine(model, window=32), prompts[:1], 120)
    engine = LLMEngine(EngineConfig.from_settings(
            model=str(model), dtype="float32", block_size=8, kv_cache_memory="4MiB"))
    streaming = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True, kv_eviction="streaming",
                               kv_window=32, kv_sink_tokens=4)
    ids = [engine.add_request(prompts[0], streaming).request_id] + \
        [engine.add_request(p, greedy).request_id for p in prompts[1:]]
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out.token_ids
        check_manager(engine.kv_manager)
        if ids[0] in engine.kv_manager.holders():
            assert len(engine.kv_manager.block_ids(ids[0])) <= StreamingWindow(4, 32).blocks_held(8, 2048)
    assert [outputs[i] for i in ids] == expected_stream + expected_plain[1:]
    assert engine.kv_stats().evicted_tokens > 0 and not engine.kv_manager.requests
    # the same prompt again: the full request hits the cache, the streaming one does not
    full = engine.add_request(prompts[1], SamplingParams(max_tokens=1)).request_id
    stream = engine.add_request(prompts[1], SamplingParams(max_tokens=1, kv_eviction="streaming",
                                                           kv_window=32)).request_id
    after_stream = engine.add_request(prompts[0], SamplingParams(max_tokens=1)).request_id  # never published
    cached = {out.request_id: out.num_cached_tokens for out in engine.step()}
    assert cached == {full: 16, stream: 0, after_stream: 0}
    with pytest.raises(ValueError, match="kv_window=4096 is more than this server's kv_window=1024"):
        engine.add_request(prompts[0], SamplingParams(kv_eviction="streaming", kv_window=4096))


@pytest.mark.parametrize("arch", ["llama", "deepseek_v2", "deepseek_v3"])
def test_streaming_one_layer_equals_a_fresh_run_on_the_kept_tokens(tiny_model_factory: Callable[..., Path],
                                                                  arch: str) -> None:
    """In a one-layer model a token's K/V depend only on the token and its position, so after
    each eviction the streaming cache equals a fresh prefill of the tokens it keeps (the sinks,
    then from the window's start less the last sink block's spare slots on) at consecutive
    positions: the turned sink keys and the window's shifted positions give the same distances.
    Every next token and its log-probability equal that fresh run's (MLA: only the latent's
    rotary key is turned)."""
    model = tiny_model_factory(arch, num_hidden_layers=1)
    sinks, window, block_size, steps = 3, 20, 4, 90
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True, logprobs=0)
    base = dict(model=str(model), dtype="float32", block_size=block_size, kv_cache_memory="4MiB")
    engine = LLMEngine(EngineConfig.from_settings(
            **base, kv_eviction="streaming", kv_sink_tokens=sinks, kv_window=window))
    start = prompt(12, 5)
    engine.add_request(start, params)
    final = None
    while engine.has_unfinished_requests():
        final = engine.step()[-1]
    assert final is not None and engine.kv_stats().evicted_tokens > 0
    fresh = LLM(**base, enable_prefix_caching=False)
    tokens = start + final.token_ids
    sink_len = -(-sinks // block_size) * block_size
    for t in range(steps):
        query = len(start) + t - 1
        shift = max(0, (query - window + 1) // block_size * block_size - sink_len)
        kept = tokens[: query + 1] if shift == 0 else tokens[:sinks] + tokens[sinks + shift : query + 1]
        want = fresh.generate([kept], SamplingParams(temperature=0.0, max_tokens=1, logprobs=0))[0]
        assert want.token_ids == [final.token_ids[t]], f"step {t} (shift {shift})"
        assert want.logprobs is not None and final.logprobs is not None
        assert abs(want.logprobs[0] - final.logprobs[t]) < 1e-4


def record_first_evictions(engine: LLMEngine) -> list[tuple[Any, list[torch.Tensor]]]:
    """Each request's first eviction with its sink blocks as written (read before the turn)."""
    firsts: list[tuple[Any, list[torch.Tensor]]] = []
    evict = engine.kv_manager.evict

    def recording(request_id: str, first_query: int) -> Any:
        eviction = evict(request_id, first_query)
        if eviction is not None and eviction.first:
            firsts.append((eviction, [b.clone() for b in engine.kv_cache.read_blocks(eviction.sink_block_ids)]))
        return eviction

    engine.kv_manager.evict = recording  # type: ignore[method-assign]
    return firsts


def check_sinks_turned(engine: LLMEngine, firsts: list[tuple[Any, list[torch.Tensor]]], model: Path) -> int:
    """After a first eviction the sink keys of every storage slot (the full-attention layers' in
    a hybrid pool) are their keys as written, turned by the shift with transformers' own global
    rotary embedding (Gemma 3's full layers; its sliding layers use another base)."""
    from transformers import AutoConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding, apply_rotary_pos_emb

    rotary = Gemma3RotaryEmbedding(AutoConfig.from_pretrained(str(model)))
    sinks, checked = engine.config.eviction_config.kv_sink_tokens, len(firsts)
    while firsts:
        eviction, written = firsts.pop()
        now = engine.kv_cache.read_blocks(eviction.sink_block_ids)
        for before, after in zip(written, now, strict=True):
            heads = before.shape[1] // 2
            keys = before[:, :heads].transpose(0, 1).reshape(heads, -1, before.shape[-1])[None, :, :sinks]
            cos, sin = rotary(keys, torch.tensor([[eviction.shift] * sinks]), "full_attention")
            _, turned = apply_rotary_pos_emb(keys, keys, cos, sin)
            got = after[:, :heads].transpose(0, 1).reshape(heads, -1, after.shape[-1])[None, :, :sinks]
            torch.testing.assert_close(got, turned, atol=2e-2 if engine.kv_cache_dtype == "int8" else 1e-5, rtol=0)
    return checked


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_streaming_on_sliding_window_groups_equals_one_table(tiny_model_factory: Callable[..., Path],
                                                              kv_dtype: str) -> None:
    """Gemma 3 (tiny: window 8, two full layers of six): streaming evicts in the full-attention
    group and closes every sliding group's table up by the same entries (out of their windows),
    each group keeping its own window. The tokens and log-probabilities equal those of one table
    for every layer (--disable-hybrid-kv-cache-manager, where the stream's cut applies to all
    layers and the sliding layers' masks keep their windows), while the sliding groups hold
    their windows only and every invariant holds each step."""
    model = tiny_model_factory("gemma3_text")
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True, logprobs=0)
    runs, held = [], []
    for one_table in (False, True):
        engine = LLMEngine(EngineConfig.from_settings(
                model=str(model), dtype="float32", block_size=4, kv_cache_memory="8MiB",
                max_num_batched_tokens=16, kv_cache_dtype=kv_dtype, kv_eviction="streaming",
                kv_sink_tokens=3, kv_window=16, disable_hybrid_kv_cache_manager=one_table))
        ids = [engine.add_request(p, params).request_id for p in (prompt(10, 1), prompt(30, 2))]
        firsts, turns = record_first_evictions(engine), 0
        final = {}
        while engine.has_unfinished_requests():
            final.update((out.request_id, out) for out in engine.step())
            check_manager(engine.kv_manager)
            turns += check_sinks_turned(engine, firsts, model)
            if not one_table:
                held += [len(table) for record in engine.kv_manager.holders().values()
                         for table in record.live_tables()[1:]]
        runs.append([final[i] for i in ids])
        assert engine.kv_stats().evicted_tokens > 0 and engine.kv_manager.pool.num_used_blocks == 0
        assert turns == len(ids)  # each request's first eviction was checked
    hybrid, one = runs
    assert [o.token_ids for o in hybrid] == [o.token_ids for o in one]
    for a, b in zip(hybrid, one, strict=True):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)
    assert max(held) <= -(-(8 - 1 + 16 - 1) // 4) + 1  # a sliding group: its window's and a chunk's blocks
    with pytest.raises(ConfigError, match="kv_window=4 is shorter than the model's sliding window of 8"):
        LLMEngine(EngineConfig.from_settings(
                model=str(model), kv_cache_memory="4MiB", kv_eviction="streaming", kv_window=4))
