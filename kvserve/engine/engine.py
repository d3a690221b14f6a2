"""LLMEngine: load the model, size the pool, and step(): schedule -> run -> sample -> update."""

from __future__ import annotations

import hashlib
import itertools
import logging
import math
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
from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.request import Request
from kvserve.engine.sampling import SamplingParams
from kvserve.engine.scheduler import Scheduler
from kvserve.engine.snapkv import snapkv_keep
from kvserve.engine.spec_decode import NgramProposer, Proposer, SpecDecoder
from kvserve.engine.step_plan import ScheduledChunk
from kvserve.model.deepseek import DeepseekForCausalLM
from kvserve.model.int8_linear import Int8Embedding, fuse_norms_into_int8, quantize_linears, quantized_bytes
from kvserve.model.llama import (
    LlamaForCausalLM,
    apply_rope,
    fuse_swiglu,
    pack_linears_for_cpu,
    rope_at,
    rope_inv_freq,
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


class InvalidRequestError(ValueError):
    """A request was rejected at submission; the message names the bad value (``param``: the
    request field at fault, where one is)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


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
        self.streaming_refusal = self._streaming_refusal()
        self.streaming = self._streaming_window()
        if config.kv_eviction == "snapkv" and self.streaming_refusal is not None:
            raise ConfigError(f"kv_eviction=snapkv: {self.streaming_refusal}")
        self._compression: dict[str, float] = {}  # snapkv: each compressing request's kept fraction
        self._prompts_scored: set[str] = set()  # snapkv: requests whose prefill was compressed (or kept whole)
        self._sink_keys: dict[str, list[torch.Tensor]] = {}  # streaming: each request's sink keys as written
        self._inv_freq: torch.Tensor | None = None
        self.kv_manager = KVCacheManager(self.num_blocks, config.block_size, config.enable_prefix_caching,
                                         self.tail_blocks, host_tier, disk_tier, self.kv_cache.per_block_tensors(),
                                         [group.spec for group in self.kv_groups], config.max_num_batched_tokens,
                                         self.streaming)
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

    def _streaming_refusal(self) -> str | None:
        """Why this engine cannot stream any request (None: it can)."""
        cfg = self.config
        if self.model_config.mla is not None or len(self.kv_groups) != 1 or any(self.model_config.layer_windows):
            return "MLA and sliding-window models are not supported yet"
        if cfg.speculative_config is not None:
            return "speculative decoding does not combine with it yet"
        return None

    def _streaming_window(self) -> StreamingWindow | None:
        """kv_eviction=streaming's window, the default of every request (else a ConfigError)."""
        cfg = self.config
        if cfg.kv_eviction != "streaming":
            return None
        if self.streaming_refusal is not None:
            raise ConfigError(f"kv_eviction=streaming: {self.streaming_refusal}")
        if cfg.enable_prefix_caching:
            logger.info("kv_eviction=streaming: streaming requests neither share nor reuse cached prefix blocks "
                        "(their sink blocks are turned in place)")
        return StreamingWindow(cfg.kv_sink_tokens, cfg.kv_window)

    def streams(self, kv_eviction: str | None) -> bool:
        """A request asking for ``kv_eviction`` (None: the engine's default) streams."""
        return kv_eviction == "streaming" or (kv_eviction is None and self.streaming is not None)

    def request_window(self, params: SamplingParams) -> StreamingWindow | None:
        """The request's streaming window: its own kv_eviction settings within the engine's
        (a window at most kv_window), else the engine's default."""
        cfg = self.config
        if params.kv_eviction is None and params.kv_window is None and params.kv_sink_tokens is None:
            return self.streaming
        if not self.streams(params.kv_eviction):
            if params.kv_window is None and params.kv_sink_tokens is None:  # none or snapkv
                return None
            raise InvalidRequestError("kv_window and kv_sink_tokens need kv_eviction=streaming (this server "
                                      "does not stream by default)", param="kv_eviction")
        if self.streaming_refusal is not None:
            raise InvalidRequestError(f"kv_eviction=streaming is not available here: {self.streaming_refusal}",
                                      param="kv_eviction")
        window = StreamingWindow(cfg.kv_sink_tokens if params.kv_sink_tokens is None else params.kv_sink_tokens,
                                 cfg.kv_window if params.kv_window is None else params.kv_window)
        for name, value in (("kv_window", window.window), ("kv_sink_tokens", window.sink_tokens)):
            if value > cfg.kv_window:
                raise InvalidRequestError(f"{name}={value} is more than this server's kv_window={cfg.kv_window}",
                                          param=name)
        held = self._streaming_blocks(window)
        if held > self.kv_manager.pool.num_usable_blocks:
            raise InvalidRequestError(f"a streaming request needs {held} KV blocks, more than the pool's "
                                      f"{self.kv_manager.pool.num_usable_blocks}")
        return window

    def request_compression(self, params: SamplingParams) -> float | None:
        """The fraction of the request's prompt SnapKV keeps after its prefill (None: it keeps
        all): its own kv_compression_ratio, at least the engine's (the most it lets a request
        drop), else the engine's when kv_eviction=snapkv."""
        cfg = self.config
        if params.kv_eviction is None and params.kv_compression_ratio is None:
            return cfg.kv_compression_ratio if cfg.kv_eviction == "snapkv" else None
        wanted = params.kv_eviction or cfg.kv_eviction
        if wanted != "snapkv":
            if params.kv_compression_ratio is None:
                return None
            raise InvalidRequestError(f"kv_compression_ratio needs kv_eviction=snapkv (this request's is "
                                      f"{wanted})", param="kv_compression_ratio")
        if self.streaming_refusal is not None:
            raise InvalidRequestError(f"kv_eviction=snapkv is not available here: {self.streaming_refusal}",
                                      param="kv_eviction")
        ratio = cfg.kv_compression_ratio if params.kv_compression_ratio is None else params.kv_compression_ratio
        if ratio < cfg.kv_compression_ratio:
            raise InvalidRequestError(f"kv_compression_ratio={ratio} keeps less of the prompt than this server's "
                                      f"kv_compression_ratio={cfg.kv_compression_ratio} allows",
                                      param="kv_compression_ratio")
        return ratio

    def _streaming_blocks(self, window: StreamingWindow) -> int:
        """Pool blocks one request streaming with ``window`` holds at most (with a prefill chunk
        of max_num_batched_tokens in flight)."""
        return window.blocks_held(self.config.block_size, self.config.max_num_batched_tokens) + self.tail_blocks

    def evict(self, request: Request) -> None:
        """Streaming: free the request's blocks between its sinks and the window of its next
        token, and turn its sink keys to their new cache positions (from the keys as first
        written, so that rounding never accumulates). The last sink block's spare slots then take
        the tokens just before the window from the last block freed (before anything can reuse
        it): their absolute positions are already right there, and the prompt's first tokens past
        the sinks would cost quality (measured against kvpress). The sink blocks are rewritten
        whole, once: a quantized block is re-quantized with scales fitted to its new keys and
        spare slots. Before a step computes the request."""
        eviction = self.kv_manager.evict(request.request_id, request.num_computed_tokens)
        if eviction is None:
            return
        sinks = self.kv_cache.read_blocks(eviction.sink_block_ids)
        kv_heads = self.model_config.num_kv_heads
        if eviction.first:
            self._sink_keys[request.request_id] = [blocks[:, :kv_heads].clone() for blocks in sinks]
        if self._inv_freq is None:
            self._inv_freq = rope_inv_freq(self.model_config).to(self.device)
        cos, signed_sin = rope_at(torch.tensor([eviction.shift], device=self.device), self._inv_freq)
        donor = None if eviction.donor_block_id is None else self.kv_cache.read_blocks([eviction.donor_block_id])
        for layer, (blocks, keys) in enumerate(zip(sinks, self._sink_keys[request.request_id], strict=True)):
            blocks[:, :kv_heads] = apply_rope(keys, cos[0], signed_sin[0])
            if donor is not None:
                blocks[-1, :, eviction.spare_from :] = donor[layer][0, :, eviction.spare_from :]
        self.kv_cache.write_blocks(eviction.sink_block_ids, sinks)

    def compress_prompt(self, request: Request, ratio: float) -> bool:
        """SnapKV, right after the request's prefill: recompute the last kv_observation_window
        tokens' queries (reading their K/V as cached, never rewriting them: the blocks may be
        published), score the prompt per KV head and keep ``ratio`` of it. False when nothing was
        dropped (a short prompt, a ratio of 1, or no pool room for the copy)."""
        cfg, length = self.config, request.num_computed_tokens
        window = min(cfg.kv_observation_window, length)
        keep = max(window, math.ceil(length * ratio))
        if keep >= length:
            return False
        queries: dict[int, torch.Tensor] = {}
        self.runner.query_observer = lambda kv, q: queries.__setitem__(id(kv), q.detach().clone())
        request.num_computed_tokens = length - window
        try:
            self.runner.forward([ScheduledChunk(request, window, blocks=self.kv_manager.blocks_of(request.request_id))])
        finally:
            self.runner.query_observer = None
            request.num_computed_tokens = length
        kv_heads = self.model_config.num_kv_heads
        tokens = self.kv_cache.read_tokens(self.kv_manager.block_ids(request.request_id), length,
                                           self._tail_slot(request))
        index = [snapkv_keep(queries[id(kv)], cached[:kv_heads].transpose(0, 1), keep, layer.scale,
                             per_head=not cfg.kv_compression_per_layer)
                 for kv, cached, layer in zip(self.kv_cache.layers, tokens, self.model.decoder_layers, strict=True)]
        return self.compact(request, index)

    def _tail_slot(self, request: Request) -> int:
        """The request's tail slot, for formats that keep its partial last block there (else 0)."""
        return self.kv_manager.tail_slot(request.request_id) if self.kv_cache.uses_tail else 0

    def compact(self, request: Request, index: list[torch.Tensor]) -> bool:
        """Keep only some of the request's cached tokens: in model layer l's storage, head h keeps
        tokens index[l][h] (sorted positions among those cached; every head as many). Queries
        and kept keys stay at their absolute rotary positions, so their distances are right
        without re-rotation. Quantized blocks are re-quantized with scales fitted to the kept
        tokens. False if the pool is short (nothing changes)."""
        if self.streaming_refusal is not None:
            raise ConfigError(f"compacting a request's KV: {self.streaming_refusal}")
        length = self.kv_manager.num_tokens(request.request_id)
        moved = self.kv_manager.compact(request.request_id, int(index[0].shape[1]))
        if moved is None:
            return False
        self.kv_cache.zero_new_blocks(self.kv_manager.pool.max_block_id_used)
        self.kv_cache.gather_tokens(*moved, index, length, self._tail_slot(request))
        return True

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
            held = self._streaming_blocks(StreamingWindow(cfg.kv_sink_tokens, cfg.kv_window))
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
        window = self.request_window(params)
        compression = self.request_compression(params)
        if window is None and not self.kv_manager.can_ever_fit(len(token_ids)):
            raise InvalidRequestError(
                f"prompt of {len(token_ids)} tokens can never fit in the KV pool "
                f"({self.kv_manager.capacity_tokens} token slots)")
        arrival = next(self._arrivals)
        request_id = request_id or f"req-{arrival}"
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if window != self.streaming:
            self.kv_manager.set_window(request_id, window)
        if compression is not None:
            self._compression[request_id] = compression
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
        if self.kv_manager.streams:
            for request in self.scheduler.running:
                self.evict(request)
        scheduled = self.scheduler.schedule()
        self.num_preemptions += len(scheduled.preempted)
        self.kv_cache.prepare(scheduled.storage)  # every step, even one with nothing to run
        chunks = scheduled.chunks
        if not chunks:
            return []
        for victim in scheduled.preempted:
            if victim.num_computed_tokens == 0:  # recomputed: its prefill is compressed again
                self._prompts_scored.discard(victim.request_id)
            if self.spec is not None:
                self.spec.proposer.free(victim.request_id)
        if self.kv_manager.streams:  # a streaming sequence may outgrow the model's rotary tables
            self.model.extend_rope(max(c.request.num_computed_tokens + c.num_tokens for c in chunks))
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
        if self._compression:
            for chunk, _ in sampled:  # prefills just completed: compress their prompts once
                request = chunk.request
                ratio = self._compression.get(request.request_id)
                if ratio is not None and not request.finished and request.request_id not in self._prompts_scored:
                    self._prompts_scored.add(request.request_id)
                    self.compress_prompt(request, ratio)
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
        self._sink_keys.pop(request.request_id, None)
        self._prompts_scored.discard(request.request_id)
        self._compression.pop(request.request_id, None)
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
