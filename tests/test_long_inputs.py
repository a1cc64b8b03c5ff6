"""Inputs longer than the model (issue 34): refused, truncated, or embedded in chunks (wde/chunking.py).

The reference is computed here with sentence-transformers' own modules: the whole text's token ids (its
tokenizer, no truncation) without the special tokens are cut into pieces of (limit - 2), each given [CLS] and
[SEP] again; each chunk runs through the Transformer and every module up to the final Normalize; the chunk vectors
are averaged weighted by their token counts, then Normalize applies. WDE must give that vector through
`Engine.embed`, `wde embed`, and the HTTP routes of a server started with `--long-inputs chunk`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import httpx
import numpy as np
import pytest
import torch
from click.testing import CliRunner

from tests import tiny_heads
from tests.st_folders import minilm_pipeline
from tests.test_server import serve, serve_split
from wde import Engine
from wde.cli import main
from wde.errors import RequestError
from wde.request import PoolingParams
from wde.server import ServerConfig, create_app
from wde.server.startup import StartupError

LONG = " ".join(f"Sentence {i} tells of rivers, towns and the weather on day {i}." for i in range(110))
"""About 1,700 MiniLM tokens: more than 4 times all-MiniLM-L6-v2's limit of 256."""
SHORT = ["A man is eating food.", "hello"]


def st_chunked(folder: Path, text: str, limit: int, dimensions: int | None = None,
               normalize: bool = True) -> tuple[np.ndarray, int, int]:
    """(vector, chunks, tokens): the text's chunks through sentence-transformers' modules, merged by token count."""
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(folder), device="cpu")
    ids = st.tokenizer(text, truncation=False)["input_ids"]
    cls, body, sep = ids[:1], ids[1:-1], ids[-1:]
    room = limit - 2
    chunks = [cls + body[i:i + room] + sep for i in range(0, len(body), room)]
    modules = list(st)
    last_normalizes = type(modules[-1]).__name__ == "Normalize"
    if last_normalizes:
        modules = modules[:-1]
    vectors = []
    for c in chunks:
        features = {"input_ids": torch.tensor([c]), "attention_mask": torch.ones(1, len(c), dtype=torch.long),
                    "token_type_ids": torch.zeros(1, len(c), dtype=torch.long)}
        with torch.no_grad():
            for m in modules:
                features = m(features)
        vectors.append(features["sentence_embedding"][0].double().numpy())
    weights = np.array([len(c) for c in chunks], dtype=np.float64)
    mean = weights @ np.stack(vectors) / weights.sum()
    if dimensions is not None:
        mean = mean[:dimensions]
    if last_normalizes and normalize:
        mean = mean / np.linalg.norm(mean)
    assert len(chunks) >= 4, "the test text must be at least 4 times the model's limit"
    return mean.astype(np.float32), len(chunks), sum(len(c) for c in chunks)


def assert_close(got: np.ndarray, expected: np.ndarray) -> None:
    got = np.asarray(got, dtype=np.float32)
    cosine = float(got @ expected / (np.linalg.norm(got) * np.linalg.norm(expected)))
    assert cosine >= 0.9999, cosine
    assert np.abs(got - expected).max() <= 1e-4


@pytest.fixture(scope="module")
def reference(minilm_path: Path) -> tuple[np.ndarray, int, int]:
    return st_chunked(minilm_path, LONG, 256)


@pytest.fixture(scope="module")
def cls_dense(minilm_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """MiniLM's Transformer with CLS pooling, a Dense module and Normalize, saved by sentence-transformers."""
    return minilm_pipeline(minilm_path, tmp_path_factory.mktemp("cls-dense") / "model", "cls", 96)


def test_engine_embeds_a_long_text_as_the_token_weighted_mean_of_its_chunks(
        minilm_engine: Engine, reference: tuple[np.ndarray, int, int]) -> None:
    expected, chunks, tokens = reference
    assert_close(minilm_engine.embed(LONG, chunk=True), expected)
    out, = minilm_engine.encode([LONG], PoolingParams(chunk=True))
    assert out.num_prompt_tokens == tokens  # usage counts every token of every chunk, special tokens included
    with pytest.raises(RequestError, match="more than the limit of 256"):
        minilm_engine.embed(LONG)  # refused unless the request says otherwise
    assert np.abs(minilm_engine.embed(LONG, truncate=True, chunk=True) - minilm_engine.embed(LONG, truncate=True)
                  ).max() == 0  # truncate wins where both are set


def test_dimensions_and_normalization_apply_to_the_merged_vector(minilm_path: Path, minilm_engine: Engine) -> None:
    expected, _, _ = st_chunked(minilm_path, LONG, 256, dimensions=64)
    assert_close(minilm_engine.embed(LONG, chunk=True, dimensions=64), expected)
    raw, _, _ = st_chunked(minilm_path, LONG, 256, normalize=False)
    assert_close(minilm_engine.embed(LONG, chunk=True, normalize=False), raw)


def test_cls_pooling_and_dense_modules_pool_each_chunk_before_the_mean(cls_dense: Path) -> None:
    expected, _, _ = st_chunked(cls_dense, LONG, 256)
    with Engine.from_workflow(None, cls_dense) as engine:
        assert_close(engine.embed(LONG, chunk=True), expected)


def test_chunks_pack_across_batches_beside_other_inputs(minilm_path: Path, minilm_engine: Engine,
                                                        reference: tuple[np.ndarray, int, int]) -> None:
    """A 512-token budget holds two chunks a batch: the long inputs' chunks spread over several batches, mixed with
    short inputs, and every input still gets its own vector."""
    short = minilm_engine.embed(SHORT)
    with Engine.from_workflow("bert", minilm_path, overrides=["scheduler.params.max_num_batched_tokens=512"]) as e:
        got = e.embed([SHORT[0], LONG, SHORT[1], LONG[::-1]], chunk=True)
        seen: list[int] = []
        e.on_batch = lambda stats: seen.append(stats.num_requests)
        e.embed([LONG], chunk=True)
    assert_close(got[1], reference[0])
    assert np.abs(got[[0, 2]] - short).max() <= 1e-5
    assert len(seen) >= 3 and max(seen) <= 2  # 7 chunks of at most 256 tokens in batches of at most 512


def test_max_embed_len_bounds_what_is_chunked(minilm_engine: Engine) -> None:
    with pytest.raises(RequestError, match=r"more than the 1000 that chunked processing takes \(max_embed_len\)"):
        minilm_engine.embed(LONG, chunk=True, max_embed_len=1000)
    assert minilm_engine.embed(SHORT, chunk=True, max_embed_len=10).shape == (2, 384)  # short inputs: no chunking


def test_chunking_is_refused_by_name_where_it_cannot_apply(minilm_engine: Engine, minilm_path: Path,
                                                           tmp_path: Path) -> None:
    with pytest.raises(RequestError, match="dense embeddings only") as e:
        minilm_engine.encode([LONG], PoolingParams(chunk=True, outputs=("dense", "token_embeddings")))
    assert e.value.field == "chunk"
    folder = tiny_heads.build_minilm_classifier(minilm_path, tmp_path / "clf", num_labels=3)
    with Engine.from_workflow(None, folder) as classifier:
        assert not classifier.chunkable
        with pytest.raises(RequestError, match="cannot be chunked"):
            classifier.encode([LONG], PoolingParams(chunk=True))
        with pytest.raises(StartupError, match="--long-inputs chunk: workflow"):
            create_app(classifier, ServerConfig(long_inputs="chunk"))


def test_an_aborted_long_input_leaves_nothing_behind(minilm_engine: Engine) -> None:
    rid = minilm_engine.add_request(LONG, PoolingParams(chunk=True))
    minilm_engine.abort(rid)
    outputs = []
    while minilm_engine.has_unfinished():
        outputs += minilm_engine.step()
    assert outputs == []
    kept = minilm_engine.add_request(LONG, PoolingParams(chunk=True))
    done = []
    while minilm_engine.has_unfinished():
        done += minilm_engine.step()
    assert [o.request_id for o in done] == [kept] and done[0].ok


def _routes(url: str) -> dict[str, Callable[[dict], tuple[np.ndarray, int | None]]]:
    """Each dense route: (vector of LONG, the tokens its answer counts, or None where it counts none)."""
    def post(path: str, body: dict) -> dict | list:
        r = httpx.post(url + path, json=body, timeout=120)
        assert r.status_code == 200, (path, r.status_code, r.text)
        return r.json()

    def openai(extra: dict) -> tuple[np.ndarray, int]:
        j = post("/v1/embeddings", {"input": [LONG], "model": "m", **extra})
        return np.array(j["data"][0]["embedding"]), j["usage"]["prompt_tokens"]

    def pooling(extra: dict) -> tuple[np.ndarray, int]:
        j = post("/pooling", {"input": [LONG], "model": "m", **extra})
        return np.array(j["data"][0]["data"]), j["usage"]["prompt_tokens"]

    def tei(extra: dict) -> tuple[np.ndarray, None]:
        return np.array(post("/embed", {"inputs": [LONG], **extra})[0]), None

    def cohere_v2(extra: dict) -> tuple[np.ndarray, int]:
        j = post("/v2/embed", {"texts": [LONG], "model": "m", "input_type": "search_document",
                               "embedding_types": ["float"], **extra})
        return np.array(j["embeddings"]["float"][0]), j["meta"]["billed_units"]["input_tokens"]

    def cohere_v1(extra: dict) -> tuple[np.ndarray, int]:
        j = post("/v1/embed", {"texts": [LONG], "model": "m", **extra})
        return np.array(j["embeddings"][0]), j["meta"]["billed_units"]["input_tokens"]

    return {"/v1/embeddings": openai, "/pooling": pooling, "/embed": tei, "/v2/embed": cohere_v2,
            "/v1/embed": cohere_v1}


def test_every_dense_route_chunks_on_a_chunking_server(minilm_engine: Engine,
                                                       reference: tuple[np.ndarray, int, int]) -> None:
    expected, _, tokens = reference
    truncated = minilm_engine.embed(LONG, truncate=True)
    with serve(minilm_engine, served_model_name="m", long_inputs="chunk", max_embed_len=4096) as (url, _):
        routes = _routes(url)
        for path, call in routes.items():
            vector, counted = call({})
            assert_close(vector, expected)
            assert counted in (None, tokens), (path, counted)
        # the request's own truncation wins over the server's chunking
        for path, extra in (("/v1/embeddings", {"truncate_prompt_tokens": -1}), ("/v1/embeddings", {"truncate": True}),
                            ("/pooling", {"truncate_prompt_tokens": -1}), ("/embed", {"truncate": True}),
                            ("/v2/embed", {"truncate": "END"}), ("/v1/embed", {"truncate": "END"})):
            assert_close(routes[path](extra)[0], truncated)
        # Cohere's NONE asks for an error, and --max-embed-len bounds every route
        r = httpx.post(url + "/v2/embed", json={"texts": [LONG], "model": "m", "input_type": "search_document",
                                                "truncate": "NONE"})
        assert r.status_code == 422 and "more than the limit of 256" in r.text
        r = httpx.post(url + "/v1/embeddings", json={"input": [LONG * 3], "model": "m"})
        assert r.status_code == 422 and "max_embed_len" in r.json()["error"]["message"]
        # outputs that cannot be chunked are refused by name, not truncated quietly
        r = httpx.post(url + "/embed_all", json={"inputs": LONG})
        assert r.status_code == 422, r.text


def test_the_default_server_refuses_and_truncate_servers_truncate(minilm_engine: Engine) -> None:
    with serve(minilm_engine, served_model_name="m") as (url, _):
        r = httpx.post(url + "/v1/embeddings", json={"input": [LONG], "model": "m"})
        assert r.status_code == 422 and "more than the limit of 256" in r.text
        assert_close(_routes(url)["/v1/embed"]({})[0], minilm_engine.embed(LONG, truncate=True))  # Cohere's END
    with serve(minilm_engine, served_model_name="m", long_inputs="truncate") as (url, _):
        for path, call in _routes(url).items():
            assert_close(call({})[0], minilm_engine.embed(LONG, truncate=True))
    with pytest.raises(ValueError, match="max_embed_len bounds chunked processing"):
        ServerConfig(max_embed_len=100)


def test_a_split_server_chunks_in_its_engine_core(minilm_path: Path, reference: tuple[np.ndarray, int, int]) -> None:
    expected, _, tokens = reference
    with serve_split(minilm_path, 1, "--long-inputs", "chunk", "--served-model-name", "m") as (url, _):
        vector, counted = _routes(url)["/v1/embeddings"]({})
        r = httpx.post(url + "/embed", json={"inputs": [LONG * 3]}, timeout=60)
    assert_close(vector, expected)
    assert counted == tokens
    assert r.status_code == 422 and "max_embed_len" in r.text


def test_wde_embed_chunks_long_texts(tmp_path: Path, minilm_path: Path, minilm_engine: Engine,
                                     reference: tuple[np.ndarray, int, int]) -> None:
    import pyarrow.parquet as pq

    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps({"text": t}) for t in (SHORT[0], LONG)) + "\n", encoding="utf-8")
    out = tmp_path / "out.parquet"
    args = ["embed", "-m", str(minilm_path), "--input", str(src), "--output", str(out)]
    ok = CliRunner().invoke(main, [*args, "--long-inputs", "chunk"])
    assert ok.exit_code == 0, ok.output
    col = pq.read_table(out).column("embedding").combine_chunks()
    rows = col.values.to_numpy().reshape(len(col), col.type.list_size)
    assert_close(rows[1], reference[0])
    assert np.abs(rows[0] - minilm_engine.embed(SHORT[0])).max() <= 1e-5
    bounded = CliRunner().invoke(main, [*args, "--long-inputs", "chunk", "--max-embed-len", "1000", "--overwrite"])
    assert bounded.exit_code == 1 and f"{src}:2:" in bounded.output and "(--max-embed-len)" in bounded.output
    both = CliRunner().invoke(main, [*args, "--long-inputs", "chunk", "--truncate", "--overwrite"])
    assert both.exit_code == 2 and "--truncate contradicts --long-inputs chunk" in both.output


@pytest.mark.parametrize("api_servers", ["0", "1"])
def test_wde_serve_refuses_chunking_for_a_workflow_that_cannot_in_one_line(api_servers: str, minilm_path: Path,
                                                                            tmp_path: Path) -> None:
    import subprocess
    import sys

    from tests.test_server import free_port

    folder = tiny_heads.build_minilm_classifier(minilm_path, tmp_path / "clf", num_labels=3)
    done = subprocess.run([sys.executable, "-m", "wde.cli", "serve", "-m", str(folder), "--long-inputs", "chunk",
                           "--port", str(free_port()), "--api-servers", api_servers],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("Error: --long-inputs chunk: workflow 'sequence_classification' cannot embed"), last
    assert "Traceback" not in done.stderr
