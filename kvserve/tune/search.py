"""The budgeted search: candidate configurations, each measured by a short concurrency sweep
against a real ``kvserve serve``, pruned by successive halving.

Rung r measures the surviving candidates with ``prompts_per_level * 2**r`` requests per level
(at least ``min_waves`` times the level);
the better half (by goodput under the SLO, then the knee furthest right) goes on to the next
rung. Each measurement is appended to ``candidates.jsonl`` as it finishes, so an interrupted
run resumes where it stopped.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvserve.bench.datasets import Sample
from kvserve.bench.sweep import SweepSpec, run_sweep
from kvserve.config import ConfigError


@dataclass(frozen=True, slots=True)
class Candidate:
    block_size: int
    kv_cache_dtype: str
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_prefix_caching: bool

    @property
    def name(self) -> str:
        return (f"bs{self.block_size}-{self.kv_cache_dtype}-seqs{self.max_num_seqs}-"
                f"mbt{self.max_num_batched_tokens}{'-pc' if self.enable_prefix_caching else ''}")

    def flags(self) -> dict[str, Any]:
        """The candidate's settings as config-file keys (flag names)."""
        return {"block-size": self.block_size, "kv-cache-dtype": self.kv_cache_dtype,
                "max-num-seqs": self.max_num_seqs, "max-num-batched-tokens": self.max_num_batched_tokens,
                "enable-prefix-caching": self.enable_prefix_caching}


@dataclass(slots=True)
class SearchSpec:
    base_flags: dict[str, Any]  # every candidate's other settings (model, KV budget, ...)
    samples: list[Sample]  # the workload's requests, drawn in turn
    levels: list[int]  # concurrency levels a sweep may run (each up to 2x the candidate's max_num_seqs)
    slo_ttft: float | None
    slo_tpot: float | None
    out: Path
    time_budget: float  # seconds
    prompts_per_level: int = 8  # at rung 0; doubled at each rung
    extra_flags: Callable[[Candidate], dict[str, Any]] | None = None  # e.g. a scales file for fp8
    progress: bool = True
    # every level sends at least min_waves x its concurrency: one burst of `level` requests measures how fast
    # a burst drains, not the steady state (the recorded classify session: two identical configs 1.6x apart at 8 of 8)
    min_waves: int = 2


def knee_level(result: dict[str, Any]) -> float:
    """The knee's concurrency; a sweep that found none kept scaling to its highest level."""
    if result.get("knee") is not None:
        return float(result["knee"])
    return max((float(level["level"]) for level in result.get("levels", [])), default=0.0)


def score(result: dict[str, Any]) -> tuple[float, float]:
    """What the search maximizes: goodput under the SLO, then the knee's concurrency."""
    if result.get("error"):
        return (-1.0, -1.0)
    return (float(result["goodput"]), knee_level(result))


def successive_halving(spec: SearchSpec, candidates: list[Candidate]) -> list[dict[str, Any]]:
    """Measure ``candidates`` rung by rung within the time budget; every measurement, the
    earlier run's included (resumed from candidates.jsonl). The best is the top score among the
    results of the highest rung reached."""
    from tqdm import tqdm

    spec.out.mkdir(parents=True, exist_ok=True)
    log = spec.out / "candidates.jsonl"
    done = [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.exists() else []
    known = {(r["name"], r["rung"]): r for r in done}
    start, alive, rung, measured = time.monotonic(), list(candidates), 0, 0
    total = sum(max(1, len(candidates) >> r) for r in range(max(1, len(candidates)).bit_length()))
    with tqdm(total=total, desc="tune", unit="candidate", disable=not spec.progress) as bar:
        while alive:
            results = []
            for candidate in alive:
                result = known.get((candidate.name, rung))
                if result is None:
                    if measured and time.monotonic() - start > spec.time_budget:  # each run measures one at least
                        bar.write(f"time budget spent: stopping at rung {rung}")
                        return done
                    bar.set_postfix_str(f"rung {rung}: {candidate.name}")
                    result = measure(spec, candidate, rung)
                    with log.open("a") as handle:
                        handle.write(json.dumps(result) + "\n")
                    done.append(result)
                    measured += 1
                results.append(result)
                bar.update()
            if len(alive) == 1:
                break
            ranked = sorted(zip(alive, results, strict=True), key=lambda pair: score(pair[1]), reverse=True)
            alive = [c for c, r in ranked[: max(1, len(ranked) // 2)] if not r.get("error")]
            rung += 1
    return done


# goodputs this close count as equal when the winner is picked: the recorded session measured
# one candidate at 11.2-12.9 req/s across rungs, and picked max-num-seqs 16 over 64 on a 10%
# difference that the full comparison reversed (docs/tuning.md)
GOODPUT_TIE = 0.10


def best_result(results: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The winner among the highest rung's results: of those within GOODPUT_TIE of the best
    goodput, the knee furthest right, then the most max-num-seqs (headroom), then goodput."""
    ok = [r for r in results if not r.get("error")]
    if not ok:
        return None
    top = max(r["rung"] for r in ok)
    last = [r for r in ok if r["rung"] == top]
    best = max(r["goodput"] for r in last)
    close = [r for r in last if r["goodput"] >= (1 - GOODPUT_TIE) * best]
    return max(close, key=lambda r: (knee_level(r), r["flags"].get("max-num-seqs", 0), r["goodput"]))


def measure(spec: SearchSpec, candidate: Candidate, rung: int) -> dict[str, Any]:
    """Start a server with the candidate, sweep its concurrency levels, stop it."""
    flags = {**spec.base_flags, **candidate.flags(), **(spec.extra_flags(candidate) if spec.extra_flags else {})}
    config = spec.out / "candidates" / f"{candidate.name}.yaml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text("".join(f"{key}: {json.dumps(value)}\n" for key, value in flags.items()))
    levels = [level for level in spec.levels if level <= 2 * candidate.max_num_seqs] or [1]
    result: dict[str, Any] = {"name": candidate.name, "rung": rung, "flags": flags, "error": None}
    started = time.monotonic()
    try:
        with serving(config, spec.out / "candidates" / f"{candidate.name}.log") as base_url:
            # every candidate of a rung gets the same requests; each level the next ones (no level
            # finds an earlier level's prompts in the prefix cache while the workload lasts)
            counts = [level_requests(spec, level, rung) for level in levels]
            starts = itertools.accumulate([rung * 7919, *counts[:-1]])
            batches = [draw(spec.samples, count, start) for count, start in zip(counts, starts, strict=True)]
            sweep = run_sweep(SweepSpec(base_url, str(flags.get("model", "smollm2-135m")), batches, "concurrency",
                                        [float(level) for level in levels], None, spec.slo_ttft, spec.slo_tpot),
                              show_progress=False)
    except ConfigError as exc:
        result["error"] = str(exc)
        return result
    levels_out = [{key: level[key] for key in ("level", "requests", "errors", "goodput", "request_throughput",
                                                "output_throughput", "peak_kv_usage", "preemptions",
                                                "prefix_hit_rate")}
                  | {"ttft_p99": level["ttft_s"]["p99"], "tpot_p99": level["tpot_s"]["p99"]}
                  for level in sweep["levels"]]
    result.update(levels=levels_out, goodput=max(level["goodput"] for level in levels_out),
                  knee=sweep["knee"]["level"], knee_reason=sweep["knee"]["reason"], seconds=time.monotonic() - started)
    return result


def level_requests(spec: SearchSpec, level: int, rung: int) -> int:
    """Requests a sweep sends at ``level`` in ``rung``: the rung's share, and at least min_waves waves."""
    return max(spec.prompts_per_level << rung, spec.min_waves * level)


def draw(samples: list[Sample], count: int, offset: int) -> list[Sample]:
    """``count`` requests of the workload in order, from ``offset`` on (wrapping around)."""
    return [samples[(offset + i) % len(samples)] for i in range(count)]


def stop_process(process: subprocess.Popen[Any], timeout: float = 30.0) -> None:
    """Terminate ``process``; kill it if it has not exited within ``timeout`` seconds."""
    process.terminate()
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def serving(config: Path, log: Path, timeout: float = 600.0) -> Iterator[str]:
    """``kvserve serve --config config`` on a free loopback port until the block ends; its base
    URL once /health answers. A server that exits first is a ConfigError quoting its log."""
    port = free_port()
    with log.open("w") as out:
        process = subprocess.Popen([sys.executable, "-m", "kvserve.cli", "serve", "--config", str(config),
                                    "--host", "127.0.0.1", "--port", str(port)], stdout=out, stderr=subprocess.STDOUT)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if process.poll() is not None:
                tail = log.read_text().strip().splitlines()[-3:]
                raise ConfigError(f"the server for {config.name} exited ({process.returncode}): {' | '.join(tail)}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base_url}/health", timeout=2.0).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise ConfigError(f"the server for {config.name} did not answer /health in {timeout:.0f} s")
            time.sleep(0.5)
        yield base_url
    finally:
        stop_process(process)
