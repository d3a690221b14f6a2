"""``kvserve tune``: plan, measure quality on the workload's own text, search the configurations
that remain with a real server, write kvserve.yaml + report.md; ``--check`` is the re-plan alarm."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

from kvserve.config import ConfigError
from kvserve.tune.search import Candidate, SearchSpec
from kvserve.tune.workload import WorkloadStats

DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
UNIT_SECONDS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}
PREFIX_CACHING_SHARE = 0.05  # prefix caching on from this share of prompt tokens a cache would serve


def add_tune_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="alias, .gguf file or HF folder")
    parser.add_argument("--workload", default="random",
                        help="requests: a .jsonl file (prompt/text/messages, optional max_tokens) or bench's "
                             "random, prefix, multiturn (with --input-len/--output-len/--prefix-len)")
    parser.add_argument("--slo", default=None, help="e.g. ttft_p99=2s,tpot_p99=150ms (goodput counts requests "
                                                     "within both)")
    parser.add_argument("--max-quality-loss", default="1%",
                        help="most perplexity increase a KV dtype may cost on the workload's text (default: "
                             "%(default)s)")
    parser.add_argument("--memory", default="1GiB", help="the KV cache budget to tune for (--kv-cache-memory)")
    parser.add_argument("--out", default="tuned", help="folder for kvserve.yaml, report.md, candidates.jsonl")
    parser.add_argument("--time-budget", default="30m", help="wall time for the search, e.g. 30m, 2h, 600s")
    parser.add_argument("--block-sizes", default="16,32,64", help="block sizes to try")
    parser.add_argument("--kv-cache-dtypes", default="auto,int8,fp8_e4m3,int4",
                        help="KV dtypes to try (those within --max-quality-loss)")
    parser.add_argument("--max-num-seqs", default="8,16,32,64", help="max_num_seqs values to try")
    parser.add_argument("--max-num-batched-tokens", default="512,2048", help="max_num_batched_tokens values to try")
    parser.add_argument("--concurrency", default="1,2,4,8,16,32,64", help="sweep levels (each up to 2x max_num_seqs)")
    parser.add_argument("--prompts-per-level", type=int, default=8, help="requests per level at the first rung")
    parser.add_argument("--min-waves", type=int, default=2,
                        help="each level sends at least this many times its concurrency in requests: a steady state, "
                             "not one burst (default: %(default)s)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--num-prompts", type=int, default=200, help="synthetic workloads: requests drawn")
    parser.add_argument("--input-len", default="256:1024", help="synthetic workloads: prompt tokens")
    parser.add_argument("--output-len", default="64:256", help="synthetic workloads: output tokens (and the "
                                                               "default for jsonl rows without max_tokens)")
    parser.add_argument("--prefix-len", type=int, default=1000)
    parser.add_argument("--num-prefixes", type=int, default=4)
    parser.add_argument("--eval-tokens", type=int, default=4096, help="workload tokens the quality check scores")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.add_argument("--check", default=None, metavar="KVSERVE.YAML",
                        help="the re-plan alarm: compare a server's live metrics with this tuned config")
    parser.add_argument("--metrics-url", default="http://127.0.0.1:8000/metrics", help="with --check")


def seconds(text: str, name: str) -> float:
    match = DURATION.match(text)
    if match is None:
        raise ConfigError(f"{name}: expected a duration like 2s, 150ms, 30m or 2h, got {text!r}")
    return float(match.group(1)) * UNIT_SECONDS[match.group(2)]


def parse_slo(text: str | None) -> tuple[float | None, float | None]:
    """``ttft_p99=2s,tpot_p99=150ms`` -> (TTFT, TPOT) limits in seconds."""
    limits: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        key, _, value = part.partition("=")
        if key not in ("ttft_p99", "tpot_p99") or not value:
            raise ConfigError(f"--slo: expected ttft_p99=DURATION and/or tpot_p99=DURATION, got {part!r}")
        limits[key] = seconds(value, f"--slo {key}")
    return limits.get("ttft_p99"), limits.get("tpot_p99")


def integers(text: str, name: str) -> list[int]:
    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise ConfigError(f"{name}: expected comma-separated integers, got {text!r}") from None
    if not values or values[0] < 1:
        raise ConfigError(f"{name}: expected positive integers, got {text!r}")
    return values


def percent(text: str, name: str) -> float:
    try:
        value = float(text.rstrip("%"))
    except ValueError:
        raise ConfigError(f"{name}: expected a percentage like 1%, got {text!r}") from None
    if value < 0:
        raise ConfigError(f"{name}: must be >= 0, got {text!r}")
    return value


def cmd_tune(args: argparse.Namespace) -> int:
    if args.check is not None:
        return check(Path(args.check), args.metrics_url)
    if args.min_waves < 1:
        raise ConfigError(f"--min-waves must be >= 1, got {args.min_waves}")
    from kvserve.tune.run import tune

    return tune(args)


def check(config: Path, metrics_url: str) -> int:
    """Print whether the server's workload still matches ``config``'s; 1 when it is time to re-tune."""
    import httpx
    import yaml

    from kvserve.tune.drift import TunedWorkload, live_from_metrics, verdict

    if not config.is_file():
        raise ConfigError(f"--check {str(config)!r} does not exist")
    data = yaml.safe_load(config.read_text())
    if not isinstance(data, dict) or "tuned-workload" not in data:
        raise ConfigError(f"{config}: no tuned-workload record (write the file with kvserve tune)")
    tuned = TunedWorkload.parse(data["tuned-workload"], f"{config}: tuned-workload")
    try:
        response = httpx.get(metrics_url, timeout=10.0)
        response.raise_for_status()
    except httpx.HTTPError as exc:
        raise ConfigError(f"--metrics-url {metrics_url}: {exc}") from None
    retune, lines = verdict(tuned, live_from_metrics(response.text))
    print("\n".join(lines))
    print("time to re-tune: run kvserve tune on the current traffic" if retune else "the configuration still fits")
    return 1 if retune else 0


def candidates(args: argparse.Namespace, stats: WorkloadStats, dtypes: list[str],
               capacity: dict[tuple[int, str], int]) -> tuple[list[Candidate], list[str]]:
    """The grid less what cannot fit (kvserve plan's block count for the budget): a block size x
    dtype that cannot hold one p90 sequence, and max_num_seqs values whose mean sequences
    overflow the pool (the smallest is kept). With prefix caching a sequence's shared prompt
    blocks are held once, so a mean sequence costs its unshared part: the recorded docqa session
    pruned bf16 x 32 sequences of 2,153 tokens from a 46,560-token pool, which the defaults then
    ran at 80% usage with half of every prompt shared. Returns the candidates and what was
    pruned, why."""
    prefix_caching = stats.prefix_share >= PREFIX_CACHING_SHARE
    shared = stats.prefix_share * stats.mean_prompt_tokens if prefix_caching else 0.0
    mean_sequence = stats.mean_prompt_tokens + stats.mean_output_tokens - shared
    p90_sequence = stats.p90_prompt_tokens + stats.p90_output_tokens
    seqs = integers(args.max_num_seqs, "--max-num-seqs")
    batched = integers(args.max_num_batched_tokens, "--max-num-batched-tokens")
    kept, pruned = [], []
    for block_size in integers(args.block_sizes, "--block-sizes"):
        for dtype in dtypes:
            tokens = capacity[(block_size, dtype)]
            if tokens < p90_sequence:
                pruned.append(f"block {block_size} {dtype}: the pool holds {tokens} tokens, less than one p90 "
                              f"sequence ({p90_sequence:.0f})")
                continue
            fitting = [n for n in seqs if n * mean_sequence <= tokens] or seqs[:1]
            if len(fitting) < len(seqs):
                pruned.append(f"block {block_size} {dtype}: max-num-seqs {', '.join(map(str, seqs[len(fitting):]))} "
                              f"(the pool holds {tokens / mean_sequence:.1f} mean sequences"
                              f"{', shared prompt blocks counted once' if shared else ''})")
            kept += [Candidate(block_size, dtype, n, m, prefix_caching) for n in fitting for m in batched]
    return kept, pruned


def search_spec(args: argparse.Namespace, slo: tuple[float | None, float | None], base: dict[str, Any],
                samples: list[Any], out: Path, scales: Path | None) -> SearchSpec:
    return SearchSpec(base, samples, integers(args.concurrency, "--concurrency"), *slo, out,
                      seconds(args.time_budget, "--time-budget"), args.prompts_per_level,
                      (lambda c: {"kv-scales": str(scales)} if c.kv_cache_dtype.startswith("fp8") else {})
                      if scales is not None else None, not args.quiet, min_waves=args.min_waves)
