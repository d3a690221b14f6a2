"""The physical KV storage: per layer, one preallocated block pool in that layer's KV format.

Layout per layer: [num_blocks, 2 * num_kv_heads, block_size, row] — each block holds its K
heads then V heads contiguously, so reading a sequence's blocks copies large contiguous rows
(measured ~2x faster than a head-major layout when the pool is cold in cache). ``row`` is
head_dim elements of a float KV dtype, or head_dim (fp8, int8) / head_dim / 2 (int4) bytes.
Token slot ``block_id * block_size + offset`` is the token's position in the pool. Blocks are
zeroed when first handed out (see zero_new_blocks), so the unwritten tail of a block is zeros,
never uninitialised memory that could hold NaN bit patterns.

Quantized formats (kvserve.cache.kv_quant) add scales: key scales per (KV head, channel),
static (one calibrated table) or per block; value scales per (token, KV head[, group]); fp8 one
static scale per layer for K and one for V. Formats that need a block's keys complete before
they can be scaled (int4, and int8 with per-block key scales) keep each running sequence's
not-yet-full last block in full precision in a tail slot (KIVI's residual, aligned to blocks)
and quantize the block when it fills. Attention reads that block from the tail slot. A tail slot
is an aligned run of pool blocks whose bytes are viewed in the model dtype, handed out by the
KVCacheManager with the sequence's first blocks: tails and blocks share one budget.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch

from kvserve.cache.huge_pages import empty_per_block
from kvserve.cache.kv_disk import DiskTier
from kvserve.cache.kv_format import KEY_SCALE_MODES
from kvserve.cache.kv_plan import StorageWork
from kvserve.cache.kv_quant import (
    FLOAT_KINDS,
    FP8_TYPES,
    QMAX,
    affine_params,
    channel_scales,
    dequantize,
    float_kind,
    from_int4_codes,
    grouped,
    hadamard,
    int4_codes,
    pack_int4,
    quantize,
    row_bytes,
    token_scales,
    unpack_int4,
    value_groups,
)
from kvserve.cache.kv_tiers import HostBlockStore, TierMoves


class TailPlan(NamedTuple):
    """One step's moves for tail-slot layers, built once per step and shared by every layer.
    Token indices refer to the step's flat token batch; tail rows are ``slot * block_size +
    offset``; staging rows are ``i * block_size + offset`` for the i-th block to quantize."""

    pre_tokens: torch.Tensor  # tokens continuing a partial block: into the tail first
    pre_rows: torch.Tensor
    block_ids: torch.Tensor  # blocks that fill in this step, quantized from the staging rows
    stage_tokens: torch.Tensor  # staging rows taken from this step's tokens...
    stage_token_rows: torch.Tensor
    stage_tail_rows: torch.Tensor  # ...and the rows taken from tail slots
    stage_from_tail: torch.Tensor
    post_tokens: torch.Tensor  # tokens of a new, still partial last block: into the tail last
    post_rows: torch.Tensor
    # where every sequence's tokens of the step lie in one block (decode): each token's tail row,
    # and the tail rows of each block that fills (in block_ids order); empty otherwise
    token_rows: torch.Tensor
    fill_rows: torch.Tensor


@dataclass(slots=True)
class KVWriteIndex:
    """Where this step's tokens go, shared by all layers."""

    write_rows: torch.Tensor  # [T * 2 * kv_heads] pool rows (block, K/V head, offset)
    scale_rows: torch.Tensor | None  # [T * kv_heads] value-scale rows (block, head, offset)
    tail: TailPlan | None


class PoolShape(NamedTuple):
    """What every layer's pool is sized by."""

    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    model_dtype: torch.dtype  # tail slots are kept in it
    device: torch.device


@dataclass(slots=True)
class LayerKV:
    """One layer's pool in one KV format: the interface every format implements.

    A format says how to store a step's K/V (``write``), how to read whole blocks back as floats
    (``dequantize``, the torch path and the kernels' reference), which per-block tensors hold a
    block (``per_block_tensors``: a block copy or a move to another tier moves exactly these,
    in their stored format), and whether it keeps a full-precision tail block per running
    sequence (``keeps_tail_block``). ``kind`` and the scale tensors are what the C++ kernels read.

    Invariants: ``data`` rows at or past a sequence's length are never read as keys (masked);
    with a tail, a block in a block table is quantized only once full, and a sequence's partial
    last block lives in its tail slot, not in the pool."""

    kind: str  # kv_quant.KIND_CODES key
    data: torch.Tensor  # [num_blocks, 2 * kv_heads, block_size, row]
    # int8/fp8: float32 [kv_heads, dim] static, or [num_blocks, kv_heads, dim];
    # int4: float16 (step, minimum) per block [num_blocks, kv_heads, 2, dim]
    key_scales: torch.Tensor | None
    # int8: float32 [num_blocks, kv_heads, block_size, 1]; int4: float16 [..., groups, 2] (step, minimum)
    value_scales: torch.Tensor | None
    v_scale: float  # fp8's static value scale
    tail: torch.Tensor | None  # [slots, block_size, 2 * kv_heads, dim] in the model dtype
    clipped: torch.Tensor  # int64: elements clipped by static scales so far (added to in place)
    value_scale_override: float | None = None  # one fixed value scale (the "global scale" mistake)
    checked: int = 0  # elements that passed through static scales
    key_rotation: torch.Tensor | None = None  # [dim, dim] orthonormal: keys stored as k @ R (q too)

    keeps_tail_block: ClassVar[bool] = False

    @classmethod
    def allocate(cls, kind: str, shape: PoolShape, quant: KVQuantSpec, layer: int, clipped: torch.Tensor
                 ) -> LayerKV:
        """A pool for ``shape`` (empty_per_block: pages are only touched when a block is first written)."""
        raise NotImplementedError

    @classmethod
    def float_pool(cls, data: torch.Tensor) -> LayerKV:
        """A plain float pool (no scales, no tail) over ``data``."""
        return FloatKV(float_kind(data.dtype), data, None, None, 1.0, None,
                       torch.zeros((), dtype=torch.long, device=data.device))

    @property
    def direct(self) -> bool:
        """Stored in a float dtype with no scales: kernels read it as-is."""
        return False

    def holds_as_is(self, dtype: torch.dtype) -> bool:
        """The pool holds K/V in exactly ``dtype`` with no scales: the fused rotary + cache-write op
        stores into it, and the float kernels read it, as it is."""
        return self.direct and self.data.dtype == dtype

    @property
    def per_block_key_scales(self) -> bool:
        return self.key_scales is not None and self.key_scales.dim() >= 3

    def per_block_tensors(self) -> list[torch.Tensor]:
        """Every tensor indexed by block id first: what one block's copy must move."""
        return [t for t in (self.data, self.value_scales, self.key_scales)
                if t is not None and (t is not self.key_scales or self.per_block_key_scales)]

    @property
    def block_bytes(self) -> int:
        """Bytes one block takes in this layer, scales included (kv_format.kv_block_bytes agrees)."""
        return sum(t[0].numel() * t.element_size() for t in self.per_block_tensors())

    def share_blocks(self, owner: LayerKV) -> None:
        """Store blocks in ``owner``'s per-block tensors (its data, per-block scales and tail
        slots) and keep this layer's own static scales: layers of different KV cache groups in
        one storage slot (kv_groups) use a block only while their group owns it."""
        if type(self) is not type(owner) or self.kind != owner.kind:
            raise ValueError(f"layers sharing a storage slot need one KV format, got {self.kind} and {owner.kind}")
        self.data, self.value_scales, self.tail = owner.data, owner.value_scales, owner.tail
        if self.per_block_key_scales:
            self.key_scales = owner.key_scales

    def write(self, key: torch.Tensor, value: torch.Tensor, index: KVWriteIndex) -> None:
        """key/value [T, kv_heads, dim]: this step's new tokens, into their slots."""
        raise NotImplementedError

    def dequantize(self, data: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Blocks ``ids`` (their rows ``data`` = self.data[ids]) as float32 [N, 2*kv_heads, block_size, dim]."""
        raise NotImplementedError

    def quantize_blocks(self, k: torch.Tensor, v: torch.Tensor, block_ids: torch.Tensor) -> None:
        """k, v [num, block_size, kv_heads, dim]: whole blocks, into the pool at ``block_ids`` (scales
        recomputed where the format keeps them per block). Here: formats that scale keys
        statically and values per token."""
        assert self.key_scales is not None
        if self.key_rotation is not None:
            k = k.float() @ self.key_rotation
        codes, vs = self._quantize_kv(k, v, self.key_scales)
        self.data.index_copy_(0, block_ids, codes.transpose(1, 2))
        if vs is not None:
            assert self.value_scales is not None
            self.value_scales.index_copy_(0, block_ids, vs.transpose(1, 2).to(self.value_scales.dtype))

    def read_blocks(self, block_ids: torch.Tensor) -> torch.Tensor:
        """Whole blocks as float32 [N, 2*kv_heads, block_size, dim], keys as the model made them
        (un-rotated where the format stores them rotated)."""
        out = self.dequantize(self.data.index_select(0, block_ids), block_ids)
        if self.key_rotation is not None:
            kv_heads = out.shape[1] // 2
            out[:, :kv_heads] = out[:, :kv_heads] @ self.key_rotation.T
        return out

    def write_blocks(self, block_ids: torch.Tensor, blocks: torch.Tensor) -> None:
        """Store whole blocks given as read_blocks reads them, in this layer's format."""
        kv_heads = blocks.shape[1] // 2
        self.quantize_blocks(blocks[:, :kv_heads].transpose(1, 2), blocks[:, kv_heads:].transpose(1, 2), block_ids)

    def gather(self, block_tables: torch.Tensor, seq_lens: torch.Tensor, tail_slots: torch.Tensor | None,
               dtype: torch.dtype) -> torch.Tensor:
        """Dequantized blocks of each sequence: [batch, width, 2*kv_heads, block_size, dim] in
        ``dtype``, a sequence's partial last block read from its tail slot. The torch path (and
        the reference the C++ kernels are tested against)."""
        batch, width = block_tables.shape
        flat = block_tables.reshape(-1)
        out = self.dequantize(self.data.index_select(0, flat), flat).to(dtype)
        out = out.view(batch, width, *out.shape[1:])
        if self.tail is not None and tail_slots is not None:
            block_size = out.shape[3]
            for b in range(batch):
                length = int(seq_lens[b])
                if length % block_size:
                    out[b, length // block_size] = self.tail[int(tail_slots[b])].transpose(0, 1).to(dtype)
        return out

    # ------------------------------------------------------------------ shared by quantized formats

    def _value_scales(self, v: torch.Tensor) -> torch.Tensor:
        if self.value_scale_override is not None:
            return torch.full((*v.shape[:-1], 1), self.value_scale_override, device=v.device)
        return token_scales(v, self.kind)

    def _quantize_kv(self, k: torch.Tensor, v: torch.Tensor, key_scales: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """k, v [..., kv_heads, dim] -> codes [..., 2*kv_heads, row] and value scales [..., kv_heads, groups]."""
        static = not self.per_block_key_scales
        kq = quantize(k, key_scales, self.kind, count_clips=static)
        if self.value_scales is None:  # fp8: a static per-layer value scale
            vq = quantize(v, torch.tensor(self.v_scale), self.kind, count_clips=True)
            self.clipped += kq.clipped + vq.clipped
            self.checked += k.numel() + v.numel()
            return torch.cat((kq.codes, vq.codes), dim=-2), None
        vs = self._value_scales(v)
        vq = quantize(v, vs, self.kind, count_clips=self.value_scale_override is not None)
        if static:
            self.clipped += kq.clipped + vq.clipped
            self.checked += k.numel() + (v.numel() if self.value_scale_override is not None else 0)
        return torch.cat((kq.codes, vq.codes), dim=-2), vs

    def _store_per_token(self, key: torch.Tensor, value: torch.Tensor, index: KVWriteIndex) -> None:
        """Quantize each token with static key scales and store it (and its value scales) at once."""
        assert self.key_scales is not None
        if self.key_rotation is not None:
            key = key.float() @ self.key_rotation
        codes, vs = self._quantize_kv(key, value, self.key_scales)
        self.data.view(-1, self.data.shape[-1]).index_copy_(0, index.write_rows, codes.view(-1, codes.shape[-1]))
        if vs is not None:
            assert self.value_scales is not None and index.scale_rows is not None
            self.value_scales.view(-1, vs.shape[-1]).index_copy_(0, index.scale_rows, vs.view(-1, vs.shape[-1]))


KV_FORMATS: dict[tuple[str, str], type[LayerKV]] = {}


def register(*keys: tuple[str, str]) -> Callable[[type[LayerKV]], type[LayerKV]]:
    """Register a format class for (KV kind, key-scale mode) pairs."""
    def add(cls: type[LayerKV]) -> type[LayerKV]:
        for key in keys:
            KV_FORMATS[key] = cls
        return cls
    return add


def format_class(kind: str, key_scale_mode: str) -> type[LayerKV]:
    """The class that stores ``kind`` with ``key_scale_mode`` (kv_format.KEY_SCALE_MODES)."""
    try:
        return KV_FORMATS[(kind, key_scale_mode)]
    except KeyError:
        raise ValueError(f"no KV format stores {kind!r} with {key_scale_mode!r} key scales") from None


def _pool(kind: str, shape: PoolShape) -> torch.Tensor:
    size = (shape.num_blocks, 2 * shape.num_kv_heads, shape.block_size)
    if kind in FLOAT_KINDS:
        return empty_per_block((*size, shape.head_dim), FLOAT_KINDS[kind], shape.device)
    return empty_per_block((*size, row_bytes(kind, shape.head_dim)), torch.uint8, shape.device)


@register(*((kind, mode) for kind in FLOAT_KINDS for mode in KEY_SCALE_MODES))
class FloatKV(LayerKV):
    """fp32 / fp16 / bf16: K/V cast to the pool's dtype, no scales."""

    __slots__ = ()

    @classmethod
    def allocate(cls, kind: str, shape: PoolShape, quant: KVQuantSpec, layer: int, clipped: torch.Tensor
                 ) -> LayerKV:
        return cls(kind, _pool(kind, shape), None, None, 1.0, None, clipped)

    @property
    def direct(self) -> bool:
        return True

    def write(self, key: torch.Tensor, value: torch.Tensor, index: KVWriteIndex) -> None:
        rows = torch.cat((key, value), dim=1).to(self.data.dtype)
        self.data.view(-1, self.data.shape[-1]).index_copy_(0, index.write_rows, rows.view(-1, rows.shape[-1]))

    def dequantize(self, data: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return data.float()

    def quantize_blocks(self, k: torch.Tensor, v: torch.Tensor, block_ids: torch.Tensor) -> None:
        self.data.index_copy_(0, block_ids, torch.cat((k, v), dim=2).transpose(1, 2).to(self.data.dtype))

    def gather(self, block_tables: torch.Tensor, seq_lens: torch.Tensor, tail_slots: torch.Tensor | None,
               dtype: torch.dtype) -> torch.Tensor:
        out = self.data.index_select(0, block_tables.reshape(-1)).to(dtype)  # no float32 detour
        return out.view(*block_tables.shape, *out.shape[1:])


class LatentKV(FloatKV):
    """MLA's cache (model/deepseek.py): one vector per token, the latent and the rotary key,
    shared by every head: [num_blocks, 1, block_size, latent_dim], in a float dtype. Quantized
    latents are not supported yet (the engine refuses them by name)."""

    __slots__ = ()

    @classmethod
    def allocate(cls, kind: str, shape: PoolShape, quant: KVQuantSpec, layer: int, clipped: torch.Tensor
                 ) -> LayerKV:
        if kind not in FLOAT_KINDS:
            raise ValueError(f"KV cache dtype {kind} is not supported for MLA's latent cache (use a float dtype)")
        data = empty_per_block((shape.num_blocks, 1, shape.block_size, shape.head_dim), FLOAT_KINDS[kind],
                               shape.device)
        return cls(kind, data, None, None, 1.0, None, clipped)

    def write(self, key: torch.Tensor, value: torch.Tensor | None, index: KVWriteIndex) -> None:
        """key: [T, 1, latent_dim], this step's vectors (no separate value)."""
        rows = key.to(self.data.dtype).reshape(-1, self.data.shape[-1])
        self.data.view(-1, self.data.shape[-1]).index_copy_(0, index.write_rows, rows)

    def write_blocks(self, block_ids: torch.Tensor, blocks: torch.Tensor) -> None:
        """Whole blocks [N, 1, block_size, latent_dim] (as read_blocks gives them): no K/V halves."""
        self.data.index_copy_(0, block_ids, blocks.to(self.data.dtype))


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
        return cls(kind, _pool(kind, shape), key_scales, _int8_value_scales(shape), 1.0, None, clipped,
                   quant.value_scale_override)

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
        return cls(kind, data, key_scales, _int8_value_scales(shape), 1.0, _tail(data, shape), clipped,
                   quant.value_scale_override)

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


class KVQuantSpec(NamedTuple):
    """How the pool stores K/V. ``key_scales`` [layers, kv_heads, dim] float32 makes int8/int4
    key scales static (else per block); ``fp8_scales`` [layers, 2] are fp8's K and V scales
    (default 1.0). Layers in ``skip_layers`` stay in the model dtype."""

    kv_dtype: str
    key_scales: torch.Tensor | None = None
    fp8_scales: torch.Tensor | None = None
    skip_layers: frozenset[int] = frozenset()
    value_scale_override: float | None = None

    def layer_kind(self, layer: int, model_kind: str) -> str:
        return model_kind if layer in self.skip_layers else self.kv_dtype

    @property
    def key_scale_mode(self) -> str:
        """kv_format's name for how int8 keys are scaled: one static table, or per block."""
        return "static" if self.key_scales is not None else "block"


class PagedKVCache:
    """Every layer's pool; block 0 (the null block) is zero-filled. With KV cache groups
    (kv_groups), ``layer_slots[i]`` is layer i's storage slot: the layers in one slot share
    its per-block tensors (``storage`` holds each slot's first layer), so a pool block is one
    group's layers' K/V."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, quant: KVQuantSpec | None = None,
                 layer_slots: list[int] | None = None, latent_dim: int = 0) -> None:
        """``latent_dim``: MLA, one vector of this size per token (LatentKV) instead of K and V heads."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.model_dtype = dtype
        model_kind = float_kind(dtype)
        quant = quant or KVQuantSpec(model_kind)
        # one clip counter for every layer (each adds to it in place): reading it is one sync
        self.clipped = torch.zeros((), dtype=torch.long, device=device)
        shape = PoolShape(num_blocks, block_size, num_kv_heads, latent_dim or head_dim, dtype, device)
        # rows one token takes in a block: its K then V heads, or MLA's one latent vector
        self.rows_per_token = 1 if latent_dim else 2 * num_kv_heads
        slots = layer_slots or list(range(num_layers))
        self.layers: list[LayerKV] = []
        owners: dict[int, LayerKV] = {}
        for layer, slot in enumerate(slots):
            kind = quant.layer_kind(layer, model_kind)
            cls = LatentKV if latent_dim else format_class(kind, quant.key_scale_mode)
            if slot not in owners:
                owners[slot] = cls.allocate(kind, shape, quant, layer, self.clipped)
                self.layers.append(owners[slot])
                continue
            sharer = cls.allocate(kind, shape._replace(num_blocks=1), quant, layer, self.clipped)
            sharer.share_blocks(owners[slot])
            self.layers.append(sharer)
        self.storage = [owners[slot] for slot in sorted(owners)]
        self.zeroed_up_to = -1
        self.zero_new_blocks(0)
        self.host_store: HostBlockStore | None = None
        self.disk: DiskTier | None = None

    @property
    def uses_tail(self) -> bool:
        return any(layer.keeps_tail_block for layer in self.layers)

    @property
    def uses_value_scales(self) -> bool:
        """Some layer stores per-token value scales as it writes (the step needs their rows)."""
        return any(layer.value_scales is not None and not layer.keeps_tail_block for layer in self.layers)

    def per_block_tensors(self) -> list[torch.Tensor]:
        """Every layer's per-block tensors, in a fixed order: a block is these tensors' rows."""
        return [tensor for layer in self.storage for tensor in layer.per_block_tensors()]

    def attach_host_tier(self, capacity_blocks: int, disk: DiskTier | None = None) -> None:
        """Host memory for tier 1 (kv_tiers): ``capacity_blocks`` blocks in the stored format;
        ``disk``: tier 2, which receives the blocks tier 1 drops."""
        self.host_store = HostBlockStore(self.per_block_tensors(), capacity_blocks)
        self.disk = disk

    def prepare(self, work: StorageWork) -> None:
        """A step's storage work, before its forward pass: first-use zeroing of new blocks (before
        blocks are loaded into them), the tier moves, then new tail slots (after the moves: a
        demotion may read a block a fresh tail run just took)."""
        self.zero_new_blocks(work.zero_up_to)
        self.run_tier_moves(work.tier_moves)
        self.zero_tail_slots(work.new_tail_slots)

    def run_tier_moves(self, moves: TierMoves | None) -> None:
        """A step's moves (after first-use zeroing, before the forward pass): tier 1's dropped
        blocks handed to tier 2 (written in the background), demotions, promotions, blocks read
        from tier 2."""
        if moves is None or not any(moves):
            return
        assert self.host_store is not None, "tier moves need attach_host_tier"
        if self.disk is not None:
            for slot, key in moves.spills:
                self.disk.put(key, self.host_store.read(slot))
            for block_id, key in moves.pool_spills:
                self.disk.put(key, [tensor[block_id].to("cpu", copy=True) for tensor in self.per_block_tensors()])
        self.host_store.run(self.per_block_tensors(), moves)
        if self.disk is not None:  # write-through: what the pool evicts is kept on disk too
            for slot, key in moves.persist:
                self.disk.put(key, self.host_store.read(slot))

    def take_load_seconds(self) -> list[tuple[str, float]]:
        """(tier, seconds) of each block loaded back into the pool since the last call."""
        loads: list[tuple[str, float]] = []
        for name, source in (("cpu", self.host_store), ("disk", self.disk)):
            if source is not None:
                loads += [(name, seconds) for seconds in source.load_seconds]
                source.load_seconds.clear()
        return loads

    def _ids(self, block_ids: list[int]) -> torch.Tensor:
        return torch.tensor(block_ids, dtype=torch.long, device=self.clipped.device)

    def read_blocks(self, block_ids: list[int]) -> list[torch.Tensor]:
        """Every storage layer's blocks ``block_ids`` as float32 [N, 2*kv_heads, block_size, dim]
        (LayerKV.read_blocks: dequantized, keys as the model made them)."""
        ids = self._ids(block_ids)
        return [layer.read_blocks(ids) for layer in self.storage]

    def write_blocks(self, block_ids: list[int], blocks: list[torch.Tensor]) -> None:
        """Store whole blocks (as read_blocks gives them) in every storage layer's format: a
        quantized block gets scales fitted to its new contents."""
        ids = self._ids(block_ids)
        for layer, layer_blocks in zip(self.storage, blocks, strict=True):
            layer.write_blocks(ids, layer_blocks)

    def read_tokens(self, block_ids: list[int], length: int, tail_slot: int) -> list[torch.Tensor]:
        """A sequence's first ``length`` cached tokens in every storage layer, float32 [2*kv_heads,
        length, dim] (read_blocks); a partial last block is read from tail slot ``tail_slot``
        where the layer keeps one."""
        out = []
        for layer, blocks in zip(self.storage, self.read_blocks(block_ids), strict=True):
            if layer.tail is not None and length % self.block_size:
                blocks[-1] = layer.tail[tail_slot].transpose(0, 1).float()
            out.append(blocks.permute(1, 0, 2, 3).reshape(blocks.shape[1], -1, blocks.shape[-1])[:, :length])
        return out

    def write_tokens(self, block_ids: list[int], tokens: list[torch.Tensor], tail_slot: int) -> None:
        """Store a sequence's tokens (as read_tokens gives them) from the start of blocks
        ``block_ids``: whole blocks in the layer's format, a partial last block into tail slot
        ``tail_slot`` where the layer keeps one (it is quantized when it fills), else zero-padded."""
        ids, size = self._ids(block_ids), self.block_size
        for layer, layer_tokens in zip(self.storage, tokens, strict=True):
            rows, length, dim = layer_tokens.shape
            padded = layer_tokens.new_zeros(rows, len(block_ids) * size, dim)
            padded[:, :length] = layer_tokens
            blocks = padded.view(rows, len(block_ids), size, dim).permute(1, 0, 2, 3)
            whole = len(block_ids) if layer.tail is None else length // size
            if whole:
                layer.write_blocks(ids[:whole], blocks[:whole])
            if whole < len(block_ids):
                assert layer.tail is not None
                layer.tail[tail_slot] = blocks[-1].transpose(0, 1).to(layer.tail.dtype)

    def gather_tokens(self, old_ids: list[int], new_ids: list[int], index: list[torch.Tensor], length: int,
                      tail_slot: int = 0) -> None:
        """Copy a sequence's kept tokens from its blocks ``old_ids`` (``length`` tokens, a partial
        last block in tail slot ``tail_slot`` for formats with tails) into ``new_ids``: in storage
        layer l, head h's j-th slot gets the K/V of its token index[l][h, j] (positions in the
        old blocks' order; every head keeps as many). Quantized blocks are re-quantized with
        scales fitted to what they now hold."""
        picked = []
        for tokens, keep in zip(self.read_tokens(old_ids, length, tail_slot), index, strict=True):
            heads = keep.shape[0]
            rows = keep.repeat(tokens.shape[0] // heads, 1)  # K heads, then V heads
            picked.append(tokens.gather(1, rows[:, :, None].expand(-1, -1, tokens.shape[-1])))
        self.write_tokens(new_ids, picked, tail_slot)

    def zero_new_blocks(self, max_block_id: int) -> None:
        """Zero blocks up to ``max_block_id`` on first use. The pool hands out never-used blocks
        in id order, so this touches each block once and pages stay lazily committed."""
        if max_block_id > self.zeroed_up_to:
            for tensor in self.per_block_tensors():
                tensor[self.zeroed_up_to + 1 : max_block_id + 1].zero_()
            self.zeroed_up_to = max_block_id

    def clip_ratio(self) -> float:
        """Share of K/V elements clipped by static (calibrated) scales over all layers so far: the
        drift watch. The counter is only read when some layer checks (static scales), so float
        pools never sync."""
        checked = sum(layer.checked for layer in self.layers)
        return int(self.clipped) / checked if checked else 0.0

    @property
    def nbytes(self) -> int:
        """Bytes of the block pools (data and per-block scales); tail slots live inside them."""
        return sum(t.numel() * t.element_size() for t in self.per_block_tensors())

    def zero_tail_slots(self, slots: list[int]) -> None:
        """Zero newly handed-out tail slots: their blocks may hold old codes, which read as floats
        could be NaN bit patterns (a slot's unwritten rows are read, masked, like a block's)."""
        if not slots:
            return
        index = torch.tensor(slots, dtype=torch.long, device=self.clipped.device)
        for layer in self.storage:
            if layer.tail is not None:
                layer.tail.index_fill_(0, index, 0)
