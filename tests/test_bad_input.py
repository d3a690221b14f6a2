"""Bad input is rejected with an error that names the value; the engine keeps serving."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from kvserve import LLM, ConfigError, EngineConfig, InvalidRequestError, SamplingParams
from kvserve.config import parse_size
from kvserve.model.loader import ModelLoadError


@pytest.fixture(scope="module")
def tiny_llm(tiny_model_factory: Callable[..., Path]) -> LLM:
    return LLM(str(tiny_model_factory("llama")), kv_cache_memory="1MiB", max_model_len=256)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"max_tokens": 0}, "max_tokens must be an integer >= 1, got 0"),
        ({"temperature": -0.5}, "temperature must be >= 0, got -0.5"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
        ({"top_k": -3}, "top_k .* got -3"),
        ({"min_p": 2.0}, "min_p .* got 2.0"),
    ],
)
def test_bad_sampling_params(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_empty_and_too_long_prompts_rejected_engine_keeps_serving(tiny_llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=3)
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        tiny_llm.generate([[]], params)
    with pytest.raises(InvalidRequestError, match="300 tokens, more than max_model_len=256"):
        tiny_llm.generate([[5] * 10, [5] * 300], params)  # the good one is not left queued
    with pytest.raises(InvalidRequestError, match="token id 999 is outside"):
        tiny_llm.generate([[999]], params)
    assert not tiny_llm.engine.has_unfinished_requests()
    out = tiny_llm.generate([[5] * 10], params)[0]
    assert len(out.token_ids) == 3


@pytest.mark.parametrize("block_size", [0, 3, 12, 512, -16])
def test_block_size_must_be_power_of_two(block_size: int) -> None:
    with pytest.raises(ConfigError, match=f"block_size must be a power of two in 1..256, got {block_size}"):
        EngineConfig.from_settings(block_size=block_size)


def test_an_unknown_engine_setting_names_itself() -> None:
    with pytest.raises(ConfigError, match="unknown engine setting 'block_sise'"):
        EngineConfig.from_settings(block_sise=16)
    with pytest.raises(ConfigError, match=r"preemption_mode=swap .* give kv_offload_memory"):
        EngineConfig.from_settings(preemption_mode="swap")  # a check across two concerns


@pytest.mark.parametrize("value", ["lots", "-5MiB", "0"])
def test_bad_sizes(value: str) -> None:
    with pytest.raises(ConfigError, match="kv_cache_memory"):
        EngineConfig.from_settings(kv_cache_memory=value)
    assert parse_size("2GiB") == 2 * 2**30 and parse_size("512MB") == 512 * 10**6


def test_unknown_model_path() -> None:
    with pytest.raises(ModelLoadError, match="'/no/such/model' is neither a known alias"):
        LLM("/no/such/model")


def test_kv_budget_smaller_than_one_sequence(tiny_model_factory: Callable[..., Path]) -> None:
    path = str(tiny_model_factory("llama"))
    with pytest.raises(ConfigError, match="holds 240 tokens, fewer than one sequence of max_model_len=512"):
        LLM(path, kv_cache_memory=16 * 16 * 512, max_model_len=512)  # 16 blocks of 16, one is null
    with pytest.raises(ConfigError, match="smaller than one KV block"):
        LLM(path, kv_cache_memory="1KiB")


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvserve.cli", *args], capture_output=True, text=True,
                          timeout=300)


def test_cli_errors_name_the_value(tiny_model_factory: Callable[..., Path]) -> None:
    r = _cli("generate", "hi", "--block-size", "24")
    assert r.returncode == 2 and "block_size must be a power of two in 1..256, got 24" in r.stderr
    r = _cli("generate", "hi", "--model", "/no/such/model")
    assert r.returncode == 2 and "'/no/such/model'" in r.stderr
    r = _cli("generate", "hi", "--kv-cache-memory", "plenty")
    assert r.returncode == 2 and "'plenty'" in r.stderr
    r = _cli("generate", "hi", "--quantization", "fp4")
    assert r.returncode == 2 and "invalid choice: 'fp4'" in r.stderr
    r = _cli("generate", "hi", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": -2}')
    assert r.returncode == 2 and "num_speculative_tokens must be an integer >= 1, got -2" in r.stderr
    r = _cli("generate", "hi", "--speculative-config", "{method: ngram}")
    assert r.returncode == 2 and "speculative_config: not valid JSON" in r.stderr
    path = str(tiny_model_factory("llama"))
    r = _cli("generate", "--model", path, "--kv-cache-memory", "64KiB", "--max-model-len", "512")
    assert r.returncode == 2 and "no prompts" in r.stderr
    r = _cli("generate", "hi", "--model", path, "--kv-cache-memory", "64KiB", "--max-model-len", "512")
    assert r.returncode == 2 and "fewer than one sequence of max_model_len=512" in r.stderr
