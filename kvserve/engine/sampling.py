"""Sampling parameters and the batched sampler.

Greedy rows take the argmax. Random rows apply temperature, top-k, top-p and min-p, then
draw with the exponential-race trick (argmax of p / Exp(1) noise), which lets a seeded
request draw its noise from its own generator: the same seed gives the same tokens
whatever else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling settings (names as in vLLM / the OpenAI API)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: chosen token only; n: chosen + top-n
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise ValueError(f"logprobs must be a non-negative integer, got {self.logprobs!r}")
        if any(not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty, got {self.stop!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[float] | None  # log-probability of each chosen token (raw model distribution)
    top_logprobs: list[dict[int, float]] | None


def _filter_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k / top-p / min-p masks (rows that do not ask are untouched)."""
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
    logits = logits / temps[:, None]
    vocab = logits.shape[-1]
    top_k = [p.top_k if p.top_k > 0 else vocab for p in params]
    if any(k < vocab for k in top_k) or any(p.top_p < 1.0 for p in params):
        sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
        ks = torch.tensor(top_k, device=logits.device)
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        drop = ranks >= ks[:, None]
        top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=logits.device)
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly above this token
        drop |= before >= top_p[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, sorted_idx, sorted_logits)
    if any(p.min_p > 0 for p in params):
        probs = logits.softmax(dim=-1)
        min_p = torch.tensor([p.min_p for p in params], dtype=logits.dtype, device=logits.device)
        threshold = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> SampleResult:
    """logits [N, vocab] float32, one row per request that samples this step."""
    tokens = logits.argmax(dim=-1)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        rows = torch.tensor(random_rows, device=logits.device)
        filtered = _filter_logits(logits[rows], [params[i] for i in random_rows])
        probs = filtered.softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_()
        for j, i in enumerate(random_rows):
            gen = generators[i]
            if gen is not None:
                noise[j] = torch.empty(probs.shape[-1], dtype=probs.dtype).exponential_(generator=gen).to(probs.device)
        tokens[rows] = (probs / noise).argmax(dim=-1)
    want = [p.logprobs is not None for p in params]
    if not any(want):
        return SampleResult(tokens.tolist(), None, None)
    logprobs = logits.log_softmax(dim=-1)
    chosen = logprobs.gather(-1, tokens[:, None])[:, 0].tolist()
    top: list[dict[int, float]] = []
    for i, p in enumerate(params):
        n = p.logprobs or 0
        if n:
            values, ids = logprobs[i].topk(n)
            top.append(dict(zip(ids.tolist(), values.tolist(), strict=True)))
        else:
            top.append({})
    return SampleResult(tokens.tolist(), chosen, top)
