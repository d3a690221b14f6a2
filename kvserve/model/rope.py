"""Rotary position embeddings: inverse frequencies (default, linear, llama3, YaRN scaling; a
second, unscaled base for sliding-window layers), cos/sin tables in the split-halves layout
with the sign of rotate_half folded into sin, and their application."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from kvserve.model.loader import ModelConfig, ModelLoadError


def rope_inv_freq(config: ModelConfig, local: bool = False) -> torch.Tensor:
    """Rotary inverse frequencies; ``local``: the sliding-window layers' base (no scaling)."""
    dim = config.rope_dim
    theta = config.local_rope_theta if local and config.local_rope_theta else config.rope_theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = None if local else config.rope_scaling
    if not scaling:
        return inv_freq.float()
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type == "linear":
        return (inv_freq / scaling["factor"]).float()
    if rope_type == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        is_mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        return torch.where(is_mid, mid, scaled).float()
    if rope_type == "yarn":
        return yarn_inv_freq(inv_freq, scaling, dim, theta, config.max_position_embeddings)
    raise ModelLoadError(f"rope scaling type {rope_type!r} is not supported (default, linear, llama3, yarn)")


def yarn_factor(scaling: dict[str, Any], max_positions: int) -> float:
    """YaRN's context factor (DeepSeek-V3 may leave it to max / original positions)."""
    return float(scaling.get("factor") or max_positions / scaling["original_max_position_embeddings"])


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any], dim: int, theta: float,
                  max_positions: int) -> torch.Tensor:
    """YaRN (arXiv 2309.00071): the fast-rotating dimensions keep their frequency, the slow ones
    are divided by the factor, with a linear ramp between the dimensions that turn beta_fast and
    beta_slow times over the original context."""
    factor = yarn_factor(scaling, max_positions)
    original = scaling["original_max_position_embeddings"]

    def dim_turning(turns: float) -> float:  # the dimension whose wavelength fits `turns` times
        return dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_turning(scaling.get("beta_fast") or 32), dim_turning(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)).clamp(0, 1)
    return (inv_freq / factor * ramp + inv_freq * (1 - ramp)).float()


def rope_attention_factor(config: ModelConfig) -> float:
    """YaRN scales cos and sin by this (1 for every other rotary type)."""
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type")) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = yarn_factor(scaling, config.max_position_embeddings)
    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return yarn_mscale(factor, scaling["mscale"]) / yarn_mscale(factor, scaling["mscale_all_dim"])
    return yarn_mscale(factor)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos/signed_sin [T, 1, D]. Split-halves (HF) rotary layout; the sign of
    rotate_half is folded into signed_sin (first half negated) to save a kernel."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * cos, swapped, signed_sin)


def rope_tables(inv_freq: torch.Tensor, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, signed sin) float32 [max_positions, head_dim] for apply_rope and the C++ op."""
    return rope_at(torch.arange(max_positions, dtype=torch.float32), inv_freq)


def rope_at(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, signed sin) float32 [len(positions), head_dim]: the rotation to each position, or
    by each offset (rotations compose: turning a key cached at p by d puts it at p + d)."""
    freqs = torch.outer(positions.float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    signed_sin = emb.sin()
    signed_sin[:, : emb.shape[1] // 2] *= -1
    return emb.cos(), signed_sin


class RotaryTables(NamedTuple):
    """This step's rotary tables: float32 [T, D] for the C++ op, model dtype [T, 1, D] otherwise."""

    cos32: torch.Tensor
    sin32: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
