"""kvserve on Ray Serve, end to end: two replicas of the default model on two Ray nodes (two
raylets on this machine, one CPU each) sharing a remote KV store (a real redis-server), behind
the ingress with the kv-aware router; then one prefill and one decode replica (disaggregation)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvserve.cluster.config import ClusterConfig
from kvserve.config import EngineConfig
from kvserve.server.app import ServerConfig

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
from ray.cluster_utils import Cluster  # noqa: E402

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.engine.loading import LoadedModel  # noqa: E402
from tests.conftest import MODEL, free_port  # noqa: E402
from tests.test_kv_remote import RedisServer  # noqa: E402

pytestmark = pytest.mark.slow


def replica_states() -> dict[str, int]:
    status = serve.status().applications["kvserve"].deployments["ReplicaServer"]
    return {str(state): count for state, count in status.replica_states.items()}


def engine_config(store: RedisServer, dtype: str) -> EngineConfig:
    return EngineConfig.from_settings(model=MODEL, dtype=dtype, kv_cache_memory="96MiB", max_num_seqs=8,
                                      kv_offload_memory="32MiB", kv_offload_remote=store.url)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from kvserve.cluster.deploy import deploy

    store = RedisServer(tmp_path_factory.mktemp("redis"))
    store.start()
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": 150 * 2**20})
    nodes.add_node(num_cpus=1, object_store_memory=150 * 2**20)
    ray.init(address=nodes.address)
    port = free_port()
    try:
        deploy(engine_config(store, "bfloat16"), ServerConfig(model_name=MODEL),
               ClusterConfig(num_replicas=2, router="kv-aware"), "127.0.0.1", port)
        yield {"base": f"http://127.0.0.1:{port}", "port": port, "nodes": nodes, "store": store}
    finally:
        serve.shutdown()
        ray.shutdown()
        nodes.shutdown()
        store.kill()


def metric_samples(base: str, name: str) -> list[Any]:
    time.sleep(2.5)  # replicas push their metrics each second
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(base + "/metrics", timeout=30).text)}
    return [s for s in families[name].samples if not s.name.endswith("_created")] if name in families else []


def own_session(i: int, question: str) -> list[dict[str, str]]:
    """A chat whose first block is its own: the kv-aware router spreads such requests by load
    (a shared first block would draw them to one replica while the load stays within bounds)."""
    return [{"role": "system", "content": f"Session {i}. " + "Answer tersely. " * 8},
            {"role": "user", "content": question}]


def chat(client: httpx.Client, messages: list[dict[str, str]], **extra: Any) -> httpx.Response:
    return client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "temperature": 0,
                                                     **extra}, timeout=120)


def test_replicas_sit_on_two_nodes(cluster: dict[str, Any]) -> None:
    from ray.util.state import list_actors

    replicas = [a for a in list_actors(filters=[("state", "=", "ALIVE")]) if "ReplicaServer" in a.class_name]
    assert len(replicas) == 2
    assert len({a.node_id for a in replicas}) == 2


def test_openai_client_through_the_ingress(cluster: dict[str, Any]) -> None:
    import openai

    client = openai.OpenAI(base_url=cluster["base"] + "/v1", api_key="unused")
    # the prompt's first request computes it whole, later ones from the prefix cache (another
    # kernel for the rest: in bf16 a near-tie may go the other way), so both compared are later ones
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=1)
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hello."}],
                                           max_tokens=8, temperature=0)
    assert reply.choices[0].message.content and reply.usage is not None and reply.usage.completion_tokens == 8
    pieces = [chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, temperature=0, stream=True)
        if chunk.choices]
    assert "".join(pieces) == reply.choices[0].message.content  # greedy: the same text, streamed
    with pytest.raises(openai.BadRequestError, match="temperature"):  # kvserve's own validation, as a 400
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=-1)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])


def test_kv_aware_keeps_a_conversation_on_one_replica(cluster: dict[str, Any]) -> None:
    served: dict[int, list[str]] = {}
    with httpx.Client(base_url=cluster["base"]) as client:
        for turn in range(3):
            for conversation in range(4):
                history = own_session(conversation, "Name a colour.")
                for earlier in range(turn):
                    history += [{"role": "assistant", "content": f"Answer {earlier}."},
                                {"role": "user", "content": f"And another one, please ({earlier})."}]
                response = chat(client, history, max_tokens=4)
                assert response.status_code == 200, response.text
                served.setdefault(conversation, []).append(response.headers["x-kvserve-replica"])
    assert all(len(set(replicas)) == 1 for replicas in served.values()), served  # every turn, one replica
    assert len({replicas[0] for replicas in served.values()}) == 2, served  # conversations spread over both


def test_a_replica_serves_a_document_the_other_computed_from_the_shared_store(cluster: dict[str, Any]) -> None:
    """The first request computes a document on one replica; two more at once: the router sends
    the second to the idle replica (its index counts the shared store's blocks on every replica),
    which reads the document's blocks from the store instead of computing them."""
    document = own_session(99, "Summarise this. " + "The quick brown fox jumps over the lazy dog. " * 40)
    with httpx.Client(base_url=cluster["base"]) as client:
        first = chat(client, document, max_tokens=2)
        assert first.status_code == 200, first.text
        prompt_tokens = first.json()["usage"]["prompt_tokens"]
        time.sleep(0.5)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            again = list(pool.map(lambda _: chat(client, document, max_tokens=2), range(2)))
    assert [r.status_code for r in again] == [200, 200]
    assert len({r.headers["x-kvserve-replica"] for r in again}) == 2  # one on each replica
    other = next(r for r in again if r.headers["x-kvserve-replica"] != first.headers["x-kvserve-replica"])
    assert other.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == (prompt_tokens - 1) // 16 * 16
    reasons = {s.labels["reason"] for s in metric_samples(cluster["base"], "kvserve:router_requests")}
    assert "shared" in reasons


def test_metrics_aggregate_every_replica(cluster: dict[str, Any]) -> None:
    with httpx.Client(base_url=cluster["base"]) as client:
        assert chat(client, [{"role": "user", "content": "Hi"}], max_tokens=2).status_code == 200
        time.sleep(2.5)  # replicas push their metrics each second
        text = client.get("/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    queries = families["kvserve:prefix_cache_queries"].samples
    assert len({s.labels["replica"] for s in queries}) == 2
    routed = families["kvserve:router_requests"].samples
    assert {s.labels["router"] for s in routed} == {"kv-aware"} and sum(s.value for s in routed
                                                                        if s.name.endswith("_total")) >= 1


def test_killed_replica_fails_its_requests_with_503_and_comes_back(cluster: dict[str, Any]) -> None:
    from ray.util.state import list_actors

    def long_request(i: int) -> tuple[int, str, str, float]:
        with httpx.Client(base_url=cluster["base"]) as client:
            response = chat(client, own_session(i, "Count slowly to a thousand."), max_tokens=400, ignore_eos=True)
            return (response.status_code, response.headers.get("x-kvserve-replica", ""), response.text,
                    time.monotonic())

    def streaming_request(i: int) -> list[str]:
        with httpx.Client(base_url=cluster["base"]) as client, client.stream(
                "POST", "/v1/chat/completions", timeout=120,
                json={"model": MODEL, "messages": own_session(i, "Tell a long story."),
                      "max_tokens": 400, "ignore_eos": True, "stream": True}) as response:
            assert response.status_code == 200
            return [line for line in response.iter_lines() if line.startswith("data: ")]

    pool = concurrent.futures.ThreadPoolExecutor(6)
    futures = [pool.submit(long_request, i) for i in range(4)]
    streams = [pool.submit(streaming_request, i) for i in (4, 5)]
    time.sleep(4)  # all running
    victim = next(a for a in list_actors(filters=[("state", "=", "ALIVE")]) if "ReplicaServer" in a.class_name)
    killed_at = time.monotonic()
    os.kill(victim.pid, signal.SIGKILL)
    results = [f.result(timeout=120) for f in futures]
    statuses = [r[0] for r in results]
    assert 503 in statuses and 200 in statuses, statuses
    for status, _replica, text, done_at in results:
        if status == 503:
            assert '"code":"replica_unavailable"' in text.replace(" ", "")
            assert done_at - killed_at < 15  # promptly, not after the survivors finish
        else:
            assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 400  # untouched
    assert len({r[1] for r in results if r[0] == 200}) == 1
    ended = [s.result(timeout=120) for s in streams]
    assert all(lines[-1] in ("data: [DONE]", ) or "replica_unavailable" in lines[-1] for lines in ended), ended
    deadline = time.monotonic() + 120
    while replica_states().get("RUNNING", 0) < 2:  # Ray restarts it
        assert time.monotonic() < deadline, replica_states()
        time.sleep(1)
    with httpx.Client(base_url=cluster["base"]) as client:
        assert all(chat(client, [{"role": "user", "content": f"Hi {i}"}], max_tokens=2).status_code == 200
                   for i in range(4))


@pytest.fixture(scope="module")
def disaggregated(cluster: dict[str, Any]) -> dict[str, Any]:
    """The same two nodes serving one prefill and one decode replica (float32: the tokens are
    compared with one engine's)."""
    from kvserve.cluster.deploy import deploy

    serve.delete("kvserve")
    deploy(engine_config(cluster["store"], "float32"), ServerConfig(model_name=MODEL),
           ClusterConfig(router="kv-aware", prefill_replicas=1, decode_replicas=1), "127.0.0.1", cluster["port"])
    return cluster


def complete(client: httpx.Client, prompt: list[int], **extra: Any) -> httpx.Response:
    return client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "temperature": 0,
                                                "max_tokens": 8, "ignore_eos": True, **extra}, timeout=120)


def test_disaggregated_serving_gives_one_engines_tokens(disaggregated: dict[str, Any], smollm: LoadedModel) -> None:
    """Each prompt is computed on the prefill replica and decoded on the other, which reads every
    full block of the prompt but the last token's from the store; greedy tokens are one engine's."""
    from ray.util.state import list_actors

    actors = [a for a in list_actors(filters=[("state", "=", "ALIVE")]) if "Server" in a.class_name]
    assert sorted(a.class_name.rsplit(":", 1)[-1] for a in actors) == ["PrefillServer", "ReplicaServer"], actors
    prompts = [[(37 * d + 11 * i) % 5000 + 100 for i in range(length)] for d, length in enumerate((300, 161, 47))]
    one = LLM(loaded=smollm).generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    with httpx.Client(base_url=disaggregated["base"]) as client:
        for prompt, expected in zip(prompts, one, strict=True):
            response = complete(client, prompt)
            assert response.status_code == 200, response.text
            body = response.json()
            assert body["choices"][0]["text"] == expected.text
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == (len(prompt) - 1) // 16 * 16
        with client.stream("POST", "/v1/completions", timeout=120, json={
                "model": MODEL, "prompt": prompts[0], "temperature": 0, "max_tokens": 8, "ignore_eos": True,
                "stream": True}) as streamed:
            events = [line[6:] for line in streamed.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1] if json.loads(e)["choices"]) == one[0].text
    done = [s.value for s in metric_samples(disaggregated["base"], "kvserve:disaggregated_prefills")
            if s.labels["outcome"] == "done"]
    assert done and done[0] >= 4


def test_a_dead_prefill_replica_costs_time_not_requests(disaggregated: dict[str, Any]) -> None:
    """The prefill replica killed while it computes prompts: every request still completes with
    200 (its decode replica computes the prompt), and the failure is counted."""
    from ray.util.state import list_actors

    def request(i: int) -> httpx.Response:
        with httpx.Client(base_url=disaggregated["base"]) as client:
            return complete(client, [(13 * i + 7 * j) % 5000 + 100 for j in range(1500)], max_tokens=4)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(request, i) for i in range(4)]
        time.sleep(1.5)  # the prefill replica is computing the first prompts
        victim = next(a for a in list_actors(filters=[("state", "=", "ALIVE")]) if "PrefillServer" in a.class_name)
        os.kill(victim.pid, signal.SIGKILL)
        responses = [f.result(timeout=180) for f in futures]
    assert [r.status_code for r in responses] == [200] * 4, [r.text for r in responses]
    assert all(r.json()["usage"]["completion_tokens"] == 4 for r in responses)
    failed = [s.value for s in metric_samples(disaggregated["base"], "kvserve:disaggregated_prefills")
              if s.labels["outcome"] == "failed"]
    assert failed and failed[0] >= 1
