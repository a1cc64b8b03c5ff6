"""Direct dispatch: the routes whose handler takes only the `Request` and returns a `Response` (every WDE route
but /v1/models/{id}: they read and validate their bodies themselves, wde/server/protocol.py) are called straight
from the innermost middleware, without FastAPI's router, dependency solving and per-request exit stacks.

That machinery cost about 40% of the event loop's CPU per request on a small model (py-spy, docs/benchmarks.md
"Serving: the event loop's time per request"), and the event loop, not the device, bounds a server of short
inputs. What a request sees is the same: the same handler, the same exception handlers in the same order
(`Exception` itself stays with Starlette's outermost error middleware, as in FastAPI's own stack), and anything
the table does not name (another method, a trailing slash, a path parameter, a route added after the app was
built, a request FastAPI's telemetry traces) goes through FastAPI as before. /openapi.json is unchanged: the routes
stay registered.
"""

from __future__ import annotations

import inspect
import typing
from typing import Any, Awaitable, Callable, Mapping, Sequence

from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Match

from wde.server.middleware import ASGIApp, Receive, Scope, Send

TRACED = "fastapi.telemetry"
"""The scope key FastAPI's native telemetry sets on a request it traces (OpenTelemetry configured): such a request
goes through FastAPI's router, which names its route in the span (`http.route`) and times the endpoint."""

Endpoint = Callable[[Request], Awaitable[Response]]
Handler = Callable[[Request, Exception], Awaitable[Response]]


def direct_endpoint(route: Any) -> Endpoint | None:
    """The handler of `route` where it can be called directly: an `APIRoute` without path parameters or
    dependencies, an async handler of the request alone, annotated to return a `Response` (FastAPI would otherwise
    validate or serialize what it returns); None otherwise, and None where FastAPI's route no longer has the
    attributes read here (that route then goes through FastAPI, as every route did before)."""
    if not isinstance(route, APIRoute):
        return None
    try:
        d = route.dependant
        if (route.param_convertors or route.response_model is not None or d.request_param_name is None
                or d.path_params or d.query_params or d.header_params or d.cookie_params or d.body_params
                or d.dependencies or d.background_tasks_param_name or d.response_param_name):
            return None
        returns = typing.get_type_hints(route.endpoint).get("return")
    except (AttributeError, NameError, TypeError):
        return None
    if inspect.iscoroutinefunction(route.endpoint) and isinstance(returns, type) and issubclass(returns, Response):
        return route.endpoint
    return None


def direct_table(routes: Sequence[Any]) -> dict[tuple[str, str], Endpoint]:
    """(method, path) -> handler, for each route `direct_endpoint` accepts that is also the route a router trying
    `routes` in order would pick for that method and path (the first full match: an earlier route with a path
    parameter can shadow a later fixed path)."""
    table: dict[tuple[str, str], Endpoint] = {}
    for route in routes:
        endpoint = direct_endpoint(route)
        for method in sorted(route.methods) if endpoint is not None else ():
            scope = {"type": "http", "method": method, "path": route.path, "root_path": ""}
            first = next(r for r in routes if r.matches(scope)[0] is Match.FULL)
            if first is route:
                table.setdefault((method, route.path), endpoint)
    return table


class DirectRoutes:
    """ASGI: calls the handlers `direct_table(routes)` names directly; anything else goes to `app`. Made when
    Starlette builds the middleware stack (the first request), so it sees every route and handler added by then.

    Exceptions: a handler's exception goes to the first of `handlers` (FastAPI's `app.exception_handlers`) that
    matches it, an `HTTPException` first by its status code, as Starlette's `ExceptionMiddleware` does; `Exception`
    and status 500 are left to propagate, to the outermost error middleware, as Starlette arranges them."""

    def __init__(self, app: ASGIApp, routes: Sequence[Any], handlers: Mapping[Any, Handler]) -> None:
        self.app = app
        self.table = direct_table(routes)
        self.by_status = {k: v for k, v in handlers.items() if isinstance(k, int) and k != 500}
        self.by_class = {k: v for k, v in handlers.items() if isinstance(k, type) and k is not Exception}

    def handler_for(self, exc: Exception) -> Handler | None:
        if isinstance(exc, HTTPException) and exc.status_code in self.by_status:
            return self.by_status[exc.status_code]
        for cls in type(exc).__mro__:
            if cls in self.by_class:
                return self.by_class[cls]
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = self.table.get((scope["method"], scope["path"])) if scope["type"] == "http" else None
        if endpoint is None or scope.get("root_path") or scope.get(TRACED) is not None:
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive, send)
        try:
            response = await endpoint(request)
        except Exception as exc:
            handler = self.handler_for(exc)
            if handler is None:
                raise
            response = await handler(request, exc)
            exc.__traceback__ = None  # a reused exception instance would pile up tracebacks
        await response(scope, receive, send)
