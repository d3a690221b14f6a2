"""``kvserve serve``: load the engine, run it in its thread, serve HTTP with uvicorn."""

from __future__ import annotations

import logging
import signal
import threading

from fastapi import FastAPI

from kvserve.config import EngineConfig
from kvserve.engine.engine import LLMEngine
from kvserve.engine.loading import LoadedModel
from kvserve.server.app import ServerConfig, create_app
from kvserve.server.async_engine import AsyncEngine

logger = logging.getLogger("kvserve")


def build(engine_config: EngineConfig, server_config: ServerConfig, loaded: LoadedModel | None = None,
          start: bool = True) -> tuple[AsyncEngine, FastAPI]:
    """The engine and the ASGI app over it (``loaded``: a model already in memory); with
    ``start`` the engine loop runs in a thread of its own."""
    engine = AsyncEngine(LLMEngine(engine_config, loaded))
    app = create_app(engine, server_config)
    if start:
        engine.start()
    return engine, app


ENGINE_DEAD_EXIT_CODE = 70  # EX_SOFTWARE: the engine failed, restart the process


def serve(engine_config: EngineConfig, server_config: ServerConfig, host: str, port: int,
          loaded: LoadedModel | None = None) -> int:
    """Serve until SIGTERM/SIGINT (returns 0) or until the engine fails (returns
    ENGINE_DEAD_EXIT_CODE, after answering what was in flight with errors). The engine loop runs
    on this (the main) thread, uvicorn in another (AsyncEngine.run says why)."""
    import uvicorn

    engine, app = build(engine_config, server_config, loaded, start=False)
    if host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("listening on %s: reachable from other machines%s", host,
                       "" if server_config.api_key else " and no --api-key is set")
    # SIGTERM/SIGINT: uvicorn stops accepting, lets in-flight requests finish (up to 30 s), then returns
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info",
                                           timeout_graceful_shutdown=30))

    def stop_on_engine_failure(_: BaseException) -> None:
        server.should_exit = True  # graceful: the failed requests' 500s still go out

    failed: list[BaseException] = []

    def serve_http() -> None:
        try:
            server.run()  # off the main thread uvicorn leaves the signals to us
        except BaseException as exc:  # uvicorn exits (SystemExit) when it cannot listen
            failed.append(exc)
        finally:
            engine.stop()  # the engine loop ends after the last request uvicorn waited for

    engine.on_fatal = stop_on_engine_failure
    # uvicorn's own handler: the first signal drains in-flight requests, a second one does not wait
    # (only the main thread may take signals: serve() embedded in another thread leaves them alone)
    on_main = threading.current_thread() is threading.main_thread()
    handlers = {sig: signal.signal(sig, server.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)} \
        if on_main else {}
    http = threading.Thread(target=serve_http, name="kvserve-http")
    http.start()
    try:
        engine.run()
    finally:
        server.should_exit = True
        http.join()
        engine.shutdown()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    if engine.error is not None:
        logger.critical("exiting with status %d: the engine failed", ENGINE_DEAD_EXIT_CODE)
        return ENGINE_DEAD_EXIT_CODE
    if failed:  # uvicorn's own status (3: it could not start, e.g. the port is taken), else 1
        code = failed[0].code if isinstance(failed[0], SystemExit) and isinstance(failed[0].code, int) else 1
        logger.critical("the HTTP server stopped (%r): exiting with status %d", failed[0], code)
        return code
    return 0
