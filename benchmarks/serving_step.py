"""Where a served decode step's time goes, at batch 1 and 32, beside its floor.

    python benchmarks/serving_step.py --dtype bfloat16 --out docs/results/serving_step.json

For each batch: ``--batch`` random 256-token prompts sampled at temperature 1 (as vLLM's `bench
serve` sends them), prefilled, then the median wall time of ``--steps`` decode steps of the
engine alone (no HTTP), and over a few more steps under torch's profiler the time in the linear
layers (the LM head included), in attention and the K/V writes, and the rest. The profiled steps
also split the rest, by profiler ranges around the step's parts: the model's time outside its
linear layers and attention (norms, rotary, building the step's tensors), the scheduler,
sampling, and the outputs (detokenization, stop checks, output objects); what is left is the
engine's own bookkeeping. The floor: the bytes one step must read (every weight once, and
the K/V the batch attends to) over this machine's read bandwidth (``x.sum()`` over 512 MiB, same
threads, best of 5), or the linear layers' FLOPs over the best rate their GEMM reached at 32, 256
or 2,048 rows, whichever is larger. The same steps run once more from a second thread (how a
server that steps off the main thread runs them: torch's OpenMP regions cost more there).
``--kv-cache-dtype`` / ``--kv-scales`` run another KV format (an AVX2 CPU serves
``--dtype float32 --quantization int8 --kv-cache-dtype int8 --kv-scales FILE``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, os.path.dirname(__file__))
from kv_quant_throughput import time_decode_steps
from workloads import cpu_flags, cpu_name

from kvserve import LLM, SamplingParams
from kvserve.engine import model_runner
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


PHASES = "step:"  # the profiler ranges phase_ranges opens start with this


@contextmanager
def phase_ranges(llm: LLM) -> Iterator[None]:
    """While open, the step's parts run inside profiler ranges named step:<part>: the scheduler,
    the model's forward pass, its LM head, sampling and the outputs (the callables are wrapped,
    then restored)."""
    engine = llm.engine
    targets: list[tuple[Any, str, str]] = [
        (engine.scheduler, "schedule", "schedule"), (engine.runner, "forward", "model"),
        (engine.runner.model, "compute_logits", "lm_head"), (model_runner, "sample", "sample"),
        (engine.outputs, "append", "outputs"), (engine.outputs, "output", "outputs")]
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in targets]

    def ranged(method: Callable[..., Any], part: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            with record_function(PHASES + part):
                return method(*args, **kwargs)
        return call
    for (owner, name, part), (_, _, method) in zip(targets, originals, strict=True):
        setattr(owner, name, ranged(method, part))
    try:
        yield
    finally:
        for owner, name, method in originals:
            if owner is model_runner:
                setattr(owner, name, method)
            else:
                delattr(owner, name)  # the instance attribute hid the class's method


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
    """The best FLOP/s of a 576 x 1,536 linear layer (a gate projection) as the engine builds it,
    kvserve's packed layer in ``dtype`` or its int8 one, over 32, 256 and 2,048 rows."""
    linear = torch.nn.Linear(576, 1536, bias=False).to(dtype)
    layer = Int8Linear(linear) if quantization == "int8" else PackedLinear(linear)
    best = 0.0
    for rows in (32, 256, 2048):
        a = torch.randn(rows, 576, dtype=dtype)
        layer(a)
        calls = max(20, 40960 // rows)
        start = time.perf_counter()
        for _ in range(calls):
            layer(a)
        best = max(best, calls * 2 * rows * 576 * 1536 / (time.perf_counter() - start))
    return best


def linear_weights(model: torch.nn.Module) -> int:
    """Weights of the linear layers (the LM head included): 2 FLOPs each per token."""
    return sum(m.in_features * m.out_features for m in model.modules()
               if isinstance(m, (torch.nn.Linear, PackedLinear, Int8Linear)))


def step_times(llm: LLM, batch: int, steps: int) -> tuple[float, dict[str, float]]:
    """Median decode step (ms) of ``batch`` sequences, and the profiled split (ms per step)."""
    engine = llm.engine
    for i in range(batch):
        engine.add_request([(7 * i + j) % 40000 + 100 for j in range(256)],
                           SamplingParams(max_tokens=2 * steps + 40, ignore_eos=True, temperature=1.0))
    while engine.num_waiting or any(r.num_computed_tokens < len(r.prompt_token_ids)
                                    for r in engine.requests.values()):
        engine.step()
    for _ in range(3):
        engine.step()
    step_ms = time_decode_steps(llm, steps)["step_ms"]
    profiled = 10
    with phase_ranges(llm), profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(profiled):
            engine.step()
        profiled_ms = 1e3 * (time.perf_counter() - start) / profiled
    split = {"linear": 0.0, "attention": 0.0}
    parts = {"schedule": 0.0, "model": 0.0, "lm_head": 0.0, "sample": 0.0, "outputs": 0.0}
    for event in prof.key_averages():
        if event.key.startswith(PHASES):
            parts[event.key.removeprefix(PHASES)] += event.cpu_time_total
        elif any(name in event.key for name in LINEAR_OPS):
            split["linear"] += event.self_cpu_time_total
        elif any(name in event.key for name in ATTENTION_OPS):
            split["attention"] += event.self_cpu_time_total
    split = {k: v / profiled / 1e3 for k, v in split.items()}
    parts = {k: v / profiled / 1e3 for k, v in parts.items()}
    split["rest"] = step_ms - split["linear"] - split["attention"]
    # the rest as the profiled steps spent it: the model outside its linear layers (the LM head
    # is one) and attention (norms, rotary, the step's tensors), the scheduler, sampling, the
    # outputs, and the engine's own bookkeeping
    model_ms = parts.pop("model") + parts.pop("lm_head")
    split["profiled_step"] = profiled_ms
    split["norms_rotary_tensors"] = model_ms - split["linear"] - split["attention"]
    split.update(parts)
    split["engine_other"] = profiled_ms - model_ms - sum(parts.values())
    while engine.has_unfinished_requests():
        engine.step()
    return step_ms, split


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--kv-scales", default=None, help="calibration file (int8 KV's static key scales)")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    loaded = load_model("smollm2-135m", torch.device("cpu"), dtype, args.quantization)
    llm = LLM(loaded=loaded, dtype=args.dtype, quantization=args.quantization, kv_cache_memory="1GiB",
              max_model_len=2048, enable_prefix_caching=False, kv_cache_dtype=args.kv_cache_dtype,
              kv_scales=args.kv_scales)
    label_linears(loaded.model)
    bandwidth, peak = read_bandwidth(), gemm_peak(dtype, args.quantization)
    weights = loaded.weight_bytes
    cfg = loaded.config
    linear_flops_per_token = 2 * linear_weights(loaded.model)
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
              f"{split['linear']:6.2f}, attention {split['attention']:5.2f}, rest {split['rest']:5.2f} (profiled step "
              f"{split['profiled_step']:5.2f}: norms, rotary, "
              f"tensors {split['norms_rotary_tensors']:4.2f}, schedule {split['schedule']:4.2f}, sample "
              f"{split['sample']:4.2f}, outputs {split['outputs']:4.2f}, engine {split['engine_other']:4.2f}); floor "
              f"{floor_ms:5.2f} ms ({weights / 2**20:.0f} MiB weights + {kv_bytes / 2**20:.0f} MiB K/V at "
              f"{bandwidth / 1e9:.1f} GB/s; GEMM peak {peak / 1e9:.0f} GFLOP/s)", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"dtype": args.dtype, "quantization": args.quantization,
                                              "kv_cache_dtype": args.kv_cache_dtype, "cpu": cpu_name(),
                                              "cpu_flags": cpu_flags(),
                                              "read_bandwidth": bandwidth, "gemm_peak_flops": peak,
                                              "layers": cfg.num_layers, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
