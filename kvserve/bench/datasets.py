"""Request samples for a sweep: random token lengths, shared prefixes, or the user's jsonl."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from kvserve.config import ConfigError, read_jsonl


@dataclass(slots=True)
class Sample:
    prompt: list[int] | str | None  # token ids or text for /v1/completions
    messages: list[dict[str, str]] | None  # for /v1/chat/completions instead
    max_tokens: int
    follows: int | None = None  # index of the sample (same list) that must finish before this one is sent


class LengthSpec:
    """Token lengths: "N" (fixed), "LOW:HIGH" (uniform, inclusive) or "normal:MEAN:STD"
    (rounded, at least 1)."""

    def __init__(self, text: str, name: str) -> None:
        parts = text.split(":")
        self.normal = parts[0] == "normal"
        try:
            numbers = [float(p) for p in (parts[1:] if self.normal else parts)]
        except ValueError:
            raise ConfigError(f"{name}: expected N, LOW:HIGH or normal:MEAN:STD, got {text!r}") from None
        if self.normal:
            if len(numbers) != 2 or numbers[0] < 1 or numbers[1] < 0:
                raise ConfigError(f"{name}: expected normal:MEAN:STD with MEAN >= 1, STD >= 0, got {text!r}")
            self.mean, self.std = numbers
            return
        if len(numbers) not in (1, 2) or any(n != int(n) for n in numbers):
            raise ConfigError(f"{name}: expected N or LOW:HIGH (integers), got {text!r}")
        self.low, self.high = int(numbers[0]), int(numbers[-1])
        if self.low < 1 or self.high < self.low:
            raise ConfigError(f"{name}: expected 1 <= LOW <= HIGH, got {text!r}")

    def draw(self, rng: random.Random) -> int:
        if self.normal:
            return max(1, round(rng.gauss(self.mean, self.std)))
        return rng.randint(self.low, self.high)


def build_samples(dataset: str, num_prompts: int, input_len: str, output_len: str, prefix_len: int = 1000,
                  num_prefixes: int = 4, seed: int = 0, vocab: int = 32000, offset: int = 0) -> list[Sample]:
    """``random``: prompts of random token ids; ``prefix``: each prompt = one of ``num_prefixes``
    shared prefixes (drawn at random) of ``prefix_len`` tokens + a random suffix; ``multiturn``: conversations of
    4 turns, each turn resending the whole history (a ``prefix_len``-token system prompt, every
    earlier user turn and answer) plus a new user turn of ``input_len`` tokens, each turn sent
    only once the one before it has finished, as a user would;
    ``jsonl:PATH``: objects with "prompt"/"text" or "messages" (and optional "max_tokens"), the
    rows from ``offset`` on, wrapping around."""
    if num_prompts < 1:
        raise ConfigError(f"--num-prompts must be positive, got {num_prompts}")
    rng = random.Random(seed)
    in_len, out_len = LengthSpec(input_len, "--input-len"), LengthSpec(output_len, "--output-len")

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, vocab - 100) for _ in range(n)]

    if dataset == "random":
        return [Sample(tokens(in_len.draw(rng)), None, out_len.draw(rng))
                for _ in range(num_prompts)]
    if dataset == "prefix":
        if prefix_len < 1 or num_prefixes < 1:
            raise ConfigError("--prefix-len and --num-prefixes must be positive")
        prefixes = [tokens(prefix_len) for _ in range(num_prefixes)]
        # a seeded random prefix per prompt, not a cycle: a cycle lines up with round-robin routing
        return [Sample(rng.choice(prefixes) + tokens(in_len.draw(rng)), None, out_len.draw(rng))
                for _ in range(num_prompts)]
    if dataset == "multiturn":
        samples: list[Sample] = []
        while len(samples) < num_prompts:
            history = tokens(prefix_len)
            for turn in range(4):
                history = history + tokens(in_len.draw(rng))
                answer = out_len.draw(rng)
                samples.append(Sample(list(history), None, answer, len(samples) - 1 if turn else None))
                history = history + tokens(answer)  # the next turn resends this answer too
        return samples[:num_prompts]
    if dataset.startswith("jsonl:"):
        return _jsonl(Path(dataset[6:]), num_prompts, out_len, rng, offset)
    raise ConfigError(f"--dataset: expected random, prefix, multiturn or jsonl:PATH, got {dataset!r}")


def _jsonl(path: Path, num_prompts: int, out_len: LengthSpec, rng: random.Random, offset: int) -> list[Sample]:
    if not path.is_file():
        raise ConfigError(f"--dataset jsonl file {str(path)!r} does not exist")
    rows: list[Sample] = []
    for n, obj in read_jsonl(path):
        max_tokens = int(obj.get("max_tokens") or out_len.draw(rng))
        if isinstance(obj.get("messages"), list):
            rows.append(Sample(None, obj["messages"], max_tokens))
        elif isinstance(obj.get("prompt", obj.get("text")), (str, list)):
            rows.append(Sample(obj.get("prompt", obj.get("text")), None, max_tokens))
        else:
            raise ConfigError(f"{path}:{n}: expected a 'prompt', 'text' or 'messages' field")
    if not rows:
        raise ConfigError(f"{path} holds no requests")
    return [rows[(offset + i) % len(rows)] for i in range(num_prompts)]
