"""The five services of TEI's `tei.proto` (Info, Embed, Predict, Rerank, Tokenize), every method answered by the
function the HTTP TEI route uses for the same body (wde/server/tei_routes.py; /rerank's handler for Rerank), so a
gRPC call gives exactly the HTTP answer: the same vectors, scores, tokens, refusals and limits.

A method the served model cannot answer (Rerank on an embedder, Embed on a classifier) is refused as its HTTP
route refuses it, which TEI's gRPC server answers FAILED_PRECONDITION; bad input is INVALID_ARGUMENT, overload
RESOURCE_EXHAUSTED (calls.py). Streams are served in order, several requests at once (streams.py); their
requests, and Rerank's, wait out an overload as TEI's do (`_admitted`).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

import grpc
import orjson

from wde.server import tei_routes
from wde.server.errors import ApiError
from wde.server.grpc import tei_pb2, tei_pb2_grpc
from wde.server.grpc.calls import answer, body_of, metadata, refuse, route_request
from wde.server.grpc.streams import STREAM_WINDOW, in_order
from wde.server.rerank_routes import rerank_body
from wde.server.service import Service

MODEL_TYPES = {"embedding": tei_pb2.MODEL_TYPE_EMBEDDING, "classifier": tei_pb2.MODEL_TYPE_CLASSIFIER,
               "reranker": tei_pb2.MODEL_TYPE_RERANKER}

Headers = dict[str, str]
T = TypeVar("T")

OVERLOAD_POLL_MIN_S = 0.005
OVERLOAD_POLL_MAX_S = 0.1
"""How often a stream's request waiting for an overloaded server tries again: at once at first (most overloads
are a burst that drains within a step), then at most ten times a second."""


class TeiServicer(tei_pb2_grpc.InfoServicer, tei_pb2_grpc.EmbedServicer, tei_pb2_grpc.PredictServicer,
                  tei_pb2_grpc.RerankServicer, tei_pb2_grpc.TokenizeServicer):
    """Every method of TEI's five services, for the app whose `Service` (engine, limits) they share with HTTP."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.service: Service = app.state.service
        self.window = min(STREAM_WINDOW, self.service.config.max_concurrent_requests)

    # --- how each request is served (the unary call and each request of a stream alike)

    async def _embed(self, message: tei_pb2.EmbedRequest) -> tuple[tei_pb2.EmbedResponse, Headers]:
        (vector,), headers = await tei_routes.embed_rows(route_request(self.app, "/embed"), body_of(message))
        return tei_pb2.EmbedResponse(embeddings=vector.tolist(), metadata=metadata(headers)), headers

    async def _embed_sparse(self, message: tei_pb2.EmbedSparseRequest
                            ) -> tuple[tei_pb2.EmbedSparseResponse, Headers]:
        (weights,), headers = await tei_routes.sparse_rows(route_request(self.app, "/embed_sparse"),
                                                           body_of(message))
        values = [tei_pb2.SparseValue(index=w["index"], value=w["value"]) for w in weights]
        return tei_pb2.EmbedSparseResponse(sparse_embeddings=values, metadata=metadata(headers)), headers

    async def _embed_all(self, message: tei_pb2.EmbedAllRequest) -> tuple[tei_pb2.EmbedAllResponse, Headers]:
        (states,), headers = await tei_routes.token_states(route_request(self.app, "/embed_all"), body_of(message))
        tokens = [tei_pb2.TokenEmbedding(embeddings=row) for row in states.tolist()]
        return tei_pb2.EmbedAllResponse(token_embeddings=tokens, metadata=metadata(headers)), headers

    async def _predict(self, message: tei_pb2.PredictRequest | tei_pb2.PredictPairRequest
                       ) -> tuple[tei_pb2.PredictResponse, Headers]:
        """Predict's `inputs` is one text, PredictPair's one or two texts: /predict's single input either way."""
        content, headers = await tei_routes.predictions(route_request(self.app, "/predict"), body_of(message))
        predictions = [tei_pb2.Prediction(score=p["score"], label=p["label"]) for p in content]
        return tei_pb2.PredictResponse(predictions=predictions, metadata=metadata(headers)), headers

    async def _rerank(self, body: dict[str, Any]) -> tuple[list[dict], Headers]:
        """/rerank's TEI answer for a TEI body, read back from the JSON it writes (its scores are Python floats,
        which JSON carries exactly), and its timing headers (not its content-type and length)."""
        response = await rerank_body(route_request(self.app, "/rerank"), body, tei=True)
        timing = {name: value for name, value in response.headers.items() if name.startswith("x-")}
        return orjson.loads(response.body), timing

    async def _tokenize(self, message: tei_pb2.EncodeRequest) -> tuple[tei_pb2.EncodeResponse, None]:
        (tokens,) = await tei_routes.tei_tokens(self.service, body_of(message))
        return tei_pb2.EncodeResponse(tokens=[tei_pb2.SimpleToken(**{k: v for k, v in t.items() if v is not None})
                                              for t in tokens]), None

    async def _decode(self, message: tei_pb2.DecodeRequest) -> tuple[tei_pb2.DecodeResponse, None]:
        (text,) = await tei_routes.decoded(self.service, body_of(message))
        return tei_pb2.DecodeResponse(text=text), None

    async def _stream(self, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext,
                      serve: Callable[[Any], Awaitable[tuple[Any, Headers | None]]]) -> AsyncIterator[Any]:
        async def response(message: Any) -> Any:
            return (await self._admitted(serve, message))[0]

        try:
            async for item in in_order(requests, response, self.window):
                yield item
        except Exception as e:  # noqa: BLE001 - every failure becomes a status (refuse logs the unexpected ones)
            await refuse(context, e)

    async def _admitted(self, serve: Callable[[Any], Awaitable[T]], message: Any) -> T:
        """`serve(message)`, waiting while the server is overloaded, where TEI waits for a permit (the requests of
        a stream, and Rerank's) rather than refusing at once (its other unary calls): tried again after 5 ms, then
        twice as long each time up to `OVERLOAD_POLL_MAX_S`, until `--request-timeout` (0: no limit) has passed
        since it came, when the overload is its answer (RESOURCE_EXHAUSTED). An overloaded request was refused at
        admission, before any of it was queued, so trying it again repeats nothing."""
        timeout = self.service.config.request_timeout
        deadline = time.monotonic() + timeout if timeout else None
        delay = OVERLOAD_POLL_MIN_S
        while True:
            try:
                return await serve(message)
            except ApiError as e:
                if e.kind != "overloaded" or deadline is not None and time.monotonic() + delay > deadline:
                    raise
            await asyncio.sleep(delay)
            delay = min(2 * delay, OVERLOAD_POLL_MAX_S)

    # --- Info

    async def Info(self, request: tei_pb2.InfoRequest, context: grpc.aio.ServicerContext) -> tei_pb2.InfoResponse:
        info = tei_routes.info_content(self.service)
        (kind,) = info["model_type"]
        optional = {name: info[name] for name in ("sha", "docker_label", "model_sha", "max_batch_requests")
                    if info[name] is not None}
        return tei_pb2.InfoResponse(version=info["version"], model_id=info["model_id"],
                                    model_dtype=info["model_dtype"], model_type=MODEL_TYPES[kind],
                                    max_concurrent_requests=info["max_concurrent_requests"],
                                    max_input_length=info["max_input_length"],
                                    max_batch_tokens=info["max_batch_tokens"],
                                    max_client_batch_size=info["max_client_batch_size"],
                                    tokenization_workers=info["tokenization_workers"], **optional)

    # --- Embed

    async def Embed(self, request: tei_pb2.EmbedRequest, context: grpc.aio.ServicerContext) -> tei_pb2.EmbedResponse:
        return await answer(context, self._embed(request))

    async def EmbedStream(self, request_iterator: AsyncIterator[tei_pb2.EmbedRequest],
                          context: grpc.aio.ServicerContext) -> AsyncIterator[tei_pb2.EmbedResponse]:
        async for response in self._stream(request_iterator, context, self._embed):
            yield response

    async def EmbedSparse(self, request: tei_pb2.EmbedSparseRequest,
                          context: grpc.aio.ServicerContext) -> tei_pb2.EmbedSparseResponse:
        return await answer(context, self._embed_sparse(request))

    async def EmbedSparseStream(self, request_iterator: AsyncIterator[tei_pb2.EmbedSparseRequest],
                                context: grpc.aio.ServicerContext) -> AsyncIterator[tei_pb2.EmbedSparseResponse]:
        async for response in self._stream(request_iterator, context, self._embed_sparse):
            yield response

    async def EmbedAll(self, request: tei_pb2.EmbedAllRequest,
                       context: grpc.aio.ServicerContext) -> tei_pb2.EmbedAllResponse:
        return await answer(context, self._embed_all(request))

    async def EmbedAllStream(self, request_iterator: AsyncIterator[tei_pb2.EmbedAllRequest],
                             context: grpc.aio.ServicerContext) -> AsyncIterator[tei_pb2.EmbedAllResponse]:
        async for response in self._stream(request_iterator, context, self._embed_all):
            yield response

    # --- Predict

    async def Predict(self, request: tei_pb2.PredictRequest,
                      context: grpc.aio.ServicerContext) -> tei_pb2.PredictResponse:
        return await answer(context, self._predict(request))

    async def PredictPair(self, request: tei_pb2.PredictPairRequest,
                          context: grpc.aio.ServicerContext) -> tei_pb2.PredictResponse:
        return await answer(context, self._predict(request))

    async def PredictStream(self, request_iterator: AsyncIterator[tei_pb2.PredictRequest],
                            context: grpc.aio.ServicerContext) -> AsyncIterator[tei_pb2.PredictResponse]:
        async for response in self._stream(request_iterator, context, self._predict):
            yield response

    async def PredictPairStream(self, request_iterator: AsyncIterator[tei_pb2.PredictPairRequest],
                                context: grpc.aio.ServicerContext) -> AsyncIterator[tei_pb2.PredictResponse]:
        async for response in self._stream(request_iterator, context, self._predict):
            yield response

    # --- Rerank

    async def Rerank(self, request: tei_pb2.RerankRequest,
                     context: grpc.aio.ServicerContext) -> tei_pb2.RerankResponse:
        async def ranked() -> tuple[tei_pb2.RerankResponse, Headers]:
            ranks, headers = await self._admitted(self._rerank, body_of(request))
            return tei_pb2.RerankResponse(ranks=[tei_pb2.Rank(**r) for r in ranks], metadata=metadata(headers)), headers

        return await answer(context, ranked())

    async def RerankStream(self, request_iterator: AsyncIterator[tei_pb2.RerankStreamRequest],
                           context: grpc.aio.ServicerContext) -> tei_pb2.RerankResponse:
        return await answer(context, self._rerank_stream(request_iterator))

    async def _rerank_stream(self, requests: AsyncIterator[tei_pb2.RerankStreamRequest]
                             ) -> tuple[tei_pb2.RerankResponse, Headers]:
        """One ranking of every (query, text) the stream sent, `index` counting them in order. As on TEI,
        `raw_scores` and `return_text` are the first request's; the stream may send at most
        --max-client-batch-size requests. Requests sharing a query and truncation go to /rerank's handler as one
        body (they are usually all of them), the groups at once."""
        start = time.perf_counter()
        groups: dict[tuple, tuple[dict[str, Any], list[int]]] = {}
        count = 0
        first: dict[str, Any] | None = None
        async for message in requests:
            count += 1
            self.service.check_batch_size(count, "the stream", "requests")
            body = body_of(message)
            first = first or body
            key = (body["query"], body["truncate"], body["truncation_direction"])
            group = groups.setdefault(key, ({"query": body["query"], "texts": [], "truncate": body["truncate"],
                                             "truncation_direction": body["truncation_direction"],
                                             "raw_scores": first["raw_scores"],
                                             "return_text": first["return_text"]}, []))
            group[0]["texts"].append(body["text"])
            group[1].append(count - 1)
        if first is None:
            raise ApiError("empty", "the RerankStream sent no request: send at least one (query, text)", "text")
        answers = await asyncio.gather(*(self._admitted(self._rerank, body) for body, _ in groups.values()))
        ranks = [{**rank, "index": indexes[rank["index"]]}
                 for (_, indexes), (group_ranks, _) in zip(groups.values(), answers) for rank in group_ranks]
        ranks.sort(key=lambda r: (-r["score"], r["index"]))
        headers = _merged([h for _, h in answers], time.perf_counter() - start)
        return tei_pb2.RerankResponse(ranks=[tei_pb2.Rank(**r) for r in ranks], metadata=metadata(headers)), headers

    # --- Tokenize

    async def Tokenize(self, request: tei_pb2.EncodeRequest,
                       context: grpc.aio.ServicerContext) -> tei_pb2.EncodeResponse:
        return await answer(context, self._tokenize(request))

    async def TokenizeStream(self, request_iterator: AsyncIterator[tei_pb2.EncodeRequest],
                             context: grpc.aio.ServicerContext) -> AsyncIterator[tei_pb2.EncodeResponse]:
        async for response in self._stream(request_iterator, context, self._tokenize):
            yield response

    async def Decode(self, request: tei_pb2.DecodeRequest,
                     context: grpc.aio.ServicerContext) -> tei_pb2.DecodeResponse:
        return await answer(context, self._decode(request))

    async def DecodeStream(self, request_iterator: AsyncIterator[tei_pb2.DecodeRequest],
                           context: grpc.aio.ServicerContext) -> AsyncIterator[tei_pb2.DecodeResponse]:
        async for response in self._stream(request_iterator, context, self._decode):
            yield response


def _merged(headers: list[Headers], seconds: float) -> Headers:
    """TEI's timing headers of several /rerank answers run at once, as one: characters and tokens add up, the total
    time is the whole call's, the other times are the longest group's."""
    merged = {name: str(max(int(h[name]) for h in headers))
              for name in ("x-tokenization-time", "x-queue-time", "x-inference-time")}
    for name in ("x-compute-characters", "x-compute-tokens"):
        merged[name] = str(sum(int(h[name]) for h in headers))
    merged["x-total-time"] = str(int(seconds * 1000))
    return merged
