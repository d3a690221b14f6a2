"""What structured output costs: the grammar mask per sampled token, and a batch's decode rate
with every request held to a JSON schema against the same batch free.

    python benchmarks/structured_output.py --out docs/results/structured_output.json

The mask: one request's llguidance matcher over SmolLM2's 49,152-token vocabulary, ``mask`` (the
allowed-token bitmask applied to a logits row) and ``advance`` (the token consumed) timed along
a JSON document the grammar accepts. The batch: ``--batch`` chat requests sampled at
temperature 1 with ``--max-tokens`` tokens each (EOS ignored, so both runs generate the same
count), one engine, the free run and the schema run alternated ``--rounds`` times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))
from workloads import cpu_name

from kvserve import LLM, SamplingParams
from kvserve.engine.structured import GrammarCompiler, StructuredOutput

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4}},
    "required": ["name", "age", "tags"]}
DOCUMENT = '{"name":"Ada Lovelace","age":36,"tags":["math","engines"]}'  # compact, as the grammar has it


def mask_cost(llm: LLM) -> dict[str, float]:
    engine = llm.engine
    compiler = GrammarCompiler(engine.tokenizer, engine.model_config.vocab_size, engine.tokenizer.eos_token_id)
    tokens = engine.tokenizer.encode(DOCUMENT, add_special_tokens=False)
    masks, advances = [], []
    for _ in range(20):
        grammar = compiler.compile(StructuredOutput("json", json.dumps(SCHEMA)))
        logits = torch.zeros(1, engine.model_config.vocab_size)
        for token in tokens:
            start = time.perf_counter()
            grammar.mask(logits)
            masks.append(time.perf_counter() - start)
            start = time.perf_counter()
            grammar.advance(token)
            advances.append(time.perf_counter() - start)
    start = time.perf_counter()
    compiler.compile(StructuredOutput("json", json.dumps(SCHEMA)))
    return {"mask_us_median": 1e6 * statistics.median(masks), "advance_us_median": 1e6 * statistics.median(advances),
            "compile_ms": 1e3 * (time.perf_counter() - start), "tokens": len(tokens)}


def batch_rate(llm: LLM, batch: int, max_tokens: int, schema: bool) -> float:
    prompts = [llm.apply_chat_template([{"role": "user", "content": f"Describe person number {i} as JSON."}])
               for i in range(batch)]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, ignore_eos=True,
                             structured_output=StructuredOutput("json", json.dumps(SCHEMA)) if schema else None)
              for i in range(batch)]
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    llm = LLM("smollm2-135m", dtype=args.dtype, kv_cache_memory="1GiB")
    result: dict[str, object] = {"cpu": cpu_name(), "threads": torch.get_num_threads(), **mask_cost(llm)}
    batch_rate(llm, args.batch, 8, schema=True)  # warm-up
    free, held = [], []
    for _ in range(args.rounds):
        free.append(batch_rate(llm, args.batch, args.max_tokens, schema=False))
        held.append(batch_rate(llm, args.batch, args.max_tokens, schema=True))
    result |= {"batch": args.batch, "max_tokens": args.max_tokens, "free_tok_s": statistics.median(free),
               "schema_tok_s": statistics.median(held)}
    result["schema_vs_free"] = result["schema_tok_s"] / result["free_tok_s"]  # type: ignore[operator]
    print(json.dumps(result, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
