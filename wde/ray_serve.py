"""WDE on Ray Serve: `build_app(args)` turns what `wde serve` takes into a Ray Serve application.

    serve run wde.ray_serve:build_app model=/models/bge-m3 num_replicas=2
    serve.run(build_app({"model": "/models/bge-m3", "autoscaling_config": {"min_replicas": 1, "max_replicas": 8}}))

Each replica (`Replica`) builds one `Engine` in its constructor and serves it with the very FastAPI app `wde serve`
builds (`wde.server.app.create_app`): every route, limit, error shape, request id and /metrics is the same, and
the app's lifespan (the engine loop) starts inside the replica and stops, then the engine is closed, when Ray stops
the replica. Ray does the rest: its HTTP proxy, routing between replicas, autoscaling (`autoscaling_config`),
placement (`ray_actor_options`), and replacing a replica that died or whose /health check fails (`check_health`).

With `models: [{model: ...}, ...]` every model is a deployment of its own (own replicas, own autoscaling) behind one
`Router` deployment that picks the deployment by the request body's `model` field (the first model when the body
names none, as TEI's routes never do). Ray is imported by `build_app` only: nothing else in WDE needs it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import difflib
import json
import logging
import os
import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError, create_model, field_validator

from wde.server.config import ServerConfig

log = logging.getLogger("wde.ray_serve")

NOT_ON_RAY = {
    "host": "Ray Serve's proxy listens for every replica (serve start --http-host, or http_options in a Serve config)",
    "port": "Ray Serve's proxy listens for every replica (serve start --http-port, or http_options in a Serve config)",
    "grpc_port": "TEI's gRPC API is not served through Ray Serve's proxy (use wde serve --grpc-port)",
    "header_timeout": "Ray Serve's proxy reads request headers, not WDE (the proxy's own timeouts apply)",
    "access_log": "Ray Serve writes the access log (each replica's log under /tmp/ray/session_latest/logs/serve)",
    "api_servers": "a replica is one process; add replicas (num_replicas, autoscaling_config) instead",
}
"""`wde serve` options that have no meaning behind Ray's proxy, and why; `build_app` refuses them by name."""

IMAGE_LIMITS = ("max_image_pixels", "max_image_aspect_ratio", "max_request_image_pixels")
"""`wde serve` options that are `--set` overrides of the input processor (`wde.cli.image_limit_overrides`)."""

DEFAULT_MAX_ONGOING = 64
"""Requests Ray hands one replica at once unless `max_ongoing_requests` says otherwise: Ray's own default (5) would
cap the engine's batches at five requests; past this, requests wait in Ray's router for a free replica."""

ROUTER_BODY_LIMIT = 256 * 2**20
"""Largest body the multi-model router reads to find its `model` (each model's app then applies its own limit)."""
ROUTER_MAX_ONGOING = 1024
"""Requests one `Router` replica relays at once (it only reads a body's `model` and waits on a model's replica)."""


class RayServeArgsError(ValueError):
    """`build_app`'s arguments are refused: one line naming the argument (Ray prints it and the app is not run)."""


class RayOptions(BaseModel):
    """Ray Serve's own deployment options (passed to `Deployment.options`; Ray validates their contents)."""

    model_config = ConfigDict(extra="forbid")
    num_replicas: PositiveInt | Literal["auto"] | None = None
    autoscaling_config: dict[str, Any] | None = None
    ray_actor_options: dict[str, Any] | None = None
    max_ongoing_requests: PositiveInt | None = None
    """None: `DEFAULT_MAX_ONGOING`, or `max_concurrent_requests` where that is lower (Ray holds the rest back
    rather than the app answering them 429)."""

    @field_validator("autoscaling_config", "ray_actor_options", mode="before")
    @classmethod
    def _json(cls, value: Any) -> Any:
        """`serve run` passes every argument as a string: a dict comes as JSON."""
        return json.loads(value) if isinstance(value, str) else value


def _server_fields() -> dict[str, Any]:
    """ServerConfig's fields as optional pydantic fields (None: `wde serve`'s default), `overrides` spelled `set`
    as the option is, the image limits added, and the options that mean nothing behind Ray's proxy left out."""
    hints = typing.get_type_hints(ServerConfig)
    fields: dict[str, Any] = {f.name: (hints[f.name] | None, None) for f in dataclasses.fields(ServerConfig)
                              if f.name not in NOT_ON_RAY and f.name not in ("overrides", "models")}
    fields["set"] = (list[str], Field(default_factory=list))
    fields.update({name: (float | None if name == "max_image_aspect_ratio" else int | None, None)
                   for name in IMAGE_LIMITS})
    return fields


class _ArgsBase(RayOptions):
    @field_validator("*", mode="before")
    @classmethod
    def _from_cli(cls, value: Any, info: Any) -> Any:
        """Strings from `serve run key=value`: a list-valued option as a JSON list or comma separated (`set` as one
        override unless it is a JSON list: an override's value may hold commas)."""
        if isinstance(value, os.PathLike):  # a model folder given as a Path from Python
            return os.fspath(value)
        annotation = str(cls.model_fields[info.field_name].annotation)
        if not isinstance(value, str) or not ("tuple" in annotation or "list" in annotation):
            return value
        if value.lstrip().startswith("["):
            return json.loads(value)
        return [value] if info.field_name == "set" else [v.strip() for v in value.split(",") if v.strip()]


ModelArgs = create_model("ModelArgs", __base__=_ArgsBase, __doc__="One model's arguments: `wde serve`'s options"
                         " with underscores, and Ray Serve's deployment options.", **_server_fields())


def _check_keys(args: dict[str, Any], where: str, allowed: set[str]) -> None:
    for key in args:
        if key in NOT_ON_RAY:
            raise RayServeArgsError(f"{where}{key}: not taken by wde.ray_serve: {NOT_ON_RAY[key]}")
        if key not in allowed:
            close = difflib.get_close_matches(key, sorted(allowed), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise RayServeArgsError(f"{where}{key}: unknown argument{hint}; wde.ray_serve takes"
                                    f" {', '.join(sorted(allowed))}")


def parse_model(args: dict[str, Any], where: str = "") -> tuple[ServerConfig, RayOptions]:
    """One model's `ServerConfig` (built and checked as `wde serve` builds it) and its Ray Serve options."""
    _check_keys(args, where, set(ModelArgs.model_fields))
    try:
        parsed = ModelArgs.model_validate(args)
    except ValidationError as e:  # a JSON value that does not parse included: a ValueError in a validator
        first = e.errors()[0]
        name = ".".join(str(p) for p in first["loc"])
        raise RayServeArgsError(f"{where}{name}: {first['msg']} (got {first.get('input')!r})") from None
    ray_keys = set(RayOptions.model_fields)
    ray = RayOptions.model_validate({k: getattr(parsed, k) for k in ray_keys})
    given = {k: v for k, v in parsed.model_dump(exclude=ray_keys | {"set", *IMAGE_LIMITS}).items() if v is not None}
    from wde.cli import image_limit_overrides

    try:
        overrides = list(parsed.set) + image_limit_overrides(**{k: getattr(parsed, k) for k in IMAGE_LIMITS})
        for name in ("allowed_origins", "allow_image_fetch"):
            if name in given:
                given[name] = tuple(given[name])
        config = ServerConfig(overrides=overrides, **given)
    except ValueError as e:  # ServerConfig's own checks (a LimitError among them): each names its setting
        raise RayServeArgsError(f"{where}{e}") from None
    if ray.max_ongoing_requests is None:
        ray.max_ongoing_requests = min(DEFAULT_MAX_ONGOING, config.max_concurrent_requests)
    if ray.num_replicas not in (None, "auto") and ray.autoscaling_config is not None:
        raise RayServeArgsError(f"{where}num_replicas: give a number of replicas or autoscaling_config, not both")
    return config, ray


class Replica:
    """One replica: an `Engine` and the app `wde serve` serves it with; `build_app` makes it a Ray Serve ingress,
    whose wrapper runs the app's lifespan (the engine loop) in the replica once the constructor returns."""

    def __init__(self, config: ServerConfig) -> None:
        from wde.engine import Engine
        from wde.server.app import create_app
        from wde.server.startup import startup_line

        logging.getLogger("wde").setLevel(config.log_level.upper())
        self.engine = Engine.from_workflow(**config.engine_args())
        self.web = create_app(self.engine, config)
        self.web.add_middleware(OneRequestId)
        self.service = self.web.state.service
        line = startup_line(config, self.service.info, self.service.model_names)
        log.info(line.split(" at http")[0] + " in a Ray Serve replica")  # Ray's proxy listens, not `config.port`

    def __serve_build_asgi_app__(self) -> Any:
        return self.web

    def names(self) -> tuple[str, ...]:
        """Every `model` a request may name for this replica's model (the `Router` routes by them)."""
        return tuple(self.service.model_names)

    async def check_health(self) -> None:
        """Ray's periodic health check: a replica whose engine stopped, gave up or stalled is replaced."""
        why = self.service.liveness()
        if why is not None:
            raise RuntimeError(why)

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """The engine's queued and running inputs and tokens (`Engine.load`), for a custom Ray Serve autoscaling
        policy (`autoscaling_config.policy`) to read from its context's `aggregated_metrics`."""
        return {k: float(v) for k, v in dataclasses.asdict(self.service.engine.load).items()}

    async def forward(self, method: str, path: str, query: bytes, headers: list[tuple[bytes, bytes]],
                      body: bytes) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """One HTTP request from the `Router` through this replica's app (middleware, limits, errors and all)."""
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
                 "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query,
                 "root_path": "", "headers": headers, "client": None, "server": None}
        sent = asyncio.Event()
        status, out_headers, chunks = 500, [], []

        async def receive() -> dict:
            if not sent.is_set():
                sent.set()
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.Event().wait()  # the client never hangs up from here; the Router's call is cancelled
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            nonlocal status, out_headers
            if message["type"] == "http.response.start":
                status, out_headers = message["status"], list(message.get("headers", []))
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        await self.web(scope, receive, send)
        return status, out_headers, b"".join(chunks)

    async def __del__(self) -> None:
        """Ray stops the replica: the app's lifespan stops the engine loop (queued work finishes), then the engine
        is closed."""
        try:
            await super().__del__()  # type: ignore[misc] - Ray's ingress wrapper: the ASGI lifespan's shutdown
        finally:
            if hasattr(self, "engine"):  # not when its constructor failed
                self.engine.close()


class RoutedReplica(Replica):
    """A model's replica behind the multi-model `Router` (an application has one ingress): it runs its app's
    lifespan itself, and is called through `forward`."""

    async def __init__(self, config: ServerConfig) -> None:
        super().__init__(config)
        self._lifespan = self.web.router.lifespan_context(self.web)
        await self._lifespan.__aenter__()

    async def __del__(self) -> None:
        try:
            if hasattr(self, "_lifespan"):
                await self._lifespan.__aexit__(None, None, None)
        finally:
            if hasattr(self, "engine"):
                self.engine.close()


class OneRequestId:
    """Ray's proxy adds the request's `x-request-id` (the client's, or its own) to every response; the app's own,
    the same id, is dropped so the response carries it once (the app's is kept where it chose another: a client id
    `wde serve` finds unfit)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"x-request-id")

        async def send_once(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [(k, v) for k, v in message.get("headers", [])
                                                  if k.lower() != b"x-request-id" or v != given]}
            await send(message)

        await self.app(scope, receive, send_once)


class Router:
    """The ingress of a multi-model application: each request goes to the deployment serving its `model`."""

    async def __init__(self, handles: list[Any], api_keys: list[str | None]) -> None:
        self.handles = handles
        self.api_keys = api_keys
        self.names = await asyncio.gather(*(h.names.remote() for h in handles))
        self.by_name: dict[str, int] = {}
        for i, names in enumerate(self.names):
            for name in names:
                if self.by_name.setdefault(name, i) != i:
                    raise RayServeArgsError(f"models: {name!r} names models[{self.by_name[name]}] and models[{i}];"
                                            " give each a served_model_name of its own")

    async def __call__(self, request: Any) -> Any:
        from wde.server.errors import ApiError, error_response, error_style

        body = await _read_body(request) if request.method == "POST" else b""
        if body is None:
            return error_response(ApiError("too_large", f"the request body is over {ROUTER_BODY_LIMIT:,} bytes, the"
                                            " most wde.ray_serve's router reads"), error_style(request))
        path, query = request.url.path, request.url.query.encode()
        headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in request.headers.items()]
        try:
            return await self._route(request, path, query, headers, body)
        except Exception as e:  # noqa: BLE001 - the model's replica died or Ray could not reach it: retry later
            log.warning("%s %s: the model's replica failed: %s: %s", request.method, path, type(e).__name__, e)
            response = error_response(ApiError("unhealthy", f"the model's replica failed ({type(e).__name__});"
                                               " retrying is safe"), error_style(request))
            response.headers["Retry-After"] = "1"
            return response

    async def _route(self, request: Any, path: str, query: bytes, headers: list[tuple[bytes, bytes]],
                     body: bytes) -> Any:
        from starlette.responses import JSONResponse, Response

        from wde.server.errors import ApiError, error_response, error_style

        if request.method == "GET" and path in ("/v1/models", "/health"):  # about every model
            answers = await asyncio.gather(*(h.forward.remote("GET", path, query, headers, b"")
                                             for h in self.handles))
            bad = next((a for a in answers if a[0] != 200), None)
            if bad is None and path == "/v1/models":
                return JSONResponse({"object": "list", "data": [m for a in answers for m in json.loads(a[2])["data"]]})
            answers = [bad or answers[0]]
        else:
            name, index = _model_field(body) if body else request.query_params.get("model"), 0
            if name is not None:
                index = self.by_name.get(name, -1)
                if index < 0 and not self._authorized(request):
                    index = 0  # the default model's app answers (401 first), so no name leaks without the key
                if index < 0:
                    served = ", ".join(repr(ns[0]) for ns in self.names)
                    return error_response(ApiError("not_found", f"model {name!r} is not served here; this"
                                                   f" application serves {served}", "model"), error_style(request))
            answers = [await self.handles[index].forward.remote(request.method, path, query, headers, body)]
        status, out_headers, out = answers[0]
        response = Response(out, status_code=status)
        for k, v in out_headers:  # the replica's app already dropped an x-request-id Ray's proxy adds again
            if k.lower() != b"content-length":
                response.headers.append(k.decode("latin-1"), v.decode("latin-1"))
        return response

    def _authorized(self, request: Any) -> bool:
        """Whether the request may learn the served names: no model needs a key, or it bears one of theirs."""
        keys = {k for k in self.api_keys if k is not None}
        bearer = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        return not keys or bearer in keys


async def _read_body(request: Any) -> bytes | None:
    """The body, or None past `ROUTER_BODY_LIMIT` bytes (never read whole)."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > ROUTER_BODY_LIMIT:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def _model_field(body: bytes) -> str | None:
    """The `model` a JSON body names (None: none, or not a JSON object: the model's own app answers that)."""
    try:
        parsed = json.loads(body) if body.lstrip()[:1] == b"{" else None
    except ValueError:
        return None
    name = parsed.get("model") if isinstance(parsed, dict) else None
    return name if isinstance(name, str) else None


def build_app(args: dict[str, Any]) -> Any:
    """The Ray Serve application for `args` (`serve.run(build_app(...))`, `serve run wde.ray_serve:build_app`).

    `args` takes `wde serve`'s options spelled with underscores (`model`, `workflow`, `served_model_name`, `set`,
    `api_key`, the limits...) and Ray Serve's `num_replicas`, `autoscaling_config`, `ray_actor_options` and
    `max_ongoing_requests`; or `models`, a list of such dicts (one deployment each), whose entries take the other
    top-level keys as defaults. An unknown key, or an option that means nothing behind Ray's proxy (`host`, `port`,
    ...), raises `RayServeArgsError` naming it.
    """
    try:
        from ray import serve
    except ImportError:
        raise RayServeArgsError("wde.ray_serve needs Ray Serve: pip install 'wde[ray]'") from None
    args = dict(args)
    models = args.pop("models", None)
    if models is None:
        config, ray = parse_model(args)
        return _deployment(serve, serve.ingress()(Replica), ray, "WDE").bind(config)
    if isinstance(models, str):
        models = json.loads(models)
    if not isinstance(models, list) or not models or not all(isinstance(m, dict) for m in models):
        raise RayServeArgsError("models: give a list of one or more dicts, each with a model's arguments")
    handles, keys = [], []
    for i, entry in enumerate(models):
        config, ray = parse_model({**args, **entry}, f"models[{i}].")
        handles.append(_deployment(serve, RoutedReplica, ray, f"WDE-{i}").bind(config))
        keys.append(config.api_key)
    return serve.deployment(Router, name="WDERouter", max_ongoing_requests=ROUTER_MAX_ONGOING).bind(handles, keys)


def _deployment(serve: Any, cls: type, ray: RayOptions, name: str) -> Any:
    options = {k: v for k, v in ray.model_dump().items() if v is not None}
    return serve.deployment(cls, name=name, **options)
