"""The registry: what the installed plugins registered, looked up by kind and name.

Component names in a workflow resolve only through this registry, never by importing a dotted path, so a
workflow file cannot make the engine import arbitrary code.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Union

import pluggy
import yaml

from wde.components.base import COMPONENT_KINDS, Component, Params
from wde.components.kinds import KIND_BASES, Attention, Model, kind_base, public_base_name
from wde.errors import RegistryError, did_you_mean
from wde.yaml_source import safe_load

if TYPE_CHECKING:
    from wde.model_source import ModelSource

ArchitectureTarget = Union[str, Callable[["ModelSource"], str]]
"""What an architecture maps to: a workflow name, or a function of the model folder that picks one (for an
architecture that checkpoints of several families declare, e.g. Qwen3ForCausalLM)."""


@dataclass(frozen=True)
class LazyComponent:
    """A component registered by reference: `register(LazyComponent("pooler", "mean_max", "pkg.pooler:MeanMax",
    MeanMaxParams))`. Its module (which may import torch) is imported only when an engine is built; validating,
    inspecting and listing need only `kind`, `name` and `params`, so keep the params model in a module that
    imports no torch. Loading checks that the class matches what was registered."""

    kind: str
    name: str
    target: str
    """"package.module:ClassName"."""
    params: type[Params] = Params
    capabilities: frozenset[str] = frozenset()
    """For a model: what it needs from its attention backend ("attention_bias", "attention_window"); for an
    attention backend: what it supports. `wde validate` checks that a workflow's model and backend fit without
    importing either; keep it equal to the class's `uses_attention_*` / `supports_*` flags (the engine checks those
    when it builds the model)."""

    @property
    def Params(self) -> type[Params]:  # noqa: N802 - the same attribute a component class has
        return self.params

    @property
    def module(self) -> str:
        return self.target.partition(":")[0]

    def load(self) -> type[Component]:
        """Import the component class; a `RegistryError` says what does not match the registration."""
        module, _, attr = self.target.partition(":")
        try:
            cls = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise RegistryError(f"{self.kind} component {self.name!r}: cannot import {self.target!r}: {e}") from None
        if not (isinstance(cls, type) and issubclass(cls, Component)):
            raise RegistryError(f"{self.kind} component {self.name!r}: {self.target} is not a Component subclass")
        check_kind_base(cls, self.kind, self.target, "its registration")
        got = (cls.kind, cls.name, cls.Params)
        if got != (self.kind, self.name, self.params):
            raise RegistryError(
                f"{self.target} does not match its registration: kind/name/Params are"
                f" {got[0]!r}/{got[1]!r}/{got[2].__qualname__}, registered as"
                f" {self.kind!r}/{self.name!r}/{self.params.__qualname__}"
            )
        return cls


def check_kind_base(cls: type[Component], kind: str, what: str, where: str) -> None:
    """Refuse a component class of `kind` that does not subclass the kind's base (`wde.components.kinds`), naming
    the class and the base to subclass; `where` says who declared the kind."""
    if kind in KIND_BASES and not issubclass(cls, kind_base(kind)):
        raise RegistryError(f"{what} is a {kind} component ({where}) but does not subclass the {kind} base"
                            f" wde.api.{public_base_name(kind)}; subclass it (docs/plugins.md, \"Component kinds\")")


def capabilities_of(component: "type[Component] | LazyComponent") -> frozenset[str]:
    """What a model needs from its attention backend ("attention_bias", "attention_window"), or what a backend
    supports (see `LazyComponent.capabilities`); nothing for other kinds."""
    if isinstance(component, LazyComponent):
        return component.capabilities
    if issubclass(component, Model):
        flags = {"attention_bias": component.uses_attention_bias, "attention_window": component.uses_attention_window}
    elif issubclass(component, Attention):
        flags = {"attention_bias": component.supports_bias, "attention_window": component.supports_window}
    else:
        return frozenset()
    return frozenset(c for c, on in flags.items() if on)


def load_component(value: type[Component] | LazyComponent) -> type[Component]:
    """The class of a registered component, importing it now when it was registered lazily."""
    return value.load() if isinstance(value, LazyComponent) else value


def _module_of(value: object) -> str:
    return value.module if isinstance(value, LazyComponent) else value.__module__  # type: ignore[attr-defined]


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

    def add_component(self, component: type | LazyComponent, plugin: str = "<direct>") -> None:
        """Register a component class, or a `LazyComponent` reference whose module is imported only when used."""
        if isinstance(component, LazyComponent):
            what = component.target
            if not (isinstance(component.params, type) and issubclass(component.params, Params)):
                raise RegistryError(f"plugin {plugin!r} registered {what} with params {component.params!r},"
                                    " which is not a wde.components.base.Params subclass")
        elif isinstance(component, type) and issubclass(component, Component):
            what = component.__qualname__
        else:
            raise RegistryError(f"plugin {plugin!r} registered {component!r}, which is not a Component subclass"
                                " or a LazyComponent")
        kind, name = component.kind, component.name
        if kind not in self.components:
            raise RegistryError(
                f"plugin {plugin!r} registered {what} with kind {kind!r};"
                f" kinds are: {', '.join(COMPONENT_KINDS)}"
            )
        if isinstance(component, type):
            check_kind_base(component, kind, f"{component.__module__}.{what}", f"registered by plugin {plugin!r}")
        if not name:
            raise RegistryError(f"plugin {plugin!r} registered {what} without a name")
        existing = self.components[kind].get(name)
        if existing is not None and existing.value != component:
            raise RegistryError(
                f"duplicate {kind} component {name!r}: registered by {existing.plugin!r}"
                f" ({_module_of(existing.value)}) and by {plugin!r} ({_module_of(component)})"
            )
        self.components[kind][name] = Registered(component, plugin)

    def add_workflow(self, path: Path | str, plugin: str = "<direct>") -> None:
        path = Path(path)
        try:
            data = safe_load(path.read_text(encoding="utf-8"))  # libyaml's safe loader, aliases bounded
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

    def add_architecture(self, architecture: str, workflow: ArchitectureTarget, plugin: str = "<direct>") -> None:
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
        return load_component(entry.value)  # type: ignore[arg-type]

    def workflow_path(self, name: str) -> Path:
        entry = self.workflows.get(name)
        if entry is None:
            known = sorted(self.workflows)
            raise RegistryError(f"unknown workflow {name!r};{did_you_mean(name, known)} (available: {', '.join(known)})")
        return Path(entry.value)  # type: ignore[arg-type]

    def workflow_for(self, architectures: list[str], source: "ModelSource | None" = None) -> str:
        """The workflow registered for the first of `architectures` that has one; a mapping that picks by the
        model folder is called with `source` (it raises `RegistryError` when the folder leaves the choice open)."""
        for arch in architectures:
            if arch in self.architectures:
                target = self.architectures[arch].value
                if isinstance(target, str):
                    return target
                if source is None:
                    raise RegistryError(f"the workflow for architecture {arch!r} depends on the model folder;"
                                        " pass --workflow explicitly")
                return target(source)  # type: ignore[operator]
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
