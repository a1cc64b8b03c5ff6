"""WDE installed as users install it: not editable, into a fresh venv, beside a top-level package named `workflows`
(llama-index-core pulls llama-index-workflows, which installs one). The bundled workflows must come from the package
data `wde.workflows`, never from `site-packages/workflows`.

The venv sees the system site-packages (torch, transformers, the bundled MiniLM come from there; nothing is
downloaded) and is built from a copy of the source tree, so the checkout gets no `build/` folder."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import pytest

from tests.test_server import free_port, wait_healthy

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "README.md", "wde", "workflows", "kernels")
"""What `pip install` needs of the checkout (pyproject.toml's packages, package-dir and readme)."""

HANG = 300
"""Seconds before a step counts as hung: each takes a few seconds to tens of seconds on a busy 2-core machine."""

CHECK = """
import json, sys

import workflows
import wde
import wde.workflows
from wde import Engine
from wde.plugins.builtin_workflows import workflows_dir

with Engine.from_workflow("bert") as engine:
    vectors = engine.embed(["hello world", "a second text"])
json.dump({"prefix": sys.prefix, "wde": wde.__file__, "package_data": wde.workflows.__file__,
           "workflows_dir": str(workflows_dir()), "other_workflows": workflows.__file__,
           "other_name": workflows.NAME, "shape": list(vectors.shape),
           "norms": [float((v * v).sum()) ** 0.5 for v in vectors]}, sys.stdout)
"""
"""Run by the venv's python: where everything came from, and `Engine.from_workflow("bert")` embedding two texts."""

pytestmark = pytest.mark.slow  # tens of seconds; stays in the default run (nothing deselects `slow`)


def clean_env() -> dict[str, str]:
    """This process's environment without what would put the checkout, or another environment, on sys.path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP",
                                                              "PYTHONUSERBASE", "VIRTUAL_ENV", "PIP_USER")}
    return {**env, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1", "PYTHONNOUSERSITE": "1"}


def sh(args: list[str | Path], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=HANG)
    assert result.returncode == 0, (f"{args} exited {result.returncode}:\n{result.stdout[-3000:]}\n"
                                    f"{result.stderr[-3000:]}")
    return result


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv with WDE installed from a copy of the checkout (a wheel, not editable) and a foreign package named
    `workflows` in its site-packages."""
    root = tmp_path_factory.mktemp("install")
    src = root / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build", "*.pyc")
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=ignore)
        else:
            shutil.copy2(REPO / name, src / name)
    env = clean_env()
    venv = root / "venv"
    # no pip of its own (ensurepip is slow); the system pip, seen through --system-site-packages, installs into it
    sh([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", venv], root, env)
    python = venv / "bin" / "python"
    # --ignore-installed: the system's editable wde is neither uninstalled nor counted as satisfying the requirement
    sh([python, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "--ignore-installed",
        "--no-compile", src], root, env)
    site = Path(sh([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], root, env)
                .stdout.strip())
    assert site.is_relative_to(venv), site
    assert (site / "wde" / "workflows" / "bert.yaml").is_file(), sorted(p.name for p in site.iterdir())
    other = site / "workflows"
    assert not other.exists(), "the wheel must not install a top-level package named workflows"
    other.mkdir()
    (other / "__init__.py").write_text('NAME = "llama-index-workflows stand-in"\n', encoding="utf-8")
    return venv


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """An empty working folder: the checkout (whose `workflows/` and `wde/` would shadow the install) is never
    the current folder, which `python -c` puts on sys.path."""
    d = tmp_path / "run"
    d.mkdir()
    return d


def test_engine_from_workflow_in_a_wheel_install_beside_a_workflows_package(venv: Path, run_dir: Path) -> None:
    result = sh([venv / "bin" / "python", "-c", CHECK], run_dir, clean_env())
    got = json.loads(result.stdout)
    site = Path(got["wde"]).resolve().parents[1]
    # the venv's copy, not the system's editable install (whose finder must not shadow it)
    assert Path(got["prefix"]).resolve() == venv.resolve() and site.is_relative_to(venv.resolve()), got
    assert (Path(got["package_data"]).resolve().parent == Path(got["workflows_dir"]).resolve()
            == site / "wde" / "workflows"), got
    assert Path(got["other_workflows"]).resolve() == site / "workflows" / "__init__.py", got
    assert got["other_name"] == "llama-index-workflows stand-in"
    assert got["shape"] == [2, 384]
    assert all(abs(n - 1) < 1e-4 for n in got["norms"]), got["norms"]  # bert normalizes


def test_wde_inspect_in_a_wheel_install(venv: Path, run_dir: Path) -> None:
    result = sh([venv / "bin" / "wde", "inspect", "bert"], run_dir, clean_env())
    assert result.stdout.startswith("name: bert\n"), result.stdout[:500]
    assert str(venv) in result.stdout  # source: the workflow file of the venv's package data


def test_wde_serve_in_a_wheel_install(venv: Path, run_dir: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen([str(venv / "bin" / "wde"), "serve", "--port", str(port)], cwd=run_dir,
                                env=clean_env(), stdout=log, stderr=subprocess.STDOUT)
        try:
            try:
                wait_healthy(url, lambda: proc.poll() is None, timeout=HANG)
            except AssertionError:
                log.seek(0)
                raise AssertionError(f"wde serve did not start:\n{log.read().decode()[-3000:]}") from None
            response = httpx.post(f"{url}/v1/embeddings", json={"input": ["hello world"]}, timeout=HANG)
            assert response.status_code == 200, response.text
            (item,) = response.json()["data"]
            assert len(item["embedding"]) == 384
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
