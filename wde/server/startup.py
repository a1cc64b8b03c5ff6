"""The one line `wde serve` logs when it starts: what it serves, how, and where, so an operator reading the log
(or a supervisor's journal) never has to guess which model, workflow or device a process is running."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from wde.engine_info import EngineInfo
    from wde.server.config import ServerConfig


def address(host: str, port: int) -> str:
    """The URL clients use: `http://127.0.0.1:8000`, an IPv6 host in brackets."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def startup_line(config: ServerConfig, info: EngineInfo, model_names: tuple[str, ...], api_servers: int = 0) -> str:
    """`serving <model> (API names: ...) with workflow <w> on <device> (<dtype>) at http://host:port`, and how
    many API-server processes front the engine core when it runs in its own process."""
    model = config.model or model_names[0]
    names = ", ".join(model_names)
    split = f" through {api_servers} API-server processes" if api_servers else ""
    return (f"serving model {model} (API names: {names}) with workflow {info.workflow} on {info.device}"
            f" ({info.dtype}) at {address(config.host, config.port)}{split}")
