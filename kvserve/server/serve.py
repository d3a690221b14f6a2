"""``kvserve serve``: load the engine, run it in its thread, serve HTTP with uvicorn."""

from __future__ import annotations

import logging

from fastapi import FastAPI

from kvserve.config import EngineConfig
from kvserve.engine.engine import LLMEngine, LoadedModel
from kvserve.server.app import ServerConfig, create_app
from kvserve.server.async_engine import AsyncEngine

logger = logging.getLogger("kvserve")


def build(engine_config: EngineConfig, server_config: ServerConfig, loaded: LoadedModel | None = None
          ) -> tuple[AsyncEngine, FastAPI]:
    """The started engine thread and the ASGI app over it (``loaded``: a model already in memory)."""
    engine = AsyncEngine(LLMEngine(engine_config, loaded))
    app = create_app(engine, server_config)
    engine.start()
    return engine, app


def serve(engine_config: EngineConfig, server_config: ServerConfig, host: str, port: int) -> None:
    import uvicorn

    engine, app = build(engine_config, server_config)
    if host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("listening on %s: reachable from other machines%s", host,
                       "" if server_config.api_key else " and no --api-key is set")
    try:
        # SIGTERM/SIGINT: uvicorn stops accepting, lets in-flight requests finish (up to 30 s), then returns
        uvicorn.run(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=30)
    finally:
        engine.shutdown()
