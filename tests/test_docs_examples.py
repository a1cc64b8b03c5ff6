"""Every example in README.md and docs/*.md that talks to the server, run verbatim against a live server.

HTTP examples (a fenced block `POST /path` + JSON body, then the status and the documented answer) are sent as
written; the answer must have the documented status and shape (the same keys at every level, the same types)
and the same model names. Python examples that talk to `http://127.0.0.1:8000` run with only that address
changed. Routes that need another kind of model (rerank, classify, bge-m3's sparse output) run against a tiny
model of that kind served under the name the docs give it; everything else runs against the default model.
"""

from __future__ import annotations

import json
import re
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from tests import tiny_heads
from tests.test_server import serve
from wde import Engine

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

NEEDS = {
    "/pooling": "bge_m3", "/embed_sparse": "bge_m3",
    "/score": "reranker", "/v1/score": "reranker", "/rerank": "reranker", "/v1/rerank": "reranker",
    "/v2/rerank": "reranker",
    "/classify": "classifier", "/v1/classify": "classifier", "/predict": "classifier",
}
"""Routes whose examples need a model other than the default embedder (docs/http_api.md names the command)."""

EXACT = {"model", "served_model_name", "model_id", "object", "workflow", "owned_by", "root"}
"""Keys whose documented string values must be exactly what the server answers."""


@dataclass
class HttpExample:
    where: str
    method: str
    path: str
    body: Any
    status: int
    answer: str

    def __str__(self) -> str:
        return f"{self.where} {self.method} {self.path}"


def _blocks(path: Path) -> Iterator[tuple[int, str, str, str]]:
    """(line, language, text, last heading) of every fenced block of a Markdown file."""
    heading, lang, start, lines = "", None, 0, []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if lang is None and line.startswith("#"):
            heading = line
        if line.startswith("```"):
            if lang is None:
                lang, start, lines = line[3:].strip(), n, []
            else:
                yield start, lang, "\n".join(lines), heading
                lang = None
        elif lang is not None:
            lines.append(line)


def http_examples() -> list[HttpExample]:
    out = []
    for doc in DOCS:
        for line, lang, text, heading in _blocks(doc):
            first, _, rest = text.partition("\n")
            where = f"{doc.relative_to(ROOT)}:{line}"
            request = re.fullmatch(r"(GET|POST) (/\S*)", first.strip())
            titled = re.match(r"#+ GET (/\S+)", heading)
            if lang or not (request or (titled and re.fullmatch(r"\d{3}", first.strip()))):
                continue
            if request:
                method, path = request.groups()
                if method == "GET":  # no body: the status line follows the request line
                    body_text, answer = "", rest.strip()
                else:
                    body_text, _, answer = rest.strip().partition("\n\n")
            else:
                method, path, body_text, answer = "GET", titled.group(1), "", text
            status, _, answer = answer.strip().partition("\n")
            body = json.loads(body_text) if body_text.strip() else None
            out.append(HttpExample(where, method, path, body, int(status), answer))
    return out


def python_examples() -> list[tuple[str, str]]:
    """docs/integrations.md's recipes run in tests/test_integrations.py instead: each in its own process, outside
    the source tree (whose `workflows/` package hides llama-index's), with their vectors checked."""
    return [(f"{doc.relative_to(ROOT)}:{line}", text) for doc in DOCS if doc.name != "integrations.md"
            for line, lang, text, _ in _blocks(doc) if lang == "python" and "127.0.0.1:8000" in text]


def documented_json(text: str) -> Any:
    """A documented answer as JSON: `...` marks elided items (`[0.1, ...]`, `[...]`)."""
    text = re.sub(r"\[\s*\.\.\.\s*\]", "[]", text)
    text = re.sub(r",\s*\.\.\.", "", text)
    return json.loads(text)


def shape_problems(doc: Any, got: Any, at: str = "answer") -> list[str]:
    """Where `got` differs from the documented `doc` in keys, types or exact names."""
    if isinstance(doc, dict):
        if not isinstance(got, dict):
            return [f"{at}: documented an object, the server answers {got!r:.80}"]
        if doc and all(k.isdigit() for k in doc):  # a map keyed by token id: keys are data, not fields
            return shape_problems(next(iter(doc.values())), next(iter(got.values())), f"{at}[*]") if got else []
        problems = [] if set(doc) == set(got) else \
            [f"{at}: documented keys {sorted(doc)}, the server answers {sorted(got)}"]
        for key in doc.keys() & got.keys():
            if key in EXACT and isinstance(doc[key], str) and doc[key] != got[key]:
                problems.append(f"{at}.{key}: documented {doc[key]!r}, the server answers {got[key]!r}")
            problems += shape_problems(doc[key], got[key], f"{at}.{key}")
        return problems
    if isinstance(doc, list):
        if not isinstance(got, list):
            return [f"{at}: documented a list, the server answers {got!r:.80}"]
        return shape_problems(doc[0], got[0], f"{at}[0]") if doc and got else []
    if doc is None or got is None:
        return []
    kinds = (bool, (int, float), str)
    for kind in kinds:
        if isinstance(doc, kind) and not (kind is not bool and isinstance(doc, bool)):
            same = isinstance(got, kind) and (kind is bool or not isinstance(got, bool))
            return [] if same else [f"{at}: documented {doc!r}, the server answers {got!r:.80}"]
    return []


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Base URLs by kind, each server started on first use and stopped at the end of the module."""
    tmp = tmp_path_factory.mktemp("docs-models")
    builders = {
        "default": lambda: (Engine.from_workflow(None), {}),
        "reranker": lambda: (Engine.from_workflow("bge_reranker_v2_m3", tiny_heads.build_xlmr_classifier(
            tmp / "bge-reranker-v2-m3", num_labels=1)), {"model": "BAAI/bge-reranker-v2-m3"}),
        "classifier": lambda: _classifier(tmp / "my-sentiment-classifier"),
        "bge_m3": lambda: (Engine.from_workflow("bge_m3", tiny_heads.build_bge_m3(tmp / "bge-m3")),
                           {"model": "BAAI/bge-m3"}),
    }
    with ExitStack() as stack:
        urls: dict[str, str] = {}

        class Lazy(dict):
            def __missing__(self, kind: str) -> str:
                engine, config = builders[kind]()
                stack.enter_context(engine)
                urls[kind] = stack.enter_context(serve(engine, **config))[0]
                return urls[kind]

        yield Lazy()


def _classifier(path: Path) -> tuple[Engine, dict[str, str]]:
    labels = {0: "neg", 1: "neu", 2: "pos"}
    tiny_heads.build_xlmr_classifier(path, num_labels=3, id2label=labels, label2id={v: k for k, v in labels.items()})
    return Engine.from_workflow(None, path), {"model": str(path)}  # a local folder is served by its name


def test_docs_have_server_examples() -> None:
    paths = {e.path for e in http_examples()}
    assert {"/v1/embeddings", "/v1/models", "/v1/rerank", "/embed", "/info"} <= paths, paths
    assert python_examples(), "no OpenAI client example found in the docs"


@pytest.mark.parametrize("example", http_examples(), ids=str)
def test_http_example_works_verbatim(example: HttpExample, servers: dict[str, str]) -> None:
    url = servers[NEEDS.get(example.path, "default")]
    r = httpx.request(example.method, url + example.path, json=example.body, timeout=60)
    assert r.status_code == example.status, f"{example}: documented {example.status}, got {r.status_code}: {r.text}"
    problems = shape_problems(documented_json(example.answer), r.json())
    assert not problems, f"{example}: the documented answer is not what the server answers:\n" + "\n".join(problems)


@pytest.mark.parametrize("where,code", python_examples(), ids=[w for w, _ in python_examples()])
def test_python_example_works_verbatim(where: str, code: str, servers: dict[str, str],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("openai")
    if "huggingface_hub" in code:  # the suite runs with HF_HUB_OFFLINE=1, under which its client refuses every URL
        from huggingface_hub import constants

        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    namespace: dict[str, Any] = {}
    exec(compile(code.replace("http://127.0.0.1:8000", servers["default"]), where, "exec"), namespace)
    vectors = namespace.get("vectors")
    assert vectors is None or (len(vectors) > 0 and len(vectors[0]) == 384), where


def test_readme_python_snippet_runs_from_any_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's snippet names its workflow by its registered name, so it works outside the source tree."""
    readme = ROOT / "README.md"
    (where, code), = [(f"README.md:{line}", text) for line, lang, text, _ in _blocks(readme)
                      if lang == "python" and "from_workflow" in text]
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {}
    exec(compile(code, where, "exec"), namespace)
    try:
        assert namespace["vectors"].shape == (2, 384)
    finally:
        namespace["engine"].close()


def test_shape_check_catches_a_wrong_doc() -> None:
    """The checker itself: a renamed key, a wrong model name or a wrong type is reported."""
    doc = documented_json('{"object": "list", "model": "m", "data": [{"index": 0, "embedding": [0.1, ...]}]}')
    good = {"object": "list", "model": "m", "data": [{"index": 0, "embedding": [0.2, 0.3]}]}
    assert shape_problems(doc, good) == []
    assert shape_problems(doc, {**good, "model": "other"})
    assert shape_problems(doc, {**good, "data": [{"index": 0, "vector": [0.2]}]})
    assert shape_problems(doc, {**good, "data": [{"index": "0", "embedding": [0.2]}]})
