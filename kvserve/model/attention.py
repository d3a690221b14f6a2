"""Paged attention: write new K/V into the block pool, read each sequence through its table.

On CPU, decode groups (one query token per sequence) and prefill groups go through fused C++
kernels that read K/V in place through the block tables. Elsewhere (CUDA, no compiler, a head
size the prefill kernel has no vector path for) a group gathers its sequences' whole
blocks (one index_select per layer for K and V together; the table tensor is built once per
step and shared by all layers) into a transient [2*kv_heads, batch, blocks*block_size,
head_dim] tensor. Padding entries point at the zeroed null block; positions at or past a
sequence's length are masked out.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.profiler import record_function

from kvserve.cache.kv_layer import KVWriteIndex, LayerKV
from kvserve.cache.kv_layer_quant import Int4KV, Int8BlockKV, Int8StaticKV, TailKV
from kvserve.cache.kv_quant import FP8_TYPES, KIND_CODES
from kvserve.model.cpu_kernels import cpu_op


class Cascade(NamedTuple):
    """Queries of sequences that all start with the same blocks (one system prompt, many users):
    the shared keys are read once for all of them, by one non-causal call of the prefill kernel
    (every query as its rows), each sequence's own blocks by the decode kernel (or, for prefill
    chunks, the causal prefill kernel), and the two partial softmaxes merged by their
    log-sum-exps (FlashInfer's cascade attention, Hydragen). The shared blocks are full cached
    prefix blocks before every query, so every query sees them all."""

    shared_table: torch.Tensor  # [1, shared blocks]
    shared_len: torch.Tensor  # [1]: shared blocks * block_size
    suffix_tables: torch.Tensor  # [batch, table width - shared blocks]
    suffix_lens: torch.Tensor  # [batch]: each sequence's keys past the shared blocks (>= its queries)


@dataclass(slots=True)
class AttentionGroup:
    """Sequences that share one attention call: ``batch`` sequences of ``query_len`` tokens each,
    stored contiguously at [token_start, token_start + batch * query_len) of the flat batch."""

    token_start: int
    batch: int
    query_len: int
    block_tables: torch.Tensor  # [batch, max_blocks] physical block ids (0 = null block)
    uses_kernel: bool  # served by a C++ kernel (decode or prefill), which reads the pool in place
    mask: torch.Tensor | None  # [batch, 1, query_len, max_blocks * block_size] True = attend (torch paths)
    seq_lens: torch.Tensor  # [batch] tokens in the cache after this step's writes
    causal_from_start: bool  # every chunk starts at position 0: plain causal attention
    bias: torch.Tensor | None  # additive mask for the matmul decode path (None: kernel or SDPA)
    tail_slots: torch.Tensor | None = None  # [batch] each sequence's tail slot (pools that keep one)
    cascade: Cascade | None = None  # kernel groups over a shared prefix (pools held as the model's dtype)


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] pool slot of each new token
    write: KVWriteIndex  # where the new tokens' K/V (and scales) go
    groups: list[AttentionGroup]
    fused_rope_write: bool = False  # layers may use the C++ rotary + cache-write op
    kv_observer: Callable[[LayerKV, torch.Tensor, torch.Tensor], None] | None = None  # sees K/V before the write
    # a recompute of tokens already cached (SnapKV's observation window): sees each layer's
    # rotated queries, and their K/V are not written again (the blocks may be shared by then)
    query_observer: Callable[[LayerKV, torch.Tensor], None] | None = None


def use_decode_kernel(device: torch.device) -> bool:
    """Decode groups use the fused C++ kernels on CPU when they compiled."""
    return device.type == "cpu" and cpu_op("paged_decode_attention") is not None


def use_prefill_kernel(device_type: str, head_dim: int, dtype: torch.dtype, pools_as_is: bool = True) -> bool:
    """Prefill groups use the C++ kernel on CPU where it has a vector path for this head size
    and dtype, over pools held in the model's dtype (``pools_as_is``) or not (quantized, or
    16-bit under a float32 model): the op for that pool says so by running a two-token probe."""
    if device_type != "cpu":
        return False
    if pools_as_is:
        op = cpu_op("paged_prefill_attention")
        return op is not None and _prefill_kernel_runs(op, head_dim, dtype)
    op = cpu_op("paged_attention_quantized")
    return op is not None and _quantized_prefill_kernel_runs(op, head_dim, dtype)


@functools.cache  # by the op itself: each ISA level's build answers for itself
def _prefill_kernel_runs(op: Callable[..., bool], head_dim: int, dtype: torch.dtype) -> bool:
    query = torch.zeros(1, 1, head_dim, dtype=dtype)
    pool = torch.zeros(2, 2, 1, head_dim, dtype=dtype)
    return bool(op(torch.empty_like(query), query, pool, torch.ones(1, 1, dtype=torch.long),
                   torch.ones(1, dtype=torch.long), 1, 1.0))


@functools.cache
def _quantized_prefill_kernel_runs(op: Callable[..., bool], head_dim: int, dtype: torch.dtype) -> bool:
    """Two queries over a float16 pool of two one-token blocks, read as a coded pool (every kind
    shares the op's prefill path: rows dequantized to float32, then the float kernel)."""
    query = torch.zeros(2, 1, head_dim, dtype=dtype)
    pool = torch.zeros(3, 2, 1, head_dim, dtype=torch.float16)
    return bool(op(torch.empty_like(query), query, pool, KIND_CODES["fp16"], None, None, 1.0, None, None, None,
                   torch.tensor([[1, 2]]), torch.tensor([2]), 2, 1.0))


def _label(name: str) -> contextlib.AbstractContextManager[object]:
    """The op's label in profiles (kvserve::name), only while a profiler records: record_function
    costs ~7 us a call even with none, and a decode step makes two such calls per layer."""
    return record_function("kvserve::" + name) if torch.autograd._profiler_enabled() else contextlib.nullcontext()


def _write_op(name: str, *args: object) -> object:
    kernel = cpu_op(name)
    assert kernel is not None
    with _label(name):
        return kernel(*args)


def _quantize_rows(layer: TailKV, src: torch.Tensor, rows: torch.Tensor, block_ids: torch.Tensor) -> None:
    """Whole blocks into ``block_ids`` from rows of ``src`` [*, 2*kv_heads, dim] (block i's tokens
    at ``rows[i * block_size : (i + 1) * block_size]``): int4, and int8 with per-block key scales,
    in one C++ op (bit for bit the torch path, whose ~30 small ops per layer took ~10% of an int4
    decode step at 32 x 2,048), else (or where the op declines) in torch."""
    if isinstance(layer, Int4KV | Int8BlockKV):
        assert layer.key_scales is not None and layer.value_scales is not None
        if _write_op("quantize_blocks", src, rows, block_ids, KIND_CODES[layer.kind], layer.data, layer.key_scales,
                     layer.value_scales):
            return
    layer.quantize_staged(src.index_select(0, rows), block_ids)


def narrowed_float_pool(layer: LayerKV, dtype: torch.dtype) -> bool:
    """A float32 model over a bf16/float16 pool (--kv-cache-dtype bf16 on a CPU whose default model
    dtype is float32): the float ops read and write it, widening and rounding per element."""
    return layer.direct and dtype == torch.float32 and layer.data.dtype in (torch.bfloat16, torch.float16)


def rope_and_write_kv(qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, layer: LayerKV,
                      meta: AttentionMetadata, num_heads: int) -> bool:
    """C++ op: rotary on qkv's query and key heads in place ([T, H + 2*KVH, D], contiguous;
    cos/signed_sin float32 [T, D]), then each token's K and V heads into its pool slot: as they
    are into a pool of the model's dtype (or rounded into a bf16/float16 pool under a float32
    model), quantized into an int8 pool with static key scales
    (as kv_quant.quantize would: codes, value scales and clip count), or, for pools that keep a
    full-precision tail block (int4, per-block int8), into the tail slots (decode: each token
    straight to its tail row; prefill: through a row per token and TailKV.write_rows), quantizing
    the blocks that fill as the torch path does. False, touching nothing, for anything else (the
    caller then ropes and writes in torch)."""
    if layer.holds_as_is(qkv.dtype) or narrowed_float_pool(layer, qkv.dtype):
        _write_op("rope_and_write_kv", qkv, cos, signed_sin, layer.data, meta.slot_mapping, num_heads)
        return True
    plan = meta.write.tail
    if isinstance(layer, TailKV) and layer.tail is not None and plan is not None and layer.tail.dtype == qkv.dtype:
        tail_rows = layer.tail.view(-1, *layer.tail.shape[2:])
        if plan.token_rows.numel() == qkv.shape[0]:
            # decode: every token into its tail row (the tail seen as a pool of one-token blocks),
            # then the blocks that filled are quantized from their tail slots
            tail = layer.tail.view(-1, layer.tail.shape[2], 1, layer.tail.shape[3])
            _write_op("rope_and_write_kv", qkv, cos, signed_sin, tail, plan.token_rows, num_heads)
            if plan.block_ids.numel():
                _quantize_rows(layer, tail_rows, plan.fill_rows, plan.block_ids)
        else:  # prefill: rotary into a row per token, then the tail moves and the blocks that fill
            num_tokens, rows_per_token = qkv.shape[0], tail_rows.shape[1]
            new = qkv.new_empty(num_tokens, rows_per_token, 1, qkv.shape[2])
            _write_op("rope_and_write_kv", qkv, cos, signed_sin, new,
                      torch.arange(num_tokens, device=qkv.device), num_heads)
            layer.write_rows(new.view(num_tokens, rows_per_token, -1), plan, lambda stage, block_ids: _quantize_rows(
                layer, stage, torch.arange(stage.shape[0], device=stage.device), block_ids))
        return True
    if not isinstance(layer, Int8StaticKV):
        return False
    assert layer.key_scales is not None and layer.value_scales is not None
    _write_op("rope_and_write_kv_int8", qkv, cos, signed_sin, layer.data, meta.slot_mapping, num_heads,
              layer.key_scales, layer.value_scales, layer.clipped)
    layer.checked += qkv.shape[0] * layer.key_scales.numel()  # key elements that passed the static scales
    return True


def kv_write_rows(slot_mapping: torch.Tensor, block_size: int, heads: int) -> torch.Tensor:
    """Row of each new token's ``heads`` rows in a per-block [num_blocks, heads, block_size, row]
    tensor viewed as [num_blocks * heads * block_size, row]: the pool (heads = 2 * kv_heads, K then
    V) or its value scales (heads = kv_heads). Built once per step."""
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    head_ids = torch.arange(heads, device=slot_mapping.device)
    return ((blocks[:, None] * heads + head_ids[None, :]) * block_size + offsets[:, None]).view(-1)


@functools.cache
def fp8_table(kind: str) -> torch.Tensor:
    """float32 value of each of the 256 codes of an fp8 format (the C++ kernel's lookup table)."""
    return torch.arange(256, dtype=torch.int64).to(torch.uint8).view(FP8_TYPES[kind]).float()


def attention_bias(mask: torch.Tensor, num_heads: int, kv_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """The boolean mask [B, 1, Lq, L] as the additive bias _attend_kv_major's baddbmm takes,
    laid out [kv_heads * B, group * Lq, L]. Built once per step, shared by all layers."""
    batch, _, query_len, kv_len = mask.shape
    group = num_heads // kv_heads
    allowed = mask.view(1, batch, 1, query_len, kv_len).expand(kv_heads, batch, group, query_len, kv_len)
    bias = torch.zeros(allowed.shape, dtype=dtype, device=mask.device).masked_fill_(~allowed, float("-inf"))
    return bias.view(kv_heads * batch, group * query_len, kv_len)


def _attend_kv_major(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [B, Lq, H, D]; k, v [KVH, B, L, D]; bias from attention_bias. GQA as batched matmuls
    with the G query heads of each KV head stacked as rows; softmax accumulates in float32."""
    batch, query_len, num_heads, head_dim = q.shape
    kv_heads, kv_len = k.shape[0], k.shape[2]
    group = num_heads // kv_heads
    qg = q.view(batch, query_len, kv_heads, group, head_dim).permute(2, 0, 3, 1, 4)
    qg = qg.reshape(kv_heads * batch, group * query_len, head_dim)
    scores = torch.baddbmm(bias, qg, k.reshape(kv_heads * batch, kv_len, head_dim).transpose(1, 2), alpha=scale)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
    out = torch.bmm(probs, v.reshape(kv_heads * batch, kv_len, head_dim))
    return out.view(kv_heads, batch, group, query_len, head_dim).permute(1, 3, 0, 2, 4)


PREFILL_TILE = 256  # query rows per SDPA call when a mask bands the keys


def banded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """SDPA with an explicit mask (q [B, H, Lq, D]; k, v [B, KVH, L, D]; mask [B, 1, Lq, L]),
    in tiles of PREFILL_TILE query rows, each over only the key columns its rows may see: a
    sliding window's prefill chunk (and a causal chunk after a cached prefix) then skips the
    keys wholly masked for the tile instead of computing and discarding them (measured on
    Gemma 3's 2,000-token prompts: the window's layers did 4x the needed work untiled)."""
    query_len = q.shape[2]
    if query_len <= PREFILL_TILE:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    out = torch.empty_like(q)
    for start in range(0, query_len, PREFILL_TILE):
        rows = mask[:, :, start : start + PREFILL_TILE]
        seen = rows.any(dim=2).any(dim=0).squeeze(0).nonzero()
        low, high = int(seen[0]), int(seen[-1]) + 1  # every row sees its own key, so seen is never empty
        out[:, :, start : start + PREFILL_TILE] = F.scaled_dot_product_attention(
            q[:, :, start : start + PREFILL_TILE], k[:, :, low:high], v[:, :, low:high],
            attn_mask=rows[..., low:high], scale=scale, enable_gqa=True)
    return out


def _quantized_kernel(out: torch.Tensor, query: torch.Tensor, layer: LayerKV, group: AttentionGroup,
                      scale: float) -> None:
    kernel = cpu_op("paged_attention_quantized")
    assert kernel is not None, "groups without a mask need the C++ kernels"
    lut = fp8_table(layer.kind) if layer.kind in FP8_TYPES else None
    # decode and prefill groups share the op; profiles name them apart
    name = "paged_attention_quantized" if group.query_len == 1 else "paged_prefill_attention_quantized"
    with _label(name):
        done = kernel(out, query, layer.data, KIND_CODES[layer.kind], layer.key_scales, layer.value_scales,
                      layer.v_scale, lut, layer.tail, group.tail_slots if layer.tail is not None else None,
                      group.block_tables, group.seq_lens, group.query_len, scale)
    assert done, "the quantized attention kernel refused a supported shape"


def cascade_attention(out: torch.Tensor, query: torch.Tensor, kv_cache: torch.Tensor, cascade: Cascade,
                      query_len: int, scale: float) -> None:
    """Attention into ``out`` [T, H, D] (contiguous) for ``query_len`` queries per sequence
    ([T, H, D]) whose tables share ``cascade``'s leading blocks (see Cascade). Both partial
    results stay float32 until the merge, which rounds once to the model dtype."""
    kernel = cpu_op("cascade_attention")
    assert kernel is not None, "a cascade needs the C++ kernels"
    with _label("cascade_attention"):
        done = kernel(out, query, kv_cache, cascade.shared_table, cascade.shared_len, cascade.suffix_tables,
                      cascade.suffix_lens, query_len, scale)
    assert done, "the prefill kernel refused a cascade's shape"


def paged_attention(query: torch.Tensor, layer: LayerKV, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """query [T, H, D]; ``layer``'s pool [num_blocks, 2*KVH, block_size, row], this step's K/V
    already written. Every group reads its sequences' K/V from the pool through their block
    tables (quantized pools are dequantized block by block inside the kernel). Returns [T, H, D]."""
    kv_cache = layer.data
    num_blocks, two_kv_heads, block_size = kv_cache.shape[:3]
    kv_heads = two_kv_heads // 2
    num_heads, head_dim = query.shape[1], query.shape[2]
    direct = layer.holds_as_is(query.dtype)
    widened = narrowed_float_pool(layer, query.dtype)
    if layer.key_rotation is not None:  # keys are stored rotated: rotate q alike, q·k is unchanged
        query = (query.float() @ layer.key_rotation).to(query.dtype)
    out = torch.empty_like(query)
    for group in meta.groups:
        end = group.token_start + group.batch * group.query_len
        # the float kernels: the pool in the query's dtype, or a float32 decode widening a 16-bit pool
        float_kernel = direct or (widened and group.query_len == 1 and group.cascade is None)
        if group.uses_kernel and not float_kernel:
            _quantized_kernel(out[group.token_start : end], query[group.token_start : end], layer, group, scale)
            continue
        if group.cascade is not None:
            cascade_attention(out[group.token_start : end], query[group.token_start : end], kv_cache, group.cascade,
                              group.query_len, scale)
            continue
        if group.uses_kernel:
            # reads K/V in place through the block tables (no gathered copy), writes into out
            name = "paged_decode_attention" if group.query_len == 1 else "paged_prefill_attention"
            kernel = cpu_op(name)
            assert kernel is not None, "groups without a mask need the C++ kernels"
            args = (out[group.token_start : end], query[group.token_start : end], kv_cache, group.block_tables,
                    group.seq_lens)
            with _label(name):
                if group.query_len == 1:
                    kernel(*args, scale)
                else:
                    assert kernel(*args, group.query_len, scale), "the prefill kernel refused a supported shape"
            continue
        q = query[group.token_start : end].view(group.batch, group.query_len, num_heads, head_dim)
        width = group.block_tables.shape[1]
        if direct:
            blocks = kv_cache.view(num_blocks, -1).index_select(0, group.block_tables.view(-1))
        else:
            blocks = layer.gather(group.block_tables, group.seq_lens, group.tail_slots, query.dtype)
        kv = blocks.view(group.batch, width, two_kv_heads, block_size, head_dim).permute(2, 0, 1, 3, 4)
        kv = kv.reshape(two_kv_heads, group.batch, width * block_size, head_dim)
        k, v = kv[:kv_heads], kv[kv_heads:]
        if group.bias is None:
            assert group.mask is not None
            # With no cached prefix, top-left causal alignment is exact (padded keys lie past
            # every query) and SDPA's is_causal path is ~30% faster than an explicit mask.
            if group.causal_from_start:
                o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(0, 1), v.transpose(0, 1),
                                                   is_causal=True, scale=scale, enable_gqa=True).transpose(1, 2)
            else:
                o = banded_attention(q.transpose(1, 2), k.transpose(0, 1), v.transpose(0, 1), group.mask,
                                     scale).transpose(1, 2)
        else:
            o = _attend_kv_major(q, k, v, group.bias, scale)
        out[group.token_start : end] = o.reshape(-1, num_heads, head_dim)
    return out


def paged_latent_attention(query: torch.Tensor, layer: LayerKV, meta: AttentionMetadata, scale: float,
                           value_dim: int,
                           expand: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None
                           ) -> torch.Tensor:
    """MLA (model/deepseek.py) over a latent pool [num_blocks, 1, block_size, latent_dim], this
    step's vectors already written. Without ``expand``, every head attends over the cached
    vectors as they are (query [T, H, latent_dim], absorbed): keys are the whole vectors,
    values their first ``value_dim`` channels. With ``expand``, the cached vectors are first
    up-projected to per-head keys and values (query [T, H, key dim]). Masks come from the
    runner (no kernel reads a latent pool). Returns [T, H, value_dim]."""
    latent_dim = layer.data.shape[-1]
    num_heads = query.shape[1]
    out = query.new_empty(query.shape[0], num_heads, value_dim)
    for group in meta.groups:
        assert group.mask is not None, "latent attention needs the runner's masks"
        end = group.token_start + group.batch * group.query_len
        q = query[group.token_start : end].view(group.batch, group.query_len, num_heads, -1).transpose(1, 2)
        cached = layer.data.index_select(0, group.block_tables.view(-1)).view(group.batch, -1, latent_dim)
        if expand is None:  # one vector for every head: the heads' query rows stacked against it
            # (one matmul per sequence; broadcasting the vectors over the heads copied them, 19x slower)
            q = q.reshape(group.batch, 1, num_heads * group.query_len, -1)
            keys, values = cached.unsqueeze(1), cached[..., :value_dim].unsqueeze(1)
        else:
            keys, values = expand(cached)
        scores = torch.matmul(q, keys.transpose(-1, -2)).view(group.batch, num_heads, group.query_len, -1)
        scores = scores.mul_(scale).masked_fill_(~group.mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(cached.dtype)
        o = torch.matmul(probs.view(*q.shape[:-1], -1), values).view(group.batch, num_heads, group.query_len, -1)
        out[group.token_start : end] = o.transpose(1, 2).reshape(-1, num_heads, value_dim)
    return out
