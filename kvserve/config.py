"""User-facing engine configuration, validated once at construction.

Names follow vLLM's engine arguments so that flags carry over unchanged.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvserve.cache.kv_format import normalize_kv_dtype

SCHEDULING_POLICIES = ("fcfs", "lpm")  # arrival order; longest cached prefix first (SGLang's lpm)
PREEMPTION_MODES = ("recompute", "swap")  # vLLM's names
# streaming: StreamingLLM's attention sinks + recent window; snapkv: SnapKV's prompt compression
KV_EVICTION = ("none", "streaming", "snapkv")
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "kib": 2**10, "ki": 2**10,
    "m": 10**6, "mb": 10**6, "mib": 2**20, "mi": 2**20,
    "g": 10**9, "gb": 10**9, "gib": 2**30, "gi": 2**30,
    "t": 10**12, "tb": 10**12, "tib": 2**40, "ti": 2**40,
}
DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATION_METHODS = ("int8",)  # weights (kvserve.model.int8_linear); vLLM's --quantization
KV_KEY_SCALES = ("auto", "static", "block", "global")


class ConfigError(ValueError):
    """A user-supplied setting is invalid; the message names the setting and the value."""


SPEC_METHODS = ("ngram", "draft_model", "layer_skip")


@dataclass(slots=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's ``speculative_config`` keys). ``ngram`` proposes what
    followed an earlier occurrence of the sequence's last n-gram (n from
    ``prompt_lookup_max`` down to ``prompt_lookup_min``); ``draft_model`` runs ``model``, a
    smaller model with the target's vocabulary, on its own paged KV cache; ``layer_skip`` drafts
    with the target's first ``num_draft_layers`` layers and its LM head (no extra weights)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: str | None = None  # draft_model: alias, .gguf or HF folder
    num_draft_layers: int = 0  # layer_skip: 0 = a third of the target's layers
    # no drafts in a step where more requests than this decode (vLLM's name); 0 = never disable
    disable_by_batch_size: int = 8
    # adapt k per request from the measured acceptance of its kind of drafts: k maximizing
    # expected tokens per unit of step cost, a verify step costing 1 + draft_token_cost x k decode steps; None: measured
    # (spec_decode.VERIFY_TOKEN_COST, growing with the batch) plus a draft model's relative size
    draft_token_cost: float | None = None

    @classmethod
    def parse(cls, value: str | dict[str, Any] | SpeculativeConfig) -> SpeculativeConfig:
        """From a dict or its JSON text; an unknown key or a bad value names itself."""
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            value = json_object(value, "speculative_config")
        if not isinstance(value, dict):
            raise ConfigError(f"speculative_config: expected a JSON object, got {value!r}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"speculative_config: unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})")
        return cls(**value)

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ConfigError(f"speculative_config: method must be one of {', '.join(SPEC_METHODS)}, "
                              f"got {self.method!r}")
        for name, low in (("num_speculative_tokens", 1), ("prompt_lookup_max", 1), ("prompt_lookup_min", 1),
                          ("num_draft_layers", 0), ("disable_by_batch_size", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigError(f"speculative_config: {name} must be an integer >= {low}, got {value!r}")
        if self.num_speculative_tokens > 32:
            raise ConfigError(f"speculative_config: num_speculative_tokens must be <= 32, "
                              f"got {self.num_speculative_tokens}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(f"speculative_config: prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                              f"prompt_lookup_max ({self.prompt_lookup_max})")
        if self.method == "draft_model" and not self.model:
            raise ConfigError("speculative_config: method draft_model needs \"model\" (an alias, .gguf or HF folder)")
        cost = self.draft_token_cost
        if cost is not None and (isinstance(cost, bool) or not isinstance(cost, (int, float)) or not 0 <= cost <= 10):
            raise ConfigError(f"speculative_config: draft_token_cost must be a number in [0, 10], "
                              f"got {self.draft_token_cost!r}")


def parse_size(value: str | int | float, name: str = "size") -> int:
    """Parse "2GiB", "512MB", "1.5G" or a plain byte count into bytes."""
    if isinstance(value, bool):
        raise ConfigError(f"{name}: expected a byte size like '2GiB', got {value!r}")
    if isinstance(value, (int, float)):
        nbytes = int(value)
    else:
        match = _SIZE_RE.match(value)
        if not match:
            raise ConfigError(f"{name}: cannot parse {value!r} as a byte size (try '2GiB' or '512MB')")
        number, unit = match.groups()
        nbytes = int(float(number) * _UNITS[(unit or "").lower()])
    if nbytes <= 0:
        raise ConfigError(f"{name}: must be positive, got {value!r}")
    return nbytes


def read_jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for each non-empty line; a bad line is a ConfigError naming it."""
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            yield n, json_object(line, f"{path}:{n}")


def json_object(text: str, where: str) -> dict[str, Any]:
    """``text`` parsed as one JSON object; anything else is a ConfigError naming ``where``."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: not valid JSON ({exc.msg}): {text[:80]!r}") from None
    if not isinstance(obj, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {text[:80]!r}")
    return obj


def read_jsonl_prompts(path: Path) -> list[Any]:
    """The "messages", "prompt" or "text" field of each object of a .jsonl file (in that order of
    preference); an object with none is a ConfigError naming its line."""
    prompts: list[Any] = []
    for n, obj in read_jsonl(path):
        key = next((k for k in ("messages", "prompt", "text") if k in obj), None)
        if key is None:
            raise ConfigError(f"{path}:{n}: expected a 'prompt', 'text' or 'messages' field")
        prompts.append(obj[key])
    return prompts


def format_bytes(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:.2f} {unit}" if unit != "B" else f"{int(nbytes)} B"
        nbytes /= 1024
    raise AssertionError("unreachable")


def machine_memory_bytes() -> int:
    """Physical RAM: the 'device memory' of a CPU run."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def device_total_memory(device: str) -> tuple[int, str]:
    """Total memory of ``device`` ("cuda", "cuda:N", "cpu"; "auto": the first GPU if there is
    one) and where the figure comes from. On CPU that is this machine's RAM."""
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        return torch.cuda.get_device_properties(torch.device(device)).total_memory, "this machine's GPU"
    return machine_memory_bytes(), "this machine's RAM"


@dataclass(slots=True)
class EngineConfig:
    """Every knob of the engine. Sizes may be given as strings ("64MiB")."""

    model: str = "smollm2-135m"
    dtype: str = "auto"
    quantization: str | None = None  # int8: W8A8 linear layers (int8 weights per channel, activations per token)
    device: str = "auto"
    block_size: int = 16
    kv_cache_memory: int | str | None = None
    kv_offload_memory: int | str | None = None  # tier 1: evicted prefix blocks kept in host memory
    kv_offload_disk: str | None = None  # tier 2: a directory for what tier 1 drops (kept across restarts)
    kv_offload_disk_size: int | str = "10GiB"
    gpu_memory_utilization: float = 0.9
    device_memory: int | str | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    kv_cache_dtype: str = "auto"  # auto (the model dtype), fp32, fp16, bf16, fp8_e4m3, fp8_e5m2, int8, int4
    kv_scales: str | None = None  # calibration file (kvserve calibrate): static key scales, fp8 scales
    kv_cache_dtype_skip_layers: tuple[int, ...] = ()  # layers kept in the model dtype
    # int8/int4 key scales: auto (static with kv_scales, else per block), static, block, or global
    # (one calibrated scale for all K and V: the classic mistake, kept to measure it)
    kv_key_scales: str = "auto"
    enable_prefix_caching: bool = True  # on by default, as in vLLM v1
    scheduling_policy: str = "fcfs"  # or "lpm": longest cached prefix first (bounded wait)
    preemption_mode: str = "recompute"  # or "swap": a preempted request's blocks go to tier 1 (kv_offload_memory)
    # admission control (vLLM's flag): admit a request only when the free blocks hold its whole prompt
    # besides the rest of the prompts being prefilled; False admits on its first chunk (may overcommit)
    scheduler_reserve_full_isl: bool = True
    # decode reads a prefix shared by the whole batch once for all its queries (vLLM's flag turns it off)
    disable_cascade_attn: bool = False
    # every layer keeps every block (sliding-window layers still attend within their window):
    # vLLM's flag of the same name, kept to measure what the KV cache groups save
    disable_hybrid_kv_cache_manager: bool = False
    # KV eviction: "streaming" keeps the first kv_sink_tokens tokens' blocks and the last kv_window
    # tokens' blocks of every request and frees the rest as it grows (memory bounded whatever max_tokens)
    kv_eviction: str = "none"
    kv_sink_tokens: int = 4
    kv_window: int = 1024
    # snapkv: keep this fraction of each prompt's tokens per KV head (1.0: all; kvpress's
    # compression_ratio is 1 minus it), scored by the last kv_observation_window prompt queries
    kv_compression_ratio: float = 0.5
    kv_observation_window: int = 32
    # snapkv: one kept set per layer (votes summed over its KV heads) instead of one per KV head
    kv_compression_per_layer: bool = False
    # speculative decoding: a SpeculativeConfig, its dict, or its JSON text (vLLM's speculative_config)
    speculative_config: SpeculativeConfig | dict[str, Any] | str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or not 1 <= self.block_size <= 256 or (
            self.block_size & (self.block_size - 1)
        ):
            raise ConfigError(f"block_size must be a power of two in 1..256, got {self.block_size!r}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ConfigError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} (or none), "
                              f"got {self.quantization!r}")
        try:
            normalize_kv_dtype(self.kv_cache_dtype, "fp32")
        except ValueError as exc:
            raise ConfigError(f"kv_cache_dtype: {exc}") from None
        if self.kv_key_scales not in KV_KEY_SCALES:
            raise ConfigError(f"kv_key_scales must be one of {', '.join(KV_KEY_SCALES)}, got {self.kv_key_scales!r}")
        if self.kv_key_scales in ("static", "global") and self.kv_scales is None:
            raise ConfigError(f"kv_key_scales={self.kv_key_scales} needs a calibration file (kv_scales)")
        self.kv_cache_dtype_skip_layers = tuple(self.kv_cache_dtype_skip_layers)
        if any(not isinstance(i, int) or i < 0 for i in self.kv_cache_dtype_skip_layers):
            raise ConfigError(f"kv_cache_dtype_skip_layers must be layer indices >= 0, "
                              f"got {self.kv_cache_dtype_skip_layers!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ConfigError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                              f"got {self.scheduling_policy!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ConfigError(f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}, "
                              f"got {self.preemption_mode!r}")
        if self.preemption_mode == "swap" and self.kv_offload_memory is None:
            raise ConfigError("preemption_mode=swap moves preempted requests' blocks to tier 1: give kv_offload_memory")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_size(self.kv_cache_memory, "kv_cache_memory")
        if self.device_memory is not None:
            self.device_memory = parse_size(self.device_memory, "device_memory")
        if self.kv_offload_memory is not None:
            self.kv_offload_memory = parse_size(self.kv_offload_memory, "kv_offload_memory")
        self.kv_offload_disk_size = parse_size(self.kv_offload_disk_size, "kv_offload_disk_size")
        if self.kv_offload_disk is not None and self.kv_offload_memory is None:
            raise ConfigError("kv_offload_disk keeps the blocks tier 1 drops: give kv_offload_memory too")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}"
            )
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.speculative_config is not None:
            self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.kv_eviction not in KV_EVICTION:
            raise ConfigError(f"kv_eviction must be one of {', '.join(KV_EVICTION)}, got {self.kv_eviction!r}")
        if not isinstance(self.kv_compression_ratio, (int, float)) or not 0.0 < self.kv_compression_ratio <= 1.0:
            raise ConfigError(f"kv_compression_ratio must be in (0, 1] (the fraction of prompt tokens kept), "
                              f"got {self.kv_compression_ratio!r}")
        for name, low in (("kv_sink_tokens", 0), ("kv_window", 1), ("kv_observation_window", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or value < low:
                raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 1):
            raise ConfigError(f"max_model_len must be a positive integer, got {self.max_model_len!r}")
