"""The typed contract of one step: what the scheduler decided and everything the model runner
needs to run it (as vLLM v1's sched/output.py). The runner reads these and nothing else of the
scheduler's or the KV manager's state."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from kvserve.cache.kv_plan import RequestBlocks, StorageWork
from kvserve.engine.request import Request


@dataclass(slots=True)
class ScheduledChunk:
    request: Request
    num_tokens: int  # tokens computed for this request this step (drafts included)
    draft_token_ids: list[int] = field(default_factory=list)  # speculative tokens verified after the real ones
    # its block tables after this step's allocations (KVCacheManager.blocks_of); set by whoever
    # schedules the chunk, before the runner reads it
    blocks: RequestBlocks | None = None

    @property
    def completes_sequence(self) -> bool:
        """True if after this step every known token is in the cache, so we sample."""
        real = self.num_tokens - len(self.draft_token_ids)
        return self.request.num_computed_tokens + real == self.request.num_tokens

    @property
    def kv(self) -> RequestBlocks:
        assert self.blocks is not None, "a chunk's blocks are set when it is scheduled"
        return self.blocks

    @property
    def cache_len(self) -> int:
        """Its sequence's length in the cache after this step: the absolute length less the
        tokens eviction or compaction took out (rotary positions stay absolute)."""
        return self.request.num_computed_tokens + self.num_tokens - self.kv.evicted


class StepPlan(NamedTuple):
    """One step. The engine prepares ``storage`` (zeroing and tier copies, before anything reads
    the pool), runs ``chunks`` (each with its block tables), and counts ``preempted``."""

    chunks: list[ScheduledChunk]
    preempted: list[Request]  # recomputed or swapped out this step, newest first; none of them runs
    storage: StorageWork

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.chunks)
