"""text-embeddings-inference (TEI) compatible routes: same request fields, defaults and response JSON.

`POST /` and `POST /invocations` (SageMaker) answer by the served model's kind, as TEI's router: a classifier
predicts, a reranker reranks, an embedder embeds (a sentence-similarity body, `inputs.source_sentence`, gets
/similarity, which TEI serves there only with TASK=sentence-similarity); `GET /` and `GET /ping` are health.
/rerank, which also speaks TEI, lives in rerank_routes.py. `POST /vertex` (Vertex AI) sends each instance to one
of these handlers (vertex.py); `/tokenize` also takes vLLM's body, and `/detokenize` is vLLM's (vllm_tokenize.py).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from starlette.responses import Response

import wde
from wde.request import PoolingParams
from wde.server import vertex, vllm_tokenize
from wde.server.errors import ApiError, error_response
from wde.server.protocol import (TeiDecodeRequest, TeiEmbedAllRequest, TeiEmbedRequest, TeiPredictRequest,
                                 TeiRerankRequest, TeiSimilarityRequest, TeiSparseRequest, TeiTokenizeRequest,
                                 VertexRequest, VllmDetokenizeRequest, VllmTokenizeRequest, body_schema, embed_items,
                                 item_names, parse, read_json)
from wde.server.quantize import quantize_rows, to_base64
from wde.server.rerank_routes import rerank_body
from wde.server.responses import JSONResponse
from wde.server.service import Service, model_service

router = APIRouter()


def service(request: Request) -> Service:
    """The model a TEI route serves: TEI's bodies name none, so the one `?model=NAME` names, else the server's
    default (its first) model."""
    return model_service(request)


@router.post("/embed", openapi_extra=body_schema(TeiEmbedRequest))
async def embed(request: Request) -> JSONResponse:
    return await _embed(request, await read_json(request))


async def _embed(request: Request, raw: Any) -> JSONResponse:
    vectors, headers = await embed_rows(request, raw)
    return JSONResponse(vectors, headers=headers)


async def embed_rows(request: Request, raw: Any) -> tuple[list[Any], dict[str, str]]:
    """/embed's answer for a parsed JSON body, before it is written (shared with gRPC's Embed): one vector (or
    its base64) per input, and TEI's timing headers."""
    svc = service(request)
    body = parse(TeiEmbedRequest, raw)
    svc.require("dense", "/embed")
    params = PoolingParams(**svc.long_inputs(body.truncate or None), truncation_direction=body.truncation_direction,
                           normalize=body.normalize, prompt_name=body.prompt_name, dimensions=body.dimensions,
                           outputs=("dense",), options=body.options)
    result = await svc.run(request, embed_items(body.inputs), params, "inputs", item_names("inputs", body.inputs))
    vectors = quantize_rows(result.dense, body.embed_dtype, svc.config.quantization_ranges, "embed_dtype")
    if body.encoding_format == "base64":
        return [to_base64(v) for v in vectors], result.headers
    return vectors, result.headers


@router.post("/embed_all", openapi_extra=body_schema(TeiEmbedAllRequest))
async def embed_all(request: Request) -> JSONResponse:
    return await _embed_all(request, await read_json(request))


async def _embed_all(request: Request, raw: Any) -> JSONResponse:
    states, headers = await token_states(request, raw)
    return JSONResponse(states, headers=headers)


async def token_states(request: Request, raw: Any) -> tuple[list[np.ndarray], dict[str, str]]:
    """Every token's final hidden state (special tokens included), unnormalized: one (tokens, dim) array per input
    (/embed_all writes [[[float]]]; gRPC's EmbedAll shares it), and TEI's timing headers."""
    svc = service(request)
    body = parse(TeiEmbedAllRequest, raw)
    # per-token states where the workflow gives them; a late-interaction model's token vectors where they are all
    # it makes (bge-m3's ColBERT vectors ride beside its dense output, on /pooling, not here)
    output = "token_embeddings" if "token_embeddings" in svc.supported else \
        "colbert" if svc.produces == ("colbert",) else None
    if output is None:
        raise ApiError("unsupported", f"/embed_all needs per-token states (output 'token_embeddings'), which"
                       " embedders built on the `sentence` pooler (or `decoder_features`) give on request, or a"
                       f" late-interaction model's token vectors ('colbert'), but workflow {svc.info.workflow!r}"
                       f" produces {list(svc.produces)}")
    # raw hidden states for an embedder, as TEI; a late-interaction model's vectors as the model makes them
    params = PoolingParams(truncate=bool(body.truncate), truncation_direction=body.truncation_direction,
                           normalize=False if output == "token_embeddings" else None, prompt_name=body.prompt_name,
                           outputs=(output,), options=body.options)
    result = await svc.run(request, embed_items(body.inputs), params, "inputs", item_names("inputs", body.inputs))
    return ([np.ascontiguousarray(o.outputs[output], dtype=np.float32) for o in result.outputs], result.headers)


@router.post("/similarity", openapi_extra=body_schema(TeiSimilarityRequest))
async def similarity(request: Request) -> JSONResponse:
    return await _similarity(request, await read_json(request))


async def _similarity(request: Request, raw: Any) -> JSONResponse:
    """`inputs.source_sentence` scored against each of `inputs.sentences`, in their order, by the workflow's
    scorer where it compares embeddings: the cosine similarity of an embedder's vectors, the MaxSim of a
    multi-vector model's (the source sentence as the query)."""
    svc = service(request)
    body = parse(TeiSimilarityRequest, raw)
    scorer = svc.info.scorer
    if scorer.output is None or scorer.pairs:
        raise ApiError("unsupported", "/similarity needs an embedding model (output 'dense') or a multi-vector one,"
                       f" but workflow {svc.info.workflow!r} produces {list(svc.produces)} and scores with"
                       f" {scorer.scoring!r}")
    sentences = body.inputs.sentences
    if not sentences:
        raise ApiError("empty", "inputs.sentences is empty: send at least one sentence", "inputs.sentences")
    given = body.parameters  # where TEI reads them; each wins over the same name at the top level
    truncate = given.truncate if given and given.truncate is not None else body.truncate
    direction = given.truncation_direction if given and given.truncation_direction else body.truncation_direction
    prompt_name = given.prompt_name if given and given.prompt_name is not None else body.prompt_name
    params = PoolingParams(truncate=bool(truncate), truncation_direction=direction, prompt_name=prompt_name)
    names = [("inputs.source_sentence", f"inputs.sentences[{i}]") for i in range(len(sentences))]
    scores, result = await svc.score(request, [(body.inputs.source_sentence, s) for s in sentences], params,
                                     "inputs", names)
    return JSONResponse(scores.tolist(), headers=result.headers)


@router.post("/decode", openapi_extra=body_schema(TeiDecodeRequest))
async def decode(request: Request) -> JSONResponse:
    """Token ids back to text: one text per id list (a single list gives a one-element answer)."""
    return JSONResponse(await decoded(service(request), await read_json(request)))


async def decoded(svc: Service, raw: Any) -> list[str]:
    """/decode's answer for a parsed JSON body (shared with gRPC's Decode)."""
    body = parse(TeiDecodeRequest, raw)
    single = not body.ids or isinstance(body.ids[0], int)
    rows: list[list[int]] = [body.ids] if single else body.ids  # type: ignore[list-item]
    if not rows or any(not row for row in rows):
        where = "ids" if single else f"ids[{next(i for i, row in enumerate(rows) if not row)}]"
        raise ApiError("empty", f"{where} is empty: send at least one token id", where)
    if len(rows) > svc.config.max_client_batch_size:
        raise ApiError("validation", f"batch size {len(rows)} > maximum allowed batch size"
                       f" {svc.config.max_client_batch_size}", "ids")
    names = ["ids"] if single else [f"ids[{i}]" for i in range(len(rows))]
    return await svc.decode(rows, body.skip_special_tokens, names)


@router.post("/embed_sparse", openapi_extra=body_schema(TeiSparseRequest))
async def embed_sparse(request: Request) -> JSONResponse:
    return await _embed_sparse(request, await read_json(request))


async def _embed_sparse(request: Request, raw: Any) -> JSONResponse:
    sparse, headers = await sparse_rows(request, raw)
    return JSONResponse(sparse, headers=headers)


async def sparse_rows(request: Request, raw: Any) -> tuple[list[list[dict]], dict[str, str]]:
    """TEI's sparse answer: per input, `[{index, value}]` sorted by token id (shared with gRPC's EmbedSparse), and
    TEI's timing headers."""
    svc = service(request)
    body = parse(TeiSparseRequest, raw)
    svc.require("sparse", "/embed_sparse")
    params = PoolingParams(truncate=bool(body.truncate), truncation_direction=body.truncation_direction,
                           prompt_name=body.prompt_name, outputs=("sparse",))
    result = await svc.run(request, embed_items(body.inputs), params, "inputs", item_names("inputs", body.inputs))
    try:
        sparse = [[{"index": int(k), "value": float(v)} for k, v in sorted(o.outputs["sparse"].items())]
                  for o in result.outputs]
    except ValueError:
        raise ApiError("unsupported", "/embed_sparse needs sparse weights keyed by token id; this workflow keys"
                       " them by token text (set output_processor.params.sparse_keys=ids)") from None
    return sparse, result.headers


def _predict_inputs(inputs: str | list[str] | list[list[str]]) -> tuple[list[Any], list[Any], bool]:
    """TEI's reading: a string or a flat list of one or two strings is one input; a list of lists is a batch.

    Returns the inputs, their names for errors (`inputs`, `inputs[i]`, a pair's sides `...[0]` / `...[1]`) and
    whether it was a single input.
    """
    def one(seq: list[str], name: str) -> tuple[Any, Any]:
        if len(seq) not in (1, 2):
            raise ApiError("validation", f"{name}: a sequence is a single string or a pair of strings, got {len(seq)}"
                           " strings", name)
        if len(seq) == 1:
            return seq[0], f"{name}[0]"
        return (seq[0], seq[1]), (f"{name}[0]", f"{name}[1]")

    if isinstance(inputs, str):
        return [inputs], ["inputs"], True
    if inputs and isinstance(inputs[0], str):
        item, name = one(inputs, "inputs")  # type: ignore[arg-type]
        return [item], [name], True
    items = [one(seq, f"inputs[{i}]") for i, seq in enumerate(inputs)]  # type: ignore[arg-type]
    return [x for x, _ in items], [n for _, n in items], False


@router.post("/predict", openapi_extra=body_schema(TeiPredictRequest))
async def predict(request: Request) -> JSONResponse:
    return await _predict(request, await read_json(request))


_FUNCTIONS = {
    "sigmoid": lambda x: 1.0 / (1.0 + np.exp(-x)),
    "softmax": lambda x: np.exp(x - x.max()) / np.exp(x - x.max()).sum(),
    "none": lambda x: x,
}
"""The Hugging Face Inference API's `function_to_apply`, on one input's logits."""


async def _predict(request: Request, raw: Any) -> JSONResponse:
    content, headers = await predictions(request, raw)
    return JSONResponse(content, headers=headers)


async def predictions(request: Request, raw: Any) -> tuple[list[Any], dict[str, str]]:
    """/predict's answer (shared with gRPC's Predict) and TEI's timing headers. Classifiers answer every label,
    best first; cross-encoders their single score.

    `raw_scores` gives logits. The Hugging Face Inference API's `parameters` (what huggingface_hub's
    `InferenceClient.text_classification` sends) are honoured: `function_to_apply` (sigmoid, softmax or none,
    applied to the logits instead of the workflow's activation) and `top_k` (the best k labels); with them a single
    input answers that API's shape, a list holding its one list of predictions.
    """
    svc = service(request)
    body = parse(TeiPredictRequest, raw)
    output = "probs" if "probs" in svc.supported else "score"
    svc.require(output, "/predict")
    items, names, single = _predict_inputs(body.inputs)
    hf = body.parameters
    function = _FUNCTIONS[hf.function_to_apply] if hf is not None and hf.function_to_apply else None
    raw_logits = body.raw_scores or function is not None
    params = PoolingParams(truncate=bool(body.truncate), truncation_direction=body.truncation_direction,
                           activation=False if raw_logits else None, outputs=(output,))
    result = await svc.run(request, items, params, "inputs", names)
    labels = svc.labels()
    answers = []
    for o in result.outputs:
        values = np.asarray(o.outputs[output], dtype=np.float64).reshape(-1)
        if function is not None:
            values = function(values)
        preds = [{"score": float(s), "label": labels[i] if i < len(labels) else f"LABEL_{i}"}
                 for i, s in enumerate(values.tolist())]
        preds.sort(key=lambda p: -p["score"])
        answers.append(preds[:hf.top_k] if hf is not None and hf.top_k else preds)
    if single and hf is None:
        return answers[0], result.headers
    return answers, result.headers


@router.post("/vertex", openapi_extra=body_schema(VertexRequest))
async def vertex_route(request: Request) -> Response:
    """TEI's Vertex AI route: `{"instances": [TEI bodies]}` to `{"predictions": [their answers]}` (vertex.py)."""
    svc = service(request)
    return await vertex.predictions(request, await read_json(request), lambda instance: _vertex_task(svc, instance),
                                    svc.check_batch_size)


def _vertex_task(svc: Service, instance: dict[str, Any]) -> Any:
    """The handler TEI's vertex route sends an instance to: /rerank for a rerank body, else the model's task."""
    outputs = svc.produces
    if vertex.is_rerank(instance):
        return lambda request, raw: rerank_body(request, raw, tei=True)
    if "probs" in outputs or "score" in outputs:
        return _predict
    if "dense" not in outputs and "sparse" in outputs:
        return _embed_sparse
    return _embed


TOKENIZE_MAX_TOKENS = 65_536
"""Tokens one /tokenize request may answer, all its texts together (at least one input of the model's max length).
Each token is an object of ~80-140 bytes of JSON, so a 1 MB text (~250,000 tokens) would answer ~34 MB: the answer
is bounded at ~9 MB instead, and a larger request is refused (422 naming `inputs` and the limit) before any of it
is built."""


class _TooManyTokens(Exception):
    def __init__(self, count: int) -> None:
        self.count = count


@router.post("/tokenize", openapi_extra=body_schema(TeiTokenizeRequest, VllmTokenizeRequest))
async def tokenize(request: Request) -> JSONResponse:
    """Each text's tokens with their character offsets; at most `TOKENIZE_MAX_TOKENS` tokens per request.

    vLLM's body (`prompt`) on the same path gets vLLM's answer (wde/server/vllm_tokenize.py)."""
    raw = await read_json(request)
    if vllm_tokenize.is_vllm_body(raw):
        return await vllm_tokenize.tokenize(request, raw, TOKENIZE_MAX_TOKENS)
    return JSONResponse(await tei_tokens(service(request), raw))


async def tei_tokens(svc: Service, raw: Any) -> list[list[dict]]:
    """TEI /tokenize's answer for a parsed JSON body (shared with gRPC's Tokenize): each text's tokens."""
    body = parse(TeiTokenizeRequest, raw)
    texts = [body.inputs] if isinstance(body.inputs, str) else body.inputs
    if not texts:
        raise ApiError("empty", "inputs is empty: send at least one text", "inputs")
    if len(texts) > svc.config.max_client_batch_size:
        raise ApiError("validation", f"batch size {len(texts)} > maximum allowed batch size"
                       f" {svc.config.max_client_batch_size}", "inputs")
    component = svc.hf_tokenizer()
    svc.check_texts(texts, item_names("inputs", body.inputs))
    prompts = svc.prompts
    if body.prompt_name is not None and body.prompt_name not in prompts:
        raise ApiError("validation", f"prompt_name {body.prompt_name!r} is not defined; defined prompts:"
                       f" {sorted(prompts) or 'none'}", "prompt_name")
    prefix = prompts[body.prompt_name] if body.prompt_name else ""
    limit = max(TOKENIZE_MAX_TOKENS, svc.info.max_length)
    try:
        tokens = await svc.off_loop(_tokens, component, [prefix + t for t in texts], body.add_special_tokens, limit)
    except _TooManyTokens as e:
        raise ApiError("validation", f"inputs: /tokenize answers at most {limit:,} tokens per request and these"
                       f" texts have {e.count:,}; send fewer or shorter texts", "inputs") from None
    return tokens


@router.post("/detokenize", openapi_extra=body_schema(VllmDetokenizeRequest))
async def detokenize(request: Request) -> JSONResponse:
    """vLLM's /detokenize (TEI's is /decode)."""
    return await vllm_tokenize.detokenize(request, await read_json(request))


def _tokens(component: Any, texts: list[str], add_special_tokens: bool, limit: int) -> list[list[dict]]:
    tokenizer = component.hf_tokenizer  # this thread's own copy
    enc = tokenizer(texts, add_special_tokens=add_special_tokens, return_offsets_mapping=True,
                    return_attention_mask=False, return_token_type_ids=False)
    count = sum(len(ids) for ids in enc["input_ids"])
    if count > limit:
        raise _TooManyTokens(count)
    special = set(tokenizer.all_special_ids)
    out = []
    for text, ids, offsets in zip(texts, enc["input_ids"], enc["offset_mapping"]):
        pieces = tokenizer.convert_ids_to_tokens(ids)
        row = []
        for tid, piece, (start, stop) in zip(ids, pieces, offsets):
            is_special = tid in special
            row.append({"id": tid, "text": piece if is_special else text[start:stop], "special": is_special,
                        "start": None if is_special else start, "stop": None if is_special else stop})
        out.append(row)
    return out


def _model_type(svc: Service) -> dict:
    supported = svc.supported
    if "probs" in supported or "score" in supported:
        labels = svc.labels() or ["LABEL_0"]
        classes = {"id2label": {str(i): name for i, name in enumerate(labels)},
                   "label2id": {name: i for i, name in enumerate(labels)}}
        return {"classifier" if "probs" in supported else "reranker": classes}
    return {"embedding": {"pooling": svc.info.pooling}}


@router.get("/info")
async def info(request: Request) -> JSONResponse:
    """TEI's /info of the default model (or the one `?model=` names); a server of several models lists each
    one's under `models` (an extension)."""
    content = info_content(service(request))
    services = request.app.state.models.services
    if len(services) > 1:
        content["models"] = [info_content(svc) for svc in services]
    return JSONResponse(content)


def info_content(svc: Service) -> dict[str, Any]:
    """/info's answer (shared with gRPC's Info)."""
    info = svc.info
    return {
        "model_id": svc.model_name,
        "model_sha": None,
        "model_dtype": info.dtype,
        "served_model_name": svc.model_name,
        "model_type": _model_type(svc),
        "max_concurrent_requests": svc.config.max_concurrent_requests,
        "max_input_length": info.max_length,
        "max_batch_tokens": info.token_budget,
        "max_batch_requests": info.max_num_requests,
        "max_client_batch_size": svc.config.max_client_batch_size,
        "auto_truncate": svc.config.long_inputs == "truncate",
        "tokenization_workers": 1,
        "version": wde.__version__,
        "sha": None,
        "docker_label": None,
        "workflow": info.workflow,
        "outputs": list(info.outputs),
        "options": {name: list(values) for name, values in info.options.items()},
    }


@router.get("/health")
@router.get("/ping")  # SageMaker's
@router.get("/")  # TEI's "Inference API health route"
async def health(request: Request) -> JSONResponse:
    """200 with Infinity's `{"unix": time}` (TEI's clients read only the status) while the engine runs and steps;
    503 once it stopped, or has not finished a step for longer than --stall-timeout (`Service.liveness`): every
    served model's engine (`ServedModels.liveness`)."""
    problem = request.app.state.models.liveness()
    if problem is not None:
        return error_response(ApiError("unhealthy", problem), "tei")
    return JSONResponse({"unix": time.time()})


@router.post("/", openapi_extra=body_schema(TeiEmbedRequest, TeiSimilarityRequest, TeiPredictRequest,
                                            TeiRerankRequest, TeiSparseRequest))
@router.post("/invocations", openapi_extra=body_schema(TeiEmbedRequest, TeiSimilarityRequest, TeiPredictRequest,
                                                       TeiRerankRequest, TeiSparseRequest))
async def root(request: Request) -> JSONResponse:
    """TEI's root route (and SageMaker's /invocations): the served model's own task, chosen as TEI's router
    does. A classifier predicts; a reranker reranks (a `/predict` body, `inputs`, is predicted); an embedder
    embeds, or answers /similarity for a sentence-similarity body; a workflow producing only sparse weights or
    only token states answers /embed_sparse or /embed_all."""
    svc = service(request)
    raw = await read_json(request)
    outputs = svc.produces
    inputs = raw.get("inputs") if isinstance(raw, dict) else None
    if "probs" in outputs:
        return await _predict(request, raw)
    if "score" in outputs:
        if isinstance(raw, dict) and "inputs" in raw and "query" not in raw:
            return await _predict(request, raw)
        return await rerank_body(request, raw, tei=True)
    if "dense" in outputs:
        if isinstance(inputs, dict) and "source_sentence" in inputs:
            return await _similarity(request, raw)
        return await _embed(request, raw)
    if "sparse" in outputs:
        return await _embed_sparse(request, raw)
    if "token_embeddings" in outputs:
        return await _embed_all(request, raw)
    raise ApiError("unsupported", f"POST {request.url.path} serves embedders, rerankers and classifiers, but"
                   f" workflow {svc.info.workflow!r} produces {list(outputs)}")
