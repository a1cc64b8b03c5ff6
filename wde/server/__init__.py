"""`wde serve`: OpenAI, Cohere/Jina rerank, vLLM score/classify and TEI-compatible HTTP routes over one engine.

`create_app` and `run_server` are imported on first use (they bring torch, the engine and FastAPI), so what only
reads a server's configuration (`ServerConfig`, `wde.server.model_config`: `wde serve`'s option checks, a spawned
process unpickling its config) starts in a fraction of a second.
"""

from typing import TYPE_CHECKING, Any

from wde.server.config import ServerConfig

if TYPE_CHECKING:
    from wde.server.app import create_app, run_server

__all__ = ["ServerConfig", "create_app", "run_server"]


def __getattr__(name: str) -> Any:
    if name in ("create_app", "run_server"):
        from wde.server import app

        return getattr(app, name)
    raise AttributeError(f"module 'wde.server' has no attribute {name!r}")
