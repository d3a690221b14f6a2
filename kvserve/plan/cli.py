"""``kvserve plan``: arguments, the spec they describe, and the rendered report."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from typing import Any

from kvserve.cache.kv_format import KEY_SCALE_MODES, KV_DTYPES
from kvserve.config import device_total_memory, format_bytes, parse_size
from kvserve.plan.planner import CONTEXT_DISTRIBUTIONS, WEIGHT_BYTES, PlanReport, gb, gib, plan
from kvserve.plan.presets import PRESETS, preset
from kvserve.plan.spec import ModelSpec, SpecError, estimate_params

_EXPLICIT = ("layers", "q_heads", "kv_heads", "head_dim")


def add_plan_args(parser: argparse.ArgumentParser) -> None:
    src = parser.add_argument_group("model (one of --model, --preset, or the explicit flags)")
    src.add_argument("--model", help="alias (smollm2-135m), .gguf file, HF folder or config.json")
    src.add_argument("--preset", help=f"built-in architecture: {', '.join(PRESETS)}")
    src.add_argument("--layers", type=int)
    src.add_argument("--q-heads", type=int)
    src.add_argument("--kv-heads", type=int, help="default: --q-heads (MHA)")
    src.add_argument("--head-dim", type=int)
    src.add_argument("--hidden-size", type=int, help="default: q-heads x head-dim")
    src.add_argument("--params", help="parameter count, e.g. 8B, 70e9, 135M (overrides the model's)")
    src.add_argument("--kv-lora-rank", type=int, default=0, help="MLA latent rank (the cache holds rank + rope dim)")
    src.add_argument("--qk-rope-head-dim", type=int, default=0)
    src.add_argument("--sliding-window", type=int, default=0)
    src.add_argument("--sliding-layers", type=int, default=None, help="layers using the window (default: all)")
    work = parser.add_argument_group("workload and device")
    work.add_argument("--concurrency", type=int, default=1, help="concurrent sequences")
    work.add_argument("--context", type=int, default=4096, help="tokens per sequence (default: %(default)s)")
    work.add_argument("--context-distribution", default="fixed", choices=CONTEXT_DISTRIBUTIONS,
                      help="lengths for the paged tail-waste estimate: all at --context, or uniform up to it")
    work.add_argument("--device-memory", help="e.g. 24GB, 80GiB (default: this machine's GPU, else RAM)")
    work.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    work.add_argument("--kv-cache-dtype", default="auto", help=f"auto or one of {', '.join(KV_DTYPES)}")
    work.add_argument("--kv-key-scales", default="static", choices=KEY_SCALE_MODES,
                      help="int8 key scales: one calibrated table, or one per block (+ a full-precision tail "
                           "block per sequence); int4's are always per block")
    work.add_argument("--dtype", default=None,
                      help=f"weight dtype: {', '.join(WEIGHT_BYTES)} (default: the model's); a GGUF file's "
                      "weights stay in their blocks (gguf) under a float dtype, which is then the KV's")
    work.add_argument("--block-size", type=int, default=16)
    work.add_argument("--kv-offload-memory", default=None, help="tier 1 in host memory, e.g. 8GiB: how many more "
                      "sessions' prefixes it holds beyond the pool")
    work.add_argument("--kv-offload-disk-size", default=None, help="tier 2 on disk, e.g. 100GiB: the same")
    work.add_argument("--activation-memory", help="activation + framework reserve, e.g. 4GB (default: estimated)")
    work.add_argument("--max-num-batched-tokens", type=int, default=2048, help="for the activation estimate")
    parser.add_argument("--json", action="store_true", help="machine-readable output (keys in docs/plan.md)")


def parse_count(value: str, name: str) -> int:
    """'8B', '70e9', '135M', '1.5T' or a plain integer."""
    text = value.strip().upper()
    scale = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}.get(text[-1:], 1)
    try:
        number = float(text[:-1] if scale != 1 else text)
    except ValueError:
        raise SpecError(f"{name}: cannot parse {value!r} as a count (try 8B or 135M)") from None
    if number <= 0:
        raise SpecError(f"{name} must be positive, got {value!r}")
    return int(number * scale)


def spec_from_args(args: argparse.Namespace) -> ModelSpec:
    explicit = [n for n in _EXPLICIT if getattr(args, n) is not None]
    chosen = [n for n, v in (("--model", args.model), ("--preset", args.preset), ("explicit flags", explicit)) if v]
    if len(chosen) > 1:
        raise SpecError(f"give one model source, not {' and '.join(chosen)}")
    params = parse_count(args.params, "--params") if args.params else None
    if args.preset:
        spec = preset(args.preset)
    elif explicit:
        missing = [f"--{n.replace('_', '-')}" for n in ("layers", "q_heads", "head_dim") if getattr(args, n) is None]
        if missing:
            raise SpecError(f"explicit model flags need {', '.join(missing)}")
        heads = args.q_heads
        config: dict[str, Any] = {
            "num_hidden_layers": args.layers, "num_attention_heads": heads,
            "num_key_value_heads": args.kv_heads or heads, "head_dim": args.head_dim,
            "hidden_size": args.hidden_size or heads * args.head_dim,
            "kv_lora_rank": args.kv_lora_rank, "qk_rope_head_dim": args.qk_rope_head_dim,
            "sliding_window": args.sliding_window,
        }
        if args.sliding_window and args.sliding_layers is not None:
            config["layer_types"] = (["sliding_attention"] * args.sliding_layers
                                     + ["full_attention"] * (args.layers - args.sliding_layers))
        if params is None:
            params = estimate_params(config)
        spec = ModelSpec.from_hf_config(config, name="explicit", params=params)
    else:
        spec = ModelSpec.from_model(args.model or "smollm2-135m")
    return replace(spec, params=params) if params is not None else spec


def device_memory_from_args(args: argparse.Namespace) -> tuple[int, str]:
    if args.device_memory:
        return parse_size(args.device_memory, "--device-memory"), "given"
    return device_total_memory("auto")


def cmd_plan(args: argparse.Namespace) -> int:
    spec = spec_from_args(args)
    device_memory, memory_source = device_memory_from_args(args)
    report = plan(
        spec, concurrency=args.concurrency, context=args.context, device_memory=device_memory,
        gpu_memory_utilization=args.gpu_memory_utilization, kv_dtype=args.kv_cache_dtype, weight_dtype=args.dtype,
        block_size=args.block_size,
        activation_memory=parse_size(args.activation_memory, "--activation-memory") if args.activation_memory
        else None,
        max_num_batched_tokens=args.max_num_batched_tokens, context_distribution=args.context_distribution,
        key_scales=args.kv_key_scales, kv_offload_memory=args.kv_offload_memory or 0,
        kv_offload_disk_size=args.kv_offload_disk_size or 0,
    )
    if args.json:
        print(json.dumps({**report.to_dict(), "device_memory_source": memory_source}, indent=2))
    else:
        render(report, memory_source)
    return 0


def render(r: PlanReport, memory_source: str) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    m = r.model
    shape = f"{m['num_layers']} layers, {m['num_heads']} query heads"
    shape += (f", MLA latent {m['kv_lora_rank']}+{m['qk_rope_head_dim']}" if m["attention"] == "mla"
              else f", {m['num_kv_heads']} KV heads x {m['head_dim']} ({m['attention'].upper()})")
    if m["num_sliding_layers"]:
        shape += f", {m['num_sliding_layers']} sliding-window layers ({m['sliding_window']} tokens)"
    console.print(f"[bold]{m['name']}[/bold]: {shape}; {m['params'] / 1e9:.2f} B params")
    table = Table(title=f"{r.concurrency} sequences x {r.context} tokens, block {r.block_size}, KV {r.kv_dtype}")
    table.add_column("item")
    table.add_column("bytes", justify="right")
    table.add_column("", justify="left")
    table.add_row("KV per token", f"{r.kv_bytes_per_token:,.0f}", f"{r.kv_bytes_per_token / 1024:.2f} KiB")
    table.add_row("KV per sequence", f"{r.kv_bytes_per_sequence:,}", format_bytes(r.kv_bytes_per_sequence))
    table.add_row("KV total", f"{r.kv_bytes_total:,}", f"{gib(r.kv_bytes_total)} ({gb(r.kv_bytes_total)})")
    table.add_row("  of which paged tail waste", f"{r.tail_waste_bytes:,}", f"{r.context_distribution} lengths")
    if len(r.kv_groups) > 1:  # hybrid layouts: what each KV cache group holds per sequence
        for i, g in enumerate(r.kv_groups):
            window = f", window {g.sliding_window}" if g.sliding_window else ""
            table.add_row(f"  group {i}: {g.kind}{window}", f"{g.bytes_per_sequence:,}",
                          f"{g.blocks_per_sequence} blocks x {g.num_layers} layers per sequence")
    table.add_row(f"weights ({r.weight_dtype})", f"{r.weight_bytes:,}", gb(r.weight_bytes))
    table.add_row("activations + reserve", f"{r.activation_bytes:,}",
                  f"{gb(r.activation_bytes)} ({r.activation_source})")
    table.add_row("total", f"{r.total_bytes:,}", gb(r.total_bytes))
    table.add_row("usable", f"{r.usable_bytes:,}",
                  f"{r.gpu_memory_utilization} x {gb(r.device_memory_bytes)} ({memory_source})")
    verdict = "[green]fits[/green]" if r.fits else "[red]does not fit[/red]"
    table.add_row("verdict", f"{r.margin_bytes:+,}", verdict)
    if r.kv_offload_memory_bytes:
        table.add_row("tier 1 (host memory)", f"{r.kv_offload_memory_bytes:,}",
                      f"prefixes of {r.tier_sessions:,} more sessions x {r.context} tokens")
    if r.kv_offload_disk_bytes:
        table.add_row("tier 2 (disk)", f"{r.kv_offload_disk_bytes:,}",
                      f"prefixes of ~{r.disk_sessions:,} more sessions x {r.context} tokens")
    console.print(table)
    whatif = Table(title="what if: KV dtype")
    for col in ("KV dtype", "B/token", "KV total", "total", "fits?", f"max seqs @ {r.context}",
                f"max context @ {r.concurrency}"):
        whatif.add_column(col, justify="right")
    for w in r.what_if:
        whatif.add_row(w.kv_dtype, f"{w.kv_bytes_per_token:,.0f}", gib(w.kv_bytes_total), gb(w.total_bytes),
                       "yes" if w.fits else "no", f"{w.max_concurrency:,}", f"{w.max_context:,}")
    console.print(whatif)
    for line in r.advice:
        console.print("- " + line, highlight=False)
