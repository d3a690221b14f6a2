"""Retention policies: how one KV cache group keeps a request's blocks as its sequence grows.

One policy class per way of keeping KV, as vLLM v1 has one single-type manager per attention
kind: every earlier block (full attention), the blocks a sliding window still reaches, an
attention-sink prefix plus a recent window (StreamingLLM), or a selection copied into private
blocks (SnapKV's kept tokens). ``retention_for`` picks the policy from a group's spec and the
request's eviction setting; the KVCacheManager asks the policy, never the spec, which blocks a
request needs, which cached blocks a hit must find and what it may give back.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar, NamedTuple

from kvserve.cache.kv_groups import KVCacheSpec, cdiv


class StreamingWindow(NamedTuple):
    """StreamingLLM's cache (Xiao et al. 2023): the blocks of the first ``sink_tokens`` tokens
    (the attention sinks) and those of the last ``window`` tokens; the blocks between are
    evicted as the sequence grows (Streaming.evict). A query sees the sinks and its last
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


class RetentionPolicy(ABC):
    """How one group keeps one request's blocks. Invariants the manager relies on: the entries
    before ``first_live_block`` of the next query are never read again (the manager puts the null
    block there and frees them); ``blocks_held`` bounds the blocks a table holds at once; a
    policy that does not ``share`` never publishes a block nor starts from a cached one."""

    shares: ClassVar[bool] = True  # its full blocks are published and its prefix hits reused

    def first_live_block(self, first_query: int, block_size: int) -> int:
        """The first block a query at position >= ``first_query`` still reads."""
        return 0

    @abstractmethod
    def blocks_held(self, num_tokens: int, block_size: int, chunk: int = 1) -> int:
        """Blocks a sequence holds at its peak while it computes up to ``num_tokens`` positions
        in chunks of at most ``chunk`` tokens."""

    def blocks_to_evict(self, first_query: int, evicted: int, block_size: int) -> int:
        """Blocks between the kept ends of the table to evict before a query at absolute
        ``first_query``, for a request that has evicted ``evicted`` tokens so far (only
        streaming evicts)."""
        return 0

    def lookahead_room(self, first_query: int, evicted: int, block_size: int) -> int | None:
        """How many positions past ``first_query`` a chunk may carry (speculative drafts); None:
        this policy sets no bound."""
        return None

    def longest_hit(self, length: int, block_size: int, cached: Callable[[int], bool]) -> int:
        """The longest cached prefix of at most ``length`` blocks this group can start from, given
        which of its blocks are ``cached``: every block the next query reads must be."""
        while length > 0:
            gaps = [i for i in range(self.first_live_block(length * block_size, block_size), length)
                    if not cached(i)]
            if not gaps:
                return length
            length = max(gaps)  # nothing at or past a missing block can end a hit
        return 0


class FullAttention(RetentionPolicy):
    """Every block, for as long as the request lives."""

    def blocks_held(self, num_tokens: int, block_size: int, chunk: int = 1) -> int:
        return cdiv(num_tokens, block_size)

    def longest_hit(self, length: int, block_size: int, cached: Callable[[int], bool]) -> int:
        return next((i for i in range(length) if not cached(i)), length)  # an unbroken prefix


class SlidingWindow(RetentionPolicy):
    """The blocks the spec's window reaches (KVCacheSpec: the last ``sliding_window`` positions,
    the query's own included); earlier ones are released as the sequence grows, and a hit needs
    only the next query's window."""

    def __init__(self, spec: KVCacheSpec) -> None:
        self.spec = spec

    def first_live_block(self, first_query: int, block_size: int) -> int:
        return self.spec.first_live_block(first_query, block_size)

    def blocks_held(self, num_tokens: int, block_size: int, chunk: int = 1) -> int:
        return self.spec.blocks_held(num_tokens, block_size, chunk)


class Compacted(FullAttention):
    """SnapKV's kept tokens, copied into private blocks: held whole, never shared (each head
    kept its own selection, so no other request's prefix matches them)."""

    shares = False


class Streaming(RetentionPolicy):
    """StreamingLLM: the sink blocks and the window's; the blocks between are evicted before each
    step (``evict``). Never shared: the sink blocks' keys are turned in place."""

    shares = False

    def __init__(self, window: StreamingWindow) -> None:
        self.window = window

    def blocks_held(self, num_tokens: int, block_size: int, chunk: int = 1) -> int:
        return min(cdiv(num_tokens, block_size), self.window.blocks_held(block_size, chunk))

    def blocks_to_evict(self, first_query: int, evicted: int, block_size: int) -> int:
        """The blocks between the sinks and the window."""
        sinks = self.window.sink_blocks(block_size)
        return max(0, (first_query - self.window.window + 1) // block_size - sinks - evicted // block_size)

    def lookahead_room(self, first_query: int, evicted: int, block_size: int) -> int:
        """So that each of a chunk's queries sees the very blocks it would see decoding one token
        a step: none of them is due an eviction that the first query's is not."""
        evicted += self.blocks_to_evict(first_query, evicted, block_size) * block_size  # as the hook will
        last = (self.window.sink_blocks(block_size) + evicted // block_size + 1) * block_size + self.window.window - 2
        return max(0, last - first_query)


def retention_for(spec: KVCacheSpec, window: StreamingWindow | None = None,
                  compacted: bool = False) -> RetentionPolicy:
    """The policy for a group of ``spec`` and a request that streams with ``window`` (its
    full-attention group; sliding groups keep their own windows) or was compacted (only on a
    full-attention group)."""
    if compacted and spec.sliding_window:
        raise ValueError("compaction takes a full-attention group")
    if compacted:
        return Compacted()
    if spec.sliding_window:
        return SlidingWindow(spec)
    return Streaming(window) if window is not None else FullAttention()
