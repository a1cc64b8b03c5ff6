"""Everything WDE installs lives under `wde`: its wheel's top_level.txt is exactly `wde`, every folder it installs
is a package with an `__init__.py`, and every Python folder of the checkout that the wheel draws on is in it.

The wheel once installed a top-level `kernels` package, the name of Hugging Face's `kernels` (which transformers
imports for hub kernels): either install overwrote the other's files. The repository's `kernels/` and `workflows/`
folders install as `wde.kernels` and `wde.workflows` through pyproject's package-dir.
"""

from __future__ import annotations

import zipfile
from pathlib import PurePosixPath

import pytest

from tests.installs import REPO, wde_wheel

pytestmark = pytest.mark.slow  # builds the wheel (tens of seconds on a busy machine), once per session

SOURCE_FOLDERS = {"wde": "wde", "kernels": "wde/kernels", "workflows": "wde/workflows"}
"""The checkout's Python folders -> where the wheel installs them."""


@pytest.fixture(scope="module")
def names() -> list[str]:
    with zipfile.ZipFile(wde_wheel()) as wheel:
        return wheel.namelist()


@pytest.fixture(scope="module")
def top_level(names: list[str]) -> str:
    (path,) = [n for n in names if n.endswith(".dist-info/top_level.txt")]
    with zipfile.ZipFile(wde_wheel()) as wheel:
        return wheel.read(path).decode()


def test_the_only_top_level_package_is_wde(names: list[str], top_level: str) -> None:
    assert top_level.split() == ["wde"], top_level
    tops = {PurePosixPath(n).parts[0] for n in names if ".dist-info/" not in n and ".data/" not in n}
    assert tops == {"wde"}, sorted(tops)


def test_every_installed_folder_is_a_package(names: list[str]) -> None:
    files = {PurePosixPath(n) for n in names if ".dist-info/" not in n}
    folders = {parent for f in files for parent in f.parents if parent != PurePosixPath(".")}
    without = sorted(str(f) for f in folders if f / "__init__.py" not in files)
    assert without == [], f"folders of the wheel without __init__.py: {without}"
    for expected in ("wde/kernels/varlen_attention.py", "wde/kernels/__init__.py", "wde/components/__init__.py",
                     "wde/workflows/bert.yaml", "wde/server/image_fetch.py"):
        assert PurePosixPath(expected) in files, expected


def test_every_python_folder_of_the_checkout_is_in_the_wheel(names: list[str]) -> None:
    """A new sub-package left out of pyproject's packages list would install without its modules."""
    files = set(names)
    missing = []
    for source, target in SOURCE_FOLDERS.items():
        for path in (REPO / source).rglob("*.py"):
            if "__pycache__" in path.parts:
                continue
            installed = f"{target}/{path.relative_to(REPO / source).as_posix()}"
            if installed not in files:
                missing.append(installed)
            if not (path.parent / "__init__.py").is_file():
                missing.append(f"{path.parent.relative_to(REPO)}/__init__.py (in the checkout)")
    assert sorted(set(missing)) == [], "add the folder to [tool.setuptools] packages in pyproject.toml"
