"""The physical KV storage (PagedKVCache): per layer, one preallocated block pool in that layer's KV
format (kv_layer, kv_layer_quant), and what moves whole blocks: tier moves, eviction's and
compaction's rewrites, first-use zeroing.

Layout per layer: [num_blocks, 2 * num_kv_heads, block_size, row] — each block holds its K
heads then V heads contiguously, so reading a sequence's blocks copies large contiguous rows
(measured ~2x faster than a head-major layout when the pool is cold in cache). ``row`` is
head_dim elements of a float KV dtype, or head_dim (fp8, int8) / head_dim / 2 (int4) bytes.
Token slot ``block_id * block_size + offset`` is the token's position in the pool. Blocks are
zeroed when first handed out (see zero_new_blocks), so the unwritten tail of a block is zeros,
never uninitialised memory that could hold NaN bit patterns.

Quantized formats (kvserve.cache.kv_quant) add scales: key scales per (KV head, channel),
static (one calibrated table) or per block; value scales per (token, KV head[, group]); fp8 one
static scale per layer for K and one for V. Formats that need a block's keys complete before
they can be scaled (int4, and int8 with per-block key scales) keep each running sequence's
not-yet-full last block in full precision in a tail slot (KIVI's residual, aligned to blocks)
and quantize the block when it fills. Attention reads that block from the tail slot. A tail slot
is an aligned run of pool blocks whose bytes are viewed in the model dtype, handed out by the
KVCacheManager with the sequence's first blocks: tails and blocks share one budget.
"""


from __future__ import annotations

import torch

from kvserve.cache import kv_layer_quant  # noqa: F401  (registers the quantized formats)
from kvserve.cache.block_store import BlockStore
from kvserve.cache.kv_layer import KVQuantSpec, LatentKV, LayerKV, PoolShape, format_class
from kvserve.cache.kv_plan import StorageWork
from kvserve.cache.kv_quant import float_kind
from kvserve.cache.kv_tiers import HostBlockStore, TierMoves


class PagedKVCache:
    """Every layer's pool; block 0 (the null block) is zero-filled. With KV cache groups
    (kv_groups), ``layer_slots[i]`` is layer i's storage slot: the layers in one slot share
    its per-block tensors (``storage`` holds each slot's first layer), so a pool block is one
    group's layers' K/V."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, quant: KVQuantSpec | None = None,
                 layer_slots: list[int] | None = None, latent_dim: int = 0) -> None:
        """``latent_dim``: MLA, one vector of this size per token (LatentKV) instead of K and V heads."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.model_dtype = dtype
        model_kind = float_kind(dtype)
        quant = quant or KVQuantSpec(model_kind)
        # one clip counter for every layer (each adds to it in place): reading it is one sync
        self.clipped = torch.zeros((), dtype=torch.long, device=device)
        shape = PoolShape(num_blocks, block_size, num_kv_heads, latent_dim or head_dim, dtype, device)
        # rows one token takes in a block: its K then V heads, or MLA's one latent vector
        self.rows_per_token = 1 if latent_dim else 2 * num_kv_heads
        slots = layer_slots or list(range(num_layers))
        self.layers: list[LayerKV] = []
        owners: dict[int, LayerKV] = {}
        for layer, slot in enumerate(slots):
            kind = quant.layer_kind(layer, model_kind)
            cls = LatentKV if latent_dim else format_class(kind, quant.key_scale_mode)
            if slot not in owners:
                owners[slot] = cls.allocate(kind, shape, quant, layer, self.clipped)
                self.layers.append(owners[slot])
                continue
            sharer = cls.allocate(kind, shape._replace(num_blocks=1), quant, layer, self.clipped)
            sharer.share_blocks(owners[slot])
            self.layers.append(sharer)
        self.storage = [owners[slot] for slot in sorted(owners)]
        self.zeroed_up_to = -1
        self.zero_new_blocks(0)
        self.host_store: HostBlockStore | None = None
        self.stores: list[BlockStore] = []

    @property
    def uses_tail(self) -> bool:
        return any(layer.keeps_tail_block for layer in self.layers)

    @property
    def uses_value_scales(self) -> bool:
        """Some layer stores per-token value scales as it writes (the step needs their rows)."""
        return any(layer.value_scales is not None and not layer.keeps_tail_block for layer in self.layers)

    def per_block_tensors(self) -> list[torch.Tensor]:
        """Every layer's per-block tensors, in a fixed order: a block is these tensors' rows."""
        return [tensor for layer in self.storage for tensor in layer.per_block_tensors()]

    def attach_host_tier(self, capacity_blocks: int, stores: list[BlockStore] | None = None) -> None:
        """Host memory for tier 1 (kv_tiers): ``capacity_blocks`` blocks in the stored format;
        ``stores``: the lower stores (disk, remote), each of which receives the blocks tier 1 drops."""
        self.host_store = HostBlockStore(self.per_block_tensors(), capacity_blocks)
        self.stores = list(stores or [])

    def prepare(self, work: StorageWork) -> None:
        """A step's storage work, before its forward pass: first-use zeroing of new blocks (before
        blocks are loaded into them), the tier moves, then new tail slots (after the moves: a
        demotion may read a block a fresh tail run just took)."""
        self.zero_new_blocks(work.zero_up_to)
        self.run_tier_moves(work.tier_moves)
        self.zero_tail_slots(work.new_tail_slots)

    def run_tier_moves(self, moves: TierMoves | None) -> None:
        """A step's moves (after first-use zeroing, before the forward pass): tier 1's dropped
        blocks handed to the lower stores (written in the background), demotions, promotions,
        blocks read from a lower store."""
        if moves is None or not any(moves):
            return
        assert self.host_store is not None, "tier moves need attach_host_tier"
        host = self.host_store
        self._hand_down(self.stores, moves.spills, host.storage)  # read out before their slots are reused
        self._hand_down(self.stores, moves.pool_spills, self.per_block_tensors())
        host.run(self.per_block_tensors(), moves)
        self._hand_down(self.stores, moves.persist, host.storage)  # write-through: what the pool evicts is kept below

    def share_published(self, published: list[tuple[int, bytes]]) -> None:
        """The blocks published this step, computed now, to the stores other engines read."""
        shared = [store for store in self.stores if store.shared]
        if shared and published:
            self._hand_down(shared, published, self.per_block_tensors())

    @staticmethod
    def _hand_down(stores: list[BlockStore], blocks: list[tuple[int, bytes]], source: list[torch.Tensor]) -> None:
        """Hand blocks ((row, key): a row of every ``source`` tensor) to the ``stores`` that want
        them: those rows are copied to the host in one batch per tensor, only for blocks some
        store wants."""
        wanted = []
        for row, key in blocks:
            wanting = [store for store in stores if store.wants(key)]
            if wanting:
                wanted.append((row, key, wanting))
        if not wanted:
            return
        rows = torch.tensor([row for row, _, _ in wanted], dtype=torch.long)
        copies = [tensor.index_select(0, rows.to(tensor.device)).to("cpu") for tensor in source]
        for i, (_, key, wanting) in enumerate(wanted):
            tensors = [copy[i] for copy in copies]
            for store in wanting:
                store.put(key, tensors)

    def take_load_seconds(self) -> list[tuple[str, float]]:
        """(tier, seconds) of each block loaded back into the pool since the last call."""
        loads: list[tuple[str, float]] = []
        sources: list[tuple[str, HostBlockStore | BlockStore | None]] = [("cpu", self.host_store)]
        for name, source in sources + [(store.name, store) for store in self.stores]:
            while source is not None and source.load_seconds:  # popleft: the loader thread appends
                loads.append((name, source.load_seconds.popleft()))
        return loads

    def _ids(self, block_ids: list[int]) -> torch.Tensor:
        return torch.tensor(block_ids, dtype=torch.long, device=self.clipped.device)

    def read_blocks(self, block_ids: list[int]) -> list[torch.Tensor]:
        """Every storage layer's blocks ``block_ids`` as float32 [N, 2*kv_heads, block_size, dim]
        (LayerKV.read_blocks: dequantized, keys as the model made them)."""
        ids = self._ids(block_ids)
        return [layer.read_blocks(ids) for layer in self.storage]

    def write_blocks(self, block_ids: list[int], blocks: list[torch.Tensor]) -> None:
        """Store whole blocks (as read_blocks gives them) in every storage layer's format: a
        quantized block gets scales fitted to its new contents."""
        ids = self._ids(block_ids)
        for layer, layer_blocks in zip(self.storage, blocks, strict=True):
            layer.write_blocks(ids, layer_blocks)

    def read_tokens(self, block_ids: list[int], length: int, tail_slot: int) -> list[torch.Tensor]:
        """A sequence's first ``length`` cached tokens in every storage layer, float32 [2*kv_heads,
        length, dim] (read_blocks); a partial last block is read from tail slot ``tail_slot``
        where the layer keeps one."""
        out = []
        for layer, blocks in zip(self.storage, self.read_blocks(block_ids), strict=True):
            if layer.tail is not None and length % self.block_size:
                blocks[-1] = layer.tail[tail_slot].transpose(0, 1).float()
            out.append(blocks.permute(1, 0, 2, 3).reshape(blocks.shape[1], -1, blocks.shape[-1])[:, :length])
        return out

    def write_tokens(self, block_ids: list[int], tokens: list[torch.Tensor], tail_slot: int) -> None:
        """Store a sequence's tokens (as read_tokens gives them) from the start of blocks
        ``block_ids``: whole blocks in the layer's format, a partial last block into tail slot
        ``tail_slot`` where the layer keeps one (it is quantized when it fills), else zero-padded."""
        ids, size = self._ids(block_ids), self.block_size
        for layer, layer_tokens in zip(self.storage, tokens, strict=True):
            rows, length, dim = layer_tokens.shape
            padded = layer_tokens.new_zeros(rows, len(block_ids) * size, dim)
            padded[:, :length] = layer_tokens
            blocks = padded.view(rows, len(block_ids), size, dim).permute(1, 0, 2, 3)
            whole = len(block_ids) if layer.tail is None else length // size
            if whole:
                layer.write_blocks(ids[:whole], blocks[:whole])
            if whole < len(block_ids):
                assert layer.tail is not None
                layer.tail[tail_slot] = blocks[-1].transpose(0, 1).to(layer.tail.dtype)

    def gather_tokens(self, old_ids: list[int], new_ids: list[int], index: list[torch.Tensor], length: int,
                      tail_slot: int = 0) -> None:
        """Copy a sequence's kept tokens from its blocks ``old_ids`` (``length`` tokens, a partial
        last block in tail slot ``tail_slot`` for formats with tails) into ``new_ids``: in storage
        layer l, head h's j-th slot gets the K/V of its token index[l][h, j] (positions in the
        old blocks' order; every head keeps as many). Quantized blocks are re-quantized with
        scales fitted to what they now hold."""
        picked = []
        for tokens, keep in zip(self.read_tokens(old_ids, length, tail_slot), index, strict=True):
            heads = keep.shape[0]
            rows = keep.repeat(tokens.shape[0] // heads, 1)  # K heads, then V heads
            picked.append(tokens.gather(1, rows[:, :, None].expand(-1, -1, tokens.shape[-1])))
        self.write_tokens(new_ids, picked, tail_slot)

    def zero_new_blocks(self, max_block_id: int) -> None:
        """Zero blocks up to ``max_block_id`` on first use. The pool hands out never-used blocks
        in id order, so this touches each block once and pages stay lazily committed."""
        if max_block_id > self.zeroed_up_to:
            for tensor in self.per_block_tensors():
                tensor[self.zeroed_up_to + 1 : max_block_id + 1].zero_()
            self.zeroed_up_to = max_block_id

    def clip_ratio(self) -> float:
        """Share of K/V elements clipped by static (calibrated) scales over all layers so far: the
        drift watch. The counter is only read when some layer checks (static scales), so float
        pools never sync."""
        checked = sum(layer.checked for layer in self.layers)
        return int(self.clipped) / checked if checked else 0.0

    @property
    def nbytes(self) -> int:
        """Bytes of the block pools (data and per-block scales); tail slots live inside them."""
        return sum(t.numel() * t.element_size() for t in self.per_block_tensors())

    def zero_tail_slots(self, slots: list[int]) -> None:
        """Zero newly handed-out tail slots: their blocks may hold old codes, which read as floats
        could be NaN bit patterns (a slot's unwritten rows are read, masked, like a block's)."""
        if not slots:
            return
        index = torch.tensor(slots, dtype=torch.long, device=self.clipped.device)
        for layer in self.storage:
            if layer.tail is not None:
                layer.tail.index_fill_(0, index, 0)
