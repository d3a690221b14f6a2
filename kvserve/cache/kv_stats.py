"""Snapshots of the KV cache for stats, /v1/kv, /metrics and the CLI summary."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvserve.cache.kv_tiers import TierStats

if TYPE_CHECKING:  # the manager builds its snapshot here; it imports this module
    from kvserve.cache.kv_cache_manager import KVCacheManager


@dataclass(slots=True)
class PrefixCacheStats:
    """Prefix-cache counters since start-up (vLLM's prefix_cache_queries/hits are in tokens)."""

    enabled: bool
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens found in the cache
    cached_blocks: int = 0  # blocks holding a published key
    evictable_blocks: int = 0  # cached blocks no running request holds
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def __str__(self) -> str:
        if not self.enabled:
            return "prefix cache: off"
        return (f"prefix cache: hit rate {100 * self.hit_rate:.1f}% ({self.hits}/{self.queries} tokens), "
                f"{self.cached_blocks} cached blocks ({self.evictable_blocks} evictable), "
                f"{self.evictions} evictions")


@dataclass(slots=True)
class KVGroupStats:
    """One KV cache group (kv_groups): its kind, and what its block tables hold now."""

    kind: str  # full_attention or sliding_window
    sliding_window: int
    blocks_used: int  # blocks in its tables (a shared prefix block once; tails excluded)
    logical_tokens: int  # tokens its tables store (released sliding entries excluded)


@dataclass(slots=True)
class SpecDecodeStats:
    """Speculative decoding counters since start-up (vLLM's spec_decode_* names)."""

    method: str
    num_speculative_tokens: int
    num_drafts: int = 0  # verify steps (one per request per step that verified drafts)
    num_draft_tokens: int = 0  # drafts proposed and verified
    num_accepted_tokens: int = 0  # drafts that stood
    num_bonus_tokens: int = 0  # verify steps whose drafts all stood (the target's next token is a bonus)
    accepted_per_position: list[int] = field(default_factory=list)  # drafts accepted at position i
    num_disabled_steps: int = 0  # steps that drafted nothing: more requests decoded than disable_by_batch_size
    draft_kv: KVCacheStats | None = None  # the draft model's own pool (draft_model, layer_skip)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verify step yields: accepted drafts plus the target's own token."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def __str__(self) -> str:
        draft = f", draft KV {self.draft_kv.blocks_used}/{self.draft_kv.num_blocks} blocks" if self.draft_kv else ""
        return (f"speculative decoding ({self.method}, k={self.num_speculative_tokens}): {self.num_drafts} verify "
                f"steps, acceptance {100 * self.acceptance_rate:.1f}% ({self.num_accepted_tokens}/"
                f"{self.num_draft_tokens} drafts), mean accepted length {self.mean_accepted_length:.2f}, "
                f"{self.num_disabled_steps} steps disabled by batch size{draft}")


@dataclass(slots=True)
class KVCacheStats:
    """A snapshot of the pool. Token figures count slots, not bytes.

    Physical figures count each block once: ``live_tokens`` are the slots holding a token, so
    ``utilization`` <= 1 and ``tail_waste`` >= 0 always. Logical figures count what requests
    see: a prefix block shared by k requests is k blocks' worth of ``logical_tokens``. With several
    KV cache groups (kv_groups) token figures add up over the groups: a token fills a slot in
    each group that still holds it."""

    block_size: int
    num_blocks: int  # usable blocks (the null block excluded)
    blocks_used: int
    blocks_free: int
    blocks_cached: int
    live_tokens: int  # physical: slots holding a token (a shared block counts once)
    allocated_slots: int  # block_size * blocks in block tables (blocks_used less tail blocks)
    num_requests: int
    logical_tokens: int = 0  # sum of every running request's tokens (a shared block counts per holder)
    num_preemptions: int = 0  # counted by the engine (the scheduler reports them)
    peak_blocks_used: int = 0
    peak_live_tokens: int = 0
    peak_num_requests: int = 0
    utilization_at_peak: float = 1.0
    mean_utilization: float = 1.0
    per_request_blocks: dict[str, int] = field(default_factory=dict)
    prefix_cache: PrefixCacheStats = field(default_factory=lambda: PrefixCacheStats(enabled=False))
    kv_cache_dtype: str = ""  # set by the engine
    clip_ratio: float = 0.0  # elements clipped by static KV scales / elements checked (drift watch)
    tail_slots_used: int = 0  # running sequences holding a full-precision tail block (int4, per-block int8)
    tail_blocks_used: int = 0  # pool blocks those tails take (counted in blocks_used, not in allocated_slots)
    tiers: list[TierStats] = field(default_factory=list)  # lower tiers (kv_tiers), top first
    swaps_out: int = 0  # requests preempted by swapping their blocks to tier 1
    swaps_in: int = 0
    swap_fallbacks: int = 0  # swap preemptions that recomputed instead: tier 1 was full
    num_swapped: int = 0  # requests whose blocks wait in tier 1 now
    groups: list[KVGroupStats] = field(default_factory=list)  # per KV cache group (one for plain models)
    spec_decode: SpecDecodeStats | None = None  # set by the engine when speculative decoding is on
    # streaming eviction and prompt compression (snapkv): tokens whose K/V were dropped since
    # start, and those the running (or swapped-out) requests hold out of the pool now (what
    # eviction saves at this moment, in bytes too: set by the engine)
    evicted_tokens: int = 0
    evicted_tokens_now: int = 0
    evicted_bytes_now: int = 0

    @property
    def kept_ratio(self) -> float:
        """Of the current requests' tokens, the share whose K/V the pool still holds (1: nothing
        evicted or compressed away)."""
        total = self.logical_tokens + self.evicted_tokens_now
        return self.logical_tokens / total if total else 1.0

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests (vLLM's kv_cache_usage_perc / 100)."""
        return self.blocks_used / self.num_blocks if self.num_blocks else 0.0

    @property
    def utilization(self) -> float:
        """Physical live / allocated: how much of the memory handed out holds real tokens (<= 1)."""
        return self.live_tokens / self.allocated_slots if self.allocated_slots else 1.0

    @property
    def tail_waste(self) -> int:
        """Allocated slots holding no token (the unused end of each last block); >= 0."""
        return self.allocated_slots - self.live_tokens

    @property
    def sharing_factor(self) -> float:
        """Logical / physical tokens: how many times prefix sharing multiplies the pool (>= 1)."""
        return self.logical_tokens / self.live_tokens if self.live_tokens else 1.0

    @property
    def peak_usage(self) -> float:
        return self.peak_blocks_used / self.num_blocks if self.num_blocks else 0.0

    def __str__(self) -> str:
        tails = f", {self.tail_blocks_used} in tail blocks" if self.tail_blocks_used else ""
        return (
            f"KV cache: usage {100 * self.usage:.1f}% ({self.blocks_used}/{self.num_blocks} blocks used, "
            f"{self.blocks_free} free, {self.blocks_cached} cached{tails}), live tokens {self.live_tokens} "
            f"(logical {self.logical_tokens}, sharing x{self.sharing_factor:.2f}), "
            f"allocated slots {self.allocated_slots}, utilization {100 * self.utilization:.1f}%, "
            f"tail waste {self.tail_waste} slots | peak: usage {100 * self.peak_usage:.1f}% "
            f"({self.peak_blocks_used} blocks), live tokens {self.peak_live_tokens}, "
            f"{self.peak_num_requests} requests, utilization at peak {100 * self.utilization_at_peak:.1f}%, "
            f"mean utilization {100 * self.mean_utilization:.1f}% | preemptions {self.num_preemptions} | "
            f"{self.prefix_cache}"
            + "".join(f" | tier {t.name}: {t.blocks} blocks ({t.used_bytes / 2**20:.1f}/"
                      f"{t.capacity_bytes / 2**20:.1f} MiB), {t.hits} hits, {t.blocks_in} in, {t.evictions} dropped"
                      for t in self.tiers)
            + (f" | {self.spec_decode}" if self.spec_decode is not None else "")
        )


@dataclass(slots=True)
class PeakUsage:
    """The pool's peak and mean figures over the steps so far (KVCacheManager.record_step)."""

    blocks: int = 0
    live_tokens: int = 0
    requests: int = 0
    utilization_at_peak: float = 1.0
    _util_sum: float = 0.0
    _util_samples: int = 0

    def record(self, used_blocks: int, live_tokens: int, allocated_slots: int, requests: int) -> None:
        util = live_tokens / allocated_slots if allocated_slots else 1.0
        if used_blocks:
            self._util_sum += util
            self._util_samples += 1
        if used_blocks > self.blocks:
            self.blocks, self.utilization_at_peak = used_blocks, util
        self.live_tokens = max(self.live_tokens, live_tokens)
        self.requests = max(self.requests, requests)

    @property
    def mean_utilization(self) -> float:
        return self._util_sum / self._util_samples if self._util_samples else 1.0


def usage_snapshot(kv: KVCacheManager) -> KVCacheStats:
    """The manager's figures now: the pool, its requests' records, the prefix cache, the tiers."""
    holders = kv.holders()
    tail_runs = kv.tails.num_held
    offload, peaks = kv.offload, kv.peaks
    return KVCacheStats(
        block_size=kv.block_size,
        num_blocks=kv.pool.num_usable_blocks,
        blocks_used=kv.pool.num_used_blocks,
        blocks_free=kv.pool.num_free_blocks,
        blocks_cached=kv.pool.num_cached_blocks,
        live_tokens=kv.physical_tokens,
        allocated_slots=kv.table_blocks_used * kv.block_size,
        num_requests=len(holders),
        logical_tokens=kv.logical_tokens,
        peak_blocks_used=peaks.blocks,
        peak_live_tokens=peaks.live_tokens,
        peak_num_requests=peaks.requests,
        utilization_at_peak=peaks.utilization_at_peak,
        mean_utilization=peaks.mean_utilization,
        per_request_blocks={rid: sum(map(len, record.live_tables())) for rid, record in holders.items()},
        prefix_cache=kv.prefix_cache.stats(),
        tail_slots_used=tail_runs,
        tail_blocks_used=tail_runs * kv.tail_blocks,
        tiers=offload.stats(),
        swaps_out=offload.num_swaps_out, swaps_in=offload.num_swaps_in, swap_fallbacks=offload.num_swap_fallbacks,
        num_swapped=sum(1 for record in kv.requests.values() if record.swapped is not None),
        groups=_group_usage(kv),
        evicted_tokens=kv.num_evicted_tokens,
        evicted_tokens_now=sum(record.evicted for record in holders.values()),
    )


def _group_usage(kv: KVCacheManager) -> list[KVGroupStats]:
    """Per group: the blocks its tables hold (a shared block once) and the tokens they store."""
    held: list[set[int]] = [set() for _ in kv.groups]
    tokens = [0] * len(kv.groups)
    for record in kv.holders().values():
        for group, (live, first) in enumerate(zip(record.live_tables(), record.num_released, strict=True)):
            held[group].update(block.block_id for block in live)
            tokens[group] += record.num_tokens - first * kv.block_size
    return [KVGroupStats(spec.kind, spec.sliding_window, len(ids), count)
            for spec, ids, count in zip(kv.groups, held, tokens, strict=True)]
