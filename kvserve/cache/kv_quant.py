"""Quantize and dequantize KV rows (torch), in the byte layout of kv_format and the C++ kernels.

Rows are [..., head_dim] float tensors. Seed §4.2: keys are scaled per channel (a [heads, dim]
table, static from calibration or computed per block), values per token (one scale per token
and head, or per group of 32 channels for int4). Codes are symmetric: int8 in [-127, 127];
int4 in [-7, 7] stored offset by 8, two per byte, channel c in the low nibble of byte c and
channel c + dim/2 in its high nibble (so unpacking a row is two shifts, no shuffles). fp8 uses
torch's float8 types with one static scale per layer for K and one for V.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvserve.cache.kv_format import INT4_VALUE_GROUP

# The element encodings the C++ kernels understand (kind codes are shared with cpu_ops.cpp).
KIND_CODES = {"fp32": 0, "fp16": 1, "bf16": 2, "fp8_e4m3": 3, "fp8_e5m2": 4, "int8": 5, "int4": 6}
FLOAT_KINDS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
FP8_TYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
QMAX = {"int8": 127.0, "int4": 7.0, "fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}
MIN_SCALE = 1e-8  # an all-zero row still gets a finite, positive scale


class Quantized(NamedTuple):
    codes: torch.Tensor  # uint8 [..., row_bytes]
    clipped: torch.Tensor  # int64 scalar: elements beyond a static scale's range (clipped)


def row_bytes(kind: str, head_dim: int) -> int:
    """Bytes one head's row of ``head_dim`` elements takes."""
    if kind in FLOAT_KINDS:
        return head_dim * torch.empty((), dtype=FLOAT_KINDS[kind]).element_size()
    return head_dim // 2 if kind == "int4" else head_dim


def value_groups(kind: str, head_dim: int) -> int:
    """Value scales per (token, head): int4 scales each group of 32 channels."""
    return max(1, head_dim // INT4_VALUE_GROUP) if kind == "int4" else 1


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """int codes in [-8, 7], [..., dim] -> uint8 [..., dim/2] (low nibble c, high nibble c + dim/2)."""
    biased = (codes + 8).to(torch.uint8)
    half = biased.shape[-1] // 2
    return biased[..., :half] | (biased[..., half:] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_int4: uint8 [..., dim/2] -> int8 codes [..., dim]."""
    low = (packed & 0xF).to(torch.int8) - 8
    high = (packed >> 4).to(torch.int8) - 8
    return torch.cat((low, high), dim=-1)


def _clip_count(x: torch.Tensor, scale: torch.Tensor, qmax: float) -> torch.Tensor:
    return (x.abs() > scale * (qmax + 0.5)).sum()


def quantize(x: torch.Tensor, scale: torch.Tensor, kind: str, count_clips: bool = False) -> Quantized:
    """x [..., dim] float; scale broadcasts against x (per channel, per token or per group, already
    expanded to dim). Values beyond the scale's range are clipped (and counted if asked)."""
    xf = x.float()
    clipped = _clip_count(xf, scale, QMAX[kind]) if count_clips else torch.zeros((), dtype=torch.long)
    qmax = QMAX[kind]
    if kind in FP8_TYPES:
        y = (xf / scale).clamp_(-qmax, qmax).to(FP8_TYPES[kind])
        return Quantized(y.view(torch.uint8), clipped)
    codes = torch.round(xf / scale).clamp_(-qmax, qmax).to(torch.int8)
    if kind == "int4":
        return Quantized(pack_int4(codes), clipped)
    return Quantized(codes.view(torch.uint8), clipped)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, kind: str) -> torch.Tensor:
    """Inverse of quantize: uint8 [..., row_bytes] -> float32 [..., dim]."""
    if kind in FP8_TYPES:
        return codes.view(FP8_TYPES[kind]).float() * scale
    values = unpack_int4(codes) if kind == "int4" else codes.view(torch.int8)
    return values.float() * scale


def token_scales(x: torch.Tensor, kind: str) -> torch.Tensor:
    """Dynamic value scales: x [..., dim] -> [..., groups] (absmax of each token's group / qmax)."""
    groups = value_groups(kind, x.shape[-1])
    absmax = x.float().abs().view(*x.shape[:-1], groups, -1).amax(dim=-1)
    return (absmax / QMAX[kind]).clamp_(min=MIN_SCALE)


def expand_groups(scales: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[..., groups] -> [..., head_dim]: each group's scale repeated over its channels."""
    return scales.repeat_interleave(head_dim // scales.shape[-1], dim=-1)


def channel_scales(x: torch.Tensor, kind: str, dim: int = 0) -> torch.Tensor:
    """Per-channel key scales from a block of keys: absmax over ``dim`` (the tokens) / qmax."""
    return (x.float().abs().amax(dim=dim) / QMAX[kind]).clamp_(min=MIN_SCALE)
