"""KV tier 1 (host memory): prefix blocks the pool evicts are demoted instead of lost and
promoted back on a hit, in their stored format; outputs never change."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve import LLM, SamplingParams
from kvserve.cache.block_pool import KVCacheBlock
from kvserve.cache.block_store import HEADER, BackgroundWriter
from kvserve.cache.kv_cache_manager import KVCacheManager
from kvserve.cache.kv_tiers import TierIndex, TierMoves, split_blocks
from kvserve.model.cpu_kernels import cpu_op


def documents(num_docs: int, length: int, questions: int) -> list[list[int]]:
    """Document-QA prompts: each document asked ``questions`` times, documents interleaved so the
    pool has evicted a document before it is asked again."""
    docs = [[(7 * d + 13 * i) % 250 + 3 for i in range(length)] for d in range(num_docs)]
    return [docs[d] + [200 + q, 201 + q] for q in range(questions) for d in range(num_docs)]


@pytest.mark.parametrize("kv_dtype,block_size", [("fp32", 16), ("fp32", 64), ("bf16", 16), ("bf16", 64), ("int4", 16),
                                                 ("int4", 64)])
def test_tier_outputs_equal_no_tier_with_a_working_set_five_times_the_pool(
        kv_dtype: str, block_size: int, tiny_model_factory: Callable[..., Path]) -> None:
    path = str(tiny_model_factory("llama"))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    common = dict(kv_cache_dtype=kv_dtype, block_size=block_size, max_model_len=320, max_num_seqs=2)
    budget = _pool_bytes(path, common, tokens=320)
    base = LLM(path, **common, kv_cache_memory=budget)
    num_docs = -(-5 * base.engine.kv_manager.capacity_tokens // 256)  # the documents are 5x the pool
    prompts = documents(num_docs, length=256, questions=2)
    tiered = LLM(path, **common, kv_cache_memory=budget, kv_offload_memory="64MiB")
    expected = [o.token_ids for o in _one_by_one(base, prompts, params)]
    outputs = _one_by_one(tiered, prompts, params)
    assert [o.token_ids for o in outputs] == expected
    tier = tiered.kv_stats().tiers[0]
    assert tier.hits > 0 and tier.blocks_in >= tier.blocks_out
    cached = sum(o.num_cached_tokens for o in outputs[num_docs:])  # the second round reads its documents back
    assert cached >= num_docs * (256 // block_size - 1) * block_size
    assert sum(o.num_cached_tokens for o in _one_by_one(base, prompts, params)[num_docs:]) < cached


def _pool_bytes(path: str, common: dict, tokens: int) -> int:
    """A pool that holds about ``tokens`` tokens (plus a tail run for int4)."""
    probe = LLM(path, **common, kv_cache_memory="8MiB").engine
    tail = probe.tail_blocks
    blocks = max(2 * tail, -(-tokens // probe.config.cache_config.block_size) + 1 + tail)
    return blocks * probe.kv_block_bytes


def _one_by_one(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list:
    return [llm.generate([p], params)[0] for p in prompts]


def doc_tokens(doc: int) -> Callable[[int, int], list[int]]:
    """Token ids of one of a few documents: requests on the same document share prefixes."""
    return lambda start, end: [doc * 1000 + i for i in range(start, end)]


def apply_moves(kv: KVCacheManager, host: dict[int, object], pool: dict[int, object]) -> TierMoves:
    """Run the step's moves on a model of what each tier slot and pool block holds."""
    moves = kv.take_storage_work().tier_moves
    assert moves is not None
    for block, slot in moves.demotions:
        host[slot] = pool[block]
    for slot, block in moves.promotions:
        pool[block] = host[slot]
    return moves


@given(ops=st.lists(st.tuples(st.sampled_from(["submit", "finish"]), st.integers(0, 9), st.integers(1, 80)),
                    max_size=60),
       num_blocks=st.integers(6, 30), tier_blocks=st.integers(1, 12))
@settings(max_examples=200, deadline=None)
def test_tier_bookkeeping_never_loses_duplicates_or_mislabels(ops: list[tuple[str, int, int]], num_blocks: int,
                                                               tier_blocks: int) -> None:
    """Random submits (with prefix lookups through both tiers) and finishes: a key is in the pool
    or the tier, never both; tier slots are unique and within capacity; every promotion reads a
    slot last written with the same key; after draining, every byte is accounted."""
    tier = TierIndex("cpu", tier_blocks, 100)
    kv = KVCacheManager(num_blocks, 4, enable_prefix_caching=True, host_tier=tier)
    content: dict[int, object] = {}  # tier slot -> key whose bytes it holds (after the moves ran)
    pool_content: dict[int, object] = {}  # pool block -> key whose bytes it holds
    for op, rid, length in ops:
        request_id = f"r{rid}"
        if op == "finish" or request_id in kv.holders():
            kv.forget(request_id)
            continue
        tokens = doc_tokens(rid % 3)
        cached = kv.find_cached_prefix(request_id, length, tokens)
        if kv.allocate_slots(request_id, length, tokens, cached):
            moves = apply_moves(kv, content, pool_content)
            read = {b.block_id for b in cached.blocks[0] if isinstance(b, KVCacheBlock)}
            read |= {b for _, b in moves.promotions}
            for block in kv.requests[request_id].tables[0]:
                if block.block_hash is None:
                    continue
                if block.block_id in read:  # a hit: the bytes there must be its key's
                    assert pool_content[block.block_id] == block.block_hash
                else:  # computed by this step
                    pool_content[block.block_id] = block.block_hash
        assert not set(kv.pool.cached_blocks) & set(tier.slots), "a key in two tiers"
        assert len(set(tier.slots.values())) == len(tier.slots) <= tier_blocks
        for key, slot in tier.slots.items():  # a slot holds its key's bytes once this step's moves ran
            assert content.get(slot) == key
    for rid in list(kv.holders()):
        kv.free(rid)
    stats = tier.stats()
    assert stats.blocks == len(tier.slots) and stats.used_bytes == 100 * stats.blocks
    assert stats.blocks_in - stats.blocks_out - stats.evictions - stats.discarded == stats.blocks


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16", "int4"])
def test_swap_preemption_keeps_outputs_and_skips_recompute(kv_dtype: str,
                                                           tiny_model_factory: Callable[..., Path]) -> None:
    """16 long requests at once in a pool for two (8x oversubscribed): swap preemption moves a victim's blocks (its
    full-precision tail too) to tier 1 and back, and outputs equal one-at-a-time's. Recompute
    preemption does too in fp32; with int4 it may not: recomputed, a block of generated tokens
    is quantized within one prefill step, where decoding had read it from the full-precision
    tail while it filled, so later tokens can differ (seen: 1 of 8 requests). Swap keeps them."""
    path = str(tiny_model_factory("llama"))
    prompts = [[(11 * r + 3 * i) % 250 + 3 for i in range(160)] for r in range(16)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    common = dict(kv_cache_dtype=kv_dtype, block_size=16, max_model_len=224, max_num_seqs=16,
                  max_num_batched_tokens=256)
    probe = LLM(path, **common, kv_cache_memory="8MiB").engine
    # two prompts (10 blocks and a tail run each) fit, their growth to 13 blocks does not: preemptions
    budget = (2 * (10 + probe.tail_blocks) + 3) * probe.kv_block_bytes
    alone = [o.token_ids for o in _one_by_one(LLM(path, **common, kv_cache_memory="8MiB"), prompts, params)]
    runs = {}
    for mode in ("recompute", "swap"):
        llm = LLM(path, **common, kv_cache_memory=budget, enable_prefix_caching=False, preemption_mode=mode,
                  kv_offload_memory="8MiB")  # no prefix cache: recompute really recomputes
        outs = llm.generate(prompts, params)
        if mode == "swap" or kv_dtype == "fp32":
            assert [o.token_ids for o in outs] == alone
        runs[mode] = llm.kv_stats()
    swap, recompute = runs["swap"], runs["recompute"]
    assert recompute.num_preemptions >= 8 and recompute.swaps_out == 0
    assert swap.swaps_out > 0 and swap.swaps_in == swap.swaps_out and swap.swap_fallbacks == 0
    assert swap.num_swapped == 0 and swap.tiers[0].blocks == 0 and swap.blocks_used == 0  # all returned


def test_swap_falls_back_to_recompute_when_tier_1_is_full(tiny_model_factory: Callable[..., Path]) -> None:
    path = str(tiny_model_factory("llama"))
    prompts = [[(5 * r + i) % 250 + 3 for i in range(160)] for r in range(4)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    common = dict(block_size=16, max_model_len=224, max_num_seqs=4)
    alone = [o.token_ids for o in _one_by_one(LLM(path, **common, kv_cache_memory="8MiB"), prompts, params)]
    probe = LLM(path, **common, kv_cache_memory="8MiB").engine
    llm = LLM(path, **common, kv_cache_memory=23 * probe.kv_block_bytes, preemption_mode="swap",
              kv_offload_memory=2 * probe.kv_block_bytes)  # two prompts fit, not their growth; no victim fits tier 1
    assert [o.token_ids for o in llm.generate(prompts, params)] == alone
    stats = llm.kv_stats()
    assert stats.swap_fallbacks > 0 and stats.swaps_out == 0 and stats.num_preemptions >= stats.swap_fallbacks


def test_swap_needs_tier_1() -> None:
    from kvserve import ConfigError, EngineConfig

    with pytest.raises(ConfigError, match=r"preemption_mode=swap .* kv_offload_memory"):
        EngineConfig.from_settings(preemption_mode="swap")
    with pytest.raises(ConfigError, match="preemption_mode must be one of recompute, swap, got 'drop'"):
        EngineConfig.from_settings(preemption_mode="drop")


def _disk_llm(path: str, budget: int, disk: Path, **extra: object) -> LLM:
    return LLM(path, block_size=16, max_model_len=320, max_num_seqs=2, kv_cache_memory=budget,
               kv_offload_memory=8 * 16 * 2**10, kv_offload_disk=str(disk), kv_offload_disk_size="64MiB",
               **extra)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def disk_setup(tiny_model_factory: Callable[..., Path]) -> tuple[str, int, list[list[int]], list[list[int]]]:
    """A tiny model, a pool for one document, a tier 1 of 8 blocks, and the expected outputs."""
    path = str(tiny_model_factory("llama"))
    common = dict(block_size=16, max_model_len=320, max_num_seqs=2)
    budget = _pool_bytes(path, common, tokens=320)
    prompts = documents(num_docs=6, length=256, questions=2)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = [o.token_ids for o in _one_by_one(LLM(path, **common, kv_cache_memory="8MiB"), prompts, params)]
    return path, budget, prompts, expected


PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def test_disk_tier_keeps_what_tier_1_drops_and_survives_a_restart(disk_setup, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                                   tiny_model_factory: Callable[..., Path]) -> None:
    path, budget, prompts, expected = disk_setup
    first = _disk_llm(path, budget, tmp_path)
    assert [o.token_ids for o in _one_by_one(first, prompts, PARAMS)] == expected
    disk = first.engine.kv_manager.disk_tier
    assert disk is not None
    disk.flush()
    cpu_tier, on_disk = first.kv_stats().tiers
    assert cpu_tier.evictions > 0  # tier 1 is small: what it dropped went to disk
    assert on_disk.name == "disk" and on_disk.blocks_in > 0 and on_disk.hits > 0 and on_disk.errors == 0
    # a restart on the same directory: the documents come back from disk, not from recompute
    second = _disk_llm(path, budget, tmp_path)
    outputs = _one_by_one(second, prompts[:6], PARAMS)
    assert [o.token_ids for o in outputs] == expected[:6]
    assert second.kv_stats().tiers[1].hits > 0 and sum(o.num_cached_tokens for o in outputs) > 0
    # another KV format, or another model, on the same directory never reads those files
    other = _disk_llm(path, budget, tmp_path, kv_cache_dtype="bf16")
    outs = _one_by_one(other, prompts[:6], PARAMS)
    assert other.kv_stats().tiers[1].hits == 0 and all(o.num_cached_tokens == 0 for o in outs)
    other_model = str(tiny_model_factory("llama", rms_norm_eps=1e-6))  # same shapes, another fingerprint
    third = _disk_llm(other_model, budget, tmp_path)
    assert third.kv_stats().tiers[1].blocks == 0
    outs = _one_by_one(third, prompts[:6], PARAMS)
    assert third.kv_stats().tiers[1].hits == 0 and all(o.num_cached_tokens == 0 for o in outs)
    assert len({p.name for p in tmp_path.iterdir()}) == 3  # one namespace directory each


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "foreign"])
def test_damaged_block_files_are_recomputed_never_served(disk_setup, tmp_path: Path, damage: str) -> None:  # type: ignore[no-untyped-def]
    path, budget, prompts, expected = disk_setup
    first = _disk_llm(path, budget, tmp_path)
    _one_by_one(first, prompts, PARAMS)  # both rounds: every document's whole chain reaches the disk
    first.engine.kv_manager.disk_tier.flush()  # type: ignore[union-attr]
    files = sorted(tmp_path.glob("*/*/*.kvb"))
    assert files
    for i, file in enumerate(files):
        data = file.read_bytes()
        if damage == "truncate":
            file.write_bytes(data[: len(data) // 2])
        elif damage == "flip":
            file.write_bytes(data[:-7] + bytes([data[-7] ^ 0x10]) + data[-6:])
        elif damage == "delete":
            file.unlink()
        else:  # another block's file under this name: the key in the header does not match
            file.write_bytes(files[(i + 1) % len(files)].read_bytes() if len(files) > 1 else b"")
    second = _disk_llm(path, budget, tmp_path)
    if damage == "delete":  # the index is rebuilt from the directory: nothing to find, nothing served
        second.engine.kv_manager.disk_tier.index.update(dict.fromkeys(bytes.fromhex(f.stem) for f in files))  # type: ignore[union-attr]
    assert [o.token_ids for o in _one_by_one(second, prompts[:6], PARAMS)] == expected[:6]
    disk_stats = second.kv_stats().tiers[1]
    assert disk_stats.hits == 0 and disk_stats.errors > 0


def test_a_file_damaged_under_a_running_engine_is_recomputed(disk_setup, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    path, budget, prompts, expected = disk_setup
    llm = _disk_llm(path, budget, tmp_path)
    assert [o.token_ids for o in _one_by_one(llm, prompts[:6], PARAMS)] == expected[:6]
    llm.engine.kv_manager.disk_tier.flush()  # type: ignore[union-attr]
    for file in tmp_path.glob("*/*/*.kvb"):  # every block on disk, bit-flipped in place
        data = bytearray(file.read_bytes())
        data[-1] ^= 0x01
        file.write_bytes(bytes(data))
    assert [o.token_ids for o in _one_by_one(llm, prompts[6:], PARAMS)] == expected[6:]
    assert llm.kv_stats().tiers[1].errors > 0  # (later hits are blocks written again since, intact)


def test_disk_full_or_unwritable_is_survived(disk_setup, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    import errno
    import os

    path, budget, prompts, expected = disk_setup

    def full(*_: object, **__: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    llm = _disk_llm(path, budget, tmp_path)
    assert [o.token_ids for o in _one_by_one(llm, prompts, PARAMS)] == expected
    llm.engine.kv_manager.disk_tier.flush()  # type: ignore[union-attr]
    disk_stats = llm.kv_stats().tiers[1]
    assert disk_stats.errors > 0 and disk_stats.blocks == 0 and not list(tmp_path.glob("*/*/*"))


@given(ops=st.lists(st.tuples(st.sampled_from(["submit", "finish", "swap_out", "swap_in"]), st.integers(0, 7),
                              st.integers(1, 60)), max_size=60),
       num_blocks=st.integers(6, 30), tier_blocks=st.integers(1, 24))
@settings(max_examples=200, deadline=None)
def test_swap_and_demotion_never_mix_up_blocks(ops: list[tuple[str, int, int]], num_blocks: int,
                                               tier_blocks: int) -> None:
    """Submits (prefix lookups through both tiers), finishes, swap-outs and swap-ins in any order:
    after each step's moves every block of every running request holds what it should (its
    published key's bytes, or its own private bytes), swapped-out requests' slots are never
    handed to anyone else, and after draining every slot and block is free again."""
    tier = TierIndex("cpu", tier_blocks, 1)
    kv = KVCacheManager(num_blocks, 4, enable_prefix_caching=True, host_tier=tier)
    pool: dict[int, object] = {}  # pool block -> what its bytes are
    host: dict[int, object] = {}  # tier slot -> what its bytes are

    def expected(request_id: str, i: int, block: KVCacheBlock) -> object:
        """What the request's i-th block must hold: a full block, the content its chained key
        names (whoever computed it); the partial last one, the request's own tokens."""
        hashes = kv.requests[request_id].block_hashes if request_id in kv.requests else []
        return hashes[i] if i < len(hashes) else (request_id, i)

    def run_moves() -> None:
        apply_moves(kv, host, pool)

    for op, rid, length in ops:
        request_id = f"r{rid}"
        tokens = doc_tokens(rid % 3)
        record = kv.request(request_id)
        if op == "submit" and (record is None or (record.tables is None and record.swapped is None)):
            cached = kv.find_cached_prefix(request_id, length, tokens)
            if kv.allocate_slots(request_id, length, tokens, cached):
                run_moves()
                (table,) = kv.requests[request_id].tables
                for i, block in enumerate(table[cached.num_blocks :], start=cached.num_blocks):
                    pool[block.block_id] = expected(request_id, i, block)  # computed this step
        elif op == "finish":
            kv.forget(request_id)
            run_moves()
        elif op == "swap_out" and record is not None and record.tables is not None:
            kv.swap_out(request_id)
            run_moves()
        elif op == "swap_in" and record is not None and record.swapped is not None:
            kv.swap_in(request_id)
            run_moves()
        for request_id, holder in kv.holders().items():
            (table,) = holder.tables
            for i, block in enumerate(table):
                assert pool.get(block.block_id) == expected(request_id, i, block), "a block holds the wrong bytes"
        reserved = [s for r in kv.requests.values() if r.swapped is not None for s in r.swapped.slots]
        assert len(set(reserved)) == len(reserved) and not set(reserved) & set(tier.slots.values())
    for request_id in list(kv.requests):
        kv.free(request_id)
    run_moves()
    assert kv.pool.num_free_blocks == kv.pool.num_usable_blocks and tier.num_reserved == 0
    assert len(tier.slots) + len(tier._free) == tier_blocks


def test_int4_blocks_go_to_disk_in_their_stored_format_and_come_back(tiny_model_factory: Callable[..., Path],
                                                                      tmp_path: Path) -> None:
    """int4 codes with their per-block scales round-trip through host memory and disk files,
    across a restart: outputs equal an int4 run without tiers."""
    path = str(tiny_model_factory("llama"))
    common = dict(kv_cache_dtype="int4", block_size=16, max_model_len=320, max_num_seqs=2)
    budget = _pool_bytes(path, common, tokens=320)
    prompts = documents(num_docs=6, length=256, questions=2)
    expected = [o.token_ids for o in _one_by_one(LLM(path, **common, kv_cache_memory="8MiB"), prompts, PARAMS)]
    probe = LLM(path, **common, kv_cache_memory="8MiB").engine
    tiers = dict(kv_cache_memory=budget, kv_offload_memory=8 * probe.kv_block_bytes, kv_offload_disk=str(tmp_path),
                 kv_offload_disk_size="64MiB")
    first = LLM(path, **common, **tiers)
    assert [o.token_ids for o in _one_by_one(first, prompts, PARAMS)] == expected
    first.engine.kv_manager.disk_tier.flush()  # type: ignore[union-attr]
    file = next(tmp_path.glob("*/*/*.kvb"))
    assert file.stat().st_size == HEADER.size + probe.kv_block_bytes  # header + the int4 block with its scales
    second = LLM(path, **common, **tiers)
    assert [o.token_ids for o in _one_by_one(second, prompts[:6], PARAMS)] == expected[:6]
    assert second.kv_stats().tiers[1].hits > 0


def test_a_lower_store_hit_is_read_once_while_its_request_waits(tmp_path: Path) -> None:
    """Blocks read and verified from a lower store stay verified between steps (within a byte
    bound), so a request that waits for room is not read from disk (or the network) each step."""
    import torch

    from kvserve.cache.block_store import namespace
    from kvserve.cache.kv_disk import DiskTier
    from kvserve.cache.kv_offload import OffloadManager
    from kvserve.cache.kv_tiers import TierIndex

    disk = DiskTier(tmp_path, 1 << 20, namespace("test"), 16 * 8 * 4)
    key = bytes(range(32))
    disk.put(key, [torch.arange(16 * 8, dtype=torch.float32).view(16, 8)])
    disk.flush()
    offload = OffloadManager(TierIndex("cpu", 2, 16 * 8 * 4), [disk])
    assert not offload.prefetch([key])  # the read runs on the loader thread: not ready yet
    offload.wait_for_reads(10)
    for _ in range(3):  # three steps in which the request finds its hit but cannot be admitted
        assert offload.prefetch([key])  # as the prefix cache's lookup does before asking holds()
        assert offload.holds(key)
        offload.take_moves()
    assert disk.stats().hits == 1


def test_a_prompt_read_in_two_reads_is_answered_once_both_are_done(tmp_path: Path) -> None:
    """Reads run on a loader thread; a block the stores lacked is remembered as missing for a
    while, so a prompt whose blocks were read in two reads (one begun for another request) is
    answered once both are done instead of being read again step after step."""
    import torch

    from kvserve.cache.block_store import namespace
    from kvserve.cache.kv_disk import DiskTier
    from kvserve.cache.kv_offload import OffloadManager
    from kvserve.cache.kv_tiers import TierIndex

    disk = DiskTier(tmp_path, 1 << 20, namespace("test"), 16 * 8 * 4)
    held, absent = bytes(range(32)), bytes(range(1, 33))
    disk.put(held, [torch.ones(16, 8)])
    disk.flush()
    offload = OffloadManager(TierIndex("cpu", 2, 16 * 8 * 4), [disk])
    assert not offload.prefetch([absent])  # another request's read: the block is missing
    offload.wait_for_reads(10)
    assert not offload.prefetch([held, absent])  # this prompt's read of the block the first lacked
    offload.wait_for_reads(10)
    assert offload.prefetch([held, absent]) and offload.holds(held) and not offload.holds(absent)
    assert not offload.reading


def test_blocks_read_back_land_in_the_pool_as_the_torch_path_puts_them(isa: str) -> None:
    """copy_blocks_in writes each payload's rows (block_store's format) into its pool blocks as
    split_blocks + index_copy_ do, for pool tensors of mixed dtypes and an odd row size; a payload
    of the wrong size or a block outside the pool is refused."""
    copy_in = cpu_op("copy_blocks_in")
    assert copy_in is not None
    gen = torch.Generator().manual_seed(0)
    like = [torch.zeros(9, 2, 16, 8, dtype=torch.bfloat16), torch.zeros(9, 2, 16, 4, dtype=torch.uint8),
            torch.zeros(9, 2, 3, dtype=torch.float32), torch.zeros(9, 5, dtype=torch.int8)]
    row_bytes = sum(t[0].numel() * t.element_size() for t in like)
    payloads = [torch.randint(0, 256, (row_bytes,), dtype=torch.uint8, generator=gen) for _ in range(4)]
    blocks = torch.tensor([7, 0, 3, 8])
    expected = [t.clone() for t in like]
    for pool, loaded in zip(expected, split_blocks(torch.stack(payloads), expected), strict=True):
        pool.index_copy_(0, blocks, loaded)
    copy_in(like, blocks, payloads)
    for got, want in zip(like, expected, strict=True):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    with pytest.raises(RuntimeError, match="payloads of"):
        copy_in(like, blocks[:1], [payloads[0][:-1]])
    with pytest.raises(RuntimeError, match="outside the pool"):
        copy_in(like, torch.tensor([9]), payloads[:1])


def test_a_store_writer_drops_blocks_beyond_its_bound_and_takes_them_again_once_caught_up(
        caplog: pytest.LogCaptureFixture) -> None:
    """Behind a store slower than the steps the queued bytes stay bounded: a block that would
    exceed the bound is dropped and counted (one warning per backlog); what was accepted is
    written in order; once the store catches up, blocks are taken again."""
    release, written = threading.Event(), []

    def slow_store(blocks: list[tuple[bytes, list[torch.Tensor]]]) -> None:
        release.wait(10)
        written.extend(key for key, _ in blocks)

    writer = BackgroundWriter(slow_store, "test-store", max_pending_bytes=3 * 1024)
    block = [torch.zeros(1024, dtype=torch.uint8)]
    logger = logging.getLogger("kvserve")  # once an LLM is built it does not propagate to caplog's root
    logger.addHandler(caplog.handler)
    try:
        accepted = [writer.submit(bytes([i]), block) for i in range(6)]
    finally:
        logger.removeHandler(caplog.handler)
    assert accepted == [True, True, True, False, False, False]
    assert writer.dropped == 3 and writer.pending_bytes == 3 * 1024
    assert sum("falls behind" in r.getMessage() for r in caplog.records) == 1
    release.set()
    writer.flush()
    assert written == [b"\x00", b"\x01", b"\x02"] and writer.pending_bytes == 0
    assert writer.submit(b"\x07", block)
    writer.close()
    assert written[-1] == b"\x07" and writer.dropped == 3
