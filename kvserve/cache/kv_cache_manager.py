"""Per-request block tables on top of the BlockPool: the only door to the pool."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.cache.block_pool import BlockPool, KVCacheBlock


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class KVCacheStats:
    """A snapshot of the pool. Token figures count slots, not bytes."""

    block_size: int
    num_blocks: int  # usable blocks (the null block excluded)
    blocks_used: int
    blocks_free: int
    blocks_cached: int
    live_tokens: int  # tokens whose K/V are stored for running requests
    allocated_slots: int  # blocks_used * block_size
    num_requests: int
    num_preemptions: int = 0
    peak_blocks_used: int = 0
    peak_live_tokens: int = 0
    peak_num_requests: int = 0
    utilization_at_peak: float = 1.0
    mean_utilization: float = 1.0
    per_request_blocks: dict[str, int] = field(default_factory=dict)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests (vLLM's kv_cache_usage_perc / 100)."""
        return self.blocks_used / self.num_blocks if self.num_blocks else 0.0

    @property
    def utilization(self) -> float:
        """live / allocated: how much of the memory handed out holds real tokens."""
        return self.live_tokens / self.allocated_slots if self.allocated_slots else 1.0

    @property
    def tail_waste(self) -> int:
        """Allocated slots holding no token (the unused end of each last block)."""
        return self.allocated_slots - self.live_tokens

    @property
    def peak_usage(self) -> float:
        return self.peak_blocks_used / self.num_blocks if self.num_blocks else 0.0

    def __str__(self) -> str:
        return (
            f"KV cache: usage {100 * self.usage:.1f}% ({self.blocks_used}/{self.num_blocks} blocks used, "
            f"{self.blocks_free} free, {self.blocks_cached} cached), live tokens {self.live_tokens}, "
            f"allocated slots {self.allocated_slots}, utilization {100 * self.utilization:.1f}%, "
            f"tail waste {self.tail_waste} slots | peak: usage {100 * self.peak_usage:.1f}% "
            f"({self.peak_blocks_used} blocks), live tokens {self.peak_live_tokens}, "
            f"{self.peak_num_requests} requests, utilization at peak {100 * self.utilization_at_peak:.1f}%, "
            f"mean utilization {100 * self.mean_utilization:.1f}% | preemptions {self.num_preemptions}"
        )


class KVCacheManager:
    """Maps each request to a block table and grows it on demand.

    Invariants: a request's table covers exactly cdiv(num_tokens, block_size) blocks;
    no block appears in two tables; free() returns every block of the request at once.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[KVCacheBlock]] = {}
        self.num_tokens: dict[str, int] = {}
        self._live_tokens = 0
        self.num_preemptions = 0
        self._peak_blocks = 0
        self._peak_live = 0
        self._peak_requests = 0
        self._util_at_peak = 1.0
        self._util_sum = 0.0
        self._util_samples = 0

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_usable_blocks * self.block_size

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) <= self.pool.num_usable_blocks

    def allocate_slots(self, request_id: str, num_tokens: int) -> bool:
        """Make room for the request's first ``num_tokens`` tokens. False if the pool is short
        (nothing is allocated then)."""
        table = self.block_tables.setdefault(request_id, [])
        missing = self.blocks_needed(num_tokens) - len(table)
        if missing > self.pool.num_free_blocks:
            if not table:
                del self.block_tables[request_id]
            return False
        if missing > 0:
            table.extend(self.pool.get_new_blocks(missing))
        previous = self.num_tokens.get(request_id, 0)
        if num_tokens > previous:
            self.num_tokens[request_id] = num_tokens
            self._live_tokens += num_tokens - previous
        return True

    def free(self, request_id: str) -> None:
        """Return all of a request's blocks to the pool (finished, aborted or preempted)."""
        table = self.block_tables.pop(request_id, [])
        self._live_tokens -= self.num_tokens.pop(request_id, 0)
        self.pool.free_blocks(table[::-1])

    def block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.block_tables[request_id]]

    def slot_mapping(self, request_id: str, start: int, end: int) -> list[int]:
        """Flat cache slot of each token position in [start, end)."""
        table, size = self.block_tables[request_id], self.block_size
        return [table[pos // size].block_id * size + pos % size for pos in range(start, end)]

    def record_step(self) -> None:
        """Update peak and mean figures; called once per engine step."""
        used = self.pool.num_used_blocks
        allocated = used * self.block_size
        util = self._live_tokens / allocated if allocated else 1.0
        if used:
            self._util_sum += util
            self._util_samples += 1
        if used > self._peak_blocks:
            self._peak_blocks, self._util_at_peak = used, util
        self._peak_live = max(self._peak_live, self._live_tokens)
        self._peak_requests = max(self._peak_requests, len(self.block_tables))

    def stats(self) -> KVCacheStats:
        used = self.pool.num_used_blocks
        return KVCacheStats(
            block_size=self.block_size,
            num_blocks=self.pool.num_usable_blocks,
            blocks_used=used,
            blocks_free=self.pool.num_free_blocks,
            blocks_cached=0,
            live_tokens=self._live_tokens,
            allocated_slots=used * self.block_size,
            num_requests=len(self.block_tables),
            num_preemptions=self.num_preemptions,
            peak_blocks_used=self._peak_blocks,
            peak_live_tokens=self._peak_live,
            peak_num_requests=self._peak_requests,
            utilization_at_peak=self._util_at_peak,
            mean_utilization=self._util_sum / self._util_samples if self._util_samples else 1.0,
            per_request_blocks={rid: len(t) for rid, t in self.block_tables.items()},
        )
