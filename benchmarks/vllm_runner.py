"""Run one workload through vLLM's CPU build; prints a JSON line. Runs in vLLM's own venv:

    VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 \\
        /path/to/vllm-venv/bin/python benchmarks/vllm_runner.py --model HF_FOLDER --workload uniform

``--prompts-json FILE`` (a JSON list of token-id lists) replaces the named workload, each prompt
with ``--max-tokens`` outputs; the greedy output tokens are printed too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from workloads import WORKLOADS, Workload


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--workload", choices=list(WORKLOADS))
    parser.add_argument("--prompts-json", default=None)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--kv-cache-gib", type=int, default=4)
    parser.add_argument("--prefix-caching", action="store_true")
    parser.add_argument("--speculative-config", default=None, help="JSON, as LLM(speculative_config=...) takes it")
    parser.add_argument("--tpot-batches", default=None,
                        help="comma-separated batch sizes: for each, the wall time of the first B prompts with "
                             "--max-tokens and with one output token (TPOT = difference / (max_tokens - 1))")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gib))
    from vllm import LLM, SamplingParams, TokensPrompt

    if args.prompts_json:
        with open(args.prompts_json) as file:
            prompt_ids = json.load(file)
        work = Workload("prompts-json", prompt_ids, [args.max_tokens] * len(prompt_ids))
    else:
        work = WORKLOADS[args.workload]()
    start = time.perf_counter()
    spec = json.loads(args.speculative_config) if args.speculative_config else None
    llm = LLM(model=args.model, dtype=args.dtype, block_size=args.block_size, max_num_seqs=64,
              enable_prefix_caching=args.prefix_caching, max_model_len=args.max_model_len, seed=0,
              speculative_config=spec, disable_log_stats=spec is None and not args.tpot_batches)
    startup = time.perf_counter() - start
    prompts = [TokensPrompt(prompt_token_ids=p) for p in work.prompts]
    if args.tpot_batches:
        tpot_batches(llm, prompts, args, SamplingParams)
        return
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in work.output_lens]
    times = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - t)
        assert sum(len(o.outputs[0].token_ids) for o in outs) == work.output_tokens
    print("RESULT " + json.dumps({"engine": "vllm-cpu", "dtype": args.dtype, "workload": work.name,
                                  "times": times, "startup_s": startup, "output_tokens": work.output_tokens,
                                  "outputs": [list(o.outputs[0].token_ids) for o in outs]}))


def tpot_batches(llm: object, prompts: list, args: argparse.Namespace, params_class: type) -> None:
    """Walls per batch size (medians of --repeats), the greedy outputs, and vLLM's speculative
    decoding counters if it kept any."""
    rows = []
    for batch in [int(b) for b in args.tpot_batches.split(",")]:
        walls: dict[int, float] = {}
        tpots: list[float] = []
        for max_tokens in (1, args.max_tokens):
            params = params_class(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            llm.generate(prompts[:batch], params, use_tqdm=False)  # type: ignore[attr-defined]  # warm
            times = []
            for _ in range(args.repeats):
                t = time.perf_counter()
                outs = llm.generate(prompts[:batch], params, use_tqdm=False)  # type: ignore[attr-defined]
                times.append(time.perf_counter() - t)
                if max_tokens > 1:  # per request (last token - first token) / (tokens - 1), as vLLM's bench
                    tpots.append(sum((o.metrics.last_token_ts - o.metrics.first_token_ts)
                                     / (len(o.outputs[0].token_ids) - 1) for o in outs) / len(outs))
            walls[max_tokens] = sorted(times)[len(times) // 2]
        rows.append({"batch": batch, "wall_1": walls[1], "wall_n": walls[args.max_tokens],
                     "tpot_ms": 1000 * sorted(tpots)[len(tpots) // 2],
                     "outputs": [list(o.outputs[0].token_ids) for o in outs]})
    counters: dict[str, float] = {}
    try:
        for metric in llm.get_metrics():  # type: ignore[attr-defined]
            if metric.name.startswith("vllm:spec_decode") and hasattr(metric, "value"):
                counters[metric.name] = float(metric.value)
    except Exception as exc:  # older builds keep no offline metrics
        counters["error"] = str(exc)  # type: ignore[assignment]
    print("RESULT " + json.dumps({"engine": "vllm-cpu", "rows": rows, "spec_counters": counters}))


if __name__ == "__main__":
    main()
