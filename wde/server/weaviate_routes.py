"""Weaviate's text2vec-transformers "inference container" protocol, so a Weaviate started with
`TRANSFORMERS_INFERENCE_API=http://<wde>:8000` vectorizes with WDE instead of a t2v-transformers container.

Weaviate waits at start-up until `GET /.well-known/ready` answers 2xx, reads `GET /meta` for its own /v1/meta,
and sends each text to `POST /vectors` as `{"text", "config": {"pooling_strategy", "task_type", "dimensions"}}`
(plus `dims`, `vector`, `error` fields of its response struct, ignored here), without a Content-Type: the
content-type check in middleware.py takes a body without one as JSON on these two paths only. Newer Weaviates may
send the batch shape `{"texts": [...], "config": ...}` (with a Content-Type) and read `{"vectors", "dims"}`.

WDE serves the model the way it was built, so the options are honoured or refused, never ignored:
`pooling_strategy` must name the pooling the model does (the container's `masked_mean` is WDE's `mean`, `cls` is
`cls`; WDE's own mode name works too); `task_type` (`query` for searches, `passage` for objects, which Weaviate
always sends) picks the model's matching prompt when it has one (as sentence-transformers' encode_query /
encode_document do), else the text is embedded as is; `dimensions` keeps the first N features (Matryoshka).
Over-long texts are truncated to the model's limit, as the container and sentence-transformers do: Weaviate
joins an object's properties into one text and has no way to ask for anything else.

Errors are `{"error": message, "error_type": kind}` (TEI's shape): Weaviate's client reads the `error` string,
as from the container, and shows "fail with status N: <error>".
"""

from __future__ import annotations

import asyncio
import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import Field

from wde.request import PoolingParams
from wde.server.errors import ApiError
from wde.server.protocol import Body, body_schema, parse, read_json
from wde.server.responses import JSONResponse
from wde.server.service import Service, model_service

router = APIRouter()

POOLING_STRATEGIES = {"masked_mean": "mean", "cls": "cls"}
"""The container's pooling strategies → the WDE pooling mode that computes the same vector."""

TASK_PROMPTS = {"query": ("query",), "passage": ("document", "passage", "corpus")}
"""Weaviate's task types → the prompt names that serve them, first defined wins: sentence-transformers'
encode_query uses `query`, encode_document the first of `document`, `passage`, `corpus`."""


class VectorConfig(Body):
    """The `config` of a /vectors request, as Weaviate's client marshals it (each field only when set)."""

    pooling_strategy: str | None = None
    task_type: str | None = None
    dimensions: int | None = Field(None, gt=0)


class VectorInput(Body):
    """One text: what every Weaviate version sends."""

    text: str
    config: VectorConfig | None = None


class VectorsInput(Body):
    """Several texts in one request: the batch shape of newer Weaviate clients."""

    texts: list[str]
    config: VectorConfig | None = None


def _service(request: Request) -> Service:
    request.state.error_style = "tei"  # {"error": "..."}: the string Weaviate's client reads
    return model_service(request)  # Weaviate's bodies name no model: `?model=`, else the default one


@router.get("/.well-known/live", status_code=204)
async def live(request: Request) -> Response:
    """The process answers: 204, as the container. A stalled engine is not a reason to restart the server."""
    return Response(status_code=204)


@router.get("/.well-known/ready", status_code=204)
async def ready(request: Request) -> Response:
    """204 while the engine serves, else 503 saying why (/health's check): Weaviate waits until it is 2xx."""
    _service(request)
    problem = request.app.state.models.liveness()
    if problem is not None:
        raise ApiError("unhealthy", problem)
    return Response(status_code=204)


@router.get("/meta")
async def meta(request: Request) -> JSONResponse:
    """`{"model": <the model folder's config.json>}`, as the container answers (it sends the Hugging Face config
    of its model); Weaviate shows it under its own /v1/meta."""
    svc = _service(request)  # the folder is resolved off the loop too (a hub id is a cache lookup on disk)
    return JSONResponse({"model": await asyncio.to_thread(lambda: _hf_config(model_folder(svc)))})


@router.post("/vectors", openapi_extra=body_schema(VectorInput, VectorsInput))
@router.post("/vectors/", openapi_extra=body_schema(VectorInput, VectorsInput))  # the container serves both
async def vectors(request: Request) -> JSONResponse:
    svc = _service(request)
    raw = await read_json(request)
    batch = isinstance(raw, dict) and "texts" in raw
    body: VectorInput | VectorsInput = parse(VectorsInput if batch else VectorInput, raw)
    svc.require("dense", request.url.path)
    config = body.config or VectorConfig()
    check_pooling(config.pooling_strategy, svc.info.pooling)
    params = PoolingParams(truncate=True, prompt_name=task_prompt(config.task_type, svc),
                           dimensions=config.dimensions, outputs=("dense",))
    if isinstance(body, VectorsInput):
        result = await svc.run(request, body.texts, params, "texts")
        dims = len(result.dense[0])
        return JSONResponse({"vectors": result.dense, "dims": dims}, headers=result.headers)
    result = await svc.run(request, [body.text], params, "text", ["text"])
    vector = result.dense[0]
    # "dim" is the container's field; Weaviate's client reads "dims" (its own struct), so both are sent.
    return JSONResponse({"text": body.text, "vector": vector, "dim": len(vector), "dims": len(vector)},
                        headers=result.headers)


def check_pooling(strategy: str | None, pooling: str) -> None:
    """Refuse a `pooling_strategy` other than the served model's own pooling (none given: the model's own)."""
    if not strategy or strategy == pooling or POOLING_STRATEGIES.get(strategy) == pooling:
        return
    own = next((name for name, mode in POOLING_STRATEGIES.items() if mode == pooling), pooling)
    raise ApiError("validation", f"config.pooling_strategy {strategy!r} is not how the served model pools: it pools"
                   f" with {pooling!r}, and WDE serves a model only its own way. Set the Weaviate collection's"
                   f" text2vec-transformers poolingStrategy to {own!r} (Weaviate sends 'masked_mean' when it is"
                   " not set)", "config.pooling_strategy")


def task_prompt(task_type: str | None, svc: Service) -> str | None:
    """The prompt a `task_type` selects: the model's matching prompt, or none (the text as is) when the model
    defines none; a task type Weaviate never sends is refused by name."""
    if task_type is None:
        return None
    if task_type not in TASK_PROMPTS:
        raise ApiError("validation", f"config.task_type {task_type!r} is not a Weaviate task type: send 'query' or"
                       " 'passage' (or leave it out)", "config.task_type")
    prompts = svc.prompts
    return next((name for name in TASK_PROMPTS[task_type] if name in prompts), None)


def model_folder(svc: Service) -> Path:
    """The served model's folder (in an API server of a split engine, the one `wde serve --model` resolves to, as
    the engine core did)."""
    return svc.engine.source.path


@lru_cache(maxsize=4)
def _hf_config(folder: Path) -> Any:
    """config.json of a loaded model (read once: it does not change while the model is served)."""
    return json.loads((folder / "config.json").read_text(encoding="utf-8"))
