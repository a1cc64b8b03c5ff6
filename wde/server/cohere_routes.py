"""Cohere v2 /v2/embed: embeddings by type (float, int8, uint8, binary, ubinary, base64), `input_type` mapped
to the workflow's prompts; texts (`texts`, text content) and, for an image-text model, images (`images`, image_url
content). Cohere v1 /v1/embed (`cohere.Client.embed`, langchain-cohere's `CohereEmbeddings`) is the same
embedding in v1's body and answer. A late-interaction model answers both with each input's token matrix
(`input_type` search_query / search_document → its `task` option query / document). /v2/rerank lives with the
other rerank routes (rerank_routes.py)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from fastapi import APIRouter, Request

from wde.request import PoolingParams
from wde.server.errors import ApiError
from wde.server.image_inputs import check_one_part, image_inputs, require_images, text_input
from wde.server.protocol import (Body, CohereEmbeddingType, CohereEmbedRequest, CohereImage, body_schema, parse,
                                 read_json)
from wde.server.quantize import quantize_rows, to_base64
from wde.server.responses import JSONResponse
from wde.server.service import Service, model_service

router = APIRouter()

INPUT_TYPE_PROMPTS: dict[str, tuple[str, ...]] = {
    "search_query": ("search_query", "query"),
    "search_document": ("search_document", "document", "passage"),
    "classification": ("classification",),
    "clustering": ("clustering",),
}
"""Cohere's input types → the prompt names that serve them, first defined wins (sentence-transformers models
usually name theirs `query` and `document` or `passage`)."""

def cohere_long_inputs(svc: Service, truncate: str | None) -> dict[str, Any]:
    """PoolingParams keyword arguments for Cohere's `truncate`: NONE refuses an over-long input, START and END
    truncate it; left out, a server set to --long-inputs chunk chunks it, any other truncates it (Cohere's default,
    END)."""
    if truncate is None and svc.config.long_inputs == "chunk":
        return svc.long_inputs(None)
    return {**svc.long_inputs(truncate != "NONE"), "truncation_direction": "left" if truncate == "START" else "right"}


def prompt_name(input_type: str | None, prompts: dict[str, str]) -> str | None:
    """The prompt an `input_type` selects: one of its names the model defines, else none (the plain text); any
    other value must name one of the model's prompts itself. "image" selects none (prompts are for texts)."""
    if input_type is None or input_type == "image":
        return None
    for name in INPUT_TYPE_PROMPTS.get(input_type, (input_type,)):
        if name in prompts:
            return name
    if input_type in INPUT_TYPE_PROMPTS:
        return None
    raise ApiError("validation", f"input_type {input_type!r} is neither a Cohere input type"
                   f" ({', '.join(INPUT_TYPE_PROMPTS)}, image) nor a prompt of this model (defined prompts:"
                   f" {sorted(prompts) or 'none'})", "input_type")


@dataclass
class _Inputs:
    """What a /v2/embed body asks to embed: engine inputs in order, their names, and which are which."""

    items: list[Any] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    """The texts, for the response's `texts`."""
    images: list[tuple[str, str]] = field(default_factory=list)
    """(reference, name) of each image, resolved into `items` by `_resolve`."""
    field: str = "texts"


def _inputs(svc: Service, body: CohereEmbedRequest) -> _Inputs:
    """The inputs of `texts`, `images` or `inputs` (exactly one of them), checked against what the model embeds."""
    given = [f for f in ("texts", "images", "inputs") if getattr(body, f) is not None]
    if len(given) > 1:
        both = "both" if len(given) == 2 else "all"
        raise ApiError("validation", f"{' and '.join(given)} are {both} given; send one of them", given[-1])
    out = _Inputs(field=given[0] if given else "texts")
    if body.input_type == "image":
        require_images(svc, "input_type", "input_type 'image'")
    if body.images is not None:
        require_images(svc, "images", "images")
        for i, image in enumerate(body.images):
            out.images.append((image, f"images[{i}]"))
            out.items.append(None)
            out.names.append(f"images[{i}]")
        return out
    if body.inputs is None:
        for i, text in enumerate(body.texts or []):
            _add_text(out, body, text, f"texts[{i}]")
        return out
    for i, item in enumerate(body.inputs):
        where = f"inputs[{i}].content"
        images = [j for j, part in enumerate(item.content) if isinstance(part, CohereImage)]
        if images and not svc.takes_images:
            raise ApiError("unsupported", f"{where}[{images[0]}] is an image_url part: this model embeds text only"
                           f" (workflow {svc.info.workflow!r})", where)
        check_one_part(where, len(images), len(item.content), "send exactly one text or image per input")
        part = item.content[0]
        if isinstance(part, CohereImage):
            out.images.append((part.image_url.url, f"{where}[0].image_url"))
            out.items.append(None)
            out.names.append(f"{where}[0].image_url")
        else:
            _add_text(out, body, part.text, f"{where}[0].text")
    return out


def _add_text(out: _Inputs, body: CohereEmbedRequest, text: str, name: str) -> None:
    if body.input_type == "image":
        raise ApiError("validation", f"input_type 'image' is for images, and {name} is a text; give texts a text"
                       f" input type ({', '.join(INPUT_TYPE_PROMPTS)})", "input_type")
    out.items.append(text_input(text))
    out.names.append(name)
    out.texts.append(text)


async def _resolve(request: Request, svc: Service, out: _Inputs) -> None:
    """Fill in the engine inputs of the images (data: URIs as they are, allowed URLs fetched)."""
    if not out.images:
        return
    resolved = iter(await image_inputs(svc, request, [v for v, _ in out.images], [n for _, n in out.images],
                                       out.field, len(out.items)))
    out.items = [next(resolved) if item is None else item for item in out.items]


MULTI_VECTOR = "colbert"
"""The output a late-interaction model embeds with: one vector per scored token (a matrix per input)."""

MULTI_VECTOR_TASKS = {"search_query": "query", "search_document": "document"}
"""Cohere's input types → a late-interaction model's `task` option. classification and clustering have no side of
late interaction and are refused by name (a ColBERT model is trained to score queries against documents)."""


def multi_vector(svc: Service) -> bool:
    """Whether /v1/embed and /v2/embed answer with token matrices: a late-interaction model, which has no single
    vector (bge-m3, which has both, keeps its dense vectors here)."""
    return "dense" not in svc.supported and MULTI_VECTOR in svc.supported


def multi_vector_options(svc: Service, body: CohereEmbedRequest) -> dict[str, str] | None:
    """The `task` option of Cohere's `input_type` for a late-interaction model (left out or "image": the model's
    default side, documents); refused by name where it names no side, or where the model takes no task option."""
    if body.input_type is None or body.input_type == "image":
        return None
    if body.input_type not in MULTI_VECTOR_TASKS:
        raise ApiError("validation", f"input_type {body.input_type!r}: a late-interaction model embeds queries"
                       " (search_query) and documents (search_document), and has no other kind of input",
                       "input_type")
    return svc.options(None, MULTI_VECTOR_TASKS[body.input_type], "input_type")


async def _embed(request: Request, svc: Service, body: CohereEmbedRequest, route: str) -> tuple[_Inputs, Any]:
    """Embed what a Cohere body asks for (v1's body comes here as a v2 one): the inputs and the engine's result,
    whose outputs hold 'dense' vectors, or for a late-interaction model 'colbert' token matrices."""
    svc = model_service(request, body.model)
    multi = multi_vector(svc)
    if not multi:
        svc.require("dense", route)
    elif body.output_dimension is not None:
        raise ApiError("validation", "output_dimension: a late-interaction model's token vectors have the model's"
                       " width and cannot be shortened; leave it out", "output_dimension")
    inputs = _inputs(svc, body)
    if not inputs.items:
        raise ApiError("empty", f"{inputs.field} is empty: send at least one input", inputs.field)
    svc.check_token_cap(body.max_tokens, "max_tokens")
    if multi:
        params = PoolingParams(**cohere_long_inputs(svc, body.truncate), options=multi_vector_options(svc, body),
                               outputs=(MULTI_VECTOR,))
    else:
        params = PoolingParams(**cohere_long_inputs(svc, body.truncate),
                               prompt_name=prompt_name(body.input_type, svc.prompts), dimensions=body.output_dimension,
                               options=svc.input_type_task(body.input_type), outputs=("dense",))
    await _resolve(request, svc, inputs)
    return inputs, await svc.run(request, inputs.items, params, inputs.field, inputs.names, images=True)


def _embeddings(result: Any) -> list[np.ndarray]:
    """Each input's float32 embedding, as `_embed` asked for it: its 'dense' vector, or a late-interaction model's
    'colbert' token matrix."""
    return [np.asarray(o.outputs["dense" if "dense" in o.outputs else MULTI_VECTOR], dtype=np.float32)
            for o in result.outputs]


def _by_type(svc: Service, floats: list[np.ndarray], types: list[str]) -> dict[str, list]:
    """`embeddings` of an `embeddings_by_type` answer: each asked type once, in the order asked. Token matrices
    (a late-interaction model's) come as float (a list of rows per input) and base64 (`to_base64`: row-major
    little-endian float32, an input's rows one after the other); their quantized types are refused by name."""
    embeddings: dict[str, list] = {}
    matrices = any(v.ndim == 2 for v in floats)
    for kind in dict.fromkeys(types):
        if kind == "float":
            embeddings[kind] = floats
        elif kind == "base64":
            embeddings[kind] = [to_base64(v) for v in floats]
        elif matrices:
            raise ApiError("validation", f"embedding_types {kind!r}: a late-interaction model's token vectors are"
                           " served as float and base64 (float32); int8, uint8, binary and ubinary are not",
                           "embedding_types")
        else:
            embeddings[kind] = quantize_rows(floats, kind, svc.config.quantization_ranges,  # type: ignore[arg-type]
                                             "embedding_types")
    return embeddings


def _shapes(floats: list[np.ndarray]) -> dict[str, list]:
    """A WDE extension on a late-interaction model's answer: each input's token matrix shape [rows, dim], which
    its base64 bytes do not carry. Nothing for vectors."""
    return {"shapes": [list(v.shape) for v in floats]} if any(v.ndim == 2 for v in floats) else {}


def _billed(inputs: _Inputs, tokens: int) -> dict[str, int]:
    """Cohere's `meta.billed_units`: the tokens embedded, and the images (Cohere bills those per image)."""
    billed = {"input_tokens": tokens}
    if inputs.images:
        billed["images"] = len(inputs.images)
    return billed


@router.post("/v2/embed", openapi_extra=body_schema(CohereEmbedRequest))
async def embed(request: Request) -> JSONResponse:
    svc: Service = request.app.state.service
    body = parse(CohereEmbedRequest, await read_json(request))
    inputs, result = await _embed(request, svc, body, "/v2/embed")
    floats = _embeddings(result)
    tokens = result.prompt_tokens
    return JSONResponse({"id": f"embed-{uuid.uuid4().hex}", "response_type": "embeddings_by_type",
                         "embeddings": _by_type(svc, floats, body.embedding_types or ["float"]),
                         **_shapes(floats), "texts": inputs.texts,
                         "meta": {"api_version": {"version": "2"}, "billed_units": _billed(inputs, tokens),
                                  "tokens": {"input_tokens": tokens}}}, headers=result.headers)


class CohereV1EmbedRequest(Body):
    """Cohere v1 /v1/embed: exactly what cohere's v1 `Client.embed` sends (cohere 7.3's raw_base_client.py)."""

    texts: list[str] | None = None
    images: list[str] | None = None
    """data:image URIs (or, with --allow-image-fetch, http(s) URLs) for an image-text model."""
    model: str | None = None
    input_type: str | None = None
    """As /v2/embed's: Cohere's input types mapped to the workflow's prompts, or a prompt's own name."""
    embedding_types: list[CohereEmbeddingType] | None = None
    """Left out: the v1 float answer (`embeddings_floats`); given: the by-type answer, as v2's."""
    truncate: Literal["NONE", "START", "END"] | None = None
    """Left out or null (langchain-cohere sends null when its `truncate` is unset): as /v2/embed's."""


_V2_ONLY = ("inputs", "max_tokens", "output_dimension", "priority")
"""Fields of /v2/embed that Cohere's v1 body does not have: refused by name on /v1/embed, not silently dropped
(a client sending `output_dimension` there would otherwise get full-width vectors without a word)."""


@router.post("/v1/embed", openapi_extra=body_schema(CohereV1EmbedRequest))
async def embed_v1(request: Request) -> JSONResponse:
    """Cohere v1's answer: `embeddings_floats` (a plain list of vectors) unless `embedding_types` is given.
    A refused request is a 4xx other than 408/409/429, which cohere's client answers at once without retrying."""
    svc: Service = request.app.state.service
    raw = await read_json(request)
    for name in _V2_ONLY:
        if isinstance(raw, dict) and name in raw:
            raise ApiError("validation", f"{name} is a Cohere v2 field, which /v1/embed (Cohere v1) does not take:"
                           f" send it to /v2/embed (cohere.ClientV2)", name)
    v1 = parse(CohereV1EmbedRequest, raw)
    inputs, result = await _embed(request, svc, CohereEmbedRequest(**v1.model_dump(exclude_none=True)), "/v1/embed")
    floats = _embeddings(result)
    answer: dict[str, Any] = {"id": f"embed-{uuid.uuid4().hex}", "texts": inputs.texts, **_shapes(floats),
                              "meta": {"api_version": {"version": "1"},
                                       "billed_units": _billed(inputs, result.prompt_tokens)}}
    if v1.embedding_types is None:
        answer.update(response_type="embeddings_floats", embeddings=floats)
    else:
        by_type = _by_type(svc, floats, v1.embedding_types or ["float"])
        answer.update(response_type="embeddings_by_type", embeddings=by_type)
    return JSONResponse(answer, headers=result.headers)
