"""The T5-encoder example plugin (examples/wde-plugin-t5): parity with transformers' T5EncoderModel and the
sentence-transformers pipeline, built from `wde.api` alone.

Skipped when the package is not installed, except under CI (which installs it), where that is a failure.
"""

from __future__ import annotations

import ast
import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.tiny_models import build_bert, varied_texts
from tests.tiny_t5 import build_sentence_t5
from wde import Engine
from wde.components.attention.torch_sdpa import TorchSDPABackend
from wde.errors import ModelLoadError, WorkflowError
from wde.plugins import make_plugin_manager
from wde.registry import Registry, get_registry

PLUGIN = "wde_plugin_t5"
ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "examples/wde-plugin-t5" / PLUGIN

if importlib.util.find_spec(PLUGIN) is None:
    if os.environ.get("CI"):
        pytest.fail("wde-plugin-t5 must be installed in CI: pip install -e ./examples/wde-plugin-t5", pytrace=False)
    pytest.skip("wde-plugin-t5 is not installed (pip install -e ./examples/wde-plugin-t5)", allow_module_level=True)

TEXTS = varied_texts(10, seed=3)
SDPA = {"name": "torch_sdpa"}
TOL = 1e-4


@pytest.fixture(scope="module", params=["gated-gelu", "relu"])
def st_t5(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_sentence_t5(tmp_path_factory.mktemp(f"t5-{request.param}"), request.param)


def st_reference(folder: Path, texts: list[str]) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(folder), device="cpu").encode(texts, convert_to_numpy=True)


def test_plugin_imports_only_the_public_api() -> None:
    """Every `wde` import in the plugin's package goes through `wde.api`."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            offenders += [f"{path.name}:{node.lineno} {n}" for n in names if n.split(".")[0] == "wde" and n != "wde.api"]
    assert len(list(PACKAGE.rglob("*.py"))) >= 4
    assert offenders == []


def test_entry_point_registers_components_workflow_and_architecture() -> None:
    reg = get_registry()
    assert reg.components["model"]["t5_encoder"].plugin == PLUGIN
    assert reg.components["pooler"]["sentence_dense"].plugin == PLUGIN
    assert reg.workflows["sentence_t5"].plugin == PLUGIN
    assert reg.architectures["T5EncoderModel"].plugin == PLUGIN


def test_matches_sentence_transformers(st_t5: Path) -> None:
    with Engine.from_workflow(None, st_t5, dtype="float32", device="cpu") as engine:
        assert engine.workflow.name == "sentence_t5"  # picked by the T5EncoderModel architecture
        assert engine.components["attention"].name == "auto"  # the workflow's own choice
        got = engine.embed(TEXTS)
        raw = engine.embed(TEXTS, normalize=False)
    ref = st_reference(st_t5, TEXTS)
    assert got.shape == ref.shape == (len(TEXTS), 64)
    assert np.abs(got - ref).max() <= TOL
    assert np.abs(raw / np.linalg.norm(raw, axis=1, keepdims=True) - got).max() <= 1e-5


def test_hidden_states_match_transformers(st_t5: Path) -> None:
    from transformers import AutoTokenizer, T5EncoderModel

    tok = AutoTokenizer.from_pretrained(str(st_t5))
    ref_model = T5EncoderModel.from_pretrained(str(st_t5)).eval()
    pooler = {"name": "sentence", "params": {"pooling": "all", "normalize": False}}
    with Engine.from_workflow("sentence_t5", st_t5, attention=SDPA, pooler=pooler, dtype="float32",
                              device="cpu") as engine:
        outs = engine.encode(TEXTS[:6])
    for text, out in zip(TEXTS[:6], outs):
        with torch.no_grad():
            ref = ref_model(**tok(text, return_tensors="pt")).last_hidden_state[0].numpy()
        assert np.abs(out.outputs["token_embeddings"] - ref).max() <= TOL


def test_the_relative_bias_is_what_makes_parity(st_t5: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from wde_plugin_t5.model import T5EncoderModel

    texts = TEXTS[:4]
    monkeypatch.setattr(T5EncoderModel, "attention_bias", lambda self, batch: torch.zeros(
        self.config.num_heads, batch.max_seqlen, batch.max_seqlen))
    with Engine.from_workflow("sentence_t5", st_t5, attention=SDPA, dtype="float32", device="cpu") as engine:
        unbiased = engine.embed(texts)
    assert np.abs(unbiased - st_reference(st_t5, texts)).max() > 1e-3


def test_triton_kernel_with_bias_matches(st_t5: Path) -> None:
    """The Triton kernel (interpreted on CPU, so only short texts) with the same bias."""
    texts = ["hello world", "the water was hot", "a"]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with Engine.from_workflow("sentence_t5", st_t5, attention={"name": "triton_varlen"}, dtype="float32",
                              device=device) as engine:
        got = engine.embed(texts)
    assert np.abs(got - st_reference(st_t5, texts)).max() <= TOL


class NoBiasBackend(TorchSDPABackend):
    name = "no_bias_sdpa"
    supports_bias = False


def test_registry_argument_and_bias_capability(st_t5: Path, tmp_path: Path) -> None:
    """`Engine.from_workflow(registry=)` resolves through a registry built without entry points, with the
    architecture check applied; a backend without `supports_bias` is refused by name."""
    import wde_plugin_t5.plugin as plugin

    pm = make_plugin_manager(load_entrypoints=False)
    pm.register(plugin, name="t5_under_test")
    reg = Registry.from_plugin_manager(pm)
    reg.add_component(NoBiasBackend, plugin="test")
    assert reg.workflows["sentence_t5"].plugin == "t5_under_test"
    with Engine.from_workflow("sentence_t5", st_t5, attention=SDPA, registry=reg, device="cpu") as engine:
        assert engine.embed(["hello"]).shape == (1, 64)
    with pytest.raises(ModelLoadError, match="serves \\['T5EncoderModel'\\]"):
        Engine.from_workflow("sentence_t5", build_bert(tmp_path / "bert"), registry=reg, device="cpu")
    with pytest.raises(WorkflowError, match="attention 'no_bias_sdpa' does not support"):  # wde validate's check
        Engine.from_workflow("sentence_t5", st_t5, attention={"name": "no_bias_sdpa"}, registry=reg, device="cpu")


def test_registering_the_plugin_imports_no_torch() -> None:
    """Components are registered lazily with torch-free params, so `wde plugins` / `wde validate` stay light."""
    import subprocess
    import sys

    code = ("import sys; from wde.plugins import make_plugin_manager; from wde.registry import Registry; "
            "reg = Registry.from_plugin_manager(make_plugin_manager()); assert 'sentence_t5' in reg.workflows; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    env = {**os.environ, "WDE_LOAD_PLUGINS": "wde-plugin-t5"}
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env=env, timeout=120)
