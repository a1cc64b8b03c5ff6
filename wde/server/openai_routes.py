"""OpenAI-compatible routes: /v1/embeddings (also at /embeddings, where TEI and Infinity serve it), /v1/models,
/v1/models/{id}, Infinity's /models, and /pooling (every output, e.g. bge-m3's dense + sparse + colbert, in
OpenAI's list envelope)."""

from __future__ import annotations

import numpy as np
from fastapi import APIRouter, Request

from wde.request import PoolingParams
from wde.server.errors import ApiError
from wde.server.protocol import EmbeddingRequest, PoolingRequest, body_schema, embed_items, item_names, parse, read_json
from wde.server.quantize import quantize_rows, to_base64
from wde.server.responses import JSONResponse
from wde.server.service import Result, Service, to_json

router = APIRouter()


def service(request: Request) -> Service:
    return request.app.state.service


def encode_vector(vector: np.ndarray, encoding_format: str) -> np.ndarray | str:
    """OpenAI's base64 format is the little-endian float32 bytes of the vector (a quantized vector's own bytes);
    float is the array itself (the JSON response writes it without a Python list)."""
    if encoding_format == "base64":
        return to_base64(vector)
    return np.ascontiguousarray(vector)


@router.post("/v1/embeddings", openapi_extra=body_schema(EmbeddingRequest))
@router.post("/embeddings", openapi_extra=body_schema(EmbeddingRequest))
async def embeddings(request: Request) -> JSONResponse:
    svc = service(request)
    body = parse(EmbeddingRequest, await read_json(request))
    svc.check_model(body.model)
    if body.modality not in (None, "text"):
        raise ApiError("unsupported", f"modality {body.modality!r}: this server embeds text only", "modality")
    svc.require("dense", request.url.path)
    params = PoolingParams(truncate=body.truncate, prompt_name=body.prompt_name, dimensions=body.dimensions or None,
                           outputs=("dense",))
    result = await svc.run(request, embed_items(body.input), params, "input", item_names("input", body.input))
    vectors = quantize_rows(result.dense, body.embed_dtype, svc.config.quantization_ranges, "embed_dtype")
    data = [{"object": "embedding", "embedding": encode_vector(v, body.encoding_format), "index": i}
            for i, v in enumerate(vectors)]
    return _list_response(svc, data, result)


@router.post("/pooling", openapi_extra=body_schema(PoolingRequest))
async def pooling(request: Request) -> JSONResponse:
    svc = service(request)
    body = parse(PoolingRequest, await read_json(request))
    svc.check_model(body.model)
    wanted = tuple(body.outputs) if body.outputs else svc.produces  # per-token states only when asked for
    unknown = [o for o in wanted if o not in svc.supported]
    if unknown:
        raise ApiError("validation", f"outputs {unknown} are not produced by this model; it produces"
                       f" {list(svc.supported)}", "outputs")
    params = PoolingParams(truncate=body.truncate, truncation_direction=body.truncation_direction,
                           normalize=body.normalize, prompt_name=body.prompt_name, dimensions=body.dimensions,
                           outputs=wanted)
    result = await svc.run(request, embed_items(body.input), params, "input", item_names("input", body.input))
    data = [{"object": "pooling", "index": i, **{k: to_json(v) for k, v in o.outputs.items() if k in wanted}}
            for i, o in enumerate(result.outputs)]
    return _list_response(svc, data, result)


def _list_response(svc: Service, data: list[dict], result: Result) -> JSONResponse:
    """OpenAI's list envelope with token usage, plus the timing headers."""
    usage = {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens}
    return JSONResponse({"object": "list", "data": data, "model": svc.model_name, "usage": usage},
                        headers=result.headers)


def _model_card(svc: Service) -> dict:
    """OpenAI's Model object (`id`, `object`, `created`, `owned_by`) plus what WDE serves it with."""
    info = svc.info
    return {"id": svc.model_name, "object": "model", "created": svc.created, "owned_by": "wde",
            "root": svc.model_name, "workflow": info.workflow,
            "outputs": list(info.outputs), "max_model_len": info.max_length}


@router.get("/v1/models")
async def models(request: Request) -> JSONResponse:
    return JSONResponse({"object": "list", "data": [_model_card(service(request))]})


@router.get("/v1/models/{model_id:path}")
async def model(request: Request, model_id: str) -> JSONResponse:
    """OpenAI's `models.retrieve`: the served model under any of its names; 404 for any other id."""
    svc = service(request)
    if model_id not in svc.model_names:
        raise svc.not_served(model_id)
    return JSONResponse(_model_card(svc))


_CAPABILITIES = {"dense": "embed", "score": "rerank", "probs": "classify"}
"""WDE outputs → Infinity's capability names."""


@router.get("/models")
async def infinity_models(request: Request) -> JSONResponse:
    """Infinity's /models: OpenAI's list whose cards carry Infinity's `stats` (read by infinity_client),
    `backend` and `capabilities`."""
    svc = service(request)
    engine = svc.engine
    limit = max(1, engine.max_concurrent_requests)
    stats = {"queue_fraction": engine.active_calls / limit, "queue_absolute": engine.queue_depth,
             "results_pending": engine.num_pending, "batch_size": svc.info.max_num_requests}
    card = {"id": svc.model_name, "object": "model", "owned_by": "infinity", "created": svc.created,
            "backend": "wde", "capabilities": sorted(_CAPABILITIES[o] for o in svc.supported if o in _CAPABILITIES),
            "stats": stats}
    return JSONResponse({"object": "list", "data": [card]})
