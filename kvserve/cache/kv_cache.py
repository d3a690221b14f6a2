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
and quantize the block when it fills. Attention reads that block from the tail slot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from kvserve.cache.kv_format import keeps_tail_block
from kvserve.cache.kv_quant import (
    FLOAT_KINDS,
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


@dataclass(slots=True)
class KVWriteIndex:
    """Where this step's tokens go, shared by all layers."""

    write_rows: torch.Tensor  # [T * 2 * kv_heads] pool rows (block, K/V head, offset)
    scale_rows: torch.Tensor | None  # [T * kv_heads] value-scale rows (block, head, offset)
    tail: TailPlan | None


@dataclass(slots=True)
class LayerKV:
    """One layer's pool and how to read it.

    Invariants: ``data`` rows at or past a sequence's length are never read as keys (masked);
    with ``tail`` set, a block in a block table is quantized only once full, and a sequence's
    partial last block lives in its tail slot, not in the pool."""

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

    @classmethod
    def float_pool(cls, data: torch.Tensor) -> LayerKV:
        """A plain float pool (no scales, no tail) over ``data``."""
        return cls(float_kind(data.dtype), data, None, None, 1.0, None,
                   torch.zeros((), dtype=torch.long, device=data.device))

    @property
    def direct(self) -> bool:
        """Stored in a float dtype with no scales: kernels read it as-is."""
        return self.kind in FLOAT_KINDS and self.tail is None

    @property
    def per_block_key_scales(self) -> bool:
        return self.key_scales is not None and self.key_scales.dim() >= 3

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

    def write(self, key: torch.Tensor, value: torch.Tensor, index: KVWriteIndex) -> None:
        """key/value [T, kv_heads, dim]: this step's new tokens, into their slots."""
        kv_heads = key.shape[1]
        if self.direct:
            rows = torch.cat((key, value), dim=1).to(self.data.dtype)
            self.data.view(-1, self.data.shape[-1]).index_copy_(0, index.write_rows, rows.view(-1, rows.shape[-1]))
            return
        if self.tail is None:
            assert self.key_scales is not None
            if self.key_rotation is not None:
                key = key.float() @ self.key_rotation
            codes, vs = self._quantize_kv(key, value, self.key_scales)
            self.data.view(-1, self.data.shape[-1]).index_copy_(0, index.write_rows, codes.view(-1, codes.shape[-1]))
            if vs is not None:
                assert self.value_scales is not None and index.scale_rows is not None
                self.value_scales.view(-1, vs.shape[-1]).index_copy_(0, index.scale_rows, vs.view(-1, vs.shape[-1]))
            return
        plan = index.tail
        assert plan is not None
        new = torch.cat((key, value), dim=1).to(self.tail.dtype)  # [T, 2*kv_heads, dim]
        tail = self.tail.view(-1, *new.shape[1:])
        tail.index_copy_(0, plan.pre_rows, new.index_select(0, plan.pre_tokens))
        if plan.block_ids.numel():
            self._quantize_blocks(new, tail, plan, kv_heads)
        tail.index_copy_(0, plan.post_rows, new.index_select(0, plan.post_tokens))

    def _quantize_blocks(self, new: torch.Tensor, tail: torch.Tensor, plan: TailPlan, kv_heads: int) -> None:
        """Quantize the blocks that filled in this step into the pool."""
        num, block_size = plan.block_ids.numel(), self.data.shape[2]
        stage = new.new_empty((num * block_size, *new.shape[1:]))
        stage.index_copy_(0, plan.stage_token_rows, new.index_select(0, plan.stage_tokens))
        stage.index_copy_(0, plan.stage_from_tail, tail.index_select(0, plan.stage_tail_rows))
        stage = stage.view(num, block_size, 2 * kv_heads, -1)
        k, v = stage[:, :, :kv_heads], stage[:, :, kv_heads:]
        assert self.key_scales is not None and self.value_scales is not None
        if self.kind == "int4":  # asymmetric: keys per block and channel, values per token and group
            k_step, k_low = affine_params(k.float(), dim=1)  # [num, kv_heads, dim]
            groups = self.value_scales.shape[3]
            v_step, v_low = affine_params(grouped(v.float(), groups), dim=-1)  # [num, bs, kv_heads, groups]
            k_codes = pack_int4(int4_codes(k, k_step[:, None], k_low[:, None]))
            v_codes = pack_int4(int4_codes(grouped(v, groups), v_step[..., None], v_low[..., None]).flatten(-2))
            self.key_scales.index_copy_(0, plan.block_ids, torch.stack((k_step, k_low), dim=2))
            self.value_scales.index_copy_(0, plan.block_ids, torch.stack((v_step, v_low), dim=-1).transpose(1, 2))
            self.data.index_copy_(0, plan.block_ids, torch.cat((k_codes, v_codes), dim=2).transpose(1, 2))
            return
        if self.per_block_key_scales:
            scales = channel_scales(k, self.kind, dim=1)  # [num, kv_heads, dim]
            self.key_scales.index_copy_(0, plan.block_ids, scales)
            key_scales = scales[:, None]
        else:
            key_scales = self.key_scales
        codes, vs = self._quantize_kv(k, v, key_scales)
        assert vs is not None
        self.data.index_copy_(0, plan.block_ids, codes.transpose(1, 2))
        self.value_scales.index_copy_(0, plan.block_ids, vs.transpose(1, 2))

    def gather(self, block_tables: torch.Tensor, seq_lens: torch.Tensor, tail_slots: torch.Tensor | None,
               dtype: torch.dtype) -> torch.Tensor:
        """Dequantized blocks of each sequence: [batch, width, 2*kv_heads, block_size, dim] in
        ``dtype``, a sequence's partial last block read from its tail slot. The torch path (and
        the reference the C++ kernels are tested against)."""
        batch, width = block_tables.shape
        flat = block_tables.reshape(-1)
        data = self.data.index_select(0, flat)  # [B*W, 2H, bs, row]
        kv_heads = data.shape[1] // 2
        if self.kind in FLOAT_KINDS:
            out = data.to(dtype)
        elif self.kind == "int4":
            assert self.key_scales is not None and self.value_scales is not None
            affine = self.key_scales.index_select(0, flat)[:, :, None]  # [B*W, H, 1, 2, D]
            k = from_int4_codes(unpack_int4(data[:, :kv_heads]), affine[..., 0, :], affine[..., 1, :])
            v_affine = self.value_scales.index_select(0, flat)  # [B*W, H, bs, G, 2]
            v_codes = grouped(unpack_int4(data[:, kv_heads:]), v_affine.shape[3])
            v = from_int4_codes(v_codes, v_affine[..., 0:1], v_affine[..., 1:2]).flatten(-2)
            out = torch.cat((k, v), dim=1).to(dtype)
        else:
            assert self.key_scales is not None
            ks = self.key_scales.index_select(0, flat)[:, :, None] if self.per_block_key_scales \
                else self.key_scales[None, :, None]
            k = dequantize(data[:, :kv_heads], ks, self.kind)
            if self.value_scales is None:
                v = dequantize(data[:, kv_heads:], torch.tensor(self.v_scale), self.kind)
            else:
                v = dequantize(data[:, kv_heads:], self.value_scales.index_select(0, flat), self.kind)
            out = torch.cat((k, v), dim=1).to(dtype)
        out = out.view(batch, width, *out.shape[1:])
        if self.tail is not None and tail_slots is not None:
            block_size = out.shape[3]
            for b in range(batch):
                length = int(seq_lens[b])
                if length % block_size:
                    last = length // block_size
                    out[b, last] = self.tail[int(tail_slots[b])].transpose(0, 1).to(dtype)
        return out


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
    """Every layer's pool; block 0 (the null block) is zero-filled."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, quant: KVQuantSpec | None = None,
                 num_tail_slots: int = 0) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.model_dtype = dtype
        model_kind = float_kind(dtype)
        quant = quant or KVQuantSpec(model_kind)
        # one clip counter for every layer (each adds to it in place): reading it is one sync
        self.clipped = torch.zeros((), dtype=torch.long, device=device)
        self.layers: list[LayerKV] = []
        for layer in range(num_layers):
            kind = quant.layer_kind(layer, model_kind)
            shape = (num_blocks, 2 * num_kv_heads, block_size)
            # torch.empty: pages are only touched when a block is first written.
            if kind in FLOAT_KINDS:
                data = torch.empty((*shape, head_dim), dtype=FLOAT_KINDS[kind], device=device)
            else:
                data = torch.empty((*shape, row_bytes(kind, head_dim)), dtype=torch.uint8, device=device)
            key_scales = value_scales = tail = rotation = None
            v_scale = 1.0
            if kind == "int4":
                key_scales = torch.empty((num_blocks, num_kv_heads, 2, head_dim), dtype=torch.float16, device=device)
                value_scales = torch.empty((num_blocks, num_kv_heads, block_size, value_groups(kind, head_dim), 2),
                                           dtype=torch.float16, device=device)
            elif kind == "int8":
                value_scales = torch.empty((num_blocks, num_kv_heads, block_size, 1), dtype=torch.float32,
                                           device=device)
                if quant.key_scales is not None:
                    key_scales = (quant.key_scales[layer] / QMAX[kind]).float().to(device).contiguous()
                else:
                    key_scales = torch.empty((num_blocks, num_kv_heads, head_dim), dtype=torch.float32, device=device)
            elif kind not in FLOAT_KINDS:  # fp8
                k_scale, v_scale = (1.0, 1.0) if quant.fp8_scales is None else map(float, quant.fp8_scales[layer])
                key_scales = torch.full((num_kv_heads, head_dim), k_scale, dtype=torch.float32, device=device)
                if head_dim & (head_dim - 1) == 0:
                    rotation = hadamard(head_dim).to(device)
            if keeps_tail_block(kind, quant.key_scale_mode):
                tail = torch.zeros((num_tail_slots, block_size, 2 * num_kv_heads, head_dim), dtype=dtype,
                                   device=device)
            self.layers.append(LayerKV(kind, data, key_scales, value_scales, v_scale, tail, self.clipped,
                                       quant.value_scale_override if kind == "int8" else None,
                                       key_rotation=rotation))
        self.zeroed_up_to = -1
        self.zero_new_blocks(0)

    @property
    def uses_tail(self) -> bool:
        return any(layer.tail is not None for layer in self.layers)

    @property
    def uses_value_scales(self) -> bool:
        return any(layer.value_scales is not None and layer.tail is None for layer in self.layers)

    def _per_block(self) -> list[torch.Tensor]:
        tensors = []
        for layer in self.layers:
            tensors.append(layer.data)
            if layer.value_scales is not None:
                tensors.append(layer.value_scales)
            if layer.per_block_key_scales:
                assert layer.key_scales is not None
                tensors.append(layer.key_scales)
        return tensors

    def zero_new_blocks(self, max_block_id: int) -> None:
        """Zero blocks up to ``max_block_id`` on first use. The pool hands out never-used blocks
        in id order, so this touches each block once and pages stay lazily committed."""
        if max_block_id > self.zeroed_up_to:
            for tensor in self._per_block():
                tensor[self.zeroed_up_to + 1 : max_block_id + 1].zero_()
            self.zeroed_up_to = max_block_id

    def clip_stats(self) -> tuple[int, int]:
        """(elements clipped by static scales, elements checked) over all layers so far; the
        counter is only read when some layer checks (static scales), so float pools never sync."""
        checked = sum(layer.checked for layer in self.layers)
        return (int(self.clipped) if checked else 0), checked

    @property
    def nbytes(self) -> int:
        """Bytes of the block pools (data and per-block scales), excluding tail slots."""
        return sum(t.numel() * t.element_size() for t in self._per_block())

    @property
    def tail_nbytes(self) -> int:
        return sum(layer.tail.numel() * layer.tail.element_size() for layer in self.layers if layer.tail is not None)
