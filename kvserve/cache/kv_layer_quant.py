"""The quantized KV formats (kvserve.cache.kv_quant's arithmetic): fp8 with static per-layer
scales, int8 with calibrated static key scales, and the tail formats (int8 with per-block key
scales, int4), which keep a sequence's partial last block in full precision in its tail slot and
quantize a block in the step that fills it. Each registers itself for its (kind, key-scale
mode) pairs."""


from __future__ import annotations

from collections.abc import Callable

import torch

from kvserve.cache.huge_pages import empty_per_block
from kvserve.cache.kv_format import KEY_SCALE_MODES
from kvserve.cache.kv_layer import KVQuantSpec, KVWriteIndex, LayerKV, PoolShape, TailPlan, _pool, register
from kvserve.cache.kv_quant import (
    FP8_TYPES,
    QMAX,
    affine_params,
    channel_scales,
    dequantize,
    from_int4_codes,
    grouped,
    hadamard,
    int4_codes,
    pack_int4,
    unpack_int4,
    value_groups,
)


@register(*((kind, mode) for kind in FP8_TYPES for mode in KEY_SCALE_MODES))
class Fp8KV(LayerKV):
    """fp8: static per-layer K and V scales; keys stored Hadamard-rotated (the query is rotated alike)."""

    __slots__ = ()

    @classmethod
    def allocate(cls, kind: str, shape: PoolShape, quant: KVQuantSpec, layer: int, clipped: torch.Tensor
                 ) -> LayerKV:
        k_scale, v_scale = (1.0, 1.0) if quant.fp8_scales is None else map(float, quant.fp8_scales[layer])
        key_scales = torch.full((shape.num_kv_heads, shape.head_dim), k_scale, dtype=torch.float32,
                                device=shape.device)
        power_of_two = shape.head_dim & (shape.head_dim - 1) == 0
        rotation = hadamard(shape.head_dim).to(shape.device) if power_of_two else None
        return cls(kind, _pool(kind, shape), key_scales, None, v_scale, None, clipped, key_rotation=rotation)

    def write(self, key: torch.Tensor, value: torch.Tensor, index: KVWriteIndex) -> None:
        self._store_per_token(key, value, index)

    def dequantize(self, data: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        assert self.key_scales is not None
        kv_heads = data.shape[1] // 2
        k = dequantize(data[:, :kv_heads], self.key_scales[None, :, None], self.kind)
        v = dequantize(data[:, kv_heads:], torch.tensor(self.v_scale), self.kind)
        return torch.cat((k, v), dim=1)


@register(("int8", "static"))
class Int8StaticKV(LayerKV):
    """int8 with a calibrated static key table per (KV head, channel); values per token."""

    __slots__ = ()

    @classmethod
    def allocate(cls, kind: str, shape: PoolShape, quant: KVQuantSpec, layer: int, clipped: torch.Tensor
                 ) -> LayerKV:
        assert quant.key_scales is not None
        key_scales = (quant.key_scales[layer] / QMAX[kind]).float().to(shape.device).contiguous()
        return cls(kind, _pool(kind, shape), key_scales, _int8_value_scales(shape), 1.0, None, clipped)

    def write(self, key: torch.Tensor, value: torch.Tensor, index: KVWriteIndex) -> None:
        self._store_per_token(key, value, index)

    def dequantize(self, data: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        assert self.key_scales is not None and self.value_scales is not None
        kv_heads = data.shape[1] // 2
        k = dequantize(data[:, :kv_heads], self.key_scales[None, :, None], self.kind)
        v = dequantize(data[:, kv_heads:], self.value_scales.index_select(0, ids), self.kind)
        return torch.cat((k, v), dim=1)


def _int8_value_scales(shape: PoolShape) -> torch.Tensor:
    return empty_per_block((shape.num_blocks, shape.num_kv_heads, shape.block_size, 1), torch.float32,
                           shape.device)


def _tail(data: torch.Tensor, shape: PoolShape) -> torch.Tensor:
    """The pool's own bytes seen as tail slots [slots, block_size, 2*kv_heads, dim] in the model
    dtype: slot i is blocks [i*n, (i+1)*n) with n = tail bytes / a block's codes (see
    kv_format.tail_blocks), so a tail costs n blocks of the one budget, taken on demand."""
    tail_bytes = shape.block_size * 2 * shape.num_kv_heads * shape.head_dim * shape.model_dtype.itemsize
    block_bytes = data[0].numel() * data.element_size()
    assert tail_bytes % block_bytes == 0, "a tail block spans a whole number of pool blocks"
    run = tail_bytes // block_bytes
    slots = shape.num_blocks // run
    raw = data.view(-1)[: slots * run * data[0].numel()]
    return raw.view(shape.model_dtype).view(slots, shape.block_size, 2 * shape.num_kv_heads, shape.head_dim)


class TailKV(LayerKV):
    """Formats whose key scales need a block's keys complete: a sequence's partial last block
    waits in its full-precision tail slot, and a block is quantized in the step that fills it."""

    __slots__ = ()
    keeps_tail_block = True

    def write(self, key: torch.Tensor, value: torch.Tensor, index: KVWriteIndex) -> None:
        assert index.tail is not None and self.tail is not None
        self.write_rows(torch.cat((key, value), dim=1).to(self.tail.dtype), index.tail)

    def write_rows(self, new: torch.Tensor, plan: TailPlan,
                   quantize: Callable[[torch.Tensor, torch.Tensor], None] | None = None) -> None:
        """This step's K/V rows ``new`` [T, 2*kv_heads, dim] (the tail's dtype) into the tail
        slots, and the blocks they fill quantized: ``quantize(stage, block_ids)`` gets those
        blocks' rows staged in token order (default: quantize_staged)."""
        assert self.tail is not None
        tail = self.tail.view(-1, *new.shape[1:])
        tail.index_copy_(0, plan.pre_rows, new.index_select(0, plan.pre_tokens))
        if plan.block_ids.numel():
            stage = new.new_empty((plan.block_ids.numel() * self.data.shape[2], *new.shape[1:]))
            stage.index_copy_(0, plan.stage_token_rows, new.index_select(0, plan.stage_tokens))
            stage.index_copy_(0, plan.stage_from_tail, tail.index_select(0, plan.stage_tail_rows))
            (quantize or self.quantize_staged)(stage, plan.block_ids)
        tail.index_copy_(0, plan.post_rows, new.index_select(0, plan.post_tokens))

    def quantize_staged(self, stage: torch.Tensor, block_ids: torch.Tensor) -> None:
        """stage [num * block_size, 2*kv_heads, dim]: whole blocks in token order, into ``block_ids``."""
        stage = stage.view(block_ids.numel(), self.data.shape[2], *stage.shape[1:])
        kv_heads = stage.shape[2] // 2
        self.quantize_blocks(stage[:, :, :kv_heads], stage[:, :, kv_heads:], block_ids)


@register(("int8", "block"))
class Int8BlockKV(TailKV):
    """int8 with key scales per (block, KV head, channel), computed when the block fills."""

    __slots__ = ()

    @classmethod
    def allocate(cls, kind: str, shape: PoolShape, quant: KVQuantSpec, layer: int, clipped: torch.Tensor
                 ) -> LayerKV:
        key_scales = empty_per_block((shape.num_blocks, shape.num_kv_heads, shape.head_dim), torch.float32,
                                     shape.device)
        data = _pool(kind, shape)
        return cls(kind, data, key_scales, _int8_value_scales(shape), 1.0, _tail(data, shape), clipped)

    def quantize_blocks(self, k: torch.Tensor, v: torch.Tensor, block_ids: torch.Tensor) -> None:
        assert self.key_scales is not None and self.value_scales is not None
        scales = channel_scales(k, self.kind, dim=1)  # [num, kv_heads, dim]
        self.key_scales.index_copy_(0, block_ids, scales)
        codes, vs = self._quantize_kv(k, v, scales[:, None])
        assert vs is not None
        self.data.index_copy_(0, block_ids, codes.transpose(1, 2))
        self.value_scales.index_copy_(0, block_ids, vs.transpose(1, 2))

    def dequantize(self, data: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        assert self.key_scales is not None and self.value_scales is not None
        kv_heads = data.shape[1] // 2
        k = dequantize(data[:, :kv_heads], self.key_scales.index_select(0, ids)[:, :, None], self.kind)
        v = dequantize(data[:, kv_heads:], self.value_scales.index_select(0, ids), self.kind)
        return torch.cat((k, v), dim=1)


@register(("int4", "static"), ("int4", "block"))
class Int4KV(TailKV):
    """int4, asymmetric (float16 step + minimum): keys per (block, KV head, channel), values per
    (token, KV head, group of channels); two codes per byte."""

    __slots__ = ()

    @classmethod
    def allocate(cls, kind: str, shape: PoolShape, quant: KVQuantSpec, layer: int, clipped: torch.Tensor
                 ) -> LayerKV:
        heads, dim, device = shape.num_kv_heads, shape.head_dim, shape.device
        key_scales = empty_per_block((shape.num_blocks, heads, 2, dim), torch.float16, device)
        value_scales = empty_per_block((shape.num_blocks, heads, shape.block_size, value_groups(kind, dim), 2),
                                       torch.float16, device)
        data = _pool(kind, shape)
        return cls(kind, data, key_scales, value_scales, 1.0, _tail(data, shape), clipped)

    @property
    def per_block_key_scales(self) -> bool:
        return True

    def quantize_blocks(self, k: torch.Tensor, v: torch.Tensor, block_ids: torch.Tensor) -> None:
        assert self.key_scales is not None and self.value_scales is not None
        k_step, k_low = affine_params(k.float(), dim=1)  # [num, kv_heads, dim]
        groups = self.value_scales.shape[3]
        v_step, v_low = affine_params(grouped(v.float(), groups), dim=-1)  # [num, bs, kv_heads, groups]
        k_codes = pack_int4(int4_codes(k, k_step[:, None], k_low[:, None]))
        v_codes = pack_int4(int4_codes(grouped(v, groups), v_step[..., None], v_low[..., None]).flatten(-2))
        self.key_scales.index_copy_(0, block_ids, torch.stack((k_step, k_low), dim=2))
        self.value_scales.index_copy_(0, block_ids, torch.stack((v_step, v_low), dim=-1).transpose(1, 2))
        self.data.index_copy_(0, block_ids, torch.cat((k_codes, v_codes), dim=2).transpose(1, 2))

    def dequantize(self, data: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        assert self.key_scales is not None and self.value_scales is not None
        kv_heads = data.shape[1] // 2
        affine = self.key_scales.index_select(0, ids)[:, :, None]  # [N, H, 1, 2, D]
        k = from_int4_codes(unpack_int4(data[:, :kv_heads]), affine[..., 0, :], affine[..., 1, :])
        v_affine = self.value_scales.index_select(0, ids)  # [N, H, bs, G, 2]
        v_codes = grouped(unpack_int4(data[:, kv_heads:]), v_affine.shape[3])
        v = from_int4_codes(v_codes, v_affine[..., 0:1], v_affine[..., 1:2]).flatten(-2)
        return torch.cat((k, v), dim=1)
