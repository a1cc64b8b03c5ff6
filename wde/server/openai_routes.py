"""OpenAI-compatible routes: /v1/embeddings, /v1/models, and /pooling (every output, e.g. bge-m3's
dense + sparse + colbert, in OpenAI's list envelope)."""

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
async def embeddings(request: Request) -> JSONResponse:
    svc = service(request)
    body = parse(EmbeddingRequest, await read_json(request))
    svc.check_model(body.model)
    svc.require("dense", "/v1/embeddings")
    params = PoolingParams(truncate=body.truncate, prompt_name=body.prompt_name, dimensions=body.dimensions,
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
    wanted = tuple(body.outputs) if body.outputs else svc.supported
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


@router.get("/v1/models")
async def models(request: Request) -> JSONResponse:
    svc = service(request)
    info = svc.info
    card = {"id": svc.model_name, "object": "model", "created": svc.created, "owned_by": "wde",
            "root": svc.model_name, "workflow": info.workflow,
            "outputs": list(info.outputs), "max_model_len": info.max_length}
    return JSONResponse({"object": "list", "data": [card]})
