"""The workload a tuning run measures: its requests as token ids, and the statistics the
configuration records (mean and p90 prompt and output lengths, prefix share, rate)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

from kvserve.bench.datasets import Sample, build_samples
from kvserve.bench.sweep import percentiles
from kvserve.cache.prefix_cache import prompt_block_hashes
from kvserve.model.tokenizer import chat_token_ids

PREFIX_BLOCK = 16  # the prefix share is counted in blocks of this many tokens, as a cache would hit them


class WorkloadStats(NamedTuple):
    num_requests: int
    mean_prompt_tokens: float
    p90_prompt_tokens: float
    mean_output_tokens: float
    p90_output_tokens: float
    prefix_share: float  # prompt tokens an unbounded prefix cache would serve (0..1)
    rate: float | None  # requests per second of the trace (None: not timed)

    def summary(self) -> str:
        return (f"{self.num_requests} requests, prompt tokens mean {self.mean_prompt_tokens:.0f} / p90 "
                f"{self.p90_prompt_tokens:.0f}, output tokens mean {self.mean_output_tokens:.0f} / p90 "
                f"{self.p90_output_tokens:.0f}, prefix share {100 * self.prefix_share:.1f}%")


def load_workload(workload: str, num_prompts: int, input_len: str, output_len: str, prefix_len: int,
                  num_prefixes: int, seed: int) -> list[Sample]:
    """A .jsonl file of requests (bench's jsonl format: "prompt"/"text"/"messages", optional
    "max_tokens"), or one of bench's synthetic datasets (random, prefix, multiturn)."""
    if workload.endswith(".jsonl") and not workload.startswith("jsonl:"):
        workload = f"jsonl:{workload}"
    if workload.startswith("jsonl:"):
        rows = sum(1 for line in Path(workload[6:]).read_text().splitlines() if line.strip()) \
            if Path(workload[6:]).is_file() else num_prompts
        num_prompts = max(num_prompts, rows)
    return build_samples(workload, num_prompts, input_len, output_len, prefix_len, num_prefixes, seed)


def prompt_ids(sample: Sample, tokenizer: Any) -> list[int]:
    """The token ids the server will see for ``sample``'s prompt."""
    if isinstance(sample.prompt, list):
        return list(sample.prompt)
    if sample.messages is not None:
        return chat_token_ids(tokenizer, sample.messages)
    return list(tokenizer.encode(sample.prompt or ""))


def prefix_share(prompts: list[list[int]], block_size: int = PREFIX_BLOCK) -> float:
    """Share of prompt tokens in leading full blocks that an earlier prompt already had (chained
    block keys, as the prefix cache keys them), with a cache that never evicts."""
    seen: set[bytes] = set()
    hits = total = 0
    for ids in prompts:
        reusing = True
        for key in prompt_block_hashes(ids, block_size):
            if reusing and key in seen:
                hits += block_size
            else:
                reusing = False
            seen.add(key)
        total += len(ids)
    return hits / total if total else 0.0


def workload_stats(prompts: list[list[int]], samples: list[Sample], rate: float | None = None) -> WorkloadStats:
    prompt_lengths = percentiles([float(len(ids)) for ids in prompts])
    output_lengths = percentiles([float(s.max_tokens) for s in samples])
    return WorkloadStats(len(samples), prompt_lengths["mean"], prompt_lengths["p90"], output_lengths["mean"],
                         output_lengths["p90"], prefix_share(prompts), rate)
