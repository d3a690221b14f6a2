"""Loading a GGUF model: time, resident memory after the load and its peak during it, with the
weights kept in their blocks (kvserve's default for a GGUF) and widened to float32
(`--quantization none`), each in a fresh process with the C++ ops already built.

    python benchmarks/gguf_load.py --model qwen2.5-coder-0.5b --model qwen2.5-coder-1.5b \\
        --out docs/results/gguf_load.json

A child process imports kvserve, loads the model (weights, tokenizer) and answers one 8-token
greedy request; the parent samples the child's resident set every 50 ms (its peak) and reads the
child's own figures: seconds from start to loaded, RSS once loaded. A first run per setting is not
counted (it converts and caches the tokenizer).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
from workloads import cpu_name

CHILD = """
import json, sys, time
start = time.monotonic()
import torch
from kvserve import LLM, SamplingParams
from kvserve.engine.loading import load_model
quantization = None if sys.argv[2] == "default" else sys.argv[2]
loaded = load_model(sys.argv[1], torch.device("cpu"), torch.float32, quantization)
loaded_s = time.monotonic() - start
rss = int(open("/proc/self/statm").read().split()[1]) * 4096
llm = LLM(loaded=loaded, quantization=quantization, kv_cache_memory="64MiB", max_num_seqs=1)
text = llm.generate(["def fibonacci(n):"], SamplingParams(temperature=0, max_tokens=8))[0].text
print("RESULT " + json.dumps({"loaded_s": loaded_s, "rss_loaded": rss, "weight_bytes": loaded.weight_bytes,
                              "weight_format": loaded.weight_format, "first_answer_s": time.monotonic() - start,
                              "text": text}))
"""


def peak_rss(proc: subprocess.Popen[str], peak: list[int]) -> None:
    while proc.poll() is None:
        try:
            pages = int(Path(f"/proc/{proc.pid}/statm").read_text().split()[1])
        except (OSError, ValueError, IndexError):
            break
        peak[0] = max(peak[0], pages * 4096)
        time.sleep(0.05)


def measure(model: str, quantization: str) -> dict[str, Any]:
    proc = subprocess.Popen([sys.executable, "-c", CHILD, model, quantization], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    peak = [0]
    sampler = threading.Thread(target=peak_rss, args=(proc, peak), daemon=True)
    sampler.start()
    out, _ = proc.communicate()
    sampler.join()
    line = next(line for line in out.splitlines() if line.startswith("RESULT "))
    return {"model": model, "quantization": quantization, "peak_rss": peak[0], **json.loads(line[7:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", help="alias or .gguf file (repeat)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per setting after a first one; the fastest "
                        "is kept")
    parser.add_argument("--out", default="docs/results/gguf_load.json")
    args = parser.parse_args()
    from kvserve.model.cpu_kernels import cpu_kernels
    from kvserve.model.loader import resolve_model_path

    cpu_kernels()  # built (and cached) before anything is timed
    rows = []
    for model in args.model or ["qwen2.5-coder-0.5b"]:
        file_bytes = resolve_model_path(model).stat().st_size  # joined (once) before anything is timed
        for quantization in ("default", "none"):
            measure(model, quantization)  # not counted: converts and caches the tokenizer, warms the page cache
            runs = [measure(model, quantization) for _ in range(args.repeats)]
            best = min(runs, key=lambda r: r["loaded_s"])
            best["file_bytes"] = file_bytes
            rows.append(best)
            print(f"{model:22s} {quantization:8s} {best['weight_format']:28s} loaded {best['loaded_s']:5.1f} s  "
                  f"RSS {best['rss_loaded'] / 2**20:6.0f} MiB  peak {best['peak_rss'] / 2**20:6.0f} MiB  "
                  f"file {file_bytes / 2**20:5.0f} MiB", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"cpu": cpu_name(), "cores": os.cpu_count(),
                                          "date": time.strftime("%Y-%m-%d"), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
