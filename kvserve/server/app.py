"""OpenAI-compatible routes over an AsyncEngine: /v1/completions, /v1/chat/completions (both
with SSE streaming), /v1/models, /v1/kv, /health, /metrics. Errors use OpenAI's shape
{"error": {"message", "type", "param", "code"}}; a bad request never disturbs the others."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvserve.engine.engine import RequestOutput
from kvserve.engine.sampling import SamplingParams
from kvserve.server.async_engine import AsyncEngine
from kvserve.server.metrics import ServerMetrics


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


@dataclass(slots=True)
class ServerConfig:
    model_name: str
    api_key: str | None = None
    max_waiting: int = 256
    max_body_bytes: int = 4 * 1024 * 1024


def _number(body: dict[str, Any], name: str, default: Any, kind: type | tuple[type, ...]) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, kind):
        raise APIError(400, f"{name} must be a number, got {value!r}", param=name)
    return value


def sampling_params(body: dict[str, Any], chat: bool) -> SamplingParams:
    """OpenAI request fields -> SamplingParams; every bad value is a 400 naming its field."""
    if body.get("n", 1) != 1:
        raise APIError(400, f"only n=1 is supported, got {body.get('n')!r}", param="n")
    max_tokens = body.get("max_completion_tokens") if chat else None
    max_tokens = max_tokens if max_tokens is not None else _number(body, "max_tokens", 16, int)
    stop = body.get("stop")
    if stop is not None and not (isinstance(stop, str) or (isinstance(stop, list)
                                                           and all(isinstance(s, str) for s in stop))):
        raise APIError(400, f"stop must be a string or a list of strings, got {stop!r}", param="stop")
    logprobs: int | None = None
    if chat and body.get("logprobs"):
        logprobs = _number(body, "top_logprobs", 0, int)
    elif not chat and body.get("logprobs") is not None:
        logprobs = _number(body, "logprobs", 0, int)
    try:
        return SamplingParams(
            temperature=float(_number(body, "temperature", 1.0, (int, float))),
            top_p=float(_number(body, "top_p", 1.0, (int, float))), top_k=_number(body, "top_k", 0, int),
            min_p=float(_number(body, "min_p", 0.0, (int, float))), seed=_number(body, "seed", None, int),
            max_tokens=max_tokens, stop=stop, ignore_eos=bool(body.get("ignore_eos", False)), logprobs=logprobs)
    except ValueError as exc:
        message = str(exc)
        param = next((p for p in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "logprobs")
                      if message.startswith(p)), None)
        raise APIError(400, message, param=param) from exc


def create_app(engine: AsyncEngine, config: ServerConfig) -> FastAPI:
    app = FastAPI(title="kvserve", docs_url=None, redoc_url=None)
    app.state.server_config = config  # read per request: limits can be adjusted at run time
    metrics = ServerMetrics(engine)
    engine.on_step = metrics.on_step
    tokenizer = engine.engine.tokenizer

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    def check_auth(request: Request) -> None:
        if config.api_key is not None and request.headers.get("authorization") != f"Bearer {config.api_key}":
            raise APIError(401, "invalid or missing API key (Authorization: Bearer ...)", kind="authentication_error",
                           code="invalid_api_key")

    async def read_body(request: Request) -> dict[str, Any]:
        check_auth(request)
        raw = await request.body()
        if len(raw) > config.max_body_bytes:
            raise APIError(413, f"request body of {len(raw)} bytes exceeds the limit of {config.max_body_bytes}")
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise APIError(400, f"request body is not valid JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise APIError(400, "request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != config.model_name:
            raise APIError(404, f"model {model!r} does not exist; this server serves {config.model_name!r}",
                           param="model", code="model_not_found")
        if engine.num_waiting >= config.max_waiting:
            raise APIError(503, f"server busy: {engine.num_waiting} requests already waiting", kind="server_error",
                           headers={"Retry-After": "1"})
        return body

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        check_auth(request)
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": 0,
                                            "owned_by": "kvserve", "max_model_len": engine.engine.max_model_len}]}

    @app.get("/v1/kv")
    async def kv(request: Request) -> dict[str, Any]:
        check_auth(request)
        s = engine.kv_stats
        return {"block_size": s.block_size, "num_blocks": s.num_blocks, "blocks_used": s.blocks_used,
                "blocks_free": s.blocks_free, "blocks_cached": s.blocks_cached, "usage": s.usage,
                "live_tokens": s.live_tokens, "allocated_slots": s.allocated_slots, "utilization": s.utilization,
                "tail_waste_slots": s.tail_waste, "num_requests": s.num_requests,
                "blocks_evictable": s.prefix_cache.evictable_blocks,
                "num_preemptions": s.num_preemptions, "prefix_cache_hit_rate": s.prefix_cache.hit_rate,
                "prefix_cache_queries": s.prefix_cache.queries, "prefix_cache_hits": s.prefix_cache.hits,
                "per_request_blocks": s.per_request_blocks}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await read_body(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            if not prompt:
                raise APIError(400, "prompt is empty", param="prompt")
            token_ids = _encode(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                          for t in prompt):
            token_ids = list(prompt)
        else:
            raise APIError(400, "prompt must be a non-empty string or list of token ids (one prompt)", param="prompt")
        return await _serve(request, body, token_ids, sampling_params(body, chat=False), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await read_body(request)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise APIError(400, "messages must be a non-empty list", param="messages")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise APIError(400, "each message needs a string role and string content", param="messages")
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer or chat template")
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return await _serve(request, body, _encode(text), sampling_params(body, chat=True), chat=True)

    def _piece(token: int) -> str:
        return str(tokenizer.decode([token])) if tokenizer is not None else str(token)

    def _logprobs(out: RequestOutput, start: int, chat: bool) -> dict[str, Any] | None:
        """OpenAI logprobs for the output tokens from ``start`` on (None unless asked for)."""
        if out.logprobs is None:
            return None
        tokens, chosen = out.token_ids[start:], out.logprobs[start:]
        tops = (out.top_logprobs or [])[start:] or [{} for _ in tokens]
        if chat:
            return {"content": [
                {"token": _piece(t), "logprob": lp, "bytes": list(_piece(t).encode()),
                 "top_logprobs": [{"token": _piece(k), "logprob": v, "bytes": list(_piece(k).encode())}
                                  for k, v in top.items()]}
                for t, lp, top in zip(tokens, chosen, tops, strict=False)]}
        return {"tokens": [_piece(t) for t in tokens], "token_logprobs": chosen,
                "top_logprobs": [{_piece(k): v for k, v in top.items()} for top in tops]}

    def _encode(text: str) -> list[int]:
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send token ids", param="prompt")
        return list(tokenizer.encode(text))

    async def _serve(request: Request, body: dict[str, Any], token_ids: list[int], params: SamplingParams,
                     chat: bool) -> Response:
        stream = bool(body.get("stream", False))
        try:
            request_id, outputs = await engine.generate(token_ids, params, stream=stream)
        except ValueError as exc:
            message = str(exc)
            raise APIError(400, message, param="prompt" if "prompt" in message else None) from exc
        created, rid = int(time.time()), f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        include_usage = bool((body.get("stream_options") or {}).get("include_usage", False))
        if stream:
            return StreamingResponse(
                _sse(request_id, outputs, rid, created, chat, include_usage, len(token_ids)),
                media_type="text/event-stream")
        final: RequestOutput | None = None
        try:
            async for out in outputs:
                final = out
        finally:
            if final is None or not final.finished:
                engine.abort(request_id)
        assert final is not None
        usage = _usage(len(token_ids), len(final.token_ids))
        logprobs = _logprobs(final, 0, chat)
        if chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": final.text},
                                      "logprobs": logprobs, "finish_reason": final.finish_reason}
        else:
            choice = {"index": 0, "text": final.text, "logprobs": logprobs, "finish_reason": final.finish_reason}
        return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                             "created": created, "model": config.model_name, "choices": [choice], "usage": usage})

    async def _sse(request_id: str, outputs: AsyncIterator[RequestOutput], rid: str, created: int, chat: bool,
                   include_usage: bool, prompt_tokens: int) -> AsyncIterator[str]:
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> str:
            data: dict[str, Any] = {"id": rid, "object": kind, "created": created, "model": config.model_name,
                                    "choices": choices}
            if usage is not None:
                data["usage"] = usage
            return f"data: {json.dumps(data)}\n\n"

        finished = False
        generated = 0
        try:
            if chat:
                yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}])
            sent = 0  # output tokens whose logprobs went out already
            async for out in outputs:
                generated = len(out.token_ids)
                finished = out.finished
                if not out.new_text and not finished:
                    continue
                delta: dict[str, Any] = {"content": out.new_text} if chat else {}
                choice: dict[str, Any] = {"index": 0, "logprobs": _logprobs(out, sent, chat),
                                          "finish_reason": out.finish_reason if finished else None}
                sent = generated
                choice.update({"delta": delta} if chat else {"text": out.new_text})
                yield chunk([choice])
            if include_usage:
                yield chunk([], _usage(prompt_tokens, generated))
            yield "data: [DONE]\n\n"
        finally:
            if not finished:  # the client went away: free its blocks at the next step
                engine.abort(request_id)

    return app


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
