"""Cohere v2 /v2/embed: embeddings by type (float, int8, uint8, binary, ubinary, base64), `input_type` mapped
to the workflow's prompts. /v2/rerank lives with the other rerank routes (rerank_routes.py)."""

from __future__ import annotations

import uuid

import numpy as np
from fastapi import APIRouter, Request

from wde.request import PoolingParams
from wde.server.errors import ApiError
from wde.server.protocol import CohereEmbedRequest, CohereImage, body_schema, parse, read_json
from wde.server.quantize import quantize_rows, to_base64
from wde.server.responses import JSONResponse
from wde.server.service import Service

router = APIRouter()

INPUT_TYPE_PROMPTS: dict[str, tuple[str, ...]] = {
    "search_query": ("search_query", "query"),
    "search_document": ("search_document", "document", "passage"),
    "classification": ("classification",),
    "clustering": ("clustering",),
}
"""Cohere's input types → the prompt names that serve them, first defined wins (sentence-transformers models
usually name theirs `query` and `document` or `passage`)."""

_TRUNCATE = {"NONE": (False, "right"), "END": (True, "right"), "START": (True, "left")}


def prompt_name(input_type: str | None, prompts: dict[str, str]) -> str | None:
    """The prompt an `input_type` selects: one of its names the model defines, else none (the plain text); any
    other value must name one of the model's prompts itself."""
    if input_type is None:
        return None
    if input_type == "image":
        raise ApiError("unsupported", "input_type 'image': this server embeds text only", "input_type")
    for name in INPUT_TYPE_PROMPTS.get(input_type, (input_type,)):
        if name in prompts:
            return name
    if input_type in INPUT_TYPE_PROMPTS:
        return None
    raise ApiError("validation", f"input_type {input_type!r} is neither a Cohere input type"
                   f" ({', '.join(INPUT_TYPE_PROMPTS)}) nor a prompt of this model (defined prompts:"
                   f" {sorted(prompts) or 'none'})", "input_type")


def _texts(body: CohereEmbedRequest) -> tuple[list[str], list[str]]:
    """The texts to embed and their names for errors, from `texts` or from text-only `inputs`."""
    if body.images:
        raise ApiError("unsupported", "images: this server embeds text only", "images")
    if body.texts is not None and body.inputs is not None:
        raise ApiError("validation", "texts and inputs are both given; send one of them", "inputs")
    if body.inputs is None:
        texts = body.texts or []
        return texts, [f"texts[{i}]" for i in range(len(texts))]
    texts, names = [], []
    for i, item in enumerate(body.inputs):
        where = f"inputs[{i}].content"
        if any(isinstance(part, CohereImage) for part in item.content):
            raise ApiError("unsupported", f"{where}: this server embeds text only, not image_url parts", where)
        if len(item.content) != 1:
            raise ApiError("validation", f"{where} has {len(item.content)} text parts; send exactly one text per"
                           " input", where)
        texts.append(item.content[0].text)  # type: ignore[union-attr]
        names.append(f"{where}[0].text")
    return texts, names


@router.post("/v2/embed", openapi_extra=body_schema(CohereEmbedRequest))
async def embed(request: Request) -> JSONResponse:
    svc: Service = request.app.state.service
    body = parse(CohereEmbedRequest, await read_json(request))
    svc.check_model(body.model)
    svc.require("dense", "/v2/embed")
    texts, names = _texts(body)
    if not texts:
        raise ApiError("empty", "texts is empty: send at least one text", "texts")
    svc.check_token_cap(body.max_tokens, "max_tokens")
    truncate, direction = _TRUNCATE[body.truncate]
    prompts = getattr(svc.engine.input_processor, "prompts", {})
    params = PoolingParams(truncate=truncate, truncation_direction=direction,  # type: ignore[arg-type]
                           prompt_name=prompt_name(body.input_type, prompts), dimensions=body.output_dimension,
                           outputs=("dense",))
    result = await svc.run(request, texts, params, "texts", names)
    floats = [np.asarray(v, dtype=np.float32) for v in result.dense]
    embeddings: dict[str, list] = {}
    for kind in dict.fromkeys(body.embedding_types or ["float"]):
        if kind == "float":
            embeddings[kind] = floats
        elif kind == "base64":
            embeddings[kind] = [to_base64(v) for v in floats]
        else:
            embeddings[kind] = quantize_rows(floats, kind, svc.config.quantization_ranges,  # type: ignore[arg-type]
                                             "embedding_types")
    tokens = result.prompt_tokens
    return JSONResponse({"id": f"embed-{uuid.uuid4().hex}", "response_type": "embeddings_by_type",
                         "embeddings": embeddings, "texts": texts,
                         "meta": {"api_version": {"version": "2"}, "billed_units": {"input_tokens": tokens},
                                  "tokens": {"input_tokens": tokens}}}, headers=result.headers)
