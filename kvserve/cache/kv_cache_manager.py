"""The KV manager: per-request block tables on top of the BlockPool, the only door to the pool.
It keeps one record per request (request_kv), asks each group's retention policy
(kv_retention) what to hold, and coordinates the prefix cache (prefix_cache) and the lower
tiers (kv_offload)."""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.cache.block_pool import BlockPool, KVCacheBlock
from kvserve.cache.block_store import BlockStore
from kvserve.cache.kv_disk import DiskTier
from kvserve.cache.kv_groups import FULL_ATTENTION, KVCacheSpec, capacity_tokens, cdiv
from kvserve.cache.kv_offload import OffloadManager
from kvserve.cache.kv_plan import GroupBlocks, RequestBlocks, StorageWork
from kvserve.cache.kv_retention import Compacted, Eviction, RetentionPolicy, StreamingWindow, retention_for
from kvserve.cache.kv_stats import KVCacheStats, PeakUsage, usage_snapshot
from kvserve.cache.kv_tiers import TierIndex
from kvserve.cache.prefix_cache import CachedBlock, CachedPrefix, PrefixCache, TokenReader
from kvserve.cache.request_kv import RequestKV, SwappedBlocks
from kvserve.cache.tail_runs import TailRuns


class KVCacheManager:
    """The coordinator of a request's KV: one RequestKV record per request, one block table per
    KV cache group (kv_groups) in it, kept by the group's retention policy (kv_retention); over
    them the pool, the prefix cache and the lower tiers (kv_offload).

    Invariants: a record's tables follow RequestKV's invariants; free() returns every block of
    the request at once. A block is in two tables only as a shared, published prefix block:
    full, and never written again (a request writes only at positions at or past its
    num_computed_tokens, which lie after its cache hits).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 tail_blocks: int = 0, host_tier: TierIndex | None = None, stores: list[BlockStore] | None = None,
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
            self._check_streamable(streaming)
        self.max_chunk_tokens = max_chunk_tokens
        self.enable_prefix_caching = enable_prefix_caching
        self.streaming = streaming
        self.requests: dict[str, RequestKV] = {}
        self.num_evicted_tokens = 0  # since start
        self.tail_blocks = tail_blocks
        self.offload = OffloadManager(host_tier, stores)
        self.offload.attach(self.pool, enable_prefix_caching)
        self.prefix_cache = PrefixCache(self.pool, self.offload, block_size, len(self.groups), enable_prefix_caching)
        self.tails = TailRuns(self.pool, tail_blocks, len(self.groups))
        self.logical_tokens = 0  # tokens the records hold, a shared block counted by every holder
        self.peaks = PeakUsage()

    @property
    def stores(self) -> list[BlockStore]:
        """The lower stores below tier 1 (disk, remote), in the order they are asked."""
        return self.offload.stores

    def take_published(self) -> list[tuple[int, bytes]]:
        """(pool block, key) of the blocks published since the last call, when a shared store
        wants them (after the step that computed them)."""
        return self.offload.take_published()

    @property
    def disk_tier(self) -> DiskTier | None:
        return next((s for s in self.stores if isinstance(s, DiskTier)), None)

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

    # ------------------------------------------------------------------ records and policies

    def _policies(self, window: StreamingWindow | None, compacted: bool) -> list[RetentionPolicy]:
        return [retention_for(spec, window, compacted) for spec in self.groups]

    def _record(self, request_id: str) -> RequestKV:
        """The request's record, made on first use with the engine's default window."""
        record = self.requests.get(request_id)
        if record is None:
            record = self.requests[request_id] = RequestKV(self._policies(self.streaming, False), self.streaming)
        return record

    def request(self, request_id: str) -> RequestKV | None:
        return self.requests.get(request_id)

    def holders(self) -> dict[str, RequestKV]:
        """The records of the requests holding blocks now."""
        return {rid: record for rid, record in self.requests.items() if record.tables is not None}

    def set_window(self, request_id: str, window: StreamingWindow | None) -> None:
        """The request streams with ``window`` (None: it keeps every block) whatever the default;
        before its first allocation, until forget()."""
        if window is not None:
            self._check_streamable(window)
        record = self._record(request_id)
        record.window, record.policies = window, self._policies(window, record.compacted)

    def _check_streamable(self, window: StreamingWindow) -> None:
        """Streaming takes the one full-attention group (group 0); sliding groups keep their own
        windows, which ``window`` must cover, so that every block it evicts is out of them too."""
        full = [spec for spec in self.groups if not spec.sliding_window]
        if len(full) != 1 or self.groups[0].sliding_window:
            raise ValueError("streaming eviction takes one full-attention group")
        widest = max((spec.sliding_window for spec in self.groups), default=0)
        if window.window < widest:
            raise ValueError(f"a streaming window of {window.window} tokens is shorter than the model's sliding "
                             f"window of {widest}")

    def window_of(self, request_id: str) -> StreamingWindow | None:
        record = self.requests.get(request_id)
        return record.window if record is not None else self.streaming

    @property
    def streams(self) -> bool:
        """Some request may stream."""
        return self.streaming is not None or any(record.window is not None for record in self.requests.values())

    def lookahead_room(self, request_id: str, first_query: int) -> int | None:
        """Positions past ``first_query`` (the decoding request's last token) its next chunk may
        carry as lookahead (speculative drafts); None: no bound. A streaming request stays within
        its eviction period (Streaming.lookahead_room: its queries see what they would see one
        token a step); with tail formats, drafts stop before the last slot of the block the next
        token starts in: a block quantized when it fills could not take back a rejected token
        (with block_size 1 a block holds one token and is freed whole)."""
        record = self.requests.get(request_id)
        rooms = [] if record is None else [
            room for policy in record.policies
            if (room := policy.lookahead_room(first_query, record.evicted, self.block_size)) is not None]
        if self.tail_blocks and self.block_size > 1:
            evicted = record.evicted if record is not None else 0
            rooms.append(self.block_size - 1 - (first_query + 1 - evicted) % self.block_size)
        return min(rooms, default=None)

    def num_tokens(self, request_id: str) -> int:
        """Cache positions the request's tables cover (absolute ones less its evicted tokens)."""
        record = self.requests.get(request_id)
        return record.num_tokens if record is not None else 0

    def evicted_tokens(self, request_id: str) -> int:
        """Absolute position - cache position of the request's tokens past its sinks."""
        record = self.requests.get(request_id)
        return record.evicted if record is not None else 0

    def _take_out(self, record: RequestKV, tokens: int, stored_before: int) -> None:
        """``tokens`` of the request's cached tokens left its tables (eviction, compaction), which
        held ``stored_before`` token slots over all groups before."""
        record.num_tokens -= tokens
        record.evicted += tokens
        self.num_evicted_tokens += tokens
        self.logical_tokens += record.stored_tokens(self.block_size) - stored_before

    def compact(self, request_id: str, keep: int) -> tuple[list[int], list[int]] | None:
        """Move the request to cdiv(keep, block_size) fresh private blocks that will hold ``keep``
        of its cached tokens (which ones, per layer and head, the caller copies: old block ids,
        new block ids); its old blocks are released (published ones stay cached). From now on
        it publishes nothing. None if the pool is short (nothing changes then). One group; its
        tail runs stay (the caller puts a partial last block in the tail slot); the cache must
        hold only computed tokens."""
        record = self.requests[request_id]
        assert record.tables is not None and not record.window
        table, tokens, before = record.tables[0], record.num_tokens, record.stored_tokens(self.block_size)
        if not 0 < keep <= tokens or self.blocks_needed(keep) > self.pool.num_free_blocks:
            return None
        fresh = self.pool.get_new_blocks(self.blocks_needed(keep))
        old = [block.block_id for block in table]
        self.pool.free_blocks(table[::-1])
        record.tables[0] = fresh
        self._take_out(record, tokens - keep, before)
        record.compacted, record.policies = True, [Compacted()]  # a selection: never publish it
        return old, [block.block_id for block in fresh]

    def evict(self, request_id: str, first_query: int) -> Eviction | None:
        """Streaming: free the blocks between the sinks and the window of a query at absolute
        position ``first_query`` (the request's next token; every earlier one is computed) and
        close the table up; None if nothing left. Sliding groups (group 0 is the full-attention
        one) close theirs up by the same entries, all out of their windows (_check_streamable):
        released ones are the null block, the rest are freed now, so every group keeps one cache
        position per token."""
        record = self.requests.get(request_id)
        if record is None or record.tables is None:
            return None
        size, evicted = self.block_size, record.evicted
        drop = record.policies[0].blocks_to_evict(first_query, evicted, size)
        if drop <= 0:
            return None
        window = record.window
        assert window is not None, "only a streaming request's policy evicts"
        sinks = window.sink_blocks(size)
        before = record.stored_tokens(size)
        for group, table in enumerate(record.tables):
            dead = table[sinks : sinks + drop]
            del table[sinks : sinks + drop]
            released = record.num_released[group]
            nulls = max(0, min(released, sinks + drop) - sinks)
            record.num_released[group] = released - nulls
            self.pool.free_blocks(dead[nulls:][::-1])
            if group == 0:
                donor = dead[-1]
        self._take_out(record, drop * size, before)
        spare = window.spare_slots(size)
        return Eviction([block.block_id for block in record.tables[0][:sinks]], record.evicted, evicted == 0,
                        donor.block_id if spare else None, size - spare)

    # ------------------------------------------------------------------ allocation

    def _release_unread(self, record: RequestKV) -> None:
        """Each group's policy gives back the blocks no query from now on reads (they stay in the
        prefix cache when published). The next query is at the request's num_tokens."""
        assert record.tables is not None
        for group, policy in enumerate(record.policies):
            live, released = policy.first_live_block(record.num_tokens, self.block_size), record.num_released[group]
            if live > released:
                table = record.tables[group]
                dead = table[released:live]
                table[released:live] = [self.pool.null_block] * len(dead)
                self.pool.free_blocks(dead[::-1])
                self.logical_tokens -= self.block_size * len(dead)
                record.num_released[group] = live

    def allocate_slots(self, request_id: str, num_tokens: int, tokens: TokenReader | None = None,
                       cached: CachedPrefix | None = None, num_lookahead_tokens: int = 0) -> bool:
        """Make room for the request's first ``num_tokens`` tokens, starting a new request's tables
        with ``cached`` (from find_cached_prefix; lower-tier hits get fresh blocks, copied back
        before the step runs). False if the pool is short (nothing is allocated then). With
        caching on, ``tokens`` reads the request's token ids, and every block that these tokens
        fill is published — except the last ``num_lookahead_tokens`` (speculative drafts, which
        may still be rejected: see rollback)."""
        record = self._record(request_id)
        num_tokens -= record.evicted
        new = record.tables is None
        if not new and cached is not None and cached.num_blocks:
            raise ValueError(f"request {request_id!r} already has blocks; cached blocks start a table")
        hits: list[list[CachedBlock | None]] = (cached.blocks if cached is not None and cached.num_blocks
                                                 else [[] for _ in self.groups])
        needed = self.blocks_needed(num_tokens)
        if new:
            pool_hits = [b for group in hits for b in group if isinstance(b, KVCacheBlock)]
            missing = sum(needed - sum(1 for b in group if isinstance(b, KVCacheBlock) or b is None) for group in hits)
        else:
            self._release_unread(record)
            pool_hits = []
            missing = sum(needed - len(table) for table in record.tables or [])
        reviving = sum(1 for block in pool_hits if block.ref_cnt == 0)  # leave the free queue
        tail_cost = self.tails.blocks_per_sequence if new else 0
        if missing + tail_cost > self.pool.num_free_blocks - reviving:
            return False
        if new:
            # tier-1 hits leave the tier first, so that no claim below can demote them out of it;
            # tier-2 hits were read and verified by the lookup
            taken = self.offload.take([key for group in hits for key in group if isinstance(key, bytes)])
            if tail_cost:
                runs = self.tails.take({block.block_id for block in pool_hits})
                if runs is None:
                    self.offload.give_back(taken)
                    return False
                record.tails = runs
            self.pool.touch(pool_hits)
            record.tables = self._start_tables(hits, taken)
            record.num_released = [sum(1 for b in group if b is None) for group in hits]
            record.num_tokens = 0
            record.num_published = cached.num_blocks if cached is not None else 0
        assert record.tables is not None
        before = 0 if new else record.stored_tokens(self.block_size)
        for table in record.tables:
            if needed > len(table):
                table.extend(self.pool.get_new_blocks(needed - len(table)))
        record.num_tokens = max(num_tokens, record.num_tokens)
        self.logical_tokens += record.stored_tokens(self.block_size) - before
        if self.enable_prefix_caching and tokens is not None and record.shares:
            self.prefix_cache.publish(record, num_tokens - num_lookahead_tokens, tokens)
        return True

    def _start_tables(self, hits: list[list[CachedBlock | None]], taken: dict[bytes, int]
                      ) -> list[list[KVCacheBlock]]:
        """New tables from a prefix hit (its pool blocks already referenced): entries out of a
        policy's reach are the null block; each lower-tier hit (``taken`` out of its tier) gets a
        fresh block, published at once under its key, its bytes copied back before the step's
        forward pass."""
        fresh = iter(self.pool.get_new_blocks(len(taken)))  # may demote other blocks into the tier
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
                    self.offload.fill(block, hit, taken[hit])
                    self.prefix_cache.cache(block, hit, computed=False)
                    table.append(block)
            tables.append(table)
        return tables

    def blocks_to_reach(self, request_id: str, num_tokens: int, cached: CachedPrefix | None = None) -> int:
        """Free pool blocks the request still takes, at its peak, until its first ``num_tokens``
        positions are allocated (each group's policy says what it holds at most: a sliding group
        or a streaming request only its window; a request without blocks starts from ``cached``:
        hits another request holds cost nothing, hits in the free queue cost the block they
        revive). Exact for full-attention groups; for sliding ones an estimate (a block shared
        with another request stays held when it leaves this one's window). Admission control
        reserves this for every prompt still being prefilled."""
        record = self._record(request_id)
        if record.tables is None:
            hits = cached.blocks if cached is not None and cached.num_blocks else [[] for _ in self.groups]
            held = [sum(1 for b in group if isinstance(b, KVCacheBlock) and b.ref_cnt > 0) for group in hits]
            tail_cost = self.tail_blocks
        else:
            held = [len(table) for table in record.live_tables()]
            tail_cost = 0
            num_tokens -= record.evicted
        total = 0
        for policy, holding in zip(record.policies, held, strict=True):
            peak = policy.blocks_held(num_tokens, self.block_size, self.max_chunk_tokens)
            total += max(0, min(peak, self.blocks_needed(num_tokens)) - holding) + tail_cost
        return total

    def rollback(self, request_id: str, num_tokens: int) -> None:
        """Keep only the request's first ``num_tokens`` slots (its rejected draft tokens' slots are
        forgotten): table entries wholly past them go back to the pool. They were never published
        (allocate_slots publishes no lookahead token), and the slots kept past the accepted
        tokens are rewritten before anything reads them."""
        record = self.requests[request_id]
        assert record.tables is not None
        num_tokens -= record.evicted
        if num_tokens >= record.num_tokens:
            return
        before = record.stored_tokens(self.block_size)
        keep = self.blocks_needed(num_tokens)
        for table in record.tables:
            rejected = table[keep:]
            del table[keep:]
            self.pool.free_blocks(rejected[::-1])
        record.num_tokens = num_tokens
        self.logical_tokens += record.stored_tokens(self.block_size) - before

    # ------------------------------------------------------------------ swap, free

    def swap_out(self, request_id: str) -> bool:
        """Preemption by swapping: copy the request's live blocks (and its tail runs) to reserved
        tier-1 slots and free them. False if tier 1 cannot take them (the caller recomputes
        instead; counted in num_swap_fallbacks); nothing changes then."""
        record = self.requests[request_id]
        live = record.live_tables()
        slots = self.offload.swap_out([block for table in live for block in table] +
                                      [block for run in record.tails for block in run])
        if slots is None:
            return False
        record.swapped = SwappedBlocks(slots, [len(table) for table in live], list(record.num_released),
                                       record.num_tokens, record.num_published)
        self._release_blocks(record)
        return True

    def swap_in(self, request_id: str, headroom: int = 0) -> bool:
        """Bring a swapped-out request's blocks back into fresh pool blocks (copied before the
        step's forward pass), leaving ``headroom`` blocks free. False if the pool is short
        (nothing changes then)."""
        record = self.requests[request_id]
        state = record.swapped
        assert state is not None
        tail_cost = self.tails.blocks_per_sequence
        if sum(state.num_live) + tail_cost + headroom > self.pool.num_free_blocks:
            return False
        runs: list[list[KVCacheBlock]] = []
        if tail_cost:
            taken = self.tails.take(set(), fresh=False)
            if taken is None:
                return False
            runs = record.tails = taken
        fresh = self.pool.get_new_blocks(sum(state.num_live))
        self.offload.swap_in(state.slots, fresh + [block for run in runs for block in run])
        record.swapped = None
        tables, start = [], 0
        for live, released in zip(state.num_live, state.num_released, strict=True):
            tables.append([self.pool.null_block] * released + fresh[start : start + live])
            start += live
        record.tables, record.num_released, record.num_tokens = tables, list(state.num_released), state.num_tokens
        self.logical_tokens += record.stored_tokens(self.block_size)
        # its full blocks were published before: these copies are published again where no equal
        # block is cached
        record.num_published = 0
        if record.shares:
            self.prefix_cache.publish_up_to(record, state.num_published)
        return True

    def free(self, request_id: str) -> None:
        """Return all of a request's blocks to the pool (preempted for recompute), or its
        swapped-out blocks' tier slots; it starts afresh (its window and block keys stay). Its
        published blocks stay cached until evicted."""
        record = self.requests.get(request_id)
        if record is None:
            return
        if record.swapped is not None:
            self.offload.release(record.swapped.slots)
            record.swapped = None
        self._release_blocks(record)
        record.evicted, record.compacted = 0, False
        record.policies = self._policies(record.window, False)

    def _release_blocks(self, record: RequestKV) -> None:
        if record.tables is None:
            return
        self.logical_tokens -= record.stored_tokens(self.block_size)
        for table in record.live_tables():
            self.pool.free_blocks(table[::-1])
        self.tails.free(record.tails)
        record.tables, record.num_released, record.tails = None, [], []
        record.num_tokens = record.num_published = 0

    def forget(self, request_id: str) -> None:
        """The request ended (finished or aborted): free what it holds and drop its record."""
        self.free(request_id)
        self.requests.pop(request_id, None)

    # ------------------------------------------------------------------ lookups and the step's view

    def find_cached_prefix(self, request_id: str, num_tokens: int, tokens: TokenReader) -> CachedPrefix:
        """The request's longest cached prefix (PrefixCache.find); takes no references."""
        return self.prefix_cache.find(self._record(request_id), num_tokens, tokens)

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache.record_lookup(num_tokens, num_hit_tokens)

    def take_storage_work(self) -> StorageWork:
        """What the storage must do before this step's forward pass (every step, even one with
        nothing to run, so tier moves never wait across steps)."""
        return StorageWork(self.pool.max_block_id_used, self.offload.take_moves(), self.tails.take_new_slots())

    def blocks_of(self, request_id: str) -> RequestBlocks:
        """The request's tables as the step reads them (after this step's allocations)."""
        record = self.requests[request_id]
        assert record.tables is not None
        tails = [self.tails.slot(run) for run in record.tails] or [-1] * len(self.groups)
        return RequestBlocks([GroupBlocks([block.block_id for block in table], released, tail)
                              for table, released, tail in zip(record.tables, record.num_released, tails,
                                                               strict=True)], record.evicted)

    def block_ids(self, request_id: str, group: int = 0) -> list[int]:
        """The request's table in ``group`` (entries out of a sliding window are the null block, 0)."""
        return self.blocks_of(request_id).groups[group].block_ids

    def tail_slot(self, request_id: str, group: int = 0) -> int:
        """The request's tail run for ``group`` in the pool viewed as runs of tail_blocks blocks."""
        return self.tails.slot(self.requests[request_id].tails[group])

    def slot_mapping(self, request_id: str, start: int, end: int, group: int = 0) -> list[int]:
        """Flat cache slot of each token (absolute) position in [start, end) in ``group``'s table."""
        return self.blocks_of(request_id).slots(start, end, self.block_size, group)

    # ------------------------------------------------------------------ statistics

    @property
    def table_blocks_used(self) -> int:
        """Blocks held by block tables (tail runs excluded)."""
        return self.pool.num_used_blocks - self.tails.num_held * self.tail_blocks

    @property
    def physical_tokens(self) -> int:
        """Slots holding a token, each block once: a shared block is full and counted by every
        holder in the logical sum, so its extra references come off."""
        return self.logical_tokens - self.block_size * self.pool.num_shared_refs

    def record_step(self) -> None:
        """Update peak and mean figures; called once per engine step."""
        self.peaks.record(self.pool.num_used_blocks, self.physical_tokens, self.table_blocks_used * self.block_size,
                          len(self.holders()))

    def stats(self) -> KVCacheStats:
        return usage_snapshot(self)
