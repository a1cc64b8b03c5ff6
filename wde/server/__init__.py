"""`wde serve`: OpenAI, Cohere/Jina rerank, vLLM score/classify and TEI-compatible HTTP routes over one engine."""

from wde.server.app import create_app, run_server
from wde.server.config import ServerConfig

__all__ = ["ServerConfig", "create_app", "run_server"]
