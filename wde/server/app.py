"""The FastAPI app: routers, middleware, error handlers, /metrics, and the engine thread's lifetime."""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

import wde
from wde.async_engine import AsyncEngine
from wde.engine import Engine
from wde.server import openai_routes, rerank_routes, score_routes, tei_routes
from wde.server.config import ServerConfig
from wde.server.errors import ApiError, api_error_handler
from wde.server.metrics import ServerMetrics
from wde.server.middleware import ApiKeyMiddleware, MetricsMiddleware
from wde.server.service import ClientDisconnected, Service

_ROUTERS = (openai_routes.router, score_routes.router, rerank_routes.router, tei_routes.router)


async def _client_gone(request: Request, exc: Exception) -> Response:
    """Nobody reads this answer; 499 (nginx's 'client closed request') keeps it apart in the metrics."""
    return Response(status_code=499)


def create_app(engine: Engine, config: ServerConfig | None = None) -> FastAPI:
    """An app serving `engine`; its engine thread starts and stops with the app (the caller closes `engine`)."""
    config = config or ServerConfig()
    metrics = ServerMetrics()
    async_engine = AsyncEngine(engine, config.max_concurrent_requests, on_batch=metrics.on_batch)
    metrics.bind(async_engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        try:
            yield
        finally:
            async_engine.stop()

    app = FastAPI(title="WDE", version=wde.__version__, lifespan=lifespan)
    app.state.service = Service(async_engine, config, metrics)
    for router in _ROUTERS:
        app.include_router(router)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    app.add_exception_handler(ApiError, api_error_handler)
    app.add_exception_handler(ClientDisconnected, _client_gone)
    routes = frozenset(r.path for router in _ROUTERS for r in router.routes) | {"/metrics"}
    app.add_middleware(MetricsMiddleware, metrics=metrics, routes=routes)
    if config.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)
    return app


def run_server(config: ServerConfig) -> None:
    """Build the engine, serve until interrupted, then release the engine."""
    import uvicorn

    engine = Engine.from_workflow(config.workflow, config.model, overrides=config.overrides,
                                  trust_remote_code=config.trust_remote_code)
    with engine:
        uvicorn.run(create_app(engine, config), host=config.host, port=config.port, log_level="info",
                    access_log=config.access_log)
