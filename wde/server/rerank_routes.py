"""/rerank and /v1/rerank: one path, two request shapes; /v2/rerank (Cohere v2, vLLM).

A body with `documents` is Cohere/Jina/vLLM/Infinity-style and gets `{"id", "object": "rerank", "created",
"model", "results": [{index, relevance_score, document}], "usage": {prompt_tokens, total_tokens}}`, which each of
those clients reads; `document` is `{"text": ...}` (Cohere, Jina, vLLM) except for infinity_client's body (it always
sends `model`, `return_documents` and `raw_scores`), which gets Infinity's plain string. A body with `texts` is
TEI's and gets TEI's bare list `[{index, score, text?}]` (and TEI's error shape).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter, Request

from wde.request import PoolingParams
from wde.server.protocol import (CohereRerankRequest, Document, RerankRequest, TeiRerankRequest, body_schema, parse,
                                 read_json)
from wde.server.responses import JSONResponse
from wde.server.service import Result, Service, scalar

router = APIRouter()


async def _scores(svc: Service, request: Request, query: str, docs: list[str], params: PoolingParams,
                  field: str) -> tuple[list[tuple[int, float]], Result]:
    """(index, score) best first, and the raw result for usage and headers. Errors name `query` or `field[i]`."""
    svc.require("score", request.url.path)
    names = [("query", f"{field}[{i}]") for i in range(len(docs))]
    result = await svc.run(request, [(query, d) for d in docs], params, field, names)
    ranked = sorted(((i, scalar(o.outputs["score"])) for i, o in enumerate(result.outputs)), key=lambda x: -x[1])
    return ranked, result


@router.post("/rerank", openapi_extra=body_schema(RerankRequest, TeiRerankRequest))
@router.post("/v1/rerank", openapi_extra=body_schema(RerankRequest, TeiRerankRequest))
async def rerank(request: Request) -> JSONResponse:
    return await rerank_body(request, await read_json(request))


INFINITY_CLIENT_KEYS = frozenset({"model", "return_documents", "raw_scores"})
"""What infinity_client's RerankInput always sends (with its defaults when its user gives none)."""


async def rerank_body(request: Request, raw: Any, tei: bool = False) -> JSONResponse:
    """Rerank a parsed JSON body in the shape it was sent in: TEI's with `texts` (or, when `tei`, with neither
    `texts` nor `documents`: TEI's root route names what is missing in TEI's shape), else with `documents`."""
    svc: Service = request.app.state.service
    documents = isinstance(raw, dict) and "documents" in raw
    if not documents and (tei or isinstance(raw, dict) and "texts" in raw):
        request.state.error_style = "tei"
        return await _tei_rerank(svc, request, parse(TeiRerankRequest, raw))
    request.state.error_style = "openai"
    flat = isinstance(raw, dict) and INFINITY_CLIENT_KEYS <= raw.keys()
    return await _documents_rerank(svc, request, parse(RerankRequest, raw), truncate=False, flat_documents=flat)


@router.post("/v2/rerank", openapi_extra=body_schema(CohereRerankRequest))
async def rerank_v2(request: Request) -> JSONResponse:
    """Cohere v2 (and vLLM's /v2/rerank): the /v1/rerank answer plus Cohere's `meta`."""
    svc: Service = request.app.state.service
    body = parse(CohereRerankRequest, await read_json(request))
    svc.check_model(body.model)
    svc.require("score", "/v2/rerank")
    cap = body.max_tokens_per_doc
    svc.check_token_cap(cap, "max_tokens_per_doc", " per (query, document) pair")
    # Cohere truncates documents to max_tokens_per_doc; within the model's limit that is at most `cap` tokens.
    return await _documents_rerank(svc, request, body, truncate=cap is not None)


async def _documents_rerank(svc: Service, request: Request, body: RerankRequest, truncate: bool,
                            flat_documents: bool = False) -> JSONResponse:
    svc.check_model(body.model)
    docs = [d.text if isinstance(d, Document) else d for d in body.documents]
    params = PoolingParams(truncate=body.truncate or truncate, activation=False if body.raw_scores else None,
                           outputs=("score",))
    ranked, result = await _scores(svc, request, body.query, docs, params, "documents")
    if body.top_n:
        ranked = ranked[:body.top_n]
    results = []
    for i, score in ranked:
        item: dict = {"index": i, "relevance_score": score}
        if body.return_documents:
            item["document"] = docs[i] if flat_documents else {"text": docs[i]}
        results.append(item)
    tokens = result.prompt_tokens
    content = {"id": f"rerank-{uuid.uuid4().hex}", "object": "rerank", "created": int(time.time()),
               "model": svc.model_name, "results": results,
               "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
    if isinstance(body, CohereRerankRequest):
        content["meta"] = {"api_version": {"version": "2"}, "tokens": {"input_tokens": result.prompt_tokens}}
    return JSONResponse(content, headers=result.headers)


async def _tei_rerank(svc: Service, request: Request, body: TeiRerankRequest) -> JSONResponse:
    params = PoolingParams(truncate=bool(body.truncate), truncation_direction=body.truncation_direction,
                           activation=False if body.raw_scores else None, outputs=("score",))
    ranked, result = await _scores(svc, request, body.query, body.texts, params, "texts")
    ranks = [{"index": i, "score": s, **({"text": body.texts[i]} if body.return_text else {})} for i, s in ranked]
    return JSONResponse(ranks, headers=result.headers)
