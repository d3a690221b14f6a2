"""``kvserve calibrate``: K/V statistics of the user's data -> a scales file; ``--check`` compares
another dataset with a scales file (seed §4.2: calibrating on short chats and serving long
documents is the most common failure, so lengths and key ranges are both compared)."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import NamedTuple

import torch

from kvserve.cache.kv_scales import KVScales, length_summary
from kvserve.config import ConfigError
from kvserve.engine.sampling import SamplingParams
from kvserve.llm import LLM
from kvserve.quant.data import read_samples, token_stream, tokenize

logger = logging.getLogger("kvserve")
LENGTH_RATIO_WARN = 2.0  # p50 or p90 token length this many times the calibration data's
KEY_CLIP_WARN = 0.001  # share of keys beyond the calibrated per-channel range


class KVStats:
    """Running per-layer statistics of the K/V the model caches, fed by LLMEngine.observe_kv.
    With ``reference`` (calibrated key absmax), also counts keys beyond it."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int,
                 reference: torch.Tensor | None = None) -> None:
        n = num_layers
        self.key_absmax = torch.zeros(n, kv_heads, head_dim)
        self.value_absmax = torch.zeros(n, kv_heads)
        self.key_norm_max = torch.zeros(n)
        self.token_value_absmax: list[list[torch.Tensor]] = [[] for _ in range(n)]
        self.reference = reference
        self.keys_beyond = 0
        self.keys_seen = 0

    def __call__(self, i: int, key: torch.Tensor, value: torch.Tensor) -> None:
        k = key.detach().float().abs()  # [T, heads, dim]
        torch.maximum(self.key_absmax[i], k.amax(dim=0).cpu(), out=self.key_absmax[i])
        self.key_norm_max[i] = max(float(self.key_norm_max[i]), float(k.norm(dim=-1).max()))
        per_token = value.detach().float().abs().amax(dim=-1).cpu()  # [T, heads]
        torch.maximum(self.value_absmax[i], per_token.amax(dim=0), out=self.value_absmax[i])
        self.token_value_absmax[i].append(per_token.flatten())
        if self.reference is not None:
            self.keys_beyond += int((k.cpu() > self.reference[i]).sum())
            self.keys_seen += k.numel()

    def value_percentiles(self, q: float) -> list[float]:
        return [float(torch.quantile(torch.cat(t), q)) if t else 0.0 for t in self.token_value_absmax]


def collect(llm: LLM, token_lists: list[list[int]], reference: torch.Tensor | None = None,
            progress: bool = True) -> KVStats:
    """Run every sample through the model (prefill only, nothing from the prefix cache) and
    gather the statistics of the K/V it writes."""
    engine = llm.engine
    cfg = engine.model_config
    stats = KVStats(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, reference)
    with engine.observe_kv(stats):
        llm.generate(token_lists, SamplingParams(max_tokens=1, temperature=0), use_tqdm=progress)
    return stats


def load_tokens(llm: LLM, source: str, num_samples: int, max_length: int, pack: bool = False) -> list[list[int]]:
    """Up to ``num_samples`` token lists of at most ``max_length`` tokens; with ``pack``, the
    samples are concatenated and cut into ``max_length`` windows (long contexts from short texts)."""
    samples = read_samples(source)
    if not samples:
        raise ConfigError(f"--data {source!r} holds no samples")
    if not pack:
        token_lists = tokenize(samples[:num_samples], llm.engine.encode, llm.apply_chat_template)
        return [t[:max_length] for t in token_lists if t]
    stream = token_stream(samples, llm.engine.encode, llm.apply_chat_template, num_samples * max_length)
    return [stream[i : i + max_length] for i in range(0, len(stream), max_length)]


def calibrate(llm: LLM, source: str, num_samples: int, max_length: int, progress: bool = True,
              pack: bool = False) -> KVScales:
    return scales_from_tokens(llm, load_tokens(llm, source, num_samples, max_length, pack), source, progress)


def scales_from_tokens(llm: LLM, token_lists: list[list[int]], source: str, progress: bool = True) -> KVScales:
    """Calibrated scales from the K/V the model writes for ``token_lists`` (``source`` names them)."""
    stats = collect(llm, token_lists, progress=progress)
    engine = llm.engine
    return KVScales(
        model_name=engine.config.model_config.model, fingerprint=engine.fingerprint, key_absmax=stats.key_absmax,
        value_absmax=stats.value_absmax, key_norm_max=stats.key_norm_max.tolist(),
        value_token_absmax_p50=stats.value_percentiles(0.5),
        value_token_absmax_p99=stats.value_percentiles(0.99), num_samples=len(token_lists),
        num_tokens=sum(len(t) for t in token_lists), lengths=length_summary([len(t) for t in token_lists]),
        source=source)


class CheckReport(NamedTuple):
    lengths: dict[str, float]  # the other dataset's
    key_clip_ratio: float  # its keys beyond the calibrated per-channel range
    channels_over: float  # share of (layer, head, channel) whose range exceeds the calibrated one by 25%
    value_p99_ratio: float  # its per-token |V| p99 / the calibration's (median over layers)
    warnings: list[str]


def check(llm: LLM, scales: KVScales, source: str, num_samples: int, max_length: int,
          progress: bool = True, pack: bool = False) -> CheckReport:
    """Compare another dataset's K/V statistics and lengths with a scales file."""
    token_lists = load_tokens(llm, source, num_samples, max_length, pack)
    stats = collect(llm, token_lists, reference=scales.key_absmax, progress=progress)
    lengths = length_summary([len(t) for t in token_lists])
    clip = stats.keys_beyond / max(stats.keys_seen, 1)
    over = float((stats.key_absmax > 1.25 * scales.key_absmax).float().mean())
    ratios = [o / c for o, c in zip(stats.value_percentiles(0.99), scales.value_token_absmax_p99, strict=False)
              if c > 0]
    value_ratio = float(torch.tensor(ratios).median()) if ratios else 1.0
    warnings = []
    calib = scales.lengths
    for q in ("p50", "p90"):
        if calib.get(q) and lengths.get(q):
            ratio = lengths[q] / calib[q]
            if ratio > LENGTH_RATIO_WARN:  # longer than calibrated: the dangerous direction
                warnings.append(
                    f"token lengths differ: {q} {lengths[q]:.0f} here vs {calib[q]:.0f} in the calibration data "
                    f"({ratio:.1f}x); scales calibrated on short sequences clip long-context keys (seed §4.2)")
                break
    if clip > KEY_CLIP_WARN:
        warnings.append(f"{100 * clip:.3f}% of this data's keys lie beyond the calibrated per-channel range "
                        f"({100 * over:.1f}% of channels exceed it by >25%): static int8/int4 key scales would "
                        f"clip them; recalibrate on data like this or use --kv-key-scales block")
    if value_ratio > LENGTH_RATIO_WARN:
        warnings.append(f"per-token |V| p99 is {value_ratio:.1f}x the calibration's: fp8's static value scale "
                        f"would clip")
    return CheckReport(lengths, clip, over, value_ratio, warnings)


def add_calibrate_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="alias, .gguf file or HF folder")
    parser.add_argument("--data", default=None,
                        help="calibration data: .jsonl (text/prompt/messages), plain text, "
                             "or builtin:stdlib-docstrings")
    parser.add_argument("--num-samples", type=int, default=256)
    parser.add_argument("--max-length", type=int, default=2048, help="tokens kept per sample")
    parser.add_argument("--pack", action="store_true",
                        help="concatenate the samples and cut them into --max-length windows (long contexts)")
    parser.add_argument("--out", default="kv_scales.json", help="scales file to write (with --data)")
    parser.add_argument("--scales", default=None, help="existing scales file for --check (default: --out)")
    parser.add_argument("--check", default=None, help="another dataset to compare with the scales file")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--kv-cache-memory", default="1GiB")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def cmd_calibrate(args: argparse.Namespace) -> int:
    if args.data is None and args.check is None:
        raise ConfigError("give --data (to calibrate) and/or --check (to compare a dataset with a scales file)")
    for name in ("num_samples", "max_length"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    llm = LLM(args.model, dtype=args.dtype, kv_cache_memory=args.kv_cache_memory, enable_prefix_caching=False)
    if args.data is not None:
        scales = calibrate(llm, args.data, args.num_samples, args.max_length, progress=not args.quiet,
                           pack=args.pack)
        scales.save(args.out)
        lengths = scales.lengths
        print(f"wrote {args.out}: {scales.num_samples} samples, {scales.num_tokens} tokens (length p50 "
              f"{lengths.get('p50', 0):.0f}, p90 {lengths.get('p90', 0):.0f}, max {lengths.get('max', 0):.0f}); "
              f"key |K| max per channel: median {scales.key_absmax.median():.2f}, max {scales.key_absmax.max():.2f}; "
              f"|V| max {scales.value_absmax.max():.2f}")
    if args.check is not None:
        scales = KVScales.load(args.scales or args.out)
        engine = llm.engine
        cfg = engine.model_config
        scales.check_model(args.model, engine.fingerprint, (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim))
        report = check(llm, scales, args.check, args.num_samples, args.max_length, progress=not args.quiet,
                       pack=args.pack)
        print(f"check {args.check}: length p50 {report.lengths.get('p50', 0):.0f} / p90 "
              f"{report.lengths.get('p90', 0):.0f} (calibration {scales.lengths.get('p50', 0):.0f} / "
              f"{scales.lengths.get('p90', 0):.0f}); keys beyond the calibrated range "
              f"{100 * report.key_clip_ratio:.4f}%; channels over by >25%: {100 * report.channels_over:.1f}%; "
              f"per-token |V| p99 ratio {report.value_p99_ratio:.2f}")
        for warning in report.warnings:
            print(f"WARNING: {warning}", file=sys.stderr)
        if not report.warnings:
            print("the scales file matches this data")
    return 0
