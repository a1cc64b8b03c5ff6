"""Mixed precision on CPU (`model.params.mixed_precision`): bf16 linear layers, float32 everywhere else.

Every family the engine serves is built three ways from the same tiny random weights (float32, bf16 mixed, bf16
pure) and each output is compared with the float32 one. bf16 matmuls run on any CPU (emulated where the CPU lacks
native bf16: slower, same numbers), so these tests run everywhere; the MiniLM precision bound is in
tests/test_cpu_bf16.py.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests import tiny_decoders, tiny_heads, tiny_models
from tests.test_cpu_bf16 import cosines
from tests.tiny_models import varied_texts
from wde import Engine
from wde.request import PoolingParams
from wde.components.models.cpu_linear import PackedLinear, onednn_available, onednn_error
from wde.components.models.mixed_precision import (CastLinear, cast_linears, float32_outside_linears,
                                                   resolve_mixed_precision)

TEXTS = [" ".join(t.split()[:12]) for t in varied_texts(24, seed=5)]
PAIRS = [(TEXTS[0], t) for t in TEXTS[1:12]]
BF16 = "bfloat16"
MEAN = ["pooler.params.pooling=mean"]

cpu, cuda = torch.device("cpu"), torch.device("cuda")


def test_auto_is_mixed_for_low_precision_on_cpu_only() -> None:
    assert resolve_mixed_precision("auto", cpu, torch.bfloat16)
    assert resolve_mixed_precision("auto", cpu, torch.float16)
    assert not resolve_mixed_precision("auto", cpu, torch.float32)
    assert not resolve_mixed_precision("auto", cuda, torch.float16)
    assert not resolve_mixed_precision("auto", cuda, torch.bfloat16)
    assert not resolve_mixed_precision(False, cpu, torch.bfloat16)
    assert resolve_mixed_precision(True, cpu, torch.bfloat16)
    assert not resolve_mixed_precision(True, cpu, torch.float32)  # nothing to mix
    assert not resolve_mixed_precision(False, cuda, torch.float16)


def test_true_on_a_gpu_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"model.params.mixed_precision=true is supported on CPU only.*cuda"):
        resolve_mixed_precision(True, cuda, torch.float16)


def test_cast_linears_casts_weights_and_inputs() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Sequential(nn.Linear(16, 4, bias=False)), nn.LayerNorm(4))
    x = torch.randn(5, 8)
    w0, b0, w2 = (t.detach().bfloat16() for t in (model[0].weight, model[0].bias, model[2][0].weight))
    with torch.no_grad():
        expected = F.linear(F.gelu(F.linear(x.bfloat16(), w0, b0)), w2)
        assert cast_linears(model, torch.bfloat16) == 2
        out = model[:3](x)
    assert type(model[0]) is CastLinear and type(model[2][0]) is CastLinear
    assert model[0].weight.dtype == model[0].bias.dtype == torch.bfloat16 and model[2][0].bias is None
    assert model[3].weight.dtype == torch.float32  # not a linear layer: untouched
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)


def test_float32_outside_linears_then_cast_linears_copies_no_linear_weight() -> None:
    """The load path of a mixed model: built in bf16, all but the linear layers moved to float32, the linear layers
    wrapped in place (their bf16 weights are not copied, so a big model never holds them twice)."""
    with torch.device("cpu"):
        model = nn.Sequential(nn.Embedding(10, 8), nn.LayerNorm(8), nn.Linear(8, 8)).to(torch.bfloat16)
    model.register_buffer("positions", torch.arange(4))
    model[1].register_buffer("table", torch.ones(3, dtype=torch.bfloat16))
    weight = model[2].weight.data_ptr()
    float32_outside_linears(model)
    assert model[0].weight.dtype == model[1].weight.dtype == model[1].bias.dtype == model[1].table.dtype == torch.float32
    assert model.positions.dtype == torch.int64 and model[2].weight.dtype == torch.bfloat16
    cast_linears(model, torch.bfloat16)
    assert type(model[2]) is CastLinear and model[2].weight.data_ptr() == weight


@pytest.mark.skipif(not onednn_available() or onednn_error(torch.float32) is not None,
                    reason="oneDNN runs no prepacked float32 linear here")
def test_packed_linear_casts_its_input() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(8, 16)
    x = torch.randn(5, 8).bfloat16()
    with torch.no_grad():
        out = PackedLinear(linear, rows=8)(x)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, linear(x.float()), rtol=1e-5, atol=1e-5)


def _dense(engine: Engine) -> dict[str, np.ndarray]:
    return {"dense": engine.embed(TEXTS)}


def _m3(engine: Engine) -> dict[str, np.ndarray]:
    outs = engine.encode(TEXTS, PoolingParams(outputs=("dense", "sparse", "colbert")))
    vocab = int(engine.source.hf_config.vocab_size)
    sparse = np.zeros((len(outs), vocab), dtype=np.float32)  # lexical weights as rows over the vocabulary
    for row, o in zip(sparse, outs):
        for token, weight in o.outputs["sparse"].items():
            row[token] = weight
    return {
        "dense": np.stack([o.outputs["dense"] for o in outs]),
        "colbert": np.concatenate([o.outputs["colbert"] for o in outs]),
        "sparse": sparse,
    }


def _gemma(folder: Path) -> Path:
    from tests.test_embeddinggemma import build

    return build(folder)


Case = tuple[str, Callable[[Path], Path], list[str], Callable[[Engine], dict[str, np.ndarray]]]

CASES: dict[str, Case] = {
    "bert": ("bert", tiny_models.build_bert, MEAN, _dense),
    "xlm_roberta": ("xlm_roberta", tiny_models.build_xlmr, MEAN, _dense),
    "gte_qwen2": ("gte_qwen2", lambda d: tiny_decoders.build_qwen2(d, tiny_decoders.qwen2_tokenizer(real=False)), [],
                  _dense),
    "e5_mistral": ("e5_mistral", tiny_decoders.build_mistral, [], _dense),
    "llm2vec": ("llm2vec", tiny_decoders.build_llama, [], _dense),
    "qwen3_embedding": ("qwen3_embedding",
                        lambda d: tiny_decoders.build_qwen3(d / "m", tiny_decoders.qwen3_tokenizer(real=False)), [],
                        _dense),
    "bge_m3": ("bge_m3", tiny_heads.build_bge_m3, [], _m3),
    "embeddinggemma": ("embeddinggemma", lambda d: _gemma(d), MEAN, _dense),
    "cross_encoder": ("bge_reranker_v2_m3", tiny_heads.build_xlmr_classifier, [],
                      lambda e: {"score": np.array(e.score(PAIRS))}),
    "qwen3_reranker": ("qwen3_reranker", lambda d: tiny_decoders.build_qwen3(
        d / "m", tiny_decoders.qwen3_tokenizer(real=False), causal_lm=True, tie_word_embeddings=False), [],
        lambda e: {"score": np.array(e.score(PAIRS, activation=False))}),
}
if importlib.util.find_spec("wde_plugin_t5") is not None:  # an outside plugin's model is cast the same way
    from tests.tiny_t5 import build_sentence_t5

    CASES["sentence_t5"] = ("sentence_t5", build_sentence_t5, [], _dense)


def _run(workflow: str, path: Path, overrides: list[str], fetch: Callable[[Engine], dict[str, np.ndarray]],
         dtype: str, mixed: str) -> tuple[dict[str, np.ndarray], nn.Module]:
    with Engine.from_workflow(workflow, path, dtype=dtype, device="cpu",
                              overrides=[*overrides, f"model.params.mixed_precision={mixed}"]) as engine:
        return fetch(engine), engine.components["model"]


def _error(ref: np.ndarray, out: np.ndarray) -> float:
    """1 - cosine for vectors (rows), relative max error for scalars and flat weights."""
    if ref.ndim == 2:
        return float(1 - cosines(ref, out).min())
    return float(np.abs(ref - out).max() / max(np.abs(ref).max(), 1e-6))


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_family_runs_mixed_and_stays_close_to_float32(case: str, tmp_path: Path) -> None:
    workflow, build, overrides, fetch = CASES[case]
    path = build(tmp_path)
    ref, _ = _run(workflow, path, overrides, fetch, "float32", "auto")
    low = "model.params.mixed_precision_kernels=low"  # bf16 kernels, whatever this host's timings say
    mixed, model = _run(workflow, path, [*overrides, low], fetch, BF16, "auto")
    pure, pure_model = _run(workflow, path, overrides, fetch, BF16, "false")
    wide, wide_model = _run(workflow, path, [*overrides, "model.params.mixed_precision_kernels=float32"], fetch, BF16,
                            "auto")

    assert model.mixed_precision and model.dtype == torch.bfloat16 and not pure_model.mixed_precision
    # the norms of a decoder's blocks write the linear layers' input dtype (no cast pass), and only here
    assert model.linear_input_dtype == torch.bfloat16
    assert pure_model.linear_input_dtype is None and wide_model.linear_input_dtype is None
    linears = [m for m in model.modules() if isinstance(m, (nn.Linear, PackedLinear))]
    assert linears and all(type(m) in (CastLinear, PackedLinear) for m in linears)
    assert {m.weight.dtype for m in linears if isinstance(m, nn.Linear)} <= {torch.bfloat16}
    others = {p.dtype for name, p in model.named_parameters() if not any(
        name.startswith(f"{n}.") for n, m in model.named_modules() if isinstance(m, nn.Linear))}
    assert others == {torch.float32}  # embeddings and norms
    assert {p.dtype for p in pure_model.parameters()} == {torch.bfloat16}
    for key in ref:
        assert mixed[key].shape == ref[key].shape and np.isfinite(mixed[key]).all()
        err_mixed, err_pure = _error(ref[key], mixed[key]), _error(ref[key], pure[key])
        # measured: ≤ 5e-5 for vectors; log-odds ≤ 6.2e-3 with cpu_varlen's attention and 1.01e-2 (tiny random
        # qwen3_reranker; pure bf16 2.1e-2) with cpu_flash_varlen's, which rounds its bf16 output at another point
        bound = 2e-4 if ref[key].ndim == 2 else 1.5e-2
        assert err_mixed <= bound, f"{key}: mixed {err_mixed:.2e} (pure {err_pure:.2e})"
        # float32 kernels (cpu_kernels.py, where a host runs them faster): the float32 model, output rounded to bf16
        assert _error(ref[key], wide[key]) <= (2e-5 if ref[key].ndim == 2 else 1e-2), key
    assert wide_model.linear_dtype == torch.float32 and {p.dtype for p in wide_model.parameters()} == {torch.float32}
