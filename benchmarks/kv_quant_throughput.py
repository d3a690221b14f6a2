"""Quantized KV at a fixed small KV budget: does the freed memory turn into throughput?

    python benchmarks/kv_quant_throughput.py --kv-scales docs/results/smollm2_kv_scales.json \\
        --out docs/results/kv_quant_throughput.json

Workload: 48 requests of 512 random prompt tokens and 128 output tokens (EOS ignored, no shared
prefixes) submitted at once to one engine per KV dtype, all with the same --kv-cache-memory
(default 64 MiB: 16-bit KV holds ~5 such requests at once) and --max-num-seqs 16 (int4 reserves
a full-precision tail block per possible sequence from the budget). Per dtype: output tokens/s, total
time, the most requests running at once, preemptions. Then the cost of reading each format:
the mean decode step at a fixed batch (16 sequences of 1,024 tokens, plenty of memory), so the
dequantization work shows on its own. bf16 model, 2 threads (this machine's cores).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from kvserve import LLM, SamplingParams
from kvserve.engine.loading import load_model


def workload(seed: int, requests: int, prompt_len: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(prompt_len)] for _ in range(requests)]


def run_load(llm: LLM, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    stats = llm.kv_stats()
    generated = sum(len(o.token_ids) for o in outs)
    return {"seconds": elapsed, "output_tok_s": generated / elapsed, "peak_running": stats.peak_num_requests,
            "preemptions": stats.num_preemptions, "num_blocks": stats.num_blocks}


ATTENTION_EVENTS = ("kvserve::paged_decode_attention", "kvserve::paged_attention_quantized")


@contextlib.contextmanager
def random_kv_prefill(llm: LLM) -> Iterator[None]:
    """While open, the engine's model does not run: a step writes random K/V (normal, unit
    variance) for its tokens into every layer through the layer's own write path (its format's
    quantizer and scales) and returns zero hidden states. A decode step's speed depends on the
    pool's bytes and layout, not on the values in it; this skips prefilling batch x context
    tokens: 32 x 4,096 in bf16 on a CPU without AVX512-BF16 is half an hour per engine (56 s
    per prompt on a Zen 3, 14 s in float32)."""
    model = llm.engine.runner.model
    config = model.config
    dtype = next(model.parameters()).dtype
    generator = torch.Generator().manual_seed(0)

    def forward(input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[Any],
                metas: list[Any]) -> torch.Tensor:
        shape = (input_ids.shape[0], config.num_kv_heads, config.head_dim)
        for kv, meta in zip(kv_caches, metas, strict=True):
            key, value = (torch.randn(shape, generator=generator).to(dtype) for _ in range(2))
            kv.write(key, value, meta.write)
        return torch.zeros(input_ids.shape[0], config.hidden_size, dtype=dtype)

    model.forward = forward
    try:
        yield
    finally:
        del model.forward


def start_decoding(llm: LLM, batch: int, context: int, steps: int, random_kv: bool = False) -> list[str]:
    """Add ``batch`` requests of ``context`` random prompt tokens and step the engine until all
    are prefilled, so that every later step decodes all of them; each may generate ``steps``
    more tokens than its prefill takes (sequences prefilled first decode while the rest
    prefill), so none finishes before it is measured. ``random_kv``: the prompts' K/V written
    at random instead of computed (random_kv_prefill). Returns the request ids (to abort)."""
    engine = llm.engine
    prefill_steps = -(-batch * context // engine.config.scheduler_config.max_num_batched_tokens)
    params = SamplingParams(temperature=0, max_tokens=prefill_steps + steps + 8, ignore_eos=True)
    ids = [engine.add_request(prompt, params).request_id for prompt in workload(7, batch, context)]
    with random_kv_prefill(llm) if random_kv else contextlib.nullcontext():
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
            engine.step()
    assert len(engine.requests) == batch, "a request finished before the decode steps were measured"
    return ids


def time_decode_steps(llm: LLM, steps: int, profiled: int = 0) -> dict[str, float]:
    """The median wall time (ms) of ``steps`` decode steps and, over ``profiled`` further steps
    under torch's profiler, the attention kernels' mean time per step (ms). Every running
    request must have room for them (start_decoding)."""
    engine = llm.engine
    running = len(engine.requests)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    attention_us = 0.0
    if profiled:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(profiled):
                engine.step()
        attention_us = sum(e.cpu_time_total for e in prof.key_averages() if e.key in ATTENTION_EVENTS) / profiled
    assert len(engine.requests) == running, "a request finished during the measured decode steps"
    return {"step_ms": 1000 * statistics.median(times), "attention_ms": attention_us / 1000}


def decode_steps(llm: LLM, batch: int, context: int, steps: int, profiled: int = 0) -> dict[str, float]:
    """Prefill ``batch`` sequences of ``context`` tokens, then time decode steps with all of them
    running (time_decode_steps); the requests are aborted afterwards."""
    ids = start_decoding(llm, batch, context, steps + profiled)
    result = time_decode_steps(llm, steps, profiled)
    for request_id in ids:
        llm.engine.abort_request(request_id)
    return result


def decode_step_ms(llm: LLM, batch: int, context: int, steps: int) -> float:
    """Median wall time (ms) of a decode step with ``batch`` sequences at ~``context`` tokens."""
    return decode_steps(llm, batch, context, steps)["step_ms"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kv-cache-dtype", default="auto,fp8_e4m3,int8,int4")
    parser.add_argument("--kv-scales", default=None, help="calibration file (static int8 key scales)")
    parser.add_argument("--kv-cache-memory", default="64MiB")
    parser.add_argument("--max-num-seqs", type=int, default=16,
                        help="also the number of full-precision tail slots int4 reserves from the budget")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(2)
    loaded = load_model("smollm2-135m", torch.device("cpu"), torch.bfloat16)
    prompts = workload(0, args.requests, args.prompt_len)
    rows = []
    for kv_dtype in args.kv_cache_dtype.split(","):
        kwargs: dict[str, Any] = {"kv_scales": args.kv_scales} if args.kv_scales else {}
        llm = LLM(loaded=loaded, kv_cache_dtype=kv_dtype, kv_cache_memory=args.kv_cache_memory,
                  enable_prefix_caching=False, max_num_seqs=args.max_num_seqs, **kwargs)
        llm.generate([prompts[0][:64]], SamplingParams(max_tokens=4))  # warm-up
        load = run_load(llm, prompts, args.max_tokens)
        wide = LLM(loaded=loaded, kv_cache_dtype=kv_dtype, kv_cache_memory="1GiB", enable_prefix_caching=False,
                   **kwargs)
        step = decode_step_ms(wide, batch=16, context=1024, steps=12)
        row = {"kv_cache_dtype": kv_dtype, "kv_bytes_per_token": llm.engine.kv_bytes_per_token, **load,
               "decode_step_ms_16x1024": step}
        rows.append(row)
        print(json.dumps(row), flush=True)
    base = rows[0]
    print(f"\n| KV dtype | B/token | blocks in {args.kv_cache_memory} | peak running | preemptions | output tok/s "
          f"| vs {base['kv_cache_dtype']} | decode step 16x1024 (ms) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kv_cache_dtype']} | {r['kv_bytes_per_token']} | {r['num_blocks']} | {r['peak_running']} | "
              f"{r['preemptions']} | {r['output_tok_s']:.1f} | {r['output_tok_s'] / base['output_tok_s']:.2f}x | "
              f"{r['decode_step_ms_16x1024']:.1f} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": rows}, indent=1))


if __name__ == "__main__":
    main()
