"""OpenAI-compatible routes over an AsyncEngine: /v1/completions, /v1/chat/completions (both
with SSE streaming), /v1/models, /tokenize, /detokenize, /v1/kv, /health, /metrics. Request
bodies are the pydantic models of kvserve.server.protocol (so /openapi.json describes them).
Errors use OpenAI's shape {"error": {"message", "type", "param", "code"}}: 400 for a bad field,
naming it; 500 once the engine has failed (and /health answers 503). A bad request never
disturbs the others."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvserve.cache.kv_stats import SpecDecodeStats
from kvserve.engine.output import RequestOutput
from kvserve.engine.sampling import SamplingParams
from kvserve.model.cpu_kernels import ops_isa
from kvserve.model.tokenizer import chat_token_ids
from kvserve.server.async_engine import AsyncEngine, EngineBusyError, EngineDeadError
from kvserve.server.metrics import ServerMetrics
from kvserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    chat_messages,
)
from kvserve.server.token_text import TokenText
from kvserve.server.tools import read_tool_calls
from kvserve.tune.drift import TunedWorkload


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


DRAIN_BYTES = 64 * 1024 * 1024  # of an oversized body, read and dropped before the 413


@dataclass(slots=True)
class ServerConfig:
    model_name: str
    api_key: str | None = None
    max_waiting: int = 256
    max_body_bytes: int = 4 * 1024 * 1024
    max_logprobs: int = 20  # vLLM's --max-logprobs
    # a streaming (windowed) request may run past max_model_len; this bounds how far
    max_streaming_tokens: int = 32768
    tuned_workload: TunedWorkload | None = None  # kvserve tune's record: /metrics exports config_drift


def _engine_dead(exc: EngineDeadError) -> APIError:
    return APIError(500, str(exc), kind="internal_server_error", code="engine_dead")


_UNION_TAGS = {"body", "str", "int", "float", "bool", "list", "dict", "none"}


def _validation_error(exc: RequestValidationError) -> APIError:
    """pydantic's first complaint as a 400 naming the field."""
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request body")
    first = errors[0]
    # keep field names and list indices; drop "body" and pydantic's union-member tags
    loc = [str(part) for part in first.get("loc", ()) if isinstance(part, int) or (
        part.isidentifier() and part not in _UNION_TAGS)]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return APIError(400, f"request body is not valid JSON: {first.get('msg')}")
    if not loc and isinstance(first.get("input"), bytes):  # not sent as application/json
        try:
            json.loads(first["input"])
        except ValueError as exc:
            return APIError(400, f"request body is not valid JSON: {exc}")
        return APIError(400, "request body must be a JSON object sent as Content-Type: application/json")
    if first.get("type") == "extra_forbidden":
        return APIError(400, f"unknown or unsupported field {param!r}", param=param)
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if param:
        value = first.get("input")
        shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
        message = f"{param}: {message} (got {shown})"
    return APIError(400, message, param=param)


def _spec_decode_json(stats: SpecDecodeStats | None) -> dict[str, Any] | None:
    """/v1/kv's speculative decoding figures (null when speculation is off)."""
    if stats is None:
        return None
    draft = stats.draft_kv
    return {"method": stats.method, "num_speculative_tokens": stats.num_speculative_tokens,
            "num_drafts": stats.num_drafts, "num_draft_tokens": stats.num_draft_tokens,
            "num_accepted_tokens": stats.num_accepted_tokens, "num_bonus_tokens": stats.num_bonus_tokens,
            "accepted_per_position": stats.accepted_per_position, "acceptance_rate": stats.acceptance_rate,
            "mean_accepted_length": stats.mean_accepted_length, "num_disabled_steps": stats.num_disabled_steps,
            "draft_kv": None if draft is None else {"num_blocks": draft.num_blocks, "blocks_used": draft.blocks_used,
                                                    "live_tokens": draft.live_tokens}}


def create_app(engine: AsyncEngine, config: ServerConfig) -> FastAPI:
    app = FastAPI(title="kvserve", docs_url=None, redoc_url=None)
    app.state.server_config = config  # read per request: limits can be adjusted at run time
    metrics = ServerMetrics(engine, config.tuned_workload)
    engine.on_step = metrics.on_step
    # Handlers on the event loop's thread share the engine thread's tokenizer: it is immutable.
    tokenizer = engine.engine.tokenizer
    token_text = TokenText(tokenizer)
    max_model_len = engine.engine.max_model_len

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response()

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return _engine_dead(exc).response()

    @app.middleware("http")
    async def limit_body(request: Request, call_next: Any) -> Response:
        """Bodies over max_body_bytes get a 413, read no further than the limit (a chunked upload
        too). What the client is still sending is read and dropped, up to a bound, so that it sees
        the 413 rather than a reset connection."""
        limit = config.max_body_bytes
        length = request.headers.get("content-length")
        size = int(length) if length and length.isdigit() else 0
        chunks = request.stream()
        if size <= limit:
            body = bytearray()
            async for chunk in chunks:
                body += chunk
                if len(body) > limit:
                    break
            else:
                request._body = bytes(body)  # what call_next hands the route (starlette's cached body)
                response: Response = await call_next(request)
                return response
            size = len(body)
        drained = 0
        async for chunk in chunks:
            drained += len(chunk)
            if drained > DRAIN_BYTES:
                break
        shown = f"{size} bytes" if length else f"more than {limit} bytes"
        return APIError(413, f"request body of {shown} exceeds the limit of {limit}",
                        headers={"Connection": "close"}).response()

    def check_auth(request: Request) -> None:
        if config.api_key is not None and request.headers.get("authorization") != f"Bearer {config.api_key}":
            raise APIError(401, "invalid or missing API key (Authorization: Bearer ...)", kind="authentication_error",
                           code="invalid_api_key")

    def check_model(model: str | None) -> None:
        if model is not None and model != config.model_name:
            raise APIError(404, f"model {model!r} does not exist; this server serves {config.model_name!r}",
                           param="model", code="model_not_found")

    def request_max_tokens(body: CompletionRequest | ChatCompletionRequest, prompt_tokens: int, chat: bool) -> int:
        """Checks that need the prompt or the server's limits; the max_tokens each choice gets."""
        wanted = body.logprobs_wanted()
        if wanted is not None and wanted > config.max_logprobs:
            param = "top_logprobs" if chat else "logprobs"
            raise APIError(400, f"{param}={wanted} is more than the server's max_logprobs={config.max_logprobs}",
                           param=param)
        vocab = engine.engine.model_config.vocab_size
        outside = [key for key in body.logit_bias or {} if int(key) >= vocab]
        if outside:
            raise APIError(400, f"logit_bias: token id {outside[0]} is outside the vocabulary [0, {vocab})",
                           param="logit_bias")
        room = max_model_len - prompt_tokens
        if room < 1:
            raise APIError(400, f"prompt has {prompt_tokens} tokens, more than max_model_len={max_model_len} "
                           f"leaves room for (at least one token must be generated)",
                           param="messages" if chat else "prompt")
        requested = body.requested_max_tokens()
        param = body.max_tokens_field()
        # a streaming request's attention stays within its window: it may generate past max_model_len,
        # up to the server's --max-streaming-tokens
        if engine.engine.eviction.streams(body.kv_eviction):
            if requested is not None and requested > config.max_streaming_tokens:
                raise APIError(400, f"{param}={requested} is more than the server's max_streaming_tokens="
                               f"{config.max_streaming_tokens} for a request with kv_eviction=streaming", param=param)
        elif requested is not None and requested > room:
            raise APIError(400, f"{param}={requested} is more than the {room} tokens left after the prompt's "
                           f"{prompt_tokens} tokens in max_model_len={max_model_len}", param=param)
        # OpenAI's defaults: 16 for completions, as much as fits for chat (0: the prompt is only scored)
        return requested if requested is not None else (room if chat else min(16, room))

    def choice_params(body: CompletionRequest | ChatCompletionRequest, max_tokens: int, choice: int
                      ) -> SamplingParams:
        try:  # a prompt only scored (max_tokens 0) still runs to its first token; the response drops it
            return body.sampling_params(max(max_tokens, 1), choice)
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc

    @app.get("/health")
    async def health() -> Response:
        error = engine.error
        if error is not None:
            return APIError(503, f"the engine failed: {error!r}", kind="internal_server_error",
                            code="engine_dead").response()
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(check_auth)])
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": 0,
                                            "owned_by": "kvserve", "max_model_len": max_model_len,
                                            "max_logprobs": config.max_logprobs,
                                            "quantization": engine.engine.config.model_config.quantization,
                                            "kv_cache_dtype": engine.engine.config.cache_config.kv_cache_dtype}]}

    @app.get("/v1/kv", dependencies=[Depends(check_auth)])
    async def kv() -> dict[str, Any]:
        s = engine.kv_stats
        return {"block_size": s.block_size, "num_blocks": s.num_blocks, "blocks_used": s.blocks_used,
                "blocks_free": s.blocks_free, "blocks_cached": s.blocks_cached, "usage": s.usage,
                "live_tokens": s.live_tokens, "logical_tokens": s.logical_tokens, "sharing_factor": s.sharing_factor,
                "allocated_slots": s.allocated_slots, "utilization": s.utilization,
                "tail_slots_used": s.tail_slots_used, "tail_blocks_used": s.tail_blocks_used,
                "tail_waste_slots": s.tail_waste, "num_requests": s.num_requests,
                "blocks_evictable": s.prefix_cache.evictable_blocks,
                "num_preemptions": s.num_preemptions, "prefix_cache_hit_rate": s.prefix_cache.hit_rate,
                "prefix_cache_queries": s.prefix_cache.queries, "prefix_cache_hits": s.prefix_cache.hits,
                "tiers": [t._asdict() for t in s.tiers], "swaps_out": s.swaps_out, "swaps_in": s.swaps_in,
                "swap_fallbacks": s.swap_fallbacks, "num_swapped": s.num_swapped,
                "groups": [asdict(g) for g in s.groups], "per_request_blocks": s.per_request_blocks,
                "spec_decode": _spec_decode_json(s.spec_decode),
                "evicted_tokens": s.evicted_tokens, "evicted_tokens_now": s.evicted_tokens_now,
                "evicted_bytes_now": s.evicted_bytes_now, "kept_ratio": s.kept_ratio,
                "cpu_ops_isa": ops_isa(engine.engine.device)}

    @app.post("/v1/completions", dependencies=[Depends(check_auth)])
    async def completions(body: CompletionRequest) -> Response:
        check_model(body.model)
        texts = body.prompts()
        prompts = [_encode(p) if isinstance(p, str) else list(p) for p in texts]
        echoed = [p if isinstance(p, str) else _decode(p) for p in texts] if body.echo else None
        return await _serve(body, prompts, [request_max_tokens(body, len(p), chat=False) for p in prompts],
                            chat=False, echoed=echoed)

    @app.post("/v1/chat/completions", dependencies=[Depends(check_auth)])
    async def chat_completions(body: ChatCompletionRequest) -> Response:
        check_model(body.model)
        token_ids = _chat_tokens(body.chat(), body.add_generation_prompt, body.tool_specs())
        return await _serve(body, [token_ids], [request_max_tokens(body, len(token_ids), chat=True)], chat=True)

    @app.post("/tokenize")  # like vLLM, outside /v1: not behind --api-key
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        check_model(body.model)
        if body.messages is not None:
            tokens = _chat_tokens(chat_messages(body.messages), body.add_generation_prompt)
        else:
            assert body.prompt is not None
            tokens = _encode(body.prompt, body.add_special_tokens)
        return {"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        check_model(body.model)
        vocab = engine.engine.model_config.vocab_size
        bad = [t for t in body.tokens if t >= vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param="tokens")
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer")
        return {"prompt": _decode(body.tokens)}

    def _logprobs(out: RequestOutput, start: int, chat: bool, echo: list[int] | None = None) -> dict[str, Any] | None:
        """OpenAI logprobs for the output tokens from ``start`` on (None unless asked for): each
        token by its own bytes (token_text), one top_logprobs entry per token. ``echo``: the
        prompt's tokens (with out's prompt log-probabilities) go before the output's."""
        if out.logprobs is None:
            return None
        tokens, chosen = out.token_ids[start:], list[float | None](out.logprobs[start:])
        tops = list[dict[int, float] | None]((out.top_logprobs or [])[start:] or [{} for _ in tokens])
        text, raw = token_text.text, token_text.bytes_of
        if chat:
            return {"content": [
                {"token": text(t), "logprob": lp, "bytes": list(raw(t)),
                 "top_logprobs": [{"token": text(k), "logprob": v, "bytes": list(raw(k))}
                                  for k, v in (top or {}).items()]}
                for t, lp, top in zip(tokens, chosen, tops, strict=False)]}
        if echo is not None:
            tokens, chosen = echo + tokens, list(out.prompt_logprobs or [None] * len(echo)) + chosen
            tops = list(out.prompt_top_logprobs or [None] * len(echo)) + tops
        pieces = [text(t) for t in tokens]
        offsets = list(itertools.accumulate((len(p) for p in pieces), initial=0))[:-1]
        return {"tokens": pieces, "token_logprobs": chosen, "text_offset": offsets,
                "top_logprobs": [None if top is None else {text(k): v for k, v in top.items()} for top in tops]}

    def _prompt_logprobs(out: RequestOutput) -> list[dict[str, dict[str, Any]] | None] | None:
        """vLLM's prompt_logprobs: per prompt token (the first None), its own log-probability and
        the top n at its position, keyed by token id."""
        if out.prompt_logprobs is None:
            return None
        entries: list[dict[str, dict[str, Any]] | None] = [None]
        tops = (out.prompt_top_logprobs or [])[1:]
        for token, lp, top in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:], tops, strict=False):
            entry = {str(k): {"logprob": v, "decoded_token": token_text.text(k)} for k, v in (top or {}).items()}
            entry[str(token)] = {"logprob": lp, "decoded_token": token_text.text(token)}
            entries.append(entry)
        return entries

    def _decode(token_ids: list[int]) -> str:
        return str(tokenizer.decode(token_ids)) if tokenizer is not None else ""

    def _encode(text: str, add_special_tokens: bool = True) -> list[int]:
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send token ids", param="prompt")
        return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def _chat_tokens(messages: list[dict[str, Any]], add_generation_prompt: bool,
                     tools: list[dict[str, Any]] | None = None) -> list[int]:
        if tokenizer is None or tokenizer.chat_template is None:
            raise APIError(400, "this model has no tokenizer or chat template", param="messages")
        try:
            ids = chat_token_ids(tokenizer, messages, add_generation_prompt, tools or None)
        except Exception as exc:  # the template's own complaint (jinja2 raises its own types)
            raise APIError(400, f"the chat template cannot render these messages: {exc}", param="messages") from exc
        return ids

    def _chat_turn(body: ChatCompletionRequest, text: str, finish_reason: str | None
                   ) -> tuple[dict[str, Any], str | None]:
        """The assistant message of a finished turn and its finish_reason: the tool calls it made
        (finish_reason tool_calls), or its text."""
        mode = body.tool_mode()
        said = read_tool_calls(text, body.tool_specs(), mode) if mode is not None else None
        if said is None or not said.calls:
            return {"role": "assistant", "content": text}, finish_reason
        return {"role": "assistant", "content": said.content, "tool_calls": said.calls}, "tool_calls"

    async def _start(index: int, token_ids: list[int], params: SamplingParams, stream: bool) -> _Choice:
        try:
            request_id, outputs = await engine.generate(token_ids, params, stream=stream,
                                                        max_waiting=config.max_waiting)
        except EngineBusyError as exc:
            raise APIError(503, str(exc), kind="server_error", headers={"Retry-After": "1"}) from exc
        except ValueError as exc:
            message = str(exc)
            param = getattr(exc, "param", None) or ("prompt" if "prompt" in message else None)
            raise APIError(400, message, param=param) from exc
        return _Choice(index, request_id, outputs)

    async def _submit(body: CompletionRequest | ChatCompletionRequest, prompts: list[list[int]],
                      max_tokens: list[int]) -> list[_Choice]:
        """One engine request per choice: choice i * n + j is sample j of prompt i. With prefix
        caching on, a prompt's first sample runs its prefill alone, and its n - 1 siblings start
        once it has sampled a token: they find the prompt's blocks in the prefix cache and hold
        them with it (computing only the last, partly filled block), as vLLM's v1 engine shares
        a parallel-sampling prompt."""
        n = body.n
        share = n > 1 and engine.engine.config.cache_config.enable_prefix_caching
        choices: list[_Choice] = []
        try:
            for i, (ids, limit) in enumerate(zip(prompts, max_tokens, strict=True)):
                for j in range(1 if share else n):
                    choices.append(await _start(i * n + j, ids, choice_params(body, limit, j), body.stream or share))
            if share:
                for lead, ids, limit in zip(list(choices), prompts, max_tokens, strict=True):
                    first = await anext(lead.outputs, None)
                    if first is not None:
                        lead.taken.append(first)
                    for j in range(1, n):
                        choices.append(await _start(lead.index + j, ids, choice_params(body, limit, j), body.stream))
        except BaseException:
            for choice in choices:
                engine.abort(choice.request_id)
            raise
        return sorted(choices, key=lambda c: c.index)

    async def _serve(body: CompletionRequest | ChatCompletionRequest, prompts: list[list[int]],
                     max_tokens: list[int], chat: bool, echoed: list[str] | None = None) -> Response:
        """``echoed``: completions' echo, each prompt's text to put before its choices' text."""
        choices = await _submit(body, prompts, max_tokens)
        created, rid = int(time.time()), f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        scored_only = body.requested_max_tokens() == 0
        usage = _Usage(prompts, body.n, scored_only)
        if body.stream:
            return StreamingResponse(_sse(body, choices, rid, created, usage), media_type="text/event-stream")
        finals: dict[int, RequestOutput] = {}
        try:
            async for index, out in _merged(choices):
                if out.finished:
                    finals[index] = out
        finally:
            for choice in choices:
                if choice.index not in finals:
                    engine.abort(choice.request_id)
        answers: list[dict[str, Any]] = []
        for index, final in sorted(finals.items()):
            usage.update(index, final)
            if scored_only:
                final = replace(final, token_ids=[], text="", logprobs=None if final.logprobs is None else [],
                                top_logprobs=None if final.top_logprobs is None else [], finish_reason="length")
            prompt = prompts[index // body.n]
            logprobs = _logprobs(final, 0, chat, echo=prompt if echoed is not None else None)
            if isinstance(body, ChatCompletionRequest):
                message, reason = _chat_turn(body, final.text, final.finish_reason)
                answers.append({"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason})
            else:
                text = final.text if echoed is None else echoed[index // body.n] + final.text
                answers.append({"index": index, "text": text, "logprobs": logprobs,
                                "finish_reason": final.finish_reason})
            if body.prompt_logprobs is not None:
                answers[-1]["prompt_logprobs"] = _prompt_logprobs(final)
        return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                             "created": created, "model": config.model_name, "choices": answers,
                             "usage": usage.body()})

    async def _sse(body: CompletionRequest | ChatCompletionRequest, choices: list[_Choice], rid: str, created: int,
                   usage: _Usage) -> AsyncIterator[str]:
        """The stream: a chat's role first, then each choice's new text as it comes (a turn that
        may call tools is held back and sent whole at its end: its text may turn out to be calls)."""
        chat = isinstance(body, ChatCompletionRequest)
        kind = "chat.completion.chunk" if chat else "text_completion"
        options = body.stream_options
        include_usage = options is not None and options.include_usage
        continuous = include_usage and options is not None and options.continuous_usage_stats
        held = isinstance(body, ChatCompletionRequest) and body.tool_mode() is not None

        def chunk(parts: list[dict[str, Any]], with_usage: bool = False) -> str:
            data: dict[str, Any] = {"id": rid, "object": kind, "created": created, "model": config.model_name,
                                    "choices": parts}
            if with_usage:
                data["usage"] = usage.body()
            return f"data: {json.dumps(data)}\n\n"

        finished: set[int] = set()
        scored: set[int] = set()  # choices whose prompt_logprobs went out (with their first chunk)
        sent = {choice.index: 0 for choice in choices}  # output tokens whose logprobs went out already
        try:
            if chat:
                for choice in choices:
                    yield chunk([{"index": choice.index, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}], continuous)
            async for index, out in _merged(choices):
                usage.update(index, out)
                if out.finished:
                    finished.add(index)
                if (not out.new_text or held) and not out.finished:
                    continue
                part: dict[str, Any] = {"index": index, "logprobs": _logprobs(out, sent[index], chat),
                                        "finish_reason": out.finish_reason if out.finished else None}
                if body.prompt_logprobs is not None and index not in scored:
                    part["prompt_logprobs"] = _prompt_logprobs(out)
                    scored.add(index)
                sent[index] = len(out.token_ids)
                if isinstance(body, ChatCompletionRequest) and held:  # the whole turn, at its end
                    message, part["finish_reason"] = _chat_turn(body, out.text, out.finish_reason)
                    calls = [{"index": i, **call} for i, call in enumerate(message.get("tool_calls", []))]
                    part["delta"] = {"tool_calls": calls} if calls else {"content": out.text}
                else:
                    part.update({"delta": {"content": out.new_text}} if chat else {"text": out.new_text})
                yield chunk([part], continuous)
            if include_usage:
                yield chunk([], with_usage=True)
        except EngineDeadError as exc:  # the status line went out already: report it in the stream
            yield f"data: {json.dumps(_engine_dead(exc).body())}\n\n"
        else:
            yield "data: [DONE]\n\n"
        finally:
            for choice in choices:
                if choice.index not in finished:  # the client went away: free its blocks at the next step
                    engine.abort(choice.request_id)

    return app


@dataclass(slots=True)
class _Choice:
    """One engine request behind one choice of a response."""

    index: int
    request_id: str
    outputs: AsyncIterator[RequestOutput]
    taken: list[RequestOutput] = field(default_factory=list)  # read before the response started


async def _merged(choices: list[_Choice]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Every choice's outputs as they come, tagged with its index, until each has finished."""
    arrived: asyncio.Queue[tuple[int, RequestOutput | BaseException]] = asyncio.Queue()

    async def pump(choice: _Choice) -> None:
        try:
            for out in choice.taken:
                arrived.put_nowait((choice.index, out))
            async for out in choice.outputs:
                arrived.put_nowait((choice.index, out))
        except Exception as exc:  # EngineDeadError: the merged stream raises it
            arrived.put_nowait((choice.index, exc))

    pumps = [asyncio.create_task(pump(choice)) for choice in choices]
    remaining = len(choices)
    try:
        while remaining:
            index, item = await arrived.get()
            if isinstance(item, BaseException):
                raise item
            yield index, item
            remaining -= item.finished
    finally:
        for task in pumps:
            task.cancel()


class _Usage:
    """OpenAI's usage of a response: each prompt counted once (its n samples share it), every
    choice's tokens, and prompt_tokens_details.cached_tokens: the prompt tokens each prompt's
    first sample found in the prefix cache (its siblings' hits are the sharing, not reuse)."""

    def __init__(self, prompts: list[list[int]], n: int, scored_only: bool = False) -> None:
        self.n, self.scored_only = n, scored_only
        self.prompt_tokens = sum(len(p) for p in prompts)
        self.completion: dict[int, int] = {}
        self.cached: dict[int, int] = {}

    def update(self, index: int, out: RequestOutput) -> None:
        self.completion[index] = 0 if self.scored_only else len(out.token_ids)
        if index % self.n == 0:
            self.cached[index] = out.num_cached_tokens

    def body(self) -> dict[str, Any]:
        completion = sum(self.completion.values())
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached.values())}}
