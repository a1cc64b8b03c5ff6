"""Model folders written by sentence-transformers >= 5 load and match it; old folders keep working.

sentence-transformers >= 5 saves `1_Pooling/config.json` as `{"embedding_dimension": 384, "pooling_mode": "mean",
"include_prompt": true}` instead of one boolean `pooling_mode_*_tokens` key per mode, moves `max_seq_length` into
the tokenizer's `model_max_length`, and renames the module types in `modules.json`.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.test_parity_minilm import TOLERANCE, parity_texts
from wde import Engine
from wde.components.pooler import StPooling, st_pooling, st_pooling_mode
from wde.errors import ModelLoadError


@pytest.fixture(scope="module")
def st5_folder(minilm_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """all-MiniLM-L6-v2 as the installed sentence-transformers saves it; rewritten by hand to the new pooling
    format only if an older sentence-transformers still wrote the legacy keys."""
    from sentence_transformers import SentenceTransformer

    out = tmp_path_factory.mktemp("minilm-st5") / "model"
    SentenceTransformer(str(minilm_path), device="cpu").save(str(out))
    pooling = out / "1_Pooling" / "config.json"
    cfg = json.loads(pooling.read_text())
    if "pooling_mode" not in cfg:  # sentence-transformers < 5
        pooling.write_text(json.dumps({"embedding_dimension": 384, "pooling_mode": "mean", "include_prompt": True}))
    return out


def test_st5_folder_uses_the_new_format(st5_folder: Path) -> None:
    cfg = json.loads((st5_folder / "1_Pooling" / "config.json").read_text())
    assert cfg["pooling_mode"] == "mean"
    assert not any(k.startswith("pooling_mode_") for k in cfg), cfg


def test_st5_folder_matches_sentence_transformers(st5_folder: Path) -> None:
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(st5_folder), device="cpu")
    texts = parity_texts()
    expected = reference.encode(texts, batch_size=32, convert_to_numpy=True)
    with Engine.from_workflow("bert", st5_folder) as engine:
        pooler = engine.components["pooler"]
        assert (pooler.mode, pooler.normalize) == ("mean", True)
        assert engine.max_length == reference.max_seq_length == 256
        got = engine.embed(texts, truncate=True)
    assert got.shape == expected.shape == (len(texts), 384)
    diff = np.abs(got - expected).max(axis=1)
    assert diff.max() <= TOLERANCE, f"max abs diff {diff.max():.2e} on {texts[int(diff.argmax())][:60]!r}"


@pytest.mark.parametrize(("cfg", "mode"), [
    # sentence-transformers >= 5
    ({"embedding_dimension": 384, "pooling_mode": "mean", "include_prompt": True}, "mean"),
    ({"embedding_dimension": 384, "pooling_mode": "cls"}, "cls"),
    ({"embedding_dimension": 384, "pooling_mode": "max"}, "max"),
    ({"embedding_dimension": 384, "pooling_mode": "lasttoken"}, "last"),
    ({"embedding_dimension": 384, "pooling_mode": ["cls"]}, "cls"),
    # sentence-transformers < 5
    ({"word_embedding_dimension": 384, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
      "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False}, "mean"),
    ({"word_embedding_dimension": 384, "pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}, "cls"),
    ({"pooling_mode_max_tokens": True}, "max"),
    ({"pooling_mode_lasttoken": True, "include_prompt": True}, "last"),
    # what sentence-transformers itself does with no mode named: its default, mean
    ({"pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False}, "mean"),
    ({"word_embedding_dimension": 384}, "mean"),
    # `pooling_mode` wins over legacy keys, as in sentence-transformers
    ({"pooling_mode": "cls", "pooling_mode_mean_tokens": True}, "cls"),
])
def test_both_formats_are_read(cfg: dict, mode: str) -> None:
    assert st_pooling_mode(cfg, "config.json") == mode


@pytest.mark.parametrize(("cfg", "mode"), [
    ({"pooling_mode": "weightedmean"}, "weightedmean"),
    ({"pooling_mode": "mean_sqrt_len_tokens"}, "mean_sqrt_len"),
    ({"pooling_mode_weightedmean_tokens": True}, "weightedmean"),
])
def test_every_single_mode_is_read(cfg: dict, mode: str) -> None:
    assert st_pooling_mode(cfg, "config.json") == mode


def test_concatenations_and_prompt_exclusion_are_read() -> None:
    assert st_pooling({"pooling_mode": ["cls", "mean"], "include_prompt": False}, "c") == StPooling(("cls", "mean"), False)
    assert st_pooling({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True}, "c").modes == ("cls", "mean")


@pytest.mark.parametrize(("cfg", "message"), [
    # st_pooling_mode is for poolers that pool with one mode over every token (the `sentence` pooler reads all)
    ({"pooling_mode": "avg"}, "unknown pooling mode 'avg'; WDE supports cls, mean, max, lasttoken, weightedmean"),
    ({"pooling_mode": ["cls", "mean"]}, "concatenates the modes ['cls', 'mean']"),
    ({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True}, "concatenates the modes ['cls', 'mean']"),
    ({"pooling_mode": 3}, "pooling_mode must be a mode name or a list of them"),
    ({"pooling_mode": "mean", "include_prompt": False}, "include_prompt is false"),
])
def test_unsupported_configs_are_refused(cfg: dict, message: str) -> None:
    with pytest.raises(ModelLoadError, match="pooler.params.pooling") as err:
        st_pooling_mode(cfg, "x/1_Pooling/config.json")
    assert str(err.value).startswith("x/1_Pooling/config.json: ")
    assert message in str(err.value)


def _folder_with_pooling(minilm_path: Path, dest: Path, pooling: dict) -> Path:
    """The MiniLM folder (files linked, not copied) with its Pooling config replaced."""
    dest.mkdir()
    for item in minilm_path.iterdir():
        if item.name != "1_Pooling":
            (dest / item.name).symlink_to(item, target_is_directory=item.is_dir())
    (dest / "1_Pooling").mkdir()
    (dest / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return dest


def test_engine_refuses_an_unknown_mode(minilm_path: Path, tmp_path: Path) -> None:
    folder = _folder_with_pooling(minilm_path, tmp_path / "m", {"embedding_dimension": 384, "pooling_mode": "avg"})
    with pytest.raises(ModelLoadError, match=r"1_Pooling/config.json: unknown pooling mode 'avg'"):
        Engine.from_workflow("bert", folder)
    # an explicit pooling mode does not read the config
    with Engine.from_workflow("bert", folder, overrides=["pooler.params.pooling=mean"]) as engine:
        assert engine.components["pooler"].mode == "mean"


def test_engine_reads_a_hand_written_new_config(minilm_path: Path, minilm_engine: Engine, tmp_path: Path) -> None:
    folder = _folder_with_pooling(minilm_path, tmp_path / "m", {"embedding_dimension": 384, "pooling_mode": "mean",
                                                                "include_prompt": True})
    texts = ["pooling from the new key", "and the same vectors"]
    with Engine.from_workflow("bert", folder) as engine:
        np.testing.assert_array_equal(engine.embed(texts), minilm_engine.embed(texts))


def test_legacy_folder_still_loads(minilm_path: Path) -> None:
    cfg = json.loads((minilm_path / "1_Pooling" / "config.json").read_text())
    assert cfg.get("pooling_mode_mean_tokens") is True and "pooling_mode" not in cfg
    assert st_pooling_mode(cfg, "config.json") == "mean"

