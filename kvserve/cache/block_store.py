"""The KV cache's lower stores (below tier 1 in host memory): what one is, and the sealed block
format they share.

A store keeps prefix blocks by content key (the prefix cache's chained token hash) in their
stored format (an int4 block stays int4, with its scales). Every block is *sealed*: a header with
the store's *namespace* (a digest of everything that decides what a block's bytes mean: model
fingerprint, KV dtype, format version, block size, key-scale mode, layers kept in the model
dtype, the scales file's hash), the block's key, its length and an XXH3-128 checksum of its
bytes. A block is only ever read back when all of these match, so a store shared with another
model, format or replica of another configuration is never misread, and a damaged block is a
miss, not a token. The checksum guards against damage, not against a writer with access to the
store (no unkeyed digest could: such a writer recomputes it); it runs at memory speed, where a
SHA-256 over a document's blocks cost as long as fetching them.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import struct
import threading
import warnings
from collections import deque
from collections.abc import Callable
from typing import Protocol

import torch
import xxhash

from kvserve.cache.kv_tiers import TierStats

MAGIC = b"KVSBLK02"
FORMAT_VERSION = 2  # bump when the stored layout of any KV format changes
HEADER = struct.Struct("<8s32s32sQ16s")  # MAGIC | namespace | key | payload length | XXH3-128 of the payload
# payload_tensor views a store's read-only reply in place: torch warns once that it could write there
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)

logger = logging.getLogger("kvserve")


def namespace(*parts: object) -> str:
    """The digest that keys a store: every part that decides what a block's bytes mean."""
    return hashlib.sha256(repr((FORMAT_VERSION, *parts)).encode()).hexdigest()


def seal(space: bytes, key: bytes, tensors: list[torch.Tensor]) -> bytearray:
    """A block's per-block tensors (on the host), in order, after the header: one copy."""
    size = block_bytes(tensors)
    sealed = bytearray(HEADER.size + size)
    torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors],
              out=torch.frombuffer(sealed, dtype=torch.uint8)[HEADER.size :])
    digest = xxhash.xxh3_128_digest(memoryview(sealed)[HEADER.size :])
    HEADER.pack_into(sealed, 0, MAGIC, space, key, size, digest)
    return sealed


def unseal(space: bytes, key: bytes, payload_bytes: int, data: bytes | bytearray) -> memoryview | None:
    """The payload of a sealed block (a view into ``data``, not a copy), or None unless its
    namespace, key, length and digest all match what is asked for."""
    if len(data) != HEADER.size + payload_bytes:
        return None
    magic, block_space, block_key, length, digest = HEADER.unpack_from(data)
    payload = memoryview(data)[HEADER.size :]
    if (magic, block_space, block_key, length) != (MAGIC, space, key, payload_bytes):
        return None
    return payload if xxhash.xxh3_128_digest(payload) == digest else None


def payload_tensor(payload: memoryview) -> torch.Tensor:
    """A block's payload as a uint8 tensor viewing it in place (no copy). Invariant: nothing
    writes into it (a store's reply may be an immutable ``bytes``); blocks are copied out of it."""
    return torch.frombuffer(payload, dtype=torch.uint8)


Block = tuple[bytes, list[torch.Tensor]]  # a key and its per-block tensors, on the host
WRITE_BATCH = 32  # blocks a writer hands its store at once, at most (a remote store pipelines them)
# bytes of blocks queued for a store, at most: behind a store slower than the steps, writes are
# dropped (counted, logged once per backlog) instead of host memory growing without bound
MAX_PENDING_BYTES = 256 << 20


def block_bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class BackgroundWriter:
    """Writes blocks on a thread of its own, in order, so that a step never waits for a store:
    ``write(blocks)`` runs there with the blocks submitted so far (up to WRITE_BATCH, sealing
    them too); it must not raise. At most ``max_pending_bytes`` of blocks wait; beyond, a block
    is dropped and counted in ``dropped``."""

    def __init__(self, write: Callable[[list[Block]], None], name: str,
                 max_pending_bytes: int = MAX_PENDING_BYTES) -> None:
        self._write = write
        self.name, self.max_pending_bytes = name, max_pending_bytes
        self._queue: queue.Queue[Block | threading.Event | None] = queue.Queue()
        self._lock = threading.Lock()  # owns pending_bytes and dropped
        self.pending_bytes = self.dropped = 0
        self._backlog = False  # dropping since the last block accepted (logged once per backlog)
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, key: bytes, tensors: list[torch.Tensor]) -> bool:
        """Queue a block (its per-block tensors on the host, which nothing may change after);
        False (the block dropped and counted) while the blocks waiting would exceed the bound."""
        size = block_bytes(tensors)
        with self._lock:
            accepted = self.pending_bytes + size <= self.max_pending_bytes
            starts_backlog = not accepted and not self._backlog
            self._backlog = not accepted
            if accepted:
                self.pending_bytes += size
            else:
                self.dropped += 1
        if accepted:
            self._queue.put((key, tensors))
        elif starts_backlog:
            logger.warning("%s: the store falls behind (%d MiB of blocks waiting); blocks are dropped until it "
                           "catches up", self.name, self.pending_bytes >> 20)
        return accepted

    @property
    def pending(self) -> int:
        """Writes submitted and not done yet."""
        return self._queue.unfinished_tasks

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def flush(self) -> None:
        """Wait until every submitted write is done (tests, shutdown)."""
        self._queue.join()

    def written(self) -> threading.Event:
        """An event set once every write submitted before this call is done (writes go in
        order; unlike ``flush`` it does not wait for later ones). Any thread may call it."""
        done = threading.Event()
        self._queue.put(done)
        return done

    def close(self) -> None:
        """Write what is submitted, then stop the thread."""
        self._queue.put(None)
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        while True:
            items = [self._queue.get()]
            while len(items) < WRITE_BATCH and isinstance(items[-1], tuple):  # a batch ends at a marker
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            try:
                blocks = [item for item in items if isinstance(item, tuple)]
                try:
                    if blocks:
                        self._write(blocks)
                except Exception:  # a store's bug must not stop the thread (written() would hang)
                    logger.exception("KV store writer: %d blocks were not written", len(blocks))
                with self._lock:
                    self.pending_bytes -= sum(block_bytes(tensors) for _, tensors in blocks)
                for item in items:
                    if isinstance(item, threading.Event):
                        item.set()
                if items[-1] is None:
                    return
            finally:
                for _ in items:
                    self._queue.task_done()


class WritesInBackground:
    """``flush``, ``written`` and ``close`` for a store whose writes go through ``self._writer``."""

    _writer: BackgroundWriter

    def flush(self) -> None:
        self._writer.flush()

    def written(self) -> threading.Event:
        return self._writer.written()

    def close(self) -> None:
        self._writer.close()


class BlockStore(Protocol):
    """A lower tier. Invariants: ``load_many`` returns a block only if it was put under the same
    namespace and key and its bytes are intact (else it is left out, counted in its stats' errors); ``put``
    never blocks the engine's step (writes go in the background) and a failed write is dropped
    and counted; neither raises when the store's medium fails."""

    name: str  # the tier's label in stats and metrics
    shared: bool  # other engines read it: blocks are written once computed, not only when evicted
    load_seconds: deque[float]  # per block read back, until the metrics drain it

    def load_many(self, keys: list[bytes]) -> dict[bytes, torch.Tensor]:
        """The blocks found among ``keys``, each its payload as a uint8 tensor (kv_tiers.split_blocks
        turns them into pool blocks), read in one request where the store can."""

    def wants(self, key: bytes) -> bool:
        """Whether ``put(key, ...)`` would write: a caller copies a block to the host only then."""

    def put(self, key: bytes, tensors: list[torch.Tensor]) -> None: ...

    def flush(self) -> None: ...

    def written(self) -> threading.Event:
        """Set once every block ``put`` before this call is written or dropped (any thread)."""

    def close(self) -> None: ...

    def stats(self) -> TierStats: ...
