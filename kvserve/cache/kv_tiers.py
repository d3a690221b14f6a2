"""Tier 1 of the KV cache: prefix blocks evicted from the pool, kept in host memory in their
stored format (codes and per-block scales, as ``LayerKV.per_block_tensors`` lists them).

The KVCacheManager owns a ``TierIndex`` (which content keys the tier holds, in which slot, in
LRU order, within a capacity in blocks) and decides the moves; the PagedKVCache owns the
``HostBlockStore`` (the bytes); the engine runs them once per step, right after scheduling
(before the forward pass, and in steps that run nothing, so moves never wait across steps):

- **demotion**: a published block the pool evicts is copied to a tier slot instead of lost
  (the tier's least recently used block is dropped when it is full);
- **promotion**: a prefix lookup that runs past the pool's cached blocks continues in the tier;
  each hit gets a fresh pool block, is copied back and published again, and its tier slot is
  freed after the step's copies (exclusive tiers: a key is in the pool or the tier).

Order within a step: demotions first (they read pool blocks that promotions may overwrite), then
promotions (they read slots that no demotion of the same step may reuse: freed slots are only
recycled after the moves ran).
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from typing import NamedTuple

import torch

from kvserve.model.cpu_kernels import cpu_op


class TierStats(NamedTuple):
    name: str
    capacity_bytes: int
    used_bytes: int
    blocks: int  # prefix blocks and swapped-out requests' blocks
    hits: int  # blocks promoted back into the pool (prefill they saved)
    blocks_in: int  # blocks demoted into the tier
    blocks_out: int  # blocks promoted out of it
    evictions: int  # blocks dropped because the tier was full
    discarded: int  # copies dropped because the pool had recomputed the same block
    errors: int = 0  # lower stores: blocks found missing or damaged (recomputed), writes failed or dropped


class TierMoves(NamedTuple):
    """One step's copies between the pool and the tiers, in the order they run."""

    spills: list[tuple[int, bytes]]  # (tier slot, key): tier 1's dropped blocks, read out for tier 2 first
    pool_spills: list[tuple[int, bytes]]  # (pool block id, key): dropped before they even reached tier 1
    demotions: list[tuple[int, int]]  # (pool block id, tier slot)
    persist: list[tuple[int, bytes]]  # (tier slot, key): prefix blocks demoted now, written through to tier 2
    promotions: list[tuple[int, int]]  # (tier slot, pool block id)
    loads: list[tuple[int, torch.Tensor]]  # (pool block id, the payload of a block read from tier 2)


class TierIndex:
    """Which content keys tier 1 holds. Invariants: ``slots`` maps a key to a slot no other key
    has; a slot is in exactly one of ``slots``' values, ``_free`` or ``_released``; the pending
    moves name each slot at most once."""

    def __init__(self, name: str, capacity_blocks: int, block_bytes: int) -> None:
        self.name = name
        self.capacity_blocks = capacity_blocks
        self.block_bytes = block_bytes
        self.slots: OrderedDict[bytes, int] = OrderedDict()  # oldest first
        self._free = list(range(capacity_blocks - 1, -1, -1))
        self._released: list[int] = []  # freed by this step's promotions: reusable after the moves ran
        self._demotions: dict[int, int] = {}  # slot -> pool block id (a later demotion to a slot wins)
        self._demoted_keys: dict[int, bytes] = {}  # slot -> key, for the demotions of prefix blocks
        self._promotions: list[tuple[int, int]] = []
        self._spills: list[tuple[int, bytes]] = []  # LRU blocks dropped this step (tier 2 may keep them)
        self._pool_spills: list[tuple[int, bytes]] = []
        self._loads: list[tuple[int, torch.Tensor]] = []
        self.hits = self.blocks_in = self.blocks_out = self.evictions = self.discarded = 0
        self.num_reserved = 0  # slots holding swapped-out requests' blocks (no key, never evicted)

    def __contains__(self, key: bytes) -> bool:
        return key in self.slots

    def demote(self, key: bytes, block_id: int) -> None:
        """The pool evicts published block ``block_id`` holding ``key``: keep a copy in the tier."""
        if key in self.slots:  # the same content is there already (recomputed, then evicted again)
            self.slots.move_to_end(key)
            return
        if not self._free:
            if not self.slots:
                return  # every slot is being promoted out this step
            slot = self._drop_oldest()
        else:
            slot = self._free.pop()
        self.slots[key] = slot
        self._demotions[slot] = block_id
        self._demoted_keys[slot] = key
        self.blocks_in += 1

    def discard(self, key: bytes) -> None:
        """The pool published ``key`` again (recomputed): the tier's copy is redundant, drop it."""
        slot = self.slots.pop(key, None)
        if slot is not None:
            self._demotions.pop(slot, None)
            self._free.append(slot)
            self.discarded += 1

    def take(self, key: bytes) -> int:
        """``key`` leaves the tier (it is going back to the pool): its slot, still holding the
        bytes until this step's moves ran. Take before claiming pool blocks for it, so that a
        demotion those claims cause cannot drop it."""
        slot = self.slots.pop(key)
        self._released.append(slot)
        return slot

    def give_back(self, key: bytes, slot: int) -> None:
        """Undo take() (the allocation it was for failed): the key is in the tier again."""
        self._released.remove(slot)
        self.slots[key] = slot

    def promote(self, slot: int, block_id: int) -> None:
        """Copy the taken ``slot`` back into pool block ``block_id`` in this step's moves."""
        self._promotions.append((slot, block_id))
        self.hits += 1
        self.blocks_out += 1

    def reserve(self, count: int) -> list[int] | None:
        """``count`` slots for a swapped-out request (dropping LRU prefix blocks to make room), or
        None if even that is not enough (nothing changes then)."""
        if count > len(self._free) + len(self.slots):
            return None
        while len(self._free) < count:
            self._free.append(self._drop_oldest())
        self.num_reserved += count
        return [self._free.pop() for _ in range(count)]

    def _drop_oldest(self) -> int:
        """Drop the least recently used block (to tier 2, if there is one): its slot."""
        key, slot = self.slots.popitem(last=False)
        if slot in self._demotions:  # its bytes have not arrived yet: tier 2 takes them from the pool block
            self._pool_spills.append((self._demotions.pop(slot), key))
        else:
            self._spills.append((slot, key))
        self.evictions += 1
        return slot

    def load(self, block_id: int, payload: torch.Tensor) -> None:
        """Copy a block read from tier 2 (its payload) into pool block ``block_id`` in this step's moves."""
        self._loads.append((block_id, payload))

    def save(self, block_id: int, slot: int) -> None:
        """Copy pool block ``block_id`` into reserved ``slot`` in this step's moves."""
        self._demotions[slot] = block_id
        self._demoted_keys.pop(slot, None)  # a swapped-out block is no prefix to persist

    def restore(self, slots: list[int], block_ids: list[int]) -> None:
        """Copy reserved ``slots`` back into pool blocks; the slots are free after the step."""
        self._promotions.extend(zip(slots, block_ids, strict=True))
        self.release(slots)

    def release(self, slots: list[int]) -> None:
        """Reserved slots are no longer needed (restored, or their request ended)."""
        self.num_reserved -= len(slots)
        self._released.extend(slots)

    def take_moves(self) -> TierMoves:
        """This step's copies, in the order they must run; their slots become reusable."""
        demotions = [(block, slot) for slot, block in self._demotions.items()]
        persist = [(slot, key) for slot, key in self._demoted_keys.items() if slot in self._demotions]
        moves = TierMoves(self._spills, self._pool_spills, demotions, persist, self._promotions, self._loads)
        self._spills, self._pool_spills, self._demotions, self._demoted_keys = [], [], {}, {}
        self._promotions, self._loads = [], []
        self._free.extend(self._released)
        self._released = []
        return moves

    def stats(self) -> TierStats:
        used = len(self.slots) + self.num_reserved
        return TierStats(self.name, self.capacity_blocks * self.block_bytes, used * self.block_bytes,
                         used, self.hits, self.blocks_in, self.blocks_out, self.evictions, self.discarded)


def split_blocks(payloads: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Stacked block payloads ([blocks, payload bytes], uint8; block_store's format) as blocks of
    each of ``like`` (the pool's per-block tensors), one view per tensor: a payload holds them in
    order, each starting at a multiple of its element size."""
    views, offset = [], 0
    for t in like:
        size = t[0].numel() * t.element_size()
        part = payloads[:, offset : offset + size]
        if payloads.stride(0) % t.element_size():  # rows not aligned to the element: copy the part
            part = part.contiguous()
        views.append(part.view(t.dtype).view(len(payloads), *t.shape[1:]))
        offset += size
    return views


class HostBlockStore:
    """The bytes of tier 1: one host tensor per pool per-block tensor, [slots, ...] in the same
    layout and dtype (pinned when the pool is on CUDA, so copies can overlap compute)."""

    def __init__(self, per_block: list[torch.Tensor], capacity_blocks: int) -> None:
        pin = any(t.is_cuda for t in per_block)
        # torch.empty: on CPU, host pages are only committed as blocks are demoted into them
        self.storage = [torch.empty((capacity_blocks, *t.shape[1:]), dtype=t.dtype, pin_memory=pin)
                        for t in per_block]
        # per block promoted (a step's batch, shared out), until drained by the metrics (bounded otherwise)
        self.load_seconds: deque[float] = deque(maxlen=4096)

    def run(self, per_block: list[torch.Tensor], moves: TierMoves) -> None:
        """Demotions (pool -> host), then promotions (host -> pool), batched per tensor, then
        blocks read from tier 2 (spills are read out by the caller before this)."""
        if moves.demotions:
            blocks = torch.tensor([b for b, _ in moves.demotions], dtype=torch.long)
            slots = torch.tensor([s for _, s in moves.demotions], dtype=torch.long)
            for pool, host in zip(per_block, self.storage, strict=True):
                host.index_copy_(0, slots, pool.index_select(0, blocks.to(pool.device)).to(host.device))
        if moves.promotions:
            start = time.perf_counter()
            slots = torch.tensor([s for s, _ in moves.promotions], dtype=torch.long)
            blocks = torch.tensor([b for _, b in moves.promotions], dtype=torch.long)
            for pool, host in zip(per_block, self.storage, strict=True):
                pool.index_copy_(0, blocks.to(pool.device), host.index_select(0, slots).to(pool.device))
            per_block_seconds = (time.perf_counter() - start) / len(moves.promotions)
            self.load_seconds.extend([per_block_seconds] * len(moves.promotions))
        if moves.loads:
            blocks = torch.tensor([b for b, _ in moves.loads], dtype=torch.long)
            payloads = [payload for _, payload in moves.loads]
            copy_in = cpu_op("copy_blocks_in") if all(pool.device.type == "cpu" for pool in per_block) else None
            if copy_in is not None:  # one memcpy per block and tensor, from the payloads in place
                copy_in(per_block, blocks, payloads)
            else:  # one copy per pool tensor for all the step's blocks, not one per block and tensor
                for pool, loaded in zip(per_block, split_blocks(torch.stack(payloads), per_block), strict=True):
                    pool.index_copy_(0, blocks.to(pool.device), loaded.to(pool.device))
