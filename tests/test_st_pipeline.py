"""sentence-transformers pipelines, module by module: folders saved by sentence-transformers itself from the
bundled MiniLM (Transformer → Pooling → Dense / LayerNorm / Dropout / Normalize) give `SentenceTransformer(folder)
.encode`'s vectors through `Engine.from_workflow(None, folder)`, at the width after the last Dense module; what
WDE does not implement is refused by name when the model is loaded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch

from tests.test_parity_minilm import TOLERANCE, parity_texts
from wde import Engine, RequestError
from wde.errors import ModelLoadError

TEXTS = parity_texts()[::3]
"""A third of the parity texts (short, long, non-ASCII), enough to cover every pooling path at a third of the time."""


@pytest.fixture(scope="module")
def build(minilm_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Save a SentenceTransformer made of the MiniLM Transformer and `modules(models)` into a new folder."""
    from sentence_transformers import SentenceTransformer

    try:
        from sentence_transformers.sentence_transformer import modules as models  # sentence-transformers >= 6
    except ImportError:
        from sentence_transformers import models

    transformer = SentenceTransformer(str(minilm_path), device="cpu")[0]

    def make(name: str, modules: Callable, **kwargs: object) -> Path:
        torch.manual_seed(sum(map(ord, name)))
        model = SentenceTransformer(modules=[transformer, *modules(models)], device="cpu", **kwargs)
        out = tmp_path_factory.mktemp(name) / "model"
        model.save(str(out))
        return out

    return make


def reference(folder: Path, texts: list[str], **kwargs: object) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(folder), device="cpu").encode(texts, batch_size=32, convert_to_numpy=True, **kwargs)


def assert_parity(got: np.ndarray, expected: np.ndarray) -> None:
    assert got.shape == expected.shape, (got.shape, expected.shape)
    diff = np.abs(got - expected).max()
    assert diff <= TOLERANCE, f"max abs diff {diff:.2e}"


PIPELINES: dict[str, Callable] = {
    "dense-tanh-normalize": lambda m: [m.Pooling(384, "mean"), m.Dense(384, 256), m.Normalize()],
    "two-dense-no-normalize": lambda m: [m.Pooling(384, "mean"), m.Dense(384, 320),
                                         m.Dense(320, 128, activation_function=torch.nn.Identity())],
    "cls-dense-normalize": lambda m: [m.Pooling(384, "cls"), m.Dense(384, 256, bias=False), m.Normalize()],
    "weightedmean": lambda m: [m.Pooling(384, "weightedmean"), m.Normalize()],
    "max": lambda m: [m.Pooling(384, "max")],
    "mean-sqrt-len": lambda m: [m.Pooling(384, "mean_sqrt_len_tokens")],
    "lasttoken": lambda m: [m.Pooling(384, "lasttoken"), m.Normalize()],
    "concat-cls-mean-dense": lambda m: [m.Pooling(384, ["cls", "mean"]), m.Dense(768, 64, activation_function=torch.nn.GELU())],
    "layernorm-dropout": lambda m: [m.Pooling(384, "mean"), m.Dense(384, 96, activation_function=torch.nn.ReLU()),
                                    m.Dropout(0.3), m.LayerNorm(96), m.Normalize()],
    "dense-residual": lambda m: [m.Pooling(384, "mean"), m.Dense(384, 384, use_residual=True),
                                 m.Dense(384, 200, use_residual=True, activation_function=torch.nn.SiLU())],
    "normalize-then-dense": lambda m: [m.Pooling(384, "max"), m.Normalize(), m.Dense(384, 48)],
}


@pytest.mark.parametrize("name", list(PIPELINES))
def test_pipeline_matches_sentence_transformers(build: Callable[..., Path], name: str) -> None:
    folder = build(name, PIPELINES[name])
    expected = reference(folder, TEXTS)
    with Engine.from_workflow(None, folder) as engine:
        assert engine.workflow.name == "bert"
        assert engine.dense_size == expected.shape[1]
        got = engine.embed(TEXTS, truncate=True)
    assert_parity(got, expected)


def test_dense_width_reaches_dimensions_and_the_routes(build: Callable[..., Path]) -> None:
    folder = build("dims", PIPELINES["dense-tanh-normalize"])
    full = reference(folder, TEXTS[:8])
    with Engine.from_workflow(None, folder) as engine:
        short = engine.embed(TEXTS[:8], dimensions=64)
        with pytest.raises(RequestError, match="dimensions=300 is larger than the model's embedding size 256"):
            engine.embed(TEXTS[:1], dimensions=300)
        from wde.engine_info import EngineInfo

        assert EngineInfo.of(engine).dense_size == 256
    expected = full[:, :64] / np.linalg.norm(full[:, :64], axis=1, keepdims=True)
    assert_parity(short, expected)


def test_prompts_left_out_of_pooling(build: Callable[..., Path]) -> None:
    """include_prompt: false — the prompt's tokens are in the model's input but not in the mean (nor is the CLS
    token, as sentence-transformers counts it); the default prompt applies when a request names none."""
    prompts = {"query": "query: find the passage that answers ", "passage": "passage: "}
    folder = build("no-prompt", lambda m: [m.Pooling(384, "mean", include_prompt=False), m.Dense(384, 128), m.Normalize()],
                   prompts=prompts, default_prompt_name="passage")
    with Engine.from_workflow(None, folder) as engine:
        assert engine.components["pooler"].include_prompt is False
        for name in ("query", "passage"):
            assert_parity(engine.embed(TEXTS, truncate=True, prompt_name=name), reference(folder, TEXTS, prompt_name=name))
        assert_parity(engine.embed(TEXTS[:10], truncate=True), reference(folder, TEXTS[:10]))
        with_prompt = engine.embed(TEXTS[:10], truncate=True)
    # the same folder pooling the prompt too gives other vectors: the exclusion is real
    cfg = folder / "1_Pooling" / "config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "include_prompt": True}))
    with Engine.from_workflow(None, folder) as engine:
        assert np.abs(engine.embed(TEXTS[:10], truncate=True) - with_prompt).max() > 1e-3


def test_cls_pooling_without_the_prompt_takes_the_first_text_token(build: Callable[..., Path]) -> None:
    folder = build("cls-no-prompt", lambda m: [m.Pooling(384, "cls", include_prompt=False)],
                   prompts={"query": "query: "})
    with Engine.from_workflow(None, folder) as engine:
        got = engine.embed(TEXTS[:20], prompt_name="query", truncate=True)
    assert_parity(got, reference(folder, TEXTS[:20], prompt_name="query"))


def test_truncate_dim(build: Callable[..., Path]) -> None:
    """`truncate_dim` in config_sentence_transformers.json: the embedding keeps its first features, then the
    model's normalization applies (sentence-transformers' `truncate_dim` with `normalize_embeddings=True`)."""
    from sentence_transformers import SentenceTransformer

    folder = build("truncate", PIPELINES["dense-tanh-normalize"])
    cfg = folder / "config_sentence_transformers.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "truncate_dim": 100}))
    expected = SentenceTransformer(str(folder), device="cpu", truncate_dim=100).encode(TEXTS, normalize_embeddings=True)
    with Engine.from_workflow(None, folder) as engine:
        assert engine.dense_size == 100
        assert_parity(engine.embed(TEXTS, truncate=True), expected)


def _rewrite_modules(folder: Path, edit: Callable[[list[dict]], None]) -> None:
    path = folder / "modules.json"
    modules = json.loads(path.read_text())
    edit(modules)
    path.write_text(json.dumps(modules))


@pytest.mark.parametrize(("edit", "message"), [
    (lambda ms: ms.append({"idx": 9, "name": "9", "path": "9_Router", "type": "sentence_transformers.models.Router"}),
     "sentence-transformers module type 'sentence_transformers.models.Router' is not implemented"),
    (lambda ms: ms.append({"idx": 9, "name": "9", "path": "9_Mine", "type": "my_package.Whitening"}),
     "module type 'my_package.Whitening' is not implemented"),
    (lambda ms: ms.insert(1, {"idx": 0, "name": "x", "path": "", "type": "sentence_transformers.models.CNN"}),
     "'sentence_transformers.models.CNN' is not implemented"),
    (lambda ms: ms.pop(1), "follow the Transformer without a Pooling module"),
])
def test_unknown_or_unrunnable_modules_are_refused(build: Callable[..., Path], edit: Callable, message: str) -> None:
    folder = build("refused", PIPELINES["dense-tanh-normalize"])
    _rewrite_modules(folder, edit)
    with pytest.raises(ModelLoadError, match="modules.json") as err:
        Engine.from_workflow(None, folder)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(("change", "message"), [
    ({"activation_function": "os.system"}, "activation_function 'os.system' is not a torch.nn module class"),
    ({"activation_function": "torch.nn.modules.linear.Bilinear"}, "cannot be built without arguments"),
    ({"in_features": 300}, "Dense takes 300 features but 384 reach it"),
    ({"module_input_name": "token_embeddings"}, "Dense reads or writes 'token_embeddings'"),
    ({"some_new_setting": 1}, "Dense settings ['some_new_setting'] are not implemented"),
])
def test_dense_settings_wde_cannot_honour_are_refused(build: Callable[..., Path], change: dict, message: str) -> None:
    folder = build("dense-refused", PIPELINES["dense-tanh-normalize"])
    cfg = folder / "2_Dense" / "config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), **change}))
    with pytest.raises(ModelLoadError) as err:
        Engine.from_workflow(None, folder)
    assert message in str(err.value)


def test_dense_weights_must_fit(build: Callable[..., Path]) -> None:
    from safetensors.torch import save_file

    folder = build("dense-weights", PIPELINES["dense-tanh-normalize"])
    save_file({"linear.weight": torch.zeros(256, 384)}, str(folder / "2_Dense" / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"2_Dense: weights do not fit the module: missing \['linear.bias'\]"):
        Engine.from_workflow(None, folder)


def test_lower_casing_is_refused(build: Callable[..., Path]) -> None:
    folder = build("lower", PIPELINES["max"])
    cfg = folder / "sentence_bert_config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "do_lower_case": True}))
    with pytest.raises(ModelLoadError, match="do_lower_case is true"):
        Engine.from_workflow(None, folder)


def test_pooling_all_gives_the_transformer_token_states(build: Callable[..., Path]) -> None:
    """As sentence-transformers' output_value="token_embeddings": before pooling, so before any Dense module."""
    from sentence_transformers import SentenceTransformer

    folder = build("all-dense", PIPELINES["dense-tanh-normalize"])
    texts = TEXTS[:6]
    expected = SentenceTransformer(str(folder), device="cpu").encode(texts, output_value="token_embeddings")
    with Engine.from_workflow(None, folder, overrides=["pooler.params.pooling=all", "pooler.params.normalize=false"]) as engine:
        outs = engine.encode(texts)
    for out, ref in zip(outs, expected):
        assert_parity(out.outputs["token_embeddings"], ref.numpy())
