"""The OpenAI-compatible request bodies as pydantic models, as vLLM's protocol module declares
them: validation, error messages and /openapi.json all come from here.

Every field a client may send is declared. An unknown field is rejected, and so is a known
field the server cannot honour (``suffix``, ``best_of``, ``echo`` with ``stream``); the fields
that cannot change the output (``IGNORED_FIELDS``) are accepted and ignored. Nothing else is
ignored silently. Strings must be valid Unicode (a lone UTF-16 surrogate such as ``"\\ud800"``
is rejected), numbers finite.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from kvserve.engine.sampling import SamplingParams
from kvserve.engine.structured import StructuredOutput
from kvserve.server.tools import forced_calls_grammar


def _valid_unicode(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"string is not valid Unicode: {exc.reason} at index {exc.start}") from exc
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]
TokenId = Annotated[int, Field(ge=0)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


MAX_N = 128  # choices per prompt (n): each is an engine request of its own

# accepted, and cannot change what is generated: bookkeeping for the client's side (OpenAI's
# stored completions, metadata, end-user ids, service tiers) or a tool-calling preference that only
# matters with tools
IGNORED_FIELDS = ("metadata", "store", "service_tier", "user", "parallel_tool_calls")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Strict):
    name: Text = "response"
    description: Text | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's response_format: text, any JSON object, or JSON that validates against a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs its json_schema")
        return self


class StructuredOutputs(_Strict):
    """vLLM's structured_outputs: exactly one of a JSON schema, a regex, a choice of strings or a
    Lark grammar."""

    json_: dict[str, Any] | Text | None = Field(None, alias="json")
    regex: Text | None = None
    choice: Annotated[list[Text], Field(min_length=1)] | None = None
    grammar: Text | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [name for name in ("json_", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of json, regex, choice or grammar")
        return self

    def output(self) -> StructuredOutput:
        if self.json_ is not None:
            return StructuredOutput("json", self.json_ if isinstance(self.json_, str) else json.dumps(self.json_))
        if self.regex is not None:
            return StructuredOutput("regex", self.regex)
        if self.choice is not None:
            return StructuredOutput("choice", json.dumps(self.choice))
        assert self.grammar is not None
        return StructuredOutput("grammar", self.grammar)


class FunctionSpec(_Strict):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: Text | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(_Strict):
    name: Text


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class _Sampling(_Strict):
    """Fields shared by completions and chat completions (OpenAI's, plus vLLM's extras)."""

    model: Text | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=100.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    seed: int | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, le=100.0)] = 1.0
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    min_tokens: Annotated[int, Field(ge=0)] = 0
    include_stop_str_in_output: bool = False
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    metadata: dict[str, Text] | None = None
    store: bool | None = None
    service_tier: Text | None = None
    # kvserve's extra: this request's KV eviction (within the server's kv_window, keeping at least
    # its kv_compression_ratio)
    kv_eviction: Literal["none", "streaming", "snapkv"] | None = None
    kv_window: Annotated[int, Field(ge=1)] | None = None
    kv_sink_tokens: Annotated[int, Field(ge=0)] | None = None
    kv_compression_ratio: Annotated[float, Field(gt=0, le=1)] | None = None
    # vLLM's extras: the prompt tokens' log-probabilities (the top n besides each token's own);
    # output kept inside a JSON schema, a regex, a choice or a grammar
    prompt_logprobs: Annotated[int, Field(ge=0)] | None = None
    structured_outputs: StructuredOutputs | None = None

    @field_validator("seed")
    @classmethod
    def _seed_range(cls, seed: int | None) -> int | None:
        if seed is not None and not -(2**63) <= seed < 2**64:
            raise ValueError("seed must fit in 64 bits")
        return seed

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key in bias or {}:
            if not key.isdigit():
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
        return bias

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if stop is not None and any(not s for s in ([stop] if isinstance(stop, str) else stop)):
            raise ValueError("stop strings must be non-empty")
        return stop

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def max_tokens_field(self) -> str:
        """The field that set requested_max_tokens (for error messages)."""
        return "max_tokens"

    def logprobs_wanted(self) -> int | None:
        raise NotImplementedError

    def prompt_logprobs_wanted(self) -> int | None:
        return self.prompt_logprobs

    def structured_output(self) -> StructuredOutput | None:
        """What the output must match, from whichever field asked (None: free text)."""
        return None if self.structured_outputs is None else self.structured_outputs.output()

    def sampling_params(self, max_tokens: int, choice: int = 0) -> SamplingParams:
        """The engine's parameters for the ``choice``-th of n samples (OpenAI defaults:
        temperature 1, top_p 1). As in vLLM, sample i of a seeded request is seeded seed + i, so
        it equals a request of its own sent with that seed."""
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0,
            min_p=self.min_p or 0.0, seed=None if self.seed is None else self.seed + choice,
            max_tokens=max_tokens, stop=self.stop,
            stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
            logprobs=self.logprobs_wanted(), include_stop_str_in_output=self.include_stop_str_in_output,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
            prompt_logprobs=self.prompt_logprobs_wanted(), structured_output=self.structured_output(),
            min_tokens=min(self.min_tokens, max_tokens), kv_eviction=self.kv_eviction, kv_window=self.kv_window,
            kv_sink_tokens=self.kv_sink_tokens, kv_compression_ratio=self.kv_compression_ratio)


class CompletionRequest(_Sampling):
    prompt: Text | list[TokenId] | list[Text] | list[list[TokenId]]
    # 0 with echo: score the prompt only (lm-evaluation-harness's loglikelihood requests)
    max_tokens: Annotated[int, Field(ge=0)] | None = None
    logprobs: Annotated[int, Field(ge=0)] | None = None
    echo: bool = False
    suffix: None = Field(None, description="suffix is not supported")
    best_of: int | None = None

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, best_of: int | None) -> int | None:
        if best_of not in (None, 1):
            raise ValueError("best_of is not supported (vLLM's v1 engine dropped it too); use n")
        return best_of

    @model_validator(mode="after")
    def _prompts_not_empty(self) -> CompletionRequest:
        if not self.prompt or any(not p for p in self.prompts()):
            raise ValueError("prompt is empty")
        if self.echo and self.stream:
            raise ValueError("echo is not supported with stream")
        if self.max_tokens == 0 and (self.stream or not (self.echo or self.prompt_logprobs is not None)):
            raise ValueError("max_tokens=0 scores the prompt: it needs echo or prompt_logprobs, without stream")
        return self

    def prompt_logprobs_wanted(self) -> int | None:
        """echo with logprobs reports the prompt's tokens as the output's, at the same top n."""
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request: one, or a batch (one choice per prompt, in order)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            return list(prompt)
        return [prompt]  # type: ignore[list-item]

    def logprobs_wanted(self) -> int | None:
        return self.logprobs


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[dict[str, Any]] | None = None
    name: Text | None = None
    tool_call_id: Text | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn that called tools, in the history

    @field_validator("content")
    @classmethod
    def _join_text_parts(cls, content: str | list[dict[str, Any]] | None) -> str | None:
        """OpenAI content parts: text parts are joined; any other part type is refused by name."""
        if not isinstance(content, list):
            return content
        texts = []
        for part in content:
            kind = part.get("type")
            if kind != "text":
                raise ValueError(f"content part type {kind!r} is not supported (only 'text')")
            texts.append(TextPart.model_validate(part).text)
        return "\n".join(texts)


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0)] | None = None
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    add_generation_prompt: bool = True
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _one_constraint(self) -> ChatCompletionRequest:
        choice = self.tool_choice
        names = {t.function.name for t in self.tools or []}
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names function {choice.function.name!r}, which is not among the tools")
        if choice == "required" and not self.tools:
            raise ValueError("tool_choice=required needs tools")
        forced = [name for name, given in (
            ("tool_choice", self.forced_tool_calls()),
            ("response_format", self.response_format is not None and self.response_format.type != "text"),
            ("structured_outputs", self.structured_outputs is not None)) if given]
        if len(forced) > 1:
            raise ValueError(f"{' and '.join(forced)} each constrain the output: give one")
        return self

    def tool_specs(self) -> list[dict[str, Any]]:
        return [t.model_dump(exclude_none=True) for t in self.tools or []]

    def tool_mode(self) -> str | dict[str, Any] | None:
        """How this turn may call tools: "auto", "required", a named function, or None (text)."""
        if not self.tools or self.tool_choice == "none":
            return None
        choice = self.tool_choice or "auto"
        return choice.model_dump() if isinstance(choice, NamedToolChoice) else choice

    def forced_tool_calls(self) -> bool:
        mode = self.tool_mode()
        return mode is not None and mode != "auto"

    def structured_output(self) -> StructuredOutput | None:
        mode = self.tool_mode()
        if mode is not None and mode != "auto":
            return forced_calls_grammar(self.tool_specs(), mode)
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            return StructuredOutput("json", json.dumps({"type": "object"}))
        if fmt is not None and fmt.type == "json_schema":
            assert fmt.json_schema is not None
            return StructuredOutput("json", json.dumps(fmt.json_schema.schema_))
        return super().structured_output()

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def chat(self) -> list[dict[str, Any]]:
        return chat_messages(self.messages)


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template takes them (content parts already joined into text)."""
    return [m.model_dump(exclude_none=True) | {"content": m.content or ""} for m in messages]


class TokenizeRequest(_Strict):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the chat template."""

    model: Text | None = None
    prompt: Text | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(_Strict):
    model: Text | None = None
    tokens: list[TokenId]
