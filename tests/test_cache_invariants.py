"""Property-based tests of the block pool, the manager and the scheduler's use of them."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvserve.cache.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from kvserve.cache.kv_cache_manager import KVCacheManager
from kvserve.cache.kv_groups import FULL_ATTENTION, KVCacheSpec, cdiv
from kvserve.cache.kv_retention import StreamingWindow
from kvserve.cache.kv_tiers import TierIndex
from kvserve.cache.prefix_cache import TokenReader
from kvserve.engine.request import Request, RequestStatus
from kvserve.engine.sampling import SamplingParams
from kvserve.engine.scheduler import Scheduler


def check_manager(kv: KVCacheManager) -> None:
    """Every invariant of the records (RequestKV), the pool and the statistics."""
    holders = kv.holders()
    owners = Counter(b.block_id for record in holders.values() for table in record.live_tables() for b in table)
    assert 0 not in owners, "the null block was handed out"
    assert all(b.ref_cnt >= 0 for b in kv.pool.blocks)
    free_ids = {b.block_id for b in kv.pool.free_queue}
    assert len(free_ids) == kv.pool.num_free_blocks
    assert not free_ids & set(owners)
    assert all(not record.tails for record in kv.requests.values() if record.tables is None)  # tails go with tables
    runs = [run for record in holders.values() for run in record.tails]
    tail_ids = [b.block_id for run in runs for b in run]
    for record in holders.values():  # one tail run per group, where the format keeps tails
        assert len(record.tails) == (len(kv.groups) if kv.tail_blocks else 0)
        assert len(record.policies) == len(kv.groups) and record.shares == (record.window is None
                                                                              and not record.compacted)
    for run in runs:  # aligned, contiguous, held once, past the null block's run
        ids = [b.block_id for b in run]
        assert ids == list(range(ids[0], ids[0] + kv.tail_blocks)) and ids[0] % kv.tail_blocks == 0 and ids[0]
        assert all(b.ref_cnt == 1 and b.block_hash is None for b in run)
    assert len(set(tail_ids)) == len(tail_ids) and not set(tail_ids) & (free_ids | set(owners))
    assert len(free_ids) + len(owners) + len(tail_ids) == kv.pool.num_usable_blocks
    held: dict[int, int] = {}  # physical: tokens each distinct block holds
    logical = 0
    for record in holders.values():
        assert record.tables is not None and record.swapped is None
        for policy, table, first in zip(record.policies, record.tables, record.num_released, strict=True):
            assert len(table) == cdiv(record.num_tokens, kv.block_size)
            assert all(b is kv.pool.null_block for b in table[:first])
            # nothing the next query (at num_tokens) reads was released
            assert first <= policy.first_live_block(record.num_tokens, kv.block_size)
            logical += record.num_tokens - first * kv.block_size
            for i, block in enumerate(table[first:], start=first):
                assert block.ref_cnt == owners[block.block_id], "ref count != number of tables holding it"
                if block.ref_cnt > 1:
                    assert block.block_hash is not None, "only published blocks are shared"
                filled = min(kv.block_size, record.num_tokens - i * kv.block_size)
                held[block.block_id] = max(held.get(block.block_id, 0), filled)
    stats = kv.stats()
    assert stats.blocks_used == len(owners) + len(tail_ids) and stats.tail_blocks_used == len(tail_ids)
    assert stats.logical_tokens == logical == sum(g.logical_tokens for g in stats.groups)
    assert sum(g.blocks_used for g in stats.groups) == len(owners)
    assert stats.live_tokens == sum(held.values())
    assert stats.allocated_slots == len(owners) * kv.block_size
    assert stats.utilization <= 1.0 and stats.tail_waste >= 0
    assert stats.tail_waste < max(1, len(holders) * len(kv.groups)) * kv.block_size or not holders
    assert stats.sharing_factor >= 1.0


GROUPS = {"full": [FULL_ATTENTION], "hybrid": [FULL_ATTENTION, KVCacheSpec(5), KVCacheSpec(5)],
          "sliding": [KVCacheSpec(17)]}


ops = st.lists(
    st.tuples(st.sampled_from(["grow", "grow", "free", "compact"]), st.integers(0, 7), st.integers(1, 40)),
    max_size=80
)


def shared_tokens(request_id: str) -> TokenReader:
    """Token ids with long common prefixes across requests (every third request differs), so
    prefix caching shares blocks."""
    offset = 1000 if int(request_id[1:]) % 3 == 0 else 0
    return lambda start, end: [offset + i // 5 for i in range(start, end)]


@given(ops=ops, block_size=st.sampled_from([1, 2, 4, 16]), num_blocks=st.integers(2, 40), caching=st.booleans(),
       tail_blocks=st.sampled_from([0, 0, 2, 4]), groups=st.sampled_from(sorted(GROUPS)))
@settings(max_examples=300, deadline=None)
def test_manager_random_ops(ops: list[tuple[str, int, int]], block_size: int, num_blocks: int,
                            caching: bool, tail_blocks: int, groups: str) -> None:
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching, tail_blocks=tail_blocks,
                        groups=GROUPS[groups])
    for op, rid, n in ops:
        request_id = f"r{rid}"
        tokens = shared_tokens(request_id)
        shift = kv.evicted_tokens(request_id)  # compaction moved the request's tokens to cache positions
        if op == "grow":
            before = kv.pool.num_free_blocks
            target = kv.num_tokens(request_id) + shift + n
            cached = None if request_id in kv.holders() else kv.find_cached_prefix(request_id, target, tokens)
            foreseen = kv.blocks_to_reach(request_id, target, cached)  # what admission control reserves
            ok = kv.allocate_slots(request_id, target, tokens, cached)
            exact = groups == "full"  # sliding groups: an estimate (shared blocks leaving the window stay held)
            if not ok:
                # a failed allocation takes nothing (sliding groups may still give back blocks out of the window)
                assert kv.pool.num_free_blocks == before or (groups != "full" and kv.pool.num_free_blocks > before)
                assert not exact or foreseen > before or tail_blocks  # short of blocks (or of an aligned tail run)
            else:
                assert kv.num_tokens(request_id) == target - shift
                assert not exact or before - kv.pool.num_free_blocks == foreseen
                assert not exact or kv.blocks_to_reach(request_id, target) == 0
        elif op == "compact":  # keep n% of the request's tokens in fresh private blocks (SnapKV)
            if groups != "full" or request_id not in kv.holders():
                continue
            held, free = kv.num_tokens(request_id), kv.pool.num_free_blocks
            keep = max(1, held * n // 40)
            old_blocks = len(kv.block_ids(request_id))
            moved = kv.compact(request_id, keep)
            if moved is None:  # the pool was short: nothing changed
                assert kv.num_tokens(request_id) == held and kv.pool.num_free_blocks == free
            else:
                old, new = moved
                assert len(old) == old_blocks and len(new) == kv.blocks_needed(keep) and not set(new) & set(old)
                assert kv.num_tokens(request_id) == keep and kv.evicted_tokens(request_id) == shift + held - keep
                assert kv.requests[request_id].compacted and not kv.requests[request_id].shares
        else:
            kv.free(request_id)
        check_manager(kv)
    for rid in list(kv.holders()):
        kv.free(rid)
    check_manager(kv)
    assert kv.pool.num_free_blocks == kv.pool.num_usable_blocks and kv.stats().live_tokens == 0
    assert kv.pool.num_shared_refs == 0 and not kv.holders()


def test_shared_prefix_counts_once() -> None:
    """Two requests on one cached prefix block: the block is stored once, so utilization stays
    <= 1 (on a16fa74 the shared block counted twice: 64 live tokens in 48 slots, 133%)."""
    kv = KVCacheManager(8, 16, enable_prefix_caching=True)
    tokens = shared_tokens("r1")
    assert kv.allocate_slots("r1", 32, tokens)
    cached = kv.find_cached_prefix("r2", 32, tokens)
    assert cached.num_blocks == 1
    assert kv.allocate_slots("r2", 32, tokens, cached)
    stats = kv.stats()
    assert (stats.blocks_used, stats.allocated_slots) == (3, 48)
    assert (stats.live_tokens, stats.logical_tokens) == (48, 64)
    assert stats.utilization == 1.0 and stats.tail_waste == 0
    assert stats.sharing_factor == pytest.approx(64 / 48)
    kv.record_step()
    assert kv.stats().utilization_at_peak == 1.0


def test_free_queue_is_o1_linked_list() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    q.remove(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4] and q.num_free_blocks == 4
    assert q.popleft() is blocks[0]
    q.append(blocks[2])
    assert [b.block_id for b in q] == [1, 3, 4, 2]
    with pytest.raises(ValueError):
        q.append(blocks[3])
    pool = BlockPool(3)
    taken = pool.get_new_blocks(2)
    pool.free_blocks(taken)
    with pytest.raises(ValueError, match="double free"):
        pool.free_blocks(taken[:1])


@st.composite
def workloads(draw: st.DrawFn) -> tuple[list[tuple[int, int, int]], int, int, int, int, int]:
    block_size = draw(st.sampled_from([1, 4, 16]))
    num_blocks = draw(st.integers(4, 30))
    tail_blocks = draw(st.sampled_from([0, 0, 2]))  # 2: each running request also holds a tail run
    max_len = (num_blocks - 1 - tail_blocks) * block_size
    reqs = draw(st.lists(st.tuples(st.integers(1, max_len), st.integers(1, 30), st.integers(0, 6)),
                         min_size=1, max_size=12))
    tier_blocks = draw(st.sampled_from([0, 0, 4, 40]))  # tier 1: prefix demotion and swap preemption
    return (reqs, block_size, num_blocks, draw(st.integers(1, 8)), draw(st.integers(1, 64)), tail_blocks, tier_blocks,
            draw(st.sampled_from([0, 0, 3, 7])),  # speculative drafts per step, at most
            draw(st.sampled_from(sorted(GROUPS))))


@given(workloads(), st.randoms(use_true_random=False))
@settings(max_examples=150, deadline=None)
def test_scheduler_never_drops_or_corrupts(workload, rnd) -> None:  # type: ignore[no-untyped-def]
    """Drive the real scheduler and manager with bookkeeping in place of the model: random
    arrivals and aborts, and speculative drafts of which a random prefix stands (the rest rolled
    back); every request ends with exactly its tokens, blocks never leak."""
    specs, block_size, num_blocks, max_seqs, budget, tail_blocks, tier_blocks, max_drafts, groups = workload
    tier = TierIndex("cpu", tier_blocks, 1) if tier_blocks else None
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=True, tail_blocks=tail_blocks, host_tier=tier,
                        groups=GROUPS[groups], max_chunk_tokens=budget)
    sched = Scheduler(kv, max_seqs, budget, preemption_mode="swap" if tier else "recompute")
    max_len = kv.capacity_tokens
    assume(max_len >= 1)  # three groups' tail runs may leave a tiny pool no room for a token
    pending = list(enumerate(specs))
    requests: list[Request] = []
    aborted: set[str] = set()
    steps = 0
    while pending or sched.has_unfinished():
        steps += 1
        assert steps < 20000, "no progress"
        while pending and (not sched.has_unfinished() or rnd.random() < 0.3):
            i, (prompt_len, max_tokens, _) = pending.pop(0)
            # prompts of three kinds, so that requests share cached prefix blocks
            r = Request(f"r{i}", [i % 3] * min(prompt_len, max_len), SamplingParams(max_tokens=max_tokens), i)
            requests.append(r)
            sched.add(r)
        if sched.running and rnd.random() < 0.05:
            victim = rnd.choice(sched.running)
            sched.finish(victim, "abort")
            aborted.add(victim.request_id)
        for r in sched.running:  # drafts: the tokens that should come next (a token encodes its index)
            if max_drafts and r.num_computed_tokens == r.num_tokens - 1:
                k = min(rnd.randint(0, max_drafts), r.params.max_tokens - len(r.output_token_ids) - 1,
                        max_len - r.num_tokens - 1)
                r.spec_token_ids = list(range(len(r.output_token_ids), len(r.output_token_ids) + max(k, 0)))
        scheduled = sched.schedule()
        chunks = scheduled.chunks
        for r in scheduled.preempted:  # swapped out (progress kept, blocks in tier 1) or reset for recompute
            assert (r.status is RequestStatus.SWAPPED and kv.requests[r.request_id].swapped is not None) or (
                r.status is RequestStatus.WAITING and r.num_computed_tokens == 0)
        # the plan carries the step's tier moves: nothing is left waiting in the tier for a later step
        assert (scheduled.storage.tier_moves is None) == (tier is None) and not any(tier.take_moves() if tier else ())
        assert not {r.request_id for r in scheduled.preempted} & {c.request.request_id for c in chunks}
        assert sum(c.num_tokens for c in chunks) <= budget and len(sched.running) <= max_seqs
        assert all(c.request.request_id in kv.holders() for c in chunks)
        written: list[int] = []
        for c in chunks:
            r = c.request
            # every token about to be computed has a slot of its own, outside the null block
            written += kv.slot_mapping(r.request_id, r.num_computed_tokens, r.num_computed_tokens + c.num_tokens)
        # no two requests write one slot (a block published this step may already be shared by a
        # request admitted in it, which reads it after the publisher's write)
        assert len(set(written)) == len(written) and (not written or min(written) >= block_size)
        for c in chunks:
            done = c.completes_sequence
            c.request.num_computed_tokens += c.num_tokens
            if done:
                r = c.request
                accepted = rnd.randint(0, len(c.draft_token_ids))
                if c.draft_token_ids:  # the rest were rejected: their slots are rolled back
                    r.num_computed_tokens -= len(c.draft_token_ids) - accepted
                    kv.rollback(r.request_id, r.num_computed_tokens)
                for _ in range(accepted + 1):
                    r.output_token_ids.append(len(r.output_token_ids))  # the token encodes its index
                    if len(r.output_token_ids) >= r.params.max_tokens or r.num_tokens >= max_len:
                        sched.finish(r, "length")
                        break
        check_manager(kv)
        for r in sched.running:  # slots held = tokens computed: rejected drafts hold none
            assert kv.num_tokens(r.request_id) == r.num_computed_tokens
    assert kv.pool.num_free_blocks == kv.pool.num_usable_blocks
    assert not kv.requests and (tier is None or tier.num_reserved == 0)
    for r in requests:
        assert r.finished
        if r.request_id not in aborted:
            expected = min(r.params.max_tokens, max_len - r.num_prompt_tokens)
            assert r.output_token_ids == list(range(max(expected, 1)))


@given(st.sampled_from([1, 4, 16]), st.integers(0, 20), st.integers(1, 40), st.integers(1, 64),
       st.lists(st.tuples(st.integers(1, 60), st.integers(1, 200)), min_size=1, max_size=8),
       st.sampled_from([0, 40]), st.booleans(), st.randoms(use_true_random=False))
@settings(max_examples=100, deadline=None)
def test_streaming_eviction_keeps_sinks_and_window(block_size, sinks, window, budget, specs, tier_blocks,  # type: ignore[no-untyped-def]
                                                   hybrid, rnd) -> None:
    """The scheduler and a streaming manager (evict before each step, as the engine does), with
    bookkeeping in place of the model: each table holds its sink blocks (the same blocks from
    the first eviction on, until a swap moves them) and its window, never more than StreamingWindow.blocks_held; the
    accounting holds after every step, with aborts and preemption; nothing leaks. With sliding
    groups beside the full one, they close up with it and keep their windows."""
    streaming = StreamingWindow(sinks, window)
    held = streaming.blocks_held(block_size, budget)
    # hybrid: two sliding groups besides the full one, which the stream's window covers
    groups = [FULL_ATTENTION, *([KVCacheSpec(5)] * 2 if hybrid else [])]
    assume(not hybrid or window >= 5)
    per_request = held + sum(spec.blocks_held(1 << 30, block_size, budget) for spec in groups[1:])
    num_blocks = 1 + per_request * 2 + rnd.randint(0, per_request)  # room for two or three requests: preemption
    tier = TierIndex("cpu", tier_blocks, 1) if tier_blocks else None
    kv = KVCacheManager(num_blocks, block_size, host_tier=tier, max_chunk_tokens=budget, streaming=streaming,
                        groups=groups)
    sched = Scheduler(kv, 4, budget, preemption_mode="swap" if tier else "recompute")
    requests = [Request(f"r{i}", [1] * prompt, SamplingParams(max_tokens=out), i) for i, (prompt, out) in
                enumerate(specs)]
    for r in requests:
        sched.add(r)
    sink_ids: dict[str, list[int]] = {}
    steps = 0
    while sched.has_unfinished():
        steps += 1
        assert steps < 20000, "no progress"
        for r in sched.running:
            eviction = kv.evict(r.request_id, r.num_computed_tokens)
            if eviction is not None:
                assert eviction.shift == kv.evicted_tokens(r.request_id) and eviction.shift % block_size == 0
                if eviction.first or r.request_id not in sink_ids:  # or back from a swap: new block ids
                    sink_ids[r.request_id] = eviction.sink_block_ids
                assert eviction.sink_block_ids == sink_ids[r.request_id]
                assert len(eviction.sink_block_ids) == streaming.sink_blocks(block_size)
        if sched.running and rnd.random() < 0.03:
            sched.finish(rnd.choice(sched.running), "abort")
        scheduled = sched.schedule()
        for r in scheduled.preempted:
            sink_ids.pop(r.request_id, None)  # swapped: its blocks come back elsewhere
            if r.status is RequestStatus.WAITING:  # recomputed: evicts afresh
                assert kv.evicted_tokens(r.request_id) == 0
        assert (scheduled.storage.tier_moves is None) == (tier is None) and not any(tier.take_moves() if tier else ())
        written: list[int] = []
        for c in scheduled.chunks:
            r = c.request
            written += kv.slot_mapping(r.request_id, r.num_computed_tokens, r.num_computed_tokens + c.num_tokens)
        assert len(set(written)) == len(written) and (not written or min(written) >= block_size)
        for c in scheduled.chunks:
            r = c.request
            done = c.completes_sequence
            r.num_computed_tokens += c.num_tokens
            first_query = r.num_computed_tokens - c.num_tokens  # the window is kept for the chunk's first query
            table = kv.block_ids(r.request_id)
            assert len(table) <= held
            sink = streaming.sink_blocks(block_size)
            if kv.evicted_tokens(r.request_id):  # the window's blocks start where the first query needs them
                assert (kv.evicted_tokens(r.request_id) + sink * block_size) // block_size == \
                    (first_query - window + 1) // block_size
            if done:
                r.output_token_ids.append(len(r.output_token_ids))
                if len(r.output_token_ids) >= r.params.max_tokens:
                    sched.finish(r, "length")
        check_manager(kv)
        for r in sched.running:
            assert kv.num_tokens(r.request_id) + kv.evicted_tokens(r.request_id) == r.num_computed_tokens
    assert kv.pool.num_free_blocks == kv.pool.num_usable_blocks and not kv.requests


def test_blocks_to_reach_counts_revived_hits() -> None:
    """Cached blocks no request holds sit in the free queue: a hit on them costs the block it
    revives; a hit on blocks another request holds costs nothing."""
    kv = KVCacheManager(8, 4, enable_prefix_caching=True)
    tokens: TokenReader = lambda start, end: list(range(start, end))  # noqa: E731
    assert kv.allocate_slots("a", 8, tokens)
    kv.free("a")  # its two full blocks stay cached, unreferenced
    hits = kv.find_cached_prefix("b", 10, tokens)
    assert hits.num_blocks == 2 and kv.blocks_to_reach("b", 10, hits) == 3
    free = kv.pool.num_free_blocks
    assert kv.allocate_slots("b", 10, tokens, hits) and free - kv.pool.num_free_blocks == 3
    assert kv.blocks_to_reach("c", 10, kv.find_cached_prefix("c", 10, tokens)) == 1
