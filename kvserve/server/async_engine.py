"""Runs an LLMEngine's loop in one thread (``kvserve serve``: the main thread, the HTTP server in
another) so HTTP handlers can submit requests at any time; new requests join the batch between
steps (continuous batching across HTTP requests).

Owners: only the engine thread touches the engine (and its tokenizer) after start(); handlers
talk to it through a command queue (submit, abort) and receive each request's outputs on its
own asyncio queue, in order, ending with a finished output. An aborted request's blocks are
freed before the next step. The counts handlers read (waiting, running, the KV snapshot) are
owned by ``_lock``: the waiting limit is checked and a slot reserved in one critical section,
counting submissions the engine thread has not taken yet, so a burst cannot pass it.

If a step raises, the engine is dead: the error is logged with its traceback, every request in
flight and every later submission fails with EngineDeadError (the thread stays to answer
them), ``error`` is set (health checks report it) and ``on_fatal`` runs, which makes
``kvserve serve`` exit non-zero for a supervisor to restart it.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass

from kvserve.cache.kv_stats import KVCacheStats
from kvserve.engine.engine import LLMEngine
from kvserve.engine.output import RequestOutput
from kvserve.engine.sampling import SamplingParams

logger = logging.getLogger("kvserve")


class EngineDeadError(RuntimeError):
    """The engine thread failed; no request can be served until the process restarts."""


class EngineBusyError(RuntimeError):
    """The waiting queue is at its limit (max_waiting)."""


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
        self.on_fatal: Callable[[BaseException], None] | None = None  # called once, in the engine thread
        self._commands: queue.Queue[_Submit | str | None] = queue.Queue()
        self._sinks: dict[str, _Submit] = {}
        self._thread = threading.Thread(target=self.run, name="kvserve-engine", daemon=True)
        self._lock = threading.Lock()  # owns everything below
        self._stats = engine.kv_stats()
        self._engine_waiting = 0  # the scheduler's waiting queue, as of the last step
        self._queued = 0  # submissions the engine thread has not taken yet
        self._running = 0
        self._error: BaseException | None = None

    def start(self) -> None:
        """Run the engine loop in a thread of its own (tests, Ray replicas)."""
        self._thread.start()

    def shutdown(self) -> None:
        """Stop the engine loop (after the commands already queued) and close the engine."""
        self.stop()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        self.engine.close()

    def stop(self) -> None:
        """Ask the engine loop to return once the commands queued before this one are done."""
        self._commands.put(None)

    @property
    def kv_stats(self) -> KVCacheStats:
        with self._lock:
            return self._stats

    @property
    def num_waiting(self) -> int:
        """Requests not yet running: in the scheduler's queue or still in the command queue."""
        with self._lock:
            return self._engine_waiting + self._queued

    @property
    def num_running(self) -> int:
        with self._lock:
            return self._running

    @property
    def error(self) -> BaseException | None:
        """The exception that killed the engine thread, or None while it is healthy."""
        with self._lock:
            return self._error

    async def generate(self, prompt: list[int], params: SamplingParams, stream: bool = False,
                       max_waiting: int | None = None) -> tuple[str, AsyncIterator[RequestOutput]]:
        """Submit; raises the engine's InvalidRequestError at once for a bad request,
        EngineBusyError when ``max_waiting`` requests already wait (None: no limit), EngineDeadError once the engine
        failed. Returns the request id and an iterator over its outputs (the last one finished)."""
        loop = asyncio.get_running_loop()
        sink: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        accepted: Future[str] = Future()
        with self._lock:
            if self._error is not None:
                raise EngineDeadError(f"the engine failed and is restarting: {self._error!r}")
            waiting = self._engine_waiting + self._queued
            if max_waiting is not None and waiting >= max_waiting:
                raise EngineBusyError(f"server busy: {waiting} requests already waiting")
            self._queued += 1
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

    def run(self) -> None:
        """The engine loop, in the calling thread, until stop(). ``kvserve serve`` runs it on the
        thread that loaded the model (the main one): each thread that runs torch's parallel
        regions keeps an OpenMP team, and with two teams alive (loading's and the loop's) libgomp
        counts more threads than cores and stops its workers spinning between regions. Every
        region then waits for a woken worker: a 1 x 576 x 1,536 bf16 product took 135 us
        instead of 60, which nearly doubled a batch-1 decode step."""
        engine = self.engine
        while True:
            idle = self._error is not None or not engine.has_unfinished_requests()
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
            if self._error is not None:
                continue  # dead: only answer commands, with errors
            try:
                outputs = self._step() if engine.has_unfinished_requests() else []
                self._publish(outputs)
            except Exception as exc:  # an engine bug must not leave clients waiting forever
                self._die(exc)

    def _die(self, exc: BaseException) -> None:
        logger.critical("the engine thread failed; every request is failed and the server stops", exc_info=exc)
        with self._lock:
            self._error = exc
        dead = EngineDeadError(f"the engine failed: {exc!r}")
        for waiting in self._sinks.values():
            waiting.loop.call_soon_threadsafe(waiting.sink.put_nowait, dead)
        self._sinks.clear()
        if self.on_fatal is not None:
            self.on_fatal(exc)

    def _step(self) -> list[RequestOutput]:
        outputs = self.engine.step()
        for out in outputs:
            sub = self._sinks.get(out.request_id)
            if sub is not None:
                sub.loop.call_soon_threadsafe(sub.sink.put_nowait, out)
                if out.finished:
                    del self._sinks[out.request_id]
        return outputs

    def _accept(self, sub: _Submit) -> None:
        try:
            if self._error is not None:
                raise EngineDeadError(f"the engine failed and is restarting: {self._error!r}")
            request = self.engine.add_request(sub.prompt, sub.params, stream=sub.stream)
        except (ValueError, EngineDeadError) as exc:
            sub.accepted.set_exception(exc)
            return
        finally:
            with self._lock:  # taken off the command queue: in the scheduler's count now, or rejected
                self._queued -= 1
                self._engine_waiting = self.engine.num_waiting
        self._sinks[request.request_id] = sub
        sub.accepted.set_result(request.request_id)

    def _abort(self, request_id: str) -> None:
        if self._sinks.pop(request_id, None) is not None and self._error is None:
            self.engine.abort_request(request_id)

    def _publish(self, outputs: list[RequestOutput]) -> None:
        stats = self.engine.kv_stats()
        with self._lock:
            self._stats = stats
            self._engine_waiting = self.engine.num_waiting
            self._running = self.engine.num_running
        if self.on_step is not None:
            self.on_step(outputs)
