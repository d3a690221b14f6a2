"""The HTTP API's contract, fast: a tiny random-weight Llama with SmolLM2's real tokenizer and
chat template behind uvicorn on 127.0.0.1. Bad input gets a 400 naming the field, never a 5xx;
an engine failure answers every request with a 500 and /health with 503; a schema fuzz of every
route finds no 5xx and leaves the server serving."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from kvserve.config import EngineConfig
from kvserve.engine.loading import LoadedModel, load_model
from kvserve.server.app import ServerConfig
from kvserve.server.serve import build
from tests.conftest import free_port, serve_in_thread, wait_healthy

MODEL = "tiny"
MAX_MODEL_LEN = 128
STREAMING_CAP = 1024


@pytest.fixture(scope="module")
def tiny_chat_model(tiny_model_factory: Callable[..., Path], smollm: LoadedModel) -> LoadedModel:
    """Random weights over SmolLM2's vocabulary, with SmolLM2's tokenizer (the tiny HF folders have none)."""
    path = tiny_model_factory("llama", vocab_size=smollm.config.vocab_size)
    return load_model(str(path), torch.device("cpu"), torch.float32)._replace(tokenizer=smollm.tokenizer)


def start_server(loaded: LoadedModel, engine_kwargs: dict[str, Any] | None = None,
                 **server: Any) -> tuple[Any, Any, str, Callable[[], None]]:
    config = EngineConfig.from_settings(**{"model": MODEL, "kv_cache_memory": "4MiB", "max_model_len": MAX_MODEL_LEN,
                             "max_num_seqs": 8, **(engine_kwargs or {})})
    engine, app = build(config, ServerConfig(model_name=MODEL, **server), loaded=loaded)
    base, stop_http = serve_in_thread(app)

    def stop() -> None:
        stop_http()
        engine.shutdown()

    return engine, app, base, stop


@pytest.fixture(scope="module")
def api(tiny_chat_model: LoadedModel) -> Iterator[dict[str, Any]]:
    # the fuzz test draws huge max_tokens for streaming requests: the cap keeps each under its timeout
    engine, app, base, stop = start_server(tiny_chat_model, max_streaming_tokens=STREAMING_CAP)
    yield {"base": base, "engine": engine, "app": app}
    stop()


def post(base: str, path: str, body: Any) -> httpx.Response:
    """As a client would send it: json.dumps escapes lone surrogates and writes NaN."""
    return httpx.post(base + path, content=json.dumps(body), headers={"content-type": "application/json"},
                      timeout=30)


def still_serving(base: str) -> None:
    r = post(base, "/v1/completions", {"prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert httpx.get(base + "/health").status_code == 200


@pytest.mark.parametrize("path,body,param,fragment", [
    ("/v1/completions", {"prompt": "\ud800"}, "prompt", "not valid Unicode"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\udfffb"}]}, "messages.0.content",
     "not valid Unicode"),
    ("/v1/completions", {"prompt": "hi", "temperature": float("nan")}, "temperature", "finite"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 10000}, "logprobs", "max_logprobs=20"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                              "top_logprobs": 21}, "top_logprobs", "max_logprobs=20"),
    ("/v1/completions", {"prompt": [5] * 100, "max_tokens": 50}, "max_tokens",
     "max_tokens=50 is more than the 28 tokens left after the prompt's 100 tokens in max_model_len=128"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role", "wizard"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages.0.content", "'image_url' is not supported"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools.0.type",
     "'function'"),
    ("/v1/completions", {"prompt": "hi", "n": 200}, "n", "less than or equal to 128"),
    ("/v1/completions", {"prompt": "hi", "best_of": 2}, "best_of", "use n"),
    ("/v1/completions", {"prompt": ["hi", ""]}, "prompt", "prompt is empty"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"49152": 5}}, "logit_bias",
     "token id 49152 is outside the vocabulary [0, 49152)"),
    ("/v1/completions", {"prompt": "hi", "frobnicate": True}, "frobnicate", "unknown or unsupported field"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 3}, "presence_penalty", "less than or equal to 2"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
    ("/v1/completions", {"prompt": [10**9]}, "prompt", "outside the vocabulary"),
    ("/v1/completions", {"prompt": "hi", "kv_eviction": "streaming", "kv_window": 4096}, "kv_window",
     "kv_window=4096 is more than this server's kv_window=1024"),
    ("/v1/completions", {"prompt": "hi", "kv_eviction": "snap"}, "kv_eviction", "snapkv"),
    ("/v1/completions", {"prompt": "hi", "kv_eviction": "snapkv", "kv_compression_ratio": 0.25},
     "kv_compression_ratio", "keeps less of the prompt than this server's kv_compression_ratio=0.5"),
    ("/v1/completions", {"prompt": "hi", "kv_compression_ratio": 0.75}, "kv_compression_ratio",
     "needs kv_eviction=snapkv"),
    ("/v1/completions", {"prompt": "hi", "kv_window": 64}, "kv_eviction", "need kv_eviction=streaming"),
])
def test_bad_requests_get_a_400_naming_the_field(api: dict[str, Any], path: str, body: dict[str, Any],
                                                 param: str, fragment: str) -> None:
    r = post(api["base"], path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param or (param == "prompt" and error["param"] in ("prompt", None)), error
    assert fragment in error["message"], error
    still_serving(api["base"])


def completion(base: str, body: dict[str, Any]) -> dict[str, Any]:
    r = post(base, "/v1/completions", body)
    assert r.status_code == 200, r.text
    return dict(r.json())


def stream_events(base: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", base + path, json={**body, "stream": True}, timeout=30) as s:
        assert s.status_code == 200
        lines = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_n_samples_equal_separately_seeded_requests_and_share_the_prompt(api: dict[str, Any]) -> None:
    """n=3 with seed s: sample i equals a request of its own with seed s + i (vLLM's rule). The
    samples after the first find the prompt's full blocks in the prefix cache (its 40 tokens:
    2 blocks of 16 each), so the prompt is computed once and its blocks are held once."""
    base = api["base"]
    prompt = [7 + (i * 13) % 900 for i in range(40)]
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 1.0, "seed": 1234, "ignore_eos": True}
    hits = httpx.get(base + "/v1/kv").json()["prefix_cache_hits"]
    together = completion(base, {**body, "n": 3})
    shared = httpx.get(base + "/v1/kv").json()["prefix_cache_hits"] - hits
    assert shared == 2 * 32  # the two later samples, the prompt's 2 full blocks each
    assert [c["index"] for c in together["choices"]] == [0, 1, 2]
    alone = [completion(base, {**body, "seed": 1234 + i})["choices"][0]["text"] for i in range(3)]
    assert [c["text"] for c in together["choices"]] == alone
    assert len(set(alone)) > 1  # the seeds differ, so do the samples
    usage = together["usage"]
    assert usage["prompt_tokens"] == 40 and usage["completion_tokens"] == 18
    events = stream_events(base, "/v1/completions", {**body, "n": 3})
    streamed = ["", "", ""]
    finished = set()
    for event in events:
        for choice in event["choices"]:
            streamed[choice["index"]] += choice["text"]
            if choice["finish_reason"] is not None:
                finished.add(choice["index"])
    assert streamed == alone and finished == {0, 1, 2}


def test_a_list_of_prompts_gets_one_choice_per_prompt(api: dict[str, Any]) -> None:
    base = api["base"]
    body = {"max_tokens": 5, "temperature": 0, "ignore_eos": True}
    for prompts in (["Hello there", "Another one", "A third prompt"], [[5, 6, 7, 8], [9, 10]]):
        batch = completion(base, {**body, "prompt": prompts})
        singles = [completion(base, {**body, "prompt": p}) for p in prompts]
        assert [c["text"] for c in batch["choices"]] == [s["choices"][0]["text"] for s in singles]
        assert [c["index"] for c in batch["choices"]] == list(range(len(prompts)))
        assert batch["usage"]["prompt_tokens"] == sum(s["usage"]["prompt_tokens"] for s in singles)
    two = completion(base, {**body, "prompt": prompts[:2], "n": 2})  # choice i * n + j: sample j of prompt i
    assert [c["text"] for c in two["choices"]] == [singles[0]["choices"][0]["text"]] * 2 + [
        singles[1]["choices"][0]["text"]] * 2


def test_usage_reports_cached_prompt_tokens(api: dict[str, Any]) -> None:
    """usage.prompt_tokens_details.cached_tokens: the prompt tokens served from the prefix cache,
    in a response and in a stream's usage chunk; with continuous_usage_stats every chunk has the
    usage so far."""
    base = api["base"]
    prompt = [11 + (i * 7) % 800 for i in range(50)]
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    first = completion(base, body)["usage"]
    again = completion(base, body)["usage"]
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["prompt_tokens_details"]["cached_tokens"] == 48  # 3 full blocks of 16
    events = stream_events(base, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert events[-1]["choices"] == [] and events[-1]["usage"] == again
    assert all("usage" not in e for e in events[:-1])
    events = stream_events(base, "/v1/completions", {
        **body, "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    counts = [e["usage"]["completion_tokens"] for e in events]
    assert counts == sorted(counts) and counts[-1] == 4 and all(e["usage"]["prompt_tokens"] == 50 for e in events)


def test_fields_that_cannot_change_the_output_are_accepted(api: dict[str, Any]) -> None:
    """protocol.IGNORED_FIELDS, and an assistant turn with tool_calls in the history."""
    base = api["base"]
    chat = {"messages": [{"role": "user", "content": "What is 2+2?"},
                         {"role": "assistant", "content": None, "tool_calls": [
                             {"id": "call_1", "type": "function",
                              "function": {"name": "add", "arguments": "{\"a\": 2, \"b\": 2}"}}]},
                         {"role": "tool", "tool_call_id": "call_1", "content": "4"}],
            "max_tokens": 3, "temperature": 0}
    plain = post(base, "/v1/chat/completions", chat)
    assert plain.status_code == 200, plain.text
    extras = {"metadata": {"team": "a"}, "store": False, "service_tier": "auto", "user": "u-1",
              "parallel_tool_calls": True}
    r = post(base, "/v1/chat/completions", {**chat, **extras})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]


def test_logprobs_carry_each_tokens_own_bytes(api: dict[str, Any], smollm: LoadedModel) -> None:
    """Byte-level tokens (a piece of a multi-byte character) are reported by their own bytes,
    never as U+FFFD, and top_logprobs has one entry per token (keys never collapse)."""
    from kvserve.server.token_text import TokenText

    base, text = api["base"], TokenText(smollm.tokenizer)
    prompt = smollm.tokenizer.encode("日本語 — 東京 ✓", add_special_tokens=False)
    byte_tokens = [t for t in prompt if text.text(t).startswith("bytes:")]
    assert byte_tokens  # the prompt itself splits characters over tokens
    r = post(base, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 12,
                                            "temperature": 0, "logprobs": True, "top_logprobs": 5,
                                            "logit_bias": {str(byte_tokens[0]): 100}}).json()
    content = r["choices"][0]["logprobs"]["content"]
    assert content[0]["token"] == text.text(byte_tokens[0]) and bytes(content[0]["bytes"]) == text.bytes_of(
        byte_tokens[0])
    assert "\ufffd" not in content[0]["token"]
    for entry in content:
        assert len({t["token"] for t in entry["top_logprobs"]}) == len(entry["top_logprobs"]) == 5
    c = completion(base, {"prompt": "hi", "max_tokens": 12, "temperature": 0, "logprobs": 3,
                          "logit_bias": {str(byte_tokens[0]): 100}})["choices"][0]["logprobs"]
    assert c["tokens"][0] == text.text(byte_tokens[0])
    assert all(len(top) == 3 for top in c["top_logprobs"])


def test_echo_scores_the_prompt_as_lm_evaluation_harness_asks(api: dict[str, Any]) -> None:
    """echo + logprobs + max_tokens 0 (loglikelihood scoring): the prompt's tokens come back with
    their log-probabilities (the first None), each equal to what the model gives that token after
    the tokens before it, and a second request for the same prompt (a prefix-cache hit) scores it
    alike: such requests compute their whole prompt."""
    base = api["base"]
    prompt = [9 + (i * 31) % 700 for i in range(37)]
    body = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 3, "temperature": 0}
    first = completion(base, body)
    (choice,) = first["choices"]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == 37 and logprobs["token_logprobs"][0] is None
    assert logprobs["top_logprobs"][0] is None and all(len(t) == 3 for t in logprobs["top_logprobs"][1:])
    assert first["usage"]["completion_tokens"] == 0 and choice["finish_reason"] == "length"
    assert choice["text"] == post(base, "/detokenize", {"tokens": prompt}).json()["prompt"]
    for k in (1, 20, 36):  # the distribution at position k is what a request for prompt[:k]'s next token sees
        alone = completion(base, {"prompt": prompt[:k], "max_tokens": 1, "temperature": 0, "logprobs": 3})
        top = alone["choices"][0]["logprobs"]["top_logprobs"][0]
        assert top.keys() == logprobs["top_logprobs"][k].keys()
        assert list(top.values()) == pytest.approx(list(logprobs["top_logprobs"][k].values()), abs=2e-3)
    again = completion(base, body)
    assert again["choices"][0]["logprobs"]["token_logprobs"][1:] == pytest.approx(logprobs["token_logprobs"][1:],
                                                                                  abs=1e-5)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # computed again, as promised
    vllm_style = completion(base, {"prompt": prompt, "max_tokens": 2, "prompt_logprobs": 1, "temperature": 0})
    entries = vllm_style["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == 37
    assert entries[5][str(prompt[5])]["logprob"] == pytest.approx(logprobs["token_logprobs"][5], abs=1e-5)
    assert vllm_style["usage"]["completion_tokens"] == 2
    r = post(base, "/v1/completions", {"prompt": "hi", "max_tokens": 0})
    assert r.status_code == 400 and "max_tokens=0" in r.json()["error"]["message"]
    r = post(base, "/v1/completions", {"prompt": "hi", "echo": True, "stream": True})
    assert r.status_code == 400 and "echo" in r.json()["error"]["message"]


COLOR = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
         "required": ["color", "ok"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"enum": ["Paris", "Oslo"]}, "celsius": {"type": "boolean"}},
                                                "required": ["city", "celsius"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}


def chat(base: str, body: dict[str, Any]) -> dict[str, Any]:
    r = post(base, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 60,
                                            **body})
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_structured_output_follows_the_schema_even_from_random_weights(api: dict[str, Any]) -> None:
    """A random-weight model constrained by response_format (json_schema, json_object) and vLLM's
    structured_outputs (choice, regex): every output parses and validates."""
    import jsonschema

    base = api["base"]
    for seed in range(3):
        body = {"temperature": 1.0, "seed": seed,
                "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": COLOR}}}
        content = chat(base, body)["choices"][0]["message"]["content"]
        jsonschema.validate(json.loads(content), COLOR)
    anything = chat(base, {"temperature": 0, "response_format": {"type": "json_object"}, "max_tokens": 90})
    choice = anything["choices"][0]
    if choice["finish_reason"] == "stop":  # a free object may run past max_tokens
        assert isinstance(json.loads(choice["message"]["content"]), dict)
    else:
        assert choice["message"]["content"].startswith("{")
    picked = completion(base, {"prompt": "Yes or no?", "max_tokens": 8, "temperature": 1.0, "seed": 1,
                               "structured_outputs": {"choice": ["yes", "no", "maybe"]}})
    assert picked["choices"][0]["text"] in ("yes", "no", "maybe")
    code = completion(base, {"prompt": "Code:", "max_tokens": 8, "temperature": 1.0,
                             "structured_outputs": {"regex": "[0-9]{3}-[A-Z]{2}"}})["choices"][0]["text"]
    assert re.fullmatch("[0-9]{3}-[A-Z]{2}", code), code


def test_tool_calls_come_back_in_openais_shape(api: dict[str, Any]) -> None:
    """tool_choice required and named force valid calls (finish_reason tool_calls, arguments
    that validate); a stream sends them whole in one delta; a conversation carrying the calls
    and the tool's answer continues."""
    import jsonschema

    base = api["base"]
    required = chat(base, {"tools": [WEATHER, CLOCK], "tool_choice": "required", "temperature": 0})["choices"][0]
    assert required["finish_reason"] == "tool_calls" and required["message"]["content"] is None
    for call in required["message"]["tool_calls"]:
        spec = {"get_weather": WEATHER, "get_time": CLOCK}[call["function"]["name"]]
        jsonschema.validate(json.loads(call["function"]["arguments"]), spec["function"]["parameters"])
        assert call["type"] == "function" and call["id"].startswith("call_")
    named = {"type": "function", "function": {"name": "get_time"}}
    forced = chat(base, {"tools": [WEATHER, CLOCK], "tool_choice": named, "temperature": 1.0, "seed": 3})
    (call,) = forced["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_time"
    assert json.loads(call["function"]["arguments"])["zone"] in ("UTC", "CET")
    events = stream_events(base, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                          "max_tokens": 60, "tools": [CLOCK], "tool_choice": named})
    deltas = [c["delta"] for e in events for c in e["choices"]]
    (streamed,) = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert streamed[0]["index"] == 0 and streamed[0]["function"]["name"] == "get_time"
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    history = [{"role": "user", "content": "time?"},
               {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": call["id"], "content": "12:00"}]
    answer = post(base, "/v1/chat/completions", {"messages": history, "tools": [CLOCK], "max_tokens": 5})
    assert answer.status_code == 200, answer.text


@pytest.mark.parametrize("body,param,fragment", [
    ({"tools": [CLOCK], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, None,
     "tool_choice names function 'nope', which is not among the tools"),
    ({"tool_choice": "required"}, None, "needs tools"),
    ({"tools": [CLOCK], "tool_choice": "required", "response_format": {"type": "json_object"}}, None,
     "tool_choice and response_format each constrain the output"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs its json_schema"),
    ({"structured_outputs": {"regex": "(", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"regex": "(unclosed"}}, None, "structured output does not compile"),
])
def test_bad_structured_requests_get_a_400(api: dict[str, Any], body: dict[str, Any], param: str | None,
                                           fragment: str) -> None:
    r = post(api["base"], "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], **body})
    assert r.status_code == 400, r.text
    assert fragment in r.json()["error"]["message"], r.json()
    if param is not None:
        assert r.json()["error"]["param"].startswith(param), r.json()
    still_serving(api["base"])


def test_an_oversized_body_gets_a_413_not_a_reset(api: dict[str, Any]) -> None:
    """A client that sends 5 MiB (over the 4 MiB limit) reads the 413 and its error body, with
    a declared length and chunked; the server keeps serving."""
    import urllib.error
    import urllib.request

    body = json.dumps({"prompt": "x" * (5 * 1024 * 1024)}).encode()
    request = urllib.request.Request(api["base"] + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as error:
        urllib.request.urlopen(request, timeout=30)
    assert error.value.code == 413
    assert "exceeds the limit" in json.loads(error.value.read())["error"]["message"]

    def chunks() -> Iterator[bytes]:
        for start in range(0, len(body), 1 << 20):
            yield body[start:start + (1 << 20)]

    r = httpx.post(api["base"] + "/v1/completions", content=chunks(), headers={"content-type": "application/json"},
                   timeout=30)
    assert r.status_code == 413 and "more than 4194304 bytes" in r.json()["error"]["message"]
    still_serving(api["base"])


def test_content_parts_are_joined(api: dict[str, Any]) -> None:
    """vLLM's bench client and many SDKs send content as a list of text parts."""
    base = api["base"]
    plain = post(base, "/v1/chat/completions", {"messages": [{"role": "user", "content": "ab\ncd"}],
                                                "max_tokens": 4, "temperature": 0}).json()
    parts = post(base, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "ab"}, {"type": "text", "text": "cd"}]}],
        "max_tokens": 4, "temperature": 0}).json()
    assert parts["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
    for usage in (parts["usage"], plain["usage"]):
        usage.pop("prompt_tokens_details")  # the second request finds the first one's blocks
    assert parts["usage"] == plain["usage"]


def test_models_route_says_how_weights_and_kv_are_stored(tiny_chat_model: LoadedModel) -> None:
    _, _, base, stop = start_server(tiny_chat_model, {"kv_cache_dtype": "int8"})
    try:
        (model,) = httpx.get(base + "/v1/models").json()["data"]
        assert model["id"] == MODEL and model["max_model_len"] == MAX_MODEL_LEN
        assert model["quantization"] is None and model["kv_cache_dtype"] == "int8"
    finally:
        stop()


def test_tokenize_and_detokenize_round_trip(api: dict[str, Any], smollm: LoadedModel) -> None:
    base = api["base"]
    text = "The quick brown fox"
    r = post(base, "/tokenize", {"prompt": text}).json()
    assert r["tokens"] == list(smollm.tokenizer.encode(text)) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == MAX_MODEL_LEN
    assert post(base, "/detokenize", {"tokens": r["tokens"]}).json()["prompt"] == text
    chat = post(base, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()
    expected = smollm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert chat["tokens"] == list(smollm.tokenizer.encode(expected))
    assert post(base, "/detokenize", {"tokens": [10**7]}).status_code == 400
    assert post(base, "/tokenize", {"prompt": "a", "messages": []}).status_code == 400


def test_max_tokens_fills_the_context_only_when_not_asked(api: dict[str, Any]) -> None:
    r = post(api["base"], "/v1/completions", {"prompt": [5] * 120, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8  # min(16, 128 - 120)
    r = post(api["base"], "/v1/completions", {"prompt": [5] * 120, "max_tokens": 8, "ignore_eos": True})
    assert r.status_code == 200


def test_a_streaming_request_runs_past_max_model_len(api: dict[str, Any]) -> None:
    """kv_eviction in the body (vLLM-style extra parameters): 100 prompt tokens + 200 generated
    on a server of max_model_len 128, the request's KV bounded by its 32-token window."""
    before = httpx.get(api["base"] + "/v1/kv").json()["evicted_tokens"]
    r = post(api["base"], "/v1/completions", {"prompt": [5] * 100, "max_tokens": 200, "ignore_eos": True,
                                              "kv_eviction": "streaming", "kv_window": 32, "kv_sink_tokens": 4})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 200
    assert httpx.get(api["base"] + "/v1/kv").json()["evicted_tokens"] - before >= 300 - 32 - 3 * 16
    still_serving(api["base"])


def test_the_openai_sdk_passes_kv_eviction_as_extra_body(api: dict[str, Any]) -> None:
    """The official client sends kv_eviction settings through extra_body, as vLLM's extra
    parameters: a chat that streams past max_model_len with a 32-token window, and a window
    larger than the server allows gets a BadRequestError naming the field."""
    import openai

    client = openai.OpenAI(base_url=api["base"] + "/v1", api_key="none")
    before = httpx.get(api["base"] + "/v1/kv").json()["evicted_tokens"]
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=150,
        extra_body={"ignore_eos": True, "kv_eviction": "streaming", "kv_window": 32, "kv_sink_tokens": 4})
    assert chat.usage is not None and chat.usage.completion_tokens == 150
    assert httpx.get(api["base"] + "/v1/kv").json()["evicted_tokens"] > before
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model="tiny", prompt="hi", max_tokens=4,
                                  extra_body={"kv_eviction": "streaming", "kv_window": 4096})
    assert "kv_window" in str(error.value)
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                       max_completion_tokens=STREAMING_CAP + 1, extra_body={"kv_eviction": "streaming"})
    assert f"max_completion_tokens={STREAMING_CAP + 1}" in str(error.value)
    assert f"max_streaming_tokens={STREAMING_CAP}" in str(error.value)
    still_serving(api["base"])


def test_a_request_asks_for_snapkv(api: dict[str, Any]) -> None:
    """kv_eviction=snapkv in the body of a server that compresses nothing by default: the
    request's 100-token prompt keeps 75 tokens after its prefill, and a later request for the
    same prompt (no eviction) hits the same cached blocks and answers as before."""
    before = httpx.get(api["base"] + "/v1/kv").json()["evicted_tokens"]
    body = {"prompt": [5 + i % 50 for i in range(100)], "max_tokens": 8, "ignore_eos": True, "temperature": 0}
    post(api["base"], "/v1/completions", body)  # publishes the prompt's blocks
    plain = post(api["base"], "/v1/completions", body)  # hits them
    r = post(api["base"], "/v1/completions", {**body, "kv_eviction": "snapkv", "kv_compression_ratio": 0.75})
    assert r.status_code == 200 == plain.status_code, r.text
    assert httpx.get(api["base"] + "/v1/kv").json()["evicted_tokens"] - before == 25
    again = post(api["base"], "/v1/completions", body)
    assert again.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]


def test_waiting_limit_holds_under_a_burst(tiny_chat_model: LoadedModel) -> None:
    """A burst of submissions faster than the engine thread takes them: at most max_waiting get
    in line, the rest get 503 (the limit counts what is still in the command queue)."""
    engine, _, base, stop = start_server(tiny_chat_model, max_waiting=3)
    try:
        engine.engine.scheduler.max_num_seqs = 1  # nothing leaves the queue quickly

        async def burst() -> list[int]:
            async with httpx.AsyncClient(timeout=120) as client:
                body = {"prompt": [5] * 10, "max_tokens": 110, "ignore_eos": True}  # long: nobody leaves
                rs = await asyncio.gather(*(client.post(base + "/v1/completions", json=body) for _ in range(12)))
            return [r.status_code for r in rs]

        codes = asyncio.run(burst())
        assert set(codes) <= {200, 503} and 503 in codes
        assert codes.count(200) <= 3 + 1  # max_waiting in line + the one running
    finally:
        stop()


def test_engine_failure_fails_requests_and_health(tiny_chat_model: LoadedModel) -> None:
    """On a16fa74 the request after a failed step hung forever and /health said ok."""
    engine, _, base, stop = start_server(tiny_chat_model)
    fatal: list[BaseException] = []
    engine.on_fatal = fatal.append
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("kvserve").addHandler(handler)
    try:
        still_serving(base)
        real_step, steps = engine.engine.step, [0]

        def faulty_step() -> Any:
            steps[0] += 1
            if steps[0] == 3:
                raise RuntimeError("injected fault")
            return real_step()

        engine.engine.step = faulty_step
        body = {"prompt": [5] * 10, "max_tokens": 20, "ignore_eos": True}
        r = post(base, "/v1/completions", body)  # in flight when the step fails
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_dead", r.text
        assert "injected fault" in r.json()["error"]["message"]
        r = post(base, "/v1/completions", body)  # a new request is answered at once
        assert r.status_code == 500 and r.json()["error"]["type"] == "internal_server_error"
        with httpx.stream("POST", base + "/v1/completions", json={**body, "stream": True}, timeout=10) as s:
            assert s.status_code == 500
        assert httpx.get(base + "/health").status_code == 503
        assert len(fatal) == 1 and "injected fault" in str(fatal[0])
        assert any(rec.exc_info and "injected fault" in str(rec.exc_info[1]) for rec in records)  # traceback
    finally:
        logging.getLogger("kvserve").removeHandler(handler)
        stop()


def test_serve_exits_non_zero_when_the_engine_fails(tiny_chat_model: LoadedModel) -> None:
    """kvserve serve returns ENGINE_DEAD_EXIT_CODE (the CLI's exit status) after a failed step."""
    from kvserve.server import serve as serve_module

    port = free_port()
    original_build, result = serve_module.build, {}

    def build_faulty(*args: Any, **kwargs: Any) -> Any:
        engine, app = original_build(*args, **kwargs)

        def fail() -> Any:
            raise RuntimeError("injected fault")

        engine.engine.step = fail
        return engine, app

    serve_module.build = build_faulty  # type: ignore[assignment]
    try:
        config = EngineConfig.from_settings(model=MODEL, kv_cache_memory="4MiB", max_model_len=MAX_MODEL_LEN)
        thread = threading.Thread(target=lambda: result.setdefault("code", serve_module.serve(
            config, ServerConfig(model_name=MODEL), "127.0.0.1", port, loaded=tiny_chat_model)))
        thread.start()
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, seconds=10)
        r = post(base, "/v1/completions", {"prompt": [5] * 4, "max_tokens": 4})
        assert r.status_code == 500
        thread.join(timeout=30)
        assert not thread.is_alive() and result["code"] == serve_module.ENGINE_DEAD_EXIT_CODE
    finally:
        serve_module.build = original_build  # type: ignore[assignment]


def test_fuzz_every_route_from_the_schema(api: dict[str, Any]) -> None:
    """schemathesis draws bodies from /openapi.json (valid and invalid) for every route: no
    5xx, and the server keeps serving. Bounded: a few dozen examples per route."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis.generation.modes import GenerationMode

    base = api["base"]
    schema = schemathesis.openapi.from_url(base + "/openapi.json")
    failures: list[str] = []
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"}
    for operation, mode in itertools.product(operations, GenerationMode):
        if mode is GenerationMode.NEGATIVE and operation.method.upper() != "POST":
            continue  # a route without a body or parameters has no invalid input

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=40, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        def check(case: Any) -> None:
            response = case.call(base_url=base, timeout=30)
            if response.status_code >= 500:
                failures.append(f"{case.method} {case.path} {case.body!r} -> {response.status_code} "
                                f"{response.text[:200]}")

        check()
    assert not failures, failures[:5]
    still_serving(base)


def test_tier_metrics_and_kv_route(tiny_chat_model: LoadedModel) -> None:
    """A pool of a few blocks and a host tier: documents evicted from the pool come back from the
    tier, and /metrics and /v1/kv say so per tier."""
    from prometheus_client.parser import text_string_to_metric_families

    _, _, base, stop = start_server(tiny_chat_model, {"kv_cache_memory": "160KiB", "kv_offload_memory": "4MiB"})
    try:
        docs = [[(5 * d + i) % 200 + 3 for i in range(96)] for d in range(4)]
        for _ in range(2):
            for doc in docs:
                assert post(base, "/v1/completions", {"prompt": doc, "max_tokens": 2}).status_code == 200
        samples = {(s.name, s.labels.get("tier")): s.value
                   for f in text_string_to_metric_families(httpx.get(base + "/metrics").text) for s in f.samples}
        assert samples[("kvserve:kv_tier_hits_total", "cpu")] > 0
        assert samples[("kvserve:kv_tier_capacity_bytes", "cpu")] > 0
        assert samples[("kvserve:kv_tier_load_seconds_count", "cpu")] == samples[("kvserve:kv_tier_hits_total", "cpu")]
        tier = httpx.get(base + "/v1/kv").json()["tiers"][0]
        assert tier["name"] == "cpu" and tier["hits"] == samples[("kvserve:kv_tier_hits_total", "cpu")]
    finally:
        stop()


def test_shutdown_finishes_queued_disk_writes(tiny_chat_model: LoadedModel, tmp_path: Any) -> None:
    engine, _, base, stop = start_server(tiny_chat_model, {"kv_cache_memory": "160KiB", "kv_offload_memory": "64KiB",
                                                           "kv_offload_disk": str(tmp_path)})
    docs = [[(7 * d + i) % 200 + 3 for i in range(96)] for d in range(4)]
    for doc in docs:
        assert post(base, "/v1/completions", {"prompt": doc, "max_tokens": 2}).status_code == 200
    stop()  # the engine's shutdown
    disk = engine.engine.kv_manager.disk_tier
    assert disk._writer.pending == 0 and not disk._writer.running
    assert len(list(tmp_path.glob("*/*/*.kvb"))) == len(disk.index) > 0
