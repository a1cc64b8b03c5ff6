"""Model ↔ attention backend capabilities: `wde validate` refuses a workflow whose model needs what its backend
does not support (an attention bias, local windows), naming the backends that fit — before any model is loaded —
and every registration declares exactly what its class's `uses_attention_*` / `supports_*` flags say."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from wde.cli import main
from wde.errors import WorkflowError
from wde.registry import LazyComponent, capabilities_of, get_registry
from wde.workflow import load_workflow


@pytest.mark.parametrize("kind", ["model", "attention"])
def test_every_registration_declares_what_its_class_does(kind: str) -> None:
    for name, entry in get_registry().components[kind].items():
        if not isinstance(entry.value, LazyComponent):
            continue
        cls = entry.value.load()
        assert capabilities_of(entry.value) == capabilities_of(cls), f"{kind} {name!r} ({entry.value.target})"


def test_the_flags_are_read() -> None:
    registry = get_registry()
    attention = {n: capabilities_of(e.value) for n, e in registry.components["attention"].items()}
    assert attention["cpu_varlen"] == {"attention_window"}
    assert attention["torch_sdpa"] == attention["auto"] == {"attention_bias", "attention_window"}
    assert capabilities_of(registry.components["model"]["mpnet"].value) == {"attention_bias"}
    assert capabilities_of(registry.components["model"]["modernbert"].value) == {"attention_window"}


def test_a_biased_model_on_a_backend_without_bias_is_refused_by_validate(tmp_path: Path) -> None:
    wf = tmp_path / "mpnet_varlen.yaml"
    wf.write_text("name: mpnet_varlen\nextends: mpnet\nattention:\n  name: cpu_varlen\n")
    with pytest.raises(WorkflowError) as err:
        load_workflow(wf)
    message = str(err.value)
    assert f"{wf}:4:3: attention.name: model 'mpnet' adds an additive attention bias, which attention" \
           " 'cpu_varlen' does not support; attention backends that fit: auto, torch_sdpa, triton_varlen" in message
    result = CliRunner().invoke(main, ["validate", str(wf)])
    assert result.exit_code == 1 and "attention backends that fit" in result.output


def test_a_plugin_model_is_checked_too(tmp_path: Path) -> None:
    if "t5_encoder" not in get_registry().components["model"]:
        pytest.skip("the T5 example plugin is not installed")
    with pytest.raises(WorkflowError, match="model 't5_encoder' adds an additive attention bias"):
        load_workflow("sentence_t5", ["attention.name=cpu_varlen"])


def test_fitting_pairs_validate() -> None:
    assert load_workflow("modernbert", ["attention.name=cpu_varlen"]).name == "modernbert"
    assert load_workflow("mpnet", ["attention.name=torch_sdpa"]).name == "mpnet"


def test_a_missing_rename_names_the_unfilled_parameters_and_the_unused_tensors() -> None:
    import torch
    from torch import nn

    from wde.components.models.loader import load_weights
    from wde.errors import ModelLoadError

    module = nn.Module()
    module.encoder = nn.Linear(2, 2)
    weights = [("model.block.weight", torch.zeros(2, 2)), ("model.block.bias", torch.zeros(2))]
    with pytest.raises(ModelLoadError) as err:
        load_weights(module, weights, ("model.",), {})
    assert str(err.value) == ("checkpoint lacks weights for encoder.weight, encoder.bias; checkpoint tensors left"
                              " unused: model.block.weight (as block.weight), model.block.bias (as block.bias)"
                              " (a missing prefix or rename?)")
    load_weights(module, weights, ("model.",), {}, {"block": "encoder"})  # the rename fixes it
