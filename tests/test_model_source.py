"""Model loading: local folders with safetensors or .bin weights, the offline hub cache, clear errors."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.tiny_models import varied_texts
from wde import Engine, ModelLoadError
from wde.model_source import resolve_model_path

TEXTS = varied_texts(8, seed=7)
MEAN = ["pooler.params.pooling=mean"]


def _embed(path: Path | str, **kw) -> np.ndarray:
    with Engine.from_workflow("bert", path, overrides=MEAN, **kw) as engine:
        return engine.embed(TEXTS, truncate=True)


def test_bin_checkpoint_equals_safetensors(tiny_bert: Path, tmp_path: Path) -> None:
    import torch
    from transformers import AutoModel

    bin_dir = tmp_path / "bin"
    shutil.copytree(tiny_bert, bin_dir)
    (bin_dir / "model.safetensors").unlink()
    torch.save(AutoModel.from_pretrained(tiny_bert).state_dict(), bin_dir / "pytorch_model.bin")
    np.testing.assert_allclose(_embed(bin_dir), _embed(tiny_bert), atol=1e-6)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_on_cpu_stays_close(tiny_bert: Path, dtype: str) -> None:
    half, full = _embed(tiny_bert, dtype=dtype), _embed(tiny_bert, dtype="float32")
    cos = (half * full).sum(1) / (np.linalg.norm(half, axis=1) * np.linalg.norm(full, axis=1))
    assert cos.min() > 0.99


def test_hub_cache_is_used_offline(tiny_bert: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    snapshot = tmp_path / "hub" / "models--acme--tiny-bert" / "snapshots" / "0123abcd"
    shutil.copytree(tiny_bert, snapshot)
    (tmp_path / "hub" / "models--acme--tiny-bert" / "refs").mkdir()
    (tmp_path / "hub" / "models--acme--tiny-bert" / "refs" / "main").write_text("0123abcd")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    assert resolve_model_path("acme/tiny-bert") == snapshot
    np.testing.assert_allclose(_embed("acme/tiny-bert"), _embed(tiny_bert), atol=1e-6)


def test_missing_model_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="never downloads"):
        resolve_model_path("acme/not-cached-anywhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        resolve_model_path(tmp_path / "empty")


def test_progress_bar_is_opt_in(minilm_engine, capsys: pytest.CaptureFixture[str]) -> None:
    minilm_engine.embed(TEXTS, truncate=True)
    assert "wde" not in capsys.readouterr().err
    minilm_engine.embed(TEXTS, truncate=True, progress=True)
    assert "wde" in capsys.readouterr().err
