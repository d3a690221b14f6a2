"""Ray Serve request routers for kvserve replicas: ``round-robin``, ``power-of-two`` (Ray's
default) and ``kv-aware`` (prefix affinity, bounded by load).

Ray calls ``choose_replicas`` for one pending request and tries the returned ranks in order; a
replica at its ``max_ongoing_requests`` rejects and the next rank is tried. Round-robin and
kv-aware honour the request's ``exclude`` (replicas that answered busy) unless it would leave
none.
Routers run in the ingress's process; their counters live in ``router_metrics``, which the
ingress's /metrics appends.
"""

from __future__ import annotations

import itertools
from typing import Any

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from kvserve.cluster import router_metrics
from kvserve.cluster.asgi import ForwardedRequest
from kvserve.cluster.config import MAX_KV_IMBALANCE, MAX_REQUEST_IMBALANCE, ROUTER_NAMES
from kvserve.cluster.prefix_index import Load, PrefixIndex, Route, choose_replica


def short_id(replica: RunningReplica) -> str:
    return str(replica.replica_id.unique_id)


def forwarded(pending: PendingRequest | None) -> ForwardedRequest | None:
    if pending is None:
        return None
    for arg in pending.args:
        if isinstance(arg, ForwardedRequest):
            return arg
    return None


def eligible(candidates: list[RunningReplica], pending: PendingRequest | None) -> list[RunningReplica]:
    """The candidates, less those the request asks to avoid (all of them if it would avoid all),
    in a stable order."""
    request = forwarded(pending)
    ordered = sorted(candidates, key=short_id)
    if request is None or not request.exclude:
        return ordered
    kept = [r for r in ordered if short_id(r) not in request.exclude]
    return kept or ordered


class RoundRobinRouter(RequestRouter):
    """Each request to the next replica in turn; the rest in turn order as fallback ranks."""

    def initialize_state(self, **kwargs: Any) -> None:
        self._turn = itertools.count()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        ordered = eligible(candidate_replicas, pending_request)
        if not ordered:
            return []
        first = next(self._turn) % len(ordered)
        rotated = ordered[first:] + ordered[:first]
        return [[rotated[0]], rotated[1:]] if len(rotated) > 1 else [rotated]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: Any, result: Any) -> None:
        router_metrics.ROUTED.labels("round-robin", str(replica_id.unique_id), "turn").inc()


class PowerOfTwoRouter(PowerOfTwoChoicesRequestRouter):
    """Ray's default, as it is (two random replicas, the shorter queue; it picks among all
    replicas, so a busy replica is avoided by its queue length, not by exclude), counted."""

    def on_request_routed(self, pending_request: PendingRequest, replica_id: Any, result: Any) -> None:
        router_metrics.ROUTED.labels("power-of-two", str(replica_id.unique_id), "shorter-queue").inc()


class KVAwareRouter(RequestRouter):
    """Longest expected cached prefix first (PrefixIndex over the block keys the ingress
    computed), unless that replica is busier than the least-loaded one by more than
    ``max_request_imbalance`` requests or ``max_kv_imbalance`` KV usage; requests with no cached
    prefix take turns over the replicas within those bounds (see ``choose_replica``). With
    ``shared_store`` (the replicas share a remote KV store) a prefix routed anywhere counts on
    every replica, so such requests go to the least-loaded one."""

    def initialize_state(self, max_request_imbalance: float = MAX_REQUEST_IMBALANCE,
                         max_kv_imbalance: float = MAX_KV_IMBALANCE,
                         index_capacity_blocks: int = 65536, shared_store: bool = False, **kwargs: Any) -> None:
        self.max_request_imbalance = max_request_imbalance
        self.max_kv_imbalance = max_kv_imbalance
        # the shared store outlasts any one pool: remember more of it
        self.index = PrefixIndex(index_capacity_blocks, 4 * index_capacity_blocks if shared_store else 0)
        # request id -> the route it is counted against, from its choice until it completes. The
        # load of a replica is the number of such requests: counted when chosen, not when routed,
        # since Ray may call choose_replicas for the next request before routing this one, and
        # not from Ray's cached queue lengths, which lag by seconds.
        self._charged: dict[str, Route] = {}
        # request id -> its prompt's block keys, counted in the shared store once it completes
        # (counting them at routing time sent a burst on one new prefix to every replica at once,
        # each reading blocks not yet written and computing them)
        self._unshared: dict[str, list[bytes]] = {}
        self._load: dict[str, int] = {}
        self._choices = itertools.count()
        self._last_chosen: dict[str, int] = {}  # unmatched requests and ties take the one chosen least recently

    def _charge(self, request_id: str, route: Route | None) -> None:
        """Count ``request_id`` against ``route``'s replica (None: against none any more)."""
        previous = self._charged.pop(request_id, None)
        if previous is not None:
            self._load[previous.replica] -= 1
        if route is not None:
            self._charged[request_id] = route
            self._load[route.replica] = self._load.get(route.replica, 0) + 1

    def _loads(self, replicas: list[RunningReplica]) -> dict[str, Load]:
        """Requests chosen for each replica and not completed; KV usage from its last routing stats."""
        return {short_id(r): Load(float(self._load.get(short_id(r), 0)),
                                  float((r.routing_stats or {}).get("kv_usage", 0.0))) for r in replicas}

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        ordered = eligible(candidate_replicas, pending_request)
        if not ordered:
            return []
        self.index.sync(short_id(r) for r in self.curr_replicas.values())
        request_id = pending_request.metadata.internal_request_id if pending_request is not None else None
        chosen = self._charged.get(request_id) if request_id is not None else None
        if chosen is not None and any(short_id(r) == chosen.replica for r in ordered):
            # Ray asks again when its probe of the chosen replica went unanswered: the same answer
            # (a new choice here once sent every request of a test run to the fastest replica)
            return [[next(r for r in ordered if short_id(r) == chosen.replica)]]
        request = forwarded(pending_request)
        keys = list(request.block_keys) if request is not None else []
        route = choose_replica(self.index, keys, self._loads(ordered), self.max_request_imbalance,
                               self.max_kv_imbalance, self._last_chosen)
        self._last_chosen[route.replica] = next(self._choices)
        if request_id is not None:
            self._charge(request_id, route)
        # one rank: when Ray's probe of the chosen replica goes unanswered it asks again instead of
        # falling through to the others
        return [[next(r for r in ordered if short_id(r) == route.replica)]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: Any, result: Any) -> None:
        replica = str(replica_id.unique_id)
        request_id = pending_request.metadata.internal_request_id
        chosen = self._charged.get(request_id)
        if chosen is None or chosen.replica != replica:
            chosen = Route(replica, 0, "fallback")
            self._charge(request_id, chosen)
        router_metrics.ROUTED.labels("kv-aware", replica, chosen.reason).inc()
        request = forwarded(pending_request)
        if request is not None and request.block_keys:
            keys = list(request.block_keys)
            router_metrics.PROMPT_BLOCKS.inc(len(keys))
            router_metrics.MATCHED_BLOCKS.inc(max(self.index.matched_blocks(replica, keys),
                                                  self.index.shared_blocks(keys)))
            self.index.insert(replica, keys)
            if self.index.shared_capacity_blocks:
                self._unshared[request_id] = keys

    def on_request_completed(self, replica_id: Any, internal_request_id: str) -> None:
        self._charge(internal_request_id, None)
        keys = self._unshared.pop(internal_request_id, None)
        if keys is not None:
            self.index.insert_shared(keys)

ROUTERS: dict[str, type[RequestRouter]] = {"round-robin": RoundRobinRouter, "power-of-two": PowerOfTwoRouter,
                                           "kv-aware": KVAwareRouter}
assert set(ROUTERS) == set(ROUTER_NAMES)
