"""Hugging Face transformers as the float reference of a checkpoint (a GGUF file is dequantized
by transformers itself, ``gguf_file=``): greedy continuations and log-probabilities to hold
kvserve's answers against, and the agreement and perplexity figures that compare the two."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch

from kvserve.quant.data import python_reference


def load_reference(path: Path) -> Any:
    """The checkpoint in transformers, float32 (a GGUF file's weights dequantized by it)."""
    from transformers import AutoModelForCausalLM

    if path.suffix == ".gguf":
        with _gguf_parsed_once():
            return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                        dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """transformers reads a GGUF file with gguf-py twice (config, then weights) and builds
    gguf-py's tensor-name map once per tensor: 35 of the 51 s it took to load SmolLM2 here. Both
    are pure functions of their arguments, so within one load each is computed once; what
    transformers computes from them is unchanged."""
    import gguf

    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, Any], Any] = {}

    def reader(path: Any, mode: Any = "r") -> Any:
        key = (str(path), mode)
        if key not in readers:
            readers[key] = reader_class(path, mode)
        return readers[key]

    gguf.GGUFReader = reader  # type: ignore[misc, assignment]
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map  # type: ignore[misc]


def reference_greedy(model: Any, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy continuation of one prompt (no padding, EOS ignored) with transformers' own KV
    cache, and the log-probabilities at every step."""
    tokens: list[int] = []
    logprobs: list[torch.Tensor] = []
    past = None
    inputs = torch.tensor([prompt_ids])
    with torch.no_grad():
        for _ in range(max_new_tokens):
            out = model(input_ids=inputs, cache=past, use_cache=True)
            past = out.past_key_values
            step = out.logits[0, -1].float().log_softmax(-1)
            token = int(step.argmax())
            tokens.append(token)
            logprobs.append(step)
            inputs = torch.tensor([[token]])
    return tokens, logprobs


def reference_logprobs(model: Any, tokens: list[int]) -> torch.Tensor:
    """Log-probabilities [len - 1, vocab] of each next token of ``tokens`` in one pass."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([tokens])).logits[0, :-1].float().log_softmax(-1)


def perplexity(logprobs: torch.Tensor, tokens: list[int]) -> float:
    """exp of the mean negative log-likelihood of tokens[1:] under logprobs [len - 1, vocab]."""
    targets = torch.tensor(tokens[1:])
    return float(torch.exp(-logprobs.gather(1, targets[:, None]).mean()))


def fidelity_prompts(tokenizer: Any, count: int, min_tokens: int = 12, max_tokens: int = 48) -> list[list[int]]:
    """``count`` prompts of real prose (the held-out built-in corpus), each the first
    ``min_tokens``-``max_tokens`` tokens of a different text, deterministic."""
    prompts: list[list[int]] = []
    for text in python_reference():
        ids = list(tokenizer.encode(text))
        if len(ids) >= min_tokens:
            prompts.append(ids[: min_tokens + len(prompts) * 7 % (max_tokens - min_tokens + 1)])
        if len(prompts) == count:
            return prompts
    raise ValueError(f"the corpus has fewer than {count} texts of {min_tokens} tokens")


def evaluation_tokens(tokenizer: Any, count: int) -> list[int]:
    """The first ``count`` tokens of the held-out built-in corpus, texts joined by blank lines."""
    text = "\n\n".join(python_reference())
    return list(tokenizer.encode(text))[:count]


class Divergence(NamedTuple):
    position: int  # the continuation's first token that is not the reference's greedy choice
    gap: float  # the reference's log-probability of its choice minus that of ours, there


def first_divergence(model: Any, prompt: list[int], continuation: list[int]) -> Divergence | None:
    """Where a greedy ``continuation`` of ``prompt`` parts from the reference's own greedy
    continuation, by teacher forcing (one forward pass): the reference's greedy run would repeat
    every token up to there. None where it never does."""
    logprobs = reference_logprobs(model, prompt + continuation)[len(prompt) - 1:]
    for i, token in enumerate(continuation):
        best = int(logprobs[i].argmax())
        if best != token:
            return Divergence(i, float(logprobs[i, best] - logprobs[i, token]))
    return None
