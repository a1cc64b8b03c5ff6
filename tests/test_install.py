"""WDE installed as users install it: its wheel (not editable) in a fresh venv, beside a top-level package named
`workflows` (llama-index-core pulls llama-index-workflows, which installs one). The bundled workflows must come from
the package data `wde.workflows`, never from `site-packages/workflows`.

The venv sees the test environment's site-packages behind its own (torch, transformers and the bundled MiniLM come
from there; nothing is downloaded); tests/installs.py builds the wheel from a copy of the source tree, so the
checkout gets no `build/` folder. The README's quick start in a venv with no extras and nothing else is checked by
.ci/run (tests/quickstart_check.py)."""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

import httpx
import pytest

from tests.installs import HANG, clean_env, new_venv, pip_install_wde, sh, site_packages
from tests.test_server import free_port, stop_server, wait_healthy

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


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv with WDE's wheel installed and a foreign package named `workflows` in its site-packages."""
    venv = tmp_path_factory.mktemp("install") / "venv"
    python = new_venv(venv)
    pip_install_wde(python)
    site = site_packages(python)
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


def test_wde_kernels_status_in_a_wheel_install(venv: Path, run_dir: Path) -> None:
    """The kernels' sources ship as package data (a start compiles them from there) and `wde kernels status` reads
    them from the venv's copy."""
    site = Path(sh([venv / "bin" / "python", "-c", "import wde, sys; sys.stdout.write(wde.__file__)"], run_dir,
                   clean_env()).stdout).resolve().parents[1]
    for name in ("cpu_ops.cpp", "cpu_flash_attention.cpp", "cpu_exp.h", "cpp_build.py"):
        assert (site / "wde" / "kernels" / name).is_file(), name
    result = sh([venv / "bin" / "wde", "kernels", "status", "--format", "json"], run_dir, clean_env())
    states = {k["name"]: k for k in json.loads(result.stdout)}
    assert {n: k["source"] for n, k in states.items()} == {"cpu_ops": "cpu_ops.cpp",
                                                          "cpu_flash": "cpu_flash_attention.cpp"}


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
            stop_server(proc)
