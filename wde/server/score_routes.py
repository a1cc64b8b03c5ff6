"""vLLM-style /score and /v1/score (pairs under any of vLLM's field names, 1:1, 1:N, N:N) and /classify, which
also speaks Infinity's /classify (and /v1/classify, Infinity under a /v1 prefix) for a body carrying `raw_scores`."""

from __future__ import annotations

import time
import uuid

import numpy as np
from fastapi import APIRouter, Request

from wde.request import PoolingParams
from wde.server.errors import ApiError
from wde.server.image_sides import score_images
from wde.server.protocol import (ClassifyRequest, InfinityClassifyRequest, ScoreRequest, body_schema, item_names, parse,
                                 read_json)
from wde.server.responses import JSONResponse
from wde.server.service import model_service
from wde.server.truncation import truncation

router = APIRouter()


_SIDES = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2"))
"""vLLM's field pairs of a /score body, each naming the two sides the same way."""


_FIELDS = tuple(dict.fromkeys(f for pair in _SIDES for f in pair))
"""Every field of those pairs once, in their order."""


def _sides(body: ScoreRequest) -> tuple[str, str]:
    """The one field pair `body` uses; a body giving fields of two pairs, or half a pair, is refused by name."""
    given = [f for f in _FIELDS if getattr(body, f) is not None]
    complete = [pair for pair in _SIDES if set(pair) == set(given)]
    if complete:
        return complete[0]
    pairs = " or ".join(f"{a}/{b}" for a, b in _SIDES)
    if not given:
        raise ApiError("validation", f"the texts to score are missing: send {pairs}", "text_1")
    raise ApiError("validation", f"{', '.join(given)} given; send exactly one field pair: {pairs}", given[-1])


def _pairs(body: ScoreRequest, sides: tuple[str, str]) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """vLLM's rules: a single first side (or a one-element list) is scored against every second; else zip (1:1,
    N:N). Also returns each pair's field names (`queries` or `queries[i]`, `documents[j]`...) for errors. `sides`
    is the body's field pair (`_sides`)."""
    field_1, field_2 = sides
    side_1, side_2 = getattr(body, field_1), getattr(body, field_2)
    left = [side_1] if isinstance(side_1, str) else side_1
    right = [side_2] if isinstance(side_2, str) else side_2
    for field, side in ((field_1, left), (field_2, right)):
        if not side:
            raise ApiError("empty", f"{field} is empty: send at least one text", field)
    if len(left) != 1 and len(left) != len(right):
        raise ApiError("validation", f"{field_1} has {len(left)} texts and {field_2} has {len(right)}; send one"
                       f" {field_1} or as many as {field_2}", field_1)

    def name(field: str, value: str | list[str], i: int) -> str:
        return field if isinstance(value, str) else f"{field}[{i}]"

    pairs = [(left[0 if len(left) == 1 else i], t) for i, t in enumerate(right)]
    names = [(name(field_1, side_1, 0 if len(left) == 1 else i), name(field_2, side_2, i)) for i in range(len(right))]
    return pairs, names


@router.post("/score", openapi_extra=body_schema(ScoreRequest))
@router.post("/v1/score", openapi_extra=body_schema(ScoreRequest))
async def score(request: Request) -> JSONResponse:
    """Each pair scored by the workflow's scorer: a cross-encoder scores the pair, an embedder answers with the
    cosine similarity of the two texts, a multi-vector model with their MaxSim (the first text as the query)."""
    body = parse(ScoreRequest, await read_json(request))
    svc = model_service(request, body.model)
    svc.scorer("/score")
    sides = _sides(body)
    body, images = await score_images(svc, request, body, sides)
    pairs, names = _pairs(body, sides)
    if body.raw_scores and body.use_activation:
        raise ApiError("validation", "raw_scores: true and use_activation: true contradict each other; send one",
                       "use_activation")
    cut = truncation(body, svc.info.max_length, body.truncate)
    raw = body.raw_scores or body.use_activation is False
    scored, result = await svc.score(request, pairs, PoolingParams(**cut, activation=False if raw else None),
                                     sides[1], names, images=images)
    scores = scored.tolist()
    data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
    usage = {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens}
    return JSONResponse({"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                         "model": svc.model_name, "data": data, "usage": usage}, headers=result.headers)


@router.post("/classify", openapi_extra=body_schema(ClassifyRequest, InfinityClassifyRequest))
@router.post("/v1/classify", openapi_extra=body_schema(ClassifyRequest, InfinityClassifyRequest))
async def classify(request: Request) -> JSONResponse:
    raw = await read_json(request)
    if isinstance(raw, dict) and "raw_scores" in raw:  # infinity_client always sends it; vLLM has no such field
        return await _infinity_classify(request, parse(InfinityClassifyRequest, raw))
    body = parse(ClassifyRequest, raw)
    svc = model_service(request, body.model)
    svc.require("probs", request.url.path)
    inputs = [body.input] if isinstance(body.input, str) else body.input
    result = await svc.run(request, inputs, PoolingParams(truncate=body.truncate, outputs=("probs",)), "input",
                           item_names("input", body.input))
    labels = svc.labels()
    data = []
    for i, o in enumerate(result.outputs):
        probs = np.asarray(o.outputs["probs"], dtype=np.float32).reshape(-1)
        best = int(probs.argmax())
        data.append({"index": i, "label": labels[best] if best < len(labels) else str(best),
                     "probs": probs.tolist(), "num_classes": int(probs.shape[0])})
    usage = {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens}
    return JSONResponse({"id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                         "model": svc.model_name, "data": data, "usage": usage}, headers=result.headers)


async def _infinity_classify(request: Request, body: InfinityClassifyRequest) -> JSONResponse:
    """Infinity's answer: per input, every label with its score, best first; `raw_scores` gives logits."""
    svc = model_service(request, body.model)
    svc.require("probs", request.url.path)
    inputs = [body.input] if isinstance(body.input, str) else body.input
    params = PoolingParams(truncate=body.truncate, activation=False if body.raw_scores else None, outputs=("probs",))
    result = await svc.run(request, inputs, params, "input", item_names("input", body.input))
    labels = svc.labels()
    data = []
    for o in result.outputs:
        scores = np.asarray(o.outputs["probs"], dtype=np.float32).reshape(-1).tolist()
        ranked = sorted(range(len(scores)), key=lambda i: -scores[i])
        data.append([{"score": scores[i], "label": labels[i] if i < len(labels) else f"LABEL_{i}"} for i in ranked])
    usage = {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens}
    return JSONResponse({"id": f"classify-{uuid.uuid4().hex}", "object": "classify", "created": int(time.time()),
                         "model": svc.model_name, "data": data, "usage": usage}, headers=result.headers)
