"""Cohere v1 /v1/embed, driven by the clients that send it: cohere's v1 `Client.embed` (cohere 7.3) and
langchain-cohere's `CohereEmbeddings` (which builds that client), against sentence-transformers' vectors.

The server has two prompts (`query`, `document`), so a wrong `input_type` mapping gives a wrong vector, not the
same one. Refusals must be 4xx that cohere's client does not retry (it retries 5xx, 408, 409 and 429)."""

from __future__ import annotations

import base64
import time
from pathlib import Path
from typing import Iterator

import httpx
import numpy as np
import pytest

from tests.test_server import serve
from wde import Engine
from wde.server.quantize import quantize

MODEL = "minilm"
TEXTS = ["A man is eating food.", "The new movie is awesome", "Berlin has 3.5 million people."]
PROMPTS = "input_processor.params.prompts={query: 'q: ', document: 'd: '}"


@pytest.fixture(scope="module")
def url(minilm_path: Path) -> Iterator[str]:
    with Engine.from_workflow("bert", minilm_path, overrides=[PROMPTS]) as engine, \
            serve(engine, served_model_name=MODEL) as (base, _):
        yield base


@pytest.fixture(scope="module")
def st(minilm_path: Path):  # noqa: ANN201
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(minilm_path), device="cpu")
    return lambda texts, prefix="": model.encode([prefix + t for t in texts])


def _client(url: str):  # noqa: ANN202
    import cohere

    return cohere.Client(api_key="unused", base_url=url, timeout=60)


def _close(got: object, want: np.ndarray) -> None:
    got = np.asarray(got, dtype=np.float32)
    assert got.shape == want.shape and np.abs(got - want).max() <= 1e-4, np.abs(got - want).max()


def test_client_embed_floats(url: str, st, minilm_engine: Engine) -> None:  # noqa: ANN001
    response = _client(url).embed(texts=TEXTS, model=MODEL, input_type="search_document")
    assert response.response_type == "embeddings_floats" and response.texts == TEXTS
    _close(response.embeddings, st(TEXTS, "d: "))
    tokens = sum(o.num_prompt_tokens for o in minilm_engine.encode(["d: " + t for t in TEXTS]))
    assert response.meta.api_version.version == "1" and response.meta.billed_units.input_tokens == tokens
    query = _client(url).embed(texts=TEXTS[:1], model=MODEL, input_type="search_query")
    _close(query.embeddings, st(TEXTS[:1], "q: "))
    plain = _client(url).embed(texts=TEXTS[:1], model=MODEL, input_type="clustering")  # no such prompt: as is
    _close(plain.embeddings, st(TEXTS[:1]))


def test_client_embed_by_type_equals_v2(url: str, st) -> None:  # noqa: ANN001
    types = ["float", "int8", "ubinary", "base64"]
    response = _client(url).embed(texts=TEXTS, model=MODEL, input_type="search_query", embedding_types=types)
    assert response.response_type == "embeddings_by_type" and response.texts == TEXTS
    floats = np.array(response.embeddings.float_, dtype=np.float32)
    _close(floats, st(TEXTS, "q: "))
    assert np.array_equal(np.array(response.embeddings.int8), quantize(floats, "int8"))
    assert np.array_equal(np.array(response.embeddings.ubinary), quantize(floats, "ubinary"))
    v2 = httpx.post(f"{url}/v2/embed", json={"texts": TEXTS, "model": MODEL, "input_type": "search_query",
                                             "embedding_types": types}).json()["embeddings"]
    assert set(response.embeddings.dict(by_alias=True, exclude_none=True)) == set(types)
    for name in types:
        assert getattr(response.embeddings, "float_" if name == "float" else name) == v2[name], name


def test_truncate_start_end_none(url: str, st, minilm_engine: Engine) -> None:  # noqa: ANN001
    import cohere

    long = "word " * 300 + "finally"
    end = _client(url).embed(texts=[long], model=MODEL)  # Cohere's default: END
    start = _client(url).embed(texts=[long], model=MODEL, truncate="START")
    _close(end.embeddings, minilm_engine.embed([long], truncate=True))
    _close(start.embeddings, minilm_engine.embed([long], truncate=True, truncation_direction="left"))
    began = time.monotonic()
    with pytest.raises(cohere.UnprocessableEntityError) as refused:
        _client(url).embed(texts=[long], model=MODEL, truncate="NONE")
    assert time.monotonic() - began < 3, "a 4xx was retried"
    assert refused.value.body["error"]["param"] == "texts[0]"


def test_langchain_cohere(url: str, st) -> None:  # noqa: ANN001
    from langchain_cohere import CohereEmbeddings

    embeddings = CohereEmbeddings(base_url=url, cohere_api_key="unused", model=MODEL)
    _close(embeddings.embed_documents(TEXTS), st(TEXTS, "d: "))
    _close(embeddings.embed_query("what do people eat?"), st(["what do people eat?"], "q: ")[0])
    typed = CohereEmbeddings(base_url=url, cohere_api_key="unused", model=MODEL, embedding_types=["int8"])
    assert np.array_equal(np.array(typed.embed_documents(TEXTS)), quantize(st(TEXTS, "d: "), "int8"))


def test_langchain_cohere_refusal_is_not_retried_by_the_client(url: str) -> None:
    """langchain-cohere retries every exception itself (max_retries=3: 4 s, then 8 s); with max_retries=1 the
    server's 4xx reaches the caller at once, with cohere's own client adding no retry."""
    import cohere
    from langchain_cohere import CohereEmbeddings

    embeddings = CohereEmbeddings(base_url=url, cohere_api_key="unused", model="embed-english-v3.0", max_retries=1)
    began = time.monotonic()
    with pytest.raises(cohere.NotFoundError) as refused:
        embeddings.embed_documents(TEXTS)
    assert time.monotonic() - began < 3, "a 4xx was retried"
    assert refused.value.body["error"]["param"] == "model"


@pytest.mark.parametrize("body,status,param,needle", [
    ({"texts": ["x"], "output_dimension": 64}, 422, "output_dimension", "Cohere v2 field"),
    ({"texts": ["x"], "max_tokens": 512}, 422, "max_tokens", "Cohere v2 field"),
    ({"inputs": [{"content": [{"type": "text", "text": "y"}]}]}, 422, "inputs", "/v2/embed"),
    ({"texts": []}, 400, "texts", "empty"),
    ({}, 400, "texts", "empty"),
    ({"texts": ["x"], "truncate": "MIDDLE"}, 422, "truncate", "truncate"),
    ({"texts": ["x"], "embedding_types": ["int4"]}, 422, "embedding_types.0", "embedding_types"),
    ({"texts": ["x"], "input_type": "nonsense"}, 422, "input_type", "defined prompts: ['document', 'query']"),
    ({"images": ["data:image/png;base64,AAAA"]}, 424, "images", "text only"),
])
def test_refusals_name_the_field(url: str, body: dict, status: int, param: str, needle: str) -> None:
    r = httpx.post(f"{url}/v1/embed", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"], err


def test_client_embeds_images_of_an_image_text_model(clip_path: Path, clip: Engine) -> None:
    """v1's `images` (data URIs) on tiny CLIP: the same vectors as `Engine.embed` of the images; texts and images
    together are refused, as on /v2/embed."""
    import cohere

    from tests.tiny_clip import encoded, scene

    pictures = [encoded(scene(k)) for k in range(2)]
    uris = [f"data:image/png;base64,{base64.b64encode(p).decode()}" for p in pictures]
    with Engine.from_workflow(None, clip_path) as engine, serve(engine, served_model_name="clip") as (base, _):
        response = _client(base).embed(images=uris, model="clip", input_type="image")
        assert response.response_type == "embeddings_floats" and response.texts == []
        assert np.abs(np.array(response.embeddings) - clip.embed(pictures)).max() <= 1e-5
        assert response.meta.billed_units.dict()["images"] == 2
        with pytest.raises(cohere.UnprocessableEntityError) as refused:
            _client(base).embed(texts=["a cat"], images=uris[:1], model="clip", input_type="image")
        assert refused.value.body["error"]["param"] == "images"
