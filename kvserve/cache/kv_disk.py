"""Tier 2 of the KV cache: prefix blocks on disk, one file per block, sealed (block_store: the
namespace, the key and a digest in each file's header); an index kept across restarts, so a
restarted server finds its prefix cache again.

The namespace names the directory the files live in. A file that is missing, truncated,
corrupted, from another namespace or under another key is never used: the block is recomputed
and ``errors`` counts it. Writes go to a temporary file that is renamed into place (atomic), on
a background thread, so the step never waits for the disk; a write that fails (disk full,
read-only) is dropped and counted.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict, deque
from pathlib import Path

import torch

from kvserve.cache.block_store import (
    HEADER,
    BackgroundWriter,
    Block,
    WritesInBackground,
    payload_tensor,
    seal,
    unseal,
)
from kvserve.cache.kv_tiers import TierStats

logger = logging.getLogger("kvserve")


class DiskTier(WritesInBackground):
    """Block files under ``root/<namespace>/``, LRU within ``capacity_bytes``.

    Invariants: ``index`` lists exactly the keys whose files were completely written (and not
    since found bad or evicted); a key is added only after its file's rename. The index is
    owned by ``_lock`` (the writer thread adds to it, the engine thread reads and evicts)."""

    name = "disk"
    shared = False

    def __init__(self, root: str | Path, capacity_bytes: int, namespace_digest: str, block_bytes: int) -> None:
        self.dir = Path(root) / namespace_digest
        self.dir.mkdir(parents=True, exist_ok=True)
        self.namespace = bytes.fromhex(namespace_digest)
        self.block_bytes = block_bytes
        self.file_bytes = HEADER.size + block_bytes
        self.capacity_blocks = max(0, capacity_bytes // self.file_bytes)
        self.index: OrderedDict[bytes, None] = OrderedDict()  # oldest first
        self._lock = threading.Lock()
        self.hits = self.blocks_in = self.blocks_out = self.evictions = self.errors = 0
        self.load_seconds: deque[float] = deque(maxlen=4096)  # per block read back, until drained (metrics)
        self._load_index()
        self._writer = BackgroundWriter(self._write_blocks, "kvserve-disk-tier")

    # ------------------------------------------------------------------ index

    def _path(self, key: bytes) -> Path:
        name = key.hex()
        return self.dir / name[:2] / f"{name}.kvb"

    def _load_index(self) -> None:
        """The files already there (a restart), oldest first; over capacity, the oldest go.
        Temporary files of writes a crash interrupted are removed."""
        for tmp in self.dir.glob("*/*.tmp*"):
            tmp.unlink(missing_ok=True)
        files = sorted(self.dir.glob("*/*.kvb"), key=lambda p: p.stat().st_mtime)
        for path in files:
            try:
                key = bytes.fromhex(path.stem)
            except ValueError:
                continue
            if len(key) == 32 and path.stat().st_size == self.file_bytes:
                self.index[key] = None
            else:  # truncated (or not ours): never read, counted, removed
                self.errors += 1
                path.unlink(missing_ok=True)
        while len(self.index) > self.capacity_blocks:
            self._evict_oldest()
        if self.index:
            logger.info("KV disk tier %s: %d blocks found from an earlier run", self.dir, len(self.index))

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self.index

    def _evict_oldest(self) -> None:
        key, _ = self.index.popitem(last=False)
        self.evictions += 1
        self._path(key).unlink(missing_ok=True)

    def _forget(self, key: bytes) -> None:
        with self._lock:
            self.index.pop(key, None)
        self._path(key).unlink(missing_ok=True)

    # ------------------------------------------------------------------ write (background)

    def put(self, key: bytes, tensors: list[torch.Tensor]) -> None:
        """Queue a block (its per-block tensors, on the host) for writing."""
        if self.wants(key):
            self._writer.submit(key, tensors)

    def wants(self, key: bytes) -> bool:
        return self.capacity_blocks > 0 and key not in self

    def _write_blocks(self, blocks: list[Block]) -> None:
        for key, tensors in blocks:
            self._write(key, tensors)

    def _write(self, key: bytes, tensors: list[torch.Tensor]) -> None:
        path = self._path(key)
        tmp = path.with_suffix(f".tmp{threading.get_ident()}")
        try:
            path.parent.mkdir(exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(seal(self.namespace, key, tensors))
            os.replace(tmp, path)  # atomic: readers see the old state or the whole file
        except OSError as exc:
            with self._lock:
                self.errors += 1
            tmp.unlink(missing_ok=True)
            logger.warning("KV disk tier: could not write a block (%s); it will be recomputed when needed", exc)
            return
        with self._lock:
            if key not in self.index:
                self.index[key] = None
                self.blocks_in += 1
            while len(self.index) > self.capacity_blocks:
                self._evict_oldest()

    # ------------------------------------------------------------------ read (engine thread)

    def load(self, key: bytes) -> torch.Tensor | None:
        """The block's payload (read into a buffer of its own, not copied again), or None if its
        file is missing or bad (then it is forgotten and counted in ``errors``)."""
        start = time.perf_counter()
        data = bytearray(HEADER.size + self.block_bytes + 1)  # one byte more: a longer file is caught
        try:
            with self._path(key).open("rb") as file:  # buffered: readinto fills the buffer or reaches the end
                del data[file.readinto(data):]
        except OSError:
            data = bytearray()
        payload = unseal(self.namespace, key, self.block_bytes, data)
        if payload is None:
            with self._lock:
                self.errors += 1
            self._forget(key)
            logger.warning("KV disk tier: block %s… is missing or damaged; recomputing it", key.hex()[:12])
            return None
        block = payload_tensor(payload)
        with self._lock:
            if key in self.index:
                self.index.move_to_end(key)
            self.hits += 1
            self.blocks_out += 1
        self.load_seconds.append(time.perf_counter() - start)
        return block

    def load_many(self, keys: list[bytes]) -> dict[bytes, torch.Tensor]:
        found = {}
        for key in keys:
            block = self.load(key) if key in self else None
            if block is not None:
                found[key] = block
        return found

    def stats(self) -> TierStats:
        with self._lock:
            blocks = len(self.index)
            return TierStats("disk", self.capacity_blocks * self.file_bytes, blocks * self.file_bytes, blocks,
                             self.hits, self.blocks_in, self.blocks_out, self.evictions, 0,
                             self.errors + self._writer.dropped)
