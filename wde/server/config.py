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
    """The name the API answers to, or several comma separated (as vLLM); the first is the one responses show."""
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
    quantization_ranges: str | None = None
    """A .npy (2, dim) array of per-dimension minima/maxima for int8/uint8 embeddings (wde/server/quantize.py)."""

    def engine_args(self) -> dict[str, object]:
        """What `Engine.from_workflow` / `wde.engine.resolve` are given to build what this server serves."""
        return {"workflow": self.workflow, "model": self.model, "overrides": self.overrides,
                "trust_remote_code": self.trust_remote_code}

    def model_names(self, public_name: str) -> tuple[str, ...]:
        """Every `model` a request may name, the primary first: the --served-model-name values (else
        `public_name`, the model as clients see it), then `public_name`, the --model value, and the short alias of
        each, the last path component (`sentence-transformers/all-MiniLM-L6-v2` → `all-MiniLM-L6-v2`)."""
        served = [n.strip() for n in (self.served_model_name or "").split(",") if n.strip()]
        names = served + [public_name] + ([self.model] if self.model else [])
        names += [n.rstrip("/").rsplit("/", 1)[-1] for n in names]
        return tuple(dict.fromkeys(n for n in names if n))

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key is empty: an empty key would turn authentication off; give a key, or none")
        if self.payload_limit < 1:
            raise ValueError(f"payload_limit must be at least 1 byte, got {self.payload_limit}")
        if self.served_model_name is not None and not self.served_model_name.strip(" ,"):
            raise ValueError("served_model_name is empty: give a name, several comma separated, or none")
        if self.quantization_ranges is not None:
            from wde.server.quantize import load_ranges

            load_ranges(self.quantization_ranges)  # a bad file fails at start-up, not at the first request
