"""LoRA adapters behind `wde serve` (wde/server/lora_routes.py, `ServedModels.pick`): a request's `model` naming an
adapter runs with it (vLLM's convention) and matches sentence-transformers' `load_adapter`, the base name runs
without; vLLM's `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` behind the API key with the bound; in one
process and with an engine core in its own process (`--api-servers 2`, adapters given with `--lora-modules`)."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.test_lora import make_adapter, minilm, reference
from tests.test_server import serve, serve_split
from wde import Engine
from wde.server.lora_routes import lora_module_overrides
from wde.server.startup import StartupError

TOL = 1e-4
TEXTS = ["A man is eating food.", "The new movie is awesome", "Berlin has 3.5 million people."]
KEY = {"Authorization": "Bearer k"}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("server-lora")
    targets = ["query", "key", "value", "dense"]
    return {"first": make_adapter(minilm(), root / "a", 100, r=4, lora_alpha=8, target_modules=targets),
            "second": make_adapter(minilm(), root / "b", 101, r=8, lora_alpha=8, target_modules=targets)}


def embed(url: str, model: str, **extra: object) -> httpx.Response:
    return httpx.post(f"{url}/v1/embeddings", json={"model": model, "input": TEXTS, **extra}, headers=KEY, timeout=60)


def vectors(response: httpx.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    return np.array([d["embedding"] for d in response.json()["data"]])


def test_model_names_an_adapter_and_adapters_load_and_unload(adapters: dict[str, Path]) -> None:
    engine = Engine.from_workflow(None, minilm(), lora_modules={"first": adapters["first"]},
                                  overrides=["model.params.lora.max_adapters=2"])
    try:
        with serve(engine, api_key="k", served_model_name="minilm") as (url, _):
            first = embed(url, "first")
            assert first.json()["model"] == "first"
            assert np.abs(vectors(first) - reference(minilm(), adapters["first"], TEXTS)).max() <= TOL
            assert np.abs(vectors(embed(url, "minilm")) - reference(minilm(), None, TEXTS)).max() <= TOL
            cards = httpx.get(f"{url}/v1/models", headers=KEY).json()["data"]
            assert [(c["id"], c.get("parent")) for c in cards] == [("minilm", None), ("first", "minilm")]
            assert httpx.get(f"{url}/v1/models/first", headers=KEY).json()["parent"] == "minilm"
            missing = embed(url, "second")
            assert missing.status_code == 404 and "'first'" in missing.text
            contradicts = embed(url, "first", options={"adapter": "none"})
            assert contradicts.status_code == 422 and "options.adapter" in contradicts.text

            load = {"lora_name": "second", "lora_path": str(adapters["second"])}
            assert httpx.post(f"{url}/v1/load_lora_adapter", json=load).status_code == 401  # behind the key
            loaded = httpx.post(f"{url}/v1/load_lora_adapter", json=load, headers=KEY, timeout=60)
            assert loaded.status_code == 200, loaded.text
            assert np.abs(vectors(embed(url, "second")) - reference(minilm(), adapters["second"], TEXTS)).max() <= TOL
            again = httpx.post(f"{url}/v1/load_lora_adapter", json=load, headers=KEY, timeout=60)
            assert again.status_code == 422 and "already loaded" in again.text
            inplace = httpx.post(f"{url}/v1/load_lora_adapter", json={**load, "load_inplace": True}, headers=KEY,
                                 timeout=60)
            assert inplace.status_code == 200, inplace.text
            third = httpx.post(f"{url}/v1/load_lora_adapter", headers=KEY, timeout=60,
                               json={"lora_name": "third", "lora_path": str(adapters["first"])})
            assert third.status_code == 422 and "max_adapters = 2" in third.text  # the bound
            clash = httpx.post(f"{url}/v1/load_lora_adapter", headers=KEY, timeout=60,
                               json={"lora_name": "minilm", "lora_path": str(adapters["first"])})
            assert clash.status_code == 422 and "served model" in clash.text
            broken = httpx.post(f"{url}/v1/load_lora_adapter", headers=KEY, timeout=60,
                                json={"lora_name": "broken", "lora_path": str(adapters["first"].parent)})
            assert broken.status_code == 422 and "adapter_config.json" in broken.text

            unload = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "second"}, headers=KEY)
            assert unload.status_code == 200, unload.text
            assert embed(url, "second").status_code == 404
            assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "second"},
                              headers=KEY).status_code == 404
            assert httpx.get(f"{url}/info", headers=KEY).json()["options"] == {"adapter": ["none", "first"]}
    finally:
        engine.close()


def test_run_time_loading_needs_adapters_enabled(adapters: dict[str, Path]) -> None:
    engine = Engine.from_workflow(None, minilm())
    try:
        with serve(engine) as (url, _):
            r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "first",
                                                                 "lora_path": str(adapters["first"])}, timeout=60)
            assert r.status_code == 422 and "lora.enable=true" in r.text
    finally:
        engine.close()


def test_lora_modules_with_an_engine_core_process(adapters: dict[str, Path]) -> None:
    with serve_split(Path(minilm()), 2, "--served-model-name", "minilm",
                     "--lora-modules", f"first={adapters['first']}") as (url, _):
        got = vectors(httpx.post(f"{url}/v1/embeddings", json={"model": "first", "input": TEXTS}, timeout=60))
        assert np.abs(got - reference(minilm(), adapters["first"], TEXTS)).max() <= TOL
        base = vectors(httpx.post(f"{url}/v1/embeddings", json={"model": "minilm", "input": TEXTS}, timeout=60))
        assert np.abs(base - reference(minilm(), None, TEXTS)).max() <= TOL
        r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "second",
                                                             "lora_path": str(adapters["second"])}, timeout=60)
        assert r.status_code == 424 and "--api-servers 0" in r.text


@pytest.mark.parametrize(("specs", "models", "named"), [
    (["first"], 1, "NAME=PATH"),
    (["a.b=/x"], 1, "letters, digits"),
    (["first=/x"], 2, "one model"),
])
def test_bad_lora_modules_are_refused_in_one_line(specs: list[str], models: int, named: str) -> None:
    with pytest.raises(StartupError, match=named):
        lora_module_overrides(specs, models)


def test_lora_modules_become_the_models_adapter_overrides() -> None:
    assert lora_module_overrides(["legal=/srv/adapters/legal v2"], 1) == [
        'model.params.lora.modules.legal="/srv/adapters/legal v2"']
