"""KV cache groups: layers that share one KV spec share one block table per request.

A hybrid model (Gemma 3: five sliding-window layers for every full-attention one) needs
different tables per kind of layer: a sliding layer drops blocks that fall out of its window,
a full layer keeps them all. As in vLLM v1's hybrid KV cache manager, the layers of each spec
are split into groups of one common size ``n`` (the smallest per-spec layer count), and every
group draws whole blocks from one shared pool. A pool block holds ``n`` layers' K/V: storage
slot ``j`` of block ``b`` belongs to layer ``j`` of whichever group owns ``b`` at the time.
Block sizes are therefore equal in every group and the pool is one budget. A model whose
layers all share one spec has one group holding every layer: the plain paged cache.

Gemma 3 270M (18 layers, 15 sliding + 3 full):

    group 0  full      layers  5 11 17
    group 1  sliding   layers  0  1  2
    group 2  sliding   layers  3  4  6     storage slot:  0  1  2
    ...                                    (a block is 3 layers' K/V)
    group 5  sliding   layers 14 15 16
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """What a group's layers attend to: every earlier token (``sliding_window`` 0), or only the
    last ``sliding_window`` positions, the query's own included (HF's q - k < window)."""

    sliding_window: int = 0

    @property
    def kind(self) -> str:
        return "sliding_window" if self.sliding_window else "full_attention"

    def first_live_block(self, first_query: int, block_size: int) -> int:
        """The first block any query at position >= ``first_query`` still reads; every block
        before it is wholly out of the window and can be released."""
        if not self.sliding_window:
            return 0
        return max(0, first_query - self.sliding_window + 1) // block_size

    def blocks_held(self, num_tokens: int, block_size: int, chunk: int = 1) -> int:
        """Blocks one sequence holds in this group at its peak while it computes positions up
        to ``num_tokens`` in chunks of at most ``chunk`` tokens (decode: 1). Full attention:
        every block; a sliding window: the window's blocks plus the chunk's, at most."""
        every = cdiv(num_tokens, block_size)
        if not self.sliding_window:
            return every
        return min(every, cdiv(self.sliding_window - 1 + chunk - 1, block_size) + 1)


FULL_ATTENTION = KVCacheSpec()


def sequence_blocks(specs: Sequence[KVCacheSpec], num_tokens: int, block_size: int, chunk: int = 1,
                    tail_blocks: int = 0) -> int:
    """Pool blocks one sequence of ``num_tokens`` tokens holds at its peak: every group's share
    (KVCacheSpec.blocks_held) and one tail run of ``tail_blocks`` per group."""
    return sum(spec.blocks_held(num_tokens, block_size, chunk) for spec in specs) + len(specs) * tail_blocks


def capacity_tokens(specs: Sequence[KVCacheSpec], usable_blocks: int, block_size: int, chunk: int = 1,
                    tail_blocks: int = 0) -> int:
    """The longest sequence ``usable_blocks`` pool blocks hold on their own (1 << 30 when only
    sliding groups, whose memory stops growing, fit at all; 0 when the pool has no room for one
    aligned tail run per group besides the null block's)."""
    if tail_blocks and usable_blocks + 1 < (len(specs) + 1) * tail_blocks:
        return 0

    def fits(tokens: int) -> bool:
        return sequence_blocks(specs, tokens, block_size, chunk, tail_blocks) <= usable_blocks

    if all(spec.sliding_window for spec in specs):
        return 1 << 30 if fits(1 << 30) else 0
    low, high = 0, usable_blocks * block_size
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


class KVCacheGroup(NamedTuple):
    spec: KVCacheSpec
    layers: tuple[int, ...]  # model layer ids; layer ``layers[j]`` uses storage slot j


def group_layers(layer_specs: Sequence[KVCacheSpec]) -> list[KVCacheGroup]:
    """Split the layers into groups of one size (the smallest per-spec layer count; a spec's
    last group may be smaller), full-attention groups first, each spec's layers in order."""
    by_spec: dict[KVCacheSpec, list[int]] = {}
    for layer, spec in enumerate(layer_specs):
        by_spec.setdefault(spec, []).append(layer)
    size = min(len(layers) for layers in by_spec.values())
    groups = []
    for spec in sorted(by_spec, key=lambda s: s.sliding_window):
        layers = by_spec[spec]
        groups += [KVCacheGroup(spec, tuple(layers[i : i + size])) for i in range(0, len(layers), size)]
    return groups


def group_size(groups: Sequence[KVCacheGroup]) -> int:
    """Layers' worth of storage in one pool block: the largest group."""
    return max(len(group.layers) for group in groups)


def layer_slots(groups: Sequence[KVCacheGroup], num_layers: int) -> list[int]:
    """Storage slot of each model layer."""
    slots = [0] * num_layers
    for group in groups:
        for slot, layer in enumerate(group.layers):
            slots[layer] = slot
    return slots


def layer_groups(groups: Sequence[KVCacheGroup], num_layers: int) -> list[int]:
    """Group index of each model layer."""
    owner = [0] * num_layers
    for index, group in enumerate(groups):
        for layer in group.layers:
            owner[layer] = index
    return owner


def sliding_specs(num_layers: int, num_sliding: int, window: int) -> list[KVCacheSpec]:
    """Per-layer specs from counts alone (the planner's view: order does not change sizes)."""
    sliding = KVCacheSpec(window)
    return [sliding] * num_sliding + [FULL_ATTENTION] * (num_layers - num_sliding)
