"""The plugin manager: built-in plugins plus third-party ones found through the ``wde`` entry-point group.

Set ``WDE_LOAD_PLUGINS`` to a comma-separated allowlist of distribution names to load only those
third-party plugins (an empty value loads none); unset, every installed plugin loads.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import re

import pluggy

from wde.plugins import hookspecs

DEFAULT_PLUGINS: tuple[str, ...] = (
    "wde.plugins.builtin_components",
    "wde.plugins.builtin_workflows",
)
"""Modules registered through the same hooks third-party plugins use."""

ENTRYPOINT_GROUP = "wde"


def _normalize(name: str) -> str:
    """Distribution names compare as pip compares them: `wde_plugin_example` is `wde-plugin-example`."""
    return re.sub(r"[-_.]+", "-", name.strip()).lower()


def _load_entrypoints(pm: pluggy.PluginManager) -> None:
    allow = os.environ.get("WDE_LOAD_PLUGINS")
    if allow is None:
        pm.load_setuptools_entrypoints(ENTRYPOINT_GROUP)
        return
    wanted = {_normalize(name) for name in allow.split(",") if name.strip()}
    for dist in importlib.metadata.distributions():
        if _normalize(dist.metadata["Name"] or "") not in wanted:
            continue
        for ep in dist.entry_points:
            if ep.group == ENTRYPOINT_GROUP and pm.get_plugin(ep.name) is None:
                pm.register(ep.load(), name=ep.name)


def make_plugin_manager(load_entrypoints: bool = True) -> pluggy.PluginManager:
    """A plugin manager with the hookspecs, the built-in plugins and (by default) installed plugins.

    `check_pending` rejects a hook implementation whose name matches no hook, so a typo fails loudly.
    """
    pm = pluggy.PluginManager("wde")
    pm.add_hookspecs(hookspecs)
    for module_name in DEFAULT_PLUGINS:
        pm.register(importlib.import_module(module_name), name=module_name)
    if load_entrypoints:
        _load_entrypoints(pm)
    pm.check_pending()
    return pm
