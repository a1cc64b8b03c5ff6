"""TEI's gRPC API (`wde serve --grpc-port P`): the services of TEI's own `tei.proto`, kept verbatim beside this file
(its origin and licence in TEI_PROTO_LICENSE.md) with the stubs grpcio-tools generates from it (`tei_pb2.py`,
`tei_pb2_grpc.py`; tests/test_grpc.py regenerates them and checks they are identical).

The server runs in the HTTP app's process and event loop (grpc.aio), started and stopped with the app's lifespan
(`server.py`), and answers every call with the very functions the HTTP TEI routes use (`servicers.py`), so a gRPC
call gives what the same TEI body gives over HTTP, under the same auth and limits.

grpcio and protobuf come with the `grpc` extra (`pip install 'wde[grpc]'`); this module imports neither, so it can
tell `wde serve` at start-up, in one line, that they are missing (`check_installed`). Everything that needs them is
in the submodules, imported only when a gRPC port is asked for.
"""

from __future__ import annotations

import dataclasses
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, AsyncIterator

if TYPE_CHECKING:
    from fastapi import FastAPI

    from wde.server.config import ServerConfig

INSTALL_HINT = "pip install 'wde[grpc]'"


def check_installed() -> None:
    """`StartupError` naming the extra when grpcio or protobuf (or a release the generated stubs accept) is missing."""
    from wde.server.startup import StartupError

    try:
        from wde.server.grpc import tei_pb2, tei_pb2_grpc  # noqa: F401 - both check the installed releases
    except (ImportError, RuntimeError) as e:  # the stubs raise RuntimeError for a grpcio older than they need
        raise StartupError(f"--grpc-port needs grpcio and protobuf ({e}): {INSTALL_HINT}") from None


def prepare(config: ServerConfig) -> ServerConfig:
    """Before the model loads: refuse a missing extra or an unusable `--grpc-port` (in use, bad host) in one line,
    and turn port 0 into the free port the kernel picks, so every API server of a split server binds the same one
    and the start-up log names it. `config` unchanged without a gRPC port."""
    if config.grpc_port is None:
        return config
    check_installed()
    from wde.server.startup import StartupError, listen

    try:
        probe = listen(config.host, config.grpc_port)
    except StartupError as e:
        raise StartupError(f"--grpc-port: {e}") from None
    port = probe[0].getsockname()[1]
    for sock in probe:
        sock.close()
    return dataclasses.replace(config, grpc_port=port)


@asynccontextmanager
async def serving(app: FastAPI, config: ServerConfig, reuse_port: bool) -> AsyncIterator[None]:
    """The gRPC server of `app` while the body runs (the app's lifespan), when `config.grpc_port` is set: started
    after the engine, stopped before it, finishing the calls in flight (`server.STOP_GRACE_S`). `reuse_port`: the
    API servers of a split server share the port (SO_REUSEPORT); one process binds it alone."""
    if config.grpc_port is None:
        yield
        return
    from wde.server.grpc.server import STOP_GRACE_S, start
    from wde.server.startup import StartupError

    try:
        server = await start(app, config, reuse_port)
    except StartupError as e:  # the port was taken after `prepare` checked it: `wde serve` exits 1 with this line
        app.state.startup_error = e
        raise
    try:
        yield
    finally:
        await server.stop(STOP_GRACE_S)
