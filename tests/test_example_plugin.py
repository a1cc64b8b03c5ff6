"""The example third-party plugin (examples/wde-plugin-example), installed with pip, works end to end.

Skipped when the package is not installed, except under CI (which installs it), where that is a failure.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from click.testing import CliRunner

from wde import Engine, WorkflowError
from wde.cli import main
from wde.plugins import make_plugin_manager
from wde.registry import Registry, get_registry
from wde.workflow import load_workflow

DISTRIBUTION = "wde-plugin-example"
PLUGIN = "wde_plugin_example"
WORKFLOW = "bert_mean_max"

if importlib.util.find_spec(PLUGIN) is None:
    if os.environ.get("CI"):
        pytest.fail(f"{DISTRIBUTION} must be installed in CI: pip install ./examples/wde-plugin-example",
                    pytrace=False)
    pytest.skip(f"{DISTRIBUTION} is not installed (pip install ./examples/wde-plugin-example)",
                allow_module_level=True)

TEXTS = ["This is an example sentence", "naïve café — 東京", "Short", "the water was hot " * 20]


def workflow_params() -> dict:
    """The pooler params the plugin's YAML sets, read from the file rather than from the engine."""
    data = yaml.safe_load(get_registry().workflow_path(WORKFLOW).read_text(encoding="utf-8"))
    assert data["extends"] == "bert" and data["pooler"]["name"] == "mean_max"
    return data["pooler"]["params"]


def test_entry_point_registers_component_and_workflow() -> None:
    reg = get_registry()
    assert reg.components["pooler"]["mean_max"].plugin == PLUGIN
    assert reg.workflows[WORKFLOW].plugin == PLUGIN
    wf = load_workflow(WORKFLOW)
    assert wf.components["pooler"].name == "mean_max" and wf.components["pooler"].plugin == PLUGIN
    assert wf.components["model"].name == "bert" and wf.architectures == ("BertModel",)
    assert wf.components["pooler"].params.model_dump() == workflow_params()


def test_wde_plugins_lists_it() -> None:
    result = CliRunner().invoke(main, ["plugins", "--format", "json"])
    assert result.exit_code == 0
    listing = json.loads(result.output)[PLUGIN]
    assert listing == {"components": ["pooler:mean_max"], "workflows": [WORKFLOW]}


@pytest.mark.parametrize(("allow", "loaded"), [("", False), ("wde-plugin-example", True), ("someone-else", False)])
def test_allowlist(monkeypatch: pytest.MonkeyPatch, allow: str, loaded: bool) -> None:
    monkeypatch.setenv("WDE_LOAD_PLUGINS", allow)
    reg = Registry.from_plugin_manager(make_plugin_manager())
    assert (WORKFLOW in reg.workflows) == loaded
    if not loaded:
        with pytest.raises(WorkflowError, match=f"unknown workflow '{WORKFLOW}'"):
            load_workflow(WORKFLOW, registry=reg)


def test_plugin_params_are_validated_like_builtins() -> None:
    with pytest.raises(WorkflowError) as info:
        load_workflow(WORKFLOW, ["pooler.params.max_wieght=2"])
    assert "unknown param 'max_wieght' for pooler 'mean_max'; did you mean 'max_weight'?" in str(info.value)
    with pytest.raises(WorkflowError, match="greater than 0"):
        load_workflow(WORKFLOW, ["pooler.params.max_weight=-1"])


def reference_mean_max(model_path: Path, texts: list[str], max_weight: float) -> np.ndarray:
    """[mean ; max_weight * max] of transformers' last hidden states, L2-normalized: the plugin's math, redone."""
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_path))
    model = AutoModel.from_pretrained(str(model_path)).eval()
    rows = []
    for text in texts:
        with torch.no_grad():
            states = model(**tok(text, return_tensors="pt")).last_hidden_state[0].numpy()
        row = np.concatenate([states.mean(0), max_weight * states.max(0)])
        rows.append(row / np.linalg.norm(row))
    return np.stack(rows)


def test_engine_serves_the_plugin_pooler(minilm_path: Path) -> None:
    params = workflow_params()
    with Engine.from_workflow(WORKFLOW, minilm_path) as engine:
        got = engine.embed(TEXTS)
        raw = engine.embed(TEXTS, normalize=False)
        assert engine.supported_outputs == ("dense",)
    expected = reference_mean_max(minilm_path, TEXTS, params["max_weight"])
    assert got.shape == (len(TEXTS), 2 * 384)
    assert np.abs(got - expected).max() <= 1e-4
    assert np.abs(raw / np.linalg.norm(raw, axis=1, keepdims=True) - got).max() <= 1e-5
    with Engine.from_workflow(WORKFLOW, minilm_path, pooler={"params": {"max_weight": 1.0}}) as engine:
        unweighted = engine.embed(TEXTS)
    assert np.abs(unweighted - reference_mean_max(minilm_path, TEXTS, 1.0)).max() <= 1e-4
    assert np.abs(unweighted - got).max() > 1e-3
