"""The fused CPU decode and prefill kernels and the gather + matmul/SDPA paths compute the
same attention, and the engine gives the same tokens through either."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.cache.kv_layer import KVWriteIndex, LayerKV
from kvserve.model import attention
from kvserve.model.attention import (
    PREFILL_TILE,
    AttentionGroup,
    AttentionMetadata,
    Cascade,
    attention_bias,
    banded_attention,
    kv_write_rows,
    paged_attention,
    rope_and_write_kv,
    use_prefill_kernel,
)
from kvserve.model.cpu_kernels import cpu_op
from kvserve.model.rope import apply_rope

# the prefill and cascade kernels: AVX-512 and AVX2 code (the portable level runs gather + SDPA)
prefill_levels = pytest.mark.isa_levels("avx2", "avx512", "amx")


def _write_index(slots: torch.Tensor, block_size: int, kv_heads: int) -> KVWriteIndex:
    return KVWriteIndex(kv_write_rows(slots, block_size, 2 * kv_heads), None, None)


def _decode_group(block_tables: torch.Tensor, lens: torch.Tensor, block_size: int, heads: int, kv_heads: int,
                  dtype: torch.dtype, with_bias: bool) -> AttentionGroup:
    if not with_bias:  # the C++ kernel
        return AttentionGroup(0, len(lens), 1, block_tables, True, None, lens, False, None)
    kv_len = block_tables.shape[1] * block_size
    mask = (torch.arange(kv_len)[None, :] < lens[:, None])[:, None, None, :]
    bias = attention_bias(mask, heads, kv_heads, dtype)
    return AttentionGroup(0, len(lens), 1, block_tables, False, mask, lens, False, bias)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("block_size", [1, 16, 64])
# (64|128, group <= 8) take the AVX-512 path where the CPU has it; dim 32 and group 9 the portable one
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 8, 128), (4, 2, 32), (9, 1, 64), (4, 1, 256)])
def test_kernel_matches_matmul_path(dtype: torch.dtype, tol: float, block_size: int, heads: int, kv_heads: int,
                                    dim: int, isa: str) -> None:
    torch.manual_seed(0)
    batch = 5
    lens = torch.tensor([1, 7, 33, 64, 150])
    width = int((lens.max() + block_size - 1) // block_size)
    num_blocks = batch * width + 1
    cache = torch.randn(num_blocks, 2 * kv_heads, block_size, dim).to(dtype)
    ids = torch.randperm(num_blocks - 1)[: batch * width].view(batch, width) + 1
    tables = torch.where(torch.arange(width)[None, :] * block_size < lens[:, None], ids, torch.zeros_like(ids))
    query = torch.randn(batch, heads, dim).to(dtype)
    # the step writes one new token per sequence at position len-1
    new_k, new_v = torch.randn(batch, kv_heads, dim).to(dtype), torch.randn(batch, kv_heads, dim).to(dtype)
    slots = tables[torch.arange(batch), (lens - 1) // block_size] * block_size + (lens - 1) % block_size
    outs = []
    for with_bias in (True, False):
        pool = cache.clone()
        meta = AttentionMetadata(slots, _write_index(slots, block_size, kv_heads),
                                 [_decode_group(tables, lens, block_size, heads, kv_heads, dtype, with_bias)])
        layer = LayerKV.float_pool(pool)
        layer.write(new_k, new_v, meta.write)
        outs.append(paged_attention(query, layer, meta, dim**-0.5).float())
    torch.testing.assert_close(outs[1], outs[0], atol=tol, rtol=tol)


@pytest.mark.parametrize("kind", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [1, 16, 128])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 2, 40), (5, 1, 256)])
def test_float32_queries_over_a_16_bit_pool_are_float32_attention_over_its_values(
        kind: torch.dtype, block_size: int, heads: int, kv_heads: int, dim: int, isa: str) -> None:
    """A float32 model with --kv-cache-dtype bf16/fp16: decode takes the float kernel, which widens
    the 16-bit rows as it reads them, and must give float32 attention over the stored values, as
    a float32 pool holding the same values does (float32 rounding only)."""
    torch.manual_seed(1)
    lens = torch.tensor([1, 17, 150, 300])
    batch, width = len(lens), int((lens.max() + block_size - 1) // block_size)
    num_blocks = batch * width + 1
    cache = torch.randn(num_blocks, 2 * kv_heads, block_size, dim).to(kind)
    ids = torch.randperm(num_blocks - 1)[: batch * width].view(batch, width) + 1
    tables = torch.where(torch.arange(width)[None, :] * block_size < lens[:, None], ids, torch.zeros_like(ids))
    query = torch.randn(batch, heads, dim)
    slots = tables[torch.arange(batch), (lens - 1) // block_size] * block_size + (lens - 1) % block_size
    meta = AttentionMetadata(slots, _write_index(slots, block_size, kv_heads),
                             [_decode_group(tables, lens, block_size, heads, kv_heads, torch.float32, False)])
    out = paged_attention(query, LayerKV.float_pool(cache), meta, dim**-0.5)
    expected = paged_attention(query, LayerKV.float_pool(cache.float()), meta, dim**-0.5)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # only float32 queries may differ from the pool's dtype
    half_query = query.half()
    with pytest.raises(RuntimeError, match="one dtype"):
        cpu_op("paged_decode_attention")(torch.empty_like(half_query), half_query, cache.bfloat16(), tables, lens,
                                         dim**-0.5)


def test_kernel_calls_are_labelled_only_while_a_profiler_records(isa: str) -> None:
    """The benchmarks time attention by its kvserve:: label under torch.profiler; outside a
    profile no label is opened (record_function costs ~7 us a call even with no profiler)."""
    lens = torch.tensor([5, 20])
    tables = torch.tensor([[1, 0], [2, 3]])
    meta = AttentionMetadata(lens - 1, _write_index(lens - 1, 16, 1), [_decode_group(tables, lens, 16, 2, 1,
                                                                                    torch.float32, False)])
    layer = LayerKV.float_pool(torch.randn(4, 2, 16, 64))
    query = torch.randn(2, 2, 64)
    with torch.profiler.profile() as prof:
        paged_attention(query, layer, meta, 0.125)
    assert "kvserve::paged_decode_attention" in {event.key for event in prof.key_averages()}
    opened: list[str] = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(attention, "record_function", lambda name: opened.append(name) or contextlib.nullcontext())
        paged_attention(query, layer, meta, 0.125)
        assert opened == []
        with torch.profiler.profile():
            paged_attention(query, layer, meta, 0.125)
        assert opened == ["kvserve::paged_decode_attention"]


@pytest.mark.parametrize("block_size", [1, 16, 32, 128])
# one sequence: a job per KV head; six: a job per sequence (two threads); long ones (K/V over half of
# L2) prefetch the next job's keys in their value pass (NextKeys)
@pytest.mark.parametrize("lengths", [(300,), (1, 15, 16, 17, 100, 300), (3000, 700, 15, 1800, 4100)])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 2, 128), (4, 1, 256)])
def test_bf16_decode_kernel_is_float32_attention_over_the_bf16_values(block_size: int, lengths: tuple[int, ...],
                                                                      heads: int, kv_heads: int, dim: int,
                                                                      isa: str) -> None:
    """bf16 pools (the AVX512-BF16 one-pass path where the CPU has it): float32 attention over the
    stored bf16 values, rounded once to bf16 at the end, across chunk and block edges."""
    torch.manual_seed(1)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        lens = torch.tensor(lengths)
        batch = len(lens)
        width = int((lens.max() + block_size - 1) // block_size)
        cache = torch.randn(batch * width + 1, 2 * kv_heads, block_size, dim).to(torch.bfloat16)
        tables = (torch.randperm(batch * width) + 1).view(batch, width)
        query = (3 * torch.randn(batch, heads, dim)).to(torch.bfloat16)  # peaked softmaxes too
        out = torch.empty_like(query)
        kernel = cpu_op("paged_decode_attention")
        assert kernel is not None
        kernel(out, query, cache, tables, lens, dim**-0.5)
    finally:
        torch.set_num_threads(threads)
    group = heads // kv_heads
    for b in range(batch):
        blocks = cache[tables[b]].float()  # [width, 2*kv_heads, block, dim]
        kv = blocks.permute(1, 0, 2, 3).reshape(2 * kv_heads, -1, dim)[:, : lens[b]]
        k, v = kv[:kv_heads].repeat_interleave(group, 0), kv[kv_heads:].repeat_interleave(group, 0)
        weights = torch.softmax(query[b].float()[:, None, :] @ k.transpose(1, 2) * dim**-0.5, dim=-1)
        expected = (weights @ v)[:, 0].to(torch.bfloat16)
        torch.testing.assert_close(out[b].float(), expected.float(), atol=8e-3, rtol=8e-3)


@prefill_levels
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 2, 128), (8, 1, 64)])
@pytest.mark.parametrize("cached", [False, True])  # True: each chunk follows a prefix already in the pool
def test_prefill_kernel_matches_sdpa_path(dtype: torch.dtype, tol: float, block_size: int, heads: int,
                                          kv_heads: int, dim: int, cached: bool, isa: str) -> None:
    torch.manual_seed(2)
    query_len = 7
    lens = torch.tensor([7, 30, 100]) if cached else torch.full((3,), query_len)
    batch = len(lens)
    width = int((lens.max() + block_size - 1) // block_size)
    num_blocks = batch * width + 1
    pool = torch.randn(num_blocks, 2 * kv_heads, block_size, dim).to(dtype)
    ids = torch.randperm(num_blocks - 1)[: batch * width].view(batch, width) + 1
    tables = torch.where(torch.arange(width)[None, :] * block_size < lens[:, None], ids, torch.zeros_like(ids))
    query = torch.randn(batch * query_len, heads, dim).to(dtype)
    key_pos = torch.arange(width * block_size)
    query_pos = lens[:, None] - query_len + torch.arange(query_len)[None, :]
    mask = (key_pos[None, None, :] <= query_pos[:, :, None]).unsqueeze(1)
    fresh = not cached
    slots = torch.zeros(0, dtype=torch.long)
    outs = []
    for group_mask in (mask, None):  # gather + SDPA, then the kernel
        group = AttentionGroup(0, batch, query_len, tables, group_mask is None, group_mask, lens, fresh, None)
        meta = AttentionMetadata(slots, KVWriteIndex(slots, None, None), [group])
        outs.append(paged_attention(query, LayerKV.float_pool(pool), meta, dim**-0.5).float())
    torch.testing.assert_close(outs[1], outs[0], atol=tol, rtol=tol)


@prefill_levels
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("sharpness", [1.0, 30.0])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 2, 128)])
def test_prefill_kernel_over_long_sequences(dtype: torch.dtype, tol: float, sharpness: float, heads: int,
                                            kv_heads: int, dim: int, isa: str) -> None:
    """Chunks of 40 queries after 660 and 293 cached tokens, against softmax attention in
    float64 over the same pool: several of the AMX kernel's 256-key chunks, query tiles whose
    rows see different numbers of keys, and (sharpness 30) attention so peaked that a row's
    running maximum grows by more than the kernel's slack from one chunk to the next, so its
    partial outputs and sums are rescaled mid-row."""
    torch.manual_seed(5)
    block_size, query_len = 16, 40
    lens = torch.tensor([700, 333])
    batch, width = len(lens), int((lens.max() + block_size - 1) // block_size)
    pool = torch.randn(batch * width + 1, 2 * kv_heads, block_size, dim).to(dtype)
    tables = (torch.randperm(batch * width) + 1).view(batch, width)
    query = (sharpness * torch.randn(batch * query_len, heads, dim)).to(dtype)
    out = torch.empty_like(query)
    assert cpu_op("paged_prefill_attention")(out, query, pool, tables, lens, query_len, dim**-0.5)
    group = heads // kv_heads
    for b, length in enumerate(lens.tolist()):
        kv = pool[tables[b]].double().permute(1, 0, 2, 3).reshape(2 * kv_heads, -1, dim)[:, :length]
        k, v = kv[:kv_heads].repeat_interleave(group, 0), kv[kv_heads:].repeat_interleave(group, 0)
        q = query[b * query_len : (b + 1) * query_len].double().transpose(0, 1)  # [heads, queries, dim]
        scores = q @ k.transpose(1, 2) * dim**-0.5
        positions = torch.arange(length - query_len, length)
        scores = scores.masked_fill(torch.arange(length)[None, :] > positions[:, None], float("-inf"))
        expected = (scores.softmax(-1) @ v).transpose(0, 1)
        torch.testing.assert_close(out[b * query_len : (b + 1) * query_len].double(), expected, atol=tol, rtol=tol)


@prefill_levels
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 2, 128), (8, 1, 64)])
@pytest.mark.parametrize("query_len", [1, 5])  # decode, prefill chunks
def test_cascade_matches_the_kernels(dtype: torch.dtype, tol: float, block_size: int, heads: int, kv_heads: int,
                                     dim: int, query_len: int, isa: str) -> None:
    """Six sequences over one shared prefix of 1-4 blocks plus 1-70 tokens of their own, the
    last query_len of them queries: the shared part read once (non-causal prefill kernel) merged
    with each sequence's own (decode kernel, or the causal prefill kernel) by their log-sum-exps
    equals the decode or prefill kernel over each whole table."""
    torch.manual_seed(3)
    for shared_blocks in (1, 4):
        own = torch.tensor([1, 2, 17, 33, 70, 5]).clamp(min=query_len)
        lens = shared_blocks * block_size + own
        batch, width = len(lens), int((lens.max() + block_size - 1) // block_size)
        num_blocks = batch * width + 1
        pool = torch.randn(num_blocks, 2 * kv_heads, block_size, dim).to(dtype)
        ids = torch.randperm(num_blocks - 1)[: batch * width].view(batch, width) + 1
        ids[:, :shared_blocks] = ids[0, :shared_blocks]
        tables = torch.where(torch.arange(width)[None, :] * block_size < lens[:, None], ids, torch.zeros_like(ids))
        query = (2 * torch.randn(batch * query_len, heads, dim)).to(dtype)
        plain = AttentionGroup(0, batch, query_len, tables, True, None, lens, False, None)
        cascade = Cascade(tables[:1, :shared_blocks], torch.tensor([shared_blocks * block_size]),
                          tables[:, shared_blocks:].contiguous(), own)
        cascaded = AttentionGroup(0, batch, query_len, tables, True, None, lens, False, None, cascade=cascade)
        slots = torch.zeros(0, dtype=torch.long)
        outs = [paged_attention(query, LayerKV.float_pool(pool), AttentionMetadata(slots, KVWriteIndex(
            slots, None, None), [group]), dim**-0.5).float() for group in (plain, cascaded)]
        torch.testing.assert_close(outs[1], outs[0], atol=tol, rtol=tol)


@prefill_levels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_full_prefill_kernel_and_its_log_sum_exps(dtype: torch.dtype, isa: str) -> None:
    """causal=False: every query row sees all the sequence's keys; lse is each row's
    log-sum-exp of its scaled scores (what merging partial softmaxes needs)."""
    torch.manual_seed(4)
    heads, kv_heads, dim, block_size, num_keys, rows = 9, 3, 64, 16, 100, 11
    pool = torch.randn(8, 2 * kv_heads, block_size, dim).to(dtype)
    table = torch.tensor([[3, 1, 7, 5, 2, 6, 4]])
    query = torch.randn(rows, heads, dim).to(dtype)
    out, lse = torch.empty_like(query), torch.empty(rows, heads)
    assert cpu_op("paged_prefill_attention")(out, query, pool, table, torch.tensor([num_keys]), rows, dim**-0.5,
                                             causal=False, lse=lse)
    kv = pool[table[0]].float().permute(1, 0, 2, 3).reshape(2 * kv_heads, -1, dim)[:, :num_keys]
    k, v = kv[:kv_heads].repeat_interleave(3, 0), kv[kv_heads:].repeat_interleave(3, 0)
    scores = query.float().transpose(0, 1) @ k.transpose(1, 2) * dim**-0.5  # [heads, rows, keys]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(lse, scores.logsumexp(-1).T, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(out.float(), (scores.softmax(-1) @ v).transpose(0, 1), atol=tol, rtol=tol)


@prefill_levels
def test_engine_cascade_same_tokens_and_taken(tiny_model_factory: Callable[..., Path],
                                               monkeypatch: pytest.MonkeyPatch, isa: str) -> None:
    """Sixteen requests on one 800-token prompt prefix (a system prompt, cached: 16 x 800 tokens
    pass the cascade's threshold) prefill their own 5 tokens and decode through the cascade —
    both counted — with the same greedy tokens as with --disable-cascade-attn."""
    import kvserve.model.attention as attention

    path = str(tiny_model_factory("qwen2", hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                                  max_position_embeddings=1024))
    system = [(7 * i) % 200 + 3 for i in range(800)]
    prompts = [[*system, i + 1, i + 2, i + 3, i + 4, i + 5] for i in range(16)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    calls = []
    real = attention.cascade_attention
    monkeypatch.setattr(attention, "cascade_attention", lambda *args: calls.append(args[4]) or real(*args))
    results = []
    for disable in (False, True):
        llm = LLM(path, kv_cache_memory="16MiB", max_num_batched_tokens=1024, disable_cascade_attn=disable)
        llm.generate([[*system, 1]], params)  # caches the system prompt: the others start from it
        results.append([o.token_ids for o in llm.generate(prompts, params)])
        assert (1 in calls and 5 in calls) != disable  # decode steps and the 5-token prefill chunks
        calls.clear()
    assert results[0] == results[1]


def test_engine_tokens_same_with_and_without_kernel(tiny_model_factory: Callable[..., Path], isa: str) -> None:
    # head_dim 64, which the prefill kernel serves; chunks of 40 make cached-prefix prefills too
    path = str(tiny_model_factory("qwen2", hidden_size=128, num_attention_heads=2, num_key_value_heads=1))
    prompts = [[5] * 3, list(range(1, 90)), [9, 8, 7, 6]]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    results = []
    for kernel in (True, False):
        llm = LLM(path, kv_cache_memory="4MiB", max_num_batched_tokens=40)
        runner = llm.engine.runner
        assert runner.prefill_kernel == use_prefill_kernel("cpu", 64, torch.float32)
        if not kernel:
            runner.decode_kernel = runner.prefill_kernel = False
        results.append([o.token_ids for o in llm.generate(prompts, params)])
    assert results[0] == results[1]


@pytest.mark.parametrize("dtype,pool_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                              (torch.float32, torch.bfloat16), (torch.float32, torch.float16)])
def test_fused_rope_and_cache_write_matches_torch(dtype: torch.dtype, pool_dtype: torch.dtype, isa: str) -> None:
    """Rotary then the cache write, as the torch path does them; a float32 model's K/V rounded
    into a bf16/float16 pool as torch's cast rounds them."""
    torch.manual_seed(1)
    tokens, heads, kv_heads, dim, block_size = 7, 9, 3, 64, 4
    qkv = torch.randn(tokens, heads + 2 * kv_heads, dim).to(dtype)
    angles = torch.rand(tokens, dim // 2) * 6
    cos = torch.cat((angles.cos(), angles.cos()), -1)
    signed_sin = torch.cat((-angles.sin(), angles.sin()), -1)
    slots = torch.tensor([4, 5, 6, 7, 9, 13, 30])
    meta = AttentionMetadata(slots, _write_index(slots, block_size, kv_heads), [])
    pool_ref, pool = (torch.zeros(9, 2 * kv_heads, block_size, dim, dtype=pool_dtype) for _ in range(2))
    qk = apply_rope(qkv[:, : heads + kv_heads], cos.to(dtype)[:, None], signed_sin.to(dtype)[:, None])
    LayerKV.float_pool(pool_ref).write(qk[:, heads:], qkv[:, heads + kv_heads :], meta.write)
    fused = qkv.clone()
    assert rope_and_write_kv(fused, cos, signed_sin, LayerKV.float_pool(pool), meta, heads)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(fused[:, :heads].float(), qk[:, :heads].float(), atol=tol, rtol=tol)
    # a key a float32 rounding away from a tie may round the other way (one bf16/fp16 step)
    pool_tol = {torch.float32: tol, torch.bfloat16: 2e-2, torch.float16: 2e-3}[pool_dtype]
    torch.testing.assert_close(pool.float(), pool_ref.float(), atol=pool_tol, rtol=pool_tol)
    assert (pool != 0).sum() == (pool_ref != 0).sum() > 0  # every slot written, nothing else
    with pytest.raises(RuntimeError, match="one per token"):  # a short slot mapping is refused, not read past
        cpu_op("rope_and_write_kv")(qkv.clone(), cos, signed_sin, pool, slots[:-1], heads)


@pytest.mark.parametrize("dtype,dim", [(torch.float32, 64), (torch.bfloat16, 64), (torch.bfloat16, 40)])
def test_fused_rope_and_int8_write_quantizes_as_torch_does(dtype: torch.dtype, dim: int, isa: str) -> None:
    """Into an int8 pool with static key scales, the fused op stores what the torch path stores
    for the keys it rotated: the same codes, value scales and clip count (scales small enough
    that some keys clip; head_dim 40 ends past the last 16 lanes). Pools it does not serve
    (per-block keys, int4, fp8) are left untouched."""
    from kvserve.cache.kv_cache import PagedKVCache
    from kvserve.cache.kv_layer import KVQuantSpec

    torch.manual_seed(2)
    tokens, heads, kv_heads, block_size, blocks = 7, 9, 3, 4, 9
    qkv = (torch.randn(tokens, heads + 2 * kv_heads, dim) * 3).to(dtype)
    angles = torch.rand(tokens, dim // 2) * 6
    cos = torch.cat((angles.cos(), angles.cos()), -1)
    signed_sin = torch.cat((-angles.sin(), angles.sin()), -1)
    slots = torch.tensor([4, 5, 6, 7, 9, 13, 30])
    write = KVWriteIndex(kv_write_rows(slots, block_size, 2 * kv_heads), kv_write_rows(slots, block_size, kv_heads),
                         None)
    meta = AttentionMetadata(slots, write, [])
    key_scales = (torch.rand(1, kv_heads, dim) + 0.5) * 5  # /127 per channel: ~2% of keys clip
    caches = [PagedKVCache(1, blocks, block_size, kv_heads, dim, dtype, torch.device("cpu"),
                           KVQuantSpec("int8", key_scales=key_scales)) for _ in range(2)]
    for cache in caches:
        cache.zero_new_blocks(blocks - 1)
        cache.layers[0].value_scales.fill_(-1.0)
    fused, ref = caches[0].layers[0], caches[1].layers[0]
    rotated = qkv.clone()
    assert rope_and_write_kv(rotated, cos, signed_sin, fused, meta, heads)
    ref.write(rotated[:, heads : heads + kv_heads], rotated[:, heads + kv_heads :], write)
    assert torch.equal(fused.data, ref.data)
    assert torch.equal(fused.value_scales, ref.value_scales)
    assert int(fused.clipped) == int(ref.clipped) > 0 and fused.checked == ref.checked
    qk = apply_rope(qkv[:, : heads + kv_heads], cos.to(dtype)[:, None], signed_sin.to(dtype)[:, None])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(rotated[:, : heads + kv_heads].float(), qk.float(), atol=tol, rtol=tol)
    for kind, scales in (("int8", None), ("int4", None), ("fp8_e4m3", None)):
        other = PagedKVCache(1, blocks, block_size, kv_heads, dim, dtype, torch.device("cpu"),
                             KVQuantSpec(kind, key_scales=scales)).layers[0]
        before, untouched = other.data.clone(), qkv.clone()
        assert not rope_and_write_kv(untouched, cos, signed_sin, other, meta, heads)
        assert torch.equal(other.data, before) and torch.equal(untouched, qkv)


@pytest.mark.parametrize("kind", ["int4", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rope_and_tail_write_in_a_prefill_chunk_stores_what_torch_does(kind: str,
                                                                             dtype: torch.dtype, isa: str) -> None:
    """A prefill chunk into a pool with tail slots (int4; int8 with per-block key scales): the
    fused op rotates the tokens into a row each, then the tail moves and the blocks that fill go
    through the C++ quantizer. Pool codes, scales and tail rows equal the torch path's
    (TailKV.write of the same rotated K/V), bit for bit. The chunk continues a sequence whose 2
    cached tokens wait in its tail slot: 2 tokens complete that block (staged from the tail), 4
    fill the next one, the last starts a new partial block."""
    from kvserve.cache.kv_cache import PagedKVCache
    from kvserve.cache.kv_layer import KVQuantSpec, TailPlan

    torch.manual_seed(3)
    tokens, heads, kv_heads, dim, block_size, blocks = 7, 9, 3, 64, 4, 24
    qkv = (torch.randn(tokens, heads + 2 * kv_heads, dim) * 2).to(dtype)
    angles = torch.rand(tokens, dim // 2) * 6
    cos = torch.cat((angles.cos(), angles.cos()), -1)
    signed_sin = torch.cat((-angles.sin(), angles.sin()), -1)
    slots = torch.arange(2, 2 + tokens)  # positions 2..8 of the sequence (its slot mapping is unused here)
    ids = lambda *values: torch.tensor(values, dtype=torch.long)  # noqa: E731
    plan = TailPlan(pre_tokens=ids(0, 1), pre_rows=ids(2, 3), block_ids=ids(12, 13), stage_tokens=ids(2, 3, 4, 5),
                    stage_token_rows=ids(4, 5, 6, 7), stage_tail_rows=ids(0, 1, 2, 3),
                    stage_from_tail=ids(0, 1, 2, 3), post_tokens=ids(6), post_rows=ids(0), token_rows=ids(),
                    fill_rows=ids())
    meta = AttentionMetadata(slots, KVWriteIndex(kv_write_rows(slots, block_size, 2 * kv_heads), None, plan), [])
    cached = torch.randn(2, 2 * kv_heads, dim).to(dtype)  # the sequence's first 2 tokens, in its tail slot
    layers = [PagedKVCache(1, blocks, block_size, kv_heads, dim, dtype, torch.device("cpu"),
                           KVQuantSpec(kind)).layers[0] for _ in range(2)]
    for layer in layers:
        assert layer.tail is not None
        layer.data.zero_()
        layer.tail[0, :2] = cached
    fused, ref = layers
    rotated = qkv.clone()
    assert rope_and_write_kv(rotated, cos, signed_sin, fused, meta, heads)
    ref.write(rotated[:, heads : heads + kv_heads], rotated[:, heads + kv_heads :], meta.write)
    assert fused.tail is not None and ref.tail is not None
    assert fused.key_scales is not None and ref.key_scales is not None
    assert fused.value_scales is not None and ref.value_scales is not None
    assert torch.equal(fused.data[12:14], ref.data[12:14]) and fused.data[12:14].any()
    assert torch.equal(fused.key_scales[12:14], ref.key_scales[12:14])
    assert torch.equal(fused.value_scales[12:14], ref.value_scales[12:14])
    assert torch.equal(fused.tail[0], ref.tail[0])  # its first row: the new partial block's token
    torch.testing.assert_close(fused.tail[0, 0, :kv_heads].float(), rotated[6, heads : heads + kv_heads].float(),
                               atol=0, rtol=0)
    qk = apply_rope(qkv[:, : heads + kv_heads], cos.to(dtype)[:, None], signed_sin.to(dtype)[:, None])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(rotated[:, : heads + kv_heads].float(), qk.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("window", [0, 100])
def test_banded_attention_equals_one_masked_call(window: int) -> None:
    """Query tiles over only the key columns they may see give what one SDPA call over the
    whole mask gives: a chunk of 600 queries after 300 cached tokens, causal, and with a window."""
    torch.manual_seed(0)
    batch, heads, kv_heads, cached, chunk, dim = 2, 4, 2, 300, 600, 32
    q = torch.randn(batch, heads, chunk, dim)
    k, v = torch.randn(batch, kv_heads, cached + chunk, dim), torch.randn(batch, kv_heads, cached + chunk, dim)
    query_pos = cached + torch.arange(chunk)[:, None]
    key_pos = torch.arange(cached + chunk)[None, :]
    mask = key_pos <= query_pos
    if window:
        mask &= key_pos > query_pos - window
    mask = mask.expand(batch, 1, chunk, cached + chunk)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.2, enable_gqa=True)
    assert chunk > PREFILL_TILE
    torch.testing.assert_close(banded_attention(q, k, v, mask, 0.2), want, atol=1e-5, rtol=1e-5)
