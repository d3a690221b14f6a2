"""KV eviction: what keeping StreamingLLM's positions right costs, three ways, on SmolLM2's shapes.

    python benchmarks/kv_eviction.py --out docs/results/kv_eviction.json

StreamingLLM puts every cached token at its position within the cache. When a block is evicted
the tokens after it move bs positions earlier, and keys are cached after RoPE, so either
- **window**: re-rotate every cached key of the window by -bs at each eviction (in place);
- **read**: store keys before RoPE and rotate the whole window at every attention read;
- **sinks** (kvserve's): keep queries and window keys at their absolute positions (RoPE scores
  depend only on q - k, so their distances are already the cache's) and turn only the sink
  keys by the evicted count, from their keys as first written.
Per decode step (bf16, 30 layers, 3 KV heads of 64, block size 16, 4 sink tokens): the time each
way adds, amortized over the bs steps between evictions, and the error that in-place
re-rotation accumulates in bf16 keys over the W / bs evictions a key lives through.

    python benchmarks/kv_eviction.py --ppl-curve 20480 --out docs/results/kv_eviction_curve.json

scores the built-in held-out text teacher-forced in chunks of 32 tokens, one sequence of that
many tokens, with the full cache (up to SmolLM2's 8,192 positions), StreamingLLM (4 sink tokens,
a 1,024-token window) and the window alone, checks the streaming request's blocks after every
chunk, and plots the negative log-likelihood per 1,024 tokens (kv_eviction_curve.png).

    python benchmarks/kv_eviction.py --generate-curve 20000 --out docs/results/kv_eviction_generate.json

samples 20,000 tokens in one request (temperature 1, seed 0) with 4 sinks and a 1,024-token
window, checks its blocks after every token, and plots the NLL of the sampled tokens per 1,024
(kv_eviction_generate.png), with the full cache's run up to SmolLM2's 8,192 positions.

    python benchmarks/kv_eviction.py --kvpress /path/to/kvpress-venv/bin/python \
        --out docs/results/kv_eviction_kvpress.json

compares kvserve's StreamingLLM and SnapKV with kvpress's presses on SmolLM2 (float32, the same
token ids) at compression ratios 0.25, 0.5 and 0.75 (the fraction of the prompt removed):
passkey retrieval at 1k and 2k tokens (the classic repeated haystack, the key at 10 depths), and
KL / top-1 agreement of the teacher-forced full-cache answer to questions about 1k- and 2k-token
held-out texts. Both compress the whole prompt once after its prefill (kvserve streaming: a
per-request window of the kept count less the sinks; SnapKV: a 64-token observation window,
kvpress's default), and each is scored against its own full cache.

    python benchmarks/kv_eviction.py --kvpress /path/to/kvpress-venv/bin/python --ppl \
        --out docs/results/kv_eviction_kvpress_ppl.json

scores 4,096 held-out tokens in windows of 2,048, teacher-forced in chunks of 32 (as ``kvserve
eval``), with the full cache and StreamingLLM (4 sinks; windows 256, 512, 1024) in kvserve and
in kvpress (``DecodingPress(StreamingLLMPress)``, compressing after every chunk).

    python benchmarks/kv_eviction.py --snapkv-heads --out docs/results/kv_eviction_snapkv_heads.json

kvserve alone, on the same samples: SnapKV keeping a set of tokens per KV head (the paper's
choice, kvserve's) against one set per layer (the votes summed over the layer's KV heads: what
a block table shared by the heads would need), at ratios 0.25, 0.5 and 0.75, with the paired
difference in mean KL over the questions.

    python benchmarks/kv_eviction.py --capacity --out docs/results/kv_eviction_capacity.json

what kvpress cannot report: 16 questions about 2,048-token held-out texts with 128 output tokens
each, then 16 about 1,024-token texts with 512 each, in a KV pool that holds four of them whole
(bf16 model, chunked prefill of a whole prompt): the
most sequences running at once, preemptions, and output tok/s, with the full cache, SnapKV
keeping 50% and 25% of each prompt, and StreamingLLM with a 512-token window.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))
from kv_eviction_kvpress import (
    STORY,
    kvpress_ppl,
    kvpress_quality,
    quality_samples,
    report_from_json,
    snapkv_heads,
)
from workloads import cpu_name

from kvserve.cache.kv_cache import PagedKVCache
from kvserve.cache.kv_groups import cdiv
from kvserve.config import EngineConfig
from kvserve.engine.engine import LLMEngine
from kvserve.engine.loading import load_model
from kvserve.engine.sampling import SamplingParams
from kvserve.llm import LLM, chat_token_ids
from kvserve.model.loader import ModelConfig
from kvserve.model.rope import apply_rope, rope_at, rope_inv_freq

LAYERS, KV_HEADS, HEAD_DIM, BLOCK, SINK_BLOCKS = 30, 3, 64, 16, 1


def timed(fn: Any, repeats: int = 20) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def costs(window: int, inv_freq: torch.Tensor) -> dict[str, float]:
    """Milliseconds per decode step each way adds at this window."""
    blocks = window // BLOCK + SINK_BLOCKS + 1
    cache = PagedKVCache(LAYERS, blocks + 1, BLOCK, KV_HEADS, HEAD_DIM, torch.bfloat16, torch.device("cpu"))
    for layer in cache.storage:
        layer.data.normal_()
    window_ids = list(range(1 + SINK_BLOCKS, blocks + 1))
    sink_ids = list(range(1, 1 + SINK_BLOCKS))
    cos, sin = rope_at(torch.tensor([-BLOCK]), inv_freq)
    originals = cache.read_blocks(sink_ids)
    turn_cos, turn_sin = rope_at(torch.tensor([4096]), inv_freq)

    def turn(ids: list[int], blocks: list[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor) -> None:
        for layer in blocks:  # the keys turned; the blocks rewritten whole, as LLMEngine.evict does
            layer[:, :KV_HEADS] = apply_rope(layer[:, :KV_HEADS], cos[0], sin[0])
        cache.write_blocks(ids, blocks)

    def rerotate_window() -> None:
        turn(window_ids, cache.read_blocks(window_ids), cos, sin)

    def turn_sinks() -> None:
        turn(sink_ids, [layer.clone() for layer in originals], turn_cos, turn_sin)

    positions = torch.arange(window)
    read_cos, read_sin = rope_at(positions, inv_freq)
    read_cos, read_sin = read_cos.to(torch.bfloat16)[:, None], read_sin.to(torch.bfloat16)[:, None]
    raw = [torch.randn(window, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16) for _ in range(LAYERS)]

    def rotate_at_read() -> None:  # every layer's window, every step (the torch path's cost)
        for keys in raw:
            apply_rope(keys, read_cos, read_sin)

    return {"window_per_eviction_ms": 1000 * timed(rerotate_window),
            "window_per_step_ms": 1000 * timed(rerotate_window) / BLOCK,
            "read_per_step_ms": 1000 * timed(rotate_at_read),
            "sinks_per_eviction_ms": 1000 * timed(turn_sinks),
            "sinks_per_step_ms": 1000 * timed(turn_sinks) / BLOCK}


def accumulated_error(window: int, inv_freq: torch.Tensor) -> dict[str, float]:
    """Relative error of bf16 keys turned by -bs once per eviction over a window's lifetime,
    against one turn by the total (what turning from the original keys gives)."""
    torch.manual_seed(0)
    keys = torch.randn(4096, KV_HEADS, HEAD_DIM).to(torch.bfloat16)
    steps = window // BLOCK
    cos, sin = rope_at(torch.tensor([-BLOCK]), inv_freq)
    stepwise = keys
    for _ in range(steps):
        stepwise = apply_rope(stepwise.float(), cos[0], sin[0]).to(torch.bfloat16)
    cos_all, sin_all = rope_at(torch.tensor([-BLOCK * steps]), inv_freq)
    exact = apply_rope(keys.float(), cos_all[0], sin_all[0])
    once = exact.to(torch.bfloat16)
    norm = exact.norm(dim=-1)
    return {"evictions": steps,
            "stepwise_rel_error": float(((stepwise.float() - exact).norm(dim=-1) / norm).mean()),
            "once_rel_error": float(((once.float() - exact).norm(dim=-1) / norm).mean())}


def nll_curve(engine: LLMEngine, tokens: list[int], chunk: int, bound: int | None) -> list[float]:
    """Negative log-likelihood of each next token, teacher-forced chunk by chunk through the
    engine as ``kvserve eval`` scores (evicting before each chunk when it streams); ``bound``: the
    most blocks the request may hold, checked after every chunk."""
    from tqdm import tqdm

    nll: list[float] = []
    for start, logprobs in tqdm(engine.score(tokens, chunk), total=-(-len(tokens) // chunk),
                                desc=engine.config.eviction_config.kv_eviction, unit="chunk", mininterval=10):
        if bound is not None:
            assert len(engine.kv_manager.block_tables["eval"][0]) <= bound, "the streaming request outgrew its bound"
        targets = torch.tensor(tokens[start + 1 : start + 1 + len(logprobs)])
        nll += (-logprobs[: len(targets)].float().gather(1, targets[:, None])[:, 0]).tolist()
    return nll


def ppl_curve(num_tokens: int, out: Path | None, chunk: int = 32, window: int = 1024) -> None:
    from kvserve.quant.data import read_samples, token_stream

    loaded = load_model("smollm2-135m", torch.device("cpu"), torch.float32)
    tokenizer = loaded.tokenizer
    assert tokenizer is not None
    tokens = token_stream(read_samples("builtin:python-reference"), lambda text: list(tokenizer.encode(text)),
                          lambda messages: chat_token_ids(tokenizer, messages), num_tokens)
    limit = loaded.config.max_position_embeddings
    curves: dict[str, list[float]] = {}
    for name, kwargs, length in (
            ("full cache", {}, min(num_tokens, limit)),
            (f"streaming (4 sinks + {window})", {"kv_eviction": "streaming", "kv_window": window}, num_tokens),
            (f"window {window} alone", {"kv_eviction": "streaming", "kv_window": window, "kv_sink_tokens": 0},
             num_tokens)):
        engine = LLMEngine(EngineConfig.from_settings(model="smollm2-135m", dtype="float32", kv_cache_memory="2GiB",
                                        enable_prefix_caching=False, max_num_batched_tokens=chunk, **kwargs),
                           loaded=loaded)
        window = engine.eviction.default_window
        bound = window.blocks_held(16, chunk) if window is not None else None
        curves[name] = nll_curve(engine, tokens[:length], chunk, bound)
    bucket = 1024
    table = bucket_means(curves, bucket)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"cpu": cpu_name(), "chunk": chunk, "window": window, "bucket": bucket,
                                   "model_positions": limit, "mean_nll_per_bucket": table}, indent=1))
        plot_buckets(table, bucket, limit, "SmolLM2-135M, teacher-forced held-out text", out)


def generate_curve(num_tokens: int, out: Path | None, window: int = 1024) -> None:
    """One request sampling ``num_tokens`` tokens (temperature 1, seeded) with StreamingLLM: its
    blocks checked after every token against their bound, and the NLL of each sampled token (the
    model's own distribution) per 1,024 tokens; the full cache's run of the same prompt and seed
    up to SmolLM2's positions for reference."""
    from tqdm import tqdm

    loaded = load_model("smollm2-135m", torch.device("cpu"), torch.float32)
    limit = loaded.config.max_position_embeddings
    curves: dict[str, list[float]] = {}
    held: dict[str, list[int]] = {}
    for name, kwargs in (("full cache", {}),
                         (f"streaming (4 sinks + {window})", {"kv_eviction": "streaming", "kv_window": window})):
        llm = LLM(loaded=loaded, dtype="float32", kv_cache_memory="2GiB", enable_prefix_caching=False, **kwargs)
        prompt = llm.apply_chat_template([{"role": "user", "content": STORY}])
        total = num_tokens if kwargs else limit - len(prompt)
        params = SamplingParams(max_tokens=total, temperature=1.0, seed=0, ignore_eos=True, logprobs=0)
        engine = llm.engine
        window = engine.eviction.default_window
        bound = window.blocks_held(16) if window is not None else None
        blocks: list[int] = []
        request = engine.add_request(prompt, params)
        with tqdm(total=total, desc=name, unit="tok", mininterval=10) as bar:
            while not request.finished:
                engine.step()
                tables = engine.kv_manager.block_tables.get(request.request_id)
                used = len(tables[0]) if tables else 0
                assert bound is None or used <= bound, f"the streaming request holds {used} blocks, bound {bound}"
                blocks.append(used)
                bar.update(len(request.output_token_ids) - bar.n)
        assert len(request.output_token_ids) == total
        curves[name], held[name] = [-lp for lp in request.output_logprobs], blocks
        del llm
    bucket = 1024
    table = bucket_means(curves, bucket)
    for name, blocks in held.items():
        print(f"{name:28s} blocks held: max {max(blocks)}, over the last half "
              f"{min(blocks[len(blocks) // 2:])}..{max(blocks[len(blocks) // 2:])}")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"cpu": cpu_name(), "window": window, "bucket": bucket, "model_positions": limit,
                                   "mean_nll_per_bucket": table,
                                   "blocks_held": {n: {"max": max(b), "last_half_min": min(b[len(b) // 2:]),
                                                       "last_half_max": max(b[len(b) // 2:])}
                                                   for n, b in held.items()}}, indent=1))
        plot_buckets(table, bucket, limit, "SmolLM2-135M, its own sampled text (temperature 1)", out)


def bucket_means(curves: dict[str, list[float]], bucket: int) -> dict[str, list[float]]:
    """Each curve's mean per ``bucket`` tokens (the last bucket may be shorter), printed."""
    table = {name: [sum(c[i : i + bucket]) / len(c[i : i + bucket]) for i in range(0, len(c), bucket)]
             for name, c in curves.items()}
    for name, values in table.items():
        print(f"{name:28s} " + " ".join(f"{v:.2f}" for v in values))
    return table


def plot_buckets(table: dict[str, list[float]], bucket: int, limit: int, title: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, values in table.items():
        ax.plot([bucket * (i + 0.5) for i in range(len(values))], values, marker="o", label=name)
    ax.axvline(limit, color="grey", linestyle=":", label=f"SmolLM2's {limit} positions")
    ax.set_xlabel("token position")
    ax.set_ylabel(f"mean NLL per {bucket} tokens")
    ax.set_title(title)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=2, fontsize="small")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=100)


def capacity(out: Path | None, requests: int = 16,
             workloads: tuple[tuple[int, int], ...] = ((2048, 128), (1024, 512))) -> None:
    """Concurrency and throughput gained at a fixed pool, per (prompt, output) length (see the
    module docstring)."""
    loaded = load_model("smollm2-135m", torch.device("cpu"), torch.bfloat16)
    results, tables = [], []
    for length, output in workloads:
        rows, pool = capacity_rows(loaded, requests, length, output)
        base = rows[0]["output_tok_s"]
        lines = [f"{requests} requests of {length} prompt + {output} output tokens, a pool of "
                 f"{pool / 2**20:.1f} MiB (four whole sequences):", "",
                 "| config | peak running | preemptions | output tok/s | vs full cache | wall s |", "|---" * 6 + "|"]
        for r in rows:
            lines.append(f"| {r['config']} | {r['peak_running']} | {r['preemptions']} | {r['output_tok_s']:.1f} | "
                         f"{r['output_tok_s'] / base:.2f}x | {r['seconds']:.1f} |")
        tables.append("\n".join(lines))
        print(tables[-1], flush=True)
        results.append({"prompt_tokens": length, "output_tokens": output, "pool_bytes": pool, "rows": rows})
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"cpu": cpu_name(), "requests": requests, "workloads": results,
                                   "table": "\n\n".join(tables)}, indent=1))


def capacity_rows(loaded: Any, requests: int, length: int, output: int) -> tuple[list[dict[str, Any]], int]:
    common: dict[str, Any] = {"dtype": "bfloat16", "enable_prefix_caching": False, "max_num_seqs": requests,
                              "max_num_batched_tokens": length, "block_size": 16}
    probe = LLM(loaded=loaded, kv_cache_memory="64MiB", **common)
    samples = quality_samples(probe, (length,), depths=0, questions=requests)
    pool = 4 * cdiv(length + output, 16) * probe.engine.kv_block_bytes + probe.engine.kv_tail_bytes
    del probe
    params = SamplingParams(max_tokens=output, temperature=0, ignore_eos=True)
    rows = []
    for name, extra in (("full cache", {}),
                        ("snapkv keeps 50%", {"kv_eviction": "snapkv", "kv_compression_ratio": 0.5}),
                        ("snapkv keeps 25%", {"kv_eviction": "snapkv", "kv_compression_ratio": 0.25}),
                        ("streaming 4 + 512", {"kv_eviction": "streaming", "kv_window": 512})):
        llm = LLM(loaded=loaded, kv_cache_memory=str(pool), **common, **extra)
        llm.generate([samples[0]["prompt"]], SamplingParams(max_tokens=4))  # warm-up
        start = time.perf_counter()
        outs = llm.generate([s["prompt"] for s in samples], params, use_tqdm=True)
        seconds = time.perf_counter() - start
        stats = llm.kv_stats()
        rows.append({"config": name, "seconds": seconds, "output_tok_s": sum(len(o.token_ids) for o in outs) / seconds,
                     "peak_running": stats.peak_num_requests, "preemptions": stats.num_preemptions,
                     "pool_blocks": stats.num_blocks, "peak_blocks_used": stats.peak_blocks_used})
        print(rows[-1], flush=True)
        del llm
    return rows, pool


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--windows", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--ppl-curve", type=int, default=0, metavar="TOKENS",
                        help="only score one sequence of this many held-out tokens (see the module docstring)")
    parser.add_argument("--generate-curve", type=int, default=0, metavar="TOKENS",
                        help="only sample this many tokens with StreamingLLM (see the module docstring)")
    parser.add_argument("--kvpress", default=None, metavar="PYTHON",
                        help="compare with kvpress run by this venv's python (see the module docstring)")
    parser.add_argument("--report", type=Path, default=None, metavar="JSON",
                        help="recompute the tables of a --kvpress run from its --out file")
    parser.add_argument("--ppl", action="store_true", help="with --kvpress: StreamingLLM's perplexity")
    parser.add_argument("--capacity", action="store_true", help="concurrency and throughput in a fixed pool")
    parser.add_argument("--snapkv-heads", action="store_true",
                        help="SnapKV's kept sets per KV head against one per layer (see the module docstring)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(2)
    if args.capacity:
        capacity(args.out)
        return
    if args.snapkv_heads:
        snapkv_heads(args.out)
        return
    if args.generate_curve:
        generate_curve(args.generate_curve, args.out)
        return
    if args.report:
        report_from_json(args.report)
        return
    if args.kvpress:
        (kvpress_ppl if args.ppl else kvpress_quality)(args.kvpress, args.out)
        return
    if args.ppl_curve:
        ppl_curve(args.ppl_curve, args.out)
        return
    config = ModelConfig(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_layers=LAYERS, num_heads=9, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, rms_norm_eps=1e-5,
                         rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True)
    inv_freq = rope_inv_freq(config)
    rows = []
    for window in args.windows:
        row = {"window": window, **costs(window, inv_freq), **accumulated_error(window, inv_freq)}
        rows.append(row)
        print(f"W={window:5d}: re-rotate window {row['window_per_eviction_ms']:.3f} ms/eviction "
              f"({row['window_per_step_ms']:.3f} ms/step), rotate at read {row['read_per_step_ms']:.3f} ms/step, "
              f"turn sinks {row['sinks_per_eviction_ms']:.3f} ms/eviction ({row['sinks_per_step_ms']:.4f} ms/step); "
              f"bf16 error after {row['evictions']} in-place turns {100 * row['stepwise_rel_error']:.2f}% "
              f"vs one turn {100 * row['once_rel_error']:.2f}%", flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"cpu": cpu_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
