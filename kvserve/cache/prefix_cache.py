"""The prefix cache: full blocks published under a chained content key as soon as their tokens
are scheduled, and a new request's longest cached prefix, found in the pool or a lower tier.
The blocks themselves stay in the BlockPool (cached blocks no request holds wait in its free
queue, evicted least recently freed first); this module keys, finds and publishes them."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable
from typing import NamedTuple

from kvserve.cache.block_pool import BlockPool, KVCacheBlock
from kvserve.cache.kv_offload import OffloadManager
from kvserve.cache.kv_stats import PrefixCacheStats
from kvserve.cache.request_kv import RequestKV

TokenReader = Callable[[int, int], list[int]]  # (start, end) -> the request's token ids in [start, end)
CachedBlock = KVCacheBlock | bytes  # a prefix hit: a pool block, or the key of a block in a lower tier


def hash_block(parent: bytes | None, tokens: list[int]) -> bytes:
    """A block's content key: SHA-256 over its parent's key and its own token ids, so equal keys
    mean equal whole prefixes (collision-resistant, no token comparison needed)."""
    digest = hashlib.sha256(parent or b"")
    digest.update(array("q", tokens).tobytes())
    return digest.digest()


def prompt_block_hashes(token_ids: list[int], block_size: int) -> list[bytes]:
    """The chained keys of a prompt's full blocks, as the prefix cache keys them."""
    keys: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        keys.append(hash_block(keys[-1] if keys else None, token_ids[start : start + block_size]))
    return keys


def group_key(block_hash: bytes, group: int) -> bytes:
    """The prefix-cache key of a block of KV cache group ``group`` (kv_groups): group 0 uses the
    token key itself; other groups' blocks hold other layers, so they get keys of their own."""
    return block_hash if group == 0 else hashlib.sha256(block_hash + group.to_bytes(2, "little")).digest()


class CachedPrefix(NamedTuple):
    """A prefix hit: the first ``num_blocks`` blocks of the request, per group. An entry is a
    pool block, the key of a block in a lower tier (promoted by allocate_slots), or None: a block
    out of a sliding window, which the request never reads (its table holds the null block)."""

    num_blocks: int
    blocks: list[list[CachedBlock | None]]
    reading: bool = False  # some of its blocks are being read from a lower store: look again later


class PrefixCache:
    """Invariants: a published block is full and never written again; a key maps to one block
    (an equal block published later stays private); tiers stay exclusive (publishing a key drops
    a lower tier's copy)."""

    def __init__(self, pool: BlockPool, offload: OffloadManager, block_size: int, num_groups: int,
                 enabled: bool) -> None:
        self.pool, self.offload = pool, offload
        self.block_size, self.num_groups = block_size, num_groups
        self.enabled = enabled
        self.queries = 0  # prompt tokens of admitted requests
        self.hits = 0  # of which served from the cache

    def hashes(self, record: RequestKV, tokens: TokenReader, num_blocks: int) -> list[bytes]:
        """Keys of the request's first ``num_blocks`` full blocks (computed once, then kept)."""
        hashes, size = record.block_hashes, self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            hashes.append(hash_block(hashes[-1] if hashes else None, tokens(i * size, (i + 1) * size)))
        return hashes

    def lookup(self, key: bytes) -> CachedBlock | None:
        block = self.pool.cached_block(key)
        if block is not None:
            return block
        return key if self.offload.holds(key) else None

    def find(self, record: RequestKV, num_tokens: int, tokens: TokenReader) -> CachedPrefix:
        """The longest cached prefix of the request's first tokens that every group's policy can
        start from (RetentionPolicy.longest_hit: a full-attention group needs all its blocks, a
        sliding-window one only the blocks the next query's window reaches: vLLM's hybrid
        rule). The last token is always left to compute (its logits are needed), so only blocks
        inside the first num_tokens - 1 tokens count. Takes no references and counts nothing
        (record_lookup): a request the pool cannot admit yet looks again. While blocks it may
        start from are being read from a lower store, the answer is ``reading`` (no blocks)."""
        if not self.enabled or not record.shares:
            return CachedPrefix(0, [[] for _ in range(self.num_groups)])
        length = (num_tokens - 1) // self.block_size
        hashes = self.hashes(record, tokens, length)
        if self.offload.stores and not self.offload.prefetch(  # every block the pool lacks, at once
                [key for i in range(length) for group in range(self.num_groups)
                 if self.pool.cached_block(key := group_key(hashes[i], group)) is None]):
            return CachedPrefix(0, [[] for _ in range(self.num_groups)], reading=True)
        found: list[dict[int, CachedBlock | None]] = [{} for _ in range(self.num_groups)]

        def hit(group: int, index: int) -> CachedBlock | None:
            if index not in found[group]:
                found[group][index] = self.lookup(group_key(hashes[index], group))
            return found[group][index]

        def cached_in(group: int) -> Callable[[int], bool]:
            return lambda index: hit(group, index) is not None

        while True:  # the longest length every group can start from
            shortest = min(policy.longest_hit(length, self.block_size, cached_in(group))
                           for group, policy in enumerate(record.policies))
            if shortest == length:
                break
            length = shortest
        blocks: list[list[CachedBlock | None]] = []
        for group, policy in enumerate(record.policies):
            first = policy.first_live_block(length * self.block_size, self.block_size)
            blocks.append([None] * first + [hit(group, i) for i in range(first, length)])
        return CachedPrefix(length, blocks)

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count an admitted request's lookup: its tokens and how many came from the cache."""
        if self.enabled:
            self.queries += num_tokens
            self.hits += num_hit_tokens

    def publish(self, record: RequestKV, num_tokens: int, tokens: TokenReader) -> None:
        """Offer the blocks that ``num_tokens`` fill to the cache. They are computed in this step,
        before any later step can hit them; a request admitted in this same step that hits one
        reads it after this step's layers wrote it (each layer writes K/V before it attends)."""
        full = num_tokens // self.block_size
        if full > record.num_published:
            self.hashes(record, tokens, full)
            self.publish_up_to(record, full)

    def publish_up_to(self, record: RequestKV, full: int) -> None:
        """Publish every group's blocks up to ``full`` (their keys already computed)."""
        assert record.tables is not None
        start, hashes = record.num_published, record.block_hashes
        for group, (table, released) in enumerate(zip(record.tables, record.num_released, strict=True)):
            for index in range(max(start, released), full):
                self.cache(table[index], group_key(hashes[index], group))
        record.num_published = max(start, full)

    def cache(self, block: KVCacheBlock, block_hash: bytes, computed: bool = True) -> None:
        """Publish a full block under its key (unless an equal block is); tiers stay exclusive,
        so a lower tier's copy of it is dropped; a store shared with other engines gets it once
        the step has ``computed`` it (a block copied back from a tier was shared when computed)."""
        fresh = block.block_hash is None and block_hash not in self.pool.cached_blocks
        self.pool.cache_block(block, block_hash)
        if block.block_hash == block_hash:
            self.offload.discard(block_hash)
        if fresh and computed:
            self.offload.published(block.block_id, block_hash)

    def stats(self) -> PrefixCacheStats:
        cached = self.pool.cached_blocks.values()
        return PrefixCacheStats(
            enabled=self.enabled, queries=self.queries, hits=self.hits, cached_blocks=len(cached),
            evictable_blocks=sum(1 for b in cached if b.ref_cnt == 0), evictions=self.pool.num_evictions)
