"""Running one HTTP request through an ASGI app in-process, its response as a stream of parts.

A Ray Serve replica serves kvserve's own FastAPI app this way, so the ingress gets exactly the
routes, pydantic models, errors and server-sent events that ``kvserve serve`` gives.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, NamedTuple


class ForwardedRequest(NamedTuple):
    """An HTTP request as the ingress hands it to a replica, with what the routers read."""

    method: str
    path: str
    query: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    block_keys: tuple[bytes, ...] = ()  # the prompt's chained block keys, for the kv-aware router
    exclude: frozenset[str] = frozenset()  # replicas that answered busy: route elsewhere if possible


class ResponseStart(NamedTuple):
    """The first part of a forwarded response; body chunks (bytes) follow."""

    status: int
    headers: list[tuple[bytes, bytes]]
    replica: str


async def call_asgi(app: Any, request: ForwardedRequest, replica: str) -> AsyncIterator[ResponseStart | bytes]:
    """Yield the app's response to ``request``: one ResponseStart, then each body chunk as the
    app sends it. Closing the iterator early tells the app the client disconnected."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": request.method,
             "scheme": "http", "path": request.path, "raw_path": request.path.encode(),
             "query_string": request.query, "headers": request.headers, "root_path": "",
             "client": ("127.0.0.1", 0), "server": ("kvserve-replica", 80)}
    messages: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
    disconnected = asyncio.Event()
    body_sent = False

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        await messages.put(message)

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            await messages.put(None)  # the app is done, normally or not

    task = asyncio.create_task(run())
    try:
        while (message := await messages.get()) is not None:
            if message["type"] == "http.response.start":
                yield ResponseStart(message["status"], list(message.get("headers", [])), replica)
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    break
        await task  # the app's own exception, if it raised one
    finally:
        disconnected.set()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
