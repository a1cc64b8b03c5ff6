"""OpenAI-compatible routes: /v1/embeddings (also at /embeddings, where TEI and Infinity serve it), /v1/models,
/v1/models/{id}, Infinity's /models, and vLLM's /pooling (the task's output in `data[i].data`, plus e.g. bge-m3's
sparse + colbert under their own names).

/v1/embeddings takes OpenAI's body (`input`: texts), Infinity's `modality: "image"` (`input`: image URLs or data
URIs) and vLLM's chat-style body (`messages`, wde/server/chat_embeddings.py), for images of an image-text model."""

from __future__ import annotations

import time
import uuid
from typing import Any, TypeVar

import numpy as np
from fastapi import APIRouter, Request

from wde.request import PoolingParams
from wde.server.chat_embeddings import chat_input
from wde.server.errors import ApiError
from wde.server.image_inputs import image_inputs, require_images
from wde.server.image_sides import pooling_inputs
from wde.server.late_chunking import LateChunkingRequest, asked, late_chunks
from wde.server.protocol import (ChatEmbeddingRequest, EmbeddingOptions, EmbeddingRequest, PoolingRequest, body_schema,
                                 embed_items, item_names, parse, read_json)
from wde.server.quantize import quantize_rows, to_base64
from wde.server.responses import JSONResponse, encode_array
from wde.server.service import Result, ServedModels, Service, model_service, to_json
from wde.server.truncation import truncation

router = APIRouter()

T = TypeVar("T", bound=EmbeddingOptions)


def service(request: Request, model: str | None = None) -> Service:
    """The service of the model a request names (`model`, else `?model=`, else the default one)."""
    return model_service(request, model)


def served(request: Request) -> ServedModels:
    return request.app.state.models


def encode_vector(vector: np.ndarray, encoding_format: str) -> np.ndarray | str:
    """OpenAI's base64 format is the little-endian float32 bytes of the vector (a quantized vector's own bytes);
    float is the array itself (the JSON response writes it without a Python list)."""
    if encoding_format == "base64":
        return to_base64(vector)
    return np.ascontiguousarray(vector)


@router.post("/v1/embeddings", openapi_extra=body_schema(EmbeddingRequest, ChatEmbeddingRequest, LateChunkingRequest))
@router.post("/embeddings", openapi_extra=body_schema(EmbeddingRequest, ChatEmbeddingRequest, LateChunkingRequest))
async def embeddings(request: Request) -> JSONResponse:
    raw = await read_json(request)
    if asked(raw):  # late chunking: one vector per chunk of a document (wde/server/late_chunking.py)
        svc, body, chunks, result = await late_chunks(request, raw)
        body = jina_encoding(body)
        vectors = quantize_rows([c.vector for c in chunks], body.embed_dtype, svc.config.quantization_ranges,
                                "embed_dtype")
        return _list_response(svc, [{"object": "embedding", "embedding": encode_vector(v, body.encoding_format),
                                     "index": i, "char_range": list(c.char_range), "token_range": list(c.token_range)}
                                    for i, (c, v) in enumerate(zip(chunks, vectors))], result)
    if isinstance(raw, dict) and "messages" in raw:
        chat = parse(ChatEmbeddingRequest, raw)
        if "input" in raw:
            raise ApiError("validation", "input and messages are both given; send one of them (messages: vLLM's"
                           " chat-style request, one vector per request)", "messages")
        svc = service(request, chat.model)
        svc.require("dense", request.url.path)
        item, name = await chat_input(svc, request, chat)
        if chat.prompt_name is not None and not isinstance(item, dict):  # texts are {"text": ...}
            raise ApiError("validation", f"prompt_name applies to texts, and {name} is an image; leave it out",
                           "prompt_name")
        return await _embed(request, svc, chat, [item], [name], images=True)
    body = parse(EmbeddingRequest, raw)
    svc = service(request, body.model)
    if body.modality == "audio":
        raise ApiError("unsupported", "modality 'audio': WDE embeds texts and images, not audio", "modality")
    if body.modality == "image":
        require_images(svc, "modality", "modality 'image'")
        svc.require("dense", request.url.path)
        values = [body.input] if isinstance(body.input, str) else list(body.input)
        if not all(isinstance(v, str) for v in values):
            raise ApiError("validation", "input: with modality 'image' it is an image URL or data:image URI, or a list"
                           " of them, not token ids", "input")
        names = item_names("input", body.input)
        if body.prompt_name is not None:
            raise ApiError("validation", "prompt_name applies to texts, and with modality 'image' every input is an"
                           " image; leave it out", "prompt_name")
        inputs = await image_inputs(svc, request, values, names, "input")
        return await _embed(request, svc, body, inputs, names, images=True)
    svc.require("dense", request.url.path)
    return await _embed(request, svc, body, embed_items(body.input), item_names("input", body.input))


async def _embed(request: Request, svc: Service, body: EmbeddingOptions, inputs: list, names: list[str],
                 images: bool = False) -> JSONResponse:
    """Embed `inputs` with the body's options, in OpenAI's list envelope."""
    body = jina_encoding(body)
    params = PoolingParams(normalize=body.normalized, **long_inputs(svc, truncation(body, svc.info.max_length, body.truncate)),
                           prompt_name=body.prompt_name, dimensions=body.dimensions or None, outputs=("dense",),
                           options=svc.jina_task(body.task, body.options))
    result = await svc.run(request, inputs, params, "input", names, images=images)
    vectors = quantize_rows(result.dense, body.embed_dtype, svc.config.quantization_ranges, "embed_dtype")
    data = [{"object": "embedding", "embedding": encode_vector(v, body.encoding_format), "index": i}
            for i, v in enumerate(vectors)]
    return _list_response(svc, data, result)


def jina_encoding(body: T) -> T:
    """`body` with Jina's `embedding_type` as the encoding_format / embed_dtype that give its answer: base64 is
    OpenAI's base64 (float32 bytes), binary / ubinary the packed bits of embed_dtype binary / ubinary. Both ways
    given at once is a 422 naming embedding_type, rather than one silently winning."""
    kind = body.embedding_type
    if kind is None:
        return body
    both = sorted({"encoding_format", "embed_dtype"} & body.model_fields_set)
    if both:
        raise ApiError("validation", f"embedding_type {kind!r} (Jina's) and {' and '.join(both)} both say how to"
                       " encode the vectors; send one", "embedding_type")
    if kind == "base64":
        return body.model_copy(update={"encoding_format": "base64"})
    return body.model_copy(update={"embed_dtype": kind}) if kind != "float" else body


def long_inputs(svc: Service, cut: dict[str, Any]) -> dict[str, Any]:
    """`cut` (vLLM's truncation fields read), with the server's --long-inputs where the body asked for no
    truncation."""
    return cut if cut["truncate"] else {**cut, **svc.long_inputs(None)}


@router.post("/pooling", openapi_extra=body_schema(PoolingRequest))
async def pooling(request: Request) -> JSONResponse:
    """vLLM's /pooling: `data[i].data` is the task's output (what vLLM's clients read); the workflow's other
    outputs (bge-m3's sparse and colbert), or those `outputs` names, ride along under their own names."""
    body = parse(PoolingRequest, await read_json(request))
    svc = service(request, body.model)
    main = _task_output(svc, body.task)
    extras = [o for o in (body.outputs if body.outputs is not None else svc.produces) if o != main]
    unknown = [o for o in extras if o not in svc.supported]
    if unknown:
        raise ApiError("validation", f"outputs {unknown} are not produced by this model; it produces"
                       f" {list(svc.supported)}", "outputs")
    if body.encoding_format == "base64" and main == "sparse":
        raise ApiError("validation", "encoding_format 'base64' encodes arrays, and this model's output is sparse"
                       " {token_id: weight}; use 'float'", "encoding_format")
    if body.encoding_format == "float" and body.embed_dtype != "float32":
        raise ApiError("validation", f"embed_dtype {body.embed_dtype!r} is the element type of base64 outputs; with"
                       " encoding_format 'float' they are JSON numbers (float32): send encoding_format 'base64'",
                       "embed_dtype")
    if body.use_activation is not None and body.normalize is not None:
        raise ApiError("validation", "normalize and use_activation are both given; send one (vLLM's name is"
                       " use_activation)", "use_activation")
    pooled = main in ("dense", "sparse")  # use_activation: normalization for vectors, the activation for scores
    cut = truncation(body, svc.info.max_length, body.truncate, body.truncation_direction
                     if "truncation_direction" in body.model_fields_set else None)
    params = PoolingParams(**(long_inputs(svc, cut) if main == "dense" and not extras else cut),
                           normalize=body.use_activation if pooled and body.normalize is None else body.normalize,
                           activation=None if pooled else body.use_activation, prompt_name=body.prompt_name,
                           options=svc.options(body.options, body.input_type, "input_type"),
                           dimensions=body.dimensions, outputs=(main, *extras))
    inputs, images = await pooling_inputs(svc, request, body)
    result = await svc.run(request, inputs, params, "input", item_names("input", body.input), images=images)
    data = []
    for i, o in enumerate(result.outputs):
        value = o.outputs[main]
        if main in ("score", "probs"):  # vLLM's classify output: one list of floats per input
            value = np.asarray(value, dtype=np.float32).reshape(-1)
        item: dict[str, Any] = {"index": i, "object": "pooling"}
        if main == "sparse":
            item["data"] = to_json(value)
        else:
            item["data"] = encode_array(value, body.encoding_format, body.embed_dtype, body.endianness)
            if body.encoding_format == "base64":  # the bytes carry no shape: a token matrix's rows vary
                item["shape"] = list(np.shape(value))
        item.update({k: to_json(o.outputs[k]) for k in extras})
        data.append(item)
    usage = {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens}
    return JSONResponse({"id": f"pool-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                         "model": svc.model_name, "data": data, "usage": usage}, headers=result.headers)


_TASKS = {"embed": ("dense",), "classify": ("probs", "score"), "token_embed": ("colbert", "token_embeddings")}
"""vLLM's pooling tasks → the WDE outputs that answer them, first produced wins."""


def _task_output(svc: Service, task: str | None) -> str:
    """The WDE output `data[i].data` holds: the task's, else the model's own (vLLM's default task: embed for an
    embedder, classify for a classifier or cross-encoder; a sparse-only model's sparse weights)."""
    if task is None:
        for outputs in _TASKS.values():
            for output in outputs:
                if output in svc.produces:
                    return output
        return svc.produces[0]
    if task not in _TASKS:
        raise ApiError("unsupported", f"task {task!r} is not served by WDE; it serves {sorted(_TASKS)}", "task")
    for output in _TASKS[task]:
        if output in svc.supported:
            return output
    raise ApiError("unsupported", f"task {task!r} needs one of the outputs {list(_TASKS[task])}, and workflow"
                   f" {svc.info.workflow!r} produces {list(svc.supported)}", "task")


def _list_response(svc: Service, data: list[dict], result: Result) -> JSONResponse:
    """OpenAI's list envelope with token usage, plus the timing headers."""
    usage = {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens}
    return JSONResponse({"object": "list", "data": data, "model": svc.model_name, "usage": usage},
                        headers=result.headers)


def _model_card(svc: Service) -> dict:
    """OpenAI's Model object (`id`, `object`, `created`, `owned_by`) plus what WDE serves it with."""
    info = svc.info
    card = {"id": svc.model_name, "object": "model", "created": svc.created, "owned_by": "wde",
            "root": svc.model_names[0], "workflow": info.workflow,
            "outputs": list(info.outputs), "max_model_len": info.max_length}
    if svc.adapter is not None:  # a LoRA adapter of the model: vLLM's card names its base model as `parent`
        card["parent"] = svc.model_names[0]
    return card


@router.get("/v1/models")
async def models(request: Request) -> JSONResponse:
    """Every served model, the default first, each followed by its LoRA adapters (docs/adapters.md)."""
    return JSONResponse({"object": "list", "data": [
        card for svc in served(request).services
        for card in [_model_card(svc), *(_model_card(svc.for_adapter(a)) for a in svc.adapters())]]})


@router.get("/v1/models/{model_id:path}")
async def model(request: Request, model_id: str) -> JSONResponse:
    """OpenAI's `models.retrieve`: the served model under any of its names; 404 for any other id."""
    return JSONResponse(_model_card(served(request).pick(model_id)))


_CAPABILITIES = {"dense": "embed", "score": "rerank", "probs": "classify"}
"""WDE outputs → Infinity's capability names."""


@router.get("/models")
async def infinity_models(request: Request) -> JSONResponse:
    """Infinity's /models: OpenAI's list whose cards carry Infinity's `stats` (read by infinity_client),
    `backend` and `capabilities`; one per served model, the default first."""
    return JSONResponse({"object": "list", "data": [_infinity_card(svc) for svc in served(request).services]})


def _infinity_card(svc: Service) -> dict:
    engine = svc.engine
    limit = max(1, engine.max_concurrent_requests)
    stats = {"queue_fraction": engine.active_calls / limit, "queue_absolute": engine.queue_depth,
             "results_pending": engine.num_pending, "batch_size": svc.info.max_num_requests}
    return {"id": svc.model_name, "object": "model", "owned_by": "infinity", "created": svc.created,
            "backend": "wde", "capabilities": sorted(_CAPABILITIES[o] for o in svc.supported if o in _CAPABILITIES),
            "stats": stats}
