"""API errors and the two JSON shapes they are sent in: OpenAI's and TEI's.

Handlers raise `ApiError(kind, message)`; the kind fixes the status code. Which shape goes out depends on
the route family (TEI routes answer like TEI so TEI clients parse our errors), decided in `error_style`.
"""

from __future__ import annotations

from typing import Literal

from fastapi import Request

from wde.server.responses import JSONResponse

ErrorKind = Literal["empty", "validation", "too_long", "not_found", "unauthorized", "unsupported", "overloaded",
                    "backend", "unhealthy", "bad_json", "bad_text", "too_large", "not_allowed", "timeout",
                    "client_timeout", "forbidden", "unsupported_media", "bad_image", "image_too_large"]
Style = Literal["openai", "tei"]

STATUS: dict[str, int] = {
    "empty": 400,
    "bad_json": 400,
    "bad_text": 400,
    "bad_image": 400,
    "unauthorized": 401,
    "forbidden": 403,
    "not_found": 404,
    "not_allowed": 405,
    "client_timeout": 408,
    "too_large": 413,
    "image_too_large": 413,
    "unsupported_media": 415,
    "validation": 422,
    "too_long": 422,
    "unsupported": 424,
    "overloaded": 429,
    "backend": 500,
    "unhealthy": 503,
    "timeout": 503,
}

_OPENAI_TYPE: dict[str, str] = {
    "unauthorized": "authentication_error",
    "forbidden": "permission_error",
    "not_found": "invalid_request_error",
    "overloaded": "rate_limit_error",
    "backend": "internal_server_error",
    "unhealthy": "service_unavailable",
    "timeout": "service_unavailable",
}

_TEI_TYPE: dict[str, str] = {
    "empty": "Empty",
    "bad_json": "Validation",
    "bad_text": "Validation",
    "bad_image": "Validation",
    "too_large": "Validation",
    "image_too_large": "Validation",
    "not_allowed": "Validation",
    "validation": "Validation",
    "too_long": "Validation",
    "unsupported": "Backend",
    "backend": "Backend",
    "overloaded": "Overloaded",
    "unhealthy": "Unhealthy",
    "timeout": "Overloaded",
    "client_timeout": "Validation",
    "unauthorized": "Validation",
    "forbidden": "Validation",
    "unsupported_media": "Validation",
    "not_found": "Validation",
}
"""TEI's `error_type`, spelled as TEI sends it: its router serializes the Rust enum `ErrorType` with serde's
default, the variant name (`"Validation"`, not the lowercase its OpenAPI examples show). Only TEI's variants are
used (Unhealthy, Backend, Overloaded, Validation, Tokenizer, Empty), so a client typed on that enum parses every
error; refusals TEI answers without a JSON body (a wrong API key, a body too large) are `Validation`."""

TEI_PATHS = frozenset({"/embed", "/embed_all", "/embed_sparse", "/rerank", "/predict", "/similarity", "/tokenize",
                       "/decode", "/info", "/health", "/", "/invocations", "/ping", "/vertex"})


class ApiError(Exception):
    """A request the server refuses or could not serve; `param` names the offending field when there is one."""

    def __init__(self, kind: ErrorKind, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.param = param
        self.headers = headers or {}
        """Sent with the error response (e.g. Retry-After)."""

    @property
    def status(self) -> int:
        return STATUS[self.kind]


def error_style(request: Request) -> Style:
    """A handler may pick the style (/rerank answers in the shape it was asked in); else the path decides."""
    chosen = getattr(request.state, "error_style", None)
    if chosen is not None:
        return chosen
    return "tei" if request.url.path in TEI_PATHS else "openai"


def error_body(error: ApiError, style: Style) -> dict:
    if style == "tei":
        return {"error": error.message, "error_type": _TEI_TYPE[error.kind]}
    # OpenAI's clients read the nested `error`; TEI's OpenAI-compatible route answers a flat `message`, which
    # clients written against TEI read (pymilvus' TEIEmbeddingFunction): both are there.
    return {"error": {"message": error.message, "type": _OPENAI_TYPE.get(error.kind, "invalid_request_error"),
                      "param": error.param, "code": error.kind}, "message": error.message}


def error_response(error: ApiError, style: Style) -> JSONResponse:
    return JSONResponse(error_body(error, style), status_code=error.status)


async def api_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    response = error_response(exc, error_style(request))
    response.headers.update(exc.headers)
    return response


def request_id(request: Request) -> str:
    """The id `RequestIdMiddleware` gave this request (also sent back as the x-request-id header)."""
    return getattr(request.state, "request_id", None) or "-"


async def http_error_handler(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's own errors (unknown path, wrong method) in our JSON shapes."""
    status = getattr(exc, "status_code", 500)
    kind: ErrorKind = {404: "not_found", 405: "not_allowed"}.get(status, "validation")  # type: ignore[assignment]
    detail = getattr(exc, "detail", None) or "error"
    message = f"{request.method} {request.url.path}: {str(detail).lower()}"
    response = error_response(ApiError(kind, message), error_style(request))
    response.headers.update(getattr(exc, "headers", None) or {})
    return response


async def internal_error_handler(request: Request, exc: Exception) -> JSONResponse:
    """Anything unforeseen: a JSON 500 naming the request id, never the exception (the log has it)."""
    rid = request_id(request)
    response = error_response(ApiError("backend", f"internal error (request id {rid}); the server log has the"
                                       " details"), error_style(request))
    response.headers["x-request-id"] = rid
    return response
