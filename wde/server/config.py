"""What `wde serve` is told: the workflow and model to serve, where to listen, and the limits."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ServerConfig:
    workflow: str | None = None
    model: str | None = None
    host: str = "127.0.0.1"
    """Loopback by default: exposing the server is an explicit choice."""
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    overrides: list[str] = field(default_factory=list)
    max_client_batch_size: int = 1024
    """Inputs one HTTP request may carry."""
    max_concurrent_requests: int = 512
    """HTTP requests in flight at once; one more is answered 429 at once rather than queued."""
    payload_limit: int = 2_000_000
    """Largest request body in bytes (TEI's default); a larger one is answered 413 before it is read."""
    trust_remote_code: bool = False
    access_log: bool = False
    """One log line per request; off by default because formatting it costs more than a small model's batch."""

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key is empty: an empty key would turn authentication off; give a key, or none")
        if self.payload_limit < 1:
            raise ValueError(f"payload_limit must be at least 1 byte, got {self.payload_limit}")
