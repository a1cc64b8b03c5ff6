"""What every gRPC method shares: the HTTP request a TEI route function is handed, TEI's proto fields as that route's
JSON body, TEI's timing headers as the proto's `Metadata`, and `ApiError`s as the gRPC status TEI gives them."""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any, Awaitable, NoReturn, TypeVar

import grpc
from google.protobuf.message import Message
from google.protobuf.unknown_fields import UnknownFieldSet
from starlette.requests import Request

from wde.server.errors import ApiError, error_body
from wde.server.grpc import tei_pb2

log = logging.getLogger("wde.server")

T = TypeVar("T")

STATUS = {
    "Validation": grpc.StatusCode.INVALID_ARGUMENT,
    "Empty": grpc.StatusCode.INVALID_ARGUMENT,
    "Tokenizer": grpc.StatusCode.FAILED_PRECONDITION,
    "Backend": grpc.StatusCode.FAILED_PRECONDITION,
    "Overloaded": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "Unhealthy": grpc.StatusCode.UNAVAILABLE,
}
"""TEI's `error_type` → the gRPC status TEI's gRPC server answers it with (its `impl From<ErrorResponse> for
Status`). An `ApiError` goes through the same `error_type` its HTTP TEI answer carries (`error_body`), so a model
that cannot serve a method (an embedder asked to rerank: `Backend`) answers FAILED_PRECONDITION as TEI does, and a
request timeout (`Overloaded` on TEI's routes) RESOURCE_EXHAUSTED."""

DIRECTIONS = {tei_pb2.TRUNCATION_DIRECTION_RIGHT: "right", tei_pb2.TRUNCATION_DIRECTION_LEFT: "left"}


def status_of(error: ApiError) -> grpc.StatusCode:
    return STATUS[error_body(error, "tei")["error_type"]]


async def _connected() -> dict[str, Any]:
    """The `receive` of a gRPC call's request: it never reports a disconnect, because grpc.aio cancels the task of a
    call whose client went away, which aborts its engine work as an HTTP disconnect does."""
    return await asyncio.get_running_loop().create_future()


def route_request(app: Any, path: str) -> Request:
    """The request a TEI route function reads for one gRPC call: the app (hence the `Service`), the route's path
    (named in its refusals) and a request id of its own (`grpc-...`, in the server log's lines about it)."""
    scope = {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(), "root_path": "",
             "query_string": b"", "headers": [], "app": app, "state": {"request_id": f"grpc-{uuid.uuid4().hex}"}}
    return Request(scope, _connected)


def body_of(message: Message) -> dict[str, Any]:
    """A TEI request message as the JSON body of the same HTTP route (TEI's proto fields are named as its JSON
    fields): every field, except a proto3 `optional` one left unset, which the route's own default then fills
    (`normalize`, `prompt_name`, `dimensions`); the truncation enum as its JSON string. A field this tei.proto does
    not declare (a client built on a newer one) is refused by its number rather than dropped unread."""
    unknown = sorted({f.field_number for f in UnknownFieldSet(message)})
    if unknown:
        raise ApiError("validation", f"{message.DESCRIPTOR.full_name} has field number(s)"
                       f" {', '.join(map(str, unknown))}, which TEI's tei.proto served here does not declare")
    body: dict[str, Any] = {}
    for field in message.DESCRIPTOR.fields:
        name = field.name
        if field.has_presence and not message.HasField(name):
            continue
        value = getattr(message, name)
        if name == "truncation_direction":
            if value not in DIRECTIONS:
                raise ApiError("validation", f"truncation_direction is {value}, which is no TruncationDirection"
                               " (0: TRUNCATION_DIRECTION_RIGHT, 1: TRUNCATION_DIRECTION_LEFT)", name)
            value = DIRECTIONS[value]
        elif field.is_repeated:
            value = list(value)
        body[name] = value
    return body


HEADER_NS = {"total_time_ns": "x-total-time", "tokenization_time_ns": "x-tokenization-time",
             "queue_time_ns": "x-queue-time", "inference_time_ns": "x-inference-time"}


def metadata(headers: dict[str, str]) -> tei_pb2.Metadata:
    """TEI's timing headers of an HTTP answer (milliseconds) as the proto's `Metadata` (nanoseconds, unsigned: a
    time the headers round below zero, as the queue time of a request whose batch started before it was counted
    in, is 0)."""
    return tei_pb2.Metadata(compute_chars=int(headers["x-compute-characters"]),
                            compute_tokens=int(headers["x-compute-tokens"]),
                            **{field: max(0, int(headers[name])) * 1_000_000 for field, name in HEADER_NS.items()})


async def refuse(context: grpc.aio.ServicerContext, error: BaseException) -> NoReturn:
    """End the call with the status of `error`: an `ApiError`'s TEI status and message; anything else is logged
    and answered INTERNAL naming the request, never the exception (as the HTTP routes answer 500)."""
    if isinstance(error, ApiError):
        await context.abort(status_of(error), error.message)
    rid = uuid.uuid4().hex
    log.error("a gRPC call failed (request id grpc-%s)", rid, exc_info=error)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error (request id grpc-{rid}); the server log has the"
                        " details")


async def answer(context: grpc.aio.ServicerContext, work: Awaitable[tuple[T, dict[str, str] | None]]) -> T:
    """A unary call's response, TEI's timing headers (when the route gives some) sent as its initial metadata as
    TEI does; a failure ends the call with its status (`refuse`)."""
    try:
        response, headers = await work
    except Exception as e:  # noqa: BLE001 - every failure becomes a status (refuse logs the unexpected ones)
        await refuse(context, e)
    if headers:
        await context.send_initial_metadata(tuple(headers.items()))
    return response
