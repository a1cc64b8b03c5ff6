"""The registry: what the installed plugins registered, looked up by kind and name.

Component names in a workflow resolve only through this registry, never by importing a dotted path, so a
workflow file cannot make the engine import arbitrary code.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

import pluggy
import yaml

from wde.components.base import COMPONENT_KINDS, Component
from wde.errors import RegistryError, did_you_mean


@dataclass(frozen=True)
class Registered:
    """Something a plugin registered, and which plugin did it (for error messages and `wde plugins`)."""

    value: object
    plugin: str


@dataclass
class Registry:
    """Components by kind and name, workflow files by name, and architecture → workflow mappings."""

    components: dict[str, dict[str, Registered]] = field(
        default_factory=lambda: {kind: {} for kind in COMPONENT_KINDS}
    )
    workflows: dict[str, Registered] = field(default_factory=dict)
    architectures: dict[str, Registered] = field(default_factory=dict)
    unreadable: dict[str, str] = field(default_factory=dict)
    """Registered workflow files that could not be parsed: kept out of the registry so one broken file does not
    break every command; `wde validate` reports them with their location."""

    @classmethod
    def from_plugin_manager(cls, pm: pluggy.PluginManager) -> "Registry":
        """Call every plugin's registration hooks, attributing each registration to its plugin."""
        reg = cls()
        for impl in pm.hook.register_components.get_hookimpls():
            impl.function(register=functools.partial(reg.add_component, plugin=impl.plugin_name))
        for impl in pm.hook.register_workflows.get_hookimpls():
            impl.function(register=functools.partial(reg.add_workflow, plugin=impl.plugin_name))
        for impl in pm.hook.register_architectures.get_hookimpls():
            impl.function(register=functools.partial(reg.add_architecture, plugin=impl.plugin_name))
        return reg

    def add_component(self, component: type, plugin: str = "<direct>") -> None:
        if not (isinstance(component, type) and issubclass(component, Component)):
            raise RegistryError(f"plugin {plugin!r} registered {component!r}, which is not a Component subclass")
        kind = getattr(component, "kind", None)
        name = getattr(component, "name", None)
        if kind not in self.components:
            raise RegistryError(
                f"plugin {plugin!r} registered {component.__qualname__} with kind {kind!r};"
                f" kinds are: {', '.join(COMPONENT_KINDS)}"
            )
        if not name:
            raise RegistryError(f"plugin {plugin!r} registered {component.__qualname__} without a name")
        existing = self.components[kind].get(name)
        if existing is not None and existing.value is not component:
            raise RegistryError(
                f"duplicate {kind} component {name!r}: registered by {existing.plugin!r}"
                f" ({existing.value.__module__}) and by {plugin!r} ({component.__module__})"
            )
        self.components[kind][name] = Registered(component, plugin)

    def add_workflow(self, path: Path | str, plugin: str = "<direct>") -> None:
        path = Path(path)
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError) as e:
            self.unreadable[str(path)] = f"plugin {plugin!r} registered {path}, which cannot be read: {e}"
            return
        name = data.get("name") if isinstance(data, dict) else None
        if not isinstance(name, str) or not name:
            self.unreadable[str(path)] = f"plugin {plugin!r} registered {path}, which has no 'name' key"
            return
        existing = self.workflows.get(name)
        if existing is not None and Path(existing.value).resolve() != path.resolve():
            raise RegistryError(
                f"duplicate workflow {name!r}: {existing.value} (plugin {existing.plugin!r})"
                f" and {path} (plugin {plugin!r})"
            )
        self.workflows[name] = Registered(path, plugin)

    def add_architecture(self, architecture: str, workflow: str, plugin: str = "<direct>") -> None:
        existing = self.architectures.get(architecture)
        if existing is not None and existing.value != workflow:
            raise RegistryError(
                f"duplicate mapping for architecture {architecture!r}: workflow {existing.value!r}"
                f" (plugin {existing.plugin!r}) and {workflow!r} (plugin {plugin!r})"
            )
        self.architectures[architecture] = Registered(workflow, plugin)

    def component(self, kind: str, name: str) -> type[Component]:
        entry = self.components[kind].get(name)
        if entry is None:
            known = sorted(self.components[kind])
            raise RegistryError(
                f"unknown {kind} {name!r};{did_you_mean(name, known)} (available: {', '.join(known) or 'none'})"
            )
        return entry.value  # type: ignore[return-value]

    def workflow_path(self, name: str) -> Path:
        entry = self.workflows.get(name)
        if entry is None:
            known = sorted(self.workflows)
            raise RegistryError(f"unknown workflow {name!r};{did_you_mean(name, known)} (available: {', '.join(known)})")
        return Path(entry.value)  # type: ignore[arg-type]

    def workflow_for(self, architectures: list[str]) -> str:
        """The workflow registered for the first of `architectures` that has one."""
        for arch in architectures:
            if arch in self.architectures:
                return self.architectures[arch].value  # type: ignore[return-value]
        known = ", ".join(sorted(self.architectures))
        raise RegistryError(
            f"no workflow is registered for architectures {architectures}; known architectures: {known}."
            " Pass --workflow explicitly, or install a plugin that registers one"
            " (see docs/plugins.md: the register_architectures hook)."
        )


_default: Registry | None = None


def get_registry(refresh: bool = False) -> Registry:
    """The process-wide registry built from the built-in and installed plugins (built on first use)."""
    global _default
    if _default is None or refresh:
        from wde.plugins import make_plugin_manager

        _default = Registry.from_plugin_manager(make_plugin_manager())
    return _default
