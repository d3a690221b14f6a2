"""Output tokens/s of kvserve vs HF transformers `generate` (static padded batch) and,
where it is installed, vLLM's CPU build — same model, same token-id workloads, same run.

    python benchmarks/throughput.py --repeats 3 --out docs/results/throughput.json \\
        [--vllm-python /path/to/vllm-venv/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))
from workloads import WORKLOADS, Workload

from kvserve import LLM, SamplingParams
from kvserve.engine.loading import load_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def run_kvserve(work: Workload, dtype: str, repeats: int, block_size: int,
                quantization: str | None = None) -> dict[str, Any]:
    loaded = load_model("smollm2-135m", torch.device("cpu"), DTYPES[dtype], quantization)
    llm = LLM(loaded=loaded, block_size=block_size, kv_cache_memory="6GiB", max_num_seqs=64,
              max_num_batched_tokens=2048, max_model_len=2048, quantization=quantization)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in work.output_lens]
    llm.generate(work.prompts[:2], params[:2])  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        outs = llm.generate(work.prompts, params)
        times.append(time.perf_counter() - t)
        assert sum(len(o.token_ids) for o in outs) == work.output_tokens
    return {"engine": "kvserve" + (f"-{quantization}" if quantization else ""), "dtype": dtype,
            "workload": work.name, "times": times,
            "output_tokens": work.output_tokens, "preemptions": llm.kv_stats().num_preemptions}


def run_hf(work: Workload, dtype: str, repeats: int) -> dict[str, Any]:
    """One static batch, left-padded to the longest prompt, run to the longest output."""
    from transformers import AutoModelForCausalLM

    path = load_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model = model.to(DTYPES[dtype]).eval()
    model.generation_config.eos_token_id = None
    width = max(len(p) for p in work.prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in work.prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in work.prompts])
    max_new = max(work.output_lens)
    times = []
    with torch.inference_mode():
        model.generate(ids[:2, -8:], attention_mask=mask[:2, -8:], max_new_tokens=2, do_sample=False,
                       pad_token_id=0)
        for _ in range(repeats):
            t = time.perf_counter()
            out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
                                 do_sample=False, pad_token_id=0)
            times.append(time.perf_counter() - t)
            assert out.shape[1] == width + max_new
    # useful tokens: what each request asked for (the rest of a static batch is padding work)
    return {"engine": "hf-generate", "dtype": dtype, "workload": work.name, "times": times,
            "output_tokens": work.output_tokens}


def load_model_path(model: str = "smollm2-135m") -> Path:
    from kvserve.model.loader import resolve_model_path

    return resolve_model_path(model)


_HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def export_hf_folder(dest: Path, model: str = "smollm2-135m") -> Path:
    """vLLM reads HF folders: write the GGUF's dequantized float32 weights (HF names, Q/K
    un-permuted by kvserve's loader) as safetensors, a Llama or Qwen2 config.json and the
    tokenizer."""
    if (dest / "config.json").exists():
        return dest
    from safetensors.torch import save_file

    from kvserve.model.loader import load_checkpoint, load_tokenizer

    path = load_model_path(model)
    cfg, weights = load_checkpoint(path)
    if cfg.architecture not in _HF_ARCHITECTURES:
        raise SystemExit(f"export_hf_folder writes llama and qwen2 configs, not {cfg.architecture}")
    dest.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(dest / "model.safetensors"))
    config = {
        "architectures": [_HF_ARCHITECTURES[cfg.architecture]], "model_type": cfg.architecture,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings, "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_ids[0], "torch_dtype": "float32", "hidden_act": "silu",
    }
    if cfg.architecture == "qwen2":
        config["use_sliding_window"] = False
    (dest / "config.json").write_text(json.dumps(config, indent=1))
    tokenizer = load_tokenizer(path)
    assert tokenizer is not None
    tokenizer.save_pretrained(str(dest))
    return dest


def vllm_child_result(cmd: list[str], **env_vars: str) -> dict[str, Any]:
    """Run a vLLM child process on both cores; return the JSON of its "RESULT " line."""
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0-1", VLLM_CPU_NUM_OF_RESERVED_CPU="0", **env_vars)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            result: dict[str, Any] = json.loads(line[7:])
            return result
    raise RuntimeError(f"vLLM run failed:\n{proc.stderr[-3000:]}")


def vllm_prompts_result(python: str, folder: str | Path, prompts: list[list[int]], args: list[str],
                        **env_vars: str) -> dict[str, Any]:
    """vllm_runner.py over these token-id prompts (a temporary JSON file, removed after) with the
    runner's further ``args``; the JSON of its "RESULT " line."""
    with tempfile.NamedTemporaryFile("w", suffix=".json") as file:
        json.dump(prompts, file)
        file.flush()
        return vllm_child_result([python, str(Path(__file__).with_name("vllm_runner.py")), "--model", str(folder),
                                  "--prompts-json", file.name, *args], **env_vars)


def run_vllm(python: str, work: Workload, dtype: str, repeats: int, folder: Path) -> dict[str, Any]:
    return vllm_child_result([python, str(Path(__file__).with_name("vllm_runner.py")), "--model", str(folder),
                              "--workload", work.name, "--dtype", dtype, "--repeats", str(repeats)])


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    median = statistics.median(result["times"])
    return {**result, "median_s": median, "tok_per_s": result["output_tokens"] / median}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="uniform,mixed")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--engines", default="kvserve,hf", help="kvserve, kvserve-int8 (--quantization int8), hf")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hf-repeats", type=int, default=None, help="repeats for HF (default: --repeats)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu installed")
    parser.add_argument("--vllm-dtypes", default="bfloat16", help="dtypes to run vLLM in")
    parser.add_argument("--hf-folder", default="bench_out/smollm2-135m-hf")
    parser.add_argument("--out", default="docs/results/throughput.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    engines = args.engines.split(",") + (["vllm"] if args.vllm_python else [])
    for name in args.workloads.split(","):
        work = WORKLOADS[name]()
        for dtype in args.dtypes.split(","):
            for engine in engines:
                if engine == "vllm" and dtype not in args.vllm_dtypes.split(","):
                    continue
                print(f"[{name} {dtype} {engine}] ...", flush=True)
                if engine.startswith("kvserve"):  # kvserve, or kvserve-int8: --quantization int8
                    quantization = engine.removeprefix("kvserve").removeprefix("-") or None
                    r = run_kvserve(work, dtype, args.repeats, args.block_size, quantization)
                elif engine == "hf":
                    r = run_hf(work, dtype, args.hf_repeats or args.repeats)
                else:
                    r = run_vllm(args.vllm_python, work, dtype, args.repeats, export_hf_folder(Path(args.hf_folder)))
                r = summarize(r)
                results.append(r)
                print(f"   {r['tok_per_s']:.1f} tok/s (median of {len(r['times'])}: {r['median_s']:.2f}s)", flush=True)
                out.write_text(json.dumps({"threads": args.threads, "results": results}, indent=1))
    print("\nworkload  dtype     engine        tok/s   vs HF same dtype")
    for r in results:
        hf = [x for x in results if x["engine"] == "hf-generate" and x["dtype"] == r["dtype"]
              and x["workload"] == r["workload"]]
        ratio = f"{r['tok_per_s'] / hf[0]['tok_per_s']:.2f}x" if hf else "-"
        print(f"{r['workload']:9} {r['dtype']:9} {r['engine']:12} {r['tok_per_s']:7.1f}   {ratio}")


if __name__ == "__main__":
    main()
