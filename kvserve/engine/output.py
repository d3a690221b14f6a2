"""From sampled tokens to what a caller sees: tokens appended with their logprobs, stop
conditions (EOS, stop tokens, stop strings, length), incremental detokenization and the
RequestOutput of each step (as vLLM v1's output processor and detokenizer)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvserve.engine.request import Request
from kvserve.engine.sampling import SampleResult
from kvserve.model.tokenizer import Tokenizer


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    stop_reason: str | int | None
    logprobs: list[float] | None
    top_logprobs: list[dict[int, float]] | None
    num_preemptions: int
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # params.prompt_logprobs: one per prompt token (the first None: nothing precedes it)
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[dict[int, float] | None] | None = None
    metrics: dict[str, float] = field(default_factory=dict)


class OutputProcessor:
    """``streams(request_id)``: the request streams (StreamingLLM), so no length limit applies
    to it but max_tokens (its attention spans stay within the window)."""

    def __init__(self, tokenizer: Tokenizer | None, eos_token_ids: set[int], max_model_len: int,
                 streams: Callable[[str], bool]) -> None:
        self.tokenizer, self.eos_token_ids = tokenizer, eos_token_ids
        self.max_model_len, self.streams = max_model_len, streams

    def append(self, request: Request, result: SampleResult) -> tuple[list[int], str | None]:
        """Append a step's sampled tokens (and their logprobs) to the request, up to the first
        that stops it: (the tokens appended, why it stops or None). Tokens after a stop are
        dropped."""
        new_tokens = []
        for j, token in enumerate(result.token_ids):
            request.output_token_ids.append(token)
            new_tokens.append(token)
            if result.logprobs is not None and request.params.logprobs is not None:
                request.output_logprobs.append(result.logprobs[j])
                if result.top_logprobs is not None:
                    request.output_top_logprobs.append(result.top_logprobs[j])
            reason = self.stop_reason(request, token)
            if reason is not None:
                return new_tokens, reason
        return new_tokens, None

    def decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=True))

    def detokenize(self, request: Request, final: bool = False) -> None:
        """Append the new tokens' text to ``output_text``, decoding them with the tokens of the
        previous call before them (a word's leading space, a character split over tokens), so that
        a long stream costs O(1) per token, not a decode of everything so far. Until ``final``, an
        incomplete character waits for its next token."""
        ids = request.output_token_ids
        prefix, read = request.detok_prefix, request.detok_read
        if read == len(ids):
            return
        before, after = self.decode(ids[prefix:read]), self.decode(ids[prefix:])
        if after.endswith("\ufffd") and not final:
            return
        request.output_text += after[len(before):]
        request.detok_prefix, request.detok_read = read, len(ids)

    def stop_reason(self, request: Request, token: int) -> str | None:
        """Why the request stops after its new ``token`` (None: it goes on); its text is final
        once it stops (a stop string cut out unless it is to be included)."""
        params = request.params
        reason: str | None = None
        incremental = bool(params.stop) or request.stream
        if incremental:
            self.detokenize(request)
        may_stop = len(request.output_token_ids) >= params.min_tokens  # before that, stops are masked
        if not may_stop:
            pass
        elif not params.ignore_eos and token in self.eos_token_ids:
            reason = "stop"
        elif token in params.stop_token_ids:
            reason, request.stop_reason = "stop", token
        elif params.stop:
            text = request.output_text
            for stop in params.stop:
                at = text.find(stop, max(0, len(text) - len(stop) - 16))
                if at >= 0:
                    end = at + len(stop) if params.include_stop_str_in_output else at
                    request.output_text = text[:end]
                    reason, request.stop_reason = "stop", stop
                    break
        if reason is None and (
            len(request.output_token_ids) >= params.max_tokens
            # a streaming request's attention spans stay within the window: no length limit
            or (request.num_tokens >= self.max_model_len and not self.streams(request.request_id))
        ):
            reason = "length"
        if reason is not None:
            if not incremental:
                request.output_text = self.decode(request.output_token_ids)
            elif not isinstance(request.stop_reason, str):  # a stop string already cut the text
                self.detokenize(request, final=True)  # what an incomplete character left
        return reason

    def output(self, request: Request, new_tokens: list[int], previous_text: str) -> RequestOutput:
        """What the caller sees of the request after a step: ``new_tokens`` and the text they
        added to ``previous_text`` (a trailing partial character held back until it completes)."""
        text = request.output_text
        # Hold back a trailing partial UTF-8 character until it completes.
        stable = text if request.finished or not text.endswith("\ufffd") else text.rstrip("\ufffd")
        new_text = stable[len(previous_text.rstrip("\ufffd")):] if stable.startswith(
            previous_text.rstrip("\ufffd")) else stable
        metrics = {"arrival_time": request.arrival_time}
        if request.first_token_time is not None:
            metrics["ttft"] = request.first_token_time - request.arrival_time
        if request.finish_time is not None:
            metrics["e2e"] = request.finish_time - request.arrival_time
        want_logprobs = request.params.logprobs is not None
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=list(request.output_token_ids),
            text=text,
            new_token_ids=new_tokens,
            new_text=new_text,
            finished=request.finished,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            logprobs=list(request.output_logprobs) if want_logprobs else None,
            top_logprobs=list(request.output_top_logprobs) if want_logprobs else None,
            num_preemptions=request.num_preemptions,
            num_cached_tokens=request.num_cached_tokens,
            prompt_logprobs=None if request.params.prompt_logprobs is None else [None, *request.prompt_logprobs],
            prompt_top_logprobs=None if request.params.prompt_logprobs is None
            else [None, *request.prompt_top_logprobs],
            metrics=metrics,
        )
