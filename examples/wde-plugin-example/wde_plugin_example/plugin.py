"""Hook implementations: what this plugin adds to WDE's registry.

The package's entry point (`[project.entry-points.wde]`, in pyproject.toml) points at this module; WDE
registers it with its plugin manager, then calls each hook with a `register` callback.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from wde.plugins.hookspecs import hookimpl
from wde_plugin_example.pooler import MeanMaxPooler

WORKFLOWS_DIR = Path(__file__).parent / "workflows"


@hookimpl
def register_components(register: Callable[[type], None]) -> None:
    register(MeanMaxPooler)


@hookimpl
def register_workflows(register: Callable[[Path], None]) -> None:
    for path in sorted(WORKFLOWS_DIR.glob("*.yaml")):
        register(path)
