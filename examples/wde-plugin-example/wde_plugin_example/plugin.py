"""Hook implementations: what this plugin adds to WDE's registry.

The package's entry point (`[project.entry-points.wde]`, in pyproject.toml) points at this module; WDE
registers it with its plugin manager, then calls each hook with a `register` callback. The pooler is registered
by reference, so loading this plugin (for `wde validate`, say) imports no torch; its module is imported when an
engine is built.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from wde.plugins.hookspecs import hookimpl
from wde.registry import LazyComponent
from wde_plugin_example.params import MeanMaxParams

WORKFLOWS_DIR = Path(__file__).parent / "workflows"


@hookimpl
def register_components(register: Callable[[LazyComponent], None]) -> None:
    register(LazyComponent("pooler", "mean_max", "wde_plugin_example.pooler:MeanMaxPooler", MeanMaxParams))


@hookimpl
def register_workflows(register: Callable[[Path], None]) -> None:
    for path in sorted(WORKFLOWS_DIR.glob("*.yaml")):
        register(path)
