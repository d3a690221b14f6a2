"""LLMEngine: built from its start-up (startup.py), then step(): schedule -> prepare storage ->
run -> sample -> update."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from kvserve.cache.kv_cache import PagedKVCache
from kvserve.cache.kv_cache_manager import KVCacheManager
from kvserve.cache.kv_groups import layer_groups
from kvserve.cache.kv_stats import KVCacheStats
from kvserve.config import EngineConfig
from kvserve.engine.draft import spec_decoder
from kvserve.engine.loading import LoadedModel
from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.output import OutputProcessor, RequestOutput
from kvserve.engine.request import InvalidRequestError, Request, check_prompt
from kvserve.engine.sampling import SamplingParams
from kvserve.engine.scheduler import Scheduler
from kvserve.engine.scoring import score_chunks
from kvserve.engine.snapkv import SnapKVHook
from kvserve.engine.startup import EngineStartup
from kvserve.engine.streaming import StreamingHook
from kvserve.engine.structured import GrammarCompiler, GrammarError

logger = logging.getLogger("kvserve")
KVObserver = Callable[[int, torch.Tensor, torch.Tensor], None]  # (layer index, K, V) before the write
READ_WAIT_S = 0.05  # an idle step's wait for a lower store's read (new requests are taken between steps)
CLIP_WARN_RATIO = 0.001  # drift watch: warn once when more than this share of K/V is clipped


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        """``loaded`` lets several engines (e.g. different block sizes) share one model."""
        self.config = config
        cache, sched, evict = config.cache_config, config.scheduler_config, config.eviction_config
        start = EngineStartup(config, loaded)  # loads, quantizes and sizes; raises ConfigError
        self.device, self.dtype, self.model_path = start.device, start.dtype, start.loaded.path
        self.model_config, self.model, self.tokenizer = start.model_config, start.model, start.tokenizer
        self.weight_bytes, self.fingerprint = start.weight_bytes, start.fingerprint
        self.max_model_len = start.max_model_len
        self.kv_quant, self.kv_cache_dtype, self.kv_groups = start.kv_quant, start.kv_cache_dtype, start.kv_groups
        self.kv_block_bytes, self.kv_bytes_per_token = start.kv_block_bytes, start.kv_bytes_per_token
        self.tail_blocks, self.kv_tail_bytes = start.tail_blocks, start.kv_tail_bytes
        self.draft, self.draft_num_blocks, self.num_blocks = start.draft, start.draft_num_blocks, start.num_blocks
        self.eviction = start.eviction
        model_config, mla = self.model_config, self.model_config.mla
        self.kv_cache = PagedKVCache(
            model_config.num_layers, self.num_blocks, cache.block_size, model_config.num_kv_heads,
            model_config.head_dim, self.dtype, self.device, self.kv_quant, start.slots,
            mla.latent_dim if mla is not None else 0)
        self._clip_warned = False
        host_tier, stores = start.host_tier, start.lower_stores
        if host_tier is not None:
            self.kv_cache.attach_host_tier(host_tier.capacity_blocks, stores)
        self.kv_manager = KVCacheManager(self.num_blocks, cache.block_size, cache.enable_prefix_caching,
                                         self.tail_blocks, host_tier, stores,
                                         [group.spec for group in self.kv_groups], sched.max_num_batched_tokens,
                                         self.eviction.default_window)
        self.scheduler = Scheduler(self.kv_manager, sched.max_num_seqs, sched.max_num_batched_tokens,
                                   sched.scheduling_policy, preemption_mode=sched.preemption_mode,
                                   reserve_full_prompt=sched.scheduler_reserve_full_isl)
        self.runner = ModelRunner(self.model, self.kv_cache, self.device,
                                  layer_groups(self.kv_groups, model_config.num_layers), model_config.layer_windows,
                                  cascade=not sched.disable_cascade_attn)
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0  # requests preempted (recomputed or swapped out) since start-up
        self._arrivals = itertools.count()
        self.eos_token_ids = start.eos_token_ids
        self.runner.eos_token_ids = frozenset(self.eos_token_ids)
        self.outputs = OutputProcessor(self.tokenizer, self.eos_token_ids, self.max_model_len,
                                       lambda request_id: self.kv_manager.window_of(request_id) is not None)
        # the features that act at named points of the step, each owning its per-request state
        self.streaming_hook = StreamingHook(self.model, self.kv_cache, self.kv_manager, self.device)
        self.snapkv = SnapKVHook(self.runner, self.kv_cache, self.kv_manager, evict.kv_observation_window,
                                 evict.kv_compression_per_layer, self.eviction.refusal)
        eos = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size,
                                        eos if eos is not None else min(self.eos_token_ids, default=0))
        self.spec = spec_decoder(config, self.draft, self.draft_num_blocks, self.device, self.model_config.vocab_size,
                                 self.max_model_len,
                                 lambda r: self.kv_manager.lookahead_room(r.request_id, r.num_computed_tokens))

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
        check_prompt(token_ids, self.model_config.vocab_size, self.max_model_len)
        window = self.eviction.request_window(params, self.kv_manager.pool.num_usable_blocks)
        compression = self.eviction.request_compression(params)
        if window is None and not self.kv_manager.can_ever_fit(len(token_ids)):
            raise InvalidRequestError(
                f"prompt of {len(token_ids)} tokens can never fit in the KV pool "
                f"({self.kv_manager.capacity_tokens} token slots)")
        grammar = None
        if params.structured_output is not None:
            try:
                grammar = self.grammars.compile(params.structured_output)
            except GrammarError as exc:
                raise InvalidRequestError(f"structured output does not compile: {exc}") from exc
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
        request = Request(request_id, token_ids, params, arrival, prompt=text, generator=generator, stream=stream,
                          grammar=grammar)
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
            self.kv_manager.offload.wait_for_reads(READ_WAIT_S)  # a request waits for its blocks: no spinning
            return []
        for victim in scheduled.preempted:
            self.snapkv.preempted(victim)
            if self.spec is not None:
                self.spec.proposer.free(victim.request_id)
        self.streaming_hook.before_forward(chunks)
        sampled = self.runner.execute(chunks)
        self.kv_cache.share_published(self.kv_manager.take_published())
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
            new_tokens, reason = self.outputs.append(request, result)
            if reason is not None:
                self._finish(request, reason)
                request.finish_time = now
                self.requests.pop(request.request_id, None)
            outputs.append(self.outputs.output(request, new_tokens, previous_text))
        self.snapkv.after_step([chunk.request for chunk, _ in sampled])
        if self.spec is not None:
            self.spec.propose(self.scheduler.running)
        return outputs

    def _finish(self, request: Request, reason: str) -> None:
        self.scheduler.finish(request, reason)
        self.streaming_hook.finish(request.request_id)
        self.snapkv.finish(request.request_id)
        if self.spec is not None:
            self.spec.free(request.request_id)

    def kv_stats(self) -> KVCacheStats:
        stats = self.kv_manager.stats()
        stats.num_preemptions = self.num_preemptions
        stats.kv_cache_dtype = self.kv_cache_dtype
        stats.clip_ratio = self.kv_clip_ratio()
        stats.evicted_bytes_now = stats.evicted_tokens_now * self.kv_bytes_per_token
        stats.spec_decode = self.spec.snapshot() if self.spec is not None else None
        return stats

    def score(self, tokens: list[int], chunk: int, prompt_len: int = 0) -> Iterator[tuple[int, torch.Tensor]]:
        """Teacher-forced log-probabilities of ``tokens``, chunk by chunk (scoring.score_chunks)."""
        return score_chunks(self, tokens, chunk, prompt_len)

    @contextmanager
    def observe_kv(self, observer: KVObserver) -> Iterator[None]:
        """Within the block, ``observer(layer index, K, V)`` sees every layer's new K/V before it
        is written (calibration statistics; an observer that edits them in place changes what is
        cached)."""
        index = {id(layer): i for i, layer in enumerate(self.kv_cache.layers)}
        self.runner.kv_observer = lambda layer, key, value: observer(index[id(layer)], key, value)
        try:
            yield
        finally:
            self.runner.kv_observer = None

    def kv_clip_ratio(self) -> float:
        """Share of cached K/V values clipped by static (calibrated) scales so far."""
        return self.kv_cache.clip_ratio()

    def take_tier_load_seconds(self) -> list[tuple[str, float]]:
        """(tier, seconds) of each block loaded back into the pool since the last call."""
        return self.kv_cache.take_load_seconds()

    def shared_writes(self) -> list[threading.Event]:
        """One event per shared store, set once every block handed to it so far is written: a
        prefill replica waits on them before a decode replica reads the prompt's blocks (any
        thread may call it)."""
        return [store.written() for store in self.kv_manager.stores if store.shared]

    def close(self) -> None:
        """Finish what outlives the engine: the lower stores' queued block writes, so a restart (or
        another replica) finds them."""
        for store in self.kv_manager.stores:
            store.close()
        self.kv_manager.offload.close()

    def _watch_drift(self) -> None:
        if self._clip_warned:
            return
        ratio = self.kv_clip_ratio()
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
            "block_size": self.config.cache_config.block_size, "kv_bytes_per_token": self.kv_bytes_per_token,
        }
