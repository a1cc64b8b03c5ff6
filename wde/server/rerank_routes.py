"""/rerank and /v1/rerank: one path, several request shapes, each answered in its own client's shape; /v2/rerank
(Cohere v2, vLLM).

A body with `documents` is Cohere/Jina/vLLM/Infinity-style and gets `{"id", "object": "rerank", "created",
"model", "results": [{index, relevance_score, document}], "usage": {prompt_tokens, total_tokens}}`, which each of
those clients reads; `document` is `{"text": ...}` (Cohere, Jina, vLLM) except for Infinity's clients, which get
Infinity's plain string. A body with `texts` is TEI's and gets TEI's bare list `[{index, score, text?}]` (and TEI's
error shape). The bodies alone cannot always tell the clients apart, so `answer_shape` also reads the path and the
client's User-Agent; docs/http_api.md states the rule.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from fastapi import APIRouter, Request

from wde.request import PoolingParams
from wde.server.protocol import (CohereRerankRequest, Document, RerankRequest, TeiRerankRequest, body_schema, parse,
                                 read_json)
from wde.server.responses import JSONResponse
from wde.server.service import Result, Service, model_service

router = APIRouter()


async def _scores(svc: Service, request: Request, query: str, docs: list[str], params: PoolingParams,
                  field: str) -> tuple[list[tuple[int, float]], Result]:
    """(index, score) best first, as the workflow's scorer scores (a cross-encoder each pair, an embedder or a
    multi-vector model the query and each document), and the raw result for usage and headers. Errors name
    `query` or `field[i]`."""
    svc.scorer(request.url.path)
    names = [("query", f"{field}[{i}]") for i in range(len(docs))]
    scores, result = await svc.score(request, [(query, d) for d in docs], params, field, names)
    ranked = sorted(enumerate(scores.tolist()), key=lambda x: -x[1])
    return ranked, result


@router.post("/rerank", openapi_extra=body_schema(RerankRequest, TeiRerankRequest))
@router.post("/v1/rerank", openapi_extra=body_schema(RerankRequest, TeiRerankRequest))
async def rerank(request: Request) -> JSONResponse:
    return await rerank_body(request, await read_json(request))


INFINITY_CLIENT_KEYS = frozenset({"model", "return_documents", "raw_scores"})
"""What infinity_client's RerankInput always sends (with its defaults when its user gives none)."""

LITELLM_AGENT = "litellm/"
"""litellm's User-Agent (`litellm/<version>`). Its `infinity/` provider posts `{api_base}/rerank` and validates each
`document` as a string; its `hosted_vllm/` provider sends the very same body, headers and path but reads
`document["text"]`. Infinity's default route (the root `/rerank`) goes to Infinity; hosted_vllm's `api_base=URL/v1`
reaches `/v1/rerank`, which keeps vLLM's object."""

ELASTIC_AGENT = "apache-httpasyncclient/"
"""Elasticsearch's inference plugin posts with Apache HttpAsyncClient and no User-Agent of its own, so the
client's default (`Apache-HttpAsyncClient/4.1.x (Java/...)`) arrives. Its `hugging_face` rerank service parses only a
top-level array; versions that send `{query, documents, top_n}` instead of TEI's `texts` are told apart by it."""

Shape = Literal["tei", "elastic", "infinity", "documents"]


def answer_shape(request: Request, raw: Any, tei: bool = False) -> Shape:
    """Which answer a rerank body gets. `tei`: the body came to TEI's root route (`/`, `/invocations`), where no
    Cohere/Jina/vLLM/Infinity client posts, so even a `documents` body (Elastic's, pointed at an endpoint's root URL as
    Hugging Face endpoints are) gets TEI's array."""
    if not isinstance(raw, dict) or "documents" not in raw:
        return "tei" if tei or isinstance(raw, dict) and "texts" in raw else "documents"
    agent = request.headers.get("user-agent", "").lower()
    if tei or agent.startswith(ELASTIC_AGENT):
        return "elastic"
    if INFINITY_CLIENT_KEYS <= raw.keys():
        return "infinity"
    if agent.startswith(LITELLM_AGENT) and not request.url.path.rstrip("/").endswith("/v1/rerank"):
        return "infinity"
    return "documents"


async def rerank_body(request: Request, raw: Any, tei: bool = False) -> JSONResponse:
    """Rerank a parsed JSON body in the shape `answer_shape` picks: TEI's with `texts` (or, when `tei`, with neither
    `texts` nor `documents`: TEI's root route names what is missing in TEI's shape), else with `documents`."""
    shape = answer_shape(request, raw, tei)
    if shape == "tei":  # TEI's body names no model: `?model=`, else the default one
        request.state.error_style = "tei"
        return await _tei_rerank(model_service(request), request, parse(TeiRerankRequest, raw))
    request.state.error_style = "tei" if shape == "elastic" else "openai"
    body = parse(RerankRequest, raw)
    svc = model_service(request, body.model)
    if shape == "elastic":
        return await _documents_as_tei(svc, request, body)
    return await _documents_rerank(svc, request, body, truncate=False, flat_documents=shape == "infinity")


@router.post("/v2/rerank", openapi_extra=body_schema(CohereRerankRequest))
async def rerank_v2(request: Request) -> JSONResponse:
    """Cohere v2 (and vLLM's /v2/rerank): the /v1/rerank answer plus Cohere's `meta`."""
    body = parse(CohereRerankRequest, await read_json(request))
    svc = model_service(request, body.model)
    svc.scorer("/v2/rerank")
    cap = body.max_tokens_per_doc
    svc.check_token_cap(cap, "max_tokens_per_doc", " per (query, document) pair")
    # Cohere truncates documents to max_tokens_per_doc; within the model's limit that is at most `cap` tokens.
    return await _documents_rerank(svc, request, body, truncate=cap is not None)


async def _rank_documents(svc: Service, request: Request, body: RerankRequest,
                          truncate: bool) -> tuple[list[str], list[tuple[int, float]], Any]:
    """A `documents` body scored by `svc` (the model it names): its documents as texts, the best `top_n`
    (index, score) first, and the result (tokens, headers); what both its answer shapes are made of."""
    docs = [d.text if isinstance(d, Document) else d for d in body.documents]
    params = PoolingParams(truncate=body.truncate or truncate, activation=False if body.raw_scores else None)
    ranked, result = await _scores(svc, request, body.query, docs, params, "documents")
    return docs, ranked[:body.top_n] if body.top_n else ranked, result


async def _documents_rerank(svc: Service, request: Request, body: RerankRequest, truncate: bool,
                            flat_documents: bool = False) -> JSONResponse:
    docs, ranked, result = await _rank_documents(svc, request, body, truncate)
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
                           activation=False if body.raw_scores else None)
    ranked, result = await _scores(svc, request, body.query, body.texts, params, "texts")
    return JSONResponse(_tei_ranks(ranked, body.texts, body.return_text), headers=result.headers)


async def _documents_as_tei(svc: Service, request: Request, body: RerankRequest) -> JSONResponse:
    """A `documents` body answered as TEI answers `texts` (Elastic's `hugging_face` service): `return_documents` is
    TEI's `return_text`, `top_n` keeps the best n."""
    docs, ranked, result = await _rank_documents(svc, request, body, truncate=False)
    return JSONResponse(_tei_ranks(ranked, docs, body.return_documents), headers=result.headers)


def _tei_ranks(ranked: list[tuple[int, float]], texts: list[str], with_text: bool) -> list[dict]:
    """TEI's bare list, best first: only `index`, `score` and `text`, the keys Elastic's parser accepts."""
    return [{"index": i, "score": s, **({"text": texts[i]} if with_text else {})} for i, s in ranked]
