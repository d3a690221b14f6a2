"""Quantize and dequantize KV rows (torch), in the byte layout of kv_format and the C++ kernels.

Rows are [..., head_dim] float tensors. Seed §4.2: keys are scaled per channel (a [heads, dim]
table, static from calibration or computed per block), values per token (one scale per token
and head, or per group of 32 channels for int4). int8 codes are symmetric, in [-127, 127].
int4 codes are asymmetric: 16 levels from a minimum in steps (both float16), so a channel whose
values sit in [5, 7] uses all 16 levels on that range; two codes per byte, channel c in the low
nibble of byte c and channel c + dim/2 in its high nibble (unpacking a row is two shifts, no
shuffles). fp8 uses torch's float8 types with one static scale per layer for K and one for V; fp8 keys are stored
Hadamard-rotated (the query is rotated the same way, so q·k is unchanged): a float format's
error is relative to each element, and rotation spreads the few large key channels that the
query weighs most over all channels (measured on SmolLM2: fp8 K+V +1.4% perplexity -> +0.6%).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvserve.cache.kv_format import INT4_VALUE_GROUP

# The element encodings the C++ kernels understand (kind codes are shared with csrc/common.h).
KIND_CODES = {"fp32": 0, "fp16": 1, "bf16": 2, "fp8_e4m3": 3, "fp8_e5m2": 4, "int8": 5, "int4": 6}
FLOAT_KINDS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
FP8_TYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
QMAX = {"int8": 127.0, "fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}
MIN_SCALE = 1e-8  # an all-zero row still gets a finite, positive scale


class Quantized(NamedTuple):
    codes: torch.Tensor  # uint8 [..., row_bytes]
    clipped: torch.Tensor  # int64 scalar: elements beyond a static scale's range (clipped)


def float_kind(dtype: torch.dtype) -> str:
    """The short name (fp32, fp16, bf16) of a float torch dtype."""
    return next(kind for kind, t in FLOAT_KINDS.items() if t == dtype)


def row_bytes(kind: str, head_dim: int) -> int:
    """Bytes one head's row of ``head_dim`` elements takes."""
    if kind in FLOAT_KINDS:
        return head_dim * torch.empty((), dtype=FLOAT_KINDS[kind]).element_size()
    return head_dim // 2 if kind == "int4" else head_dim


def value_groups(kind: str, head_dim: int) -> int:
    """Value scales per (token, head): int4 scales each group of 32 channels."""
    return max(1, head_dim // INT4_VALUE_GROUP) if kind == "int4" else 1


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """codes in [0, 15], [..., dim] -> uint8 [..., dim/2] (low nibble c, high nibble c + dim/2)."""
    codes = codes.to(torch.uint8)
    half = codes.shape[-1] // 2
    return codes[..., :half] | (codes[..., half:] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_int4: uint8 [..., dim/2] -> uint8 codes [..., dim]."""
    return torch.cat((packed & 0xF, packed >> 4), dim=-1)


def affine_params(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int4's (step, minimum) over ``dim``, float16 as stored (quantize with these rounded values)."""
    low = x.amin(dim=dim)
    step = ((x.amax(dim=dim) - low) / 15).clamp_(min=1e-4)
    return step.half(), low.half()


def int4_codes(x: torch.Tensor, step: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """Unpacked int4 codes in [0, 15] of x, with step/low broadcasting against it."""
    return torch.round((x.float() - low.float()) / step.float()).clamp_(0, 15).to(torch.uint8)


def from_int4_codes(codes: torch.Tensor, step: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    return codes.float() * step.float() + low.float()


def _clip_count(x: torch.Tensor, scale: torch.Tensor, qmax: float) -> torch.Tensor:
    return (x.abs() > scale * (qmax + 0.5)).sum()


def quantize(x: torch.Tensor, scale: torch.Tensor, kind: str, count_clips: bool = False) -> Quantized:
    """int8 or fp8: x [..., dim] float; scale broadcasts against x (per channel or per token).
    Values beyond the scale's range are clipped (and counted if asked)."""
    xf = x.float()
    clipped = _clip_count(xf, scale, QMAX[kind]) if count_clips else torch.zeros((), dtype=torch.long)
    qmax = QMAX[kind]
    if kind in FP8_TYPES:
        y = (xf / scale).clamp_(-qmax, qmax).to(FP8_TYPES[kind])
        return Quantized(y.view(torch.uint8), clipped)
    codes = torch.round(xf / scale).clamp_(-qmax, qmax).to(torch.int8)
    return Quantized(codes.view(torch.uint8), clipped)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, kind: str) -> torch.Tensor:
    """Inverse of quantize: uint8 [..., row_bytes] -> float32 [..., dim]."""
    if kind in FP8_TYPES:
        return codes.view(FP8_TYPES[kind]).float() * scale
    return codes.view(torch.int8).float() * scale


def token_scales(x: torch.Tensor, kind: str) -> torch.Tensor:
    """Dynamic int8/fp8 value scales: x [..., dim] -> [..., 1] (absmax of each token / qmax)."""
    return (x.float().abs().amax(dim=-1, keepdim=True) / QMAX[kind]).clamp_(min=MIN_SCALE)


def grouped(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[..., dim] -> [..., groups, dim / groups]."""
    return x.reshape(*x.shape[:-1], groups, x.shape[-1] // groups)


def sylvester(n: int) -> torch.Tensor:
    """The +-1 Sylvester-Hadamard matrix [n, n] (n a power of two): H H^T = n I, entries exact in any dtype."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two size, got {n}")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h


def hadamard(n: int) -> torch.Tensor:
    """Orthonormal Sylvester-Hadamard matrix [n, n] (n a power of two); symmetric, its own inverse."""
    return sylvester(n) / n**0.5


def channel_scales(x: torch.Tensor, kind: str, dim: int = 0) -> torch.Tensor:
    """Per-channel key scales from a block of keys: absmax over ``dim`` (the tokens) / qmax."""
    return (x.float().abs().amax(dim=dim) / QMAX[kind]).clamp_(min=MIN_SCALE)
