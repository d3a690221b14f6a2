"""Bytes of KV cache for every KV dtype kvserve supports: one formula for the engine's pool and
the capacity planner, so the two always agree.

What one token of one layer stores is a ``KVLayout``: a key part (``key_heads`` x ``key_dim``)
and a value part (``value_heads`` x ``value_dim``). Standard attention stores K and V for each
KV head; MLA stores one latent vector (kv_lora_rank + qk_rope_head_dim), counted as a value part.

The quantized formats (seed §4.2: keys per channel, values per token):

=========  =========  ==================================================================
dtype      element    scales (float32)
=========  =========  ==================================================================
fp32       4 B        none
fp16/bf16  2 B        none
fp8_e4m3,  1 B        one static scale per layer for K and one for V (a fixed few bytes,
fp8_e5m2              not per token or block)
int8       1 B        keys: per (layer, KV head, channel) — static, from calibration (a
                      fixed table), or with key_scales="block" one per block too (then
                      each running sequence's tail block is kept in full precision, as int4);
                      values: one per (token, layer, KV head)
int4       1/2 B      asymmetric (min + step, float16 each; 16 levels over [min, max]):
                      keys per (block, layer, KV head, channel), always per block; values
                      per (token, layer, KV head, group of 32 channels); plus each running
                      sequence's not-yet-full tail block in full precision (KIVI's residual,
                      aligned to blocks). Measured on SmolLM2: symmetric per-block int4 keys
                      cost +7.9% perplexity, asymmetric +0.4% (offset channels)
=========  =========  ==================================================================
"""

from __future__ import annotations

from typing import NamedTuple

KV_DTYPES = ("fp32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2", "int8", "int4")
SCALE_BYTES = 4
AFFINE_BYTES = 4  # int4: a float16 step and a float16 minimum
INT4_VALUE_GROUP = 32
KEY_SCALE_MODES = ("static", "block")  # static: one calibrated table; block: computed per block
_ELEMENT_BITS = {"fp32": 32, "fp16": 16, "bf16": 16, "fp8_e4m3": 8, "fp8_e5m2": 8, "int8": 8, "int4": 4}
_TORCH_NAMES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


class KVLayout(NamedTuple):
    """What one token stores per layer: a key part with per-channel scales and a value part with
    per-token scales (MLA's latent is a value part with no key part)."""

    key_heads: int
    key_dim: int
    value_heads: int
    value_dim: int

    @classmethod
    def standard(cls, num_kv_heads: int, head_dim: int) -> KVLayout:
        return cls(num_kv_heads, head_dim, num_kv_heads, head_dim)

    @classmethod
    def mla(cls, kv_lora_rank: int, qk_rope_head_dim: int) -> KVLayout:
        return cls(0, 0, 1, kv_lora_rank + qk_rope_head_dim)

    @property
    def elements(self) -> int:
        return self.key_heads * self.key_dim + self.value_heads * self.value_dim


def normalize_kv_dtype(kv_dtype: str, model_dtype: str) -> str:
    """``auto`` -> the model's dtype; torch names (float16, bfloat16, float32) -> short names;
    ``fp8`` -> fp8_e4m3. Raises ValueError naming the value for anything else."""
    name = kv_dtype.strip().lower()
    if name == "auto":
        name = model_dtype
    name = _TORCH_NAMES.get(name, name)
    if name == "fp8":
        name = "fp8_e4m3"
    if name not in _ELEMENT_BITS:
        raise ValueError(f"unknown KV cache dtype {kv_dtype!r} (choose from auto, {', '.join(KV_DTYPES)})")
    return name


def kv_block_bytes(layout: KVLayout, num_layers: int, kv_dtype: str, block_size: int,
                   key_scales: str = "static") -> int:
    """Exact bytes one block of ``block_size`` tokens takes across all layers, scales included
    (the static key-scale table is per model, not per block, so it is not counted here).
    ``key_scales`` applies to int8; int4's key ranges are always per block."""
    if key_scales not in KEY_SCALE_MODES:
        raise ValueError(f"key scales must be one of {', '.join(KEY_SCALE_MODES)}, got {key_scales!r}")
    bits = _ELEMENT_BITS[kv_dtype]
    per_layer = block_size * layout.elements * bits // 8
    if kv_dtype == "int8":
        block_key_scales = layout.key_heads * layout.key_dim if key_scales == "block" else 0
        value_scales = block_size * layout.value_heads  # per token
        per_layer += (block_key_scales + value_scales) * SCALE_BYTES
    elif kv_dtype == "int4":
        groups = max(1, layout.value_dim // INT4_VALUE_GROUP)
        per_layer += (layout.key_heads * layout.key_dim + block_size * layout.value_heads * groups) * AFFINE_BYTES
    return num_layers * per_layer


def keeps_tail_block(kv_dtype: str, key_scales: str = "static") -> bool:
    """int4 (always) and int8 with per-block key scales need a block's keys complete before they
    can scale them, so each running sequence's not-yet-full block stays in full precision."""
    return kv_dtype == "int4" or (kv_dtype == "int8" and key_scales == "block")


def tail_blocks(kv_dtype: str, full_dtype: str, key_scales: str = "static") -> int:
    """Pool blocks that one running sequence's full-precision tail block takes (0 for formats
    without one, see keeps_tail_block). The tail lives in the pool's own memory: ``n`` aligned
    blocks whose codes span exactly its bytes (n = full bits / stored bits: 2, 4 or 8), taken
    when the sequence starts and returned when it ends, so tails and blocks share one budget."""
    if not keeps_tail_block(kv_dtype, key_scales):
        return 0
    return _ELEMENT_BITS[full_dtype] // _ELEMENT_BITS[kv_dtype]


def kv_sequence_extra_bytes(layout: KVLayout, num_layers: int, kv_dtype: str, block_size: int,
                            full_dtype: str, key_scales: str = "static") -> int:
    """Per running sequence, beyond its blocks: its tail block, as the pool blocks it takes."""
    return tail_blocks(kv_dtype, full_dtype, key_scales) * kv_block_bytes(layout, num_layers, kv_dtype, block_size,
                                                                         key_scales)


def num_blocks_for_budget(budget_bytes: int, block_bytes: int) -> int:
    """How many whole blocks (the null block included) a byte budget buys."""
    return budget_bytes // block_bytes
