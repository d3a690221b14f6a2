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
import math
import os
import sys
import time
from pathlib import Path
from statistics import mean, stdev
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))
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


STORY = "Tell me a long story about a lighthouse keeper."
HAYSTACK = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
QUESTIONS = ("What is the text above about? Answer in two sentences.",
             "Which Python feature does the text above explain first, and how is it used?",
             "Write a short Python example that follows the text above.")
RATIOS = (0.25, 0.5, 0.75)  # fraction of the prompt removed (kvpress's compression_ratio)
SINKS, OBSERVATION_WINDOW = 4, 64


def quality_samples(llm: LLM, lengths: tuple[int, ...], depths: int, questions: int) -> list[dict[str, Any]]:
    """Passkey prompts (the key at ``depths`` depths) and questions about held-out text, each
    about ``length`` tokens in SmolLM2's chat template."""
    import random

    from kvserve.quant.data import read_samples

    tokenizer = llm.tokenizer
    assert tokenizer is not None
    rng = random.Random(0)
    texts = [s for s in read_samples("builtin:python-reference") if isinstance(s, str)]
    text_ids = tokenizer.encode("\n\n".join(texts))
    hay_ids = tokenizer.encode(HAYSTACK * 400)
    samples = []

    def fill(ids: list[int], at: int, n: int) -> str:
        return str(tokenizer.decode(ids[at : at + n]))

    for length in lengths:
        for i in range(depths):
            key = rng.randint(10000, 99999)
            needle = f"\nThe pass key is {key}. Remember it. {key} is the pass key.\n"
            head, question = "There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it.\n", \
                "\nWhat is the pass key?"
            n = length - len(llm.apply_chat_template([{"role": "user", "content": head + needle + question}])) - 4
            at = int(n * (i + 0.5) / depths)
            content = head + fill(hay_ids, 0, at) + needle + fill(hay_ids, at, n - at) + question
            prompt = llm.apply_chat_template([{"role": "user", "content": content}])
            prompt += tokenizer.encode("The pass key is")
            samples.append({"kind": "passkey", "length": length, "key": str(key), "depth": (i + 0.5) / depths,
                            "prompt": prompt, "max_tokens": 8})
        for i in range(questions):
            ask = QUESTIONS[i % len(QUESTIONS)]
            n = length - len(llm.apply_chat_template([{"role": "user", "content": ask}])) - 2
            content = fill(text_ids, i * 3000, n) + "\n\n" + ask
            samples.append({"kind": "qa", "length": length, "prompt": llm.apply_chat_template(
                [{"role": "user", "content": content}]), "max_tokens": 32})
    return samples


def kvserve_press(llm: LLM, method: str, ratio: float, sample: dict[str, Any],
                  answer: list[int] | None) -> dict[str, Any]:
    """One sample through kvserve compressing ``ratio`` of its prompt (``llm`` set up for the
    method): the greedy answer, the teacher-forced log-probabilities of ``answer[1:]`` (None:
    of the greedy answer) and the prompt tokens kept."""
    prompt = sample["prompt"]
    kept_target = int(len(prompt) * (1 - ratio))
    window = kept_target - SINKS if method == "streaming" else None
    params = SamplingParams(max_tokens=sample["max_tokens"], temperature=0, kv_window=window,
                            kv_eviction="streaming" if window else None)
    generated = list(llm.generate([prompt], params)[0].token_ids)
    answer = generated if answer is None else answer
    engine = llm.engine
    if window is not None:
        pool_blocks = engine.kv_manager.pool.num_usable_blocks
        engine.kv_manager.set_window("eval", engine.eviction.request_window(params, pool_blocks))
    tokens = prompt + answer[:-1]
    kept, rows = len(prompt), []
    for start, logprobs in engine.score(tokens, len(tokens), prompt_len=len(prompt)):
        if start == len(prompt):
            kept = engine.kv_manager.num_tokens["eval"] - len(answer) + 1
            rows.append(logprobs)
    engine.kv_manager.forget("eval")
    return {"answer": generated, "kept": kept, "logprobs": torch.cat(rows)[: len(answer) - 1]}


def run_kvpress(python: str, cases: dict[str, Any]) -> dict[str, Any]:
    """kvpress_runner.py on ``cases`` in kvpress's venv; its JSON result."""
    import subprocess
    import tempfile

    from throughput import export_hf_folder

    folder = export_hf_folder(Path(tempfile.gettempdir()) / "kvserve-smollm2-hf")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "cases.json"
        path.write_text(json.dumps({"model": str(folder), **cases}))
        result = Path(tmp) / "kvpress.json"
        subprocess.run([python, os.path.join(os.path.dirname(__file__), "kvpress_runner.py"), "--cases", str(path),
                        "--out", str(result)], check=True)
        return dict(json.loads(result.read_text()))


def kvpress_ppl(python: str, out: Path | None, windows: tuple[int, ...] = (256, 512, 1024),
                num_tokens: int = 4096, context: int = 2048, chunk: int = 32) -> None:
    """StreamingLLM's perplexity in kvserve and kvpress, one run (see the module docstring)."""
    from kvserve.quant.data import read_samples, token_stream
    from kvserve.quant.evaluate import Variant, evaluate

    loaded = load_model("smollm2-135m", torch.device("cpu"), torch.float32)
    tokenizer = loaded.tokenizer
    assert tokenizer is not None
    tokens = token_stream(read_samples("builtin:python-reference"), lambda text: list(tokenizer.encode(text)),
                          lambda messages: chat_token_ids(tokenizer, messages), num_tokens)
    reference = Variant("full cache", "auto", "auto")
    variants = [reference] + [reference._replace(name=f"streaming {w}", kv_eviction="streaming", kv_window=w)
                              for w in windows]
    ours = evaluate(loaded, "smollm2-135m", tokens, variants, context=context, chunk=chunk, kv_scales=None,
                    kv_cache_memory="1GiB", block_size=16, kv_sink_tokens=SINKS)
    theirs = run_kvpress(python, {"ppl": {"tokens": tokens, "context": context, "chunk": chunk,
                                          "windows": list(windows), "sinks": SINKS}})["ppl"]
    rows = []
    twins = [theirs[0]] + [next(t for t in theirs if t["name"] == name and t["window"] == w)
                           for w in windows for name in ("streaming", "streaming-ordered")]
    for r, t in zip([ours[0]] + [o for o in ours[1:] for _ in range(2)], twins, strict=True):
        ppl = math.exp(t["nll"] / t["count"])
        config = r.name if t["name"] != "streaming-ordered" else f"{r.name} vs kvpress time-ordered"
        rows.append({"config": config, "kvserve_ppl": r.ppl, "kvpress_ppl": ppl, "kvserve_kl": r.mean_kl,
                     "kvpress_kl": t["kl"] / t["count"], "kvserve_top1": r.top1_agreement,
                     "kvpress_top1": t["agree"] / t["count"], "kvserve_s": r.seconds, "kvpress_s": t["seconds"]})
    base_ours, base_theirs = rows[0]["kvserve_ppl"], rows[0]["kvpress_ppl"]
    lines = ["| config | kvserve PPL | kvpress PPL | kvserve ΔPPL | kvpress ΔPPL | kvserve KL | kvpress KL "
             "| kvserve top-1 | kvpress top-1 |", "|---" * 9 + "|"]
    for r in rows:
        lines.append(f"| {r['config']} | {r['kvserve_ppl']:.3f} | {r['kvpress_ppl']:.3f} | "
                     f"{100 * (r['kvserve_ppl'] / base_ours - 1):+.1f}% | "
                     f"{100 * (r['kvpress_ppl'] / base_theirs - 1):+.1f}% | "
                     f"{r['kvserve_kl']:.4f} | {r['kvpress_kl']:.4f} | {100 * r['kvserve_top1']:.1f}% | "
                     f"{100 * r['kvpress_top1']:.1f}% |")
    print("\n".join(lines))
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"cpu": cpu_name(), "tokens": num_tokens, "context": context, "chunk": chunk,
                                   "sinks": SINKS, "rows": rows, "table": "\n".join(lines)}, indent=1))


COMMON: dict[str, Any] = {"dtype": "float32", "kv_cache_memory": "512MiB", "enable_prefix_caching": False,
                          "max_num_batched_tokens": 4096, "max_num_seqs": 1}


def full_cache_samples(loaded: Any) -> tuple[list[dict[str, Any]], list[torch.Tensor]]:
    """The quality samples, each with kvserve's full-cache greedy answer (what every run
    teacher-forces), and that answer's full-cache log-probabilities."""
    full = LLM(loaded=loaded, **COMMON)
    samples = quality_samples(full, (1024, 2048), depths=10, questions=6)
    reference = []
    for sample in samples:
        row = kvserve_press(full, "none", 0.0, sample, None)
        sample["answer"] = row["answer"]
        reference.append(row["logprobs"])
    return samples, reference


def kvserve_run(loaded: Any, method: str, ratio: float, samples: list[dict[str, Any]],
                reference: list[torch.Tensor], per_layer: bool = False) -> dict[str, Any]:
    """Every sample through kvserve with ``method`` removing ``ratio`` of its prompt: answers,
    kept counts, and per answer token the KL from the full cache and top-1 agreement."""
    extra = ({"kv_eviction": "streaming", "kv_window": 4096, "kv_sink_tokens": SINKS}
             if method == "streaming" else {"kv_eviction": "snapkv", "kv_compression_ratio": 1 - ratio,
                                            "kv_observation_window": OBSERVATION_WINDOW,
                                            "kv_compression_per_layer": per_layer})
    llm = LLM(loaded=loaded, **COMMON, **extra)
    start, rows = time.perf_counter(), []
    for sample, ref in zip(samples, reference, strict=True):
        row = kvserve_press(llm, method, ratio, sample, sample["answer"])
        logprobs = row.pop("logprobs")
        row["kl"] = (ref.exp() * (ref - logprobs)).sum(-1).tolist()
        row["agree"] = (logprobs.argmax(-1) == ref.argmax(-1)).tolist()
        rows.append(row)
    print(f"kvserve {method} {ratio}: {time.perf_counter() - start:.1f} s", flush=True)
    return {"method": method, "ratio": ratio, "seconds": time.perf_counter() - start, "samples": rows}


def kvpress_quality(python: str, out: Path | None) -> None:
    """kvserve against kvpress in one run (see the module docstring)."""
    loaded = load_model("smollm2-135m", torch.device("cpu"), torch.float32)
    samples, reference = full_cache_samples(loaded)
    ours = [kvserve_run(loaded, method, ratio, samples, reference)
            for method in ("streaming", "snapkv") for ratio in RATIOS]
    theirs = run_kvpress(python, {"window": OBSERVATION_WINDOW, "sinks": SINKS, "samples": samples,
                                  "presses": [{"method": m, "ratio": r} for m in
                                              ("streaming", "streaming-rerotated", "snapkv") for r in RATIOS]})
    report = quality_report(samples, ours, theirs, decoder(loaded))
    print(report["table"])
    save_quality(out, samples, {"kvserve": ours, "kvpress": theirs, **report})


def decoder(loaded: Any) -> Any:
    tokenizer = loaded.tokenizer
    assert tokenizer is not None
    return lambda ids: str(tokenizer.decode(ids, skip_special_tokens=True))


def save_quality(out: Path | None, samples: list[dict[str, Any]], results: dict[str, Any]) -> None:
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"cpu": cpu_name(), "samples": [{k: v for k, v in s.items() if k != "prompt"}
                                                                  for s in samples], **results}, indent=1))


def snapkv_heads(out: Path | None) -> None:
    """SnapKV with a kept set per KV head (the default) against one set per layer
    (kv_compression_per_layer: the votes summed over its KV heads), on the --kvpress quality
    samples (see the module docstring)."""
    loaded = load_model("smollm2-135m", torch.device("cpu"), torch.float32)
    samples, reference = full_cache_samples(loaded)
    runs = {name: [kvserve_run(loaded, "snapkv", ratio, samples, reference, per_layer) for ratio in RATIOS]
            for name, per_layer in (("per head", False), ("shared per layer", True))}
    save_quality(out, samples, {"runs": runs})  # the measurements first: the tables can be redone from them
    decode = decoder(loaded)
    lengths = sorted({s["length"] for s in samples})
    qa = [i for i, s in enumerate(samples) if s["kind"] == "qa"]
    lines = ["| kept sets | removed | " + " | ".join(f"passkey {n}" for n in lengths) +
             " | mean KL | top-1 | Δ mean KL, shared − per head (± 1.96 SE) |", "|---" * (5 + len(lengths)) + "|"]
    rows = []
    for ratio_index, ratio in enumerate(RATIOS):
        per_head = runs["per head"][ratio_index]
        for name, per_ratio in runs.items():
            run = per_ratio[ratio_index]
            row = run_summary(samples, name, run, decode)
            diff = [mean(run["samples"][i]["kl"]) - mean(per_head["samples"][i]["kl"]) for i in qa]
            row.update(kl_diff=mean(diff), kl_ci=1.96 * stdev(diff) / len(diff) ** 0.5)
            rows.append(row)
            paired = "" if run is per_head else f"{row['kl_diff']:+.4f} ± {row['kl_ci']:.4f}"
            lines.append(f"| {name} | {ratio:.2f} | " + " | ".join(f"{100 * row[f'passkey_{n}']:.0f}%"
                                                                  for n in lengths)
                         + f" | {row['kl']:.4f} | {100 * row['top1']:.1f}% | {paired} |")
    table = "\n".join(lines)
    print(table)
    save_quality(out, samples, {"runs": runs, "rows": rows, "table": table})


def run_summary(samples: list[dict[str, Any]], engine: str, run: dict[str, Any], decode: Any) -> dict[str, Any]:
    """One run's passkey hits per prompt length, mean KL and top-1 agreement over the questions'
    answer tokens, and the mean fraction of the prompt kept."""
    lengths = sorted({s["length"] for s in samples})
    row: dict[str, Any] = {"engine": engine, "method": run["method"], "ratio": run["ratio"]}
    pairs = list(zip(samples, run["samples"], strict=True))
    for length in lengths:
        keys = [(s, r) for s, r in pairs if s["kind"] == "passkey" and s["length"] == length]
        row[f"passkey_{length}"] = sum(s["key"] in decode(r["answer"]) for s, r in keys) / len(keys)
    qa = [r for s, r in pairs if s["kind"] == "qa"]
    row["kl"] = sum(sum(r["kl"]) for r in qa) / sum(len(r["kl"]) for r in qa)
    row["top1"] = sum(sum(r["agree"]) for r in qa) / sum(len(r["agree"]) for r in qa)
    row["kept"] = sum(r["kept"] / len(s["prompt"]) for s, r in pairs) / len(pairs)
    return row


def quality_report(samples: list[dict[str, Any]], ours: list[dict[str, Any]], theirs: dict[str, Any],
                   decode: Any) -> dict[str, Any]:
    """Per engine, method and ratio: passkey hits per length, mean KL and top-1 agreement over
    the questions' answer tokens, and the mean fraction of the prompt kept."""
    lengths = sorted({s["length"] for s in samples})

    full_rows = []
    for engine, answers in (("kvserve", [s["answer"] for s in samples]), ("kvpress", theirs["full_answers"])):
        row = {"engine": engine, "method": "full cache", "ratio": 0.0}
        for length in lengths:
            keys = [(s, a) for s, a in zip(samples, answers, strict=True)
                    if s["kind"] == "passkey" and s["length"] == length]
            row[f"passkey_{length}"] = sum(s["key"] in decode(a) for s, a in keys) / len(keys)
        row.update(kl=0.0, top1=1.0, kept=1.0)
        full_rows.append(row)
    rows = full_rows + [run_summary(samples, "kvserve", r, decode) for r in ours] + \
        [run_summary(samples, "kvpress", r, decode) for r in theirs["presses"]]
    same_full = sum(a == s["answer"] for s, a in zip(samples, theirs["full_answers"], strict=True))
    head = "| engine | method | removed | kept | " + " | ".join(f"passkey {n}" for n in lengths) + \
        " | mean KL | top-1 |"
    lines = [head, "|" + "---|" * (6 + len(lengths))]
    for r in sorted(rows, key=lambda r: (r["ratio"], r["method"].replace("-rerotated", ""), r["engine"])):
        lines.append(f"| {r['engine']} | {r['method']} | {r['ratio']:.2f} | {100 * r['kept']:.1f}% | "
                     + " | ".join(f"{100 * r[f'passkey_{n}']:.0f}%" for n in lengths)
                     + f" | {r['kl']:.4f} | {100 * r['top1']:.1f}% |")
    lines.append(f"\nfull-cache greedy answers identical in kvserve and HF transformers: {same_full}/{len(samples)}")
    lines += ["", "Same method, paired over the questions (kvserve − kvpress, mean ± 1.96 standard errors):", "",
              "| method | removed | Δ mean KL | kvpress mean KL | Δ top-1 (points) | passkey hits kvserve / kvpress |",
              "|---|---|---|---|---|---|"]
    twins = {"streaming": "streaming-rerotated", "snapkv": "snapkv"}
    paired = []
    for run in ours:
        twin = next(t for t in theirs["presses"] if t["method"] == twins[run["method"]] and t["ratio"] == run["ratio"])
        qa = [i for i, s in enumerate(samples) if s["kind"] == "qa"]
        keys = [i for i, s in enumerate(samples) if s["kind"] == "passkey"]
        kl = [mean(run["samples"][i]["kl"]) - mean(twin["samples"][i]["kl"]) for i in qa]
        top1 = [100 * (mean(run["samples"][i]["agree"]) - mean(twin["samples"][i]["agree"])) for i in qa]
        hits = [sum(samples[i]["key"] in decode(r["samples"][i]["answer"]) for i in keys) for r in (run, twin)]
        row = {"method": run["method"], "ratio": run["ratio"], "kl_diff": mean(kl), "kl_ci": 1.96 * stdev(kl) /
               len(kl) ** 0.5, "kvpress_kl": mean(mean(twin["samples"][i]["kl"]) for i in qa),
               "top1_diff": mean(top1), "top1_ci": 1.96 * stdev(top1) / len(top1) ** 0.5, "hits": hits,
               "passkeys": len(keys)}
        paired.append(row)
        lines.append(f"| {row['method']} | {row['ratio']:.2f} | {row['kl_diff']:+.4f} ± {row['kl_ci']:.4f} | "
                     f"{row['kvpress_kl']:.4f} | {row['top1_diff']:+.1f} ± {row['top1_ci']:.1f} | "
                     f"{hits[0]} / {hits[1]} of {len(keys)} |")
    return {"rows": rows, "paired": paired, "table": "\n".join(lines)}


def report_from_json(path: Path) -> None:
    """Recompute --kvpress's tables from its saved results (the prompts rebuilt the same way)."""
    saved = json.loads(path.read_text())
    loaded = load_model("smollm2-135m", torch.device("cpu"), torch.float32)
    llm = LLM(loaded=loaded, dtype="float32", kv_cache_memory="64MiB")
    samples = quality_samples(llm, (1024, 2048), depths=10, questions=6)
    for sample, kept in zip(samples, saved["samples"], strict=True):
        assert kept.get("key") == sample.get("key") and kept["length"] == sample["length"]
        sample["answer"] = kept["answer"]
    tokenizer = loaded.tokenizer
    assert tokenizer is not None
    report = quality_report(samples, saved["kvserve"], saved["kvpress"],
                            lambda ids: str(tokenizer.decode(ids, skip_special_tokens=True)))
    print(report["table"])
    path.write_text(json.dumps({**saved, **report}, indent=1))


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
