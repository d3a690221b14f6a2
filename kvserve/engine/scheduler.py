"""Continuous batching with chunked prefill and recompute preemption.

Each step spends a token budget (max_num_batched_tokens) over at most max_num_seqs
requests: running requests first (a decode costs one token, an unfinished prompt a chunk),
then waiting requests in arrival order. When the pool runs dry the most recently arrived
running request is preempted: its blocks are freed and it goes back to the front of the
queue, to be recomputed (prompt + tokens generated so far) later. Nothing is dropped.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass

from kvserve.cache.kv_cache_manager import KVCacheManager
from kvserve.engine.request import Request, RequestStatus


@dataclass(slots=True)
class ScheduledChunk:
    request: Request
    num_tokens: int  # tokens computed for this request this step

    @property
    def completes_sequence(self) -> bool:
        """True if after this step every known token is in the cache, so we sample."""
        return self.request.num_computed_tokens + self.num_tokens == self.request.num_tokens


class Scheduler:
    def __init__(self, kv_manager: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.kv = kv_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # sorted by arrival_seq: the last is the newest

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt_newest(self) -> Request:
        victim = self.running.pop()
        self.kv.free(victim.request_id)
        self.kv.num_preemptions += 1
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        victim.status = RequestStatus.WAITING
        self.waiting.appendleft(victim)
        return victim

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.kv.allocate_slots(request.request_id, request.num_computed_tokens + n):
                preempted = True
                if self._preempt_newest() is request:
                    break
            else:
                chunks.append(ScheduledChunk(request, n))
                budget -= n
                i += 1
                continue
            break  # the request itself was preempted; everything after it is gone too
        # Admit waiting requests only when nobody had to be preempted this step.
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self.kv.allocate_slots(request.request_id, request.num_computed_tokens + n):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=lambda r: r.arrival_seq)
            chunks.append(ScheduledChunk(request, n))
            budget -= n
        return chunks

    def finish(self, request: Request, reason: str) -> None:
        """Mark finished and release its blocks at once (finished or aborted)."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        self.kv.free(request.request_id)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
