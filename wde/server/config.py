"""What `wde serve` is told: the workflow and model to serve, where to listen, and the limits."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from wde.server.model_config import ModelConfig, explicit_names, name_table, with_aliases


@dataclass
class ServerConfig:
    workflow: str | None = None
    model: str | None = None
    host: str = "127.0.0.1"
    """Loopback by default: exposing the server is an explicit choice."""
    port: int = 8000
    grpc_port: int | None = None
    """Also serve TEI's gRPC API (wde/server/grpc) on this port of `host`; 0: a free one; None: no gRPC."""
    api_key: str | None = None
    served_model_name: str | None = None
    """The name the API answers to, or several comma separated (as vLLM); the first is the one responses show."""
    overrides: list[str] = field(default_factory=list)
    max_client_batch_size: int = 2048
    """Inputs one HTTP request may carry (OpenAI's own limit for /v1/embeddings)."""
    max_concurrent_requests: int = 512
    """HTTP requests in flight at once; one more is answered 429 at once rather than queued."""
    payload_limit: int | None = None
    """Largest request body in bytes; a larger one is answered 413 before it is read. None: derived from the
    batch limit and the model's max length so that a full legal batch fits (`effective_payload_limit`)."""
    token_id_inputs: bool = True
    """Accept token-id inputs (a list of ints, `{"token_ids": ...}`), as vLLM and TEI do; False refuses them
    with a 422 naming the input (`wde serve --no-token-id-inputs`), for clients that send another tokenizer's
    ids (langchain-openai's OpenAIEmbeddings sends tiktoken cl100k ids by default)."""
    long_inputs: Literal["refuse", "truncate", "chunk"] = "refuse"
    """What an input longer than the model gets where its request does not say (`wde serve --long-inputs`): a 422
    (refuse), truncation to the model's limit (truncate), or chunked processing (chunk: wde/chunking.py, within
    `max_embed_len`; dense embeddings only). A request that asks to truncate (`truncate`, `truncate_prompt_tokens`,
    Cohere's START/END) is truncated, and Cohere's NONE refuses, whatever this says."""
    max_embed_len: int | None = None
    """With long_inputs=chunk, the most tokens one input may have in all (more is a 422); None: 16 times the
    model's limit (`Service.max_embed_len`)."""
    trust_remote_code: bool = False
    access_log: bool = False
    """One log line per request; off by default because formatting it costs more than a small model's batch."""
    quantization_ranges: str | None = None
    """A .npy (2, dim) array of per-dimension minima/maxima for int8/uint8 embeddings (wde/server/quantize.py)."""
    allowed_origins: tuple[str, ...] = ()
    """Web origins (`https://app.example.com`, scheme://host[:port]) whose pages may call the server from a browser;
    `*` allows any. None by default: a request with an `Origin` header is a web page's and is answered 403
    (wde/server/middleware.py `OriginMiddleware`)."""
    log_level: str = "info"
    """The server's log level (critical, error, warning, info, debug); debug also prints the traceback of a
    start-up failure after its one line."""
    request_timeout: float = 300.0
    """Seconds a request may wait for the engine (queued and running) before its inputs are aborted there and it
    is answered 503 with Retry-After; 0: no deadline. 300 s is over twice the longest legal request (2,048 inputs of
    256 tokens: 117 s for all-MiniLM-L6-v2 on a shared 2-core CPU), so the default never cuts legitimate work."""
    stall_timeout: float = 15.0
    """/health answers 503 while the engine loop has not finished a step for this many seconds (a hung step, a
    frozen core); 0: never. A step of the bundled model takes under 1 s even on a busy 2-core CPU."""
    header_timeout: float = 10.0
    """Seconds a connection has to send a request's headers (from its first byte, or from connecting); then it is
    answered 408 and closed, so slowloris connections cannot be held; 0: no limit."""
    body_timeout: float = 60.0
    """Seconds a request's body has to arrive after its headers; then it is answered 408 and the connection closed;
    0: no limit."""
    allow_image_fetch: tuple[str, ...] = ()
    """Host names whose http(s) image URLs the server fetches for an image-text model (`wde serve
    --allow-image-fetch`). None by default: an image URL is refused with a 400 and only data: URIs are served, so a
    client can never make the server connect anywhere (no SSRF). See wde/server/image_fetch.py."""
    image_fetch_timeout: float = 10.0
    """Seconds one image fetch may take in all (connecting, redirects, the whole body); then it is refused (400)."""
    image_fetch_max_urls: int = 64
    """Image URLs one request may name; more are refused (422) before the first fetch."""
    image_fetch_max_bytes: int = 32 * 2**20
    """Bytes all the image fetches of one request may bring in together; past them it is refused (413) and its
    other fetches cancelled, so no request holds more fetched bytes than this."""
    image_fetch_deadline: float = 30.0
    """Seconds all the image fetches of one request may take together; then they are cancelled and it is refused
    (400, as OpenAI answers an image URL it could not download in time)."""
    image_fetch_connections: int = 32
    """Connections the server (each API server process) holds for fetching images at once, all requests together;
    further fetches wait for one, within their request's deadline."""

    models: tuple[ModelConfig, ...] = ()
    """Every model the server serves, the default first (`wde serve --model A --model B`, `--config serve.yaml`:
    wde/server/model_config.py); empty: the one model of `workflow`, `model`, `served_model_name` and
    `overrides`, which must then be unset."""

    shared_token_budget: int | None = None
    """Tokens the forwards of all the models' engines may hold at once (`wde/token_pool.py`), in one process of
    several models; None: the largest engine's own token budget."""

    def served_models(self) -> tuple[ModelConfig, ...]:
        """The models this server serves, the default one (for requests naming none) first."""
        return self.models or (ModelConfig(self.model, self.workflow, self.served_model_name, tuple(self.overrides)),)

    def engine_args(self, index: int = 0) -> dict[str, object]:
        """What `Engine.from_workflow` / `wde.engine.resolve` are given to build served model `index`."""
        return self.served_models()[index].engine_args(self.trust_remote_code)

    def effective_payload_limit(self, max_length: int, max_image_bytes: int | None = None) -> int:
        """The body limit in bytes: `payload_limit` when given, else `default_payload_limit` for this batch limit
        and a model of `max_length` tokens (taking images of up to `max_image_bytes`, for an image-text model)."""
        if self.payload_limit is not None:
            return self.payload_limit
        return default_payload_limit(self.max_client_batch_size, max_length, max_image_bytes)

    def model_names(self, public_name: str) -> tuple[str, ...]:
        """Every `model` a request may name, the primary first: the --served-model-name values (else
        `public_name`, the model as clients see it), then `public_name`, the --model value, and the short alias of
        each, the last path component (`sentence-transformers/all-MiniLM-L6-v2` → `all-MiniLM-L6-v2`)."""
        return with_aliases(explicit_names(self.served_model_name, public_name, self.model))

    def __post_init__(self) -> None:
        if self.models and (self.model or self.workflow or self.served_model_name or self.overrides):
            raise ValueError("models lists every served model: give model, workflow, served_model_name and"
                             " overrides in its entries, not beside it")
        name_table(self.served_models())  # two models called alike: a StartupError naming both
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key is empty: an empty key would turn authentication off; give a key, or none")
        check_limits(self)
        check_grpc_port(self.grpc_port)
        if self.long_inputs not in LONG_INPUTS:
            raise ValueError(f"long_inputs must be one of {', '.join(LONG_INPUTS)}, got {self.long_inputs!r}")
        if self.max_embed_len is not None and self.long_inputs != "chunk":
            raise ValueError("max_embed_len bounds chunked processing; give it with long_inputs=chunk"
                             " (--long-inputs chunk)")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        if self.allowed_origins:
            from wde.server.middleware import normalize_origin

            self.allowed_origins = tuple(dict.fromkeys(normalize_origin(o) for o in self.allowed_origins))
        for served in self.served_models():
            if served.served_model_name is not None and not served.served_model_name.strip(" ,"):
                raise ValueError("served_model_name is empty: give a name, several comma separated, or none")
        self.allow_image_fetch = tuple(dict.fromkeys(fetch_host(h) for h in self.allow_image_fetch))
        if self.quantization_ranges is not None:
            from wde.server.quantize import load_ranges

            load_ranges(self.quantization_ranges)  # a bad file fails at start-up, not at the first request


LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
LONG_INPUTS = ("refuse", "truncate", "chunk")


class LimitError(ValueError):
    """A numeric setting outside the range where it means something (`--max-concurrent-requests 0` would answer
    every request 429 while /health says 200). `wde serve` refuses it at start-up in one line naming the option
    (`option`) and its minimum, exit 1, rather than serve a server that cannot work."""

    def __init__(self, name: str, value: object, bound: str, why: str = "") -> None:
        self.name, self.value, self.bound, self.why = name, value, bound, why
        super().__init__(self.message(name))

    @property
    def option(self) -> str:
        """The `wde serve` option that sets it: `max_concurrent_requests` → `--max-concurrent-requests`."""
        return "--" + self.name.replace("_", "-")

    def message(self, name: str) -> str:
        return f"{name} must be {self.bound}, got {self.value}{': ' + self.why if self.why else ''}"


AT_LEAST_ONE = {
    "max_client_batch_size": "a request with no input is refused anyway",
    "max_concurrent_requests": "with 0 every request would be answered 429",
    "payload_limit": "a body limit of 0 bytes refuses every request",
    "image_fetch_max_urls": "with 0 every image URL would be refused",
    "image_fetch_max_bytes": "with 0 every fetched image would be refused",
    "image_fetch_connections": "with 0 no image could be fetched",
    "max_embed_len": "with 0 every input would be refused",
    "shared_token_budget": "a pool of 0 tokens would run no batch",
}
"""Integer settings whose minimum is 1, with why a smaller value is meaningless."""
SECONDS_OR_ZERO = ("request_timeout", "stall_timeout", "header_timeout", "body_timeout")
"""Timeouts in seconds where 0 means no limit (a negative one would expire before anything happens)."""
SECONDS_ABOVE_ZERO = ("image_fetch_timeout", "image_fetch_deadline")
"""Timeouts in seconds that must leave some time (there is no "no limit" for a fetch)."""


def check_limits(config: ServerConfig) -> None:
    """Raise `LimitError` for the first numeric setting of `config` outside its range: integers (bools are not
    numbers here) at least 1, timeouts finite and not negative (0 where it means no limit, else above 0)."""
    for name, why in AT_LEAST_ONE.items():
        value = getattr(config, name)
        if value is None and name in ("payload_limit", "max_embed_len", "shared_token_budget"):
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise LimitError(name, value, "an integer, at least 1", why)
    for name in SECONDS_OR_ZERO + SECONDS_ABOVE_ZERO:
        value = getattr(config, name)
        above = name in SECONDS_ABOVE_ZERO
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value == float("inf") \
                or not (value > 0 if above else value >= 0):
            raise LimitError(name, value, "a number of seconds above 0" if above
                             else "a number of seconds, 0 or more (0: no limit)")

def check_grpc_port(port: int | None) -> None:
    """`LimitError` for a `grpc_port` that is no TCP port (None, no gRPC, passes)."""
    if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535):
        raise LimitError("grpc_port", port, "a TCP port from 0 to 65535 (0: a free one)")


BYTES_PER_TOKEN = 16
"""Generous JSON bytes for one token of an input: English text runs at 4 to 6 bytes per token, token ids at up
to 8 ("250001, "), \\u-escaped non-Latin text at 6 to 12; 16 leaves room for long tokens (URLs, runs of symbols)."""
BYTES_PER_INPUT = 64
"""JSON around each input: quotes, comma, a pair's brackets or a `{"text": ...}` wrapper."""
BODY_OVERHEAD = 65_536
"""The request's other fields (model, options, a rerank query...)."""
MIN_PAYLOAD_LIMIT = 2_000_000
"""Never below TEI's default."""


def default_payload_limit(max_client_batch_size: int, max_length: int, max_image_bytes: int | None = None) -> int:
    """The default body limit: a full legal batch (`max_client_batch_size` inputs of `max_length` tokens) fits,
    `batch x (max_length x 16 + 64) + 64 KiB` bytes, and never below TEI's 2,000,000 bytes. For a model that takes
    images (`max_image_bytes`, its `input_processor.params.max_image_bytes`), one image of the largest legal size
    also fits as a base64 data: URI, so the engine, not the body limit, is what refuses an image over its size
    limit, by name (a full batch of the largest images would be gigabytes: several go in one body while they fit).

    The all-MiniLM-L6-v2 default (2,048 inputs of up to 256 tokens) gives 8,585,216 bytes; an 8,192-token model
    ~269 MB; CLIP (77 tokens, 20 MiB images) 28,027,628 bytes (an explicit `--payload-limit` wins).
    """
    per_input = max_length * BYTES_PER_TOKEN + BYTES_PER_INPUT
    limit = max(MIN_PAYLOAD_LIMIT, max_client_batch_size * per_input + BODY_OVERHEAD)
    if max_image_bytes is not None:
        limit = max(limit, -(-max_image_bytes // 3) * 4 + BYTES_PER_INPUT + BODY_OVERHEAD)
    return limit


def fetch_host(host: str) -> str:
    """One `--allow-image-fetch` entry as it is compared with a URL's host: lowercased, IPv6 brackets and a final
    dot dropped. A scheme, port, path or wildcard is refused: the list names hosts, each exactly."""
    name = host.strip().lower().rstrip(".")
    if name.startswith("[") and name.endswith("]"):
        name = name[1:-1]
    if not name:
        raise ValueError("allow_image_fetch has an empty host name")
    if "*" in name:
        raise ValueError(f"allow_image_fetch host {host!r}: wildcards are not accepted (a server that fetches any"
                         " URL can be made to reach internal services); name each host")
    if any(c in name for c in "/@?#") or name.count(":") == 1:
        raise ValueError(f"allow_image_fetch host {host!r} is not a host name: give names such as images.example.com"
                         " or 10.0.0.5, without scheme, port or path (any port of a listed host is allowed)")
    return name
