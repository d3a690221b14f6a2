"""``kvserve serve``: load the engine, run it in its thread, serve HTTP with uvicorn."""

from __future__ import annotations

import logging

from fastapi import FastAPI

from kvserve.config import EngineConfig
from kvserve.engine.engine import LLMEngine
from kvserve.engine.loading import LoadedModel
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


ENGINE_DEAD_EXIT_CODE = 70  # EX_SOFTWARE: the engine failed, restart the process


def serve(engine_config: EngineConfig, server_config: ServerConfig, host: str, port: int,
          loaded: LoadedModel | None = None) -> int:
    """Serve until SIGTERM/SIGINT (returns 0) or until the engine fails (returns
    ENGINE_DEAD_EXIT_CODE, after answering what was in flight with errors)."""
    import uvicorn

    engine, app = build(engine_config, server_config, loaded)
    if host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("listening on %s: reachable from other machines%s", host,
                       "" if server_config.api_key else " and no --api-key is set")
    # SIGTERM/SIGINT: uvicorn stops accepting, lets in-flight requests finish (up to 30 s), then returns
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info",
                                           timeout_graceful_shutdown=30))

    def stop_on_engine_failure(_: BaseException) -> None:
        server.should_exit = True  # graceful: the failed requests' 500s still go out

    engine.on_fatal = stop_on_engine_failure
    try:
        server.run()
    finally:
        engine.shutdown()
    if engine.error is not None:
        logger.critical("exiting with status %d: the engine failed", ENGINE_DEAD_EXIT_CODE)
        return ENGINE_DEAD_EXIT_CODE
    return 0
