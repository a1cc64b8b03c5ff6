"""ColPali and ColQwen2 (issue 35, page images): tiny random folders (tests/tiny_colpali.py) served by the `colpali` and
`colqwen2` workflows, against transformers' `ColPaliForRetrieval` / `ColQwen2ForRetrieval` with their processors
(`process_queries`, `process_images`, `score_retrieval`) and sentence-transformers' `MultiVectorEncoder` on the same
folder: every query's and page's token vectors within 1e-4 in fp32, MaxSim within 1e-4 relative, queries and pages
in one engine step, Qwen2-VL's preprocessing to the bit, the routes, and what is refused."""

from __future__ import annotations

import base64
import io
import json
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from tests.test_server import serve
from tests.tiny_colpali import QUERIES, build_colpali, build_colqwen2, page_image
from wde import Engine
from wde.errors import ModelLoadError, RequestError
from wde.request import PoolingParams

FAMILIES = ("colpali", "colqwen2")
TOL = 1e-4
PAGES = [(40, 60), (90, 50), (300, 210), (12, 20), (57, 57)]
"""Page sizes (width, height): ColQwen2 resizes each to its own grid, down to max_pixels and up to min_pixels."""


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("colpali")
    return {"colpali": build_colpali(root / "colpali"), "colqwen2": build_colqwen2(root / "colqwen2")}


@pytest.fixture(scope="module")
def engines(folders: dict[str, Path]):
    built = {name: Engine.from_workflow(None, folder) for name, folder in folders.items()}
    yield built
    for engine in built.values():
        engine.close()


@pytest.fixture(scope="module")
def references(folders: dict[str, Path]):
    from transformers import AutoProcessor, ColPaliForRetrieval, ColQwen2ForRetrieval

    classes = {"colpali": ColPaliForRetrieval, "colqwen2": ColQwen2ForRetrieval}
    return {name: (classes[name].from_pretrained(folder).eval(), AutoProcessor.from_pretrained(folder, backend="pil"))
            for name, folder in folders.items()}


def pages() -> list[bytes]:
    return [page_image(w, h, seed=i) for i, (w, h) in enumerate(PAGES)]


def pil(data: bytes):  # noqa: ANN201
    from PIL import Image

    return Image.open(io.BytesIO(data))


def reference_vectors(reference, queries: list[str], images: list[bytes]) -> list[torch.Tensor]:  # noqa: ANN001
    """transformers' token vectors of each input, run in one batch per side as the processors make them, each cut to
    its attention mask."""
    model, processor = reference
    out = []
    with torch.no_grad():
        for batch in (processor.process_queries(queries), processor.process_images([pil(b) for b in images])):
            inputs = {k: v for k, v in batch.items() if k != "labels"}
            vectors = model(**inputs).embeddings
            out += [v[m.bool()] for v, m in zip(vectors, batch["attention_mask"])]
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_picked_from_the_folder(engines: dict[str, Engine], family: str) -> None:
    engine = engines[family]
    assert engine.workflow.name == family
    assert engine.supported_outputs == ("colbert",) and engine.scorer.scoring == "maxsim"
    assert engine.request_options == {"task": ("document", "query")}


@pytest.mark.parametrize("family", FAMILIES)
def test_queries_and_pages_match_transformers(engines: dict[str, Engine], references, family: str) -> None:
    engine, images = engines[family], pages()
    want = reference_vectors(references[family], QUERIES, images)
    batches: list = []
    engine.on_batch = batches.append
    try:
        got = engine.encode([*QUERIES, *images])  # one call, queries and pages mixed in one step
    finally:
        engine.on_batch = None
    assert [b.num_requests for b in batches] == [len(want)]
    for i, (out, ref) in enumerate(zip(got, want)):
        vectors = out.outputs["colbert"]
        assert vectors.shape == tuple(ref.shape), i
        assert np.abs(vectors - ref.numpy()).max() <= TOL, i
        assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
        assert out.num_prompt_tokens == ref.shape[0]
    assert got[0].outputs["colbert"].shape[1] == 24  # the config's embedding_dim
    # the same inputs one at a time give the same vectors (padding within a batch changes nothing)
    alone = engine.encode([images[2]])[0].outputs["colbert"]
    assert np.abs(alone - got[len(QUERIES) + 2].outputs["colbert"]).max() <= 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_maxsim_matches_score_retrieval(engines: dict[str, Engine], references, family: str) -> None:
    engine, images = engines[family], pages()
    _, processor = references[family]
    vectors = reference_vectors(references[family], QUERIES, images)
    queries, docs = vectors[:len(QUERIES)], vectors[len(QUERIES):]
    for q, query in zip(queries, QUERIES):
        # pair by pair: score_retrieval pads a batch's shorter pages with zero vectors, which can raise a max to 0
        want = np.array([float(processor.score_retrieval([q], [d])[0, 0]) for d in docs])
        got = engine.score([(query, image) for image in images])
        assert np.abs(got - want).max() <= TOL * np.abs(want).max(), (query, got, want)
    ranked = engine.rerank(QUERIES[0], images)
    assert sorted(i for i, _ in ranked) == list(range(len(images)))
    assert [s for _, s in ranked] == sorted((s for _, s in ranked), reverse=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_multi_vector_encoder_loads_the_same_folder(engines: dict[str, Engine], folders: dict[str, Path],
                                                    family: str) -> None:
    from sentence_transformers import MultiVectorEncoder

    st = MultiVectorEncoder(str(folders[family]), device="cpu")
    images = pages()[:3]
    got = engines[family].encode([*QUERIES, *images])
    want = [*st.encode_query(QUERIES), *st.encode_document([pil(b) for b in images])]
    for out, ref in zip(got, want):
        ref = ref.float().numpy() if isinstance(ref, torch.Tensor) else np.asarray(ref, dtype=np.float32)
        assert out.outputs["colbert"].shape == ref.shape
        assert np.abs(out.outputs["colbert"] - ref).max() <= TOL


def test_qwen2_vl_pixels_are_the_processors_to_the_bit(engines: dict[str, Engine], references) -> None:
    """Qwen2VLPreprocessor against transformers' PIL-backend Qwen2VLImageProcessor: pixel values and grid of pages of
    odd sizes and modes, larger than max_pixels and smaller than min_pixels."""
    from PIL import Image

    processor = references["colqwen2"][1].image_processor
    ours = engines["colqwen2"].input_processor
    rng = np.random.default_rng(3)
    images = [pil(b) for b in pages()]
    images += [Image.fromarray(rng.integers(0, 256, (33, 71), dtype=np.uint8), "L"),
               Image.fromarray(rng.integers(0, 256, (45, 29, 4), dtype=np.uint8), "RGBA")]
    for image in images:
        want = processor(image, return_tensors="np")
        got = ours.preprocessor(image)
        h, w = int(want["image_grid_thw"][0][1]), int(want["image_grid_thw"][0][2])
        assert got.shape == (h, w, want["pixel_values"].shape[1])
        assert np.array_equal(got.reshape(h * w, -1), want["pixel_values"])
        assert ours.vision_tokens(*image.size) == h * w // 4


def test_token_vectors_unnormalized_on_request(engines: dict[str, Engine]) -> None:
    engine = engines["colpali"]
    raw = engine.encode([QUERIES[0]], PoolingParams(normalize=False))[0].outputs["colbert"]
    normed = engine.encode([QUERIES[0]])[0].outputs["colbert"]
    assert not np.allclose(np.linalg.norm(raw, axis=1), 1.0)
    assert np.abs(raw / np.linalg.norm(raw, axis=1, keepdims=True) - normed).max() <= 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_sides_follow_the_processor(engines: dict[str, Engine], family: str) -> None:
    """Texts are queries and pages documents: the task option may name an input's own side, never the other."""
    engine, image = engines[family], pages()[0]
    query = PoolingParams(options={"task": "query"})
    document = PoolingParams(options={"task": "document"})
    same = engine.encode([QUERIES[0]], query)[0].outputs["colbert"]
    assert np.array_equal(same, engine.encode([QUERIES[0]])[0].outputs["colbert"])
    assert engine.encode([image], document)[0].outputs["colbert"].shape[0] > 0
    with pytest.raises(RequestError, match="texts are queries") as e:
        engine.encode([QUERIES[0]], document)
    assert e.value.field == "options.task"
    with pytest.raises(RequestError, match="page images are documents"):
        engine.encode([image], query)
    for params, field in ((PoolingParams(prompt_name="query"), "prompt_name"),
                          (PoolingParams(dimensions=8), "dimensions")):
        with pytest.raises(RequestError) as e:
            engine.encode([QUERIES[0]], params)
        assert e.value.field == field


def test_long_query_refused_not_cut(engines: dict[str, Engine]) -> None:
    engine = engines["colqwen2"]
    with pytest.raises(RequestError, match="not truncated") as e:
        engine.encode([" ".join(["water"] * 600)], PoolingParams(truncate=True))
    assert e.value.kind == "too_long"


def test_oversized_page_refused_by_its_limit(folders: dict[str, Path]) -> None:
    with Engine.from_workflow(None, folders["colqwen2"],
                              overrides=["input_processor.params.max_image_pixels=10000"]) as engine:
        assert engine.encode([page_image(100, 100)])[0].outputs["colbert"].shape[0] > 0
        with pytest.raises(RequestError, match="max_image_pixels") as e:
            engine.encode([page_image(101, 100)])
        assert e.value.kind == "image_too_large"


def test_folder_settings_not_implemented_are_refused(folders: dict[str, Path], tmp_path: Path) -> None:
    broken = shutil.copytree(folders["colpali"], tmp_path / "colpali")
    cfg = json.loads((broken / "processor_config.json").read_text())
    (broken / "processor_config.json").write_text(json.dumps({**cfg, "max_num_visual_tokens": 64}))
    with pytest.raises(ModelLoadError, match="max_num_visual_tokens is not implemented"):
        Engine.from_workflow(None, broken)
    fixed = shutil.copytree(folders["colqwen2"], tmp_path / "colqwen2")
    cfg = json.loads((fixed / "processor_config.json").read_text())
    cfg["image_processor"]["do_resize"] = False
    (fixed / "processor_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="do_resize is false"):
        Engine.from_workflow(None, fixed)
    moved = shutil.copytree(folders["colqwen2"], tmp_path / "moved")
    cfg = json.loads((moved / "config.json").read_text())
    cfg["vlm_config"]["image_token_id"] = 7
    (moved / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="vlm_config.image_token_id is 7"):
        Engine.from_workflow(None, moved)


def test_workflow_settings_it_does_not_take_are_refused(folders: dict[str, Path]) -> None:
    for override, match in (("attention.params.causal=true", "transformers' own attention"),
                            ("model.params.cpu_linear=onednn", "model.params cpu_linear: not taken"),
                            ("model.params.lora.enable=true", "model.params lora: not taken"),
                            ("request_processor.params.pad_text=max_length", "pad_text"),
                            ("tokenizer.params.add_eos=true", "add_eos")):
        with pytest.raises(ModelLoadError, match=match):
            Engine.from_workflow(None, folders["colpali"], overrides=[override])


# -- HTTP ----------------------------------------------------------------------------------------------------------


def data_uri(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


@pytest.fixture(scope="module")
def url(engines: dict[str, Engine]):
    with serve(engines["colqwen2"], served_model_name="m") as (base, _):
        yield base


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def test_pooling_token_embed_of_queries_and_pages(url: str, engines: dict[str, Engine]) -> None:
    engine, images = engines["colqwen2"], pages()[:3]
    want = engine.encode([*QUERIES[:2], *images])
    r = post(url, "/pooling", {"model": "m", "input": QUERIES[:2], "task": "token_embed", "input_type": "query"})
    assert r.status_code == 200, r.text
    r2 = post(url, "/pooling", {"model": "m", "input": [data_uri(b) for b in images], "modality": "image",
                                "task": "token_embed", "input_type": "document"})
    assert r2.status_code == 200, r2.text
    got = [item["data"] for item in r.json()["data"] + r2.json()["data"]]
    for g, w in zip(got, want):
        assert np.abs(np.array(g, dtype=np.float32) - w.outputs["colbert"]).max() <= 1e-5
    assert r2.json()["usage"]["prompt_tokens"] == sum(w.num_prompt_tokens for w in want[2:])
    # TEI's /embed_all gives a query's token vectors too
    r = post(url, "/embed_all", {"inputs": QUERIES[:2]})
    assert r.status_code == 200, r.text
    for g, w in zip(r.json(), want[:2]):
        assert np.abs(np.array(g, dtype=np.float32) - w.outputs["colbert"]).max() <= 1e-5
    # the other side is refused by name, as in Python
    r = post(url, "/pooling", {"model": "m", "input": QUERIES[:1], "task": "token_embed", "input_type": "document"})
    assert r.status_code == 422 and "options.task" in r.text and "texts are queries" in r.text
    # a page sent as a text is refused: /pooling's input is texts unless modality says images
    r = post(url, "/pooling", {"model": "m", "input": [data_uri(images[0])], "task": "token_embed"})
    assert r.status_code == 422 and "data:image/ URI in a field that carries texts" in r.text


def test_score_route_scores_a_query_against_pages(url: str, engines: dict[str, Engine]) -> None:
    engine, images = engines["colqwen2"], pages()
    want = engine.score([(QUERIES[1], image) for image in images])
    content = {"content": [{"type": "image_url", "image_url": {"url": data_uri(b)}} for b in images]}
    for shape in ({"text_1": QUERIES[1], "text_2": content}, {"queries": [QUERIES[1]], "documents": content}):
        r = post(url, "/v1/score", {"model": "m", **shape})
        assert r.status_code == 200, r.text
        got = np.array([d["score"] for d in r.json()["data"]], dtype=np.float32)
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    r = post(url, "/v1/score", {"model": "m", "text_1": QUERIES[1],
                                "text_2": {"content": [{"type": "text", "text": "a page as text"}]}})
    assert r.status_code == 422 and "text_2.content[0] is a text part" in r.text


def test_oversized_page_over_http_names_the_limit(folders: dict[str, Path]) -> None:
    with Engine.from_workflow(None, folders["colpali"],
                              overrides=["input_processor.params.max_image_pixels=10000"]) as engine:
        with serve(engine, served_model_name="m") as (base, _):
            body = {"model": "m", "input": [data_uri(page_image(120, 100))], "modality": "image",
                    "task": "token_embed"}
            r = post(base, "/pooling", body)
            assert 400 <= r.status_code < 500, r.text
            assert "max_image_pixels" in r.text and "input[0]" in r.text
            r = post(base, "/v1/score", {"model": "m", "text_1": QUERIES[0], "text_2": {"content": [
                {"type": "image_url", "image_url": {"url": data_uri(page_image(120, 100))}}]}})
            assert 400 <= r.status_code < 500 and "max_image_pixels" in r.text, r.text


def test_split_engine_serves_pages_and_queries(folders: dict[str, Path], engines: dict[str, Engine]) -> None:
    """`wde serve --api-servers 1`: the API server renders and tokenizes queries and decodes pages (their pixels
    travel to the core as arrays, its token ids rebuilt there from their grids); the vectors are the engine's."""
    from tests.test_server import serve_split

    engine, images = engines["colqwen2"], pages()[:3]
    want = engine.encode([*QUERIES[:2], *images])
    with serve_split(folders["colqwen2"], 1) as (base, _):
        r = post(base, "/pooling", {"input": QUERIES[:2], "task": "token_embed"})
        assert r.status_code == 200, r.text
        r2 = post(base, "/pooling", {"input": [data_uri(b) for b in images], "modality": "image",
                                     "task": "token_embed"})
        assert r2.status_code == 200, r2.text
    got = [item["data"] for item in r.json()["data"] + r2.json()["data"]]
    for g, w in zip(got, want):
        assert np.abs(np.array(g, dtype=np.float32) - w.outputs["colbert"]).max() <= 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_a_batch_cut_over_cpu_streams_changes_nothing(folders: dict[str, Path], family: str) -> None:
    """A batch of queries and pages split into pieces (the runner's CPU streams, each piece its own padded runs):
    every input's vectors are the ones it gets alone."""
    inputs = [x for i in range(6) for x in (QUERIES[i % len(QUERIES)] + f" {i}", page_image(30 + 17 * i, 44, seed=i))]
    with Engine.from_workflow(None, folders[family],
                              runner={"params": {"cpu_streams": 2, "cpu_stream_min_tokens": 32,
                                                  "cpu_stream_max_mean_tokens": 100000}}) as engine:
        batches: list = []
        engine.on_batch = batches.append
        together = engine.encode(inputs)
        engine.on_batch = None
        assert [b.num_requests for b in batches] == [len(inputs)]
        for x, out in zip(inputs, together):
            alone = engine.encode([x])[0].outputs["colbert"]
            assert np.abs(alone - out.outputs["colbert"]).max() <= 1e-5


def test_cohere_embed_takes_pages_and_queries(url: str, engines: dict[str, Engine]) -> None:
    """Cohere /v2/embed: `images` with input_type search_document (or image) and `texts` with search_query give the
    token matrices; texts as search_document are refused by name."""
    engine, images = engines["colqwen2"], pages()[:2]
    want = engine.encode([QUERIES[0], *images])
    r = post(url, "/v2/embed", {"model": "m", "images": [data_uri(b) for b in images],
                                "input_type": "search_document", "embedding_types": ["float"]})
    assert r.status_code == 200, r.text
    q = post(url, "/v2/embed", {"model": "m", "texts": QUERIES[:1], "input_type": "search_query",
                                "embedding_types": ["float"]})
    assert q.status_code == 200, q.text
    got = q.json()["embeddings"]["float"] + r.json()["embeddings"]["float"]
    for g, w in zip(got, want):
        assert np.abs(np.array(g, dtype=np.float32) - w.outputs["colbert"]).max() <= 1e-5
    r = post(url, "/v2/embed", {"model": "m", "texts": QUERIES[:1], "input_type": "search_document",
                                "embedding_types": ["float"]})
    assert r.status_code == 422 and "options.task" in r.text
