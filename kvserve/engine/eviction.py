"""The engine's KV eviction settings (kv_eviction: none, streaming, snapkv) and each request's
own within them: its streaming window or SnapKV's kept fraction, refused with the field named
where the request asks for more than the engine allows or the model cannot do."""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.cache.kv_groups import FULL_ATTENTION, KVCacheSpec
from kvserve.cache.kv_retention import StreamingWindow
from kvserve.config import ConfigError, EngineConfig
from kvserve.engine.request import InvalidRequestError
from kvserve.engine.sampling import SamplingParams


class KVEviction:
    """``refusal``: why this engine cannot compact a request's KV (snapkv; None: it can);
    ``streaming_refusal``: why it cannot stream one; ``tail_blocks``: the pool blocks a
    sequence's tail run takes (a streaming request holds one per KV cache group besides its
    window); ``groups``: the KV cache groups' specs (a stream's window must cover every sliding
    one)."""

    def __init__(self, config: EngineConfig, refusal: str | None, streaming_refusal: str | None,
                 tail_blocks: int, groups: Sequence[KVCacheSpec] = (FULL_ATTENTION,)) -> None:
        evict = config.eviction_config
        self.config, self.refusal, self.tail_blocks = config, refusal, tail_blocks
        self.streaming_refusal, self.groups = streaming_refusal, list(groups)
        self.narrowest_window = max((spec.sliding_window for spec in self.groups), default=0)
        if evict.kv_eviction == "streaming" and evict.kv_window < self.narrowest_window:
            raise ConfigError(f"kv_window={evict.kv_window} is shorter than the model's sliding window of "
                              f"{self.narrowest_window} tokens: a stream keeps at least what its sliding layers read")
        why = self.streaming_refusal if evict.kv_eviction == "streaming" else refusal
        if evict.kv_eviction != "none" and why is not None:
            raise ConfigError(f"kv_eviction={evict.kv_eviction}: {why}")
        # the default window of every request (kv_eviction=streaming)
        self.default_window = (StreamingWindow(evict.kv_sink_tokens, evict.kv_window)
                               if evict.kv_eviction == "streaming" else None)

    def streams(self, kv_eviction: str | None) -> bool:
        """A request asking for ``kv_eviction`` (None: the engine's default) streams."""
        return kv_eviction == "streaming" or (kv_eviction is None and self.default_window is not None)

    def streaming_blocks(self, window: StreamingWindow) -> int:
        """Pool blocks one request streaming with ``window`` holds at most (with a prefill chunk
        of max_num_batched_tokens in flight): its sinks and window in the full-attention group,
        each sliding group's window, a tail run per group."""
        size, chunk = self.config.cache_config.block_size, self.config.scheduler_config.max_num_batched_tokens
        sliding = sum(spec.blocks_held(1 << 30, size, chunk) for spec in self.groups if spec.sliding_window)
        return window.blocks_held(size, chunk) + sliding + self.tail_blocks * len(self.groups)

    def _refuse(self, kind: str) -> None:
        why = self.streaming_refusal if kind == "streaming" else self.refusal
        if why is not None:
            raise InvalidRequestError(f"kv_eviction={kind} is not available here: {why}", param="kv_eviction")

    def request_window(self, params: SamplingParams, pool_blocks: int) -> StreamingWindow | None:
        """The request's streaming window: its own kv_eviction settings within the engine's (a
        window at most kv_window), else the engine's default."""
        evict = self.config.eviction_config
        if params.kv_eviction is None and params.kv_window is None and params.kv_sink_tokens is None:
            return self.default_window
        if not self.streams(params.kv_eviction):
            if params.kv_window is None and params.kv_sink_tokens is None:  # none or snapkv
                return None
            raise InvalidRequestError("kv_window and kv_sink_tokens need kv_eviction=streaming (this server "
                                      "does not stream by default)", param="kv_eviction")
        self._refuse("streaming")
        window = StreamingWindow(evict.kv_sink_tokens if params.kv_sink_tokens is None else params.kv_sink_tokens,
                                 evict.kv_window if params.kv_window is None else params.kv_window)
        for name, value in (("kv_window", window.window), ("kv_sink_tokens", window.sink_tokens)):
            if value > evict.kv_window:
                raise InvalidRequestError(f"{name}={value} is more than this server's kv_window={evict.kv_window}",
                                          param=name)
        if window.window < self.narrowest_window:
            raise InvalidRequestError(f"kv_window={window.window} is shorter than the model's sliding window of "
                                      f"{self.narrowest_window} tokens", param="kv_window")
        held = self.streaming_blocks(window)
        if held > pool_blocks:
            raise InvalidRequestError(f"a streaming request needs {held} KV blocks, more than the pool's "
                                      f"{pool_blocks}")
        return window

    def request_compression(self, params: SamplingParams) -> float | None:
        """The fraction of the request's prompt SnapKV keeps after its prefill (None: it keeps
        all): its own kv_compression_ratio, at least the engine's (the most it lets a request
        drop), else the engine's when kv_eviction=snapkv."""
        evict = self.config.eviction_config
        if params.kv_eviction is None and params.kv_compression_ratio is None:
            return evict.kv_compression_ratio if evict.kv_eviction == "snapkv" else None
        wanted = params.kv_eviction or evict.kv_eviction
        if wanted != "snapkv":
            if params.kv_compression_ratio is None:
                return None
            raise InvalidRequestError(f"kv_compression_ratio needs kv_eviction=snapkv (this request's is "
                                      f"{wanted})", param="kv_compression_ratio")
        self._refuse("snapkv")
        ratio = evict.kv_compression_ratio if params.kv_compression_ratio is None else params.kv_compression_ratio
        if ratio < evict.kv_compression_ratio:
            raise InvalidRequestError(f"kv_compression_ratio={ratio} keeps less of the prompt than this server's "
                                      f"kv_compression_ratio={evict.kv_compression_ratio} allows",
                                      param="kv_compression_ratio")
        return ratio
