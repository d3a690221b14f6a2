"""Runs an LLMEngine in its own thread so HTTP handlers can submit requests at any time; new
requests join the batch between steps (continuous batching across HTTP requests).

Invariants: only the engine thread touches the engine after start(); handlers talk to it
through a command queue (submit, abort) and receive each request's outputs on its own asyncio
queue, in order, ending with a finished output. An aborted request's blocks are freed before
the next step.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass

from kvserve.cache.kv_cache_manager import KVCacheStats
from kvserve.engine.engine import LLMEngine, RequestOutput
from kvserve.engine.sampling import SamplingParams


@dataclass(slots=True)
class _Submit:
    prompt: list[int]
    params: SamplingParams
    stream: bool
    sink: asyncio.Queue[RequestOutput | BaseException]
    loop: asyncio.AbstractEventLoop
    accepted: Future[str]


class AsyncEngine:
    def __init__(self, engine: LLMEngine, on_step: Callable[[list[RequestOutput]], None] | None = None) -> None:
        self.engine = engine
        self.on_step = on_step  # called in the engine thread after every step (metrics)
        self._commands: queue.Queue[_Submit | str | None] = queue.Queue()
        self._sinks: dict[str, _Submit] = {}
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
        self._stats_lock = threading.Lock()
        self._stats = engine.kv_stats()
        self.num_waiting = 0
        self.num_running = 0

    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        self._commands.put(None)
        self._thread.join(timeout=30)

    @property
    def kv_stats(self) -> KVCacheStats:
        with self._stats_lock:
            return self._stats

    async def generate(self, prompt: list[int], params: SamplingParams, stream: bool = False
                       ) -> tuple[str, AsyncIterator[RequestOutput]]:
        """Submit; raises the engine's InvalidRequestError at once for a bad request. Returns the
        request id and an iterator over its outputs (the last one finished)."""
        loop = asyncio.get_running_loop()
        sink: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        accepted: Future[str] = Future()
        self._commands.put(_Submit(prompt, params, stream, sink, loop, accepted))
        request_id = await asyncio.wrap_future(accepted)

        async def outputs() -> AsyncIterator[RequestOutput]:
            while True:
                item = await sink.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return

        return request_id, outputs()

    def abort(self, request_id: str) -> None:
        self._commands.put(request_id)

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        engine = self.engine
        while True:
            idle = not engine.has_unfinished_requests()
            command: _Submit | str | None
            try:
                command = self._commands.get(timeout=0.5) if idle else self._commands.get_nowait()
            except queue.Empty:
                command = ""
            while command != "":  # drain every pending command between two steps
                if command is None:
                    return
                if isinstance(command, _Submit):
                    self._accept(command)
                else:
                    self._abort(command)
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    command = ""
            outputs = self._step() if engine.has_unfinished_requests() else []
            self._publish(outputs)

    def _step(self) -> list[RequestOutput]:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # an engine bug must not leave clients waiting forever
            for waiting in self._sinks.values():
                waiting.loop.call_soon_threadsafe(waiting.sink.put_nowait, exc)
            self._sinks.clear()
            raise
        for out in outputs:
            sub = self._sinks.get(out.request_id)
            if sub is not None:
                sub.loop.call_soon_threadsafe(sub.sink.put_nowait, out)
                if out.finished:
                    del self._sinks[out.request_id]
        return outputs

    def _accept(self, sub: _Submit) -> None:
        try:
            request = self.engine.add_request(sub.prompt, sub.params, stream=sub.stream)
        except ValueError as exc:
            sub.accepted.set_exception(exc)
            return
        self._sinks[request.request_id] = sub
        sub.accepted.set_result(request.request_id)

    def _abort(self, request_id: str) -> None:
        if self._sinks.pop(request_id, None) is not None:
            self.engine.abort_request(request_id)

    def _publish(self, outputs: list[RequestOutput]) -> None:
        stats = self.engine.kv_stats()
        with self._stats_lock:
            self._stats = stats
            self.num_waiting = len(self.engine.scheduler.waiting)
            self.num_running = len(self.engine.scheduler.running)
        if self.on_step is not None:
            self.on_step(outputs)
