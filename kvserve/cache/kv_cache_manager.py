"""Per-request block tables on top of the BlockPool: the only door to the pool. With prefix
caching on, also the prefix cache: full blocks are published under a chained content key as
soon as their tokens are scheduled, and a new request starts from the longest chain of
published blocks that matches its tokens."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from kvserve.cache.block_pool import BlockPool, KVCacheBlock
from kvserve.cache.kv_disk import DiskTier
from kvserve.cache.kv_groups import FULL_ATTENTION, KVCacheSpec, capacity_tokens, cdiv
from kvserve.cache.kv_stats import KVCacheStats, KVGroupStats, PrefixCacheStats
from kvserve.cache.kv_tiers import TierIndex, TierMoves

TokenReader = Callable[[int, int], list[int]]  # (start, end) -> the request's token ids in [start, end)
CachedBlock = KVCacheBlock | bytes  # a prefix hit: a pool block, or the key of a block in tier 1


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


class SwappedBlocks(NamedTuple):
    """A swapped-out request: the tier-1 slots holding each group's live blocks in turn, then
    each group's tail run."""

    slots: list[int]
    num_live: list[int]  # per group: blocks saved (its table's entries past the released ones)
    num_released: list[int]  # per group: leading table entries out of the window (the null block)
    num_tokens: int
    num_published: int


class StreamingWindow(NamedTuple):
    """StreamingLLM's cache (Xiao et al. 2023): the blocks of the first ``sink_tokens`` tokens
    (the attention sinks) and those of the last ``window`` tokens; the blocks between are
    evicted as the sequence grows (KVCacheManager.evict). A query sees the sinks and its last
    ``window`` to ``window + block_size - 1`` tokens (a prefill chunk's later queries up to a
    chunk more), plus the ``spare_slots`` tokens before those: the last sink block's slots past
    the sinks hold the tokens just before the window, not the prompt's first tokens."""

    sink_tokens: int
    window: int

    def sink_blocks(self, block_size: int) -> int:
        return cdiv(self.sink_tokens, block_size)

    def spare_slots(self, block_size: int) -> int:
        """Slots of the last sink block past the sinks."""
        return self.sink_blocks(block_size) * block_size - self.sink_tokens

    def blocks_held(self, block_size: int, chunk: int = 1) -> int:
        """A sequence's most blocks, however long it grows: the sinks, the window's, a chunk's."""
        return self.sink_blocks(block_size) + cdiv(self.window - 1 + chunk - 1, block_size) + 1


class Eviction(NamedTuple):
    """What one eviction did to a request: its tokens past the sinks now sit ``shift`` cache
    positions before their absolute positions. Queries keep absolute rotary positions, and so do
    the window's keys, so their distances are right as they are (RoPE sees only q - k); the sink
    blocks' keys must be turned to sit ``shift`` positions later (StreamingLLM's positions within
    the cache)."""

    sink_block_ids: list[int]
    shift: int
    first: bool  # the request's first eviction: its sinks still hold their keys as written
    # the last block evicted, freed but not yet reused: its slots past the sinks hold the tokens
    # just before the window, at positions that fit the last sink block's spare slots (None: no
    # spare slots)
    donor_block_id: int | None = None
    spare_from: int = 0  # the last sink block's first spare slot


class KVCacheManager:
    """Maps each request to one block table per KV cache group (kv_groups) and grows them on demand.

    Invariants: each of a request's tables covers exactly cdiv(num_tokens, block_size) entries
    (num_tokens counts cache positions: absolute ones less ``evicted``, with streaming eviction);
    a sliding-window group's leading entries that fell wholly out of its window are the null
    block (``num_released``) and every other entry is a block the request holds; free() returns
    every block of the request at once. A block is in two tables only as a shared, published
    prefix block: full, and never written again (a request writes only at positions at or past
    its num_computed_tokens, which lie after its cache hits).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 tail_blocks: int = 0, host_tier: TierIndex | None = None, disk_tier: DiskTier | None = None,
                 disk_block_like: list[torch.Tensor] | None = None,
                 groups: Sequence[KVCacheSpec] = (FULL_ATTENTION,), max_chunk_tokens: int = 1,
                 streaming: StreamingWindow | None = None) -> None:
        """``tail_blocks``: for pools that keep a full-precision tail block per running sequence
        (kv_format.tail_blocks), the aligned run of pool blocks that holds one; every request
        holding blocks then holds one run per group, taken with its first blocks and freed with
        them. ``max_chunk_tokens``: the longest chunk a step computes (sizes sliding groups).
        ``streaming``: the default window of every request (set_window overrides it per request);
        streaming takes one full-attention group. A streaming request neither publishes blocks
        nor starts from cached ones: its sink blocks are turned in place, so none can be shared."""
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.groups = list(groups)
        if streaming is not None:
            self._check_streamable()
        self.max_chunk_tokens = max_chunk_tokens
        self.enable_prefix_caching = enable_prefix_caching
        self.streaming = streaming
        self.windows: dict[str, StreamingWindow | None] = {}  # per-request overrides of ``streaming``
        self.private: set[str] = set()  # compacted requests: their blocks are never published
        # tokens evicted from each request's table (streaming): its table holds cache positions,
        # which are absolute positions less this past the sinks
        self.evicted: dict[str, int] = {}
        self.num_evicted_tokens = 0  # since start
        self.block_tables: dict[str, list[list[KVCacheBlock]]] = {}  # per request, per group
        self.num_released: dict[str, list[int]] = {}  # per request, per group (see the class invariants)
        self.num_tokens: dict[str, int] = {}
        self.block_hashes: dict[str, list[bytes]] = {}  # keys of a request's full blocks so far
        self.num_published: dict[str, int] = {}  # leading blocks of its tables already offered to the cache
        self.tail_blocks = tail_blocks
        self.host_tier = host_tier  # tier 1 (kv_tiers): evicted prefix blocks, swapped-out requests
        self.disk_tier = disk_tier if host_tier is not None else None  # tier 2 (kv_disk): what tier 1 drops
        self._disk_like = disk_block_like or []  # the pool's per-block tensors: how a block read back looks
        self._disk_loaded: dict[bytes, list[torch.Tensor]] = {}  # verified tier-2 blocks, until promoted
        if host_tier is not None and enable_prefix_caching:
            self.pool.on_evict = host_tier.demote
        self.tails: dict[str, list[list[KVCacheBlock]]] = {}  # per request, per group
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
        """Tokens one sequence that keeps every block can hold in an otherwise empty pool (its
        tail runs included); a streaming one holds at most StreamingWindow.blocks_held."""
        return capacity_tokens(self.groups, self.pool.num_usable_blocks, self.block_size, self.max_chunk_tokens,
                               self.tail_blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        return num_tokens <= self.capacity_tokens

    def set_window(self, request_id: str, window: StreamingWindow | None) -> None:
        """The request streams with ``window`` (None: it keeps every block) whatever the default;
        before its first allocation, until forget()."""
        if window is not None:
            self._check_streamable()
        self.windows[request_id] = window

    def _check_streamable(self) -> None:
        if len(self.groups) != 1 or self.groups[0].sliding_window:
            raise ValueError("streaming eviction takes one full-attention group")

    def _shares(self, request_id: str) -> bool:
        """The request's blocks may be published: it neither streams nor was compacted."""
        return self.window_of(request_id) is None and request_id not in self.private

    def window_of(self, request_id: str) -> StreamingWindow | None:
        return self.windows.get(request_id, self.streaming)

    @property
    def streams(self) -> bool:
        """Some request may stream."""
        return self.streaming is not None or any(w is not None for w in self.windows.values())

    def compact(self, request_id: str, keep: int) -> tuple[list[int], list[int]] | None:
        """Move the request to cdiv(keep, block_size) fresh private blocks that will hold ``keep``
        of its cached tokens (which ones, per layer and head, the caller copies: old block ids,
        new block ids); its old blocks are released (published ones stay cached). From now on
        it publishes nothing. None if the pool is short (nothing changes then). One group; its
        tail runs stay (the caller puts a partial last block in the tail slot); the cache must
        hold only computed tokens."""
        table = self.block_tables[request_id][0]
        tokens = self.num_tokens[request_id]
        if not 0 < keep <= tokens or self.blocks_needed(keep) > self.pool.num_free_blocks:
            return None
        fresh = self.pool.get_new_blocks(self.blocks_needed(keep))
        old = [block.block_id for block in table]
        self.pool.free_blocks(table[::-1])
        self.block_tables[request_id][0] = fresh
        self.num_tokens[request_id] = keep
        self._logical_tokens -= tokens - keep
        self.evicted[request_id] = self.evicted.get(request_id, 0) + tokens - keep
        self.num_evicted_tokens += tokens - keep
        self.private.add(request_id)  # its blocks hold a selection: never publish them
        return old, [block.block_id for block in fresh]

    def evicted_tokens(self, request_id: str) -> int:
        """Absolute position - cache position of the request's tokens past its sinks."""
        return self.evicted.get(request_id, 0)

    def evict(self, request_id: str, first_query: int) -> Eviction | None:
        """Streaming: free the blocks between the sinks and the window of a query at absolute
        position ``first_query`` (the request's next token; every earlier one is computed) and
        close the table up; None if nothing left."""
        window = self.window_of(request_id)
        if window is None or request_id not in self.block_tables:
            return None
        size, evicted = self.block_size, self.evicted.get(request_id, 0)
        sinks = window.sink_blocks(size)
        drop = (first_query - window.window + 1) // size - sinks - evicted // size
        if drop <= 0:
            return None
        table = self.block_tables[request_id][0]
        dead = table[sinks : sinks + drop]
        del table[sinks : sinks + drop]
        self.pool.free_blocks(dead[::-1])
        self.num_tokens[request_id] -= drop * size
        self._logical_tokens -= drop * size
        self.evicted[request_id] = evicted + drop * size
        self.num_evicted_tokens += drop * size
        spare = window.spare_slots(size)
        return Eviction([block.block_id for block in table[:sinks]], evicted + drop * size, evicted == 0,
                        dead[-1].block_id if spare else None, size - spare)

    def _hashes(self, request_id: str, tokens: TokenReader, num_blocks: int) -> list[bytes]:
        """Keys of the request's first ``num_blocks`` full blocks (computed once, then kept)."""
        hashes = self.block_hashes.setdefault(request_id, [])
        size = self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            hashes.append(hash_block(hashes[-1] if hashes else None, tokens(i * size, (i + 1) * size)))
        return hashes

    def _lookup(self, key: bytes) -> CachedBlock | None:
        block = self.pool.cached_block(key)
        if block is not None:
            return block
        return key if self._in_lower_tier(key) else None

    def find_cached_prefix(self, request_id: str, num_tokens: int, tokens: TokenReader) -> CachedPrefix:
        """The longest cached prefix of the request's first tokens that every group can start
        from: full-attention groups need all its blocks, sliding-window groups only the blocks
        the next query's window reaches (vLLM's hybrid rule). Blocks are pool blocks, or keys of
        blocks in a lower tier (promoted by allocate_slots). The last token is always left to
        compute (its logits are needed), so only blocks inside the first num_tokens - 1 tokens
        count. Takes no references (see allocate_slots) and counts nothing (see
        record_prefix_lookup): a request the pool cannot admit yet looks again."""
        groups = len(self.groups)
        if not self.enable_prefix_caching or self.window_of(request_id) is not None:
            return CachedPrefix(0, [[] for _ in range(groups)])
        hashes = self._hashes(request_id, tokens, (num_tokens - 1) // self.block_size)
        hashes = hashes[: (num_tokens - 1) // self.block_size]
        found: list[dict[int, CachedBlock | None]] = [{} for _ in range(groups)]

        def hit(group: int, index: int) -> CachedBlock | None:
            if index not in found[group]:
                found[group][index] = self._lookup(group_key(hashes[index], group))
            return found[group][index]

        length = len(hashes)
        for group, spec in enumerate(self.groups):
            if not spec.sliding_window:  # a full group caps the hit at its own unbroken prefix
                length = next((i for i in range(length) if hit(group, i) is None), length)
        while length > 0:  # the longest length every sliding group has the window's blocks for
            gaps = [i for group, spec in enumerate(self.groups) if spec.sliding_window
                    for i in range(spec.first_live_block(length * self.block_size, self.block_size), length)
                    if hit(group, i) is None]
            if not gaps:
                break
            length = max(gaps)  # nothing at or past a missing block can be the end of a hit
        blocks: list[list[CachedBlock | None]] = []
        for group, spec in enumerate(self.groups):
            first = spec.first_live_block(length * self.block_size, self.block_size)
            blocks.append([None] * first + [hit(group, i) for i in range(first, length)])
        return CachedPrefix(length, blocks)

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count an admitted request's lookup: its tokens and how many came from the cache."""
        if self.enable_prefix_caching:
            self.prefix_queries += num_tokens
            self.prefix_hits += num_hit_tokens

    def _stored_tokens(self, request_id: str) -> int:
        """Token slots the request's tables hold, over all groups (released entries excluded)."""
        if request_id not in self.block_tables:
            return 0
        return sum(self.num_tokens[request_id] - self.block_size * released
                   for released in self.num_released[request_id])

    def _live_tables(self, request_id: str) -> list[list[KVCacheBlock]]:
        """Per group, the blocks the request holds: its table past the released entries."""
        return [table[first:] for table, first in zip(self.block_tables[request_id], self.num_released[request_id],
                                                      strict=True)]

    def _release_out_of_window(self, request_id: str) -> None:
        """Sliding-window groups give back the blocks no query from now on reads (they stay in
        the prefix cache when published). The next query is at the request's num_tokens."""
        tables, released = self.block_tables[request_id], self.num_released[request_id]
        first_query = self.num_tokens[request_id]
        for group, spec in enumerate(self.groups):
            live = spec.first_live_block(first_query, self.block_size)
            if live > released[group]:
                dead = tables[group][released[group] : live]
                tables[group][released[group] : live] = [self.pool.null_block] * len(dead)
                self.pool.free_blocks(dead[::-1])
                self._logical_tokens -= self.block_size * len(dead)
                released[group] = live

    def allocate_slots(self, request_id: str, num_tokens: int, tokens: TokenReader | None = None,
                       cached: CachedPrefix | None = None, num_lookahead_tokens: int = 0) -> bool:
        """Make room for the request's first ``num_tokens`` tokens, starting a new request's tables
        with ``cached`` (from find_cached_prefix; lower-tier hits get fresh blocks, copied back
        before the step runs). False if the pool is short (nothing is allocated then). With
        caching on, ``tokens`` reads the request's token ids, and every block that these tokens
        fill is published — except the last ``num_lookahead_tokens`` (speculative drafts, which
        may still be rejected: see rollback)."""
        num_tokens -= self.evicted.get(request_id, 0)
        tables = self.block_tables.get(request_id)
        new = tables is None
        if not new and cached is not None and cached.num_blocks:
            raise ValueError(f"request {request_id!r} already has blocks; cached blocks start a table")
        hits: list[list[CachedBlock | None]] = (cached.blocks if cached is not None and cached.num_blocks
                                                 else [[] for _ in self.groups])
        if new:
            pool_hits = [b for group in hits for b in group if isinstance(b, KVCacheBlock)]
            missing = sum(self.blocks_needed(num_tokens) - sum(1 for b in group if isinstance(b, KVCacheBlock)
                                                               or b is None) for group in hits)
        else:
            assert tables is not None
            self._release_out_of_window(request_id)
            pool_hits = []
            missing = sum(self.blocks_needed(num_tokens) - len(table) for table in tables)
        reviving = sum(1 for block in pool_hits if block.ref_cnt == 0)  # leave the free queue
        tail_cost = self.tail_blocks * len(self.groups) if new else 0
        if missing + tail_cost > self.pool.num_free_blocks - reviving:
            return False
        if new:
            # tier-1 hits leave the tier first, so that no claim below can demote them out of it;
            # tier-2 hits were read and verified by the lookup (slot -1: loaded from disk)
            tier_slots = {key: self.host_tier.take(key) if key in self.host_tier else -1
                          for group in hits for key in group if isinstance(key, bytes)} \
                if self.host_tier is not None else {}
            if tail_cost:
                runs = self._take_tail_runs({block.block_id for block in pool_hits})
                if runs is None:
                    for key, slot in tier_slots.items():
                        if slot >= 0:
                            self.host_tier.give_back(key, slot)  # type: ignore[union-attr]
                    return False
                self.tails[request_id] = runs
            self.pool.touch(pool_hits)
            tables = self._start_tables(hits, tier_slots)
            self.block_tables[request_id] = tables
            self.num_released[request_id] = [sum(1 for b in group if b is None) for group in hits]
            self.num_tokens[request_id] = 0
            self.num_published[request_id] = cached.num_blocks if cached is not None else 0
        assert tables is not None
        before = 0 if new else self._stored_tokens(request_id)
        for table in tables:
            if self.blocks_needed(num_tokens) > len(table):
                table.extend(self.pool.get_new_blocks(self.blocks_needed(num_tokens) - len(table)))
        self.num_tokens[request_id] = max(num_tokens, self.num_tokens[request_id])
        self._logical_tokens += self._stored_tokens(request_id) - before
        if self.enable_prefix_caching and tokens is not None and self._shares(request_id):
            self._publish(request_id, num_tokens - num_lookahead_tokens, tokens)
        return True

    def blocks_to_reach(self, request_id: str, num_tokens: int, cached: CachedPrefix | None = None) -> int:
        """Free pool blocks the request still takes, at its peak, until its first ``num_tokens``
        positions are allocated (a sliding group or a streaming request holds only its window;
        a request without blocks starts from ``cached``: hits another request holds cost
        nothing, hits in the free queue cost the block they revive). Exact for full-attention
        groups; for sliding ones an estimate (a block shared with another request stays held when
        it leaves this one's window). Admission control reserves this for every prompt still
        being prefilled."""
        window = self.window_of(request_id)
        tables = self.block_tables.get(request_id)
        if tables is None:
            hits = cached.blocks if cached is not None and cached.num_blocks else [[] for _ in self.groups]
            held = [sum(1 for b in group if isinstance(b, KVCacheBlock) and b.ref_cnt > 0) for group in hits]
            tail_cost = self.tail_blocks
        else:
            held = [len(table) - first for table, first in zip(tables, self.num_released[request_id], strict=True)]
            tail_cost = 0
            num_tokens -= self.evicted.get(request_id, 0)
        total = 0
        for spec, holding in zip(self.groups, held, strict=True):
            peak = (window.blocks_held(self.block_size, self.max_chunk_tokens) if window is not None
                    else spec.blocks_held(num_tokens, self.block_size, self.max_chunk_tokens))
            total += max(0, min(peak, self.blocks_needed(num_tokens)) - holding) + tail_cost
        return total

    def rollback(self, request_id: str, num_tokens: int) -> None:
        """Keep only the request's first ``num_tokens`` slots (its rejected draft tokens' slots are
        forgotten): table entries wholly past them go back to the pool. They were never published
        (allocate_slots publishes no lookahead token), and the slots kept past the accepted
        tokens are rewritten before anything reads them."""
        tables = self.block_tables[request_id]
        num_tokens -= self.evicted.get(request_id, 0)
        if num_tokens >= self.num_tokens[request_id]:
            return
        before = self._stored_tokens(request_id)
        keep = self.blocks_needed(num_tokens)
        for table in tables:
            rejected = table[keep:]
            del table[keep:]
            self.pool.free_blocks(rejected[::-1])
        self.num_tokens[request_id] = num_tokens
        self._logical_tokens += self._stored_tokens(request_id) - before

    def _take_tail_runs(self, avoid: set[int], fresh: bool = True) -> list[list[KVCacheBlock]] | None:
        """One aligned tail run per group (none of them in ``avoid``), or None (nothing taken).
        ``fresh`` runs are zeroed before use (not those a swap-in restores)."""
        runs: list[list[KVCacheBlock]] = []
        for _ in self.groups:
            run = self.pool.get_aligned_run(self.tail_blocks, avoid)
            if run is None:
                for taken in runs:
                    self.pool.free_blocks(taken)
                return None
            runs.append(run)
        if fresh:
            self.new_tail_slots += [run[0].block_id // self.tail_blocks for run in runs]
        return runs

    def swap_out(self, request_id: str) -> bool:
        """Preemption by swapping: copy the request's live blocks (and its tail runs) to reserved
        tier-1 slots and free them. False if tier 1 cannot take them (the caller recomputes
        instead; counted in num_swap_fallbacks); nothing changes then."""
        live = self._live_tables(request_id)
        blocks = [block for table in live for block in table] + \
            [block for run in self.tails.get(request_id, []) for block in run]
        slots = self.host_tier.reserve(len(blocks)) if self.host_tier is not None else None
        if slots is None:
            self.num_swap_fallbacks += 1
            return False
        assert self.host_tier is not None
        for block, slot in zip(blocks, slots, strict=True):
            self.host_tier.save(block.block_id, slot)
        self.swapped[request_id] = SwappedBlocks(slots, [len(table) for table in live],
                                                 list(self.num_released[request_id]),
                                                 self.num_tokens[request_id], self.num_published[request_id])
        self._release_blocks(request_id)
        self.num_swaps_out += 1
        return True

    def swap_in(self, request_id: str, headroom: int = 0) -> bool:
        """Bring a swapped-out request's blocks back into fresh pool blocks (copied before the
        step's forward pass), leaving ``headroom`` blocks free. False if the pool is short
        (nothing changes then)."""
        state = self.swapped[request_id]
        tail_cost = self.tail_blocks * len(self.groups)
        if sum(state.num_live) + tail_cost + headroom > self.pool.num_free_blocks:
            return False
        runs: list[list[KVCacheBlock]] = []
        if tail_cost:
            taken = self._take_tail_runs(set(), fresh=False)
            if taken is None:
                return False
            runs = self.tails[request_id] = taken
        fresh = self.pool.get_new_blocks(sum(state.num_live))
        assert self.host_tier is not None
        self.host_tier.restore(state.slots, [block.block_id for block in fresh + [b for run in runs for b in run]])
        del self.swapped[request_id]
        tables, start = [], 0
        for live, released in zip(state.num_live, state.num_released, strict=True):
            tables.append([self.pool.null_block] * released + fresh[start : start + live])
            start += live
        self.block_tables[request_id] = tables
        self.num_released[request_id] = list(state.num_released)
        self.num_tokens[request_id] = state.num_tokens
        self._logical_tokens += self._stored_tokens(request_id)
        # its full blocks were published before: these copies are published again where no equal
        # block is cached
        self.num_published[request_id] = 0
        if self._shares(request_id):
            self._publish_up_to(request_id, state.num_published)
        self.num_swaps_in += 1
        return True

    def _start_tables(self, hits: list[list[CachedBlock | None]], slots: dict[bytes, int]
                      ) -> list[list[KVCacheBlock]]:
        """New tables from a prefix hit (its pool blocks already referenced): entries out of a
        sliding window are the null block; each lower-tier hit (taken out of tier 1 into
        ``slots``, or read from tier 2) gets a fresh block, published at once under its key,
        its bytes copied back before the step's forward pass."""
        fresh = iter(self.pool.get_new_blocks(len(slots)))  # may demote other blocks into the tier
        tables: list[list[KVCacheBlock]] = []
        for group in hits:
            table = []
            for hit in group:
                if hit is None:
                    table.append(self.pool.null_block)
                elif isinstance(hit, KVCacheBlock):
                    table.append(hit)
                else:
                    block = next(fresh)
                    if slots[hit] >= 0:
                        self.host_tier.promote(slots[hit], block.block_id)  # type: ignore[union-attr]
                    else:
                        self.host_tier.load(block.block_id, self._disk_loaded.pop(hit))  # type: ignore[union-attr]
                    self._cache(block, hit)
                    table.append(block)
            tables.append(table)
        return tables

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
        full = num_tokens // self.block_size
        if full > self.num_published[request_id]:
            self._hashes(request_id, tokens, full)
            self._publish_up_to(request_id, full)

    def _publish_up_to(self, request_id: str, full: int) -> None:
        """Publish every group's blocks up to ``full`` (their keys already computed)."""
        start, hashes = self.num_published[request_id], self.block_hashes.get(request_id, [])
        for group, (table, released) in enumerate(zip(self.block_tables[request_id],
                                                      self.num_released[request_id], strict=True)):
            for index in range(max(start, released), full):
                self._cache(table[index], group_key(hashes[index], group))
        self.num_published[request_id] = max(start, full)

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
        self.evicted.pop(request_id, None)
        self.private.discard(request_id)
        self._release_blocks(request_id)

    def _release_blocks(self, request_id: str) -> None:
        self._logical_tokens -= self._stored_tokens(request_id)
        live = self._live_tables(request_id) if request_id in self.block_tables else []
        self.block_tables.pop(request_id, None)
        self.num_released.pop(request_id, None)
        self.num_tokens.pop(request_id, None)
        self.num_published.pop(request_id, None)
        for table in live:
            self.pool.free_blocks(table[::-1])
        for run in self.tails.pop(request_id, []):
            self.pool.free_blocks(run)

    def forget(self, request_id: str) -> None:
        """Drop a finished request's remembered block keys (and its window)."""
        self.block_hashes.pop(request_id, None)
        self.windows.pop(request_id, None)

    def prefix_cache_stats(self) -> PrefixCacheStats:
        cached = self.pool.cached_blocks.values()
        return PrefixCacheStats(
            enabled=self.enable_prefix_caching, queries=self.prefix_queries, hits=self.prefix_hits,
            cached_blocks=len(cached), evictable_blocks=sum(1 for b in cached if b.ref_cnt == 0),
            evictions=self.pool.num_evictions)

    def tail_slot(self, request_id: str, group: int = 0) -> int:
        """Index of the request's tail run for ``group`` in the pool viewed as runs of tail_blocks blocks."""
        return self.tails[request_id][group][0].block_id // self.tail_blocks

    def take_new_tail_slots(self) -> list[int]:
        """Tail slots handed out since the last call (their blocks may hold old codes: zero them)."""
        slots, self.new_tail_slots = self.new_tail_slots, []
        return slots

    @property
    def table_blocks_used(self) -> int:
        """Blocks held by block tables (tail runs excluded)."""
        return self.pool.num_used_blocks - len(self.tails) * len(self.groups) * self.tail_blocks

    def block_ids(self, request_id: str, group: int = 0) -> list[int]:
        """The request's table in ``group`` (entries out of a sliding window are the null block, 0)."""
        return [block.block_id for block in self.block_tables[request_id][group]]

    def live_blocks(self, request_id: str, group: int = 0) -> tuple[int, list[int]]:
        """(index of the first entry a query can still read, the ids from there on)."""
        return (self.num_released[request_id][group],
                [block.block_id for block in self._live_tables(request_id)[group]])

    def slot_mapping(self, request_id: str, start: int, end: int, group: int = 0) -> list[int]:
        """Flat cache slot of each token (absolute) position in [start, end) in ``group``'s table."""
        table, size, shift = self.block_tables[request_id][group], self.block_size, self.evicted.get(request_id, 0)
        return [table[pos // size].block_id * size + pos % size for pos in range(start - shift, end - shift)]

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
            per_request_blocks={rid: sum(map(len, self._live_tables(rid))) for rid in self.block_tables},
            prefix_cache=self.prefix_cache_stats(),
            tail_slots_used=len(self.tails) * len(self.groups),
            tail_blocks_used=len(self.tails) * len(self.groups) * self.tail_blocks,
            tiers=[tier.stats() for tier in (self.host_tier, self.disk_tier) if tier is not None],
            swaps_out=self.num_swaps_out, swaps_in=self.num_swaps_in, swap_fallbacks=self.num_swap_fallbacks,
            num_swapped=len(self.swapped),
            groups=self.group_stats(),
            evicted_tokens=self.num_evicted_tokens, evicted_tokens_now=sum(self.evicted.values()),
        )

    def group_stats(self) -> list[KVGroupStats]:
        """Per group: the blocks its tables hold (a shared block once) and the tokens they store."""
        held: list[set[int]] = [set() for _ in self.groups]
        tokens = [0] * len(self.groups)
        for rid in self.block_tables:
            for group, (live, first) in enumerate(zip(self._live_tables(rid), self.num_released[rid], strict=True)):
                held[group].update(block.block_id for block in live)
                tokens[group] += self.num_tokens[rid] - first * self.block_size
        return [KVGroupStats(spec.kind, spec.sliding_window, len(ids), count)
                for spec, ids, count in zip(self.groups, held, tokens, strict=True)]
