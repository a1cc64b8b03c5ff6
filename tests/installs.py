"""Fresh venvs for the install tests: WDE's wheel, built once per test session from a copy of the checkout, and
venvs to install it into.

The wheel is built by `pip wheel` with build isolation, as `pip install .` builds it for a user: pip brings the
setuptools pyproject.toml asks for into a throwaway environment, so nothing of the host's build tools (a `wheel`
package, an old setuptools) is needed; `--no-build-isolation` once failed on a fresh machine with
`invalid command 'bdist_wheel'`. The copy keeps the checkout free of `build/` and `*.egg-info`.

A venv made by `new_venv` sees this test environment's site-packages behind its own (torch, transformers and the
bundled MiniLM come from there, so nothing large is installed), the way `--system-site-packages` would if this
environment were not itself a venv: `python -m venv` links a venv to the base interpreter, never to the venv it is
run from, so that flag alone would show neither torch nor anything else installed here.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "README.md", "wde", "workflows", "kernels")
"""What a build needs of the checkout (pyproject.toml's packages, package-dir and readme)."""

CONSTRAINTS = REPO / "constraints.txt"

HANG = 300
"""Seconds before a step counts as hung: each takes seconds to tens of seconds on a busy 2-core machine."""


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without what would put the checkout, or another environment, on sys.path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP",
                                                              "PYTHONUSERBASE", "VIRTUAL_ENV", "PIP_USER")}
    return {**env, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1", "PYTHONNOUSERSITE": "1", **extra}


def sh(args: list[str | Path], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run a command; fail the test with its output when it exits non-zero."""
    result = subprocess.run([str(a) for a in args], cwd=cwd, env=env or clean_env(), capture_output=True, text=True,
                            timeout=HANG)
    assert result.returncode == 0, (f"{args} exited {result.returncode}:\n{result.stdout[-3000:]}\n"
                                    f"{result.stderr[-3000:]}")
    return result


@cache
def wde_wheel() -> Path:
    """WDE's wheel, built once per session from a copy of the checkout's SOURCES."""
    root = Path(tempfile.mkdtemp(prefix="wde-wheel-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    src = root / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build", "*.pyc")
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=ignore)
        else:
            shutil.copy2(REPO / name, src / name)
    sh([sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", root / "dist", src], root)
    (wheel,) = (root / "dist").glob("wde-*.whl")
    return wheel


def new_venv(path: Path) -> Path:
    """A venv at `path`, without a pip of its own (this environment's pip, seen through site-packages, installs
    into it), that sees this environment's site-packages after its own. Returns its python."""
    sh([sys.executable, "-m", "venv", "--without-pip", path], path.parent)
    python = path / "bin" / "python"
    site = site_packages(python)
    here = dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib"))
    # `import` lines of a .pth file run at start-up; addsitedir also runs this environment's own .pth files
    (site / "zz_test_environment.pth").write_text(
        "".join(f"import site; site.addsitedir({p!r})\n" for p in here), encoding="utf-8")
    return python


def site_packages(python: Path) -> Path:
    site = Path(sh([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], python.parent)
                .stdout.strip())
    assert site.is_relative_to(python.parents[1]), site
    return site


def pip_install_wde(python: Path) -> None:
    """Install WDE's wheel into the venv of `python`; --ignore-installed: an editable WDE in this environment is
    neither uninstalled nor counted as satisfying the requirement."""
    sh([python, "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed", "--no-compile",
        wde_wheel()], python.parent)
