"""The pool's lower tiers, as the KVCacheManager sees them: which content keys tier 1 (host
memory, kv_tiers) and the stores below it (block_store: disk, kv_disk; a server shared by
replicas, kv_remote) hold, the copies a step must run, and swap preemption's reserved slots. The
bytes move in the PagedKVCache (run_tier_moves), once a step."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import torch

from kvserve.cache.block_pool import BlockPool, KVCacheBlock
from kvserve.cache.block_store import BlockStore
from kvserve.cache.kv_tiers import TierIndex, TierMoves, TierStats

STORE_LOADED_BYTES = 256 << 20  # lower-store blocks kept verified between steps
# a block the lower stores lacked is not asked for again for this long (unless this engine hands
# it down meanwhile): a request whose blocks were read in several reads sees them all answered
MISS_MEMORY_S = 2.0
Read = tuple[Future[dict[bytes, torch.Tensor]], list[bytes]]  # a read under way and the keys it reads
logger = logging.getLogger("kvserve")


class OffloadManager:
    """Invariants: a key is in the pool's prefix cache or in tier 1, never both (exclusive
    tiers); a block in a lower store is read and verified before it counts as a hit, and a bad
    one is a miss; a slot reserved for a swapped-out request is released exactly once (swapped back in,
    or its request freed)."""

    def __init__(self, host_tier: TierIndex | None = None, stores: list[BlockStore] | None = None) -> None:
        """``stores``: below tier 1, asked in order (they keep what tier 1 drops)."""
        self.host_tier = host_tier
        self.stores = list(stores or []) if host_tier is not None else []
        # verified lower-store blocks, until promoted: kept across steps (oldest dropped past
        # STORE_LOADED_BYTES), so a request that waits for room does not read its hits again each step
        self._store_loaded: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # key -> payload
        # reads run on a loader thread while steps compute; results join _store_loaded on the
        # engine thread (collect), so only the engine thread touches it
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvserve-store-reads") if self.stores else None
        self._reads: list[Read] = []
        self._reading: set[bytes] = set()  # the keys of the reads under way
        self._missed: OrderedDict[bytes, float] = OrderedDict()  # key -> when the stores lacked it
        self.num_swaps_out = self.num_swaps_in = self.num_swap_fallbacks = 0
        self._shares = any(store.shared for store in self.stores)
        self._published: list[tuple[int, bytes]] = []  # (pool block, key) published this step, for shared stores

    def attach(self, pool: BlockPool, prefix_caching: bool) -> None:
        """Published blocks the pool evicts go down to tier 1 (with prefix caching on)."""
        if self.host_tier is not None and prefix_caching:
            pool.on_evict = self.host_tier.demote

    def holds(self, key: bytes) -> bool:
        """In tier 1, or read and verified from a lower store by ``prefetch`` (which the prefix
        cache calls first; a bad block is a miss)."""
        if self.host_tier is not None and key in self.host_tier:
            return True
        if key in self._store_loaded:
            self._store_loaded.move_to_end(key)
            return True
        return False

    def prefetch(self, keys: list[bytes]) -> bool:
        """Start reading the lower stores' blocks among ``keys`` (those tier 1 lacks, not read
        already, not found missing within MISS_MEMORY_S) on the loader thread, in one request per store
        (one network round trip for a remote store, not one per block). True once no key of
        ``keys`` is still being read: ``holds`` then answers from what was read."""
        now = time.monotonic()
        while self._missed and now - next(iter(self._missed.values())) > MISS_MEMORY_S:
            self._missed.popitem(last=False)
        self._collect()
        wanted = [key for key in keys if key not in self._store_loaded and key not in self._reading
                  and key not in self._missed and (self.host_tier is None or key not in self.host_tier)]
        if wanted and self._loader is not None:
            self._reads.append((self._loader.submit(self._read, wanted), wanted))
            self._reading.update(wanted)
        return not any(key in self._reading for key in keys)

    def _read(self, keys: list[bytes]) -> dict[bytes, torch.Tensor]:
        """On the loader thread: the blocks the stores hold among ``keys``, asked in order."""
        found: dict[bytes, torch.Tensor] = {}
        for store in self.stores:
            if len(found) == len(keys):
                break
            found.update(store.load_many([key for key in keys if key not in found]))
        return found

    def _collect(self) -> None:
        """Reads that finished: their blocks join the verified ones, their misses are remembered."""
        now = time.monotonic()
        finished: list[Read] = []
        pending: list[Read] = []
        for entry in self._reads:  # one look at each read: it may finish meanwhile
            (finished if entry[0].done() else pending).append(entry)
        self._reads = pending
        for read, keys in finished:
            try:
                self._store_loaded.update(read.result())
            except Exception:  # stores do not raise; if one did, its blocks are misses
                logger.exception("KV lower store: a read failed; its blocks are recomputed")
            self._reading.difference_update(keys)
            self._missed.update((key, now) for key in keys if key not in self._store_loaded)

    @property
    def reading(self) -> bool:
        """Reads from the lower stores are under way."""
        return bool(self._reading)

    def wait_for_reads(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until one of the reads under way finishes: an engine with
        nothing to compute but a request whose blocks are on their way waits here, not spinning."""
        if self._reads:
            wait([read for read, _ in self._reads], timeout_s, return_when=FIRST_COMPLETED)

    def close(self) -> None:
        if self._loader is not None:
            self._loader.shutdown(wait=False)

    def take(self, keys: list[bytes]) -> dict[bytes, int]:
        """Lower-tier hits a new request starts from leave tier 1 now, so that no pool claim can
        demote them out of it: each key's tier-1 slot, or -1 for a block read from a lower store."""
        if self.host_tier is None:
            return {}
        return {key: self.host_tier.take(key) if key in self.host_tier else -1 for key in keys}

    def give_back(self, taken: dict[bytes, int]) -> None:
        """Undo take() (the allocation it was for failed)."""
        for key, slot in taken.items():
            if slot >= 0:
                self.host_tier.give_back(key, slot)  # type: ignore[union-attr]

    def fill(self, block: KVCacheBlock, key: bytes, slot: int) -> None:
        """Copy a taken hit (its tier-1 ``slot``, or -1: the block read from a lower store) into
        pool ``block`` in this step's moves."""
        assert self.host_tier is not None
        if slot >= 0:
            self.host_tier.promote(slot, block.block_id)
        else:
            self.host_tier.load(block.block_id, self._store_loaded.pop(key))

    def published(self, block_id: int, key: bytes) -> None:
        """A block was published: a shared store gets it after the step computes it."""
        if self._shares:
            self._published.append((block_id, key))

    def take_published(self) -> list[tuple[int, bytes]]:
        """The blocks published since the last call (to write to shared stores after the step)."""
        published, self._published = self._published, []
        self._no_longer_missing(published)
        return published

    def _no_longer_missing(self, *handed_down: list[tuple[int, bytes]]) -> None:
        """Blocks (slot or pool block, key) this engine hands down to the stores now: the stores
        will hold them, so a miss remembered for them is forgotten."""
        for blocks in handed_down if self._missed else ():
            for _, key in blocks:
                self._missed.pop(key, None)

    def discard(self, key: bytes) -> None:
        """The pool published ``key`` again: tier 1's copy is dropped (exclusive tiers)."""
        if self.host_tier is not None:
            self.host_tier.discard(key)

    def swap_out(self, blocks: list[KVCacheBlock]) -> list[int] | None:
        """Reserve tier-1 slots for a preempted request's blocks and copy them there in this
        step's moves; None if tier 1 cannot take them (counted: the caller recomputes)."""
        slots = self.host_tier.reserve(len(blocks)) if self.host_tier is not None else None
        if slots is None:
            self.num_swap_fallbacks += 1
            return None
        assert self.host_tier is not None
        for block, slot in zip(blocks, slots, strict=True):
            self.host_tier.save(block.block_id, slot)
        self.num_swaps_out += 1
        return slots

    def swap_in(self, slots: list[int], blocks: list[KVCacheBlock]) -> None:
        """Copy reserved slots back into pool blocks in this step's moves, and release them."""
        assert self.host_tier is not None
        self.host_tier.restore(slots, [block.block_id for block in blocks])
        self.num_swaps_in += 1

    def release(self, slots: list[int]) -> None:
        """A swapped-out request ended: its reserved slots are free."""
        if self.host_tier is not None:
            self.host_tier.release(slots)

    def take_moves(self) -> TierMoves | None:
        """This step's copies between the pool and the tiers (run before the forward pass)."""
        self._trim_store_loaded()  # between steps only: within one, a hit found is still there at fill()
        moves = self.host_tier.take_moves() if self.host_tier is not None else None
        if moves is not None:
            self._no_longer_missing(moves.spills, moves.pool_spills, moves.persist)
        return moves

    def _trim_store_loaded(self) -> None:
        held = sum(payload.numel() for payload in self._store_loaded.values())
        while held > STORE_LOADED_BYTES and self._store_loaded:
            held -= self._store_loaded.popitem(last=False)[1].numel()

    def stats(self) -> list[TierStats]:
        return ([self.host_tier.stats()] if self.host_tier is not None else []) + [s.stats() for s in self.stores]
