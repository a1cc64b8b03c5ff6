"""Every package a WDE module imports is installed by `pip install .`, with no extras.

CI installs `.[dev]`, so a module that imports a package found only in the extras works in every test and crashes
for a user: `wde serve` once ended in `ModuleNotFoundError: No module named 'httpx'` because httpx was in `dev`.
This test reads the source instead of running it: every `import`, `from ... import` and
`importlib.import_module("literal")` in every module the wheel installs (pyproject's packages and package-dir),
at module level or inside a function, must name the standard library, `wde` itself, or a distribution in the
closure of pyproject's `dependencies` (their own dependencies, recursively, with no extras).

Packages of an extra (`triton`, `ray`, `grpc`) are listed below with the extra that installs them. They may be
imported inside functions only, so nothing reachable from `wde serve`, `wde embed` or `Engine` fails on import
without them; the only modules allowed to import them at module level are the ones listed in EXTRA_ONLY_MODULES,
and those modules must in turn be imported only inside functions.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the CI's Python is 3.11
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))

EXTRA_ONLY = {"triton": ("triton", "triton"), "ray": ("ray", "ray"), "grpc": ("grpc", "grpcio"),
              "google": ("grpc", "protobuf")}
"""Top-level import name -> (the extra that installs it, the distribution): imported inside functions only."""

EXTRA_ONLY_MODULES = {
    "wde.kernels.varlen_attention": "triton",
    "wde.kernels.l2norm": "triton",
    "wde.kernels.fused_norm": "triton",
    "wde.server.grpc.tei_pb2": "grpc",
    "wde.server.grpc.tei_pb2_grpc": "grpc",
    "wde.server.grpc.auth": "grpc",
    "wde.server.grpc.calls": "grpc",
    "wde.server.grpc.servicers": "grpc",
    "wde.server.grpc.server": "grpc",
}
"""Modules that define Triton kernels on import, and those of TEI's gRPC API (wde/server/grpc): they import their
extra's package at module level, and every other module imports them inside a function, after checking that the
package is there."""


@dataclass(frozen=True)
class Import:
    module: str       # the WDE module that imports
    line: int
    name: str         # the absolute dotted name imported
    lazy: bool        # inside a function: runs when called, not when the module is imported


def installed_modules() -> dict[str, Path]:
    """Module name -> source file, for every module the wheel installs (pyproject's packages and package-dir)."""
    setuptools = PROJECT["tool"]["setuptools"]
    package_dir = setuptools.get("package-dir", {})
    modules = {}
    for package in setuptools["packages"]:
        folder = REPO / package_dir.get(package, package.replace(".", "/"))
        for path in sorted(folder.glob("*.py")):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            modules[name] = path
    return modules


def imports_of(module: str, source: str, is_package: bool) -> list[Import]:
    """The imports in `source`, resolved to absolute names; those under `if TYPE_CHECKING:` never run and are left
    out."""
    package = module if is_package else module.rpartition(".")[0]
    found: list[Import] = []

    def absolute(name: str | None, level: int) -> str:
        if level == 0:
            return name or ""
        base = package.split(".")
        base = base[: len(base) - (level - 1)]
        return ".".join(base + ([name] if name else []))

    def visit(node: ast.AST, lazy: bool) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child, lazy)
            return
        if isinstance(node, ast.Import):
            found.extend(Import(module, node.lineno, alias.name, lazy) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = absolute(node.module, node.level)
            found.append(Import(module, node.lineno, base, lazy))
            # `from wde.kernels import varlen_attention` imports the submodule too
            found.extend(Import(module, node.lineno, f"{base}.{alias.name}", lazy) for alias in node.names
                         if alias.name != "*")
        elif (isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name))
              and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.append(Import(module, node.lineno, node.args[0].value, lazy))
        inner = lazy or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(ast.parse(source, filename=module), lazy=False)
    return found


def runtime_closure(requirements: Iterable[str]) -> set[str]:
    """Canonical names of `requirements` and everything they require, recursively, as `pip install` resolves them
    with no extras (a dependency's own extras, such as `ray[data]`, are followed)."""
    found: set[str] = set()
    seen: set[tuple[str, str]] = set()
    todo = [(Requirement(r), "") for r in requirements]
    while todo:
        requirement, parent_extra = todo.pop()
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": parent_extra}):
            continue
        name = canonicalize_name(requirement.name)
        found.add(name)
        for extra in ("", *sorted(requirement.extras)):
            if (name, extra) in seen:
                continue
            seen.add((name, extra))
            try:
                requires = metadata.requires(name) or []
            except metadata.PackageNotFoundError:
                continue  # not installed here, so none of its own dependencies can be found below either
            todo.extend((Requirement(r), extra) for r in requires)
    return found


@cache
def distributions_of() -> dict[str, frozenset[str]]:
    """Top-level import name -> canonical names of the installed distributions that provide it."""
    return {top: frozenset(map(canonicalize_name, dists))
            for top, dists in metadata.packages_distributions().items()}


def problems(dependencies: Iterable[str], sources: dict[str, tuple[str, bool]]) -> list[str]:
    """What is wrong with the imports of `sources` (module -> (source, is_package)) for a project whose runtime
    requirements are `dependencies`: one line per import, naming module:line."""
    closure = runtime_closure(dependencies)
    imports = [i for module, (source, is_package) in sources.items() for i in imports_of(module, source, is_package)]
    wrong = []
    for i in imports:
        top = i.name.split(".")[0]
        where = f"{i.module}:{i.line} imports {i.name}"
        if top in sys.stdlib_module_names or top == "wde" or top in EXTRA_ONLY:
            continue
        dists = distributions_of().get(top, frozenset())
        if not dists & closure:
            wrong.append(f"{where}: {'/'.join(sorted(dists)) or 'no installed distribution'} is not a runtime "
                         "dependency (pyproject's dependencies, or theirs): add it there, or list it in EXTRA_ONLY "
                         "and import it inside a function")
    # which modules need an extra to be imported: those importing its package, or such a module, at module level
    needs = {}
    changed = True
    while changed:
        changed = False
        for i in imports:
            top = i.name.split(".")[0]
            extra = EXTRA_ONLY[top][0] if top in EXTRA_ONLY else needs.get(i.name)
            if extra and not i.lazy and needs.get(i.module) != extra:
                needs[i.module] = extra
                changed = True
    for module, extra in sorted(needs.items()):
        if EXTRA_ONLY_MODULES.get(module) != extra:
            culprit = next(i for i in imports if i.module == module and not i.lazy
                           and (EXTRA_ONLY.get(i.name.split(".")[0], ("",))[0] == extra or needs.get(i.name) == extra))
            wrong.append(f"{module}:{culprit.line} imports {culprit.name} at module level, so importing {module} "
                         f"needs the `{extra}` extra: import it inside the function that uses it")
    return wrong


def project_sources() -> dict[str, tuple[str, bool]]:
    return {name: (path.read_text(encoding="utf-8"), path.name == "__init__.py")
            for name, path in installed_modules().items()}


def test_every_import_is_a_runtime_dependency_or_a_lazy_extra() -> None:
    assert problems(PROJECT["project"]["dependencies"], project_sources()) == []


def test_the_scan_covers_the_serving_offline_and_kernel_modules() -> None:
    """The scan would pass vacuously if it read no files: it must see the modules `wde serve`, `wde embed` and
    `Engine` load, and the kernels that install as `wde.kernels`."""
    modules = installed_modules()
    for name in ("wde.cli", "wde.engine", "wde.server.app", "wde.server.image_fetch", "wde.corpus.job",
                 "wde.kernels", *EXTRA_ONLY_MODULES):
        assert name in modules, name
    assert modules["wde.kernels"] == REPO / "kernels" / "__init__.py"


def test_the_extras_named_here_install_those_packages() -> None:
    extras = PROJECT["project"]["optional-dependencies"]
    for extra, distribution in EXTRA_ONLY.values():
        assert distribution in {canonicalize_name(Requirement(r).name) for r in extras[extra]}, (extra, distribution)


def test_a_dependency_left_in_the_dev_extras_is_named() -> None:
    """httpx was once only in `dev`: the check names the module that imports it."""
    dependencies = [r for r in PROJECT["project"]["dependencies"] if Requirement(r).name != "httpx"]
    lines = problems(dependencies, project_sources())
    assert lines and all("imports httpx" in line and ": httpx is not a runtime dependency" in line
                         for line in lines), lines
    assert any(line.startswith("wde.server.image_fetch:") for line in lines), lines


@pytest.mark.parametrize("source, culprit", [
    ("import ray\n", "wde.fake:1 imports ray at module level"),
    ("def f():\n    pass\nfrom wde.kernels import varlen_attention\n",
     "wde.fake:3 imports wde.kernels.varlen_attention at module level"),
    ("from wde.kernels.l2norm import l2_normalize\n", "wde.fake:1 imports wde.kernels.l2norm at module level"),
])
def test_an_extra_imported_at_module_level_is_named(source: str, culprit: str) -> None:
    sources = {**project_sources(), "wde.fake": (source, False)}
    (line,) = problems(PROJECT["project"]["dependencies"], sources)
    assert line.startswith(culprit), line


def test_lazy_extra_imports_and_type_checking_imports_pass() -> None:
    source = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import openai\n"
              "def f():\n    import ray\n    from wde.kernels import varlen_attention\n")
    assert problems(PROJECT["project"]["dependencies"], {**project_sources(), "wde.fake": (source, False)}) == []


def test_an_import_outside_the_closure_is_named_wherever_it_is() -> None:
    source = "def f():\n    import importlib\n    importlib.import_module('openai')\n"
    (line,) = problems(PROJECT["project"]["dependencies"], {**project_sources(), "wde.fake": (source, False)})
    assert line.startswith("wde.fake:3 imports openai: openai is not a runtime dependency"), line
