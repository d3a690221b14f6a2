"""The load generator: streaming requests over httpx, timed per token as received, and a
/metrics scraper that follows the server's KV usage, memory, preemptions and prefix hits."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvserve.bench.datasets import Sample

# kvserve's names first, then vLLM's (older vLLM: gpu_cache_usage_perc)
_USAGE = ("kvserve:kv_cache_usage_perc", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
_PREEMPT = ("kvserve:num_preemptions_total", "vllm:num_preemptions_total")
_HITS = ("kvserve:prefix_cache_hits_total", "vllm:prefix_cache_hits_total")
_TIER_HITS = ("kvserve:kv_tier_hits_total",)  # summed over tiers
_QUERIES = ("kvserve:prefix_cache_queries_total", "vllm:prefix_cache_queries_total")
_DRAFTS = ("kvserve:spec_decode_num_drafts_total", "vllm:spec_decode_num_drafts_total")
_DRAFT_TOKENS = ("kvserve:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_draft_tokens_total")
_ACCEPTED = ("kvserve:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_accepted_tokens_total")


@dataclass(slots=True)
class RequestResult:
    ok: bool
    error: str = ""
    start: float = 0.0  # time.perf_counter() when sent
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds from send to the first content
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between content chunks

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


async def one_request(client: httpx.AsyncClient, base_url: str, model: str, sample: Sample,
                      headers: dict[str, str]) -> RequestResult:
    chat = sample.messages is not None
    body: dict[str, Any] = {"model": model, "max_tokens": sample.max_tokens, "stream": True, "temperature": 0,
                            "ignore_eos": True, "stream_options": {"include_usage": True}}
    if chat:
        body["messages"] = sample.messages
    else:
        body["prompt"] = sample.prompt
    url = base_url.rstrip("/") + ("/v1/chat/completions" if chat else "/v1/completions")
    start = time.perf_counter()
    result = RequestResult(ok=False, start=start)
    last = None
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                return RequestResult(ok=False, error=f"HTTP {response.status_code}: {text[:200]}", start=start)
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if data.get("usage"):
                    result.prompt_tokens = data["usage"]["prompt_tokens"]
                    result.output_tokens = data["usage"]["completion_tokens"]
                for choice in data.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                    if piece:
                        now = time.perf_counter()
                        if last is None:
                            result.ttft = now - start
                        else:
                            result.itl.append(now - last)
                        last = now
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        return RequestResult(ok=False, error=f"{type(exc).__name__}: {exc}", start=start)
    result.e2e = time.perf_counter() - start
    result.ok = last is not None or result.output_tokens == 0
    if last is None:
        result.ttft = result.e2e
    return result


def scrape(text: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.labels or sample.name.startswith(("kvserve:", "vllm:")):
                values[sample.name] = values.get(sample.name, 0.0) + float(sample.value)
    return values


def first(values: dict[str, float], names: tuple[str, ...]) -> float | None:
    return next((values[n] for n in names if n in values), None)


@dataclass(slots=True)
class ServerTrace:
    """What /metrics showed during a level."""

    peak_kv_usage: float = 0.0
    peak_rss_bytes: float = 0.0
    preemptions: float = 0.0
    prefix_hit_rate: float | None = None
    tier_hits: float | None = None  # prefix blocks promoted from KV tiers below the pool (kvserve)
    spec_acceptance: float | None = None  # speculative decoding: accepted / proposed draft tokens
    spec_accepted_length: float | None = None  # tokens per verify step (accepted drafts + 1)
    kv_snapshot_at_peak: dict[str, Any] | None = None  # kvserve's /v1/kv when usage peaked


async def _watch(client: httpx.AsyncClient, base_url: str, headers: dict[str, str], trace: ServerTrace,
                 stop: asyncio.Event) -> None:
    base = base_url.rstrip("/")
    begin: dict[str, float] | None = None
    end: dict[str, float] = {}
    while True:
        try:
            values = scrape((await client.get(base + "/metrics")).text)
        except (httpx.HTTPError, ValueError):
            values = {}
        if values:
            begin = begin if begin is not None else values
            end = values
            usage = first(values, _USAGE) or 0.0
            if usage >= trace.peak_kv_usage:
                trace.peak_kv_usage = usage
                try:
                    response = await client.get(base + "/v1/kv", headers=headers)
                    trace.kv_snapshot_at_peak = response.json() if response.status_code == 200 else None
                except (httpx.HTTPError, ValueError):
                    pass
            trace.peak_rss_bytes = max(trace.peak_rss_bytes, values.get("process_resident_memory_bytes", 0.0))
        if stop.is_set():
            break
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=0.25)
    if begin is not None:
        trace.preemptions = (first(end, _PREEMPT) or 0.0) - (first(begin, _PREEMPT) or 0.0)
        queries = (first(end, _QUERIES) or 0.0) - (first(begin, _QUERIES) or 0.0)
        hits = (first(end, _HITS) or 0.0) - (first(begin, _HITS) or 0.0)
        trace.prefix_hit_rate = hits / queries if queries > 0 else None
        tier_end = first(end, _TIER_HITS)
        trace.tier_hits = None if tier_end is None else tier_end - (first(begin, _TIER_HITS) or 0.0)

        def delta(names: tuple[str, ...]) -> float:
            return (first(end, names) or 0.0) - (first(begin, names) or 0.0)

        drafts, proposed, accepted = delta(_DRAFTS), delta(_DRAFT_TOKENS), delta(_ACCEPTED)
        if proposed > 0:
            trace.spec_acceptance = accepted / proposed
            trace.spec_accepted_length = 1 + accepted / drafts if drafts > 0 else None


async def run_level(base_url: str, model: str, samples: list[Sample], concurrency: int | None = None,
                    rate: float | None = None, api_key: str | None = None, timeout: float = 600.0,
                    seed: int = 0, progress: Any = None, max_duration: float | None = None,
                    ) -> tuple[list[RequestResult], float, ServerTrace]:
    """Send every sample, at most ``concurrency`` in flight, or at Poisson arrivals of ``rate``
    requests/s, a sample that follows another (a conversation's next turn) not before that one has
    finished; after ``max_duration`` seconds the requests still pending are cancelled and
    count as errors. Returns the results (in sample order), the wall time and the server trace."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max(concurrency or 0, 64) + 4)
    trace, stop = ServerTrace(), asyncio.Event()
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        watcher = asyncio.create_task(_watch(client, base_url, headers, trace, stop))
        gate = asyncio.Semaphore(concurrency or len(samples))
        rng = random.Random(seed)
        finished = [asyncio.Event() for _ in samples]

        async def send(index: int, sample: Sample, delay: float) -> RequestResult:
            try:
                await asyncio.sleep(delay)
                if sample.follows is not None:
                    await finished[sample.follows].wait()
                async with gate:
                    result = await one_request(client, base_url, model, sample, headers)
            except asyncio.CancelledError:
                result = RequestResult(ok=False, error=f"not finished within --max-duration {max_duration:g} s")
            finished[index].set()
            if progress is not None:
                progress.update(1)
            return result

        delays, t = [], 0.0
        for _ in samples:
            delays.append(t)
            if rate:
                t += rng.expovariate(rate)
        start = time.perf_counter()
        tasks = [asyncio.create_task(send(i, s, d)) for i, (s, d) in enumerate(zip(samples, delays, strict=True))]
        _, pending = await asyncio.wait(tasks, timeout=max_duration)
        for task in pending:
            task.cancel()
        results = [await task for task in tasks]
        wall = time.perf_counter() - start
        stop.set()
        await watcher
    return list(results), wall, trace
