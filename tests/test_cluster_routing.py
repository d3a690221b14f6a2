"""Scale-out pieces that need no Ray: the kv-aware router's index and rule, the ASGI bridge a
replica serves through, the ingress's metrics merge."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvserve.cache.prefix_cache import hash_block, prompt_block_hashes
from kvserve.cluster.asgi import ForwardedRequest, ResponseStart, call_asgi
from kvserve.cluster.config import ClusterConfig
from kvserve.cluster.metrics import exposition, merge_replica_metrics
from kvserve.cluster.prefix_index import Load, PrefixIndex, choose_replica
from kvserve.config import ConfigError


def keys(tokens: list[int], block_size: int = 4) -> list[bytes]:
    return prompt_block_hashes(tokens, block_size)


def test_prompt_block_hashes_chain_full_blocks_only() -> None:
    got = prompt_block_hashes(list(range(10)), 4)
    assert len(got) == 2  # the partial third block has no key
    assert got[0] == hash_block(None, [0, 1, 2, 3]) and got[1] == hash_block(got[0], [4, 5, 6, 7])
    assert prompt_block_hashes([9, 1, 2, 3, 4, 5, 6, 7], 4)[1] != got[1]  # a different first block changes all


def test_index_matches_leading_blocks_and_forgets_lru() -> None:
    index = PrefixIndex(capacity_blocks=4)
    index.sync(["a", "b"])
    system = list(range(8))
    index.insert("a", keys([*system, 100, 101, 102, 103]))
    assert index.matched_blocks("a", keys([*system, 200, 201, 202, 203])) == 2  # the shared system prompt
    assert index.matched_blocks("b", keys(system)) == 0
    # chained: a later block held without the earlier one does not count
    assert index.matched_blocks("a", keys([7] * 4 + system[4:])) == 0
    index.insert("a", keys(list(range(50, 58))))  # 2 more blocks: the 4-block budget drops the oldest 2
    assert index.size("a") == 4
    assert index.matched_blocks("a", keys(system)) == 0
    index.forget("a", keys(list(range(50, 58)))[1:])
    assert index.matched_blocks("a", keys(list(range(50, 58)))) == 1
    index.sync(["b", "c"])
    assert index.replicas == ["b", "c"] and index.size("a") == 0
    with pytest.raises(ValueError, match="capacity_blocks"):
        PrefixIndex(0)


def test_choose_replica_affinity_within_load_bounds() -> None:
    index = PrefixIndex(1000)
    index.sync(["a", "b"])
    prompt = keys(list(range(16)))
    index.insert("a", prompt)
    idle = {"a": Load(0), "b": Load(0)}
    assert choose_replica(index, prompt, idle, 4, 0.3) == ("a", 4, "affinity")
    # busier by 4 requests: still within the bound; by 5: balance wins
    assert choose_replica(index, prompt, {"a": Load(6), "b": Load(2)}, 4, 0.3).replica == "a"
    assert choose_replica(index, prompt, {"a": Load(7), "b": Load(2)}, 4, 0.3) == ("b", 0, "balance-requests")
    # KV usage too
    assert choose_replica(index, prompt, {"a": Load(0, 0.9), "b": Load(0, 0.5)}, 4, 0.3).reason == "balance-kv"
    assert choose_replica(index, prompt, {"a": Load(0, 0.7), "b": Load(0, 0.5)}, 4, 0.3).reason == "affinity"
    # no replica holds the prompt: the replicas within the load bounds take turns (the one chosen
    # least recently), not the least-loaded
    other = keys(list(range(100, 116)))
    assert choose_replica(index, other, idle, 4, 0.3, {"a": 3, "b": 2}) == ("b", 0, "spread")
    assert choose_replica(index, other, idle, 4, 0.3, {"a": 2, "b": 3}) == ("a", 0, "spread")
    assert choose_replica(index, other, {"a": Load(0), "b": Load(3)}, 4, 0.3, {"a": 9}).replica == "b"
    assert choose_replica(index, other, {"a": Load(0), "b": Load(5)}, 4, 0.3, {"a": 9}).replica == "a"
    assert choose_replica(index, other, {"a": Load(1, 0.7), "b": Load(1, 0.2)}, 4, 0.3, {"b": 9}).replica == "b"
    # balance goes to the least-loaded replica, ties to the one chosen least recently
    assert choose_replica(index, prompt, {"a": Load(7), "b": Load(1), "c": Load(1)}, 4, 0.3,
                          {"b": 5, "c": 4}) == ("c", 0, "balance-requests")
    # the longest match wins among several
    index.insert("b", prompt[:2])
    assert choose_replica(index, prompt, idle, 4, 0.3).replica == "a"
    with pytest.raises(ValueError):
        choose_replica(index, prompt, {}, 4, 0.3)


def test_a_prefix_in_the_shared_store_counts_on_every_replica() -> None:
    index = PrefixIndex(1000, shared_capacity_blocks=6)
    index.sync(["a", "b", "c"])
    document = keys(list(range(16)))
    index.insert("a", document)
    assert index.shared_blocks(document) == 0  # routed, not yet computed: not in the store
    index.insert_shared(document)  # the request completed
    assert index.shared_blocks(document) == 4 and index.matched_blocks("b", document) == 0
    # a holds it in its pool: it wins while loads tie; the others serve it from the store when a is busier
    idle = {"a": Load(0), "b": Load(0), "c": Load(0)}
    assert choose_replica(index, document, idle, 8, 1.0) == ("a", 4, "affinity")
    assert choose_replica(index, document, {"a": Load(1), "b": Load(0), "c": Load(0)}, 8, 1.0,
                          {"b": 2, "c": 1}) == ("c", 4, "shared")
    # a longer prefix in a's own pool still beats the shared one, within the load bounds
    index.insert("a", keys(list(range(24))))
    index.insert_shared(keys(list(range(24))))  # 6 blocks: the shared list keeps 6
    longer = keys(list(range(28)))
    assert index.shared_blocks(longer) == 6
    index.insert_shared(keys(list(range(200, 204))))  # the shared list drops the oldest block: a chain miss
    assert index.shared_blocks(longer) == 0 and index.matched_blocks("a", longer) == 6
    assert choose_replica(index, longer, {"a": Load(3), "b": Load(0), "c": Load(0)}, 8, 1.0).reason == "affinity"
    # without a shared store nothing is shared
    alone = PrefixIndex(1000)
    alone.insert_shared(document)
    assert alone.shared_blocks(document) == 0
    with pytest.raises(ValueError, match="shared_capacity_blocks"):
        PrefixIndex(10, -1)


def test_cluster_config_names_bad_values() -> None:
    with pytest.raises(ConfigError, match=r"--router must be one of .* got 'random'"):
        ClusterConfig(router="random")
    with pytest.raises(ConfigError, match="--num-replicas must be >= 1, got 0"):
        ClusterConfig(num_replicas=0)
    with pytest.raises(ConfigError, match="--router-max-kv-imbalance"):
        ClusterConfig(max_kv_imbalance=1.5)
    with pytest.raises(ConfigError, match=r"--prefill-replicas and --decode-replicas go together .* got 1 and 0"):
        ClusterConfig(prefill_replicas=1)
    with pytest.raises(ConfigError, match="--decode-replicas must be >= 0, got -1"):
        ClusterConfig(prefill_replicas=1, decode_replicas=-1)
    split = ClusterConfig(prefill_replicas=1, decode_replicas=3)
    assert split.disaggregated and split.num_replicas == 3
    with pytest.raises(ConfigError, match="give --kv-offload-remote"):
        split.check_engine(None)
    split.check_engine("redis://127.0.0.1:6379/0")
    ClusterConfig().check_engine(None)  # no disaggregation: no store needed


def test_the_prefill_copy_of_a_request_asks_one_token_without_streaming() -> None:
    from kvserve.cluster.deploy import prefill_body

    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 50, "stream": True, "n": 3, "logprobs": 2,
            "stream_options": {"include_usage": True}, "temperature": 0.7}
    copy = json.loads(prefill_body(json.dumps(body).encode()) or b"")
    assert copy == {"model": "m", "prompt": [1, 2, 3], "max_tokens": 1, "stream": False, "n": 1, "temperature": 0.7}
    assert "echo" not in json.loads(prefill_body(json.dumps({"prompt": "x", "echo": True}).encode()) or b"")
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 9}
    assert json.loads(prefill_body(json.dumps(chat).encode()) or b"")["max_tokens"] == 1
    assert prefill_body(b"not json") is None and prefill_body(b"[1]") is None
    assert prefill_body(json.dumps({**body, "prompt_logprobs": 1}).encode()) is None
    assert prefill_body(json.dumps({**body, "prompt_logprobs": 0}).encode()) is None  # 0 still computes the prompt
    assert prefill_body(json.dumps({"prompt": "x", "echo": True, "logprobs": 0}).encode()) is None
    assert "é" in (prefill_body(json.dumps({"prompt": "café"}).encode()) or b"").decode()  # kept as sent


def _toy_app() -> FastAPI:
    app = FastAPI()
    closed: list[bool] = []
    app.state.closed = closed

    @app.post("/echo")
    async def echo(body: dict[str, int]) -> dict[str, int]:
        return {"doubled": body["x"] * 2}

    @app.get("/stream")
    async def stream() -> StreamingResponse:
        async def parts():  # type: ignore[no-untyped-def]
            try:
                for i in range(100):
                    yield f"data: {i}\n\n"
                    await asyncio.sleep(0.001)
            finally:
                closed.append(True)

        return StreamingResponse(parts(), media_type="text/event-stream")

    return app


def test_call_asgi_forwards_body_status_and_stream() -> None:
    app = _toy_app()

    async def collect(request: ForwardedRequest, limit: int | None = None) -> list[ResponseStart | bytes]:
        parts: list[ResponseStart | bytes] = []
        gen = call_asgi(app, request, "r1")
        async for part in gen:
            parts.append(part)
            if limit is not None and len(parts) >= limit:
                await gen.aclose()  # the client went away
                break
        return parts

    json_headers = [(b"content-type", b"application/json")]
    parts = asyncio.run(collect(ForwardedRequest("POST", "/echo", b"", json_headers, b'{"x": 21}')))
    assert isinstance(parts[0], ResponseStart) and parts[0].status == 200 and parts[0].replica == "r1"
    assert json.loads(b"".join(p for p in parts[1:] if isinstance(p, bytes))) == {"doubled": 42}
    bad = asyncio.run(collect(ForwardedRequest("POST", "/echo", b"", json_headers, b'{"x": "no"}')))
    assert isinstance(bad[0], ResponseStart) and bad[0].status == 422
    missing = asyncio.run(collect(ForwardedRequest("GET", "/nowhere", b"", [], b"")))
    assert isinstance(missing[0], ResponseStart) and missing[0].status == 404
    streamed = asyncio.run(collect(ForwardedRequest("GET", "/stream", b"", [], b"")))
    assert b"".join(p for p in streamed if isinstance(p, bytes)).count(b"data: ") == 100
    app.state.closed.clear()
    asyncio.run(collect(ForwardedRequest("GET", "/stream", b"", [], b""), limit=5))
    assert app.state.closed == [True]  # closing early ended the app's stream


def _replica_text(hits: float) -> str:
    registry = CollectorRegistry()
    Counter("kvserve:prefix_cache_hits", "hits", registry=registry).inc(hits)
    Gauge("kvserve:num_requests_running", "running", ["tier"], registry=registry).labels("pool").set(hits)
    Histogram("kvserve:time_to_first_token_seconds", "ttft", registry=registry).observe(0.2)
    return generate_latest(registry).decode()


def test_merged_metrics_label_every_replica_and_parse() -> None:
    router = CollectorRegistry()
    Counter("kvserve:router_requests", "routed", ["router"], registry=router).labels("kv-aware").inc(3)
    text = exposition(merge_replica_metrics({"r1": _replica_text(2), "r2": _replica_text(5)}), router).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    hits = {s.labels["replica"]: s.value for s in families["kvserve:prefix_cache_hits"].samples
            if s.name.endswith("_total")}
    assert hits == {"r1": 2.0, "r2": 5.0}
    running = families["kvserve:num_requests_running"].samples
    assert {(s.labels["replica"], s.labels["tier"]) for s in running} == {("r1", "pool"), ("r2", "pool")}
    counts = [s for s in families["kvserve:time_to_first_token_seconds"].samples if s.name.endswith("_count")]
    assert sorted(s.labels["replica"] for s in counts) == ["r1", "r2"]
    assert text.count("# TYPE kvserve:prefix_cache_hits_total counter") == 1
    assert families["kvserve:router_requests"].samples[0].value == 3.0
