"""The capacity arithmetic (seed §1): KV bytes per token for every KV dtype, per sequence and in
total; weights; activations; the verdict against device memory; maximum concurrency and
context; a what-if table over KV dtypes; advice in plain words."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from kvserve.cache.kv_format import (
    KEY_SCALE_MODES,
    kv_block_bytes,
    kv_sequence_extra_bytes,
    normalize_kv_dtype,
    num_blocks_for_budget,
)
from kvserve.cache.kv_groups import group_layers, group_size, sequence_blocks, sliding_specs
from kvserve.config import ConfigError, parse_size
from kvserve.engine.activations import estimate_activation_bytes
from kvserve.plan.spec import ModelSpec, SpecError

WEIGHT_BYTES = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5}
GGUF_WEIGHTS = "gguf"  # a GGUF file's weights as served: its blocks (ModelSpec.served_weight_bytes)
WHAT_IF_DTYPES = ("fp8_e4m3", "int8", "int4")  # after the chosen dtype and a 16-bit one
CONTEXT_DISTRIBUTIONS = ("fixed", "uniform")
_MAX_CONTEXT_SEARCH = 1 << 40
JSON_SCHEMA_VERSION = 1


@dataclass(slots=True)
class WhatIf:
    kv_dtype: str
    kv_bytes_per_token: float
    kv_bytes_total: int
    total_bytes: int
    fits: bool
    max_concurrency: int
    max_context: int


@dataclass(slots=True)
class GroupPlan:
    """One KV cache group (kvserve.cache.kv_groups) of a sequence at the planned context."""

    kind: str  # full_attention or sliding_window
    sliding_window: int
    num_layers: int  # layers in the group (a pool block holds the largest group's worth)
    blocks_per_sequence: int
    bytes_per_sequence: int


@dataclass(slots=True)
class PlanReport:
    """Everything ``kvserve plan`` prints; ``to_dict`` is the --json output (keys documented in
    docs/plan.md, stable within a schema_version)."""

    model: dict[str, Any]
    concurrency: int
    context: int
    block_size: int
    kv_dtype: str
    weight_dtype: str
    context_distribution: str
    key_scales: str
    device_memory_bytes: int
    gpu_memory_utilization: float
    usable_bytes: int
    kv_bytes_per_token: float
    kv_bytes_per_sequence: int
    kv_bytes_total: int
    tail_waste_bytes: int
    weight_bytes: int
    activation_bytes: int
    activation_source: str
    total_bytes: int
    fits: bool
    margin_bytes: int  # usable - total: negative when it does not fit
    max_concurrency: int
    max_context: int
    kv_offload_memory_bytes: int = 0  # tier 1 (host memory) below the pool
    tier_sessions: int = 0  # more sequences of ``context`` tokens whose prefix blocks tier 1 holds
    kv_offload_disk_bytes: int = 0  # tier 2 on disk
    disk_sessions: int = 0  # ... and tier 2
    what_if: list[WhatIf] = field(default_factory=list)
    advice: list[str] = field(default_factory=list)
    kv_groups: list[GroupPlan] = field(default_factory=list)  # per KV cache group, as the engine allocates

    def to_dict(self) -> dict[str, Any]:
        return {"schema_version": JSON_SCHEMA_VERSION, **asdict(self)}


def _check_positive(name: str, value: float) -> None:
    if not value > 0:
        raise SpecError(f"{name} must be positive, got {value!r}")


class _Sizer:
    """KV bytes for one (spec, KV dtype, block size)."""

    def __init__(self, spec: ModelSpec, kv_dtype: str, block_size: int, key_scales: str) -> None:
        self.spec, self.block_size = spec, block_size
        full = normalize_kv_dtype("auto", spec.dtype)
        self.layer_block = kv_block_bytes(spec.kv_layout, 1, kv_dtype, block_size, key_scales)
        # the engine's KV cache groups (kv_groups): a pool block holds one group's layers
        self.groups = group_layers(sliding_specs(spec.num_layers, spec.num_sliding_layers, spec.sliding_window))
        self.specs = [group.spec for group in self.groups]
        self.pool_block = group_size(self.groups) * self.layer_block
        self.extra = len(self.groups) * kv_sequence_extra_bytes(spec.kv_layout, group_size(self.groups), kv_dtype,
                                                                block_size, full, key_scales)
        self.per_token = spec.num_layers * self.layer_block / block_size

    def blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def sequence_bytes(self, context: int) -> int:
        """One sequence at ``context`` tokens, as the engine allocates it while decoding: whole
        blocks in every full-attention group, in each sliding-window group the blocks its window
        spans (at most cdiv(window - 1, block_size) + 1), plus per-sequence extras."""
        return sequence_blocks(self.specs, context, self.block_size) * self.pool_block + self.extra

    def group_plans(self, context: int) -> list[GroupPlan]:
        out = []
        for group in self.groups:
            blocks = group.spec.blocks_held(context, self.block_size)
            out.append(GroupPlan(group.spec.kind, group.spec.sliding_window, len(group.layers), blocks,
                                 blocks * self.pool_block))
        return out

    def max_concurrency(self, available: int, context: int) -> int:
        return max(0, available // self.sequence_bytes(context)) if available > 0 else 0

    def max_context(self, available: int, concurrency: int) -> int:
        """Largest context whose ``concurrency`` sequences fit in ``available`` bytes."""
        if available <= 0 or concurrency * self.sequence_bytes(1) > available:
            return 0
        low, high = 1, _MAX_CONTEXT_SEARCH
        while low < high:
            mid = (low + high + 1) // 2
            if concurrency * self.sequence_bytes(mid) <= available:
                low = mid
            else:
                high = mid - 1
        return low

    def tail_waste(self, context: int, concurrency: int, distribution: str) -> int:
        """Allocated-but-unused slots: exact for fixed-length sequences; for lengths uniform in
        1..context, the expected (block_size - 1) / 2 tokens per sequence."""
        full_layers = sum(len(g.layers) for g in self.groups if not g.spec.sliding_window)
        per_seq: float = self.blocks(context) * self.block_size - context
        if distribution == "uniform":
            per_seq = (self.block_size - 1) / 2
        return int(concurrency * per_seq * full_layers * self.layer_block / self.block_size)


def plan(spec: ModelSpec, *, concurrency: int = 1, context: int = 4096, device_memory: int | str,
         gpu_memory_utilization: float = 0.9, kv_dtype: str = "auto", weight_dtype: str | None = None,
         block_size: int = 16, activation_memory: int | str | None = None, max_num_batched_tokens: int = 2048,
         context_distribution: str = "fixed", key_scales: str = "static",
         kv_offload_memory: int | str = 0, kv_offload_disk_size: int | str = 0) -> PlanReport:
    """Plan ``concurrency`` sequences of ``context`` tokens on ``device_memory`` (bytes or a
    size like "24GB"). ``activation_memory`` overrides the activation + reserve estimate;
    ``key_scales`` picks int8/int4's key scales: one static table, or also one per block."""
    try:
        device_memory = parse_size(device_memory, "device_memory")
        if isinstance(activation_memory, str):
            activation_memory = parse_size(activation_memory, "activation_memory")
    except ConfigError as exc:
        raise SpecError(str(exc)) from exc
    for name, value in (("concurrency", concurrency), ("context", context), ("device_memory", device_memory),
                        ("block_size", block_size), ("max_num_batched_tokens", max_num_batched_tokens)):
        _check_positive(name, value)
    if not 0 < gpu_memory_utilization <= 1:
        raise SpecError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}")
    if block_size & (block_size - 1):
        raise SpecError(f"block_size must be a power of two, got {block_size}")
    if context_distribution not in CONTEXT_DISTRIBUTIONS:
        raise SpecError(f"context distribution must be one of {', '.join(CONTEXT_DISTRIBUTIONS)}, "
                        f"got {context_distribution!r}")
    if key_scales not in KEY_SCALE_MODES:
        raise SpecError(f"key scales must be one of {', '.join(KEY_SCALE_MODES)}, got {key_scales!r}")
    if activation_memory is not None and activation_memory < 0:
        raise SpecError(f"activation_memory must not be negative, got {activation_memory!r}")
    weight_name = (weight_dtype or spec.dtype).lower()
    # a GGUF's weights stay in their blocks under a float model dtype (or "gguf"): as served
    served = bool(spec.served_weight_bytes) and weight_name in (GGUF_WEIGHTS, "fp32", "fp16", "bf16")
    if weight_name not in WEIGHT_BYTES and not served:
        raise SpecError(f"unknown weight dtype {weight_dtype!r} (choose from {', '.join(WEIGHT_BYTES)}"
                        f"{', gguf' if spec.served_weight_bytes else ''})")
    if weight_name in ("fp32", "fp16", "bf16"):
        spec = spec.with_dtype(weight_name)  # a float weight dtype is the model dtype: KV auto follows it
    if served:
        weight_name = GGUF_WEIGHTS
    try:
        kv_name = normalize_kv_dtype(kv_dtype, spec.dtype)
    except ValueError as exc:
        raise SpecError(str(exc)) from exc

    weights = spec.served_weight_bytes if served else int(spec.params * WEIGHT_BYTES[weight_name])
    if activation_memory is not None:
        activations, activation_source = activation_memory, "given"
    else:
        hidden = spec.hidden_size or spec.num_heads * spec.head_dim
        activations = estimate_activation_bytes(
            hidden_size=hidden, num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
            intermediate_size=spec.intermediate_size or 4 * hidden, vocab_size=spec.vocab_size or 32000,
            num_tokens=min(max_num_batched_tokens, context), max_num_seqs=concurrency, max_model_len=context,
            elem_bytes=int(WEIGHT_BYTES[normalize_kv_dtype("auto", spec.dtype)]))
        activation_source = "estimated"
    usable = int(device_memory * gpu_memory_utilization)
    available = usable - weights - activations

    def assess(name: str) -> tuple[_Sizer, WhatIf]:
        sizer = _Sizer(spec, name, block_size, key_scales)
        kv_total = concurrency * sizer.sequence_bytes(context)
        total = weights + activations + kv_total
        row = WhatIf(name, sizer.per_token, kv_total, total, total <= usable,
                     sizer.max_concurrency(available, context), sizer.max_context(available, concurrency))
        return sizer, row

    sizer, mine = assess(kv_name)
    half = next((d for d in (kv_name, normalize_kv_dtype("auto", spec.dtype)) if d in ("fp16", "bf16")), "bf16")
    rows = [assess(name)[1] for name in dict.fromkeys((kv_name, half, *WHAT_IF_DTYPES))]
    report = PlanReport(
        model=_model_dict(spec), concurrency=concurrency, context=context, block_size=block_size,
        kv_dtype=kv_name, weight_dtype=weight_name, context_distribution=context_distribution, key_scales=key_scales,
        device_memory_bytes=device_memory, gpu_memory_utilization=gpu_memory_utilization, usable_bytes=usable,
        kv_bytes_per_token=sizer.per_token, kv_bytes_per_sequence=sizer.sequence_bytes(context),
        kv_bytes_total=mine.kv_bytes_total, tail_waste_bytes=sizer.tail_waste(context, concurrency,
                                                                               context_distribution),
        weight_bytes=weights, activation_bytes=activations, activation_source=activation_source,
        total_bytes=mine.total_bytes, fits=mine.fits, margin_bytes=usable - mine.total_bytes,
        max_concurrency=mine.max_concurrency, max_context=mine.max_context, what_if=rows,
        kv_groups=sizer.group_plans(context),
    )
    # a tier keeps whole blocks in their stored format (tails stay in the pool)
    blocks_bytes = max(1, sizer.sequence_bytes(context) - sizer.extra)
    if kv_offload_memory:
        report.kv_offload_memory_bytes = parse_size(kv_offload_memory, "kv_offload_memory")
        report.tier_sessions = report.kv_offload_memory_bytes // blocks_bytes
    if kv_offload_disk_size:
        report.kv_offload_disk_bytes = parse_size(kv_offload_disk_size, "kv_offload_disk_size")
        report.disk_sessions = report.kv_offload_disk_bytes // blocks_bytes  # (each file adds a 96-byte header)
    report.advice = _advice(report, spec)
    return report


def _model_dict(spec: ModelSpec) -> dict[str, Any]:
    return {
        "name": spec.name, "attention": spec.attention, "num_layers": spec.num_layers, "num_heads": spec.num_heads,
        "num_kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim, "params": spec.params, "dtype": spec.dtype,
        "kv_lora_rank": spec.kv_lora_rank, "qk_rope_head_dim": spec.qk_rope_head_dim,
        "sliding_window": spec.sliding_window, "num_sliding_layers": spec.num_sliding_layers,
        "max_position_embeddings": spec.max_position_embeddings,
    }


def gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.1f} GB"


def gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB"


def _advice(r: PlanReport, spec: ModelSpec) -> list[str]:
    label = r.kv_dtype.upper()
    lines = [
        f"{label} KV: {r.kv_bytes_per_token:,.0f} B/token, {gib(r.kv_bytes_total)} for {r.concurrency} x "
        f"{r.context} tokens; total {gb(r.total_bytes)} (weights {gb(r.weight_bytes)} + activations "
        f"{gb(r.activation_bytes)} + KV {gb(r.kv_bytes_total)}) against {gb(r.usable_bytes)} usable: "
        + (f"fits, {gb(r.margin_bytes)} to spare." if r.fits else f"does NOT fit, over by {gb(-r.margin_bytes)}.")
    ]
    fixed = r.weight_bytes + r.activation_bytes
    if fixed >= r.usable_bytes:
        lines.append(f"Weights and activations alone ({gb(fixed)}) exceed the usable {gb(r.usable_bytes)}: no "
                     "KV budget at any KV dtype; use a smaller or weight-quantized model, or more devices.")
        return lines
    if not r.fits:
        smaller = [w for w in r.what_if if w.kv_bytes_per_token < r.kv_bytes_per_token]
        for w in sorted(smaller, key=lambda w: -w.kv_bytes_per_token):
            verdict = "fits" if w.fits else f"still over {gb(r.usable_bytes)}"
            lines.append(f"{w.kv_dtype.upper()} KV: KV {gib(w.kv_bytes_total)}, total {gb(w.total_bytes)}, {verdict}.")
            if w.fits:
                break
        half = max(1, r.context // 2)
        for w in r.what_if:
            if w.kv_dtype not in (r.kv_dtype, "int8"):
                continue
            at_half = _Sizer(spec, w.kv_dtype, r.block_size, r.key_scales).max_concurrency(
                r.usable_bytes - fixed, half)
            lines.append(f"At {w.kv_dtype.upper()}: {w.max_concurrency} sessions x {r.context} tokens fit, "
                         f"or {at_half} sessions x {half} tokens, or {r.concurrency} sessions x "
                         f"{w.max_context} tokens.")
    else:
        lines.append(f"Headroom: up to {r.max_concurrency} sessions x {r.context} tokens, or {r.concurrency} "
                     f"sessions x {r.max_context} tokens at {label} KV.")
    if r.kv_offload_memory_bytes:
        lines.append(f"Tier 1: {gib(r.kv_offload_memory_bytes)} of host memory keeps the prefix blocks of "
                     f"{r.tier_sessions} more sessions x {r.context} tokens beyond the pool; an evicted prefix is "
                     "copied back instead of recomputed (kvserve serve --kv-offload-memory).")
    if r.kv_offload_disk_bytes:
        lines.append(f"Tier 2: {gib(r.kv_offload_disk_bytes)} of disk keeps the prefix blocks of about "
                     f"{r.disk_sessions} more sessions x {r.context} tokens, across restarts "
                     "(kvserve serve --kv-offload-disk DIR --kv-offload-disk-size).")
    if spec.max_position_embeddings and r.context > spec.max_position_embeddings:
        lines.append(f"Note: context {r.context} exceeds the model's {spec.max_position_embeddings} positions.")
    return lines


def kv_blocks_for_budget(spec: ModelSpec, kv_dtype: str, block_size: int, budget: int,
                         key_scales: str = "static") -> int:
    """Blocks (the null block included) a KV budget buys: what the engine allocates."""
    return num_blocks_for_budget(
        budget, kv_block_bytes(spec.kv_layout, spec.num_layers, kv_dtype, block_size, key_scales))
