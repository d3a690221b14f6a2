"""``kvserve serve --ray``: kvserve replicas as a Ray Serve deployment behind one OpenAI ingress.

    HTTP ── Ray Serve proxy ── Ingress (FastAPI) ── handle + router ──┬── ReplicaServer 1 (AsyncEngine)
                                                                      └── ReplicaServer N

Each ReplicaServer runs kvserve's own FastAPI app in-process (``asgi.call_asgi``), so routes,
validation, errors and streaming are those of ``kvserve serve``. The ingress computes each
prompt's block keys for the kv-aware router, forwards the request, and turns a replica that
died into a 503 (a stream that already started ends with an error event). Replicas push their
Prometheus text to a MetricsBoard actor each time Ray polls their routing stats; the ingress's
/metrics merges it, labelled by replica, with the router's counters.

Prefill/decode disaggregation (``--prefill-replicas``/``--decode-replicas``) adds a second
deployment of ReplicaServer, ``PrefillServer``: the ingress first sends a completion request,
cut to one output token, to a prefill replica, which answers once the prompt's blocks are in the
shared store (``--kv-offload-remote``, written as each step computes them); then it forwards the
request itself to a decode replica, whose prefix lookup reads those blocks. The store, not Ray's
object store, carries them: blocks there are already sealed and verified on read, any replica on
any node reaches them, and a later request with the same prefix hits them too. A prefill that
fails costs only time: the decode replica computes the prompt itself.
"""

# no `from __future__ import annotations`: Ray's ingress reads the route signatures' types at run time
import asyncio
import json
import logging
import signal
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import Future
from typing import Any, cast

import ray
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from kvserve.cache.prefix_cache import prompt_block_hashes
from kvserve.cluster import router_metrics, routers
from kvserve.cluster.asgi import ForwardedRequest, ResponseStart, call_asgi
from kvserve.cluster.config import ClusterConfig
from kvserve.cluster.metrics import exposition, merge_replica_metrics
from kvserve.config import EngineConfig
from kvserve.server.app import APIError, ServerConfig

logger = logging.getLogger("kvserve")
STATS_PERIOD_S = 1.0  # how often Ray polls each replica's routing stats (and its metrics are pushed)
SHARED_WRITE_TIMEOUT_S = 30.0  # a prefill replica's wait for its blocks to reach the shared store
COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")


@ray.remote(num_cpus=0)
class MetricsBoard:
    """The latest Prometheus text of each replica, with when it arrived."""

    def __init__(self) -> None:
        self.texts: dict[str, tuple[str, float]] = {}

    def put(self, replica: str, text: str) -> None:
        self.texts[replica] = (text, time.time())

    def fresh(self, max_age_s: float) -> dict[str, str]:
        """Texts younger than ``max_age_s``: a dead replica's stop counting after that."""
        now = time.time()
        self.texts = {r: (t, at) for r, (t, at) in self.texts.items() if now - at <= max_age_s}
        return {r: t for r, (t, _) in self.texts.items()}


class ReplicaServer:
    """One kvserve engine and its HTTP app, served to the ingress through Ray."""

    def __init__(self, engine_config: EngineConfig, server_config: ServerConfig, threads: int,
                 board: Any) -> None:
        import torch

        from kvserve.llm import _setup_logging
        from kvserve.server.serve import build

        _setup_logging()
        built: Future[Any] = Future()

        def load_and_loop() -> None:
            # the model loads on the thread that then steps it: a second thread's OpenMP team
            # would make libgomp stop spinning (AsyncEngine.run)
            try:
                torch.set_num_threads(max(1, threads))
                engine, app = build(engine_config, server_config, start=False)
            except BaseException as exc:
                built.set_exception(exc)
                return
            built.set_result((engine, app))
            engine.run()

        threading.Thread(target=load_and_loop, name="kvserve-engine", daemon=True).start()
        self.engine, self.app = built.result()
        self.replica = str(serve.get_replica_context().replica_id.unique_id)
        self.board = board

    async def __call__(self, request: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
        async for part in call_asgi(self.app, request, self.replica):
            yield part

    async def prefill(self, request: ForwardedRequest) -> int:
        """Serve ``request`` (a prefill-only copy of a completion request) and return its HTTP
        status once the blocks its prompt filled are in the shared store."""
        status = 500
        async for part in call_asgi(self.app, request, self.replica):
            if isinstance(part, ResponseStart):
                status = part.status
        for written in self.engine.engine.shared_writes():
            if not await asyncio.to_thread(written.wait, SHARED_WRITE_TIMEOUT_S):
                logger.warning("the shared store took over %.0f s to take a prompt's blocks", SHARED_WRITE_TIMEOUT_S)
                return 504
        return status

    async def record_routing_stats(self) -> dict[str, Any]:
        """Polled by Ray every STATS_PERIOD_S: what the kv-aware router weighs; the replica's
        metrics go to the board on the same beat."""
        parts = [part async for part in call_asgi(self.app, ForwardedRequest("GET", "/metrics", b"", [], b""),
                                                  self.replica)]
        self.board.put.remote(self.replica, b"".join(p for p in parts if isinstance(p, bytes)).decode())
        return {"kv_usage": self.engine.kv_stats.usage, "waiting": self.engine.num_waiting,
                "running": self.engine.num_running}

    def check_health(self) -> None:
        """Ray restarts a replica whose engine thread failed."""
        if self.engine.error is not None:
            raise RuntimeError(f"the engine failed: {self.engine.error!r}")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


def _unavailable(message: str) -> APIError:
    return APIError(503, message, kind="service_unavailable_error", code="replica_unavailable",
                    headers={"Retry-After": "1"})


async def _relay(stream: DeploymentResponseGenerator) -> AsyncIterator[bytes]:
    """Server-sent events from the replica; if it dies mid-stream, an error event (the status
    line went out already), as kvserve serve reports a failed engine."""
    try:
        async for part in stream:
            if isinstance(part, bytes):
                yield part
    except (RayActorError, ActorUnavailableError) as exc:
        error = _unavailable(f"the replica serving this request died mid-stream: {type(exc).__name__}")
        yield f"data: {json.dumps(error.body())}\n\n".encode()


def prefill_body(body: bytes) -> bytes | None:
    """The prefill replica's copy of a completion request: the same prompt, one output token, no
    streaming; None when a prefill would not help (prompt_logprobs: the decode replica computes
    such a prompt whole, as echo with logprobs does) or the body is no JSON object (the decode
    replica names the problem)."""
    try:
        request = json.loads(body)
    except ValueError:
        return None
    if not isinstance(request, dict) or request.get("prompt_logprobs") is not None or (
            request.get("echo") and request.get("logprobs") is not None):
        return None
    for key in ("max_completion_tokens", "stream_options", "min_tokens", "logprobs", "top_logprobs", "echo"):
        request.pop(key, None)
    request.update(max_tokens=1, stream=False, n=1)
    return json.dumps(request, ensure_ascii=False).encode()


ingress_app = FastAPI(title="kvserve (Ray Serve)", docs_url=None, redoc_url=None)


@serve.ingress(ingress_app)
class Ingress:
    """The OpenAI endpoint: forwards every route to a replica chosen by the router. (Ray pickles
    this class when it is decorated: whatever it calls must be defined above it.)"""

    def __init__(self, replicas: DeploymentHandle, model: str, block_size: int, board: Any,
                 prefill_replicas: DeploymentHandle | None = None) -> None:
        from kvserve.model.loader import load_tokenizer, resolve_model_path

        self.replicas = replicas.options(stream=True)
        self.prefill_replicas = prefill_replicas
        self.block_size = block_size
        self.tokenizer = load_tokenizer(resolve_model_path(model))
        self.board = board

    def block_keys(self, path: str, body: bytes) -> tuple[bytes, ...]:
        """The prompt's chained block keys as the replica will compute them; none when the
        body is not a valid completion request (the replica answers that with a 400)."""
        from kvserve.model.tokenizer import chat_token_ids
        from kvserve.server.protocol import ChatCompletionRequest, CompletionRequest

        if self.tokenizer is None or path not in COMPLETION_PATHS:
            return ()
        try:
            if path == "/v1/chat/completions":
                chat = ChatCompletionRequest.model_validate(json.loads(body))
                ids = chat_token_ids(self.tokenizer, chat.chat(), chat.add_generation_prompt)
            else:
                prompt = CompletionRequest.model_validate(json.loads(body)).prompts()[0]  # a batch: its first
                ids = list(self.tokenizer.encode(prompt)) if isinstance(prompt, str) else list(prompt)
        except Exception:  # any invalid body: the replica's validation names the problem
            return ()
        return tuple(prompt_block_hashes(ids, self.block_size))

    async def _prefill(self, request: ForwardedRequest) -> None:
        """With disaggregation: the prompt computed on a prefill replica, its blocks in the shared
        store, before the decode replica gets the request. A failure is logged and counted: the
        decode replica then computes the prompt itself."""
        if self.prefill_replicas is None or not request.block_keys:
            return
        body = prefill_body(request.body)
        if body is None:
            return
        headers = [(k, v) for k, v in request.headers if k != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        try:
            status = await self.prefill_replicas.prefill.remote(request._replace(body=body, headers=headers))
        except Exception as exc:  # a dead replica, or an error inside it: the decode replica computes it
            logger.warning("a prefill replica failed (%s): the decode replica computes the prompt", exc)
            status = 0
        router_metrics.PREFILLS.labels("done" if status == 200 else "failed").inc()

    def _open(self, request: ForwardedRequest) -> DeploymentResponseGenerator:
        stream = self.replicas.remote(request)
        assert isinstance(stream, DeploymentResponseGenerator)  # what a stream=True handle returns
        return stream

    @ingress_app.get("/metrics")
    async def metrics(self) -> Response:
        texts = await self.board.fresh.remote(5 * STATS_PERIOD_S)
        return Response(exposition(merge_replica_metrics(texts), router_metrics.ROUTER_REGISTRY),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    @ingress_app.api_route("/{path:path}", methods=["GET", "POST", "DELETE"])
    async def forward(self, request: Request, path: str) -> Response:
        body = await request.body()
        headers = [(k.lower(), v) for k, v in request.headers.raw if k.lower() != b"host"]
        forwarded = ForwardedRequest(request.method, request.url.path, request.url.query.encode(), headers, body,
                                     self.block_keys(request.url.path, body))
        await self._prefill(forwarded)
        for _attempt in range(2):  # a busy replica's 503: once more, elsewhere
            stream = self._open(forwarded)
            try:
                start = await stream.__anext__()
            except (RayActorError, ActorUnavailableError) as exc:
                return _unavailable(f"the replica serving this request is gone: {type(exc).__name__}").response()
            assert isinstance(start, ResponseStart)
            if start.status == 503 and not forwarded.exclude:
                stream.cancel()
                forwarded = forwarded._replace(exclude=frozenset({start.replica}))
                continue
            break
        response_headers = {k.decode(): v.decode() for k, v in start.headers if k.lower() != b"content-length"}
        response_headers["x-kvserve-replica"] = start.replica
        if response_headers.get("content-type", "").startswith("text/event-stream"):
            return StreamingResponse(_relay(stream), status_code=start.status, headers=response_headers)
        try:  # a whole JSON body: a replica that dies before it ends gives a 503
            content = b"".join([part async for part in stream if isinstance(part, bytes)])
        except (RayActorError, ActorUnavailableError) as exc:
            return _unavailable(f"the replica serving this request is gone: {type(exc).__name__}").response()
        return Response(content, status_code=start.status, headers=response_headers)


def build_app(engine_config: EngineConfig, server_config: ServerConfig, cluster: ClusterConfig) -> Any:
    """The Serve application: N replicas with the chosen router, behind the ingress (and with
    disaggregation, the prefill replicas beside them)."""
    cluster.check_engine(engine_config.offload_config.kv_offload_remote)
    board = MetricsBoard.remote()  # type: ignore[attr-defined]
    router_settings: dict[str, Any] = {
        "request_router_class": routers.ROUTERS[cluster.router],
        "request_router_kwargs": {
            "max_request_imbalance": cluster.max_request_imbalance, "max_kv_imbalance": cluster.max_kv_imbalance,
            "shared_store": engine_config.offload_config.kv_offload_remote is not None,
        } if cluster.router == "kv-aware" else {},
        "request_routing_stats_period_s": STATS_PERIOD_S, "request_routing_stats_timeout_s": 5 * STATS_PERIOD_S}
    router = RequestRouterConfig(**router_settings)
    deployment = cast(Any, serve.deployment)  # its overloads confuse mypy with a class argument
    gpus = cluster.gpus_per_replica or (1.0 if engine_config.model_config.device.startswith("cuda") else 0.0)
    threads = max(1, int(cluster.cpus_per_replica))

    def replicas(name: str, count: int) -> Any:
        return deployment(ReplicaServer).options(
            name=name, num_replicas=count, max_ongoing_requests=cluster.max_ongoing_requests,
            ray_actor_options={"num_cpus": cluster.cpus_per_replica, "num_gpus": gpus},
            request_router_config=router, health_check_period_s=2, health_check_timeout_s=10,
        ).bind(engine_config, server_config, threads, board)

    prefill = replicas("PrefillServer", cluster.prefill_replicas) if cluster.disaggregated else None
    ingress = deployment(Ingress).options(
        num_replicas=1, max_ongoing_requests=10_000, ray_actor_options={"num_cpus": 0})
    return ingress.bind(replicas("ReplicaServer", cluster.num_replicas), engine_config.model_config.model,
                        engine_config.cache_config.block_size, board, prefill)


def deploy(engine_config: EngineConfig, server_config: ServerConfig, cluster: ClusterConfig, host: str,
           port: int) -> None:
    """Deploy on the Ray cluster this process is connected to; returns once every replica is up.
    One HTTP proxy, on the head node: one OpenAI endpoint for the whole cluster."""
    serve.start(http_options={"host": host, "port": port}, proxy_location="HeadOnly")
    serve.run(build_app(engine_config, server_config, cluster), name="kvserve", route_prefix="/")


def run(engine_config: EngineConfig, server_config: ServerConfig, cluster: ClusterConfig, host: str,
        port: int) -> int:
    """Start (or join) Ray, deploy, serve until SIGTERM/SIGINT, then tear the application down."""
    ray.init(address=cluster.ray_address, ignore_reinit_error=True, log_to_driver=True)
    deploy(engine_config, server_config, cluster, host, port)
    if cluster.disaggregated:
        logger.info("serving %d prefill and %d decode kvserve replicas (router %s) at http://%s:%d",
                    cluster.prefill_replicas, cluster.decode_replicas, cluster.router, host, port)
    else:
        logger.info("serving %d kvserve replicas (router %s) at http://%s:%d", cluster.num_replicas,
                    cluster.router, host, port)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    serve.shutdown()
    return 0
