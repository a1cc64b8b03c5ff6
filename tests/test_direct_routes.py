"""Direct dispatch (wde/server/direct_routes.py): which routes skip FastAPI's router, that they answer exactly as
they would through it (results, our error shapes, Starlette's 500, a client that hung up), and that everything
else still goes through FastAPI. The server suites (test_server*, test_hostile_inputs, test_openapi_fuzz, the
client shapes) run every WDE route through the direct path as well."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRouter
from fastapi.testclient import TestClient
from starlette.exceptions import HTTPException

from tests.test_server import serve
from wde import Engine
from wde.server.app import _ROUTERS
from wde.server.direct_routes import DirectRoutes, direct_table
from wde.server.errors import ApiError, api_error_handler, http_error_handler, internal_error_handler

router = APIRouter()


def routed(request: Request) -> dict[str, Any]:
    """What a handler can tell about its way in: FastAPI's router puts the matched endpoint into the scope."""
    return {"via_router": "endpoint" in request.scope, "path": request.url.path}


@router.post("/plain")
async def plain(request: Request) -> JSONResponse:
    return JSONResponse({**routed(request), "body": await request.json()})


@router.get("/plain")
async def plain_get(request: Request) -> JSONResponse:
    return JSONResponse(routed(request))


@router.post("/items/{item}")  # a path parameter: FastAPI's
async def item(request: Request, item: str) -> JSONResponse:
    return JSONResponse({**routed(request), "item": item})


@router.post("/items/fixed")  # shadowed by /items/{item} above: a router never reaches it
async def fixed(request: Request) -> JSONResponse:
    return JSONResponse(routed(request))


@router.post("/query")  # a query parameter: FastAPI parses it
async def query(request: Request, n: int = 1) -> JSONResponse:
    return JSONResponse({**routed(request), "n": n})


def token(request: Request) -> str:
    return request.headers.get("x-token", "none")


@router.post("/depends")  # a dependency: FastAPI solves it
async def depends(request: Request, tok: str = Depends(token)) -> JSONResponse:
    return JSONResponse({**routed(request), "token": tok})


@router.post("/dict")  # returns a dict: FastAPI serializes it
async def returns_dict(request: Request) -> dict:
    return routed(request)


@router.post("/sync")  # a plain function: FastAPI runs it in its thread pool
def sync(request: Request) -> JSONResponse:
    return JSONResponse(routed(request))


@router.post("/api-error")
async def api_error(request: Request) -> JSONResponse:
    raise ApiError("validation", "input: too many", "input")


@router.post("/http-error")
async def http_error(request: Request) -> JSONResponse:
    raise HTTPException(418, "short and stout")


@router.post("/status-error")
async def status_error(request: Request) -> JSONResponse:
    raise HTTPException(409, "taken")


@router.post("/crash")
async def crash(request: Request) -> JSONResponse:
    raise ZeroDivisionError("a bug")


@router.post("/teapot")
async def teapot(request: Request) -> Response:
    return Response(b"short", status_code=418, headers={"x-kind": "teapot"})


async def conflict(request: Request, exc: Exception) -> JSONResponse:
    return JSONResponse({"conflict": True}, status_code=409)


def app(direct: bool) -> FastAPI:
    app = FastAPI()
    app.include_router(router)
    app.add_exception_handler(ApiError, api_error_handler)
    app.add_exception_handler(HTTPException, http_error_handler)
    app.add_exception_handler(409, conflict)
    app.add_exception_handler(Exception, internal_error_handler)
    if direct:
        app.add_middleware(DirectRoutes, routes=router.routes, handlers=app.exception_handlers)
    return app


def test_the_table_holds_the_routes_a_handler_of_the_request_alone_serves() -> None:
    assert set(direct_table(router.routes)) == {
        ("POST", "/plain"), ("GET", "/plain"), ("POST", "/api-error"), ("POST", "/http-error"),
        ("POST", "/status-error"), ("POST", "/crash"), ("POST", "/teapot")}


def test_every_wde_route_but_the_one_with_a_path_parameter_is_direct() -> None:
    table = direct_table([r for router in _ROUTERS for r in router.routes])
    for hot in ("/v1/embeddings", "/embeddings", "/embed", "/v2/embed", "/v1/rerank", "/rerank", "/pooling",
                "/v1/score", "/predict", "/tokenize", "/vectors"):
        assert ("POST", hot) in table
    assert ("GET", "/health") in table and ("GET", "/v1/models") in table
    assert not any(path.startswith("/v1/models/") for _, path in table)


CASES = [("post", "/plain", {"json": {"a": [1, 2]}}), ("get", "/plain", {}), ("post", "/items/fixed", {}),
         ("post", "/items/x", {}), ("post", "/query?n=3", {}), ("post", "/depends", {"headers": {"x-token": "t"}}),
         ("post", "/dict", {}), ("post", "/sync", {}), ("post", "/api-error", {}), ("post", "/http-error", {}),
         ("post", "/status-error", {}), ("post", "/crash", {}), ("post", "/teapot", {}), ("post", "/nowhere", {}),
         ("delete", "/plain", {}), ("post", "/plain/", {"json": {}}), ("head", "/plain", {})]


@pytest.mark.parametrize("method,path,kwargs", CASES, ids=[f"{m} {p}" for m, p, _ in CASES])
def test_an_answer_is_the_same_either_way(method: str, path: str, kwargs: dict[str, Any]) -> None:
    answers = []
    for direct in (False, True):
        with TestClient(app(direct), raise_server_exceptions=False) as client:
            r = getattr(client, method)(path, **kwargs)
        body = r.json() if r.content and r.headers.get("content-type") == "application/json" else r.content
        if isinstance(body, dict):
            body.pop("via_router", None)
        answers.append((r.status_code, body, {k: v for k, v in r.headers.items() if k != "content-length"}))
    assert answers[1] == answers[0]


@pytest.mark.parametrize("path,direct", [("/plain", True), ("/items/fixed", False), ("/query", False),
                                         ("/depends", False), ("/dict", False), ("/sync", False)])
def test_only_the_table_skips_the_router(path: str, direct: bool) -> None:
    with TestClient(app(True)) as client:
        assert client.post(path, json={}).json()["via_router"] is not direct


def test_the_error_handlers_answer_as_fastapis_stack_does() -> None:
    with TestClient(app(True), raise_server_exceptions=False) as client:
        assert client.post("/api-error").json()["error"]["param"] == "input"
        assert "short and stout" in client.post("/http-error").json()["error"]["message"]  # ours, not Starlette's
        assert client.post("/status-error").json() == {"conflict": True}  # by status code first
        crashed = client.post("/crash")
        assert crashed.status_code == 500 and "internal error" in crashed.json()["error"]["message"]
    with TestClient(app(True)) as client, pytest.raises(ZeroDivisionError):  # re-raised, as Starlette does
        client.post("/crash")


def test_a_wde_route_is_served_directly_by_a_live_server(minilm_engine: Engine,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Through uvicorn: the embeddings route never reaches FastAPI's route handling; /openapi.json still lists it;
    a path the table does not hold still gets our 404."""
    from fastapi import routing

    through_fastapi: list[str] = []
    handle = routing.APIRoute.handle

    async def counting(self: routing.APIRoute, scope: dict, receive: Any, send: Any) -> None:
        through_fastapi.append(self.path)
        await handle(self, scope, receive, send)

    monkeypatch.setattr(routing.APIRoute, "handle", counting)
    with serve(minilm_engine, served_model_name="minilm") as (base, _):
        r = httpx.post(f"{base}/v1/embeddings", json={"input": "hello", "model": "minilm"})
        assert r.status_code == 200 and r.headers["x-request-id"]
        assert len(r.json()["data"][0]["embedding"]) == 384
        bad = httpx.post(f"{base}/v1/embeddings", json={"input": [], "model": "minilm"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "input"
        assert httpx.get(f"{base}/v1/models/minilm").status_code == 200  # a path parameter: FastAPI's route
        assert "/v1/embeddings" in httpx.get(f"{base}/openapi.json").json()["paths"]
        assert httpx.post(f"{base}/v1/embeddings/nowhere", json={}).json()["error"]["type"]
    assert through_fastapi == ["/v1/models/{model_id:path}"]


def test_a_request_fastapis_telemetry_traces_goes_through_its_router() -> None:
    """With OpenTelemetry configured, FastAPI names the route in the request's span: such requests keep its path."""
    sdk = pytest.importorskip("opentelemetry.sdk.trace")
    export = pytest.importorskip("opentelemetry.sdk.trace.export")
    memory = pytest.importorskip("opentelemetry.sdk.trace.export.in_memory_span_exporter")
    spans = memory.InMemorySpanExporter()
    provider = sdk.TracerProvider()
    provider.add_span_processor(export.SimpleSpanProcessor(spans))
    traced = FastAPI(telemetry={"tracer_provider": provider})
    traced.include_router(router)
    traced.add_middleware(DirectRoutes, routes=router.routes, handlers=traced.exception_handlers)
    with TestClient(traced) as client:
        assert client.post("/plain", json={}).json()["via_router"] is True
    assert "POST /plain" in [span.name for span in spans.get_finished_spans()]
    with TestClient(app(True)) as client:  # untraced: direct
        assert client.post("/plain", json={}).json()["via_router"] is False
