"""The FastAPI app: routers, middleware, error handlers, /metrics, and the engine thread's lifetime."""

from __future__ import annotations

import dataclasses
import logging
import signal
import socket
import threading
from contextlib import ExitStack, asynccontextmanager
from typing import AsyncIterator, Sequence

from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, Gauge
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

import wde
from wde.async_engine import AsyncEngine
from wde.core.client import CoreClient
from wde.engine import Engine
from wde.restarts import EngineFailed
from wde.serving import ServingFrontEnd
from wde.token_pool import TokenPool
from wde.server import (cohere_routes, lora_routes, openai_routes, rerank_routes, score_routes, tei_routes,
                        weaviate_routes)
from wde.server.config import ServerConfig
from wde.server.direct_routes import DirectRoutes
from wde.server.errors import ApiError, api_error_handler, http_error_handler, internal_error_handler
from wde.server.grpc import prepare as prepare_grpc
from wde.server.grpc import serving as serving_grpc
from wde.server.heap import frozen_heap
from wde.server.metrics import ServerMetrics
from wde.server.middleware import (ApiKeyMiddleware, JsonContentTypeMiddleware, MetricsMiddleware, OriginMiddleware,
                                   PayloadLimitMiddleware, RequestIdMiddleware)
from wde.server.model_config import name_table
from wde.server.service import ClientDisconnected, ServedModels, Service
from wde.server.startup import StartupError, check_metrics_dir, listen, log_to_stderr, startup_line
from wde.server.timeouts import BodyTimeoutMiddleware, client_gone, http_protocol

_ROUTERS = (openai_routes.router, score_routes.router, rerank_routes.router, cohere_routes.router, tei_routes.router,
            weaviate_routes.router, lora_routes.router)


def create_app(engine: Engine | CoreClient | Sequence[Engine | CoreClient],
               config: ServerConfig | None = None) -> FastAPI:
    """An app serving `engine`: an `Engine` in this process, whose engine thread starts and stops with the app
    (the caller closes `engine`), or, in an API server of a split engine, the client of the engine core. A server
    of several models (`config.served_models()`) is given one per model, in that order; each is a `Service` in
    `app.state.models`, the first also `app.state.service` (the default model). With `config.grpc_port` the app's
    lifespan also runs TEI's gRPC API on the default model (wde/server/grpc)."""
    config = config or ServerConfig()
    engines = list(engine) if isinstance(engine, (list, tuple)) else [engine]
    if len(engines) != len(config.served_models()):
        raise ValueError(f"create_app got {len(engines)} engines for the {len(config.served_models())} models of"
                         " its config; give one per model, in order")
    metrics = ServerMetrics()
    names = name_table(config.served_models())
    async_engines: list[ServingFrontEnd] = []
    for i, each in enumerate(engines):
        model_metrics = metrics.for_model(names[i][0])
        if isinstance(each, Engine):
            async_engines.append(AsyncEngine(each, config.max_concurrent_requests, on_batch=model_metrics.on_batch))
            model_metrics.on_weights(each.components["model"])
        else:
            async_engines.append(each)
        model_metrics.bind(async_engines[-1])
    in_process = isinstance(engines[0], Engine)
    app_pool = share_tokens([e for e in engines if isinstance(e, Engine)], [n[0] for n in names], config, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        started: list[ServingFrontEnd] = []
        try:
            for each in async_engines:
                each.start()
                started.append(each)
            async with serving_grpc(app, config, reuse_port=not in_process):
                yield
        finally:
            for each in started:
                each.stop()

    app = FastAPI(title="WDE", version=wde.__version__, lifespan=lifespan)
    services = [Service(each, config, metrics, i) for i, each in enumerate(async_engines)]
    app.state.models = ServedModels(services)
    app.state.service = services[0]
    app.state.metrics = metrics
    app.state.token_pool = app_pool
    for router in _ROUTERS:
        app.include_router(router)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    app.add_exception_handler(ApiError, api_error_handler)
    app.add_exception_handler(ClientDisconnected, client_gone)  # hung up while waiting: 499, one log line
    app.add_exception_handler(ClientDisconnect, client_gone)  # hung up while sending the body: the same
    app.add_exception_handler(HTTPException, http_error_handler)
    app.add_exception_handler(Exception, internal_error_handler)
    # Added innermost first: a request passes the id, metrics, origin, key, content-type, size and body-time
    # checks in that order (the origin check before the key: a CORS preflight carries no key), then is handed
    # to its route's handler directly where it can be (wde/server/direct_routes.py), else to FastAPI's router.
    app.add_middleware(DirectRoutes, routes=[r for router in _ROUTERS for r in router.routes],
                       handlers=app.exception_handlers)
    app.add_middleware(BodyTimeoutMiddleware, timeout=config.body_timeout)
    limit = max(config.effective_payload_limit(svc.info.max_length, svc.max_image_bytes) for svc in services)
    app.add_middleware(PayloadLimitMiddleware, limit=limit)
    json_routes = frozenset(r.path for router in _ROUTERS for r in router.routes if "POST" in r.methods)
    app.add_middleware(JsonContentTypeMiddleware, paths=json_routes)
    if config.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)
    app.add_middleware(OriginMiddleware, allowed=config.allowed_origins)
    routes = frozenset(r.path for router in _ROUTERS for r in router.routes) | {"/metrics"}
    app.add_middleware(MetricsMiddleware, metrics=metrics, routes=routes)
    app.add_middleware(RequestIdMiddleware)
    return app


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def share_tokens(engines: Sequence[Engine], names: Sequence[str], config: ServerConfig,
                 metrics: ServerMetrics) -> TokenPool | None:
    """One token pool for the engines of this process (wde/token_pool.py) where it serves several models, or where
    `config.shared_token_budget` is given: its size that option, else the largest engine's own budget. Reported in
    /metrics as `wde_shared_token_pool_size` and, per model, `wde_shared_token_pool_tokens` (what its forwards hold
    now). None for one model without the option, and in an API server (its engines are the cores' processes)."""
    if not engines or (len(engines) == 1 and config.shared_token_budget is None):
        for engine in engines:  # an engine an earlier app of several models shared stops sharing
            engine.token_pool = None
        return None
    budgets = [e.scheduler.token_budget for e in engines if e.scheduler.token_budget is not None]
    pool = TokenPool(config.shared_token_budget or max(budgets, default=1))
    Gauge("wde_shared_token_pool_size", "tokens the forwards of every model's engine in this process may hold at"
          " once (--shared-token-budget, else the largest engine's budget)", registry=metrics.registry).set(pool.size)
    held = Gauge("wde_shared_token_pool_tokens", "tokens of the shared pool the model's forwards hold now",
                 ["model"], registry=metrics.registry)
    for engine, name in zip(engines, names):
        engine.token_pool, engine.pool_owner = pool, name
        held.labels(name).set_function(lambda name=name: pool.held(name))
    return pool


def run_server(config: ServerConfig) -> None:
    """Build the engine and serve until SIGINT/SIGTERM (finishing requests in flight), then release the engine.

    The port is bound before the model loads: a port in use or a bad host raises `StartupError` with nothing
    loaded, as does an unusable `PROMETHEUS_MULTIPROC_DIR`. Raises `EngineFailed` after a shutdown caused by the
    engine loop giving up (see `AsyncEngine`).
    """
    log_to_stderr(config.log_level)
    check_metrics_dir()
    sockets = listen(config.host, config.port)
    try:
        _serve(prepare_grpc(config), sockets)
    finally:
        for sock in sockets:
            sock.close()


def _serve(config: ServerConfig, sockets: list[socket.socket]) -> None:
    import uvicorn

    if config.port == 0:  # the port the kernel chose, for the start-up line
        config = dataclasses.replace(config, port=sockets[0].getsockname()[1])
    with ExitStack() as stack:
        engines = [stack.enter_context(Engine.from_workflow(**config.engine_args(i)))
                   for i in range(len(config.served_models()))]
        app = create_app(engines, config)
        service = app.state.service
        others = [(svc.info, svc.model_names) for svc in app.state.models.services[1:]]
        logging.getLogger("wde").info(startup_line(config, service.info, service.model_names, others=others))
        server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                                               access_log=config.access_log,
                                               http=http_protocol(config, service.metrics)))
        fatal: list[BaseException] = []

        def on_fatal(error: BaseException) -> None:
            fatal.append(error)
            server.should_exit = True

        for svc in app.state.models.services:
            svc.engine.on_fatal = on_fatal
        # uvicorn re-raises a caught SIGTERM after its graceful shutdown, with the handler that was in place
        # before it started; with the default one the process would die by the signal (exit 143), not exit 0.
        # This one also stops a server that is told to before uvicorn's own handler is in place.
        previous = (signal.signal(signal.SIGTERM, lambda *_: setattr(server, "should_exit", True))
                    if _main_thread() else None)
        try:
            with frozen_heap():
                server.run(sockets=sockets)
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
        if not server.started:  # the app's start-up failed: uvicorn logged it and returned
            raise getattr(app.state, "startup_error", None) or StartupError("the server's start-up failed (the log"
                                                                            " above says why)")
    if fatal:
        raise EngineFailed(f"the engine loop failed repeatedly and the server shut down: {type(fatal[0]).__name__}:"
                           f" {fatal[0]}")
