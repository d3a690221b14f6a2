"""``kvserve bench serve`` and ``kvserve bench report``."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvserve.bench.datasets import build_samples
from kvserve.bench.sweep import SweepSpec, compare, run_sweep, write_outputs
from kvserve.config import ConfigError


def add_bench_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``bench``'s subcommands; returns ``bench serve``'s parser (the one --config files set)."""
    sub = parser.add_subparsers(dest="bench_command", required=True)
    serve = sub.add_parser("serve", help="sweep load against an OpenAI-compatible server, find the knee")
    serve.add_argument("--base-url", default="http://127.0.0.1:8000")
    serve.add_argument("--model", default="smollm2-135m", help="model name the server serves")
    serve.add_argument("--api-key", default=None)
    serve.add_argument("--dataset", default="random", help="random, prefix, multiturn or jsonl:PATH")
    serve.add_argument("--input-len", default="256:1024", help="prompt tokens: N, LOW:HIGH or normal:MEAN:STD")
    serve.add_argument("--output-len", default="64:256", help="output tokens: N, LOW:HIGH or normal:MEAN:STD")
    serve.add_argument("--prefix-len", type=int, default=1000,
                       help="prefix: shared prefix tokens; multiturn: system prompt tokens")
    serve.add_argument("--num-prefixes", type=int, default=4)
    serve.add_argument("--num-prompts", type=int, default=200, help="requests per level")
    serve.add_argument("--concurrency", default=None, help="levels, e.g. 1,2,4,8 (default sweep)")
    serve.add_argument("--request-rate", default=None, help="Poisson arrival rates per second, e.g. 2,4,8")
    serve.add_argument("--slo-ttft", type=float, default=None, help="goodput: TTFT limit in seconds")
    serve.add_argument("--slo-tpot", type=float, default=None, help="goodput: TPOT limit in seconds")
    serve.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    serve.add_argument("--max-duration", type=float, default=None,
                       help="per level: cancel what is still pending after this many seconds (counted as errors)")
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument("--out", default="results/run", help="folder for results.json/csv, report.md, plots")
    serve.add_argument("--quiet", action="store_true", help="no progress bars")
    report = sub.add_parser("report", help="compare runs side by side (overlaid plots, tables)")
    report.add_argument("runs", nargs="+", help="run folders written by bench serve")
    report.add_argument("--out", default=None, help="folder for the comparison (default: RUN1/compare)")
    return serve


def _levels(text: str, name: str, integer: bool) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"{name}: expected a comma-separated list of numbers, got {text!r}") from None
    if not values or any(v <= 0 for v in values) or (integer and any(v != int(v) for v in values)):
        raise ConfigError(f"{name}: levels must be positive{' integers' if integer else ''}, got {text!r}")
    return sorted(values)


def cmd_bench(args: argparse.Namespace) -> int:
    if args.bench_command == "report":
        out = Path(args.out) if args.out else Path(args.runs[0]) / "compare"
        try:
            files = compare([Path(r) for r in args.runs], out)
        except FileNotFoundError as exc:
            raise ConfigError(str(exc)) from exc
        print("\n".join(str(f) for f in files))
        return 0
    if args.concurrency and args.request_rate:
        raise ConfigError("give --concurrency or --request-rate, not both")
    if args.request_rate:
        mode, levels = "rate", _levels(args.request_rate, "--request-rate", integer=False)
    else:
        mode, levels = "concurrency", _levels(args.concurrency or "1,2,4,8,16,32,64", "--concurrency", integer=True)
    # fresh prompts for each level (jsonl: the next --num-prompts rows, repeating only when the file
    # runs out): a level must not find the previous level's prompts in the server's prefix cache
    samples = [build_samples(args.dataset, args.num_prompts, args.input_len, args.output_len, args.prefix_len,
                             args.num_prefixes, args.seed + i, offset=i * args.num_prompts)
               for i in range(len(levels))]
    if args.max_duration is not None and args.max_duration <= 0:
        raise ConfigError(f"--max-duration must be positive, got {args.max_duration}")
    spec = SweepSpec(args.base_url, args.model, samples, mode, levels, args.api_key, args.slo_ttft, args.slo_tpot,
                     args.timeout, args.max_duration)
    result = run_sweep(spec, show_progress=not args.quiet)
    files = write_outputs(result, Path(args.out))
    knee = result["knee"]
    print(f"knee: {knee['level'] if knee['level'] is not None else 'none'} ({knee['limiting_factor']}): "
          f"{knee['reason']}\n{result['diagnosis']}")
    print("\n".join(str(f) for f in files))
    return 0
