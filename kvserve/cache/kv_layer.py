"""A layer's KV storage format: one preallocated block pool per layer, its scales, and how a
step's K/V are written and read back (one class per format, picked by ``format_class``).

Layout per layer: [num_blocks, 2 * num_kv_heads, block_size, row] — each block holds its K
heads then V heads contiguously, so reading a sequence's blocks copies large contiguous rows
(measured ~2x faster than a head-major layout when the pool is cold in cache). ``row`` is
head_dim elements of a float KV dtype, or head_dim (fp8, int8) / head_dim / 2 (int4) bytes.
Token slot ``block_id * block_size + offset`` is the token's position in the pool. The float
formats are here; the quantized ones are in kv_layer_quant, registered when it is imported
(kv_cache imports it)."""


from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch

from kvserve.cache.huge_pages import empty_per_block
from kvserve.cache.kv_format import KEY_SCALE_MODES
from kvserve.cache.kv_quant import (
    FLOAT_KINDS,
    float_kind,
    quantize,
    row_bytes,
    token_scales,
)


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
        vs = token_scales(v, self.kind)  # a value's own range: nothing to clip
        vq = quantize(v, vs, self.kind)
        if static:
            self.clipped += kq.clipped
            self.checked += k.numel()
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


class KVQuantSpec(NamedTuple):
    """How the pool stores K/V. ``key_scales`` [layers, kv_heads, dim] float32 makes int8/int4
    key scales static (else per block); ``fp8_scales`` [layers, 2] are fp8's K and V scales
    (default 1.0). Layers in ``skip_layers`` stay in the model dtype."""

    kv_dtype: str
    key_scales: torch.Tensor | None = None
    fp8_scales: torch.Tensor | None = None
    skip_layers: frozenset[int] = frozenset()

    def layer_kind(self, layer: int, model_kind: str) -> str:
        return model_kind if layer in self.skip_layers else self.kv_dtype

    @property
    def key_scale_mode(self) -> str:
        """kv_format's name for how int8 keys are scaled: one static table, or per block."""
        return "static" if self.key_scales is not None else "block"
