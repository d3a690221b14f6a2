"""User-facing engine configuration, validated once at construction.

Names follow vLLM's engine arguments so that flags carry over unchanged.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import Field, dataclass, field, fields
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
QUANTIZATION_METHODS = ("gguf", "int8", "none")  # the weights' format; vLLM's --quantization
KV_KEY_SCALES = ("auto", "static", "block")


class ConfigError(ValueError):
    """A user-supplied setting is invalid; the message names the setting and the value."""


SPEC_METHODS = ("ngram", "draft_model", "layer_skip")


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}, got {value!r}")


def _check_int(name: str, value: Any, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}")


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
        _check_choice("speculative_config: method", self.method, SPEC_METHODS)
        for name, low in (("num_speculative_tokens", 1), ("prompt_lookup_max", 1), ("prompt_lookup_min", 1),
                          ("num_draft_layers", 0), ("disable_by_batch_size", 0)):
            _check_int(f"speculative_config: {name}", getattr(self, name), low)
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


GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default fraction of a GPU
CPU_KV_CACHE_MEMORY = 4 << 30  # the CPU pool unless sized: RAM is shared with everything else on the host


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


# the concerns a setting belongs to: its group in --help and in the configuration reference, and
# its part of EngineConfig (the "<concern>_config" attribute)
CONCERNS = ("model", "cache", "scheduler", "offload", "eviction", "speculative")


def knob(default: Any, help: str, choices: tuple[str, ...] = (), kind: type | None = None,
         short: str | None = None) -> Any:
    """A setting with what the CLI, --config files, --print-config and the reference need:
    ``help`` (%(default)s allowed), ``choices``, ``kind`` (the value's type where the default
    does not show it: int for an optional count, str for a size written "2GiB") and a ``short``
    flag."""
    return field(default=default, metadata={"help": help, "choices": choices, "kind": kind, "short": short})


@dataclass(slots=True)
class ServedModelConfig:
    """Which model, in which dtype and weight format, on which device, and its request limits."""

    model: str = knob("smollm2-135m", "alias, .gguf file or HF folder (default: %(default)s)")
    dtype: str = knob("auto", "the model's dtype; auto: bfloat16 on CUDA, float32 on CPU", DTYPES)
    quantization: str | None = knob(
        None, "gguf: a GGUF file's quantized weights served in their own blocks (the default for a quantized GGUF "
        "on CPU); int8: linear layers in int8 (weights per output channel, activations per token at run time, "
        "exact int32 sums on every CPU level); none: every weight widened to --dtype (the default for other "
        "checkpoints)", QUANTIZATION_METHODS, short="-q")
    device: str = knob("auto", "auto, cpu, cuda or cuda:N")
    max_model_len: int | None = knob(None, "longest sequence (prompt + output) a request may have; "
                                     "default: the model's context, lowered to what the KV cache holds", kind=int)
    seed: int = knob(0, "seed of sampled requests that give none")

    def __post_init__(self) -> None:
        _check_choice("dtype", self.dtype, DTYPES)
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ConfigError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} (or unset: by the "
                              f"checkpoint), got {self.quantization!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        if self.max_model_len is not None:
            _check_int("max_model_len", self.max_model_len, 1)


@dataclass(slots=True)
class CacheConfig:
    """The paged KV pool: its block size, its size, its storage format and prefix caching."""

    block_size: int = knob(16, "tokens per KV block, a power of two 1..256 (default: %(default)s)")
    kv_cache_memory: int | str | None = knob(None, "KV pool size, e.g. 2GiB (overrides "
                                             "--gpu-memory-utilization)", kind=str)
    gpu_memory_utilization: float | None = knob(
        None, "fraction of device memory for weights, activations and the KV cache (CPU: of RAM); default: 0.9 "
        "on a GPU; on CPU, unset, the pool is the smaller of 4 GiB and what --max-num-seqs sequences of "
        "--max-model-len need", kind=float)
    device_memory: int | str | None = knob(None, "device memory to plan against, e.g. 24GB (default: "
                                           "this machine's)", kind=str)
    kv_cache_dtype: str = knob("auto", "auto (the model dtype), fp32, fp16, bf16, fp8_e4m3, fp8_e5m2, "
                               "int8, int4")
    kv_scales: str | None = knob(None, "calibration file from kvserve calibrate: static key scales "
                                 "(int8/int4), fp8 scales", kind=str)
    kv_key_scales: str = knob("auto", "int8/int4 key scales: static (calibrated, needs --kv-scales) or per "
                              "block; auto: static with --kv-scales", KV_KEY_SCALES)
    kv_cache_dtype_skip_layers: tuple[int, ...] = knob((), "comma-separated layer indices kept in the "
                                                       "model dtype, e.g. 0,29")
    enable_prefix_caching: bool = knob(True, "reuse cached blocks of shared prompt prefixes "
                                       "(default: on, as in vLLM v1)")
    disable_hybrid_kv_cache_manager: bool = knob(
        False, "one block table for every layer: sliding-window layers keep every block too (vLLM's flag; lets "
        "layers of different groups take different KV dtypes)")

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or not 1 <= self.block_size <= 256 or (
            self.block_size & (self.block_size - 1)
        ):
            raise ConfigError(f"block_size must be a power of two in 1..256, got {self.block_size!r}")
        try:
            normalize_kv_dtype(self.kv_cache_dtype, "fp32")
        except ValueError as exc:
            raise ConfigError(f"kv_cache_dtype: {exc}") from None
        _check_choice("kv_key_scales", self.kv_key_scales, KV_KEY_SCALES)
        if self.kv_key_scales == "static" and self.kv_scales is None:
            raise ConfigError(f"kv_key_scales={self.kv_key_scales} needs a calibration file (kv_scales)")
        self.kv_cache_dtype_skip_layers = tuple(self.kv_cache_dtype_skip_layers)
        if any(not isinstance(i, int) or i < 0 for i in self.kv_cache_dtype_skip_layers):
            raise ConfigError(f"kv_cache_dtype_skip_layers must be layer indices >= 0, "
                              f"got {self.kv_cache_dtype_skip_layers!r}")
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_size(self.kv_cache_memory, "kv_cache_memory")
        if self.device_memory is not None:
            self.device_memory = parse_size(self.device_memory, "device_memory")
        if self.gpu_memory_utilization is not None and not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")


@dataclass(slots=True)
class SchedulerConfig:
    """What one step may hold and run, and who is admitted or preempted first."""

    max_num_seqs: int = knob(64, "most requests running at once (default: %(default)s)")
    max_num_batched_tokens: int = knob(2048, "token budget of one step: decodes plus prefill chunks "
                                       "(default: %(default)s)")
    scheduling_policy: str = knob("fcfs", "admission order: arrival, or longest cached prefix first "
                                  "(bounded wait)", SCHEDULING_POLICIES)
    scheduler_reserve_full_isl: bool = knob(
        True, "admit a request only when the KV cache holds its whole prompt besides the prompts "
        "still prefilling; off: admit on its first chunk (more requests start, more are preempted) (default: on)")
    preemption_mode: str = knob("recompute", "swap: a preempted request's blocks go to tier 1 "
                                "(--kv-offload-memory) and come back without recompute; recompute when tier 1 is "
                                "full (default: %(default)s)", PREEMPTION_MODES)
    disable_cascade_attn: bool = knob(False, "read a prefix that every running sequence shares once "
                                      "per sequence (default: once per decode step for all of them: cascade "
                                      "attention)")

    def __post_init__(self) -> None:
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _check_choice("scheduling_policy", self.scheduling_policy, SCHEDULING_POLICIES)
        _check_choice("preemption_mode", self.preemption_mode, PREEMPTION_MODES)


@dataclass(slots=True)
class OffloadConfig:
    """The KV tiers below the pool: host memory (tier 1), disk, and a store shared by replicas."""

    kv_offload_memory: int | str | None = knob(None, "tier 1: keep prefix blocks the pool evicts in "
                                               "this much host memory, e.g. 8GiB", kind=str)
    kv_offload_disk: str | None = knob(None, "tier 2: a directory for the blocks tier 1 drops, found "
                                       "again after a restart", kind=str)
    kv_offload_disk_size: int | str = knob("10GiB", "tier 2's capacity (default: %(default)s)")
    kv_offload_remote: str | None = knob(None, "a Redis or Valkey server shared by replicas, e.g. "
                                         "redis://host:6379/0: the blocks tier 1 drops, found by any replica of "
                                         "the same model and KV format", kind=str)
    kv_offload_remote_ttl: int = knob(86400, "seconds a block stays in the remote store unless read or written "
                                      "again (default: %(default)s)")

    def __post_init__(self) -> None:
        if self.kv_offload_memory is not None:
            self.kv_offload_memory = parse_size(self.kv_offload_memory, "kv_offload_memory")
        self.kv_offload_disk_size = parse_size(self.kv_offload_disk_size, "kv_offload_disk_size")
        if self.kv_offload_disk is not None and self.kv_offload_memory is None:
            raise ConfigError("kv_offload_disk keeps the blocks tier 1 drops: give kv_offload_memory too")
        if self.kv_offload_remote is not None:
            if self.kv_offload_memory is None:
                raise ConfigError("kv_offload_remote keeps the blocks tier 1 drops: give kv_offload_memory too")
            if not self.kv_offload_remote.startswith(("redis://", "rediss://", "unix://")):
                raise ConfigError(f"kv_offload_remote must be a redis://, rediss:// or unix:// URL, "
                                  f"got {self.kv_offload_remote!r}")
        if not isinstance(self.kv_offload_remote_ttl, int) or self.kv_offload_remote_ttl < 1:
            raise ConfigError(f"kv_offload_remote_ttl must be a whole number of seconds >= 1, "
                              f"got {self.kv_offload_remote_ttl!r}")


@dataclass(slots=True)
class EvictionConfig:
    """Token eviction: StreamingLLM's sinks and window, or SnapKV's prompt compression."""

    kv_eviction: str = knob("none", "streaming: keep the attention sinks and a recent window of every "
                            "request's KV, free the rest as it grows (StreamingLLM; memory bounded whatever "
                            "--max-tokens); snapkv: compress each prompt once after its prefill to "
                            "--kv-compression-ratio of its tokens", KV_EVICTION)
    kv_sink_tokens: int = knob(4, "streaming: first tokens kept as attention sinks (whole blocks) "
                               "(default: %(default)s)")
    kv_window: int = knob(1024, "streaming: most recent tokens kept (default: %(default)s)")
    kv_compression_ratio: float = knob(0.5, "snapkv: fraction of each prompt's tokens kept per KV "
                                       "head (default: %(default)s)")
    kv_observation_window: int = knob(32, "snapkv: last prompt tokens whose attention scores the "
                                      "rest (default: %(default)s)")
    kv_compression_per_layer: bool = knob(False, "snapkv: keep one set of tokens per layer (attention "
                                          "summed over its KV heads) instead of one per KV head")

    def __post_init__(self) -> None:
        _check_choice("kv_eviction", self.kv_eviction, KV_EVICTION)
        if not isinstance(self.kv_compression_ratio, (int, float)) or not 0.0 < self.kv_compression_ratio <= 1.0:
            raise ConfigError(f"kv_compression_ratio must be in (0, 1] (the fraction of prompt tokens kept), "
                              f"got {self.kv_compression_ratio!r}")
        _check_int("kv_sink_tokens", self.kv_sink_tokens, 0)
        _check_int("kv_window", self.kv_window, 1)
        _check_int("kv_observation_window", self.kv_observation_window, 1)


@dataclass(slots=True)
class EngineConfig:
    """Every setting of the engine, nested by concern as vLLM's VllmConfig is. Each setting carries
    its help, choices and default in its metadata (knob): the one source of the CLI flags,
    --config keys, --print-config and the configuration reference (kvserve.config_reference).
    Setting names follow vLLM's engine arguments and are unique across concerns, so
    ``EngineConfig.from_settings(block_size=32, ...)`` takes them flat, as ``LLM(...)`` does.
    Sizes may be given as strings ("64MiB")."""

    model_config: ServedModelConfig = field(default_factory=ServedModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    offload_config: OffloadConfig = field(default_factory=OffloadConfig)
    eviction_config: EvictionConfig = field(default_factory=EvictionConfig)
    speculative_config: SpeculativeConfig | dict[str, Any] | str | None = knob(
        None, 'speculative decoding, JSON with vLLM\'s keys, e.g. \'{"method": "ngram", '
        '"num_speculative_tokens": 4}\' (methods: ngram, draft_model with "model", layer_skip)', kind=str)

    def __post_init__(self) -> None:
        if self.speculative_config is not None:
            self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.scheduler_config.preemption_mode == "swap" and self.offload_config.kv_offload_memory is None:
            raise ConfigError("preemption_mode=swap moves preempted requests' blocks to tier 1: give kv_offload_memory")

    @classmethod
    def from_settings(cls, **settings: Any) -> EngineConfig:
        """From flat settings (``block_size=32``); an unknown name is a ConfigError naming it."""
        parts: dict[str, dict[str, Any]] = {concern: {} for concern in CONCERNS}
        owner = {f.name: concern for concern, f in setting_fields()}
        for name, value in settings.items():
            if name not in owner:
                raise ConfigError(f"unknown engine setting {name!r}")
            parts[owner[name]][name] = value
        spec = parts.pop("speculative").get("speculative_config")
        return cls(**{f"{concern}_config": _PARTS[concern](**values) for concern, values in parts.items()},
                   speculative_config=spec)

    def settings(self) -> dict[str, Any]:
        """Every setting by its flat name (what from_settings takes back)."""
        return {f.name: getattr(self if concern == "speculative" else getattr(self, f"{concern}_config"), f.name)
                for concern, f in setting_fields()}


_PARTS: dict[str, type] = {"model": ServedModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
                           "offload": OffloadConfig, "eviction": EvictionConfig}


def setting_fields() -> Iterator[tuple[str, Field[Any]]]:
    """(concern, field) of every engine setting, in the order of --help and the reference."""
    for concern in CONCERNS:
        if concern == "speculative":
            yield concern, EngineConfig.__dataclass_fields__["speculative_config"]
        else:
            yield from ((concern, f) for f in fields(_PARTS[concern]))
