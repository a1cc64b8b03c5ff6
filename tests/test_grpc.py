"""`wde serve --grpc-port`: TEI's gRPC API (tei.proto), driven with a client generated from the same proto.

Every method must answer what the HTTP TEI route answers for the same input (the same float32 vectors and scores,
the same tokens), refuse bad input with the gRPC status TEI's gRPC server uses, and share the HTTP server's auth and
limits; the server keeps serving after every refusal. No test depends on wall-clock speed.
"""

from __future__ import annotations

import filecmp
import queue
import re
import socket
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import numpy as np
import pytest

grpc = pytest.importorskip("grpc")

from tests import tiny_heads  # noqa: E402
from tests.test_server import REPO, free_port, serve, serve_split, stop_server, wait_healthy  # noqa: E402
from wde import Engine  # noqa: E402
from wde.server.grpc import tei_pb2, tei_pb2_grpc  # noqa: E402

TOL = 1e-4
TEXTS = ["A man is eating food.", "The new movie is awesome", "Berlin has 3.5 million people.", "hello"]
BATCH_LIMIT = 16
LABELS = {0: "neg", 1: "neu", 2: "pos"}


class Client:
    """Stubs of TEI's five services on one channel, and the HTTP base URL of the same server."""

    def __init__(self, url: str, port: int, api_key: str | None = None) -> None:
        self.url = url
        self.port = port
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
        self.info = tei_pb2_grpc.InfoStub(self.channel)
        self.embed = tei_pb2_grpc.EmbedStub(self.channel)
        self.predict = tei_pb2_grpc.PredictStub(self.channel)
        self.rerank = tei_pb2_grpc.RerankStub(self.channel)
        self.tokenize = tei_pb2_grpc.TokenizeStub(self.channel)

    def http(self, path: str, body: Any) -> Any:
        headers = {"Authorization": self.metadata[0][1]} if self.metadata else {}
        r = httpx.post(self.url + path, json=body, headers=headers, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    def close(self) -> None:
        self.channel.close()


@contextmanager
def grpc_server(engine: Engine, **config: Any) -> Iterator[Client]:
    """`serve` (tests/test_server.py) with a gRPC port: the HTTP app's lifespan starts the gRPC server on it."""
    with serve(engine, grpc_port=0, **config) as (url, app):
        client = Client(url, app.state.grpc_port, config.get("api_key"))  # type: ignore[attr-defined]
        try:
            yield client
        finally:
            client.close()


@pytest.fixture(scope="module")
def served(minilm_engine: Engine) -> Iterator[tuple[Client, Any]]:
    with serve(minilm_engine, grpc_port=0, served_model_name="minilm", max_client_batch_size=BATCH_LIMIT) \
            as (url, app):
        client = Client(url, app.state.grpc_port)  # type: ignore[attr-defined]
        yield client, app
        client.close()


@pytest.fixture(scope="module")
def client(served: tuple[Client, Any]) -> Client:
    return served[0]


@pytest.fixture(scope="module")
def reranker(minilm_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Client, Path]]:
    folder = tiny_heads.build_minilm_classifier(minilm_path, tmp_path_factory.mktemp("grpc-ce"), num_labels=1)
    with Engine.from_workflow("cross_encoder", folder) as engine, \
            grpc_server(engine, max_client_batch_size=BATCH_LIMIT) as client:
        yield client, folder


@pytest.fixture(scope="module")
def classifier(minilm_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Client]:
    folder = tiny_heads.build_minilm_classifier(minilm_path, tmp_path_factory.mktemp("grpc-cls"), num_labels=3,
                                                id2label=LABELS, label2id={v: k for k, v in LABELS.items()})
    with Engine.from_workflow(None, folder) as engine, grpc_server(engine) as client:
        yield client


def refused(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """The `grpc.RpcError` a call ends with (the test fails if it succeeds)."""
    with pytest.raises(grpc.RpcError) as caught:
        result = call(*args, **kwargs)
        if hasattr(result, "__iter__") and not isinstance(result, (str, bytes)):
            list(result)  # a response stream fails when read
    return caught.value


def f32(values: Any) -> np.ndarray:
    return np.asarray(values, dtype=np.float32)


# --- the proto and its stubs


def test_stubs_are_the_ones_grpcio_tools_generates(tmp_path: Path) -> None:
    """The committed tei_pb2.py / tei_pb2_grpc.py are exactly what grpcio-tools makes of the committed tei.proto."""
    pytest.importorskip("grpc_tools")
    proto = "wde/server/grpc/tei.proto"
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", str(REPO), f"--python_out={tmp_path}",
                    f"--grpc_python_out={tmp_path}", proto], check=True, cwd=REPO)
    for name in ("tei_pb2.py", "tei_pb2_grpc.py"):
        generated, committed = tmp_path / "wde/server/grpc" / name, REPO / "wde/server/grpc" / name
        assert filecmp.cmp(generated, committed, shallow=False), f"{name} differs from what {proto} generates"


def test_the_proto_is_tei_s_with_its_licence_note() -> None:
    folder = REPO / "wde/server/grpc"
    proto = (folder / "tei.proto").read_text(encoding="utf-8")
    assert proto.startswith('syntax = "proto3";\n\npackage tei.v1;\n')
    services = re.findall(r"^service (\w+)", proto, flags=re.M)
    assert services == ["Info", "Embed", "Predict", "Rerank", "Tokenize"]
    note = (folder / "TEI_PROTO_LICENSE.md").read_text(encoding="utf-8")
    assert "Apache License 2.0" in note and "huggingface/text-embeddings-inference" in note
    assert re.search(r"commit `[0-9a-f]{40}`", note)


# --- every method answers what its HTTP route answers


def test_info_is_http_info(client: Client) -> None:
    info = client.info.Info(tei_pb2.InfoRequest())
    http = httpx.get(client.url + "/info").json()
    assert info.model_type == tei_pb2.MODEL_TYPE_EMBEDDING
    for name in ("version", "model_id", "model_dtype", "max_concurrent_requests", "max_input_length",
                 "max_batch_tokens", "max_batch_requests", "max_client_batch_size", "tokenization_workers"):
        assert getattr(info, name) == http[name], name
    assert not info.HasField("model_sha") and not info.HasField("sha")


def test_embed_is_http_embed_and_sentence_transformers(client: Client, minilm_path: Path) -> None:
    from sentence_transformers import SentenceTransformer

    expected = SentenceTransformer(str(minilm_path), device="cpu").encode(TEXTS)
    for text, reference in zip(TEXTS, expected):
        got = client.embed.Embed(tei_pb2.EmbedRequest(inputs=text))
        vector = f32(got.embeddings)
        assert np.array_equal(vector, f32(client.http("/embed", {"inputs": text})[0]))
        assert np.abs(vector - reference).max() <= TOL
        assert got.metadata.compute_chars == len(text) and got.metadata.compute_tokens > 2
    options = [({"normalize": False}, {"normalize": False}), ({"dimensions": 64}, {"dimensions": 64}),
               ({"truncate": True, "truncation_direction": tei_pb2.TRUNCATION_DIRECTION_LEFT},
                {"truncate": True, "truncation_direction": "left"})]
    long_text = " ".join(TEXTS * 40)
    for grpc_fields, http_fields in options:
        got = client.embed.Embed(tei_pb2.EmbedRequest(inputs=long_text if "truncate" in grpc_fields else TEXTS[0],
                                                      **grpc_fields))
        http = client.http("/embed", {"inputs": long_text if "truncate" in http_fields else TEXTS[0], **http_fields})
        assert np.array_equal(f32(got.embeddings), f32(http[0])), grpc_fields


def test_embed_all_is_http_embed_all(client: Client) -> None:
    got = client.embed.EmbedAll(tei_pb2.EmbedAllRequest(inputs=TEXTS[0]))
    http = f32(client.http("/embed_all", {"inputs": TEXTS[0]})[0])
    assert np.array_equal(f32([t.embeddings for t in got.token_embeddings]), http)


def test_tokenize_and_decode_are_http_s(client: Client) -> None:
    for special in (True, False):
        got = client.tokenize.Tokenize(tei_pb2.EncodeRequest(inputs=TEXTS[2], add_special_tokens=special))
        http = client.http("/tokenize", {"inputs": TEXTS[2], "add_special_tokens": special})[0]
        assert [{"id": t.id, "text": t.text, "special": t.special,
                 "start": t.start if t.HasField("start") else None, "stop": t.stop if t.HasField("stop") else None}
                for t in got.tokens] == http
    ids = [t.id for t in client.tokenize.Tokenize(tei_pb2.EncodeRequest(inputs=TEXTS[1], add_special_tokens=True)).tokens]
    for skip in (True, False):
        got = client.tokenize.Decode(tei_pb2.DecodeRequest(ids=ids, skip_special_tokens=skip))
        assert got.text == client.http("/decode", {"ids": ids, "skip_special_tokens": skip})[0]
    streamed = client.tokenize.DecodeStream(iter([tei_pb2.DecodeRequest(ids=ids, skip_special_tokens=True)] * 3))
    assert [d.text for d in streamed] == [client.http("/decode", {"ids": ids})[0]] * 3
    streamed = client.tokenize.TokenizeStream(iter(tei_pb2.EncodeRequest(inputs=t) for t in TEXTS))
    assert [[t.id for t in e.tokens] for e in streamed] == \
        [[t["id"] for t in client.http("/tokenize", {"inputs": t, "add_special_tokens": False})[0]] for t in TEXTS]


def test_embed_stream_of_1000_loses_none_and_keeps_order(client: Client) -> None:
    texts = [f"sentence number {i}: {TEXTS[i % len(TEXTS)]}" for i in range(1000)]
    expected = np.concatenate([f32(client.http("/embed", {"inputs": texts[i:i + BATCH_LIMIT]}))
                               for i in range(0, len(texts), BATCH_LIMIT)])
    got = f32([r.embeddings for r in client.embed.EmbedStream(iter(tei_pb2.EmbedRequest(inputs=t) for t in texts))])
    assert got.shape == expected.shape == (1000, 384)
    assert np.abs(got - expected).max() <= 1e-5  # each answer is its own text's (batches may differ in order)
    assert (np.argmax(got @ expected.T, axis=1) == np.arange(1000)).all()


def test_a_stream_serves_a_client_that_waits_for_each_answer(client: Client) -> None:
    """Requests are read while answers are awaited: a client sending its next request only after reading the
    previous answer is served (a server reading a window of requests before answering would wait for it forever)."""
    answered: queue.Queue[None] = queue.Queue()

    def requests() -> Iterator[Any]:
        for text in TEXTS:
            yield tei_pb2.EmbedRequest(inputs=text)
            answered.get(timeout=300)  # only a deadlock waits this long

    got = []
    for response in client.embed.EmbedStream(requests()):
        got.append(f32(response.embeddings))
        answered.put(None)
    assert np.abs(np.stack(got) - f32(client.http("/embed", {"inputs": TEXTS}))).max() <= 1e-5


def test_a_stream_ends_at_its_first_bad_request_after_the_answers_before_it(client: Client) -> None:
    requests = [tei_pb2.EmbedRequest(inputs=t) for t in TEXTS[:2]] + [tei_pb2.EmbedRequest(inputs="")]
    answers = []
    with pytest.raises(grpc.RpcError) as caught:
        for answer in client.embed.EmbedStream(iter(requests)):
            answers.append(answer)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len(answers) == 2
    assert client.embed.Embed(tei_pb2.EmbedRequest(inputs="still serving")).embeddings


def test_rerank_is_http_rerank_and_cross_encoder(reranker: tuple[Client, Path]) -> None:
    from sentence_transformers import CrossEncoder

    client, folder = reranker
    query, texts = "what is eaten?", TEXTS
    for raw_scores in (False, True):
        got = client.rerank.Rerank(tei_pb2.RerankRequest(query=query, texts=texts, raw_scores=raw_scores,
                                                         return_text=True))
        http = client.http("/rerank", {"query": query, "texts": texts, "raw_scores": raw_scores, "return_text": True})
        assert [(r.index, r.text) for r in got.ranks] == [(r["index"], r["text"]) for r in http]
        assert np.array_equal(f32([r.score for r in got.ranks]), f32([r["score"] for r in http]))
    expected = CrossEncoder(str(folder), device="cpu").predict([(query, t) for t in texts])
    got = client.rerank.Rerank(tei_pb2.RerankRequest(query=query, texts=texts))
    assert max(abs(r.score - expected[r.index]) for r in got.ranks) <= TOL
    assert not any(r.HasField("text") for r in got.ranks)
    streamed = client.rerank.RerankStream(iter(tei_pb2.RerankStreamRequest(query=query, text=t) for t in texts))
    # other batch shapes: the same scores up to float rounding (the batches are packed differently)
    assert [r.index for r in streamed.ranks] == [r.index for r in got.ranks]
    assert np.allclose([r.score for r in streamed.ranks], [r.score for r in got.ranks], rtol=1e-5, atol=1e-6)
    pair = client.predict.PredictPair(tei_pb2.PredictPairRequest(inputs=[query, texts[0]]))
    http = client.http("/predict", {"inputs": [query, texts[0]]})
    assert [(p.label, p.score) for p in pair.predictions] == [(p["label"], f32(p["score"])) for p in http]
    pairs = list(client.predict.PredictPairStream(iter(tei_pb2.PredictPairRequest(inputs=[query, t])
                                                       for t in texts)))
    by_index = {r.index: r.score for r in got.ranks}
    assert np.allclose([p.predictions[0].score for p in pairs], [by_index[i] for i in range(len(texts))], rtol=1e-5,
                       atol=1e-6)


def test_predict_is_http_predict(classifier: Client) -> None:
    for raw_scores in (False, True):
        for text in TEXTS:
            got = classifier.predict.Predict(tei_pb2.PredictRequest(inputs=text, raw_scores=raw_scores))
            http = classifier.http("/predict", {"inputs": text, "raw_scores": raw_scores})
            assert [(p.label, p.score) for p in got.predictions] == [(p["label"], f32(p["score"])) for p in http]
    streamed = classifier.predict.PredictStream(iter(tei_pb2.PredictRequest(inputs=t) for t in TEXTS))
    assert [[p.label for p in r.predictions] for r in streamed] == \
        [[p["label"] for p in classifier.http("/predict", {"inputs": t})] for t in TEXTS]
    assert classifier.info.Info(tei_pb2.InfoRequest()).model_type == tei_pb2.MODEL_TYPE_CLASSIFIER


def test_embed_sparse_is_http_embed_sparse(tmp_path_factory: pytest.TempPathFactory) -> None:
    folder = tiny_heads.build_bge_m3(tmp_path_factory.mktemp("grpc-bge-m3"))
    with Engine.from_workflow("bge_m3", folder) as engine, grpc_server(engine) as client:
        for text in TEXTS:
            got = client.embed.EmbedSparse(tei_pb2.EmbedSparseRequest(inputs=text))
            http = client.http("/embed_sparse", {"inputs": text})[0]
            assert [(v.index, v.value) for v in got.sparse_embeddings] == [(v["index"], f32(v["value"])) for v in http]
        streamed = client.embed.EmbedSparseStream(iter(tei_pb2.EmbedSparseRequest(inputs=t) for t in TEXTS))
        assert [len(r.sparse_embeddings) for r in streamed] == \
            [len(client.http("/embed_sparse", {"inputs": t})[0]) for t in TEXTS]


# --- refusals: TEI's status codes, and the server serves on


def test_bad_input_gets_tei_s_status(client: Client) -> None:
    codes = grpc.StatusCode
    assert refused(client.embed.Embed, tei_pb2.EmbedRequest(inputs="")).code() == codes.INVALID_ARGUMENT
    too_long = refused(client.embed.Embed, tei_pb2.EmbedRequest(inputs="word " * 1000))
    assert too_long.code() == codes.INVALID_ARGUMENT and "truncate" in too_long.details()
    assert client.embed.Embed(tei_pb2.EmbedRequest(inputs="word " * 1000, truncate=True)).embeddings
    assert refused(client.embed.Embed, tei_pb2.EmbedRequest(inputs="x", dimensions=0)).code() == \
        codes.INVALID_ARGUMENT
    assert refused(client.embed.Embed, tei_pb2.EmbedRequest(inputs="x", prompt_name="nope")).code() == \
        codes.INVALID_ARGUMENT
    assert refused(client.embed.Embed, tei_pb2.EmbedRequest(inputs="x", truncation_direction=7)).code() == \
        codes.INVALID_ARGUMENT
    assert refused(client.tokenize.Decode, tei_pb2.DecodeRequest(ids=[10**9])).code() == codes.INVALID_ARGUMENT
    # methods an embedder cannot answer (it reranks with its scorer, cosine): TEI's FAILED_PRECONDITION
    for call, message in ((client.predict.Predict, tei_pb2.PredictRequest(inputs="a")),
                          (client.embed.EmbedSparse, tei_pb2.EmbedSparseRequest(inputs="a"))):
        error = refused(call, message)
        assert error.code() == codes.FAILED_PRECONDITION, (call, error.details())
    assert client.embed.Embed(tei_pb2.EmbedRequest(inputs="still serving")).embeddings
    assert httpx.get(client.url + "/health").status_code == 200


def test_batch_too_large_and_pair_shapes(reranker: tuple[Client, Path]) -> None:
    client, _ = reranker
    codes = grpc.StatusCode
    texts = [f"text {i}" for i in range(BATCH_LIMIT + 1)]
    error = refused(client.rerank.Rerank, tei_pb2.RerankRequest(query="q", texts=texts))
    assert error.code() == codes.INVALID_ARGUMENT and f"batch size {BATCH_LIMIT + 1} > maximum allowed" in \
        error.details()
    error = refused(client.rerank.RerankStream, iter(tei_pb2.RerankStreamRequest(query="q", text=t) for t in texts))
    assert error.code() == codes.INVALID_ARGUMENT and "batch size" in error.details()
    assert refused(client.rerank.Rerank, tei_pb2.RerankRequest(query="q")).code() == codes.INVALID_ARGUMENT
    assert refused(client.rerank.RerankStream, iter([])).code() == codes.INVALID_ARGUMENT
    for inputs in ([], ["a", "b", "c"]):
        assert refused(client.predict.PredictPair, tei_pb2.PredictPairRequest(inputs=inputs)).code() == \
            codes.INVALID_ARGUMENT
    assert refused(client.embed.Embed, tei_pb2.EmbedRequest(inputs="a")).code() == codes.FAILED_PRECONDITION
    assert client.rerank.Rerank(tei_pb2.RerankRequest(query="q", texts=texts[:BATCH_LIMIT])).ranks


def test_overload_is_resource_exhausted_and_streams_wait_it_out(served: tuple[Client, Any],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """As on TEI: a unary call to an overloaded server is refused at once, RESOURCE_EXHAUSTED; a stream's request
    waits for room (TEI's permit) until --request-timeout. The engine takes no request at all while the test says
    so (`max_concurrent_requests = 0`), whatever the timing; the stream's first refused try is observed."""
    client, app = served
    engine = app.state.service.engine
    tried = threading.Event()
    encode = engine.encode

    async def observed(*args: Any, **kwargs: Any) -> Any:
        if engine.max_concurrent_requests == 0:
            tried.set()
        return await encode(*args, **kwargs)

    monkeypatch.setattr(engine, "encode", observed)
    monkeypatch.setattr(engine, "max_concurrent_requests", 0)
    error = refused(client.embed.Embed, tei_pb2.EmbedRequest(inputs="a"))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "overloaded" in error.details()
    tried.clear()
    with ThreadPoolExecutor(1) as pool:
        streamed = pool.submit(lambda: list(client.embed.EmbedStream(iter([tei_pb2.EmbedRequest(inputs="a")]))))
        assert tried.wait(300), "the stream's request never reached the engine"
        engine.max_concurrent_requests = 512
        (answer,) = streamed.result(timeout=300)
    assert np.array_equal(f32(answer.embeddings), f32(client.http("/embed", {"inputs": "a"})[0]))
    engine.max_concurrent_requests = 0
    monkeypatch.setattr(app.state.service.config, "request_timeout", 0.05)
    error = refused(client.embed.EmbedStream, iter([tei_pb2.EmbedRequest(inputs="a")]))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "overloaded" in error.details()
    monkeypatch.undo()
    assert client.embed.Embed(tei_pb2.EmbedRequest(inputs="a")).embeddings


def test_engine_failures_get_tei_s_status(served: tuple[Client, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """A request timeout is TEI's `Overloaded` on the HTTP TEI routes (503 there), a stopped engine `Unhealthy`:
    RESOURCE_EXHAUSTED and UNAVAILABLE here. The engine is made to fail at once, whatever the timing."""
    from wde.async_engine import EngineTimeout, EngineUnavailable

    client, app = served
    engine = app.state.service.engine
    for failure, code in ((EngineTimeout("no answer within the request timeout"), grpc.StatusCode.RESOURCE_EXHAUSTED),
                          (EngineUnavailable("the engine is not running"), grpc.StatusCode.UNAVAILABLE)):
        async def failing(*args: Any, error: Exception = failure, **kwargs: Any) -> Any:
            raise error

        monkeypatch.setattr(engine, "encode", failing)
        error = refused(client.embed.Embed, tei_pb2.EmbedRequest(inputs="a"))
        assert error.code() == code and str(failure) in error.details()
        monkeypatch.undo()
    assert client.embed.Embed(tei_pb2.EmbedRequest(inputs="a")).embeddings


def test_every_api_error_kind_has_a_tei_status() -> None:
    from wde.server.errors import STATUS, ApiError
    from wde.server.grpc.calls import status_of

    codes = {kind: status_of(ApiError(kind, "x")) for kind in STATUS}  # type: ignore[arg-type]
    assert codes["empty"] == codes["too_long"] == codes["validation"] == grpc.StatusCode.INVALID_ARGUMENT
    assert codes["unsupported"] == codes["backend"] == grpc.StatusCode.FAILED_PRECONDITION
    assert codes["overloaded"] == codes["timeout"] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert codes["unhealthy"] == grpc.StatusCode.UNAVAILABLE


def test_a_field_tei_proto_does_not_declare_is_refused_by_number(client: Client) -> None:
    raw = client.channel.unary_unary("/tei.v1.Embed/Embed", response_deserializer=tei_pb2.EmbedResponse.FromString)
    newer = tei_pb2.EmbedRequest(inputs="a").SerializeToString() + bytes([15 << 3, 1])  # field 15 = 1 (varint)
    error = refused(raw, newer)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "field number(s) 15" in error.details()
    assert client.embed.Embed(tei_pb2.EmbedRequest(inputs="a")).embeddings


def test_api_key_and_message_size(tiny_bert: Path) -> None:
    with Engine.from_workflow("bert", tiny_bert, overrides=["pooler.params.pooling=mean"]) as engine, \
            grpc_server(engine, api_key="secret", payload_limit=50_000) as client:
        request = tei_pb2.EmbedRequest(inputs="hello")
        for metadata in (None, (("authorization", "Bearer wrong"),), (("authorization", "secret"),)):
            error = refused(client.embed.Embed, request, metadata=metadata)
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED, metadata
        assert refused(client.embed.EmbedStream, iter([request])).code() == grpc.StatusCode.UNAUTHENTICATED
        assert refused(client.info.Info, tei_pb2.InfoRequest()).code() == grpc.StatusCode.UNAUTHENTICATED
        assert client.embed.Embed(request, metadata=client.metadata).embeddings
        big = tei_pb2.EmbedRequest(inputs="x" * 60_000, truncate=True)
        error = refused(client.embed.Embed, big, metadata=client.metadata)
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert client.embed.Embed(request, metadata=client.metadata).embeddings


# --- start-up: the CLI, a missing extra, split mode, the documented example


def test_grpc_port_without_grpcio_fails_in_one_line() -> None:
    code = "import sys; sys.modules['grpc'] = None; from wde.cli import main; main()"
    done = subprocess.run([sys.executable, "-c", code, "serve", "--port", str(free_port()), "--grpc-port", "0",
                           "--api-servers", "0"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'wde[grpc]'" in lines[0], done.stderr


def test_wde_serve_grpc_port_0_names_its_port_and_stops_cleanly(tiny_bert: Path, tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "wde.cli", "serve", "--model", str(tiny_bert), "--set",
                                 "pooler.params.pooling=mean", "--port", str(free_port()), "--grpc-port", "0",
                                 "--api-servers", "0"], stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        wait_healthy(f"http://127.0.0.1:{proc.args[proc.args.index('--port') + 1]}", lambda: proc.poll() is None)
        (port,) = re.findall(r"and TEI's gRPC API at 127\.0\.0\.1:(\d+)", log.read_text())
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            info = tei_pb2_grpc.InfoStub(channel).Info(tei_pb2.InfoRequest())
        assert info.model_type == tei_pb2.MODEL_TYPE_EMBEDDING
    finally:
        stop_server(proc)
    assert proc.returncode == 0, log.read_text()


def test_grpc_port_in_use_fails_in_one_line() -> None:
    port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        done = subprocess.run([sys.executable, "-m", "wde.cli", "serve", "--port", str(free_port()),
                               "--grpc-port", str(port), "--api-servers", "0"], capture_output=True, text=True,
                              timeout=300, cwd=REPO)
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--grpc-port" in lines[0] and "in use" in lines[0], done.stderr


@pytest.mark.slow
def test_split_server_serves_grpc_from_its_api_servers(minilm_path: Path) -> None:
    port = free_port()
    with serve_split(minilm_path, 2, "--grpc-port", str(port)) as (url, _):
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        try:
            stub = tei_pb2_grpc.EmbedStub(channel)
            got = list(stub.EmbedStream(iter(tei_pb2.EmbedRequest(inputs=t) for t in TEXTS)))
            http = httpx.post(url + "/embed", json={"inputs": TEXTS}, timeout=60).json()
            assert np.abs(f32([g.embeddings for g in got]) - f32(http)).max() <= 1e-5
        finally:
            channel.close()


def test_the_documented_python_example_runs(client: Client) -> None:
    """docs/http_api.md's gRPC example, run as written with only the address changed."""
    from tests.test_docs_examples import _blocks

    doc = REPO / "docs" / "http_api.md"
    (code,) = [text for _, lang, text, heading in _blocks(doc) if lang == "python" and "gRPC" in heading]
    namespace: dict[str, Any] = {}
    exec(compile(code.replace("127.0.0.1:50051", f"127.0.0.1:{client.port}"), "docs/http_api.md", "exec"), namespace)
    assert len(namespace["vectors"]) == 2 and len(namespace["vectors"][0]) == 384
