"""``kvserve eval``: what each KV format costs in quality and buys in memory, on held-out text.

For every variant (a KV dtype, optionally ``:static`` or ``:block`` key scales) the
held-out tokens are run through the engine in windows of ``--context`` tokens, chunked prefill
of ``--chunk`` tokens at a time, so every chunk attends to the earlier ones through the
quantized paged cache (and to itself: K/V are read back from the cache). Per variant:
perplexity, its change against the first variant (full precision), the mean KL divergence of
the next-token distributions, top-1 agreement, KV bytes per token (scales included), and the
sequences of ``--context`` tokens the same KV budget holds.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch

from kvserve.cache.kv_format import KVLayout, kv_block_bytes
from kvserve.cache.kv_groups import cdiv
from kvserve.config import KV_EVICTION, KV_KEY_SCALES, QUANTIZATION_METHODS, ConfigError, EngineConfig
from kvserve.engine.engine import LLMEngine
from kvserve.engine.loading import LoadedModel, load_model
from kvserve.model.tokenizer import chat_token_ids
from kvserve.quant.data import read_samples, token_stream


class Variant(NamedTuple):
    name: str  # as given: "int8", "int4:block", "int8:static"; "auto streaming 256", "auto snapkv 0.5"
    kv_dtype: str
    key_scales: str  # auto, static, block
    kv_eviction: str = "none"
    kv_window: int = 0  # streaming's window
    kv_compression_ratio: float = 1.0  # snapkv: the fraction of each prompt kept


class EvalResult(NamedTuple):
    name: str
    kv_cache_dtype: str
    key_scales: str
    tokens: int
    ppl: float
    delta_ppl_pct: float
    mean_kl: float
    top1_agreement: float
    kv_bytes_per_token: int
    bytes_vs_fp16: float
    max_concurrency: int
    clip_ratio: float
    seconds: float


def parse_variants(text: str) -> list[Variant]:
    variants = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        dtype, _, mode = part.partition(":")
        if mode and mode not in KV_KEY_SCALES:
            raise ConfigError(f"--kv-cache-dtype {part!r}: key scales must be one of {', '.join(KV_KEY_SCALES)}")
        variants.append(Variant(part, dtype, mode or "auto"))
    if not variants:
        raise ConfigError("--kv-cache-dtype names no variant")
    return variants


def _numbers(flag: str, text: str, kind: type[int] | type[float], low: float, high: float) -> list[Any]:
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: expected comma-separated numbers") from None
    if not values or not all(low <= v <= high for v in values):
        raise ConfigError(f"{flag} {text!r}: expected values in [{low:g}, {high:g}]")
    return values


def eviction_variants(variant: Variant, evictions: str, windows: str, ratios: str) -> list[Variant]:
    """Rows for ``--kv-eviction none,streaming,snapkv``: ``variant``'s KV dtype with StreamingLLM
    at each ``--kv-window`` and SnapKV at each ``--kv-compression-ratio`` (``none`` is the
    variant's own row)."""
    names = [e.strip() for e in evictions.split(",") if e.strip()]
    bad = [e for e in names if e not in KV_EVICTION]
    if bad:
        raise ConfigError(f"--kv-eviction {bad[0]!r}: expected one of {', '.join(KV_EVICTION)}")
    rows = []
    if "streaming" in names:
        rows += [variant._replace(name=f"{variant.name} streaming {w}", kv_eviction="streaming", kv_window=w)
                 for w in _numbers("--kv-window", windows, int, 1, math.inf)]
    if "snapkv" in names:
        rows += [variant._replace(name=f"{variant.name} snapkv {r:g}", kv_eviction="snapkv",
                                    kv_compression_ratio=r)
                 for r in _numbers("--kv-compression-ratio", ratios, float, 1e-6, 1.0)]
    return rows


def next_token_logprobs(engine: LLMEngine, tokens: list[int], chunk: int) -> torch.Tensor:
    """Log-probabilities [len-1, vocab] of each next token (LLMEngine.score, concatenated); with
    kv_eviction=snapkv the first half of ``tokens`` is the prompt it compresses."""
    prompt_len = len(tokens) // 2 if engine.config.eviction_config.kv_eviction == "snapkv" else 0
    return torch.cat([rows for _, rows in engine.score(tokens, chunk, prompt_len)])[:-1]


class _Totals:
    def __init__(self) -> None:
        self.nll = 0.0
        self.kl = 0.0
        self.agree = 0
        self.count = 0

    def add(self, logprobs: torch.Tensor, targets: torch.Tensor, reference: torch.Tensor) -> None:
        self.nll -= float(logprobs.gather(1, targets[:, None]).sum())
        self.kl += float((reference.exp() * (reference - logprobs)).sum())
        self.agree += int((logprobs.argmax(dim=1) == reference.argmax(dim=1)).sum())
        self.count += len(targets)


def evaluate(loaded: LoadedModel, model: str, tokens: list[int], variants: list[Variant], *, context: int,
             chunk: int, kv_scales: str | None, kv_cache_memory: str, block_size: int,
             progress: bool = True, kv_sink_tokens: int = 4, kv_observation_window: int = 32) -> list[EvalResult]:
    """Score ``tokens`` in windows of ``context`` under every variant; the first is the reference."""
    engines = []
    for v in variants:
        config = EngineConfig.from_settings(model=model, quantization=loaded.quantization, kv_cache_dtype=v.kv_dtype,
                           kv_key_scales=v.key_scales, kv_scales=kv_scales, block_size=block_size,
                           kv_cache_memory=kv_cache_memory, enable_prefix_caching=False, max_num_seqs=1,
                           max_model_len=context, max_num_batched_tokens=chunk,
                           kv_eviction=v.kv_eviction, kv_window=v.kv_window or 1024,
                           kv_sink_tokens=kv_sink_tokens, kv_compression_ratio=v.kv_compression_ratio,
                           kv_observation_window=kv_observation_window)
        engines.append(LLMEngine(config, loaded=loaded))
    windows = [tokens[i : i + context] for i in range(0, len(tokens), context)]
    windows = [w for w in windows if len(w) > 1]
    totals = [_Totals() for _ in variants]
    seconds = [0.0] * len(variants)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(windows) * len(variants), desc="eval", unit="window")
    for window in windows:
        targets = torch.tensor(window[1:])
        reference = None
        for i, engine in enumerate(engines):
            start = time.perf_counter()
            logprobs = next_token_logprobs(engine, window, chunk)
            seconds[i] += time.perf_counter() - start
            reference = logprobs if reference is None else reference
            totals[i].add(logprobs, targets, reference)
            if bar is not None:
                bar.update()
    if bar is not None:
        bar.close()
    mcfg = loaded.config
    layout = KVLayout.standard(mcfg.num_kv_heads, mcfg.head_dim)
    fp16_per_token = kv_block_bytes(layout, mcfg.num_layers, "fp16", block_size) / block_size
    ref_ppl = math.exp(totals[0].nll / totals[0].count)
    budget = int(engines[0].config.cache_config.kv_cache_memory or 0)
    results = []
    for v, engine, t, secs in zip(variants, engines, totals, seconds, strict=True):
        ppl = math.exp(t.nll / t.count)
        mode = engine.kv_quant.key_scale_mode
        if engine.kv_cache_dtype not in ("int8", "int4"):
            mode = "static per layer" if engine.kv_cache_dtype.startswith("fp8") else "-"
        results.append(EvalResult(
            v.name, engine.kv_cache_dtype, mode, t.count, ppl, 100 * (ppl / ref_ppl - 1), t.kl / t.count,
            t.agree / t.count, engine.kv_bytes_per_token, engine.kv_bytes_per_token / fp16_per_token,
            budget // (held_blocks(engine, context, chunk) * engine.kv_block_bytes + engine.kv_tail_bytes),
            engine.kv_clip_ratio(), secs))
    return results


def held_blocks(engine: LLMEngine, context: int, chunk: int) -> int:
    """Blocks one window of ``context`` tokens holds at its end: all of them; with streaming
    eviction its sinks, its window and a chunk; with snapkv its compressed prompt (the first
    half) and the rest (its whole prompt only while that prefills)."""
    size, evict = engine.config.cache_config.block_size, engine.config.eviction_config
    if engine.eviction.default_window is not None:
        return min(cdiv(context, size), engine.eviction.default_window.blocks_held(size, chunk))
    if evict.kv_eviction == "snapkv":
        prompt = context // 2
        kept = max(min(evict.kv_observation_window, prompt), math.ceil(prompt * evict.kv_compression_ratio))
        return cdiv(kept + context - prompt, size)
    return cdiv(context, size)


def table(results: list[EvalResult]) -> str:
    head = ("| variant | KV dtype | key scales | PPL | ΔPPL % | mean KL | top-1 agree | KV B/token | vs fp16 "
            "| max seqs | clipped |")
    lines = [head, "|" + "---|" * 11]
    for r in results:
        lines.append(f"| {r.name} | {r.kv_cache_dtype} | {r.key_scales} | {r.ppl:.3f} | {r.delta_ppl_pct:+.2f} | "
                     f"{r.mean_kl:.4f} | {100 * r.top1_agreement:.1f}% | {r.kv_bytes_per_token} | "
                     f"{r.bytes_vs_fp16:.3f}x | {r.max_concurrency} | {100 * r.clip_ratio:.3f}% |")
    return "\n".join(lines)


def plot(results: list[EvalResult], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.name for r in results]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    panels: list[tuple[str, list[float], str]] = [
        ("ΔPPL % vs " + results[0].name, [r.delta_ppl_pct for r in results], "%.2f"),
        ("KV bytes / token (scales included)", [float(r.kv_bytes_per_token) for r in results], "%d"),
        ("max sequences in the same KV budget", [float(r.max_concurrency) for r in results], "%d")]
    for ax, (title, values, fmt) in zip(axes, panels, strict=True):
        bars = ax.bar(names, values, color=["#888" if i == 0 else "#3a7" for i in range(len(names))])
        ax.set_title(title, fontsize=10)
        ax.bar_label(bars, fmt=fmt, fontsize=8)
        ax.tick_params(axis="x", rotation=30, labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def add_eval_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="alias, .gguf file or HF folder")
    parser.add_argument("--data", default="builtin:python-reference",
                        help="held-out text: plain text, .jsonl, or builtin:python-reference (default)")
    parser.add_argument("--kv-cache-dtype", default="auto,fp8_e4m3,int8,int4",
                        help="comma-separated variants, the first is the reference; DTYPE[:static|block]")
    parser.add_argument("--kv-scales", default=None, help="calibration file (kvserve calibrate)")
    parser.add_argument("--kv-eviction", default="none",
                        help="none,streaming,snapkv: also score each KV dtype with StreamingLLM eviction at "
                             "each --kv-window (a chunk's first query keeps the sinks and its window) and with "
                             "SnapKV at each --kv-compression-ratio (each window's first half is the prompt, "
                             "compressed once after its prefill; every row scores every token)")
    parser.add_argument("--kv-window", default="256,512,1024", help="streaming windows to score, comma-separated")
    parser.add_argument("--kv-sink-tokens", type=int, default=4, help="streaming: attention sink tokens")
    parser.add_argument("--kv-compression-ratio", default="0.25,0.5,0.75",
                        help="snapkv: fractions of the prompt kept, comma-separated")
    parser.add_argument("--kv-observation-window", type=int, default=32,
                        help="snapkv: the last prompt tokens whose attention scores the rest")
    parser.add_argument("--num-tokens", type=int, default=20480, help="held-out tokens to score")
    parser.add_argument("--context", type=int, default=2048, help="window length: contexts up to this")
    parser.add_argument("--chunk", type=int, default=512,
                        help="prefill chunk (later chunks read the cache); 1 scores every token through the "
                             "decode kernels")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-memory", default="1GiB", help="the budget 'max seqs' is computed in")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--quantization", default=None, choices=QUANTIZATION_METHODS,
                        help="int8: the model's linear layers in int8 (as serve's --quantization)")
    parser.add_argument("--out", default="kv_eval", help="folder for results.json, report.md, eval.png")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def cmd_eval(args: argparse.Namespace) -> int:
    for name, least in (("num_tokens", 2), ("context", 2), ("chunk", 1)):
        if getattr(args, name) < least:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least {least}, got {getattr(args, name)}")
    variants = parse_variants(args.kv_cache_dtype)
    variants += [row for v in variants
                 for row in eviction_variants(v, args.kv_eviction, args.kv_window, args.kv_compression_ratio)]
    probe = EngineConfig.from_settings(model=args.model, dtype=args.dtype, block_size=args.block_size,
                         quantization=args.quantization)  # validates
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32, "float32": torch.float32,
             "bfloat16": torch.bfloat16, "float16": torch.float16}[probe.model_config.dtype]
    loaded = load_model(args.model, device, dtype, args.quantization)
    if loaded.tokenizer is None:
        raise ConfigError(f"model {args.model!r} has no tokenizer to encode --data")
    tokenizer = loaded.tokenizer

    tokens = token_stream(read_samples(args.data), lambda text: list(tokenizer.encode(text)),
                          lambda messages: chat_token_ids(tokenizer, messages), args.num_tokens)
    if len(tokens) < args.num_tokens:
        raise ConfigError(f"--data {args.data!r} holds {len(tokens)} tokens, fewer than --num-tokens "
                          f"{args.num_tokens}")
    results = evaluate(loaded, args.model, tokens, variants, context=args.context, chunk=args.chunk,
                       kv_scales=args.kv_scales, kv_cache_memory=args.kv_cache_memory, block_size=args.block_size,
                       progress=not args.quiet, kv_sink_tokens=args.kv_sink_tokens,
                       kv_observation_window=args.kv_observation_window)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta: dict[str, Any] = {"model": args.model, "data": args.data, "tokens": len(tokens), "context": args.context,
            "chunk": args.chunk, "block_size": args.block_size, "kv_cache_memory": args.kv_cache_memory,
            "kv_scales": args.kv_scales, "model_dtype": str(dtype).removeprefix("torch."),
            "quantization": args.quantization}
    (out / "results.json").write_text(json.dumps({"schema": 1, **meta,
                                                  "results": [r._asdict() for r in results]}, indent=1))
    text = table(results)
    png = plot(results, out / "eval.png")
    (out / "report.md").write_text(f"# KV quantization eval\n\n{json.dumps(meta)}\n\n{text}\n\n![eval]({png.name})\n")
    print(text)
    print(f"\nwrote {out / 'results.json'}, {out / 'report.md'}, {png}")
    return 0
