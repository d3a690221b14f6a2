"""What the KV manager hands a step: each scheduled request's block tables as plain ids, and
the storage work (zeroing, tier copies) to run before the forward pass. The model runner reads
only these; it never calls the manager."""

from __future__ import annotations

from typing import NamedTuple

from kvserve.cache.kv_tiers import TierMoves


class GroupBlocks(NamedTuple):
    """One request's block table in one KV cache group (kv_groups), as a step reads it."""

    block_ids: list[int]  # every entry of the table; the null block (0) where released
    num_released: int  # leading entries no query reads again (past a sliding window)
    tail_slot: int  # its tail run's slot (formats that keep a full-precision tail), else -1


class RequestBlocks(NamedTuple):
    """One request's tables in every group, and where its cache positions sit."""

    groups: list[GroupBlocks]
    # tokens taken out of its tables (streaming eviction, compaction): a token past the sinks at
    # absolute position p sits at cache position p - evicted; rotary positions stay absolute
    evicted: int

    def slots(self, start: int, end: int, block_size: int, group: int = 0) -> list[int]:
        """Flat cache slot of each absolute position in [start, end) in ``group``'s table."""
        table = self.groups[group].block_ids
        return [table[pos // block_size] * block_size + pos % block_size
                for pos in range(start - self.evicted, end - self.evicted)]


class StorageWork(NamedTuple):
    """The storage a step needs ready before its forward pass, in this order (PagedKVCache.prepare)."""

    zero_up_to: int  # the highest block id handed out so far: blocks up to it are zeroed on first use
    tier_moves: TierMoves | None  # copies between the pool and the tiers (demotions before the rest)
    new_tail_slots: list[int]  # tail slots handed out since the last step: zeroed after the moves
