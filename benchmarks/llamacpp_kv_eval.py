"""Anchor for `kvserve eval`: llama.cpp's quantized KV cache (q8_0, q4_0) on the same GGUF file and
the same held-out tokens, scored the same way (ΔPPL, mean KL, top-1 against its own f16 cache).

    # 1. in kvserve's venv: the held-out token windows kvserve eval scores
    .venv/bin/python benchmarks/llamacpp_kv_eval.py export --out bench_out/heldout_tokens.json
    # 2. in a venv with llama-cpp-python==0.3.36 (builds llama.cpp from source, ~5 min):
    ~/llama-venv/bin/python benchmarks/llamacpp_kv_eval.py score --tokens bench_out/heldout_tokens.json \\
        --out docs/results/llamacpp_kv_eval.json

llama.cpp's weights stay Q4_1 and its matmuls quantize activations, so its absolute perplexity
differs from kvserve's float32 dequantized weights; compare the deltas. Its quantized V cache
needs flash attention (on for every run here, f16 included).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any


def export(out: str, num_tokens: int, context: int) -> None:
    import torch

    from kvserve.engine.loading import load_model
    from kvserve.model.tokenizer import chat_token_ids
    from kvserve.quant.data import read_samples, token_stream

    loaded = load_model("smollm2-135m", torch.device("cpu"), torch.float32)
    tokenizer = loaded.tokenizer
    tokens = token_stream(read_samples("builtin:python-reference"), lambda t: list(tokenizer.encode(t)),
                          lambda m: chat_token_ids(tokenizer, m), num_tokens)
    windows = [tokens[i : i + context] for i in range(0, num_tokens, context)]
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps({"model_path": str(loaded.path), "windows": windows}))
    print(f"wrote {len(windows)} windows of {context} tokens to {out}")


def score(tokens_file: str, out: str | None, threads: int) -> None:
    import llama_cpp
    import numpy as np

    data = json.loads(Path(tokens_file).read_text())
    windows: list[list[int]] = data["windows"]
    types = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0, "q4_0": llama_cpp.GGML_TYPE_Q4_0}

    def logprobs(llm: Any, window: list[int]) -> Any:
        llm.reset()
        llm.eval(window)
        scores = np.asarray(llm.scores[: len(window)], dtype=np.float64)
        scores -= scores.max(axis=1, keepdims=True)
        return scores - np.log(np.exp(scores).sum(axis=1, keepdims=True))

    models = {name: llama_cpp.Llama(data["model_path"], n_ctx=max(len(w) for w in windows), n_batch=512,
                                    logits_all=True, type_k=t, type_v=t, flash_attn=True, n_threads=threads,
                                    verbose=False)
              for name, t in types.items()}
    totals = {name: {"nll": 0.0, "kl": 0.0, "agree": 0, "count": 0, "seconds": 0.0} for name in types}
    for window in windows:
        targets = np.asarray(window[1:])
        reference = None
        for name, llm in models.items():
            start = time.perf_counter()
            lp = logprobs(llm, window)[:-1]
            totals[name]["seconds"] += time.perf_counter() - start
            reference = lp if reference is None else reference
            t = totals[name]
            t["nll"] -= float(lp[np.arange(len(targets)), targets].sum())
            t["kl"] += float((np.exp(reference) * (reference - lp)).sum())
            t["agree"] += int((lp.argmax(axis=1) == reference.argmax(axis=1)).sum())
            t["count"] += len(targets)
    ref_ppl = math.exp(totals["f16"]["nll"] / totals["f16"]["count"])
    rows = []
    for name, t in totals.items():
        ppl = math.exp(t["nll"] / t["count"])
        rows.append({"kv_cache_type": name, "tokens": t["count"], "ppl": ppl,
                     "delta_ppl_pct": 100 * (ppl / ref_ppl - 1), "mean_kl": t["kl"] / t["count"],
                     "top1_agreement": t["agree"] / t["count"], "seconds": t["seconds"]})
        print(json.dumps(rows[-1]), flush=True)
    if out:
        Path(out).write_text(json.dumps({"llama_cpp_python": llama_cpp.__version__, "results": rows}, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("export")
    ex.add_argument("--out", default="bench_out/heldout_tokens.json")
    ex.add_argument("--num-tokens", type=int, default=20480)
    ex.add_argument("--context", type=int, default=2048)
    sc = sub.add_parser("score")
    sc.add_argument("--tokens", default="bench_out/heldout_tokens.json")
    sc.add_argument("--out", default=None)
    sc.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if args.cmd == "export":
        export(args.out, args.num_tokens, args.context)
    else:
        score(args.tokens, args.out, args.threads)


if __name__ == "__main__":
    main()
