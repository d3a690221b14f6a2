"""SnapKV: each prompt compressed once after its prefill, a selection per KV head copied into
private blocks (compaction), against HF transformers' own attention and cache."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig
from kvserve.engine.engine import LLMEngine
from kvserve.engine.snapkv import snapkv_keep
from tests.test_cache_invariants import check_manager
from tests.test_kv_eviction import prompt, run_checked
from tests.test_kv_quant import FORMATS


def test_per_request_snapkv_beside_full_requests(tiny_model_factory: Callable[..., Path]) -> None:
    """On an engine that compresses nothing by default (prefix caching on), a request asking for
    snapkv gets what an all-snapkv engine gives it and the others are untouched. The published
    blocks it hit are never written: its observation window is recomputed without rewriting
    K/V. A request may not keep less than the engine's kv_compression_ratio."""
    model = tiny_model_factory("llama")
    prompts = [prompt(40, seed) for seed in range(2)]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    common: dict[str, Any] = {"dtype": "float32", "block_size": 8, "kv_cache_memory": "4MiB",
                              "kv_observation_window": 16}  # half of it in a block the request hit
    expected_plain = [o.token_ids for o in LLM(str(model), **common).generate(prompts, greedy)]
    expected_snap = LLM(str(model), kv_eviction="snapkv", **common).generate(prompts, greedy)[1].token_ids
    llm = LLM(str(model), **common)
    assert llm.generate(prompts[1:], greedy)[0].token_ids == expected_plain[1]  # publishes its blocks
    engine = llm.engine
    published = [b.block_id for b in engine.kv_manager.pool.blocks if b.block_hash is not None]
    before = [layer.data[published].clone() for layer in engine.kv_cache.storage]
    snap = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, kv_eviction="snapkv",
                          kv_compression_ratio=0.5)
    outputs = llm.generate(prompts[::-1], [snap, greedy])
    assert outputs[0].num_cached_tokens == 32 and [o.token_ids for o in outputs] == [expected_snap, expected_plain[0]]
    assert engine.kv_stats().evicted_tokens == 20
    assert all(torch.equal(layer.data[published], old) for layer, old in zip(engine.kv_cache.storage, before,
                                                                             strict=True))
    for layer in engine.kv_cache.storage:  # marked: a rewrite by the window's recompute would undo this
        layer.data[published] *= 1.5
    marked = [layer.data[published].clone() for layer in engine.kv_cache.storage]
    assert llm.generate(prompts[1:], snap)[0].num_cached_tokens == 32
    assert all(torch.equal(layer.data[published], old) for layer, old in zip(engine.kv_cache.storage, marked,
                                                                             strict=True))
    for layer, old in zip(engine.kv_cache.storage, before, strict=True):
        layer.data[published] = old
    assert llm.generate(prompts[1:], greedy)[0].token_ids == expected_plain[1]
    with pytest.raises(ValueError, match=r"kv_compression_ratio=0\.25 keeps less of the prompt than this server's"):
        engine.add_request(prompts[0], SamplingParams(kv_eviction="snapkv", kv_compression_ratio=0.25))
    with pytest.raises(ValueError, match="kv_compression_ratio needs kv_eviction=snapkv"):
        engine.add_request(prompts[0], SamplingParams(kv_compression_ratio=0.75))


def hf_compacted_greedy(model: Any, prompt_ids: list[int], max_new_tokens: int,
                        index: list[torch.Tensor]) -> list[int]:
    """HF transformers' greedy tokens when, right after the prompt's prefill, each layer's cache
    keeps only the tokens index[layer][head] of each KV head (queries at absolute positions)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt_ids]), cache=cache, use_cache=True)
        tokens = [int(out.logits[0, -1].argmax())]
        for layer, keep in zip(cache.layers, index, strict=True):
            picks = keep[None, :, :, None].expand(1, -1, -1, layer.keys.shape[-1])
            layer.keys, layer.values = layer.keys.gather(2, picks), layer.values.gather(2, picks)
        for step in range(max_new_tokens - 1):
            length = cache.get_seq_length()
            out = model(input_ids=torch.tensor([[tokens[-1]]]), position_ids=torch.tensor([[len(prompt_ids) + step]]),
                        cache=cache, use_cache=True, cache_position=torch.tensor([length]))
            tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


@pytest.mark.parametrize("keep", [40, 24, 5])
def test_compaction_keeps_any_tokens_per_layer_and_head(tiny_model_factory: Callable[..., Path], keep: int) -> None:
    """After the prompt's prefill, keep a different random subset of its 40 tokens in every
    layer and KV head (all of them: nothing changes): the engine's tokens equal HF's with its
    cache gathered the same way; the compacted blocks are private, the prompt's published ones
    stay cached."""
    import transformers

    model = tiny_model_factory("llama")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    p = prompt(40, 3)
    gen = torch.Generator().manual_seed(keep)
    kv_heads, layers = hf.config.num_key_value_heads, hf.config.num_hidden_layers
    index = [torch.stack([torch.randperm(40, generator=gen)[:keep].sort().values for _ in range(kv_heads)])
             for _ in range(layers)]
    engine = LLMEngine(EngineConfig.from_settings(
            model=str(model), dtype="float32", block_size=8, kv_cache_memory="4MiB"))
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    request = engine.add_request(p, params)
    outputs = engine.step()  # the prompt's prefill and the first token
    assert request.num_computed_tokens == 40 and engine.snapkv.compact(request, index)
    check_manager(engine.kv_manager)
    assert len(engine.kv_manager.block_ids(request.request_id)) == -(-keep // 8)
    while engine.has_unfinished_requests():
        outputs = engine.step()
        check_manager(engine.kv_manager)
    assert outputs[0].token_ids == hf_compacted_greedy(hf, p, 30, index)
    pool = engine.kv_manager.pool
    assert pool.num_used_blocks == 0 and pool.num_cached_blocks == 5  # the prompt's, none of the compacted
    if keep == 40:
        plain = LLM(str(model), dtype="float32", block_size=8, kv_cache_memory="4MiB")
        assert outputs[0].token_ids == plain.generate([p], params)[0].token_ids


@pytest.mark.parametrize("kv_dtype", ["fp8", "int8", "int4"])
def test_compaction_that_keeps_everything_changes_nothing_in_quantized_pools(
        tiny_model_factory: Callable[..., Path], kv_dtype: str) -> None:
    """Re-quantizing what a quantized block holds gives it back: compacting a 43-token prompt
    (its last 3 tokens in a tail slot where the format keeps one) into fresh blocks, keeping
    every token, gives the tokens of the run that never compacted."""
    model = tiny_model_factory("llama")
    p = prompt(43, 4)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    common: dict[str, Any] = {"model": str(model), "dtype": "float32", "block_size": 8, "kv_cache_memory": "4MiB",
                              "kv_cache_dtype": kv_dtype, "enable_prefix_caching": False}
    plain = LLM(**common).generate([p], params)[0].token_ids
    engine = LLMEngine(EngineConfig.from_settings(**common))
    request = engine.add_request(p, params)
    outputs = engine.step()
    everything = torch.arange(43).expand(engine.model_config.num_kv_heads, 43)
    assert engine.snapkv.compact(request, [everything] * engine.model_config.num_layers)
    while engine.has_unfinished_requests():
        outputs = engine.step()
        check_manager(engine.kv_manager)
    assert outputs[0].token_ids == plain


def test_snapkv_scores_as_the_paper_says() -> None:
    """snapkv_keep against a plain loop: per KV head, the window's attention (causal, softmax per
    query head), summed over the window and the head's query group, averaged over 5 neighbours
    (padding not counted), the top of the prefix plus the window itself; shared per layer, the
    votes summed over the KV heads first."""
    torch.manual_seed(0)
    window, heads, kv_heads, dim, length, keep = 4, 6, 2, 8, 30, 12
    q, k = torch.randn(window, heads, dim), torch.randn(length, kv_heads, dim)
    k[7, 1] = q[:, 3:].sum(dim=(0, 1)) * 3  # a token head 1's queries all look at

    def top(votes: torch.Tensor) -> list[int]:
        prefix = votes[: length - window]
        pooled = torch.stack([prefix[max(0, j - 2) : j + 3].mean() for j in range(length - window)])
        return sorted(pooled.topk(keep - window).indices.tolist() + list(range(length - window, length)))

    got = snapkv_keep(q, k, keep, scale=dim**-0.5)
    all_votes = torch.zeros(length)
    for g in range(kv_heads):
        votes = torch.zeros(length)
        for i in range(window):
            for h in range(g * 3, g * 3 + 3):
                seen = length - window + i + 1
                votes[:seen] += torch.softmax(k[:seen, g] @ q[i, h] * dim**-0.5, dim=0)
        assert got[g].tolist() == top(votes)
        all_votes += votes
    assert 7 in got[1].tolist() and got[0].tolist() != got[1].tolist()
    shared = snapkv_keep(q, k, keep, scale=dim**-0.5, per_head=False)
    assert shared[0].tolist() == shared[1].tolist() == top(all_votes)
    with pytest.raises(ValueError, match="keep=3 must lie between"):
        snapkv_keep(q, k, 3, scale=1.0)


@pytest.mark.parametrize("ratio", [1.0, 0.5, 0.25])
def test_snapkv_compresses_each_prompt_once(tiny_model_factory: Callable[..., Path], ratio: float) -> None:
    """Prompts of 40-60 tokens with kv_compression_ratio: each keeps ceil(ratio x L) tokens per
    head after its prefill (ratio 1: exactly the plain engine's tokens), decodes on from them as
    HF transformers does with its cache gathered by the same indices, and frees everything."""
    import transformers

    model = tiny_model_factory("llama")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    prompts = [prompt(40 + 10 * i, 10 + i) for i in range(3)]
    engine = LLMEngine(EngineConfig.from_settings(
            model=str(model), dtype="float32", block_size=8, kv_cache_memory="4MiB",
            kv_eviction="snapkv", kv_compression_ratio=ratio, kv_observation_window=8))
    indices: dict[str, list[torch.Tensor]] = {}
    compact = engine.snapkv.compact

    def recording(request: Any, index: list[torch.Tensor]) -> bool:
        indices[request.request_id] = index
        return compact(request, index)

    engine.snapkv.compact = recording  # type: ignore[method-assign]
    outputs = run_checked(engine, prompts, 24)
    if ratio == 1.0:
        plain = LLM(str(model), dtype="float32", block_size=8, kv_cache_memory="4MiB")
        greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        assert not indices and outputs == [o.token_ids for o in plain.generate(prompts, greedy)]
        return
    assert sorted(i.shape[1] for i in (v[0] for v in indices.values())) == [
        math.ceil(len(p) * ratio) for p in prompts]
    assert engine.kv_stats().evicted_tokens == sum(len(p) - math.ceil(len(p) * ratio) for p in prompts)
    for out, p, rid in zip(outputs, prompts, sorted(indices), strict=True):
        assert out == hf_compacted_greedy(hf, p, 24, indices[rid])


def test_per_layer_compression_keeps_one_set_for_all_heads(tiny_model_factory: Callable[..., Path]) -> None:
    """kv_compression_per_layer: every KV head of a layer keeps the same tokens (a set the
    per-head selection does not give in some layer), the requests complete and nothing leaks."""
    model = tiny_model_factory("llama")
    prompts = [prompt(48, 30 + i) for i in range(2)]
    chosen: dict[bool, list[list[torch.Tensor]]] = {}
    for per_layer in (False, True):
        engine = LLMEngine(EngineConfig.from_settings(
                model=str(model), dtype="float32", block_size=8, kv_cache_memory="4MiB",
                kv_eviction="snapkv", kv_compression_ratio=0.5, kv_observation_window=8,
                kv_compression_per_layer=per_layer))
        compact, chosen[per_layer] = engine.snapkv.compact, []

        def recording(request: Any, index: list[torch.Tensor], compact: Any = compact,
                      record: list[list[torch.Tensor]] = chosen[per_layer]) -> bool:
            record.append(index)
            return compact(request, index)

        engine.snapkv.compact = recording  # type: ignore[method-assign]
        assert [len(o) for o in run_checked(engine, prompts, 8)] == [8, 8]
    assert all(bool((layer == layer[:1]).all()) for index in chosen[True] for layer in index)
    assert any(not bool((layer == layer[:1]).all()) for index in chosen[False] for layer in index)


def test_snapkv_selection_matches_hf_attention(tiny_model_factory: Callable[..., Path]) -> None:
    """The tokens the engine keeps are those HF transformers' own attention probabilities
    (eager, output_attentions) rank highest from the last 8 prompt queries, per layer and head:
    the queries captured, the keys read and the scale are the right ones."""
    import transformers

    model = tiny_model_factory("llama")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    p, window, ratio = prompt(48, 5), 8, 0.5
    keep = math.ceil(len(p) * ratio)
    engine = LLMEngine(EngineConfig.from_settings(
            model=str(model), dtype="float32", block_size=8, kv_cache_memory="4MiB",
            kv_eviction="snapkv", kv_compression_ratio=ratio, kv_observation_window=window))
    captured: list[list[torch.Tensor]] = []
    compact = engine.snapkv.compact
    engine.snapkv.compact = lambda request, index: captured.append(index) or compact(request, index)  # type: ignore
    run_checked(engine, [p], 2)
    with torch.no_grad():
        attentions = hf(input_ids=torch.tensor([p]), output_attentions=True).attentions
    kv_heads = hf.config.num_key_value_heads
    for index, probs in zip(captured[0], attentions, strict=True):
        votes = probs[0, :, -window:, : len(p) - window].sum(dim=1)  # [heads, L - w]
        votes = votes.view(kv_heads, -1, len(p) - window).sum(dim=1)
        pooled = torch.nn.functional.avg_pool1d(votes[:, None], 5, stride=1, padding=2, count_include_pad=False)[:, 0]
        for g in range(kv_heads):
            expected = set(pooled[g].topk(keep - window).indices.tolist()) | set(range(len(p) - window, len(p)))
            assert set(index[g].tolist()) == expected


# how far a format's read-back may sit from what was stored, relative to the tokens' largest magnitude
FORMAT_ERROR = {"fp32": 1e-6, "bf16": 1e-2, "fp8_e4m3": 0.07, "fp8_e5m2": 0.13, "int8": 0.01, "int4": 0.1}


@pytest.mark.parametrize("kind,mode", FORMATS)
def test_compacted_tokens_are_requantized_in_every_format(kind: str, mode: str) -> None:
    """What eviction rewrites (sink blocks, compacted blocks) goes through read_tokens and
    write_tokens: in every format, tokens read back lie within the format's rounding of what was
    written (fp8 keys un-rotated, a partial last block in the tail slot where the format keeps
    one); writing what was read changes nothing more; a gathered subset reads back as the
    subset of the original, its blocks re-quantized with scales fitted to it."""
    from kvserve.cache.kv_cache import PagedKVCache
    from kvserve.cache.kv_layer import KVQuantSpec

    layers, heads, dim, size, length = 2, 2, 16, 4, 10
    gen = torch.Generator().manual_seed(0)
    written = [torch.randn(2 * heads, length, dim, generator=gen) * torch.linspace(0.5, 2, dim)
               for _ in range(layers)]
    calibrated = torch.stack([t[:heads].abs().amax(dim=1) for t in written])  # keys' absmax per channel
    key_scales = calibrated if mode == "static" and kind == "int8" else None
    cache = PagedKVCache(layers, 24, size, heads, dim, torch.float32, torch.device("cpu"),
                         KVQuantSpec(kind, key_scales=key_scales))
    cache.zero_new_blocks(23)
    tail_slot = 1  # int8's tail slot 1 spans blocks 4-7, int4's 8-15: clear of blocks 1-3 and 16-17
    bound = FORMAT_ERROR[kind] * max(float(t.abs().max()) for t in written)
    cache.write_tokens([1, 2, 3], written, tail_slot)
    read = cache.read_tokens([1, 2, 3], length, tail_slot)
    for before, after in zip(written, read, strict=True):
        assert (after - before).abs().max() <= bound
    cache.write_tokens([1, 2, 3], read, tail_slot)
    for once, twice in zip(read, cache.read_tokens([1, 2, 3], length, tail_slot), strict=True):
        torch.testing.assert_close(twice, once, atol=bound / 50, rtol=0)
    keep = [torch.stack([torch.randperm(length, generator=gen)[:6].sort().values for _ in range(heads)])
            for _ in range(layers)]
    cache.gather_tokens([1, 2, 3], [16, 17], keep, length, tail_slot)
    for tokens, index, kept in zip(read, keep, cache.read_tokens([16, 17], 6, tail_slot), strict=True):
        picked = tokens.gather(1, index.repeat(2, 1)[:, :, None].expand(-1, -1, dim))
        assert (kept - picked).abs().max() <= bound
