"""Device check: the engine on CUDA matches transformers (CPU, float32) on tiny random models,
and sizes its pool from --gpu-memory-utilization with a profiled activation peak.

    PYTHONPATH=. python benchmarks/cuda_smoke.py
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from kvserve import LLM, SamplingParams
from kvserve.quant.reference import reference_greedy
from tests.conftest import first_divergence_is_near_tie, make_tiny_model

PROMPTS = [[1 + (7 * i + 3 * j) % 250 for j in range(n)] for i, n in enumerate([1, 5, 17, 40, 90, 130])]


def main() -> int:
    assert torch.cuda.is_available(), "no CUDA device"
    print("device:", torch.cuda.get_device_name(0), "torch", torch.__version__)
    failures = 0
    root = Path(tempfile.mkdtemp())
    for arch in ("llama", "qwen2", "qwen3"):
        path = make_tiny_model(root, arch)
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        refs = [reference_greedy(hf, p, 16) for p in PROMPTS]
        for block_size in (1, 16, 64):
            llm = LLM(str(path), device="cuda", dtype="float32", block_size=block_size, kv_cache_memory="8MiB",
                      max_num_batched_tokens=48)
            assert llm.engine.kv_cache.layers[0].data.is_cuda
            outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
            for out, (ref, lp) in zip(outs, refs, strict=True):
                ok, why = first_divergence_is_near_tie(out.token_ids, ref, lp)
                if not ok:
                    failures += 1
                    print(f"FAIL {arch} block {block_size}: {why}")
            print(f"ok   {arch} block_size={block_size} float32 on cuda matches HF")
    path = make_tiny_model(root, "llama")
    llm = LLM(str(path), device="cuda", gpu_memory_utilization=0.05, max_num_batched_tokens=4096)
    print("pool from utilization:", llm.engine.describe(), "bf16 blocks", llm.engine.num_blocks)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=64, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(PROMPTS * 20, params)
    dt = time.perf_counter() - t
    assert all(len(o.token_ids) == 64 for o in outs)
    print(f"bf16 sampled batch of {len(outs)}: {sum(len(o.token_ids) for o in outs) / dt:.0f} tok/s, {llm.kv_stats()}")
    print("CUDA SMOKE", "PASSED" if failures == 0 else f"FAILED ({failures})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
