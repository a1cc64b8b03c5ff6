"""WDE's activation table (wde/components/models/activations.py) against transformers' `ACT2FN`, which it replaces
so that a model load does not import transformers' activations module (~3 s of CPU a process)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from transformers.activations import ACT2FN

from wde.components.models.activations import ACTIVATIONS, activation
from wde.components.models.cpu_linear import post_op_for
from wde.components.models.fused import _is_silu
from wde.errors import ModelLoadError


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_name_computes_what_transformers_computes(name: str, dtype: torch.dtype) -> None:
    """The same torch calls in the same order: the same values bit for bit, over a range that reaches the tails."""
    x = (torch.randn(257, 96, generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
    x[0, :4] = torch.tensor([0.0, -0.0, 30.0, -30.0])
    ours, theirs = activation(name)(x), ACT2FN[name](x)
    assert ours.dtype == theirs.dtype
    assert torch.equal(ours, theirs), (name, (ours.float() - theirs.float()).abs().max())


def test_the_table_covers_transformers_table_less_the_learned_ones() -> None:
    from transformers.activations import ACT2CLS

    assert set(ACT2CLS) - set(ACTIVATIONS) == {"prelu", "xielu"}
    assert set(ACTIVATIONS) <= set(ACT2CLS)


def test_an_unknown_name_is_refused_by_name() -> None:
    for name in ("prelu", "gelu2", None):
        with pytest.raises(ModelLoadError, match=f"activation {name!r} is not implemented; known: .*gelu_new"):
            activation(name)


def test_fusion_recognizes_both_tables() -> None:
    """cpu_linear's oneDNN post-ops and the SiLU * up kernel take WDE's modules and transformers' alike."""
    for name, op in [("gelu", ("gelu", "none")), ("gelu_new", ("gelu", "tanh")), ("gelu_pytorch_tanh", ("gelu", "tanh")),
                     ("relu", ("relu", "")), ("quick_gelu", None), ("silu", None)]:
        assert post_op_for(activation(name)) == op, name
        assert post_op_for(ACT2FN[name]) == op, name
    assert _is_silu(activation("silu")) and _is_silu(ACT2FN["silu"]) and _is_silu(activation("swish"))
    assert not _is_silu(activation("gelu"))


def test_loading_the_families_does_not_import_transformers_activations() -> None:
    """What made every model-building process ~3 s slower to start: transformers' activations module imports its
    hub-kernel integration and `torch.distributed.tensor`."""
    code = ("import sys, wde.components.models.bert, wde.components.models.decoder_layers, wde.components.classifier,"
            " wde.components.models.cpu_linear, wde.components.models.modernbert, wde.components.models.deberta_v2;"
            " print(sorted(m for m in ('transformers.activations', 'torch.distributed.tensor') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
