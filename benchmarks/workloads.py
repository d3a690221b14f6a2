"""Token-id workloads shared by every benchmark and every engine (stdlib only, so the vLLM
runner can import it from its own venv). Token ids, not text, so tokenizers cannot differ."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, NamedTuple

VOCAB = 49152


def cpu_name() -> str:
    """The CPU's model name (benchmark results record which machine measured them)."""
    try:
        return next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


def cpu_flags() -> list[str]:
    """The CPU's vector ISA flags (avx*, amx*, fma): what decides which kernels run."""
    try:
        flags = next(line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("flags"))
    except (OSError, StopIteration):
        return []
    return sorted(f for f in flags if f.startswith(("avx", "amx", "fma")))


class Workload(NamedTuple):
    name: str
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


PAGE_SUFFIXES = {"/4k": False, "/2m": True}


def page_choice(kv_dtype: str) -> tuple[str, bool | None]:
    """``bf16/4k``, ``bf16/2m``: the KV dtype before the suffix, its pools forced onto 4 KB or 2 MB
    pages (kvserve.cache.huge_pages), so one run can compare the two; no suffix: None, the engine's
    default (KVSERVE_HUGE_PAGES)."""
    for suffix, huge in PAGE_SUFFIXES.items():
        if kv_dtype.endswith(suffix):
            return kv_dtype[: -len(suffix)], huge
    return kv_dtype, None


def top_ops(prof: Any, n: int = 4) -> str:
    """The n ops of a torch.profiler run that took the most CPU time, as "name 1.2 s, ..."."""
    top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:n]
    return ", ".join(f"{e.key} {e.self_cpu_time_total / 1e6:.1f} s" for e in top)


def _ids(rng: random.Random, n: int) -> list[int]:
    # skip the first 100 ids (special and control tokens)
    return [rng.randrange(100, VOCAB) for _ in range(n)]


def uniform(num: int = 32, prompt_len: int = 128, output_len: int = 128, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    return Workload("uniform", [_ids(rng, prompt_len) for _ in range(num)], [output_len] * num)


def mixed(num: int = 64, prompt_range: tuple[int, int] = (16, 1024), output_range: tuple[int, int] = (16, 256),
          seed: int = 0) -> Workload:
    rng = random.Random(seed)
    prompts = [_ids(rng, rng.randint(*prompt_range)) for _ in range(num)]
    return Workload("mixed", prompts, [rng.randint(*output_range) for _ in range(num)])


def long_context(num: int = 64, prompt_range: tuple[int, int] = (2000, 6000),
                 output_range: tuple[int, int] = (128, 512), seed: int = 0) -> Workload:
    """The long-context workload: far more KV than a 2 GiB budget holds at once."""
    rng = random.Random(seed)
    prompts = [_ids(rng, rng.randint(*prompt_range)) for _ in range(num)]
    return Workload("long", prompts, [rng.randint(*output_range) for _ in range(num)])


WORKLOADS = {"uniform": uniform, "mixed": mixed, "long": long_context}
