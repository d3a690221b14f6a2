"""Prometheus metrics, named like vLLM's with a ``kvserve:`` prefix. Pool and scheduler figures
are read from the engine's latest snapshot at scrape time; per-request figures are observed
when a request finishes (from the engine thread; prometheus_client is thread-safe)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvserve.cache.kv_stats import KVGroupStats, SpecDecodeStats
from kvserve.cache.kv_tiers import TierStats
from kvserve.engine.output import RequestOutput
from kvserve.model.cpu_kernels import ops_isa
from kvserve.tune.drift import LiveWorkload, TunedWorkload, drifts

if TYPE_CHECKING:
    from kvserve.server.async_engine import AsyncEngine

_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_LOAD = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0)
_TOKENS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
RECENT_REQUESTS = 256  # config_drift compares the mean lengths of this many latest finished requests


class _PoolCollector:
    def __init__(self, engine: AsyncEngine, tuned: TunedWorkload | None) -> None:
        self.engine = engine
        self.tuned = tuned
        self.recent: deque[tuple[int, int]] = deque(maxlen=RECENT_REQUESTS)  # (prompt, output) tokens

    def collect(self) -> Iterator[Metric]:
        stats, engine = self.engine.kv_stats, self.engine
        cache = stats.prefix_cache
        gauges = {
            "kv_cache_usage_perc": ("Fraction of KV blocks held by requests (0..1)", stats.usage),
            "kv_cache_utilization": ("Slots holding a token / allocated token slots, each block once (0..1)",
                                     stats.utilization),
            "kv_cache_tail_waste_slots": ("Allocated slots holding no token", stats.tail_waste),
            "kv_cache_live_tokens": ("Physical: slots holding a token, a shared block counted once",
                                     stats.live_tokens),
            "kv_cache_logical_tokens": ("Logical: tokens of every running request, shared blocks counted "
                                        "per holder", stats.logical_tokens),
            "kv_cache_sharing_factor": ("Logical / physical tokens (prefix sharing, >= 1)", stats.sharing_factor),
            "kv_cache_tail_slots_used": ("Running sequences holding a full-precision tail block",
                                         stats.tail_slots_used),
            "kv_cache_tail_blocks_used": ("Pool blocks those tail blocks take (part of kv_cache_usage_perc)",
                                          stats.tail_blocks_used),
            "num_requests_running": ("Requests in the running batch", engine.num_running),
            "num_requests_waiting": ("Requests waiting for admission or swapped out", engine.num_waiting),
            "num_requests_swapped": ("Requests whose blocks wait in tier 1", stats.num_swapped),
            "avg_sequence_length": ("Mean tokens per running request",
                                    stats.logical_tokens / stats.num_requests if stats.num_requests else 0.0),
            "prefix_cache_hit_rate": ("Prefix-cache hits / queries, in tokens", cache.hit_rate),
            "prefix_cache_cached_blocks": ("Blocks holding a published prefix", cache.cached_blocks),
            "kv_cache_clip_ratio": ("Share of cached K/V values clipped by static (calibrated) quantization "
                                    "scales: drift from the calibration data", stats.clip_ratio),
            "kv_evicted_tokens_now": ("Tokens the current requests hold out of the pool by streaming eviction "
                                      "or prompt compression", stats.evicted_tokens_now),
            "kv_evicted_bytes_now": ("KV bytes that eviction and compression save at this moment",
                                     stats.evicted_bytes_now),
            "kv_eviction_kept_ratio": ("Of the current requests' tokens, the share whose K/V the pool holds "
                                       "(1: nothing evicted)", stats.kept_ratio),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(f"kvserve:{name}", doc, value=value)
        ops = GaugeMetricFamily("kvserve:cpu_ops_info", "The C++ CPU ops' instruction-set level that runs: portable, "
                                "avx2, avx512 or amx; torch where none does (slower); none off CPU", labels=["isa"])
        ops.add_metric([ops_isa(engine.engine.device)], 1)
        yield ops
        counters = {
            "prefix_cache_queries": ("Prompt tokens looked up in the prefix cache", cache.queries),
            "prefix_cache_hits": ("Prompt tokens served from the prefix cache", cache.hits),
            "num_preemptions": ("Requests preempted (recomputed later)", stats.num_preemptions),
            "prefix_cache_evictions": ("Cached blocks evicted", cache.evictions),
            "kv_swaps_out": ("Requests preempted by swapping their blocks to tier 1", stats.swaps_out),
            "kv_swaps_in": ("Swapped-out requests brought back into the pool", stats.swaps_in),
            "kv_swap_fallbacks": ("Swap preemptions that recomputed instead: tier 1 was full", stats.swap_fallbacks),
            "kv_evicted_tokens": ("Tokens whose K/V streaming eviction or prompt compression dropped",
                                  stats.evicted_tokens),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(f"kvserve:{name}", doc, value=value)
        yield from _tier_metrics(stats.tiers)
        yield from _group_metrics(stats.groups)
        if stats.spec_decode is not None:
            yield from _spec_decode_metrics(stats.spec_decode)
        if self.tuned is not None:
            yield from self._drift_metrics(self.tuned, stats.usage, stats.num_preemptions, cache.hit_rate)

    def _drift_metrics(self, tuned: TunedWorkload, usage: float, preemptions: int,
                       hit_rate: float) -> Iterator[Metric]:
        recent = list(self.recent)
        count = len(recent)
        live = LiveWorkload(sum(p for p, _ in recent) / count if count else 0.0,
                            sum(o for _, o in recent) / count if count else 0.0, count, hit_rate, usage,
                            preemptions, self.engine.num_waiting)
        found = drifts(tuned, live)
        ratio = GaugeMetricFamily("kvserve:config_drift", f"Live / tuned value over the last {RECENT_REQUESTS} "
                                  "finished requests (1: the workload the config was tuned for)",
                                  labels=["quantity"])
        for drift in found:
            ratio.add_metric([drift.quantity], drift.ratio)
        yield ratio
        yield GaugeMetricFamily("kvserve:config_retune_needed", "1 when a quantity of config_drift passed its alarm "
                                "threshold (kvserve tune --check says which, with numbers)",
                                value=float(any(d.alarm for d in found)))


def _spec_decode_metrics(spec: SpecDecodeStats) -> Iterator[Metric]:
    """Speculative decoding (vLLM's spec_decode_* names)."""
    counters = {"spec_decode_num_drafts": ("Verify steps (one per request per step that verified drafts)",
                                           spec.num_drafts),
                "spec_decode_num_draft_tokens": ("Draft tokens proposed and verified", spec.num_draft_tokens),
                "spec_decode_num_accepted_tokens": ("Draft tokens accepted", spec.num_accepted_tokens),
                "spec_decode_num_bonus_tokens": ("Verify steps whose drafts were all accepted (a bonus token)",
                                                 spec.num_bonus_tokens),
                "spec_decode_num_disabled_steps": ("Steps without drafts: more requests decoded than "
                                                   "disable_by_batch_size", spec.num_disabled_steps)}
    for name, (doc, value) in counters.items():
        yield CounterMetricFamily(f"kvserve:{name}", doc, value=value)
    yield GaugeMetricFamily("kvserve:spec_decode_acceptance_rate", "Accepted / proposed draft tokens",
                            value=spec.acceptance_rate)
    yield GaugeMetricFamily("kvserve:spec_decode_mean_accepted_length",
                            "Tokens per verify step: accepted drafts plus the target's own",
                            value=spec.mean_accepted_length)
    per_position = CounterMetricFamily("kvserve:spec_decode_num_accepted_tokens_per_pos",
                                       "Draft tokens accepted at each position", labels=["position"])
    for position, count in enumerate(spec.accepted_per_position):
        per_position.add_metric([str(position)], count)
    yield per_position
    if spec.draft_kv is not None:
        yield GaugeMetricFamily("kvserve:spec_decode_draft_kv_usage_perc",
                                "Fraction of the draft model's KV blocks in use (0..1)", value=spec.draft_kv.usage)


def _group_metrics(groups: list[KVGroupStats]) -> Iterator[Metric]:
    """Per KV cache group (label ``group``: its index, ``kind``: full_attention or sliding_window)."""
    for name, doc, field in (("kv_group_blocks_used", "Pool blocks a KV cache group's tables hold", "blocks_used"),
                             ("kv_group_tokens", "Tokens a KV cache group's tables store (sliding groups drop "
                              "those out of their window)", "logical_tokens")):
        gauge = GaugeMetricFamily(f"kvserve:{name}", doc, labels=["group", "kind"])
        for index, group in enumerate(groups):
            gauge.add_metric([str(index), group.kind], getattr(group, field))
        yield gauge


def _tier_metrics(tiers: list[TierStats]) -> Iterator[Metric]:
    """Per lower tier (label ``tier``): bytes used and capacity, blocks in and out, hits, drops."""
    gauges = {"kv_tier_used_bytes": ("Bytes held by a KV tier below the pool", "used_bytes"),
              "kv_tier_capacity_bytes": ("Capacity of a KV tier below the pool", "capacity_bytes")}
    counters = {"kv_tier_hits": ("Prefix blocks promoted from a tier back into the pool", "hits"),
                "kv_tier_blocks_in": ("Blocks demoted into a tier", "blocks_in"),
                "kv_tier_blocks_out": ("Blocks promoted out of a tier", "blocks_out"),
                "kv_tier_evictions": ("Blocks dropped from a full tier", "evictions"),
                "kv_tier_errors": ("Disk blocks found missing or damaged (recomputed) and failed writes", "errors")}
    for name, (doc, field) in gauges.items():
        gauge = GaugeMetricFamily(f"kvserve:{name}", doc, labels=["tier"])
        for tier in tiers:
            gauge.add_metric([tier.name], getattr(tier, field))
        yield gauge
    for name, (doc, field) in counters.items():
        counter = CounterMetricFamily(f"kvserve:{name}", doc, labels=["tier"])
        for tier in tiers:
            counter.add_metric([tier.name], getattr(tier, field))
        yield counter


class ServerMetrics:
    def __init__(self, engine: AsyncEngine, tuned: TunedWorkload | None = None) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes and friends
        self.pool = _PoolCollector(engine, tuned)
        self.registry.register(self.pool)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"kvserve:{name}", doc, buckets=buckets, registry=self.registry)

        self.prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per request", _TOKENS)
        self.generation_tokens = histogram("request_generation_tokens", "Generated tokens per request", _TOKENS)
        self.sequence_length = histogram("request_sequence_length", "Prompt + generated tokens", _TOKENS)
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token", _LATENCY)
        self.tpot = histogram("time_per_output_token_seconds", "Mean time per token after the first", _LATENCY)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish", _LATENCY)
        self.tier_load = Histogram("kvserve:kv_tier_load_seconds", "Time to bring one block back into the pool "
                                   "from a KV tier", ["tier"], buckets=_LOAD, registry=self.registry)
        self.llm_engine = engine.engine  # the loop's engine: tier load times

    def on_step(self, outputs: list[RequestOutput]) -> None:
        for tier, seconds in self.llm_engine.take_tier_load_seconds():
            self.tier_load.labels(tier).observe(seconds)
        for out in outputs:
            if not out.finished:
                continue
            prompt, generated = len(out.prompt_token_ids), len(out.token_ids)
            self.pool.recent.append((prompt, generated))
            self.prompt_tokens.observe(prompt)
            self.generation_tokens.observe(generated)
            self.sequence_length.observe(prompt + generated)
            ttft, e2e = out.metrics.get("ttft"), out.metrics.get("e2e")
            if ttft is not None:
                self.ttft.observe(ttft)
            if e2e is not None:
                self.e2e.observe(e2e)
                if ttft is not None and generated > 1:
                    self.tpot.observe((e2e - ttft) / (generated - 1))
