"""LLMEngine: load the model, size the pool, and step(): schedule -> run -> sample -> update."""

from __future__ import annotations

import hashlib
import itertools
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

from kvserve.cache.huge_pages import weights_on_huge_pages
from kvserve.cache.kv_cache import KVQuantSpec, PagedKVCache
from kvserve.cache.kv_cache_manager import KVCacheManager
from kvserve.cache.kv_disk import DiskTier, namespace
from kvserve.cache.kv_format import (
    KVLayout,
    kv_block_bytes,
    normalize_kv_dtype,
    num_blocks_for_budget,
    tail_blocks,
)
from kvserve.cache.kv_groups import (
    FULL_ATTENTION,
    KVCacheGroup,
    KVCacheSpec,
    capacity_tokens,
    group_layers,
    layer_groups,
    layer_slots,
)
from kvserve.cache.kv_quant import FP8_TYPES, QMAX, float_kind
from kvserve.cache.kv_retention import StreamingWindow
from kvserve.cache.kv_scales import KVScales, model_fingerprint
from kvserve.cache.kv_stats import KVCacheStats
from kvserve.cache.kv_tiers import TierIndex
from kvserve.config import ConfigError, EngineConfig, SpeculativeConfig, device_total_memory, format_bytes
from kvserve.engine.activations import estimate_activation_bytes
from kvserve.engine.draft import DraftModelProposer, shallow_exit
from kvserve.engine.eviction import KVEviction
from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.request import InvalidRequestError, Request
from kvserve.engine.sampling import SamplingParams
from kvserve.engine.scheduler import Scheduler
from kvserve.engine.snapkv import SnapKVHook
from kvserve.engine.spec_decode import NgramProposer, Proposer, SpecDecoder
from kvserve.engine.step_plan import ScheduledChunk
from kvserve.engine.streaming import StreamingHook
from kvserve.model.deepseek import DeepseekForCausalLM
from kvserve.model.int8_linear import Int8Embedding, fuse_norms_into_int8, quantize_linears, quantized_bytes
from kvserve.model.llama import (
    LlamaForCausalLM,
    fuse_swiglu,
    pack_linears_for_cpu,
    weights_uninitialized,
)
from kvserve.model.loader import ModelConfig, load_checkpoint, load_tokenizer, resolve_model_path
from kvserve.model.rotation import rotate_residual_stream, run_time_rotations

logger = logging.getLogger("kvserve")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


CLIP_WARN_RATIO = 0.001  # drift watch: warn once when more than this share of K/V is clipped


class LoadedModel(NamedTuple):
    path: Path
    config: ModelConfig
    model: LlamaForCausalLM
    tokenizer: Any | None
    weight_bytes: int
    fingerprint: str  # see kvserve.cache.kv_scales.model_fingerprint
    quantization: str | None = None  # the linear layers' (int8_linear), None: the model dtype


def load_model(model: str, device: torch.device, dtype: torch.dtype, quantization: str | None = None) -> LoadedModel:
    """The model's weights in ``dtype`` on ``device``; with ``quantization`` ("int8") the linear
    layers become Int8Linear, the LM head included, behind Hadamard rotations
    (kvserve.model.rotation), and the embedding Int8Embedding."""
    path = resolve_model_path(model)
    model_config, weights = load_checkpoint(path)
    fingerprint = model_fingerprint(asdict(model_config), weights)
    model_class = DeepseekForCausalLM if model_config.mla is not None else LlamaForCausalLM
    with weights_uninitialized():
        module = model_class(model_config, model_config.max_position_embeddings)
    module.load_weights(weights)
    del weights
    module = module.to(device=device, dtype=dtype).eval()
    for name in ("rope_cos", "rope_sin", "local_rope_cos", "local_rope_sin"):  # rotary tables stay float32
        setattr(module, name, getattr(module, name).float())
    if quantization is not None:
        stream_rotated = rotate_residual_stream(module)
        quantize_linears(module, quantization, rotate=run_time_rotations(module, stream_rotated))
        fuse_norms_into_int8(module)
        setattr(module, "embed_tokens", Int8Embedding(module.embed_tokens))  # noqa: B010 (nn.Embedding's slot)
    weight_bytes = sum(p.numel() * p.element_size() for p in module.parameters()) + quantized_bytes(module)
    pack_linears_for_cpu(module)
    fuse_swiglu(module)
    weights_on_huge_pages(module)
    return LoadedModel(path, model_config, module, load_tokenizer(path), weight_bytes, fingerprint, quantization)


def kv_cache_groups(config: ModelConfig, all_full: bool = False) -> list[KVCacheGroup]:
    """The model's KV cache groups (kv_groups): by each layer's window, or with ``all_full``
    one group of every layer, each keeping every block."""
    if all_full or not config.layer_windows:
        return [KVCacheGroup(FULL_ATTENTION, tuple(range(config.num_layers)))]
    return group_layers([KVCacheSpec(window) for window in config.layer_windows])


class DraftModel(NamedTuple):
    model: LlamaForCausalLM  # a model of its own, or the target's shallow exit (weights shared)
    weight_bytes: int  # what it adds to the target's weights
    relative_cost: float  # one draft token's forward pass, in target decode steps (by weights or layers)


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    stop_reason: str | int | None
    logprobs: list[float] | None
    top_logprobs: list[dict[int, float]] | None
    num_preemptions: int
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: dict[str, float] = field(default_factory=dict)


def warn_if_matmuls_emulated(device: torch.device, dtype: torch.dtype) -> None:
    """Say so where torch has no native matmul for a 16-bit model dtype on this CPU (no AVX-512:
    an AVX2 CPU emulates bf16 and float16 products), with the way out."""
    native = {torch.bfloat16: torch.ops.mkldnn._is_mkldnn_bf16_supported,
              torch.float16: torch.ops.mkldnn._is_mkldnn_fp16_supported}.get(dtype)
    if device.type != "cpu" or native is None or native():
        return
    name = str(dtype).removeprefix("torch.")
    logger.warning("dtype %s: this CPU (%s) has no native %s matmul, so the linear layers run emulated, several "
                   "times slower than in float32 (bf16 on a Zen 3: the rest of a 32 x 4,096 decode step, mostly "
                   "linear layers, 500 ms against 126 ms; docs/benchmarks.md); --dtype float32 (the "
                   "CPU default) with --kv-cache-dtype bf16 keeps the KV memory saving at float32 speed",
                   name, torch.backends.cpu.get_cpu_capability(), name)


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        """``loaded`` lets several engines (e.g. different block sizes) share one model."""
        self.config = config
        self.device = torch.device(
            ("cuda" if torch.cuda.is_available() else "cpu") if config.device == "auto" else config.device
        )
        dtype_name = config.dtype if config.dtype != "auto" else (
            "bfloat16" if self.device.type == "cuda" else "float32")
        self.dtype = _DTYPES[dtype_name]
        if loaded is not None:
            self.dtype, self.device = loaded.model.norm.dtype, loaded.model.norm.device
        loaded = loaded or load_model(config.model, self.device, self.dtype, config.quantization)
        warn_if_matmuls_emulated(self.device, self.dtype)
        if loaded.quantization != config.quantization:
            raise ConfigError(f"quantization={config.quantization!r}, but the model given was loaded with "
                              f"quantization={loaded.quantization!r}")
        self.model_path, self.model_config, self.model, self.tokenizer, self.weight_bytes, self.fingerprint, _ = loaded
        model_config = self.model_config
        self.max_model_len = self._max_model_len()

        self.kv_quant = self._kv_quant_spec()
        self.kv_cache_dtype = self.kv_quant.kv_dtype
        # the same formulas the planner uses (kvserve.cache.kv_format), so the two agree
        mla = model_config.mla
        layout = (KVLayout.mla(mla.kv_lora_rank, mla.qk_rope_head_dim) if mla is not None
                  else KVLayout.standard(model_config.num_kv_heads, model_config.head_dim))
        model_kind = float_kind(self.dtype)
        key_scales = self.kv_quant.key_scale_mode
        self.kv_groups = kv_cache_groups(model_config, config.disable_hybrid_kv_cache_manager)
        slots = layer_slots(self.kv_groups, model_config.num_layers)
        kinds = self._slot_kinds(slots, model_kind)
        self.kv_block_bytes = sum(kv_block_bytes(layout, 1, kind, config.block_size, key_scales) for kind in kinds)
        # a token in every group: each pool block holds one group's layers
        self.kv_bytes_per_token = self.kv_block_bytes * len(self.kv_groups) // config.block_size
        # formats that keep a full-precision tail block per running sequence take it from the pool:
        # an aligned run of tail_blocks blocks (the planner counts the same, kv_sequence_extra_bytes)
        self.tail_blocks = tail_blocks(self.kv_cache_dtype, model_kind, key_scales)
        self.kv_tail_bytes = self.tail_blocks * self.kv_block_bytes
        self.draft = self._draft_model()
        self.eviction = KVEviction(config, self._eviction_refusal(), self.tail_blocks)
        if self.eviction.default_window is not None and config.enable_prefix_caching:
            logger.info("kv_eviction=streaming: streaming requests neither share nor reuse cached prefix blocks "
                        "(their sink blocks are turned in place)")
        self.draft_num_blocks = 0  # set by _size_pool when a draft model keeps its own KV pool
        self.num_blocks = self._size_pool()
        self.kv_cache = PagedKVCache(
            model_config.num_layers, self.num_blocks, config.block_size, model_config.num_kv_heads,
            model_config.head_dim, self.dtype, self.device, self.kv_quant, slots,
            mla.latent_dim if mla is not None else 0)
        self._clip_warned = False
        host_tier = self._host_tier()
        disk_tier = self._disk_tier()
        if host_tier is not None:
            self.kv_cache.attach_host_tier(host_tier.capacity_blocks, disk_tier)
        self.kv_manager = KVCacheManager(self.num_blocks, config.block_size, config.enable_prefix_caching,
                                         self.tail_blocks, host_tier, disk_tier, self.kv_cache.per_block_tensors(),
                                         [group.spec for group in self.kv_groups], config.max_num_batched_tokens,
                                         self.eviction.default_window)
        self.scheduler = Scheduler(self.kv_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.scheduling_policy, preemption_mode=config.preemption_mode,
                                   reserve_full_prompt=config.scheduler_reserve_full_isl)
        self.runner = ModelRunner(self.model, self.kv_cache, self.device,
                                  layer_groups(self.kv_groups, model_config.num_layers), model_config.layer_windows,
                                  cascade=not config.disable_cascade_attn)
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0  # requests preempted (recomputed or swapped out) since start-up
        self._arrivals = itertools.count()
        self.eos_token_ids = set(model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        if model_config.is_gemma and self.tokenizer is not None:  # a chat turn ends with <end_of_turn>
            self.eos_token_ids.add(self.tokenizer.convert_tokens_to_ids("<end_of_turn>"))
        self.runner.eos_token_ids = frozenset(self.eos_token_ids)
        # the features that act at named points of the step, each owning its per-request state
        self.streaming_hook = StreamingHook(self.model, self.kv_cache, self.kv_manager, self.device)
        self.snapkv = SnapKVHook(self.runner, self.kv_cache, self.kv_manager, config.kv_observation_window,
                                 config.kv_compression_per_layer, self.eviction.refusal)
        self.spec = self._spec_decoder()

    def _draft_model(self) -> DraftModel | None:
        """The model that drafts (speculative_config method draft_model or layer_skip)."""
        spec = self.config.speculative_config
        if not isinstance(spec, SpeculativeConfig) or spec.method == "ngram":
            return None
        target = self.model_config
        if target.mla is not None:
            raise ConfigError(f"speculative_config: method {spec.method} needs a model with K/V heads; "
                              f"use method ngram with MLA models")
        if spec.method == "layer_skip":
            layers = spec.num_draft_layers or max(1, target.num_layers // 3)
            if layers >= target.num_layers:
                raise ConfigError(f"speculative_config: num_draft_layers={layers} must be fewer than the "
                                  f"model's {target.num_layers} layers")
            return DraftModel(shallow_exit(self.model, layers), 0, layers / target.num_layers)
        assert spec.model is not None
        loaded = load_model(spec.model, self.device, self.dtype, self.config.quantization)
        draft_config = loaded.config
        if draft_config.mla is not None:
            raise ConfigError(f"speculative_config: draft model {spec.model} uses MLA; pick one with K/V heads")
        if draft_config.max_position_embeddings < self.max_model_len:
            raise ConfigError(f"speculative_config: draft model {spec.model} handles "
                              f"{draft_config.max_position_embeddings} positions, fewer than max_model_len="
                              f"{self.max_model_len}; lower max_model_len")
        if self.tokenizer is not None and loaded.tokenizer is not None and \
                loaded.tokenizer.get_vocab() != self.tokenizer.get_vocab():
            raise ConfigError(f"speculative_config: draft model {spec.model} has another tokenizer than "
                              f"{self.config.model}; a draft model must share the target's vocabulary")
        return DraftModel(loaded.model, loaded.weight_bytes, loaded.weight_bytes / self.weight_bytes)

    def _spec_decoder(self) -> SpecDecoder | None:
        spec = self.config.speculative_config
        if spec is None:
            return None
        assert isinstance(spec, SpeculativeConfig)
        proposer: Proposer
        if self.draft is None:
            proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
        else:
            proposer = DraftModelProposer(self.draft.model, self.draft_num_blocks, self.config.block_size,
                                          self.device, self.config.max_num_batched_tokens,
                                          self.model_config.vocab_size)
        logger.info("speculative decoding: %s, up to %d tokens per step, off above %s decoding requests",
                    spec.method, spec.num_speculative_tokens, spec.disable_by_batch_size or "no limit of")
        return SpecDecoder(spec, proposer, self.config.block_size, self.kv_cache.uses_tail, self.max_model_len,
                           self.draft.relative_cost if self.draft is not None else 0.0)

    # ------------------------------------------------------------------ start-up sizing

    def _eviction_refusal(self) -> str | None:
        """Why this engine cannot evict (stream or compact) any request's KV (None: it can)."""
        if self.model_config.mla is not None or len(self.kv_groups) != 1 or any(self.model_config.layer_windows):
            return "MLA and sliding-window models are not supported yet"
        if self.config.speculative_config is not None:
            return "speculative decoding does not combine with it yet"
        return None

    @property
    def streaming(self) -> StreamingWindow | None:
        """Every request's streaming window unless it asks otherwise (kv_eviction=streaming)."""
        return self.eviction.default_window

    def _max_model_len(self) -> int:
        limit = self.model_config.max_position_embeddings
        if self.config.max_model_len is not None and self.config.max_model_len > limit:
            raise ConfigError(
                f"max_model_len={self.config.max_model_len} exceeds the model's context length {limit}")
        return self.config.max_model_len or limit

    def _slot_kinds(self, slots: list[int], model_kind: str) -> list[str]:
        """The KV format of each storage slot; the layers sharing a slot (kv_groups) need one."""
        kinds: dict[int, str] = {}
        for layer, slot in enumerate(slots):
            kind = self.kv_quant.layer_kind(layer, model_kind)
            if kinds.setdefault(slot, kind) != kind:
                raise ConfigError(f"kv_cache_dtype_skip_layers: layer {layer} shares KV storage with layers of "
                                  f"another KV cache group; skip whole slots (layers at one position of every "
                                  f"group) or pass disable_hybrid_kv_cache_manager")
        return [kinds[slot] for slot in sorted(kinds)]

    def _kv_quant_spec(self) -> KVQuantSpec:
        """The KV format from kv_cache_dtype, kv_scales and kv_cache_dtype_skip_layers."""
        cfg, mcfg = self.config, self.model_config
        kv_dtype = normalize_kv_dtype(cfg.kv_cache_dtype, float_kind(self.dtype))
        bad = [i for i in cfg.kv_cache_dtype_skip_layers if i >= mcfg.num_layers]
        if bad:
            raise ConfigError(f"kv_cache_dtype_skip_layers: layer {bad[0]} does not exist "
                              f"(the model has {mcfg.num_layers} layers)")
        scales = None
        if cfg.kv_scales is not None:
            scales = KVScales.load(cfg.kv_scales)
            scales.check_model(cfg.model, self.fingerprint, (mcfg.num_layers, mcfg.num_kv_heads, mcfg.head_dim))
        mode = cfg.kv_key_scales if cfg.kv_key_scales != "auto" else "static" if scales is not None else "block"
        if mcfg.mla is not None and kv_dtype not in ("fp32", "fp16", "bf16"):
            raise ConfigError(f"kv_cache_dtype={cfg.kv_cache_dtype}: MLA's latent KV cache is kept in a float dtype "
                              f"(fp32, fp16, bf16); quantized latents are not supported yet")
        if kv_dtype == "int4" and cfg.kv_key_scales in ("static", "global"):
            raise ConfigError(f"kv_key_scales={cfg.kv_key_scales} does not apply to int4: its key ranges are "
                              f"always computed per block")
        key_scales = fp8_scales = override = None
        if scales is not None and mode == "global":  # one scale for every K and V element
            top = float(max(scales.key_absmax.max(), scales.value_absmax.max()))
            key_scales = torch.full_like(scales.key_absmax, top)
            if kv_dtype in QMAX:
                override = top / QMAX[kv_dtype]
                fp8_scales = torch.full((mcfg.num_layers, 2), override)
        elif scales is not None:
            key_scales = scales.key_absmax if mode == "static" else None
            fp8_scales = scales.fp8_scales(kv_dtype) if kv_dtype in FP8_TYPES else None
        return KVQuantSpec(kv_dtype, key_scales=key_scales if kv_dtype == "int8" else None,
                           fp8_scales=fp8_scales if kv_dtype in FP8_TYPES else None,
                           skip_layers=frozenset(cfg.kv_cache_dtype_skip_layers), value_scale_override=override)

    def _size_pool(self) -> int:
        cfg = self.config
        block_bytes = self.kv_block_bytes
        if cfg.kv_cache_memory is not None:
            budget = int(cfg.kv_cache_memory)
            source = f"kv_cache_memory={format_bytes(budget)}"
        else:
            if cfg.device_memory is not None:
                total = int(cfg.device_memory)
            else:
                total = device_total_memory(str(self.device))[0]
            activations = self._activation_peak()
            weights = self.weight_bytes + (self.draft.weight_bytes if self.draft is not None else 0)
            budget = int(total * cfg.gpu_memory_utilization) - weights - activations
            source = (f"gpu_memory_utilization={cfg.gpu_memory_utilization} of {format_bytes(total)} "
                      f"- weights {format_bytes(weights)} - activations {format_bytes(activations)}")
            if budget <= 0:
                raise ConfigError(f"no memory left for the KV cache: {source} = {format_bytes(budget)}")
        if self.draft is not None:
            budget -= self._draft_pool(budget)
        num_blocks = num_blocks_for_budget(budget, block_bytes)
        # the null block and one block of tokens, or with tails a run aligned past the null block's
        needed = (len(self.kv_groups) + 1) * self.tail_blocks or 2
        if num_blocks < needed:
            raise ConfigError(
                f"{source} is smaller than one KV block of {cfg.block_size} tokens "
                f"({format_bytes(needed * block_bytes)} needed with the reserved null block"
                f"{' and a full-precision tail block' if self.tail_blocks else ''})")
        capacity = capacity_tokens([g.spec for g in self.kv_groups], num_blocks - 1, cfg.block_size,
                                   cfg.max_num_batched_tokens, self.tail_blocks)
        if cfg.kv_eviction == "streaming":  # a request holds its sinks and window, however long it grows
            held = self.eviction.streaming_blocks(StreamingWindow(cfg.kv_sink_tokens, cfg.kv_window))
            if held > num_blocks - 1:
                raise ConfigError(f"{source} holds {num_blocks - 1} blocks, fewer than the {held} one streaming "
                                  f"request needs (kv_window={cfg.kv_window} plus a chunk of "
                                  f"max_num_batched_tokens={cfg.max_num_batched_tokens})")
            capacity = max(capacity, self.max_model_len)
        if capacity < self.max_model_len:
            if cfg.max_model_len is not None:
                raise ConfigError(
                    f"{source} holds {capacity} tokens, fewer than one sequence of max_model_len="
                    f"{cfg.max_model_len} needs ({format_bytes(self.max_model_len * self.kv_bytes_per_token)})")
            logger.warning("max_model_len lowered from %d to %d tokens to fit the KV cache",
                           self.max_model_len, capacity)
            self.max_model_len = capacity
        logger.info(
            "KV cache: %d blocks x %d tokens = %d token slots, %s (%s, %d B/token, from %s); "
            "maximum concurrency for %d tokens per request: %.2fx",
            num_blocks - 1, cfg.block_size, capacity, format_bytes(num_blocks * block_bytes),
            self.kv_cache_dtype, self.kv_bytes_per_token, source, self.max_model_len,
            capacity / self.max_model_len)
        if self.tail_blocks:
            logger.info("each running sequence's not-yet-full last block is kept in full precision in %d pool "
                        "blocks, taken when it starts", self.tail_blocks)
        if self.kv_cache_dtype in ("int8", "int4", "fp8_e4m3", "fp8_e5m2"):
            logger.info("KV cache dtype %s: key scales %s", self.kv_cache_dtype,
                        "static per layer" if self.kv_cache_dtype.startswith("fp8") else
                        "static, calibrated" if self.kv_quant.key_scales is not None else "per block")
        return num_blocks

    def _draft_pool(self, budget: int) -> int:
        """Size the draft model's own KV pool from the KV budget, so that it holds as many tokens
        as the target's; returns the bytes it takes."""
        assert self.draft is not None
        config = self.draft.model.config
        block_bytes = kv_block_bytes(KVLayout.standard(config.num_kv_heads, config.head_dim), config.num_layers,
                                     float_kind(self.dtype), self.config.block_size)
        per_token = block_bytes / self.config.block_size
        share = int(budget * per_token / (per_token + self.kv_bytes_per_token))
        self.draft_num_blocks = num_blocks_for_budget(share, block_bytes)
        if self.draft_num_blocks < 2:
            raise ConfigError(f"the KV budget {format_bytes(budget)} leaves the draft model less than one block")
        logger.info("draft model KV cache: %d blocks x %d tokens, %s of the KV budget (%d B/token)",
                    self.draft_num_blocks - 1, self.config.block_size,
                    format_bytes(self.draft_num_blocks * block_bytes), int(per_token))
        return self.draft_num_blocks * block_bytes

    def _host_tier(self) -> TierIndex | None:
        """Tier 1 in host memory (--kv-offload-memory), sized in whole pool blocks."""
        cfg = self.config
        if cfg.kv_offload_memory is None:
            return None
        capacity = int(cfg.kv_offload_memory) // self.kv_block_bytes
        if capacity < 1:
            raise ConfigError(f"kv_offload_memory={format_bytes(int(cfg.kv_offload_memory))} is smaller than one "
                              f"KV block ({format_bytes(self.kv_block_bytes)})")
        logger.info("KV tier 1 (host memory): %d blocks = %d tokens, %s", capacity, capacity * self.config.block_size,
                    format_bytes(capacity * self.kv_block_bytes))
        return TierIndex("cpu", capacity, self.kv_block_bytes)

    def _disk_tier(self) -> DiskTier | None:
        """Tier 2 on disk (--kv-offload-disk), under a namespace of everything that decides what a
        block's bytes mean, so a directory shared with another model or format is never misread."""
        cfg = self.config
        if cfg.kv_offload_disk is None:
            return None
        scales_hash = hashlib.sha256(Path(cfg.kv_scales).read_bytes()).hexdigest() if cfg.kv_scales else None
        quant = self.kv_quant
        space = namespace(self.fingerprint, str(self.dtype), quant.kv_dtype, quant.key_scale_mode,
                          sorted(quant.skip_layers), quant.value_scale_override, cfg.block_size, scales_hash)
        disk = DiskTier(cfg.kv_offload_disk, int(cfg.kv_offload_disk_size), space, self.kv_block_bytes)
        logger.info("KV tier 2 (disk): %s, %d blocks = %d tokens, %s", disk.dir, disk.capacity_blocks,
                    disk.capacity_blocks * cfg.block_size, format_bytes(int(cfg.kv_offload_disk_size)))
        return disk

    def _activation_peak(self) -> int:
        cfg, mcfg = self.config, self.model_config
        tokens = min(cfg.max_num_batched_tokens, self.max_model_len)
        if self.device.type != "cuda":
            elem = torch.empty((), dtype=self.dtype).element_size()
            return estimate_activation_bytes(
                hidden_size=mcfg.hidden_size, num_heads=mcfg.num_heads, num_kv_heads=mcfg.num_kv_heads,
                head_dim=mcfg.head_dim, intermediate_size=mcfg.intermediate_size, vocab_size=mcfg.vocab_size,
                num_tokens=tokens, max_num_seqs=cfg.max_num_seqs, max_model_len=self.max_model_len, elem_bytes=elem)
        # Profile one max-size prefill against a throwaway pool sized for it.
        bs = cfg.block_size
        blocks = -(-tokens // bs) + 1
        blocks += 2 * self.tail_blocks  # room for an aligned tail run
        scratch = PagedKVCache(mcfg.num_layers, blocks, bs, mcfg.num_kv_heads, mcfg.head_dim, self.dtype, self.device,
                               self.kv_quant)
        manager = KVCacheManager(blocks, bs, tail_blocks=self.tail_blocks)
        runner = ModelRunner(self.model, scratch, self.device)
        dummy = Request("profile", [0] * tokens, SamplingParams(max_tokens=1), -1)
        manager.allocate_slots("profile", tokens)
        scratch.prepare(manager.take_storage_work())
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        runner.execute([ScheduledChunk(dummy, tokens, blocks=manager.blocks_of("profile"))])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        del scratch
        torch.cuda.empty_cache()
        return int(peak)

    # ------------------------------------------------------------------ requests

    def encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer: pass prompt_token_ids instead of text")
        return list(self.tokenizer.encode(prompt))

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, stream: bool = False) -> Request:
        params = params or SamplingParams()
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not token_ids:
            raise InvalidRequestError("prompt is empty: at least one token is needed")
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if len(token_ids) > self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(token_ids)} tokens, more than max_model_len={self.max_model_len}")
        window = self.eviction.request_window(params, self.kv_manager.pool.num_usable_blocks)
        compression = self.eviction.request_compression(params)
        if window is None and not self.kv_manager.can_ever_fit(len(token_ids)):
            raise InvalidRequestError(
                f"prompt of {len(token_ids)} tokens can never fit in the KV pool "
                f"({self.kv_manager.capacity_tokens} token slots)")
        arrival = next(self._arrivals)
        request_id = request_id or f"req-{arrival}"
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if window != self.eviction.default_window:
            self.kv_manager.set_window(request_id, window)
        self.snapkv.add(request_id, compression)
        generator = None
        if params.seed is not None and not params.greedy:
            generator = torch.Generator().manual_seed(params.seed)
        request = Request(request_id, token_ids, params, arrival, prompt=text, generator=generator, stream=stream)
        self.requests[request_id] = request
        self.scheduler.add(request)
        return request

    def abort_request(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is not None and not request.finished:
            self._finish(request, "abort")
            request.finish_time = time.monotonic()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------------ the loop

    def step(self) -> list[RequestOutput]:
        """One iteration of continuous batching; returns outputs of requests that advanced."""
        self.streaming_hook.before_step(self.scheduler.running)
        scheduled = self.scheduler.schedule()
        self.num_preemptions += len(scheduled.preempted)
        self.kv_cache.prepare(scheduled.storage)  # every step, even one with nothing to run
        chunks = scheduled.chunks
        if not chunks:
            return []
        for victim in scheduled.preempted:
            self.snapkv.preempted(victim)
            if self.spec is not None:
                self.spec.proposer.free(victim.request_id)
        self.streaming_hook.before_forward(max(c.request.num_computed_tokens + c.num_tokens for c in chunks))
        sampled = self.runner.execute(chunks)
        self.kv_manager.record_step()  # peak figures as held during the forward pass
        self._watch_drift()
        for chunk in chunks:
            chunk.request.num_computed_tokens += chunk.num_tokens
        outputs = []
        now = time.monotonic()
        for chunk, result in sampled:
            request = chunk.request
            if chunk.draft_token_ids:  # rejected drafts leave nothing behind
                accepted = len(result.token_ids) - 1
                request.num_computed_tokens -= len(chunk.draft_token_ids) - accepted
                self.kv_manager.rollback(request.request_id, request.num_computed_tokens)
                assert self.spec is not None
                self.spec.record(request.request_id, len(chunk.draft_token_ids), accepted)
            if request.first_token_time is None:
                request.first_token_time = now
            previous_text = request.output_text
            new_tokens = []
            for j, token in enumerate(result.token_ids):
                request.output_token_ids.append(token)
                new_tokens.append(token)
                if result.logprobs is not None and request.params.logprobs is not None:
                    request.output_logprobs.append(result.logprobs[j])
                    if result.top_logprobs is not None:
                        request.output_top_logprobs.append(result.top_logprobs[j])
                self._check_stop(request, token)
                if request.finished:  # tokens after a stop are dropped
                    request.finish_time = now
                    self.requests.pop(request.request_id, None)
                    break
            outputs.append(self._output(request, new_tokens, previous_text))
        self.snapkv.after_step([chunk.request for chunk, _ in sampled])
        if self.spec is not None:
            self.spec.propose(self.scheduler.running)
        return outputs

    def _decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=True))

    def _detokenize(self, request: Request, final: bool = False) -> None:
        """Append the new tokens' text to ``output_text``, decoding them with the tokens of the
        previous call before them (a word's leading space, a character split over tokens), so that
        a long stream costs O(1) per token, not a decode of everything so far. Until ``final``, an
        incomplete character waits for its next token."""
        ids = request.output_token_ids
        prefix, read = request.detok_prefix, request.detok_read
        if read == len(ids):
            return
        before, after = self._decode(ids[prefix:read]), self._decode(ids[prefix:])
        if after.endswith("\ufffd") and not final:
            return
        request.output_text += after[len(before):]
        request.detok_prefix, request.detok_read = read, len(ids)

    def _check_stop(self, request: Request, token: int) -> None:
        params = request.params
        reason: str | None = None
        incremental = bool(params.stop) or request.stream
        if incremental:
            self._detokenize(request)
        may_stop = len(request.output_token_ids) >= params.min_tokens  # before that, stops are masked
        if not may_stop:
            pass
        elif not params.ignore_eos and token in self.eos_token_ids:
            reason = "stop"
        elif token in params.stop_token_ids:
            reason, request.stop_reason = "stop", token
        elif params.stop:
            text = request.output_text
            for stop in params.stop:
                at = text.find(stop, max(0, len(text) - len(stop) - 16))
                if at >= 0:
                    end = at + len(stop) if params.include_stop_str_in_output else at
                    request.output_text = text[:end]
                    reason, request.stop_reason = "stop", stop
                    break
        if reason is None and (
            len(request.output_token_ids) >= params.max_tokens
            # a streaming request's attention spans stay within the window: no length limit
            or (request.num_tokens >= self.max_model_len and self.kv_manager.window_of(request.request_id) is None)
        ):
            reason = "length"
        if reason is not None:
            if not incremental:
                request.output_text = self._decode(request.output_token_ids)
            elif not isinstance(request.stop_reason, str):  # a stop string already cut the text
                self._detokenize(request, final=True)  # what an incomplete character left
            self._finish(request, reason)

    def _finish(self, request: Request, reason: str) -> None:
        self.scheduler.finish(request, reason)
        self.streaming_hook.finish(request.request_id)
        self.snapkv.finish(request.request_id)
        if self.spec is not None:
            self.spec.free(request.request_id)

    def _output(self, request: Request, new_tokens: list[int], previous_text: str) -> RequestOutput:
        text = request.output_text
        # Hold back a trailing partial UTF-8 character until it completes.
        stable = text if request.finished or not text.endswith("\ufffd") else text.rstrip("\ufffd")
        new_text = stable[len(previous_text.rstrip("\ufffd")):] if stable.startswith(
            previous_text.rstrip("\ufffd")) else stable
        metrics = {"arrival_time": request.arrival_time}
        if request.first_token_time is not None:
            metrics["ttft"] = request.first_token_time - request.arrival_time
        if request.finish_time is not None:
            metrics["e2e"] = request.finish_time - request.arrival_time
        want_logprobs = request.params.logprobs is not None
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=list(request.output_token_ids),
            text=text,
            new_token_ids=new_tokens,
            new_text=new_text,
            finished=request.finished,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            logprobs=list(request.output_logprobs) if want_logprobs else None,
            top_logprobs=list(request.output_top_logprobs) if want_logprobs else None,
            num_preemptions=request.num_preemptions,
            num_cached_tokens=request.num_cached_tokens,
            metrics=metrics,
        )

    def kv_stats(self) -> KVCacheStats:
        stats = self.kv_manager.stats()
        stats.num_preemptions = self.num_preemptions
        stats.kv_cache_dtype = self.kv_cache_dtype
        stats.clip_ratio = self.clip_ratio()
        stats.evicted_bytes_now = stats.evicted_tokens_now * self.kv_bytes_per_token
        stats.spec_decode = self.spec.snapshot() if self.spec is not None else None
        return stats

    def clip_ratio(self) -> float:
        """Share of K/V elements clipped by static (calibrated) scales so far: the drift watch."""
        clipped, checked = self.kv_cache.clip_stats()
        return clipped / checked if checked else 0.0

    def _watch_drift(self) -> None:
        if self._clip_warned:
            return
        ratio = self.clip_ratio()
        if ratio > CLIP_WARN_RATIO:
            self._clip_warned = True
            logger.warning("KV scales drift: %.3f%% of cached K/V values were clipped by the static scales "
                           "(threshold %.1f%%): this traffic differs from the calibration data; recalibrate "
                           "(kvserve calibrate) on it", 100 * ratio, 100 * CLIP_WARN_RATIO)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        """Requests not running: waiting for admission, or swapped out."""
        return len(self.scheduler.waiting) + len(self.scheduler.swapped)

    def describe(self) -> dict[str, Any]:
        return {
            "model": str(self.model_path), "device": str(self.device), "dtype": str(self.dtype),
            "max_model_len": self.max_model_len, "num_blocks": self.num_blocks - 1,
            "block_size": self.config.block_size, "kv_bytes_per_token": self.kv_bytes_per_token,
        }
