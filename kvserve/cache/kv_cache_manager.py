"""Per-request block tables on top of the BlockPool: the only door to the pool. With prefix
caching on, also the prefix cache: full blocks are published under a chained content key as
soon as their tokens are scheduled, and a new request starts from the longest chain of
published blocks that matches its tokens."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable
from typing import NamedTuple

import torch

from kvserve.cache.block_pool import BlockPool, KVCacheBlock
from kvserve.cache.kv_disk import DiskTier
from kvserve.cache.kv_stats import KVCacheStats, PrefixCacheStats
from kvserve.cache.kv_tiers import TierIndex, TierMoves

TokenReader = Callable[[int, int], list[int]]  # (start, end) -> the request's token ids in [start, end)
CachedBlock = KVCacheBlock | bytes  # a prefix hit: a pool block, or the key of a block in tier 1


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def hash_block(parent: bytes | None, tokens: list[int]) -> bytes:
    """A block's content key: SHA-256 over its parent's key and its own token ids, so equal keys
    mean equal whole prefixes (collision-resistant, no token comparison needed)."""
    digest = hashlib.sha256(parent or b"")
    digest.update(array("q", tokens).tobytes())
    return digest.digest()


class SwappedBlocks(NamedTuple):
    """A swapped-out request: the tier-1 slots holding its table's blocks, then its tail run's."""

    slots: list[int]
    num_blocks: int  # table blocks (the rest of ``slots`` is the tail run)
    num_tokens: int
    num_published: int


class KVCacheManager:
    """Maps each request to a block table and grows it on demand.

    Invariants: a request's table covers exactly cdiv(num_tokens, block_size) blocks;
    free() returns every block of the request at once. A block is in two tables only as a
    shared, published prefix block: full, and never written again (a request writes only at
    positions at or past its num_computed_tokens, which lie after its cache hits).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 tail_blocks: int = 0, host_tier: TierIndex | None = None, disk_tier: DiskTier | None = None,
                 disk_block_like: list[torch.Tensor] | None = None) -> None:
        """``tail_blocks``: for pools that keep a full-precision tail block per running sequence
        (kv_format.tail_blocks), the aligned run of pool blocks that holds one; every request
        holding blocks then holds one run, taken with its first blocks and freed with them."""
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.block_tables: dict[str, list[KVCacheBlock]] = {}
        self.num_tokens: dict[str, int] = {}
        self.block_hashes: dict[str, list[bytes]] = {}  # keys of a request's full blocks so far
        self.num_published: dict[str, int] = {}  # leading blocks of its table already offered to the cache
        self.tail_blocks = tail_blocks
        self.host_tier = host_tier  # tier 1 (kv_tiers): evicted prefix blocks, swapped-out requests
        self.disk_tier = disk_tier if host_tier is not None else None  # tier 2 (kv_disk): what tier 1 drops
        self._disk_like = disk_block_like or []  # the pool's per-block tensors: how a block read back looks
        self._disk_loaded: dict[bytes, list[torch.Tensor]] = {}  # verified tier-2 blocks, until promoted
        if host_tier is not None and enable_prefix_caching:
            self.pool.on_evict = host_tier.demote
        self.tails: dict[str, list[KVCacheBlock]] = {}
        self.new_tail_slots: list[int] = []  # handed out since the runner last zeroed them
        self.swapped: dict[str, SwappedBlocks] = {}  # requests whose blocks wait in tier 1
        self.num_swaps_out = self.num_swaps_in = self.num_swap_fallbacks = 0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self._logical_tokens = 0
        self._peak_blocks = 0
        self._peak_live = 0
        self._peak_requests = 0
        self._util_at_peak = 1.0
        self._util_sum = 0.0
        self._util_samples = 0

    @property
    def capacity_tokens(self) -> int:
        """Tokens one sequence can hold in an otherwise empty pool (its tail run included)."""
        if self.tail_blocks and self.pool.num_blocks < 2 * self.tail_blocks:
            return 0  # no aligned run besides the null block's
        return (self.pool.num_usable_blocks - self.tail_blocks) * self.block_size

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        return num_tokens <= self.capacity_tokens

    def _hashes(self, request_id: str, tokens: TokenReader, num_blocks: int) -> list[bytes]:
        """Keys of the request's first ``num_blocks`` full blocks (computed once, then kept)."""
        hashes = self.block_hashes.setdefault(request_id, [])
        size = self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            hashes.append(hash_block(hashes[-1] if hashes else None, tokens(i * size, (i + 1) * size)))
        return hashes

    def find_cached_prefix(self, request_id: str, num_tokens: int, tokens: TokenReader) -> list[CachedBlock]:
        """The longest run of cached blocks matching the request's first tokens: pool blocks, or
        keys of blocks in tier 1 (promoted by allocate_slots). The last token is always left to
        compute (its logits are needed), so only blocks inside the first num_tokens - 1 tokens
        count. Takes no references (see allocate_slots) and counts nothing (see
        record_prefix_lookup): a request the pool cannot admit yet looks again."""
        if not self.enable_prefix_caching:
            return []
        hits: list[CachedBlock] = []
        num_blocks = (num_tokens - 1) // self.block_size
        for block_hash in self._hashes(request_id, tokens, num_blocks)[:num_blocks]:
            block = self.pool.cached_block(block_hash)
            if block is not None:
                hits.append(block)
            elif self._in_lower_tier(block_hash):
                hits.append(block_hash)
            else:
                break
        return hits

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count an admitted request's lookup: its tokens and how many came from the cache."""
        if self.enable_prefix_caching:
            self.prefix_queries += num_tokens
            self.prefix_hits += num_hit_tokens

    def allocate_slots(self, request_id: str, num_tokens: int, tokens: TokenReader | None = None,
                       cached: list[CachedBlock] | None = None) -> bool:
        """Make room for the request's first ``num_tokens`` tokens, starting a new request's table
        with ``cached`` (from find_cached_prefix; tier-1 hits get fresh blocks, copied back
        before the step runs). False if the pool is short (nothing is allocated then). With
        caching on, ``tokens`` reads the request's token ids, and every block that these tokens
        fill is published."""
        pool_hits = [block for block in cached or [] if isinstance(block, KVCacheBlock)]
        table = self.block_tables.get(request_id)
        if table is None:
            table = pool_hits
        elif cached:
            raise ValueError(f"request {request_id!r} already has blocks; cached blocks start a table")
        new = request_id not in self.block_tables
        missing = self.blocks_needed(num_tokens) - len(table)
        reviving = sum(1 for block in pool_hits if block.ref_cnt == 0)  # leave the free queue
        tail_cost = self.tail_blocks if new else 0
        if missing + tail_cost > self.pool.num_free_blocks - reviving:
            return False
        if new:
            # tier-1 hits leave the tier first, so that no claim below can demote them out of it;
            # tier-2 hits were read and verified by the lookup (slot -1: loaded from disk)
            tier_slots = {key: self.host_tier.take(key) if key in self.host_tier else -1
                          for key in cached or [] if isinstance(key, bytes)} if self.host_tier is not None else {}
            if tail_cost:
                tail = self.pool.get_aligned_run(tail_cost, {block.block_id for block in table})
                if tail is None:
                    for key, slot in tier_slots.items():
                        if slot >= 0:
                            self.host_tier.give_back(key, slot)  # type: ignore[union-attr]
                    return False
                self.tails[request_id] = tail
                self.new_tail_slots.append(tail[0].block_id // tail_cost)
            self.pool.touch(table)
            if tier_slots:
                table = self._promote(cached or [], tier_slots)
                missing = self.blocks_needed(num_tokens) - len(table)
            self.block_tables[request_id] = table
            self.num_published[request_id] = len(table)
        if missing > 0:
            table.extend(self.pool.get_new_blocks(missing))
        previous = self.num_tokens.get(request_id, 0)
        if num_tokens > previous:
            self.num_tokens[request_id] = num_tokens
            self._logical_tokens += num_tokens - previous
        if self.enable_prefix_caching and tokens is not None:
            self._publish(request_id, num_tokens, tokens)
        return True

    def swap_out(self, request_id: str) -> bool:
        """Preemption by swapping: copy the request's blocks (and its tail run) to reserved tier-1
        slots and free them. False if tier 1 cannot take them (the caller recomputes instead;
        counted in num_swap_fallbacks); nothing changes then."""
        table = self.block_tables[request_id]
        tail = self.tails.get(request_id, [])
        slots = self.host_tier.reserve(len(table) + len(tail)) if self.host_tier is not None else None
        if slots is None:
            self.num_swap_fallbacks += 1
            return False
        assert self.host_tier is not None
        for block, slot in zip(table + tail, slots, strict=True):
            self.host_tier.save(block.block_id, slot)
        self.swapped[request_id] = SwappedBlocks(slots, len(table), self.num_tokens[request_id],
                                                 self.num_published[request_id])
        self._release_blocks(request_id)
        self.num_swaps_out += 1
        return True

    def swap_in(self, request_id: str, headroom: int = 0) -> bool:
        """Bring a swapped-out request's blocks back into fresh pool blocks (copied before the
        step's forward pass), leaving ``headroom`` blocks free. False if the pool is short
        (nothing changes then)."""
        state = self.swapped[request_id]
        tail_cost = self.tail_blocks
        if state.num_blocks + tail_cost + headroom > self.pool.num_free_blocks:
            return False
        tail: list[KVCacheBlock] = []
        if tail_cost:
            run = self.pool.get_aligned_run(tail_cost, set())
            if run is None:
                return False
            tail = self.tails[request_id] = run
        table = self.pool.get_new_blocks(state.num_blocks)
        assert self.host_tier is not None
        self.host_tier.restore(state.slots, [block.block_id for block in table + tail])
        del self.swapped[request_id]
        self.block_tables[request_id] = table
        self.num_tokens[request_id] = state.num_tokens
        self._logical_tokens += state.num_tokens
        # its full blocks were published before: these copies are published again where no equal
        # block is cached
        for block, block_hash in zip(table, self.block_hashes.get(request_id, [])[: state.num_published],
                                     strict=False):
            self._cache(block, block_hash)
        self.num_published[request_id] = state.num_published
        self.num_swaps_in += 1
        return True

    def _promote(self, cached: list[CachedBlock], slots: dict[bytes, int]) -> list[KVCacheBlock]:
        """A new table from a prefix hit that reaches into tier 1: each tier hit (taken out of the
        tier into ``slots``) gets a fresh block (its pool hits are already referenced), published
        at once under its key; its bytes are copied back before the step's forward pass."""
        tier = self.host_tier
        assert tier is not None
        fresh = iter(self.pool.get_new_blocks(len(slots)))  # may demote other blocks into the tier
        table = []
        for hit in cached:
            if isinstance(hit, KVCacheBlock):
                table.append(hit)
                continue
            block = next(fresh)
            if slots[hit] >= 0:
                tier.promote(slots[hit], block.block_id)
            else:
                tier.load(block.block_id, self._disk_loaded.pop(hit))
            self._cache(block, hit)
            table.append(block)
        return table

    def _in_lower_tier(self, key: bytes) -> bool:
        """In tier 1, or in tier 2 with its file read and verified (a bad file is a miss)."""
        if self.host_tier is not None and key in self.host_tier:
            return True
        if self.disk_tier is None or key not in self.disk_tier:
            return False
        if key not in self._disk_loaded:
            tensors = self.disk_tier.load(key, self._disk_like)
            if tensors is None:
                return False
            self._disk_loaded[key] = tensors
        return True

    def take_tier_moves(self) -> TierMoves | None:
        """This step's copies between the pool and the tiers (run before the forward pass)."""
        self._disk_loaded.clear()  # a waiting request reads its tier-2 hits again next step
        return self.host_tier.take_moves() if self.host_tier is not None else None

    def _publish(self, request_id: str, num_tokens: int, tokens: TokenReader) -> None:
        """Offer the blocks that ``num_tokens`` fill to the cache. They are computed in this step,
        before any later step can hit them; a request admitted in this same step that hits one
        reads it after this step's layers wrote it (each layer writes K/V before it attends)."""
        table, start = self.block_tables[request_id], self.num_published[request_id]
        full = num_tokens // self.block_size
        if full <= start:
            return
        hashes = self._hashes(request_id, tokens, full)
        for block, block_hash in zip(table[start:full], hashes[start:full], strict=True):
            self._cache(block, block_hash)
        self.num_published[request_id] = full

    def _cache(self, block: KVCacheBlock, block_hash: bytes) -> None:
        """Publish a full block under its key (unless an equal block is); tiers stay exclusive,
        so a copy of it in tier 1 is dropped."""
        self.pool.cache_block(block, block_hash)
        if self.host_tier is not None and block.block_hash == block_hash:
            self.host_tier.discard(block_hash)

    def free(self, request_id: str) -> None:
        """Return all of a request's blocks to the pool (finished, aborted or preempted), or its
        swapped-out blocks' tier slots. Its published blocks stay cached until evicted."""
        state = self.swapped.pop(request_id, None)
        if state is not None and self.host_tier is not None:
            self.host_tier.release(state.slots)
        self._release_blocks(request_id)

    def _release_blocks(self, request_id: str) -> None:
        table = self.block_tables.pop(request_id, [])
        self._logical_tokens -= self.num_tokens.pop(request_id, 0)
        self.num_published.pop(request_id, None)
        self.pool.free_blocks(table[::-1])
        self.pool.free_blocks(self.tails.pop(request_id, []))

    def forget(self, request_id: str) -> None:
        """Drop a finished request's remembered block keys."""
        self.block_hashes.pop(request_id, None)

    def prefix_cache_stats(self) -> PrefixCacheStats:
        cached = self.pool.cached_blocks.values()
        return PrefixCacheStats(
            enabled=self.enable_prefix_caching, queries=self.prefix_queries, hits=self.prefix_hits,
            cached_blocks=len(cached), evictable_blocks=sum(1 for b in cached if b.ref_cnt == 0),
            evictions=self.pool.num_evictions)

    def tail_slot(self, request_id: str) -> int:
        """Index of the request's tail run in the pool viewed as runs of tail_blocks blocks."""
        return self.tails[request_id][0].block_id // self.tail_blocks

    def take_new_tail_slots(self) -> list[int]:
        """Tail slots handed out since the last call (their blocks may hold old codes: zero them)."""
        slots, self.new_tail_slots = self.new_tail_slots, []
        return slots

    @property
    def table_blocks_used(self) -> int:
        """Blocks held by block tables (tail runs excluded)."""
        return self.pool.num_used_blocks - len(self.tails) * self.tail_blocks

    def block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.block_tables[request_id]]

    def slot_mapping(self, request_id: str, start: int, end: int) -> list[int]:
        """Flat cache slot of each token position in [start, end)."""
        table, size = self.block_tables[request_id], self.block_size
        return [table[pos // size].block_id * size + pos % size for pos in range(start, end)]

    @property
    def physical_tokens(self) -> int:
        """Slots holding a token, each block once: a shared block is full and counted by every
        holder in the logical sum, so its extra references come off."""
        return self._logical_tokens - self.block_size * self.pool.num_shared_refs

    def record_step(self) -> None:
        """Update peak and mean figures; called once per engine step."""
        used = self.pool.num_used_blocks
        allocated = self.table_blocks_used * self.block_size
        live = self.physical_tokens
        util = live / allocated if allocated else 1.0
        if used:
            self._util_sum += util
            self._util_samples += 1
        if used > self._peak_blocks:
            self._peak_blocks, self._util_at_peak = used, util
        self._peak_live = max(self._peak_live, live)
        self._peak_requests = max(self._peak_requests, len(self.block_tables))

    def stats(self) -> KVCacheStats:
        used = self.pool.num_used_blocks
        return KVCacheStats(
            block_size=self.block_size,
            num_blocks=self.pool.num_usable_blocks,
            blocks_used=used,
            blocks_free=self.pool.num_free_blocks,
            blocks_cached=self.pool.num_cached_blocks,
            live_tokens=self.physical_tokens,
            allocated_slots=self.table_blocks_used * self.block_size,
            num_requests=len(self.block_tables),
            logical_tokens=self._logical_tokens,
            peak_blocks_used=self._peak_blocks,
            peak_live_tokens=self._peak_live,
            peak_num_requests=self._peak_requests,
            utilization_at_peak=self._util_at_peak,
            mean_utilization=self._util_sum / self._util_samples if self._util_samples else 1.0,
            per_request_blocks={rid: len(t) for rid, t in self.block_tables.items()},
            prefix_cache=self.prefix_cache_stats(),
            tail_slots_used=len(self.tails),
            tail_blocks_used=len(self.tails) * self.tail_blocks,
            tiers=[tier.stats() for tier in (self.host_tier, self.disk_tier) if tier is not None],
            swaps_out=self.num_swaps_out, swaps_in=self.num_swaps_in, swap_fallbacks=self.num_swap_fallbacks,
            num_swapped=len(self.swapped),
        )
