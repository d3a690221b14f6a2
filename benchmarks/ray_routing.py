"""Routing kvserve replicas on Ray Serve: round-robin, power-of-two and kv-aware, in one run.

    python benchmarks/ray_routing.py --out docs/results/ray_routing.json

Two replicas (one CPU each) of the default model behind ``kvserve serve --ray``'s ingress; for
each router and workload, one ``kvserve bench serve`` run at one concurrency level. The
cluster-wide prefix hit rate is the change in the replicas' summed ``kvserve:prefix_cache_hits``
over ``prefix_cache_queries`` (the ingress's aggregated /metrics) across the run. The reference
is one replica that holds everything: the same ingress, one replica with both replicas' KV
budget and both CPUs.

Workloads (token-id prompts from ``kvserve bench``'s generators):
- ``shared-prompts``: 8 system prompts of 512 tokens, each request one of them + 64 own tokens;
- ``multi-turn``: conversations of 4 turns resending their history (a 128-token system prompt);
- ``random``: unrelated prompts of 256-768 tokens (nothing to share: kv-aware must not lose).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, os.path.dirname(__file__))
from workloads import cpu_name

WORKLOADS: dict[str, list[str]] = {
    "shared-prompts": ["--dataset", "prefix", "--num-prefixes", "8", "--prefix-len", "512", "--input-len", "64",
                       "--output-len", "32"],
    "multi-turn": ["--dataset", "multiturn", "--prefix-len", "128", "--input-len", "64", "--output-len", "32"],
    "random": ["--dataset", "random", "--input-len", "256:768", "--output-len", "32"],
}
ROUTERS = ("round-robin", "power-of-two", "kv-aware")


def prefix_counters(base: str) -> tuple[float, float]:
    """(hits, queries) in prompt tokens, summed over the replicas."""
    text = httpx.get(base + "/metrics", timeout=30).text
    totals = {"kvserve:prefix_cache_hits": 0.0, "kvserve:prefix_cache_queries": 0.0}
    for family in text_string_to_metric_families(text):
        if family.name in totals:
            totals[family.name] += sum(s.value for s in family.samples if not s.name.endswith("_created"))
    return totals["kvserve:prefix_cache_hits"], totals["kvserve:prefix_cache_queries"]


def bench(base: str, workload: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One bench run; its level's figures and the cluster's prefix hit rate over it."""
    time.sleep(2.5)  # replicas push their metrics each second: let the last run's settle
    hits0, queries0 = prefix_counters(base)
    subprocess.run([sys.executable, "-m", "kvserve.cli", "bench", "serve", "--base-url", base, *WORKLOADS[workload],
                    "--num-prompts", str(args.num_prompts), "--concurrency", str(args.concurrency), "--quiet",
                    "--out", str(out)], check=True)
    time.sleep(2.5)
    hits1, queries1 = prefix_counters(base)
    level = json.loads((out / "results.json").read_text())["levels"][0]
    return {"prefix_hit_rate": (hits1 - hits0) / max(1.0, queries1 - queries0),
            "ttft_p50": level["ttft_s"]["p50"], "ttft_p99": level["ttft_s"]["p99"],
            "request_throughput": level["request_throughput"], "output_throughput": level["output_throughput"],
            "errors": level["errors"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kv-cache-memory", default="256MiB", help="per replica")
    parser.add_argument("--num-prompts", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--out", type=Path, default=Path("docs/results/ray_routing.json"))
    args = parser.parse_args()
    import ray
    from ray import serve

    from kvserve.cluster.config import ClusterConfig
    from kvserve.cluster.deploy import deploy
    from kvserve.config import EngineConfig, parse_size
    from kvserve.server.app import ServerConfig

    ray.init(num_cpus=2, include_dashboard=False)
    port = 8300
    base = f"http://127.0.0.1:{port}"
    runs_dir = Path("bench_out/ray_routing")
    per_replica = parse_size(args.kv_cache_memory, "--kv-cache-memory")
    setups: dict[str, tuple[ClusterConfig, int]] = {
        router: (ClusterConfig(num_replicas=2, router=router), per_replica) for router in ROUTERS}
    setups["one replica, all KV"] = (ClusterConfig(num_replicas=1, router="round-robin", cpus_per_replica=2),
                                     2 * per_replica)
    results: dict[str, Any] = {"cpu": cpu_name(), "kv_cache_memory_per_replica": args.kv_cache_memory,
                               "num_prompts": args.num_prompts, "concurrency": args.concurrency, "runs": {}}
    for name, (cluster, kv_bytes) in setups.items():
        engine = EngineConfig(model="smollm2-135m", dtype="bfloat16", kv_cache_memory=kv_bytes)
        deploy(engine, ServerConfig(model_name="smollm2-135m"), cluster, "127.0.0.1", port)
        for workload in args.workloads.split(","):
            result = bench(base, workload, args, runs_dir / name.replace(" ", "_").replace(",", "") / workload)
            results["runs"].setdefault(workload, {})[name] = result
            print(f"{workload:15s} {name:20s} hit rate {result['prefix_hit_rate']:.3f}  "
                  f"TTFT p50 {result['ttft_p50']:.3f} p99 {result['ttft_p99']:.3f} s  "
                  f"{result['request_throughput']:.2f} req/s", flush=True)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=1))
        serve.delete("kvserve")
    serve.shutdown()


if __name__ == "__main__":
    main()
