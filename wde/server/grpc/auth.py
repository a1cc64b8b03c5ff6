"""`--api-key` on the gRPC port: every call must carry the metadata `authorization: Bearer KEY`, as every HTTP route
but /health must carry the header, else it ends UNAUTHENTICATED before its method runs (TEI's gRPC server answers
the same, with the same message)."""

from __future__ import annotations

import hmac
from typing import Any, Awaitable, Callable

import grpc

MESSAGE = "No valid auth token"
"""TEI's own message for it."""

_HANDLERS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, api_key: str) -> None:
        self._expected = f"Bearer {api_key}".encode()

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[grpc.RpcMethodHandler]],
                                handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        given = dict(handler_call_details.invocation_metadata or ()).get("authorization", "")
        if handler is None or hmac.compare_digest(str(given).encode(), self._expected):
            return handler  # an unknown method stays UNIMPLEMENTED, as on TEI
        return _refusing(handler)


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` (unary or streaming each way) that ends the call UNAUTHENTICATED."""
    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, MESSAGE)

    make = _HANDLERS[handler.request_streaming, handler.response_streaming]
    return make(refuse, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
