"""One tuning run, start to end: the workload and its statistics, which KV dtypes keep quality
on its own text, what the plan says fits, the search, and the files it writes."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from kvserve.cache.kv_format import normalize_kv_dtype
from kvserve.cache.kv_quant import float_kind
from kvserve.config import ConfigError, EngineConfig, parse_size
from kvserve.tune.cli import PREFIX_CACHING_SHARE, candidates, integers, parse_slo, percent, search_spec
from kvserve.tune.output import tuned_workload, write_config, write_report
from kvserve.tune.search import best_result, successive_halving
from kvserve.tune.workload import WorkloadStats, load_workload, prompt_ids, workload_stats

CALIBRATION_SAMPLES, CALIBRATION_LENGTH = 32, 2048


def tune(args: argparse.Namespace) -> int:
    from kvserve.engine.loading import load_model
    from kvserve.plan.planner import kv_blocks_for_budget
    from kvserve.plan.spec import ModelSpec

    out = Path(args.out)
    budget = parse_size(args.memory, "--memory")
    max_loss = percent(args.max_quality_loss, "--max-quality-loss")
    slo = parse_slo(args.slo)
    dtypes = list(dict.fromkeys(d.strip() for d in args.kv_cache_dtypes.split(",") if d.strip()))
    for dtype in dtypes:  # a bad name fails here, before anything loads
        EngineConfig.from_settings(model=args.model, kv_cache_dtype=dtype)
    for flag in ("block_sizes", "max_num_seqs", "max_num_batched_tokens", "concurrency"):
        integers(getattr(args, flag), "--" + flag.replace("_", "-"))
    model_dtype = {"auto": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16,
                   "float16": torch.float16}[args.dtype]
    loaded = load_model(args.model, torch.device("cpu"), model_dtype)
    if loaded.tokenizer is None:
        raise ConfigError(f"model {args.model!r} has no tokenizer to read the workload with")
    samples = load_workload(args.workload, args.num_prompts, args.input_len, args.output_len, args.prefix_len,
                            args.num_prefixes, args.seed)
    prompts = [prompt_ids(s, loaded.tokenizer) for s in samples]
    stats = workload_stats(prompts, samples)
    out.mkdir(parents=True, exist_ok=True)
    allowed, quality_lines, scales = quality(args, loaded, prompts, dtypes, max_loss, out)
    spec = ModelSpec.from_model(args.model)
    kind = float_kind(model_dtype)
    capacity = {(bs, d): (kv_blocks_for_budget(spec, normalize_kv_dtype(d, kind), bs, budget,
                                               "static" if d.startswith("fp8") else "block") - 1) * bs
                for bs in integers(args.block_sizes, "--block-sizes") for d in allowed}
    grid, pruned = candidates(args, stats, allowed, capacity)
    if not grid:
        raise ConfigError(f"no configuration fits --memory {args.memory}: " + "; ".join(pruned))
    base = {"model": args.model, "dtype": args.dtype, "kv-cache-memory": args.memory}
    print(f"workload: {stats.summary()}\nKV dtypes within {max_loss:g}% perplexity: {', '.join(allowed)}\n"
          f"{len(grid)} candidates after the plan" + (f" (pruned: {'; '.join(pruned)})" if pruned else ""), flush=True)
    results = successive_halving(search_spec(args, slo, base, samples, out, scales), grid)
    best = best_result(results)
    if best is None:
        raise ConfigError(f"no candidate could be measured (see {out / 'candidates'}/*.log)")
    flags = best["flags"]
    pool_tokens = capacity[(flags["block-size"], flags["kv-cache-dtype"])]
    why = reasons(results, best, stats, quality_lines, pool_tokens)
    slo_ttft, slo_tpot = slo
    header = [f"kvserve tune: the best of {len(grid)} candidates for this workload (goodput under the SLO: "
              f"TTFT p99 <= {slo_ttft if slo_ttft is not None else '-'} s, TPOT p99 <= "
              f"{slo_tpot if slo_tpot is not None else '-'} s)", "any flag on the command line overrides this file"]
    config = out / "kvserve.yaml"
    write_config(config, best, stats, why, tuned_workload(stats, best, pool_tokens), header)
    files = write_report(out, results, best, [f"Workload: {stats.summary()}.", "",
                                              "Quality on the workload's own text (kvserve eval):", "",
                                              *[f"- {line}" for line in quality_lines], "",
                                              f"Pruned by the plan: {'; '.join(pruned) or 'nothing'}."])
    print(f"chosen: {best['name']} (goodput {best['goodput']:.3f} req/s, knee {best['knee']})")
    print("\n".join(str(f) for f in [config, *files]))
    return 0


def quality(args: argparse.Namespace, loaded: Any, prompts: list[list[int]], dtypes: list[str], max_loss: float,
            out: Path) -> tuple[list[str], list[str], Path | None]:
    """The dtypes whose perplexity on the workload's own text (kvserve eval, against the model
    dtype) rises at most ``max_loss`` percent; fp8 scored with scales calibrated on that text."""
    from kvserve.llm import LLM
    from kvserve.quant.calibrate import scales_from_tokens
    from kvserve.quant.evaluate import Variant, evaluate

    if dtypes == ["auto"]:
        return dtypes, ["only the model dtype was asked for"], None
    tokens = [t for ids in prompts for t in ids][: args.eval_tokens]
    if len(tokens) < 64:
        raise ConfigError(f"the workload's prompts hold {len(tokens)} tokens: too few to measure KV quality")
    scales = None
    if any(d.startswith("fp8") for d in dtypes):
        llm = LLM(loaded=loaded, kv_cache_memory="256MiB", enable_prefix_caching=False)
        lists = [ids[:CALIBRATION_LENGTH] for ids in prompts[:CALIBRATION_SAMPLES] if ids]
        scales = out / "kv_scales.json"
        scales_from_tokens(llm, lists, f"kvserve tune --workload {args.workload}", not args.quiet).save(scales)
        del llm
    context = min(2048, len(tokens))
    variants = [Variant(d, "auto" if d == "auto" else d, "block" if d in ("int8", "int4") else "auto")
                for d in dict.fromkeys(["auto", *dtypes])]
    results = evaluate(loaded, args.model, tokens, variants, context=context, chunk=min(512, context),
                       kv_scales=str(scales) if scales else None, kv_cache_memory="512MiB", block_size=16,
                       progress=not args.quiet)
    allowed = [r.name for r in results if r.name in dtypes and r.delta_ppl_pct <= max_loss]
    lines = [f"{r.name}: PPL {r.ppl:.3f} ({r.delta_ppl_pct:+.2f}%), KL {r.mean_kl:.4f}, "
             f"{'kept' if r.name in allowed else 'over the limit'}" for r in results if r.name in dtypes]
    if not allowed:
        raise ConfigError(f"no KV dtype stays within --max-quality-loss {max_loss:g}%: {'; '.join(lines)}")
    return allowed, lines, scales if any(d.startswith("fp8") for d in allowed) else None


def by_value(results: list[dict[str, Any]], key: str) -> str:
    """Best goodput at the first rung (every candidate measured alike) for each value of ``key``."""
    best: dict[Any, float] = {}
    for r in results:
        if r["rung"] == 0 and not r.get("error"):
            value = r["flags"][key]
            best[value] = max(best.get(value, 0.0), r["goodput"])
    return ", ".join(f"{value}: {goodput:.3f}" for value, goodput in sorted(best.items(), key=lambda kv: str(kv[0])))


def reasons(results: list[dict[str, Any]], best: dict[str, Any], stats: WorkloadStats, quality_lines: list[str],
            capacity_tokens: int) -> dict[str, str]:
    """Why each value of the chosen configuration, in the words kvserve.yaml carries."""
    measured = "best goodput (req/s) at the first rung, by value"
    share = 100 * stats.prefix_share
    return {
        "kv-cache-memory": f"the KV budget tuned for (--memory): {capacity_tokens:,} token slots in this "
                           f"block size and dtype",
        "block-size": f"{measured}: {by_value(results, 'block-size')}",
        "kv-cache-dtype": f"{measured}: {by_value(results, 'kv-cache-dtype')}; quality on the workload's text: "
                          + "; ".join(quality_lines),
        "max-num-seqs": f"{measured}: {by_value(results, 'max-num-seqs')}; the knee: {best['knee_reason']}",
        "max-num-batched-tokens": f"{measured}: {by_value(results, 'max-num-batched-tokens')}",
        "enable-prefix-caching": f"an unbounded prefix cache would serve {share:.1f}% of the prompt tokens "
                                 f"(on from {100 * PREFIX_CACHING_SHARE:g}%)",
        "kv-scales": "fp8 scales calibrated on the workload's own prompts",
    }
