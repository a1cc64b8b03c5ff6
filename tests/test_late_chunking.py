"""Late chunking (wde/late_chunking.py): each chunk's vector is the mean of the WHOLE input's token states over
the chunk's tokens, then the model's modules after pooling and its normalization.

References are sentence-transformers' own: `SentenceTransformer.encode(text, output_value="token_embeddings")`
for the whole text, averaged over each chunk's token range, then the model's modules after Pooling run on the
mean (Dense, Normalize). Token ranges are checked against the Hugging Face tokenizer's offsets, computed here.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Iterator

import httpx
import numpy as np
import pytest
import torch

from tests import tiny_heads
from tests.st_folders import minilm_pipeline
from tests.test_server import serve, serve_split
from wde import Engine
from wde.errors import RequestError
from wde.components.pooler import TOKENS
from wde.late_chunking import LateChunk, sentences
from wde.request import PoolingParams

TOL = 1e-5
TEXT = ("Berlin is the capital and largest city of Germany. Its population is about 3.8 million! Is it the most"
        " populous city of the European Union? It is.\n\nThe city lies on the Spree.")
SENTENCES = ["Berlin is the capital and largest city of Germany.", "Its population is about 3.8 million!",
             "Is it the most populous city of the European Union?", "It is.", "The city lies on the Spree."]


@pytest.fixture(scope="module")
def st_minilm(minilm_path: Path):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_path), device="cpu")


@pytest.fixture(scope="module")
def dense_model(minilm_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The MiniLM Transformer, then mean Pooling, a random Dense 384 -> 96 (tanh) and Normalize."""
    return minilm_pipeline(minilm_path, tmp_path_factory.mktemp("late-dense") / "model", "mean", 96, seed=7)


def reference(st, text: str, token_ranges: list[tuple[int, int]]) -> np.ndarray:
    """sentence-transformers' token states of the whole `text`, averaged over each range, then its modules after
    Pooling (for all-MiniLM-L6-v2: Normalize)."""
    states = st.encode(text, output_value="token_embeddings", convert_to_tensor=True).double()
    means = torch.stack([states[a:b].mean(0) for a, b in token_ranges]).float()
    features = {"sentence_embedding": means}
    with torch.inference_mode():
        for module in list(st)[2:]:
            features = module(features)
    return features["sentence_embedding"].numpy()


def overlapping_tokens(minilm_path: Path, text: str, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Each character span's token range, from the tokenizer's offsets: the tokens whose characters overlap it."""
    from transformers import AutoTokenizer

    enc = AutoTokenizer.from_pretrained(minilm_path)(text, return_offsets_mapping=True)
    ranges = []
    for a, b in spans:
        hit = [i for i, (s, e) in enumerate(enc["offset_mapping"]) if e > s and s < b and e > a]
        ranges.append((hit[0], hit[-1] + 1))
    return ranges


def assert_close(chunks: list[LateChunk], expected: np.ndarray) -> None:
    got = np.stack([c.vector for c in chunks])
    assert got.shape == expected.shape, (got.shape, expected.shape)
    assert np.abs(got - expected).max() <= TOL, np.abs(got - expected).max()


def test_sentences_chunker_finds_sentence_spans() -> None:
    assert [TEXT[a:b] for a, b in sentences(TEXT)] == SENTENCES
    assert sentences("  no end  ") == [(2, 8)]
    text = 'He said "stop." Then left.\nA line. 句子一。句子二'
    assert [text[a:b] for a, b in sentences(text)] == ['He said "stop."', "Then left.", "A line.", "句子一。",
                                                       "句子二"]
    assert sentences(" \n\n ") == []


@pytest.mark.parametrize("how", ["sentences", "tokens", "spans"])
def test_chunk_vectors_equal_pooling_the_whole_inputs_token_states(minilm_engine: Engine, st_minilm,
                                                                  minilm_path: Path, how: str) -> None:
    if how == "sentences":
        chunks = minilm_engine.late_chunk(TEXT)
        assert [c.text for c in chunks] == SENTENCES
    elif how == "tokens":
        chunks = minilm_engine.late_chunk(TEXT, chunker="tokens", chunk_tokens=7)
        n = len(st_minilm.tokenizer(TEXT)["input_ids"]) - 2
        assert [c.token_range for c in chunks] == [(1 + k, 1 + min(k + 7, n)) for k in range(0, n, 7)]
    else:
        spans = [(0, 6), (4, 60), (150, len(TEXT))]  # overlapping, starting mid-word
        chunks = minilm_engine.late_chunk(TEXT, spans)
        assert [c.char_range for c in chunks] == spans and [c.text for c in chunks] == [TEXT[a:b] for a, b in spans]
    assert [c.text for c in chunks] == [TEXT[a:b] for a, b in (c.char_range for c in chunks)]
    if how != "tokens":
        assert [c.token_range for c in chunks] == overlapping_tokens(minilm_path, TEXT, [c.char_range for c in chunks])
    assert_close(chunks, reference(st_minilm, TEXT, [c.token_range for c in chunks]))


def test_modules_after_pooling_dimensions_and_normalization(dense_model: Path) -> None:
    """A Dense module after pooling: it runs on each chunk's mean; `dimensions` cuts before normalization."""
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(dense_model), device="cpu")
    with Engine.from_workflow(None, dense_model) as engine:
        chunks = engine.late_chunk(TEXT)
        raw = engine.late_chunk(TEXT, normalize=False)
        cut = engine.late_chunk(TEXT, dimensions=32)
    expected = reference(st, TEXT, [c.token_range for c in chunks])
    assert expected.shape == (len(SENTENCES), 96)
    assert_close(chunks, expected)
    assert not np.allclose(np.linalg.norm(np.stack([c.vector for c in raw]), axis=1), 1.0)
    short = np.stack([c.vector[:32] for c in raw])
    assert_close(cut, short / np.linalg.norm(short, axis=1, keepdims=True))


def test_jinas_shape_chunks_are_the_texts_joined(minilm_engine: Engine, st_minilm) -> None:
    """A list of texts is one document's consecutive chunks: joined by spaces, one vector each."""
    chunks = minilm_engine.late_chunk(SENTENCES)
    joined = " ".join(SENTENCES)
    assert [c.text for c in chunks] == SENTENCES and joined[slice(*chunks[2].char_range)] == SENTENCES[2]
    assert_close(chunks, reference(st_minilm, joined, [c.token_range for c in chunks]))
    alone = minilm_engine.embed(SENTENCES[1])
    assert 0.5 < float(chunks[1].vector @ alone) < 0.9999  # the context changed it


def test_an_instruction_prompt_is_encoded_but_in_no_chunk(minilm_path: Path, st_minilm) -> None:
    """`prompt_name`: the prompt is encoded before the text, as for `embed`; character ranges stay the text's."""
    with Engine.from_workflow("bert", minilm_path,
                              overrides=['input_processor.params.prompts={"query": "query: "}']) as engine:
        chunks = engine.late_chunk(TEXT, prompt_name="query")
    assert [c.text for c in chunks] == SENTENCES and chunks[0].token_range[0] == 3  # [CLS] query :
    assert_close(chunks, reference(st_minilm, "query: " + TEXT, [c.token_range for c in chunks]))


def test_spans_on_token_ids_in_a_mixed_batch(minilm_engine: Engine, st_minilm) -> None:
    """`PoolingParams.spans` on token ids, batched with requests without spans and with other dimensions: every
    request gets what it would alone."""
    ids = st_minilm.tokenizer(TEXT)["input_ids"]
    ranges = [(0, 1), (1, 12), (5, len(ids))]
    requests = [minilm_engine.make_request(ids, PoolingParams(spans=tuple(ranges))),
                minilm_engine.make_request(SENTENCES[0]),
                minilm_engine.make_request(ids, PoolingParams(spans=((1, 3),), dimensions=16, normalize=False))]
    done = minilm_engine.run(requests)
    first, plain, third = (done[r.request_id] for r in requests)
    assert np.abs(first.outputs["chunk_embeddings"] - reference(st_minilm, TEXT, ranges)).max() <= TOL
    assert np.abs(plain.outputs["dense"] - minilm_engine.embed(SENTENCES[0])).max() <= TOL
    assert plain.outputs["chunk_embeddings"].shape == (0, 384)
    states = st_minilm.encode(TEXT, output_value="token_embeddings", convert_to_tensor=True).double()
    row = third.outputs["chunk_embeddings"]
    assert row.shape == (1, 384) and not row[0, 16:].any()
    assert np.abs(row[0, :16] - states[1:3].mean(0)[:16].numpy()).max() <= TOL


def test_spans_survive_a_batch_split_across_cpu_streams(minilm_path: Path, minilm_engine: Engine) -> None:
    """A batch cut into pieces for CPU streams (`Pooled.cat`): a piece where nobody asked for spans or token states
    still gives the requests of the other pieces theirs."""
    ids = minilm_engine.encode([TEXT])[0].prompt_token_ids
    params = [PoolingParams(), PoolingParams(spans=((1, 5), (2, 9))), PoolingParams(outputs=("dense", TOKENS)),
              PoolingParams(spans=((0, 3),))]
    inputs = ["plain text here", ids, "more text", ids]
    always_split = ["runner.params.cpu_streams=2", "runner.params.cpu_stream_min_tokens=1",
                    "runner.params.cpu_stream_max_mean_tokens=100000"]
    with Engine.from_workflow("bert", minilm_path, overrides=always_split) as split:
        requests = [split.make_request(x, p) for x, p in zip(inputs, params)]
        done = split.run(requests)
    for r, x, p in zip(requests, inputs, params):
        got = done[r.request_id].outputs
        alone, = minilm_engine.encode([x], p)
        for name in ("dense", *alone.outputs):
            assert got[name].shape == alone.outputs[name].shape, name
            assert np.abs(got[name] - alone.outputs[name]).max(initial=0) <= TOL, name


def test_truncation_chunks_only_the_kept_text(minilm_engine: Engine, st_minilm) -> None:
    long_text = " ".join(f"Sentence number {i} is here." for i in range(120))
    with pytest.raises(RequestError, match="more than the limit") as e:
        minilm_engine.late_chunk(long_text)
    assert e.value.kind == "too_long"
    chunks = minilm_engine.late_chunk(long_text, truncate=True)
    assert chunks[-1].token_range[1] <= minilm_engine.max_length - 1
    assert [c.text for c in chunks[:2]] == ["Sentence number 0 is here.", "Sentence number 1 is here."]
    kept_ids = st_minilm.tokenizer(long_text, truncation=True, max_length=256)["input_ids"]
    kept = st_minilm.tokenizer.decode(kept_ids[1:-1])
    assert kept.startswith(" ".join(c.text.lower() for c in chunks[:-1]))
    assert_close(chunks, reference(st_minilm, long_text, [c.token_range for c in chunks]))
    with pytest.raises(RequestError, match="covers no token") as e:
        minilm_engine.late_chunk(long_text, [(0, 5), (len(long_text) - 5, len(long_text))], truncate=True)
    assert e.value.field == "spans[1]"
    left = minilm_engine.late_chunk(long_text, truncate=True, truncation_direction="left")
    assert left[-1].text == "Sentence number 119 is here." and left[-1].token_range[1] == minilm_engine.max_length - 1
    st_minilm.tokenizer.truncation_side = "left"
    try:
        assert_close(left, reference(st_minilm, long_text, [c.token_range for c in left]))
    finally:
        st_minilm.tokenizer.truncation_side = "right"


@pytest.mark.parametrize("kwargs, field", [
    ({"spans": []}, "spans"),
    ({"spans": [(0, 5), (5, 5)]}, "spans[1]"),
    ({"spans": [(0, 10_000)]}, "spans[0]"),
    ({"spans": [(-1, 3)]}, "spans[0]"),
    ({"spans": [(0, 1.5)]}, "spans[0]"),
    ({"spans": [(50, 51)]}, "spans[0]"),  # a space: no token
    ({"spans": [(0, 5)] * 100}, "spans"),  # more spans than the text's tokens
    ({"spans": [(0, 5)], "chunker": "sentences"}, "chunker"),
    ({"chunker": "paragraphs"}, "chunker"),
    ({"chunk_tokens": 5}, "chunk_tokens"),
    ({"chunker": "tokens"}, "chunk_tokens"),
    ({"chunker": "tokens", "chunk_tokens": 0}, "chunk_tokens"),
])
def test_bad_spans_and_chunkers_are_refused_by_name(minilm_engine: Engine, kwargs: dict, field: str) -> None:
    with pytest.raises(RequestError) as e:
        minilm_engine.late_chunk(TEXT, **kwargs)
    assert e.value.field == field, str(e.value)


def test_spans_the_engine_cannot_honour_are_refused(minilm_engine: Engine, minilm_path: Path,
                                                   tmp_path: Path) -> None:
    ids = list(range(101, 111))
    for params, inputs, field in [
        (PoolingParams(spans=((0, 3),)), "a text", "spans"),  # tokenized only later
        (PoolingParams(spans=((0, 11),)), ids, "spans[0]"),
        (PoolingParams(spans=((0, 1),) * 11), ids, "spans"),  # more spans than tokens
        (PoolingParams(spans=((0, 3),), truncate=True), ids, "spans"),
        (PoolingParams(spans=((0, 3),), chunk=True), ids, "spans"),
        (PoolingParams(spans=((0, 3),), max_tokens=5), ids, "spans"),
    ]:
        with pytest.raises(RequestError) as e:
            minilm_engine.make_request(inputs, params)
        assert e.value.field == field, str(e.value)
    # a pooler that is no SpanPooling (a classifier's), and one that cannot as built (modes concatenated)
    classifier = tiny_heads.build_minilm_classifier(minilm_path, tmp_path / "classifier", num_labels=2)
    with Engine.from_workflow(None, classifier) as engine:
        with pytest.raises(RequestError, match="pools token spans"):
            engine.make_request(ids, PoolingParams(spans=((0, 3),)))
        with pytest.raises(RequestError, match="pools token spans"):
            engine.late_chunk(TEXT)
    concat_folder(minilm_path, tmp_path / "concat")
    with Engine.from_workflow(None, tmp_path / "concat") as engine:
        assert not engine.span_pooling
        with pytest.raises(RequestError, match="pools token spans") as e:
            engine.make_request(ids, PoolingParams(spans=((0, 3),)))
        assert e.value.field == "spans"


def concat_folder(minilm_path: Path, out: Path) -> None:
    """The MiniLM with a Pooling that concatenates the CLS and mean states (no Dense: 768 wide)."""
    from sentence_transformers import SentenceTransformer

    try:
        from sentence_transformers.sentence_transformer import modules as models  # sentence-transformers >= 6
    except ImportError:
        from sentence_transformers import models

    transformer = SentenceTransformer(str(minilm_path), device="cpu")[0]
    SentenceTransformer(modules=[transformer, models.Pooling(384, ["cls", "mean"])], device="cpu").save(str(out))


@pytest.fixture(scope="module")
def server(minilm_path: Path) -> Iterator[str]:
    with Engine.from_workflow("bert", minilm_path) as engine, serve(engine) as (url, _):
        yield url


def _check_http(url: str, engine: Engine) -> None:
    """Both shapes on /v1/embeddings give `Engine.late_chunk`'s chunks, ranges reported back."""
    r = httpx.post(f"{url}/v1/embeddings", json={"input": SENTENCES, "late_chunking": True}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    want = engine.late_chunk(SENTENCES)
    assert [d["index"] for d in body["data"]] == list(range(len(SENTENCES)))
    assert [tuple(d["char_range"]) for d in body["data"]] == [c.char_range for c in want]
    assert [tuple(d["token_range"]) for d in body["data"]] == [c.token_range for c in want]
    assert np.abs(np.array([d["embedding"] for d in body["data"]]) - np.stack([c.vector for c in want])).max() <= TOL
    assert body["usage"]["prompt_tokens"] == want[-1].token_range[1] + 1
    spans = [[0, 6], [7, 60]]
    for extra, expected in [({}, engine.late_chunk(TEXT, [(0, len(TEXT))])),  # one text, Jina's: one chunk
                            ({"chunker": "tokens", "chunk_tokens": 9}, engine.late_chunk(TEXT, chunker="tokens",
                                                                                         chunk_tokens=9)),
                            ({"spans": spans, "dimensions": 8}, engine.late_chunk(TEXT, spans, dimensions=8)),
                            ({"chunker": "sentences"}, engine.late_chunk(TEXT))]:
        r = httpx.post(f"{url}/v1/embeddings", json={"input": TEXT, "late_chunking": True, **extra}, timeout=60)
        assert r.status_code == 200, r.text
        data = r.json()["data"]
        assert [(tuple(d["char_range"]), tuple(d["token_range"])) for d in data] == \
            [(c.char_range, c.token_range) for c in expected]
        assert np.abs(np.array([d["embedding"] for d in data]) - np.stack([c.vector for c in expected])).max() <= TOL
    as_base64 = {"input": SENTENCES, "late_chunking": True, "encoding_format": "base64"}
    r = httpx.post(f"{url}/v1/embeddings", json=as_base64, timeout=60)
    got = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in r.json()["data"]])
    assert np.abs(got - np.stack([c.vector for c in want])).max() <= TOL


def test_http_late_chunking(server: str, minilm_engine: Engine) -> None:
    _check_http(server, minilm_engine)


@pytest.mark.parametrize("body, field", [
    ({"input": TEXT, "spans": [[0, 5]]}, "spans"),
    ({"input": TEXT, "late_chunking": False, "chunker": "sentences"}, "chunker"),
    ({"input": TEXT, "late_chunking": "yes"}, "late_chunking"),
    ({"input": TEXT, "late_chunking": True, "spans": [[0, 5000]]}, "spans[0]"),
    ({"input": TEXT, "late_chunking": True, "spans": [[0, 5, 7]]}, "spans.0"),
    ({"input": TEXT, "late_chunking": True, "chunker": "tokens"}, "chunk_tokens"),
    ({"input": [TEXT, "b"], "late_chunking": True, "chunker": "sentences"}, "input"),
    ({"input": [[101, 102]], "late_chunking": True}, "input"),
    ({"input": ["a", " "], "late_chunking": True}, "input[1]"),
    ({"input": " ", "late_chunking": True}, "input"),
    ({"input": TEXT * 40, "late_chunking": True}, "input"),
    ({"messages": [{"role": "user", "content": "hi"}], "late_chunking": True}, "messages"),
])
def test_http_refusals_name_the_field(server: str, body: dict, field: str) -> None:
    r = httpx.post(f"{server}/v1/embeddings", json=body, timeout=60)
    empty = body.get("input") in (["a", " "], " ")
    assert r.status_code == (400 if empty else 422), r.text  # an empty input is a 400, as anywhere
    assert r.json()["error"]["param"] == field, r.text


def test_http_late_chunking_false_is_plain_embeddings(server: str, minilm_engine: Engine) -> None:
    for flag in (False, None):
        r = httpx.post(f"{server}/v1/embeddings", json={"input": SENTENCES[:2], "late_chunking": flag}, timeout=60)
        assert r.status_code == 200, r.text
        got = np.array([d["embedding"] for d in r.json()["data"]])
        assert np.abs(got - minilm_engine.embed(SENTENCES[:2])).max() <= TOL


def test_http_late_chunking_on_a_split_server(minilm_path: Path, minilm_engine: Engine) -> None:
    """The spans travel to the engine core in `PoolingParams`, the chunk vectors come back."""
    with serve_split(minilm_path, 1) as (url, _):
        _check_http(url, minilm_engine)
