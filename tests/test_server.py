"""The HTTP server end to end: the real default model behind uvicorn on 127.0.0.1, driven by
the official openai client and raw HTTP."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvserve import LLM, SamplingParams
from kvserve.engine.loading import LoadedModel
from tests.conftest import KEY, MODEL, free_port, wait_healthy

pytestmark = pytest.mark.slow


def metric(base: str, name: str) -> float:
    text = httpx.get(base + "/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    raise KeyError(name)


def test_chat_and_completion_match_offline_generate(server: dict[str, Any], smollm: LoadedModel) -> None:
    client: openai.OpenAI = server["client"]
    messages = [{"role": "user", "content": "Name three primary colors."}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    completion = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=12,
                                           temperature=0)
    offline = LLM(loaded=smollm, kv_cache_memory="64MiB")
    greedy = SamplingParams(temperature=0, max_tokens=16)
    expected_chat = offline.generate([offline.apply_chat_template(messages)], greedy)[0]
    expected = offline.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=12))[0]
    assert chat.choices[0].message.content == expected_chat.text
    assert completion.choices[0].text == expected.text
    assert completion.usage is not None and completion.usage.completion_tokens == len(expected.token_ids)
    assert completion.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + completion.usage.completion_tokens


def test_streaming_with_usage_and_stop(server: dict[str, Any]) -> None:
    client: openai.OpenAI = server["client"]
    full = client.completions.create(model=MODEL, prompt="Count: one, two, three,", max_tokens=24, temperature=0)
    text = full.choices[0].text
    pieces, usage = [], None
    for chunk in client.completions.create(model=MODEL, prompt="Count: one, two, three,", max_tokens=24,
                                           temperature=0, stream=True, stream_options={"include_usage": True}):
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(pieces) == text
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens  # type: ignore[union-attr]
    stop = text.strip().split()[1] if len(text.split()) > 1 else text[:2]
    stopped = client.completions.create(model=MODEL, prompt="Count: one, two, three,", max_tokens=24,
                                        temperature=0, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop" and stop not in stopped.choices[0].text
    chat_pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi"}], max_tokens=8, temperature=0, stream=True)]
    assert "".join(chat_pieces)


def test_sixteen_concurrent_streams_complete(server: dict[str, Any]) -> None:
    async def one(i: int) -> int:
        client = openai.AsyncOpenAI(base_url=server["base"] + "/v1", api_key=KEY)
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Tell me fact number {i} about the sea."}],
            max_tokens=20, temperature=0.7, seed=i, stream=True, extra_body={"ignore_eos": True})
        tokens = 0
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason is not None:
                assert chunk.choices[0].finish_reason == "length"
            tokens += 1
        return tokens

    async def run() -> list[int]:
        return await asyncio.gather(*(one(i) for i in range(16)))

    counts = asyncio.run(run())
    assert all(c > 1 for c in counts)
    deadline = time.time() + 5
    while metric(server["base"], "kvserve:num_requests_running") != 0 and time.time() < deadline:
        time.sleep(0.05)
    assert metric(server["base"], "kvserve:num_requests_running") == 0


def test_metrics_move(server: dict[str, Any]) -> None:
    base, client = server["base"], server["client"]
    prompt = "A long shared instruction about careful answers. " * 12
    hits_before = metric(base, "kvserve:prefix_cache_hits_total")
    seen_usage = []
    seen_group_blocks = []

    def watch() -> None:
        for _ in range(100):
            seen_usage.append(metric(base, "kvserve:kv_cache_usage_perc"))
            seen_group_blocks.append(metric(base, "kvserve:kv_group_blocks_used"))  # one group: every layer
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    for _ in range(2):  # the second request reuses the first one's blocks
        client.completions.create(model=MODEL, prompt=prompt + "Go.", max_tokens=24, temperature=0,
                                  extra_body={"ignore_eos": True})
    watcher.join()
    assert max(seen_usage) > 0 and max(seen_group_blocks) > 0
    assert metric(base, "kvserve:prefix_cache_hits_total") > hits_before
    assert metric(base, "kvserve:request_generation_tokens_count") >= 2
    assert metric(base, "process_resident_memory_bytes") > 0
    assert metric(base, "kvserve:kv_cache_clip_ratio") == 0.0  # a full-precision cache clips nothing


def test_metrics_and_kv_name_the_cpu_ops_level(server: dict[str, Any]) -> None:
    """An operator sees which build of the C++ ops runs (here the best this CPU runs)."""
    from kvserve.model.cpu_kernels import active_isa, selected_level

    level = selected_level()
    assert level is not None and active_isa() == level.name
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server["base"] + "/metrics").text
    assert f'kvserve:cpu_ops_info{{isa="{level.name}"}} 1.0' in text
    # as a Prometheus scraper reads it: one sample, the running level as its label
    (info,) = [family for family in text_string_to_metric_families(text) if family.name == "kvserve:cpu_ops_info"]
    assert [(sample.labels, sample.value) for sample in info.samples] == [({"isa": level.name}, 1.0)]
    kv = httpx.get(server["base"] + "/v1/kv", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert kv["cpu_ops_isa"] == level.name


def test_client_disconnect_frees_blocks(server: dict[str, Any]) -> None:
    base = server["base"]
    body = {"model": MODEL, "prompt": "Write a very long story about a lighthouse.", "max_tokens": 400,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", base + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=30) as response:
        for i, _ in enumerate(response.iter_lines()):
            if i > 6:
                break  # drop the connection mid-stream
    deadline = time.time() + 1.0  # within a second of the drop
    while time.time() < deadline:
        kv = httpx.get(base + "/v1/kv", headers={"Authorization": f"Bearer {KEY}"}).json()
        if kv["blocks_used"] == 0:
            break
        time.sleep(0.05)
    assert kv["blocks_used"] == 0 and kv["num_requests"] == 0
    assert kv["groups"] == [{"kind": "full_attention", "sliding_window": 0, "blocks_used": 0, "logical_tokens": 0}]
    assert kv["blocks_evictable"] == kv["blocks_cached"]  # nothing runs: every cached block is idle


@pytest.mark.parametrize("case,status,fragment", [
    ({"prompt": "x " * 9000, "max_tokens": 4}, 400, "more than max_model_len"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ({"prompt": ""}, 400, "prompt is empty"),
    ({"prompt": "hi", "model": "gpt-9"}, 404, "gpt-9"),
    ({"prompt": "hi", "n": 0}, 400, "n"),
])
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(
        server: dict[str, Any], case: dict[str, Any], status: int, fragment: str) -> None:
    base = server["base"]
    body = {"model": MODEL, **case}
    r = httpx.post(base + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert fragment in error["message"] and {"message", "type", "param", "code"} <= set(error)
    ok = server["client"].completions.create(model=MODEL, prompt="Hello", max_tokens=2)
    assert ok.choices[0].text is not None


def test_malformed_json_empty_messages_and_bad_key(server: dict[str, Any]) -> None:
    base, auth = server["base"], {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(base + "/v1/chat/completions", content=b"{not json", headers=auth)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(base + "/v1/chat/completions", json={"model": MODEL, "messages": []}, headers=auth)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "hi"},
                   headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    models = server["client"].models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert json.loads(httpx.get(base + "/health").text)["status"] == "ok"


def test_full_queue_gets_503_and_oversized_body_413(server: dict[str, Any]) -> None:
    base, auth, config = server["base"], {"Authorization": f"Bearer {KEY}"}, server["app"].state.server_config
    config.max_waiting = 0  # every request finds the queue full
    try:
        r = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "hi"}, headers=auth)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
    finally:
        config.max_waiting = 64
    limit, config.max_body_bytes = config.max_body_bytes, 100
    try:
        r = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "x" * 200}, headers=auth)
        assert r.status_code == 413 and "exceeds the limit of 100" in r.json()["error"]["message"]
    finally:
        config.max_body_bytes = limit
    assert server["client"].completions.create(model=MODEL, prompt="Hello", max_tokens=2).choices


def test_grafana_dashboard_uses_only_exposed_metrics(server: dict[str, Any]) -> None:
    import re
    from pathlib import Path

    dashboard = json.loads((Path(__file__).parent.parent / "deploy" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    used = {m for e in exprs for m in re.findall(r"(?:kvserve:|process_)[a-z0-9_]+", e)}
    families = list(text_string_to_metric_families(httpx.get(server["base"] + "/metrics").text))
    exposed = {s.name for f in families for s in f.samples}
    # per-tier families are declared even where no tier is configured (they have no samples then)
    exposed |= {f.name + ("_total" if f.type == "counter" else "") for f in families}
    assert used and used <= exposed, used - exposed


def test_monitoring_page_documents_every_exposed_metric(server: dict[str, Any]) -> None:
    """docs/monitoring.md has a row for every kvserve family the server exposes, and names no
    kvserve metric that is neither exposed here nor one of the families only some servers have
    (speculative decoding, a tuned configuration's drift, the Ray router)."""
    import re
    from pathlib import Path

    page = (Path(__file__).parent.parent / "docs" / "monitoring.md").read_text()
    documented = set(re.findall(r"^\| `(kvserve:[a-z0-9_]+)`", page, flags=re.MULTILINE))
    families = list(text_string_to_metric_families(httpx.get(server["base"] + "/metrics").text))
    # (prometheus_client also writes each histogram's creation time as a family of its own)
    exposed = {f.name for f in families if f.name.startswith("kvserve:") and not f.name.endswith("_created")}
    assert exposed - documented == set(), "metrics missing from docs/monitoring.md"
    conditional = re.compile(r"kvserve:(spec_decode_|config_|router_)")
    assert {m for m in documented - exposed if not conditional.match(m)} == set(), "documented, never exposed"


def test_logprobs_in_completion_and_chat(server: dict[str, Any]) -> None:
    client: openai.OpenAI = server["client"]
    completion = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4,
                                           temperature=0, logprobs=2)
    lp = completion.choices[0].logprobs
    assert lp is not None and len(lp.token_logprobs or []) == completion.usage.completion_tokens  # type: ignore
    assert all(x <= 0 for x in lp.token_logprobs or []) and all(len(t) == 2 for t in lp.top_logprobs or [])
    # greedy: the chosen token is the most likely one
    pairs = zip(lp.top_logprobs or [], lp.token_logprobs or [], strict=True)
    assert all(abs(max(top.values()) - chosen) < 1e-4 for top, chosen in pairs)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=1)
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == chat.usage.completion_tokens  # type: ignore[union-attr]
    assert all(len(c.top_logprobs) == 1 for c in content)


def test_a_taken_port_stops_the_server_with_uvicorns_status() -> None:
    """The engine loop holds the main thread; when uvicorn cannot listen, the process still
    exits, with uvicorn's start-up failure status and its error, instead of serving nothing."""
    import socket
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "kvserve.cli", "serve", "--port", str(port),
                                 "--kv-cache-memory", "64MiB"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 3, result.stderr[-2000:]
    assert "address already in use" in result.stderr and "exiting with status 3" in result.stderr


def test_sigterm_drains_in_flight_requests(tmp_path: Any) -> None:
    import signal
    import subprocess
    import sys

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvserve.cli", "serve", "--port", str(port),
                             "--kv-cache-memory", "64MiB"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, seconds=60)
        lines: list[str] = []
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 40, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line and not lines:
                    proc.send_signal(signal.SIGTERM)  # mid-stream
                if line:
                    lines.append(line)
        assert lines[-1] == "data: [DONE]"  # the accepted request was finished, not cut off
        # uvicorn finishes the shutdown, then re-raises the signal it caught
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
        assert proc.stdout is not None and "Finished server process" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_what_the_openai_sdk_asks_of_the_real_model(server: dict[str, Any]) -> None:
    """The official client against SmolLM2: n=3 seeded samples, a pydantic model through
    response_format (the reply parses and validates), a tool-call round trip, and a stream's
    usage with the prompt tokens the prefix cache served."""
    import pydantic

    client: openai.OpenAI = server["client"]
    messages = [{"role": "user", "content": "Describe a cat in one short sentence."}]
    three = client.chat.completions.create(model=MODEL, messages=messages, n=3, max_tokens=12, temperature=0.9,
                                           seed=11)
    assert [c.index for c in three.choices] == [0, 1, 2]
    alone = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0.9, seed=12)
    assert three.choices[1].message.content == alone.choices[0].message.content  # sample 1 is seeded 11 + 1

    class Pet(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=12)
        legs: int = pydantic.Field(ge=0, le=8)

    parsed = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Invent a pet."}],
                                           response_format=Pet, max_tokens=60, temperature=0)
    pet = parsed.choices[0].message.parsed
    assert isinstance(pet, Pet) and 0 <= pet.legs <= 8

    tool = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                             "parameters": {"type": "object", "properties": {
                                                 "city": {"type": "string", "maxLength": 20}},
                                                 "required": ["city"], "additionalProperties": False}}}
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(model=MODEL, messages=ask, tools=[tool], tool_choice="required",
                                           max_tokens=40, temperature=0)
    assert first.choices[0].finish_reason == "tool_calls"
    (call,) = first.choices[0].message.tool_calls or []
    assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)
    follow = [*ask, first.choices[0].message.model_dump(exclude_none=True),
              {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}]
    second = client.chat.completions.create(model=MODEL, messages=follow, tools=[tool], max_tokens=16, temperature=0)
    assert second.choices[0].message.content and second.choices[0].finish_reason in ("stop", "length")

    prompt = "Here is a long shared preamble. " * 8 + "Answer:"
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    usage = None
    for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, stream=True,
                                           stream_options={"include_usage": True}):
        usage = chunk.usage or usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens // 16 * 16
