"""The `auto` attention backend dispatches on the batch's device and changes no result."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.tiny_models import varied_texts
from wde import Engine
from wde.components.attention.torch_sdpa import TorchSDPABackend

TEXTS = varied_texts(12, seed=5)


def _embed(path: Path, attention: str, device: str, dtype: str) -> tuple[np.ndarray, Engine]:
    with Engine.from_workflow("bert", path, device=device, dtype=dtype, attention={"name": attention},
                              overrides=["pooler.params.pooling=mean"]) as engine:
        return engine.embed(TEXTS, truncate=True), engine


def test_auto_uses_sdpa_for_cpu_batches(tiny_bert: Path) -> None:
    auto, engine = _embed(tiny_bert, "auto", "cpu", "float32")
    sdpa, _ = _embed(tiny_bert, "torch_sdpa", "cpu", "float32")
    backend = engine.components["attention"]
    assert backend.name == "auto" and isinstance(backend._cpu, TorchSDPABackend)
    # long CPU batches go to cpu_varlen (tests/test_cpu_attention.py): same math, other summation order
    np.testing.assert_allclose(auto, sdpa, atol=1e-5, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_auto_uses_triton_for_cuda_batches(tiny_bert: Path) -> None:
    from wde.components.attention.triton_varlen import TritonVarlenBackend

    auto, engine = _embed(tiny_bert, "auto", "cuda", "float16")
    triton, _ = _embed(tiny_bert, "triton_varlen", "cuda", "float16")
    assert isinstance(engine.components["attention"]._cuda, TritonVarlenBackend)
    np.testing.assert_array_equal(auto, triton)
