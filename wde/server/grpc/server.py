"""The grpc.aio server of `wde serve --grpc-port`: TEI's five services on the HTTP app's event loop and engine, with
its limits. `--max-concurrent-requests` bounds the calls open at once (one more is answered RESOURCE_EXHAUSTED
by gRPC, as TEI answers overload) besides bounding the engine's work as for HTTP; a request message may be as
large as an HTTP body (`ServerConfig.effective_payload_limit`; a larger one is RESOURCE_EXHAUSTED); the
request timeout, batch and length limits are the TEI routes' own, which every method calls."""

from __future__ import annotations

from typing import Any

import grpc

from wde.server.config import ServerConfig
from wde.server.grpc import tei_pb2_grpc
from wde.server.grpc.auth import ApiKeyInterceptor
from wde.server.grpc.servicers import TeiServicer
from wde.server.startup import StartupError

STOP_GRACE_S = 30.0
"""How long calls in flight get to finish when the server stops (as an API server's requests, processes.py)."""

_ADD = (tei_pb2_grpc.add_InfoServicer_to_server, tei_pb2_grpc.add_EmbedServicer_to_server,
        tei_pb2_grpc.add_PredictServicer_to_server, tei_pb2_grpc.add_RerankServicer_to_server,
        tei_pb2_grpc.add_TokenizeServicer_to_server)


async def start(app: Any, config: ServerConfig, reuse_port: bool) -> grpc.aio.Server:
    """The started server of `app` on `config.host`:`config.grpc_port`, the port it got in `app.state.grpc_port`
    (the kernel's choice for 0); `StartupError` when it cannot bind. `reuse_port` lets the API servers of a split
    server bind the one port (the kernel spreads connections over them); without it a port someone else holds is
    refused, as the HTTP port is."""
    service = app.state.service
    limit = config.effective_payload_limit(service.info.max_length, service.max_image_bytes)
    options = [("grpc.so_reuseport", int(reuse_port)), ("grpc.max_receive_message_length", limit)]
    interceptors = [ApiKeyInterceptor(config.api_key)] if config.api_key is not None else []
    server = grpc.aio.server(options=options, interceptors=interceptors,
                             maximum_concurrent_rpcs=config.max_concurrent_requests)
    servicer = TeiServicer(app)
    for add in _ADD:
        add(servicer, server)
    host = f"[{config.host}]" if ":" in config.host else config.host
    try:
        app.state.grpc_port = server.add_insecure_port(f"{host}:{config.grpc_port}")
    except RuntimeError as e:
        raise StartupError(f"--grpc-port: cannot listen on {host}:{config.grpc_port} ({e})") from None
    await server.start()
    return server
