"""The knee of a sweep: the last level whose increase still paid for itself."""

from __future__ import annotations

from typing import NamedTuple


class Knee(NamedTuple):
    level_index: int | None  # the knee level (the last one worth going to); None: no knee in the sweep
    limiting_factor: str  # "kv memory", "compute", "queueing" or "none"
    reason: str


def find_knee(levels: list[float], throughput: list[float], ttft_p99: list[float], tpot_p99: list[float],
              kv_usage: list[float], preemptions: list[float], min_gain: float = 0.1,
              latency_growth: float = 1.1) -> Knee:
    """Walk the sweep. At step i the elasticity of throughput to load is
    (T_i / T_(i-1) - 1) / (x_i / x_(i-1) - 1) (1.0: throughput grows as fast as load). The knee
    is level i-1 at the first step where the elasticity is below ``min_gain`` while a p99 latency
    (TTFT or TPOT) grows more than ``latency_growth`` times, or where the KV pool saturates (usage
    >= 95% or preemptions start). Limiting factor: KV memory if the pool saturated; queueing if
    only TTFT grew (requests wait, each one runs as fast as before); compute if TPOT grew (bigger
    batches, slower steps)."""
    if not len(levels) == len(throughput) == len(ttft_p99) == len(tpot_p99) == len(kv_usage) == len(preemptions):
        raise ValueError("every series needs one value per level")
    for i in range(1, len(levels)):
        load_step = levels[i] / levels[i - 1] - 1
        change = throughput[i] / throughput[i - 1] - 1 if throughput[i - 1] > 0 else 0.0
        gain = change / load_step if load_step > 0 else 0.0
        ttft_up = ttft_p99[i] > latency_growth * ttft_p99[i - 1]
        tpot_up = tpot_p99[i] > latency_growth * tpot_p99[i - 1]
        saturated = kv_usage[i] >= 0.95 or preemptions[i] > 0
        if not (saturated or (gain < min_gain and (ttft_up or tpot_up))):
            continue
        factor = "kv memory" if saturated else ("compute" if tpot_up else "queueing")
        why = (f"from {levels[i - 1]:g} to {levels[i]:g}, throughput changed {100 * change:+.0f}% (elasticity "
               f"{gain:.2f}); p99 TTFT {ttft_p99[i - 1]:.2f} -> {ttft_p99[i]:.2f} s, p99 TPOT "
               f"{1000 * tpot_p99[i - 1]:.0f} -> {1000 * tpot_p99[i]:.0f} ms; peak KV usage {100 * kv_usage[i]:.0f}%, "
               f"{preemptions[i]:g} preemptions")
        return Knee(i - 1, factor, why)
    return Knee(None, "none", "throughput kept paying for the added load up to the highest level")
