"""What a tuning run writes: kvserve.yaml (the winner, every value with why, and the workload it
assumed, which the re-plan alarm compares against), report.md and a goodput plot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvserve.tune.search import score
from kvserve.tune.workload import WorkloadStats


def tuned_workload(stats: WorkloadStats, best: dict[str, Any], capacity_tokens: int) -> dict[str, Any]:
    """The ``tuned-workload`` record (drift.TunedWorkload's fields)."""
    return {"mean_prompt_tokens": round(stats.mean_prompt_tokens, 1), "p90_prompt_tokens": stats.p90_prompt_tokens,
            "mean_output_tokens": round(stats.mean_output_tokens, 1), "p90_output_tokens": stats.p90_output_tokens,
            "prefix_share": round(stats.prefix_share, 4), "knee_concurrency": knee_or_highest(best),
            "kv_capacity_tokens": capacity_tokens, "rate": stats.rate}


def knee_or_highest(result: dict[str, Any]) -> float:
    """The knee's concurrency, or the highest level tried when throughput still grew there."""
    return float(result["knee"] if result["knee"] is not None else result["levels"][-1]["level"])


def write_config(path: Path, best: dict[str, Any], stats: WorkloadStats, why: dict[str, str],
                 record: dict[str, Any], header: list[str]) -> None:
    """kvserve.yaml: ``best``'s flags, each with the reason ``why`` gives, then the workload
    record. Values are written as JSON, which YAML reads as they are."""
    lines = [f"# {line}" for line in header]
    lines += [f"# workload assumed: {stats.summary()}, rate "
              + (f"{stats.rate:g}/s" if stats.rate else "not timed (closed loop)"),
              f"# measured: goodput {best['goodput']:.3f} req/s under the SLO, knee at concurrency "
              f"{best['knee'] if best['knee'] is not None else 'beyond the levels tried'} ({best['knee_reason']})", ""]
    for key, value in best["flags"].items():
        if key in why:
            lines.append(f"# {why[key]}")
        lines.append(f"{key}: {json.dumps(value)}")
    lines += ["# what the re-plan alarm compares the live workload with (kvserve tune --check, "
              "kvserve:config_drift)", f"tuned-workload: {json.dumps(record)}", ""]
    path.write_text("\n".join(lines))


def write_report(out: Path, results: list[dict[str, Any]], best: dict[str, Any], preamble: list[str]) -> list[Path]:
    """report.md (every measurement, best first within each rung) and goodput.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if not r.get("error")]
    fig, ax = plt.subplots(figsize=(8, 5))
    top = max((r["rung"] for r in ok), default=0)
    for r in sorted((r for r in ok if r["rung"] == top), key=score, reverse=True):
        levels = r["levels"]
        ax.plot([lv["level"] for lv in levels], [lv["goodput"] for lv in levels], marker="o",
                linewidth=2.5 if r is best else 1.2, label=r["name"] + (" (chosen)" if r is best else ""))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency")
    ax.set_ylabel("goodput (requests/s within the SLO)")
    ax.set_title(f"goodput per candidate, rung {top}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    plot = out / "goodput.png"
    fig.savefig(plot, dpi=120, bbox_inches="tight")
    plt.close(fig)
    lines = ["# kvserve tune report", "", *preamble, "", f"Chosen: **{best['name']}**", "",
             "| rung | candidate | goodput (req/s) | knee | best output tok/s | peak KV usage | preemptions | "
             "TTFT p99 at knee (s) | seconds |", "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(results, key=lambda r: (-r["rung"], [-x for x in score(r)])):
        if r.get("error"):
            lines.append(f"| {r['rung']} | {r['name']} | failed: {r['error']} | | | | | | |")
            continue
        at_knee = next((lv for lv in r["levels"] if lv["level"] == r["knee"]), r["levels"][-1])
        lines.append(f"| {r['rung']} | {r['name']} | {r['goodput']:.3f} | {r['knee'] or '-'} | "
                     f"{max(lv['output_throughput'] for lv in r['levels']):.1f} | "
                     f"{100 * max(lv['peak_kv_usage'] for lv in r['levels']):.0f}% | "
                     f"{sum(lv['preemptions'] for lv in r['levels']):.0f} | {at_knee['ttft_p99']:.2f} | "
                     f"{r['seconds']:.0f} |")
    lines += ["", f"![goodput per candidate]({plot.name})", ""]
    report = out / "report.md"
    report.write_text("\n".join(lines))
    return [report, plot]
