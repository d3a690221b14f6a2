"""Physical KV blocks: reference counts, an O(1) free queue, and the prefix cache's map from
content keys to blocks.

Block 0 is the *null block*: it is never handed out and its slots stay zero, so padded
gathers in the attention op can point at it without reading uninitialised memory.

Prefix caching: a full block may carry a *block hash*, a key chained over every token up to
and including its own (see kv_cache_manager.hash_block). A hashed block whose ref count drops
to 0 stays in the map and in the free queue: it can be revived by a later request with the same
prefix, or evicted — least recently freed first — when a new block is needed.
"""

from __future__ import annotations

from collections.abc import Callable


class KVCacheBlock:
    """One physical block of ``block_size`` token slots in every layer's K and V."""

    __slots__ = ("block_hash", "block_id", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None  # set while the block is in the prefix cache
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks with O(1) popleft, append and remove.

    Invariant: a block is in the queue exactly when its ref_cnt is 0. Blocks are taken
    from the front and returned to the back, so the front holds the least recently freed
    block (the natural LRU order for prefix-cache eviction).
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is None or block is self._tail:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev_block, next_block = block.prev_free, block.next_free
        if prev_block is None or next_block is None:
            raise ValueError(f"{block} is not in the free queue")
        prev_block.next_free = next_block
        next_block.prev_free = prev_block
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """To the back: taken last (a cached block, kept as long as possible)."""
        last = self._tail.prev_free
        assert last is not None
        self._insert_after(last, block)

    def appendleft(self, block: KVCacheBlock) -> None:
        """To the front: taken first (a block with nothing worth keeping)."""
        self._insert_after(self._head, block)

    def _insert_after(self, prev_block: KVCacheBlock, block: KVCacheBlock) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"{block} is already in the free queue")
        next_block = prev_block.next_free
        assert next_block is not None
        prev_block.next_free = block
        block.prev_free = prev_block
        block.next_free = next_block
        next_block.prev_free = block
        self.num_free_blocks += 1

    def __iter__(self):  # type: ignore[no-untyped-def]
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    """Owns every block. Only the KVCacheManager talks to it.

    Invariants: ref_cnt >= 0; a block with ref_cnt > 0 is not in the free queue;
    num_free_blocks + blocks in use == num_blocks - 1 (the null block is in neither);
    num_shared_refs == sum(ref_cnt - 1) over blocks in use;
    cached_blocks[h].block_hash == h, and a block with a hash is in cached_blocks.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"a block pool needs at least 2 blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1  # pinned forever
        self.free_queue = FreeKVCacheBlockQueue(self.blocks[1:])
        self.cached_blocks: dict[bytes, KVCacheBlock] = {}
        self.num_evictions = 0
        # references beyond the first on blocks in use: each is a full, shared prefix block that
        # several tables count, so physical tokens = logical tokens - block_size * this
        self.num_shared_refs = 0
        self._next_run = 0  # get_aligned_run's next-fit cursor
        # called with (block hash, block id) when a published block is evicted, before its
        # content is overwritten: the manager demotes it to a lower tier
        self.on_evict: Callable[[bytes, int], None] | None = None
        # Never-used blocks leave the queue in id order (freed ones go to the back), so every
        # block with an id above this has never held data.
        self.max_block_id_used = 0

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - self.num_free_blocks

    def get_new_blocks(self, count: int) -> list[KVCacheBlock]:
        """Take ``count`` free blocks (ref_cnt becomes 1). Raises if the pool is short."""
        if count > self.num_free_blocks:
            raise ValueError(f"asked for {count} blocks, only {self.num_free_blocks} free")
        return [self._claim(self.free_queue.popleft()) for _ in range(count)]

    def _claim(self, block: KVCacheBlock) -> KVCacheBlock:
        """A block just taken off the free queue now has one holder; a cached prefix in it is evicted."""
        if block.block_hash is not None:  # evict: its content is about to be overwritten
            del self.cached_blocks[block.block_hash]
            if self.on_evict is not None:
                self.on_evict(block.block_hash, block.block_id)
            block.block_hash = None
            self.num_evictions += 1
        block.ref_cnt = 1
        self.max_block_id_used = max(self.max_block_id_used, block.block_id)
        return block

    def get_aligned_run(self, length: int, avoid: set[int]) -> list[KVCacheBlock] | None:
        """Take ``length`` free blocks with consecutive ids, the first a multiple of ``length``
        (a sequence's tail slot, see kv_format.tail_blocks), none in ``avoid``; runs holding no
        cached prefix are preferred to evicting one. None if no such run is free."""
        fallback: list[KVCacheBlock] | None = None
        starts = range(length, self.num_blocks - length + 1, length)  # run 0 holds the null block
        if not starts:
            return None
        first = self._next_run % len(starts)  # next fit: resume where the last search ended
        for i in range(len(starts)):
            index = (first + i) % len(starts)
            run = self.blocks[starts[index] : starts[index] + length]
            if any(block.ref_cnt or block.block_id in avoid for block in run):
                continue
            if all(block.block_hash is None for block in run):
                fallback, self._next_run = run, index + 1
                break
            if fallback is None:
                fallback, self._next_run = run, index + 1
        if fallback is None:
            return None
        for block in fallback:
            self.free_queue.remove(block)
        return [self._claim(block) for block in fallback]

    def free_blocks(self, blocks: list[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching zero return to the queue.

        Callers pass a sequence's blocks tail-first so that, in LRU order, the end of a
        chain is evicted before its beginning. Blocks without a hash go to the front: they hold
        nothing reusable, so they are taken before any cached block is evicted.
        """
        for block in blocks:
            if block.ref_cnt <= 0 or block is self.null_block:
                raise ValueError(f"double free of {block}")
            if block.ref_cnt > 1:
                self.num_shared_refs -= 1
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    # ------------------------------------------------------------------ prefix cache

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached_blocks)

    def cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached_blocks.get(block_hash)

    def cache_block(self, block: KVCacheBlock, block_hash: bytes) -> None:
        """Publish a full block under its key, unless an equal block is already published
        (then this copy simply stays private)."""
        if block.block_hash is None and block_hash not in self.cached_blocks:
            block.block_hash = block_hash
            self.cached_blocks[block_hash] = block

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take a reference on cached blocks a new request reuses; idle ones leave the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            else:
                self.num_shared_refs += 1
            block.ref_cnt += 1
