"""Tail slots: formats that quantize a block only once it is full keep each running sequence's
partial last block in full precision (kv_format.tail_blocks), in an aligned run of pool blocks
per KV cache group, taken with the sequence's first blocks and freed with them."""

from __future__ import annotations

from kvserve.cache.block_pool import BlockPool, KVCacheBlock


class TailRuns:
    """Invariants: a run is ``blocks_per_run`` consecutive blocks, the first a multiple of it
    (slot ``first // blocks_per_run`` in the pool viewed as runs), held by one sequence only, never
    published; a fresh run's slot is handed to the runner once (take_new_slots) to be zeroed."""

    def __init__(self, pool: BlockPool, blocks_per_run: int, num_groups: int) -> None:
        self.pool = pool
        self.blocks_per_run = blocks_per_run  # 0: the format keeps no tails
        self.num_groups = num_groups
        self.new_slots: list[int] = []  # handed out since the runner last zeroed them
        self.num_held = 0  # runs held by sequences now

    @property
    def blocks_per_sequence(self) -> int:
        """Pool blocks a sequence's tails take: one run per group."""
        return self.blocks_per_run * self.num_groups

    def take(self, avoid: set[int], fresh: bool = True) -> list[list[KVCacheBlock]] | None:
        """One run per group (none of them in ``avoid``), or None (nothing taken). ``fresh``
        runs are zeroed before use (not those a swap-in restores)."""
        runs: list[list[KVCacheBlock]] = []
        for _ in range(self.num_groups):
            run = self.pool.get_aligned_run(self.blocks_per_run, avoid)
            if run is None:
                self.free(runs)
                return None
            runs.append(run)
            self.num_held += 1
        if fresh:
            self.new_slots += [self.slot(run) for run in runs]
        return runs

    def free(self, runs: list[list[KVCacheBlock]]) -> None:
        for run in runs:
            self.pool.free_blocks(run)
        self.num_held -= len(runs)

    def slot(self, run: list[KVCacheBlock]) -> int:
        """The run's index in the pool viewed as runs of blocks_per_run blocks."""
        return run[0].block_id // self.blocks_per_run

    def take_new_slots(self) -> list[int]:
        """Slots handed out since the last call (their blocks may hold old codes: zero them)."""
        slots, self.new_slots = self.new_slots, []
        return slots
