"""A sweep over load levels, its statistics, the knee, and the files it writes: results.json
(schema_version 1), results.csv, report.md and PNG plots with the knee marked."""

from __future__ import annotations

import asyncio
import csv
import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvserve.bench.datasets import Sample
from kvserve.bench.knee import Knee, find_knee
from kvserve.bench.loadgen import RequestResult, ServerTrace, run_level

SCHEMA_VERSION = 1


@dataclass(slots=True)
class SweepSpec:
    base_url: str
    model: str
    samples: list[list[Sample]]  # one list per level: fresh prompts, so no level hits the cache of another
    mode: str  # "concurrency" or "rate"
    levels: list[float]
    api_key: str | None = None
    slo_ttft: float | None = None  # seconds
    slo_tpot: float | None = None
    timeout: float = 600.0
    max_duration: float | None = None  # per level


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

    return {"mean": statistics.fmean(ordered), "p50": at(0.5), "p90": at(0.9), "p99": at(0.99)}


def level_stats(level: float, results: list[RequestResult], wall: float, trace: ServerTrace,
                spec: SweepSpec) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    good = [r for r in ok if (spec.slo_ttft is None or r.ttft <= spec.slo_ttft)
            and (spec.slo_tpot is None or r.tpot <= spec.slo_tpot)]
    return {
        "level": level, "requests": len(results), "errors": len(results) - len(ok),
        "error_samples": sorted({r.error for r in results if not r.ok})[:3], "duration_s": wall,
        "request_throughput": len(ok) / wall, "output_throughput": sum(r.output_tokens for r in ok) / wall,
        "goodput": len(good) / wall,
        "prompt_tokens": sum(r.prompt_tokens for r in ok), "output_tokens": sum(r.output_tokens for r in ok),
        "ttft_s": percentiles([r.ttft for r in ok]), "tpot_s": percentiles([r.tpot for r in ok if r.output_tokens > 1]),
        "itl_s": percentiles([gap for r in ok for gap in r.itl]), "e2e_s": percentiles([r.e2e for r in ok]),
        "peak_kv_usage": trace.peak_kv_usage, "peak_rss_bytes": trace.peak_rss_bytes,
        "preemptions": trace.preemptions, "prefix_hit_rate": trace.prefix_hit_rate, "tier_hits": trace.tier_hits,
        "spec_acceptance": trace.spec_acceptance, "spec_accepted_length": trace.spec_accepted_length,
        "kv_snapshot_at_peak": trace.kv_snapshot_at_peak,
        "requests_detail": [{"ok": r.ok, "ttft": r.ttft, "e2e": r.e2e, "prompt_tokens": r.prompt_tokens,
                             "output_tokens": r.output_tokens} for r in results],
    }


def run_sweep(spec: SweepSpec, show_progress: bool = True) -> dict[str, Any]:
    from tqdm import tqdm

    levels = []
    for level, samples in zip(spec.levels, spec.samples, strict=True):
        label = f"{spec.mode} {level:g}"
        with tqdm(total=len(samples), desc=label, disable=not show_progress) as bar:
            results, wall, trace = asyncio.run(run_level(
                spec.base_url, spec.model, samples, concurrency=int(level) if spec.mode == "concurrency" else None,
                rate=level if spec.mode == "rate" else None, api_key=spec.api_key, timeout=spec.timeout, progress=bar,
                max_duration=spec.max_duration))
        levels.append(level_stats(level, results, wall, trace, spec))
    return analyze({"schema_version": SCHEMA_VERSION, "base_url": spec.base_url, "model": spec.model,
                    "mode": spec.mode, "num_prompts": len(spec.samples[0]), "slo_ttft_s": spec.slo_ttft,
                    "slo_tpot_s": spec.slo_tpot, "levels": levels})


def analyze(result: dict[str, Any]) -> dict[str, Any]:
    """(Re)derive the knee and the diagnosis from the measured levels, in place."""
    levels = result["levels"]
    knee = knee_of(levels)
    result["knee"] = {"level": None if knee.level_index is None else levels[knee.level_index]["level"],
                      "limiting_factor": knee.limiting_factor, "reason": knee.reason}
    result["diagnosis"] = diagnose(levels, knee)
    return result


def knee_of(levels: list[dict[str, Any]]) -> Knee:
    return find_knee([lv["level"] for lv in levels], [lv["output_throughput"] for lv in levels],
                     [lv["ttft_s"]["p99"] for lv in levels], [lv["tpot_s"]["p99"] for lv in levels],
                     [lv["peak_kv_usage"] for lv in levels], [lv["preemptions"] for lv in levels])


def diagnose(levels: list[dict[str, Any]], knee: Knee) -> str:
    """Volume or fragmentation (seed §2, §4.3), from kvserve's /v1/kv snapshot at peak usage in
    the level that exposed the knee (or the busiest level): is the pool full of live tokens, or of
    the unused ends of blocks? (Idle cached prefix blocks are evictable, so they count as free.)"""
    if not levels:
        return "no levels were run"
    index = len(levels) - 1 if knee.level_index is None else min(knee.level_index + 1, len(levels) - 1)
    snap = levels[index]["kv_snapshot_at_peak"]
    if not snap:
        return "no /v1/kv snapshot (not a kvserve server): volume vs fragmentation cannot be told apart"
    allocated, waste = snap["allocated_slots"], snap["tail_waste_slots"]
    share = (f"at {levels[index]['level']:g}: {100 * snap['usage']:.0f}% of {snap['num_blocks']} blocks held, "
             f"{snap['live_tokens']} live tokens in {allocated} allocated slots, tail waste {waste} slots "
             f"({100 * waste / max(1, allocated):.1f}%), {snap['blocks_cached']} blocks with cached prefixes"
             + (f", prefix sharing x{snap['sharing_factor']:.2f} ({snap['logical_tokens']} logical tokens)"
                if snap.get("sharing_factor", 1.0) > 1.0 else ""))
    if snap["usage"] < 0.9:
        return f"the KV pool was not the limit ({share})"
    if waste > 0.1 * allocated:
        return f"allocation problem: smaller blocks would hold more sequences ({share})"
    return ("volume problem: the pool is full of live tokens; quantize KV, shorten contexts or run fewer "
            f"sequences ({share})")


def write_outputs(result: dict[str, Any], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1))
    columns = ["level", "requests", "errors", "request_throughput", "output_throughput", "goodput",
               "ttft_mean", "ttft_p50", "ttft_p99", "tpot_mean", "tpot_p99", "itl_p99", "e2e_p50", "e2e_p99",
               "peak_kv_usage", "peak_rss_bytes", "preemptions", "prefix_hit_rate"]
    with (out / "results.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(columns)
        for lv in result["levels"]:
            writer.writerow([lv["level"], lv["requests"], lv["errors"], lv["request_throughput"],
                             lv["output_throughput"], lv["goodput"], lv["ttft_s"]["mean"], lv["ttft_s"]["p50"],
                             lv["ttft_s"]["p99"], lv["tpot_s"]["mean"], lv["tpot_s"]["p99"], lv["itl_s"]["p99"],
                             lv["e2e_s"]["p50"], lv["e2e_s"]["p99"], lv["peak_kv_usage"], lv["peak_rss_bytes"],
                             lv["preemptions"], lv["prefix_hit_rate"]])
    plots = plot_runs([result], [out.name], out)
    (out / "report.md").write_text(report_markdown([result], [out.name], plots))
    return [out / "results.json", out / "results.csv", out / "report.md", *plots]


def plot_runs(runs: list[dict[str, Any]], names: list[str], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def quantile(key: str, q: str) -> Callable[[dict[str, Any]], float]:
        return lambda lv: float(lv[key][q])

    Series = list[tuple[str, Callable[[dict[str, Any]], float]]]
    figures: dict[str, Series] = {
        "throughput.png": [("output tok/s", lambda lv: lv["output_throughput"])],
        "latency.png": [(f"{name} {q} (s)", quantile(key, q))
                        for name, key in (("TTFT", "ttft_s"), ("TPOT", "tpot_s")) for q in ("p50", "p99")],
        "memory.png": [("peak KV usage", lambda lv: lv["peak_kv_usage"]),
                       ("peak RSS (GiB)", lambda lv: lv["peak_rss_bytes"] / 2**30)],
    }
    paths = []
    for filename, series in figures.items():
        fig, axes = plt.subplots(1, len(series), figsize=(4.2 * len(series), 3.4), squeeze=False)
        for ax, (label, value) in zip(axes[0], series, strict=True):
            for run, name in zip(runs, names, strict=True):
                xs = [lv["level"] for lv in run["levels"]]
                ax.plot(xs, [value(lv) for lv in run["levels"]], marker="o", label=name)
                if run["knee"]["level"] is not None:
                    knee_lv = next(lv for lv in run["levels"] if lv["level"] == run["knee"]["level"])
                    ax.plot([knee_lv["level"]], [value(knee_lv)], marker="*", markersize=14, color="red")
            ax.set_xscale("log", base=2)
            ax.set_xlabel(runs[0]["mode"])
            ax.set_title(label)
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=8)
        fig.tight_layout()
        path = out / filename
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)
    return paths


def report_markdown(runs: list[dict[str, Any]], names: list[str], plots: list[Path]) -> str:
    lines = ["# Load test report", ""]
    for run, name in zip(runs, names, strict=True):
        knee = run["knee"]
        lines += [f"## {name}: {run['model']} at {run['base_url']}, {run['num_prompts']} requests per level", ""]
        where = (f"The knee is at {run['mode']} {knee['level']:g} (limited by {knee['limiting_factor']}): "
                 if knee["level"] is not None else "No knee in this sweep: ")
        lines += [where + knee["reason"] + ". " + run["diagnosis"].capitalize() + ".", ""]
        tiers = any(lv.get("tier_hits") is not None for lv in run["levels"])  # a kvserve server with KV tiers
        spec = any(lv.get("spec_acceptance") is not None for lv in run["levels"])  # speculative decoding on
        lines += [f"| {run['mode']} | req/s | output tok/s | goodput | TTFT p50 / p99 (s) | TPOT p50 / p99 (ms) | "
                  "E2E p99 (s) | peak KV | preemptions | " + ("KV tier hits (blocks) | " if tiers else "")
                  + ("draft acceptance | accepted length | " if spec else "") + "errors |",
                  "|---|---|---|---|---|---|---|---|---|" + ("---|" if tiers else "") + ("---|---|" if spec else "")
                  + "---|"]
        for lv in run["levels"]:
            tier_cell = f"{lv['tier_hits'] or 0:g} | " if tiers else ""
            if spec:
                rate, length = lv.get("spec_acceptance"), lv.get("spec_accepted_length")
                tier_cell += ("- | - | " if rate is None else
                              f"{100 * rate:.0f}% | " + ("- | " if length is None else f"{length:.2f} | "))
            lines.append(
                f"| {lv['level']:g} | {lv['request_throughput']:.2f} | {lv['output_throughput']:.1f} | "
                f"{lv['goodput']:.2f} | {lv['ttft_s']['p50']:.2f} / {lv['ttft_s']['p99']:.2f} | "
                f"{1000 * lv['tpot_s']['p50']:.0f} / {1000 * lv['tpot_s']['p99']:.0f} | {lv['e2e_s']['p99']:.2f} | "
                f"{100 * lv['peak_kv_usage']:.0f}% | {lv['preemptions']:g} | {tier_cell}{lv['errors']} |")
        lines.append("")
    lines += [f"![{p.stem}]({p.name})" for p in plots]
    return "\n".join(lines) + "\n"


def compare(run_dirs: list[Path], out: Path) -> list[Path]:
    """``bench report A B``: overlay the runs' plots and put their tables side by side."""
    runs, names = [], []
    for directory in run_dirs:
        path = directory / "results.json"
        if not path.is_file():
            raise FileNotFoundError(f"no results.json in {str(directory)!r}")
        runs.append(analyze(json.loads(path.read_text())))
        names.append(directory.name)
    out.mkdir(parents=True, exist_ok=True)
    plots = plot_runs(runs, names, out)
    (out / "report.md").write_text(report_markdown(runs, names, plots))
    return [out / "report.md", *plots]
