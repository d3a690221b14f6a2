"""The kv-aware router's picture of the cluster: which replica probably holds which prompt
prefix, and the rule that weighs that against load.

The index is approximate, as SGLang's router and llm-d's approximate scorer are: it records
the chained block keys of the prompts it *sent* to each replica (the keys the replica's prefix
cache uses), not what the replica really kept. Each replica's record is an LRU list bounded by
``capacity_blocks`` (about the replica's pool), so the index forgets in roughly the order the
replica evicts; replicas may also report evictions (``forget``).

With a store every replica reads (``--kv-offload-remote``), a block computed anywhere is written
there once its step is done, so the index also keeps one shared LRU list, filled as requests
complete (by then their blocks were computed and written): a prefix in it is a hit on every
replica, which then competes on load, the replica's own pool breaking ties.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import NamedTuple

ReplicaKey = str  # a replica's id


class PrefixIndex:
    """Per replica, an LRU set of block keys, and with ``shared_capacity_blocks`` one more for the
    shared store. Invariant: every set holds at most its capacity, the most recently routed last."""

    def __init__(self, capacity_blocks: int, shared_capacity_blocks: int = 0) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        if shared_capacity_blocks < 0:
            raise ValueError(f"shared_capacity_blocks must be >= 0, got {shared_capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self.shared_capacity_blocks = shared_capacity_blocks
        self._blocks: dict[ReplicaKey, OrderedDict[bytes, None]] = {}
        self._shared: OrderedDict[bytes, None] = OrderedDict()

    @property
    def replicas(self) -> list[ReplicaKey]:
        return list(self._blocks)

    def size(self, replica: ReplicaKey) -> int:
        return len(self._blocks.get(replica, ()))

    def sync(self, replicas: Iterable[ReplicaKey]) -> None:
        """Track exactly ``replicas``: new ones start empty, gone ones are dropped."""
        wanted = set(replicas)
        for gone in set(self._blocks) - wanted:
            del self._blocks[gone]
        for new in wanted - set(self._blocks):
            self._blocks[new] = OrderedDict()

    def matched_blocks(self, replica: ReplicaKey, keys: list[bytes]) -> int:
        """How many of ``keys``' leading blocks ``replica`` is believed to hold in its own pool."""
        return _leading(self._blocks.get(replica), keys)

    def shared_blocks(self, keys: list[bytes]) -> int:
        """How many of ``keys``' leading blocks the shared store is believed to hold (0 without one)."""
        return _leading(self._shared, keys)

    def insert(self, replica: ReplicaKey, keys: list[bytes]) -> None:
        """``replica`` was sent a prompt with these block keys: they become its most recent."""
        _touch(self._blocks.setdefault(replica, OrderedDict()), keys, self.capacity_blocks)

    def insert_shared(self, keys: list[bytes]) -> None:
        """A request with these block keys completed: the shared store holds them (no-op without one)."""
        if self.shared_capacity_blocks:
            _touch(self._shared, keys, self.shared_capacity_blocks)

    def forget(self, replica: ReplicaKey, keys: Iterable[bytes]) -> None:
        """``replica`` reports it evicted these blocks."""
        held = self._blocks.get(replica)
        if held is not None:
            for key in keys:
                held.pop(key, None)


def _leading(held: OrderedDict[bytes, None] | None, keys: list[bytes]) -> int:
    if not held:
        return 0
    count = 0
    for key in keys:  # chained keys: a miss ends the shared prefix
        if key not in held:
            break
        count += 1
    return count


def _touch(held: OrderedDict[bytes, None], keys: list[bytes], capacity: int) -> None:
    for key in keys:
        held[key] = None
        held.move_to_end(key)
    while len(held) > capacity:
        held.popitem(last=False)


class Load(NamedTuple):
    """A replica's load as the router sees it: requests queued or running there, and the share
    of its KV pool in use (from its last routing stats)."""

    requests: float
    kv_usage: float = 0.0


class Route(NamedTuple):
    replica: ReplicaKey
    matched_blocks: int
    # "affinity": longest cached prefix, in the replica's pool; "shared": as long a prefix, read
    # from the shared store; "balance-requests" / "balance-kv": affinity lost to the request or
    # the KV-usage bound; "spread": no prefix held
    reason: str


def choose_replica(index: PrefixIndex, keys: list[bytes], loads: dict[ReplicaKey, Load],
                   max_request_imbalance: float, max_kv_imbalance: float,
                   last_chosen: dict[ReplicaKey, int] | None = None) -> Route:
    """The replica with the longest expected cached prefix (its own pool's, or the shared
    store's, which every replica reads: then the least-loaded one, its own blocks breaking ties),
    unless its load exceeds the
    least-loaded replica's by more than ``max_request_imbalance`` requests or
    ``max_kv_imbalance`` of KV usage (balance beats affinity): then the least-loaded one. Without
    a match, the replicas within those bounds take turns: the one chosen least recently
    (``last_chosen``: a sequence number per replica; never chosen counts as oldest). Sending such
    requests to the least-loaded replica instead sent each replacement in a closed loop to the
    replica whose request had just finished, so a replica's requests were prefilled together and
    finished together (on random prompts: TTFT p50 3x round-robin's, 0.9x its throughput).
    ``loads`` must not be empty."""
    if not loads:
        raise ValueError("no replica to choose from")
    least_requests = min(load.requests for load in loads.values())
    least_kv = min(load.kv_usage for load in loads.values())

    def recency(replica: ReplicaKey) -> int:
        return (last_chosen or {}).get(replica, -1)

    def over(replica: ReplicaKey) -> str | None:
        """Which bound ``replica``'s load breaks, if any."""
        if loads[replica].requests - least_requests > max_request_imbalance:
            return "balance-requests"
        if loads[replica].kv_usage - least_kv > max_kv_imbalance:
            return "balance-kv"
        return None

    shared = index.shared_blocks(keys)
    own = {replica: index.matched_blocks(replica, keys) for replica in loads}
    reach = {replica: max(own[replica], shared) for replica in loads}
    best = max(loads, key=lambda r: (reach[r], -loads[r].requests, own[r], -loads[r].kv_usage, -recency(r)))
    if reach[best] == 0:  # the least-loaded replica is always within the bounds
        return Route(min((r for r in loads if over(r) is None), key=recency), 0, "spread")
    bound = over(best)
    if bound is None:
        return Route(best, reach[best], "affinity" if own[best] == reach[best] else "shared")
    lightest = min(loads.values())
    by_load = min((r for r in loads if loads[r] == lightest), key=recency)
    return Route(by_load, reach[by_load], bound)
