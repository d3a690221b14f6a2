"""Where a served decode step's time goes, at batch 1 and 32, beside its floor.

    python benchmarks/serving_step.py --dtype bfloat16 --out docs/results/serving_step.json

For each batch: ``--batch`` random 256-token prompts sampled at temperature 1 (as vLLM's `bench
serve` sends them), prefilled, then the median wall time of ``--steps`` decode steps of the
engine alone (no HTTP), and over a few more steps under torch's profiler the time in the linear
layers (the LM head included), in attention and the K/V writes, and the rest (sampling, norms,
the step's Python). The floor: the bytes one step must read (every weight once, and the K/V the
batch attends to) over this machine's read bandwidth (``x.sum()`` over 512 MiB, same threads,
best of 5), and the linear layers' FLOPs over the peak their GEMM reached at 2,048 rows.
The same steps run once more from a second thread (how a server that steps off the main thread
runs them: torch's OpenMP regions cost more there).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, os.path.dirname(__file__))
from kv_quant_throughput import time_decode_steps

from kvserve import LLM, SamplingParams
from kvserve.engine.loading import load_model
from kvserve.model.int8_linear import Int8Linear
from kvserve.model.llama import PackedLinear

LINEAR_OPS = ("linear", "qlinear", "aten::mm", "aten::addmm")
ATTENTION_OPS = ("attention", "write_kv", "rope")


def label_linears(model: torch.nn.Module) -> None:
    """Run each linear layer's forward inside a profiler range named "linear": kvserve's C++ GEMMs
    are pybind calls, which the profiler does not see on its own."""
    def labelled(method: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            with record_function("linear"):
                return method(*args, **kwargs)
        return call
    for module in model.modules():
        if isinstance(module, (torch.nn.Linear, PackedLinear, Int8Linear)):
            module.forward = labelled(module.forward)  # type: ignore[method-assign]
            if isinstance(module, Int8Linear):
                module.forward_after_norm = labelled(module.forward_after_norm)  # type: ignore[method-assign]


def read_bandwidth() -> float:
    """Bytes per second that x.sum() reads from a 512 MiB float32 tensor (best of 5)."""
    x = torch.ones(128 * 2**20)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best


def gemm_peak(dtype: torch.dtype, quantization: str | None) -> float:
    """FLOP/s of one 2,048 x 576 x 1,536 linear layer (a prefill chunk's gate projection) as the
    engine builds it: kvserve's packed layer in ``dtype``, or its int8 one."""
    linear = torch.nn.Linear(576, 1536, bias=False).to(dtype)
    layer = Int8Linear(linear) if quantization == "int8" else PackedLinear(linear)
    a = torch.randn(2048, 576, dtype=dtype)
    layer(a)
    start = time.perf_counter()
    for _ in range(20):
        layer(a)
    return 20 * 2 * 2048 * 576 * 1536 / (time.perf_counter() - start)


def step_times(llm: LLM, batch: int, steps: int) -> tuple[float, dict[str, float]]:
    """Median decode step (ms) of ``batch`` sequences, and the profiled split (ms per step)."""
    engine = llm.engine
    for i in range(batch):
        engine.add_request([(7 * i + j) % 40000 + 100 for j in range(256)],
                           SamplingParams(max_tokens=steps + 40, ignore_eos=True, temperature=1.0))
    while engine.num_waiting or any(r.num_computed_tokens < len(r.prompt_token_ids)
                                    for r in engine.requests.values()):
        engine.step()
    for _ in range(3):
        engine.step()
    step_ms = time_decode_steps(llm, steps)["step_ms"]
    profiled = 10
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(profiled):
            engine.step()
    split = {"linear": 0.0, "attention": 0.0}
    total = 0.0
    for event in prof.key_averages():
        if event.key.startswith("ProfilerStep"):
            continue
        if any(name in event.key for name in LINEAR_OPS):
            split["linear"] += event.self_cpu_time_total
        elif any(name in event.key for name in ATTENTION_OPS):
            split["attention"] += event.self_cpu_time_total
        total += event.self_cpu_time_total
    split = {k: v / profiled / 1e3 for k, v in split.items()}
    split["rest"] = step_ms - sum(split.values())
    while engine.has_unfinished_requests():
        engine.step()
    return step_ms, split


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    loaded = load_model("smollm2-135m", torch.device("cpu"), dtype, args.quantization)
    llm = LLM(loaded=loaded, dtype=args.dtype, quantization=args.quantization, kv_cache_memory="1GiB",
              max_model_len=2048, enable_prefix_caching=False)
    label_linears(loaded.model)
    bandwidth, peak = read_bandwidth(), gemm_peak(dtype, args.quantization)
    weights = loaded.weight_bytes
    cfg = loaded.config
    weight_size = 1 if args.quantization == "int8" else torch.empty((), dtype=dtype).element_size()
    linear_flops_per_token = 2 * weights / weight_size  # 2 FLOPs per weight
    rows: list[dict[str, Any]] = []
    for batch in (int(b) for b in args.batches.split(",")):
        step_ms, split = step_times(llm, batch, args.steps)
        result: dict[str, Any] = {}

        def off_main(b: int = batch, into: dict[str, Any] = result) -> None:
            into["ms"] = step_times(llm, b, args.steps)[0]
        thread = threading.Thread(target=off_main)
        thread.start()
        thread.join()
        context = 256 + args.steps // 2
        kv_bytes = batch * context * llm.engine.kv_bytes_per_token
        floor_ms = 1e3 * max((weights + kv_bytes) / bandwidth, batch * linear_flops_per_token / peak)
        rows.append({"batch": batch, "step_ms": step_ms, "off_main_thread_ms": result["ms"], **split,
                     "weight_bytes": weights, "kv_bytes": kv_bytes, "floor_ms": floor_ms})
        print(f"batch {batch:3d}: step {step_ms:6.2f} ms (off the main thread {result['ms']:6.2f}); linear "
              f"{split['linear']:6.2f}, attention {split['attention']:5.2f}, rest {split['rest']:5.2f}; floor "
              f"{floor_ms:5.2f} ms ({weights / 2**20:.0f} MiB weights + {kv_bytes / 2**20:.0f} MiB K/V at "
              f"{bandwidth / 1e9:.1f} GB/s; GEMM peak {peak / 1e9:.0f} GFLOP/s)", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"dtype": args.dtype, "quantization": args.quantization,
                                              "read_bandwidth": bandwidth, "gemm_peak_flops": peak,
                                              "layers": cfg.num_layers, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
