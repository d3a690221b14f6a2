"""A KV store shared by replicas: prefix blocks in a Redis (or Valkey) server, sealed as the disk
tier seals them (block_store), under the same namespace and chained content keys. Replicas of
one model and KV format on any node that reach the server find each other's blocks (a block is
written once the step that computes it is done, and again when the pool evicts it unless the
server still has it); a block of
another model or format is never read (its namespace differs), and a damaged one is a miss.

A store that is down or slow never stops the engine: every call has a short timeout, a failure
is counted (``errors``), logged once per outage, and for ``retry_after_s`` the store is treated
as empty (misses, writes dropped) before it is tried again; requests recompute what they would
have loaded. Writes go through a background thread (the step never waits for the network), with
a TTL so that blocks of a model nobody serves any more expire; the server's own memory limit and
eviction policy (Redis's ``maxmemory``, ``allkeys-lru``) bound its size.

Keys: ``kvserve:<namespace hex>:<content key hex>``; values: the sealed block (header + payload).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from typing import Any

import torch

from kvserve.cache.block_store import BackgroundWriter, Block, WritesInBackground, payload_tensor, seal, unseal
from kvserve.cache.kv_tiers import TierStats
from kvserve.config import ConfigError

logger = logging.getLogger("kvserve")

KNOWN_KEYS = 1 << 16  # keys remembered as stored, so that they are not written again
READ_BATCH = 16  # blocks per MGET (~6 MB of bf16 SmolLM2 KV): bounds a reply's size


class RemoteTier(WritesInBackground):
    """Invariants: ``load_many`` returns a block only if the server holds it sealed under this
    namespace and key with its digest intact; no call raises because the server failed; while ``_down_until``
    is in the future the server is not contacted."""

    name = "remote"
    shared = True

    def __init__(self, url: str, namespace_digest: str, block_bytes: int, ttl_s: int, timeout_s: float = 0.5,
                 retry_after_s: float = 5.0) -> None:
        try:
            import redis
        except ImportError:
            raise ConfigError("kv_offload_remote needs the Redis client: pip install 'kvserve[remote]'") from None
        self.url, self.block_bytes, self.ttl_s = url, block_bytes, ttl_s
        self.namespace = bytes.fromhex(namespace_digest)
        self.prefix = f"kvserve:{namespace_digest}:".encode()
        self.retry_after_s = retry_after_s
        self._client: Any = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._errors_seen: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        self._lock = threading.Lock()  # owns the counters and _down_until
        self._down_until = 0.0
        self.hits = self.blocks_in = self.blocks_out = self.errors = 0
        self.load_seconds: deque[float] = deque(maxlen=4096)
        # keys this engine read from the server or wrote to it, with when: writing them again
        # (a block read from the store and later evicted from the pool) would only cost time
        self._known: OrderedDict[bytes, float] = OrderedDict()
        self._writer = BackgroundWriter(self._write_blocks, "kvserve-remote-tier")

    def _name(self, key: bytes) -> bytes:
        return self.prefix + key.hex().encode()

    def _up(self) -> bool:
        with self._lock:
            return time.monotonic() >= self._down_until

    def _failed(self, exc: BaseException, doing: str) -> None:
        """Count a failure; the first of an outage is logged, and the store rests for a while."""
        with self._lock:
            self.errors += 1
            was_up = time.monotonic() >= self._down_until
            self._down_until = time.monotonic() + self.retry_after_s
            self._known.clear()  # a server that came back may have lost what it held
        if was_up:
            logger.warning("KV remote tier %s failed while %s (%s); blocks are recomputed, retrying in %.0f s",
                           self.url, doing, exc, self.retry_after_s)

    # ------------------------------------------------------------------ reads (the loader thread)

    def _checked(self, key: bytes, data: bytes | None) -> torch.Tensor | None:
        """The block ``data`` holds, if it is there and sealed under this namespace and key."""
        if data is None:
            return None
        payload = unseal(self.namespace, key, self.block_bytes, data)
        if payload is None:
            with self._lock:
                self.errors += 1
            logger.warning("KV remote tier: block %s… is damaged or not this model's; recomputing it", key.hex()[:12])
            return None
        with self._lock:
            self.hits += 1
            self.blocks_out += 1
        self._remember(key)
        return payload_tensor(payload)

    def load_many(self, keys: list[bytes]) -> dict[bytes, torch.Tensor]:
        """The blocks found among ``keys``, in one round trip (MGET) per READ_BATCH blocks, each
        checked as it arrives (its checksum runs at memory speed); a block that is missing,
        damaged or of another namespace is left out (damaged ones counted in ``errors``), and
        nothing is read while the server rests after a failure."""
        began = time.perf_counter()
        found: dict[bytes, torch.Tensor] = {}
        for start in range(0, len(keys), READ_BATCH):
            if not self._up():
                break
            batch = keys[start : start + READ_BATCH]
            try:
                values = self._client.mget([self._name(key) for key in batch])
            except self._errors_seen as exc:
                self._failed(exc, "reading blocks")
                break
            for key, data in zip(batch, values, strict=True):
                payload = self._checked(key, data)
                if payload is not None:
                    found[key] = payload
        if found:  # the round trips and the checks, shared by the blocks found
            self.load_seconds.extend([(time.perf_counter() - began) / len(found)] * len(found))
        return found

    # ------------------------------------------------------------------ writes (background)

    def _remember(self, key: bytes) -> None:
        with self._lock:
            self._known[key] = time.monotonic()
            self._known.move_to_end(key)
            while len(self._known) > KNOWN_KEYS:
                self._known.popitem(last=False)

    def _recently_stored(self, key: bytes) -> bool:
        """Read or written within half the TTL: the server still has it (unless its memory limit
        evicted it: then a replica recomputes, which is what a miss costs anyway)."""
        with self._lock:
            when = self._known.get(key)
        return when is not None and time.monotonic() - when < self.ttl_s / 2

    def put(self, key: bytes, tensors: list[torch.Tensor]) -> None:
        """Queue a block (its per-block tensors, on the host) for the server, unless it is there
        or queued already (a failed write forgets every key: ``_failed``)."""
        if self.wants(key) and self._writer.submit(key, tensors):
            self._remember(key)

    def wants(self, key: bytes) -> bool:
        return self._up() and not self._recently_stored(key)

    def _write_blocks(self, blocks: list[Block]) -> None:
        """One pipelined round trip for the batch (a round trip per block cost as much again)."""
        if not self._up():
            return
        pipe = self._client.pipeline(transaction=False)
        for key, tensors in blocks:
            pipe.set(self._name(key), seal(self.namespace, key, tensors), ex=self.ttl_s)
        try:
            pipe.execute()
        except self._errors_seen as exc:
            self._failed(exc, "writing blocks")
            return
        with self._lock:
            self.blocks_in += len(blocks)

    def stats(self) -> TierStats:
        """Blocks read and written by this engine (the server's own size is its business)."""
        with self._lock:
            errors = self.errors + self._writer.dropped
        return TierStats(self.name, 0, 0, 0, self.hits, self.blocks_in, self.blocks_out, 0, 0, errors)
