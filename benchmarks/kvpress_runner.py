"""Run prompt-compression cases through kvpress on HF transformers; writes a JSON file. Runs in
kvpress's own venv (kvpress 0.5.5 pins transformers < 5.3):

    /path/to/kvpress-venv/bin/python benchmarks/kvpress_runner.py --cases cases.json --out kvpress.json

cases.json (written by ``benchmarks/kv_eviction.py --kvpress``): the HF model folder, the
samples (prompt token ids, the reference answer to teacher-force, how many tokens to generate)
and the presses to run (method and compression ratio, the fraction *removed*, kvpress's sense).
For every press and sample, as kvpress's pipeline does it: the whole prompt is prefilled under
the press (the first answer token comes from that prefill's full attention), then the answer is
decoded greedily from the compressed cache, and the reference answer is teacher-forced through
another copy of it. Per sample: the generated ids, and per teacher-forced answer token after the
first, KL(full cache || compressed) and whether the two argmaxes agree, against this same model
with no press.

With a "ppl" entry instead (``benchmarks/kv_eviction.py --kvpress PYTHON --ppl``): held-out
tokens teacher-forced in windows of ``context``, chunk by chunk, with the full cache and with
kvpress's decoding-time StreamingLLM (``DecodingPress(StreamingLLMPress)``, compressing the cache
to the sinks and the last ``window`` tokens after every chunk; positions absolute, as kvpress
keeps them), as it is and with its kept tokens kept in time order (TimeOrderedStreamingLLMPress):
the summed NLL, KL against the full cache and top-1 agreement.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from typing import Any

import torch
from kvpress import DecodingPress, KeyRerotationPress, SnapKVPress, StreamingLLMPress
from transformers import AutoModelForCausalLM, DynamicCache


def make_press(method: str, ratio: float, window: int, sinks: int) -> Any:
    if method == "snapkv":
        return SnapKVPress(compression_ratio=ratio, window_size=window)
    if method == "streaming":  # kvpress's default: kept keys stay where they were rotated
        return StreamingLLMPress(compression_ratio=ratio, n_sink=sinks)
    if method == "streaming-rerotated":  # the paper's positions within the cache
        return KeyRerotationPress(StreamingLLMPress(compression_ratio=ratio, n_sink=sinks))
    raise ValueError(method)


class TimeOrderedStreamingLLMPress(StreamingLLMPress):  # type: ignore[misc]
    """StreamingLLMPress whose kept tokens stay in time order. ScorerPress keeps ``topk``'s
    indices as they come, ties in any order, so after one compression the cache is shuffled and a
    second one (DecodingPress) takes the wrong "first" tokens as sinks and evicts at random; a
    tiebreak falling with the index makes topk return the kept tokens in order."""

    def score(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        scores = super().score(*args, **kwargs)
        return scores - torch.arange(scores.shape[-1], device=scores.device) * (0.5 / scores.shape[-1])


@torch.inference_mode()
def prefill(model: Any, prompt: list[int], press: Any) -> tuple[DynamicCache, torch.Tensor, int]:
    """The prompt prefilled (under the press if any): its cache, the next-token logits and the
    position of the next token (the cache's length when keys were re-rotated to it)."""
    cache = DynamicCache()
    ids = torch.tensor([prompt])
    if press is None:
        logits = model(input_ids=ids, past_key_values=cache).logits[0, -1]
    else:
        with press(model):
            logits = model(input_ids=ids, past_key_values=cache).logits[0, -1]
    position = cache.get_seq_length() if isinstance(press, KeyRerotationPress) else len(prompt)
    return cache, logits, position


@torch.inference_mode()
def greedy(model: Any, cache: DynamicCache, logits: torch.Tensor, position: int, max_tokens: int) -> list[int]:
    out = [int(logits.argmax())]
    for i in range(max_tokens - 1):
        step = model(input_ids=torch.tensor([[out[-1]]]), past_key_values=cache,
                     position_ids=torch.tensor([[position + i]])).logits[0, -1]
        out.append(int(step.argmax()))
    return out


@torch.inference_mode()
def forced(model: Any, cache: DynamicCache, position: int, answer: list[int]) -> torch.Tensor:
    """Log-probabilities [len(answer) - 1, vocab] of answer[1:], teacher-forced."""
    n = len(answer) - 1
    logits = model(input_ids=torch.tensor([answer[:-1]]), past_key_values=cache,
                   position_ids=torch.arange(position, position + n)[None]).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


@torch.inference_mode()
def window_logprobs(model: Any, tokens: list[int], chunk: int, press: Any) -> torch.Tensor:
    """Log-probabilities [len, vocab] of the token after each, chunk by chunk (under ``press``)."""
    cache, rows = DynamicCache(), []
    for start in range(0, len(tokens), chunk):
        ids = torch.tensor([tokens[start : start + chunk]])
        positions = torch.arange(start, start + ids.shape[1])[None]
        if press is None:
            logits = model(input_ids=ids, past_key_values=cache, position_ids=positions).logits[0]
        else:
            with press(model):
                logits = model(input_ids=ids, past_key_values=cache, position_ids=positions).logits[0]
        rows.append(torch.log_softmax(logits.float(), dim=-1))
    return torch.cat(rows)


def perplexity(model: Any, spec: dict[str, Any]) -> list[dict[str, Any]]:
    tokens, context, chunk = spec["tokens"], spec["context"], spec["chunk"]
    windows = [tokens[i : i + context] for i in range(0, len(tokens), context)]
    configs: list[tuple[str, int]] = [("full cache", 0)] + [(name, w) for w in spec["windows"]
                                                            for name in ("streaming", "streaming-ordered")]
    totals = {c: {"name": c[0], "window": c[1], "nll": 0.0, "kl": 0.0, "agree": 0, "count": 0, "seconds": 0.0}
              for c in configs}
    for window in windows:
        targets = torch.tensor(window[1:])
        reference = None
        for config in configs:
            start = time.perf_counter()
            streaming = TimeOrderedStreamingLLMPress if config[0] == "streaming-ordered" else StreamingLLMPress
            press = None if not config[1] else DecodingPress(streaming(n_sink=spec["sinks"]),
                                                             compression_interval=1,
                                                             target_size=spec["sinks"] + config[1])
            logprobs = window_logprobs(model, window, chunk, press)[:-1]
            reference = logprobs if reference is None else reference
            t = totals[config]
            t["seconds"] += time.perf_counter() - start
            t["nll"] -= float(logprobs.gather(1, targets[:, None]).sum())
            t["kl"] += float((reference.exp() * (reference - logprobs)).sum())
            t["agree"] += int((logprobs.argmax(1) == reference.argmax(1)).sum())
            t["count"] += len(targets)
            print(config, f"{t['seconds']:.1f} s", flush=True)
    return list(totals.values())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(2)
    with open(args.cases) as file:
        cases = json.load(file)
    model = AutoModelForCausalLM.from_pretrained(cases["model"], dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    if "ppl" in cases:
        with open(args.out, "w") as file:
            json.dump({"ppl": perplexity(model, cases["ppl"])}, file)
        return
    samples = cases["samples"]
    references = []
    full_answers = []
    for sample in samples:
        cache, logits, position = prefill(model, sample["prompt"], None)
        full_answers.append(greedy(model, copy.deepcopy(cache), logits, position, sample["max_tokens"]))
        references.append(forced(model, cache, position, sample["answer"]))
    results = []
    for config in cases["presses"]:
        start = time.perf_counter()
        rows = []
        for sample, reference in zip(samples, references, strict=True):
            press = make_press(config["method"], config["ratio"], cases["window"], cases["sinks"])
            cache, logits, position = prefill(model, sample["prompt"], press)
            kept = cache.get_seq_length()
            answer = greedy(model, copy.deepcopy(cache), logits, position, sample["max_tokens"])
            logprobs = forced(model, cache, position, sample["answer"])
            kl = (reference.exp() * (reference - logprobs)).sum(-1)
            agree = logprobs.argmax(-1) == reference.argmax(-1)
            rows.append({"answer": answer, "kept": kept, "kl": kl.tolist(), "agree": agree.tolist()})
        results.append({**config, "seconds": time.perf_counter() - start, "samples": rows})
        print(config, f"{time.perf_counter() - start:.1f} s", flush=True)
    with open(args.out, "w") as file:
        json.dump({"full_answers": full_answers, "presses": results}, file)


if __name__ == "__main__":
    main()
