"""Hugging Face's `kernels` package (a top-level `kernels`, which transformers imports for hub kernels) and WDE
installed side by side, in both orders, in fresh venvs: both import, WDE's Triton kernels (`wde.kernels`) still
load, and uninstalling either leaves every file of the other in place.

WDE's wheel once installed the repository's `kernels/` as a top-level `kernels`: `pip install kernels` overwrote
its `__init__.py`, installing WDE afterwards broke `from kernels import get_kernel`, and `pip uninstall wde`
deleted Hugging Face's file. `kernels` comes from PyPI at the release constraints.txt pins (pip's cache keeps
later runs quick); the rest comes from the test environment (tests/installs.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.installs import CONSTRAINTS, clean_env, new_venv, pip_install_wde, sh, site_packages

pytestmark = pytest.mark.slow  # two venvs, a download of `kernels` on a cold cache: a minute or two

CHECK = """
import base64, hashlib, importlib.metadata, importlib.util, json, sys

def changed(f):  # missing, or not the bytes its RECORD lists (overwritten by another package)
    path = f.locate()
    if not path.exists():
        return True
    if f.hash is None:
        return False
    digest = hashlib.new(f.hash.mode, path.read_bytes()).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode() != f.hash.value

found = {}
for dist in sys.argv[1:]:
    files = importlib.metadata.files(dist) or []
    found[dist] = {"changed": [str(f) for f in files if changed(f)], "count": len(files)}
if importlib.util.find_spec("kernels") is not None and "kernels" in sys.argv[1:]:
    import kernels
    from kernels import get_kernel
    found["hf_kernels"] = {"file": kernels.__file__, "get_kernel": callable(get_kernel)}
if "wde" in sys.argv[1:]:
    import wde.kernels
    found["wde_kernels"] = {"file": wde.kernels.__file__, "triton": importlib.util.find_spec("triton") is not None}
    if found["wde_kernels"]["triton"]:
        import wde.kernels.varlen_attention as varlen  # TRITON_INTERPRET=1: defined for the CPU interpreter
        found["wde_kernels"]["varlen"] = varlen.__file__
json.dump(found, sys.stdout)
"""
"""Run by a venv's python with the installed distributions to look at: whether each one's files are all there as
installed, and what imports."""


def pip(python: Path, *args: str | Path) -> None:
    sh([python, "-m", "pip", *args], python.parent)


def pip_install_hf_kernels(python: Path) -> None:
    pip(python, "install", "--no-compile", "-c", CONSTRAINTS, "kernels")


def look(python: Path, *dists: str) -> dict:
    """CHECK's findings, run from an empty folder (the checkout's own `kernels/` must not be the current folder)."""
    run_dir = python.parents[2] / "run"
    run_dir.mkdir(exist_ok=True)
    return json.loads(sh([python, "-c", CHECK, *dists], run_dir, clean_env(TRITON_INTERPRET="1")).stdout)


def assert_both_work(python: Path) -> None:
    site = site_packages(python).resolve()
    got = look(python, "wde", "kernels")
    assert got["wde"]["changed"] == [] and got["kernels"]["changed"] == [], got
    assert Path(got["hf_kernels"]["file"]).resolve() == site / "kernels" / "__init__.py", got
    assert got["hf_kernels"]["get_kernel"], got
    assert Path(got["wde_kernels"]["file"]).resolve() == site / "wde" / "kernels" / "__init__.py", got
    if got["wde_kernels"]["triton"]:
        assert Path(got["wde_kernels"]["varlen"]).resolve() == site / "wde" / "kernels" / "varlen_attention.py"


def test_wde_first_then_hf_kernels_then_uninstall_wde(tmp_path: Path) -> None:
    python = new_venv(tmp_path / "venv")
    pip_install_wde(python)
    assert not (site_packages(python) / "kernels").exists(), "WDE's wheel must not install a top-level kernels"
    pip_install_hf_kernels(python)
    assert_both_work(python)
    pip(python, "uninstall", "--yes", "wde")
    got = look(python, "kernels")
    assert got["kernels"]["changed"] == [] and got["kernels"]["count"] > 10, got
    assert got["hf_kernels"]["get_kernel"], got


def test_hf_kernels_first_then_wde_then_uninstall_hf_kernels(tmp_path: Path) -> None:
    python = new_venv(tmp_path / "venv")
    pip_install_hf_kernels(python)
    pip_install_wde(python)
    assert_both_work(python)
    pip(python, "uninstall", "--yes", "kernels")
    site = site_packages(python).resolve()
    got = look(python, "wde")
    assert got["wde"]["changed"] == [] and got["wde"]["count"] > 50, got
    assert Path(got["wde_kernels"]["file"]).resolve() == site / "wde" / "kernels" / "__init__.py", got
