"""The kvpress comparison of benchmarks/kv_eviction.py (its --kvpress, --report and --snapkv-heads
modes; the module docstring there describes them): the same SnapKV and StreamingLLM presses in
kvserve and in kvpress, run in kvpress's own venv, on the same samples."""

from __future__ import annotations

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

from kvserve.engine.loading import load_model
from kvserve.engine.sampling import SamplingParams
from kvserve.llm import LLM, chat_token_ids

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
