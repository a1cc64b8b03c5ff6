"""The quick-start check .ci/run runs in its no-extras venv (tests/quickstart_check.py), checked here where the
extras are installed: its reference is the published model's output, it refuses vectors that are off, it notices
installed extras, and it passes against this environment's `wde serve`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests import quickstart_check as check


def test_the_reference_recipe_is_sentence_transformers_output(minilm_path: Path) -> None:
    """The model card's plain-transformers recipe gives what sentence-transformers, the published pipeline, gives."""
    from sentence_transformers import SentenceTransformer

    published = SentenceTransformer(str(minilm_path), device="cpu").encode(check.TEXTS, normalize_embeddings=True)
    assert check.compare(check.reference_vectors(check.TEXTS), published.tolist()) == []


def test_compare_refuses_a_vector_off_by_more_than_the_tolerance() -> None:
    want = check.reference_vectors(check.TEXTS)
    nudged = [list(v) for v in want]
    nudged[1][7] += 3 * check.MAX_ABS_DIFF
    (line,) = check.compare(nudged, want)
    assert line.startswith("vector 1:") and "max abs diff 3.00e-04" in line, line
    assert check.compare([v[:256] for v in want], want)[0] == "vector 0: 256 dimensions, the model has 384"
    assert check.compare(want[:2], want) == ["2 vectors for 3 texts"]
    assert check.compare(want, want) == []


def test_installed_extras_are_named() -> None:
    """Here the dev extras are installed (pytest runs this), so --no-extras must fail."""
    assert "pytest" in check.extras_installed()
    assert check.main(["--no-extras"]) == 1


@pytest.mark.slow
def test_the_check_passes_against_wde_serve(capsys: pytest.CaptureFixture[str]) -> None:
    wde = Path(sys.executable).with_name("wde")
    assert wde.is_file(), f"no wde command beside {sys.executable}"
    assert check.main(["--wde", str(wde)]) == 0
    assert "answered /v1/embeddings with all-MiniLM-L6-v2's vectors for 3 texts" in capsys.readouterr().out


def test_ci_installs_as_the_readme_quick_start_says() -> None:
    """The README's quick start is two commands: the install-and-serve line, whose installs .ci/run runs verbatim
    (then tests/quickstart_check.py serves as `wde serve` does), and `bash .ci/run`."""
    root = Path(__file__).resolve().parents[1]
    readme = root / "README.md"
    section = readme.read_text(encoding="utf-8").split("## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks = [b.split("\n", 1)[1].strip() for b in section.split("```")[1::2]]
    assert len(blocks) == 2 and blocks[1] == "bash .ci/run", blocks
    *installs, serve = [step.strip() for step in blocks[0].split("&&")]
    assert serve == "wde serve" and installs, blocks[0]
    ci = [line.strip() for line in (root / ".ci" / "run").read_text(encoding="utf-8").splitlines()]
    check = ci.index("python tests/quickstart_check.py --no-extras")
    assert [line for line in ci[:check] if line.startswith("pip ")] == installs, ci[:check]
