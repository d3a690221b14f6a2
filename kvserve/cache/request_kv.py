"""One request's KV state in the KVCacheManager: one record, from its first prefix lookup until
the manager forgets it (finished or aborted)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from kvserve.cache.block_pool import KVCacheBlock
from kvserve.cache.kv_retention import RetentionPolicy, StreamingWindow


class SwappedBlocks(NamedTuple):
    """A swapped-out request: the tier-1 slots holding each group's live blocks in turn, then
    each group's tail run."""

    slots: list[int]
    num_live: list[int]  # per group: blocks saved (its table's entries past the released ones)
    num_released: list[int]  # per group: leading table entries out of the window (the null block)
    num_tokens: int
    num_published: int


@dataclass(slots=True, eq=False)
class RequestKV:
    """Invariants while the request holds blocks (``tables`` is not None): each group's table
    covers exactly cdiv(num_tokens, block_size) entries, ``num_tokens`` counting cache positions
    (absolute ones less ``evicted``); a table's first ``num_released`` entries are the null block
    (out of its policy's reach) and every other entry is a block the request holds; ``tails``
    holds one aligned run per group where the format keeps tails, none otherwise. While it holds
    none, ``swapped`` may say where its blocks wait in tier 1."""

    policies: list[RetentionPolicy]  # per group: how its blocks are kept (kv_retention)
    window: StreamingWindow | None  # the request streams with this window (None: it does not)
    compacted: bool = False  # SnapKV kept a selection of its tokens in private blocks
    tables: list[list[KVCacheBlock]] | None = None  # per group
    num_released: list[int] = field(default_factory=list)  # per group
    num_tokens: int = 0
    tails: list[list[KVCacheBlock]] = field(default_factory=list)  # per group
    block_hashes: list[bytes] = field(default_factory=list)  # keys of its full blocks so far (kept across frees)
    num_published: int = 0  # leading blocks of its tables already offered to the prefix cache
    evicted: int = 0  # tokens taken out of its tables (streaming, compaction): cache = absolute - this
    swapped: SwappedBlocks | None = None

    @property
    def shares(self) -> bool:
        """Its blocks may be published and its prefix served from the cache."""
        return all(policy.shares for policy in self.policies)

    def live_tables(self) -> list[list[KVCacheBlock]]:
        """Per group, the blocks it holds: each table past its released entries."""
        assert self.tables is not None
        return [table[first:] for table, first in zip(self.tables, self.num_released, strict=True)]

    def stored_tokens(self, block_size: int) -> int:
        """Token slots its tables hold, over all groups (released entries excluded)."""
        if self.tables is None:
            return 0
        return sum(self.num_tokens - block_size * released for released in self.num_released)
