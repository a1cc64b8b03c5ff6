"""`benchmarks/throughput.py --images` runs (issue 28): on a tiny CLIP folder, and on random weights built the way
`--size clip-b32` builds them (at a tiny shape here), it prints images/s for WDE, transformers and
sentence-transformers, the ratios, and vectors that agree with transformers' `get_image_features` (the figures
themselves are for docs/benchmarks.md, not for a test)."""

from __future__ import annotations

import importlib.util
import io
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest
from PIL import Image

from tests.tiny_clip import build_clip

ROOT = Path(__file__).resolve().parents[1]
SIDES = ("transformers", "sentence-transformers", "wde")


@pytest.fixture(scope="module")
def throughput() -> ModuleType:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("wde_bench_throughput", ROOT / "benchmarks" / "throughput.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def check_report(text: str, n: int) -> None:
    assert f"workload: {n} images, 300-800 px, JPEG and PNG" in text, text
    for side in SIDES:
        assert re.search(rf"^ *{re.escape(side)}: +\S+ s +\S+ images/s  \(float32\)$", text, re.MULTILINE), text
    assert "ratio wde / transformers:" in text and "ratio wde / sentence-transformers:" in text, text
    agreements = re.findall(r"^agreement of (\S+) with transformers over (\d+) images: min cosine (\S+), max abs diff"
                            r" (\S+)$", text, re.MULTILINE)
    assert [(name, int(count)) for name, count, _, _ in agreements] == [("sentence-transformers", n), ("wde", n)]
    assert all(float(cos) >= 0.9999 and float(diff) <= 1e-4 for _, _, cos, diff in agreements), text


def test_images_mode_on_a_clip_folder(throughput: ModuleType, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    folder = build_clip(tmp_path / "clip")
    throughput.main(["--images", "5", "--model", str(folder), "--repeats", "1", "--st-batch-size", "2"])
    check_report(capsys.readouterr().out, 5)


def test_images_mode_on_random_weights_of_a_size(throughput: ModuleType, capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """`--size clip-b32`'s code path, at a tiny shape (the real one takes half a minute to build)."""
    tiny = dict(text=dict(vocab_size=500, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, max_position_embeddings=40),
                vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                            image_size=64, patch_size=16),
                projection_dim=16)
    monkeypatch.setitem(throughput.CLIP_SIZES, "clip-b32", tiny)
    throughput.main(["--images", "3", "--size", "clip-b32", "--repeats", "1"])
    text = capsys.readouterr().out
    check_report(text, 3)
    assert "model: clip-b32 (cpu; wde float32, transformers float32)" in text


def test_images_mode_needs_a_clip(throughput: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        throughput.main(["--images", "3"])
    assert "--images N (N >= 1) goes with --model CLIP_FOLDER or --size clip-b32" in capsys.readouterr().err


def test_generated_images_vary_in_size_and_format() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from image_workload import images

    blobs = images(6)
    opened = [Image.open(io.BytesIO(b)) for b in blobs]
    assert [im.format for im in opened] == ["JPEG", "PNG"] * 3
    assert all(300 <= side <= 800 for im in opened for side in im.size)
    assert len({im.size for im in opened}) == 6
    assert images(6) == blobs  # deterministic
