"""KV tiers: what keeping evicted prefix blocks in host memory (tier 1) buys against recomputing
them, on workloads whose reused prefixes are 4x the pool. Same model, same token ids, one run:

- ``pool only``: evicted prefixes are recomputed;
- ``+ cpu tier``: evicted prefixes are demoted to host memory and promoted back on a hit;
- ``all in pool``: a pool large enough that nothing is evicted (the reference a tier is paying
  to approach).

Workloads (token ids, EOS ignored, requests run one at a time so TTFT is the prefill time):
``doc-qa`` asks each of N documents several questions, documents round-robin, so a document has
left the pool before it is asked again; ``multi-turn`` runs N conversations turn by turn,
round-robin, each turn's prompt the whole history so far. ``swap``: 16 requests of 1,024
prompt tokens submitted at once into a pool for two of them (8x oversubscribed), preempted by
recompute or by swapping their blocks to tier 1 (the pool holds two prompts, not their growth).

    python benchmarks/kv_tiers.py --out docs/results/kv_tiers.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kvserve import LLM, SamplingParams
from kvserve.engine.loading import load_model


def doc_qa(num_docs: int, doc_len: int, questions: int, vocab: int) -> list[tuple[list[int], bool]]:
    rng = random.Random(0)
    docs = [[rng.randrange(10, vocab) for _ in range(doc_len)] for _ in range(num_docs)]
    return [(docs[d] + [rng.randrange(10, vocab) for _ in range(24)], q > 0)
            for q in range(questions) for d in range(num_docs)]


def multi_turn(num_chats: int, turns: int, turn_len: int, reply_len: int, vocab: int) -> list[tuple[list[int], bool]]:
    """Each turn's prompt is the whole conversation so far (earlier replies as fixed token ids)."""
    rng = random.Random(1)
    history: list[list[int]] = [[rng.randrange(10, vocab) for _ in range(256)] for _ in range(num_chats)]  # system
    requests = []
    for turn in range(turns):
        for chat in range(num_chats):
            history[chat] = history[chat] + [rng.randrange(10, vocab) for _ in range(turn_len)]
            requests.append((list(history[chat]), turn > 0))
            history[chat] = history[chat] + [rng.randrange(10, vocab) for _ in range(reply_len)]
    return requests


def run(llm: LLM, requests: list[tuple[list[int], bool]]) -> dict[str, Any]:
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm.generate([requests[0][0][:32]], params)  # warm-up (kernels, allocator)
    ttft_reused: list[float] = []
    computed = 0
    start = time.perf_counter()
    outputs = []
    for prompt, reused in requests:
        out = llm.generate([prompt], params)[0]
        outputs.append(out.token_ids)
        computed += len(prompt) - out.num_cached_tokens
        if reused:
            ttft_reused.append(out.metrics["ttft"])
    total = time.perf_counter() - start
    stats = llm.kv_stats()
    tiers = [t._asdict() for t in stats.tiers]
    loads: dict[str, list[float]] = {}
    for tier, seconds in llm.engine.kv_cache.take_load_seconds():
        loads.setdefault(tier, []).append(seconds)
    for tier in tiers:  # mean time to bring one block back, per tier (the load histogram's mean)
        times = loads.get(tier["name"], [])
        tier["load_ms_per_block"] = 1e3 * statistics.mean(times) if times else None
    return {"total_s": total, "prefill_tokens_computed": computed,
            "ttft_reused_mean_s": statistics.mean(ttft_reused), "ttft_reused_p50_s": statistics.median(ttft_reused),
            "ttft_reused_p99_s": sorted(ttft_reused)[min(len(ttft_reused) - 1, int(0.99 * len(ttft_reused)))],
            "pool_blocks": stats.num_blocks, "tiers": tiers, "outputs": outputs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--out", default="docs/results/kv_tiers.json")
    parser.add_argument("--restart-only", action="store_true", help="only the warm-disk restart, printed")
    args = parser.parse_args()
    torch.set_num_threads(2)
    loaded = load_model("smollm2-135m", torch.device("cpu"), getattr(torch, args.dtype))
    if args.restart_only:
        warm_restart(loaded, args)
        return
    vocab = loaded.config.vocab_size
    workloads = {
        "doc-qa": (doc_qa(num_docs=8, doc_len=1024, questions=3, vocab=vocab), 2048),
        "multi-turn": (multi_turn(num_chats=8, turns=4, turn_len=64, reply_len=32, vocab=vocab), 1024),
        # one-block documents: where loading a block could cost more than recomputing it
        "short-doc-qa": (doc_qa(num_docs=64, doc_len=16, questions=3, vocab=vocab), 256),
    }
    results: dict[str, Any] = {"dtype": args.dtype, "kv_cache_dtype": args.kv_cache_dtype,
                               "block_size": args.block_size, "workloads": {}}
    for name, (requests, pool_tokens) in workloads.items():
        reused = sum(len(p) for p, _ in requests[: len(requests) // 3])  # rough working set of the prefixes
        common = dict(loaded=loaded, block_size=args.block_size, kv_cache_dtype=args.kv_cache_dtype,
                      max_model_len=pool_tokens, max_num_seqs=4)
        probe = LLM(**common, kv_cache_memory="64MiB").engine  # type: ignore[arg-type]
        pool_bytes = (pool_tokens // args.block_size + 2 + 2 * probe.tail_blocks) * probe.kv_block_bytes
        configs = {
            "pool only (recompute)": dict(kv_cache_memory=pool_bytes),
            "+ cpu tier": dict(kv_cache_memory=pool_bytes, kv_offload_memory="2GiB"),
            # tier 1 as small as the pool: most reused prefixes come back from disk
            "+ small cpu tier + disk": dict(kv_cache_memory=pool_bytes, kv_offload_memory=pool_bytes,
                                            kv_offload_disk=tempfile.mkdtemp(prefix="kvserve-disk-"),
                                            kv_offload_disk_size="4GiB"),
            "all in pool": dict(kv_cache_memory="2GiB"),
        }
        rows = {}
        for label, extra in configs.items():
            llm = LLM(**common, **extra)  # type: ignore[arg-type]
            rows[label] = run(llm, requests)
            print(f"{name:10s} {label:22s} total {rows[label]['total_s']:6.1f} s, reused-turn TTFT mean "
                  f"{1e3 * rows[label]['ttft_reused_mean_s']:7.1f} ms p50 {1e3 * rows[label]['ttft_reused_p50_s']:7.1f}"
                  f" p99 {1e3 * rows[label]['ttft_reused_p99_s']:7.1f}, prefill computed "
                  f"{rows[label]['prefill_tokens_computed']}; ms per block loaded: "
                  + ", ".join(f"{t['name']} {t['load_ms_per_block']:.3f}" for t in rows[label]["tiers"]
                              if t["load_ms_per_block"] is not None), flush=True)
            del llm
        same = all(r["outputs"] == rows["all in pool"]["outputs"] for r in rows.values())
        for r in rows.values():
            del r["outputs"]
        results["workloads"][name] = {"requests": len(requests), "pool_tokens": pool_tokens,
                                      "first_round_prompt_tokens": reused, "outputs_identical": same, "runs": rows}
        print(f"{name}: outputs identical across configurations: {same}")
    results["swap"] = swap_vs_recompute(loaded, args)
    results["restart"] = warm_restart(loaded, args)
    Path(args.out).write_text(json.dumps(results, indent=1))


def warm_restart(loaded: Any, args: argparse.Namespace) -> dict[str, Any]:
    """A server restarted on its disk tier serves a document it saw before from disk; a cold
    one (empty directory) prefills it. TTFT of that first repeated document, median of 3."""
    requests = doc_qa(num_docs=8, doc_len=1024, questions=3, vocab=loaded.config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    scale = next(loaded.model.parameters()).element_size() // 2  # float32 KV takes twice bf16's bytes
    common = dict(loaded=loaded, block_size=args.block_size, kv_cache_dtype=args.kv_cache_dtype, max_model_len=2048,
                  max_num_seqs=4, kv_cache_memory=f"{64 * scale}MiB", kv_offload_memory=f"{16 * scale}MiB",
                  kv_offload_disk_size="4GiB")
    warm_dir = tempfile.mkdtemp(prefix="kvserve-disk-")
    first = LLM(**common, kv_offload_disk=warm_dir)  # type: ignore[arg-type]
    for prompt, _ in requests:
        first.generate([prompt], params)
    first.engine.kv_manager.disk_tier.flush()  # type: ignore[union-attr]
    rows: dict[str, Any] = {}
    question = [t + 1 for t in requests[0][0][-24:]]  # a new question about document 0
    for label in ("cold restart (empty disk)", "warm restart (same disk)"):
        times, outputs = [], []
        for _ in range(3):
            disk = warm_dir if label.startswith("warm") else tempfile.mkdtemp(prefix="kvserve-disk-")
            llm = LLM(**common, kv_offload_disk=disk)  # type: ignore[arg-type]
            llm.generate([requests[1][0][:32]], SamplingParams(max_tokens=1))  # warm-up, unrelated tokens
            out = llm.generate([requests[0][0][:-24] + question], params)[0]
            times.append(out.metrics["ttft"])
            outputs.append(out.token_ids)
        rows[label] = {"ttft_s": statistics.median(times), "runs_s": times, "outputs": outputs,
                       "disk_hits": llm.kv_stats().tiers[1].hits}
        print(f"restart    {label:26s} TTFT {1e3 * rows[label]['ttft_s']:7.1f} ms (runs "
              f"{', '.join(f'{1e3 * t:.0f}' for t in times)}), disk hits {rows[label]['disk_hits']}", flush=True)
    same = rows["cold restart (empty disk)"]["outputs"] == rows["warm restart (same disk)"]["outputs"]
    for row in rows.values():
        del row["outputs"]
    print(f"restart: outputs identical: {same}")
    return {"outputs_identical": same, "runs": rows}


def swap_vs_recompute(loaded: Any, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(2)
    prompts = [[rng.randrange(10, loaded.config.vocab_size) for _ in range(1024)] for _ in range(16)]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    common = dict(loaded=loaded, block_size=args.block_size, kv_cache_dtype=args.kv_cache_dtype, max_model_len=1088,
                  max_num_seqs=16, enable_prefix_caching=False, kv_offload_memory="2GiB")
    probe = LLM(**common, kv_cache_memory="64MiB").engine  # type: ignore[arg-type]
    # two prompts fit, not their growth: running requests preempt each other as they decode
    blocks = 2 * (1024 // args.block_size + probe.tail_blocks) + 2 + probe.tail_blocks
    rows: dict[str, Any] = {}
    for mode in ("recompute", "swap"):
        llm = LLM(**common, kv_cache_memory=blocks * probe.kv_block_bytes, preemption_mode=mode)  # type: ignore[arg-type]
        llm.generate([prompts[0][:32]], SamplingParams(max_tokens=1))
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        total = time.perf_counter() - start
        stats = llm.kv_stats()
        ttfts = sorted(o.metrics["ttft"] for o in outs)
        rows[mode] = {"total_s": total, "output_tok_s": sum(len(o.token_ids) for o in outs) / total,
                      "ttft_p50_s": statistics.median(ttfts), "ttft_p99_s": ttfts[-1],
                      "preemptions": stats.num_preemptions, "swaps_out": stats.swaps_out,
                      "swap_fallbacks": stats.swap_fallbacks, "outputs": [o.token_ids for o in outs]}
        print(f"swap       {mode:22s} total {total:6.1f} s, {rows[mode]['output_tok_s']:6.1f} output tok/s, TTFT p50 "
              f"{rows[mode]['ttft_p50_s']:.2f} s p99 {rows[mode]['ttft_p99_s']:.2f} s, preemptions "
              f"{stats.num_preemptions}, swaps {stats.swaps_out}", flush=True)
    same = rows["swap"]["outputs"] == rows["recompute"]["outputs"]
    print(f"swap: outputs identical: {same}")
    for row in rows.values():
        del row["outputs"]
    return {"pool_blocks": blocks - 1, "requests": 16, "prompt_tokens": 1024, "output_tokens": 64,
            "outputs_identical": same, "runs": rows}


if __name__ == "__main__":
    main()
