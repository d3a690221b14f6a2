"""A request's state as it moves through the engine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from kvserve.engine.sampling import SamplingParams
from kvserve.engine.structured import Grammar


class InvalidRequestError(ValueError):
    """A request was rejected at submission; the message names the bad value (``param``: the
    request field at fault, where one is)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def check_prompt(token_ids: list[int], vocab_size: int, max_model_len: int) -> None:
    """An InvalidRequestError unless the prompt has 1..max_model_len tokens, each in the vocabulary."""
    if not token_ids:
        raise InvalidRequestError("prompt is empty: at least one token is needed")
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    if len(token_ids) > max_model_len:
        raise InvalidRequestError(f"prompt has {len(token_ids)} tokens, more than max_model_len={max_model_len}")


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted by swapping: its blocks wait in tier 1, its progress is kept
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_seq: int  # monotonically increasing submission order
    prompt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[dict[int, float]] = field(default_factory=list)
    # params.prompt_logprobs: prompt token i's log-probability given the tokens before it (from i = 1)
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_top_logprobs: list[dict[int, float]] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at (latest) admission
    num_skips: int = 0  # times the lpm policy admitted a later request ahead of this one
    generator: torch.Generator | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    finish_time: float | None = None
    output_text: str = ""
    # incremental detokenization (OutputProcessor.detokenize): output_text covers the tokens before
    # detok_read; the tokens from detok_prefix on give the next token's text its context
    detok_prefix: int = 0
    detok_read: int = 0
    stream: bool = False  # detokenize every step (for streaming) instead of once at the end
    spec_token_ids: list[int] = field(default_factory=list)  # drafts proposed for the next step
    grammar: Grammar | None = None  # params.structured_output's state: it has consumed the output tokens

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """All tokens (prompt then output) in [start, end)."""
        prompt_len = len(self.prompt_token_ids)
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        return (self.prompt_token_ids + self.output_token_ids)[start:end]

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
