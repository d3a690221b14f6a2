"""The decode and prefill kernels over quantized pools (int8, int4, fp8) compute float32 attention
over the values the pool stands for."""

from __future__ import annotations

import pytest
import torch

from kvserve.cache.kv_quant import FP8_TYPES, KIND_CODES
from kvserve.model.attention import (
    fp8_table,
)
from kvserve.model.cpu_kernels import cpu_op

# the levels with a float prefill kernel (the portable level runs gather + SDPA; see use_prefill_kernel)
prefill_levels = pytest.mark.isa_levels("avx2", "avx512", "amx")


def _quantized_pool(kind: str, num_blocks: int, kv_heads: int, block_size: int, dim: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """A random int8, int4 or fp8 pool and its scales in the kernel's layout, and the float32 K/V
    they stand for, [num_blocks, 2 * kv_heads, block_size, dim]. "int8" and "fp8_*": codes times
    per-channel key scales of each block and per-token value scales; "-static": one key scale
    table, one v_scale (0.02); "int4": codes 0-15 two per byte, keys code * step + min per channel
    of each block, values per token and group of 32 channels. fp8 codes span the format's
    exponents, subnormals included (no NaNs)."""
    shape = (num_blocks, 2 * kv_heads, block_size, dim)
    if kind == "int4":
        codes = torch.randint(0, 16, shape)
        packed = (codes[..., : dim // 2] | (codes[..., dim // 2 :] << 4)).to(torch.uint8)
        key_affine = torch.stack([0.01 + 0.05 * torch.rand(num_blocks, kv_heads, dim),
                                  torch.randn(num_blocks, kv_heads, dim) * 0.3], 2).half()
        value_affine = torch.stack([0.01 + 0.05 * torch.rand(num_blocks, kv_heads, block_size, dim // 32),
                                    torch.randn(num_blocks, kv_heads, block_size, dim // 32) * 0.3], 4).half()
        step, low = key_affine.float().unbind(2)
        k = codes[:, :kv_heads] * step[:, :, None, :] + low[:, :, None, :]
        v_step, v_low = value_affine.float().repeat_interleave(32, 3).unbind(4)
        v = codes[:, kv_heads:] * v_step + v_low
        return packed, key_affine, value_affine, torch.cat([k, v], 1)
    if kind.startswith("fp8"):
        x = torch.randn(shape) * torch.exp2(torch.randint(-12, 5, shape).float())
        fp8 = x.clamp(-448, 448).to(FP8_TYPES[kind.split("-")[0]])
        codes, levels = fp8.view(torch.uint8), fp8.float()
    else:
        codes = torch.randint(-127, 128, shape, dtype=torch.int8)
        levels = codes.float()
    if kind.endswith("-static"):
        key_scales = 0.005 + 0.03 * torch.rand(kv_heads, dim)
        return codes, key_scales, None, torch.cat([levels[:, :kv_heads] * key_scales[:, None, :],
                                                   levels[:, kv_heads:] * 0.02], 1)
    key_scales = 0.005 + 0.03 * torch.rand(num_blocks, kv_heads, dim)
    value_scales = 0.005 + 0.03 * torch.rand(num_blocks, kv_heads, block_size, 1)
    return codes, key_scales, value_scales, torch.cat([levels[:, :kv_heads] * key_scales[:, :, None, :],
                                                       levels[:, kv_heads:] * value_scales], 1)


def _quantized_pool_attention(kind: str, block_size: int, heads: int, kv_heads: int, dim: int, query_len: int,
                            dtype: torch.dtype, lengths: tuple[int, ...] = (1, 15, 16, 17, 100, 300),
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The quantized kernel's attention for query_len queries per sequence (each sequence's last
    positions, causal) over a random quantized pool (_quantized_pool), and float32 attention over the
    values the pool stands for: (out, expected), [batch * query_len, heads, dim] float32."""
    torch.manual_seed(3)
    lens = torch.tensor(lengths).clamp(min=query_len)
    batch, group, width = len(lens), heads // kv_heads, int((lens.max() + block_size - 1) // block_size)
    data, key_scales, value_scales, kv_pool = _quantized_pool(kind, batch * width + 1, kv_heads, block_size, dim)
    tables = (torch.randperm(batch * width) + 1).view(batch, width)
    with_tail = not kind.endswith("-static")
    fp8 = kind.split("-")[0] if kind.startswith("fp8") else None
    tail = torch.randn(batch, block_size, 2 * kv_heads, dim) if with_tail else None
    tail_slots = torch.randperm(batch) if with_tail else None
    query = (2 * torch.randn(batch * query_len, heads, dim)).to(dtype)
    out = torch.empty_like(query)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        kernel = cpu_op("paged_attention_quantized")
        assert kernel is not None
        assert kernel(out, query, data, KIND_CODES[kind.split("-")[0]], key_scales, value_scales, 0.02,
                      None if fp8 is None else fp8_table(fp8), tail,
                      tail_slots, tables, lens, query_len, dim**-0.5)
    finally:
        torch.set_num_threads(threads)
    expected = torch.empty(batch * query_len, heads, dim)
    for b in range(batch):
        kv = kv_pool[tables[b]].clone()  # [width, 2*kv_heads, block, dim]
        length, partial = int(lens[b]), int(lens[b]) % block_size
        if tail is not None and tail_slots is not None and partial:
            kv[length // block_size, :, :partial] = tail[tail_slots[b], :partial].transpose(0, 1)
        kv = kv.permute(1, 0, 2, 3).reshape(2 * kv_heads, -1, dim)[:, :length]
        keys, values = kv[:kv_heads].repeat_interleave(group, 0), kv[kv_heads:].repeat_interleave(group, 0)
        q = query[b * query_len : (b + 1) * query_len].float().transpose(0, 1)  # [heads, query_len, dim]
        visible = torch.arange(length)[None, :] <= (length - query_len + torch.arange(query_len))[:, None]
        scores = (q @ keys.transpose(1, 2) * dim**-0.5).masked_fill(~visible, float("-inf"))
        expected[b * query_len : (b + 1) * query_len] = (torch.softmax(scores, dim=-1) @ values).transpose(0, 1)
    return out.float(), expected


@pytest.mark.parametrize("block_size", [1, 16, 256])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (7, 1, 64), (10, 2, 128), (4, 1, 256)])
@pytest.mark.parametrize("kind", ["int8-static", "int8", "int4", "fp8_e4m3-static", "fp8_e5m2-static", "fp8_e4m3"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-3), (torch.bfloat16, 1e-2)])
def test_quantized_decode_kernel_is_float32_attention_over_the_dequantized_pool(block_size: int, heads: int,
                                                                                kv_heads: int, dim: int, kind: str,
                                                                                dtype: torch.dtype,
                                                                                tol: float, isa: str) -> None:
    """int8, int4 and fp8 pools (integer dot products on VNNI CPUs, bf16 ones for fp8 on
    AVX512-BF16 + VBMI CPUs): float32 attention over the values the codes and scales stand for;
    where scales are per block, each sequence's partial last block is read from its
    full-precision tail slot. VNNI rounds the query and the weights to int16 (2^-16 of their
    largest): ~1e-4 of the values' range; fp8 scores float32 queries times the key scales as two
    bf16 parts (~2^-17), bf16 ones as one (2^-9 of each product, ~1e-4 of the outputs here); bf16
    outputs are rounded to bf16 (2^-9 of values up to 2.9)."""
    out, expected = _quantized_pool_attention(kind, block_size, heads, kv_heads, dim, 1, dtype)
    if kind.startswith("fp8") and dtype == torch.float32:
        tol = 1e-5  # fp8's exact bf16 values, the query's two parts: float32 rounding only
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("kind", ["int8-static", "int4", "fp8_e4m3-static"])
def test_quantized_decode_of_long_sequences(kind: str, isa: str) -> None:
    """Sequences whose K/V is over half of L2 (here up to 6,000 tokens, 2.3 MB of int8) take the
    decode jobs that prefetch the next job's keys (NextKeys), mixed with short ones in one call."""
    out, expected = _quantized_pool_attention(kind, 16, 9, 3, 64, 1, torch.float32, (6000, 700, 2500, 15, 4100))
    torch.testing.assert_close(out, expected, atol=1e-3, rtol=1e-3)


@prefill_levels
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (10, 2, 128)])
@pytest.mark.parametrize("kind", ["int8-static", "int8", "int4", "fp8_e5m2-static", "fp8_e4m3"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_quantized_prefill_kernel_is_attention_over_the_dequantized_pool(block_size: int, heads: int, kv_heads: int,
                                                                       dim: int, kind: str, dtype: torch.dtype,
                                                                       tol: float, isa: str) -> None:
    """Prefill chunks (5 queries per sequence after a cached prefix) over int8, int4 and fp8 pools:
    float32 queries through the float32 tile path, bf16 queries through the bf16 dot-product path
    over the rows dequantized to bf16 (to within bf16's rounding of keys, values, weights and
    outputs: 3e-2 of values as large as 4.4 here)."""
    out, expected = _quantized_pool_attention(kind, block_size, heads, kv_heads, dim, 5, dtype)
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)
