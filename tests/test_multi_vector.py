"""Late interaction (the `multi_vector` workflow) against sentence-transformers 6's own `MultiVectorEncoder`, on
folders it saves here (fp32 CPU): each token matrix of `encode_query` / `encode_document` (same rows, <= 1e-4) with
and without prompts, fixed and min query expansion with and without `attend`, skiplists on either side,
`keep_only_token_ids`, chains of Dense modules with a Normalize between them, on a tiny random BERT with
all-MiniLM-L6-v2's tokenizer and on all-MiniLM-L6-v2 itself; queries and documents in one engine step, and through a
split engine's API server and core; `maxsim` against `similarity` (maxsim and meanmaxsim); the workflow picked from
the folder; and what is refused, by name."""

from __future__ import annotations

import json
import shutil
import string
from pathlib import Path

import numpy as np
import pytest
import torch

from wde import Engine, PoolingParams
from wde.components.multi_vector import maxsim
from wde.engine import resolve
from wde.errors import ModelLoadError, RequestError

TOL = 1e-4
QUERY = PoolingParams(truncate=True, options={"task": "query"})
DOCUMENT = PoolingParams(truncate=True, options={"task": "document"})
TEXTS = ["what is the capital of france?", "hi", "Paris is the capital of France. It has, many museums!",
         "berlin, bonn; and hamburg? " * 6, "a b c d e f g h i j k l m n o p", "naïve café: größe, 東京!"]


def tiny_backbone(minilm_path: Path, out: Path) -> Path:
    """A tiny random BertModel (hidden 32, 2 layers) with all-MiniLM-L6-v2's tokenizer: real punctuation and a
    [MASK] token, quick to save and run."""
    from transformers import AutoTokenizer, BertConfig, BertModel

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(minilm_path)
    cfg = BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=512)
    BertModel(cfg).eval().save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def backbone(tmp_path_factory: pytest.TempPathFactory, minilm_path: Path) -> Path:
    return tiny_backbone(minilm_path, tmp_path_factory.mktemp("mv-backbone"))


def build(backbone: Path, out: Path, *, prompts: dict | None = None, expansion: dict | None = None,
          query_length: int | None = None, document_length: int | None = None, skiplist: list[str] | None = None,
          skiplist_tasks: list[str] | None = None, keep_only: list[int] | None = None, dims: tuple[int, ...] = (16,),
          similarity: str | None = None, normalize_between: bool = False) -> Path:
    """A MultiVectorEncoder folder saved by sentence-transformers, as a user builds one: Transformer, per-token
    Dense modules (the first linear, any further ones with tanh and a bias, with `normalize_between` each after a
    per-token Normalize), MultiVectorMask, per-token Normalize."""
    from sentence_transformers import MultiVectorEncoder
    from sentence_transformers.base.modules import Dense, Normalize, Transformer
    from sentence_transformers.multi_vector_encoder.modules import MultiVectorMask

    torch.manual_seed(1)
    transformer = Transformer(str(backbone), query_length=query_length, document_length=document_length,
                              query_expansion=expansion)
    width = transformer.get_embedding_dimension()
    modules: list = [transformer]
    for i, dim in enumerate(dims):
        if i and normalize_between:
            modules.append(Normalize(module_input_name="token_embeddings"))
        modules.append(Dense(width, dim, bias=i > 0, activation_function=torch.nn.Tanh() if i else None,
                             module_input_name="token_embeddings"))
        width = dim
    modules += [MultiVectorMask(skiplist, skiplist_tasks=skiplist_tasks, keep_only_token_ids=keep_only),
                Normalize(module_input_name="token_embeddings")]
    MultiVectorEncoder(modules=modules, prompts=prompts, similarity_fn_name=similarity, device="cpu").save(str(out))
    return out


def st_model(folder: Path):  # noqa: ANN201 - a sentence_transformers.MultiVectorEncoder
    from sentence_transformers import MultiVectorEncoder

    return MultiVectorEncoder(str(folder), device="cpu")


def assert_parity(engine: Engine, st, texts: list[str]) -> None:  # noqa: ANN001
    """Every text as a query and as a document: the same token rows as sentence-transformers, within TOL."""
    for params, expected in ((QUERY, st.encode_query(texts)), (DOCUMENT, st.encode_document(texts))):
        for text, out, want in zip(texts, engine.encode(texts, params), expected):
            got = out.outputs["colbert"]
            assert got.shape == tuple(want.shape), (params.options, text)
            assert np.abs(got - want.numpy()).max(initial=0.0) <= TOL, (params.options, text)


def assert_one_step(engine: Engine, st, texts: list[str]) -> None:  # noqa: ANN001
    """Every text as a query and as a document, all packed into one engine step (queries and documents
    interleaved): the same token rows as sentence-transformers' encode_query / encode_document, within TOL."""
    requests, expected = [], []
    for params, encode in ((QUERY, st.encode_query), (DOCUMENT, st.encode_document)):
        requests += [engine.make_request(text, params) for text in texts]
        expected += list(encode(texts))
    order = [i for pair in zip(range(len(texts)), range(len(texts), 2 * len(texts))) for i in pair]
    batches: list = []
    engine.on_batch = batches.append
    try:
        done = engine.run([requests[i] for i in order])
    finally:
        engine.on_batch = None
    assert [b.num_requests for b in batches] == [len(requests)]
    for request, want in zip(requests, expected):
        got = done[request.request_id].outputs["colbert"]
        assert got.shape == tuple(want.shape) and np.abs(got - want.numpy()).max(initial=0.0) <= TOL


VARIANTS = {
    "prompts-fixed-masked-skiplist": dict(prompts={"query": "[Q] ", "document": "[D] "},
                                          expansion={"strategy": "fixed", "length": 12}, document_length=24,
                                          skiplist=list(string.punctuation)),
    "no-prompts-fixed-attend": dict(expansion={"strategy": "fixed", "length": 12, "attend": True}),
    "min-masked": dict(prompts={"query": "query: "}, expansion={"strategy": "min", "length": 10},
                       query_length=14, skiplist=[",", "?"]),
    "min-attend-own-token": dict(expansion={"strategy": "min", "length": 10, "attend": True, "token": "[unused1]"}),
    "no-expansion-both-sides-skiplist": dict(prompts={"passage": "passage: "}, query_length=8, document_length=20,
                                             skiplist=[",", ".", "notaword"], skiplist_tasks=["query", "document"],
                                             dims=(24, 16), normalize_between=True, similarity="meanmaxsim"),
    "keep-only-ids": dict(keep_only=[1996, 1010, 1012, 2003], skiplist=["."]),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_sentence_transformers(variant: str, backbone: Path, tmp_path: Path) -> None:
    folder = build(backbone, tmp_path / variant, **VARIANTS[variant])
    with Engine.from_workflow(None, folder) as engine:
        assert engine.workflow.name == "multi_vector"
        assert engine.request_options == {"task": ("document", "query")}
        assert_parity(engine, st_model(folder), TEXTS)


def test_prompts_as_sentence_transformers_picks_them(backbone: Path, tmp_path: Path) -> None:
    """A folder whose prompts name neither `query` nor `document`: encode_query / encode_document apply none (not
    `passage`, not `default_prompt_name`), and a request's `prompt_name` picks one."""
    folder = build(backbone, tmp_path / "st", expansion={"strategy": "min", "length": 10})
    _edit(folder / "config_sentence_transformers.json",
          lambda cfg: cfg.update(prompts={"passage": "passage: ", "search": "search: "}, default_prompt_name="search"))
    st = st_model(folder)
    with Engine.from_workflow(None, folder) as engine:
        assert_parity(engine, st, TEXTS)
        for task, encode in (("query", st.encode_query), ("document", st.encode_document)):
            params = PoolingParams(prompt_name="passage", options={"task": task})
            got, = engine.encode([TEXTS[0]], params)
            want = encode([TEXTS[0]], prompt_name="passage")[0]
            assert got.outputs["colbert"].shape == tuple(want.shape)
            assert np.abs(got.outputs["colbert"] - want.numpy()).max() <= TOL


def classic_colbert(minilm_path: Path, out: Path) -> Path:
    """all-MiniLM-L6-v2 as a classic ColBERT: [Q]/[D] prompts, 32-token fixed expansion without attend, 180-token
    documents, a punctuation skiplist, a 128-wide projection."""
    return build(minilm_path, out, dims=(128,), prompts={"query": "[Q] ", "document": "[D] "},
                 expansion={"strategy": "fixed", "length": 32}, query_length=32, document_length=180,
                 skiplist=list(string.punctuation))


@pytest.fixture(scope="module")
def colbert_minilm(minilm_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return classic_colbert(minilm_path, tmp_path_factory.mktemp("colbert-minilm") / "st")


@pytest.fixture(scope="module")
def colbert(colbert_minilm: Path):
    with Engine.from_workflow(None, colbert_minilm) as engine:
        yield engine


def test_real_weights_match_sentence_transformers(colbert: Engine, colbert_minilm: Path) -> None:
    assert_parity(colbert, st_model(colbert_minilm), TEXTS + ["a long document " * 120])


def test_queries_and_documents_in_one_engine_step(colbert: Engine, colbert_minilm: Path) -> None:
    """Queries (expanded, their expansion masked as keys) and documents (skiplist) packed into one batch, the
    request's prompt overriding the task's, and `normalize=False` for one request."""
    st = st_model(colbert_minilm)
    requests, expected = [], []
    for i, text in enumerate(TEXTS):
        query = i % 2 == 0
        requests.append(colbert.make_request(text, QUERY if query else DOCUMENT))
        expected.append((st.encode_query if query else st.encode_document)([text])[0])
    requests.append(colbert.make_request(TEXTS[0], PoolingParams(prompt_name="document", options={"task": "query"})))
    expected.append(st.encode_query([TEXTS[0]], prompt_name="document")[0])
    requests.append(colbert.make_request(TEXTS[2], PoolingParams(normalize=False)))
    unnormalized = type(st)(modules=list(st)[:-1], prompts=st.prompts, device="cpu")
    expected.append(unnormalized.encode_document([TEXTS[2]])[0])
    batches: list = []
    colbert.on_batch = batches.append
    try:
        done = colbert.run(requests)
    finally:
        colbert.on_batch = None
    assert [b.num_requests for b in batches] == [len(requests)]
    for request, want in zip(requests, expected):
        got = done[request.request_id].outputs["colbert"]
        assert got.shape == tuple(want.shape) and np.abs(got - want.numpy()).max() <= TOL


@pytest.mark.parametrize("variant", ["prompts-fixed-masked-skiplist", "min-masked"])
def test_split_engine_serves_queries_as_one_engine_does(variant: str, backbone: Path, tmp_path: Path) -> None:
    """A split engine's API server tokenizes and expands a query (its `Frontend`), and its core receives the token
    ids: their trailing expansion tokens are masked as keys again, so the vectors are those of one engine."""
    from wde.core.frontend import Frontend, core_request

    folder = build(backbone, tmp_path / variant, **VARIANTS[variant])
    with Engine.from_workflow(None, folder) as engine:
        frontend = Frontend(*resolve(None, folder), engine.info)
        for i, (text, query) in enumerate(zip(TEXTS, engine.encode(TEXTS, QUERY))):
            ready, = frontend.tokenize([frontend.make_request(text, QUERY, f"r{i}", "input")])
            assert ready.token_ids == query.prompt_token_ids, text
            done = engine.run([core_request(f"r{i}", ready.token_ids, ready.token_type_ids, QUERY)])
            assert np.abs(done[f"r{i}"].outputs["colbert"] - query.outputs["colbert"]).max() <= 1e-6, text


@pytest.mark.parametrize("similarity", ["maxsim", "meanmaxsim"])
def test_maxsim_matches_similarity(colbert: Engine, colbert_minilm: Path, similarity: str) -> None:
    st = st_model(colbert_minilm)
    st.similarity_fn_name = similarity
    queries = [o.outputs["colbert"] for o in colbert.encode(TEXTS[:2], QUERY)]
    documents = [torch.from_numpy(o.outputs["colbert"]) for o in colbert.encode(TEXTS, DOCUMENT)]
    expected = st.similarity([torch.from_numpy(q) for q in queries], documents)
    for q, want in zip(queries, expected):
        got = maxsim(torch.from_numpy(q), documents, similarity)  # type: ignore[arg-type]
        assert torch.allclose(got, want.float(), rtol=TOL, atol=0)


def test_pooler_exposes_similarity(backbone: Path, tmp_path: Path, colbert: Engine) -> None:
    assert colbert.components["pooler"].similarity_fn_name == "maxsim"
    assert colbert.components["pooler"].vector_size == 128
    folder = build(backbone, tmp_path / "mean", similarity="meanmaxsim")
    with Engine.from_workflow(None, folder) as engine:
        assert engine.components["pooler"].similarity_fn_name == "meanmaxsim"


def test_workflow_picked_from_the_folder(colbert_minilm: Path, minilm_path: Path, tmp_path: Path) -> None:
    """BertModel gets `multi_vector` for a MultiVectorEncoder folder (by its model_type, or a MultiVectorMask in
    modules.json) and `bert` for every other."""
    assert resolve(None, colbert_minilm)[0].name == "multi_vector"
    assert resolve(None, minilm_path)[0].name == "bert"
    masked = _copy(colbert_minilm, tmp_path / "mask-only")
    _edit(masked / "config_sentence_transformers.json", lambda cfg: cfg.pop("model_type"))
    assert resolve(None, masked)[0].name == "multi_vector"


def test_requests_refused_by_name(colbert: Engine) -> None:
    with pytest.raises(RequestError, match="option task='passage'") as e:
        colbert.encode(["x"], PoolingParams(options={"task": "passage"}))
    assert e.value.field == "options.task"
    with pytest.raises(RequestError, match="cannot be truncated") as e:
        colbert.encode(["x"], PoolingParams(dimensions=8))
    assert e.value.field == "dimensions"
    with pytest.raises(RequestError, match="more than the 32 a query may have \\(query_expansion length"):
        colbert.encode(["word " * 40], PoolingParams(options={"task": "query"}))
    with pytest.raises(RequestError, match="more than the 180 a document may have \\(document_length"):
        colbert.encode(["word " * 200])
    with pytest.raises(RequestError, match="not produced"):
        colbert.encode(["x"], PoolingParams(outputs=("dense",)))


def _copy(folder: Path, out: Path) -> Path:
    return Path(shutil.copytree(folder, out))


def _edit(path: Path, change) -> None:  # noqa: ANN001
    cfg = json.loads(path.read_text())
    change(cfg)
    path.write_text(json.dumps(cfg))


def _add_module(folder: Path, type_name: str) -> None:
    _edit(folder / "modules.json", lambda mods: mods.append({"idx": len(mods), "name": "x", "path": "",
                                                             "type": type_name}))


REFUSALS = {
    "normalize-on-sentence-embedding": (
        lambda f: _edit(f / "3_Normalize/config.json", lambda c: c.update(module_input_name="sentence_embedding")),
        "Normalize module_input_name is 'sentence_embedding'"),
    "other-token-pooling": (
        lambda f: _add_module(f, "sentence_transformers.multi_vector_encoder.modules.token_pooling."
                                 "LambdaTokenPooling"),
        "LambdaTokenPooling.* is not implemented .*WDE implements HierarchicalTokenPooling"),
    "similarity": (
        lambda f: _edit(f / "config_sentence_transformers.json", lambda c: c.update(similarity_fn_name="cosine")),
        "similarity_fn_name 'cosine' is not implemented"),
    "pylate-keys": (
        lambda f: _edit(f / "config_sentence_transformers.json", lambda c: c.update(query_prefix="[unused0]")),
        "settings \\['query_prefix'\\] are not implemented"),
    "expansion-strategy": (
        lambda f: _edit(f / "sentence_bert_config.json", lambda c: c["query_expansion"].update(strategy="dynamic")),
        "query_expansion strategy 'dynamic' is not implemented"),
    "transformer-setting": (
        lambda f: _edit(f / "sentence_bert_config.json", lambda c: c.update(processing_kwargs={"text": {"x": 1}})),
        "processing_kwargs"),
    "mask-setting": (
        lambda f: _edit(f / "2_MultiVectorMask/config.json", lambda c: c.update(pool_factor=2)),
        "MultiVectorMask settings \\['pool_factor'\\] are not implemented"),
    "document-length-over-model": (
        lambda f: _edit(f / "sentence_bert_config.json", lambda c: c.update(document_length=4096)),
        "document_length 4096 is more than the 512 tokens"),
    "no-mask": (
        lambda f: _edit(f / "modules.json", lambda mods: mods.pop(2)),
        "exactly one MultiVectorMask"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_folders_refused_by_name(case: str, backbone: Path, tmp_path_factory: pytest.TempPathFactory,
                                 tmp_path: Path) -> None:
    base = tmp_path_factory.getbasetemp() / "mv-refusal-base"
    if not base.exists():
        build(backbone, base, expansion={"strategy": "fixed", "length": 12}, skiplist=["."])
    folder = _copy(base, tmp_path / case)
    change, message = REFUSALS[case]
    change(folder)
    with pytest.raises(ModelLoadError, match=message):
        Engine.from_workflow("multi_vector", folder)


def test_attention_that_cannot_mask_keys_refused_for_masked_expansion(backbone: Path, tmp_path: Path) -> None:
    """Query expansion without `attend` needs a backend that masks keys; one that cannot (a plugin's) is refused at
    load, naming it, rather than letting queries attend to their expansion tokens. With `attend` it serves."""
    from wde.components.attention.torch_sdpa import TorchSDPABackend
    from wde.registry import get_registry

    class NoKeyMask(TorchSDPABackend):
        name = "test_no_key_mask"
        supports_key_mask = False

    registry = get_registry()
    registry.add_component(NoKeyMask, plugin="tests.test_multi_vector")
    try:
        masked = build(backbone, tmp_path / "masked", expansion={"strategy": "fixed", "length": 8})
        with pytest.raises(ModelLoadError, match="attention backend 'test_no_key_mask' cannot mask keys"):
            Engine.from_workflow(None, masked, overrides=["attention.name=test_no_key_mask"])
        attend = build(backbone, tmp_path / "attend", expansion={"strategy": "fixed", "length": 8, "attend": True})
        with Engine.from_workflow(None, attend, overrides=["attention.name=test_no_key_mask"]) as engine:
            assert_parity(engine, st_model(attend), TEXTS[:3])
    finally:  # the registry is the process's: later tests (tests/test_capabilities.py lists the backends) see none
        del registry.components["attention"][NoKeyMask.name]


def test_plain_folder_refused_by_the_workflow(minilm_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="serves sentence-transformers MultiVectorEncoder folders"):
        Engine.from_workflow("multi_vector", minilm_path)


def test_wde_embed_writes_multi_vector_rows_for_queries_and_documents(colbert: Engine, colbert_minilm: Path,
                                                                      tmp_path: Path) -> None:
    """`wde embed --outputs colbert` writes one list of token vectors per record; `--option task=query` embeds the
    records as queries; an option the workflow does not take is refused naming --option."""
    import pyarrow.parquet as pq
    from click.testing import CliRunner

    from wde.cli import main

    src = tmp_path / "in.txt"
    src.write_text("\n".join(TEXTS[:3]) + "\n", encoding="utf-8")
    for task, params in (("document", DOCUMENT), ("query", QUERY)):
        out = tmp_path / f"{task}.parquet"
        done = CliRunner().invoke(main, ["embed", "-m", str(colbert_minilm), "--input", str(src), "--output", str(out),
                                         "--outputs", "colbert", "--option", f"task={task}", "--truncate"])
        assert done.exit_code == 0 and f"wrote 3 rows to {out}" in done.output, done.output
        rows = pq.read_table(out).column("colbert").to_pylist()
        want = colbert.encode(TEXTS[:3], params)
        for row, w in zip(rows, want):
            assert np.abs(np.array(row) - w.outputs["colbert"]).max() <= 1e-6
    bad = CliRunner().invoke(main, ["embed", "-m", str(colbert_minilm), "--input", str(src), "--output",
                                    str(tmp_path / "x.parquet"), "--outputs", "colbert", "--option", "task=passage"])
    assert bad.exit_code == 1 and "--option: option task='passage'" in bad.output, bad.output
