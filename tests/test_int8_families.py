"""quantization: int8 on every bundled workflow (issue 38), on the tiny random folders of benchmarks/gpu_parity.py's
`families`: each one runs in float32 and with `quantization="int8"` on the same inputs, and either the int8 engine
builds (its fidelity gate passes) with every linear layer of its blocks in int8 (or in a layer kind the gate kept
float, which it logs), finite outputs close to float32's and not equal to them (the int8 layers ran), or it refuses
in one line naming why (`REFUSED`, listed in docs/int8.md's "Families").

Tiny random weights barely move the residual stream, so the cosines here say that each family's int8 path runs and
stays close, not how faithful int8 is on trained weights (tests/test_int8.py measures MiniLM's real weights)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import torch
from torch import nn

from benchmarks.gpu_parity import bundled_workflows, families, stdout_to_stderr
from wde import Engine
from wde.components.lora import LoraLinear
from wde.components.models.cpu_linear import PackedLinear
from wde.components.models.int8_linear import Bf16Linear, Int8Linear, int8_unsupported, kind_of
from wde.errors import ModelLoadError

pytestmark = pytest.mark.skipif(int8_unsupported() is not None, reason=f"no int8 kernels: {int8_unsupported()}")

MIN_COSINE = 0.99
MIN_SPEARMAN = 0.99

COL_RETRIEVAL = ("workflow '{}': building model 'col_retrieval' failed: model.params quantization: not taken by"
                 " model 'col_retrieval' (it runs transformers' modules as they are: no WDE linear kernels, mixed"
                 " precision or LoRA); it takes dtype and device")
TWO_TOWER = ("workflow '{}': building model '{}' failed: quantization=int8 does not cover model '{}': its fidelity"
             " gate probes texts only, so the vision tower would run int8 uncalibrated and unmeasured; use"
             " quantization: none")
REFUSED = {
    "colpali": COL_RETRIEVAL.format("colpali"),
    "colqwen2": COL_RETRIEVAL.format("colqwen2"),
    "clip": TWO_TOWER.format("clip", "clip", "clip"),
    "siglip": TWO_TOWER.format("siglip", "siglip", "siglip"),
    "siglip2": TWO_TOWER.format("siglip2", "siglip2", "siglip2"),
    "jina_embeddings_v3": (
        "workflow 'jina_embeddings_v3': building model 'jina_embeddings_v3' failed: quantization=int8 does not cover"
        " model 'jina_embeddings_v3': its tasks (retrieval.query, retrieval.passage, separation, classification,"
        " text-matching) are LoRA adapters, which int8 does not combine with; use quantization: none"),
}
"""The exact one-line refusal of each workflow int8 does not cover (docs/int8.md, "Families")."""

LINEARS = (nn.Linear, PackedLinear, LoraLinear, Int8Linear, Bf16Linear)
"""What a linear layer of a block is once an engine is built: int8, kept float by the gate (bf16 or packed float32),
or a plain, packed or LoRA-wrapped float layer."""


@pytest.fixture(scope="module")
def family_specs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple]]:
    """Each workflow's (builder, overrides, inputs, params), its folder built on first use; the gate's verdicts
    cached in this module's own directory."""
    root = tmp_path_factory.mktemp("families")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WDE_CACHE_DIR", str(root / "cache"))
        with stdout_to_stderr():
            specs = {f[0]: f[1:] for f in families(root)}
        yield specs


def build(specs: dict[str, tuple], workflow: str) -> tuple[Path, dict[str, Any], list, Any]:
    builder, overrides, inputs, params = specs[workflow]
    try:
        with stdout_to_stderr():
            path = builder()
    except ImportError as e:  # a family this transformers (or a missing peft) cannot build
        pytest.skip(f"{workflow}: tiny reference model not built here ({e})")
    return path, overrides, inputs, params


def block_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The linear layers (in whatever form the engine left them) inside the model's `nn.ModuleList`s, outermost
    only (an `Int8Linear` inside a LoRA wrapper counts as the wrapper)."""
    found: dict[str, nn.Module] = {}
    for prefix, blocks in model.named_modules():
        if isinstance(blocks, nn.ModuleList):
            for name, module in blocks.named_modules():
                full = f"{prefix}.{name}"
                if isinstance(module, LINEARS) and not any(full.startswith(f"{f}.") for f in found):
                    found[full] = module
    return found


def kept_float(log: str) -> set[str]:
    """The layers (by name, or by kind where all of a kind) the fidelity gate kept float, from its log line."""
    match = re.search(r"int8 fidelity gate passed: .*?kept in \w+: ([^)]*)\)", log)
    return set(match.group(1).split(", ")) if match else set()


def gate_figures(log: str) -> str:
    match = re.search(r"int8 fidelity gate passed: min cosine ([\d.]+), mean ([\d.]+)", log)
    return f"gate min {match.group(1)} mean {match.group(2)}" if match else "gate: no figures logged"


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = a.reshape(a.shape[0], -1).astype(np.float64), b.reshape(b.shape[0], -1).astype(np.float64)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1) + 1e-30)


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def as_arrays(ref: list, got: list, name: str, vocab: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Output `name` of each input as float arrays (a sparse output as a vocabulary-sized vector)."""
    def dense(x: Any) -> np.ndarray:
        if isinstance(x, dict):
            v = np.zeros(vocab)
            for k, w in x.items():
                v[int(k)] = w
            return v
        return np.asarray(x, dtype=np.float64)
    return [dense(o.outputs[name]) for o in ref], [dense(o.outputs[name]) for o in got]


def compare(ref: list, got: list, vocab: int) -> dict[str, tuple[str, float, float]]:
    """Per output: (measure, its worst value over the inputs, max abs diff to float32). Vectors (dense, sparse,
    probs): cosine per input; token matrices (colbert, token embeddings): cosine per token; scores: Spearman across
    the inputs."""
    out = {}
    for name in ref[0].outputs:
        r, g = as_arrays(ref, got, name, vocab)
        for x in g:
            assert np.isfinite(x).all(), f"{name}: non-finite int8 output"
        diff = max(float(np.abs(a - b).max(initial=0.0)) for a, b in zip(r, g))
        if r[0].ndim == 0:
            out[name] = ("spearman", spearman(np.stack(r), np.stack(g)), diff)
        elif r[0].ndim == 2:
            out[name] = ("cosine per token", min(float(cosines(a, b).min()) for a, b in zip(r, g)), diff)
        else:
            out[name] = ("cosine", float(cosines(np.stack(r), np.stack(g)).min()), diff)
    return out


def test_every_bundled_workflow_has_a_family(family_specs: dict[str, tuple]) -> None:
    assert sorted(family_specs) == bundled_workflows()
    assert set(REFUSED) <= set(family_specs)


@pytest.mark.parametrize("workflow", bundled_workflows())
def test_int8_family(workflow: str, family_specs: dict[str, tuple], caplog: pytest.LogCaptureFixture) -> None:
    if workflow not in family_specs:
        pytest.fail(f"bundled workflow {workflow!r} has no tiny family in benchmarks/gpu_parity.py")
    path, overrides, inputs, params = build(family_specs, workflow)
    if workflow in REFUSED:
        with pytest.raises(ModelLoadError) as refused:
            Engine.from_workflow(workflow, path, quantization="int8", **overrides)
        assert str(refused.value) == REFUSED[workflow]
        return
    with Engine.from_workflow(workflow, path, **overrides) as e32:
        ref = e32.encode(inputs, params)
        vocab = e32.tokenizer.vocab_size
    caplog.set_level("INFO", logger="wde.models")
    with Engine.from_workflow(workflow, path, quantization="int8", **overrides) as e8:
        layers = block_layers(e8.components["model"])
        got = e8.encode(inputs, params)
    int8 = {n for n, m in layers.items() if isinstance(m, Int8Linear)}
    kept = kept_float(caplog.text)
    assert int8, f"{workflow}: no Int8Linear in the model's blocks"
    floats = set(layers) - int8
    unkept = {n for n in floats if n not in kept and kind_of(n) not in kept}
    assert not unkept, f"{workflow}: block layers float that the gate did not keep float: {unkept}"
    scores = compare(ref, got, vocab)
    shown = ", ".join(f"{k} {m} {v:.6f} (max abs diff {d:.2g})" for k, (m, v, d) in scores.items())
    bf16_out = sorted({kind_of(n) for n in int8 if layers[n].out_dtype == torch.bfloat16})
    print(f"{workflow}: {len(int8)} of {len(layers)} block layers int8 (bf16 out: {', '.join(bf16_out) or 'none'}),"
          f" {len(floats)} kept float;"
          f" {gate_figures(caplog.text)}; {shown}")
    for name, (measure, value, _) in scores.items():
        assert value >= (MIN_SPEARMAN if measure == "spearman" else MIN_COSINE), f"{workflow} {name}: {measure}"
    assert max(d for _, _, d in scores.values()) > 0, f"{workflow}: int8 outputs equal float32's: int8 did not run"
